//! `live-bytes` (issue #26): two JAX-like notebooks (gpuburst `--prealloc 0.75`: one
//! allocation of 75% of the free memory they are told about, 5% of the GPU used) on a
//! 4 GiB simulated GPU charging real hardware's costs, taking turns: without the
//! discard hint, with it (`--discard`: the untouched part is declared dead when the
//! shim asks), and the same programs allocating only what they use (the control) on
//! an 896 MiB GPU where they still take turns, moving only live bytes. Measured in one
//! run: bytes copied per hand-off
//! and the hand-off (a grant to the new holder's memory being resident), from the
//! arbiter's event log, and each pair's makespan from the start gate (both ready:
//! memory allocated, backed and filled).

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use kiwi_protocol::{Event, EventKind};

use crate::jobs::{Build, Sim};
use crate::pipeline::Job;
use crate::procs::{monotonic_ns, ArbiterProc};
use crate::report::{percentile, Figure};
use crate::shimbench::arbiter_events;

/// The simulated GPU: the 4 GiB.
const GPU: u64 = 4 << 30;
/// The control's GPU: the used-only pair (2 × 205 MiB and two 300 MiB contexts) does
/// not fit beside the arbiter's reserve, so it takes the same turns, moving only used
/// bytes: the least any hand-off of these programs can move.
const GPU_CONTROL: u64 = 896 << 20;
const MIB: f64 = (1u64 << 20) as f64;

/// How a pair allocates.
#[derive(Clone, Copy)]
enum Variant {
    /// 75% of reported free, no hint.
    Prealloc,
    /// 75% of reported free, the untouched part discarded when asked.
    Hinted,
    /// Only the used bytes.
    UsedOnly,
}

/// What one pair did.
struct Pair {
    /// From the start gate (both ready: memory allocated, backed once and filled) to
    /// both exits.
    makespan: Duration,
    /// Bytes each swap-out copied.
    swap_out_bytes: Vec<f64>,
    /// Each hand-off: a grant (not a client's first) to that client's swap-in
    /// reported, in ms.
    handoff_ms: Vec<f64>,
}

fn pair(b: &Build, v: Variant, used: u64, rounds: u32) -> Result<Pair> {
    let sim = Sim::new(
        "live",
        match v {
            Variant::UsedOnly => GPU_CONTROL,
            _ => GPU,
        },
    );
    let arb = ArbiterProc::start(2.0, &[])?;
    // A notebook: short GPU bursts between idle pauses; the other asks for the GPU
    // in each pause, so every turn ends in an early release.
    let script = vec!["gpu:150,idle:350"; rounds as usize].join(",");
    let extra: &[&str] = match v {
        Variant::Prealloc => &["--prealloc", "0.75"],
        Variant::Hinted => &["--prealloc", "0.75", "--discard"],
        Variant::UsedOnly => &[],
    };
    let mut jobs = Vec::new();
    for seed in 1..=2 {
        let job = Job::ready_with(b, &sim, &arb, used, &script, seed, extra, &[])?;
        jobs.push(job);
    }
    let start = monotonic_ns() + 50_000_000;
    let t0 = Instant::now();
    for (k, j) in jobs.iter_mut().enumerate() {
        // B starts half a period after A: they alternate rather than collide.
        j.go(start + k as u64 * 250_000_000)?;
    }
    let deadline = Instant::now() + Duration::from_secs(120);
    for j in jobs {
        j.finish(deadline)?;
    }
    let makespan = t0.elapsed();
    let events = arbiter_events(&arb)?;
    Ok(Pair {
        makespan,
        swap_out_bytes: events
            .iter()
            .filter_map(|e| match e.kind {
                EventKind::SwapOut { bytes, .. } => Some(bytes as f64),
                _ => None,
            })
            .collect(),
        handoff_ms: handoffs(&events),
    })
}

/// Each grant after a client's first, to the swap-in it reported next (if it
/// reported one before its release), in ms.
fn handoffs(events: &[Event]) -> Vec<f64> {
    let mut out = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for (i, e) in events.iter().enumerate() {
        // A client's first grant is its cold start, not a hand-off.
        if !matches!(e.kind, EventKind::Grant { .. }) || seen.insert(e.client) {
            continue;
        }
        let swap_in = events[i + 1..]
            .iter()
            .filter(|x| x.client == e.client)
            .take_while(|x| !matches!(x.kind, EventKind::Release { .. }))
            .find(|x| matches!(x.kind, EventKind::SwapIn { .. }));
        if let Some(s) = swap_in {
            out.push((s.t_ns - e.t_ns) as f64 / 1e6);
        }
    }
    out
}

fn mean(v: &[f64]) -> f64 {
    if v.is_empty() {
        0.0
    } else {
        v.iter().sum::<f64>() / v.len() as f64
    }
}

pub fn live_bytes(quick: bool) -> Result<Vec<Figure>> {
    let b = Build::find()?;
    let used = GPU / 20;
    let rounds = if quick { 4 } else { 10 };
    let plain = pair(&b, Variant::Prealloc, used, rounds).context("the pair without the hint")?;
    let hinted = pair(&b, Variant::Hinted, used, rounds).context("the pair with the hint")?;
    let control = pair(&b, Variant::UsedOnly, used, rounds).context("the used-only pair")?;
    let s = "live-bytes";
    let per_handoff = |p: &Pair| mean(&p.swap_out_bytes) / MIB;
    let med = |p: &Pair| percentile(&mut p.handoff_ms.clone(), 50.0);
    anyhow::ensure!(
        [&plain, &hinted, &control]
            .iter()
            .all(|p| !p.swap_out_bytes.is_empty()),
        "a pair never handed the GPU over"
    );
    let ctl = control.makespan.as_secs_f64();
    let used_only = "the same pair allocating only what it uses, taking turns";
    Ok(vec![
        Figure::new(s, "makespan_hint", hinted.makespan.as_secs_f64(), "s")
            .against(ctl, used_only)
            .goal("<= 1.1x"),
        Figure::new(s, "makespan_no_hint", plain.makespan.as_secs_f64(), "s")
            .against(ctl, used_only),
        Figure::new(s, "mib_per_swap_out_hint", per_handoff(&hinted), "MiB")
            .against(per_handoff(&control), used_only)
            .goal(&format!(
                "<= {:.0} MiB used + one 64 MiB segment",
                used as f64 / MIB
            )),
        Figure::new(s, "mib_per_swap_out_no_hint", per_handoff(&plain), "MiB")
            .against(per_handoff(&control), used_only),
        Figure::new(s, "handoff_hint", med(&hinted), "ms")
            .against(med(&control), &format!("median, {used_only}"))
            .goal("<= 1.1x"),
        Figure::new(s, "handoff_no_hint", med(&plain), "ms")
            .against(med(&control), &format!("median, {used_only}")),
        Figure::new(s, "swap_outs_hint", hinted.swap_out_bytes.len() as f64, "").against(
            plain.swap_out_bytes.len() as f64,
            "the same pair without the hint",
        ),
    ])
}
