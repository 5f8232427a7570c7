//! `oversub` and `fit`: two notebook-like jobs (gpuburst) on one simulated GPU, their
//! makespan under Kiwi against baselines measured in the same run.
//!
//! - `oversub`: each job needs 70% of the GPU's memory (of what two contexts leave)
//!   and spends half its time on the GPU. Baselines: the jobs one after the other (serial), and both at once
//!   without Kiwi (the second runs out of memory). A TQ sweep shows the trade-off.
//! - `fit`: each job needs 40%; Kiwi against the scheduler turned off.
//!
//! Every simulated machine here charges the costs of real hardware ([`COSTS`]).

use std::io::Read;
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

/// The costs of real hardware every benchmark's simulated machine charges, set
/// explicitly (whatever the caller's environment says); `docs/benchmarks.md` lists
/// them.
pub struct Costs {
    /// Device memory each context costs (`KIWI_SIM_CONTEXT_MEMORY`), bytes.
    pub context_memory: u64,
    /// `cuMemCreate`, µs a call (`KIWI_SIM_MEMCREATE_US`).
    pub memcreate_us: f64,
    /// `cuMemCreate`, µs per 2 MiB on top (`KIWI_SIM_MEMCREATE_US_PER_2MIB`).
    pub memcreate_us_per_2mib: f64,
    /// Page-locking host memory, GB/s (`KIWI_SIM_PIN_GBPS`).
    pub pin_gbps: f64,
    /// Each direction of a GPU's PCIe link, shared by every copy in it, GB/s
    /// (`KIWI_SIM_PCIE_GBPS`).
    pub pcie_gbps: f64,
    /// Device memory bandwidth, GB/s (`KIWI_SIM_HBM_GBPS`).
    pub hbm_gbps: f64,
}

/// The simulator's defaults: the figures of a real data-centre GPU (see
/// `docs/simulator.md` for their sources).
pub const COSTS: Costs = Costs {
    context_memory: kiwi_sim_core::knobs::DEFAULT_CONTEXT_MEMORY,
    memcreate_us: kiwi_sim_core::knobs::DEFAULT_MEMCREATE_US,
    memcreate_us_per_2mib: kiwi_sim_core::knobs::DEFAULT_MEMCREATE_US_PER_2MIB,
    pin_gbps: kiwi_sim_core::knobs::DEFAULT_PIN_GBPS,
    pcie_gbps: 25.0,
    hbm_gbps: 1000.0,
};

/// GPU memory of the machines the scheduling scenarios run on: room for two
/// contexts of [`COSTS`] and two jobs of 70% of what is left, which do not fit
/// together.
pub const GPU: u64 = 2 << 30;

/// `percent`% of the memory two processes' jobs can have on [`GPU`]: what is left
/// after both contexts.
pub fn job_mem(percent: u64) -> u64 {
    (GPU - 2 * COSTS.context_memory) / 100 * percent
}

/// One simulated machine for one measurement; its segment is removed on drop.
pub struct Sim {
    pub name: String,
    pub memory: u64,
    /// Where its kernels are traced (`KIWI_SIM_TRACE`), if anywhere.
    pub trace: Option<PathBuf>,
    /// The PCIe link's rate per direction, GB/s: [`COSTS`]' unless a scenario picks
    /// another.
    pub pcie_gbps: f64,
}

impl Sim {
    pub fn new(tag: &str, memory: u64) -> Sim {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Sim {
            name: format!("kiwi-bench-{tag}-{}-{n}", std::process::id()),
            memory,
            trace: None,
            pcie_gbps: COSTS.pcie_gbps,
        }
    }

