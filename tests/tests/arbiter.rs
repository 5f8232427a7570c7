//! The arbiter with real processes and real sockets: faults and hostile clients.

use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::process::Command;
use std::time::{Duration, Instant};

use kiwi_protocol::{
    ArbiterMsg, ClientMsg, ClientState, ControlRequest, ErrorCode, EventKind, MAGIC,
    PROTOCOL_VERSION,
};
use kiwi_tests::{bin, monotonic_ns, register_msg, wait_until, Arbiter, Client, FakeClient};

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;

#[test]
fn sigkilled_holder_hands_over_within_100ms() {
    let arb = Arbiter::start(&["--tq", "30"]);
    let mut a = FakeClient::spawn(&arb, &["--ws", &(700 * MIB).to_string(), "--request"]);
    a.expect("GRANTED");
    let mut b = FakeClient::spawn(&arb, &["--ws", &(700 * MIB).to_string(), "--request"]);
    b.expect("REGISTERED");
    wait_until("B queued", Duration::from_secs(5), || {
        arb.status().gpus[0].queue.len() == 1
    });
    let killed_at = monotonic_ns();
    a.child.kill().unwrap();
    let granted = FakeClient::time_of(&b.expect("GRANTED"));
    let ms = (granted - killed_at) as f64 / 1e6;
    assert!(ms < 100.0, "next waiter granted {ms:.1} ms after SIGKILL");
    let ev = arb.events();
    assert!(ev.iter().any(|e| matches!(e.kind, EventKind::Exit)));
}

#[test]
fn stubborn_holder_loses_the_gpu_after_grace() {
    let arb = Arbiter::start(&["--tq", "0.2", "--grace-ms", "300"]);
    let mut a = FakeClient::spawn(
        &arb,
        &["--ws", &(700 * MIB).to_string(), "--request", "--stubborn"],
    );
    a.expect("GRANTED");
    let mut b = FakeClient::spawn(&arb, &["--ws", &(700 * MIB).to_string(), "--request"]);
    a.expect("DROP");
    a.expect("REVOKED");
    b.expect("GRANTED");
    // Every instant from the arbiter's own log, one clock at the source: the fake
    // clients read their messages late on a loaded machine (a late read of the drop
    // made the grace look 255 ms long).
    let ev = arb.events();
    let at = |what: &str, f: &dyn Fn(&EventKind) -> bool| -> u64 {
        ev.iter()
            .find(|e| f(&e.kind))
            .unwrap_or_else(|| panic!("no {what} in the log: {ev:#?}"))
            .t_ns
    };
    let a_granted = at("grant", &|k| matches!(k, EventKind::Grant { .. }));
    let dropped = at("drop", &|k| matches!(k, EventKind::Drop { .. }));
    let revoked = at("revocation", &|k| matches!(k, EventKind::Revoke));
    let b_granted = ev
        .iter()
        .filter(|e| matches!(e.kind, EventKind::Grant { .. }))
        .nth(1)
        .expect("B's grant in the log")
        .t_ns;
    let grace_ms = (revoked - dropped) as f64 / 1e6;
    assert!(
        (295.0..600.0).contains(&grace_ms),
        "revoked {grace_ms:.0} ms after the drop"
    );
    assert!(b_granted >= revoked && b_granted - a_granted < 2_000_000_000);
}

