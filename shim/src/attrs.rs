//! What the application asks about, and grants on, the shim's allocations: pointer
//! attributes (`cuPointerGetAttribute(s)`), other devices' access (`cuMemSetAccess`
//! on a shim allocation) and peer access (`cuCtxEnablePeerAccess`,
//! `cuCtxDisablePeerAccess`).
//!
//! A shim allocation is a reserved range with the shim's own 64 MiB (or shared 2 MiB)
//! mappings in it, absent while swapped out: asked directly, the driver would answer
//! with a mapping's range, or that the address is unknown. The answers here are the
//! allocation's own, resident or not. Access grants are recorded by the allocator
//! ([`crate::mem::Memory::set_access`], [`crate::mem::Memory::set_peer`]) and applied
//! to every mapping it makes, so they survive swaps. Everything else goes to the
//! driver unchanged.

use std::ffi::{c_int, c_void};

use crate::cuda::ptr_attr::{
    BUFFER_ID, CONTEXT, DEVICE_ORDINAL, DEVICE_POINTER, HOST_POINTER, IS_MANAGED, MAPPED,
    MEMORY_TYPE, MEMPOOL_HANDLE, RANGE_SIZE, RANGE_START_ADDR,
};
use crate::cuda::*;
use crate::devices::{app_context, current_device, device_of, with_allocation, with_device_memory};

type Real<A> = A;

/// `CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE` (not in `kiwi_cuda::sys::ptr_attr`).
const IS_LEGACY_CUDA_IPC_CAPABLE: c_int = 10;

/// The answer for attribute `attr` of `ptr` in the shim allocation `(base, size)` on
/// device `d`, written to `data`; `None` for an attribute the driver answers.
///
/// # Safety
/// `data` is non-null and points to storage for the attribute's type (`cuda.h`).
unsafe fn answer(
    attr: c_int,
    d: usize,
    (base, size): (u64, u64),
    ptr: u64,
    data: *mut c_void,
) -> Option<CUresult> {
    // SAFETY: every write below goes to the caller's storage for this attribute's type.
    unsafe {
        match attr {
            CONTEXT => *data.cast::<CUcontext>() = app_context(d),
            MEMORY_TYPE => *data.cast::<u32>() = CU_MEMORYTYPE_DEVICE,
            DEVICE_POINTER => *data.cast::<u64>() = ptr,
            // Device memory has no host address (the driver's answer for it).
            HOST_POINTER => return Some(CUDA_ERROR_INVALID_VALUE),
            // Unique among live allocations (an address is reused only after a free).
            BUFFER_ID => *data.cast::<u64>() = base,
            IS_MANAGED => *data.cast::<u32>() = 0,
            DEVICE_ORDINAL => *data.cast::<c_int>() = d as c_int,
            // The shim serves cuIpcGetMemHandle for its allocations (crate::ipc).
            IS_LEGACY_CUDA_IPC_CAPABLE => {
                *data.cast::<u32>() = u32::from(crate::devices::exportable())
            }
            RANGE_START_ADDR => *data.cast::<u64>() = base,
            RANGE_SIZE => *data.cast::<usize>() = size as usize,
            // The application's view: its memory is there, swapped out or not.
            MAPPED => *data.cast::<u32>() = 1,
            MEMPOOL_HANDLE => *data.cast::<*mut c_void>() = std::ptr::null_mut(),
            _ => return None,
        }
    }
    Some(CUDA_SUCCESS)
}

/// `cuPointerGetAttribute`.
/// # Safety
/// `real` is the driver's original of this entry point; the other arguments are the
/// application's, valid as `cuda.h` documents them.
pub unsafe fn pointer_get_attribute(
    real: Real<unsafe extern "C" fn(*mut c_void, c_int, CUdeviceptr) -> CUresult>,
    data: *mut c_void,
    attr: c_int,
    ptr: CUdeviceptr,
) -> CUresult {
    if !data.is_null() {
        // SAFETY: data is the caller's storage for `attr`, checked non-null.
        let ours = with_allocation(ptr, |d, range, _| unsafe {
            answer(attr, d, range, ptr, data)
        });
        if let Some(Some(r)) = ours {
            return r;
        }
    }
    // SAFETY: forwarding the caller's arguments.
    unsafe { real(data, attr, ptr) }
}

