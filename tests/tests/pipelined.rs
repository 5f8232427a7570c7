//! Pipelined hand-offs (issue #15) against a real `kiwi-arbiter` over its real
//! socket: a dropped holder that says `drained` lets the next `pipelined` client in
//! before its own release; a client that did not opt in waits for the release as
//! before; a `drained` out of turn is an error reply and never a second grant.

use std::process::Command;
use std::time::Duration;

use kiwi_protocol::{ArbiterMsg, ClientMsg, ErrorCode, EventKind, Usage};
use kiwi_tests::{bin, monotonic_ns, register_msg, Arbiter, Client};

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;
const GPU: &str = "GPU-pipelined-0";
const WAIT: Duration = Duration::from_secs(5);

/// 700 MiB on a 1 GiB GPU: two do not fit, so grants are exclusive.
fn client(arb: &Arbiter, name: &str, pipelined: bool) -> Client {
    let mut reg = register_msg(GPU, GIB, 700 * MIB);
    reg.name = Some(name.into());
    reg.pipelined = pipelined;
    Client::register(&arb.client_socket(), reg)
}

fn usage(resident_mib: u64) -> Usage {
    Usage {
        working_set_bytes: 700 * MIB,
        resident_bytes: resident_mib * MIB,
    }
}

/// The next grant to `c`, as (exclusive, pipelined), or `None` within `within`.
fn grant(c: &mut Client, within: Duration) -> Option<(bool, bool)> {
    match c.wait_for(within, |m| matches!(m, ArbiterMsg::Grant { .. }))? {
        ArbiterMsg::Grant {
            exclusive,
            pipelined,
            ..
        } => Some((exclusive, pipelined)),
        _ => unreachable!(),
    }
}

/// A holds (all resident), B asks, A's 0.2 s quantum ends: A is told to drop.
fn a_dropped_for_b(arb: &Arbiter, b_pipelined: bool) -> (Client, Client) {
    let mut a = client(arb, "A", true);
    let mut b = client(arb, "B", b_pipelined);
    a.conn.send(&ClientMsg::Request).unwrap();
    assert_eq!(grant(&mut a, WAIT), Some((true, false)));
    a.conn.send(&ClientMsg::Usage(usage(700))).unwrap();
    b.conn.send(&ClientMsg::Request).unwrap();
    a.wait_for(WAIT, |m| matches!(m, ArbiterMsg::Drop { .. }))
        .expect("A's quantum ends with a drop");
    (a, b)
}

#[test]
fn drained_grants_the_next_client_before_the_old_holders_release() {
    let arb = Arbiter::start(&["--tq", "0.2", "--grace-ms", "3000"]);
    let (mut a, mut b) = a_dropped_for_b(&arb, true);
    a.conn.send(&ClientMsg::Drained).unwrap();
    let drained_at = monotonic_ns();
    assert_eq!(
        grant(&mut b, WAIT),
        Some((true, true)),
        "B is granted, pipelined, while A swaps out"
    );
    let granted_at = monotonic_ns();
    // A's swap-out takes a while; its release comes after B's grant and is taken.
    std::thread::sleep(Duration::from_millis(150));
    let released_at = monotonic_ns();
    a.conn.send(&ClientMsg::Release(usage(300))).unwrap();
    assert!(granted_at < released_at);
    assert!(
        granted_at - drained_at < 1_000_000_000,
        "B waited {} ms after A drained",
        (granted_at - drained_at) / 1_000_000
    );

    // A second `drained` (there is no drop outstanding now) is an error reply; the
    // connection stays usable and nobody else is granted.
    a.conn.send(&ClientMsg::Drained).unwrap();
    match a.wait_for(WAIT, |m| matches!(m, ArbiterMsg::Error { .. })) {
        Some(ArbiterMsg::Error { code, message }) => {
            assert_eq!(code, ErrorCode::InvalidArgument);
            assert!(message.contains("does not hold the GPU"), "{message}");
        }
        other => panic!("expected an error reply, got {other:?}"),
    }
    a.conn.send(&ClientMsg::Ping { token: 7 }).unwrap();
    assert!(a
        .wait_for(WAIT, |m| matches!(m, ArbiterMsg::Pong { token: 7 }))
        .is_some());
    assert!(grant(&mut a, Duration::from_millis(100)).is_none());

    // The log orders B's grant before A's release, by seq and by time.
    let st = arb.status();
    assert_eq!(st.gpus[0].holders, vec![b.id]);
    let ca = st.gpus[0].clients.iter().find(|c| c.id == a.id).unwrap();
    assert_eq!(ca.resident_bytes, 300 * MIB, "A's release usage was taken");
    let events = arb.events();
    let grant_b = events
        .iter()
        .find(|e| e.client == Some(b.id) && matches!(e.kind, EventKind::Grant { .. }))
        .expect("B's grant is logged");
    let release_a = events
        .iter()
        .find(|e| {
            e.client == Some(a.id)
                && matches!(e.kind, EventKind::Release { early: false, resident_bytes } if resident_bytes == 300 * MIB)
        })
        .expect("A's release is logged");
    assert!(grant_b.seq < release_a.seq && grant_b.t_ns < release_a.t_ns);
    assert!(
        !events.iter().any(|e| matches!(e.kind, EventKind::Revoke)),
        "A released within its grace"
    );

    // `kiwictl timeline` draws the overlap.
    let o = Command::new(bin("kiwictl"))
        .env_remove("KIWI_CONFIG")
        .env("KIWI_SOCKET_DIR", arb.socket_dir())
        .env("NO_COLOR", "1")
        .args(["timeline", "--width", "80"])
        .output()
        .expect("run kiwictl");
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "{out}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(out.contains('A') && out.contains('B'), "{out}");
}

#[test]
fn a_client_that_did_not_opt_in_is_granted_at_the_release() {
    let arb = Arbiter::start(&["--tq", "0.2", "--grace-ms", "3000"]);
    let (mut a, mut b) = a_dropped_for_b(&arb, false);
    a.conn.send(&ClientMsg::Drained).unwrap();
    assert!(
        grant(&mut b, Duration::from_millis(300)).is_none(),
        "B did not register `pipelined`: it waits for A's release"
    );
    a.conn.send(&ClientMsg::Release(usage(300))).unwrap();
    assert_eq!(grant(&mut b, WAIT), Some((true, false)));

    // And `drained` from a client that never opted in is refused the same way.
    b.conn.send(&ClientMsg::Drained).unwrap();
    match b.wait_for(WAIT, |m| matches!(m, ArbiterMsg::Error { .. })) {
        Some(ArbiterMsg::Error { code, message }) => {
            assert_eq!(code, ErrorCode::InvalidArgument);
            assert!(message.contains("pipelined"), "{message}");
        }
        other => panic!("expected an error reply, got {other:?}"),
    }
    assert_eq!(arb.status().gpus[0].holders, vec![b.id]);
}
