//! The memory ledger: memory no swap frees (#13), the driver's figures against the
//! clients' reports, and a tenant's view.

use super::*;

// ---- memory no swap frees (#13) ----------------------------------------------

/// A 4 GiB GPU with the default reserve (1/8: 512 MiB).
fn sched_4g() -> GpuScheduler {
    GpuScheduler::new(
        4096 * MIB,
        3584 * MIB,
        Settings {
            scheduler_on: true,
            tq_ms: 1_000,
        },
        500,
    )
}

fn reg_unswappable(s: &mut GpuScheduler, now: Nanos, id: ClientId, ws: u64, fixed: Option<u64>) {
    let info = ClientInfo {
        unswappable: fixed,
        ..ClientInfo::default()
    };
    s.register(now, id, info, usage(ws, 0), None);
}

/// Four 768 MiB programs with 300 MiB contexts on 4 GiB: their working sets fit in
/// total − reserve (3072 ≤ 3584 MiB), but not next to their contexts (3072 + 1200 >
/// 4096). Counting the contexts, they take turns; not counting them, all four were
/// granted at once and the last allocations ran out of GPU memory.
#[test]
fn working_sets_fit_only_next_to_every_clients_unswappable_memory() {
    let mut s = sched_4g();
    for id in 1..=4 {
        reg_unswappable(&mut s, 0, id, 768 * MIB, Some(300 * MIB));
    }
    assert_eq!(s.fixed(), 1200 * MIB);
    assert_eq!(s.room(), 2896 * MIB);
    assert!(!s.fits());
    assert_eq!(granted(&s.request(1, 1), 1), Some(true));
    assert_eq!(granted(&s.request(2, 2), 2), None, "B waits");
    // The same clients without reports: the reserve alone, and they all share.
    let mut old = sched_4g();
    for id in 1..=4 {
        reg_unswappable(&mut old, 0, id, 768 * MIB, None);
    }
    assert_eq!(old.fixed(), 512 * MIB, "the reserve");
    assert!(old.fits());
    // A context reported later counts from then on.
    let mut s = sched_4g();
    reg_unswappable(&mut s, 0, 1, 1700 * MIB, Some(0));
    reg_unswappable(&mut s, 0, 2, 1700 * MIB, Some(0));
    assert!(s.fits(), "3400 ≤ 4096: every client reports, no reserve");
    s.unswappable(1, 1, 400 * MIB);
    assert!(s.fits(), "3400 + 400 ≤ 4096");
    s.unswappable(2, 2, 400 * MIB);
    assert!(!s.fits(), "3400 + 800 > 4096: the reports pass the reserve");
    assert_eq!(s.swap_need(), 104 * MIB);
}

/// With every client reporting its memory no swap frees, the reports are the truth:
/// the context reserve (a floor for clients that predate the report) no longer
/// counts, so the room is the GPU less the reports (issue #24: a process can
/// allocate what it could without Kiwi). One client that does not report brings the
/// reserve back.
#[test]
fn reports_replace_the_reserve_unless_a_client_does_not_report() {
    let mut s = GpuScheduler::new(
        1024 * MIB,
        896 * MIB,
        Settings {
            scheduler_on: true,
            tq_ms: 1_000,
        },
        500,
    );
    reg_unswappable(&mut s, 0, 1, 400 * MIB, Some(48 * MIB));
    reg_unswappable(&mut s, 0, 2, 400 * MIB, Some(48 * MIB));
    assert_eq!(s.room(), 928 * MIB);
    assert!(s.fits());
    assert_eq!(granted(&s.request(0, 1), 1), Some(false));
    assert_eq!(granted(&s.request(0, 2), 2), Some(false));
    reg_unswappable(&mut s, 0, 3, 0, None);
    assert_eq!(s.room(), 896 * MIB);
}

