//! Virtual memory management as the API sees it: granularity, address
//! reservations, physical handles (`cuMemCreate`, `cuMemRelease`, shareable ones
//! exported and imported as POSIX fds), mappings and access, each taking the time it
//! takes on hardware. Bodies of the exports `crate::exports` lists; the address
//! space is `crate::memory`'s.

use std::ffi::c_void;
use std::time::Instant;

use kiwi_sim_core::{knobs, GRANULARITY};

use crate::abi::*;
use crate::driver::{driver, Driver};
use crate::ffi::{out, read};
use crate::hw::take_time;
use crate::memory::Access;

fn check_prop(d: &Driver, prop: *const CUmemAllocationProp) -> Result<u32, CUresult> {
    let p = read(prop)?;
    if p.type_ != CU_MEM_ALLOCATION_TYPE_PINNED || p.location.type_ != CU_MEM_LOCATION_TYPE_DEVICE {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    d.device(p.location.id)
        .map_err(|_| CUDA_ERROR_INVALID_DEVICE)
}

/// Charges a VMM call's measured cost (`kiwi_sim_core::knobs::VMM_*`), when
/// `cuMemCreate`'s is on.
fn vmm_call(d: &Driver, start: Instant, us: f64) {
    if d.memcreate_s > 0.0 {
        take_time(start, us * 1e-6);
    }
}

/// `cuMemGetAllocationGranularity`: 2 MiB, minimum and recommended.
pub(crate) fn granularity(
    g: *mut usize,
    prop: *const CUmemAllocationProp,
    option: i32,
) -> Result<(), CUresult> {
    let d = driver()?;
    check_prop(d, prop)?;
    if !matches!(option, 0 | 1) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    out(g, GRANULARITY as usize)
}

/// `cuMemAddressReserve` (`flags` must be 0).
pub(crate) fn reserve(
    ptr: *mut CUdeviceptr,
    size: usize,
    align: usize,
    addr: CUdeviceptr,
    flags: u64,
) -> Result<(), CUresult> {
    let d = driver()?;
    if ptr.is_null() || flags != 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let at = d.mem.reserve(size as u64, align as u64, addr)?;
    out(ptr, at)
}

/// `cuMemAddressFree`.
pub(crate) fn unreserve(ptr: CUdeviceptr, size: usize) -> Result<(), CUresult> {
    driver()?.mem.unreserve(ptr, size as u64)
}

/// `cuMemCreate` (`flags` must be 0).
pub(crate) fn create(
    handle: *mut CUmemGenericAllocationHandle,
    size: usize,
    prop: *const CUmemAllocationProp,
    flags: u64,
) -> Result<(), CUresult> {
    let d = driver()?;
    let g = check_prop(d, prop)?;
    if handle.is_null() || flags != 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // Shareable handle types: the POSIX fd is supported (Linux); Win32 handles and
    // fabric handles are not, on this system, as the driver says for them.
    let shareable = match read(prop)?.requested_handle_types {
        0 => false,
        CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR => true,
        _ => return Err(CUDA_ERROR_NOT_SUPPORTED),
    };
    d.inject_memcreate_failure()?;
    let start = Instant::now();
    let h = d.mem.create(g, size as u64, shareable)?;
    out(handle, h)?;
    // Mostly the call, little per page (KIWI_SIM_MEMCREATE_US, _PER_2MIB).
    take_time(
        start,
        d.memcreate_s + (size as u64 / GRANULARITY) as f64 * d.memcreate_s_per_2mib,
    );
    Ok(())
}

/// `cuMemExportToShareableHandle`: the POSIX fd type only (others are
/// `CUDA_ERROR_NOT_SUPPORTED` here), of a handle created asking for it (else
/// `CUDA_ERROR_INVALID_VALUE`); writes a new descriptor (an `int`) the caller owns.
pub(crate) fn export(
    shareable: *mut c_void,
    handle: CUmemGenericAllocationHandle,
    handle_type: i32,
    flags: u64,
) -> Result<(), CUresult> {
    let d = driver()?;
    if shareable.is_null() || flags != 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    if handle_type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR {
        return Err(CUDA_ERROR_NOT_SUPPORTED);
    }
    let fd = d.mem.export_fd(handle)?;
    out(shareable.cast::<i32>(), fd).inspect_err(|_| {
        // SAFETY: closing the descriptor just made, which nobody else has seen.
        unsafe { libc::close(fd) };
    })
}

/// `cuMemImportFromShareableHandle`: `os_handle` carries the fd itself (as a
/// pointer-sized integer, as the driver takes it); it must be a simulator export of
/// this machine (else `CUDA_ERROR_INVALID_VALUE`) and stays the caller's.
pub(crate) fn import(
    handle: *mut CUmemGenericAllocationHandle,
    os_handle: *mut c_void,
    handle_type: i32,
) -> Result<(), CUresult> {
    let d = driver()?;
    if handle.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    if handle_type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR {
        return Err(CUDA_ERROR_NOT_SUPPORTED);
    }
    let fd = i32::try_from(os_handle as usize).map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
    let h = d.mem.import_fd(fd)?;
    out(handle, h).inspect_err(|_| {
        let _ = d.mem.release(h);
    })
}

/// `cuMemRelease`.
pub(crate) fn release(handle: CUmemGenericAllocationHandle) -> Result<(), CUresult> {
    let start = Instant::now();
    let d = driver()?;
    let pages = d.mem.release(handle)? / GRANULARITY;
    vmm_call(
        d,
        start,
        knobs::VMM_RELEASE_US + pages as f64 * knobs::VMM_RELEASE_US_PER_2MIB,
    );
    Ok(())
}

/// `cuMemMap` (`flags` must be 0).
pub(crate) fn map(
    ptr: CUdeviceptr,
    size: usize,
    offset: usize,
    handle: CUmemGenericAllocationHandle,
    flags: u64,
) -> Result<(), CUresult> {
    let start = Instant::now();
    let d = driver()?;
    if flags != 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    d.mem.map(ptr, size as u64, offset as u64, handle)?;
    vmm_call(d, start, knobs::VMM_MAP_US);
    Ok(())
}

/// `cuMemUnmap`.
pub(crate) fn unmap(ptr: CUdeviceptr, size: usize) -> Result<(), CUresult> {
    let start = Instant::now();
    let d = driver()?;
    d.mem.unmap(ptr, size as u64)?;
    vmm_call(d, start, knobs::VMM_UNMAP_US);
    Ok(())
}

/// `cuMemSetAccess`: each descriptor grants one device its access.
pub(crate) fn set_access(
    ptr: CUdeviceptr,
    size: usize,
    desc: *const CUmemAccessDesc,
    count: usize,
) -> Result<(), CUresult> {
    let start = Instant::now();
    let d = driver()?;
    if desc.is_null() || count == 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let mut grants = Vec::with_capacity(count);
    for i in 0..count {
        // SAFETY: the caller passes an array of `count` descriptors.
        let dsc = read(unsafe { desc.add(i) })?;
        if dsc.location.type_ != CU_MEM_LOCATION_TYPE_DEVICE {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let dev = d
            .device(dsc.location.id)
            .map_err(|_| CUDA_ERROR_INVALID_DEVICE)?;
        let access = match dsc.flags {
            CU_MEM_ACCESS_FLAGS_PROT_NONE => Access::None,
            CU_MEM_ACCESS_FLAGS_PROT_READ => Access::Read,
            CU_MEM_ACCESS_FLAGS_PROT_READWRITE => Access::ReadWrite,
            _ => return Err(CUDA_ERROR_INVALID_VALUE),
        };
        grants.push((dev, access));
    }
    d.mem.set_access(ptr, size as u64, &grants)?;
    vmm_call(d, start, knobs::VMM_SET_ACCESS_US);
    Ok(())
}
