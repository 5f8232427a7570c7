//! The simulator's environment knobs (`KIWI_SIM_*`), parsed once per process.
//!
//! The knobs only shape a machine segment when the segment is created: a later
//! process naming an existing segment gets the segment's GPUs, memory and
//! bandwidths, whatever its own environment says (see `docs/simulator.md`).

use std::path::PathBuf;

/// Most GPUs one simulated machine can have (fixed by the segment layout).
pub const MAX_GPUS: u32 = 16;

/// Why a knob could not be used.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum KnobError {
    #[error("{var}={value:?}: {reason}")]
    Invalid {
        var: &'static str,
        value: String,
        reason: String,
    },
}

/// The simulator configuration read from the environment.
#[derive(Debug, Clone, PartialEq)]
pub struct SimConfig {
    /// `KIWI_SIM_GPUS`, default 1.
    pub gpus: u32,
    /// `KIWI_SIM_MEMORY` in bytes, default 16 GiB.
    pub memory: u64,
    /// `KIWI_SIM_NAME`, default `default`.
    pub name: String,
    /// `KIWI_SIM_PCIE_GBPS` (GB/s, 1e9 bytes), default 25.
    pub pcie_gbps: f64,
    /// `KIWI_SIM_HBM_GBPS` (GB/s), default 1000.
    pub hbm_gbps: f64,
    /// `KIWI_SIM_TRACE`: file every kernel appends a line to.
    pub trace: Option<PathBuf>,
    /// `KIWI_SIM_CONTEXT_MEMORY` in bytes: device memory each context costs, never
    /// the application's to free or swap. Default [`DEFAULT_CONTEXT_MEMORY`].
    pub context_memory: u64,
    /// `KIWI_SIM_MEMCREATE_US`: wall time each `cuMemCreate` call takes, in
    /// microseconds, whatever its size. Default [`DEFAULT_MEMCREATE_US`].
    pub memcreate_us: f64,
    /// `KIWI_SIM_MEMCREATE_US_PER_2MIB`: wall time `cuMemCreate` takes per 2 MiB on
    /// top of the call's, in microseconds. Default [`DEFAULT_MEMCREATE_US_PER_2MIB`].
    pub memcreate_us_per_2mib: f64,
    /// `KIWI_SIM_PIN_GBPS`: how fast host memory is page-locked (`cuMemHostAlloc`,
    /// `cuMemAllocHost`, `cuMemHostRegister`), GB/s. Default [`DEFAULT_PIN_GBPS`];
    /// 0 turns the cost off.
    pub pin_gbps: f64,
    /// `KIWI_SIM_PIN_POPULATED_GBPS`: how fast `cuMemHostRegister` page-locks pages
    /// that were already populated (touched), GB/s. Default
    /// [`DEFAULT_PIN_POPULATED_GBPS`]; 0 turns the cost off.
    pub pin_populated_gbps: f64,
    /// `KIWI_SIM_PAGEABLE_H2D_GBPS` / `_D2H_GBPS`: how fast a copy between pageable
    /// (neither allocated pinned nor registered) host memory and a device runs, GB/s,
    /// at most the link's rate. Defaults [`DEFAULT_PAGEABLE_H2D_GBPS`],
    /// [`DEFAULT_PAGEABLE_D2H_GBPS`]; 0 turns the cost off (the link's rate).
    pub pageable_h2d_gbps: f64,
    pub pageable_d2h_gbps: f64,
    /// `KIWI_SIM_FAIL_SYNC`: fault injection for tests. While this file exists, the
    /// process's next `cuCtxSynchronize` deletes it and fails with
    /// `CUDA_ERROR_UNKNOWN` at once, without waiting for the context's work (which
    /// goes on; the context stays usable): a synchronization that failed while work
    /// was still queued. Per process; unset: never.
    pub fail_sync: Option<PathBuf>,
    /// `KIWI_SIM_PROCESS_CONTEXT_MEMORY` in bytes: what this process's contexts cost,
    /// instead of the machine's `KIWI_SIM_CONTEXT_MEMORY` (fixed when the machine is
    /// created). Real contexts differ by process (300–500 MiB on an H100, issue
    /// #24: the libraries loaded, the loading mode). Per process; unset: the
    /// machine's.
    pub process_context_memory: Option<u64>,
    /// `KIWI_SIM_MODULE_MEMORY` in bytes: device memory each module loaded through
    /// the driver API (`cuModuleLoad*`) costs its context until it is unloaded, never
    /// the application's to free or swap. Per process. Default
    /// [`DEFAULT_MODULE_MEMORY`]; 0 turns it off.
    pub module_memory: u64,
    /// `KIWI_SIM_FAIL_MEMCREATE=N`: fault injection for tests. Every Nth
    /// `cuMemCreate` of the process (the Nth, the 2Nth, ...) fails with
    /// `CUDA_ERROR_OUT_OF_MEMORY`, as when other processes' memory fills the GPU. Per
    /// process; unset or 0: never.
    pub fail_memcreate_every: u64,
    /// `KIWI_SIM_CHECKPOINT=0`: this process's driver has no checkpoint API (every
    /// `cuCheckpointProcess*` call is `CUDA_ERROR_NOT_SUPPORTED`, as a driver older
    /// than 570). Default on.
    pub checkpoint: bool,
    /// `KIWI_SIM_PREPARE` (`0` or `1`): accepted and ignored. It prepared host
    /// memory ahead for reserved device ranges while device memory lived in the
    /// process; it now lives in each GPU's memory file, whose freed pages are
    /// reused, and `kiwi-sim populate` fills them ahead.
    pub prepare: bool,
    /// `KIWI_SIM_CHECKPOINT_MS` / `KIWI_SIM_CHECKPOINT_GBPS`: what a checkpoint of
    /// this process costs, a fixed part plus its device memory at a rate; likewise
    /// `KIWI_SIM_RESTORE_MS` / `KIWI_SIM_RESTORE_GBPS` for a restore. Defaults
    /// [`DEFAULT_CHECKPOINT_MS`] and the rest; 0 turns a part off.
    pub checkpoint_ms: f64,
    pub checkpoint_gbps: f64,
    pub restore_ms: f64,
    pub restore_gbps: f64,
}

