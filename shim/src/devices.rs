//! The process's per-device state: each device's allocator ([`crate::mem`] over the
//! real driver, [`RealDriver`]), the application's context on it, the device's
//! identity and turn registration with the client, whether its physical memory is
//! created exportable (CUDA IPC), and the accessors the hooked behaviour shares
//! (`hooks`, `attrs`, `ipc`): by pointer, by device, the current device.
//! Also the [`Residency`] the client swaps and drains through.

use std::ffi::{c_int, c_void};
use std::ptr::null_mut;
use std::sync::atomic::{AtomicPtr, AtomicU64, AtomicU8, Ordering};
use std::sync::{Mutex, MutexGuard};

use crate::client::{self, DeviceInfo, Residency};
use crate::cuda::*;
use crate::mem::{Driver, Figures, Memory, Swap};
use crate::real::call_real as call;

/// The real driver, for one device, through the originals.
#[derive(Clone, Copy)]
pub struct RealDriver {
    device: CUdevice,
}

impl Driver for RealDriver {
    fn granularity(&self) -> Result<u64, CUresult> {
        let prop = CUmemAllocationProp::device(self.device);
        let mut g: usize = 0;
        call!(cuMemGetAllocationGranularity: fn(*mut usize, *const CUmemAllocationProp, c_int)
            (&mut g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM))?;
        Ok(g as u64)
    }
    fn reserve(&self, size: u64, align: u64) -> Result<u64, CUresult> {
        let mut va: CUdeviceptr = 0;
        call!(cuMemAddressReserve: fn(*mut CUdeviceptr, usize, usize, CUdeviceptr, u64)
            (&mut va, size as usize, align as usize, 0, 0))?;
        Ok(va)
    }
    fn free_va(&self, va: u64, size: u64) -> Result<(), CUresult> {
        call!(cuMemAddressFree: fn(CUdeviceptr, usize)(va, size as usize))
    }
    fn create(&self, size: u64) -> Result<u64, CUresult> {
        // Exportable (POSIX fd), for CUDA IPC ([`crate::ipc`]), unless the driver refuses.
        let mut prop = alloc_prop(self.device);
        let mut h: CUmemGenericAllocationHandle = 0;
        let mut create = |prop: &CUmemAllocationProp| {
            call!(cuMemCreate: fn(*mut CUmemGenericAllocationHandle, usize, *const CUmemAllocationProp, u64)
            (&mut h, size as usize, prop, 0))
        };
        match create(&prop) {
            Err(e) if create_refused(&prop, e) => {
                prop.requested_handle_types = 0;
                create(&prop)?;
            }
            r => {
                r?;
                if prop.requested_handle_types != 0 {
                    created_exportable();
                }
            }
        }
        Ok(h)
    }
    fn create_like(&self, size: u64, prop: &crate::mem::AppProp) -> Result<u64, CUresult> {
        let mut h: CUmemGenericAllocationHandle = 0;
        call!(cuMemCreate: fn(*mut CUmemGenericAllocationHandle, usize, *const CUmemAllocationProp, u64)
            (&mut h, size as usize, &prop.0, 0))?;
        Ok(h)
    }
    fn release(&self, handle: u64) -> Result<(), CUresult> {
        call!(cuMemRelease: fn(CUmemGenericAllocationHandle)(handle))
    }
    fn map(&self, va: u64, size: u64, handle: u64) -> Result<(), CUresult> {
        call!(cuMemMap: fn(CUdeviceptr, usize, usize, CUmemGenericAllocationHandle, u64)
            (va, size as usize, 0, handle, 0))?;
        let desc = CUmemAccessDesc {
            location: CUmemLocation {
                type_: CU_MEM_LOCATION_TYPE_DEVICE,
                id: self.device,
            },
            flags: CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        let r = call!(cuMemSetAccess: fn(CUdeviceptr, usize, *const CUmemAccessDesc, usize)
            (va, size as usize, &desc, 1));
        if r.is_err() {
            let _ = self.unmap(va, size);
        }
        r
    }
    fn unmap(&self, va: u64, size: u64) -> Result<(), CUresult> {
        call!(cuMemUnmap: fn(CUdeviceptr, usize)(va, size as usize))
    }
    fn set_access(&self, va: u64, size: u64, grants: &[crate::mem::Grant]) -> Result<(), CUresult> {
        let descs: Vec<CUmemAccessDesc> = grants
            .iter()
            .map(|&(id, flags)| CUmemAccessDesc {
                location: CUmemLocation {
                    type_: CU_MEM_LOCATION_TYPE_DEVICE,
                    id,
                },
                flags,
            })
            .collect();
        call!(cuMemSetAccess: fn(CUdeviceptr, usize, *const CUmemAccessDesc, usize)
            (va, size as usize, descs.as_ptr(), descs.len()))
    }
    fn host_alloc(&self, size: u64) -> Result<*mut u8, CUresult> {
        pinned::alloc(size)
    }
    fn host_free(&self, p: *mut u8, size: u64) {
        pinned::free(p, size)
    }
    fn pageable_alloc(&self, size: u64) -> Option<*mut u8> {
        pinned::alloc_pageable(size)
    }
    fn pageable_free(&self, p: *mut u8, size: u64) {
        pinned::free_pageable(p, size)
    }
    fn host_register(&self, p: *mut u8, size: u64) -> Result<(), CUresult> {
        pinned::register(p, size)
    }
    fn host_spill(&self, p: *mut u8, size: u64) -> Option<u64> {
        pinned::spill(p, size)
    }
    fn host_spillable(&self, p: *mut u8) -> bool {
        crate::pool::owns(p)
    }
    fn spilled_to_device(&self, h: u64, va: u64, pieces: &[(u64, u64)]) -> Result<(), CUresult> {
        crate::pool::read_back(h, |base, len| {
            for &(off, n) in pieces {
                if off.checked_add(n).is_none_or(|end| end > len as u64) {
                    return Err(CUDA_ERROR_INVALID_VALUE);
                }
                // SAFETY: `[base + off, base + off + n)` lies in the read-only mapping
                // of the spill files, valid for the whole closure.
                unsafe { self.to_device(va + off, base.add(off as usize), n) }?;
            }
            Ok(())
        })
        .unwrap_or_else(|| {
            crate::kerror!(
                "cannot map this process's swapped-out memory back from the swap pool's disk tier"
            );
            Err(CUDA_ERROR_UNKNOWN)
        })
    }
    fn spill_free(&self, h: u64) {
        crate::pool::forget(h)
    }
    unsafe fn to_host(&self, dst: *mut u8, src: u64, n: u64) -> Result<(), CUresult> {
        call!(cuMemcpyDtoH_v2: fn(*mut c_void, CUdeviceptr, usize)(dst as *mut c_void, src, n as usize))
    }
    unsafe fn to_device(&self, dst: u64, src: *const u8, n: u64) -> Result<(), CUresult> {
        call!(cuMemcpyHtoD_v2: fn(CUdeviceptr, *const c_void, usize)(dst, src as *const c_void, n as usize))
    }
    // Swap copies run on the context's legacy default stream: the application's work is
    // drained and the gate closed while the shim swaps, so nothing else is queued there,
    // and the copy engine moves one segment while the shim maps or pins the next.
    unsafe fn to_host_async(&self, dst: *mut u8, src: u64, n: u64) -> Result<(), CUresult> {
        call!(cuMemcpyDtoHAsync_v2: fn(*mut c_void, CUdeviceptr, usize, CUstream)
            (dst as *mut c_void, src, n as usize, null_mut()))
    }
    unsafe fn to_device_async(&self, dst: u64, src: *const u8, n: u64) -> Result<(), CUresult> {
        call!(cuMemcpyHtoDAsync_v2: fn(CUdeviceptr, *const c_void, usize, CUstream)
            (dst, src as *const c_void, n as usize, null_mut()))
    }
    fn wait_copies(&self) -> Result<(), CUresult> {
        call!(cuStreamSynchronize: fn(CUstream)(null_mut()))
    }
    fn copies_done(&self) -> Option<bool> {
        // CUDA_ERROR_NOT_READY (600): still copying.
        match call!(cuStreamQuery: fn(CUstream)(null_mut())) {
            Ok(()) => Some(true),
            Err(600) => Some(false),
            Err(_) => None,
        }
    }
    // A free waits for the work that may still use the memory: a stream-ordered free
    // for its own stream only ([`FREE_STREAM`]), any other free for the context, never
    // while a stream captures (the driver would refuse and invalidate the capture;
    // frees during a capture are deferred before they get here, see `hooks::mem_free`).
    fn sync(&self) -> Result<(), CUresult> {
        if let Some(s) = FREE_STREAM.get() {
            return call!(cuStreamSynchronize: fn(CUstream)(s.handle_for_legacy_entry()));
        }
        crate::capture::sync_unless_capturing(|| call!(cuCtxSynchronize: fn()()))
            .unwrap_or(Err(crate::capture::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED))
    }
}

thread_local! {
    /// The stream a stream-ordered free on this thread waits for ([`crate::hooks::mem_free_async`]).
    pub(crate) static FREE_STREAM: std::cell::Cell<Option<crate::capture::StreamArg>> =
        const { std::cell::Cell::new(None) };
}

/// Most device ordinals the shim manages (one allocator and one turn each).
pub(crate) const MAX_DEVICES: usize = client::MAX_TURNS;

/// Each device's allocator (created when the process first gets a context or
/// allocates on it).
static MEMS: [Mutex<Option<Memory<RealDriver>>>; MAX_DEVICES] =
    [const { Mutex::new(None) }; MAX_DEVICES];
/// The application's context on each device, made current on the shim's own threads
/// before they swap or drain.
pub(crate) static APP_CTX: [AtomicPtr<c_void>; MAX_DEVICES] =
    [const { AtomicPtr::new(null_mut()) }; MAX_DEVICES];
/// Every context the application made and has not destroyed, by (device, context,
/// bytes counted for it), newest last: a drain waits for the work of each one on
/// its device, not only [`APP_CTX`]'s (a program that works in an older context
/// while a newer one lives had its kernels' memory swapped out from under them).
/// The first live context on a device is counted with the device's registration
/// (0 here); each further one as much as the first ([`context_made`]).
static LIVE: Mutex<Vec<(usize, usize, u64)>> = Mutex::new(Vec::new());

fn live() -> MutexGuard<'static, Vec<(usize, usize, u64)>> {
    LIVE.lock().unwrap_or_else(|p| p.into_inner())
}

