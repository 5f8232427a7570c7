//! `gang` (issue #41): 2-GPU jobs under Kiwi. A job is two gpuburst ranks, one per
//! GPU, that wait for each other at the end of every step through stream memory
//! operations on a shared file (`--exchange`), as NCCL ranks do. On two simulated
//! GPUs that hold one job's memory at a time:
//!
//! - `beside_notebooks`: job J and a notebook on each GPU. J's run time under Kiwi
//!   (group turns: its ranks share `KIWI_GROUP`) against the ideal interleave of J
//!   and the notebook as each ran alone in this run (every start-up and GPU phase
//!   back to back on the busier GPU, swaps free); J's mean step against J alone.
//! - `crosswise`: J, a second job K with its ranks the other way round, and the
//!   notebooks: the makespan with group turns against the ideal, and against per-GPU
//!   turns (the same ranks without a group, granted one GPU at a time, as before:
//!   a rank that holds its GPU waits at its exchange for a peer that waits for its
//!   own GPU). And, from the arbiter's event log, the time ranks held their GPU while
//!   their peer waited for a turn on the other GPU (a quantum spent spinning).

use std::collections::BTreeMap;

use std::path::Path;
use std::process::Child;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};

use crate::jobs::{
    ideal_interleave, spawn_job_args, wait_all_reports, Alone, Build, Job, Sim, COSTS,
};
use crate::procs::ArbiterProc;
use crate::report::Figure;
use crate::shimbench::events_at;
use kiwi_protocol::{Event, EventKind};

/// Each simulated GPU: three contexts and one job of [`job_mem`] fit; two jobs never
/// do, even beside only two contexts (a job and a notebook on one GPU take turns:
/// sized for three contexts, they fit beside two and ran shared, and the figure
/// measured sharing, not group turns).
const GPU: u64 = 2 << 30;

fn job_mem() -> u64 {
    (GPU - 2 * COSTS.context_memory) / 100 * 55
}

