//! Idle eviction (#15).

use super::*;

fn idle_reclaim(outs: &[Output], to: ClientId) -> Option<u64> {
    let sent_bytes = reclaims(outs, to);
    let logged_idle = logged(outs).iter().any(|(id, k)| {
        *id == Some(to) && matches!(k, EventKind::Reclaim { idle: true, need_bytes } if *need_bytes == sent_bytes)
    });
    (sent_bytes > 0 && logged_idle).then_some(sent_bytes)
}

/// A (500 MiB) holds; B (600 MiB, 500 resident) went idle at time 0. 1000 MiB room:
/// oversubscribed, and nobody needed a reclaim so far.
fn idle_b(idle_ms: u64) -> GpuScheduler {
    let mut s = sched(1000 * MIB, 30_000, 500).with_idle_evict(idle_ms);
    reg(&mut s, 0, 1, 500 * MIB);
    reg(&mut s, 0, 2, 600 * MIB);
    s.usage(0, 2, usage(600 * MIB, 500 * MIB));
    let outs = s.request(0, 1);
    assert_eq!(reclaims(&outs, 2), 0, "{outs:?}");
    s.usage(0, 1, usage(500 * MIB, 500 * MIB));
    s
}

#[test]
fn an_idle_resident_client_is_evicted_when_oversubscribed() {
    let mut s = idle_b(1_000);
    assert_eq!(s.next_deadline(), Some(SEC));
    assert_eq!(idle_reclaim(&s.tick(SEC - 1), 2), None);
    let outs = s.tick(SEC);
    assert_eq!(idle_reclaim(&outs, 2), Some(500 * MIB), "{outs:?}");
    // Asked once: no repeat while its answer is on the way.
    assert_eq!(idle_reclaim(&s.tick(3 * SEC), 2), None);
    assert!(s.next_deadline().is_none_or(|d| d > 3 * SEC));
    let outs = s.reclaimed(3 * SEC, 2, usage(600 * MIB, 0));
    assert_eq!(idle_reclaim(&outs, 2), None);
    let st = s.status(4 * SEC, 0, "GPU-0");
    let b = st.clients.iter().find(|c| c.id == 2).unwrap();
    assert_eq!((b.resident_bytes, b.swapped_bytes), (0, 600 * MIB));
    assert_eq!(b.idle_since_ns, Some(0));
    let a = st.clients.iter().find(|c| c.id == 1).unwrap();
    assert_eq!(a.idle_since_ns, None, "a holder is not idle");
    // B asks later: it is granted after A and pays only its own swap-in (nobody
    // else is asked to reclaim for it once A gives the GPU back).
    s.request(5 * SEC, 2);
    let outs = s.release(6 * SEC, 1, usage(500 * MIB, 400 * MIB));
    assert_eq!(grant_msg(&outs, 2), Some((true, false)));
    assert_eq!(reclaims(&outs, 1), 0, "{outs:?}");
}

#[test]
fn no_idle_eviction_when_it_fits_when_off_or_for_a_recent_client() {
    // Off.
    let mut s = idle_b(0);
    assert_eq!(s.next_deadline(), None);
    assert_eq!(idle_reclaim(&s.tick(100 * SEC), 2), None);
    // Fits: B shrinks to 400 MiB.
    let mut s = idle_b(1_000);
    s.usage(0, 2, usage(400 * MIB, 400 * MIB));
    assert!(s.fits());
    // The end of the pressure is told when its interval ends; then nothing is due.
    assert_eq!(s.next_deadline(), Some(STATE_INTERVAL_NS));
    s.tick(STATE_INTERVAL_NS);
    assert_eq!(s.next_deadline(), None);
    assert_eq!(idle_reclaim(&s.tick(100 * SEC), 2), None);
    // Active: B changed its memory at 0.9 s: its idle time starts again.
    let mut s = idle_b(1_000);
    s.usage(900 * MS, 2, usage(600 * MIB, 450 * MIB));
    assert_eq!(idle_reclaim(&s.tick(SEC), 2), None);
    assert_eq!(s.next_deadline(), Some(1_900 * MS));
    // Waiting clients are not idle.
    let mut s = idle_b(1_000);
    s.request(0, 2);
    assert_eq!(idle_reclaim(&s.tick(100 * SEC), 2), None);
}

#[test]
fn idle_eviction_waits_for_a_free_link_and_goes_one_at_a_time() {
    // C (100 MiB, resident) went idle at 0.1 s, after B.
    let mut s = idle_b(1_000);
    reg(&mut s, 0, 3, 100 * MIB);
    s.usage(100 * MS, 3, usage(100 * MIB, 100 * MIB));
    s.set_tq(0, kiwi_config::Quantum::from_millis(1_000).unwrap());

    // 1) A hand-off under way (D waits, A is dropped at its TQ): no eviction until
    // A's release ends it.
    let mut busy = s.clone();
    reg(&mut busy, 0, 4, 100 * MIB);
    busy.request(0, 4);
    let outs = busy.tick(SEC);
    assert!(dropped(&outs, 1).is_some(), "{outs:?}");
    assert_eq!(idle_reclaim(&outs, 2), None, "a drop is outstanding");
    assert_eq!(idle_reclaim(&busy.tick(SEC + 100 * MS), 2), None);
    // D's grant needs 100 MiB reclaimed (from B, least recently active): that
    // reclaim keeps the link busy until B answers it; then the rest of B goes.
    let outs = busy.release(SEC + 200 * MS, 1, usage(500 * MIB, 400 * MIB));
    assert_eq!(grant_msg(&outs, 4), Some((true, false)));
    assert_eq!(reclaims(&outs, 2), 100 * MIB);
    assert_eq!(idle_reclaim(&outs, 2), None, "{outs:?}");
    let outs = busy.reclaimed(SEC + 250 * MS, 2, usage(600 * MIB, 400 * MIB));
    assert_eq!(idle_reclaim(&outs, 2), Some(400 * MIB), "{outs:?}");

    // 2) One at a time, least recently seen first: B (seen at 0), then C (0.1 s)
    // once B answers.
    let outs = s.tick(SEC);
    assert_eq!(idle_reclaim(&outs, 2), Some(500 * MIB));
    assert_eq!(idle_reclaim(&outs, 3), None);
    let outs = s.reclaimed(SEC + 50 * MS, 2, usage(600 * MIB, 0));
    assert_eq!(idle_reclaim(&outs, 3), None, "C is idle for 1 s at 1.1 s");
    assert!(!s.fits());
    assert_eq!(s.next_deadline(), Some(1_100 * MS));
    assert_eq!(idle_reclaim(&s.tick(1_100 * MS), 3), Some(100 * MIB));
}

#[test]
fn an_unanswered_idle_reclaim_blocks_the_link_only_for_the_grace() {
    let mut s = idle_b(1_000);
    reg(&mut s, 0, 3, 100 * MIB);
    s.usage(0, 3, usage(100 * MIB, 100 * MIB));
    s.usage(0, 2, usage(600 * MIB, 599 * MIB));
    let outs = s.tick(SEC);
    // B and C were both seen at 0: the lower id goes first.
    assert_eq!(idle_reclaim(&outs, 2), Some(599 * MIB));
    // B never answers: C is asked once the grace (500 ms) has passed.
    assert_eq!(s.next_deadline(), Some(SEC + 500 * MS));
    assert_eq!(idle_reclaim(&s.tick(SEC + 499 * MS), 3), None);
    assert_eq!(idle_reclaim(&s.tick(SEC + 500 * MS), 3), Some(100 * MIB));
    assert_eq!(s.next_deadline(), None, "nothing left to evict");
}
