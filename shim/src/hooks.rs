//! The bodies of the `hook` exports: `cuInit` (start the client), context creation
//! (a device's allocator and turn), allocation (served by [`crate::mem`] through the
//! per-device state of [`crate::devices`]) and memory info. The application's own
//! VMM handles are [`crate::appvmm`]'s; modules, libraries, their code and a
//! context's limits [`crate::modules`]'.

use std::ffi::{c_int, c_void};
use std::ptr::null_mut;
use std::sync::atomic::Ordering;

use crate::client;
use crate::cuda::*;
use crate::devices::{
    current_device, current_mem_device, mem_lock, seen_devices, with_owner, FREE_STREAM,
};
use crate::real::call_real as call;
use crate::real::original_of;
use crate::room;
use crate::symbols::Sym;

// ---------------------------------------------------------------------------------
// Hooks. Each receives the original and the caller's arguments.

type Real<A> = A;

/// `cuInit`: the real one first, then (once) the client.
/// # Safety
/// `real` is the driver's original of this entry point; the other arguments are the
/// application's, valid as `cuda.h` documents them.
pub unsafe fn init(real: Real<unsafe extern "C" fn(Uint) -> CUresult>, flags: Uint) -> CUresult {
    // SAFETY: forwarding the caller's argument.
    let r = unsafe { real(flags) };
    if r != CUDA_SUCCESS {
        return r;
    }
    client::on_init(|| {
        let mut n: c_int = 0;
        call!(cuDeviceGetCount: fn(*mut c_int)(&mut n))?;
        if n > 0 {
            Ok(())
        } else {
            Err(CUDA_ERROR_NO_DEVICE)
        }
    })
}

/// A context creation on `dev` writing through `pctx`: it waits for room when the GPU
/// is full of others' memory ([`crate::room`]), then the device gets its allocator and
/// turn.
fn made(
    dev: CUdevice,
    pctx: *mut CUcontext,
    undo: room::Undo,
    create: impl FnMut() -> CUresult,
) -> CUresult {
    let before = room::counted_now(dev);
    let r = room::create_context(dev, pctx, create);
    room::context_created(r, pctx, dev, before, undo)
}

/// # Safety
/// `real` is the driver's original of this entry point; the other arguments are the
/// application's, valid as `cuda.h` documents them.
pub unsafe fn primary_ctx_retain(
    real: Real<unsafe extern "C" fn(*mut CUcontext, CUdevice) -> CUresult>,
    pctx: *mut CUcontext,
    dev: CUdevice,
) -> CUresult {
    // SAFETY: forwarding the caller's arguments.
    made(dev, pctx, room::Undo::ReleasePrimary, || unsafe {
        real(pctx, dev)
    })
}

/// # Safety
/// `real` is the driver's original of this entry point; the other arguments are the
/// application's, valid as `cuda.h` documents them.
pub unsafe fn ctx_create_v2(
    real: Real<unsafe extern "C" fn(*mut CUcontext, Uint, CUdevice) -> CUresult>,
    pctx: *mut CUcontext,
    flags: Uint,
    dev: CUdevice,
) -> CUresult {
    // SAFETY: forwarding the caller's arguments.
    made(dev, pctx, room::Undo::Destroy, || unsafe {
        real(pctx, flags, dev)
    })
}

/// # Safety
/// `real` is the driver's original of this entry point; the other arguments are the
/// application's, valid as `cuda.h` documents them.
pub unsafe fn ctx_create_v3(
    real: Real<unsafe extern "C" fn(*mut CUcontext, Opaque, c_int, Uint, CUdevice) -> CUresult>,
    pctx: *mut CUcontext,
    params: Opaque,
    num_params: c_int,
    flags: Uint,
    dev: CUdevice,
) -> CUresult {
    // SAFETY: forwarding the caller's arguments.
    made(dev, pctx, room::Undo::Destroy, || unsafe {
        real(pctx, params, num_params, flags, dev)
    })
}

/// # Safety
/// `real` is the driver's original of this entry point; the other arguments are the
/// application's, valid as `cuda.h` documents them.
pub unsafe fn ctx_create_v4(
    real: Real<unsafe extern "C" fn(*mut CUcontext, Opaque, Uint, CUdevice) -> CUresult>,
    pctx: *mut CUcontext,
    params: Opaque,
    flags: Uint,
    dev: CUdevice,
) -> CUresult {
    // SAFETY: forwarding the caller's arguments.
    made(dev, pctx, room::Undo::Destroy, || unsafe {
        real(pctx, params, flags, dev)
    })
}