/// A hand-off's need keeps everybody's unswappable memory on the GPU: the holder
/// must evict enough that the next one's working set fits beside all contexts.
#[test]
fn a_handoffs_need_counts_unswappable_memory() {
    let mut s = sched_4g();
    for id in 1..=4 {
        reg_unswappable(&mut s, 0, id, 768 * MIB, Some(300 * MIB));
    }
    assert_eq!(granted(&s.request(0, 1), 1), Some(true));
    s.usage(0, 1, usage(768 * MIB, 768 * MIB));
    // B, C, D were resident earlier (say they ran while D's context was not counted).
    s.reclaimed(0, 2, usage(768 * MIB, 768 * MIB));
    s.reclaimed(0, 3, usage(768 * MIB, 768 * MIB));
    s.request(1, 4);
    let outs = s.tick(SEC + 1);
    // Resident 3 × 768 + D's 768 = 3072 over a room of 2896 MiB.
    assert_eq!(dropped(&outs, 1), Some(176 * MIB), "{outs:?}");
    let outs = s.release(SEC + 2, 1, usage(768 * MIB, 768 * MIB));
    assert_eq!(granted(&outs, 4), Some(true));
    // A released without evicting: the idle ones make room, least recently active
    // first (B, registered first and never active since).
    assert_eq!(reclaims(&outs, 2), 176 * MIB, "{outs:?}");
}

/// An exclusive holder whose swap-in found no room (a revoked holder's memory still
/// resident, a reclaim answered with less than asked) gets that room reclaimed from
/// idle clients; reclaims already asked are not asked twice.
#[test]
fn a_holder_short_of_room_gets_it_reclaimed() {
    let mut s = sched_4g();
    reg_unswappable(&mut s, 0, 1, 2000 * MIB, Some(300 * MIB));
    reg_unswappable(&mut s, 0, 2, 2000 * MIB, Some(300 * MIB));
    assert_eq!(granted(&s.request(0, 1), 1), Some(true));
    s.usage(0, 1, usage(2000 * MIB, 2000 * MIB));
    s.request(1, 2);
    let outs = s.tick(SEC + 1);
    assert!(dropped(&outs, 1).is_some());
    // A never answers: revoked after the grace, its memory still resident. B gets
    // the GPU and A is asked to reclaim what B lacks: 2000 + 2000 − 3496.
    let outs = s.tick(SEC + 1 + 500 * MS);
    assert!(sent(&outs, 1)
        .iter()
        .any(|m| matches!(m, ArbiterMsg::Revoked { .. })));
    assert_eq!(granted(&outs, 2), Some(true));
    assert_eq!(reclaims(&outs, 1), 504 * MIB, "{outs:?}");
    // Nothing asked twice while that reclaim is pending.
    let outs = s.usage(SEC + 2, 2, usage(2000 * MIB, 1000 * MIB));
    assert_eq!(reclaims(&outs, 1), 0, "{outs:?}");
    // A evicted only 200 MiB: B is still short, and A is asked for the rest.
    let outs = s.reclaimed(SEC + 3, 1, usage(2000 * MIB, 1800 * MIB));
    assert_eq!(reclaims(&outs, 1), 304 * MIB, "{outs:?}");
    let outs = s.reclaimed(SEC + 4, 1, usage(2000 * MIB, 1496 * MIB));
    assert_eq!(reclaims(&outs, 1), 0, "room made: {outs:?}");
    s.usage(SEC + 5, 2, usage(2000 * MIB, 2000 * MIB));
    assert!(s.holds_exclusive(2));
}

