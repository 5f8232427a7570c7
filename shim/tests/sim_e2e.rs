//! libkiwi.so end to end: real processes (a C program built against NVIDIA's cuda.h)
//! on the GPU simulator, preloaded with the shim, under a real `kiwi-arbiter`.
//!
//! Needs the workspace built first (`cargo build --workspace --all-targets`: the
//! simulator, the arbiter and the shim), `gcc`, and `cuda.h` (fetched once by
//! `scripts/fetch-cuda-h.sh`).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use kiwi_protocol::EventKind;
use kiwi_tests::{profile_dir, require_tool, shared_grants, Arbiter};

struct Env {
    shim: PathBuf,
    sim_dir: PathBuf,
    probe_link: PathBuf,
    probe_dlopen: PathBuf,
    _tmp: tempfile::TempDir,
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// Builds the probes; `None` (skip) when gcc is missing outside CI.
fn setup() -> Option<Env> {
    if !require_tool("gcc") {
        return None;
    }
    let profile = profile_dir();
    let shim = profile.join("libkiwi.so");
    assert!(
        shim.exists(),
        "{} is missing: run `cargo build --workspace --all-targets` first",
        shim.display()
    );
    let sim_dir = kiwi_sim_core::ensure_sim_dir(&profile).expect("simulator built");
    let out = Command::new("sh")
        .arg(workspace_root().join("scripts/fetch-cuda-h.sh"))
        .output()
        .expect("run fetch-cuda-h.sh");
    assert!(
        out.status.success(),
        "fetch-cuda-h.sh failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let include = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim().to_string());
    let tmp = tempfile::tempdir().unwrap();
    let src = workspace_root().join("shim/tests/c/probe.c");
    let probe_link = tmp.path().join("probe_link");
    let probe_dlopen = tmp.path().join("probe_dlopen");
    for (dst, extra) in [
        (
            &probe_link,
            vec![
                "-L".to_string(),
                sim_dir.display().to_string(),
                "-lcuda".into(),
            ],
        ),
        (&probe_dlopen, vec!["-DKIWI_DLOPEN".to_string()]),
    ] {
        let st = Command::new("gcc")
            .args(["-O1", "-Wall", "-Werror", "-I"])
            .arg(&include)
            .arg(&src)
            .arg("-o")
            .arg(dst)
            .args(&extra)
            .arg("-ldl")
            .status()
            .expect("gcc");
        assert!(st.success(), "compiling {}", dst.display());
    }
    Some(Env {
        shim,
        sim_dir,
        probe_link,
        probe_dlopen,
        _tmp: tmp,
    })
}

/// One probe run's configuration.
struct Run<'a> {
    env: &'a Env,
    sim_name: String,
    sim_memory: &'a str,
    /// `KIWI_SIM_CONTEXT_MEMORY`: the suite's value for the GPU's size (see
    /// `kiwi_sim_core::harness::suite_context_memory`: not 300 MiB until issue #13).
    context_memory: u64,
    socket_dir: Option<&'a Path>,
    preload: bool,
    dlopen: bool,
    args: Vec<String>,
    extra_env: Vec<(String, String)>,
    stats: PathBuf,
    trace: Option<PathBuf>,
}

impl<'a> Run<'a> {
    fn new(env: &'a Env, sim_name: &str, stats_dir: &Path, tag: &str, args: &[&str]) -> Self {
        Run {
            env,
            sim_name: format!("{sim_name}-{}", std::process::id()),
            sim_memory: "1GiB",
            context_memory: kiwi_sim_core::harness::suite_context_memory(1 << 30),
            socket_dir: None,
            preload: true,
            dlopen: false,
            args: args.iter().map(|s| s.to_string()).collect(),
            extra_env: Vec::new(),
            stats: stats_dir.join(format!("{tag}.stats")),
            trace: None,
        }
    }

    fn command(&self) -> Command {
        let exe = if self.dlopen {
            &self.env.probe_dlopen
        } else {
            &self.env.probe_link
        };
        let mut c = Command::new(exe);
        c.args(&self.args)
            .env("LD_LIBRARY_PATH", &self.env.sim_dir)
            .env("KIWI_SIM_NAME", &self.sim_name)
            .env("KIWI_SIM_MEMORY", self.sim_memory)
            .env("KIWI_SIM_CONTEXT_MEMORY", self.context_memory.to_string())
            .env("KIWI_STATS", &self.stats)
            .env("KIWI_LOG", "info")
            .env_remove("LD_PRELOAD")
            .env_remove("KIWI_REQUIRE_ARBITER")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if self.preload {
            c.env("LD_PRELOAD", &self.env.shim);
        }
        match self.socket_dir {
            Some(d) => c.env("KIWI_SOCKET_DIR", d),
            None => c.env("KIWI_SOCKET_DIR", "/nonexistent-kiwi"),
        };
        if let Some(t) = &self.trace {
            c.env("KIWI_SIM_TRACE", t);
        }
        for (k, v) in &self.extra_env {
            c.env(k, v);
        }
        c
    }

    fn spawn(&self) -> std::process::Child {
        self.command().spawn().expect("spawn probe")
    }

