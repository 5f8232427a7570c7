//! After an arbiter restart: resumed holders and waiters, and claims to hold that
//! the scheduler can refute.

use super::*;

#[test]
fn resumed_holders_rebuild_state() {
    let mut s = sched(1000 * MIB, 30_000, 5_000);
    let holding = Some(Resume {
        holding: true,
        waiting: false,
    });
    let waiting = Some(Resume {
        holding: false,
        waiting: true,
    });
    s.register(
        0,
        1,
        ClientInfo::default(),
        usage(700 * MIB, 700 * MIB),
        holding,
    );
    let outs = s.register(0, 2, ClientInfo::default(), usage(700 * MIB, 0), waiting);
    assert_eq!(granted(&outs, 2), None);
    assert_eq!(s.holders(), vec![1]);
    assert_eq!(s.queue(), vec![2]);
    assert!(s.holds_exclusive(1));
}

#[test]
fn resumed_waiter_does_not_jump_a_resumed_holder() {
    // After a restart the waiter may re-register before the holder: it must not be
    // granted while the holder may still be running.
    let mut s = sched(1000 * MIB, 30_000, 5_000);
    let waiting = Some(Resume {
        holding: false,
        waiting: true,
    });
    let outs = s.register(0, 2, ClientInfo::default(), usage(700 * MIB, 0), waiting);
    assert_eq!(granted(&outs, 2), None);
    assert_eq!(s.next_deadline(), Some(2 * SEC));
    let holding = Some(Resume {
        holding: true,
        waiting: false,
    });
    s.register(
        SEC / 10,
        1,
        ClientInfo::default(),
        usage(700 * MIB, 700 * MIB),
        holding,
    );
    assert_eq!(s.holders(), vec![1]);
    assert_eq!(s.queue(), vec![2]);
    // Had no holder come back, the waiter is granted once the window closes.
    let mut s = sched(1000 * MIB, 30_000, 5_000);
    s.register(0, 2, ClientInfo::default(), usage(700 * MIB, 0), waiting);
    reg(&mut s, 0, 3, 700 * MIB);
    assert!(s.tick(SEC).is_empty());
    assert_eq!(granted(&s.tick(2 * SEC), 2), Some(true));
}

#[test]
fn resumed_holder_first_then_waiter() {
    let mut s = sched(896 * MIB, 30_000, 5_000);
    let holding = Some(Resume {
        holding: true,
        waiting: false,
    });
    let waiting = Some(Resume {
        holding: false,
        waiting: true,
    });
    s.register(
        0,
        2,
        ClientInfo::default(),
        usage(700 * MIB, 700 * MIB),
        holding,
    );
    let outs = s.register(
        SEC / 10,
        3,
        ClientInfo::default(),
        usage(700 * MIB, 0),
        waiting,
    );
    assert_eq!(granted(&outs, 3), None, "{outs:?}");
    assert_eq!(s.holders(), vec![2]);
    assert_eq!(s.queue(), vec![3]);
}

const HOLDING: Option<Resume> = Some(Resume {
    holding: true,
    waiting: false,
});

#[test]
fn claim_to_hold_after_the_window_is_refused_and_queued() {
    // Long after the arbiter started: A holds, B waits; H says it holds.
    let t = 60 * SEC;
    let mut s = sched(1000 * MIB, 30_000, 5_000);
    reg(&mut s, t, 1, 700 * MIB);
    reg(&mut s, t, 2, 700 * MIB);
    s.request(t, 1);
    s.request(t, 2);
    let outs = s.register(t, 3, ClientInfo::default(), usage(700 * MIB, 0), HOLDING);
    assert!(revoked(&outs, 3), "H is told it holds nothing: {outs:?}");
    assert_eq!(granted(&outs, 3), None);
    assert_eq!(s.holders(), vec![1]);
    assert_eq!(s.queue(), vec![2, 3], "H queues behind the honest waiter");
    assert!(dropped(&outs, 1).is_none(), "the holder is not disturbed");
}

#[test]
fn claim_to_hold_after_an_own_grant_is_refused() {
    // Inside the window, but the scheduler already granted the GPU itself.
    let mut s = sched(1000 * MIB, 30_000, 5_000);
    reg(&mut s, 0, 1, 700 * MIB);
    assert!(granted(&s.request(0, 1), 1).is_some());
    let outs = s.register(
        SEC / 10,
        2,
        ClientInfo::default(),
        usage(700 * MIB, 0),
        HOLDING,
    );
    assert!(revoked(&outs, 2), "{outs:?}");
    assert_eq!(s.holders(), vec![1]);
    assert_eq!(s.queue(), vec![2]);
    // The refused claimant is granted in turn, like anyone else.
    let outs = s.release(SEC, 1, usage(700 * MIB, 0));
    assert_eq!(granted(&outs, 2), Some(true));
}

#[test]
fn refused_claim_on_an_idle_gpu_is_granted_at_once() {
    // A real holder that came back too late loses nothing when nobody else wants it.
    let mut s = sched(1000 * MIB, 30_000, 5_000).with_resume_window(SEC);
    let outs = s.register(
        2 * SEC,
        1,
        ClientInfo::default(),
        usage(700 * MIB, 700 * MIB),
        HOLDING,
    );
    assert!(revoked(&outs, 1));
    assert!(granted(&outs, 1).is_some());
    assert_eq!(s.holders(), vec![1]);
}

#[test]
fn a_late_resume_does_not_hold_back_waiters() {
    // The post-restart quiet period exists only inside the window.
    let t = 60 * SEC;
    let mut s = sched(1000 * MIB, 30_000, 5_000);
    reg(&mut s, t, 1, 700 * MIB);
    let waiting = Some(Resume {
        holding: false,
        waiting: true,
    });
    s.register(t, 2, ClientInfo::default(), usage(700 * MIB, 0), waiting);
    assert_eq!(s.holders(), vec![2], "granted at once, no quiet period");
}

#[test]
fn re_registering_as_holder_does_not_starve_a_waiter() {
    // H re-registers with `holding` each time it is revoked; the honest waiter B is
    // granted within TQ + grace of asking, and H never holds next to another holder.
    let (tq, grace) = (1_000, 300);
    let t0 = 60 * SEC;
    let mut s = sched(1000 * MIB, tq, grace);
    reg(&mut s, t0, 1, 700 * MIB);
    s.request(t0, 1);
    reg(&mut s, t0, 2, 700 * MIB);
    s.request(t0, 2);
    let mut h = 3;
    let mut now = t0;
    let mut b_granted = None;
    while now < t0 + 10 * SEC && b_granted.is_none() {
        now += 10 * MS;
        let mut outs = s.tick(now);
        // A obeys drops at once; H re-registers as a holder whenever revoked.
        if dropped(&outs, 1).is_some() {
            outs.extend(s.release(now, 1, usage(700 * MIB, 0)));
        }
        if revoked(&outs, h) || s.holders().is_empty() || now == t0 + 10 * MS {
            s.exit(now, h);
            h += 1;
            outs.extend(s.register(
                now,
                h,
                ClientInfo::default(),
                usage(700 * MIB, 700 * MIB),
                HOLDING,
            ));
        }
        if granted(&outs, 2).is_some() {
            b_granted = Some(now);
        }
        let holders = s.holders();
        assert!(
            !(holders.len() > 1 && holders.contains(&h)),
            "H holds next to another holder: {holders:?}"
        );
    }
    let waited = b_granted.expect("B granted") - t0;
    assert!(
        waited <= ms_to_ns(tq + grace) + 20 * MS,
        "B waited {} ms",
        waited / MS
    );
}
