//! Page-locked host memory for swap buffers: anonymous memory registered with the
//! driver (`cuMemHostRegister`). On an H100 host (driver 580) registering fresh
//! memory in the shim's 64 MiB pieces ran at 3.3 GB/s, `cuMemHostAlloc` at 2.3 GB/s
//! (`docs/gpu-validation.md`). Transparent huge pages registered faster still there
//! (6.1 GB/s alone), but not inside the notebooks (1.6–1.8 GB/s either way), and on
//! this project's VMs faulting them in at times stalled for compaction, which made
//! the timing of pinning ahead unpredictable: not asked for. Registering pages
//! touched before ran at 20–21 GB/s: the cost is populating, which [`pinned::alloc`]
//! does on several threads first.

use std::ffi::{c_uint, c_void};
use std::ptr::null_mut;
use std::sync::OnceLock;

use crate::cuda::*;

type Register = unsafe extern "C" fn(*mut c_void, usize, c_uint) -> CUresult;
type Unregister = unsafe extern "C" fn(*mut c_void) -> CUresult;

fn entry_points() -> Option<(Register, Unregister)> {
    static FNS: OnceLock<Option<(usize, usize)>> = OnceLock::new();
    let (r, u) = (*FNS.get_or_init(|| {
        let r = crate::real::lookup(c"cuMemHostRegister_v2");
        let u = crate::real::lookup(c"cuMemHostUnregister");
        (!r.is_null() && !u.is_null()).then_some((r as usize, u as usize))
    }))?;
    // SAFETY: the driver's own functions of these names, with cuda.h's signatures.
    Some(unsafe {
        (
            std::mem::transmute::<usize, Register>(r),
            std::mem::transmute::<usize, Unregister>(u),
        )
    })
}

/// The length mapped for a buffer of `size` bytes: whole pages.
fn mapped_len(size: u64) -> usize {
    (size as usize).next_multiple_of(4096)
}