    fn run(&self) -> Output {
        finish(self.spawn())
    }
}

/// Waits for a child's output, killing it (and failing the test) after 300 s: a hung
/// application must fail the suite, not stall it.
fn finish(child: std::process::Child) -> Output {
    let pid = child.id() as i32;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(Duration::from_secs(300)) {
        Ok(o) => o.expect("wait for child"),
        Err(_) => {
            // SAFETY: kill(2) on our own child's pid.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            panic!("pid {pid} hung for 300 s");
        }
    }
}

fn text(o: &Output) -> String {
    format!(
        "status {:?}\n--- stdout\n{}--- stderr\n{}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn stats(path: &Path) -> HashMap<String, String> {
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| {
            panic!(
                "no shim stats at {} ({e}): the shim did not run",
                path.display()
            )
        })
        .lines()
        .filter_map(|l| l.split_once(' '))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn num(s: &HashMap<String, String>, k: &str) -> u64 {
    s.get(k)
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("stat {k} missing"))
}

/// Kernel intervals per pid from a simulator trace: (pid, start, end).
fn trace(path: &Path) -> Vec<(u32, u64, u64)> {
    trace_by_device(path)
        .into_iter()
        .map(|(pid, _, start, end)| (pid, start, end))
        .collect()
}

fn overlaps_between_pids(t: &[(u32, u64, u64)]) -> usize {
    let mut n = 0;
    for (i, a) in t.iter().enumerate() {
        for b in &t[i + 1..] {
            if a.0 != b.0 && a.1 < b.2 && b.1 < a.2 {
                n += 1;
            }
        }
    }
    n
}

/// How often consecutive kernels (in start order) belong to different processes.
fn switches(t: &[(u32, u64, u64)]) -> usize {
    let mut v = t.to_vec();
    v.sort_by_key(|r| r.1);
    v.windows(2).filter(|w| w[0].0 != w[1].0).count()
}

/// Whether the two pids' kernel activity (first start to last end) interleaved.
fn spans_interleave(t: &[(u32, u64, u64)], a: u32, b: u32) -> bool {
    let span = |p: u32| {
        let s = t.iter().filter(|r| r.0 == p).map(|r| r.1).min();
        let e = t.iter().filter(|r| r.0 == p).map(|r| r.2).max();
        s.zip(e)
    };
    match (span(a), span(b)) {
        (Some((sa, ea)), Some((sb, eb))) => sa < eb && sb < ea,
        _ => false,
    }
}

/// Prints the `swap` and `drop-latency` figures of a run (JSON lines, as kiwi-bench
/// reports them): swap throughput against the copy bandwidth the probes measured in
/// the same run, and the time from a drop to the release minus that release's swap.
/// Returns the median drop latency in ms.
fn report_swap_figures(arb: &Arbiter, outs: &[&Output]) -> Option<f64> {
    let copy: Vec<f64> = outs
        .iter()
        .filter_map(|o| {
            String::from_utf8_lossy(&o.stdout).lines().find_map(|l| {
                l.strip_prefix("copy_dtoh_bytes_per_s ")?
                    .trim()
                    .parse()
                    .ok()
            })
        })
        .collect();
    let copy_gbps = copy.iter().sum::<f64>() / copy.len().max(1) as f64 / 1e9;
    let events = arb.events();
    for (dir, pick) in [("out", true), ("in", false)] {
        let (bytes, ns) = events
            .iter()
            .filter_map(|e| match e.kind {
                EventKind::SwapOut { bytes, duration_ns } if pick => Some((bytes, duration_ns)),
                EventKind::SwapIn { bytes, duration_ns } if !pick => Some((bytes, duration_ns)),
                _ => None,
            })
            .fold((0u64, 0u64), |a, b| (a.0 + b.0, a.1 + b.1));
        if ns > 0 {
            let gbps = bytes as f64 / ns as f64;
            println!(
                "{{\"scenario\":\"swap\",\"metric\":\"swap_{dir}_gbps\",\"value\":{gbps:.3},\"unit\":\"GB/s\",\"baseline\":{copy_gbps:.3},\"ratio\":{:.3}}}",
                gbps / copy_gbps
            );
        }
    }
    // Drop → release per client, less the swap-out reported in between.
    let mut lat = Vec::new();
    for (i, e) in events.iter().enumerate() {
        if !matches!(e.kind, EventKind::Drop { .. }) {
            continue;
        }
        let mut swap = 0;
        for f in &events[i + 1..] {
            if f.client != e.client {
                continue;
            }
            match f.kind {
                EventKind::SwapOut { duration_ns, .. } => swap += duration_ns,
                EventKind::Release { .. } => {
                    lat.push((f.t_ns - e.t_ns).saturating_sub(swap) as f64 / 1e6);
                    break;
                }
                _ => {}
            }
        }
    }
    if lat.is_empty() {
        return None;
    }
    {
        lat.sort_by(|a, b| a.partial_cmp(b).unwrap());
        println!(
            "{{\"scenario\":\"drop-latency\",\"metric\":\"drop_to_release_minus_swap_ms_median\",\"value\":{:.1},\"unit\":\"ms\",\"baseline\":250,\"ratio\":{:.3}}}",
            lat[lat.len() / 2],
            lat[lat.len() / 2] / 250.0
        );
    }
    Some(lat[lat.len() / 2])
}

fn pid_of(o: &Output) -> u32 {
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("pid ").and_then(|p| p.trim().parse().ok()))
        .expect("probe printed its pid")
}

fn resolve_line(o: &Output, name: &str) -> String {
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .find(|l| l.starts_with(&format!("resolve {name} ")))
        .unwrap_or_else(|| panic!("no resolve line for {name}:\n{}", text(o)))
        .to_string()
}

/// The arbiter client id registered by `pid`.
fn client_of(arb: &Arbiter, pid: u32) -> Option<u64> {
    arb.events().iter().find_map(|e| match &e.kind {
        EventKind::Register { pid: p, .. } if *p == pid => e.client,
        _ => None,
    })
}