    /// The environment of a process on this machine: its name, size and [`COSTS`].
    pub fn apply<'a>(&self, b: &Build, cmd: &'a mut Command) -> &'a mut Command {
        cmd.env("LD_LIBRARY_PATH", &b.sim_dir)
            .env("KIWI_SIM_NAME", &self.name)
            .env("KIWI_SIM_MEMORY", self.memory.to_string())
            .env("KIWI_SIM_CONTEXT_MEMORY", COSTS.context_memory.to_string())
            .env("KIWI_SIM_MEMCREATE_US", COSTS.memcreate_us.to_string())
            .env(
                "KIWI_SIM_MEMCREATE_US_PER_2MIB",
                COSTS.memcreate_us_per_2mib.to_string(),
            )
            .env("KIWI_SIM_PIN_GBPS", COSTS.pin_gbps.to_string())
            .env(
                "KIWI_SIM_PAGEABLE_H2D_GBPS",
                kiwi_sim_core::knobs::DEFAULT_PAGEABLE_H2D_GBPS.to_string(),
            )
            .env(
                "KIWI_SIM_PAGEABLE_D2H_GBPS",
                kiwi_sim_core::knobs::DEFAULT_PAGEABLE_D2H_GBPS.to_string(),
            )
            .env("KIWI_SIM_PCIE_GBPS", self.pcie_gbps.to_string())
            .env("KIWI_SIM_HBM_GBPS", COSTS.hbm_gbps.to_string());
        match &self.trace {
            Some(t) => cmd.env("KIWI_SIM_TRACE", t),
            None => cmd.env_remove("KIWI_SIM_TRACE"),
        }
    }
}

impl Sim {
    /// The machine with its GPU's memory populated from here: a GPU's memory exists
    /// before anyone allocates it, so a measured process pays no host page faults for
    /// fresh device memory (`docs/simulator.md`). For the one-GPU machines whose
    /// figures are hand-offs and swaps.
    pub fn populated(tag: &str, memory: u64) -> Result<Sim> {
        let sim = Sim::new(tag, memory);
        let cfg = kiwi_sim_core::SimConfig::from_lookup(|k| match k {
            "KIWI_SIM_NAME" => Some(sim.name.clone()),
            "KIWI_SIM_MEMORY" => Some(memory.to_string()),
            "KIWI_SIM_CONTEXT_MEMORY" => Some(COSTS.context_memory.to_string()),
            _ => None,
        })?;
        let m = kiwi_sim_core::Machine::open(&cfg)?;
        m.populate(0)?;
        Ok(sim)
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
    spawn_job_args(b, sim, job, seed, kiwi, &[], &[])
}

/// [`spawn_job`] with more environment (`env`: `KIWI_*` knobs of the shim) and more
/// gpuburst arguments (`args`: `--device`, `--exchange`).
pub fn spawn_job_args(
    b: &Build,
    sim: &Sim,
    job: Job,
    seed: u64,
    kiwi: Option<&Path>,
    env: &[(&str, &str)],
    args: &[&str],
) -> Result<Child> {
    let mut cmd = Command::new(&b.gpuburst);
    cmd.args(args);
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
        "--json",
    ])
    .env_remove("LD_PRELOAD")
    .env_remove("KIWI_GROUP")
    .stdin(Stdio::null())
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    sim.apply(b, &mut cmd);
    cmd.envs(env.iter().copied());
    if let Some(dir) = kiwi {
        cmd.env("LD_PRELOAD", &b.shim)
            .env("KIWI_SOCKET_DIR", dir)
            .env("KIWI_REQUIRE_ARBITER", "1");
    }
    Ok(cmd.spawn()?)
}

impl Job {
    /// A notebook of `mem` bytes (`oversub`, `fit`): phases of a second or more (two
    /// in a full run), since a hand-off costs an idle check (KIWI_IDLE_MS), a swap-out
    /// and a swap-in, which shorter phases cannot amortize.
    pub fn notebook(mem: u64, quick: bool) -> Job {
        Job {
            mem,
            bursts: if quick { 3 } else { 5 },
            gpu_ms: if quick { 1000 } else { 2000 },
            cpu_ms: if quick { 1000 } else { 2000 },
            idle_ms: 0,
            kernel_us: 5000,
        }
    }

