//! Pipelined hand-offs (#15): `drained`, drainers and their grace, and a pipelined
//! holder's quantum.

use super::*;

fn reg_pipelined(s: &mut GpuScheduler, now: Nanos, id: ClientId, ws: u64, pipelined: bool) {
    let info = ClientInfo {
        pipelined,
        ..ClientInfo::default()
    };
    s.register(now, id, info, usage(ws, 0), None);
}

fn error_to(outs: &[Output], to: ClientId) -> Option<String> {
    sent(outs, to).iter().find_map(|m| match m {
        ArbiterMsg::Error { message, .. } => Some(message.clone()),
        _ => None,
    })
}

/// A (700 MiB) holds 1000 MiB, B (700 MiB) waits; A's TQ ends and it is dropped with
/// 400 MiB to evict. Returns the scheduler at A's drop (`t`).
fn dropped_a(a_pipelined: bool, b_pipelined: bool) -> (GpuScheduler, Nanos) {
    let mut s = sched(1000 * MIB, 1_000, 500);
    reg_pipelined(&mut s, 0, 1, 700 * MIB, a_pipelined);
    reg_pipelined(&mut s, 0, 2, 700 * MIB, b_pipelined);
    assert_eq!(granted(&s.request(0, 1), 1), Some(true));
    s.usage(0, 1, usage(700 * MIB, 700 * MIB));
    s.request(MS, 2);
    let t = SEC;
    assert_eq!(dropped(&s.tick(t), 1), Some(400 * MIB));
    (s, t)
}

#[test]
fn drained_grants_the_next_pipelined_client_before_the_release() {
    let (mut s, t) = dropped_a(true, true);
    let outs = s.drained(t + MS, 1);
    assert_eq!(grant_msg(&outs, 2), Some((true, true)), "{outs:?}");
    // What A's drop frees is what B lacks: nobody is asked to reclaim more.
    assert_eq!(reclaims(&outs, 1), 0, "{outs:?}");
    assert_eq!(s.holders(), vec![2]);
    assert!(matches!(
        logged(&outs).as_slice(),
        [(
            Some(2),
            EventKind::Grant {
                exclusive: true,
                ..
            }
        )]
    ));
    // A's release still comes, with its usage, and is taken: no second grant.
    let outs = s.release(t + 200 * MS, 1, usage(700 * MIB, 300 * MIB));
    assert_eq!(grant_msg(&outs, 2), None);
    assert!(matches!(
        logged(&outs).as_slice(),
        [(Some(1), EventKind::Release { early: false, resident_bytes })] if *resident_bytes == 300 * MIB
    ));
    assert_eq!(s.holders(), vec![2]);
    let st = s.status(t + 300 * MS, 0, "GPU-0");
    let a = st.clients.iter().find(|c| c.id == 1).unwrap();
    assert_eq!(a.resident_bytes, 300 * MIB);
    assert_eq!(a.state, ClientState::Idle);
    // B's quantum runs from its pipelined grant.
    s.request(t + 300 * MS, 1);
    assert_eq!(s.next_deadline(), Some(t + MS + SEC));
}

#[test]
fn drained_waits_for_the_release_when_the_next_client_is_not_pipelined() {
    let (mut s, t) = dropped_a(true, false);
    let outs = s.drained(t + MS, 1);
    assert_eq!(grant_msg(&outs, 2), None, "{outs:?}");
    assert!(s.holders().is_empty());
    let outs = s.release(t + 200 * MS, 1, usage(700 * MIB, 300 * MIB));
    assert_eq!(grant_msg(&outs, 2), Some((true, false)), "{outs:?}");
}

#[test]
fn a_bad_drained_is_an_error_reply_and_never_a_grant() {
    // From a client that did not register `pipelined`.
    let (mut s, t) = dropped_a(false, true);
    let outs = s.drained(t + MS, 1);
    assert!(error_to(&outs, 1)
        .unwrap()
        .contains("did not register with `pipelined`"));
    assert_eq!(grant_msg(&outs, 2), None);
    assert_eq!(s.holders(), vec![1], "nothing changed");
    assert!(logged(&outs).is_empty());

    // From a holder that was not dropped and that nobody waits for (an early release
    // that crossed the waiter's going): ignored, no error, its release follows. From
    // a waiter: refused.
    let mut s = sched(1000 * MIB, 1_000, 500);
    reg_pipelined(&mut s, 0, 1, 700 * MIB, true);
    reg_pipelined(&mut s, 0, 2, 700 * MIB, true);
    s.request(0, 1);
    assert!(s.drained(MS, 1).is_empty());
    assert_eq!(s.holders(), vec![1], "still holding");
    s.request(MS, 2);
    let outs = s.drained(2 * MS, 2);
    assert!(
        error_to(&outs, 2).unwrap().contains("does not hold"),
        "{outs:?}"
    );
    assert_eq!(grant_msg(&outs, 2), None);
    assert!(s.drained(2 * MS, 99).is_empty(), "unknown client: nothing");

    // Twice: the second is refused and grants nobody else.
    let (mut s, t) = dropped_a(true, true);
    reg_pipelined(&mut s, t, 3, 700 * MIB, true);
    s.request(t, 3);
    assert_eq!(grant_msg(&s.drained(t + MS, 1), 2), Some((true, true)));
    let outs = s.drained(t + 2 * MS, 1);
    assert!(error_to(&outs, 1).unwrap().contains("already"), "{outs:?}");
    assert_eq!(grant_msg(&outs, 3), None);
    assert_eq!(s.holders(), vec![2]);
}