/// `cuPointerGetAttributes`: the driver answers first (it fills what it knows and
/// NULL defaults for the rest, and checks the arguments); then the shim overwrites
/// the attributes it answers for its own allocations.
/// # Safety
/// As [`pointer_get_attribute`]: `attrs` and `data` hold `n` entries.
pub unsafe fn pointer_get_attributes(
    real: Real<unsafe extern "C" fn(u32, *mut c_int, *mut *mut c_void, CUdeviceptr) -> CUresult>,
    n: u32,
    attrs: *mut c_int,
    data: *mut *mut c_void,
    ptr: CUdeviceptr,
) -> CUresult {
    // SAFETY: forwarding the caller's arguments.
    let r = unsafe { real(n, attrs, data, ptr) };
    if r != CUDA_SUCCESS {
        return r;
    }
    with_allocation(ptr, |d, range, _| {
        for i in 0..n as usize {
            // SAFETY: the driver accepted arrays of `n` attributes and data pointers.
            let (a, slot) = unsafe { (*attrs.add(i), *data.add(i)) };
            if slot.is_null() {
                continue;
            }
            // SAFETY: slot is the caller's storage for attribute `a`.
            if unsafe { answer(a, d, range, ptr, slot) } == Some(CUDA_ERROR_INVALID_VALUE) {
                // An attribute that does not apply reads its NULL default here.
                // SAFETY: as above; the host pointer is pointer-sized.
                unsafe { *slot.cast::<*mut c_void>() = std::ptr::null_mut() };
            }
        }
    });
    CUDA_SUCCESS
}

/// `cuMemSetAccess` on a shim allocation is recorded and applied to the shim's
/// mappings of it (now, and after every swap-in); elsewhere (the application's own
/// VMM) it goes to the driver. The owning device always has read-write access (the
/// shim swaps through it): a descriptor for it is accepted and not recorded.
/// # Safety
/// As [`pointer_get_attribute`]: `desc` holds `count` descriptors.
pub unsafe fn mem_set_access(
    real: Real<unsafe extern "C" fn(CUdeviceptr, usize, *const CUmemAccessDesc, usize) -> CUresult>,
    ptr: CUdeviceptr,
    size: usize,
    desc: *const CUmemAccessDesc,
    count: usize,
) -> CUresult {
    if !desc.is_null() && count > 0 {
        // SAFETY: the caller passes `count` descriptors at `desc`, checked non-null.
        let descs = unsafe { std::slice::from_raw_parts(desc, count) };
        // SAFETY: forwarding the caller's arguments.
        let now = || unsafe { real(ptr, size, desc, count) };
        if let Some(r) = crate::appvmm::set_access(ptr, size, descs, now) {
            return r;
        }
    }
    let ours = with_allocation(ptr, |d, _, m| {
        if desc.is_null() || count == 0 {
            return CUDA_ERROR_INVALID_VALUE;
        }
        // SAFETY: the caller passes `count` descriptors at `desc`, checked non-null.
        let descs = unsafe { std::slice::from_raw_parts(desc, count) };
        let mut grants = Vec::with_capacity(count);
        for x in descs {
            if x.location.type_ != CU_MEM_LOCATION_TYPE_DEVICE || !matches!(x.flags, 0 | 1 | 3) {
                return CUDA_ERROR_INVALID_VALUE;
            }
            if x.location.id != d as c_int {
                grants.push((x.location.id, x.flags));
            }
        }
        if grants.is_empty() {
            return CUDA_SUCCESS;
        }
        match m.set_access(ptr, size as u64, &grants) {
            Some(Ok(())) => CUDA_SUCCESS,
            Some(Err(e)) => e,
            None => CUDA_ERROR_INVALID_VALUE,
        }
    });
    match ours {
        Some(r) => r,
        // SAFETY: forwarding the caller's arguments.
        None => unsafe { real(ptr, size, desc, count) },
    }
}

/// After the driver enabled (`flags` 3) or disabled (0) the current context's access
/// to `peer`'s memory: the shim's mappings on `peer`'s device grant or withdraw the
/// current device's access (VMM mappings ignore peer access: `cuMemSetAccess` is the
/// only way), now and after every swap-in.
fn peer_changed(peer: CUcontext, flags: c_int) {
    let (Some(me), Some(owner)) = (current_device(), device_of(peer)) else {
        return;
    };
    if me == owner {
        return;
    }
    if let Some(Err(e)) = with_device_memory(owner, |m| m.set_peer(me as c_int, flags)) {
        crate::kwarn!(
            "GPU {owner}: {} GPU {me}'s access to the shim's memory failed with CUDA error {e}",
            if flags == 0 {
                "withdrawing"
            } else {
                "granting"
            }
        );
    }
}

/// `cuCtxEnablePeerAccess`.
/// # Safety
/// As [`pointer_get_attribute`].
pub unsafe fn ctx_enable_peer_access(
    real: Real<unsafe extern "C" fn(CUcontext, Uint) -> CUresult>,
    peer: CUcontext,
    flags: Uint,
) -> CUresult {
    // SAFETY: forwarding the caller's arguments.
    let r = unsafe { real(peer, flags) };
    // Already enabled: the grant is recorded all the same.
    if r == CUDA_SUCCESS || r == CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED {
        peer_changed(peer, CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    }
    r
}

/// `cuCtxDisablePeerAccess`.
/// # Safety
/// As [`pointer_get_attribute`].
pub unsafe fn ctx_disable_peer_access(
    real: Real<unsafe extern "C" fn(CUcontext) -> CUresult>,
    peer: CUcontext,
) -> CUresult {
    // SAFETY: forwarding the caller's argument.
    let r = unsafe { real(peer) };
    if r == CUDA_SUCCESS {
        peer_changed(peer, 0);
    }
    r
}
