//! Helpers the shim's end-to-end tests share: the shim under test, driver-API C
//! programs of `tests/c` built against NVIDIA's cuda.h, running them under Kiwi, and
//! waiting for them with a limit.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kiwi_protocol::{Event, EventKind};
use kiwi_tests::{bin, profile_dir, require_tool, Arbiter};

pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The shim under test: `KIWI_TEST_SHIM` (to run a test against another build of
/// it, e.g. the last commit's), else the workspace's.
pub fn shim() -> PathBuf {
    std::env::var_os("KIWI_TEST_SHIM")
        .map(PathBuf::from)
        .unwrap_or_else(|| profile_dir().join("libkiwi.so"))
}

/// Compiles a driver-API program of `tests/c` against NVIDIA's cuda.h and the
/// simulator's libcuda; `None` (skip) when gcc is missing outside CI.
pub fn compile(name: &str, dir: &Path) -> Option<PathBuf> {
    if !require_tool("gcc") {
        return None;
    }
    let out = Command::new("sh")
        .arg(root().join("scripts/fetch-cuda-h.sh"))
        .output()
        .expect("run fetch-cuda-h.sh");
    assert!(out.status.success(), "fetch-cuda-h.sh failed");
    let include = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let sim_dir = kiwi_sim_core::ensure_sim_dir(&profile_dir()).expect("simulator built");
    let exe = dir.join(name);
    let st = Command::new("gcc")
        .args(["-O1", "-Wall", "-Werror", "-I", &include])
        .arg(root().join(format!("shim/tests/c/{name}.c")))
        .arg("-o")
        .arg(&exe)
        .arg("-L")
        .arg(&sim_dir)
        .arg("-lcuda")
        .status()
        .expect("gcc");
    assert!(st.success(), "compiling {name}.c");
    Some(exe)
}

pub fn finish(child: Child) -> Output {
    let pid = child.id();
    wait_within(child, 120).unwrap_or_else(|_| panic!("pid {pid} hung for 120 s"))
}

/// The child's output once it exits within `secs`; else it is killed, and `Err`
/// holds what it wrote until then.
pub fn wait_within(child: Child, secs: u64) -> Result<Output, Output> {
    let pid = child.id() as i32;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(Duration::from_secs(secs)) {
        Ok(o) => Ok(o.expect("wait for child")),
        Err(_) => {
            // SAFETY: kill(2) on our own child's pid.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            Err(rx.recv().expect("killed child").expect("wait for child"))
        }
    }
}

pub fn text(o: &Output) -> String {
    format!(
        "status {:?}\n--- stdout\n{}--- stderr\n{}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// `c` under Kiwi: the shim under test preloaded, `arb`'s socket, the arbiter required,
/// output piped.
pub fn under_kiwi<'a>(c: &'a mut Command, arb: &Arbiter) -> &'a mut Command {
    c.env("LD_PRELOAD", shim())
        .env("KIWI_SOCKET_DIR", arb.socket_dir())
        .env("KIWI_REQUIRE_ARBITER", "1")
        .env("KIWI_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
}

/// `exe` under `kiwictl run` (the shim under test, `arb`'s socket) on the simulated
/// machine `m`, output piped: the way a user runs a program under Kiwi.
pub fn kiwictl_run(exe: &Path, m: &kiwi_sim_core::harness::SimMachine, arb: &Arbiter) -> Command {
    let mut c = Command::new(bin("kiwictl"));
    c.arg("--socket-dir")
        .arg(arb.socket_dir())
        .arg("run")
        .arg("--shim")
        .arg(shim())
        .arg("--")
        .arg(exe);
    m.apply(&mut c)
        .env_remove("LD_PRELOAD")
        .env("KIWI_REQUIRE_ARBITER", "1")
        .env("KIWI_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c
}

/// [`under_kiwi`] on the simulated machine `m`.
pub fn under_kiwi_on<'a>(
    c: &'a mut Command,
    m: &kiwi_sim_core::harness::SimMachine,
    arb: &Arbiter,
) -> &'a mut Command {
    under_kiwi(m.apply(c), arb)
}

/// A program of `tests/c` driven through stdin/stdout: it prints a line when it
/// reaches a step and waits for `go` on stdin before the next.
pub struct Stepped {
    pub child: Child,
    stdin: Option<ChildStdin>,
    stdout: BufReader<ChildStdout>,
    seen: String,
    /// Its stderr (when piped), read as it comes by a thread: a chatty log never
    /// fills the pipe, and a test can wait for a line of it.
    stderr: Arc<Mutex<Vec<u8>>>,
    stderr_reader: Option<std::thread::JoinHandle<()>>,
    _dump: DumpOnPanic,
}

/// Prints a program's stderr when its test panics before [`Stepped::finish`]: what
/// the shim logged is what explains a wait that never ended.
struct DumpOnPanic(u32, Arc<Mutex<Vec<u8>>>);

impl Drop for DumpOnPanic {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let err = self.1.lock().unwrap_or_else(|p| p.into_inner());
            eprintln!(
                "--- stderr of pid {} (test panicked)\n{}",
                self.0,
                String::from_utf8_lossy(&err)
            );
        }
    }
}

