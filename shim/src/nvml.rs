//! NVML's C ABI as a process under Kiwi meets it (issue #39): the entry points that
//! say how much memory is free and who holds it, answered for this process's view
//! ([`crate::view`]) however the library is reached:
//!
//! - **linked** (`-lnvidia-ml`): the shim, preloaded, exports each name, so the
//!   program's references bind here;
//! - **`dlopen` + `dlsym`** (pynvml, `nvidia-smi`, nvitop): the shim's `dlsym`
//!   ([`crate::dl`]) answers these names with the wrappers below, when the handle
//!   really provides the name, and keeps the library's own function to call;
//! - every versioned name (`_v2`, `_v3`), and the detail list of newer drivers.
//!
//! Each wrapper calls the driver's function first (so its checks and errors stand),
//! then replaces free and used memory or the process list with the view's. Calls from
//! inside the shim, and every call with `KIWI_NVML_VIEW=0`, get the driver's answer
//! untouched; so do utilization, clocks and every other query, which the shim does
//! not wrap. No panic crosses this ABI.

#![allow(non_snake_case)]

use std::ffi::{c_char, c_uint, c_void, CStr};
use std::ptr::null_mut;
use std::sync::atomic::{AtomicPtr, Ordering};

use crate::view::{self, Free};

use kiwi_nvml::sys::{
    Device, DeviceGetMemoryInfo as MemoryFn, DeviceGetMemoryInfoV2 as MemoryV2Fn,
    DeviceGetProcessDetailList as DetailFn, DeviceGetProcessUtilization as UtilizationFn, Memory,
    MemoryV2, NvmlReturn, ProcessDetailListV1, ProcessDetailV1, ProcessInfoV1, ProcessInfoV2,
    ProcessUtilizationSample, NO_MIG_INSTANCE as NO_INSTANCE,
    NVML_ERROR_FUNCTION_NOT_FOUND as ERROR_FUNCTION_NOT_FOUND,
    NVML_ERROR_INSUFFICIENT_SIZE as ERROR_INSUFFICIENT_SIZE,
    NVML_ERROR_NOT_FOUND as ERROR_NOT_FOUND, NVML_ERROR_UNKNOWN as ERROR_UNKNOWN,
    NVML_PROCESS_DETAIL_LIST_V1 as PROCESS_DETAIL_LIST_V1, NVML_SUCCESS as SUCCESS,
};

/// The most entries the driver's own list is read into (the view lists at most
/// [`kiwi_protocol::MAX_VIEW_PROCESSES`] of Kiwi's beside it).
const DRIVER_LIST_MAX: usize = 1024;

/// The driver functions the shim uses and wraps, by index: those below `WRAPPED`
/// are exported and handed out by `dlsym`.
const NAMES: [&CStr; 14] = [
    c"nvmlDeviceGetMemoryInfo",
    c"nvmlDeviceGetMemoryInfo_v2",
    c"nvmlDeviceGetComputeRunningProcesses",
    c"nvmlDeviceGetComputeRunningProcesses_v2",
    c"nvmlDeviceGetComputeRunningProcesses_v3",
    c"nvmlDeviceGetGraphicsRunningProcesses",
    c"nvmlDeviceGetGraphicsRunningProcesses_v2",
    c"nvmlDeviceGetGraphicsRunningProcesses_v3",
    c"nvmlDeviceGetMPSComputeRunningProcesses",
    c"nvmlDeviceGetMPSComputeRunningProcesses_v2",
    c"nvmlDeviceGetMPSComputeRunningProcesses_v3",
    c"nvmlDeviceGetRunningProcessDetailList",
    c"nvmlDeviceGetProcessUtilization",
    // Used, not wrapped.
    c"nvmlDeviceGetUUID",
];
const WRAPPED: usize = 13;
const UUID: usize = 13;

