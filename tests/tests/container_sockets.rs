//! Each container speaks only for itself (issue #27, item 1), over real sockets and
//! processes: a container's own client socket names its clients from the record the
//! hook wrote, refuses registrations for GPUs the container was not given (naming
//! only its own), adds no GPU-table entries of its own making, caps its connections
//! exactly whatever uids connect, goes when the container is deleted, and is served
//! again by a restarted arbiter while the container runs.

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::Duration;

use kiwi_config::containers;
use kiwi_protocol::blocking::Connection;
use kiwi_protocol::{ArbiterMsg, ClientMsg, ControlReply, ControlRequest, ErrorCode};
use kiwi_tests::{attach_container, container_record, register_msg, Arbiter, Client};

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;

fn attach_ok(arb: &Arbiter, rec: &containers::ContainerRecord) -> std::path::PathBuf {
    let (reply, sock) = attach_container(arb.socket_dir(), rec);
    assert!(matches!(reply, ControlReply::Done { .. }), "{reply:?}");
    sock
}

/// Registers on `sock`, returning the arbiter's first answer.
fn try_register(sock: &std::path::Path, gpu: &str) -> ArbiterMsg {
    let mut c: Connection<ClientMsg, ArbiterMsg> = Connection::connect(sock).expect("connect");
    c.stream()
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let mut reg = register_msg(gpu, 4 * GIB, 100 * MIB);
    // A liar: the record, not this, says who the client is.
    reg.pod_name = Some("someone-else".into());
    reg.pod_namespace = Some("kube-system".into());
    reg.container_id = Some("f00".into());
    // A refusal at accept is written and the connection closed before our
    // registration arrives: the send may fail, the answer is still there to read.
    let _ = c.send(&ClientMsg::Register(reg));
    c.recv().expect("an answer")
}

#[test]
fn a_container_registers_only_on_its_own_gpus_and_is_named_by_its_record() {
    let arb = Arbiter::start(&[]);
    let me = std::process::id();
    let a = attach_ok(
        &arb,
        &container_record("ctr-a", me, &["GPU-a"], Some(("team-a", "nb-0"))),
    );
    let b = attach_ok(
        &arb,
        &container_record("ctr-b", me, &["GPU-b"], Some(("team-b", "nb-1"))),
    );
    // A's client is named by A's record, whatever it says of itself.
    let _a1 = Client::register(&a, {
        let mut r = register_msg("GPU-a", 4 * GIB, 100 * MIB);
        r.pod_name = Some("someone-else".into());
        r
    });
    let _b1 = Client::register(&b, register_msg("GPU-b", 4 * GIB, 100 * MIB));
    let st = arb.status();
    let ga = st.gpus.iter().find(|g| g.uuid == "GPU-a").unwrap();
    assert_eq!(ga.clients[0].pod_name.as_deref(), Some("nb-0"));
    assert_eq!(ga.clients[0].pod_namespace.as_deref(), Some("team-a"));
    assert_eq!(ga.clients[0].container_id.as_deref(), Some("ctr-a"));

    // A on B's GPU: refused, told only A's own GPU (not B's pod, not the node's GPUs).
    match try_register(&a, "GPU-b") {
        ArbiterMsg::Error { code, message } => {
            assert_eq!(code, ErrorCode::UnknownGpu);
            assert!(message.contains("it may use GPU-a"), "{message}");
            for secret in ["nb-1", "team-b", "ctr-b"] {
                assert!(!message.contains(secret), "{message}");
            }
        }
        other => panic!("A registered on B's GPU: {other:?}"),
    }
    // Made-up GPUs (the arbiter runs without NVML) make no GPU-table entries.
    for n in 0..70 {
        let m = try_register(&a, &format!("GPU-made-up-{n}"));
        assert!(
            matches!(
                m,
                ArbiterMsg::Error {
                    code: ErrorCode::UnknownGpu,
                    ..
                }
            ),
            "{m:?}"
        );
    }
    let uuids: Vec<String> = arb.status().gpus.into_iter().map(|g| g.uuid).collect();
    assert_eq!(uuids, ["GPU-a", "GPU-b"]);
    // B's tenant was never disturbed: its GPU still has it alone.
    let st = arb.status();
    let gb = st.gpus.iter().find(|g| g.uuid == "GPU-b").unwrap();
    assert_eq!(gb.clients.len(), 1);
    assert_eq!(gb.clients[0].pod_name.as_deref(), Some("nb-1"));
}