#[test]
fn every_path_into_the_driver_is_gated() {
    let Some(env) = setup() else { return };
    let arb = Arbiter::start(&["--tq", "1"]);
    let dir = tempfile::tempdir().unwrap();
    // (mode, dlopen build, [(resolve line name, wrapper symbol)])
    type Case<'a> = (&'a str, bool, &'a [(&'a str, &'a str)]);
    let cases: [Case; 3] = [
        (
            "link",
            false,
            &[
                ("cuLaunchKernel", "cuLaunchKernel"),
                ("cuMemAlloc", "cuMemAlloc_v2"),
            ],
        ),
        (
            "dlopen",
            true,
            &[
                ("dlsym:cuLaunchKernel", "cuLaunchKernel"),
                ("dlsym_old:cuMemAlloc_v2", "cuMemAlloc_v2"),
            ],
        ),
        (
            // Per-thread default stream requested: the _ptsz/_ptds wrappers come back.
            "procaddr",
            false,
            &[
                ("cuLaunchKernel", "cuLaunchKernel_ptsz"),
                ("cuMemcpyDtoH", "cuMemcpyDtoH_v2_ptds"),
                ("cuMemAlloc", "cuMemAlloc_v2"),
            ],
        ),
    ];
    for (mode, dlopen, expect) in cases {
        let mut run = Run::new(
            &env,
            "paths",
            dir.path(),
            mode,
            &[mode, "16", "3", "5", "5", "4"],
        );
        run.socket_dir = Some(arb.socket_dir());
        run.dlopen = dlopen;
        let o = run.run();
        assert_eq!(o.status.code(), Some(0), "{mode}: {}", text(&o));
        for (name, sym) in expect {
            assert_eq!(
                resolve_line(&o, name),
                format!("resolve {name} libkiwi.so {sym}"),
                "{mode}: {}",
                text(&o)
            );
        }
        let s = stats(&run.stats);
        assert_eq!(s["mode"], "managed", "{mode}");
        assert!(num(&s, "grants") >= 1, "{mode}: work waited for a grant");
        assert!(num(&s, "slow_submits") >= 1, "{mode}");
        // 1 fill + 4 small fills + 3 × (add, spin, checksum, copy) + final copies.
        assert!(num(&s, "submissions") >= 5 + 3 * 4, "{mode}: {s:?}");
        let pid = pid_of(&o);
        let id =
            client_of(&arb, pid).unwrap_or_else(|| panic!("{mode}: pid {pid} never registered"));
        let kinds: Vec<EventKind> = arb
            .events()
            .into_iter()
            .filter(|e| e.client == Some(id))
            .map(|e| e.kind)
            .collect();
        assert!(
            kinds.iter().any(|k| matches!(k, EventKind::Request)),
            "{mode}: {kinds:?}"
        );
        assert!(
            kinds.iter().any(|k| matches!(k, EventKind::Grant { .. })),
            "{mode}"
        );
    }

    // Control: without the shim the same program resolves the driver's own functions.
    let mut run = Run::new(
        &env,
        "paths",
        dir.path(),
        "control",
        &["link", "16", "1", "0", "0", "0"],
    );
    run.preload = false;
    let o = run.run();
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert_eq!(
        resolve_line(&o, "cuLaunchKernel"),
        "resolve cuLaunchKernel libcuda.so.1 cuLaunchKernel"
    );
    assert!(!run.stats.exists());
}

#[test]
fn two_apps_over_capacity_take_turns_and_keep_every_byte() {
    let Some(env) = setup() else { return };
    let arb = Arbiter::start(&["--tq", "0.5"]);
    let dir = tempfile::tempdir().unwrap();
    let args = ["link", "700", "3", "200", "100", "0"];
    let trace_file = dir.path().join("trace");
    let mk = |tag: &str| {
        let mut r = Run::new(&env, "over", dir.path(), tag, &args);
        r.socket_dir = Some(arb.socket_dir());
        r.trace = Some(trace_file.clone());
        r
    };
    let (ra, rb) = (mk("a"), mk("b"));
    let a = ra.spawn();
    std::thread::sleep(Duration::from_millis(300));
    let b = rb.spawn();
    let (oa, ob) = (finish(a), finish(b));
    assert_eq!(oa.status.code(), Some(0), "A: {}", text(&oa));
    assert_eq!(ob.status.code(), Some(0), "B: {}", text(&ob));
    assert!(String::from_utf8_lossy(&oa.stdout).contains("\nOK\n"));
    assert!(String::from_utf8_lossy(&ob.stdout).contains("\nOK\n"));
    let t = trace(&trace_file);
    assert!(
        t.len() >= 2 * (1 + 3 * 3),
        "trace has every kernel: {}",
        t.len()
    );
    assert_eq!(
        overlaps_between_pids(&t),
        0,
        "kernels of the two apps overlapped"
    );
    let (sa, sb) = (stats(&ra.stats), stats(&rb.stats));
    // Exclusive turns: the GPU changes hands only at a grant, never kernel by kernel.
    let grants = num(&sa, "grants") + num(&sb, "grants");
    let sw = switches(&t);
    assert!(
        sw >= 1 && sw as u64 <= grants,
        "{sw} switches for {grants} grants"
    );
    assert!(
        num(&sa, "swap_out_bytes") + num(&sb, "swap_out_bytes") >= 500 << 20,
        "someone swapped out: {sa:?} {sb:?}"
    );
    let swaps = arb
        .events()
        .iter()
        .filter(|e| matches!(e.kind, EventKind::SwapOut { .. }))
        .count();
    assert!(swaps >= 1, "the arbiter's log records the swaps");
    let _ = report_swap_figures(&arb, &[&oa, &ob]);

    // Control: the same pair without Kiwi runs out of memory.
    let trace_ctl = dir.path().join("trace-ctl");
    let mk = |tag: &str| {
        let mut r = Run::new(&env, "over-ctl", dir.path(), tag, &args);
        r.preload = false;
        r.trace = Some(trace_ctl.clone());
        r
    };
    let (ca, cb) = (mk("ca"), mk("cb"));
    let a = ca.spawn();
    std::thread::sleep(Duration::from_millis(300));
    let ob = cb.run();
    let oa = finish(a);
    let outs = format!("{}{}", text(&oa), text(&ob));
    assert!(
        outs.contains("CUDA_ERROR_OUT_OF_MEMORY"),
        "without Kiwi one of them must run out of memory: {outs}"
    );
}

