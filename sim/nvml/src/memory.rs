//! Device memory and the processes holding it, straight from the machine segment, so
//! NVML agrees with `cuMemGetInfo` and `kiwi-sim status` at every moment: memory
//! info (`nvmlMemory_t` and `nvmlMemory_v2_t`), the running-process lists in every
//! version (compute, graphics, MPS), and per-process utilization samples.
//!
//! A process's figure is everything the simulator charges it on that GPU (contexts,
//! code, allocations), as the driver's per-process figure counts; its pid is the one
//! it sees itself. The simulator has no graphics contexts and no MPS server, so those
//! lists are always empty, as on a compute-only node.

use std::ffi::c_uint;
use std::time::{SystemTime, UNIX_EPOCH};

use kiwi_sim_core::ProcessUsage;

use crate::abi::*;
use crate::ffi::{out, struct_version, write_array};
use crate::state::Gpu;

/// `nvmlDeviceGetMemoryInfo`: used is every process's memory; no firmware reserve.
pub(crate) fn memory_info(handle: Device, memory: *mut Memory) -> Result<(), NvmlReturn> {
    let u = Gpu::of(handle)?.usage()?;
    out(
        memory,
        Memory {
            total: u.capacity,
            free: u.free(),
            used: u.used,
        },
    )
}

/// `nvmlDeviceGetMemoryInfo_v2`: the caller sets `version` to `nvmlMemory_v2`
/// (else `NVML_ERROR_ARGUMENT_VERSION_MISMATCH`). `reserved` (firmware and driver) is
/// 0 on the simulator, so `used` is the same figure as the v1 call's.
pub(crate) fn memory_info_v2(handle: Device, memory: *mut MemoryV2) -> Result<(), NvmlReturn> {
    let gpu = Gpu::of(handle)?;
    if struct_version(memory)? != NVML_MEMORY_V2 {
        return Err(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    }
    let u = gpu.usage()?;
    out(
        memory,
        MemoryV2 {
            version: NVML_MEMORY_V2,
            total: u.capacity,
            reserved: 0,
            free: u.free(),
            used: u.used,
        },
    )
}

/// Which list a running-processes call asks for.
#[derive(Clone, Copy)]
pub(crate) enum Contexts {
    Compute,
    Graphics,
    Mps,
}

/// The processes with a context of that kind on the GPU: for compute, every
/// process holding memory on it.
fn processes(handle: Device, kind: Contexts) -> Result<Vec<ProcessUsage>, NvmlReturn> {
    let u = Gpu::of(handle)?.usage()?;
    Ok(match kind {
        Contexts::Compute => u.processes.into_iter().filter(|p| p.bytes > 0).collect(),
        Contexts::Graphics | Contexts::Mps => Vec::new(),
    })
}

/// A running-process list's entry, in one of NVML's layouts.
pub(crate) trait ProcessEntry {
    fn of(p: &ProcessUsage) -> Self;
}

/// The unversioned `nvmlDevice*RunningProcesses`: `nvmlProcessInfo_v1_t`.
impl ProcessEntry for ProcessInfoV1 {
    fn of(p: &ProcessUsage) -> Self {
        ProcessInfoV1 {
            pid: p.pid,
            used_gpu_memory: p.bytes,
        }
    }
}

/// `_v2` and `_v3`: `nvmlProcessInfo_v2_t` (`nvmlProcessInfo_t`), with no MIG
/// instance.
impl ProcessEntry for ProcessInfoV2 {
    fn of(p: &ProcessUsage) -> Self {
        ProcessInfoV2 {
            pid: p.pid,
            used_gpu_memory: p.bytes,
            gpu_instance_id: NO_MIG_INSTANCE,
            compute_instance_id: NO_MIG_INSTANCE,
        }
    }
}

/// `nvmlDevice{Compute,Graphics,MPSCompute}RunningProcesses` in every version: the
/// entries in the layout `infos` points to.
pub(crate) fn running_processes<T: ProcessEntry>(
    handle: Device,
    kind: Contexts,
    count: *mut c_uint,
    infos: *mut T,
) -> Result<(), NvmlReturn> {
    let list = processes(handle, kind)?.iter().map(T::of).collect();
    write_array(count, infos, list)
}

/// `nvmlDeviceGetProcessUtilization`: a sample per compute process, stamped now
/// (so newer than any `last_seen` a caller can pass), all 0 % (kernel activity is
/// not sampled, see `crate::model`); `NVML_ERROR_NOT_FOUND` when there are none.
pub(crate) fn process_utilization(
    handle: Device,
    samples: *mut ProcessUtilizationSample,
    count: *mut c_uint,
    _last_seen_us: u64,
) -> Result<(), NvmlReturn> {
    let procs = processes(handle, Contexts::Compute)?;
    if procs.is_empty() {
        return Err(NVML_ERROR_NOT_FOUND);
    }
    let now_us = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0);
    let list = procs
        .into_iter()
        .map(|p| ProcessUtilizationSample {
            pid: p.pid,
            time_stamp: now_us,
            sm_util: 0,
            mem_util: 0,
            enc_util: 0,
            dec_util: 0,
        })
        .collect();
    write_array(count, samples, list)
}
