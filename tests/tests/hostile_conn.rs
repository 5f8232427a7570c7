//! A hostile tenant against the arbiter's client socket, with real processes and
//! real sockets (issue #14, items 3, 5 and 6): text fields that are too long or
//! forge log lines, replies too large for a frame, descriptor exhaustion with idle
//! connections from other containers (each on its own socket), a host user's
//! connections over user and pid namespaces of its own, connections that never
//! register, and half-sent frames.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kiwi_protocol::blocking::Connection;
use kiwi_protocol::{
    ArbiterMsg, ClientMsg, ControlReply, ControlRequest, ErrorCode, StatusReport, MAGIC,
    MAX_PAYLOAD, MAX_TEXT_BYTES, PROTOCOL_VERSION,
};
use kiwi_tests::{attach_container, bin, container_record, register_msg, require_tool, Hog};

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;

/// A `kiwi-arbiter` of this test's own, its log in `<dir>/arbiter.log`; killed on
/// drop.
struct Arb {
    child: Child,
    dir: tempfile::TempDir,
}

impl Arb {
    fn socket_dir(&self) -> &Path {
        self.dir.path()
    }
    fn client_socket(&self) -> PathBuf {
        kiwi_config::client_socket(self.dir.path())
    }
    fn control_socket(&self) -> PathBuf {
        kiwi_config::control_socket(self.dir.path())
    }
    fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Arb {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `kiwi-arbiter` with `args` and, when `nofile` is given, RLIMIT_NOFILE
/// (soft and hard) set to it. Made-up GPUs need `--nvml off` where the flag exists.
fn start(args: &[&str], nofile: Option<u64>) -> Arb {
    start_with(args, nofile.map(|n| (n, n)), &[])
}

/// [`start`] with RLIMIT_NOFILE `(soft, hard)` and extra environment.
fn start_with(args: &[&str], nofile: Option<(u64, u64)>, env: &[(&str, &str)]) -> Arb {
    let dir = tempfile::Builder::new()
        .prefix("kiwi-hostile")
        .tempdir()
        .expect("tempdir");
    let log = std::fs::File::create(dir.path().join("arbiter.log")).unwrap();
    let help = Command::new(bin("kiwi-arbiter"))
        .arg("--help")
        .output()
        .unwrap();
    let mut cmd = Command::new(bin("kiwi-arbiter"));
    cmd.arg("--socket-dir")
        .arg(dir.path())
        .args(args)
        .env_remove("KIWI_CONFIG")
        .env_remove("KIWI_LIMIT_NOFILE")
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log);
    if String::from_utf8_lossy(&help.stdout).contains("--nvml") {
        cmd.args(["--nvml", "off"]);
    }
    if let Some((soft, hard)) = nofile {
        // SAFETY: setrlimit is async-signal-safe; it runs in the forked child only.
        unsafe {
            cmd.pre_exec(move || {
                let lim = libc::rlimit {
                    rlim_cur: soft as libc::rlim_t,
                    rlim_max: hard as libc::rlim_t,
                };
                if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
    let child = cmd.spawn().expect("spawn kiwi-arbiter");
    let arb = Arb { child, dir };
    // Up once the control socket answers: serving, its limits set and logged.
    let deadline = Instant::now() + Duration::from_secs(20);
    let answers = || {
        let Ok(mut c) = Connection::<ControlRequest, ControlReply>::connect(&arb.control_socket())
        else {
            return false;
        };
        let _ = c.stream().set_read_timeout(Some(Duration::from_secs(1)));
        c.call(&ControlRequest::Status { gpu: None }).is_ok()
    };
    while !answers() {
        assert!(Instant::now() < deadline, "kiwi-arbiter did not come up");
        std::thread::sleep(Duration::from_millis(10));
    }
    arb
}

fn log_of(arb: &Arb) -> String {
    std::fs::read_to_string(arb.socket_dir().join("arbiter.log")).unwrap()
}

/// Raises this process's soft descriptor limit to its hard limit.
fn raise_own_fd_limit() {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: get/setrlimit on structs we own.
    unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim);
        lim.rlim_cur = lim.rlim_max;
        libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
    }
}

/// A client connection with a short read timeout.
fn connect(sock: &Path) -> Connection<ClientMsg, ArbiterMsg> {
    let c = Connection::connect(sock).expect("connect");
    c.stream()
        .set_read_timeout(Some(Duration::from_secs(3)))
        .unwrap();
    c
}

/// A control request with a short timeout: the operator must never be locked out.
fn control(arb: &Arb, req: &ControlRequest) -> ControlReply {
    let mut c = Connection::<ControlRequest, ControlReply>::connect(&arb.control_socket())
        .expect("control connect");
    c.stream()
        .set_read_timeout(Some(Duration::from_secs(3)))
        .unwrap();
    c.call(req).expect("the control socket answers")
}

/// The soft and hard RLIMIT_NOFILE of a process.
fn nofile_of(pid: u32) -> (u64, u64) {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .unwrap();
    let v: Vec<u64> = line
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect();
    (v[0], v[1])
}

fn vm_kib(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"))
}

/// Registers a client from this process; the arbiter must answer within 3 s.
fn register_ok(arb: &Arb) -> Connection<ClientMsg, ArbiterMsg> {
    let mut c = connect(&arb.client_socket());
    match c.call(&ClientMsg::Register(register_msg("GPU-h", GIB, MIB))) {
        Ok(ArbiterMsg::Registered { .. }) => c,
        other => panic!("a client of another tenant could not register: {other:?}"),
    }
}

#[test]
fn long_or_control_character_text_is_refused_with_a_reply_and_never_forges_a_log_line() {
    let arb = start(&[], None);
    let sock = arb.client_socket();

    // A name of nearly 1 MiB: refused, the reply names the field.
    let mut reg = register_msg("GPU-h", GIB, MIB);
    reg.name = Some("n".repeat(MAX_PAYLOAD - 1024));
    let mut c = connect(&sock);
    match c.call(&ClientMsg::Register(reg)).expect("a reply") {
        ArbiterMsg::Error { code, message } => {
            assert_eq!(code, ErrorCode::InvalidArgument);
            assert!(message.contains("`name`"), "{message}");
            assert!(message.contains(&MAX_TEXT_BYTES.to_string()), "{message}");
        }
        other => panic!("a 1 MiB name was accepted: {other:?}"),
    }

    // A newline, in each text field.
    for field in ["name", "pod_name", "pod_namespace", "container_id"] {
        let mut reg = register_msg("GPU-h", GIB, MIB);
        let forged = Some(format!("x\n[INFO] forged by {field}"));
        match field {
            "name" => reg.name = forged,
            "pod_name" => reg.pod_name = forged,
            "pod_namespace" => reg.pod_namespace = forged,
            _ => reg.container_id = forged,
        }
        let mut c = connect(&sock);
        match c.call(&ClientMsg::Register(reg)).expect("a reply") {
            ArbiterMsg::Error { code, message } => {
                assert_eq!(code, ErrorCode::InvalidArgument, "{field}");
                assert!(message.contains(&format!("`{field}`")), "{message}");
            }
            other => panic!("a {field} with a newline was accepted: {other:?}"),
        }
    }

    // The longest legal text is fine.
    let mut reg = register_msg("GPU-h", GIB, MIB);
    reg.name = Some("n".repeat(MAX_TEXT_BYTES));
    let mut ok = connect(&sock);
    assert!(matches!(
        ok.call(&ClientMsg::Register(reg)).unwrap(),
        ArbiterMsg::Registered { .. }
    ));

    // A malformed message whose error would quote a newline (an unknown field).
    let payload = br#"{"type":"register","x\n[WARN] forged by serde":1}"#;
    let mut frame = MAGIC.to_vec();
    frame.extend_from_slice(&PROTOCOL_VERSION.to_be_bytes());
    frame.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    frame.extend_from_slice(payload);
    let mut s = UnixStream::connect(&sock).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
    s.write_all(&frame).unwrap();
    let mut reply = Vec::new();
    let _ = s.read_to_end(&mut reply);
    assert!(
        String::from_utf8_lossy(&reply).contains("malformed"),
        "{reply:?}"
    );

    // Still serving; and no line of the log was written by a client.
    assert!(matches!(
        control(&arb, &ControlRequest::Status { gpu: None }),
        ControlReply::Status(_)
    ));
    let log = log_of(&arb);
    for line in log.lines() {
        assert!(
            !line.starts_with("[INFO] forged") && !line.starts_with("[WARN] forged"),
            "forged log line: {line:?}"
        );
    }
    assert!(
        log.lines().all(|l| l.len() <= 2200),
        "a log line longer than the limit"
    );
}

#[test]
fn status_and_events_still_answer_after_many_large_legal_registrations() {
    raise_own_fd_limit();
    const N: usize = 1_500;
    let arb = start(&["--max-conns-per-group", "2000"], None);
    let sock = arb.client_socket();
    let text = |c: char| Some(c.to_string().repeat(MAX_TEXT_BYTES));
    let mut clients = Vec::with_capacity(N);
    for _ in 0..N {
        let mut reg = register_msg("GPU-big", GIB, MIB);
        reg.name = text('n');
        reg.pod_name = text('p');
        reg.pod_namespace = text('s');
        reg.container_id = text('c');
        let mut c = connect(&sock);
        match c.call(&ClientMsg::Register(reg)).unwrap() {
            ArbiterMsg::Registered { .. } => clients.push(c),
            other => panic!("{other:?}"),
        }
    }

    let kiwictl = |args: &[&str]| {
        let out = Command::new(bin("kiwictl"))
            .arg("--socket-dir")
            .arg(arb.socket_dir())
            .args(args)
            .env_remove("KIWI_CONFIG")
            .output()
            .expect("run kiwictl");
        assert!(
            out.status.success(),
            "kiwictl {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };

    // Status: cut to one frame, with a count of what was left out.
    let json = kiwictl(&["status", "--json"]);
    let report: StatusReport = serde_json::from_str(&json).unwrap();
    let shown = report.gpus[0].clients.len();
    assert!(report.omitted_clients > 0, "the reply needed cutting");
    assert_eq!(shown + report.omitted_clients as usize, N);
    assert!(shown > N / 2, "most clients shown: {shown}");
    let table = kiwictl(&["status"]);
    assert!(table.contains("Not shown:"), "{table}");

    // Events: every registration, in pages that fit.
    let events = kiwictl(&["events"]);
    let registers = events
        .lines()
        .filter(|l| l.contains(r#""event":"register""#))
        .count();
    assert_eq!(registers, N);
}

#[test]
fn idle_connections_from_one_container_lock_out_neither_other_tenants_nor_the_operator() {
    // 256 descriptors: client connections and container sockets get at most 192, 64
    // connections per container. (Idle connections stay for the test's length: this
    // is about the caps.)
    let arb = start(&["--register-timeout-ms", "60000"], Some(256));
    let me = std::process::id();
    let attach = |name: &str| {
        let rec = container_record(name, me, &["GPU-h"], None);
        let (reply, sock) = attach_container(arb.socket_dir(), &rec);
        assert!(matches!(reply, ControlReply::Done { .. }), "{reply:?}");
        sock
    };
    let a = attach("hog-a");
    let mut hog = Hog::spawn(&a, 300, None, &[]);
    assert_eq!(hog.opened(), 300);
    let _c = register_ok(&arb);
    assert!(matches!(
        control(&arb, &ControlRequest::Status { gpu: None }),
        ControlReply::Status(_)
    ));
    // The container kept 64, exactly; every other connection was refused and closed.
    let closed = hog.wait_closed(300 - 64, Duration::from_secs(3));
    assert_eq!(closed, 300 - 64);

    // Four more containers fill the node's connections: the operator still gets in.
    let socks: Vec<PathBuf> = ["hog-b", "hog-c", "hog-d", "hog-e"]
        .iter()
        .map(|n| attach(n))
        .collect();
    let mut more: Vec<Hog> = socks.iter().map(|s| Hog::spawn(s, 64, None, &[])).collect();
    for h in &mut more {
        assert_eq!(h.opened(), 64);
    }
    for _ in 0..3 {
        assert!(matches!(
            control(&arb, &ControlRequest::Status { gpu: None }),
            ControlReply::Status(_)
        ));
    }
    // 192 places = 5 container sockets + the first container's 64 + our client + 122
    // of these.
    let kept = 192 - 5 - 64 - 1;
    let deadline = Instant::now() + Duration::from_secs(3);
    let refused = loop {
        let n: usize = more.iter_mut().map(|h| h.closed()).sum();
        if n >= 4 * 64 - kept || Instant::now() > deadline {
            break n;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(refused, 4 * 64 - kept, "the node-wide cap");

    // Hundreds of refusals, a handful of warnings.
    let warnings = log_of(&arb)
        .lines()
        .filter(|l| l.starts_with("[WARN]"))
        .count();
    assert!(warnings <= 25, "{warnings} warnings:\n{}", log_of(&arb));
}

#[test]
fn a_host_user_gains_no_connections_from_user_and_pid_namespaces() {
    for tool in ["setpriv", "unshare"] {
        if !require_tool(tool) {
            return;
        }
    }
    // Issue #27, attack 2: `unshare -Ur -pf` made each namespace a group of its own
    // (80 connections against a cap of 16). On the node's socket the cap is the uid's,
    // as the initial user namespace sees it.
    let arb = start(
        &[
            "--register-timeout-ms",
            "60000",
            "--max-conns-per-group",
            "16",
        ],
        None,
    );
    // uid 65534 must reach the socket: the test's directory is private.
    std::fs::set_permissions(
        arb.socket_dir(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let wrapper = [
        "setpriv",
        "--reuid=65534",
        "--regid=65534",
        "--clear-groups",
        "unshare",
        "--user",
        "--map-root-user",
        "--pid",
        "--fork",
        "--kill-child",
    ];
    let mut hogs: Vec<Hog> = (0..5)
        .map(|_| Hog::spawn(&arb.client_socket(), 16, None, &wrapper))
        .collect();
    for h in &mut hogs {
        assert_eq!(h.opened(), 16);
    }
    let deadline = Instant::now() + Duration::from_secs(3);
    let kept = loop {
        let closed: usize = hogs.iter_mut().map(|h| h.closed()).sum();
        if 80 - closed <= 16 || Instant::now() > deadline {
            break 80 - closed;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(kept, 16, "five namespaces of one host user share its 16");
    // Another user (root, here) is not touched by that user's cap.
    let _c = register_ok(&arb);
}

#[test]
fn the_arbiter_raises_its_descriptor_limit_and_caps_connections_below_it() {
    let arb = start_with(&[], Some((256, 1024)), &[]);
    assert_eq!(nofile_of(arb.pid()), (1024, 1024), "soft raised to hard");
    let log = log_of(&arb);
    assert!(
        log.contains("limits: 960 client connections (RLIMIT_NOFILE 1024"),
        "{log}"
    );
    // What the Helm chart asks for: above the hard limit, which takes
    // CAP_SYS_RESOURCE; without it the arbiter says so and carries on.
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let cap_eff = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        .unwrap();
    let arb = start_with(&[], Some((256, 256)), &[("KIWI_LIMIT_NOFILE", "4096")]);
    const CAP_SYS_RESOURCE: u32 = 24;
    if cap_eff & (1 << CAP_SYS_RESOURCE) != 0 {
        assert_eq!(nofile_of(arb.pid()), (4096, 4096));
    } else {
        assert_eq!(nofile_of(arb.pid()), (256, 256));
        let log = log_of(&arb);
        assert!(
            log.contains("cannot raise RLIMIT_NOFILE to 4096")
                && log.contains("limits: 192 client connections"),
            "{log}"
        );
    }
}

#[test]
fn a_connection_that_never_registers_is_closed() {
    // The limit as a flag, and as its config key (every daemon flag has one).
    let conf = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(conf.path(), "[arbiter]\nregister_timeout_ms = 300\n").unwrap();
    for args in [
        vec!["--register-timeout-ms", "300"],
        vec!["--config", conf.path().to_str().unwrap()],
    ] {
        an_unregistered_connection_is_closed(&args);
    }
}

fn an_unregistered_connection_is_closed(args: &[&str]) {
    let arb = start(args, None);
    let mut idle = connect(&arb.client_socket());
    // Pings do not count as registering.
    idle.send(&ClientMsg::Ping { token: 1 }).unwrap();
    assert!(matches!(
        idle.recv().unwrap(),
        ArbiterMsg::Pong { token: 1 }
    ));
    let mut registered = register_ok(&arb);
    let t0 = Instant::now();
    match idle.recv() {
        Ok(ArbiterMsg::Error { code, .. }) => assert_eq!(code, ErrorCode::NotRegistered),
        other => panic!("expected a not_registered error, got {other:?}"),
    }
    assert!(idle.recv().is_err(), "then the connection is closed");
    assert!(t0.elapsed() < Duration::from_secs(2));
    // A registered client is not affected.
    std::thread::sleep(Duration::from_millis(400));
    registered.send(&ClientMsg::Ping { token: 2 }).unwrap();
    assert!(matches!(
        registered.recv().unwrap(),
        ArbiterMsg::Pong { token: 2 }
    ));
}

#[test]
fn half_sent_frames_are_bounded_in_memory_and_time() {
    raise_own_fd_limit();
    const CONNS: usize = 200;
    let arb = start(
        &[
            "--max-conns-per-group",
            "1000",
            "--frame-timeout-ms",
            "1500",
        ],
        None,
    );
    let pid = arb.pid();
    let base = vm_kib(pid, "VmRSS:");
    // Each connection: a header announcing 1 MiB, and all of it but one byte.
    let mut hog = Hog::spawn(&arb.client_socket(), CONNS, Some(MAX_PAYLOAD), &[]);
    assert_eq!(hog.opened(), CONNS);
    let peak = vm_kib(pid, "VmHWM:");
    let grown_mib = peak.saturating_sub(base) / 1024;
    // The default budget is 64 MiB; old arbiters took ~1 MiB per connection.
    assert!(
        grown_mib < 64 + 32,
        "the arbiter grew by {grown_mib} MiB for {CONNS} half-sent frames"
    );
    // All are closed by the deadline (or refused at once), and the arbiter serves.
    let closed = hog.wait_closed(CONNS, Duration::from_secs(5));
    assert_eq!(
        closed, CONNS,
        "half-sent frames are closed after the deadline"
    );
    let _c = register_ok(&arb);
}