/// What the process's first context on each device was counted (0: not known):
/// every further live context there counts as much ([`context_made`]).
static CONTEXT_COST: [AtomicU64; MAX_DEVICES] = [const { AtomicU64::new(0) }; MAX_DEVICES];

/// The process's first context on device `d` was counted `bytes`.
pub(crate) fn note_context_cost(d: usize, bytes: u64) {
    if let Some(c) = CONTEXT_COST.get(d) {
        c.store(bytes, Ordering::Release);
    }
}

/// Adds `delta` to what device `d`'s turn counts as memory no swap frees.
fn count_context(d: usize, delta: i64) {
    if let Some(turn) = client::global().and_then(|c| c.turn_for(d)) {
        turn.add_context_bytes(delta);
        client::report_now(d);
    }
}

/// The application made (or retained) context `ctx` on device `d`. A context beyond
/// the first live one there (a second `cuCtxCreate`, or the primary context beside
/// one) costs as much as the first did: counted as memory no swap frees, and that
/// count returned (0 for a context already live, or the first).
pub(crate) fn context_made(d: usize, ctx: CUcontext) -> u64 {
    let mut l = live();
    if let Some(i) = l.iter().position(|&(_, c, _)| c == ctx as usize) {
        let e = l.remove(i);
        l.push(e);
        return 0;
    }
    let others = l.iter().any(|&(dd, _, _)| dd == d);
    let managed = client::global().and_then(|c| c.turn_for(d)).is_some();
    let cost = match CONTEXT_COST[d].load(Ordering::Acquire) {
        c if others && managed => c,
        _ => 0,
    };
    l.push((d, ctx as usize, cost));
    drop(l);
    if cost > 0 {
        crate::kdebug!(
            "GPU {d}: another context: {} MiB more no swap frees",
            cost >> 20
        );
        count_context(d, cost as i64);
    }
    cost
}

/// Context `ctx` is gone (destroyed): no longer drained, and one context fewer
/// counted where others live on its device (its own count, or, for the first, the
/// count of the newest other, which takes its place); where it was the one the shim
/// works in, the newest live one there takes over. `counted`: whether its count is
/// still there to give back (a context taken back at once had it given back).
pub(crate) fn context_destroyed(ctx: CUcontext, counted: bool) {
    let mut l = live();
    let Some(i) = l.iter().position(|&(_, c, _)| c == ctx as usize) else {
        return;
    };
    let (d, _, own) = l.remove(i);
    let give = if own > 0 || !counted {
        own
    } else {
        // The uncounted first went: the newest counted other is now the first.
        l.iter_mut()
            .rev()
            .find(|e| e.0 == d && e.2 > 0)
            .map_or(0, |e| std::mem::take(&mut e.2))
    };
    let newest = l.iter().rev().find(|e| e.0 == d).map(|e| e.1);
    drop(l);
    if let Some(newest) = newest {
        let _ = APP_CTX[d].compare_exchange(
            ctx,
            newest as CUcontext,
            Ordering::AcqRel,
            Ordering::Acquire,
        );
    }
    if counted && give > 0 {
        count_context(d, -(give as i64));
    }
}

/// Waits for the queued work of every live application context on device `d` but
/// `current` (the calling thread's, already waited for), each made current for it
/// and `current` again after. A context the driver no longer knows is forgotten.
fn synchronize_others(d: usize, current: CUcontext) -> Result<(), CUresult> {
    let others: Vec<usize> = live()
        .iter()
        .filter(|&&(dd, c, _)| dd == d && c != current as usize)
        .map(|&(_, c, _)| c)
        .collect();
    for c in others {
        let r = call!(cuCtxSetCurrent: fn(CUcontext)(c as CUcontext))
            .and_then(|()| call!(cuCtxSynchronize: fn()()));
        let _ = call!(cuCtxSetCurrent: fn(CUcontext)(current));
        match r {
            // CUDA_ERROR_INVALID_CONTEXT, CUDA_ERROR_CONTEXT_IS_DESTROYED.
            Err(201) | Err(709) => live().retain(|&(_, l, _)| l != c),
            r => r?,
        }
    }
    Ok(())
}

