//! What clients are told unasked: `waiting` to waiters, `pressure` to pipelined
//! clients, `room` to `room_info` clients.

use super::*;

fn reg_named(s: &mut GpuScheduler, now: Nanos, id: ClientId, ws: u64, pod: &str, wait_info: bool) {
    let info = ClientInfo {
        pod_name: Some(pod.into()),
        wait_info,
        ..ClientInfo::default()
    };
    s.register(now, id, info, usage(ws, 0), None);
}

fn all_waiting(outs: &[Output]) -> usize {
    outs.iter()
        .filter(|o| matches!(o, Output::Send(_, ArbiterMsg::Waiting { .. })))
        .count()
}

#[test]
fn waiters_hear_who_holds_their_place_and_the_quantum_once_per_change() {
    let mut s = sched(1000 * MIB, 30_000, 5_000);
    reg_named(&mut s, 0, 1, 700 * MIB, "nb-a", true);
    reg_named(&mut s, 0, 2, 700 * MIB, "nb-b", true);
    reg_named(&mut s, 0, 3, 700 * MIB, "nb-c", true);
    let outs = s.request(SEC, 1);
    assert_eq!(granted(&outs, 1), Some(true));
    assert!(
        waiting(&outs, 1).is_empty(),
        "a holder is not told it waits"
    );
    // B starts waiting: told at once, with A's quantum end (TQ 30 s from t = 1 s).
    let outs = s.request(2 * SEC, 2);
    assert_eq!(
        waiting(&outs, 2),
        vec![(Some("nb-a".into()), 0, Some(29_000))]
    );
    // C queues behind B; B's view did not change: only C hears.
    let outs = s.request(3 * SEC, 3);
    assert_eq!(
        waiting(&outs, 3),
        vec![(Some("nb-a".into()), 1, Some(28_000))]
    );
    assert_eq!(all_waiting(&outs), 1);
    // Steps that change nothing the waiters see tell nobody anything.
    let outs = s.usage(4 * SEC, 1, usage(700 * MIB, 700 * MIB));
    assert_eq!(all_waiting(&outs), 0);
    let outs = s.request(5 * SEC, 2);
    assert_eq!(all_waiting(&outs), 0);
    // The quantum ends: A is dropped; its quantum end did not move, nobody is told.
    let outs = s.tick(31 * SEC);
    assert!(dropped(&outs, 1).is_some());
    assert_eq!(all_waiting(&outs), 0);
    // A gives the GPU back: B holds, C is next, with B's whole quantum ahead.
    let outs = s.release(32 * SEC, 1, usage(700 * MIB, 0));
    assert_eq!(granted(&outs, 2), Some(true));
    assert!(waiting(&outs, 2).is_empty());
    assert_eq!(
        waiting(&outs, 3),
        vec![(Some("nb-b".into()), 0, Some(30_000))]
    );
    // A asks again: told it is behind C.
    let outs = s.request(33 * SEC, 1);
    assert_eq!(
        waiting(&outs, 1),
        vec![(Some("nb-b".into()), 1, Some(29_000))]
    );
    // A TQ change moves the quantum's end: both waiters hear it once.
    let outs = s.set_tq(34 * SEC, kiwi_config::Quantum::from_millis(60_000).unwrap());
    assert_eq!(
        waiting(&outs, 3),
        vec![(Some("nb-b".into()), 0, Some(58_000))]
    );
    assert_eq!(
        waiting(&outs, 1),
        vec![(Some("nb-b".into()), 1, Some(58_000))]
    );
}

#[test]
fn waiting_goes_only_to_clients_that_asked() {
    let mut s = sched(1000 * MIB, 30_000, 5_000);
    reg_named(&mut s, 0, 1, 700 * MIB, "nb-a", false);
    reg_named(&mut s, 0, 2, 700 * MIB, "nb-b", false);
    s.request(SEC, 1);
    let outs = s.request(2 * SEC, 2);
    assert_eq!(all_waiting(&outs), 0, "an old shim would not decode it");
    // A program name stands in for a missing pod name.
    let info = ClientInfo {
        name: Some("train.py".into()),
        wait_info: true,
        ..ClientInfo::default()
    };
    s.register(3 * SEC, 3, info, usage(700 * MIB, 0), None);
    let outs = s.request(3 * SEC, 3);
    assert_eq!(
        waiting(&outs, 3),
        vec![(Some("nb-a".into()), 1, Some(28_000))]
    );
    s.release(4 * SEC, 1, usage(700 * MIB, 0));
    s.exit(5 * SEC, 2);
    // B left: 3 holds now (granted on B's exit); 1 asks and is told nothing.
    let outs = s.request(6 * SEC, 1);
    assert_eq!(all_waiting(&outs), 0, "1 did not ask");
    assert_eq!(s.holders(), vec![3]);
    // A newcomer that asked hears 3's program name (it has no pod name).
    reg_named(&mut s, 7 * SEC, 4, 700 * MIB, "nb-d", true);
    let outs = s.request(7 * SEC, 4);
    assert_eq!(
        waiting(&outs, 4),
        vec![(Some("train.py".into()), 1, Some(28_000))]
    );
}