/// The driver's function behind each name: the one `dlsym` found for the
/// application, else looked up once ([`real`]).
static REAL: [AtomicPtr<c_void>; NAMES.len()] = [const { AtomicPtr::new(null_mut()) }; NAMES.len()];
/// The library handle an application looked one of the names up in.
static HANDLE: AtomicPtr<c_void> = AtomicPtr::new(null_mut());

/// The index of a wrapped name (`dlsym`'s question), if the shim wraps it.
pub fn lookup(name: &[u8]) -> Option<usize> {
    if !name.starts_with(b"nvml") {
        return None;
    }
    NAMES[..WRAPPED].iter().position(|n| n.to_bytes() == name)
}

/// `dlsym(handle, NAMES[index])` found `found` for the application: the wrapper to
/// hand it instead, or null for the driver's own (the view is off).
pub fn wrap_found(index: usize, handle: *mut c_void, found: *mut c_void) -> *mut c_void {
    if !view::enabled() || index >= WRAPPED {
        return null_mut();
    }
    let own = wrapper(index);
    if found != own {
        let _ =
            REAL[index].compare_exchange(null_mut(), found, Ordering::AcqRel, Ordering::Acquire);
        if !handle.is_null() && handle != libc::RTLD_DEFAULT && handle != libc::RTLD_NEXT {
            HANDLE.store(handle, Ordering::Release);
        }
    }
    own
}

/// The driver's `NAMES[index]`: found for the application, else in the library an
/// application used, else the next object after the shim, else `libnvidia-ml.so.1`
/// if it is loaded. Null where none provides it.
fn real(index: usize) -> *mut c_void {
    let p = REAL[index].load(Ordering::Acquire);
    if !p.is_null() {
        return p;
    }
    let name = NAMES[index].as_ptr();
    let dlsym = crate::real::real_dlsym();
    let own = if index < WRAPPED {
        wrapper(index)
    } else {
        null_mut()
    };
    let mut found = null_mut();
    let handle = HANDLE.load(Ordering::Acquire);
    if !handle.is_null() {
        // SAFETY: glibc's dlsym on a handle the application got from dlopen.
        found = unsafe { dlsym(handle, name) };
    }
    if found.is_null() || found == own {
        // SAFETY: glibc's dlsym, relative to the shim (the object calling it).
        found = unsafe { dlsym(libc::RTLD_NEXT, name) };
    }
    if found.is_null() || found == own {
        // SAFETY: dlopen of a loaded library by its soname (RTLD_NOLOAD loads nothing).
        let lib = unsafe {
            libc::dlopen(
                c"libnvidia-ml.so.1".as_ptr(),
                libc::RTLD_NOW | libc::RTLD_NOLOAD,
            )
        };
        if !lib.is_null() {
            // SAFETY: glibc's dlsym on the handle just opened.
            found = unsafe { dlsym(lib, name) };
            // SAFETY: balances the dlopen above; the library stays loaded.
            unsafe { libc::dlclose(lib) };
        }
    }
    if found.is_null() || found == own {
        return null_mut();
    }
    REAL[index].store(found, Ordering::Release);
    found
}

/// The driver's `NAMES[$index]` as a function of type `$ty`, or an NVML error
/// return where no library provides it.
macro_rules! real_or_missing {
    ($index:expr, $ty:ty) => {{
        let p = real($index);
        if p.is_null() {
            return ERROR_FUNCTION_NOT_FOUND;
        }
        // SAFETY: `NAMES[$index]` has this signature in nvml.h.
        unsafe { std::mem::transmute::<*mut c_void, $ty>(p) }
    }};
}

