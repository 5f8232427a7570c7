//! `oversub` and `fit`: two notebook-like jobs (gpuburst) on one simulated GPU, their
//! makespan under Kiwi against baselines measured in the same run.
//!
//! - `oversub`: each job needs 70% of the GPU's memory and spends half its time on
//!   the GPU. Baselines: the jobs one after the other (serial), and both at once
//!   without Kiwi (the second runs out of memory). A TQ sweep shows the trade-off.
//! - `fit`: each job needs 40%; Kiwi against the scheduler turned off.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::procs::ArbiterProc;
use crate::report::Figure;

/// Where the workspace's built programs are (next to this executable).
pub struct Build {
    pub gpuburst: PathBuf,
    pub shim: PathBuf,
    pub sim_dir: PathBuf,
}

impl Build {
    pub fn find() -> Result<Build> {
        let exe = std::env::current_exe()?;
        let dir = exe.parent().context("no exe dir")?.to_path_buf();
        let need = |n: &str| -> Result<PathBuf> {
            let p = dir.join(n);
            if !p.exists() {
                bail!(
                    "{} is missing: build the workspace first (cargo build --release)",
                    p.display()
                );
            }
            Ok(p)
        };
        let gpuburst = need("gpuburst")?;
        let shim = need("libkiwi.so")?;
        need("libkiwi_sim_cuda.so")?;
        let sim_dir = kiwi_sim_core::ensure_sim_dir(&dir)?;
        Ok(Build {
            gpuburst,
            shim,
            sim_dir,
        })
    }
}

/// One simulated machine for one measurement; its segment is removed on drop.
pub struct Sim {
    pub name: String,
    pub memory: u64,
}

impl Sim {
    pub fn new(tag: &str, memory: u64) -> Sim {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Sim {
            name: format!("kiwi-bench-{tag}-{}-{n}", std::process::id()),
            memory,
        }
    }
}

impl Drop for Sim {
    fn drop(&mut self) {
        let _ = kiwi_sim_core::machine::reset(&self.name);
    }
}

/// A job's shape.
#[derive(Clone, Copy, Debug)]
pub struct Job {
    pub mem: u64,
    pub bursts: u32,
    pub gpu_ms: u64,
    pub cpu_ms: u64,
    /// Idle time (sleeping, not computing) after each CPU phase.
    pub idle_ms: u64,
    /// Length of the burst's spin kernels.
    pub kernel_us: u64,
}

/// Starts one job; `kiwi`: preloaded shim talking to the arbiter on `socket_dir`.
pub fn spawn_job(b: &Build, sim: &Sim, job: Job, seed: u64, kiwi: Option<&Path>) -> Result<Child> {
    let mut cmd = Command::new(&b.gpuburst);
    cmd.args([
        "--mem",
        &job.mem.to_string(),
        "--bursts",
        &job.bursts.to_string(),
        "--gpu-ms",
        &job.gpu_ms.to_string(),
        "--cpu-ms",
        &job.cpu_ms.to_string(),
        "--idle-ms",
        &job.idle_ms.to_string(),
        "--seed",
        &seed.to_string(),
        "--kernel-us",
        &job.kernel_us.to_string(),
    ])
    .env("LD_LIBRARY_PATH", &b.sim_dir)
    .env("KIWI_SIM_NAME", &sim.name)
    .env("KIWI_SIM_MEMORY", sim.memory.to_string())
    // Not the simulator's 300 MiB per context: the jobs are sized for the arbiter's
    // context reserve (1/8 of the GPU), which does not yet count each client's
    // non-swappable memory (issue #13); two of these contexts fit in it.
    .env(
        "KIWI_SIM_CONTEXT_MEMORY",
        kiwi_sim_core::harness::suite_context_memory(sim.memory).to_string(),
    )
    .env_remove("LD_PRELOAD")
    .stdin(Stdio::null())
    .stdout(Stdio::null())
    .stderr(Stdio::piped());
    if let Some(dir) = kiwi {
        cmd.env("LD_PRELOAD", &b.shim)
            .env("KIWI_SOCKET_DIR", dir)
            .env("KIWI_REQUIRE_ARBITER", "1");
    }
    Ok(cmd.spawn()?)
}

/// Waits for every job; `Ok(true)` if all exited 0.
fn wait_all(children: Vec<Child>) -> Result<(bool, String)> {
    let mut ok = true;
    let mut why = String::new();
    for c in children {
        let out = c.wait_with_output()?;
        if !out.status.success() {
            ok = false;
            let err = String::from_utf8_lossy(&out.stderr);
            why = err.lines().last().unwrap_or("").to_string();
        }
    }
    Ok((ok, why))
}