/// Device memory a context costs on a real GPU, never the application's to free or
/// swap: about 300 MiB with CUDA 12 on data-centre GPUs (what `nvidia-smi` shows for
/// a process that only created a context: the driver's per-context state, local
/// memory, printf FIFO, malloc heap, loaded module code). The figure issue #12 gives;
/// not measured here (no GPU).
pub const DEFAULT_CONTEXT_MEMORY: u64 = 300 << 20;
/// `cuMemCreate` costs about 15 µs a call, nearly whatever its size: measured on an
/// H100 (driver 580.159.04, `scripts/gpu-costs.py`, `docs/gpu-validation.md`), 18.9 µs
/// a call in 2 MiB handles, 12 µs in 64 MiB handles, 31 µs in 1 GiB handles. (The
/// figure first used, 100 µs per 2 MiB page, came from published A100 measurements;
/// it made every swap-in creation-bound, which it is not on the H100.)
pub const DEFAULT_MEMCREATE_US: f64 = 15.0;
/// What `cuMemCreate` takes per 2 MiB on top of the call: 0.04 µs (the 1 GiB handle
/// above, less the call).
pub const DEFAULT_MEMCREATE_US_PER_2MIB: f64 = 0.04;
/// The other VMM calls, a call each, measured on the same H100 (per call, in 2 MiB to
/// 64 MiB handles): `cuMemMap` 5 µs, `cuMemSetAccess` 35 µs, `cuMemUnmap` 20 µs,
/// `cuMemRelease` 12 µs plus 0.8 µs per 2 MiB. Charged whenever `cuMemCreate` costs
/// time (`KIWI_SIM_MEMCREATE_US` not 0).
pub const VMM_MAP_US: f64 = 5.0;
pub const VMM_SET_ACCESS_US: f64 = 35.0;
pub const VMM_UNMAP_US: f64 = 20.0;
pub const VMM_RELEASE_US: f64 = 12.0;
pub const VMM_RELEASE_US_PER_2MIB: f64 = 0.8;
/// Page-locking host memory: about 2 GB/s (`cudaHostAlloc`/`cudaHostRegister` pin
/// every page through the kernel; the figure issue #12 gives). Not measured here.
pub const DEFAULT_PIN_GBPS: f64 = 2.0;
/// Registering pages already populated: measured on an H100 (driver 580,
/// `scripts/gpu-costs.py`, `docs/gpu-validation.md`) at 20.1–21.1 GB/s with 4 KiB
/// pages, against 2.7–3.7 GB/s for fresh ones: the cost is populating the pages.
pub const DEFAULT_PIN_POPULATED_GBPS: f64 = 20.0;
/// Copies from and to pageable host memory (the driver stages them through its own
/// pinned buffers): measured on an H100 (driver 580, `scripts/gpu-costs.py`) at
/// 7.0–8.0 GB/s host to device and 12.1–12.9 GB/s device to host, against 55 GB/s
/// pinned each way.
pub const DEFAULT_PAGEABLE_H2D_GBPS: f64 = 7.5;
pub const DEFAULT_PAGEABLE_D2H_GBPS: f64 = 12.5;
/// Device memory a loaded module costs: its code and constant banks go into the
/// context's device memory, which the driver takes in 2 MiB pages, so a small module
/// costs one page; libraries of many kernels (cuBLAS, cuDNN, Triton's compiled
/// kernels) load tens to hundreds of MiB across their modules (issue #13: 0.3 to over
/// 1 GiB with the context). Not measured here (no GPU).
pub const DEFAULT_MODULE_MEMORY: u64 = 2 << 20;