/// A holder that grows its memory 20 MiB at a time beside an idle client's (PyTorch's
/// expandable segments) gets room reclaimed in batches that double within its hold,
/// up to 1/16 of the GPU, not one reclaim per piece; its next hold starts over.
#[test]
fn a_growing_holder_gets_room_reclaimed_in_doubling_batches() {
    let mut s = sched_4g();
    reg_unswappable(&mut s, 0, 1, 3480 * MIB, Some(300 * MIB));
    reg_unswappable(&mut s, 0, 2, 20 * MIB, Some(300 * MIB));
    // The idle client: all in, not asking.
    assert_eq!(granted(&s.request(0, 1), 1), Some(true));
    s.usage(0, 1, usage(3480 * MIB, 3480 * MIB));
    s.release(1, 1, usage(3480 * MIB, 3480 * MIB));
    assert_eq!(granted(&s.request(2, 2), 2), Some(true));
    // The room: 4096 − 600 of contexts. The client grows to 2000 MiB, 20 at a
    // time; every reclaim is answered at once.
    let (mut ws, mut res1, mut asked) = (20 * MIB, 3480 * MIB, Vec::new());
    let mut t = 3;
    while ws < 2000 * MIB {
        ws += 20 * MIB;
        t += 1;
        let free = ((4096 - 600) * MIB).saturating_sub(res1 + ws - 20 * MIB);
        let resident = if free >= 20 * MIB { ws } else { ws - 20 * MIB };
        let mut ask = reclaims(&s.usage(t, 2, usage(ws, resident)), 1);
        while ask > 0 {
            asked.push(ask / MIB);
            res1 -= ask.min(res1);
            ask = reclaims(&s.reclaimed(t, 1, usage(3480 * MIB, res1)), 1);
            ask += reclaims(&s.usage(t, 2, usage(ws, ws)), 1);
        }
    }
    // 2000 − (3496 − 3480) MiB had to leave: 20, 20, 40, 80, 160, then 256 a time.
    assert_eq!(asked[..5], [20, 20, 40, 80, 160], "{asked:?}");
    assert!(asked[5..].iter().all(|&a| a == 256), "{asked:?}");
    assert!(asked.len() <= 13, "{} reclaims: {asked:?}", asked.len());
    // Its next hold starts from the piece again.
    s.release(t + 1, 2, usage(ws, ws));
    assert_eq!(granted(&s.request(t + 2, 2), 2), Some(true));
    let outs = s.usage(t + 3, 2, usage(ws + 20 * MIB, ws));
    assert!(reclaims(&outs, 1) <= 40 * MIB, "{outs:?}");
}

/// A report past the GPU's size (a lie or a bug) counts as the whole GPU, no more:
/// the figures status shows stay within the GPU and no sum overflows.
#[test]
fn an_unswappable_report_past_the_gpu_counts_as_the_whole_gpu() {
    let mut s = GpuScheduler::new(
        1024 * MIB,
        896 * MIB,
        Settings {
            scheduler_on: true,
            tq_ms: 1_000,
        },
        500,
    );
    reg_unswappable(&mut s, 0, 1, 100 * MIB, Some(u64::MAX));
    assert_eq!(s.fixed(), 1024 * MIB);
    s.unswappable(0, 1, u64::MAX - 1);
    reg_unswappable(&mut s, 0, 2, 100 * MIB, Some(u64::MAX));
    assert_eq!(s.fixed(), 1024 * MIB, "clamped to the GPU");
    assert_eq!(s.room(), 0);
    assert!(!s.fits());
}

/// Registers client `id` with host pid `pid`, `ws` all resident, and `fixed` of
/// memory no swap frees reported.
fn reg_pid(s: &mut GpuScheduler, id: ClientId, pid: u32, ws: u64, fixed: u64) {
    let info = ClientInfo {
        host_pid: pid,
        unswappable: Some(fixed),
        ..ClientInfo::default()
    };
    s.register(0, id, info, usage(ws, ws), None);
}

fn unreported(outs: &[Output]) -> Vec<(Option<ClientId>, u64)> {
    logged(outs)
        .into_iter()
        .filter_map(|(id, k)| match k {
            EventKind::Unreported { bytes } => Some((id, bytes)),
            _ => None,
        })
        .collect()
}