/// GPU `d`'s UUID as the driver names it.
fn uuid_of(d: Device) -> Option<String> {
    let p = real(UUID);
    if p.is_null() {
        return None;
    }
    type GetUuid = unsafe extern "C" fn(Device, *mut c_char, c_uint) -> NvmlReturn;
    // SAFETY: nvmlDeviceGetUUID's signature in nvml.h.
    let f = unsafe { std::mem::transmute::<*mut c_void, GetUuid>(p) };
    let mut buf = [0 as c_char; 96];
    // SAFETY: `buf` holds 96 bytes, the length passed; `d` is the caller's handle.
    if unsafe { f(d, buf.as_mut_ptr(), buf.len() as c_uint) } != SUCCESS {
        return None;
    }
    // SAFETY: NVML NUL-terminates the UUID within the buffer on success.
    let uuid = unsafe { CStr::from_ptr(buf.as_ptr()) };
    uuid.to_str().ok().map(str::to_string)
}

/// Runs a wrapper's body: the driver's answer alone from inside the shim (`direct`),
/// a panic turned into `NVML_ERROR_UNKNOWN`.
fn guarded(
    name: &str,
    direct: impl FnOnce() -> NvmlReturn,
    body: impl FnOnce() -> NvmlReturn,
) -> NvmlReturn {
    if crate::ffi::reentered() || !view::enabled() {
        return direct();
    }
    let r = crate::ffi::guarded(name, || body() as crate::cuda::CUresult);
    if r == crate::cuda::CUDA_ERROR_UNKNOWN {
        ERROR_UNKNOWN
    } else {
        r as NvmlReturn
    }
}

/// The view's free memory on `d` with the driver's `total` (and `reserved`, memory
/// that is neither free nor used in `_v2`); `None`: the driver's figures stand.
fn view_free(d: Device, total: u64, reserved: u64) -> Option<u64> {
    let uuid = uuid_of(d)?;
    let room = total.saturating_sub(reserved);
    match view::free(&uuid) {
        Free::Driver => None,
        Free::Bytes(b) => Some(b.min(room)),
        Free::Besides(b) => Some(room.saturating_sub(b)),
    }
}

/// `nvmlDeviceGetMemoryInfo`.
///
/// # Safety
/// nvml.h's contract: `memory` is null or points to an `nvmlMemory_t`.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo(d: Device, memory: *mut Memory) -> NvmlReturn {
    let f = real_or_missing!(0, MemoryFn);
    // SAFETY: forwarding the caller's arguments.
    let r = unsafe { f(d, memory) };
    if r != SUCCESS || memory.is_null() {
        return r;
    }
    guarded(
        "nvmlDeviceGetMemoryInfo",
        || r,
        || {
            // SAFETY: non-null, and the driver just filled it.
            let m = unsafe { &mut *memory };
            if let Some(free) = view_free(d, m.total, 0) {
                m.free = free;
                m.used = m.total - free;
            }
            r
        },
    )
}

/// `nvmlDeviceGetMemoryInfo_v2`.
///
/// # Safety
/// nvml.h's contract: `memory` is null or points to an `nvmlMemory_v2_t` whose
/// `version` the caller set.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo_v2(
    d: Device,
    memory: *mut MemoryV2,
) -> NvmlReturn {
    let f = real_or_missing!(1, MemoryV2Fn);
    // SAFETY: forwarding the caller's arguments.
    let r = unsafe { f(d, memory) };
    if r != SUCCESS || memory.is_null() {
        return r;
    }
    guarded(
        "nvmlDeviceGetMemoryInfo_v2",
        || r,
        || {
            // SAFETY: non-null, and the driver just filled it.
            let m = unsafe { &mut *memory };
            let reserved = m.reserved.min(m.total);
            if let Some(free) = view_free(d, m.total, reserved) {
                m.free = free;
                m.used = m.total - reserved - free;
            }
            r
        },
    )
}

/// An entry of one of the driver's process lists.
trait Entry: Copy + Default {
    fn make(pid: u32, bytes: u64) -> Self;
    fn pid(&self) -> u32;
    fn bytes(&self) -> u64;
}