    /// How long one run of two of these jobs may take at most: three times both
    /// jobs' phases back to back, and 30 s for starting up.
    pub fn limit(&self) -> Duration {
        let one = u64::from(self.bursts) * self.gpu_ms
            + u64::from(self.bursts.saturating_sub(1)) * (self.cpu_ms + self.idle_ms);
        Duration::from_millis(3 * 2 * one + 30_000)
    }
}

/// Waits for every job, at most until `deadline`; `Ok(true)` if all exited 0. Jobs
/// still running then (turns that make no progress) are killed and the run is an
/// error, so a benchmark never hangs.
pub fn wait_all(children: Vec<Child>, deadline: Instant) -> Result<(bool, String)> {
    let (ok, why, _) = wait_all_reports(children, deadline)?;
    Ok((ok, why))
}

/// [`wait_all`], and what each job printed on its standard output (its `--json`
/// report), in order.
pub fn wait_all_reports(
    children: Vec<Child>,
    deadline: Instant,
) -> Result<(bool, String, Vec<String>)> {
    let mut kids = Vec::new();
    let mut readers = Vec::new();
    let mut outs = Vec::new();
    let slurp = |r: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut s = String::new();
            if let Some(mut r) = r {
                let _ = r.read_to_string(&mut s);
            }
            s
        })
    };
    for mut c in children {
        readers.push(slurp(c.stderr.take().map(|e| Box::new(e) as _)));
        outs.push(slurp(c.stdout.take().map(|o| Box::new(o) as _)));
        kids.push(c);
    }
    let mut status = vec![None; kids.len()];
    let mut late = false;
    while status.iter().any(Option::is_none) {
        for (c, st) in kids.iter_mut().zip(status.iter_mut()) {
            if st.is_none() {
                *st = c.try_wait()?;
            }
        }
        if status.iter().any(Option::is_none) && Instant::now() > deadline {
            for c in &mut kids {
                let _ = c.kill();
                let _ = c.wait();
            }
            late = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let errs: Vec<String> = readers
        .into_iter()
        .map(|h| h.join().unwrap_or_default())
        .collect();
    let outs: Vec<String> = outs
        .into_iter()
        .map(|h| h.join().unwrap_or_default())
        .collect();
    if late {
        // What each job said last, to tell where it was stuck.
        let last = |s: &str| s.lines().rev().take(3).collect::<Vec<_>>().join(" | ");
        let said: Vec<String> = errs
            .iter()
            .zip(&outs)
            .enumerate()
            .map(|(i, (e, o))| format!("job {}: stderr: {}; report: {}", i + 1, last(e), last(o)))
            .collect();
        bail!(
            "the jobs had not finished by their deadline and were killed (turns that make no progress?); {}",
            said.join("; ")
        );
    }
    let mut ok = true;
    let mut why = String::new();
    for (st, err) in status.iter().zip(&errs) {
        if !st.is_some_and(|s| s.success()) {
            ok = false;
            why = err.lines().last().unwrap_or("").to_string();
        }
    }
    Ok((ok, why, outs))
}

/// Both jobs at once under Kiwi with `tq` (or the scheduler off): the makespan, and
/// what each job's `--json` report says (in order).
pub fn together_under_kiwi(
    b: &Build,
    job: Job,
    gpu: u64,
    tq: f64,
    scheduler_on: bool,
) -> Result<(Duration, Vec<String>)> {
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
    let (ok, why, reports) = wait_all_reports(kids, Instant::now() + job.limit())?;
    if !ok {
        bail!("a job failed under Kiwi: {why}");
    }
    Ok((t0.elapsed(), reports))
}

/// Where jobs that shared a GPU under Kiwi spent its time, from their reports: each
/// burst's work (its GPU phase less what it waited for the GPU, which holds the
/// wait for the grant and the swap-in), and the hand-offs between jobs (from one
/// job's last work to the next job's first: the holder's idle threshold, its
/// swap-out and the next one's swap-in), each job's first turn left out.
#[derive(Clone, Debug, Default)]
pub struct Shared {
    pub work: Duration,
    pub handoffs: Vec<Duration>,
}

impl Shared {
    /// Parses gpuburst's `--json` lines: each `burst` (its `wait_ms`) and the GPU
    /// `phase` after it (its clock: `start_ns`, `end_ns`).
    pub fn parse(reports: &[String]) -> Result<Shared> {
        // (work start, work end, job), in ns.
        let mut work: Vec<(u64, u64, usize)> = Vec::new();
        for (j, report) in reports.iter().enumerate() {
            let mut wait_ns = None;
            for v in report_events(report) {
                match v["event"].as_str() {
                    Some("burst") => wait_ns = v["wait_ms"].as_f64().map(|w| (w * 1e6) as u64),
                    Some("phase") if v["kind"] == "gpu" => {
                        let (Some(s), Some(e), Some(w)) =
                            (v["start_ns"].as_u64(), v["end_ns"].as_u64(), wait_ns.take())
                        else {
                            bail!("a GPU phase without its burst line: {v}");
                        };
                        work.push(((s + w).min(e), e, j));
                    }
                    _ => {}
                }
            }
        }
        if work.is_empty() {
            bail!("no GPU phase in the jobs' reports");
        }
        work.sort_unstable();
        // A job's first turn starts with its start-up (filling its memory), which the
        // ideal counts already: only hand-offs to a job that worked before count.
        let mut worked = vec![false; reports.len()];
        let mut handoffs = Vec::new();
        for w in work.windows(2) {
            let ((_, end, from), (start, _, to)) = (w[0], w[1]);
            worked[from] = true;
            if from != to && worked[to] {
                handoffs.push(Duration::from_nanos(start.saturating_sub(end)));
            }
        }
        Ok(Shared {
            work: work
                .iter()
                .map(|&(s, e, _)| Duration::from_nanos(e - s))
                .sum(),
            handoffs,
        })
    }
}

/// The JSON lines of a job's `--json` report (anything else it printed skipped).
fn report_events(report: &str) -> impl Iterator<Item = serde_json::Value> + '_ {
    report
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
}

