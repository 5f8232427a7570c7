//! The shim explains a wait: real `gpuburst` processes on the GPU simulator,
//! preloaded with libkiwi.so, under a real `kiwi-arbiter`. A program that waits for
//! the GPU more than a second says who holds it, its place in the queue and the
//! holder's time left, then how long it waited once it gets the GPU; `KIWI_LOG=warn`
//! silences both lines.
//!
//! The simulated contexts cost no GPU memory here (`KIWI_SIM_CONTEXT_MEMORY=0`): the
//! subject is the wait, and 1 GiB holds one 700 MiB program at a time either way.
//!
//! Needs the workspace built first (`cargo build --workspace --all-targets`).

use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use kiwi_protocol::EventKind;
use kiwi_tests::{profile_dir, Arbiter};

fn shim() -> PathBuf {
    let p = profile_dir().join("libkiwi.so");
    assert!(
        p.exists(),
        "{} is missing: build the workspace",
        p.display()
    );
    p
}

fn sim_dir() -> PathBuf {
    kiwi_sim_core::ensure_sim_dir(&profile_dir()).expect("simulator built")
}

/// `gpuburst` holding 700 MiB of a 1 GiB simulated GPU, one burst of `gpu_ms`, under
/// Kiwi.
fn burst(arb: &Arbiter, sim: &str, pod: &str, gpu_ms: &str, log: Option<&str>) -> Command {
    let mut c = Command::new(kiwi_tests::bin("gpuburst"));
    c.args([
        "--mem", "700MiB", "--bursts", "1", "--gpu-ms", gpu_ms, "--cpu-ms", "0", "--verify",
    ])
    .env("LD_LIBRARY_PATH", sim_dir())
    .env("KIWI_SIM_NAME", sim)
    .env("KIWI_SIM_MEMORY", "1GiB")
    .env("KIWI_SIM_CONTEXT_MEMORY", "0")
    .env("LD_PRELOAD", shim())
    .env("KIWI_SOCKET_DIR", arb.socket_dir())
    .env("KIWI_POD_NAME", pod)
    .env_remove("KIWI_LOG")
    .stdin(Stdio::null())
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    if let Some(l) = log {
        c.env("KIWI_LOG", l);
    }
    c
}

fn finish(c: Child) -> Output {
    let o = c.wait_with_output().expect("wait");
    assert_eq!(
        o.status.code(),
        Some(0),
        "stdout: {}\nstderr: {}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    o
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn lines<'a>(err: &'a str, what: &str) -> Vec<&'a str> {
    err.lines().filter(|l| l.contains(what)).collect()
}

/// The seconds in "~12 s left" / "~2.5 s left".
fn left_secs(line: &str) -> Option<f64> {
    let i = line.find(" s left")?;
    let start = line[..i].rfind('~')? + 1;
    line[start..i].parse().ok()
}

/// The arbiter's client id of each pod, and how long each grant's wait was.
fn waits_by_pod(arb: &Arbiter) -> Vec<(String, u64)> {
    let events = arb.events();
    let mut pods = std::collections::HashMap::new();
    let mut out = Vec::new();
    for e in &events {
        match &e.kind {
            EventKind::Register { pod_name, .. } => {
                pods.insert(e.client, pod_name.clone().unwrap_or_default());
            }
            EventKind::Grant { waited_ns, .. } => {
                out.push((pods.get(&e.client).cloned().unwrap_or_default(), *waited_ns))
            }
            _ => {}
        }
    }
    out
}