/// What a checkpoint and a restore of a process cost: fitted to the two figures
/// gpusched published for an H100 PCIe (1.4 GB frozen in 609 ms and thawed in 427 ms,
/// 3.6 GB in 1.32 s and 0.83 s; see `docs/checkpoint.md`): a checkpoint 156 ms plus
/// 3.1 GB/s, a restore 171 ms plus 5.5 GB/s. Not measured here (no GPU).
pub const DEFAULT_CHECKPOINT_MS: f64 = 156.0;
pub const DEFAULT_CHECKPOINT_GBPS: f64 = 3.1;
pub const DEFAULT_RESTORE_MS: f64 = 171.0;
pub const DEFAULT_RESTORE_GBPS: f64 = 5.5;

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            gpus: 1,
            memory: 16 << 30,
            name: "default".into(),
            pcie_gbps: 25.0,
            hbm_gbps: 1000.0,
            trace: None,
            context_memory: DEFAULT_CONTEXT_MEMORY,
            memcreate_us: DEFAULT_MEMCREATE_US,
            memcreate_us_per_2mib: DEFAULT_MEMCREATE_US_PER_2MIB,
            pin_gbps: DEFAULT_PIN_GBPS,
            pin_populated_gbps: DEFAULT_PIN_POPULATED_GBPS,
            pageable_h2d_gbps: DEFAULT_PAGEABLE_H2D_GBPS,
            pageable_d2h_gbps: DEFAULT_PAGEABLE_D2H_GBPS,
            fail_sync: None,
            module_memory: DEFAULT_MODULE_MEMORY,
            process_context_memory: None,
            fail_memcreate_every: 0,
            checkpoint: true,
            prepare: false,
            checkpoint_ms: DEFAULT_CHECKPOINT_MS,
            checkpoint_gbps: DEFAULT_CHECKPOINT_GBPS,
            restore_ms: DEFAULT_RESTORE_MS,
            restore_gbps: DEFAULT_RESTORE_GBPS,
        }
    }
}