#[test]
fn two_apps_that_fit_run_concurrently_without_swapping() {
    let Some(env) = setup() else { return };
    let arb = Arbiter::start(&["--tq", "0.5"]);
    let dir = tempfile::tempdir().unwrap();
    let trace_file = dir.path().join("trace");
    // Each runs ~4 s of bursts: on a cold fresh clone one of the two was once seen to
    // start its first kernel 2-3 s after its grant (cause not found; see docs/shim.md),
    // and side by side must not depend on that.
    let args = ["link", "400", "10", "400", "0", "0"];
    let mk = |tag: &str| {
        let mut r = Run::new(&env, "fit", dir.path(), tag, &args);
        r.socket_dir = Some(arb.socket_dir());
        r.trace = Some(trace_file.clone());
        r
    };
    let (ra, rb) = (mk("a"), mk("b"));
    let (a, b) = (ra.spawn(), rb.spawn());
    let (oa, ob) = (finish(a), finish(b));
    assert_eq!(oa.status.code(), Some(0), "A: {}", text(&oa));
    assert_eq!(ob.status.code(), Some(0), "B: {}", text(&ob));
    // The simulator time-slices kernels of different processes (as a GPU does), so
    // "concurrently" means their activity interleaved, under shared grants.
    let t = trace(&trace_file);
    assert!(
        spans_interleave(&t, pid_of(&oa), pid_of(&ob)),
        "they ran side by side: {t:?}\n{:#?}\nA: {}\nB: {}",
        arb.events(),
        text(&oa),
        text(&ob)
    );
    for r in [&ra, &rb] {
        let s = stats(&r.stats);
        assert_eq!(num(&s, "swap_out_bytes"), 0, "{s:?}");
        assert_eq!(num(&s, "swap_in_bytes"), 0, "{s:?}");
    }
    let events = arb.events();
    let shared = shared_grants(&events);
    assert!(shared >= 2, "both got shared grants: {events:#?}");
    assert!(!events.iter().any(|e| matches!(
        e.kind,
        EventKind::Grant {
            exclusive: true,
            ..
        }
    )));
}

#[test]
fn without_an_arbiter_the_app_runs_unmanaged_or_fails_when_required() {
    let Some(env) = setup() else { return };
    let dir = tempfile::tempdir().unwrap();
    let mut run = Run::new(
        &env,
        "noarb",
        dir.path(),
        "a",
        &["link", "8", "2", "1", "0", "2"],
    );
    run.extra_env = vec![("KIWI_ARBITER_TIMEOUT".into(), "0.3".into())];
    let t = Instant::now();
    let o = run.run();
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(
        t.elapsed() >= Duration::from_millis(300),
        "it waited for the arbiter"
    );
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("UNMANAGED"),
        "{}",
        text(&o)
    );
    assert_eq!(stats(&run.stats)["mode"], "unmanaged");

    let mut run = Run::new(
        &env,
        "noarb",
        dir.path(),
        "b",
        &["link", "8", "2", "1", "0", "0"],
    );
    run.extra_env = vec![
        ("KIWI_ARBITER_TIMEOUT".into(), "0.2".into()),
        ("KIWI_REQUIRE_ARBITER".into(), "1".into()),
    ];
    let o = run.run();
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("(802) in api.Init"),
        "{}",
        text(&o)
    );
}

#[test]
fn arbiter_restart_mid_run_the_app_reconnects_and_finishes() {
    let Some(env) = setup() else { return };
    let mut arb = Arbiter::start(&["--tq", "1"]);
    let dir = tempfile::tempdir().unwrap();
    let sock = arb.socket_dir().to_path_buf();
    let mut run = Run::new(
        &env,
        "restart",
        dir.path(),
        "a",
        &["link", "64", "12", "50", "100", "0"],
    );
    run.socket_dir = Some(&sock);
    let child = run.spawn();
    std::thread::sleep(Duration::from_millis(800));
    arb.restart_hard();
    let o = finish(child);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let s = stats(&run.stats);
    assert!(num(&s, "reconnects") >= 1, "{s:?}");
    let resumed = arb.events().iter().any(
        |e| matches!(e.kind, EventKind::Register { resumed: true, pid, .. } if pid == pid_of(&o)),
    );
    assert!(resumed, "the new arbiter saw a resumed registration");
}

#[test]
fn killed_holder_frees_the_gpu_for_the_other() {
    let Some(env) = setup() else { return };
    let arb = Arbiter::start(&["--tq", "5"]);
    let dir = tempfile::tempdir().unwrap();
    let mut ra = Run::new(
        &env,
        "kill",
        dir.path(),
        "a",
        &["link", "600", "50", "200", "0", "0"],
    );
    ra.socket_dir = Some(arb.socket_dir());
    let mut rb = Run::new(
        &env,
        "kill",
        dir.path(),
        "b",
        &["link", "600", "2", "20", "0", "0"],
    );
    rb.socket_dir = Some(arb.socket_dir());
    let mut a = ra.spawn();
    std::thread::sleep(Duration::from_millis(1500));
    let b = rb.spawn();
    std::thread::sleep(Duration::from_millis(300));
    a.kill().unwrap();
    let _ = a.wait();
    let t = Instant::now();
    let ob = finish(b);
    assert_eq!(ob.status.code(), Some(0), "B: {}", text(&ob));
    assert!(
        t.elapsed() < Duration::from_secs(30),
        "B was not stuck behind a dead holder"
    );
}

#[test]
fn forked_worker_holds_nothing() {
    let Some(env) = setup() else { return };
    let arb = Arbiter::start(&["--tq", "1"]);
    let dir = tempfile::tempdir().unwrap();
    // The child sleeps 300 ms after the fork and exits; the parent is done sooner.
    let mut run = Run::new(
        &env,
        "fork",
        dir.path(),
        "a",
        &["link", "8", "1", "0", "0", "0", "fork"],
    );
    run.socket_dir = Some(arb.socket_dir());
    let o = run.run();
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let regs = arb
        .events()
        .iter()
        .filter(|e| matches!(e.kind, EventKind::Register { .. }))
        .count();
    assert_eq!(regs, 1, "only the parent registered");
}