/// Devices with an allocator (bit per ordinal), so lookups by pointer visit only those.
static DEVICES_SEEN: AtomicU64 = AtomicU64::new(0);
/// Devices whose VMM is unavailable (bit per ordinal): their allocations pass through.
static VMM_UNAVAILABLE: AtomicU64 = AtomicU64::new(0);

pub(crate) fn mem_lock(d: usize) -> MutexGuard<'static, Option<Memory<RealDriver>>> {
    MEMS[d].lock().unwrap_or_else(|p| p.into_inner())
}

/// Ordinals of the devices that have an allocator.
pub(crate) fn seen_devices() -> impl Iterator<Item = usize> {
    let bits = DEVICES_SEEN.load(Ordering::Acquire);
    (0..MAX_DEVICES).filter(move |d| bits & (1 << d) != 0)
}

pub(crate) fn current_context() -> CUcontext {
    let mut ctx: CUcontext = null_mut();
    let _ = call!(cuCtxGetCurrent: fn(*mut CUcontext)(&mut ctx));
    ctx
}

/// The device of the calling thread's current context (where its next launch goes).
pub(crate) fn current_device() -> Option<usize> {
    let mut d: CUdevice = 0;
    call!(cuCtxGetDevice: fn(*mut CUdevice)(&mut d)).ok()?;
    usize::try_from(d).ok().filter(|&d| d < MAX_DEVICES)
}

/// Whether every allocation of every device is resident (slow paths only: it takes
/// each allocator's lock).
pub(crate) fn all_resident() -> bool {
    seen_devices().all(|d| mem_lock(d).as_ref().is_none_or(|m| m.all_resident()))
}

/// Waits for the work queued on the calling thread's current context: the queue
/// bound ([`crate::gate::QueueBound`]) calls it from the submitting thread, without
/// switching that thread's context.
pub fn synchronize_current() -> Result<(), CUresult> {
    crate::ffi::inside(|| call!(cuCtxSynchronize: fn()()))
}

/// The queue bound's wait, [`synchronize_current`], for at most `limit` in a process
/// with contexts on several GPUs; `Ok(false)`: it did not finish in time (or an
/// earlier one had not), and the caller goes on.
///
/// Such a process's queue may hold work that waits for work the same thread is about
/// to submit to another GPU: a collective's kernel on GPU 0 spins until its peer on
/// GPU 1 starts (NCCL from one thread, as `torch.nn.DataParallel` drives it), a
/// stream wait for a write queued next. Waiting for that queue from the submitting
/// thread would never end. So the context is synchronized on the shim's drainer
/// thread and the submitting thread waits for it at most `limit`; the queue then
/// stays bounded in all but that case, where a drop's drain takes longer instead.
pub fn synchronize_current_within(limit: std::time::Duration) -> Result<bool, CUresult> {
    if APP_CTX
        .iter()
        .filter(|c| !c.load(Ordering::Acquire).is_null())
        .count()
        < 2
    {
        return synchronize_current().map(|()| true);
    }
    let ctx = current_context();
    if ctx.is_null() {
        return Ok(true);
    }
    let Some(d) = current_device() else {
        return synchronize_current().map(|()| true);
    };
    drainer::drain(d, ctx, limit).unwrap_or_else(|| synchronize_current().map(|()| true))
}

/// The threads that synchronize a context with a bound on the wait
/// ([`synchronize_current_within`], [`Residency::drain_within`]): one lane per
/// device, started at its first use, so a synchronization stuck on one GPU (its queue
/// waits for a peer) does not hold back another GPU's.
mod drainer {
    use std::sync::{Condvar, Mutex, OnceLock};
    use std::time::{Duration, Instant};

    use super::MAX_DEVICES;
    use crate::cuda::{CUcontext, CUresult, CUDA_SUCCESS};
    use crate::real::call_real as call;

    #[derive(Default)]
    struct State {
        /// The context to synchronize (its address: the driver's handle).
        job: Option<usize>,
        /// Synchronizations asked and finished; the last one's result.
        asked: u64,
        done: u64,
        result: CUresult,
    }

    struct Lane {
        state: Mutex<State>,
        changed: Condvar,
        started: OnceLock<bool>,
    }

    static LANES: [Lane; MAX_DEVICES] = [const {
        Lane {
            state: Mutex::new(State {
                job: None,
                asked: 0,
                done: 0,
                result: CUDA_SUCCESS,
            }),
            changed: Condvar::new(),
            started: OnceLock::new(),
        }
    }; MAX_DEVICES];

    fn lock(lane: &Lane) -> std::sync::MutexGuard<'_, State> {
        lane.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Synchronizes `ctx` (a context on device `d`) on `d`'s lane, waiting at most
    /// `limit`; `Ok(false)`: not finished in time, or an earlier synchronization on
    /// the lane is still running (it is waited for within the limit, and counts as
    /// this one not finished). `None` when no thread could be started: the caller
    /// waits itself.
    pub(super) fn drain(
        d: usize,
        ctx: CUcontext,
        limit: Duration,
    ) -> Option<Result<bool, CUresult>> {
        let lane: &'static Lane = LANES.get(d)?;
        let started = *lane.started.get_or_init(|| {
            std::thread::Builder::new()
                .name("kiwi-drainer".into())
                .spawn(move || run(lane))
                .is_ok()
        });
        if !started {
            return None;
        }
        let deadline = Instant::now() + limit;
        let mut s = lock(lane);
        let own = s.done == s.asked;
        if own {
            s.job = Some(ctx as usize);
            s.asked += 1;
            lane.changed.notify_all();
        }
        let want = s.asked;
        while s.done < want {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Some(Ok(false));
            }
            s = lane
                .changed
                .wait_timeout(s, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        Some(match s.result {
            _ if !own => Ok(false),
            CUDA_SUCCESS => Ok(true),
            e => Err(e),
        })
    }

    fn run(lane: &'static Lane) {
        loop {
            let ctx = {
                let mut s = lock(lane);
                loop {
                    if let Some(c) = s.job.take() {
                        break c;
                    }
                    s = lane.changed.wait(s).unwrap_or_else(|p| p.into_inner());
                }
            };
            let r = crate::ffi::inside(|| {
                call!(cuCtxSetCurrent: fn(CUcontext)(ctx as CUcontext))?;
                let r = call!(cuCtxSynchronize: fn()());
                let _ = call!(cuCtxSetCurrent: fn(CUcontext)(std::ptr::null_mut()));
                r
            });
            let mut s = lock(lane);
            s.result = r.err().unwrap_or(CUDA_SUCCESS);
            s.done = s.asked;
            lane.changed.notify_all();
        }
    }
}

/// The application's context on a device, current on this thread until dropped; then
/// the thread's own context is current again. Swaps and drains run on the shim's
/// threads and on application threads waiting for their turn: an application thread
/// must find the context it had (its next launch goes to that context's device).
struct AppContext {
    previous: CUcontext,
    switched: bool,
}

impl AppContext {
    /// `None` when the device has no context yet.
    fn enter(d: usize) -> Option<AppContext> {
        let ctx = APP_CTX[d].load(Ordering::Acquire);
        if ctx.is_null() {
            return None;
        }
        let previous = current_context();
        if previous == ctx {
            return Some(AppContext {
                previous,
                switched: false,
            });
        }
        if call!(cuCtxSetCurrent: fn(CUcontext)(ctx)).is_ok() {
            return Some(AppContext {
                previous,
                switched: true,
            });
        }
        // The application destroyed that context (`cuCtxDestroy`) and made none on
        // this device since: its work there is gone with it, and the shim's memory
        // (VMM, not owned by a context) is reached through the device's primary
        // context, retained once for the shim.
        let mut primary: CUcontext = null_mut();
        call!(cuDevicePrimaryCtxRetain: fn(*mut CUcontext, CUdevice)(&mut primary, d as CUdevice))
            .ok()?;
        crate::kwarn!(
            "GPU {d}: the application's context is gone; swapping through the primary context"
        );
        let _ = APP_CTX[d].compare_exchange(ctx, primary, Ordering::AcqRel, Ordering::Acquire);
        let switched = call!(cuCtxSetCurrent: fn(CUcontext)(primary)).is_ok();
        Some(AppContext { previous, switched })
    }
}

impl Drop for AppContext {
    fn drop(&mut self) {
        if self.switched {
            let _ = call!(cuCtxSetCurrent: fn(CUcontext)(self.previous));
        }
    }
}

/// The identity the arbiter knows device `d` by.
fn device_info(d: usize) -> Result<DeviceInfo, CUresult> {
    let dev = d as CUdevice;
    let mut uuid = CUuuid::default();
    call!(cuDeviceGetUuid_v2: fn(*mut CUuuid, CUdevice)(&mut uuid, dev))
        .or_else(|_| call!(cuDeviceGetUuid: fn(*mut CUuuid, CUdevice)(&mut uuid, dev)))?;
    let mut total: usize = 0;
    call!(cuDeviceTotalMem_v2: fn(*mut usize, CUdevice)(&mut total, dev))?;
    Ok(DeviceInfo {
        ordinal: d,
        uuid: format_uuid(&uuid),
        total_memory: total as u64,
        context_bytes: 0,
        pending_bytes: 0,
    })
}

/// Free memory on GPU `uuid` now, as NVML counts it (it needs no context, which a
/// process whose first context was refused does not have); `None` where NVML does
/// not load.
pub(crate) fn nvml_free(uuid: &str) -> Option<u64> {
    let nvml = nvml()?;
    let dev = nvml.handle_by_uuid(uuid).ok()?;
    nvml.memory(dev).ok().map(|m| m.free)
}

/// NVML, loaded once; `None` where it does not load.
fn nvml() -> Option<&'static kiwi_nvml::Nvml> {
    static NVML: std::sync::OnceLock<Option<kiwi_nvml::Nvml>> = std::sync::OnceLock::new();
    // Inside the shim: its lookups get the driver's functions, not the view's
    // (`crate::nvml`).
    NVML.get_or_init(|| crate::ffi::inside(|| kiwi_nvml::Nvml::load(kiwi_nvml::NVML_LIBRARY).ok()))
        .as_ref()
}