/// What the driver counts for a client's process beyond its reports (code loaded
/// inside launches) is counted as memory no swap frees after three looks in a row
/// with its reports unchanged, at the least the looks saw (a report lagging a swap
/// shows in one look only); a look after its reports changed starts over, and the
/// count goes once the process's figure comes down to its reports.
#[test]
fn memory_beyond_a_clients_reports_is_counted_once_stable() {
    let mut s = sched_4g();
    reg_pid(&mut s, 1, 4242, 1000 * MIB, 300 * MIB);
    reg_pid(&mut s, 2, 4343, 1000 * MIB, 300 * MIB);
    let room = s.room();
    let procs = |extra: u64| [(4242, (1300 + extra) * MIB), (4343, 1300 * MIB)];
    assert!(unreported(&s.reconcile(SEC, &procs(700))).is_empty());
    assert!(unreported(&s.reconcile(2 * SEC, &procs(190))).is_empty());
    let outs = s.reconcile(3 * SEC, &procs(200));
    assert_eq!(unreported(&outs), vec![(Some(1), 190 * MIB)]);
    assert_eq!(
        s.room(),
        room - 190 * MIB,
        "counted as memory no swap frees"
    );
    // Stable again: nothing new to say.
    assert!(unreported(&s.reconcile(4 * SEC, &procs(200))).is_empty());
    // Its reports change (the shim counted the code itself): three looks again,
    // and the count goes.
    s.unswappable(5 * SEC, 1, 500 * MIB);
    for t in 6..8 {
        assert!(unreported(&s.reconcile(t * SEC, &procs(200))).is_empty());
    }
    assert_eq!(
        unreported(&s.reconcile(8 * SEC, &procs(200))),
        vec![(Some(1), 0)]
    );
    assert_eq!(s.room(), room - 200 * MIB);
    // Within the slack: never counted.
    for t in 9..14 {
        assert!(unreported(&s.reconcile(t * SEC, &procs(200 + 60))).is_empty());
    }
}

/// A client being reclaimed, or whose process NVML does not list, is not looked
/// at: its reports lag the swap, or the figure is someone else's.
#[test]
fn a_busy_or_unlisted_client_is_not_reconciled() {
    let mut s = sched_4g();
    reg_pid(&mut s, 1, 4242, 3000 * MIB, 300 * MIB);
    reg_pid(&mut s, 2, 4343, 1000 * MIB, 300 * MIB);
    assert_eq!(granted(&s.request(0, 2), 2), Some(true));
    assert!(
        s.clients[&1].reclaim_pending > 0,
        "client 1 is being reclaimed"
    );
    for t in 1..6 {
        let outs = s.reconcile(t * SEC, &[(4242, 3900 * MIB), (4343, 1300 * MIB)]);
        assert!(unreported(&outs).is_empty(), "{outs:?}");
    }
    // A pid NVML does not list (another pid namespace): nothing, ever.
    let mut s = sched_4g();
    reg_pid(&mut s, 1, 0, 1000 * MIB, 300 * MIB);
    for t in 1..6 {
        assert!(unreported(&s.reconcile(t * SEC, &[(0, 3000 * MIB)])).is_empty());
    }
}

/// Issue #42, item 6: a process outside Kiwi that registers a client of its own
/// and changes its reports at every look (0, then 2.4 GiB resident, and back) no
/// longer escapes the driver's figure: what it holds beyond what it claimed least
/// is counted as memory no swap frees. Before, every change started the looks over
/// and nothing was ever counted.
#[test]
fn a_client_that_changes_its_reports_at_every_look_is_counted_all_the_same() {
    let mut s = sched_4g();
    reg_pid(&mut s, 1, 4242, 0, 0);
    let held = 2400 * MIB;
    let mut counted = Vec::new();
    for t in 1..8u64 {
        let resident = if t % 2 == 0 { held } else { 0 };
        s.usage(t * SEC - MS, 1, usage(held, resident));
        counted.extend(unreported(&s.reconcile(t * SEC, &[(4242, held)])));
    }
    assert_eq!(counted, vec![(Some(1), held)]);
    assert_eq!(s.clients[&1].unswappable, held);
}