#[test]
fn two_apps_on_a_tiny_quantum_swap_back_and_forth() {
    let Some(env) = setup() else { return };
    // A small GPU and a tiny TQ: the two apps swap each other out over and over. A
    // kernel touching swapped-out memory would be an illegal address (exit 2); a lost
    // byte a checksum mismatch (exit 3).
    let arb = Arbiter::start(&["--tq", "0.005"]);
    let dir = tempfile::tempdir().unwrap();
    let args = ["link", "6", "400", "2", "0", "3"];
    let mk = |tag: &str| {
        let mut r = Run::new(&env, "cycles", dir.path(), tag, &args);
        r.sim_memory = "16MiB";
        r.context_memory = kiwi_sim_core::harness::suite_context_memory(16 << 20);
        r.socket_dir = Some(arb.socket_dir());
        r
    };
    // Started together, so on a loaded machine neither finishes before the other
    // has even registered (a start after the first grant could come too late).
    let (ra, rb) = (mk("a"), mk("b"));
    let (a, b) = (ra.spawn(), rb.spawn());
    let (oa, ob) = (finish(a), finish(b));
    assert_eq!(oa.status.code(), Some(0), "A: {}", text(&oa));
    assert_eq!(ob.status.code(), Some(0), "B: {}", text(&ob));
    let events = arb.events();
    let outs = events
        .iter()
        .filter(|e| matches!(e.kind, EventKind::SwapOut { .. }))
        .count();
    eprintln!("swap-outs recorded: {outs}");
    assert!(
        outs >= 5,
        "only {outs} swap cycles happened:\n{}\nA: {}\nB: {}",
        events
            .iter()
            .map(|e| format!("{} {:?} {:?}", e.t_ns / 1_000_000, e.client, e.kind))
            .collect::<Vec<_>>()
            .join("\n"),
        text(&oa),
        text(&ob)
    );
}

/// Counts of what a [`drop_every_grant`] arbiter saw.
#[derive(Debug, Default)]
struct FakeCounts {
    grants: u64,
    swap_outs: u64,
    swap_ins: u64,
    releases: u64,
}

/// A fake arbiter on `<dir>/client/arbiter.sock` for one client: every request is
/// granted, and 1 ms later the grant is dropped with "evict everything". Every turn
/// is therefore a full swap-out and swap-in.
fn drop_every_grant(dir: &Path) -> std::thread::JoinHandle<FakeCounts> {
    use kiwi_protocol::blocking::Connection;
    use kiwi_protocol::{ArbiterMsg, ClientMsg, DropReason, Settings, SwapDirection};
    std::fs::create_dir_all(dir.join("client")).unwrap();
    let listener = std::os::unix::net::UnixListener::bind(dir.join("client/arbiter.sock")).unwrap();
    std::thread::spawn(move || {
        let mut c = FakeCounts::default();
        // The shim probes the socket at cuInit (a connection that sends nothing), then
        // registers its GPU on a connection of its own: serve until a registered
        // connection ends.
        let mut registered = false;
        while !registered {
            let (stream, _) = listener.accept().unwrap();
            let mut conn: Connection<ArbiterMsg, ClientMsg> = Connection::new(stream);
            while let Ok(msg) = conn.recv() {
                let reply = match msg {
                    ClientMsg::Register(_) => {
                        registered = true;
                        vec![ArbiterMsg::Registered {
                            client_id: 1,
                            settings: Settings {
                                scheduler_on: true,
                                tq_ms: 3,
                            },
                            capacity_bytes: 1 << 30,
                            swap_budget_bytes: None,
                        }]
                    }
                    ClientMsg::Request => {
                        c.grants += 1;
                        conn.send(&ArbiterMsg::Grant {
                            exclusive: true,
                            tq_ms: 3,
                            waiting: 1,
                            pipelined: false,
                            group: false,
                        })
                        .unwrap();
                        std::thread::sleep(Duration::from_millis(1));
                        vec![ArbiterMsg::Drop {
                            need_bytes: u64::MAX,
                            reason: DropReason::TqExpired,
                        }]
                    }
                    ClientMsg::Swapped { direction, .. } => {
                        match direction {
                            SwapDirection::Out => c.swap_outs += 1,
                            SwapDirection::In => c.swap_ins += 1,
                        }
                        vec![]
                    }
                    ClientMsg::Release(_) => {
                        c.releases += 1;
                        vec![]
                    }
                    _ => vec![],
                };
                for r in reply {
                    if conn.send(&r).is_err() {
                        return c;
                    }
                }
            }
        }
        c
    })
}

#[test]
fn a_thousand_swap_cycles_never_lose_a_byte() {
    let Some(env) = setup() else { return };
    // Every burst (add, 2 ms spin, checksum, copy back) outlives a 1 ms turn, so each
    // burst starts a turn of its own, each turn a full swap-in and swap-out of 8 MiB + 3 small allocations. A kernel
    // touching swapped-out memory is an illegal address in the simulator (exit 2); a
    // lost byte is a checksum mismatch (exit 3).
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("sock");
    let arb = drop_every_grant(&sock);
    let mut run = Run::new(
        &env,
        "thousand",
        dir.path(),
        "a",
        &["link", "8", "1000", "2", "0", "3"],
    );
    run.socket_dir = Some(&sock);
    run.sim_memory = "64MiB";
    run.context_memory = kiwi_sim_core::harness::suite_context_memory(64 << 20);
    run.extra_env = vec![("KIWI_LOG".into(), "warn".into())];
    let o = run.run();
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let c = arb.join().unwrap();
    eprintln!("fake arbiter saw {c:?}");
    assert!(c.swap_outs >= 1000, "{c:?}");
    assert!(c.swap_ins >= 1000, "{c:?}");
    let s = stats(&run.stats);
    assert!(num(&s, "swap_out_bytes") >= 1000 * (8 << 20), "{s:?}");
}