#[test]
fn a_containers_connections_are_capped_exactly_whatever_uids_connect() {
    if !kiwi_tests::require_tool("setpriv") {
        return;
    }
    let arb = Arbiter::start(&[
        "--max-conns-per-group",
        "16",
        "--register-timeout-ms",
        "60000",
    ]);
    std::fs::set_permissions(
        arb.socket_dir(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let sock = attach_ok(
        &arb,
        &container_record("ctr-c", std::process::id(), &["GPU-c"], None),
    );
    // 24 uids, 2 connections each: the cap is the socket's, whoever connects.
    let mut held = Vec::new();
    for uid in 2000..2024 {
        let mut child = Command::new("setpriv")
            .args([
                &format!("--reuid={uid}"),
                &format!("--regid={uid}"),
                "--clear-groups",
            ])
            .arg(kiwi_tests::bin("kiwi-hostile-client"))
            .arg("--socket")
            .arg(&sock)
            .args(["--conns", "2"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("kiwi-hostile-client");
        let out = BufReader::new(child.stdout.take().unwrap());
        held.push((child, out));
    }
    let line = |out: &mut BufReader<std::process::ChildStdout>, prefix: &str| -> usize {
        let mut l = String::new();
        out.read_line(&mut l).unwrap();
        l.trim()
            .strip_prefix(prefix)
            .unwrap_or_else(|| panic!("{l:?}"))
            .trim()
            .parse()
            .unwrap()
    };
    for (_, out) in &mut held {
        assert_eq!(line(out, "OPENED"), 2);
    }
    // The arbiter closed exactly what is past 16.
    let mut closed = 0;
    for _ in 0..100 {
        closed = 0;
        for (c, out) in &mut held {
            writeln!(c.stdin.as_mut().unwrap()).unwrap();
            closed += line(out, "CLOSED");
        }
        if closed >= 48 - 16 {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(closed, 48 - 16, "24 uids share the container's 16");
    // The container's cap is full: another connection of its own is refused...
    match try_register(&sock, "GPU-c") {
        ArbiterMsg::Error { code, .. } => assert_eq!(code, ErrorCode::RateLimited),
        other => panic!("past the cap: {other:?}"),
    }
    // ...and no one else is touched: another container and the host register.
    let d = attach_ok(
        &arb,
        &container_record("ctr-d", std::process::id(), &["GPU-c"], None),
    );
    let _d = Client::register(&d, register_msg("GPU-c", 4 * GIB, MIB));
    let _h = Client::register(&arb.client_socket(), register_msg("GPU-c", 4 * GIB, MIB));
    for (mut c, _) in held {
        drop(c.stdin.take());
        let _ = c.kill();
        let _ = c.wait();
    }
}

#[test]
fn a_deleted_containers_socket_goes_and_a_restarted_arbiter_serves_running_ones() {
    let mut arb = Arbiter::start(&[]);
    let dir = arb.socket_dir().to_path_buf();
    // `running`: this test; `stopped`: a process that exits before the restart.
    let mut brief = Command::new("sleep").arg("30").spawn().unwrap();
    let running = attach_ok(
        &arb,
        &container_record("ctr-run", std::process::id(), &["GPU-r"], None),
    );
    let stopped = attach_ok(
        &arb,
        &container_record("ctr-gone", brief.id(), &["GPU-r"], None),
    );
    let _c = Client::register(&stopped, register_msg("GPU-r", 4 * GIB, MIB));
    brief.kill().unwrap();
    brief.wait().unwrap();

    arb.restart_hard();
    // Served again: its clients reconnect to the same path (once the new arbiter
    // listens there; until then the killed one's socket file refuses, and a shim
    // keeps trying).
    kiwi_tests::wait_until(
        "the restarted arbiter serves the running container's socket",
        Duration::from_secs(10),
        || std::os::unix::net::UnixStream::connect(&running).is_ok(),
    );
    let _r = Client::register(&running, register_msg("GPU-r", 4 * GIB, MIB));
    // The stopped container's record, socket and directory are gone.
    assert!(!containers::record_path(&dir, "ctr-gone").exists());
    assert!(!stopped.parent().unwrap().exists());

    // Deleting the container (the hook's poststop) removes everything at once.
    let mut c = arb.control();
    let reply = c
        .call(&ControlRequest::DetachContainer {
            key: "ctr-run".into(),
        })
        .unwrap();
    assert!(matches!(reply, ControlReply::Done { .. }), "{reply:?}");
    assert!(!running.exists());
    assert!(!containers::record_path(&dir, "ctr-run").exists());
    assert!(!running.parent().unwrap().exists());
    assert!(Connection::<ClientMsg, ArbiterMsg>::connect(&running).is_err());

    // Hostile keys are refused, never followed out of the directory.
    for key in ["../control", "", "a/b"] {
        let reply = c
            .call(&ControlRequest::AttachContainer { key: key.into() })
            .unwrap();
        assert!(
            matches!(
                reply,
                ControlReply::Error {
                    code: ErrorCode::InvalidArgument,
                    ..
                }
            ),
            "{key:?}: {reply:?}"
        );
    }
    // An unknown key: a clear error, the daemon unharmed.
    let reply = c
        .call(&ControlRequest::AttachContainer { key: "nope".into() })
        .unwrap();
    match reply {
        ControlReply::Error { message, .. } => assert!(message.contains("nope.json"), "{message}"),
        other => panic!("{other:?}"),
    }
    assert!(arb.status().gpus.iter().any(|g| g.uuid == "GPU-r"));
}

/// A container id used again (a delete the arbiter missed, then a new container of
/// the same id): attaching its new record serves it at once, labelled anew.
#[test]
fn a_container_attached_again_with_a_new_record_is_served_anew() {
    let arb = Arbiter::start(&[]);
    let me = std::process::id();
    let first = attach_ok(
        &arb,
        &container_record("ctr-again", me, &["GPU-x"], Some(("team-a", "old"))),
    );
    let again = attach_ok(
        &arb,
        &container_record("ctr-again", me, &["GPU-y"], Some(("team-b", "new"))),
    );
    assert_eq!(first, again);
    let _c = Client::register(&again, register_msg("GPU-y", 4 * GIB, MIB));
    let st = arb.status();
    let g = st.gpus.iter().find(|g| g.uuid == "GPU-y").unwrap();
    assert_eq!(g.clients[0].pod_name.as_deref(), Some("new"));
    assert_eq!(g.clients[0].pod_namespace.as_deref(), Some("team-b"));
    // The old record's GPU is no longer this container's.
    match try_register(&again, "GPU-x") {
        ArbiterMsg::Error { code, .. } => assert_eq!(code, ErrorCode::UnknownGpu),
        other => panic!("{other:?}"),
    }
}
