//! What a run is made of: the phases of a `--script`, or `--bursts` × (GPU burst,
//! CPU, idle) without one, and the busy host work of a CPU phase. A GPU phase is a
//! step ([`super::step`]).

use std::time::{Duration, Instant};

use super::Options;

/// One step of a `--script`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Cpu(u64),
    Gpu(u64),
    Idle(u64),
    /// MiB allocated and filled on the first device.
    Grow(u64),
}

impl Phase {
    pub(super) fn kind(self) -> &'static str {
        match self {
            Phase::Cpu(_) => "cpu",
            Phase::Gpu(_) => "gpu",
            Phase::Idle(_) => "idle",
            Phase::Grow(_) => "grow",
        }
    }
}

/// Parses `cpu:1500,gpu:6000,idle:500,grow:1536` (milliseconds; MiB for `grow`).
pub fn parse_script(s: &str) -> Result<Vec<Phase>, String> {
    let mut out = Vec::new();
    for step in s.split(',').map(str::trim).filter(|x| !x.is_empty()) {
        let (kind, ms) = step
            .split_once(':')
            .ok_or_else(|| format!("--script: {step:?} is not kind:ms"))?;
        let ms: u64 = ms
            .parse()
            .map_err(|_| format!("--script: {ms:?} is not a whole number of ms"))?;
        out.push(match kind {
            "cpu" => Phase::Cpu(ms),
            "gpu" if ms >= 1 => Phase::Gpu(ms),
            "gpu" => return Err("--script: a gpu phase needs at least 1 ms".into()),
            "idle" => Phase::Idle(ms),
            "grow" if ms >= 1 => Phase::Grow(ms),
            "grow" => return Err("--script: a grow phase needs at least 1 MiB".into()),
            other => {
                return Err(format!(
                    "--script: unknown phase {other:?} (cpu, gpu, idle, grow)"
                ))
            }
        });
    }
    if out.is_empty() {
        return Err("--script: no phases".into());
    }
    Ok(out)
}

/// Busy host work for `d` (a CPU phase that really uses the CPU).
pub(super) fn host_work(d: Duration) {
    let end = Instant::now() + d;
    let mut x = 0x1234_5678u64;
    while Instant::now() < end {
        for _ in 0..10_000 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
        }
        std::hint::black_box(x);
    }
}

/// The phases to run: `--script`'s, or `--bursts` GPU bursts with `--cpu-ms` of host
/// work (and `--idle-ms` of sleep) between two.
pub(super) fn planned(o: &Options) -> Vec<Phase> {
    match &o.script {
        Some(p) => p.clone(),
        None => {
            let mut p = Vec::new();
            for b in 0..o.bursts {
                p.push(Phase::Gpu(o.gpu_ms));
                if b + 1 < o.bursts {
                    p.push(Phase::Cpu(o.cpu_ms));
                    if o.idle_ms > 0 {
                        p.push(Phase::Idle(o.idle_ms));
                    }
                }
            }
            p
        }
    }
}
