//! CUDA graphs and stream-ordered pools under Kiwi, through NVIDIA's CUDA runtime
//! (programs in `shim/tests/c/`, built against the runtime wheel's headers and linked
//! against its `libcudart.so.12`, fetched once by `scripts/fetch-cuda-runtime.sh`), on
//! the strict simulator (it refuses a `cuCtxSynchronize` during a capture with 900 and
//! invalidates the capture, as the real driver does), preloaded with `libkiwi.so`,
//! under a private `kiwi-arbiter`.
//!
//! Needs the workspace built (`cargo build --workspace --all-targets`), `gcc` and
//! `pip` (a failure under `CI=true`, a loud skip otherwise).

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use kiwi_protocol::EventKind;
use kiwi_sim_core::harness::{CudaRuntime, SimMachine};
use kiwi_sim_core::monotonic_ns;
use kiwi_tests::{profile_dir, Arbiter};

fn compile(rt: &CudaRuntime, dir: &Path, src: &str) -> PathBuf {
    let path = if src.starts_with("cudart_notebook") {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../sim/core/tests/c")
    } else {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/c")
    }
    .join(src);
    let exe = dir.join(src.trim_end_matches(".c"));
    rt.compile(&path, &exe).unwrap_or_else(|e| panic!("{e}"));
    exe
}

/// Waits for a child (its stdout already taken or piped), killing it after 120 s.
fn finish(child: Child) -> Output {
    let pid = child.id() as i32;
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(Duration::from_secs(120)) {
        Ok(o) => o.expect("wait for child"),
        Err(_) => {
            // SAFETY: kill(2) on our own child's pid.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            panic!("pid {pid} hung for 120 s");
        }
    }
}

fn text(o: &Output, stdout: &str) -> String {
    format!(
        "status {:?}\n--- stdout\n{}{}--- stderr\n{}",
        o.status.code(),
        stdout,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn stats(path: &Path) -> HashMap<String, u64> {
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("no shim stats at {} ({e})", path.display()))
        .lines()
        .filter_map(|l| l.split_once(' '))
        .filter_map(|(k, v)| Some((k.to_string(), v.trim().parse().ok()?)))
        .collect()
}

/// A runtime program on machine `m` under Kiwi (the arbiter in `socket_dir`).
fn command(
    rt: &CudaRuntime,
    m: &SimMachine,
    exe: &Path,
    args: &[&str],
    socket_dir: &Path,
    stats: &Path,
) -> Command {
    let shim = profile_dir().join("libkiwi.so");
    assert!(
        shim.exists(),
        "{} is missing: run `cargo build --workspace --all-targets` first",
        shim.display()
    );
    let mut c = Command::new(exe);
    m.apply_with_runtime(&mut c, rt)
        .args(args)
        .env("KIWI_STATS", stats)
        .env("KIWI_LOG", "info")
        .env("LD_PRELOAD", shim)
        .env("KIWI_SOCKET_DIR", socket_dir)
        .env_remove("KIWI_REQUIRE_ARBITER")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c
}

fn spawn(
    rt: &CudaRuntime,
    m: &SimMachine,
    exe: &Path,
    args: &[&str],
    socket_dir: &Path,
    stats: &Path,
) -> Child {
    command(rt, m, exe, args, socket_dir, stats)
        .spawn()
        .expect("spawn the runtime program")
}

/// [`spawn`] with the test start gate: the program prints `READY` once its memory is
/// filled and waits for a line on its stdin (piped).
fn spawn_gated(
    rt: &CudaRuntime,
    m: &SimMachine,
    exe: &Path,
    args: &[&str],
    socket_dir: &Path,
    stats: &Path,
) -> Child {
    command(rt, m, exe, args, socket_dir, stats)
        .env("KIWI_TEST_GATE", "1")
        .stdin(Stdio::piped())
        .spawn()
        .expect("spawn the runtime program")
}

/// Reads a child's stdout on a thread: each line with the CLOCK_MONOTONIC time it was
/// read (the arbiter's event clock), sent as it comes; the whole text at the end.
fn lines(
    child: &mut Child,
) -> (
    mpsc::Receiver<(String, u64)>,
    std::thread::JoinHandle<String>,
) {
    let out = child.stdout.take().expect("piped stdout");
    let (tx, rx) = mpsc::channel();
    let h = std::thread::spawn(move || {
        let mut all = String::new();
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            let _ = tx.send((line.clone(), monotonic_ns()));
            all.push_str(&line);
            all.push('\n');
        }
        all
    });
    (rx, h)
}

fn wait_line(rx: &mpsc::Receiver<(String, u64)>, want: &str) -> Option<u64> {
    loop {
        match rx.recv_timeout(Duration::from_secs(60)) {
            Ok((l, t)) if l == want => return Some(t),
            Ok(_) => {}
            Err(_) => return None,
        }
    }
}

