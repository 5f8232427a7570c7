//! `kiwi-bench all --markdown`: every scenario's figures in one document
//! (`docs/benchmarks.md`), each beside its same-run baseline, with the machine.

use std::fmt::Write as _;

use crate::jobs::{COSTS, GPU};
use crate::report::Figure;

/// What the simulated machines of the run charge, in words (each a cost a real GPU
/// has; `docs/simulator.md` gives their sources).
pub fn costs() -> Vec<String> {
    let mib = |b: u64| b >> 20;
    vec![
        format!(
            "GPU memory: {} MiB per GPU for the scheduling scenarios; every context costs \
             {} MiB of it that no swap frees (`KIWI_SIM_CONTEXT_MEMORY`)",
            mib(GPU),
            mib(COSTS.context_memory)
        ),
        format!(
            "`cuMemCreate`: {} µs a call (`KIWI_SIM_MEMCREATE_US`) plus {} µs per 2 MiB \
             (`KIWI_SIM_MEMCREATE_US_PER_2MIB`); `cuMemMap` {} µs, `cuMemSetAccess` {} µs, \
             `cuMemUnmap` {} µs, `cuMemRelease` {} µs plus {} µs per 2 MiB (measured on an \
             H100, `docs/gpu-validation.md`)",
            COSTS.memcreate_us,
            COSTS.memcreate_us_per_2mib,
            kiwi_sim_core::knobs::VMM_MAP_US,
            kiwi_sim_core::knobs::VMM_SET_ACCESS_US,
            kiwi_sim_core::knobs::VMM_UNMAP_US,
            kiwi_sim_core::knobs::VMM_RELEASE_US,
            kiwi_sim_core::knobs::VMM_RELEASE_US_PER_2MIB
        ),
        format!(
            "page-locking host memory (`cuMemHostAlloc`, `cuMemAllocHost`, \
             `cuMemHostRegister`): {} GB/s (`KIWI_SIM_PIN_GBPS`)",
            COSTS.pin_gbps
        ),
        format!(
            "PCIe: one link per GPU, full duplex, {} GB/s per direction shared by every \
             copy in that direction, whichever process makes it (`KIWI_SIM_PCIE_GBPS`); \
             the host's own copy speed caps it lower (the simulator's copy engine is a \
             CPU copy)",
            COSTS.pcie_gbps
        ),
        format!(
            "copies with pageable host memory: {} GB/s host to device, {} GB/s device to \
             host, at most the link's rate (`KIWI_SIM_PAGEABLE_H2D_GBPS`, `_D2H_GBPS`; \
             measured on an H100)",
            kiwi_sim_core::knobs::DEFAULT_PAGEABLE_H2D_GBPS,
            kiwi_sim_core::knobs::DEFAULT_PAGEABLE_D2H_GBPS
        ),
        format!(
            "device memory (kernels, memsets, device-to-device copies): {} GB/s \
             (`KIWI_SIM_HBM_GBPS`)",
            COSTS.hbm_gbps
        ),
        format!(
            "the driver's checkpoint API: a checkpoint {} ms plus {} GB/s of the \
             process's device memory, a restore {} ms plus {} GB/s \
             (`KIWI_SIM_CHECKPOINT_*`, `KIWI_SIM_RESTORE_*`; fitted to gpusched's H100 \
             PCIe figures, not measured here)",
            kiwi_sim_core::knobs::DEFAULT_CHECKPOINT_MS,
            kiwi_sim_core::knobs::DEFAULT_CHECKPOINT_GBPS,
            kiwi_sim_core::knobs::DEFAULT_RESTORE_MS,
            kiwi_sim_core::knobs::DEFAULT_RESTORE_GBPS
        ),
    ]
}

