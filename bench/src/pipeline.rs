//! The hand-off figures of issue #15, on two notebook-like jobs (gpuburst) under
//! Kiwi on a simulated GPU charging real hardware's costs ([`crate::jobs::COSTS`]):
//!
//! - `handoff-swap`: the cold hand-off (the first ever) against a steady one, and a
//!   steady hand-off (A's drop to B's first kernel) against max(A's swap-out alone,
//!   A's swap-in alone), both measured in the same run: A taking turns with a
//!   protocol-only client that holds no memory, so each of A's swaps is the only
//!   traffic on the link;
//! - `idle-partner`: request-to-first-work of a notebook whose only partner idles
//!   past `idle_evict_seconds`, against its own swap-in;
//! - `early-release`: a holder that goes idle while another waits, from its last
//!   kernel's end to the waiter's grant, against `KIWI_IDLE_MS` (the most a holder
//!   waits; one whose pauses are short waits less, `shim/src/idle.rs`).
//!
//! Times come from the arbiter's event log and the simulator's kernel trace, both on
//! CLOCK_MONOTONIC.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use kiwi_protocol::blocking::Connection;
use kiwi_protocol::{ArbiterMsg, ClientMsg, Event, EventKind, Register, Usage};
use kiwi_sim_core::TraceRecord;

use crate::jobs::{job_mem, Build, Sim, COSTS, GPU};
use crate::procs::{self, monotonic_ns, registration, ArbiterProc};
use crate::report::{percentile, Figure};
use crate::shimbench::arbiter_events;

/// `KIWI_IDLE_MS` of every job here (the shim's default, set explicitly).
const IDLE_MS: u64 = 100;

/// A gpuburst under Kiwi, ready (its memory allocated and filled), waiting for its
/// start time on standard input.
pub(crate) struct Job {
    child: Child,
    pid: u32,
    stdin: ChildStdin,
    stderr: tempfile::NamedTempFile,
}

impl Job {
    /// Starts `script` with `mem` bytes and waits until the job is ready.
    pub(crate) fn ready(
        b: &Build,
        sim: &Sim,
        arb: &ArbiterProc,
        mem: u64,
        script: &str,
        seed: u64,
    ) -> Result<Job> {
        Self::ready_with(b, sim, arb, mem, script, seed, &[], &[])
    }

    /// [`Job::ready`] with more gpuburst arguments (`extra`) and more environment
    /// (`env`: the shim's knobs).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn ready_with(
        b: &Build,
        sim: &Sim,
        arb: &ArbiterProc,
        mem: u64,
        script: &str,
        seed: u64,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Result<Job> {
        let stderr = tempfile::NamedTempFile::new()?;
        let mut cmd = Command::new(&b.gpuburst);
        sim.apply(b, &mut cmd);
        let mut child = cmd
            .args(["--mem", &mem.to_string(), "--script", script])
            .args(["--seed", &seed.to_string(), "--name", &format!("job{seed}")])
            // Short kernels and a short queue: a drop drains in milliseconds, so the
            // hand-off measures Kiwi, not the application's queue depth.
            .args(["--kernel-us", "1000", "--queue-ms", "5"])
            .args(["--json", "--start-on-stdin"])
            .args(extra)
            .env("LD_PRELOAD", &b.shim)
            .env("KIWI_SOCKET_DIR", arb.socket_dir())
            .env("KIWI_REQUIRE_ARBITER", "1")
            .env("KIWI_IDLE_MS", IDLE_MS.to_string())
            .envs(env.iter().copied())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(stderr.reopen()?)
            .spawn()
            .context("cannot start gpuburst")?;
        let mut out = BufReader::new(child.stdout.take().context("stdout")?);
        let mut line = String::new();
        let pid = loop {
            line.clear();
            if out.read_line(&mut line)? == 0 {
                let _ = child.wait();
                bail!("a job failed before it was ready: {}", last_line(&stderr));
            }
            let v: serde_json::Value = match serde_json::from_str(line.trim()) {
                Ok(v) => v,
                Err(_) => continue,
            };
            if v["event"] == "ready" {
                break v["pid"].as_u64().context("ready without a pid")? as u32;
            }
        };
        // Its burst lines are not needed; keep the pipe from filling.
        std::thread::spawn(move || {
            let _ = std::io::copy(&mut out, &mut std::io::sink());
        });
        let stdin = child.stdin.take().context("stdin")?;
        Ok(Job {
            child,
            pid,
            stdin,
            stderr,
        })
    }

