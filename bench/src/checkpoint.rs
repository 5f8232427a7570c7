//! `checkpoint` (issue #25): whole-process eviction on a 4 GiB simulated GPU
//! charging real hardware's costs (300 MiB contexts, the checkpoint API's modelled
//! costs). A notebook of 3008 MiB (2.9 GiB) and three newcomers of 64 MiB, all
//! gpuburst under the shim, run bursts with pauses; the newcomers' contexts leave the
//! notebook no room for its working set even with every other byte swapped out
//! (3008 + 4 × 302 MiB > 4096), so the arbiter (with the simulator's checkpoint API)
//! checkpoints idle newcomers.
//!
//! Figures, each against a baseline of the same run:
//! - `residual_checkpoint` / `residual_restore`: the arbiter's checkpoint (lock and
//!   checkpoint) and restore (restore and unlock) of an idle newcomer, whose whole
//!   device memory is then its context and module, against what the simulator models
//!   for those bytes (`kiwi_sim_core::knobs::DEFAULT_CHECKPOINT_*`, `_RESTORE_*`):
//!   the overhead of the path, not the driver's rate.
//! - `makespan`: the four together under Kiwi, against the four run one after
//!   another, each alone on the GPU.
//! - `makespan_without_checkpoint` (not in `--quick`): the same under an arbiter
//!   without the API, against the makespan with it.

use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use kiwi_protocol::EventKind;
use kiwi_sim_core::knobs;

use crate::jobs::{Build, Sim, COSTS};
use crate::pipeline::Job;
use crate::procs::{monotonic_ns, ArbiterProc};
use crate::report::Figure;
use crate::shimbench::arbiter_events;

const GPU: u64 = 4 << 30;
const HOLDER: u64 = 3008 << 20;
const NEWCOMER: u64 = 64 << 20;

fn script(gpu_ms: u64, cpu_ms: u64, rounds: usize) -> String {
    vec![format!("gpu:{gpu_ms},cpu:{cpu_ms}"); rounds].join(",")
}

/// What one run observed.
struct Run {
    makespan_s: f64,
    checkpoints_ms: Vec<f64>,
    restores_ms: Vec<f64>,
}

/// Starts an arbiter (`checkpoint`: with the simulator's checkpoint API) and the jobs
/// `(mem, script)`, lets them all go at once and waits for the last to end.
fn run(b: &Build, tag: &str, checkpoint: bool, jobs: &[(u64, String)]) -> Result<Run> {
    let sim = Sim::new(tag, GPU);
    let extra: &[&str] = if checkpoint { &["--checkpoint"] } else { &[] };
    let arb = ArbiterProc::start_with(1.0, extra, |c| sim.apply(b, c))?;
    let mut started = Vec::new();
    for (i, (mem, s)) in jobs.iter().enumerate() {
        started.push(Job::ready(b, &sim, &arb, *mem, s, i as u64 + 1)?);
    }
    let t0 = monotonic_ns() + 50_000_000;
    for j in &mut started {
        j.go(t0)?;
    }
    let deadline = Instant::now() + Duration::from_secs(300);
    for j in started {
        j.finish(deadline)?;
    }
    let makespan_s = monotonic_ns().saturating_sub(t0) as f64 / 1e9;
    let events = arbiter_events(&arb)?;
    let ms = |want_restore: bool| -> Vec<f64> {
        events
            .iter()
            .filter_map(|e| match e.kind {
                EventKind::Checkpoint { duration_ns, .. } if !want_restore => {
                    Some(duration_ns as f64 / 1e6)
                }
                EventKind::Restore { duration_ns, .. } if want_restore => {
                    Some(duration_ns as f64 / 1e6)
                }
                _ => None,
            })
            .collect()
    };
    Ok(Run {
        makespan_s,
        checkpoints_ms: ms(false),
        restores_ms: ms(true),
    })
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

pub fn checkpoint(quick: bool) -> Result<Vec<Figure>> {
    let b = Build::find()?;
    let rounds = if quick { 3 } else { 5 };
    let holder = (HOLDER, script(300, 500, rounds));
    let newcomer = (NEWCOMER, script(100, 500, rounds));
    let together = [
        holder.clone(),
        newcomer.clone(),
        newcomer.clone(),
        newcomer.clone(),
    ];
    let with = run(&b, "ckpt", true, &together)?;
    if with.checkpoints_ms.is_empty() || with.restores_ms.is_empty() {
        bail!("nothing was checkpointed and restored: the scenario no longer needs it");
    }
    // One after another, each alone (the three newcomers are alike: one, three times).
    let alone_holder = run(&b, "ckpt-alone-h", true, &[holder])?.makespan_s;
    let alone_newcomer = run(&b, "ckpt-alone-n", true, &[newcomer])?.makespan_s;
    let serial = alone_holder + 3.0 * alone_newcomer;
    // The bytes a checkpointed idle newcomer holds: its context and gpuburst's one
    // module (its 64 MiB were swapped out first).
    let residual = (COSTS.context_memory + knobs::DEFAULT_MODULE_MEMORY) as f64;
    let modelled_ckpt =
        knobs::DEFAULT_CHECKPOINT_MS + residual / (knobs::DEFAULT_CHECKPOINT_GBPS * 1e6);
    let modelled_restore =
        knobs::DEFAULT_RESTORE_MS + residual / (knobs::DEFAULT_RESTORE_GBPS * 1e6);
    let s = "checkpoint";
    let n = with.checkpoints_ms.len();
    let mut figs = vec![
        Figure::new(s, "residual_checkpoint", median(with.checkpoints_ms), "ms")
            .against(
                modelled_ckpt,
                &format!(
                    "the simulator's modelled checkpoint of a context and a module, {} MiB (median of {n})",
                    residual as u64 >> 20
                ),
            )
            .goal("<= 1.1x"),
        Figure::new(s, "residual_restore", median(with.restores_ms), "ms")
            .against(modelled_restore, "the simulator's modelled restore of the same")
            .goal("<= 1.1x"),
        Figure::new(s, "makespan", with.makespan_s, "s")
            .against(
                serial,
                "the four run one after another, each alone on the GPU, same run",
            )
            .goal("<= 1x"),
    ];
    if !quick {
        let without = run(&b, "ckpt-off", false, &together)?;
        figs.push(
            Figure::new(s, "makespan_without_checkpoint", without.makespan_s, "s")
                .against(
                    with.makespan_s,
                    "the makespan with the checkpoint API, same run",
                )
                .goal("> 1x: the API shortens it"),
        );
    }
    Ok(figs)
}