#[test]
fn seed_timeline_turns_follow_the_quantum_and_idle_releases_early() {
    let Some(env) = setup() else { return };
    // The seed's two-notebook story: A runs long bursts; B asks during one and waits;
    // A's quantum passes and A is dropped; B gets the GPU, finishes its burst, goes
    // idle and releases early; A resumes. 500 + 500 MiB do not fit in 1 GiB.
    let tq_ms = 1000u64;
    let arb = Arbiter::start(&["--tq", "1"]);
    let dir = tempfile::tempdir().unwrap();
    let mut ra = Run::new(
        &env,
        "seed",
        dir.path(),
        "a",
        &["link", "500", "8", "300", "0", "0"],
    );
    ra.socket_dir = Some(arb.socket_dir());
    let mut rb = Run::new(
        &env,
        "seed",
        dir.path(),
        "b",
        &["link", "500", "1", "50", "2500", "0"],
    );
    rb.socket_dir = Some(arb.socket_dir());
    let a = ra.spawn();
    // B starts once A holds the GPU.
    let deadline = Instant::now() + Duration::from_secs(60);
    while !arb
        .events()
        .iter()
        .any(|e| matches!(e.kind, EventKind::Grant { .. }))
    {
        assert!(Instant::now() < deadline, "A never got the GPU");
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(200));
    let b = rb.spawn();
    let (oa, ob) = (finish(a), finish(b));
    assert_eq!(oa.status.code(), Some(0), "A: {}", text(&oa));
    assert_eq!(ob.status.code(), Some(0), "B: {}", text(&ob));
    let ev = arb.events();
    let (ca, cb) = (
        client_of(&arb, pid_of(&oa)).expect("A registered"),
        client_of(&arb, pid_of(&ob)).expect("B registered"),
    );
    let find = |client: u64, after: u64, f: &dyn Fn(&EventKind) -> bool| {
        ev.iter()
            .find(|e| e.client == Some(client) && e.t_ns >= after && f(&e.kind))
            .unwrap_or_else(|| panic!("event missing for client {client} after {after}: {ev:#?}"))
            .t_ns
    };
    let a_grant = find(ca, 0, &|k| matches!(k, EventKind::Grant { .. }));
    let b_request = find(cb, 0, &|k| matches!(k, EventKind::Request));
    assert!(b_request > a_grant, "B asked while A held");
    let a_drop = find(ca, b_request, &|k| {
        matches!(
            k,
            EventKind::Drop {
                reason: kiwi_protocol::DropReason::TqExpired,
                ..
            }
        )
    });
    let a_release = find(ca, a_drop, &|k| matches!(k, EventKind::Release { .. }));
    let b_grant = find(cb, b_request, &|k| matches!(k, EventKind::Grant { .. }));
    // A pipelined hand-off (issue #15) grants B once A's work is drained, while A
    // still swaps out: after A's drop, possibly before its release.
    assert!(b_grant >= a_drop, "B got the GPU only after A was dropped");
    let _ = a_release;
    let b_waited_ms = (b_grant - b_request) / 1_000_000;
    let held_ms = (a_drop - a_grant) / 1_000_000;
    assert!(
        held_ms + 150 >= tq_ms && held_ms <= tq_ms + 1500,
        "A was dropped after {held_ms} ms for a TQ of {tq_ms} ms"
    );
    // B's burst is short and B then idles 2.5 s: it must release early, long before
    // its own quantum ends, and A resumes.
    let b_release = ev
        .iter()
        .find(|e| {
            e.client == Some(cb)
                && e.t_ns > b_grant
                && matches!(e.kind, EventKind::Release { early: true, .. })
        })
        .unwrap_or_else(|| panic!("B never released early: {ev:#?}"))
        .t_ns;
    // B's early release is pipelined too: A may be granted at B's `drained`, before
    // B's release.
    let a_resume = find(ca, b_grant + 1, &|k| matches!(k, EventKind::Grant { .. }));
    let b_held_ms = (b_release - b_grant) / 1_000_000;
    let a_back_ms = a_resume.saturating_sub(b_release) / 1_000_000;
    eprintln!(
        "timeline: A held {held_ms} ms, B waited {b_waited_ms} ms, B held {b_held_ms} ms, A back {a_back_ms} ms after B's release"
    );
    assert!(
        a_back_ms < 1000,
        "A resumed {a_back_ms} ms after B released"
    );
    let b_exit = ev
        .iter()
        .find(|e| e.client == Some(cb) && matches!(e.kind, EventKind::Exit))
        .map(|e| e.t_ns)
        .unwrap_or(u64::MAX);
    assert!(
        b_release + 1_000_000_000 < b_exit,
        "B released while still alive and idle"
    );
}

#[test]
fn drop_after_ten_thousand_queued_kernels_is_short() {
    let Some(env) = setup() else { return };
    // Each burst queues 10,000 kernels of 20 µs (200 ms of GPU work) at once; the two
    // apps do not fit together, so turns end with drops in the middle of such queues.
    let arb = Arbiter::start(&["--tq", "0.3"]);
    let dir = tempfile::tempdir().unwrap();
    let mk = |tag: &str| {
        let mut r = Run::new(
            &env,
            "queued",
            dir.path(),
            tag,
            &["link", "500", "3", "0", "0", "0"],
        );
        r.socket_dir = Some(arb.socket_dir());
        r.extra_env = vec![
            ("PROBE_KERNELS".into(), "10000".into()),
            ("PROBE_SPIN_US".into(), "20".into()),
        ];
        r
    };
    let (ra, rb) = (mk("a"), mk("b"));
    let (a, b) = (ra.spawn(), rb.spawn());
    let (oa, ob) = (finish(a), finish(b));
    assert_eq!(oa.status.code(), Some(0), "A: {}", text(&oa));
    assert_eq!(ob.status.code(), Some(0), "B: {}", text(&ob));
    let median = report_swap_figures(&arb, &[&oa, &ob]).expect("at least one drop");
    assert!(
        median < 250.0,
        "drop → release took {median} ms beyond the swap"
    );
}

/// `gpuburst` (which resolves every entry point through `cuGetProcAddress_v2`) on the
/// simulator, with or without the shim.
fn gpuburst(
    env: &Env,
    sim_name: &str,
    socket: Option<&Path>,
    stats: Option<&Path>,
    trace: &Path,
) -> Command {
    let mut c = Command::new(kiwi_tests::bin("gpuburst"));
    c.args([
        "--mem", "700MiB", "--bursts", "3", "--gpu-ms", "200", "--cpu-ms", "100", "--verify",
    ])
    .env("LD_LIBRARY_PATH", &env.sim_dir)
    .env("KIWI_SIM_NAME", sim_name)
    .env("KIWI_SIM_MEMORY", "1GiB")
    .env(
        "KIWI_SIM_CONTEXT_MEMORY",
        kiwi_sim_core::harness::suite_context_memory(1 << 30).to_string(),
    )
    .env("KIWI_SIM_TRACE", trace)
    .env_remove("LD_PRELOAD")
    .stdin(Stdio::null())
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    if let (Some(sock), Some(stats)) = (socket, stats) {
        c.env("LD_PRELOAD", &env.shim)
            .env("KIWI_SOCKET_DIR", sock)
            .env("KIWI_STATS", stats);
    }
    c
}