/// The capacity the arbiter schedules GPU `d` against, when the process has a turn
/// on it; `None`: unmanaged there (no arbiter, or the arbiter refused this GPU), so
/// nobody will make room on it.
fn capacity_of(d: usize) -> Option<u64> {
    client::global()
        .and_then(|c| c.turn_for(d))
        .map(|t| t.capacity())
}

/// Under a node swap budget, growth of the working set is admitted by the arbiter
/// first. Asked without the allocator's lock held: the answer comes through the turn's
/// thread, which may need that lock for a swap meanwhile. `Err`: refused.
fn admit(d: usize, size: u64) -> Result<Option<client::Admission>, CUresult> {
    let Some(turn) = client::global()
        .and_then(|c| c.turn_for(d))
        .filter(|t| t.budgeted())
    else {
        return Ok(None);
    };
    let Some((ws, growth)) = mem_lock(d)
        .as_ref()
        .map(|m| (m.figures().working_set, m.growth(size)))
    else {
        return Ok(None);
    };
    if growth == 0 || ws + growth > turn.capacity() {
        // Nothing to admit, or the allocator refuses it on its own (past the GPU).
        return Ok(None);
    }
    turn.admit(ws + growth)
        .map(Some)
        .ok_or(CUDA_ERROR_OUT_OF_MEMORY)
}

/// Allocates through the shim's allocator; `None` = not ours to serve.
fn alloc(size: u64) -> Option<Result<u64, CUresult>> {
    let d = current_mem_device()?;
    let _admission = match admit(d, size) {
        Ok(a) => a,
        Err(e) => return Some(Err(e)),
    };
    let mut guard = mem_lock(d);
    let m = guard.as_mut()?;
    // Unmanaged, nobody makes room: an allocation that cannot be backed fails now
    // with the driver's error, as it would without Kiwi (left unbacked, it failed
    // later, at the first kernel or copy, as an invalid value).
    let capacity = capacity_of(d);
    let r = match m.alloc(size) {
        Err(CUDA_ERROR_OUT_OF_MEMORY)
            if capacity.is_some_and(|c| m.figures().working_set + size <= c) =>
        {
            // Within what this application may use, but the GPU is physically full of
            // others' memory: reserve now, back it at the next turn (the arbiter makes
            // room then).
            m.set_backing_allowed(false);
            let r = m.alloc(size);
            m.set_backing_allowed(true);
            if r.is_ok() {
                crate::kdebug!(
                    "GPU {d}: {size} bytes left unbacked until the next turn (the GPU is full)"
                );
            }
            r
        }
        r => r,
    };
    if r.is_ok() {
        crate::stats::ALLOCS.fetch_add(1, Ordering::Relaxed);
        // Memory on this GPU: the process needs its turn from now on.
        if let Some(t) = client::global().and_then(|c| c.turn_for(d)) {
            t.claim(&crate::gate::GATE);
        }
        if let Some(c) = client::global() {
            c.grew(d);
        }
        // Memory left unbacked must be backed before work runs. Closed under the
        // allocator's lock: the client checks residency and opens the gate under it
        // too, so it cannot open over this memory (a sticky illegal address).
        if !m.all_resident() {
            crate::gate::GATE.close();
        }
    }
    drop(guard);
    Some(r)
}

/// # Safety
/// `real` is the driver's original of this entry point; the other arguments are the
/// application's, valid as `cuda.h` documents them.
pub unsafe fn mem_alloc(
    real: Real<unsafe extern "C" fn(*mut CUdeviceptr, usize) -> CUresult>,
    dptr: *mut CUdeviceptr,
    size: usize,
) -> CUresult {
    if dptr.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    match alloc(size as u64) {
        Some(Ok(p)) => {
            // SAFETY: dptr checked non-null; the caller's out-pointer.
            unsafe { *dptr = p };
            CUDA_SUCCESS
        }
        Some(Err(e)) => e,
        // SAFETY: forwarding the caller's arguments.
        None => unsafe { real(dptr, size) },
    }
}

