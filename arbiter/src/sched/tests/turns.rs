//! Turns: grants, drops at the quantum's end, the grace, exits, settings, and
//! the hysteresis between shared and in turns.

use super::*;

#[test]
fn fitting_clients_run_together() {
    let mut s = sched(1000 * MIB, 30_000, 5_000);
    reg(&mut s, 0, 1, 400 * MIB);
    reg(&mut s, 0, 2, 400 * MIB);
    assert_eq!(granted(&s.request(1, 1), 1), Some(false));
    assert_eq!(granted(&s.request(2, 2), 2), Some(false));
    assert_eq!(s.holders(), vec![1, 2]);
    assert_eq!(s.next_deadline(), None, "no timers while everything fits");
}

#[test]
fn seed_timeline_tq_then_early_release() {
    // T1: A asks and gets the GPU; T2: B asks and waits; T3 = T1 + TQ: A is dropped,
    // B runs; T4: B releases early; A resumes.
    let tq = 2_000;
    let mut s = sched(1000 * MIB, tq, 500);
    reg(&mut s, 0, 1, 700 * MIB);
    reg(&mut s, 0, 2, 700 * MIB);
    let t1 = SEC;
    assert_eq!(granted(&s.request(t1, 1), 1), Some(true));
    s.usage(t1, 1, usage(700 * MIB, 700 * MIB));
    let t2 = t1 + SEC / 2;
    let outs = s.request(t2, 2);
    assert_eq!(granted(&outs, 2), None, "B must wait while A holds");
    assert!(sent(&outs, 1)
        .iter()
        .any(|m| matches!(m, ArbiterMsg::Contended { waiting: 1, need_bytes } if *need_bytes == 400 * MIB)));
    let t3 = t1 + tq * MS;
    assert_eq!(s.next_deadline(), Some(t3));
    assert!(s.tick(t3 - 1).is_empty());
    let outs = s.tick(t3);
    // B needs 700 MiB; free is 300 MiB: A must evict 400 MiB.
    assert_eq!(dropped(&outs, 1), Some(400 * MIB));
    let outs = s.release(t3 + 10 * MS, 1, usage(700 * MIB, 300 * MIB));
    assert_eq!(granted(&outs, 2), Some(true));
    let outs = s.request(t3 + 11 * MS, 1);
    assert_eq!(granted(&outs, 1), None, "A waits for B now");
    let t4 = t3 + SEC;
    let outs = s.release(t4, 2, usage(700 * MIB, 700 * MIB));
    // A needs its 400 MiB back; B released early with 700 resident: A is granted at
    // once and B is asked to evict 400 MiB.
    assert!(sent(&outs, 2)
        .iter()
        .any(|m| matches!(m, ArbiterMsg::Reclaim { need_bytes } if *need_bytes == 400 * MIB)));
    assert_eq!(granted(&outs, 1), Some(true));
}

#[test]
fn residency_over_capacity_is_evicted_at_the_next_drop() {
    // Two 8 MiB clients on 14 MiB. B was asked to reclaim while it waited, but was
    // granted before its answer came, and swapped back in: both are resident (16 MiB).
    // Each hand-off must now shed the 2 MiB overflow, not alternate with it forever.
    let mut s = sched(14 * MIB, 5, 500);
    reg(&mut s, 0, 1, 8 * MIB);
    reg(&mut s, 0, 2, 8 * MIB);
    assert_eq!(granted(&s.request(0, 1), 1), Some(true));
    s.usage(0, 1, usage(8 * MIB, 8 * MIB));
    s.request(1, 2);
    s.usage(1, 2, usage(8 * MIB, 8 * MIB));
    let outs = s.tick(5 * MS);
    assert_eq!(dropped(&outs, 1), Some(2 * MIB), "{outs:?}");
    let outs = s.release(6 * MS, 1, usage(8 * MIB, 6 * MIB));
    assert_eq!(granted(&outs, 2), Some(true));
    // Back within capacity: the next drop asks for nothing more than A's swap-in needs.
    s.request(7 * MS, 1);
    let outs = s.tick(11 * MS);
    assert_eq!(dropped(&outs, 2), Some(2 * MIB), "{outs:?}");
}