/// GPU `uuid` as NVML sees it at one moment: free memory, and each process's
/// memory (`(pid, bytes)`; `None` where NVML cannot list them).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct NvmlLook {
    pub free: u64,
    pub procs: Option<Vec<(u32, u64)>>,
}

/// [`NvmlLook`] of GPU `uuid` now.
pub(crate) fn nvml_look(uuid: &str) -> Option<NvmlLook> {
    let nvml = nvml()?;
    let dev = nvml.handle_by_uuid(uuid).ok()?;
    let free = nvml.memory(dev).ok()?.free;
    Some(NvmlLook {
        free,
        procs: nvml.compute_processes(dev).ok(),
    })
}

/// What this process's context creation (process `me`) took, from NVML's looks
/// before and after it: its own growth where NVML lists it under `me`; else (a pid
/// namespace of its own) the least growth of the processes that appeared or grew
/// meanwhile, one of which is this one; never more than the drop in free memory.
/// Newcomers starting together each counted the others' contexts as their own
/// before (a notebook refused for a holder it would not have blocked).
pub(crate) fn creation_cost(before: &NvmlLook, after: &NvmlLook, me: u32) -> u64 {
    let drop = before.free.saturating_sub(after.free);
    let (Some(b), Some(a)) = (&before.procs, &after.procs) else {
        return drop;
    };
    let was = |pid: u32| b.iter().find(|p| p.0 == pid).map_or(0, |p| p.1);
    if let Some(&(_, mine)) = a.iter().find(|p| p.0 == me) {
        return mine.saturating_sub(was(me)).min(drop);
    }
    a.iter()
        .map(|&(pid, bytes)| bytes.saturating_sub(was(pid)))
        .filter(|&g| g > 0)
        .min()
        .map_or(drop, |g| g.min(drop))
}

/// Device `d`'s UUID as NVML names it (`GPU-…`); `None` where the driver cannot say.
pub(crate) fn device_uuid(d: usize) -> Option<String> {
    device_info(d).ok().map(|i| i.uuid)
}

/// The drop in free memory (NVML's) around the process's first context creation on
/// each device: what [`context_cost`] counts where no twin fits (0: none seen).
static CREATION_DROP: [AtomicU64; MAX_DEVICES] = [const { AtomicU64::new(0) }; MAX_DEVICES];

/// Most a creation's drop is believed: more is others' memory that arrived meanwhile
/// (an H100's contexts cost 300–600 MiB).
const CREATION_DROP_MAX: u64 = 2 << 30;

/// What the process's first context creation on device `d` took from free memory.
pub(crate) fn note_creation_drop(d: usize, bytes: u64) {
    if let Some(c) = CREATION_DROP.get(d) {
        c.store(bytes, Ordering::Release);
    }
}

/// Device memory free now, as the driver sees it from the calling thread's context.
pub(crate) fn free_memory() -> Option<u64> {
    let (mut free, mut total) = (0usize, 0usize);
    call!(cuMemGetInfo_v2: fn(*mut usize, *mut usize)(&mut free, &mut total)).ok()?;
    Some(free as u64)
}