#[test]
fn a_thousand_waiters_cost_one_message_each_per_hand_off_and_none_otherwise() {
    let n = 1000u64;
    let mut s = sched(1000 * MIB, 1_000, 5_000);
    for id in 0..=n {
        reg_named(&mut s, 0, id, 700 * MIB, &format!("p{id}"), true);
    }
    let mut total = 0;
    for id in 0..=n {
        total += all_waiting(&s.request(SEC, id));
    }
    // Each newcomer hears once; nobody ahead of it is told again.
    assert_eq!(total, n as usize);
    // A usage change of the holder (or anything else the waiters do not see): nothing.
    assert_eq!(
        all_waiting(&s.usage(SEC + 1, 0, usage(700 * MIB, 700 * MIB))),
        0
    );
    for id in 1..=n {
        assert_eq!(all_waiting(&s.request(SEC + 2, id)), 0);
    }
    // The hand-off: every remaining waiter moves up one place, one message each.
    let outs = s.tick(2 * SEC);
    assert!(dropped(&outs, 0).is_some());
    assert_eq!(all_waiting(&outs), 0, "the quantum's end did not move");
    let outs = s.release(2 * SEC + 1, 0, usage(700 * MIB, 0));
    assert_eq!(granted(&outs, 1), Some(true));
    assert_eq!(all_waiting(&outs), n as usize - 1);
    // One waiter in the middle gives up: only those behind it move.
    let outs = s.release(2 * SEC + 2, 500, usage(700 * MIB, 0));
    assert_eq!(all_waiting(&outs), (n - 500) as usize);
}

fn pressure(outs: &[Output], to: ClientId) -> Vec<bool> {
    sent(outs, to)
        .iter()
        .filter_map(|m| match m {
            ArbiterMsg::Pressure { oversubscribed, .. } => Some(*oversubscribed),
            _ => None,
        })
        .collect()
}

#[test]
fn pipelined_clients_hear_pressure_on_every_change_and_at_registration() {
    let mut s = sched(1000 * MIB, 1_000, 500);
    let outs = s.register(
        0,
        1,
        ClientInfo {
            pipelined: true,
            ..Default::default()
        },
        usage(600 * MIB, 0),
        None,
    );
    assert!(pressure(&outs, 1).is_empty(), "fits: nothing to say");
    // A second client makes the GPU oversubscribed: the pipelined one hears it, the
    // other (which never asked) does not.
    let outs = s.register(MS, 2, ClientInfo::default(), usage(600 * MIB, 0), None);
    assert_eq!(pressure(&outs, 1), vec![true]);
    assert!(pressure(&outs, 2).is_empty());
    // A pipelined client registering now hears it at once, after `registered`.
    let outs = s.register(
        2 * MS,
        3,
        ClientInfo {
            pipelined: true,
            ..Default::default()
        },
        usage(0, 0),
        None,
    );
    let to3 = sent(&outs, 3);
    assert!(matches!(to3[0], ArbiterMsg::Registered { .. }), "{to3:?}");
    assert_eq!(pressure(&outs, 3), vec![true]);
    assert!(pressure(&outs, 1).is_empty(), "no change, no repeat");
    // Shrinking back under the room ends it: within STATE_INTERVAL_NS of the last
    // broadcast it is told when the interval ends.
    let outs = s.usage(3 * MS, 2, usage(100 * MIB, 0));
    assert!(pressure(&outs, 1).is_empty(), "{outs:?}");
    let due = MS + STATE_INTERVAL_NS;
    assert_eq!(s.next_deadline(), Some(due));
    let outs = s.tick(due);
    assert_eq!(pressure(&outs, 1), vec![false]);
    assert_eq!(pressure(&outs, 3), vec![false]);
    // So does the scheduler going off.
    s.usage(due + MS, 2, usage(600 * MIB, 0));
    let outs = s.tick(due + STATE_INTERVAL_NS);
    assert_eq!(pressure(&outs, 1), vec![true]);
    let outs = s.set_scheduler(due + 2 * STATE_INTERVAL_NS, false);
    assert_eq!(pressure(&outs, 1), vec![false]);
}