/// Stream-ordered allocations are served at once by the shim's allocator (memory usable
/// now is usable when the stream gets there), counted for `pool` (`None`: the current
/// pool of the calling thread's device, which `cuMemAllocAsync` allocates from) in the
/// pool's statistics ([`crate::pools`]); what the shim does not manage goes to the
/// original `cuMemAlloc_v2`.
/// # Safety
/// `dptr` is the application's out-pointer.
unsafe fn alloc_now(dptr: *mut CUdeviceptr, size: usize, pool: Option<CUmemoryPool>) -> CUresult {
    if dptr.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    match alloc(size as u64) {
        Some(Ok(ptr)) => {
            // SAFETY: dptr checked non-null; the caller's out-pointer.
            unsafe { *dptr = ptr };
            let pool = pool.unwrap_or_else(current_pool);
            crate::pools::allocated(pool, ptr, size as u64);
            CUDA_SUCCESS
        }
        Some(Err(e)) => e,
        None => {
            let p = original_of(Sym::cuMemAlloc_v2);
            if p.is_null() {
                return CUDA_ERROR_NOT_FOUND;
            }
            // SAFETY: the original cuMemAlloc_v2, cuda.h's signature; the caller's
            // out-pointer and size.
            unsafe {
                let real = std::mem::transmute::<
                    *mut c_void,
                    unsafe extern "C" fn(*mut CUdeviceptr, usize) -> CUresult,
                >(p);
                real(dptr, size)
            }
        }
    }
}

/// The current memory pool of the calling thread's device (null when the driver
/// cannot say).
fn current_pool() -> CUmemoryPool {
    let mut dev: CUdevice = 0;
    let mut pool: CUmemoryPool = null_mut();
    if call!(cuCtxGetDevice: fn(*mut CUdevice)(&mut dev)).is_ok() {
        let _ = call!(cuDeviceGetMemPool: fn(*mut CUmemoryPool, CUdevice)(&mut pool, dev));
    }
    pool
}

/// # Safety
/// `real` is the driver's original of this entry point; the other arguments are the
/// application's, valid as `cuda.h` documents them.
pub unsafe fn mem_alloc_async(
    _real: Real<unsafe extern "C" fn(*mut CUdeviceptr, usize, CUstream) -> CUresult>,
    dptr: *mut CUdeviceptr,
    size: usize,
    _stream: CUstream,
) -> CUresult {
    // SAFETY: the caller's arguments.
    unsafe { alloc_now(dptr, size, None) }
}

/// # Safety
/// `real` is the driver's original of this entry point; the other arguments are the
/// application's, valid as `cuda.h` documents them.
pub unsafe fn mem_alloc_from_pool(
    _real: Real<unsafe extern "C" fn(*mut CUdeviceptr, usize, CUmemoryPool, CUstream) -> CUresult>,
    dptr: *mut CUdeviceptr,
    size: usize,
    pool: CUmemoryPool,
    _stream: CUstream,
) -> CUresult {
    // SAFETY: the caller's arguments; pools are served by the shim's allocator.
    unsafe { alloc_now(dptr, size, Some(pool)) }
}

/// # Safety
/// `real` is the driver's original of this entry point; the other arguments are the
/// application's, valid as `cuda.h` documents them.
pub unsafe fn mem_alloc_pitch(
    real: Real<unsafe extern "C" fn(*mut CUdeviceptr, *mut usize, usize, usize, Uint) -> CUresult>,
    dptr: *mut CUdeviceptr,
    pitch: *mut usize,
    width: usize,
    height: usize,
    elem: Uint,
) -> CUresult {
    if dptr.is_null() || pitch.is_null() || width == 0 || height == 0 {
        return CUDA_ERROR_INVALID_VALUE;
    }
    if !matches!(elem, 4 | 8 | 16) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    let p = width.div_ceil(512) * 512;
    let Some(total) = p.checked_mul(height) else {
        return CUDA_ERROR_INVALID_VALUE;
    };
    match alloc(total as u64) {
        Some(Ok(base)) => {
            // SAFETY: both out-pointers checked non-null.
            unsafe {
                *dptr = base;
                *pitch = p;
            }
            CUDA_SUCCESS
        }
        Some(Err(e)) => e,
        // SAFETY: forwarding the caller's arguments.
        None => unsafe { real(dptr, pitch, width, height, elem) },
    }
}

