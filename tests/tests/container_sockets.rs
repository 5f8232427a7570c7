//! Each container speaks only for itself (issue #27, item 1), over real sockets and
//! processes: a container's own client socket names its clients from the record the
//! hook wrote, refuses registrations for GPUs the container was not given (naming
//! only its own), adds no GPU-table entries of its own making, caps its connections
//! exactly whatever uids connect, goes when the container is deleted, and is served
//! again by a restarted arbiter while the container runs. And (issue #42, item 5) it
//! is the container's alone: host users reach neither it nor its record, and root's
//! connections from the host count against root's one share over every socket.
//! Containers are [`FakeContainer`]s: mount and pid namespaces of their own, the
//! socket's directory bound inside as `kiwi-hook` binds it.

use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kiwi_config::containers;
use kiwi_protocol::blocking::Connection;
use kiwi_protocol::{ArbiterMsg, ClientMsg, ControlReply, ControlRequest, ErrorCode};
use kiwi_tests::{
    attach_container, container_record, register_msg, Arbiter, Client, FakeContainer, Hog,
};

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
    if !namespace_tools() {
        return;
    }
    let arb = Arbiter::start(&[
        "--max-conns-per-group",
        "16",
        "--register-timeout-ms",
        "60000",
    ]);
    let ctr = FakeContainer::start(arb.socket_dir(), "ctr-c", &["GPU-c"], None);
    assert!(matches!(ctr.attach_reply, ControlReply::Done { .. }));
    // 24 uids inside the container, 2 connections each: the cap is the socket's,
    // whoever connects.
    let mut held: Vec<Hog> = (2000..2024)
        .map(|uid| {
            let mut cmd = ctr.command("setpriv");
            cmd.args([
                &format!("--reuid={uid}"),
                &format!("--regid={uid}"),
                "--clear-groups",
            ])
            .arg(kiwi_tests::bin("kiwi-hostile-client"));
            Hog::spawn_with(cmd, &ctr.socket(), 2, None)
        })
        .collect();
    for h in &mut held {
        assert_eq!(h.opened(), 2);
    }
    // The arbiter closed exactly what is past 16.
    assert_eq!(
        closed_within(&mut held, 48 - 16),
        48 - 16,
        "24 uids share the container's 16"
    );
    // The container's cap is full: another connection of its own is refused...
    let mut one = Hog::spawn_with(
        ctr.command(kiwi_tests::bin("kiwi-hostile-client")),
        &ctr.socket(),
        1,
        None,
    );
    assert_eq!(one.opened(), 1);
    assert_eq!(
        one.wait_closed(1, Duration::from_secs(3)),
        1,
        "past the cap"
    );
    // ...and no one else is touched: another container and the host register.
    let d = attach_ok(
        &arb,
        &container_record("ctr-d", std::process::id(), &["GPU-c"], None),
    );
    let _d = Client::register(&d, register_msg("GPU-c", 4 * GIB, MIB));
    let _h = Client::register(&arb.client_socket(), register_msg("GPU-c", 4 * GIB, MIB));
}