#[test]
fn holder_hears_when_the_next_ones_needs_grow() {
    let mut s = sched(1000 * MIB, 30_000, 5_000);
    reg(&mut s, 0, 1, 700 * MIB);
    reg(&mut s, 0, 2, 400 * MIB);
    s.request(0, 1);
    s.usage(0, 1, usage(700 * MIB, 700 * MIB));
    // B asks with 400 MiB allocated: 100 MiB must go.
    let outs = s.request(1, 2);
    assert!(
        sent(&outs, 1).iter().any(
            |m| matches!(m, ArbiterMsg::Contended { waiting: 1, need_bytes } if *need_bytes == 100 * MIB)
        ),
        "{outs:?}"
    );
    // B allocates more while waiting: A hears it must free 400 MiB.
    let outs = s.usage(2, 2, usage(700 * MIB, 0));
    assert!(
        sent(&outs, 1).iter().any(
            |m| matches!(m, ArbiterMsg::Contended { waiting: 1, need_bytes } if *need_bytes == 400 * MIB)
        ),
        "{outs:?}"
    );
    // Nothing changed: nothing resent.
    assert!(sent(&s.usage(3, 2, usage(700 * MIB, 0)), 1).is_empty());
}

#[test]
fn lone_holder_keeps_the_gpu_past_tq() {
    let mut s = sched(1000 * MIB, 1_000, 500);
    reg(&mut s, 0, 1, 700 * MIB);
    reg(&mut s, 0, 2, 700 * MIB);
    s.request(0, 1);
    assert_eq!(s.next_deadline(), None);
    assert!(s.tick(100 * SEC).is_empty());
    // Somebody arrives long after TQ: the holder is dropped right away.
    let outs = s.request(100 * SEC, 2);
    assert!(dropped(&outs, 1).is_some());
}

#[test]
fn ignoring_a_drop_costs_the_gpu_after_grace() {
    let mut s = sched(1000 * MIB, 1_000, 300);
    reg(&mut s, 0, 1, 700 * MIB);
    reg(&mut s, 0, 2, 700 * MIB);
    s.request(0, 1);
    s.request(1, 2);
    let outs = s.tick(SEC);
    assert!(dropped(&outs, 1).is_some());
    assert_eq!(s.next_deadline(), Some(SEC + 300 * MS));
    let outs = s.tick(SEC + 300 * MS);
    assert!(sent(&outs, 1)
        .iter()
        .any(|m| matches!(m, ArbiterMsg::Revoked { .. })));
    assert_eq!(granted(&outs, 2), Some(true));
    assert!(outs
        .iter()
        .any(|o| matches!(o, Output::Log(Some(1), EventKind::Revoke))));
}

#[test]
fn exit_of_holder_grants_next_at_once() {
    let mut s = sched(1000 * MIB, 30_000, 5_000);
    reg(&mut s, 0, 1, 700 * MIB);
    reg(&mut s, 0, 2, 700 * MIB);
    reg(&mut s, 0, 3, 700 * MIB);
    s.request(0, 1);
    s.usage(0, 1, usage(700 * MIB, 700 * MIB));
    s.request(1, 2);
    let outs = s.exit(2, 1);
    assert_eq!(granted(&outs, 2), Some(true));
}

#[test]
fn scheduler_off_grants_everyone() {
    let mut s = sched(1000 * MIB, 30_000, 5_000);
    reg(&mut s, 0, 1, 700 * MIB);
    reg(&mut s, 0, 2, 700 * MIB);
    s.request(0, 1);
    assert_eq!(granted(&s.request(1, 2), 2), None);
    let outs = s.set_scheduler(2, false);
    assert_eq!(granted(&outs, 2), Some(false));
    assert!(sent(&outs, 1).iter().any(|m| matches!(
        m,
        ArbiterMsg::Settings(Settings {
            scheduler_on: false,
            ..
        })
    )));
    // Back on: the two running side by side no longer fit; one is dropped.
    let outs = s.set_scheduler(3, true);
    let drops: Vec<_> = [1, 2]
        .iter()
        .filter(|&&id| dropped(&outs, id).is_some())
        .collect();
    assert_eq!(drops.len(), 1, "{outs:?}");
}