/// What the figures were measured on.
pub fn machine() -> Vec<(String, String)> {
    let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
    let cpu = read("/proc/cpuinfo")
        .lines()
        .find_map(|l| {
            l.strip_prefix("model name")
                .map(|v| v.trim_start_matches([' ', '\t', ':']).to_string())
        })
        .unwrap_or_else(|| "unknown".into());
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let mem_kb: u64 = read("/proc/meminfo")
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0);
    let kernel = read("/proc/sys/kernel/osrelease").trim().to_string();
    let commit = std::process::Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "unknown".into());
    let now = std::process::Command::new("date")
        .args(["-u", "+%Y-%m-%d %H:%M UTC"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    vec![
        ("date".into(), now),
        ("CPU".into(), format!("{cpu}, {cores} cores")),
        (
            "memory".into(),
            format!("{:.1} GiB", mem_kb as f64 / (1 << 20) as f64),
        ),
        ("kernel".into(), kernel),
        (
            "GPU".into(),
            "none: the Kiwi GPU simulator (sim/) stands in".into(),
        ),
        ("commit".into(), commit),
        (
            "build".into(),
            if cfg!(debug_assertions) {
                "debug"
            } else {
                "release"
            }
            .into(),
        ),
    ]
}

fn num(v: f64) -> String {
    if v.abs() >= 100.0 {
        format!("{v:.1}")
    } else if v.abs() >= 1.0 {
        format!("{v:.3}")
    } else {
        format!("{v:.4}")
    }
}

/// What a reader needs to know to judge some of the figures.
const NOTES: &[&str] = &[
    "**oversub**: the ideal is what no scheduler can beat with these jobs on this machine, \
     swaps free: both jobs' start-ups, then all their GPU phases back to back, then the \
     quickest tail, each as the job took it alone in the same run. Both start-ups count \
     because each fills its job's memory on the GPU and the two memories do not fit \
     together. The nominal 22 s (2 × 5 × 2 s of GPU + one 2 s CPU phase) is printed for \
     comparison; it cannot be met here: gpuburst has no CPU phase after its last burst, \
     a 2 s GPU phase takes longer on the simulator (its kernels over the job's 1 GB really run, on the host's CPU; the ideal's text gives the measured total) and so does a start-up (the host faults in the job's memory). `speedup_vs_serial` is printed beside the most any \
     interleave of these jobs could gain. `handoffs` and `gpu_work_shared` say where \
     the makespan beyond the ideal went, from the jobs' own reports: the hand-offs \
     (each job's first turn left out: it holds the job's start-up, which the ideal \
     counts) and the GPU phases as they ran shared. The figures come from the second run \
     of the two jobs together; the first is printed on its own \
     (`makespan_kiwi_first_run`): it uses ~2 GB more host memory than the serial runs \
     held, and the simulator's device memory is the host's, so a host slow to fault in \
     fresh pages charges the second job's first backing seconds that no GPU would.",
"**swap**: each swap alone on the link (`KIWI_PIPELINED=0`: no hand-off overlaps a swap-out with a swap-in), so the figures are the swap path's rate. `swap_out_all` also counts each notebook's first swap-out, whose buffers were pinned ahead while it held the GPU; `handoff-swap`'s `first_swap_out` measures the cold swap-out between two ready notebooks. A swap-in makes the memory it copies into (until the grant it was the previous holder's), each 64 MiB segment's while the segment before is copied; `cuMemCreate` costs about 15 µs a call whatever the size (measured on an H100, `docs/gpu-validation.md`; `swap_in_vs_creation`'s baseline gives the rate measured), so the copy sets the pace. A swap-in that copies nothing (a notebook's first grant backs the memory it allocated while it waited) is counted apart, as `first_backing`. The benchmarks' arbiter has the daemon's default swap pool, so swap-outs go into its slices.",
        "**early-release**: a holder releases after its idle threshold, at most \
     `KIWI_IDLE_MS`, shorter once its own pauses between pieces of work are known \
     (`shim/src/idle.rs`): the p50 shows the learned threshold, the p99 the first \
     releases, with few pauses seen (the threshold falls from `KIWI_IDLE_MS` by an \
     eighth of the way with each of the first 8).",
    "**handoff-swap at 25 GB/s**: the simulator's copy engine is the host's memcpy \
     (the `swap` scenario's pinned copy is its rate), so a swap-out and a swap-in at once share the host's memory \
     bandwidth and 2 cores, which a GPU's copy engines do not; at 4 GB/s the modelled \
     link, not the host, sets the pace. `steady_handoff_vs_duplex` measures that \
     sharing in the same run (two processes copying one way each for the same 600 ms) \
     and gives the time the hand-off's bytes take at those rates: the most a pipelined \
     hand-off can overlap on this host. `swap_out_after_growth` is the H100's case of \
     issue #28: on a GPU another notebook shares, a notebook's working set grows by \
     1.5 GiB (gpuburst `grow:1536`) and it is dropped when the other asks, 100 ms \
     after the arbiter saw the growth (the interval, from the arbiter's log, is in \
     the row); its swap-out rate against the pinned copy on the same simulated \
     machine. The shim page-locks slices of the swap pool from the growth on (the GPU \
     is shared); what is not ready is page-locked on the critical path (the default) \
     or, with `KIWI_SWAP_PAGEABLE=1` (`_pageable`), copied into pageable memory and \
     registered in place afterwards (`docs/shim.md`). Both run with a pool floor of \
     2 GiB, populated before; `_no_floor` is the default, where the pool populates \
     the growth's slices as it comes, and `host_populate` (how fast this host faults \
     in fresh memory on two threads) bounds it.",
    "**live-bytes**: two JAX-like notebooks (gpuburst `--prealloc 0.75`: one allocation \
     of 75% of the free memory they are told about, 205 MiB of it used) on a 4 GiB GPU \
     take turns in short bursts with idle pauses. With the hint (`--discard` answers the \
     shim's question before each swap-out, `docs/shim.md`) the untouched part is not \
     copied; without it, it is, at every hand-off. The control is the same pair \
     allocating only what it uses, on an 896 MiB GPU where it still takes the same \
     turns: the least a hand-off of these programs can move. A partial eviction takes \
     the dead segments first, so with the hint a swap-out may copy nothing at all.",
    "**newcomer**: a notebook holds 3648 MiB (90%) of a 4 GiB GPU with 300 MiB contexts \
     and idles; a newcomer's `cuInit` and primary context (this binary under the shim) \
     find no room for the context. It waits for room (`docs/shim.md`, \"Memory the shim \
     cannot page waits for room\"): the holder releases early and swaps out what \
     the context needs. The baseline is that swap-out's own duration in the same run: \
     the newcomer's context is ready once enough segments are freed, before the swap-out \
     reports its end, so the ratio can be below 1.",
];

/// The document.
pub fn render(figures: &[Figure], errors: &[(String, String)], command: &str) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "# Kiwi benchmarks\n");
    let _ = writeln!(
        s,
        "Written by `{command}`. Every figure is printed next to a baseline measured in \
         the same run on the same machine, and their ratio; these machines are noisy, so \
         the ratio means more than the absolute time.\n"
    );
    let _ = writeln!(s, "## Machine\n");
    for (k, v) in machine() {
        let _ = writeln!(s, "- {k}: {v}");
    }
    let _ = writeln!(s, "\n## What the simulator charges\n");
    let _ = writeln!(
        s,
        "The GPU is simulated (`sim/`); it charges these costs of real hardware as wall \
         time or memory, so the figures include them:\n"
    );
    for c in costs() {
        let _ = writeln!(s, "- {c}");
    }
    let _ = writeln!(s, "\n## Figures\n");
    let _ = writeln!(s, "| scenario | metric | value | baseline | ratio | goal |");
    let _ = writeln!(s, "| --- | --- | --- | --- | --- | --- |");
    for f in figures {
        let base = match f.baseline {
            Some(b) => format!("{} {} ({})", num(b), f.unit, f.baseline_is),
            None => "–".into(),
        };
        let ratio = f.ratio.map_or("–".into(), |r| format!("{r:.2}×"));
        let goal = if f.goal.is_empty() {
            "–"
        } else {
            f.goal.as_str()
        };
        let _ = writeln!(
            s,
            "| {} | {} | {} {} | {} | {} | {} |",
            f.scenario,
            f.metric,
            num(f.value),
            f.unit,
            base,
            ratio,
            goal
        );
    }
    let _ = writeln!(s, "\n## Reading the figures\n");
    for n in NOTES {
        let _ = writeln!(s, "- {n}");
    }
    if !errors.is_empty() {
        let _ = writeln!(s, "\n## Scenarios that failed in this run\n");
        for (scen, e) in errors {
            let _ = writeln!(s, "- {scen}: {e}");
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn document_has_machine_and_every_figure() {
        let figs = vec![
            Figure::new("handoff/8", "handoff_p99", 80.0, "us").against(27.0, "raw round trip"),
            Figure::new("oversub", "speedup_vs_serial", 1.6, "x").goal(">= 1.5x"),
        ];
        let md = render(
            &figs,
            &[("swap".into(), "shim missing".into())],
            "kiwi-bench all --markdown",
        );
        assert!(md.contains("## Machine"));
        assert!(md.contains("## What the simulator charges"), "{md}");
        assert!(md.contains("every context costs 300 MiB"), "{md}");
        assert!(md.contains("`cuMemCreate`: 15 µs a call"), "{md}");
        assert!(md.contains("7.5 GB/s host to device"), "{md}");
        assert!(md.contains("2 GB/s (`KIWI_SIM_PIN_GBPS`)"), "{md}");
        assert!(md.contains("25 GB/s per direction"), "{md}");
        assert!(
            md.contains(
                "| handoff/8 | handoff_p99 | 80.000 us | 27.000 us (raw round trip) | 2.96× |"
            ),
            "{md}"
        );
        assert!(
            md.contains("| oversub | speedup_vs_serial | 1.600 x | – | – | >= 1.5x |"),
            "{md}"
        );
        assert!(md.contains("- swap: shim missing"));
    }
}