/// What a job's `--json` report says of its run alone: how long it took to be ready
/// (start-up: context, allocation, filling), its GPU phases, and its tail (from the
/// end of its last GPU phase to its end: verification, exit).
#[derive(Clone, Debug, Default)]
pub struct Alone {
    pub startup: Duration,
    pub gpu: Vec<Duration>,
    pub tail: Duration,
}

impl Alone {
    /// Parses gpuburst's `--json` lines (`ready`, `phase`, `end`).
    pub fn parse(report: &str) -> Result<Alone> {
        let mut a = Alone::default();
        let (mut t0_ns, mut last_gpu_end_ns, mut ready_ms, mut end_ms) = (None, None, None, None);
        for v in report_events(report) {
            match v["event"].as_str() {
                Some("ready") => ready_ms = v["t_ms"].as_f64(),
                Some("phase") if v["kind"] == "gpu" => {
                    let (s, e) = (v["start_ns"].as_u64(), v["end_ns"].as_u64());
                    let (Some(s), Some(e)) = (s, e) else { continue };
                    a.gpu.push(Duration::from_nanos(e.saturating_sub(s)));
                    t0_ns.get_or_insert(s);
                    last_gpu_end_ns = Some(e);
                }
                Some("end") => end_ms = v["total_ms"].as_f64(),
                _ => {}
            }
        }
        let (Some(ready), Some(end), Some(first), Some(last)) =
            (ready_ms, end_ms, t0_ns, last_gpu_end_ns)
        else {
            bail!("a job's report lacks its ready, phase or end lines: {report:?}");
        };
        a.startup = Duration::from_secs_f64(ready / 1e3);
        // The phases' clock is CLOCK_MONOTONIC and the report's is the job's own; the
        // first GPU phase starts when the job is ready.
        let last_end_ms = ready + (last - first) as f64 / 1e6;
        a.tail = Duration::from_secs_f64((end - last_end_ms).max(0.0) / 1e3);
        Ok(a)
    }
}