impl SimConfig {
    /// Reads the knobs from the process environment.
    pub fn from_env() -> Result<SimConfig, KnobError> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// Reads the knobs through `get` (testable without touching the environment).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<SimConfig, KnobError> {
        let mut c = SimConfig::default();
        let bad = |var: &'static str, value: &str, reason: String| KnobError::Invalid {
            var,
            value: value.to_string(),
            reason,
        };
        if let Some(v) = get("KIWI_SIM_GPUS") {
            let n: u32 = v
                .trim()
                .parse()
                .map_err(|_| bad("KIWI_SIM_GPUS", &v, "not a whole number".into()))?;
            if n == 0 || n > MAX_GPUS {
                return Err(bad(
                    "KIWI_SIM_GPUS",
                    &v,
                    format!("must be between 1 and {MAX_GPUS}"),
                ));
            }
            c.gpus = n;
        }
        if let Some(v) = get("KIWI_SIM_MEMORY") {
            let n = kiwi_config::parse_size(&v).map_err(|e| bad("KIWI_SIM_MEMORY", &v, e))?;
            if n < crate::GRANULARITY {
                return Err(bad("KIWI_SIM_MEMORY", &v, "must be at least 2MiB".into()));
            }
            c.memory = n;
        }
        if let Some(v) = get("KIWI_SIM_NAME") {
            validate_name(&v).map_err(|e| bad("KIWI_SIM_NAME", &v, e))?;
            c.name = v;
        }
        for (var, slot) in [
            ("KIWI_SIM_PCIE_GBPS", &mut c.pcie_gbps),
            ("KIWI_SIM_HBM_GBPS", &mut c.hbm_gbps),
        ] {
            if let Some(v) = get(var) {
                let g: f64 = v
                    .trim()
                    .parse()
                    .map_err(|_| bad(var, &v, "not a number".into()))?;
                if !(g.is_finite() && g > 0.0) {
                    return Err(bad(var, &v, "must be a positive number of GB/s".into()));
                }
                *slot = g;
            }
        }
        if let Some(v) = get("KIWI_SIM_TRACE") {
            if !v.is_empty() {
                c.trace = Some(PathBuf::from(v));
            }
        }
        if let Some(v) = get("KIWI_SIM_FAIL_SYNC") {
            if !v.is_empty() {
                c.fail_sync = Some(PathBuf::from(v));
            }
        }
        if let Some(v) = get("KIWI_SIM_CONTEXT_MEMORY") {
            c.context_memory =
                kiwi_config::parse_size(&v).map_err(|e| bad("KIWI_SIM_CONTEXT_MEMORY", &v, e))?;
        }
        if let Some(v) = get("KIWI_SIM_PROCESS_CONTEXT_MEMORY") {
            c.process_context_memory = Some(
                kiwi_config::parse_size(&v)
                    .map_err(|e| bad("KIWI_SIM_PROCESS_CONTEXT_MEMORY", &v, e))?,
            );
        }
        if let Some(v) = get("KIWI_SIM_MODULE_MEMORY") {
            c.module_memory =
                kiwi_config::parse_size(&v).map_err(|e| bad("KIWI_SIM_MODULE_MEMORY", &v, e))?;
        }
        if let Some(v) = get("KIWI_SIM_FAIL_MEMCREATE") {
            c.fail_memcreate_every = v
                .trim()
                .parse()
                .map_err(|_| bad("KIWI_SIM_FAIL_MEMCREATE", &v, "not a whole number".into()))?;
        }
        if let Some(v) = get("KIWI_SIM_PREPARE") {
            c.prepare = match v.trim() {
                "1" | "" => true,
                "0" => false,
                _ => return Err(bad("KIWI_SIM_PREPARE", &v, "must be 0 or 1".into())),
            };
        }
        if let Some(v) = get("KIWI_SIM_CHECKPOINT") {
            c.checkpoint = match v.trim() {
                "1" | "" => true,
                "0" => false,
                _ => return Err(bad("KIWI_SIM_CHECKPOINT", &v, "must be 0 or 1".into())),
            };
        }
        // Time costs: 0 turns one off (tests whose subject is not that cost).
        for (var, slot) in [
            ("KIWI_SIM_MEMCREATE_US", &mut c.memcreate_us),
            (
                "KIWI_SIM_MEMCREATE_US_PER_2MIB",
                &mut c.memcreate_us_per_2mib,
            ),
            ("KIWI_SIM_PIN_GBPS", &mut c.pin_gbps),
            ("KIWI_SIM_PIN_POPULATED_GBPS", &mut c.pin_populated_gbps),
            ("KIWI_SIM_PAGEABLE_H2D_GBPS", &mut c.pageable_h2d_gbps),
            ("KIWI_SIM_PAGEABLE_D2H_GBPS", &mut c.pageable_d2h_gbps),
            ("KIWI_SIM_CHECKPOINT_MS", &mut c.checkpoint_ms),
            ("KIWI_SIM_CHECKPOINT_GBPS", &mut c.checkpoint_gbps),
            ("KIWI_SIM_RESTORE_MS", &mut c.restore_ms),
            ("KIWI_SIM_RESTORE_GBPS", &mut c.restore_gbps),
        ] {
            if let Some(v) = get(var) {
                let g: f64 = v
                    .trim()
                    .parse()
                    .map_err(|_| bad(var, &v, "not a number".into()))?;
                if !(g.is_finite() && g >= 0.0) {
                    return Err(bad(var, &v, "must be a number, 0 or more".into()));
                }
                *slot = g;
            }
        }
        Ok(c)
    }
}