/// A runtime program holds the GPU and captures 2,000 memsets and copies into a graph
/// (far past the queue bound, which would synchronize the context every `limit`
/// submissions) in the default global mode, pausing mid-capture while a second
/// program over capacity asks for the GPU, so the drop comes during the capture. The
/// capture must survive (no shim synchronization while a stream captures; captured
/// calls do not wait in the closed gate), the drop must be answered when the capture
/// ends (no revoke), and the graph replayed across turns must produce every byte.
/// On the shim before this, the queue bound's `cuCtxSynchronize` failed with 900 and
/// `cudaStreamEndCapture` with `cudaErrorStreamCaptureInvalidated`.
#[test]
fn a_graph_captured_while_another_waits_survives_the_drop_and_replays_across_turns() {
    let Some(rt) = CudaRuntime::fetch_or_skip("CUDA graph capture under Kiwi") else {
        return;
    };
    let m = SimMachine::new("capture-kiwi", 1, 1 << 30)
        .unwrap_or_else(|e| panic!("{e}"))
        .with_env("KIWI_SIM_PCIE_GBPS", "4");
    let dir = tempfile::tempdir().unwrap();
    let capture = compile(&rt, dir.path(), "cudart_capture.c");
    let notebook = compile(&rt, dir.path(), "cudart_notebook.c");
    let arb = Arbiter::start(&["--tq", "0.5"]);
    let (sa, sb) = (dir.path().join("cap.stats"), dir.path().join("nb.stats"));

    // The notebook holds the GPU first and fills its memory; the capturing program
    // comes second (the younger, so it is not a sharer dropped for the notebook's
    // growth), takes its turn, and captures while the notebook asks for the GPU:
    // the notebook's rounds start at a gate opened when the capture has begun (on a
    // loaded CI host, rounds started earlier were over before the capture began).
    let mut b = spawn_gated(
        &rt,
        &m,
        &notebook,
        &["640", "6", "300"],
        arb.socket_dir(),
        &sb,
    );
    let mut gate_b = b.stdin.take().expect("piped stdin");
    let (rx_b, reader_b) = lines(&mut b);
    assert!(
        wait_line(&rx_b, "READY").is_some(),
        "the notebook never filled its memory"
    );
    let mut a = spawn(
        &rt,
        &m,
        &capture,
        &["600", "2000", "8", "1500"],
        arb.socket_dir(),
        &sa,
    );
    let (rx, reader) = lines(&mut a);
    let capturing = wait_line(&rx, "capturing");
    writeln!(gate_b, "go").expect("open the notebook's gate");
    drop(gate_b);
    let captured = wait_line(&rx, "captured");
    let oa = finish(a);
    let out_a = reader.join().unwrap();
    let ob = finish(b);
    let out_b = reader_b.join().unwrap();
    let (ta, tb) = (text(&oa, &out_a), text(&ob, &out_b));
    assert!(capturing.is_some(), "the capture never began: {ta}");
    assert_eq!(oa.status.code(), Some(0), "capturing program: {ta}");
    assert_eq!(out_a.lines().last(), Some("OK"), "capturing program: {ta}");
    assert_eq!(ob.status.code(), Some(0), "notebook: {tb}");
    assert_eq!(out_b.lines().last(), Some("OK"), "notebook: {tb}");
    let captured = captured.expect("the capture ended");

    // The drop reached the capturing program during its capture, and was answered
    // (a release, no revoke) after the capture ended.
    let events = arb.events();
    let id_a = second_client(&events, &ta);
    let a_events: Vec<_> = events.iter().filter(|e| e.client == Some(id_a)).collect();
    let drop_t = a_events
        .iter()
        .find(|e| matches!(e.kind, EventKind::Drop { .. }))
        .map(|e| e.t_ns)
        .unwrap_or_else(|| panic!("no drop reached the capturing program: {events:#?}"));
    assert!(
        drop_t < captured,
        "the first drop came after the capture ended, so it did not test a drop during capture ({} ms after): {events:#?}",
        (drop_t - captured) / 1_000_000
    );
    let release_t = a_events
        .iter()
        .find(|e| e.t_ns > drop_t && matches!(e.kind, EventKind::Release { .. }))
        .map(|e| e.t_ns)
        .unwrap_or_else(|| panic!("the drop was never answered: {events:#?}"));
    assert!(
        !events.iter().any(|e| matches!(e.kind, EventKind::Revoke)),
        "a holder was revoked: {events:#?}"
    );
    println!(
        "drop during capture answered {} ms after the drop, {} ms after the capture ended",
        (release_t - drop_t) / 1_000_000,
        release_t.saturating_sub(captured) / 1_000_000
    );
    // The graph was replayed across turns: swapped out and granted again.
    let s = stats(&sa);
    assert!(
        s.get("grants").copied().unwrap_or(0) >= 2,
        "the capturing program held the GPU only once: {s:?}"
    );
    assert!(
        s.get("swap_out_bytes").copied().unwrap_or(0) > 0,
        "the capturing program was never swapped out: {s:?}"
    );
}