/// The shortest any schedule of jobs that each ran `alone` (as measured) can take
/// on one GPU whose memory holds one job at a time: every start-up and every GPU
/// phase back to back, then the quickest tail. A start-up fills the job's memory on
/// the GPU, so it cannot overlap another job's GPU phase (their memories do not fit
/// together); every CPU phase can overlap another job's GPU phase when it is no
/// longer than that, as here. Swaps cost nothing in it.
pub fn ideal_interleave(alone: &[Alone]) -> Ideal {
    Ideal {
        startups: alone.iter().map(|a| a.startup).sum(),
        gpu: alone.iter().flat_map(|a| a.gpu.iter()).sum(),
        gpu_phases: alone.iter().map(|a| a.gpu.len()).sum(),
        tail: alone.iter().map(|a| a.tail).min().unwrap_or_default(),
    }
}

/// [`ideal_interleave`]'s parts.
#[derive(Clone, Copy, Debug)]
pub struct Ideal {
    pub startups: Duration,
    pub gpu: Duration,
    pub gpu_phases: usize,
    pub tail: Duration,
}

impl Ideal {
    pub fn total(&self) -> Duration {
        self.startups + self.gpu + self.tail
    }
}

/// Makespan of the two jobs one after the other, without Kiwi, and what each job's
/// report says of its run.
pub fn serial(b: &Build, job: Job, gpu: u64) -> Result<(Duration, Vec<Alone>)> {
    let sim = Sim::new("serial", gpu);
    let t0 = Instant::now();
    let mut alone = Vec::new();
    for seed in [1, 2] {
        let (ok, why, outs) = wait_all_reports(
            vec![spawn_job(b, &sim, job, seed, None)?],
            Instant::now() + job.limit(),
        )?;
        if !ok {
            bail!("a job failed on its own: {why}");
        }
        alone.push(Alone::parse(&outs[0])?);
    }
    Ok((t0.elapsed(), alone))
}

/// Both at once without Kiwi: whether both finished, and the makespan.
pub fn together_without_kiwi(b: &Build, job: Job, gpu: u64) -> Result<(bool, Duration, String)> {
    let sim = Sim::new("nokiwi", gpu);
    let t0 = Instant::now();
    let kids = vec![
        spawn_job(b, &sim, job, 1, None)?,
        spawn_job(b, &sim, job, 2, None)?,
    ];
    let (ok, why) = wait_all(kids, Instant::now() + job.limit())?;
    Ok((ok, t0.elapsed(), why))
}

