//! gpuburst `--exchange` (issue #41) on the plain simulator, without Kiwi: the
//! ranks of a "2-GPU job" wait on each other every step through stream memory
//! operations on a shared, device-mapped file, as NCCL ranks do without kernels.
//!
//! - two processes, rank 0 on GPU 0 and rank 1 on GPU 1, the second with far longer
//!   CPU phases: both finish and verify, and neither ends a step before the other
//!   has started it (the quick rank's steps last as long as the slow rank's cycle);
//! - one process with both ranks (`FILE:both --device 0,1`) finishes and verifies;
//! - a rank whose peer never starts fails with the timeout error (exit code 4)
//!   within its bound, and a file left by an earlier run is refused (exit code 1).
//!
//! Every child is waited for with a bound: a hang fails the test instead of stalling
//! the suite. Needs the workspace built (`cargo build --workspace --all-targets`).

use std::io::Read;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use kiwi_sim_core::harness::SimMachine;
use kiwi_tests::bin;

/// How long any gpuburst of these tests may take (a busy 2-core CI machine).
const CHILD_LIMIT: Duration = Duration::from_secs(120);

fn machine(tag: &str) -> SimMachine {
    SimMachine::new(tag, 2, 256 << 20).unwrap_or_else(|e| panic!("{e}"))
}

/// gpuburst with `args` on `m`, stdout and stderr captured.
fn gpuburst(m: &SimMachine, args: &[&str]) -> Child {
    m.apply(&mut Command::new(bin("gpuburst")))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn gpuburst")
}

/// What a finished gpuburst left.
struct Outcome {
    status: ExitStatus,
    stdout: String,
    stderr: String,
}

/// Reads `r` to its end on a thread of its own.
fn drain(mut r: impl Read + Send + 'static) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        let mut s = String::new();
        let _ = r.read_to_string(&mut s);
        s
    })
}