/// [`Entry`] for a process list's entry type: every one has `pid` and
/// `used_gpu_memory`; `$field: $value` fill the fields the type adds.
macro_rules! entry {
    ($t:ident { $($field:ident: $value:expr),* $(,)? }) => {
        impl Entry for $t {
            fn make(pid: u32, bytes: u64) -> Self {
                $t {
                    pid,
                    used_gpu_memory: bytes,
                    $($field: $value,)*
                }
            }
            fn pid(&self) -> u32 {
                self.pid
            }
            fn bytes(&self) -> u64 {
                self.used_gpu_memory
            }
        }
    };
}

entry!(ProcessInfoV1 {});
entry!(ProcessInfoV2 {
    gpu_instance_id: NO_INSTANCE,
    compute_instance_id: NO_INSTANCE,
});
entry!(ProcessDetailV1 {
    gpu_instance_id: NO_INSTANCE,
    compute_instance_id: NO_INSTANCE,
    used_gpu_cc_protected_memory: 0,
});

/// Writes `list` as NVML does: `*count` in is the room at `out`; too little (or no
/// array for a non-empty list) sets `*count` to what is needed and answers
/// `NVML_ERROR_INSUFFICIENT_SIZE`.
///
/// # Safety
/// `count` is non-null; `out` is null or has room for `*count` entries.
unsafe fn write_list<E: Entry>(count: *mut c_uint, out: *mut E, list: &[(u32, u64)]) -> NvmlReturn {
    // SAFETY: the caller's count, checked non-null by our caller.
    let room = unsafe { *count } as usize;
    // SAFETY: as above.
    unsafe { *count = list.len() as c_uint };
    if list.is_empty() {
        return SUCCESS;
    }
    if out.is_null() || room < list.len() {
        return ERROR_INSUFFICIENT_SIZE;
    }
    for (i, &(pid, bytes)) in list.iter().enumerate() {
        // SAFETY: i < list.len() <= room, the caller's array length.
        unsafe { out.add(i).write(E::make(pid, bytes)) };
    }
    SUCCESS
}

type ListFn<E> = unsafe extern "C" fn(Device, *mut c_uint, *mut E) -> NvmlReturn;

/// One of the `nvmlDevice*RunningProcesses*` lists through the view.
///
/// # Safety
/// nvml.h's contract for these functions.
unsafe fn running<E: Entry>(
    name: &str,
    f: ListFn<E>,
    compute: bool,
    d: Device,
    count: *mut c_uint,
    out: *mut E,
) -> NvmlReturn {
    // SAFETY: forwarding the caller's arguments.
    let direct = || unsafe { f(d, count, out) };
    if count.is_null() {
        return direct();
    }
    guarded(name, direct, || {
        let Some(uuid) = uuid_of(d) else {
            return direct();
        };
        let driver = || {
            let mut buf = vec![E::default(); DRIVER_LIST_MAX];
            let mut n = buf.len() as c_uint;
            // SAFETY: `buf` has room for `n` entries.
            (unsafe { f(d, &mut n, buf.as_mut_ptr()) } == SUCCESS).then(|| {
                buf.truncate((n as usize).min(DRIVER_LIST_MAX));
                buf.iter().map(|e| (e.pid(), e.bytes())).collect()
            })
        };
        match view::processes(&uuid, compute, driver) {
            None => direct(),
            // SAFETY: `count` non-null; `out` the caller's array of `*count`.
            Some(list) => unsafe { write_list(count, out, &list) },
        }
    })
}

macro_rules! process_lists {
    ($($name:ident: $index:literal, $entry:ty, $compute:literal;)*) => {
        $(
            /// One of NVML's running-process lists, answered for the view.
            ///
            /// # Safety
            /// nvml.h's contract: `count` points to the room at `infos`.
            #[no_mangle]
            pub unsafe extern "C" fn $name(
                d: Device,
                count: *mut c_uint,
                infos: *mut $entry,
            ) -> NvmlReturn {
                let f = real_or_missing!($index, ListFn<$entry>);
                // SAFETY: the caller's arguments, nvml.h's contract.
                unsafe { running(stringify!($name), f, $compute, d, count, infos) }
            }
        )*
    };
}