/// A client flipping its usage across the room thousands of times a second makes
/// the arbiter broadcast `pressure` at most every STATE_INTERVAL_NS, and the last
/// state always follows (issue #27, item 3: 8,000 flips in 0.12 s sent 8,000
/// messages to every pipelined client, and slow readers were disconnected).
#[test]
fn a_usage_storm_sends_pressure_at_most_every_interval_and_the_last_state_follows() {
    let mut s = sched(1000 * MIB, 1_000, 500);
    let pipelined = ClientInfo {
        pipelined: true,
        ..Default::default()
    };
    s.register(0, 1, pipelined, usage(600 * MIB, 0), None);
    // The second client makes the GPU shared: told at once (it fits).
    let mut told = pressure(
        &s.register(0, 2, ClientInfo::default(), usage(100 * MIB, 0), None),
        1,
    );
    assert_eq!(told, vec![false]);
    let mut t = MS;
    for k in 0..8000u64 {
        let ws = if k % 2 == 0 { 600 } else { 100 };
        told.extend(pressure(&s.usage(t, 2, usage(ws * MIB, 0)), 1));
        t += 15_000; // 8,000 flips in 0.12 s
    }
    assert!(told.len() <= 3, "{} broadcasts: {told:?}", told.len());
    // The storm ends on "fits" (the last flip, k odd): told once due, unless that is
    // what was told last.
    if let Some(due) = s.next_deadline() {
        told.extend(pressure(&s.tick(due), 1));
    }
    assert_eq!(told.last(), Some(&false), "{told:?}");
    assert_eq!(s.next_deadline(), None);
}

fn room(outs: &[Output], to: ClientId) -> Vec<u64> {
    sent(outs, to)
        .iter()
        .filter_map(|m| match m {
            ArbiterMsg::Room {
                others_unswappable_bytes,
                ..
            } => Some(*others_unswappable_bytes),
            _ => None,
        })
        .collect()
}

/// `room` goes to a client at most every STATE_INTERVAL_NS, the latest value follows
/// when the interval ends, and a ping gets it at once (issue #27, item 3: a client
/// flipping its memory no swap frees would have sent every other client a message
/// per flip; the shim's `cuMemGetInfo` pings so it still counts every context that
/// finished opening before it asked).
#[test]
fn room_changes_are_coalesced_and_a_ping_gets_the_latest_at_once() {
    let mut s = sched(4096 * MIB, 1_000, 500);
    let info = |room_info| ClientInfo {
        unswappable: Some(300 * MIB),
        room_info,
        ..Default::default()
    };
    let outs = s.register(0, 1, info(true), usage(0, 0), None);
    assert_eq!(room(&outs, 1), vec![0], "told at registration");
    // A second context within the interval: deferred, and due when it ends.
    let outs = s.register(MS, 2, info(false), usage(0, 0), None);
    assert!(room(&outs, 1).is_empty(), "{outs:?}");
    assert_eq!(s.next_deadline(), Some(STATE_INTERVAL_NS));
    // The client asks (ping): at once.
    assert_eq!(room(&s.flush_room(2 * MS, 1), 1), vec![300 * MIB]);
    assert!(s.flush_room(3 * MS, 1).is_empty(), "nothing new");
    // A storm of reports from client 2: 8,001 flips in 0.12 s.
    let mut told = Vec::new();
    let mut t = 3 * MS;
    for k in 0..8001u64 {
        let bytes = if k % 2 == 0 { 400 * MIB } else { 300 * MIB };
        told.extend(room(&s.unswappable(t, 2, bytes), 1));
        t += 15_000;
    }
    assert!(told.is_empty(), "{} messages: {told:?}", told.len());
    let due = s.next_deadline().expect("the last value is due");
    assert_eq!(room(&s.tick(due), 1), vec![400 * MIB]);
    assert_eq!(s.next_deadline(), None);
}
