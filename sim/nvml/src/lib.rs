//! `libnvidia-ml.so.1` of the Kiwi GPU simulator: the NVML calls the device plugin
//! uses (init, count, handles, UUID, name, memory, each process's memory, minor
//! number, PCI info, Xid events), reporting the same simulated GPUs as the simulator's `libcuda.so.1`
//! (same machine segment, same UUIDs). `kiwi-sim fault` raises the faults it reports.
//!
//! Every export catches panics and returns `NVML_ERROR_UNKNOWN` instead.
#![allow(non_snake_case)]

use std::ffi::{c_char, c_uint};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use kiwi_sim_core::{ident, Machine, SimConfig};

type NvmlReturn = u32;
const NVML_SUCCESS: NvmlReturn = 0;
const NVML_ERROR_UNINITIALIZED: NvmlReturn = 1;
const NVML_ERROR_INVALID_ARGUMENT: NvmlReturn = 2;
const NVML_ERROR_NOT_SUPPORTED: NvmlReturn = 3;
const NVML_ERROR_NOT_FOUND: NvmlReturn = 6;
const NVML_ERROR_INSUFFICIENT_SIZE: NvmlReturn = 7;
const NVML_ERROR_DRIVER_NOT_LOADED: NvmlReturn = 9;
const NVML_ERROR_TIMEOUT: NvmlReturn = 10;
const NVML_ERROR_GPU_IS_LOST: NvmlReturn = 15;
const NVML_ERROR_UNKNOWN: NvmlReturn = 999;

/// `nvmlEventTypeXidCriticalError`.
const EVENT_XID: u64 = 0x8;

/// The driver version NVML reports (matches the CUDA stand-in's 12.4).
const DRIVER_VERSION: &str = "550.54.15";

/// `nvmlMemory_t`.
#[repr(C)]
pub struct NvmlMemory {
    total: u64,
    free: u64,
    used: u64,
}

/// `nvmlPciInfo_t` (v3 layout).
#[repr(C)]
pub struct NvmlPciInfo {
    bus_id_legacy: [c_char; 16],
    domain: c_uint,
    bus: c_uint,
    device: c_uint,
    pci_device_id: c_uint,
    pci_sub_system_id: c_uint,
    bus_id: [c_char; 32],
}

/// `nvmlEventData_t`.
#[repr(C)]
pub struct NvmlEventData {
    device: usize,
    event_type: u64,
    event_data: u64,
    gpu_instance_id: c_uint,
    compute_instance_id: c_uint,
}

struct State {
    machine: Machine,
    name: String,
}

static STATE: OnceLock<Result<State, NvmlReturn>> = OnceLock::new();
static INIT_COUNT: AtomicU32 = AtomicU32::new(0);

/// An event set: registered GPUs and the fault generation each has reported up to.
struct EventSet {
    gpus: Vec<(u32, u64)>,
}

fn guard(f: impl FnOnce() -> Result<(), NvmlReturn>) -> NvmlReturn {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => NVML_SUCCESS,
        Ok(Err(e)) => e,
        Err(_) => NVML_ERROR_UNKNOWN,
    }
}