impl Stepped {
    pub fn spawn(cmd: &mut Command) -> Stepped {
        let mut child = cmd.stdin(Stdio::piped()).spawn().expect("spawn");
        let stdin = child.stdin.take();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        let stderr = Arc::new(Mutex::new(Vec::new()));
        let stderr_reader = child.stderr.take().map(|mut pipe| {
            let buf = stderr.clone();
            std::thread::spawn(move || {
                let mut chunk = [0u8; 8192];
                while let Ok(n @ 1..) = pipe.read(&mut chunk) {
                    buf.lock().unwrap().extend_from_slice(&chunk[..n]);
                }
            })
        });
        Stepped {
            _dump: DumpOnPanic(child.id(), stderr.clone()),
            child,
            stdin,
            stdout,
            seen: String::new(),
            stderr,
            stderr_reader,
        }
    }

    /// What it wrote to stderr so far.
    pub fn stderr_text(&self) -> String {
        String::from_utf8_lossy(&self.stderr.lock().unwrap()).into_owned()
    }

    /// Waits (up to `limit`) until its stderr has a line containing `want`; panics
    /// with what it wrote otherwise.
    pub fn wait_stderr(&self, want: &str, limit: Duration) {
        let deadline = std::time::Instant::now() + limit;
        while !self.stderr_text().lines().any(|l| l.contains(want)) {
            // Its stderr follows, from [`DumpOnPanic`].
            assert!(
                std::time::Instant::now() < deadline,
                "no {want:?} on stderr in {limit:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Reads stdout until a line starting with `want`; returns the line (trimmed).
    /// Panics with what the program printed if it ends first.
    pub fn wait_for(&mut self, want: &str) -> String {
        loop {
            let mut line = String::new();
            let n = self.stdout.read_line(&mut line).expect("read stdout");
            self.seen.push_str(&line);
            if n == 0 {
                if let Some(t) = self.stderr_reader.take() {
                    let _ = t.join();
                }
                // Its stderr follows, from [`DumpOnPanic`].
                panic!("no {want:?}: stdout\n{}", self.seen);
            }
            if line.trim().starts_with(want) {
                return line.trim().to_string();
            }
        }
    }

    pub fn go(&mut self) {
        let w = self.stdin.as_mut().expect("stdin open");
        writeln!(w, "go").expect("write stdin");
        w.flush().unwrap();
    }

    /// Closes stdin, waits for the program (with [`finish`]'s limit); its output is
    /// all it printed.
    pub fn finish(mut self) -> Output {
        drop(self.stdin.take());
        let mut rest = String::new();
        let _ = self.stdout.read_to_string(&mut rest);
        let mut o = finish(self.child);
        if let Some(t) = self.stderr_reader.take() {
            let _ = t.join();
        }
        self.seen.push_str(&rest);
        o.stdout = self.seen.into_bytes();
        o.stderr = std::mem::take(&mut *self.stderr.lock().unwrap());
        o
    }
}

/// The arbiter's clients registered by process `pid` (one per GPU).
pub fn clients_of(arb: &Arbiter, pid: u32) -> Vec<u64> {
    arb.events()
        .iter()
        .filter_map(|e| match e.kind {
            EventKind::Register { pid: p, .. } if p == pid => e.client,
            _ => None,
        })
        .collect()
}

/// Bytes of each swap-out of process `pid` (arbiter's log).
pub fn swap_outs(arb: &Arbiter, pid: u32) -> Vec<u64> {
    let clients = clients_of(arb, pid);
    arb.events()
        .iter()
        .filter(|e| e.client.is_some_and(|c| clients.contains(&c)))
        .filter_map(|e| match e.kind {
            EventKind::SwapOut { bytes, .. } => Some(bytes),
            _ => None,
        })
        .collect()
}

/// Each `unswappable` figure process `pid` reported, in order (arbiter's log): its
/// memory no swap frees (contexts, modules, limits, its own pinned VMM memory).
pub fn unswappable_figures(arb: &Arbiter, pid: u32) -> Vec<u64> {
    let clients = clients_of(arb, pid);
    arb.events()
        .iter()
        .filter(|e| e.client.is_some_and(|c| clients.contains(&c)))
        .filter_map(|e| match e.kind {
            EventKind::Unswappable { bytes } => Some(bytes),
            _ => None,
        })
        .collect()
}

/// Bytes process `pid` swapped out so far (arbiter's log).
pub fn swapped_out(arb: &Arbiter, pid: u32) -> u64 {
    swap_outs(arb, pid).iter().sum()
}

/// gpuburst with `mem` of memory, `bursts` GPU bursts of `gpu_ms` each with 20 ms of
/// CPU between them, verifying every byte (not yet under Kiwi).
pub fn gpuburst(mem: &str, bursts: u32, gpu_ms: u32) -> Command {
    let mut c = Command::new(bin("gpuburst"));
    c.args(["--mem", mem, "--bursts", &bursts.to_string()])
        .args([
            "--gpu-ms",
            &gpu_ms.to_string(),
            "--cpu-ms",
            "20",
            "--verify",
        ]);
    c
}

/// A gpuburst notebook of `mib` MiB under Kiwi on `m` (2 short bursts, verified):
/// over capacity with the program under test, it takes the GPU from it.
pub fn notebook(m: &kiwi_sim_core::harness::SimMachine, arb: &Arbiter, mib: u32) -> Child {
    let mut b = gpuburst(&format!("{mib}MiB"), 2, 50);
    under_kiwi_on(&mut b, m, arb)
        .spawn()
        .expect("spawn gpuburst")
}

/// The arbiter's client id of the process with host pid `host_pid`.
pub fn client_of(events: &[Event], host_pid: u32) -> Option<u64> {
    events.iter().find_map(|e| match e.kind {
        EventKind::Register { host_pid: p, .. } if p == host_pid => e.client,
        _ => None,
    })
}

/// Polls the arbiter's log (up to `limit`) until `f` finds an event; returns it.
pub fn wait_event(
    arb: &Arbiter,
    what: &str,
    limit: Duration,
    f: impl Fn(&[Event]) -> Option<Event>,
) -> Event {
    let deadline = Instant::now() + limit;
    loop {
        let ev = arb.events();
        if let Some(e) = f(&ev) {
            return e;
        }
        assert!(
            Instant::now() < deadline,
            "{what} not seen in {limit:?}: {ev:#?}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The process's first `request` after event `after_seq`, waited for (30 s).
pub fn wait_request(arb: &Arbiter, pid: u32, after_seq: u64) -> Event {
    wait_event(arb, "a request", Duration::from_secs(30), |ev| {
        let c = client_of(ev, pid)?;
        ev.iter()
            .find(|e| {
                e.client == Some(c) && e.seq > after_seq && matches!(e.kind, EventKind::Request)
            })
            .cloned()
    })
}