/// The arbiter's client id of the capturing program: the second to register.
fn second_client(events: &[kiwi_protocol::Event], ctx: &str) -> u64 {
    events
        .iter()
        .filter(|e| matches!(e.kind, EventKind::Register { .. }))
        .nth(1)
        .and_then(|e| e.client)
        .unwrap_or_else(|| panic!("no registration in the arbiter's log: {ctx}"))
}

/// Runs `exe` alone under Kiwi (it holds the GPU) and returns its output.
fn run_alone(
    rt: &CudaRuntime,
    tag: &str,
    exe: &Path,
    args: &[&str],
    dir: &Path,
) -> (Output, String) {
    let m = SimMachine::new(tag, 1, 1 << 30)
        .unwrap_or_else(|e| panic!("{e}"))
        .with_env("KIWI_SIM_PCIE_GBPS", "0.5");
    let arb = Arbiter::start(&["--tq", "0.5"]);
    let stats = dir.join(format!("{tag}.stats"));
    let o = finish(spawn(rt, &m, exe, args, arb.socket_dir(), &stats));
    let t = text(&o, "");
    (o, t)
}

/// `cudaFreeAsync` on a non-blocking stream while a blocking stream of the same
/// process copies 128 MiB (about 270 ms at 0.5 GB/s): the free waits for its own
/// stream only, so right after it returns the other stream is still busy, and it
/// takes a fraction of the other stream's time (printed). Every byte checked. On the
/// shim before this, the free of a large allocation synchronized the whole context
/// and so waited for the other stream's copy. Then a `cudaMallocAsync` and
/// `cudaFreeAsync` on that stream while a blocking stream captures in `GLOBAL` mode:
/// the capture survives. Before the shim waited for the free's stream in the
/// `RELAXED` capture mode, the driver refused that wait (900, a potentially unsafe
/// call; measured on an H100) and invalidated the capture.
#[test]
fn a_stream_ordered_free_waits_for_its_own_stream_only() {
    let Some(rt) = CudaRuntime::fetch_or_skip("cudaFreeAsync under Kiwi") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let exe = compile(&rt, dir.path(), "cudart_free_async.c");
    let (o, t) = run_alone(&rt, "free-async", &exe, &["128"], dir.path());
    assert_eq!(o.status.code(), Some(0), "{t}");
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("global capture OK"), "{t}");
    assert_eq!(out.lines().last(), Some("OK"), "{t}");
    let rounds: Vec<(f64, f64)> = out
        .lines()
        .filter_map(|l| {
            let v: Vec<&str> = l.split_whitespace().collect();
            match v.as_slice() {
                ["free_ms", f, "other_ms", o] => Some((f.parse().ok()?, o.parse().ok()?)),
                _ => None,
            }
        })
        .collect();
    assert_eq!(rounds.len(), 3, "{t}");
    // Not counted: the first round's free waits for its own stream's 64 MiB fills.
    for (free_ms, other_ms) in &rounds {
        println!("cudaFreeAsync took {free_ms:.1} ms while the other stream's copy took {other_ms:.1} ms");
        assert!(
            *free_ms < other_ms / 2.0,
            "the free took {free_ms} ms of the other stream's {other_ms} ms: {t}"
        );
    }
}

/// The same with the per-thread default stream (`cuMemFreeAsync_ptsz`, stream 0 is
/// the calling thread's per-thread stream), and then a free on the per-thread stream
/// while a blocking stream is captured: the free must synchronize the per-thread
/// stream, not the legacy one (the strict simulator, like the driver, refuses the
/// legacy stream during that capture and invalidates it). The capture survives and
/// its graph runs. On the shim before this, the free synchronized the legacy stream
/// and failed with `cudaErrorStreamCaptureUnsupported`.
#[test]
fn a_per_thread_stream_free_is_ordered_on_the_per_thread_stream() {
    let Some(rt) = CudaRuntime::fetch_or_skip("cudaFreeAsync per-thread under Kiwi") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let exe = compile(&rt, dir.path(), "cudart_free_async_ptsz.c");
    // The per-thread part alone, then after the rounds of the test above.
    let (o, t) = run_alone(&rt, "free-async-ptsz0", &exe, &["0"], dir.path());
    assert_eq!(o.status.code(), Some(0), "{t}");
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("per-thread OK"),
        "{t}"
    );
    let (o, t) = run_alone(&rt, "free-async-ptsz", &exe, &["128"], dir.path());
    assert_eq!(o.status.code(), Some(0), "{t}");
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("per-thread OK"), "{t}");
    assert_eq!(out.lines().last(), Some("OK"), "{t}");
}