#[test]
fn gpuburst_pair_over_capacity_takes_turns_under_kiwi_and_fails_without() {
    let Some(env) = setup() else { return };
    let arb = Arbiter::start(&["--tq", "0.5"]);
    let dir = tempfile::tempdir().unwrap();
    let name = format!("gpuburst-{}", std::process::id());
    let trace_file = dir.path().join("trace");
    let (sa, sb) = (dir.path().join("a.stats"), dir.path().join("b.stats"));
    let a = gpuburst(&env, &name, Some(arb.socket_dir()), Some(&sa), &trace_file)
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let ob = gpuburst(&env, &name, Some(arb.socket_dir()), Some(&sb), &trace_file)
        .spawn()
        .map(finish)
        .unwrap();
    let oa = finish(a);
    assert_eq!(oa.status.code(), Some(0), "A: {}", text(&oa));
    assert_eq!(ob.status.code(), Some(0), "B: {}", text(&ob));
    for (o, s) in [(&oa, &sa), (&ob, &sb)] {
        assert!(
            String::from_utf8_lossy(&o.stderr).contains("all bytes as expected")
                || String::from_utf8_lossy(&o.stdout).contains("all bytes as expected"),
            "{}",
            text(o)
        );
        let s = stats(s);
        assert!(
            num(&s, "procaddr_wrapped") > 0,
            "resolved through cuGetProcAddress_v2: {s:?}"
        );
        assert!(num(&s, "grants") >= 1, "{s:?}");
    }
    let t = trace(&trace_file);
    let grants = num(&stats(&sa), "grants") + num(&stats(&sb), "grants");
    let sw = switches(&t);
    assert!(
        sw >= 1 && sw as u64 <= grants,
        "{sw} switches for {grants} grants"
    );
    assert_eq!(overlaps_between_pids(&t), 0);
    // The simulator's physical use never passed the GPU, and both really used it.
    let usage = kiwi_sim_core::machine::Machine::open_existing(&name)
        .unwrap()
        .expect("the simulated machine")
        .usage(0)
        .unwrap();
    assert!(
        usage.peak <= usage.capacity && usage.peak >= 700 << 20,
        "peak {} of {}",
        usage.peak,
        usage.capacity
    );
    let _ = kiwi_sim_core::machine::reset(&name);

    // Control: the same pair without Kiwi runs out of memory.
    let name = format!("gpuburst-ctl-{}", std::process::id());
    let ctl_trace = dir.path().join("trace-ctl");
    let a = gpuburst(&env, &name, None, None, &ctl_trace)
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let ob = gpuburst(&env, &name, None, None, &ctl_trace)
        .spawn()
        .map(finish)
        .unwrap();
    let oa = finish(a);
    let all = format!("{}{}", text(&oa), text(&ob));
    assert!(
        oa.status.code() == Some(2) || ob.status.code() == Some(2),
        "one of them must fail without Kiwi: {all}"
    );
    assert!(all.contains("CUDA_ERROR_OUT_OF_MEMORY"), "{all}");
}

/// Kernel intervals per (pid, device) from a simulator trace: (pid, device, start, end).
fn trace_by_device(path: &Path) -> Vec<(u32, u32, u64, u64)> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            Some((
                f.first()?.parse().ok()?,
                f.get(1)?.parse().ok()?,
                f.get(2)?.parse().ok()?,
                f.get(3)?.parse().ok()?,
            ))
        })
        .collect()
}