/// What a context costs on device `d`, where the application has context `ctx`:
/// the drop in free memory (`cuMemGetInfo`) while the shim holds a context of its own
/// there, made and destroyed at once. Other processes allocating or freeing
/// meanwhile (their own probes, swaps) move free memory too: see [`settle_cost`]
/// for which of at most [`COST_TRIES`] tries count. The application's own context
/// was made before the shim could look (the CUDA runtime makes its primary context
/// through a private entry point), so its cost is measured on a twin. 0 when it
/// cannot be measured (no room for a second context) and the application's own
/// creation was not seen to take memory ([`note_creation_drop`]): the arbiter's
/// reserve then covers it.
pub(crate) fn context_cost(d: usize, ctx: CUcontext) -> u64 {
    let destroy = crate::real::lookup(c"cuCtxDestroy_v2");
    if ctx.is_null() || destroy.is_null() {
        return 0;
    }
    // SAFETY: the driver's cuCtxDestroy_v2, with cuda.h's signature.
    let destroy = unsafe {
        std::mem::transmute::<*mut c_void, unsafe extern "C" fn(CUcontext) -> CUresult>(destroy)
    };
    crate::ffi::inside(|| {
        let previous = current_context();
        if call!(cuCtxSetCurrent: fn(CUcontext)(ctx)).is_err() {
            return 0;
        }
        // Free memory as the driver tells it in the application's context, or, where
        // that context cannot answer yet (NVIDIA's runtime 13 makes its primary
        // context before it can: seen on an H100 and an H200, driver 580), as NVML
        // counts it, which needs no context. One source for every reading.
        let uuid = device_uuid(d);
        let use_nvml = free_memory().is_none();
        let free_memory = || {
            if use_nvml {
                uuid.as_deref().and_then(nvml_free)
            } else {
                free_memory()
            }
        };
        let mut tries: Vec<CostTry> = Vec::new();
        while tries.len() < COST_TRIES {
            std::thread::sleep(try_jitter(tries.len()));
            let Some(before) = free_memory() else {
                crate::kdebug!("GPU {d}: free memory unknown: no context cost");
                break;
            };
            let mut twin: CUcontext = null_mut();
            if let Err(e) = call!(cuCtxCreate_v2: fn(*mut CUcontext, Uint, CUdevice)(&mut twin, 0, d as CUdevice))
            {
                crate::kdebug!(
                    "GPU {d}: a twin context was refused (CUDA error {e}): no context cost"
                );
                break;
            }
            let with_twin = free_memory();
            // SAFETY: destroying the context made just above (it pops it: `ctx` is
            // current again).
            unsafe { destroy(twin) };
            let _ = call!(cuCtxSetCurrent: fn(CUcontext)(ctx));
            let (Some(with_twin), Some(after)) = (with_twin, free_memory()) else {
                break;
            };
            tries.push(CostTry {
                before,
                with_twin,
                after,
            });
            if settle_cost(&tries).is_some_and(|(_, agreed)| agreed) {
                break;
            }
        }
        let _ = call!(cuCtxSetCurrent: fn(CUcontext)(previous));
        let Some((cost, agreed)) = settle_cost(&tries) else {
            // No room for a twin (a newcomer beside a tenant that fills the GPU):
            // what the process's own creation took, if it was seen.
            let drop = CREATION_DROP[d].load(Ordering::Acquire);
            if drop > 0 && drop <= CREATION_DROP_MAX {
                crate::kinfo!(
                    "GPU {d}: no room for a second context to measure one by; counting the {} MiB its creation took",
                    drop >> 20
                );
                return drop;
            }
            crate::kinfo!("GPU {d}: could not measure what a context costs; counting none");
            return 0;
        };
        crate::kdebug!(
            "GPU {d}: a context costs {cost} bytes ({} tries{})",
            tries.len(),
            if agreed {
                ""
            } else {
                ", not settled: the least"
            }
        );
        cost
    })
}

/// Most twin contexts [`context_cost`] makes.
const COST_TRIES: usize = 6;

/// Free device memory around one twin context: before making it, while it lived,
/// after destroying it.
#[derive(Debug, Clone, Copy)]
struct CostTry {
    before: u64,
    with_twin: u64,
    after: u64,
}

/// The context cost the tries show, and whether two agreed.
///
/// - A try is calm when free memory came back to where it was (within 1 MiB) once
///   the twin was destroyed. A try during another process's swap-out (64 MiB freed
///   every few ms) is not calm: it measured the cost short by what was freed, down
///   to 0; two such tries agreed, and the arbiter then counted room that was not
///   there.
/// - A calm try can still be disturbed, upward in practice: another process's
///   short-lived memory — its own twin, when Kiwi processes start together — taken
///   and given back between this try's reads. Two processes measuring at once on a
///   loaded machine each counted both twins (600 MiB for a 300 MiB context), and two
///   notebooks that fit side by side were made to take turns. So the smallest calm
///   try counts, settled once another calm try agrees with it (within 1 MiB); tries
///   are spaced by a jitter ([`try_jitter`]) so two processes fall out of step.
/// - Else the smallest bound the disturbed tries give: others that only freed (or
///   only allocated) meanwhile moved free memory one way, so the larger of the drop
///   with the twin measured from before and from after (`max(before, after) −
///   with_twin`) is at least what the twin took.
fn settle_cost(tries: &[CostTry]) -> Option<(u64, bool)> {
    const NEAR: u64 = 1 << 20;
    let cost = |t: &CostTry| t.before.saturating_sub(t.with_twin);
    let calm: Vec<u64> = tries
        .iter()
        .filter(|t| t.after.abs_diff(t.before) <= NEAR)
        .map(cost)
        .collect();
    if let Some(least) = calm.iter().copied().min() {
        let near = calm.iter().filter(|&&c| c.abs_diff(least) <= NEAR).count();
        return Some((least, near >= 2));
    }
    let bound = |t: &CostTry| t.before.max(t.after).saturating_sub(t.with_twin);
    Some((tries.iter().map(bound).min()?, false))
}

/// How long to wait before twin try `n` (none before the first): 1–8 ms, drawn from
/// the clock and the process id, so two processes measuring at once fall out of step.
fn try_jitter(n: usize) -> std::time::Duration {
    if n == 0 {
        return std::time::Duration::ZERO;
    }
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let mix = (u64::from(nanos) ^ u64::from(std::process::id()).wrapping_mul(0x9E37_79B9))
        .wrapping_mul(0x2545_F491_4F6C_DD1D);
    std::time::Duration::from_micros(1000 + (mix >> 40) % 7000)
}

/// Creates device `d`'s allocator. Managed processes create it with backing not
/// allowed: nothing is backed before the device's turn is held.
fn create_mem(d: usize, ctx: CUcontext, backing_allowed: bool) -> bool {
    let mut guard = mem_lock(d);
    if guard.is_some() {
        return true;
    }
    match Memory::new(RealDriver {
        device: d as CUdevice,
    }) {
        Ok(mut m) => {
            m.set_backing_allowed(backing_allowed);
            *guard = Some(m);
            if !ctx.is_null() {
                let _ = APP_CTX[d].compare_exchange(
                    null_mut(),
                    ctx,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                );
            }
            DEVICES_SEEN.fetch_or(1 << d, Ordering::AcqRel);
            true
        }
        Err(e) => {
            if VMM_UNAVAILABLE.fetch_or(1 << d, Ordering::AcqRel) & (1 << d) == 0 {
                crate::kwarn!(
                    "GPU {d}: VMM unavailable (CUDA error {e}); its allocations pass through unswappable"
                );
            }
            false
        }
    }
}

/// Makes sure device `d` (where the process has context `ctx`) has its allocator and,
/// when managed, its turn. False when the shim does not manage the device's memory.
pub(crate) fn ensure_device(d: usize, ctx: CUcontext) -> bool {
    if !client::allocator_enabled() || VMM_UNAVAILABLE.load(Ordering::Acquire) & (1 << d) != 0 {
        return false;
    }
    if mem_lock(d).is_some() {
        return true;
    }
    let Some(c) = client::global() else {
        return create_mem(d, ctx, true);
    };
    let mut info = match device_info(d) {
        Ok(i) => i,
        Err(e) => {
            crate::kwarn!("GPU {d}: cannot identify it (CUDA error {e}); not managed");
            return false;
        }
    };
    info.context_bytes = context_cost(d, ctx);
    note_context_cost(d, info.context_bytes);
    let added = c.add_device(info, || {
        create_mem(d, ctx, false).then(|| Box::new(DeviceResidency(d)) as Box<dyn Residency>)
    });
    if added == client::Added::Unmanaged {
        if let Some(m) = mem_lock(d).as_mut() {
            m.set_backing_allowed(true);
        }
    }
    mem_lock(d).is_some()
}