/// Issue #42, item 5: uid 65534 on the host registered on another pod's socket,
/// labelled as that pod, and held all its connections (the socket was 0666 in 0755
/// directories; the record 0644). Now `<socket-dir>/containers/` is root's alone: a
/// host user reaches neither the socket nor the record, and one that finds the
/// socket another way (`/proc/<pid>/root` of a container process of its own uid) is
/// refused by the arbiter. Inside the container any uid connects, as before.
#[test]
fn a_host_user_reaches_neither_a_containers_socket_nor_its_record() {
    if !namespace_tools() {
        return;
    }
    let arb = Arbiter::start(&[]);
    let dir = arb.socket_dir();
    // The socket directory is 0755, as /run/kiwi is.
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let ctr = FakeContainer::start(dir, "ctr-p", &["GPU-p"], Some(("team-b", "nb-1")));
    assert!(matches!(ctr.attach_reply, ControlReply::Done { .. }));
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&containers::containers_dir(dir)), 0o700);
    assert_eq!(mode(&containers::record_path(dir, "ctr-p")), 0o600);

    // The host's uid 65534: the node's socket, yes; the container's, no.
    let (ok, out) = as_nobody_on_host(&[
        kiwi_tests::bin("kiwi-hostile-client").as_os_str(),
        "--socket".as_ref(),
        arb.client_socket().as_os_str(),
        "--conns=1".as_ref(),
    ]);
    assert!(ok && out.contains("OPENED 1"), "the node's socket: {out}");
    let sock = containers::container_socket(dir, "ctr-p");
    let (ok, out) = as_nobody_on_host(&[
        kiwi_tests::bin("kiwi-hostile-client").as_os_str(),
        "--socket".as_ref(),
        sock.as_os_str(),
        "--conns=1".as_ref(),
    ]);
    assert!(
        !ok && out.contains("Permission denied"),
        "B's socket: {out}"
    );
    let record = containers::record_path(dir, "ctr-p");
    let (ok, out) = as_nobody_on_host(&["cat".as_ref(), record.as_os_str()]);
    assert!(
        !ok && out.contains("Permission denied"),
        "B's record: {out}"
    );
    assert!(!out.contains("nb-1") && !out.contains("team-b"), "{out}");
    let listing = containers::containers_dir(dir);
    let (ok, out) = as_nobody_on_host(&["ls".as_ref(), listing.as_os_str()]);
    assert!(
        !ok && out.contains("Permission denied"),
        "the records' list: {out}"
    );

    // Inside the container, uid 65534 registers, named by the record.
    let mut inside = ctr.command("setpriv");
    inside
        .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
        .arg(kiwi_tests::bin("kiwi-fake-client"))
        .arg("--socket")
        .arg(ctr.socket())
        .args(["--gpu", "GPU-p", "--ws", "1048576"]);
    let (mut inside, first) = first_line(inside);
    assert!(first.starts_with("REGISTERED"), "inside: {first}");
    let clients = || {
        let st = arb.status();
        st.gpus
            .into_iter()
            .find(|g| g.uuid == "GPU-p")
            .map(|g| g.clients)
            .unwrap_or_default()
    };
    assert_eq!(clients().len(), 1);
    assert_eq!(clients()[0].pod_name.as_deref(), Some("nb-1"));

    // The container's init runs as 65534, so the host's 65534 may walk its root
    // (/proc/<pid>/root) to the socket: the arbiter refuses a host peer that is not
    // root, before it registers.
    let back_door = Path::new(&format!("/proc/{}/root", ctr.init))
        .join(ctr.socket().strip_prefix("/").unwrap());
    let mut cmd = Command::new("setpriv");
    cmd.args(["--reuid=65534", "--regid=65534", "--clear-groups"])
        .arg(kiwi_tests::bin("kiwi-fake-client"))
        .arg("--socket")
        .arg(&back_door)
        .args(["--gpu", "GPU-p", "--ws", "1048576"]);
    let (mut thief, first) = first_line(cmd);
    let _ = thief.kill();
    let _ = thief.wait();
    assert!(
        first.starts_with("ERROR") && first.contains("host"),
        "the host's 65534 through /proc/{}/root: {first}",
        ctr.init
    );
    assert_eq!(clients().len(), 1, "only the container's own client");
    let _ = inside.kill();
    let _ = inside.wait();
}