pub fn oversub(quick: bool) -> Result<Vec<Figure>> {
    let b = Build::find()?;
    let job = Job::notebook(job_mem(70), quick);
    let tq = 5.0;
    let (serial_d, alone) = serial(&b, job, GPU)?;
    let serial_t = serial_d.as_secs_f64();
    // The first run of the two together touches ~2 GB more host memory than the
    // serial runs (one job at a time, no pinned buffers) ever held. The simulator's
    // device memory is the host's, and a host slow to fault in fresh pages (0.5 GB/s on
    // these VMs some days, where `cuMemCreate` is modelled at ~20 GB/s) then charges
    // the second job's first backing seconds that no GPU would. That run is reported
    // on its own (`makespan_kiwi_first_run`); the figures are from the next one, on
    // host memory as recently used as the serial runs'.
    let (first_d, _) = together_under_kiwi(&b, job, GPU, tq, true)?;
    let (kiwi_d, reports) = together_under_kiwi(&b, job, GPU, tq, true)?;
    let kiwi_t = kiwi_d.as_secs_f64();
    let (nok, nt, why) = together_without_kiwi(&b, job, GPU)?;
    // The best any interleaving can do, from the jobs' own runs alone in this run:
    // both start-ups, every GPU phase back to back, one tail (see `ideal_interleave`).
    let parts = ideal_interleave(&alone);
    let ideal = parts.total().as_secs_f64();
    // The issue's formula, from the nominal phases: both jobs' GPU time (2 x 5 x 2 s)
    // plus one CPU phase. gpuburst has no CPU phase after its last burst, and a GPU
    // phase of 2 s takes longer on the simulator (its kernels over the job's memory
    // really compute, on the host), so the measured bound above is the one to meet.
    let nominal = (2 * u64::from(job.bursts) * job.gpu_ms + job.cpu_ms) as f64 / 1e3;
    let shared = Shared::parse(&reports)?;
    let handoff_total: f64 = shared.handoffs.iter().map(Duration::as_secs_f64).sum();
    let mut figs = vec![
        Figure::new("oversub", "makespan_kiwi", kiwi_t, "s")
            .against(
                ideal,
                &format!(
                    "ideal interleave of these jobs as measured alone in this run, swaps free: both start-ups {:.2} s + all {} GPU phases back to back {:.2} s + the quickest tail",
                    parts.startups.as_secs_f64(),
                    parts.gpu_phases,
                    parts.gpu.as_secs_f64(),
                ),
            )
            .goal("within 5% (ratio <= 1.05)"),
        Figure::new(
            "oversub",
            "makespan_kiwi_first_run",
            first_d.as_secs_f64(),
            "s",
        )
        .against(
            ideal,
            "the ideal above; the first run of the two together, on host memory no earlier run had used",
        ),
        Figure::new("oversub", "makespan_kiwi_vs_nominal", kiwi_t, "s")
            .against(
                nominal,
                &format!(
                    "nominal: 2 x {} x {} s of GPU + one {} s CPU phase (the phases as asked, not as run)",
                    job.bursts,
                    job.gpu_ms as f64 / 1e3,
                    job.cpu_ms as f64 / 1e3
                ),
            ),
        Figure::new("oversub", "makespan_kiwi_vs_serial", kiwi_t, "s")
            .against(serial_t, "the two jobs one after the other")
            .goal("ratio <= 0.6"),
        Figure::new("oversub", "speedup_vs_serial", serial_t / kiwi_t, "x")
            .against(
                serial_t / ideal,
                "the most any interleave of these jobs could gain (serial / ideal)",
            )
            .goal(">= 1.65x (nvshare reports 1.35x)"),
        Figure::new("oversub", "handoffs", handoff_total, "s").against(
            kiwi_t - ideal,
            &format!(
                "makespan - ideal, what sharing added: {} hand-offs (first turns left out), mean {:.0} ms from one job's last GPU work to the next's first (idle threshold, swap-out, swap-in)",
                shared.handoffs.len(),
                handoff_total * 1e3 / shared.handoffs.len().max(1) as f64,
            ),
        ),
        Figure::new("oversub", "gpu_work_shared", shared.work.as_secs_f64(), "s").against(
            parts.gpu.as_secs_f64(),
            "the same GPU phases alone: shared, the other job's CPU phase and the swaps take host CPU the simulated GPU also runs on",
        ),
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
    // Not below a second: the TQ counts from the grant, the swap-in included, and
    // with real hardware's costs a swap of these jobs takes hundreds of ms, so
    // shorter turns do little else.
    let sweep: &[f64] = if quick { &[1.0] } else { &[1.0, 3.0, 30.0] };
    for &t in sweep {
        let m = together_under_kiwi(&b, job, GPU, t, true)?.0.as_secs_f64();
        figs.push(
            Figure::new("oversub", &format!("makespan_tq_{t}s"), m, "s")
                .against(serial_t, "serial"),
        );
    }
    Ok(figs)
}

pub fn fit(quick: bool) -> Result<Vec<Figure>> {
    let b = Build::find()?;
    let job = Job::notebook(job_mem(40), quick);
    let off = together_under_kiwi(&b, job, GPU, 30.0, false)?
        .0
        .as_secs_f64();
    let on = together_under_kiwi(&b, job, GPU, 30.0, true)?
        .0
        .as_secs_f64();
    Ok(vec![Figure::new("fit", "makespan_kiwi", on, "s")
        .against(off, "scheduler off")
        .goal("within 3% (ratio <= 1.03)")])
}

#[cfg(test)]
mod tests {
    use super::*;

    const REPORT: &str = r#"{"event":"ready","name":"g","pid":1,"mem_bytes":1,"allocations":1,"t_ms":500.0,"devices":1,"device_ordinals":[0]}
{"event":"burst","name":"g","index":0,"start_ms":500.0,"duration_ms":2100.0,"wait_ms":0.1,"device_wait_ms":[0.1]}
{"event":"phase","name":"g","kind":"gpu","start_ns":1000000000,"end_ns":3100000000}
{"event":"phase","name":"g","kind":"cpu","start_ns":3100000000,"end_ns":5100000000}
{"event":"phase","name":"g","kind":"gpu","start_ns":5100000000,"end_ns":7300000000}
{"event":"verify","name":"g","ok":true,"allocations":1,"devices":1}
{"event":"end","name":"g","total_ms":6900.0}"#;

    #[test]
    fn a_report_gives_start_up_gpu_phases_and_tail() {
        let a = Alone::parse(REPORT).unwrap();
        assert_eq!(a.startup, Duration::from_millis(500));
        assert_eq!(
            a.gpu,
            vec![Duration::from_millis(2100), Duration::from_millis(2200)]
        );
        // The last GPU phase ends 6.3 s after the first began, at 6800 ms of the job.
        assert_eq!(a.tail.as_millis(), 100);
        let b = Alone {
            startup: Duration::from_millis(400),
            gpu: vec![Duration::from_secs(2)],
            tail: Duration::from_millis(300),
        };
        assert_eq!(
            ideal_interleave(&[a, b]).total().as_millis(),
            900 + 6300 + 100
        );
    }

    /// One job's report: `(wait_ms, start_ns, end_ns)` of each burst's GPU phase.
    fn shared_report(bursts: &[(f64, u64, u64)]) -> String {
        bursts
            .iter()
            .map(|&(w, s, e)| {
                format!(
                    "{{\"event\":\"burst\",\"wait_ms\":{w}}}\n{{\"event\":\"phase\",\"kind\":\"gpu\",\"start_ns\":{s},\"end_ns\":{e}}}\n{{\"event\":\"phase\",\"kind\":\"cpu\",\"start_ns\":{e},\"end_ns\":{}}}",
                    e + 1
                )
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    #[test]
    fn shared_runs_split_into_work_and_hand_offs() {
        const MS: u64 = 1_000_000;
        // A works 0-2000 ms and 2500-4500 ms; B's first burst began waiting at 100 ms
        // and got the GPU 2000 ms later (work 2100-2400 ms); its second asked at
        // 4200 ms and works from 4600 ms.
        let a = shared_report(&[(0.0, 0, 2000 * MS), (0.0, 2500 * MS, 4500 * MS)]);
        let b = shared_report(&[(2000.0, 100 * MS, 2400 * MS), (400.0, 4200 * MS, 6000 * MS)]);
        let s = Shared::parse(&[a, b]).unwrap();
        assert_eq!(s.work.as_millis(), 2000 + 2000 + 300 + 1400);
        // A→B at 2000→2100 is B's first turn (its start-up); B→A at 2400→2500 and
        // A→B at 4500→4600 are hand-offs.
        assert_eq!(
            s.handoffs,
            vec![Duration::from_millis(100); 2],
            "{:?}",
            s.handoffs
        );
        assert!(Shared::parse(&["not json".into()]).is_err());
        assert!(
            Shared::parse(&[
                "{\"event\":\"phase\",\"kind\":\"gpu\",\"start_ns\":1,\"end_ns\":2}".into()
            ])
            .is_err(),
            "a phase without its burst line"
        );
    }

    #[test]
    fn a_report_without_its_phases_is_an_error() {
        assert!(Alone::parse("{\"event\":\"end\",\"total_ms\":1}").is_err());
        assert!(Alone::parse("not json").is_err());
    }
}