#[test]
fn a_program_that_waits_says_who_holds_the_gpu_and_when_it_got_it() {
    let arb = Arbiter::start(&["--tq", "2"]);
    let sim = format!("explain-{}", std::process::id());
    // A holds the GPU; B (KIWI_LOG=warn) and then C (default logging) wait behind it.
    // A's burst outlasts its quantum; B's and C's fit in theirs.
    let a = burst(&arb, &sim, "nb-a", "2500", None).spawn().unwrap();
    std::thread::sleep(Duration::from_millis(400));
    let b = burst(&arb, &sim, "nb-b", "800", Some("warn"))
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let c = burst(&arb, &sim, "nb-c", "800", None).spawn().unwrap();
    let (oa, ob, oc) = (finish(a), finish(b), finish(c));
    let (ea, eb, ec) = (stderr(&oa), stderr(&ob), stderr(&oc));
    let waits = waits_by_pod(&arb);
    let _ = kiwi_sim_core::machine::reset(&sim);
    let all = format!("A:\n{ea}\nB:\n{eb}\nC:\n{ec}\narbiter grants: {waits:?}");

    // C: one wait line (per wait), naming the GPU, the holder, its time left and C's
    // place.
    let waiting = lines(&ec, "waiting for GPU 0 (GPU-");
    assert!(!waiting.is_empty(), "{all}");
    let w = waiting[0];
    assert!(w.starts_with("[kiwi] info: pid "), "{all}");
    assert!(
        w.contains("): nb-a holds it, ~") && w.ends_with(" s left, 1 ahead of you"),
        "{all}"
    );
    let left = left_secs(w).unwrap_or_else(|| panic!("no time left in {w:?}"));
    assert!(left <= 2.0, "at most a quantum: {all}");
    // Then one grant line, after it.
    let granted = lines(&ec, "is ours after waiting");
    assert_eq!(granted.len(), waiting.len(), "{all}");
    let g = granted[0];
    assert!(ec.find(g) > ec.find(w), "{all}");
    let waited: f64 = g
        .split("after waiting ")
        .nth(1)
        .and_then(|r| r.split(' ').next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no wait in {g:?}"));
    assert!(waited >= 1.0, "{all}");
    assert!(
        g.contains("; swapped in ") || g.ends_with("; nothing to swap in"),
        "{all}"
    );

    // B waited more than a second too, but KIWI_LOG=warn silences both lines.
    let b_waited = waits
        .iter()
        .filter(|(p, _)| p == "nb-b")
        .map(|(_, w)| *w)
        .max()
        .unwrap_or(0);
    assert!(b_waited > 1_000_000_000, "B must have waited: {all}");
    assert!(lines(&eb, "waiting for GPU").is_empty(), "{all}");
    assert!(lines(&eb, "is ours after waiting").is_empty(), "{all}");

    // A, dropped at the end of its quantum, waited for the others: it names one of them.
    for l in lines(&ea, "waiting for GPU 0") {
        assert!(
            l.contains("nb-b holds it") || l.contains("nb-c holds it"),
            "{all}"
        );
    }
}

/// An arbiter from before `wait_info` refuses the field as malformed: the shim
/// registers again without it and runs managed (it explains its wait with less).
#[test]
fn a_shim_registers_with_an_arbiter_that_predates_wait_info() {
    use kiwi_protocol::blocking::Connection;
    use kiwi_protocol::{ArbiterMsg, ClientMsg, ErrorCode, Settings};
    use std::os::unix::net::UnixListener;

    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("client")).unwrap();
    let listener = UnixListener::bind(dir.path().join("client/arbiter.sock")).unwrap();
    // The old arbiter's decoder: `Register` refused unknown fields; everything else
    // is answered like an arbiter on a GPU where everything fits.
    listener.set_nonblocking(true).unwrap();
    let old = std::thread::spawn(move || {
        let mut refused = 0;
        let mut registered = 0;
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while std::time::Instant::now() < deadline {
            let stream = match listener.accept() {
                Ok((s, _)) => s,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                }
                Err(_) => break,
            };
            stream.set_nonblocking(false).unwrap();
            stream
                .set_read_timeout(Some(Duration::from_secs(20)))
                .unwrap();
            let mut conn: Connection<ArbiterMsg, ClientMsg> = Connection::new(stream);
            let Ok(ClientMsg::Register(r)) = conn.recv() else {
                continue;
            };
            // It predates the five fields: the shim tries with all, then without
            // `bounds`, then without `room_info`, then without `pipelined`, then
            // without `unswappable_bytes`, then without `wait_info` too.
            if r.wait_info
                || r.unswappable_bytes.is_some()
                || r.pipelined
                || r.room_info
                || r.bounds
            {
                refused += 1;
                let _ = conn.send(&ArbiterMsg::Error {
                    code: ErrorCode::Malformed,
                    message: "malformed message: unknown field `wait_info`".into(),
                });
                continue;
            }
            registered += 1;
            let _ = conn.send(&ArbiterMsg::Registered {
                client_id: 1,
                settings: Settings {
                    scheduler_on: true,
                    tq_ms: 1000,
                },
                capacity_bytes: 900 << 20,
                swap_budget_bytes: None,
            });
            while let Ok(m) = conn.recv() {
                if matches!(m, ClientMsg::Request) {
                    let _ = conn.send(&ArbiterMsg::Grant {
                        exclusive: false,
                        tq_ms: 1000,
                        waiting: 0,
                        pipelined: false,
                        group: false,
                    });
                }
            }
            return (refused, registered);
        }
        (refused, registered)
    });
    let stats = dir.path().join("stats");
    let sim = format!("explain-old-{}", std::process::id());
    let o = Command::new(kiwi_tests::bin("gpuburst"))
        .args([
            "--mem", "64MiB", "--bursts", "1", "--gpu-ms", "50", "--cpu-ms", "0",
        ])
        .env("LD_LIBRARY_PATH", sim_dir())
        .env("KIWI_SIM_NAME", &sim)
        .env("KIWI_SIM_MEMORY", "1GiB")
        .env("KIWI_SIM_CONTEXT_MEMORY", "0")
        .env("LD_PRELOAD", shim())
        .env("KIWI_SOCKET_DIR", dir.path())
        .env("KIWI_STATS", &stats)
        .env("KIWI_REQUIRE_ARBITER", "1")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let _ = kiwi_sim_core::machine::reset(&sim);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(0), "{err}");
    let (refused, registered) = old.join().unwrap();
    assert_eq!((refused, registered), (5, 1), "{err}");
    let s = std::fs::read_to_string(&stats).unwrap();
    assert!(
        s.contains("mode managed") && s.contains("gpus 1"),
        "{s}\n{err}"
    );
    assert!(!err.contains("UNMANAGED"), "{err}");
}