process_lists! {
    nvmlDeviceGetComputeRunningProcesses: 2, ProcessInfoV1, true;
    nvmlDeviceGetComputeRunningProcesses_v2: 3, ProcessInfoV2, true;
    nvmlDeviceGetComputeRunningProcesses_v3: 4, ProcessInfoV2, true;
    nvmlDeviceGetGraphicsRunningProcesses: 5, ProcessInfoV1, false;
    nvmlDeviceGetGraphicsRunningProcesses_v2: 6, ProcessInfoV2, false;
    nvmlDeviceGetGraphicsRunningProcesses_v3: 7, ProcessInfoV2, false;
    nvmlDeviceGetMPSComputeRunningProcesses: 8, ProcessInfoV1, false;
    nvmlDeviceGetMPSComputeRunningProcesses_v2: 9, ProcessInfoV2, false;
    nvmlDeviceGetMPSComputeRunningProcesses_v3: 10, ProcessInfoV2, false;
}

/// `nvmlDeviceGetRunningProcessDetailList` (drivers ≥ 550): `mode` 0 is the compute
/// list, 1 graphics, 2 MPS.
///
/// # Safety
/// nvml.h's contract: `list` is null or a `nvmlProcessDetailList_t` whose version,
/// mode, array and its length the caller set.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetRunningProcessDetailList(
    d: Device,
    list: *mut ProcessDetailListV1,
) -> NvmlReturn {
    let f = real_or_missing!(11, DetailFn);
    // SAFETY: forwarding the caller's arguments.
    let direct = || unsafe { f(d, list) };
    // SAFETY: read only when non-null; the caller's structure.
    if list.is_null() || unsafe { (*list).version } != PROCESS_DETAIL_LIST_V1 {
        return direct();
    }
    guarded("nvmlDeviceGetRunningProcessDetailList", direct, || {
        let Some(uuid) = uuid_of(d) else {
            return direct();
        };
        // SAFETY: non-null, the caller's structure.
        let l = unsafe { &mut *list };
        let mode = l.mode;
        let driver = || {
            let mut buf = vec![ProcessDetailV1::default(); DRIVER_LIST_MAX];
            let mut mine = ProcessDetailListV1 {
                version: PROCESS_DETAIL_LIST_V1,
                mode,
                num_proc_array_entries: buf.len() as c_uint,
                proc_array: buf.as_mut_ptr(),
            };
            // SAFETY: our own structure, its array of `num_proc_array_entries`.
            (unsafe { f(d, &mut mine) } == SUCCESS).then(|| {
                buf.truncate((mine.num_proc_array_entries as usize).min(DRIVER_LIST_MAX));
                buf.iter().map(|e| (e.pid(), e.bytes())).collect()
            })
        };
        match view::processes(&uuid, mode == 0, driver) {
            None => direct(),
            // SAFETY: the caller's array of `num_proc_array_entries` entries.
            Some(v) => unsafe { write_list(&mut l.num_proc_array_entries, l.proc_array, &v) },
        }
    })
}