#[test]
fn growing_past_capacity_drops_all_but_one() {
    let mut s = sched(1000 * MIB, 30_000, 5_000);
    reg(&mut s, 0, 1, 400 * MIB);
    reg(&mut s, 0, 2, 400 * MIB);
    s.request(0, 1);
    s.request(0, 2);
    s.usage(0, 1, usage(400 * MIB, 400 * MIB));
    s.usage(0, 2, usage(400 * MIB, 400 * MIB));
    let outs = s.usage(5, 2, usage(800 * MIB, 400 * MIB));
    let drops: Vec<_> = outs
        .iter()
        .filter(|o| {
            matches!(
                o,
                Output::Send(
                    _,
                    ArbiterMsg::Drop {
                        reason: DropReason::NoLongerFits,
                        ..
                    }
                )
            )
        })
        .collect();
    assert_eq!(drops.len(), 1, "{outs:?}");
    assert!(s.holds_exclusive(2) != s.holds_exclusive(1));
}

#[test]
fn tq_change_applies_to_current_holder() {
    let mut s = sched(1000 * MIB, 30_000, 5_000);
    reg(&mut s, 0, 1, 700 * MIB);
    reg(&mut s, 0, 2, 700 * MIB);
    s.request(0, 1);
    s.request(0, 2);
    assert_eq!(s.next_deadline(), Some(30 * SEC));
    s.set_tq(SEC, kiwi_config::Quantum::from_millis(2_000).unwrap());
    assert_eq!(s.next_deadline(), Some(2 * SEC));
}

#[test]
fn release_without_holding_cancels_the_request() {
    let mut s = sched(1000 * MIB, 30_000, 5_000);
    reg(&mut s, 0, 1, 700 * MIB);
    reg(&mut s, 0, 2, 700 * MIB);
    s.request(0, 1);
    s.request(0, 2);
    s.release(1, 2, usage(700 * MIB, 0));
    assert!(s.queue().is_empty());
    assert_eq!(s.next_deadline(), None);
}

/// Issue #38, item 1: a tenant that flips its working set across the room at every
/// message turns the GPU exclusive at once, and shared again only once it has fit
/// for [`STATE_INTERVAL_NS`]: a sharer gets one drop for a storm of flips, not one a
/// flip, and its grant back follows the quiet interval.
#[test]
fn flips_across_the_room_turn_the_gpu_exclusive_at_once_and_shared_after_an_interval() {
    let mut s = sched(1000 * MIB, 30_000, 5_000);
    reg(&mut s, 0, 1, 400 * MIB);
    reg(&mut s, 0, 2, 400 * MIB);
    reg(&mut s, 0, 3, 0);
    assert_eq!(granted(&s.request(MS, 1), 1), Some(false));
    assert_eq!(granted(&s.request(MS, 2), 2), Some(false));
    let mut drops = 0;
    let mut t = 2 * MS;
    for k in 0..8_000u64 {
        let ws = if k % 2 == 0 { 900 * MIB } else { 0 };
        let outs = s.usage(t, 3, usage(ws, 0));
        drops += [1, 2]
            .iter()
            .filter(|&&id| dropped(&outs, id).is_some())
            .count();
        t += 10_000;
    }
    assert_eq!(drops, 1, "one sharer dropped once for 8,000 flips");
    // It fits now (the last flip was to 0), but only an interval after the last
    // oversubscription does the GPU run shared again.
    let last = t - 20_000;
    assert_eq!(s.next_deadline(), Some(last + STATE_INTERVAL_NS));
    let dropped_one = if s.holders().contains(&1) { 2 } else { 1 };
    s.release(t, dropped_one, usage(400 * MIB, 400 * MIB));
    let outs = s.request(t + MS, dropped_one);
    assert_eq!(granted(&outs, dropped_one), None, "not shared yet");
    let outs = s.tick(last + STATE_INTERVAL_NS);
    assert_eq!(granted(&outs, dropped_one), Some(false), "{outs:?}");
}