/// Issue #42, item 3: memory no swap frees that a client reports and that its
/// process does not hold, at any look, is a claim no process backs: it is not
/// counted (so it keeps nobody checkpointed or waiting), and counts again once the
/// driver shows it. Only where NVML lists some client's process: a driver that
/// lists none doubts nobody.
#[test]
fn memory_no_swap_frees_that_no_process_holds_is_not_counted() {
    let unbacked = |outs: &[Output]| {
        logged(outs)
            .into_iter()
            .filter_map(|(id, k)| match k {
                EventKind::Unbacked { bytes } => Some((id, bytes)),
                _ => None,
            })
            .collect::<Vec<_>>()
    };
    let mut s = sched_4g();
    reg_pid(&mut s, 1, 4242, 1000 * MIB, 300 * MIB);
    // Client 2 claims 3.8 GiB of contexts; its process (4343) is not listed at all.
    reg_pid(&mut s, 2, 4343, 0, 3800 * MIB);
    assert_eq!(s.room(), 0, "the claim takes the whole GPU");
    let mut said = Vec::new();
    for t in 1..=3 {
        said.extend(unbacked(&s.reconcile(t * SEC, &[(4242, 1300 * MIB)])));
    }
    assert_eq!(said, vec![(Some(2), 3800 * MIB)]);
    assert_eq!(s.room(), (4096 - 300) * MIB, "only 1's context counts");
    // Its process makes a 300 MiB context: that much is backed again.
    for t in 4..=6 {
        s.reconcile(t * SEC, &[(4242, 1300 * MIB), (4343, 300 * MIB)]);
    }
    assert_eq!(s.clients[&2].unswappable, 300 * MIB);
    // A driver that lists no client's process: no claim is doubted.
    let mut s = sched_4g();
    reg_pid(&mut s, 2, 4343, 0, 3800 * MIB);
    for t in 1..=4 {
        assert!(unbacked(&s.reconcile(t * SEC, &[(999, 100 * MIB)])).is_empty());
    }
}

/// Processes NVML lists that are no client here (run without Kiwi) count as memory
/// no swap frees once listed for three looks, at the least of them; not while some
/// client's host pid is unknown (it could be one of them).
#[test]
fn processes_outside_kiwi_count_as_memory_no_swap_frees() {
    let outside = |outs: &[Output]| {
        logged(outs)
            .into_iter()
            .filter_map(|(_, k)| match k {
                EventKind::OutsideKiwi { bytes } => Some(bytes),
                _ => None,
            })
            .collect::<Vec<_>>()
    };
    let mut s = sched_4g();
    reg_pid(&mut s, 1, 4242, 1000 * MIB, 300 * MIB);
    let room = s.room();
    let procs = |other: u64| [(4242, 1300 * MIB), (777, other * MIB), (778, 10 * MIB)];
    assert!(outside(&s.reconcile(SEC, &procs(900))).is_empty());
    assert!(outside(&s.reconcile(2 * SEC, &procs(800))).is_empty());
    assert_eq!(outside(&s.reconcile(3 * SEC, &procs(900))), vec![800 * MIB]);
    assert_eq!(
        s.room(),
        room - 800 * MIB,
        "778's 10 MiB are within the slack"
    );
    // Gone from the list: no longer counted.
    let outs = s.reconcile(4 * SEC, &[(4242, 1300 * MIB)]);
    assert_eq!(outside(&outs), vec![0]);
    assert_eq!(s.room(), room);
    // A client whose host pid is unknown: nothing is counted.
    reg_pid(&mut s, 2, 0, 100 * MIB, 300 * MIB);
    for t in 5..10 {
        assert!(outside(&s.reconcile(t * SEC, &procs(900))).is_empty());
    }
}

/// A tenant's view (issue #39): the clients it owns, each with its working set and
/// its memory no swap frees, the largest first; and every client's memory no swap
/// frees, which a process without a turn is told is in use.
#[test]
fn a_view_lists_the_chosen_clients_and_every_clients_unswappable_memory() {
    let mut s = sched(4096 * MIB, 1_000, 500);
    for (id, pid, ws, fixed) in [(1, 11, 500, 100), (2, 22, 2000, 300), (3, 33, 900, 50)] {
        let info = ClientInfo {
            pid,
            unswappable: Some(fixed * MIB),
            ..ClientInfo::default()
        };
        s.register(0, id, info, usage(ws * MIB, 0), None);
    }
    let (fixed, mine) = s.view(|id| id != 2);
    assert_eq!(fixed, 450 * MIB, "everyone's memory no swap frees");
    let listed: Vec<(u32, u64)> = mine.iter().map(|p| (p.pid, p.used_bytes)).collect();
    assert_eq!(listed, vec![(33, 950 * MIB), (11, 600 * MIB)]);
    assert!(s.view(|_| false).1.is_empty(), "no one else's");
}