    /// Lets the job start its script at `at_ns` (CLOCK_MONOTONIC).
    pub(crate) fn go(&mut self, at_ns: u64) -> Result<()> {
        writeln!(self.stdin, "{at_ns}")?;
        Ok(())
    }

    /// Ends the job now (a holder left idling by its script).
    pub(crate) fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Waits for the job to exit, at most until `deadline` (then it is killed: turns
    /// that make no progress must not hang the benchmark).
    pub(crate) fn finish(mut self, deadline: Instant) -> Result<()> {
        let st = loop {
            if let Some(st) = self.child.try_wait()? {
                break st;
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                bail!("a job had not finished by its deadline and was killed (turns that make no progress?)");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        if !st.success() {
            bail!("a job failed: {}", last_line(&self.stderr));
        }
        Ok(())
    }
}

fn last_line(f: &tempfile::NamedTempFile) -> String {
    let mut s = String::new();
    let _ = f.reopen().and_then(|mut r| r.read_to_string(&mut s));
    s.lines().last().unwrap_or("(no output)").to_string()
}

/// What a run left behind: the arbiter's events and the simulator's kernel trace.
struct Observed {
    events: Vec<Event>,
    trace: Vec<TraceRecord>,
    pid_of: HashMap<u64, u32>,
}

impl Observed {
    fn collect(arb: &ArbiterProc, sim: &Sim) -> Result<Observed> {
        let events = arbiter_events(arb)?;
        let trace = match &sim.trace {
            Some(p) if p.exists() => kiwi_sim_core::trace::read_trace(p)?,
            _ => Vec::new(),
        };
        let pid_of = events
            .iter()
            .filter_map(|e| match (&e.kind, e.client) {
                (EventKind::Register { pid, host_pid, .. }, Some(c)) => {
                    Some((c, if *host_pid != 0 { *host_pid } else { *pid }))
                }
                _ => None,
            })
            .collect();
        Ok(Observed {
            events,
            trace,
            pid_of,
        })
    }

    fn pid(&self, client: Option<u64>) -> Option<u32> {
        self.pid_of.get(&client?).copied()
    }

    /// When `pid`'s first kernel at or after `t` started.
    fn first_kernel_from(&self, pid: u32, t: u64) -> Option<u64> {
        self.trace
            .iter()
            .filter(|r| r.pid == pid && r.start_ns >= t)
            .map(|r| r.start_ns)
            .min()
    }

    /// When `pid`'s last kernel that ended by `t` ended.
    fn last_kernel_end_by(&self, pid: u32, t: u64) -> Option<u64> {
        self.trace
            .iter()
            .filter(|r| r.pid == pid && r.end_ns <= t)
            .map(|r| r.end_ns)
            .max()
    }

    /// Each hand-off at a drop: from a drop to the first kernel of the next client
    /// granted, in ms, in the order of the log.
    fn handoffs_after_drops(&self) -> Vec<f64> {
        let mut out = Vec::new();
        for (i, e) in self.events.iter().enumerate() {
            if !matches!(e.kind, EventKind::Drop { .. }) {
                continue;
            }
            let Some(g) = self.next_grant_to_other(i, e.client) else {
                continue;
            };
            let Some(pid) = self.pid(g.client) else {
                continue;
            };
            if let Some(t) = self.first_kernel_from(pid, e.t_ns) {
                out.push(ms(t - e.t_ns));
            }
        }
        out
    }

    /// Each hand-off from `from_ns` on that no drop caused (an idle holder let a
    /// waiter go): from the holder's last kernel's end to the waiter's grant, in ms.
    fn idle_handoffs(&self, from_ns: u64) -> Vec<f64> {
        let mut lat = Vec::new();
        let mut holder: Option<(Option<u64>, bool)> = None; // (client, dropped since its grant)
        let mut asked: HashMap<Option<u64>, u64> = HashMap::new();
        for e in &self.events {
            match e.kind {
                EventKind::Request => {
                    asked.insert(e.client, e.t_ns);
                }
                EventKind::Drop { .. } => {
                    if let Some((c, dropped)) = &mut holder {
                        *dropped |= *c == e.client;
                    }
                }
                EventKind::Grant { .. } => {
                    if let Some((x, false)) = holder {
                        let waited_since = asked.get(&e.client).copied();
                        let done = self.pid(x).and_then(|p| self.last_kernel_end_by(p, e.t_ns));
                        if let (true, Some(done), Some(since)) = (x != e.client, done, waited_since)
                        {
                            if e.t_ns >= from_ns && since < done {
                                lat.push(ms(e.t_ns - done));
                            }
                        }
                    }
                    holder = Some((e.client, false));
                }
                _ => {}
            }
        }
        lat
    }

    /// The first grant after event `i` to a client other than `not`.
    fn next_grant_to_other(&self, i: usize, not: Option<u64>) -> Option<&Event> {
        self.events[i + 1..]
            .iter()
            .find(|e| matches!(e.kind, EventKind::Grant { .. }) && e.client != not)
    }
}

fn traced_sim(tag: &str, dir: &Path) -> Result<Sim> {
    let mut sim = Sim::populated(tag, GPU)?;
    sim.trace = Some(dir.join("trace"));
    Ok(sim)
}

fn ms(ns: u64) -> f64 {
    ns as f64 / 1e6
}

fn median(mut v: Vec<f64>) -> f64 {
    percentile(&mut v, 50.0)
}

/// A protocol-only client of `arb` on `sim`'s GPU 0, named `name`, wanting `mem`
/// bytes and, as a real process would, reporting a context's memory no swap frees:
/// the connection and its client id (`refused` says whose registration failed).
fn register_beside(
    arb: &ArbiterProc,
    sim: &Sim,
    mem: u64,
    name: &str,
    refused: &str,
) -> Result<(Connection<ClientMsg, ArbiterMsg>, u64)> {
    let gpu = kiwi_sim_core::ident::gpu_uuid_string(&sim.name, 0);
    let reg = Register {
        unswappable_bytes: Some(COSTS.context_memory),
        ..registration(gpu, sim.memory, mem, name)
    };
    procs::register(&arb.client_socket(), Duration::from_secs(60), reg, refused)
}

/// A's swap-out and swap-in, each alone on the link, in ms (medians, the first
/// swap-out and swap-in left out: those are cold), and the MiB moved.
fn swaps_alone(b: &Build, mem: u64, cycles: u32, pcie_gbps: f64) -> Result<(f64, f64, f64)> {
    let mut sim = Sim::populated("alone", GPU)?;
    sim.pcie_gbps = pcie_gbps;
    // A TQ well above a swap, so each of A's turns runs work after its swap-in.
    let arb = ArbiterProc::start(1.0, &[])?;
    let gpu_ms = 1500 * u64::from(cycles) + 2000;
    let mut a = Job::ready(b, &sim, &arb, mem, &format!("gpu:{gpu_ms}"), 1)?;
    a.go(monotonic_ns())?;
    // The partner: a protocol-only client of the same size that holds no memory, so
    // A's swap-out is all that happens while A is dropped, and A's swap-in all that
    // happens when A gets the GPU back. It reports a context's unswappable memory,
    // as a real partner would, so A swaps what it swaps in a real hand-off.
    let (mut c, _) = register_beside(
        &arb,
        &sim,
        mem,
        "kiwi-bench-partner",
        "the partner's registration was refused",
    )?;
    for _ in 0..cycles {
        // Let A have its turn (and swap in) first.
        std::thread::sleep(Duration::from_millis(1200));
        c.send(&ClientMsg::Request)?;
        while !matches!(c.recv()?, ArbiterMsg::Grant { .. }) {}
        std::thread::sleep(Duration::from_millis(150));
        c.send(&ClientMsg::Release(Usage {
            working_set_bytes: mem,
            resident_bytes: 0,
        }))?;
    }
    drop(c);
    a.finish(Instant::now() + Duration::from_millis(3 * gpu_ms + 30_000))?;
    let seen = Observed::collect(&arb, &sim)?;
    let (mut outs, mut ins, mut bytes) = (Vec::new(), Vec::new(), Vec::new());
    for e in &seen.events {
        match e.kind {
            EventKind::SwapOut {
                bytes: n,
                duration_ns,
            } => {
                outs.push(ms(duration_ns));
                bytes.push(n as f64 / (1u64 << 20) as f64);
            }
            EventKind::SwapIn { duration_ns, .. } => ins.push(ms(duration_ns)),
            _ => {}
        }
    }
    if outs.len() < 2 || ins.len() < 2 {
        bail!(
            "the swaps alone: {} swap-outs and {} swap-ins, need 2 of each",
            outs.len(),
            ins.len()
        );
    }
    Ok((
        median(outs[1..].to_vec()),
        median(ins[1..].to_vec()),
        median(bytes),
    ))
}

/// One run of two notebooks always wanting the GPU, with the link at `pcie_gbps`.
struct Handoffs {
    /// B's start-up hand-off, the cold one, the steady median, ms.
    first: f64,
    cold: f64,
    steady: f64,
    /// Each side's swap-out and swap-in alone (medians), MiB per hand-off.
    out_alone: f64,
    in_alone: f64,
    mib: f64,
    /// The slowest first swap-out of a notebook, and the later ones' median, ms.
    first_out: f64,
    steady_out: f64,
    n: usize,
}

fn measure_handoffs(b: &Build, mem: u64, quick: bool, pcie_gbps: f64) -> Result<Handoffs> {
    let (out_alone, in_alone, mib) = swaps_alone(b, mem, if quick { 3 } else { 5 }, pcie_gbps)?;
    // A and B always want the GPU: every hand-off is a drop at the end of a TQ. B
    // starts once A runs, so the first hand-off is the first ever: A's first
    // swap-out, B's first turn.
    let dir = tempfile::tempdir()?;
    let mut sim = traced_sim("handoff", dir.path())?;
    sim.pcie_gbps = pcie_gbps;
    // A TQ well above a swap (with the costs on, a cold one takes a second), so
    // every turn runs work: the TQ counts from the grant, swap-in included.
    let arb = ArbiterProc::start(2.0, &[])?;
    let gpu_ms: u64 = if quick { 4500 } else { 7000 };
    let script = format!("gpu:{gpu_ms}");
    let deadline = Instant::now() + Duration::from_millis(3 * 2 * gpu_ms + 60_000);
    let mut a = Job::ready(b, &sim, &arb, mem, &script, 1)?;
    a.go(monotonic_ns())?;
    std::thread::sleep(Duration::from_millis(200));
    let mut bj = Job::ready(b, &sim, &arb, mem, &script, 2)?;
    bj.go(monotonic_ns())?;
    a.finish(deadline)?;
    bj.finish(deadline)?;
    let seen = Observed::collect(&arb, &sim)?;
    let handoffs = seen.handoffs_after_drops();
    if handoffs.len() < 3 {
        bail!("only {} hand-offs were measured", handoffs.len());
    }
    // The first hand-off is B's start-up: its memory is allocated then for the first
    // time (on the simulator, fresh simulated memory also costs the host's page
    // population, which a real GPU does not pay), A swaps out for the first time.
    // The second is the first ever between two ready notebooks: B's first swap-out,
    // A's first swap-in. That one is the cold hand-off; steady is the rest.
    // Each notebook's first swap-out is also compared with its later ones: what
    // pinning ahead is for (it used to page-lock its buffers on the critical path).
    let (mut first_outs, mut later_outs) = (Vec::new(), Vec::new());
    let mut seen_out = std::collections::HashSet::new();
    for e in &seen.events {
        if let EventKind::SwapOut { duration_ns, .. } = e.kind {
            if seen_out.insert(e.client) {
                first_outs.push(duration_ns as f64 / 1e6);
            } else {
                later_outs.push(duration_ns as f64 / 1e6);
            }
        }
    }
    if first_outs.is_empty() || later_outs.is_empty() {
        bail!("no swap-outs to compare");
    }
    Ok(Handoffs {
        first: handoffs[0],
        cold: handoffs[1],
        steady: median(handoffs[2..].to_vec()),
        out_alone,
        in_alone,
        mib,
        first_out: first_outs.iter().copied().fold(0.0, f64::max),
        steady_out: median(later_outs),
        n: handoffs.len(),
    })
}

/// Issue #28's case from the H100: a notebook on a shared GPU whose working set
/// just grew by 1.5 GiB is dropped 100 ms later, when the other notebook asks. Its
/// swap-out rate, GB/s, the pinned device-to-host copy's on the same simulated
/// machine (measured right before), and the interval from the growth (A's `usage`
/// showing it) to the drop, ms, both from the arbiter's log: the swap-out cannot
/// wait for page-locking, and what was prepared from the growth on is all the time
/// it had.
fn swap_out_after_growth(b: &Build, pageable: bool, floor_mib: u64) -> Result<(f64, f64, f64)> {
    const BASE: u64 = 64 << 20;
    const GROWN: u64 = 1536 << 20;
    let sim = Sim::populated("growth", 4 << 30)?;
    let (d2h, _) = crate::shimbench::pinned_copy_rates(b, &sim)?;
    // TQ 50 ms: the drop comes as soon as the other asks.
    let floor = floor_mib.to_string();
    let arb = ArbiterProc::start(0.05, &["--swap-pool-floor-mib", &floor])?;
    // The floor populated before anything starts, as on a node some time after the
    // arbiter's start.
    let deadline = Instant::now() + Duration::from_secs(60);
    while crate::shimbench::status_at(arb.socket_dir())
        .and_then(|s| s.swap_pool)
        .is_none_or(|p| p.ready_bytes < floor_mib << 20)
    {
        if Instant::now() > deadline {
            bail!("the swap pool never populated its floor of {floor_mib} MiB");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    // The other notebook: registered from the start (the GPU is shared), idle, small.
    let (mut c, me) = register_beside(
        &arb,
        &sim,
        BASE,
        "kiwi-bench-asker",
        "the asker's registration was refused",
    )?;
    let knob = if pageable { "1" } else { "0" };
    let mut a = Job::ready_with(
        b,
        &sim,
        &arb,
        BASE,
        &format!("grow:{},gpu:1500", GROWN >> 20),
        1,
        &[],
        &[("KIWI_SWAP_PAGEABLE", knob)],
    )?;
    a.go(monotonic_ns())?;
    let deadline = Instant::now() + Duration::from_secs(30);
    let grew_at = loop {
        let grew = crate::shimbench::arbiter_events(&arb)?
            .into_iter()
            .find_map(|e| match e.kind {
                EventKind::Usage {
                    working_set_bytes, ..
                } if e.client != Some(me) && working_set_bytes >= BASE + GROWN => Some(e.t_ns),
                _ => None,
            });
        if let Some(t) = grew {
            break t;
        }
        if Instant::now() > deadline {
            bail!("A never grew");
        }
        std::thread::sleep(Duration::from_millis(2));
    };
    let ask_at = grew_at + 100_000_000;
    let now = monotonic_ns();
    if ask_at > now {
        std::thread::sleep(Duration::from_nanos(ask_at - now));
    }
    // Room for the asker's 3400 MiB beside both contexts: A swaps out about what it
    // grew by.
    let asked = Usage {
        working_set_bytes: 3400 << 20,
        resident_bytes: 0,
    };
    c.send(&ClientMsg::Usage(asked))?;
    c.send(&ClientMsg::Request)?;
    while !matches!(c.recv()?, ArbiterMsg::Grant { .. }) {}
    c.send(&ClientMsg::Release(asked))?;
    drop(c);
    a.finish(Instant::now() + Duration::from_secs(60))?;
    let events = crate::shimbench::arbiter_events(&arb)?;
    let dropped_at = events
        .iter()
        .find(|e| matches!(e.kind, EventKind::Drop { .. }) && e.t_ns > grew_at)
        .map(|e| e.t_ns)
        .context("A was never dropped")?;
    let out = events
        .iter()
        .find_map(|e| match e.kind {
            EventKind::SwapOut { bytes, duration_ns } if bytes >= GROWN / 2 && e.t_ns > grew_at => {
                Some(bytes as f64 / duration_ns.max(1) as f64)
            }
            _ => None,
        })
        .context("A never swapped out what it grew by")?;
    Ok((out, d2h, (dropped_at - grew_at) as f64 / 1e6))
}

/// How fast this host faults in fresh anonymous memory, GB/s: `bytes` populated
/// writable (`MADV_POPULATE_WRITE`) on two threads, as the shim populates a swap
/// buffer. A swap-out into buffers not prepared ahead cannot go faster.
fn host_populate_rate(bytes: usize) -> Result<f64> {
    // SAFETY: a fresh anonymous private mapping; no existing memory is affected.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            bytes,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        bail!(
            "cannot map {bytes} bytes: {}",
            std::io::Error::last_os_error()
        );
    }
    let base = p as usize;
    let half = bytes / 2;
    let t = Instant::now();
    let ok = std::thread::scope(|s| {
        let parts: Vec<_> = [0, half]
            .into_iter()
            .map(|off| {
                s.spawn(move || {
                    // SAFETY: a half of the mapping made above, which only this
                    // thread touches.
                    unsafe { libc::madvise((base + off) as *mut libc::c_void, half, 23) == 0 }
                })
            })
            .collect();
        parts.into_iter().all(|h| h.join().unwrap_or(false))
    });
    let took = t.elapsed();
    // SAFETY: the mapping made above, no longer used.
    unsafe { libc::munmap(p, bytes) };
    if !ok {
        bail!("MADV_POPULATE_WRITE refused (a kernel before 5.14)");
    }
    Ok(bytes as f64 / took.as_nanos().max(1) as f64)
}

/// The link rate at which the simulator's own copies (host `memcpy`, on this
/// machine's cores) stay below the modelled time even with one copy each way at once,
/// so the hand-off measures Kiwi's pipelining, not the host's memory bandwidth.
const MODEL_BOUND_PCIE_GBPS: f64 = 4.0;

/// The swap pool's floor in `swap_out_after_growth`: more than the growth, ready
/// before it (an operator sizes the floor for the growth a notebook may make between
/// two of its turns: `docs/install.md`).
const GROWTH_FLOOR_MIB: u64 = 2048;

pub fn handoff_swap(quick: bool) -> Result<Vec<Figure>> {
    let b = Build::find()?;
    let mem = job_mem(70);
    let h = measure_handoffs(&b, mem, quick, COSTS.pcie_gbps)?;
    let m = measure_handoffs(&b, mem, quick, MODEL_BOUND_PCIE_GBPS)?;
    // A's swap-out and B's swap-in at the rates this host's copies reach one each
    // way at once (two processes), ms: the most a pipelined hand-off could overlap
    // them at 25 GB/s, where the host, not the modelled link, sets the pace.
    let duplex = {
        let sim = Sim::new("duplex", GPU);
        let (d2h, h2d) = crate::shimbench::duplex_copy_rates(&b, &sim)?;
        let bytes = h.mib * (1u64 << 20) as f64;
        (bytes / d2h).max(bytes / h2d) / 1e6
    };
    let (growth, growth_d2h, growth_ms) = swap_out_after_growth(&b, true, GROWTH_FLOOR_MIB)?;
    let (pin_now, pin_now_d2h, pin_now_ms) = swap_out_after_growth(&b, false, GROWTH_FLOOR_MIB)?;
    let (no_floor, no_floor_d2h, no_floor_ms) = swap_out_after_growth(&b, false, 0)?;
    let populate = host_populate_rate(512 << 20)?;
    let scen = "handoff-swap";
    let pcie = COSTS.pcie_gbps;
    let slow = MODEL_BOUND_PCIE_GBPS;
    Ok(vec![
        Figure::new(scen, "cold_handoff", h.cold, "ms")
            .against(
                h.steady,
                "a steady hand-off (median); cold: the first between two ready notebooks",
            )
            .goal("ratio <= 1.2"),
        Figure::new(scen, "first_swap_out", h.first_out, "ms")
            .against(h.steady_out, "a later swap-out (median), same notebooks")
            .goal("ratio <= 1.2"),
        Figure::new(scen, "swap_out_after_growth", pin_now, "GB/s")
            .against(
                pin_now_d2h,
                &format!("pinned device-to-host copy, same simulated machine; on a shared GPU the notebook grew by 1.5 GiB and was dropped {pin_now_ms:.0} ms later: the swap pool's slices page-locked from the growth on, the rest on the critical path; pool floor {GROWTH_FLOOR_MIB} MiB, populated before"),
            )
            .goal("ratio >= 0.8"),
        Figure::new(scen, "swap_out_after_growth_no_floor", no_floor, "GB/s").against(
            no_floor_d2h,
            &format!("pinned device-to-host copy; the same case (dropped {no_floor_ms:.0} ms after the growth) with no pool floor (the default): the pool populates as working sets grow, so most of the 1.5 GiB is fresh memory when the drop comes"),
        ),
        Figure::new(scen, "swap_out_after_growth_pageable", growth, "GB/s").against(
            growth_d2h,
            &format!("pinned device-to-host copy; the same case as swap_out_after_growth (dropped {growth_ms:.0} ms after the growth) with KIWI_SWAP_PAGEABLE=1: unready segments copied into pageable memory, registered after"),
        ),
        Figure::new(scen, "host_populate", populate, "GB/s").against(
            pin_now_d2h,
            "pinned device-to-host copy: what fresh host memory costs to fault in on this host (2 threads), the bound of a swap-out into buffers not prepared",
        ),
        Figure::new(scen, "handoff_at_newcomer_start", h.first, "ms").against(
            h.steady,
            "a steady hand-off (median); includes the newcomer's first allocation",
        ),
        Figure::new(scen, "steady_handoff", h.steady, "ms")
            .against(
                h.out_alone.max(h.in_alone),
                &format!("max(swap-out alone, swap-in alone), median, same run; PCIe {pcie} GB/s: the host's memcpy, not the link, sets the pace"),
            )
            .goal("ratio <= 1.2"),
        Figure::new(scen, "steady_handoff_vs_duplex", h.steady, "ms").against(
            duplex,
            &format!("the same swaps at the rates this host copies one way each at once (two processes, same run); PCIe {pcie} GB/s"),
        ),
        Figure::new(scen, "steady_handoff_model_bound", m.steady, "ms")
            .against(
                m.out_alone.max(m.in_alone),
                &format!("max(swap-out alone, swap-in alone), median, same run; PCIe {slow} GB/s: the modelled link sets the pace"),
            )
            .goal("ratio <= 1.2"),
        Figure::new(scen, "cold_handoff_model_bound", m.cold, "ms")
            .against(m.steady, &format!("a steady hand-off (median), PCIe {slow} GB/s"))
            .goal("ratio <= 1.2"),
        Figure::new(scen, "swap_out_alone", h.out_alone, "ms"),
        Figure::new(scen, "swap_in_alone", h.in_alone, "ms"),
        Figure::new(scen, "swapped_per_handoff", h.mib, "MiB"),
        Figure::new(scen, "handoffs_measured", (h.n + m.n) as f64, "n"),
    ])
}

pub fn idle_partner(quick: bool) -> Result<Vec<Figure>> {
    let b = Build::find()?;
    let mem = job_mem(70);
    let dir = tempfile::tempdir()?;
    let sim = traced_sim("idlepartner", dir.path())?;
    // Idle eviction after 1 s: A computes once, then idles; B, idle until then,
    // asks for the GPU after A has been idle long enough to be evicted.
    let arb = ArbiterProc::start(5.0, &["--idle-evict-ms", "1000"])?;
    let (a_idle, b_idle) = if quick { (4000, 2500) } else { (6000, 4000) };
    let deadline = Instant::now() + Duration::from_millis(3 * (a_idle + 300) + 60_000);
    let mut a = Job::ready(&b, &sim, &arb, mem, &format!("gpu:300,idle:{a_idle}"), 1)?;
    let mut bj = Job::ready(&b, &sim, &arb, mem, &format!("idle:{b_idle},gpu:300"), 2)?;
    let start = monotonic_ns() + 50_000_000;
    a.go(start)?;
    bj.go(start)?;
    let b_pid = bj.pid;
    a.finish(deadline)?;
    bj.finish(deadline)?;
    let seen = Observed::collect(&arb, &sim)?;
    let b_client = seen
        .pid_of
        .iter()
        .find(|(_, p)| **p == b_pid)
        .map(|(c, _)| *c);
    let req = seen
        .events
        .iter()
        .find(|e| {
            e.client == b_client
                && e.t_ns >= start + b_idle * 1_000_000
                && matches!(e.kind, EventKind::Request)
        })
        .context("B's request after its idle phase is not in the event log")?;
    let first = seen
        .first_kernel_from(b_pid, req.t_ns)
        .context("B ran no kernel after its request")?;
    let swap_in = seen
        .events
        .iter()
        .find_map(|e| match e.kind {
            EventKind::SwapIn { duration_ns, .. } if e.client == b_client && e.t_ns >= req.t_ns => {
                Some(ms(duration_ns))
            }
            _ => None,
        })
        .unwrap_or(0.0);
    let evictions = seen
        .events
        .iter()
        .filter(|e| matches!(e.kind, EventKind::Reclaim { idle: true, .. }))
        .count();
    let rtfw = ms(first - req.t_ns);
    let scen = "idle-partner";
    Ok(vec![
        Figure::new(scen, "request_to_first_work", rtfw, "ms")
            .against(swap_in, "its own swap-in")
            .goal("<= swap-in + 10 ms"),
        Figure::new(scen, "beyond_own_swap_in", rtfw - swap_in, "ms").goal("<= 10 ms"),
        Figure::new(scen, "idle_evictions", evictions as f64, "n").goal(">= 1"),
    ])
}

pub fn early_release(quick: bool) -> Result<Vec<Figure>> {
    let b = Build::find()?;
    let mem = job_mem(70);
    let dir = tempfile::tempdir()?;
    let sim = traced_sim("early", dir.path())?;
    // A TQ no turn reaches: every hand-off is an early release by an idle holder
    // while the other waits.
    let arb = ArbiterProc::start(30.0, &[])?;
    let rounds = if quick { 4 } else { 10 };
    let script = vec!["gpu:150,idle:350"; rounds].join(",");
    let deadline = Instant::now() + Duration::from_millis(3 * 2 * 500 * rounds as u64 + 60_000);
    let mut a = Job::ready(&b, &sim, &arb, mem, &script, 1)?;
    let mut bj = Job::ready(&b, &sim, &arb, mem, &script, 2)?;
    let start = monotonic_ns() + 50_000_000;
    a.go(start)?;
    bj.go(start)?;
    a.finish(deadline)?;
    bj.finish(deadline)?;
    let mut lat = Observed::collect(&arb, &sim)?.idle_handoffs(start);
    if lat.is_empty() {
        bail!("no early release handed the GPU to a waiter");
    }
    let n = lat.len();
    let scen = "early-release";
    Ok(vec![
        Figure::new(scen, "idle_to_grant_p99", percentile(&mut lat, 99.0), "ms")
            .against(
                IDLE_MS as f64,
                "KIWI_IDLE_MS: the most a holder idles before releasing; its learned threshold is shorter",
            )
            .goal("<= KIWI_IDLE_MS + 20 ms"),
        Figure::new(scen, "idle_to_grant_p50", percentile(&mut lat, 50.0), "ms")
            .against(IDLE_MS as f64, "KIWI_IDLE_MS"),
        Figure::new(scen, "early_releases_measured", n as f64, "n"),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiwi_protocol::DropReason;

    const MS: u64 = 1_000_000;

    fn ev(t_ms: u64, client: u64, kind: EventKind) -> Event {
        Event {
            seq: 0,
            t_ns: t_ms * MS,
            gpu: "GPU-x".into(),
            client: Some(client),
            kind,
        }
    }

    fn reg(client: u64, pid: u32) -> Event {
        ev(
            0,
            client,
            EventKind::Register {
                pid,
                host_pid: pid,
                name: None,
                pod_name: None,
                pod_namespace: None,
                working_set_bytes: 1,
                resumed: false,
            },
        )
    }

    fn grant(t: u64, c: u64) -> Event {
        ev(
            t,
            c,
            EventKind::Grant {
                exclusive: true,
                waited_ns: 0,
            },
        )
    }

    fn drop_(t: u64, c: u64) -> Event {
        ev(
            t,
            c,
            EventKind::Drop {
                need_bytes: 0,
                reason: DropReason::TqExpired,
            },
        )
    }

    fn release(t: u64, c: u64) -> Event {
        ev(
            t,
            c,
            EventKind::Release {
                early: true,
                resident_bytes: 0,
            },
        )
    }

    fn kernel(pid: u32, start_ms: u64, end_ms: u64) -> TraceRecord {
        TraceRecord {
            pid,
            device: 0,
            start_ns: start_ms * MS,
            end_ns: end_ms * MS,
            name: "kiwi_spin".into(),
        }
    }

    fn observed(events: Vec<Event>, trace: Vec<TraceRecord>) -> Observed {
        let pid_of = [(1, 100), (2, 200)].into_iter().collect();
        Observed {
            events,
            trace,
            pid_of,
        }
    }

    /// A drop's hand-off ends at the next holder's first kernel, whoever's grant
    /// and events come in between.
    #[test]
    fn handoffs_run_from_the_drop_to_the_next_holders_first_kernel() {
        let seen = observed(
            vec![
                reg(1, 100),
                reg(2, 200),
                grant(0, 1),
                ev(10, 2, EventKind::Request),
                drop_(100, 1),
                grant(150, 2),
                release(160, 1),
                drop_(500, 2),
                grant(560, 1),
            ],
            vec![
                kernel(100, 0, 99),
                kernel(200, 180, 190),
                kernel(200, 200, 210),
                kernel(100, 600, 610),
            ],
        );
        assert_eq!(seen.handoffs_after_drops(), vec![80.0, 100.0]);
    }

    /// An idle holder's hand-off runs from its last kernel's end to the waiter's
    /// grant, even when the grant comes before the holder's release (pipelined);
    /// a hand-off at a drop, or to a client that asked only after the holder's
    /// last kernel, is none.
    #[test]
    fn idle_handoffs_count_only_waiters_of_an_idle_holder() {
        let seen = observed(
            vec![
                reg(1, 100),
                reg(2, 200),
                grant(0, 1),
                ev(50, 2, EventKind::Request),
                grant(310, 2),
                release(400, 1),
                ev(450, 1, EventKind::Request),
                drop_(600, 2),
                grant(700, 1),
                release(720, 2),
                ev(950, 2, EventKind::Request),
                grant(1000, 2),
            ],
            vec![
                kernel(100, 0, 200),
                kernel(200, 320, 590),
                kernel(100, 710, 900),
            ],
        );
        let lat = seen.idle_handoffs(0);
        assert_eq!(lat.len(), 1, "{lat:?}");
        assert!((lat[0] - (310.0 - 200.0)).abs() < 1e-9, "{lat:?}");
        assert!(seen.idle_handoffs(400 * MS).is_empty());
    }
}