/// `nvmlDeviceGetProcessUtilization`: the driver's samples of the processes the view
/// lists only.
///
/// # Safety
/// nvml.h's contract: `count` points to the room at `samples` (null asks the size).
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetProcessUtilization(
    d: Device,
    samples: *mut ProcessUtilizationSample,
    count: *mut c_uint,
    last_seen: u64,
) -> NvmlReturn {
    let f = real_or_missing!(12, UtilizationFn);
    // SAFETY: forwarding the caller's arguments.
    let r = unsafe { f(d, samples, count, last_seen) };
    if r != SUCCESS || samples.is_null() || count.is_null() {
        return r;
    }
    guarded(
        "nvmlDeviceGetProcessUtilization",
        || r,
        || {
            let Some(uuid) = uuid_of(d) else {
                return r;
            };
            // SAFETY: the driver filled `*count` entries of the caller's array.
            let got = unsafe { std::slice::from_raw_parts_mut(samples, *count as usize) };
            let pids: Vec<(u32, u64)> = got.iter().map(|s| (s.pid, 0)).collect();
            let Some(visible) = view::processes(&uuid, true, || Some(pids)) else {
                return r;
            };
            let mut kept = 0;
            for i in 0..got.len() {
                if visible.iter().any(|&(p, _)| p == got[i].pid) {
                    got[kept] = got[i];
                    kept += 1;
                }
            }
            // SAFETY: non-null, the caller's count.
            unsafe { *count = kept as c_uint };
            if kept == 0 {
                ERROR_NOT_FOUND
            } else {
                r
            }
        },
    )
}

/// The wrapper of `NAMES[index]` (`index < WRAPPED`).
pub fn wrapper(index: usize) -> *mut c_void {
    let f: *const () = match index {
        0 => nvmlDeviceGetMemoryInfo as *const (),
        1 => nvmlDeviceGetMemoryInfo_v2 as *const (),
        2 => nvmlDeviceGetComputeRunningProcesses as *const (),
        3 => nvmlDeviceGetComputeRunningProcesses_v2 as *const (),
        4 => nvmlDeviceGetComputeRunningProcesses_v3 as *const (),
        5 => nvmlDeviceGetGraphicsRunningProcesses as *const (),
        6 => nvmlDeviceGetGraphicsRunningProcesses_v2 as *const (),
        7 => nvmlDeviceGetGraphicsRunningProcesses_v3 as *const (),
        8 => nvmlDeviceGetMPSComputeRunningProcesses as *const (),
        9 => nvmlDeviceGetMPSComputeRunningProcesses_v2 as *const (),
        10 => nvmlDeviceGetMPSComputeRunningProcesses_v3 as *const (),
        11 => nvmlDeviceGetRunningProcessDetailList as *const (),
        12 => nvmlDeviceGetProcessUtilization as *const (),
        _ => std::ptr::null(),
    };
    f as *mut c_void
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_wrapped_name_has_its_wrapper_and_lookup() {
        for (i, name) in NAMES[..WRAPPED].iter().enumerate() {
            assert_eq!(lookup(name.to_bytes()), Some(i), "{name:?}");
            assert!(!wrapper(i).is_null(), "{name:?}");
        }
        assert_eq!(lookup(b"nvmlDeviceGetUUID"), None, "used, not wrapped");
        assert_eq!(lookup(b"nvmlDeviceGetUtilizationRates"), None);
        assert_eq!(lookup(b"cuInit"), None);
    }

    #[test]
    fn a_list_too_long_for_the_room_asks_for_more() {
        let list = [(7, 100), (8, 200)];
        let mut out = [ProcessInfoV2::default(); 1];
        let mut count = 1;
        // SAFETY: `out` has room for `count` entries.
        let r = unsafe { write_list(&mut count, out.as_mut_ptr(), &list) };
        assert_eq!((r, count), (ERROR_INSUFFICIENT_SIZE, 2));
        let mut out = [ProcessInfoV2::default(); 4];
        let mut count = 4;
        // SAFETY: as above.
        let r = unsafe { write_list(&mut count, out.as_mut_ptr(), &list) };
        assert_eq!((r, count), (SUCCESS, 2));
        assert_eq!((out[1].pid, out[1].used_gpu_memory), (8, 200));
        assert_eq!(out[0].gpu_instance_id, NO_INSTANCE);
        let mut count = 0;
        // SAFETY: a null array with no room, as a size query passes.
        let r = unsafe { write_list::<ProcessInfoV1>(&mut count, null_mut(), &[]) };
        assert_eq!((r, count), (SUCCESS, 0));
    }
}