fn free_ours(ptr: CUdeviceptr) -> Option<CUresult> {
    if !client::allocator_enabled() {
        return None;
    }
    with_owner(ptr, |m| match m.free(ptr) {
        Ok(()) => {
            crate::pools::freed(ptr);
            CUDA_SUCCESS
        }
        Err(e) => e,
    })
}

/// # Safety
/// `real` is the driver's original of this entry point; the other arguments are the
/// application's, valid as `cuda.h` documents them.
pub unsafe fn mem_free(
    real: Real<unsafe extern "C" fn(CUdeviceptr) -> CUresult>,
    dptr: CUdeviceptr,
) -> CUresult {
    let ours = || client::allocator_enabled() && with_owner(dptr, |_| ()).is_some();
    // Freeing waits for the context's work that may use the memory (as cuMemFree
    // does: a small allocation's range is reused at once), which no shim may do while
    // a stream captures: the free is done when the last capture ends (the memory
    // stays allocated and mapped until then, so nothing queued can touch a range
    // handed out again, nor unmapped memory).
    let defer = || {
        crate::capture::after_captures(Box::new(move || {
            if let Some(e) = free_ours(dptr).filter(|&r| r != CUDA_SUCCESS) {
                crate::kwarn!("a free deferred past a capture failed with CUDA error {e}");
            }
        }));
        CUDA_SUCCESS
    };
    if crate::capture::active() && ours() {
        return defer();
    }
    match free_ours(dptr) {
        // A capture began between the check and the wait: the allocation is intact.
        Some(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED) if crate::capture::active() => defer(),
        Some(r) => r,
        None => {
            // SAFETY: forwarding the caller's argument.
            let r = unsafe { real(dptr) };
            if r == CUDA_SUCCESS {
                if let Some(d) = crate::managed::removed(dptr) {
                    client::report_now(d);
                }
            }
            r
        }
    }
}

/// `cuMemAllocManaged`: the driver's. In a managed process the allocation counts in
/// the working set of the current context's GPU, which claims it, and moves to the
/// host at its swap-outs ([`crate::managed`]).
///
/// # Safety
/// `real` is the driver's original of this entry point; the other arguments are the
/// application's, valid as `cuda.h` documents them.
pub unsafe fn mem_alloc_managed(
    real: Real<unsafe extern "C" fn(*mut CUdeviceptr, usize, Uint) -> CUresult>,
    dptr: *mut CUdeviceptr,
    size: usize,
    flags: Uint,
) -> CUresult {
    // SAFETY: forwarding the caller's arguments.
    let r = unsafe { real(dptr, size, flags) };
    if r != CUDA_SUCCESS || dptr.is_null() || !client::allocator_enabled() {
        return r;
    }
    if let Some(d) = current_mem_device() {
        // SAFETY: the driver just wrote the allocation's address there.
        crate::managed::added(d, unsafe { *dptr }, size as u64);
        if let Some(t) = client::global().and_then(|c| c.turn_for(d)) {
            t.claim(&crate::gate::GATE);
        }
        client::report_now(d);
    }
    r
}

/// # Safety
/// `real` is the driver's original of this entry point; the other arguments are the
/// application's, valid as `cuda.h` documents them.
pub unsafe fn mem_free_async(
    real: Real<unsafe extern "C" fn(CUdeviceptr, CUstream) -> CUresult>,
    dptr: CUdeviceptr,
    stream: CUstream,
) -> CUresult {
    // SAFETY: the caller's arguments.
    unsafe { free_async(real, dptr, crate::capture::StreamArg::new(stream, false)) }
}

/// `cuMemFreeAsync_ptsz`: a NULL stream is the calling thread's per-thread stream.
/// # Safety
/// As [`mem_free_async`].
pub unsafe fn mem_free_async_ptsz(
    real: Real<unsafe extern "C" fn(CUdeviceptr, CUstream) -> CUresult>,
    dptr: CUdeviceptr,
    stream: CUstream,
) -> CUresult {
    // SAFETY: the caller's arguments.
    unsafe { free_async(real, dptr, crate::capture::StreamArg::new(stream, true)) }
}

