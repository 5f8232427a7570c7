//! Xid events, for the device plugin's health checks: event sets, registration (Xid
//! critical errors only) and waiting. `kiwi-sim fault` raises a fault on the machine
//! segment; each event set reports each fault of a GPU it registered once.

use std::ffi::c_uint;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::abi::*;
use crate::ffi::out;
use crate::state::{state, Gpu};

/// An event set: registered GPUs and the fault generation each has reported up to.
struct Registered {
    gpus: Vec<(u32, u64)>,
}

pub(crate) fn supported_event_types(handle: Device, types: *mut u64) -> Result<(), NvmlReturn> {
    Gpu::of(handle)?;
    out(types, EVENT_TYPE_XID_CRITICAL_ERROR)
}

pub(crate) fn set_create(set: *mut EventSet) -> Result<(), NvmlReturn> {
    state()?;
    let b = Box::new(Mutex::new(Registered { gpus: Vec::new() }));
    out(set, Box::into_raw(b) as EventSet)
}

fn event_set<'a>(set: EventSet) -> Result<&'a Mutex<Registered>, NvmlReturn> {
    if set == 0 {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    // SAFETY: event sets are boxes handed out by nvmlEventSetCreate and live until
    // nvmlEventSetFree (NVML's contract: no use after free).
    Ok(unsafe { &*(set as *const Mutex<Registered>) })
}

pub(crate) fn register(handle: Device, types: u64, set: EventSet) -> Result<(), NvmlReturn> {
    let gpu = Gpu::of(handle)?;
    if types & !EVENT_TYPE_XID_CRITICAL_ERROR != 0 {
        return Err(NVML_ERROR_NOT_SUPPORTED);
    }
    let es = event_set(set)?;
    let generation = gpu
        .state
        .machine
        .fault(gpu.index)
        .map(|f| f.generation)
        .unwrap_or(0);
    let mut g = es.lock().unwrap_or_else(|e| e.into_inner());
    if !g.gpus.iter().any(|(x, _)| *x == gpu.index) {
        g.gpus.push((gpu.index, generation));
    }
    Ok(())
}

/// Waits up to `timeout_ms` for a fault not yet reported on a registered GPU.
pub(crate) fn wait(
    set: EventSet,
    data: *mut EventData,
    timeout_ms: c_uint,
) -> Result<(), NvmlReturn> {
    let s = state()?;
    let es = event_set(set)?;
    if data.is_null() {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    let deadline = Instant::now() + Duration::from_millis(u64::from(timeout_ms));
    loop {
        {
            let mut g = es.lock().unwrap_or_else(|e| e.into_inner());
            for (gpu, seen) in g.gpus.iter_mut() {
                let f = s.machine.fault(*gpu).map_err(|_| NVML_ERROR_UNKNOWN)?;
                if f.generation != *seen {
                    *seen = f.generation;
                    if f.xid != 0 {
                        return out(
                            data,
                            EventData {
                                device: (*gpu as Device + 1) as *mut std::ffi::c_void,
                                event_type: EVENT_TYPE_XID_CRITICAL_ERROR,
                                event_data: f.xid,
                                gpu_instance_id: NO_MIG_INSTANCE,
                                compute_instance_id: NO_MIG_INSTANCE,
                            },
                        );
                    }
                }
            }
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(NVML_ERROR_TIMEOUT);
        }
        std::thread::sleep((deadline - now).min(Duration::from_millis(10)));
    }
}

pub(crate) fn set_free(set: EventSet) -> Result<(), NvmlReturn> {
    event_set(set)?;
    // SAFETY: created by Box::into_raw in nvmlEventSetCreate; freed once.
    drop(unsafe { Box::from_raw(set as *mut Mutex<Registered>) });
    Ok(())
}
