//! Helpers shared by Kiwi's end-to-end tests: finding the workspace's built
//! binaries, starting a real `kiwi-arbiter` on a private socket directory, talking
//! the protocol, and requiring tools that CI must have.
//!
//! The workspace's test command builds every binary first (`cargo build --workspace
//! --all-targets`), so tests find them next to their own executable.

use std::io::{BufRead, BufReader};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kiwi_protocol::blocking::Connection;
use kiwi_protocol::{
    ArbiterMsg, ClientMsg, ControlReply, ControlRequest, Event, EventKind, Register, StatusReport,
};

/// `target/<profile>`: the directory holding the workspace's binaries.
pub fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let mut dir = exe.parent().expect("exe dir").to_path_buf();
    if dir.file_name().is_some_and(|n| n == "deps") {
        dir.pop();
    }
    dir
}

/// A workspace binary, which must have been built.
pub fn bin(name: &str) -> PathBuf {
    let p = profile_dir().join(name);
    assert!(
        p.exists(),
        "{} is missing: run `cargo build --workspace --all-targets` first (the README's test command does)",
        p.display()
    );
    p
}

/// Under CI a missing tool fails the test; elsewhere it skips loudly.
/// Returns whether the tool is there.
pub fn require_tool(tool: &str) -> bool {
    let found = Command::new("sh")
        .arg("-c")
        .arg(format!("command -v {tool}"))
        .stdout(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    if !found {
        if std::env::var("CI").is_ok_and(|v| v == "true") {
            panic!("{tool} is required by this test and missing (CI installs it via .ci/run)");
        }
        eprintln!("SKIPPED: {tool} is not installed (CI=true would fail this test)");
    }
    found
}

/// Does what `kiwi-hook` does at a claimed container's creation: writes its record
/// under `socket_dir` (the container's init is `pid`) and asks the arbiter at
/// `socket_dir` to serve its socket. Returns the reply and the socket's path.
pub fn attach_container(
    socket_dir: &Path,
    record: &kiwi_config::containers::ContainerRecord,
) -> (ControlReply, PathBuf) {
    record
        .write(socket_dir)
        .expect("write the container record");
    let key = kiwi_config::containers::key_for(&record.id).unwrap();
    let mut c: Connection<ControlRequest, ControlReply> =
        Connection::connect(&kiwi_config::control_socket(socket_dir)).expect("control connect");
    c.stream()
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let reply = c
        .call(&ControlRequest::AttachContainer { key: key.clone() })
        .expect("attach");
    (
        reply,
        kiwi_config::containers::container_socket(socket_dir, &key),
    )
}

/// A container record for `id`, its init `pid` (which must be running), on `gpus`.
pub fn container_record(
    id: &str,
    pid: u32,
    gpus: &[&str],
    pod: Option<(&str, &str)>,
) -> kiwi_config::containers::ContainerRecord {
    let pid = pid as i32;
    kiwi_config::containers::ContainerRecord {
        id: id.to_string(),
        pod_name: pod.map(|p| p.1.to_string()),
        pod_namespace: pod.map(|p| p.0.to_string()),
        container_name: None,
        gpus: gpus.iter().map(|g| g.to_string()).collect(),
        any_gpu: false,
        pid,
        pid_start: kiwi_config::containers::process_start(pid).expect("a running pid"),
    }
}

/// A stand-in for a claimed container, as runc makes one: an init in mount and pid
/// namespaces of its own, in which the container's socket directory
/// (`<socket-dir>/containers/<key>/`) is bound at [`FakeContainer::client_dir`], as
/// `kiwi-hook` binds it at `/run/kiwi/client`. That bind is the way in for the
/// container's processes, whatever their uid; on the host only root passes
/// `<socket-dir>/containers/`. Once the bind is made the init runs as uid 65534 (a
/// container's user). Needs `unshare`, `nsenter` and `setpriv`. Killed on drop.
pub struct FakeContainer {
    unshare: Child,
    _stdin: std::process::ChildStdin,
    /// The init's pid on the host (the record's).
    pub init: u32,
    /// Where the container's socket directory is bound, inside the container.
    pub client_dir: PathBuf,
    /// The arbiter's answer to `attach_container`.
    pub attach_reply: ControlReply,
    _root: tempfile::TempDir,
}

impl FakeContainer {
    /// Starts the container, records it as `id` on `gpus` (its init as the record's
    /// pid) and has the arbiter at `socket_dir` serve its socket, as `kiwi-hook` does.
    pub fn start(
        socket_dir: &Path,
        id: &str,
        gpus: &[&str],
        pod: Option<(&str, &str)>,
    ) -> FakeContainer {
        use std::io::Write;
        use std::os::unix::fs::PermissionsExt;
        let root = tempfile::Builder::new()
            .prefix("kiwi-ctr")
            .tempdir()
            .expect("tempdir");
        std::fs::set_permissions(root.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let client_dir = root.path().join("client");
        std::fs::create_dir(&client_dir).unwrap();
        let key = kiwi_config::containers::key_for(id).unwrap();
        let source = kiwi_config::containers::container_dir(socket_dir, &key);
        // The bind waits for a line on stdin: the directory exists once the record is
        // written, which needs the init's pid.
        let mut unshare = Command::new("unshare")
            .args([
                "--mount",
                "--propagation",
                "private",
                "--pid",
                "--fork",
                "--kill-child",
                "sh",
                "-c",
                "read go && mount --bind \"$0\" \"$1\" && echo READY && \
                 exec setpriv --reuid=65534 --regid=65534 --clear-groups sleep 600",
            ])
            .arg(&source)
            .arg(&client_dir)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("unshare");
        let mut stdin = unshare.stdin.take().unwrap();
        let mut out = BufReader::new(unshare.stdout.take().unwrap());
        let mut init = None;
        wait_until("the fake container's init", Duration::from_secs(10), || {
            init = child_of(unshare.id());
            init.is_some()
        });
        let init = init.unwrap();
        let (attach_reply, _) =
            attach_container(socket_dir, &container_record(id, init, gpus, pod));
        writeln!(stdin, "go").unwrap();
        let mut line = String::new();
        out.read_line(&mut line).unwrap();
        assert_eq!(line.trim(), "READY", "the fake container's bind");
        FakeContainer {
            unshare,
            _stdin: stdin,
            init,
            client_dir,
            attach_reply,
            _root: root,
        }
    }

    /// The container's socket, as its processes name it.
    pub fn socket(&self) -> PathBuf {
        self.client_dir.join(kiwi_config::containers::SOCKET_NAME)
    }

    /// `program`, to be run inside the container (its mount and pid namespaces), as
    /// root there; prefix `setpriv` for another uid.
    pub fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut c = Command::new("nsenter");
        c.arg(format!("--target={}", self.init))
            .args(["--mount", "--pid", "--"])
            .arg(program);
        c
    }
}

impl Drop for FakeContainer {
    fn drop(&mut self) {
        // The init (pid 1 of its namespace) takes every process in it along.
        // SAFETY: kill(2) on the pid of a process this test started.
        unsafe { libc::kill(self.init as i32, libc::SIGKILL) };
        let _ = self.unshare.kill();
        let _ = self.unshare.wait();
    }
}

/// A child of `pid`, if it has one.
fn child_of(pid: u32) -> Option<u32> {
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let p: u32 = e.file_name().to_str()?.parse().ok()?;
        let stat = std::fs::read_to_string(format!("/proc/{p}/stat")).ok()?;
        // Fields after the command name (which may hold spaces): state, ppid, ...
        let ppid: u32 = stat[stat.rfind(')')? + 1..]
            .split_whitespace()
            .nth(1)?
            .parse()
            .ok()?;
        (ppid == pid).then_some(p)
    })
}