/// A fresh anonymous mapping of whole pages for `size` bytes.
fn map(size: u64) -> Option<*mut c_void> {
    // SAFETY: a fresh anonymous private mapping; no existing memory is affected.
    let p = unsafe {
        libc::mmap(
            null_mut(),
            mapped_len(size),
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    (p != libc::MAP_FAILED).then_some(p)
}

/// Most threads that populate one buffer at once.
const POPULATE_THREADS: usize = 4;
/// Buffers smaller than this are populated by the calling thread alone.
const POPULATE_SPLIT: usize = 8 << 20;

/// Populates the fresh mapping `p` of `len` bytes (a multiple of the page size)
/// on several threads at once. Populating is what page-locking fresh memory costs:
/// on an H100 host `cuMemHostRegister` ran at 2.7–3.7 GB/s on fresh 4 KiB pages
/// and at 20–21 GB/s on pages touched before (docs/gpu-validation.md), and one
/// thread's page faults leave the other cores idle.
fn populate(p: *mut c_void, len: usize) {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = cores.min(POPULATE_THREADS).min(len / POPULATE_SPLIT).max(1);
    let chunk = (len / threads).next_multiple_of(4096);
    let base = p as usize;
    let one = move |at: usize| {
        let n = chunk.min(len - at);
        // SAFETY: a part of the fresh mapping `p`; populating for write keeps its
        // (zero) contents.
        let r = unsafe { libc::madvise((base + at) as *mut c_void, n, libc::MADV_POPULATE_WRITE) };
        if r != 0 {
            // Kernels before 5.14: touch each page (writing the zero it holds).
            for off in (0..n).step_by(4096) {
                // SAFETY: a byte inside the fresh mapping, which nobody else uses
                // yet.
                unsafe { std::ptr::write_volatile((base + at + off) as *mut u8, 0) };
            }
        }
    };
    if threads == 1 {
        one(0);
        return;
    }
    std::thread::scope(|s| {
        for i in 1..threads {
            let at = i * chunk;
            if at < len {
                s.spawn(move || one(at));
            }
        }
        one(0);
    });
}

pub fn alloc(size: u64) -> Result<*mut u8, CUresult> {
    entry_points().ok_or(CUDA_ERROR_NOT_FOUND)?;
    // The node's swap pool first: its pages are populated already, and charged to
    // Kiwi rather than to this process's memory limit. Page-locking maps them.
    if let Some(p) = crate::pool::map(size, false) {
        match register(p, size) {
            Ok(()) => return Ok(p),
            Err(r) => {
                crate::kdebug!("cannot page-lock a slice of the swap pool (CUDA error {r}); using this process's memory");
                crate::pool::unmap(p);
            }
        }
    }
    let p = map(size).ok_or(CUDA_ERROR_OUT_OF_MEMORY)?;
    populate(p, mapped_len(size));
    if let Err(r) = register(p.cast(), size) {
        // SAFETY: the mapping made above, not registered, used by nobody.
        unsafe { libc::munmap(p, mapped_len(size)) };
        return Err(r);
    }
    Ok(p.cast())
}

/// A pageable buffer (the same mapping, not registered), with
/// `KIWI_SWAP_PAGEABLE=1`; `None` otherwise, or where the driver cannot register
/// it later. Off by default: on the simulator here it made steady swap-outs of
/// large working sets slower (`live-bytes` without the hint: 15.5–16.3 s against
/// 12.6–13.0 s), a buffer freed at its swap-in before its registration ended being
/// faulted in again at the next swap-out.
pub fn alloc_pageable(size: u64) -> Option<*mut u8> {
    static ON: OnceLock<bool> = OnceLock::new();
    if !*ON.get_or_init(|| std::env::var("KIWI_SWAP_PAGEABLE").is_ok_and(|v| v == "1")) {
        return None;
    }
    entry_points()?;
    crate::pool::map(size, true).or_else(|| map(size).map(|p| p.cast()))
}

pub fn free_pageable(p: *mut u8, size: u64) {
    if crate::pool::unmap(p) {
        return;
    }
    // SAFETY: the mapping `alloc_pageable` made for `size` bytes, not registered,
    // freed once.
    unsafe { libc::munmap(p.cast(), mapped_len(size)) };
}

/// Moves the contents of a buffer `alloc` made from the node's swap pool to the
/// pool's disk tier ([`crate::pool::spill`]): unregistered first (the pages go
/// back to the arbiter, which frees them), registered again when the spill is
/// refused. `None`: not a pool buffer, or refused (the buffer is as it was).
pub fn spill(p: *mut u8, size: u64) -> Option<u64> {
    if !crate::pool::owns(p) {
        return None;
    }
    let (_, unregister) = entry_points()?;
    // SAFETY: `p` was registered by `alloc`; no copy to or from it is in flight
    // (the caller holds the allocator's lock and the buffer is a swapped-out
    // segment's, copied in full).
    if unsafe { unregister(p.cast()) } != CUDA_SUCCESS {
        return None;
    }
    let h = crate::pool::spill(p);
    if h.is_none() {
        if let Err(r) = register(p, size) {
            crate::kdebug!("cannot page-lock a swap buffer again after a refused spill (CUDA error {r}); it is copied from pageable memory");
        }
    }
    h
}

/// Registers a mapping `alloc_pageable` made, in place (its contents kept).
pub fn register(p: *mut u8, size: u64) -> Result<(), CUresult> {
    let (register, _) = entry_points().ok_or(CUDA_ERROR_NOT_FOUND)?;
    // SAFETY: `p` is `mapped_len(size)` bytes of this process's memory, mapped by
    // `map` and not registered yet.
    let r = unsafe { register(p.cast(), mapped_len(size), 0) };
    if r != CUDA_SUCCESS {
        return Err(r);
    }
    Ok(())
}

pub fn free(p: *mut u8, size: u64) {
    if let Some((_, unregister)) = entry_points() {
        // SAFETY: `p` was registered by `alloc` and is no longer copied to or from.
        let _ = unsafe { unregister(p.cast()) };
    }
    if crate::pool::unmap(p) {
        return;
    }
    // SAFETY: the mapping `alloc` made for `size` bytes, freed once.
    unsafe { libc::munmap(p.cast(), mapped_len(size)) };
}