/// Waits for `c` at most `limit` (then kills it and fails the test).
fn finish(mut c: Child, limit: Duration) -> Outcome {
    let out_t = drain(c.stdout.take().unwrap());
    let err_t = drain(c.stderr.take().unwrap());
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(s) = c.try_wait().unwrap() {
            break s;
        }
        if Instant::now() >= deadline {
            let _ = c.kill();
            let _ = c.wait();
            panic!(
                "gpuburst (pid {}) still running after {limit:?}:\n{}\n{}",
                c.id(),
                out_t.join().unwrap(),
                err_t.join().unwrap()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Outcome {
        status,
        stdout: out_t.join().unwrap(),
        stderr: err_t.join().unwrap(),
    }
}

impl Outcome {
    fn text(&self) -> String {
        format!("{}{}", self.stdout, self.stderr)
    }

    /// The JSON lines of `event`, parsed.
    fn events(&self, event: &str) -> Vec<serde_json::Value> {
        self.stdout
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|v| v["event"] == event)
            .collect()
    }

    fn assert_verified(&self, steps: usize) {
        let t = self.text();
        assert!(self.status.success(), "{:?}: {t}", self.status);
        assert_eq!(self.events("burst").len(), steps, "{t}");
        let verify = self.events("verify");
        assert_eq!(verify.len(), 1, "{t}");
        assert_eq!(verify[0]["ok"], true, "{t}");
        let end = &self.events("end")[0];
        let step_ms = end["step_ms"].as_array().expect("step_ms");
        assert_eq!(step_ms.len(), steps, "{t}");
        assert!(end["step_p50_ms"].as_f64().unwrap() > 0.0, "{t}");
        assert!(
            end["step_max_ms"].as_f64().unwrap() >= end["step_p50_ms"].as_f64().unwrap(),
            "{t}"
        );
    }

    /// `[start_ns, end_ns]` of each GPU phase (step), in order.
    fn steps(&self) -> Vec<(u64, u64)> {
        self.events("phase")
            .iter()
            .filter(|p| p["kind"] == "gpu")
            .map(|p| {
                (
                    p["start_ns"].as_u64().unwrap(),
                    p["end_ns"].as_u64().unwrap(),
                )
            })
            .collect()
    }

    fn step_ms(&self) -> Vec<f64> {
        self.events("end")[0]["step_ms"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect()
    }
}

/// The two slots of an exchange file (rank 0's at byte 0, rank 1's at byte 64).
fn slots(file: &Path) -> (u32, u32) {
    let b = std::fs::read(file).unwrap();
    assert_eq!(b.len(), 4096, "{}", file.display());
    let at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().unwrap());
    (at(0), at(64))
}

const STEPS: usize = 4;

fn burst_args(cpu_ms: &str) -> Vec<&str> {
    vec![
        "--mem", "8MiB", "--bursts", "4", "--gpu-ms", "20", "--cpu-ms", cpu_ms, "--verify",
        "--json",
    ]
}

#[test]
fn two_ranks_on_two_gpus_wait_for_each_other_every_step() {
    let m = machine("xchg-pair");
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("job");
    let spec = |rank: &str| format!("{}:{rank}", file.display());
    let (s0, s1) = (spec("0"), spec("1"));
    // Rank 1's CPU phases are far longer: rank 0 must wait for it at every step.
    let r0 = gpuburst(
        &m,
        &[
            &burst_args("5")[..],
            &[
                "--device",
                "0",
                "--exchange",
                &s0,
                "--name",
                "r0",
                "--seed",
                "1",
            ],
            &["--exchange-timeout-ms", "30000"],
        ]
        .concat(),
    );
    let r1 = gpuburst(
        &m,
        &[
            &burst_args("200")[..],
            &[
                "--device",
                "1",
                "--exchange",
                &s1,
                "--name",
                "r1",
                "--seed",
                "2",
            ],
            &["--exchange-timeout-ms", "30000"],
        ]
        .concat(),
    );
    let (o0, o1) = (finish(r0, CHILD_LIMIT), finish(r1, CHILD_LIMIT));
    o0.assert_verified(STEPS);
    o1.assert_verified(STEPS);
    assert_eq!(
        o0.events("ready")[0]["exchange_ranks"],
        serde_json::json!([0])
    );
    assert_eq!(
        o1.events("ready")[0]["exchange_ranks"],
        serde_json::json!([1])
    );
    // Each GPU wrote its rank's last step into the shared file.
    assert_eq!(slots(&file), (STEPS as u32, STEPS as u32));

    // Neither rank ends a step before the other has started it.
    let (a, b) = (o0.steps(), o1.steps());
    assert_eq!((a.len(), b.len()), (STEPS, STEPS));
    for s in 0..STEPS {
        assert!(a[s].1 >= b[s].0, "step {s}: rank 0 {a:?}, rank 1 {b:?}");
        assert!(b[s].1 >= a[s].0, "step {s}: rank 0 {a:?}, rank 1 {b:?}");
    }
    // From its second step on, the quick rank (20 ms of GPU, 5 ms of CPU) waits out
    // the slow rank's 200 ms CPU phase in each step.
    let quick = o0.step_ms();
    for (s, ms) in quick.iter().enumerate().skip(1) {
        assert!(*ms >= 150.0, "rank 0 step {s} took {ms} ms: {quick:?}");
    }
}

#[test]
fn one_process_with_two_gpus_is_both_ranks() {
    let m = machine("xchg-both");
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("job");
    let spec = format!("{}:both", file.display());
    let c = gpuburst(
        &m,
        &[
            &burst_args("5")[..],
            &["--device", "0,1", "--exchange", &spec, "--name", "both"],
            &["--exchange-timeout-ms", "30000"],
        ]
        .concat(),
    );
    let o = finish(c, CHILD_LIMIT);
    o.assert_verified(STEPS);
    assert_eq!(
        o.events("ready")[0]["exchange_ranks"],
        serde_json::json!([0, 1])
    );
    assert_eq!(slots(&file), (STEPS as u32, STEPS as u32));
}

#[test]
fn a_rank_whose_peer_never_comes_fails_within_its_timeout() {
    let m = machine("xchg-alone");
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("job");
    let spec = format!("{}:0", file.display());
    let c = gpuburst(
        &m,
        &[
            &burst_args("5")[..],
            &["--exchange", &spec, "--exchange-timeout-ms", "2000"],
        ]
        .concat(),
    );
    let started = Instant::now();
    let o = finish(c, Duration::from_secs(60));
    let took = started.elapsed();
    let t = o.text();
    assert_eq!(o.status.code(), Some(4), "{t}");
    // The first step waited its 2 s, not much more.
    assert!(took >= Duration::from_millis(2000), "{took:?}: {t}");
    assert!(took < Duration::from_secs(30), "{took:?}: {t}");
    assert!(o.events("burst").is_empty(), "{t}");
    let err = o.stderr.trim();
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains("step 1 did not finish within 2000 ms")
            && err.contains("waiting for rank 1 (at step 0)"),
        "{err}"
    );
    // Its own write went through; the peer's slot was never written.
    assert_eq!(slots(&file), (1, 0));

    // The same file again: slot 0 holds step 1 of that run, so it is refused before
    // any GPU work.
    let c = gpuburst(&m, &[&burst_args("5")[..], &["--exchange", &spec]].concat());
    let o = finish(c, Duration::from_secs(60));
    assert_eq!(o.status.code(), Some(1), "{}", o.text());
    let err = o.stderr.trim();
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("already holds step 1"), "{err}");
}