/// `kiwi-hostile-client` (connections held open without registering, optionally
/// each in the middle of a large frame), its output read line by line. Killed on
/// drop.
pub struct Hog {
    child: Child,
    stdin: Option<std::process::ChildStdin>,
    out: BufReader<std::process::ChildStdout>,
}

impl Hog {
    /// `kiwi-hostile-client` opening `conns` connections to `sock`, run under
    /// `wrapper` (a command prefix such as `setpriv …`), if any.
    pub fn spawn(sock: &Path, conns: usize, half_frame: Option<usize>, wrapper: &[&str]) -> Hog {
        let cmd = match wrapper.split_first() {
            Some((first, rest)) => {
                let mut c = Command::new(first);
                c.args(rest).arg(bin("kiwi-hostile-client"));
                c
            }
            None => Command::new(bin("kiwi-hostile-client")),
        };
        Self::spawn_with(cmd, sock, conns, half_frame)
    }

    /// [`Hog::spawn`] with `cmd`, a command that runs `kiwi-hostile-client` with
    /// the arguments it is given (e.g. [`FakeContainer::command`]).
    pub fn spawn_with(
        mut cmd: Command,
        sock: &Path,
        conns: usize,
        half_frame: Option<usize>,
    ) -> Hog {
        cmd.arg("--socket")
            .arg(sock)
            .arg("--conns")
            .arg(conns.to_string());
        if let Some(n) = half_frame {
            cmd.arg("--half-frame").arg(n.to_string());
        }
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn kiwi-hostile-client");
        let stdin = child.stdin.take();
        let out = BufReader::new(child.stdout.take().unwrap());
        Hog { child, stdin, out }
    }