/// A machine name becomes part of a file name in `/dev/shm`: keep it tame.
pub fn validate_name(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > 100 {
        return Err("must be 1 to 100 characters".into());
    }
    if !name
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        || name.starts_with('.')
    {
        return Err("only letters, digits, '-', '_' and '.' (not first) are allowed".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn cfg(pairs: &[(&str, &str)]) -> Result<SimConfig, KnobError> {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        SimConfig::from_lookup(|k| m.get(k).cloned())
    }

    #[test]
    fn defaults_match_design() {
        let c = cfg(&[]).unwrap();
        assert_eq!(c.gpus, 1);
        assert_eq!(c.memory, 16 << 30);
        assert_eq!(c.name, "default");
        assert_eq!(c.pcie_gbps, 25.0);
        assert_eq!(c.hbm_gbps, 1000.0);
        assert_eq!(c.trace, None);
        assert_eq!(c.context_memory, 300 << 20);
        assert_eq!(c.memcreate_us, 15.0);
        assert_eq!(c.memcreate_us_per_2mib, 0.04);
        assert_eq!(c.pin_gbps, 2.0);
        assert_eq!(c.pageable_h2d_gbps, 7.5);
        assert_eq!(c.pageable_d2h_gbps, 12.5);
        assert_eq!(c.fail_sync, None);
        assert_eq!(c.module_memory, 2 << 20);
        assert_eq!(c.fail_memcreate_every, 0);
    }

    #[test]
    fn knobs_parse() {
        let c = cfg(&[
            ("KIWI_SIM_GPUS", "2"),
            ("KIWI_SIM_MEMORY", "1GiB"),
            ("KIWI_SIM_NAME", "t-1"),
            ("KIWI_SIM_PCIE_GBPS", "1.5"),
            ("KIWI_SIM_TRACE", "/tmp/x"),
            ("KIWI_SIM_CONTEXT_MEMORY", "48MiB"),
            ("KIWI_SIM_MEMCREATE_US", "7.5"),
            ("KIWI_SIM_MEMCREATE_US_PER_2MIB", "0"),
            ("KIWI_SIM_PIN_GBPS", "0.5"),
            ("KIWI_SIM_PAGEABLE_H2D_GBPS", "0"),
            ("KIWI_SIM_PAGEABLE_D2H_GBPS", "3"),
            ("KIWI_SIM_FAIL_SYNC", "/tmp/fail"),
            ("KIWI_SIM_MODULE_MEMORY", "8MiB"),
            ("KIWI_SIM_FAIL_MEMCREATE", "7"),
        ])
        .unwrap();
        assert_eq!(c.fail_memcreate_every, 7);
        assert_eq!(c.module_memory, 8 << 20);
        assert_eq!(c.fail_sync, Some(PathBuf::from("/tmp/fail")));
        assert_eq!(c.context_memory, 48 << 20);
        assert_eq!(c.memcreate_us, 7.5);
        assert_eq!(c.memcreate_us_per_2mib, 0.0);
        assert_eq!(c.pin_gbps, 0.5);
        assert_eq!(c.pageable_h2d_gbps, 0.0);
        assert_eq!(c.pageable_d2h_gbps, 3.0);
        assert_eq!(c.gpus, 2);
        assert_eq!(c.memory, 1 << 30);
        assert_eq!(c.name, "t-1");
        assert_eq!(c.pcie_gbps, 1.5);
        assert_eq!(c.trace, Some(PathBuf::from("/tmp/x")));
    }

    #[test]
    fn bad_knobs_are_rejected_with_the_variable_named() {
        for (k, v) in [
            ("KIWI_SIM_GPUS", "0"),
            ("KIWI_SIM_GPUS", "x"),
            ("KIWI_SIM_GPUS", "17"),
            ("KIWI_SIM_MEMORY", "lots"),
            ("KIWI_SIM_MEMORY", "1k"),
            ("KIWI_SIM_NAME", "../etc"),
            ("KIWI_SIM_NAME", ""),
            ("KIWI_SIM_PCIE_GBPS", "-1"),
            ("KIWI_SIM_HBM_GBPS", "nan"),
            ("KIWI_SIM_CONTEXT_MEMORY", "much"),
            ("KIWI_SIM_MODULE_MEMORY", "-1"),
            ("KIWI_SIM_FAIL_MEMCREATE", "often"),
            ("KIWI_SIM_MEMCREATE_US_PER_2MIB", "-5"),
            ("KIWI_SIM_MEMCREATE_US", "soon"),
            ("KIWI_SIM_PIN_GBPS", "fast"),
            ("KIWI_SIM_PAGEABLE_D2H_GBPS", "-2"),
        ] {
            let e = cfg(&[(k, v)]).unwrap_err();
            assert!(e.to_string().starts_with(k), "{e}");
        }
    }
}
