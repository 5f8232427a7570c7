//! Page-locked host memory as the API sees it: `cuMemHostAlloc`, `cuMemAllocHost`,
//! `cuMemFreeHost`, `cuMemHostRegister`, `cuMemHostUnregister` and
//! `cuMemHostGetDevicePointer`, each taking the time pinning takes on hardware.
//! Bodies of the exports `crate::exports` lists; the registry of pinned ranges is
//! `crate::host_ranges`'.

use std::ffi::c_void;

use crate::abi::*;
use crate::capture;
use crate::driver::{self, driver};
use crate::ffi::out;
use crate::host_ranges::HostMap;
use crate::hw::take_time;

/// `cuMemAllocHost_v2` (`flags` 0) and `cuMemHostAlloc`.
pub(crate) fn alloc(pp: *mut *mut c_void, size: usize, flags: u32) -> Result<(), CUresult> {
    if flags & !0x7 != 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let map = HostMap {
        device_map: flags & CU_MEMHOST_DEVICEMAP != 0,
        read_only: false,
    };
    let start = std::time::Instant::now();
    let d = driver()?;
    driver::current()?;
    capture::refuse_unsafe()?;
    if pp.is_null() || size == 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // Populated at once: the real driver page-locks pinned memory when it allocates
    // it, so no copy into or out of it ever waits for a page fault (the time goes to
    // this call, as it does on hardware).
    // SAFETY: anonymous private mapping; affects no existing memory.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            size,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_POPULATE,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(CUDA_ERROR_OUT_OF_MEMORY);
    }
    d.mem.host.add(p as usize, size, true, map)?;
    out(pp, p)?;
    take_time(start, d.pin_seconds(size));
    Ok(())
}

/// `cuMemFreeHost`.
pub(crate) fn free(p: *mut c_void) -> Result<(), CUresult> {
    let d = driver()?;
    capture::refuse_unsafe()?;
    let len = d.mem.host.remove(p as usize, true)?;
    // SAFETY: unmapping a mapping `alloc` created with this length.
    unsafe { libc::munmap(p, len) };
    Ok(())
}

/// `cuMemHostRegister_v2`.
pub(crate) fn register(p: *mut c_void, size: usize, flags: u32) -> Result<(), CUresult> {
    let d = driver()?;
    driver::current()?;
    capture::refuse_unsafe()?;
    if p.is_null() || size == 0 || flags & !0xf != 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let start = std::time::Instant::now();
    let map = HostMap {
        device_map: flags & CU_MEMHOST_DEVICEMAP != 0,
        read_only: flags & CU_MEMHOSTREGISTER_READ_ONLY != 0,
    };
    d.mem.host.add(p as usize, size, false, map)?;
    // The real driver page-locks the range, populating every page now, inside the
    // charged time, not at the first copy into it (its cost with fresh memory,
    // docs/gpu-validation.md).
    let page = 4096;
    let from = p as usize / page * page;
    let len = (p as usize + size).next_multiple_of(page) - from;
    // Pages already populated register several times faster than fresh ones (the
    // cost is populating, not pinning: 20–21 GB/s against 2.7–3.7 GB/s on an H100,
    // docs/gpu-validation.md): each kind is charged at its rate.
    let populated = populated_bytes(from, len).min(size);
    // SAFETY: advice on the caller's own range, which it asks to page-lock; populating
    // for write keeps its contents.
    unsafe { libc::madvise(from as *mut c_void, len, libc::MADV_POPULATE_WRITE) };
    let populated_s = if d.pin_populated_bps > 0.0 {
        populated as f64 / d.pin_populated_bps
    } else {
        0.0
    };
    take_time(start, d.pin_seconds(size - populated) + populated_s);
    Ok(())
}

/// Bytes of the page-aligned range `[from, from + len)` already backed by memory
/// (`mincore`); 0 where that cannot be told.
fn populated_bytes(from: usize, len: usize) -> usize {
    let page = 4096;
    let mut v = vec![0u8; len.div_ceil(page)];
    // SAFETY: a page-aligned range of this process and a vector of one byte per page.
    let rc = unsafe { libc::mincore(from as *mut c_void, len, v.as_mut_ptr()) };
    if rc != 0 {
        return 0;
    }
    v.iter().filter(|&&b| b & 1 != 0).count() * page
}

/// `cuMemHostUnregister`.
pub(crate) fn unregister(p: *mut c_void) -> Result<(), CUresult> {
    let d = driver()?;
    capture::refuse_unsafe()?;
    d.mem.host.remove(p as usize, false).map(|_| ())
}

/// `cuMemHostGetDevicePointer_v2`: the device pointer of host memory allocated
/// (`cuMemHostAlloc`) or registered (`cuMemHostRegister`) with `DEVICEMAP`, which
/// is the host pointer itself, as on a 64-bit system whose devices all have
/// `CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM` (Driver API
/// reference: "the device pointer returned ... will match the original pointer");
/// an address inside such a range gives its own. Memory not mapped so (pageable,
/// pinned without the flag, device memory) is `CUDA_ERROR_INVALID_VALUE` ("will fail
/// if the CU_MEMHOSTALLOC_DEVICEMAP flag was not specified"), as is any flag ("must
/// be 0"). The v1 symbol, with its 32-bit device pointer, is not exported (as
/// `cuMemAlloc`'s is not).
pub(crate) fn device_pointer(
    pdptr: *mut CUdeviceptr,
    p: *mut c_void,
    flags: u32,
) -> Result<(), CUresult> {
    let d = driver()?;
    driver::current()?;
    if pdptr.is_null() || p.is_null() || flags != 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    match d.mem.host.map(p as usize, 1) {
        Some(m) if m.device_map => out(pdptr, p as CUdeviceptr),
        _ => Err(CUDA_ERROR_INVALID_VALUE),
    }
}