    fn line(&mut self, prefix: &str) -> usize {
        let mut l = String::new();
        self.out.read_line(&mut l).unwrap();
        l.trim()
            .strip_prefix(prefix)
            .unwrap_or_else(|| panic!("expected {prefix}, got {l:?}"))
            .trim()
            .parse()
            .unwrap()
    }

    /// How many connections it opened.
    pub fn opened(&mut self) -> usize {
        self.line("OPENED")
    }

    /// How many of its connections the arbiter has closed by now.
    pub fn closed(&mut self) -> usize {
        use std::io::Write;
        writeln!(self.stdin.as_mut().unwrap()).unwrap();
        self.line("CLOSED")
    }

    /// [`Hog::closed`], asked until it reaches `at_least` or `within` passed.
    pub fn wait_closed(&mut self, at_least: usize, within: Duration) -> usize {
        let deadline = Instant::now() + within;
        loop {
            let n = self.closed();
            if n >= at_least || Instant::now() > deadline {
                return n;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Hog {
    fn drop(&mut self) {
        drop(self.stdin.take());
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// CLOCK_MONOTONIC in nanoseconds (the arbiter's clock).
pub use kiwi_protocol::monotonic_ns;

/// A `kiwi-arbiter` process on a private socket directory; killed on drop.
///
/// Unless its arguments say otherwise (`--nvml ...`), it runs with `--nvml off`: the
/// tests register made-up GPUs, which an arbiter that found the machine's NVML (a
/// node with an NVIDIA driver) would refuse. [`Arbiter::start_with_env`] runs one
/// on the simulator's NVML.
pub struct Arbiter {
    pub child: Child,
    pub dir: tempfile::TempDir,
    pub args: Vec<String>,
    /// Extra environment (e.g. a simulated machine's), kept across restarts.
    pub env: Vec<(String, String)>,
}

impl Arbiter {
    /// Starts `kiwi-arbiter --socket-dir <tmp> <args>` and waits for its sockets.
    pub fn start(args: &[&str]) -> Arbiter {
        Self::start_with_env(args, Vec::new())
    }

    /// [`Arbiter::start`] with extra environment variables.
    pub fn start_with_env(args: &[&str], env: Vec<(String, String)>) -> Arbiter {
        let dir = tempfile::Builder::new()
            .prefix("kiwi-arb")
            .tempdir()
            .expect("tempdir");
        let mut args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        if !args
            .iter()
            .any(|a| a == "--nvml" || a.starts_with("--nvml="))
        {
            args.extend(["--nvml".to_string(), "off".to_string()]);
        }
        // Whole-process eviction only where a test asks for it (with the
        // simulator's libcuda in its environment).
        if !args
            .iter()
            .any(|a| a == "--checkpoint" || a.starts_with("--checkpoint="))
        {
            args.extend(["--checkpoint".to_string(), "off".to_string()]);
        }
        let child = Self::spawn(dir.path(), &args, &env);
        let a = Arbiter {
            child,
            dir,
            args,
            env,
        };
        a.wait_ready();
        a
    }

    /// [`Arbiter::start`] with `--checkpoint auto` and the environment of a
    /// simulated machine (`SimMachine::env`, its libcuda among it): it
    /// evicts whole idle processes through the simulator's checkpoint API (issue
    /// #25). Where a newcomer's memory no swap frees (its context) leaves an idle
    /// tenant's working set no room beside the contexts, only such an arbiter lets it
    /// be made; without one it fails at once, saying whose working set it would
    /// block (issue #24).
    pub fn start_evicting(args: &[&str], machine_env: Vec<(String, String)>) -> Arbiter {
        let mut args = args.to_vec();
        args.extend(["--checkpoint", "auto"]);
        Self::start_with_env(&args, machine_env)
    }

    fn spawn(dir: &Path, args: &[String], env: &[(String, String)]) -> Child {
        Command::new(bin("kiwi-arbiter"))
            .arg("--socket-dir")
            .arg(dir)
            .args(args)
            .env_remove("KIWI_CONFIG")
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(if std::env::var_os("KIWI_TEST_VERBOSE").is_some() {
                Stdio::inherit()
            } else {
                Stdio::null()
            })
            .spawn()
            .expect("spawn kiwi-arbiter")
    }

    fn wait_ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if UnixStream::connect(self.client_socket()).is_ok()
                && UnixStream::connect(self.control_socket()).is_ok()
            {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        panic!(
            "kiwi-arbiter did not come up in {}",
            self.dir.path().display()
        );
    }

    pub fn socket_dir(&self) -> &Path {
        self.dir.path()
    }

    pub fn client_socket(&self) -> PathBuf {
        kiwi_config::client_socket(self.dir.path())
    }

    pub fn control_socket(&self) -> PathBuf {
        kiwi_config::control_socket(self.dir.path())
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Kills (SIGKILL) and starts a new instance on the same directory and flags.
    pub fn restart_hard(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.child = Self::spawn(self.dir.path(), &self.args, &self.env);
        self.wait_ready();
    }

    /// Sends SIGTERM and waits for the exit status.
    pub fn terminate(&mut self) -> std::process::ExitStatus {
        // SAFETY: plain kill(2) on our own child's pid.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        self.child.wait().expect("wait arbiter")
    }

    /// Whether the process is still running.
    pub fn alive(&mut self) -> bool {
        self.child.try_wait().expect("try_wait").is_none()
    }

    pub fn control(&self) -> Connection<ControlRequest, ControlReply> {
        let c = Connection::connect(&self.control_socket()).expect("control connect");
        c.stream()
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        c
    }

    pub fn status(&self) -> StatusReport {
        match self
            .control()
            .call(&ControlRequest::Status { gpu: None })
            .expect("status")
        {
            ControlReply::Status(s) => s,
            other => panic!("unexpected {other:?}"),
        }
    }

    pub fn events(&self) -> Vec<Event> {
        self.control().events(None, 0).expect("events").0
    }
}

impl Drop for Arbiter {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A protocol-level client in this process.
pub struct Client {
    pub conn: Connection<ClientMsg, ArbiterMsg>,
    pub id: u64,
}

/// A registration for `gpu` with `ws` bytes of working set on a GPU of `total` bytes.
/// How many grants in `events` were shared (everything fit).
pub fn shared_grants(events: &[Event]) -> usize {
    events
        .iter()
        .filter(|e| {
            matches!(
                e.kind,
                EventKind::Grant {
                    exclusive: false,
                    ..
                }
            )
        })
        .count()
}

pub fn register_msg(gpu: &str, total: u64, ws: u64) -> Register {
    Register {
        name: Some("test".into()),
        ..Register::new(gpu, total, ws)
    }
}

impl Client {
    pub fn register(socket: &Path, reg: Register) -> Client {
        let mut conn = Connection::connect(socket).expect("connect client socket");
        conn.stream()
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        match conn.call(&ClientMsg::Register(reg)).expect("register") {
            ArbiterMsg::Registered { client_id, .. } => Client {
                conn,
                id: client_id,
            },
            other => panic!("unexpected {other:?}"),
        }
    }

    /// Waits for the next message matching `pred`, up to `timeout`.
    pub fn wait_for(
        &mut self,
        timeout: Duration,
        mut pred: impl FnMut(&ArbiterMsg) -> bool,
    ) -> Option<ArbiterMsg> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.checked_duration_since(Instant::now())?;
            match self.conn.recv_timeout(left) {
                Ok(Some(m)) if pred(&m) => return Some(m),
                Ok(Some(_)) => continue,
                Ok(None) => return None,
                Err(e) => panic!("connection error: {e}"),
            }
        }
    }
}

/// Reads a child's stdout line by line until a line starts with `prefix`.
pub fn read_line_starting(
    reader: &mut BufReader<std::process::ChildStdout>,
    prefix: &str,
) -> Option<String> {
    let mut line = String::new();
    loop {
        line.clear();
        if reader.read_line(&mut line).ok()? == 0 {
            return None;
        }
        if line.starts_with(prefix) {
            return Some(line.trim_end().to_string());
        }
    }
}

/// A `kiwi-fake-client` process (an honest client that prints what it is told, one
/// line each, with the time) and its output. Killed on drop.
pub struct FakeClient {
    pub child: Child,
    out: BufReader<std::process::ChildStdout>,
}

impl FakeClient {
    /// Starts one against `arb`'s client socket with `args` (e.g. `--ws N --request`).
    pub fn spawn(arb: &Arbiter, args: &[&str]) -> FakeClient {
        let mut child = Command::new(bin("kiwi-fake-client"))
            .arg("--socket")
            .arg(arb.client_socket())
            .args(args)
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn fake client");
        let out = BufReader::new(child.stdout.take().expect("piped stdout"));
        FakeClient { child, out }
    }

    /// The next output line starting with `prefix` (earlier lines are skipped).
    pub fn expect(&mut self, prefix: &str) -> String {
        read_line_starting(&mut self.out, prefix)
            .unwrap_or_else(|| panic!("fake client ended before printing {prefix}"))
    }

    /// The monotonic time (ns) a line printed by the fake client carries.
    pub fn time_of(line: &str) -> u64 {
        line.split_whitespace()
            .nth(1)
            .and_then(|t| t.parse().ok())
            .unwrap_or_else(|| panic!("no time in {line:?}"))
    }
}

impl Drop for FakeClient {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Polls `f` every 5 ms until it holds; panics naming `what` after `timeout`.
/// Waits for `child`, killing it after `limit`: its output (kept even when it hung:
/// a hung program fails the test with everyone's output) and whether it hung.
pub fn finish_within(
    mut child: std::process::Child,
    limit: Duration,
) -> (std::process::Output, bool) {
    let deadline = std::time::Instant::now() + limit;
    let hung = loop {
        match child.try_wait() {
            Ok(Some(_)) => break false,
            Ok(None) if std::time::Instant::now() >= deadline => {
                let _ = child.kill();
                break true;
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(50)),
            Err(e) => panic!("wait for child: {e}"),
        }
    };
    (child.wait_with_output().expect("child output"), hung)
}

/// Reads `child`'s piped stdout up to the line `want`, a byte at a time (so what
/// follows stays in the pipe for `wait_with_output`); fails the test after 60 s or
/// when the child ends first.
pub fn read_stdout_until(child: &mut std::process::Child, want: &str) {
    use std::io::Read;
    let pid = child.id();
    let out = child.stdout.as_mut().expect("stdout piped");
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let (mut line, mut byte) = (Vec::new(), [0u8; 1]);
    loop {
        assert!(
            std::time::Instant::now() < deadline,
            "pid {pid}: no {want:?} in 60 s"
        );
        match out.read(&mut byte) {
            Ok(1) if byte[0] == b'\n' => {
                if line == want.as_bytes() {
                    return;
                }
                line.clear();
            }
            Ok(1) => line.push(byte[0]),
            _ => panic!("pid {pid} ended before {want:?}"),
        }
    }
}

/// A finished program's status, stdout and stderr, for a failure message.
pub fn output_text(o: &std::process::Output) -> String {
    format!(
        "status {:?}\n--- stdout\n{}--- stderr\n{}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

pub fn wait_until(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if f() {
            return;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    panic!("timed out waiting for {what}");
}

/// Processes that keep every core busy, as other tenants of a shared machine would,
/// until dropped: for tests whose timing must hold on a loaded machine.
pub struct BusyLoad(Vec<Child>);

impl BusyLoad {
    pub fn every_core() -> BusyLoad {
        let n = std::thread::available_parallelism().map_or(2, |n| n.get());
        BusyLoad(
            (0..n)
                .map(|_| {
                    Command::new("sh")
                        .args(["-c", "while :; do :; done"])
                        .stdin(Stdio::null())
                        .spawn()
                        .expect("spawn a busy loop")
                })
                .collect(),
        )
    }
}

impl Drop for BusyLoad {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Helpers of the tests that drive container engines (docker, containerd's CRI).
pub mod engines {
    use std::io::Read;
    use std::path::{Path, PathBuf};
    use std::process::{Command, Output, Stdio};
    use std::time::{Duration, Instant};

    pub fn is_ci() -> bool {
        std::env::var("CI").is_ok_and(|v| v == "true")
    }

    pub fn which(tool: &str) -> Option<PathBuf> {
        let path = std::env::var_os("PATH").unwrap_or_default();
        std::env::split_paths(&path)
            .chain(["/usr/sbin", "/sbin"].map(PathBuf::from))
            .map(|d| d.join(tool))
            .find(|p| p.is_file())
    }

    /// Runs `cmd` with a deadline, so a wedged daemon fails the test instead of hanging it.
    pub fn output_within(mut cmd: Command, limit: Duration) -> Output {
        let shown = format!("{cmd:?}");
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("{shown}: {e}"));
        let drain = |mut r: Box<dyn Read + Send>| {
            std::thread::spawn(move || {
                let mut v = Vec::new();
                let _ = r.read_to_end(&mut v);
                v
            })
        };
        let out = drain(Box::new(child.stdout.take().unwrap()));
        let err = drain(Box::new(child.stderr.take().unwrap()));
        let t0 = Instant::now();
        let status = loop {
            if let Some(st) = child.try_wait().unwrap() {
                break st;
            }
            if t0.elapsed() > limit {
                let _ = child.kill();
                let _ = child.wait();
                panic!("{shown} took more than {limit:?}");
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        Output {
            status,
            stdout: out.join().unwrap(),
            stderr: err.join().unwrap(),
        }
    }

    pub fn text(o: &Output) -> String {
        format!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        )
    }

    /// Lazily unmounts every mount point under `dir`, deepest first.
    pub fn unmount_under(dir: &Path) {
        let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
            return;
        };
        let mut points: Vec<String> = info
            .lines()
            .filter_map(|l| l.split(' ').nth(4))
            .filter(|p| Path::new(p).starts_with(dir))
            .map(str::to_string)
            .collect();
        points.sort_by_key(|p| std::cmp::Reverse(p.len()));
        for p in points {
            let c = std::ffi::CString::new(p).unwrap();
            // SAFETY: a valid C string; MNT_DETACH on a path we own.
            unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
        }
    }
}

/// A memory cgroup of its own, removed when dropped (its processes gone).
pub struct MemCgroup {
    dir: std::path::PathBuf,
    v2: bool,
}

impl MemCgroup {
    /// A fresh memory cgroup limited to `limit` bytes; `None` where the machine has no
    /// memory controller this test can use (a failure under `CI=true`).
    pub fn new(tag: &str, limit: u64) -> Option<MemCgroup> {
        let name = format!("kiwi-test-{tag}-{}", std::process::id());
        let v2_root = std::path::PathBuf::from("/sys/fs/cgroup");
        let v2 = std::fs::read_to_string(v2_root.join("cgroup.controllers"))
            .is_ok_and(|c| c.split_whitespace().any(|w| w == "memory"));
        let (dir, file) = if v2 {
            // The controller must be on for children of the root.
            let _ = std::fs::write(v2_root.join("cgroup.subtree_control"), "+memory");
            (v2_root.join(&name), "memory.max")
        } else {
            let v1 = std::path::PathBuf::from("/sys/fs/cgroup/memory");
            if !v1.join("memory.limit_in_bytes").exists() {
                assert!(
                    !crate::engines::is_ci(),
                    "no memory cgroup (v1 or v2) on this machine: the swap pool's test needs one"
                );
                eprintln!("skipped: no memory cgroup on this machine");
                return None;
            }
            (v1.join(&name), "memory.limit_in_bytes")
        };
        let _ = std::fs::remove_dir(&dir);
        std::fs::create_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        std::fs::write(dir.join(file), limit.to_string())
            .unwrap_or_else(|e| panic!("{}/{file}: {e}", dir.display()));
        Some(MemCgroup { dir, v2 })
    }

    /// `program args…` started inside the cgroup (a shell moves itself in, then execs).
    pub fn command(&self, program: &std::path::Path, args: &[&str]) -> std::process::Command {
        let mut cmd = std::process::Command::new("/bin/sh");
        cmd.arg("-c")
            .arg("echo $$ > \"$0/cgroup.procs\" && exec \"$@\"")
            .arg(&self.dir)
            .arg(program)
            .args(args);
        cmd
    }

    /// Whether the kernel's OOM killer acted in the cgroup.
    pub fn oom_kills(&self) -> u64 {
        if self.v2 {
            let ev = std::fs::read_to_string(self.dir.join("memory.events")).unwrap_or_default();
            ev.lines()
                .find_map(|l| l.strip_prefix("oom_kill "))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0)
        } else {
            let ctl =
                std::fs::read_to_string(self.dir.join("memory.oom_control")).unwrap_or_default();
            ctl.lines()
                .find_map(|l| l.strip_prefix("oom_kill "))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0)
        }
    }

    /// The most memory the cgroup was charged at once.
    pub fn peak(&self) -> u64 {
        let f = if self.v2 {
            "memory.peak"
        } else {
            "memory.max_usage_in_bytes"
        };
        std::fs::read_to_string(self.dir.join(f))
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    }
}

impl Drop for MemCgroup {
    fn drop(&mut self) {
        for _ in 0..100 {
            if std::fs::remove_dir(&self.dir).is_ok() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }
}