/// Issue #42, item 5: one uid held 192 connections against a per-uid cap of 64 (the
/// node's socket and two container sockets, 64 each). A host process's connections
/// on a container socket count against its uid's node-wide quota; those made inside
/// the container (root there included) against the container's own.
#[test]
fn a_host_uid_gets_one_connection_quota_across_every_socket() {
    if !namespace_tools() {
        return;
    }
    let arb = Arbiter::start(&[
        "--max-conns-per-group",
        "16",
        "--register-timeout-ms",
        "60000",
    ]);
    let dir = arb.socket_dir();
    let a = FakeContainer::start(dir, "ctr-qa", &["GPU-q"], None);
    let b = FakeContainer::start(dir, "ctr-qb", &["GPU-q"], None);
    // Root on the host: 16 connections on each of three sockets.
    let mut host: Vec<Hog> = [
        arb.client_socket(),
        containers::container_socket(dir, "ctr-qa"),
        containers::container_socket(dir, "ctr-qb"),
    ]
    .iter()
    .map(|s| Hog::spawn(s, 16, None, &[]))
    .collect();
    for h in &mut host {
        assert_eq!(h.opened(), 16);
    }
    assert_eq!(
        closed_within(&mut host, 48 - 16),
        48 - 16,
        "root on the host keeps its 16, over every socket"
    );
    // Root inside A: A's own 16, whatever root on the host holds.
    let mut inside = Hog::spawn_with(
        a.command(kiwi_tests::bin("kiwi-hostile-client")),
        &a.socket(),
        17,
        None,
    );
    assert_eq!(inside.opened(), 17);
    assert_eq!(inside.wait_closed(1, Duration::from_secs(3)), 1, "A's cap");
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(inside.closed(), 1, "A keeps its 16");
    drop(b);
}

/// An arbiter that starts on a socket directory an older version left (records
/// 0644 in a 0755 `containers/`) makes them root's alone, and serves them.
#[test]
fn an_arbiter_makes_an_older_versions_records_private_at_start() {
    if !namespace_tools() {
        return;
    }
    let mut arb = Arbiter::start(&[]);
    let dir = arb.socket_dir().to_path_buf();
    let ctr = FakeContainer::start(&dir, "ctr-old", &["GPU-o"], None);
    let top = containers::containers_dir(&dir);
    let record = containers::record_path(&dir, "ctr-old");
    std::fs::set_permissions(&top, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::set_permissions(&record, std::fs::Permissions::from_mode(0o644)).unwrap();
    arb.restart_hard();
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&top), 0o700);
    assert_eq!(mode(&record), 0o600);
    kiwi_tests::wait_until(
        "the restarted arbiter serves the container",
        Duration::from_secs(10),
        || containers::container_socket(&dir, "ctr-old").exists(),
    );
    let mut c = ctr.command(kiwi_tests::bin("kiwi-fake-client"));
    c.arg("--socket")
        .arg(ctr.socket())
        .args(["--gpu", "GPU-o", "--ws", "1048576"]);
    let (mut c, first) = first_line(c);
    let _ = c.kill();
    let _ = c.wait();
    assert!(first.starts_with("REGISTERED"), "{first}");
}

fn namespace_tools() -> bool {
    ["setpriv", "unshare", "nsenter"]
        .iter()
        .all(|t| kiwi_tests::require_tool(t))
}

/// Asks each hog how many of its connections were closed until they add up to
/// `want` (or 3 s passed); the sum.
fn closed_within(hogs: &mut [Hog], want: usize) -> usize {
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        let n: usize = hogs.iter_mut().map(|h| h.closed()).sum();
        if n >= want || Instant::now() > deadline {
            return n;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Runs `args` as uid 65534 on the host: whether it succeeded, and its output.
fn as_nobody_on_host(args: &[&std::ffi::OsStr]) -> (bool, String) {
    let mut cmd = Command::new("setpriv");
    cmd.args(["--reuid=65534", "--regid=65534", "--clear-groups"])
        .args(args);
    let out = kiwi_tests::engines::output_within(cmd, Duration::from_secs(10));
    (out.status.success(), kiwi_tests::engines::text(&out))
}

/// Spawns `cmd` (a `kiwi-fake-client`) and reads its first line of output.
fn first_line(mut cmd: Command) -> (std::process::Child, String) {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    (child, line.trim().to_string())
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