/// A stream-ordered free of a shim allocation waits for its own stream only (work
/// queued there may still use the memory; other streams' use is ordered by the
/// application, as with the driver's pools), never for the whole context.
/// # Safety
/// `real` is the original taking `(dptr, s.handle)`.
unsafe fn free_async(
    real: Real<unsafe extern "C" fn(CUdeviceptr, CUstream) -> CUresult>,
    dptr: CUdeviceptr,
    s: crate::capture::StreamArg,
) -> CUresult {
    let ours = client::allocator_enabled() && with_owner(dptr, |_| ()).is_some();
    if !ours {
        // SAFETY: forwarding the caller's arguments.
        return unsafe { real(dptr, s.handle) };
    }
    if crate::capture::is_captured(Some(s)) {
        // A free captured into a graph happens each time the graph runs, after the
        // graph's earlier work, which the shim cannot order: the memory stays allocated
        // (and swappable) instead, never freed under a graph that still uses it.
        crate::kwarn!(
            "cuMemFreeAsync of {dptr:#x} captured into a graph: kept allocated (Kiwi does not free captured frees)"
        );
        return CUDA_SUCCESS;
    }
    // Waiting for a stream that does not capture is a potentially unsafe call: while
    // another stream captures in GLOBAL mode the driver would refuse it and invalidate
    // that capture, where the application's own stream-ordered free is allowed.
    let _relaxed = crate::capture::Relaxed::enter();
    if let Err(e) = call!(cuStreamSynchronize: fn(CUstream)(s.handle_for_legacy_entry())) {
        return e;
    }
    FREE_STREAM.set(Some(s));
    let r = free_ours(dptr).unwrap_or(CUDA_ERROR_INVALID_VALUE);
    FREE_STREAM.set(None);
    r
}

/// # Safety
/// `real` is the driver's original of this entry point; the other arguments are the
/// application's, valid as `cuda.h` documents them.
pub unsafe fn mem_get_info(
    real: Real<unsafe extern "C" fn(*mut usize, *mut usize) -> CUresult>,
    free: *mut usize,
    total: *mut usize,
) -> CUresult {
    let turn = client::global()
        .zip(current_device())
        .and_then(|(c, d)| c.turn_for(d));
    let Some(turn) = turn else {
        // SAFETY: forwarding the caller's arguments.
        return unsafe { real(free, total) };
    };
    if free.is_null() || total.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    let (f, t) = told_free(turn);
    // SAFETY: both out-pointers checked non-null.
    unsafe {
        *total = t as usize;
        *free = f as usize;
    }
    CUDA_SUCCESS
}

/// What `cuMemGetInfo` tells the process of `turn`'s GPU now: (free, total). Free is
/// what its working set can still grow by and be resident in its turn: the total
/// less its working set, the others' memory no swap frees and its own contexts
/// (brought up to date first, [`client::Turn::sync_room`]). NVML answers with the
/// same figure ([`crate::view`]).
pub fn told_free(turn: &client::Turn) -> (u64, u64) {
    turn.sync_room();
    let t = turn.info().total_memory;
    let reserve = t.saturating_sub(turn.told_capacity());
    let used = turn.figures().working_set;
    (t.saturating_sub(used).saturating_sub(reserve), t)
}

/// # Safety
/// `real` is the driver's original of this entry point; the other arguments are the
/// application's, valid as `cuda.h` documents them.
pub unsafe fn mem_get_address_range(
    real: Real<unsafe extern "C" fn(*mut CUdeviceptr, *mut usize, CUdeviceptr) -> CUresult>,
    pbase: *mut CUdeviceptr,
    psize: *mut usize,
    dptr: CUdeviceptr,
) -> CUresult {
    let found = seen_devices()
        .find_map(|d| mem_lock(d).as_ref().and_then(|m| m.range_of(dptr)))
        .or_else(|| crate::appvmm::range_of(dptr));
    match found {
        Some((base, size)) => {
            if !pbase.is_null() {
                // SAFETY: non-null out-pointer from the caller.
                unsafe { *pbase = base };
            }
            if !psize.is_null() {
                // SAFETY: non-null out-pointer from the caller.
                unsafe { *psize = size as usize };
            }
            CUDA_SUCCESS
        }
        // SAFETY: forwarding the caller's arguments.
        None => unsafe { real(pbase, psize, dptr) },
    }
}