/// gpuburst under the shim on a simulated machine of `gpus` GPUs of 1 GiB.
fn gpuburst_on(
    env: &Env,
    sim_name: &str,
    gpus: u32,
    socket: &Path,
    stats: &Path,
    trace: &Path,
    args: &[&str],
) -> Command {
    let mut c = Command::new(kiwi_tests::bin("gpuburst"));
    c.args(args)
        .env("LD_LIBRARY_PATH", &env.sim_dir)
        .env("KIWI_SIM_NAME", sim_name)
        .env("KIWI_SIM_GPUS", gpus.to_string())
        .env("KIWI_SIM_MEMORY", "1GiB")
        .env(
            "KIWI_SIM_CONTEXT_MEMORY",
            kiwi_sim_core::harness::suite_context_memory(1 << 30).to_string(),
        )
        .env("KIWI_SIM_TRACE", trace)
        .env("LD_PRELOAD", &env.shim)
        .env("KIWI_SOCKET_DIR", socket)
        .env("KIWI_STATS", stats)
        .env("KIWI_REQUIRE_ARBITER", "1")
        .env("KIWI_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c
}

#[test]
fn two_processes_on_two_gpus_in_opposite_orders_take_turns_without_deadlock() {
    let Some(env) = setup() else { return };
    let arb = Arbiter::start(&["--tq", "0.3"]);
    let dir = tempfile::tempdir().unwrap();
    let name = format!("multi-gpu-{}", std::process::id());
    let trace_file = dir.path().join("trace");
    let (sa, sb) = (dir.path().join("a.stats"), dir.path().join("b.stats"));
    // 600 MiB on each of two 1 GiB GPUs each: neither GPU fits both, so every kernel
    // needs both turns. A takes device 0 first, B device 1 first: turns taken in the
    // order of first use would deadlock (each holding one GPU, waiting for the other).
    let args = |devices: &'static str| {
        [
            "--device", devices, "--mem", "600MiB", "--bursts", "3", "--gpu-ms", "100", "--cpu-ms",
            "50", "--verify",
        ]
    };
    let started = Instant::now();
    let a = gpuburst_on(
        &env,
        &name,
        2,
        arb.socket_dir(),
        &sa,
        &trace_file,
        &args("0,1"),
    )
    .spawn()
    .unwrap();
    let b = gpuburst_on(
        &env,
        &name,
        2,
        arb.socket_dir(),
        &sb,
        &trace_file,
        &args("1,0"),
    )
    .spawn()
    .unwrap();
    let (oa, ob) = (finish(a), finish(b));
    let took = started.elapsed();
    let machine = kiwi_sim_core::machine::Machine::open_existing(&name)
        .unwrap()
        .expect("the simulated machine");
    for dev in [0, 1] {
        let u = machine.usage(dev).unwrap();
        assert!(
            u.peak <= u.capacity && u.peak >= 600 << 20,
            "GPU {dev}: peak {} of {}",
            u.peak,
            u.capacity
        );
    }
    drop(machine);
    let _ = kiwi_sim_core::machine::reset(&name);
    for (o, s) in [(&oa, &sa), (&ob, &sb)] {
        assert_eq!(o.status.code(), Some(0), "{}", text(o));
        assert!(
            String::from_utf8_lossy(&o.stdout).contains("all bytes as expected"),
            "{}",
            text(o)
        );
        let s = stats(s);
        assert_eq!(num(&s, "gpus"), 2, "a turn on each GPU: {s:?}");
        assert!(num(&s, "grants") >= 2, "{s:?}");
    }
    assert!(took < Duration::from_secs(120), "took {took:?}");

    // On each GPU the two processes' kernels never overlapped.
    let t = trace_by_device(&trace_file);
    for dev in [0, 1] {
        let on: Vec<(u32, u64, u64)> = t
            .iter()
            .filter(|r| r.1 == dev)
            .map(|r| (r.0, r.2, r.3))
            .collect();
        assert!(on.len() > 10, "device {dev}: {on:?}");
        assert_eq!(overlaps_between_pids(&on), 0, "device {dev}");
    }

    // From the arbiter's log: a process never keeps the later GPU (by UUID) while it
    // waits for the earlier one, beyond the moment it takes to give it back.
    let ev = arb.events();
    let mut gpus: Vec<String> = ev.iter().map(|e| e.gpu.clone()).collect();
    gpus.sort();
    gpus.dedup();
    gpus.retain(|g| !g.is_empty());
    assert_eq!(gpus.len(), 2, "{gpus:?}");
    let mut pid_of = HashMap::new();
    for e in &ev {
        if let (Some(c), EventKind::Register { host_pid, .. }) = (e.client, &e.kind) {
            pid_of.insert(c, *host_pid);
        }
    }
    // Per process: is it holding the later GPU, and since when is it waiting for the
    // earlier one.
    let mut holding_late: HashMap<u32, bool> = HashMap::new();
    let mut waiting_early_since: HashMap<u32, Option<u64>> = HashMap::new();
    let mut worst = 0u64;
    for e in &ev {
        let Some(pid) = e.client.and_then(|c| pid_of.get(&c)).copied() else {
            continue;
        };
        let early = e.gpu == gpus[0];
        match (&e.kind, early) {
            (EventKind::Request, true) => {
                waiting_early_since.insert(pid, Some(e.t_ns));
            }
            (EventKind::Grant { .. }, true) => {
                waiting_early_since.insert(pid, None);
            }
            (EventKind::Grant { .. }, false) => {
                holding_late.insert(pid, true);
            }
            (EventKind::Release { .. } | EventKind::Revoke | EventKind::Exit, false) => {
                holding_late.insert(pid, false);
            }
            _ => {}
        }
        if holding_late.get(&pid) == Some(&true) {
            if let Some(Some(since)) = waiting_early_since.get(&pid) {
                worst = worst.max(e.t_ns - since);
            }
        }
    }
    eprintln!(
        "longest time a process held the later GPU while waiting for the earlier: {} µs",
        worst / 1000
    );
    // A drop at TQ would break a deadlock after 300 ms; giving back at once takes a
    // drain without swapping.
    assert!(
        worst < 150_000_000,
        "held the later GPU {worst} ns while waiting"
    );
}

#[test]
fn swap_budget_refuses_growth_past_it_with_out_of_memory() {
    let Some(env) = setup() else { return };
    // Capacity of a 1 GiB GPU is 896 MiB (a 128 MiB reserve): 700 + 250 MiB needs
    // 54 MiB of host RAM, 700 + 400 MiB needs 204 MiB.
    let arb = Arbiter::start(&["--tq", "0.3", "--swap-budget", "100MiB"]);
    let dir = tempfile::tempdir().unwrap();
    let name = format!("budget-{}", std::process::id());
    let trace_file = dir.path().join("trace");
    let sa = dir.path().join("a.stats");
    let a = gpuburst_on(
        &env,
        &name,
        1,
        arb.socket_dir(),
        &sa,
        &trace_file,
        &[
            "--mem", "700MiB", "--bursts", "2", "--gpu-ms", "100", "--cpu-ms", "2500", "--verify",
        ],
    )
    .spawn()
    .unwrap();
    // Wait until A's 700 MiB are registered with the arbiter.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let st = arb.status();
        let ws: u64 = st
            .gpus
            .iter()
            .flat_map(|g| g.clients.iter())
            .map(|c| c.working_set_bytes)
            .sum();
        if ws >= 700 << 20 {
            break;
        }
        assert!(Instant::now() < deadline, "A never allocated: {st:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
    let small = [
        "--mem", "250MiB", "--bursts", "1", "--gpu-ms", "50", "--verify",
    ];
    let big = [
        "--mem", "400MiB", "--bursts", "1", "--gpu-ms", "50", "--verify",
    ];
    let sb = dir.path().join("b.stats");
    let ob = finish(
        gpuburst_on(&env, &name, 1, arb.socket_dir(), &sb, &trace_file, &big)
            .spawn()
            .unwrap(),
    );
    assert_eq!(ob.status.code(), Some(2), "past the budget: {}", text(&ob));
    let tb = text(&ob);
    assert!(tb.contains("CUDA_ERROR_OUT_OF_MEMORY"), "{tb}");
    assert!(tb.contains("swap budget"), "{tb}");
    let sc = dir.path().join("c.stats");
    let oc = finish(
        gpuburst_on(&env, &name, 1, arb.socket_dir(), &sc, &trace_file, &small)
            .spawn()
            .unwrap(),
    );
    assert_eq!(
        oc.status.code(),
        Some(0),
        "within the budget: {}",
        text(&oc)
    );
    let oa = finish(a);
    assert_eq!(oa.status.code(), Some(0), "{}", text(&oa));
    let _ = kiwi_sim_core::machine::reset(&name);
    let st = arb.status();
    assert_eq!(st.swap_budget_bytes, Some(100 << 20));
}