#[test]
fn a_drainer_that_never_releases_is_revoked_after_the_grace_and_its_swap_out_time() {
    let (mut s, t) = dropped_a(true, true);
    s.drained(t + MS, 1);
    // A has 700 MiB resident: a swap-out at 1 GB/s may take 734 ms past the grace.
    let allowance = 700 * MIB * SLOWEST_SWAP_OUT_NS_PER_BYTE;
    let end = t + 500 * MS + allowance;
    assert_eq!(
        s.next_deadline(),
        Some(end),
        "the drop's grace and the allowance"
    );
    assert!(
        !revoked(&s.tick(t + 500 * MS), 1),
        "a slow swap-out keeps its turn"
    );
    assert!(!revoked(&s.tick(end - 1), 1));
    let outs = s.tick(end);
    assert!(revoked(&outs, 1), "{outs:?}");
    assert!(logged(&outs)
        .iter()
        .any(|(id, k)| *id == Some(1) && *k == EventKind::Revoke));
    assert!(
        sent(&outs, 1).iter().any(
            |m| matches!(m, ArbiterMsg::Revoked { reason } if reason.contains("within 1234 ms"))
        ),
        "{outs:?}"
    );
    // Its late release is still taken, and changes nothing for B.
    let outs = s.release(end + 100 * MS, 1, usage(700 * MIB, 300 * MIB));
    assert_eq!(grant_msg(&outs, 2), None);
    assert_eq!(s.holders(), vec![2]);
}

#[test]
fn a_drained_that_crossed_the_revocation_is_ignored() {
    // A holder that ignores its drop past the grace is revoked; its `drained` sent
    // meanwhile arrives after: no error (it would land in the application's stderr),
    // and nothing changes. A grant clears it: a later stray `drained` is refused.
    let (mut s, t) = dropped_a(true, true);
    let outs = s.tick(t + 500 * MS);
    assert!(revoked(&outs, 1), "{outs:?}");
    assert_eq!(grant_msg(&outs, 2), Some((true, false)), "{outs:?}");
    let outs = s.drained(t + 501 * MS, 1);
    assert!(outs.is_empty(), "{outs:?}");
    assert_eq!(s.holders(), vec![2]);
    s.request(t + 600 * MS, 1);
    s.release(t + 700 * MS, 2, usage(700 * MIB, 0));
    assert_eq!(s.holders(), vec![1]);
    s.release(t + 800 * MS, 1, usage(700 * MIB, 0));
    let outs = s.drained(t + 900 * MS, 1);
    assert!(
        error_to(&outs, 1).unwrap().contains("does not hold"),
        "{outs:?}"
    );
}

#[test]
fn a_second_drainer_waits_for_the_first_release() {
    // A drains for B; B is dropped at once (TQ 1 ms) and drains for C while A still
    // swaps out: C waits for A's release (one swap-out beside a swap-in at most).
    let mut s = sched(1000 * MIB, 1, 5_000);
    for id in 1..=3 {
        reg_pipelined(&mut s, 0, id, 700 * MIB, true);
    }
    s.request(0, 1);
    s.usage(0, 1, usage(700 * MIB, 700 * MIB));
    s.request(0, 2);
    s.request(0, 3);
    assert!(dropped(&s.tick(MS), 1).is_some());
    assert_eq!(grant_msg(&s.drained(MS, 1), 2), Some((true, true)));
    // B's quantum starts once its memory is in.
    s.usage(MS, 2, usage(700 * MIB, 700 * MIB));
    assert!(dropped(&s.tick(2 * MS), 2).is_some());
    let outs = s.drained(2 * MS, 2);
    assert_eq!(grant_msg(&outs, 3), None, "{outs:?}");
    let outs = s.release(3 * MS, 1, usage(700 * MIB, 0));
    assert_eq!(grant_msg(&outs, 3), Some((true, true)), "{outs:?}");
}