/// Device `d`'s turn, for memory the shim cannot page that does not fit yet (a
/// context, a module, the application's own VMM memory: [`crate::room`]): registered
/// now, before any context, when the process has none there; either way with
/// `estimate` bytes pending (reported as working set not resident, so the
/// arbiter makes room for them). The caller clears them (`set_pending(0)`). `None`
/// when the shim does not manage the device.
pub(crate) fn turn_for_room(d: usize, estimate: u64) -> Option<&'static client::Turn> {
    let c = client::global()?;
    if VMM_UNAVAILABLE.load(Ordering::Acquire) & (1 << d) != 0 {
        return None;
    }
    if let Some(t) = c.turn_for(d) {
        t.set_pending(estimate);
        client::report_now(d);
        return Some(t);
    }
    let mut info = match device_info(d) {
        Ok(i) => i,
        Err(e) => {
            crate::kwarn!("GPU {d}: cannot identify it (CUDA error {e}); not managed");
            return None;
        }
    };
    info.pending_bytes = estimate;
    let added = c.add_device(info, || {
        create_mem(d, null_mut(), false).then(|| Box::new(DeviceResidency(d)) as Box<dyn Residency>)
    });
    if added == client::Added::Unmanaged {
        if let Some(m) = mem_lock(d).as_mut() {
            m.set_backing_allowed(true);
        }
        return None;
    }
    c.turn_for(d).map(|t| &**t)
}

/// The current context's device, when the shim manages its memory: its allocator
/// (and, managed, its turn) is created on first use. `None`: no context, allocator
/// disabled, VMM unavailable.
pub(crate) fn current_mem_device() -> Option<usize> {
    if !client::allocator_enabled() {
        return None;
    }
    let ctx = current_context();
    if ctx.is_null() {
        return None;
    }
    let d = current_device()?;
    ensure_device(d, ctx).then_some(d)
}

/// Runs `f` on the allocator whose allocation contains `ptr` (any byte of it), with
/// its device and the allocation's (base, size); `None` when no allocation of the
/// shim's holds `ptr`. For [`crate::attrs`].
pub(crate) fn with_allocation<T>(
    ptr: CUdeviceptr,
    f: impl FnOnce(usize, (u64, u64), &mut Memory<RealDriver>) -> T,
) -> Option<T> {
    if !client::allocator_enabled() {
        return None;
    }
    for d in seen_devices() {
        let mut guard = mem_lock(d);
        if let Some(m) = guard.as_mut() {
            if let Some(range) = m.range_of(ptr) {
                return Some(crate::ffi::inside(|| f(d, range, m)));
            }
        }
    }
    None
}

/// `kiwiMemDiscard`: declares `[ptr, ptr + bytes)` of one of the shim's allocations
/// dead until the process's next submission ([`Memory::discard`], [`crate::hint`]).
/// `CUDA_ERROR_INVALID_VALUE` for a range outside the shim's allocations (null,
/// overflow, past the allocation's end); a provider's late answer is accepted and
/// ignored.
pub(crate) fn discard(ptr: CUdeviceptr, bytes: u64) -> CUresult {
    let token = crate::hint::discard_token(crate::gate::GATE.token());
    if ptr == 0 || bytes == 0 {
        return CUDA_ERROR_INVALID_VALUE;
    }
    match with_allocation(ptr, |_, _, m| m.discard(ptr, bytes, token)) {
        Some(Ok(_)) => CUDA_SUCCESS,
        Some(Err(e)) => e,
        None => CUDA_ERROR_INVALID_VALUE,
    }
}

/// Runs `f` on device `d`'s allocator, if it has one. For [`crate::attrs`].
pub(crate) fn with_device_memory<T>(
    d: usize,
    f: impl FnOnce(&mut Memory<RealDriver>) -> T,
) -> Option<T> {
    if d >= MAX_DEVICES {
        return None;
    }
    mem_lock(d).as_mut().map(|m| crate::ffi::inside(|| f(m)))
}

/// The application's context on device `d` (null when it has none). For
/// [`crate::attrs`].
pub(crate) fn app_context(d: usize) -> CUcontext {
    APP_CTX
        .get(d)
        .map_or(null_mut(), |c| c.load(Ordering::Acquire))
}

/// The device of context `ctx`: made current for the question, the thread's own
/// context restored after. For [`crate::attrs`].
pub(crate) fn device_of(ctx: CUcontext) -> Option<usize> {
    let previous = current_context();
    if previous == ctx {
        return current_device();
    }
    call!(cuCtxSetCurrent: fn(CUcontext)(ctx)).ok()?;
    let d = current_device();
    let _ = call!(cuCtxSetCurrent: fn(CUcontext)(previous));
    d
}

/// Runs `f` on the allocator that owns `ptr` (an allocation base).
pub(crate) fn with_owner<T>(
    ptr: CUdeviceptr,
    f: impl FnOnce(&mut Memory<RealDriver>) -> T,
) -> Option<T> {
    for d in seen_devices() {
        let mut guard = mem_lock(d);
        if let Some(m) = guard.as_mut().filter(|m| m.owns(ptr)) {
            return Some(f(m));
        }
    }
    None
}

/// [`Residency`] over device `.0`'s allocator; drives the driver from the shim's thread.
struct DeviceResidency(usize);

impl DeviceResidency {
    fn with<T>(&self, default: T, f: impl FnOnce(&mut Memory<RealDriver>) -> T) -> T {
        let mut guard = mem_lock(self.0);
        match guard.as_mut() {
            Some(m) => crate::ffi::inside(|| {
                let _ctx = AppContext::enter(self.0);
                // Pinning swap buffers is a potentially unsafe call: relaxed, it never
                // invalidates the application's captures.
                let _relaxed = crate::capture::Relaxed::enter();
                f(m)
            }),
            None => default,
        }
    }
}

impl DeviceResidency {
    /// Moves the application's managed memory on this device to the host or back
    /// ([`crate::managed`]), with its context current, adding to `swap`.
    fn migrate_managed(&self, to_host: bool, swap: &mut Swap) -> Result<(), CUresult> {
        let (bytes, took) = crate::ffi::inside(|| {
            let _ctx = AppContext::enter(self.0);
            let _relaxed = crate::capture::Relaxed::enter();
            crate::managed::migrate(self.0, to_host)
        })?;
        swap.bytes += bytes;
        swap.moved += bytes;
        swap.duration += took;
        Ok(())
    }
}