fn out<T>(p: *mut T, v: T) -> Result<(), NvmlReturn> {
    if p.is_null() {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    // SAFETY: NVML's contract: a non-NULL out-pointer points to storage for a T.
    unsafe { p.write_unaligned(v) };
    Ok(())
}

fn write_str(buf: *mut c_char, len: c_uint, s: &str) -> Result<(), NvmlReturn> {
    if buf.is_null() {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    if (len as usize) < s.len() + 1 {
        return Err(NVML_ERROR_INSUFFICIENT_SIZE);
    }
    // SAFETY: the caller's buffer holds `len` >= s.len() + 1 bytes.
    unsafe {
        std::ptr::copy_nonoverlapping(s.as_ptr(), buf.cast::<u8>(), s.len());
        *buf.add(s.len()) = 0;
    }
    Ok(())
}

fn fill_chars<const N: usize>(s: &str) -> [c_char; N] {
    let mut a = [0 as c_char; N];
    for (i, b) in s.bytes().take(N - 1).enumerate() {
        a[i] = b as c_char;
    }
    a
}

fn state() -> Result<&'static State, NvmlReturn> {
    if INIT_COUNT.load(Ordering::Acquire) == 0 {
        return Err(NVML_ERROR_UNINITIALIZED);
    }
    match STATE.get() {
        Some(Ok(s)) => Ok(s),
        Some(Err(e)) => Err(*e),
        None => Err(NVML_ERROR_UNINITIALIZED),
    }
}

fn init() -> Result<(), NvmlReturn> {
    let r = STATE.get_or_init(|| {
        let cfg = SimConfig::from_env().map_err(|e| {
            eprintln!("kiwi-sim libnvidia-ml: {e}");
            NVML_ERROR_DRIVER_NOT_LOADED
        })?;
        let machine = Machine::open(&cfg).map_err(|e| {
            eprintln!("kiwi-sim libnvidia-ml: {e}");
            NVML_ERROR_DRIVER_NOT_LOADED
        })?;
        Ok(State {
            machine,
            name: cfg.name,
        })
    });
    match r {
        Ok(_) => {
            INIT_COUNT.fetch_add(1, Ordering::AcqRel);
            Ok(())
        }
        Err(e) => Err(*e),
    }
}

/// Device handles are `index + 1` wearing a pointer type (never NULL).
fn handle_index(s: &State, h: usize) -> Result<u32, NvmlReturn> {
    let i = h.checked_sub(1).ok_or(NVML_ERROR_INVALID_ARGUMENT)? as u32;
    if i >= s.machine.gpu_count() {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    Ok(i)
}

fn device_index(h: usize) -> Result<(&'static State, u32), NvmlReturn> {
    let s = state()?;
    let i = handle_index(s, h)?;
    if s.machine.fault(i).map(|f| f.lost).unwrap_or(false) {
        return Err(NVML_ERROR_GPU_IS_LOST);
    }
    Ok((s, i))
}

#[no_mangle]
extern "C" fn nvmlInit_v2() -> NvmlReturn {
    guard(init)
}

#[no_mangle]
extern "C" fn nvmlInit() -> NvmlReturn {
    guard(init)
}

#[no_mangle]
extern "C" fn nvmlInitWithFlags(_flags: c_uint) -> NvmlReturn {
    guard(init)
}

#[no_mangle]
extern "C" fn nvmlShutdown() -> NvmlReturn {
    guard(|| {
        INIT_COUNT
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
            .map(|_| ())
            .map_err(|_| NVML_ERROR_UNINITIALIZED)
    })
}

#[no_mangle]
extern "C" fn nvmlErrorString(r: NvmlReturn) -> *const c_char {
    let s: &'static std::ffi::CStr = match r {
        NVML_SUCCESS => c"Success",
        NVML_ERROR_UNINITIALIZED => c"Uninitialized",
        NVML_ERROR_INVALID_ARGUMENT => c"Invalid Argument",
        NVML_ERROR_NOT_SUPPORTED => c"Not Supported",
        NVML_ERROR_NOT_FOUND => c"Not Found",
        NVML_ERROR_INSUFFICIENT_SIZE => c"Insufficient Size",
        NVML_ERROR_DRIVER_NOT_LOADED => c"Driver Not Loaded",
        NVML_ERROR_TIMEOUT => c"Timeout",
        NVML_ERROR_GPU_IS_LOST => c"GPU is lost",
        _ => c"Unknown Error",
    };
    s.as_ptr()
}

#[no_mangle]
extern "C" fn nvmlSystemGetDriverVersion(buf: *mut c_char, len: c_uint) -> NvmlReturn {
    guard(|| {
        state()?;
        write_str(buf, len, DRIVER_VERSION)
    })
}

#[no_mangle]
extern "C" fn nvmlSystemGetCudaDriverVersion(v: *mut i32) -> NvmlReturn {
    guard(|| {
        state()?;
        out(v, 12040)
    })
}

#[no_mangle]
extern "C" fn nvmlDeviceGetCount_v2(count: *mut c_uint) -> NvmlReturn {
    guard(|| out(count, state()?.machine.gpu_count()))
}

#[no_mangle]
extern "C" fn nvmlDeviceGetCount(count: *mut c_uint) -> NvmlReturn {
    nvmlDeviceGetCount_v2(count)
}

fn handle_by_index(i: c_uint, h: *mut usize) -> Result<(), NvmlReturn> {
    let s = state()?;
    if i >= s.machine.gpu_count() {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    if s.machine.fault(i).map(|f| f.lost).unwrap_or(false) {
        return Err(NVML_ERROR_GPU_IS_LOST);
    }
    out(h, i as usize + 1)
}

#[no_mangle]
extern "C" fn nvmlDeviceGetHandleByIndex_v2(i: c_uint, h: *mut usize) -> NvmlReturn {
    guard(|| handle_by_index(i, h))
}

#[no_mangle]
extern "C" fn nvmlDeviceGetHandleByIndex(i: c_uint, h: *mut usize) -> NvmlReturn {
    guard(|| handle_by_index(i, h))
}

#[no_mangle]
extern "C" fn nvmlDeviceGetHandleByUUID(uuid: *const c_char, h: *mut usize) -> NvmlReturn {
    guard(|| {
        let s = state()?;
        if uuid.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        // SAFETY: NVML's contract: a NUL-terminated string.
        let want = unsafe { std::ffi::CStr::from_ptr(uuid) }
            .to_str()
            .map_err(|_| NVML_ERROR_INVALID_ARGUMENT)?;
        let i = (0..s.machine.gpu_count())
            .find(|&i| ident::gpu_uuid_string(&s.name, i) == want)
            .ok_or(NVML_ERROR_NOT_FOUND)?;
        handle_by_index(i, h)
    })
}

#[no_mangle]
extern "C" fn nvmlDeviceGetIndex(h: usize, index: *mut c_uint) -> NvmlReturn {
    guard(|| out(index, device_index(h)?.1))
}

#[no_mangle]
extern "C" fn nvmlDeviceGetMinorNumber(h: usize, minor: *mut c_uint) -> NvmlReturn {
    guard(|| out(minor, device_index(h)?.1))
}

#[no_mangle]
extern "C" fn nvmlDeviceGetUUID(h: usize, buf: *mut c_char, len: c_uint) -> NvmlReturn {
    guard(|| {
        let (s, i) = device_index(h)?;
        write_str(buf, len, &ident::gpu_uuid_string(&s.name, i))
    })
}

#[no_mangle]
extern "C" fn nvmlDeviceGetName(h: usize, buf: *mut c_char, len: c_uint) -> NvmlReturn {
    guard(|| {
        device_index(h)?;
        write_str(buf, len, ident::DEVICE_NAME)
    })
}

#[no_mangle]
extern "C" fn nvmlDeviceGetMemoryInfo(h: usize, mem: *mut NvmlMemory) -> NvmlReturn {
    guard(|| {
        let (s, i) = device_index(h)?;
        let u = s.machine.usage(i).map_err(|_| NVML_ERROR_UNKNOWN)?;
        out(
            mem,
            NvmlMemory {
                total: u.capacity,
                free: u.free(),
                used: u.used,
            },
        )
    })
}

/// `nvmlProcessInfo_t` (`nvmlProcessInfo_v2_t`'s layout).
#[repr(C)]
pub struct NvmlProcessInfo {
    pid: c_uint,
    used_gpu_memory: u64,
    gpu_instance_id: c_uint,
    compute_instance_id: c_uint,
}

/// No MIG: the instance ids NVML reports then.
const NO_INSTANCE: c_uint = 0xFFFF_FFFF;

/// Each process with memory on the GPU and how much: everything the simulator charges
/// it (contexts, code, allocations), as the driver's per-process figure counts.
/// `NVML_ERROR_INSUFFICIENT_SIZE` with the count needed when `*count` is too small.
#[no_mangle]
extern "C" fn nvmlDeviceGetComputeRunningProcesses_v3(
    h: usize,
    count: *mut c_uint,
    infos: *mut NvmlProcessInfo,
) -> NvmlReturn {
    guard(|| {
        let (s, i) = device_index(h)?;
        if count.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        let u = s.machine.usage(i).map_err(|_| NVML_ERROR_UNKNOWN)?;
        let procs: Vec<_> = u.processes.iter().filter(|p| p.bytes > 0).collect();
        // SAFETY: checked non-null; NVML's contract: a valid in/out count.
        let room = unsafe { *count } as usize;
        out(count, procs.len() as c_uint)?;
        if procs.len() > room {
            return Err(NVML_ERROR_INSUFFICIENT_SIZE);
        }
        if !procs.is_empty() && infos.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        for (k, p) in procs.into_iter().enumerate() {
            // SAFETY: the caller's array holds `room` >= k + 1 entries.
            unsafe {
                infos.add(k).write(NvmlProcessInfo {
                    pid: p.pid,
                    used_gpu_memory: p.bytes,
                    gpu_instance_id: NO_INSTANCE,
                    compute_instance_id: NO_INSTANCE,
                })
            };
        }
        Ok(())
    })
}

fn pci_info(h: usize, pci: *mut NvmlPciInfo) -> Result<(), NvmlReturn> {
    let (_, i) = device_index(h)?;
    let id = ident::pci_bus_id(i);
    out(
        pci,
        NvmlPciInfo {
            bus_id_legacy: fill_chars(&id[4..]),
            domain: 0,
            bus: ident::pci_bus(i),
            device: 0,
            // NVIDIA vendor id 0x10de in the low half, as NVML reports it.
            pci_device_id: 0x20b0_10de,
            pci_sub_system_id: 0x1450_10de,
            bus_id: fill_chars(&id),
        },
    )
}

#[no_mangle]
extern "C" fn nvmlDeviceGetPciInfo_v3(h: usize, pci: *mut NvmlPciInfo) -> NvmlReturn {
    guard(|| pci_info(h, pci))
}

#[no_mangle]
extern "C" fn nvmlDeviceGetPciInfo_v2(h: usize, pci: *mut NvmlPciInfo) -> NvmlReturn {
    guard(|| pci_info(h, pci))
}

#[no_mangle]
extern "C" fn nvmlDeviceGetSupportedEventTypes(h: usize, types: *mut u64) -> NvmlReturn {
    guard(|| {
        device_index(h)?;
        out(types, EVENT_XID)
    })
}

#[no_mangle]
extern "C" fn nvmlEventSetCreate(set: *mut usize) -> NvmlReturn {
    guard(|| {
        state()?;
        let b = Box::new(Mutex::new(EventSet { gpus: Vec::new() }));
        out(set, Box::into_raw(b) as usize)
    })
}

fn event_set<'a>(set: usize) -> Result<&'a Mutex<EventSet>, NvmlReturn> {
    if set == 0 {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    // SAFETY: event sets are boxes handed out by nvmlEventSetCreate and live until
    // nvmlEventSetFree (NVML's contract: no use after free).
    Ok(unsafe { &*(set as *const Mutex<EventSet>) })
}

#[no_mangle]
extern "C" fn nvmlDeviceRegisterEvents(h: usize, types: u64, set: usize) -> NvmlReturn {
    guard(|| {
        let (s, i) = device_index(h)?;
        if types & !EVENT_XID != 0 {
            return Err(NVML_ERROR_NOT_SUPPORTED);
        }
        let es = event_set(set)?;
        let generation = s.machine.fault(i).map(|f| f.generation).unwrap_or(0);
        let mut g = es.lock().unwrap_or_else(|e| e.into_inner());
        if !g.gpus.iter().any(|(x, _)| *x == i) {
            g.gpus.push((i, generation));
        }
        Ok(())
    })
}

#[no_mangle]
extern "C" fn nvmlEventSetWait_v2(
    set: usize,
    data: *mut NvmlEventData,
    timeout_ms: c_uint,
) -> NvmlReturn {
    guard(|| {
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
                                NvmlEventData {
                                    device: *gpu as usize + 1,
                                    event_type: EVENT_XID,
                                    event_data: f.xid,
                                    gpu_instance_id: u32::MAX,
                                    compute_instance_id: u32::MAX,
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
    })
}

#[no_mangle]
extern "C" fn nvmlEventSetWait(
    set: usize,
    data: *mut NvmlEventData,
    timeout_ms: c_uint,
) -> NvmlReturn {
    nvmlEventSetWait_v2(set, data, timeout_ms)
}

#[no_mangle]
extern "C" fn nvmlEventSetFree(set: usize) -> NvmlReturn {
    guard(|| {
        event_set(set)?;
        // SAFETY: created by Box::into_raw in nvmlEventSetCreate; freed once.
        drop(unsafe { Box::from_raw(set as *mut Mutex<EventSet>) });
        Ok(())
    })
}