#[test]
fn a_pipelined_holders_quantum_starts_when_its_memory_is_in() {
    // TQ 100 ms, grace 1 s: B's swap-in takes 300 ms, longer than a quantum. Counted
    // from the grant, B would be dropped before doing any work.
    let mut s = sched(1000 * MIB, 100, 1_000);
    reg_pipelined(&mut s, 0, 1, 700 * MIB, true);
    reg_pipelined(&mut s, 0, 2, 700 * MIB, true);
    s.request(0, 1);
    s.usage(0, 1, usage(700 * MIB, 700 * MIB));
    s.request(0, 2);
    assert!(dropped(&s.tick(100 * MS), 1).is_some());
    assert_eq!(grant_msg(&s.drained(110 * MS, 1), 2), Some((true, true)));
    s.release(150 * MS, 1, usage(700 * MIB, 0));
    s.request(150 * MS, 1);
    // Still swapping in at the grant + TQ: not dropped.
    assert!(dropped(&s.tick(210 * MS), 2).is_none());
    assert_eq!(s.next_deadline(), Some(110 * MS + 1_000 * MS));
    // In at 410 ms: a whole quantum from then.
    s.swapped(
        410 * MS,
        2,
        kiwi_protocol::SwapDirection::In,
        700 * MIB,
        300 * MS,
    );
    assert_eq!(s.next_deadline(), Some(510 * MS));
    assert!(dropped(&s.tick(500 * MS), 2).is_none());
    assert!(dropped(&s.tick(510 * MS), 2).is_some());
}

#[test]
fn a_holder_that_never_reports_its_memory_in_is_dropped_after_the_grace() {
    // Whatever it reports (or not), a holder holds at most max(TQ, grace) + TQ.
    let mut s = sched(1000 * MIB, 100, 1_000);
    reg_pipelined(&mut s, 0, 1, 700 * MIB, true);
    reg_pipelined(&mut s, 0, 2, 700 * MIB, true);
    s.request(0, 1);
    s.request(0, 2);
    assert!(dropped(&s.tick(999 * MS), 1).is_none());
    assert!(dropped(&s.tick(1_000 * MS), 1).is_some());
    // A report after its wait ran out does not start a new quantum.
    let mut s = sched(1000 * MIB, 100, 1_000);
    reg_pipelined(&mut s, 0, 1, 700 * MIB, true);
    reg_pipelined(&mut s, 0, 2, 700 * MIB, true);
    s.request(0, 1);
    s.request(0, 2);
    s.usage(900 * MS, 1, usage(700 * MIB, 700 * MIB));
    assert!(dropped(&s.tick(1_000 * MS), 1).is_some());
}

#[test]
fn a_client_that_does_not_report_swaps_has_its_quantum_from_the_grant() {
    let mut s = sched(1000 * MIB, 100, 1_000);
    reg_pipelined(&mut s, 0, 1, 700 * MIB, false);
    reg_pipelined(&mut s, 0, 2, 700 * MIB, false);
    s.request(0, 1);
    s.request(0, 2);
    assert!(dropped(&s.tick(100 * MS), 1).is_some());
}

#[test]
fn a_client_with_nothing_swapped_out_is_granted_at_the_release_not_at_drained() {
    // B has no memory out (nothing allocated yet, it wants to run work): granted
    // beside A's swap-out, its gate would open at once and its first allocations meet
    // a GPU still full of A's memory.
    let mut s = sched(1000 * MIB, 1, 5_000);
    reg_pipelined(&mut s, 0, 1, 700 * MIB, true);
    reg_pipelined(&mut s, 0, 2, 0, true);
    reg_pipelined(&mut s, 0, 3, 700 * MIB, true);
    s.request(0, 1);
    s.usage(0, 1, usage(700 * MIB, 700 * MIB));
    s.request(0, 2);
    assert!(dropped(&s.tick(2 * MS), 1).is_some());
    let outs = s.drained(2 * MS, 1);
    assert_eq!(grant_msg(&outs, 2), None, "{outs:?}");
    let outs = s.release(3 * MS, 1, usage(700 * MIB, 0));
    assert_eq!(grant_msg(&outs, 2), Some((true, false)), "{outs:?}");
}

#[test]
fn an_early_release_that_says_drained_hands_over_at_once_and_is_logged_early() {
    // A holder idle while B waits releases early; saying `drained` first, B (memory
    // to swap in) is granted beside its swap-out, and its release is an early one.
    let mut s = sched(1000 * MIB, 60_000, 500);
    reg_pipelined(&mut s, 0, 1, 700 * MIB, true);
    reg_pipelined(&mut s, 0, 2, 700 * MIB, true);
    s.request(0, 1);
    s.usage(0, 1, usage(700 * MIB, 700 * MIB));
    s.request(MS, 2);
    let outs = s.drained(2 * MS, 1);
    assert_eq!(grant_msg(&outs, 2), Some((true, true)), "{outs:?}");
    let outs = s.release(3 * MS, 1, usage(700 * MIB, 0));
    assert!(
        logged(&outs)
            .iter()
            .any(|(_, k)| matches!(k, EventKind::Release { early: true, .. })),
        "{outs:?}"
    );
    // Its grace runs from the `drained`, as from a drop.
    let mut s = sched(1000 * MIB, 60_000, 500);
    reg_pipelined(&mut s, 0, 1, 700 * MIB, true);
    reg_pipelined(&mut s, 0, 2, 700 * MIB, true);
    s.request(0, 1);
    s.request(MS, 2);
    s.drained(2 * MS, 1);
    assert_eq!(s.next_deadline(), Some(502 * MS));
}