#[test]
fn hostile_clients_do_not_hurt_others() {
    let arb = Arbiter::start(&[]);
    let mut good = Client::register(&arb.client_socket(), register_msg("GPU-x", GIB, 100 * MIB));

    // Garbage: an error, then the connection is closed.
    let mut s = UnixStream::connect(arb.client_socket()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.write_all(b"GET / HTTP/1.1\r\nHost: kiwi\r\n\r\n")
        .unwrap();
    let mut buf = Vec::new();
    let _ = s.read_to_end(&mut buf);
    assert!(
        String::from_utf8_lossy(&buf).contains("malformed"),
        "{buf:?}"
    );

    // Oversize frame: refused from the header alone.
    let mut s = UnixStream::connect(arb.client_socket()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut h = MAGIC.to_vec();
    h.extend_from_slice(&PROTOCOL_VERSION.to_be_bytes());
    h.extend_from_slice(&(64u32 << 20).to_be_bytes());
    s.write_all(&h).unwrap();
    let mut buf = Vec::new();
    let _ = s.read_to_end(&mut buf);
    assert!(
        String::from_utf8_lossy(&buf).contains("oversize"),
        "{:?}",
        String::from_utf8_lossy(&buf)
    );

    // Wrong protocol version in the registration.
    let mut c =
        kiwi_protocol::blocking::Connection::<ClientMsg, ArbiterMsg>::connect(&arb.client_socket())
            .unwrap();
    let mut reg = register_msg("GPU-x", GIB, 0);
    reg.version = 99;
    match c.call(&ClientMsg::Register(reg)).unwrap() {
        ArbiterMsg::Error { code, .. } => assert_eq!(code, ErrorCode::Version),
        other => panic!("{other:?}"),
    }
    assert!(
        c.recv().is_err(),
        "connection must be closed after a version mismatch"
    );

    // Flood: disconnected with a rate-limit error.
    let mut flood = Client::register(&arb.client_socket(), register_msg("GPU-x", GIB, MIB));
    let frame = kiwi_protocol::encode(&ClientMsg::Ping { token: 1 }).unwrap();
    let mut burst = Vec::new();
    for _ in 0..50_000 {
        burst.extend_from_slice(&frame);
    }
    let _ = flood.conn.stream().write_all(&burst);
    // It is cut off: an explicit rate-limit error, or the connection closes (the error
    // may not fit behind the replies it never read).
    let deadline = Instant::now() + Duration::from_secs(10);
    let cut_off = loop {
        match flood.conn.recv_timeout(Duration::from_millis(200)) {
            Ok(Some(ArbiterMsg::Error {
                code: ErrorCode::RateLimited,
                ..
            })) => break true,
            Ok(_) if Instant::now() < deadline => continue,
            Ok(_) => break false,
            Err(_) => break true,
        }
    };
    assert!(cut_off, "a flooding client is cut off");

    // Control requests on the client socket are refused.
    let mut c = kiwi_protocol::blocking::Connection::<ControlRequest, ArbiterMsg>::connect(
        &arb.client_socket(),
    )
    .unwrap();
    match c
        .call(&ControlRequest::SetScheduler {
            on: false,
            gpu: None,
        })
        .unwrap()
    {
        ArbiterMsg::Error { code, .. } => assert_eq!(code, ErrorCode::WrongSocket),
        other => panic!("{other:?}"),
    }

    // The well-behaved client and the arbiter carry on.
    good.conn.send(&ClientMsg::Ping { token: 7 }).unwrap();
    assert!(good
        .wait_for(Duration::from_secs(5), |m| matches!(
            m,
            ArbiterMsg::Pong { token: 7 }
        ))
        .is_some());
    good.conn.send(&ClientMsg::Request).unwrap();
    assert!(good
        .wait_for(Duration::from_secs(5), |m| matches!(
            m,
            ArbiterMsg::Grant { .. }
        ))
        .is_some());
    let st = arb.status();
    assert!(
        st.gpus[0].settings.scheduler_on,
        "the client socket could not turn the scheduler off"
    );
}

#[test]
fn identity_comes_from_the_socket_and_control_is_root_only() {
    let arb = Arbiter::start(&[]);
    let mode = std::fs::metadata(arb.control_socket())
        .unwrap()
        .permissions()
        .mode()
        & 0o777;
    assert_eq!(mode, 0o600, "control socket mode");
    let mode = std::fs::metadata(arb.client_socket())
        .unwrap()
        .permissions()
        .mode()
        & 0o777;
    assert_eq!(mode, 0o666, "client socket mode");

    // A client that claims someone else's pid is still known by its real one.
    let mut reg = register_msg("GPU-x", GIB, 700 * MIB);
    reg.pid = 1;
    let mut a = Client::register(&arb.client_socket(), reg);
    a.conn.send(&ClientMsg::Request).unwrap();
    a.wait_for(Duration::from_secs(5), |m| {
        matches!(m, ArbiterMsg::Grant { .. })
    })
    .unwrap();
    let mut b = Client::register(&arb.client_socket(), register_msg("GPU-x", GIB, 700 * MIB));
    b.conn.send(&ClientMsg::Request).unwrap();
    // B "releases": it cannot release A's hold, only cancel its own request.
    b.conn
        .send(&ClientMsg::Release(kiwi_protocol::Usage::default()))
        .unwrap();
    wait_until("B's request cancelled", Duration::from_secs(5), || {
        arb.status().gpus[0].queue.is_empty()
    });
    let st = arb.status();
    let g = &st.gpus[0];
    assert_eq!(g.holders, vec![a.id], "A still holds");
    let ca = g.clients.iter().find(|c| c.id == a.id).unwrap();
    assert_eq!(ca.pid, 1);
    assert_eq!(ca.host_pid, std::process::id(), "host pid from SO_PEERCRED");
    assert_eq!(ca.state, ClientState::Holding);
}

#[test]
fn clients_survive_an_arbiter_restart() {
    let mut arb = Arbiter::start(&["--tq", "30"]);
    let mut a = FakeClient::spawn(
        &arb,
        &["--ws", &(700 * MIB).to_string(), "--request", "--reconnect"],
    );
    a.expect("GRANTED");
    let mut b = FakeClient::spawn(
        &arb,
        &["--ws", &(700 * MIB).to_string(), "--request", "--reconnect"],
    );
    b.expect("REGISTERED");
    wait_until("B queued", Duration::from_secs(5), || {
        arb.status().gpus[0].queue.len() == 1
    });
    arb.restart_hard();
    a.expect("RESUMED");
    b.expect("RESUMED");
    wait_until("state rebuilt", Duration::from_secs(5), || {
        let st = arb.status();
        st.gpus.len() == 1 && st.gpus[0].holders.len() == 1 && st.gpus[0].queue.len() == 1
    });
    let st = arb.status();
    let g = &st.gpus[0];
    let holder = g.clients.iter().find(|c| c.id == g.holders[0]).unwrap();
    assert_eq!(holder.host_pid, a.child.id(), "A is the holder again");
    assert_eq!(holder.state, ClientState::Holding);
    // And the rebuilt scheduler works: A leaves, B is granted.
    a.child.kill().unwrap();
    b.expect("GRANTED");
}

#[test]
fn sigterm_removes_the_sockets() {
    let mut arb = Arbiter::start(&[]);
    let status = arb.terminate();
    assert!(status.success(), "{status:?}");
    assert!(!arb.client_socket().exists());
    assert!(!arb.control_socket().exists());
}

#[test]
fn a_second_arbiter_refuses_a_live_socket_dir() {
    let arb = Arbiter::start(&[]);
    let out = Command::new(bin("kiwi-arbiter"))
        .arg("--socket-dir")
        .arg(arb.socket_dir())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("already serving"), "{err}");
    assert!(
        arb.client_socket().exists(),
        "the live arbiter keeps its socket"
    );
}

/// Registers on the client socket and returns the client with what `registered` said:
/// (capacity, swap budget).
fn register_full(arb: &Arbiter, gpu: &str, total: u64) -> (Client, u64, Option<u64>) {
    let mut conn =
        kiwi_protocol::blocking::Connection::<ClientMsg, ArbiterMsg>::connect(&arb.client_socket())
            .unwrap();
    conn.stream()
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    match conn
        .call(&ClientMsg::Register(register_msg(gpu, total, 0)))
        .unwrap()
    {
        ArbiterMsg::Registered {
            client_id,
            capacity_bytes,
            swap_budget_bytes,
            ..
        } => (
            Client {
                conn,
                id: client_id,
            },
            capacity_bytes,
            swap_budget_bytes,
        ),
        other => panic!("{other:?}"),
    }
}

/// Sends `admit` and returns `(ok, swap_needed_bytes, swap_budget_bytes)`.
fn admit(c: &mut Client, working_set_bytes: u64) -> (bool, u64, u64) {
    c.conn
        .send(&ClientMsg::Admit { working_set_bytes })
        .unwrap();
    match c.wait_for(Duration::from_secs(10), |m| {
        matches!(m, ArbiterMsg::Admitted { .. } | ArbiterMsg::Error { .. })
    }) {
        Some(ArbiterMsg::Admitted {
            ok,
            swap_needed_bytes,
            swap_budget_bytes,
            ..
        }) => (ok, swap_needed_bytes, swap_budget_bytes),
        other => panic!("no admitted: {other:?}"),
    }
}

/// `kiwictl status --json`, without the one field that moves by itself.
fn status_json(arb: &Arbiter) -> serde_json::Value {
    let o = Command::new(bin("kiwictl"))
        .env_remove("KIWI_CONFIG")
        .env("KIWI_SOCKET_DIR", arb.socket_dir())
        .args(["status", "--json"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let mut v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("JSON");
    // What changes by itself: the clock, and the swap pool, which populates ahead in
    // the background as admitted working sets grow.
    v.as_object_mut().unwrap().remove("now_ns");
    v.as_object_mut().unwrap().remove("swap_pool");
    v
}

#[test]
fn swap_budget_admits_within_and_refuses_past_it() {
    let arb = Arbiter::start(&["--swap-budget", "100MiB"]);
    let budget = 100 * MIB;
    let (mut a, capacity, told) = register_full(&arb, "GPU-swap", GIB);
    let (mut b, _, _) = register_full(&arb, "GPU-swap", GIB);
    // The default reserve on a 1 GiB GPU is min(1536 MiB, 1 GiB / 8) = 128 MiB.
    assert_eq!(capacity, GIB - 128 * MIB);
    assert_eq!(told, Some(budget), "registered tells the budget");

    // A grows to 800 MiB: fits in the GPU, no swap needed.
    assert_eq!(admit(&mut a, 800 * MIB), (true, 0, budget));
    // B grows to 150 MiB: 950 MiB on an 896 MiB GPU, 54 MiB of swap, within budget.
    let fits_in_budget = 800 * MIB + 150 * MIB - capacity;
    assert!(fits_in_budget <= budget);
    assert_eq!(admit(&mut b, 150 * MIB), (true, fits_in_budget, budget));
    let before = status_json(&arb);
    assert_eq!(before["swap_budget_bytes"], budget);
    assert_eq!(before["swap_need_bytes"], fits_in_budget);
    // Nothing is resident: every admitted byte counts as swapped out.
    assert_eq!(before["swap_in_use_bytes"], 950 * MIB);
    let ws: Vec<u64> = before["gpus"][0]["clients"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["working_set_bytes"].as_u64().unwrap())
        .collect();
    assert_eq!(
        ws,
        vec![800 * MIB, 150 * MIB],
        "admitted working sets count at once"
    );

    // B to 250 MiB: 154 MiB of swap, past the budget. Refused, and nothing changes.
    let past = 800 * MIB + 250 * MIB - capacity;
    assert!(past > budget);
    assert_eq!(admit(&mut b, 250 * MIB), (false, past, budget));
    assert_eq!(status_json(&arb), before, "a refused admit changes nothing");

    // A shrink is always admitted, and frees room for B.
    assert_eq!(admit(&mut a, 700 * MIB), (true, 0, budget));
    assert_eq!(admit(&mut b, 250 * MIB), (true, 54 * MIB, budget));

    // A usage report past what was admitted is taken as reported...
    b.conn
        .send(&ClientMsg::Usage(kiwi_protocol::Usage {
            working_set_bytes: 300 * MIB,
            resident_bytes: 0,
        }))
        .unwrap();
    wait_until("B's usage counted", Duration::from_secs(5), || {
        arb.status().swap_need_bytes == 104 * MIB
    });
    let t = Command::new(bin("kiwictl"))
        .env_remove("KIWI_CONFIG")
        .env("KIWI_SOCKET_DIR", arb.socket_dir())
        .arg("status")
        .output()
        .unwrap();
    let t = String::from_utf8_lossy(&t.stdout).to_string();
    assert!(
        t.contains("Node swap: budget 100 MiB  need 104 MiB  in use 1000 MiB  (over budget"),
        "{t}"
    );
    // ...and over budget, growth is refused while staying put or shrinking is not.
    assert!(!admit(&mut b, 300 * MIB + 1).0);
    assert!(admit(&mut b, 300 * MIB).0);
    assert_eq!(admit(&mut b, 200 * MIB), (true, 4 * MIB, budget));

    // Both clients still work.
    a.conn.send(&ClientMsg::Ping { token: 1 }).unwrap();
    assert!(a
        .wait_for(Duration::from_secs(5), |m| matches!(
            m,
            ArbiterMsg::Pong { token: 1 }
        ))
        .is_some());
}

#[test]
fn racing_admits_cannot_both_take_the_last_of_the_budget() {
    let arb = Arbiter::start(&["--swap-budget", "100MiB"]);
    let (mut a, capacity, _) = register_full(&arb, "GPU-race", GIB);
    let (mut b, _, _) = register_full(&arb, "GPU-race", GIB);
    let half = capacity / 2;
    assert!(admit(&mut a, half).0);
    assert!(admit(&mut b, half).0);
    // Each alone would spill 80 MiB (within budget); both, 160 MiB (past it).
    for _ in 0..20 {
        let ta = std::thread::spawn(move || {
            let r = admit(&mut a, half + 80 * MIB);
            (a, r)
        });
        let tb = std::thread::spawn(move || {
            let r = admit(&mut b, half + 80 * MIB);
            (b, r)
        });
        let (a2, ra) = ta.join().unwrap();
        let (b2, rb) = tb.join().unwrap();
        (a, b) = (a2, b2);
        assert!(ra.0 ^ rb.0, "exactly one is admitted: {ra:?} {rb:?}");
        assert_eq!(arb.status().swap_need_bytes, 80 * MIB);
        // Back to the start for the next round.
        assert!(admit(&mut a, half).0);
        assert!(admit(&mut b, half).0);
    }
}

#[test]
fn without_a_budget_or_a_pool_admit_is_always_ok() {
    let arb = Arbiter::start(&["--swap-pool", "off"]);
    let (mut a, capacity, told) = register_full(&arb, "GPU-free", GIB);
    assert_eq!(told, None, "no budget, no field");
    assert_eq!(
        admit(&mut a, capacity + 10 * GIB),
        (true, 10 * GIB, u64::MAX)
    );
    let st = arb.status();
    assert_eq!(st.swap_budget_bytes, None);
    assert_eq!(st.swap_need_bytes, 10 * GIB);
}

#[test]
fn swap_budget_from_config_and_flag() {
    let cfg = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(cfg.path(), "[arbiter]\nswap_budget_mib = 64\n").unwrap();
    let path = cfg.path().to_str().unwrap();
    for (args, want) in [
        (vec!["--config", path], Some(64 * MIB)),
        (vec!["--config", path, "--swap-budget", "1GiB"], Some(GIB)),
        (
            vec!["--config", path, "--swap-budget", "0", "--swap-pool", "off"],
            None,
        ),
        (vec!["--swap-budget", "512MiB"], Some(512 * MIB)),
        // The swap pool (with no disk tier) is the budget, and bounds one the
        // operator sets (the smaller of both).
        (
            vec!["--swap-budget", "0", "--swap-pool", "256MiB"],
            Some(256 * MIB),
        ),
        (vec!["--swap-pool", "256MiB"], Some(256 * MIB)),
        (
            vec!["--swap-budget", "1GiB", "--swap-pool", "256MiB"],
            Some(256 * MIB),
        ),
        (
            vec!["--swap-budget", "128MiB", "--swap-pool", "256MiB"],
            Some(128 * MIB),
        ),
    ] {
        let arb = Arbiter::start(&args);
        let (_, _, told) = register_full(&arb, "GPU-cfg", GIB);
        assert_eq!(told, want, "{args:?}");
        assert_eq!(arb.status().swap_budget_bytes, want, "{args:?}");
    }
}

#[test]
fn bad_swap_budget_values_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    for bad in ["abc", "-1", "12parsecs", ""] {
        let out = Command::new(bin("kiwi-arbiter"))
            .env_remove("KIWI_CONFIG")
            .arg("--socket-dir")
            .arg(dir.path())
            .args(["--swap-budget", bad])
            .output()
            .unwrap();
        assert!(!out.status.success(), "--swap-budget {bad:?} accepted");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(err.contains("--swap-budget"), "{err}");
        assert!(
            !kiwi_config::client_socket(dir.path()).exists(),
            "nothing was served"
        );
    }
}

/// The operator's bound on a tenant's hint wait (`--max-hint-wait-ms`, config
/// `max_hint_wait_ms`, default 100 ms; issue #42, item 4) is said right after
/// `registered`, and only to a client that asked (`bounds`): a registration without
/// it gets no `bounds` (older shims refuse unknown message types).
#[test]
fn the_hint_wait_bound_goes_right_after_registered_and_only_to_clients_that_ask() {
    let cfg = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(cfg.path(), "[arbiter]\nmax_hint_wait_ms = 250\n").unwrap();
    let path = cfg.path().to_str().unwrap();
    for (args, want) in [
        (vec![], 100),
        (vec!["--config", path], 250),
        (vec!["--config", path, "--max-hint-wait-ms", "40"], 40),
        (vec!["--max-hint-wait-ms", "0"], 0),
    ] {
        let arb = Arbiter::start(&args);
        for asks in [true, false] {
            let mut conn = kiwi_protocol::blocking::Connection::<ClientMsg, ArbiterMsg>::connect(
                &arb.client_socket(),
            )
            .unwrap();
            conn.stream()
                .set_read_timeout(Some(Duration::from_secs(10)))
                .unwrap();
            let mut reg = register_msg("GPU-bounds", GIB, 0);
            reg.bounds = asks;
            conn.send(&ClientMsg::Register(reg)).unwrap();
            conn.send(&ClientMsg::Ping { token: 9 }).unwrap();
            let mut got = Vec::new();
            loop {
                let m = conn.recv().unwrap();
                if m == (ArbiterMsg::Pong { token: 9 }) {
                    break;
                }
                got.push(m);
            }
            assert!(
                matches!(got[0], ArbiterMsg::Registered { .. }),
                "{args:?}: {got:?}"
            );
            let bounds: Vec<_> = got
                .iter()
                .filter(|m| matches!(m, ArbiterMsg::Bounds { .. }))
                .collect();
            if asks {
                assert_eq!(
                    got[1],
                    ArbiterMsg::Bounds { hint_wait_ms: want },
                    "{args:?}: {got:?}"
                );
                assert_eq!(bounds.len(), 1, "{args:?}: {got:?}");
            } else {
                assert!(bounds.is_empty(), "{args:?}: {got:?}");
            }
        }
    }
}