/// Makespan of two jobs at once, under Kiwi with `tq` (or the scheduler off).
pub fn together_under_kiwi(
    b: &Build,
    job: Job,
    gpu: u64,
    tq: f64,
    scheduler_on: bool,
) -> Result<Duration> {
    let sim = Sim::new("kiwi", gpu);
    let extra: Vec<&str> = if scheduler_on {
        vec![]
    } else {
        vec!["--scheduler", "off"]
    };
    let arb = ArbiterProc::start(tq, &extra)?;
    let t0 = Instant::now();
    let kids = vec![
        spawn_job(b, &sim, job, 1, Some(arb.socket_dir()))?,
        spawn_job(b, &sim, job, 2, Some(arb.socket_dir()))?,
    ];
    let (ok, why) = wait_all(kids)?;
    if !ok {
        bail!("a job failed under Kiwi: {why}");
    }
    Ok(t0.elapsed())
}

/// Makespan of the two jobs one after the other, without Kiwi.
pub fn serial(b: &Build, job: Job, gpu: u64) -> Result<Duration> {
    let sim = Sim::new("serial", gpu);
    let t0 = Instant::now();
    for seed in [1, 2] {
        let (ok, why) = wait_all(vec![spawn_job(b, &sim, job, seed, None)?])?;
        if !ok {
            bail!("a job failed on its own: {why}");
        }
    }
    Ok(t0.elapsed())
}

/// Both at once without Kiwi: whether both finished, and the makespan.
pub fn together_without_kiwi(b: &Build, job: Job, gpu: u64) -> Result<(bool, Duration, String)> {
    let sim = Sim::new("nokiwi", gpu);
    let t0 = Instant::now();
    let kids = vec![
        spawn_job(b, &sim, job, 1, None)?,
        spawn_job(b, &sim, job, 2, None)?,
    ];
    let (ok, why) = wait_all(kids)?;
    Ok((ok, t0.elapsed(), why))
}

const GPU: u64 = 1 << 30;

pub fn oversub(quick: bool) -> Result<Vec<Figure>> {
    let b = Build::find()?;
    // Notebook-like phases of a second or more: a hand-off costs an idle check
    // (KIWI_IDLE_MS), a swap-out and a swap-in, which shorter phases cannot amortize.
    let job = Job {
        mem: GPU / 10 * 7,
        bursts: if quick { 3 } else { 5 },
        gpu_ms: if quick { 1000 } else { 2000 },
        cpu_ms: if quick { 1000 } else { 2000 },
        idle_ms: 0,
        kernel_us: 5000,
    };
    let tq = 5.0;
    let serial_t = serial(&b, job, GPU)?.as_secs_f64();
    let kiwi_t = together_under_kiwi(&b, job, GPU, tq, true)?.as_secs_f64();
    let (nok, nt, why) = together_without_kiwi(&b, job, GPU)?;
    let mut figs = vec![
        Figure::new("oversub", "makespan_kiwi", kiwi_t, "s")
            .against(serial_t, "the two jobs one after the other")
            .goal("ratio <= 0.67 (>= 1.5x faster than serial)"),
        Figure::new("oversub", "speedup_vs_serial", serial_t / kiwi_t, "x")
            .goal(">= 1.5x (nvshare reports 1.35x)"),
        Figure::new(
            "oversub",
            if nok {
                "makespan_no_kiwi"
            } else {
                "no_kiwi_failed_after"
            },
            nt.as_secs_f64(),
            "s",
        )
        .against(
            kiwi_t,
            &if nok {
                "Kiwi".to_string()
            } else {
                format!("Kiwi; without it: {why}")
            },
        ),
    ];
    let sweep: &[f64] = if quick {
        &[0.3]
    } else {
        &[0.2, 1.0, 3.0, 30.0]
    };
    for &t in sweep {
        let m = together_under_kiwi(&b, job, GPU, t, true)?.as_secs_f64();
        figs.push(
            Figure::new("oversub", &format!("makespan_tq_{t}s"), m, "s")
                .against(serial_t, "serial"),
        );
    }
    Ok(figs)
}

pub fn fit(quick: bool) -> Result<Vec<Figure>> {
    let b = Build::find()?;
    let job = Job {
        mem: GPU / 10 * 4,
        bursts: if quick { 3 } else { 5 },
        gpu_ms: if quick { 1000 } else { 2000 },
        cpu_ms: if quick { 1000 } else { 2000 },
        idle_ms: 0,
        kernel_us: 5000,
    };
    let off = together_under_kiwi(&b, job, GPU, 30.0, false)?.as_secs_f64();
    let on = together_under_kiwi(&b, job, GPU, 30.0, true)?.as_secs_f64();
    Ok(vec![Figure::new("fit", "makespan_kiwi", on, "s")
        .against(off, "scheduler off")
        .goal("within 3% (ratio <= 1.03)")])
}