/// One process of a scenario: its name, GPU, exchange (file tag and rank) and group.
struct Proc {
    name: &'static str,
    device: &'static str,
    exchange: Option<(&'static str, u32)>,
    group: Option<&'static str>,
}

const fn nb(name: &'static str, device: &'static str) -> Proc {
    Proc {
        name,
        device,
        exchange: None,
        group: None,
    }
}

const fn rank(
    name: &'static str,
    device: &'static str,
    file: &'static str,
    r: u32,
    group: &'static str,
) -> Proc {
    Proc {
        name,
        device,
        exchange: Some((file, r)),
        group: Some(group),
    }
}

/// What a run left: its makespan, each process's report and pid, in order.
struct Run {
    makespan: Duration,
    reports: Vec<String>,
    pids: Vec<u32>,
}

/// Starts `procs` together on a fresh 2-GPU machine (under the arbiter on `kiwi`,
/// with their groups when `grouped`); an error if one fails or they do not finish
/// by `limit`.
fn run(
    b: &Build,
    job: Job,
    procs: &[Proc],
    kiwi: Option<&Path>,
    grouped: bool,
    limit: Duration,
) -> Result<Run> {
    let sim = Sim::new("gang", GPU);
    let dir = tempfile::tempdir()?;
    let t0 = Instant::now();
    let mut kids: Vec<Child> = Vec::new();
    for (i, p) in procs.iter().enumerate() {
        let ex = p
            .exchange
            .map(|(f, r)| format!("{}:{r}", dir.path().join(f).display()));
        let mut env: Vec<(&str, &str)> = vec![("KIWI_SIM_GPUS", "2")];
        if let (true, Some(g)) = (grouped, p.group) {
            env.push(("KIWI_GROUP", g));
        }
        let mut args = vec!["--device", p.device, "--name", p.name];
        if let Some(ex) = &ex {
            args.extend(["--exchange", ex.as_str(), "--exchange-timeout-ms", "600000"]);
        }
        kids.push(spawn_job_args(
            b,
            &sim,
            job,
            i as u64 + 1,
            kiwi,
            &env,
            &args,
        )?);
    }
    let pids = kids.iter().map(Child::id).collect();
    let (ok, why, reports) = wait_all_reports(kids, Instant::now() + limit)?;
    if !ok {
        bail!("a process failed: {why}");
    }
    Ok(Run {
        makespan: t0.elapsed(),
        reports,
        pids,
    })
}

/// Seconds a rank held its GPU (exclusively) while its peer waited for a turn, over
/// every rank of `procs`, from the arbiter's event log (one clock).
fn spin_seconds(events: &[Event], procs: &[Proc], pids: &[u32]) -> f64 {
    // Client ids of each process, from the registrations.
    let mut ids: BTreeMap<u32, Vec<u64>> = BTreeMap::new();
    for e in events {
        if let (EventKind::Register { host_pid, .. }, Some(c)) = (&e.kind, e.client) {
            ids.entry(*host_pid).or_default().push(c);
        }
    }
    // Each client's holds and waits, as [start, end) intervals.
    let end = events.last().map_or(0, |e| e.t_ns);
    let mut holds: BTreeMap<u64, Vec<(u64, u64)>> = BTreeMap::new();
    let mut waits: BTreeMap<u64, Vec<(u64, u64)>> = BTreeMap::new();
    let mut open_hold: BTreeMap<u64, u64> = BTreeMap::new();
    let mut open_wait: BTreeMap<u64, u64> = BTreeMap::new();
    for e in events {
        let Some(c) = e.client else { continue };
        match &e.kind {
            EventKind::Request => {
                open_wait.entry(c).or_insert(e.t_ns);
            }
            EventKind::Grant { exclusive, .. } => {
                if let Some(s) = open_wait.remove(&c) {
                    waits.entry(c).or_default().push((s, e.t_ns));
                }
                if *exclusive {
                    open_hold.insert(c, e.t_ns);
                }
            }
            EventKind::Release { .. } | EventKind::Revoke | EventKind::Exit => {
                if let Some(s) = open_hold.remove(&c) {
                    holds.entry(c).or_default().push((s, e.t_ns));
                }
                if let Some(s) = open_wait.remove(&c) {
                    waits.entry(c).or_default().push((s, e.t_ns));
                }
            }
            _ => {}
        }
    }
    for (c, s) in open_hold {
        holds.entry(c).or_default().push((s, end));
    }
    for (c, s) in open_wait {
        waits.entry(c).or_default().push((s, end));
    }
    let clients_of = |i: usize| ids.get(&pids[i]).cloned().unwrap_or_default();
    let mut total = 0u64;
    for (i, p) in procs.iter().enumerate() {
        let Some((file, r)) = p.exchange else {
            continue;
        };
        let Some(peer) = procs.iter().position(|q| q.exchange == Some((file, 1 - r))) else {
            continue;
        };
        for me in clients_of(i) {
            for other in clients_of(peer) {
                for &(hs, he) in holds.get(&me).map_or(&[][..], |v| v) {
                    for &(ws, we) in waits.get(&other).map_or(&[][..], |v| v) {
                        total += he.min(we).saturating_sub(hs.max(ws));
                    }
                }
            }
        }
    }
    total as f64 / 1e9
}

/// The mean of a report's `step_ms` (its `end` line).
fn mean_step_ms(report: &str) -> Result<f64> {
    for l in report.lines() {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(l) else {
            continue;
        };
        if v["event"] == "end" {
            let steps: Vec<f64> = v["step_ms"]
                .as_array()
                .map(|a| a.iter().filter_map(|x| x.as_f64()).collect())
                .unwrap_or_default();
            if !steps.is_empty() {
                return Ok(steps.iter().sum::<f64>() / steps.len() as f64);
            }
        }
    }
    bail!("no step times in a report: {report:?}")
}

/// The ideal interleave of what each GPU runs (as measured alone), the busier GPU's.
fn ideal(per_gpu: &[Vec<&Alone>]) -> f64 {
    per_gpu
        .iter()
        .map(|a| {
            let owned: Vec<Alone> = a.iter().map(|x| (*x).clone()).collect();
            ideal_interleave(&owned).total().as_secs_f64()
        })
        .fold(0.0, f64::max)
}

pub fn gang(quick: bool) -> Result<Vec<Figure>> {
    let b = Build::find()?;
    let job = Job {
        mem: job_mem(),
        bursts: if quick { 3 } else { 5 },
        gpu_ms: if quick { 1000 } else { 2000 },
        // Think time idles (a notebook's user reading): six processes' busy CPU
        // phases on a small host would slow the simulated GPUs' kernels, which
        // compute on the host, and no ideal measured alone would show it.
        cpu_ms: 0,
        idle_ms: if quick { 1000 } else { 2000 },
        kernel_us: 5000,
    };
    let limit = Duration::from_secs(if quick { 240 } else { 600 });
    let tq = 5.0;

    // Alone, without Kiwi: job J's two ranks together, then one notebook.
    let j = [rank("J0", "0", "J", 0, "J"), rank("J1", "1", "J", 1, "J")];
    let j_alone = run(&b, job, &j, None, false, limit)?.reports;
    let n_alone = run(&b, job, &[nb("N0", "0")], None, false, limit)?.reports;
    let ja: Vec<Alone> = j_alone
        .iter()
        .map(|r| Alone::parse(r))
        .collect::<Result<_>>()?;
    let na = Alone::parse(&n_alone[0])?;
    let j_step_alone = mean_step_ms(&j_alone[0])?;

    // J beside a notebook on each GPU, with group turns.
    let arb = ArbiterProc::start(tq, &[])?;
    let beside = [
        rank("J0", "0", "J", 0, "J"),
        rank("J1", "1", "J", 1, "J"),
        nb("N0", "0"),
        nb("N1", "1"),
    ];
    let r = run(&b, job, &beside, Some(arb.socket_dir()), true, limit)?;
    drop(arb);
    let (beside_t, reports) = (r.makespan, r.reports);
    // J's run: its ranks' reports' `end` (total_ms from each one's start).
    let j_total = reports[..2]
        .iter()
        .map(|r| total_ms(r))
        .collect::<Result<Vec<f64>>>()?
        .into_iter()
        .fold(0.0, f64::max)
        / 1e3;
    let j_step = mean_step_ms(&reports[0])?;
    let ideal_beside = ideal(&[vec![&ja[0], &na], vec![&ja[1], &na]]);

    // Two jobs crosswise and the notebooks: group turns, then per-GPU turns.
    let cross = [
        rank("J0", "0", "J", 0, "J"),
        rank("J1", "1", "J", 1, "J"),
        rank("K0", "1", "K", 0, "K"),
        rank("K1", "0", "K", 1, "K"),
        nb("N0", "0"),
        nb("N1", "1"),
    ];
    let arb = ArbiterProc::start(tq, &[])?;
    let g = run(&b, job, &cross, Some(arb.socket_dir()), true, limit)?;
    let gang_spin = spin_seconds(&events_at(arb.socket_dir())?, &cross, &g.pids);
    drop(arb);
    let gang_t = g.makespan;
    let arb = ArbiterProc::start(tq, &[])?;
    let per_gpu = run(&b, job, &cross, Some(arb.socket_dir()), false, limit).and_then(|r| {
        let spin = spin_seconds(&events_at(arb.socket_dir())?, &cross, &r.pids);
        Ok((r.makespan, spin))
    });
    drop(arb);
    // Each GPU runs a rank of J, a rank of K and a notebook, as long alone as J's
    // ranks (K's are the same job).
    let ideal_cross = ideal(&[vec![&ja[0], &ja[1], &na], vec![&ja[1], &ja[0], &na]]);

    let mut figs = vec![
        Figure::new("gang", "job_beside_notebooks", j_total, "s")
            .against(
                ideal_beside,
                "ideal interleave of the 2-GPU job and a notebook on each GPU, as each ran alone in this run (start-ups and GPU phases back to back on the busier GPU, swaps free)",
            )
            .goal("<= 1.1x the ideal"),
        Figure::new("gang", "job_step_beside_notebooks", j_step, "ms").against(
            j_step_alone,
            "the same job's mean step alone (its step waits for its peer, and under Kiwi for its turns)",
        ),
        Figure::new("gang", "beside_notebooks_makespan", beside_t.as_secs_f64(), "s")
            .against(ideal_beside, "the ideal interleave above"),
        Figure::new("gang", "crosswise_group_turns", gang_t.as_secs_f64(), "s")
            .against(
                ideal_cross,
                "ideal interleave of two 2-GPU jobs crosswise and a notebook on each GPU (as measured alone, swaps free)",
            )
            .goal("<= 1.1x the ideal"),
    ];
    match per_gpu {
        Ok((t, spin)) => {
            figs.push(
                Figure::new("gang", "crosswise_per_gpu_turns", t.as_secs_f64(), "s").against(
                    gang_t.as_secs_f64(),
                    "the same processes with group turns (here each rank is granted its GPU on its own, as before #41)",
                ),
            );
            figs.push(
                Figure::new("gang", "spin_group_turns", gang_spin, "s").against(
                    spin,
                    "per-GPU turns: time ranks held their GPU while their peer waited for a turn on the other (summed over the four ranks)",
                ),
            );
        }
        Err(e) => figs.push(
            Figure::new(
                "gang",
                "crosswise_per_gpu_turns_failed",
                limit.as_secs_f64(),
                "s",
            )
            .against(
                gang_t.as_secs_f64(),
                // What each process said last is long; the first words say what
                // happened.
                &format!(
                    "with group turns; per-GPU turns: {}…",
                    format!("{e:#}").chars().take(160).collect::<String>()
                ),
            ),
        ),
    }
    Ok(figs)
}

/// A report's `end` `total_ms`.
fn total_ms(report: &str) -> Result<f64> {
    report
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|v| v["event"] == "end")
        .and_then(|v| v["total_ms"].as_f64())
        .ok_or_else(|| anyhow::anyhow!("no end line in a report: {report:?}"))
}