impl Residency for DeviceResidency {
    /// The allocator's figures, with the application's managed memory on this device
    /// counted as working set (resident unless a swap-out moved it to the host).
    fn figures(&self) -> Figures {
        let mut f = mem_lock(self.0)
            .as_ref()
            .map(|m| m.figures())
            .unwrap_or_default();
        let (managed, on_gpu) = crate::managed::bytes(self.0);
        f.working_set += managed;
        f.resident += on_gpu;
        f
    }
    fn set_limit(&self, limit: u64) {
        if let Some(m) = mem_lock(self.0).as_mut() {
            m.set_limit(limit);
        }
    }
    fn set_backing_allowed(&self, allowed: bool) {
        if let Some(m) = mem_lock(self.0).as_mut() {
            m.set_backing_allowed(allowed);
        }
    }
    fn all_resident(&self) -> bool {
        mem_lock(self.0).as_ref().is_none_or(|m| m.all_resident())
            && crate::managed::resident(self.0)
    }
    // Swap copies run on the legacy stream, which a capture on a blocking stream
    // forbids: they wait for such captures to end (the swap is refused, never forced
    // through a capture, when one outlasts the wait).
    fn swap_in_all(&self) -> Result<Swap, CUresult> {
        if !crate::capture::legacy_usable(crate::capture::CAPTURE_WAIT) {
            return Err(crate::capture::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
        }
        let mut swap = self.with(Ok(Swap::default()), |m| m.swap_in_all())?;
        self.migrate_managed(false, &mut swap)?;
        Ok(swap)
    }
    fn swap_in_waiting(&self, until: std::time::Instant) -> Result<Swap, CUresult> {
        if !crate::capture::legacy_usable(crate::capture::CAPTURE_WAIT) {
            return Err(crate::capture::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
        }
        let mut swap = self.with(Ok(Swap::default()), |m| m.swap_in_until(Some(until)))?;
        self.migrate_managed(false, &mut swap)?;
        Ok(swap)
    }
    /// Asks the application which of its memory is dead first ([`crate::hint`]), when
    /// the gate is closed (its work drained, nothing new can run): bytes it declared
    /// dead since its last submission are not copied.
    fn evict(&self, need: u64) -> Result<Swap, CUresult> {
        if !crate::capture::legacy_usable(crate::capture::CAPTURE_WAIT) {
            return Err(crate::capture::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
        }
        let gate = &crate::gate::GATE;
        if need > 0 && !gate.is_open() {
            crate::hint::request(gate.token(), crate::hint::wait());
        }
        let mut swap = self.with(Ok(Swap::default()), |m| {
            m.evict_live(need, Some(gate.token()))
        })?;
        // Managed memory goes when what the allocator freed is not enough (the
        // driver pages it; a prefetch to the host frees its device memory at once).
        if need > swap.moved {
            self.migrate_managed(true, &mut swap)?;
        }
        Ok(swap)
    }
    /// Registers outside the allocator's lock, one segment's buffer at a time (a swap-in
    /// that meets a buffer being registered copies from it as pageable memory; one its
    /// segment let go meanwhile is freed when the registration ends).
    fn register_swapped(&self, budget: u64) -> Result<u64, CUresult> {
        let mut done = 0;
        while done < budget {
            let Some((drv, (ptr, cap))) = mem_lock(self.0)
                .as_mut()
                .and_then(|m| Some((*m.driver(), m.register_next()?)))
            else {
                break;
            };
            let r = crate::ffi::inside(|| {
                let _ctx = AppContext::enter(self.0);
                let _relaxed = crate::capture::Relaxed::enter();
                drv.host_register(ptr, cap)
            });
            if let Some(m) = mem_lock(self.0).as_mut() {
                m.finish_register(ptr, r.is_ok());
            }
            r?;
            done += cap;
        }
        Ok(done)
    }
    /// Pins outside the allocator's lock (page-locking runs at a few GB/s): a swap,
    /// an allocation or a release never waits behind it.
    fn prepare_swap_out(&self, need: u64, budget: u64) -> Result<u64, CUresult> {
        let Some((drv, missing)) = mem_lock(self.0)
            .as_ref()
            .map(|m| (*m.driver(), m.swap_out_shortfall(need)))
        else {
            return Ok(0);
        };
        let mut done = 0;
        for size in missing {
            if done > 0 && done + size > budget {
                break;
            }
            let p = crate::ffi::inside(|| {
                let _ctx = AppContext::enter(self.0);
                let _relaxed = crate::capture::Relaxed::enter();
                drv.host_alloc(size)
            })?;
            match mem_lock(self.0).as_mut() {
                // SAFETY: `p` is a fresh buffer of `size` bytes from this allocator's
                // driver, owned by nobody else.
                Some(m) => unsafe { m.add_spare(p, size) },
                None => drv.host_free(p, size),
            }
            done += size;
        }
        Ok(done)
    }
    fn trim_spare_buffers(&self) -> u64 {
        self.with(0, |m| m.release_spares())
    }
    /// One buffer per hold of the allocator's lock: a swap-in waits for one spill at
    /// most.
    fn spill(&self, budget: u64) -> u64 {
        let mut done = 0;
        while done < budget {
            let n = self.with(0, |m| m.spill_one());
            if n == 0 {
                break;
            }
            done += n;
        }
        done
    }
    fn locked(&self, f: &mut dyn FnMut(bool) -> bool) -> bool {
        let guard = mem_lock(self.0);
        f(guard.as_ref().is_none_or(|m| m.all_resident()))
    }
    /// Waits for the context's queued work. While a stream captures the driver refuses
    /// that (and invalidates the capture), so a drain waits for the captures to end
    /// first: a drop that arrives during a capture is answered when it ends, within
    /// [`crate::capture::CAPTURE_WAIT`]. The idle detector drains with the gate open:
    /// for it a capture in progress is work in progress, and the drain returns after
    /// [`crate::capture::IDLE_PROBE`], which it reads as busy.
    /// [`Self::drain`], waiting at most `limit` for the context's queue (on the
    /// device's drainer lane, which goes on waiting in the background): `Ok(false)`
    /// when it did not finish in time, or a capture did not end within
    /// [`crate::capture::CAPTURE_WAIT`].
    fn drain_within(&self, limit: std::time::Duration) -> Result<bool, CUresult> {
        crate::ffi::inside(|| match AppContext::enter(self.0) {
            Some(_ctx) => {
                let ctx = current_context();
                let app = APP_CTX[self.0].load(Ordering::Acquire);
                let done = std::cell::Cell::new(false);
                let sync = || {
                    let whole = drainer::drain(self.0, ctx, limit)
                        .unwrap_or_else(|| call!(cuCtxSynchronize: fn()()).map(|()| true))?;
                    if whole {
                        synchronize_others(self.0, app)?;
                    }
                    done.set(whole);
                    Ok(())
                };
                match crate::capture::sync_when_quiet(crate::capture::CAPTURE_WAIT, sync) {
                    Err(crate::capture::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED) => Ok(false),
                    r => r.map(|()| done.get()),
                }
            }
            None => Ok(true),
        })
    }
    fn drain(&self) -> Result<(), CUresult> {
        crate::ffi::inside(|| match AppContext::enter(self.0) {
            Some(_ctx) => {
                let probing = crate::gate::GATE.is_open();
                let patience = if probing {
                    crate::capture::IDLE_PROBE
                } else {
                    crate::capture::CAPTURE_WAIT
                };
                let app = APP_CTX[self.0].load(Ordering::Acquire);
                let sync = || {
                    call!(cuCtxSynchronize: fn()())?;
                    synchronize_others(self.0, app)
                };
                match crate::capture::sync_when_quiet(patience, sync) {
                    Err(crate::capture::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED) if probing => Ok(()),
                    r => r,
                }
            }
            None => Ok(()),
        })
    }
}

/// `CUmemAllocationHandleType`: a POSIX file descriptor.
pub(crate) const CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR: c_int = 1;

/// Whether the shim's physical handles are created exportable: 0 untried, 1 yes,
/// 2 the driver refused the POSIX fd type (IPC of shim memory is off).
static EXPORTABLE: AtomicU8 = AtomicU8::new(0);

/// The properties of the shim's physical allocations on `device`: exportable as a
/// POSIX fd unless the driver refused that once.
pub fn alloc_prop(device: CUdevice) -> CUmemAllocationProp {
    let mut p = CUmemAllocationProp::device(device);
    if EXPORTABLE.load(Ordering::Relaxed) != 2 {
        p.requested_handle_types = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    }
    p
}

/// `cuMemCreate` with `prop` failed with `e`: whether to retry without the
/// shareable type (the driver does not support it here; said once).
pub fn create_refused(prop: &CUmemAllocationProp, e: CUresult) -> bool {
    if prop.requested_handle_types == 0
        || !matches!(e, CUDA_ERROR_INVALID_VALUE | CUDA_ERROR_NOT_SUPPORTED)
    {
        return false;
    }
    if EXPORTABLE.swap(2, Ordering::Relaxed) != 2 {
        crate::kwarn!(
            "the driver refuses exportable (POSIX fd) memory (CUDA error {e}): CUDA IPC of the shim's allocations is off"
        );
    }
    true
}

/// A physical handle was created exportable.
pub fn created_exportable() {
    let _ = EXPORTABLE.compare_exchange(0, 1, Ordering::Relaxed, Ordering::Relaxed);
}

/// Whether shim allocations can be shared (`IS_LEGACY_CUDA_IPC_CAPABLE`).
pub fn exportable() -> bool {
    EXPORTABLE.load(Ordering::Relaxed) != 2
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A context's creation cost from NVML's looks: the process's own growth where
    /// NVML lists it; else the least growth among processes that grew (another
    /// newcomer's context made at the same moment is not counted as its own);
    /// capped by the drop in free memory.
    #[test]
    fn a_creation_costs_its_own_processes_growth() {
        let look = |free: u64, procs: &[(u32, u64)]| NvmlLook {
            free: free * MIB,
            procs: Some(procs.iter().map(|&(p, b)| (p, b * MIB)).collect()),
        };
        let before = look(4000, &[(10, 1000)]);
        // Alone: its pid appears with its context.
        let after = look(3700, &[(10, 1000), (42, 300)]);
        assert_eq!(creation_cost(&before, &after, 42), 300 * MIB);
        // Another newcomer's context at the same moment: not its own.
        let after = look(3400, &[(10, 1000), (42, 300), (43, 300)]);
        assert_eq!(creation_cost(&before, &after, 42), 300 * MIB);
        // Listed under another pid (its own pid namespace): the least growth.
        let after = look(3350, &[(10, 1050), (900, 300), (901, 310)]);
        assert_eq!(creation_cost(&before, &after, 42), 50 * MIB);
        let after = look(3700, &[(10, 1000), (900, 300)]);
        assert_eq!(creation_cost(&before, &after, 42), 300 * MIB);
        // No process list: the drop in free memory, as before.
        let bare = |free: u64| NvmlLook {
            free: free * MIB,
            procs: None,
        };
        assert_eq!(creation_cost(&bare(4000), &bare(3400), 42), 600 * MIB);
    }

    const MIB: u64 = 1 << 20;

    /// A try with `ctx` MiB for the twin, others freeing `freed` MiB while it lived
    /// (negative: allocating).
    fn try_(ctx: u64, freed: i64) -> CostTry {
        let before = 1000 * MIB;
        let others = |b: u64| b.saturating_add_signed(freed * MIB as i64);
        CostTry {
            before,
            with_twin: others(before - ctx * MIB),
            after: others(before),
        }
    }

    #[test]
    fn two_calm_tries_that_agree_settle_the_cost() {
        let tries = [try_(300, 128), try_(300, 0), try_(300, 0)];
        assert_eq!(settle_cost(&tries[..2]), Some((300 * MIB, false)));
        assert_eq!(settle_cost(&tries), Some((300 * MIB, true)));
    }

    /// Another process swapping out freed more than the context costs during both
    /// tries: each measured 0, and the two zeros used to agree.
    #[test]
    fn tries_disturbed_by_frees_never_agree_on_a_short_cost() {
        let tries = [try_(300, 320), try_(300, 384)];
        assert_eq!(tries[0].before.saturating_sub(tries[0].with_twin), 0);
        // No calm try: the bound from after the twin, never short.
        assert_eq!(settle_cost(&tries), Some((300 * MIB, false)));
        // Freed half before and half after free memory was read with the twin.
        let split = CostTry {
            before: 1000 * MIB,
            with_twin: (1000 - 300 + 64) * MIB,
            after: (1000 + 128) * MIB,
        };
        assert_eq!(settle_cost(&[split]), Some((364 * MIB, false)));
        // Others allocating meanwhile: measured from before, also never short.
        assert_eq!(settle_cost(&[try_(300, -64)]), Some((364 * MIB, false)));
        let tries = [try_(300, 320), try_(300, 384), try_(300, 0)];
        assert_eq!(settle_cost(&tries), Some((300 * MIB, false)));
    }

    /// Without agreement, the smallest calm try: calm tries are disturbed upward.
    #[test]
    fn without_agreement_the_smallest_calm_try_counts() {
        let tries = [try_(300, -64), try_(310, 0), try_(290, 0)];
        assert_eq!(settle_cost(&tries), Some((290 * MIB, false)));
        assert_eq!(settle_cost(&[]), None);
    }

    /// Another process's twin, made and destroyed between a try's reads, looks calm
    /// and doubles the cost; two such tries agreed, and the GPU was believed full.
    #[test]
    fn calm_tries_doubled_by_anothers_twin_do_not_settle_the_cost() {
        let doubled = try_(600, 0);
        let tries = [doubled, doubled];
        assert_eq!(settle_cost(&tries), Some((600 * MIB, true)));
        let tries = [doubled, try_(300, 0), doubled];
        assert_eq!(settle_cost(&tries), Some((300 * MIB, false)));
        let tries = [doubled, try_(300, 0), doubled, try_(300, 0)];
        assert_eq!(settle_cost(&tries), Some((300 * MIB, true)));
    }

    #[test]
    fn tries_are_spaced_apart_except_the_first() {
        assert_eq!(try_jitter(0), std::time::Duration::ZERO);
        for n in 1..50 {
            let j = try_jitter(n);
            assert!((1000..8000).contains(&(j.as_micros() as u64)), "{j:?}");
        }
    }
}

/// Page-locked host memory for swap buffers: anonymous memory registered with the
/// driver (`cuMemHostRegister`). On an H100 host (driver 580) registering fresh
/// memory in the shim's 64 MiB pieces ran at 3.3 GB/s, `cuMemHostAlloc` at 2.3 GB/s
/// (`docs/gpu-validation.md`). Transparent huge pages registered faster still there
/// (6.1 GB/s alone), but not inside the notebooks (1.6–1.8 GB/s either way), and on
/// this project's VMs faulting them in at times stalled for compaction, which made
/// the timing of pinning ahead unpredictable: not asked for. Registering pages
/// touched before ran at 20–21 GB/s: the cost is populating, which [`pinned::alloc`]
/// does on several threads first.
mod pinned {
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
            let r =
                unsafe { libc::madvise((base + at) as *mut c_void, n, libc::MADV_POPULATE_WRITE) };
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
        // Kiwi rather than to this process's memory limit.
        if let Some(p) = crate::pool::map(size) {
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
        crate::pool::map(size).or_else(|| map(size).map(|p| p.cast()))
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
}
