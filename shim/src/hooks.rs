//! The bodies of the `hook` exports: `cuInit` (start the client), context creation
//! (a device's allocator and turn), the lookups (`cuGetProcAddress`), allocation
//! (served by [`crate::mem`]), memory info, and the application's own VMM handles.
//! Also the real [`Driver`] and the process's allocators, one per device.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::ptr::null_mut;
use std::sync::atomic::{AtomicPtr, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

use crate::client::{self, DeviceInfo, Residency};
use crate::cuda::*;
use crate::exports::{original, wrapper, Sym};
use crate::mem::{Driver, Figures, Memory, Swap};
use crate::procaddr::{resolve, Resolution};

macro_rules! call {
    ($sym:ident : fn($($ty:ty),*) ($($arg:expr),*)) => {{
        let p = original(Sym::$sym);
        if p.is_null() {
            Err(CUDA_ERROR_NOT_FOUND)
        } else {
            // SAFETY: the driver's own symbol of this name, with cuda.h's signature.
            let f = unsafe { std::mem::transmute::<*mut c_void, unsafe extern "C" fn($($ty),*) -> CUresult>(p) };
            // SAFETY: arguments valid per cuda.h (pointers to live locals or buffers).
            match unsafe { f($($arg),*) } {
                CUDA_SUCCESS => Ok(()),
                e => Err(e),
            }
        }
    }};
}

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
        let mut prop = crate::ipc::alloc_prop(self.device);
        let mut h: CUmemGenericAllocationHandle = 0;
        let mut create = |prop: &CUmemAllocationProp| {
            call!(cuMemCreate: fn(*mut CUmemGenericAllocationHandle, usize, *const CUmemAllocationProp, u64)
            (&mut h, size as usize, prop, 0))
        };
        match create(&prop) {
            Err(e) if crate::ipc::create_refused(&prop, e) => {
                prop.requested_handle_types = 0;
                create(&prop)?;
            }
            r => {
                r?;
                if prop.requested_handle_types != 0 {
                    crate::ipc::created_exportable();
                }
            }
        }
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
        let mut p: *mut c_void = null_mut();
        call!(cuMemAllocHost_v2: fn(*mut *mut c_void, usize)(&mut p, size as usize))?;
        Ok(p as *mut u8)
    }
    fn host_free(&self, p: *mut u8) {
        let _ = call!(cuMemFreeHost: fn(*mut c_void)(p as *mut c_void));
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
    // frees during a capture are deferred before they get here, see [`mem_free`]).
    fn sync(&self) -> Result<(), CUresult> {
        if let Some(s) = FREE_STREAM.get() {
            return call!(cuStreamSynchronize: fn(CUstream)(s.handle_for_legacy_entry()));
        }
        crate::capture::sync_unless_capturing(|| call!(cuCtxSynchronize: fn()()))
            .unwrap_or(Err(crate::capture::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED))
    }
}

thread_local! {
    /// The stream a stream-ordered free on this thread waits for ([`mem_free_async`]).
    static FREE_STREAM: std::cell::Cell<Option<crate::capture::StreamArg>> =
        const { std::cell::Cell::new(None) };
}

/// Most device ordinals the shim manages (one allocator and one turn each).
pub const MAX_DEVICES: usize = client::MAX_TURNS;

/// Each device's allocator (created when the process first gets a context or
/// allocates on it).
static MEMS: [Mutex<Option<Memory<RealDriver>>>; MAX_DEVICES] =
    [const { Mutex::new(None) }; MAX_DEVICES];
/// The application's context on each device, made current on the shim's own threads
/// before they swap or drain.
static APP_CTX: [AtomicPtr<c_void>; MAX_DEVICES] =
    [const { AtomicPtr::new(null_mut()) }; MAX_DEVICES];
/// Devices with an allocator (bit per ordinal), so lookups by pointer visit only those.
static DEVICES_SEEN: AtomicU64 = AtomicU64::new(0);
/// Devices whose VMM is unavailable (bit per ordinal): their allocations pass through.
static VMM_UNAVAILABLE: AtomicU64 = AtomicU64::new(0);

fn mem_lock(d: usize) -> MutexGuard<'static, Option<Memory<RealDriver>>> {
    MEMS[d].lock().unwrap_or_else(|p| p.into_inner())
}

/// Ordinals of the devices that have an allocator.
fn seen_devices() -> impl Iterator<Item = usize> {
    let bits = DEVICES_SEEN.load(Ordering::Acquire);
    (0..MAX_DEVICES).filter(move |d| bits & (1 << d) != 0)
}

fn current_context() -> CUcontext {
    let mut ctx: CUcontext = null_mut();
    let _ = call!(cuCtxGetCurrent: fn(*mut CUcontext)(&mut ctx));
    ctx
}

/// The device of the calling thread's current context (where its next launch goes).
pub fn current_device() -> Option<usize> {
    let mut d: CUdevice = 0;
    call!(cuCtxGetDevice: fn(*mut CUdevice)(&mut d)).ok()?;
    usize::try_from(d).ok().filter(|&d| d < MAX_DEVICES)
}

/// Whether every allocation of every device is resident (slow paths only: it takes
/// each allocator's lock).
pub fn all_resident() -> bool {
    seen_devices().all(|d| mem_lock(d).as_ref().is_none_or(|m| m.all_resident()))
}

/// Waits for the work queued on the calling thread's current context: the queue
/// bound ([`crate::gate::QueueBound`]) calls it from the submitting thread, without
/// switching that thread's context.
pub fn synchronize_current() -> Result<(), CUresult> {
    crate::ffi::inside(|| call!(cuCtxSynchronize: fn()()))
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
    })
}

/// Device memory free now, as the driver sees it from the calling thread's context.
fn free_memory() -> Option<u64> {
    let (mut free, mut total) = (0usize, 0usize);
    call!(cuMemGetInfo_v2: fn(*mut usize, *mut usize)(&mut free, &mut total)).ok()?;
    Some(free as u64)
}

/// What a context costs on device `d`, where the application has context `ctx`:
/// the drop in free memory (`cuMemGetInfo`) while the shim holds a context of its own
/// there, made and destroyed at once. Other processes allocating or freeing
/// meanwhile (their own probes, swaps) move free memory too, so it tries until two
/// measurements agree within 1 MiB (at most 6 tries, else their median). The
/// application's own context was made
/// before the shim could look (the CUDA runtime makes its primary context through a
/// private entry point), so its cost is measured on a twin. 0 when it cannot be
/// measured (no room for a second context: the arbiter's reserve then covers it).
fn context_cost(d: usize, ctx: CUcontext) -> u64 {
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
        let mut seen: Vec<u64> = Vec::new();
        let mut agreed = None;
        for _ in 0..6 {
            let Some(before) = free_memory() else { break };
            let mut twin: CUcontext = null_mut();
            if call!(cuCtxCreate_v2: fn(*mut CUcontext, Uint, CUdevice)(&mut twin, 0, d as CUdevice))
                .is_err()
            {
                break;
            }
            let after = free_memory();
            // SAFETY: destroying the context made just above (it pops it: `ctx` is
            // current again).
            unsafe { destroy(twin) };
            let _ = call!(cuCtxSetCurrent: fn(CUcontext)(ctx));
            let Some(after) = after else { break };
            let cost = before.saturating_sub(after);
            if seen.iter().any(|&c| c.abs_diff(cost) <= 1 << 20) {
                agreed = Some(cost);
                break;
            }
            seen.push(cost);
        }
        let _ = call!(cuCtxSetCurrent: fn(CUcontext)(previous));
        seen.sort_unstable();
        let cost = agreed.or_else(|| seen.get(seen.len() / 2).copied());
        let Some(cost) = cost else {
            crate::kinfo!("GPU {d}: could not measure what a context costs; counting none");
            return 0;
        };
        crate::kdebug!(
            "GPU {d}: a context costs {cost} bytes ({} tries)",
            seen.len() + 1
        );
        cost
    })
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
fn ensure_device(d: usize, ctx: CUcontext) -> bool {
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

/// The current context's device, when the shim manages its memory: its allocator
/// (and, managed, its turn) is created on first use. `None`: no context, allocator
/// disabled, VMM unavailable.
fn current_mem_device() -> Option<usize> {
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
fn with_owner<T>(ptr: CUdeviceptr, f: impl FnOnce(&mut Memory<RealDriver>) -> T) -> Option<T> {
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

impl Residency for DeviceResidency {
    fn figures(&self) -> Figures {
        mem_lock(self.0)
            .as_ref()
            .map(|m| m.figures())
            .unwrap_or_default()
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
    }
    // Swap copies run on the legacy stream, which a capture on a blocking stream
    // forbids: they wait for such captures to end (the swap is refused, never forced
    // through a capture, when one outlasts the wait).
    fn swap_in_all(&self) -> Result<Swap, CUresult> {
        if !crate::capture::legacy_usable(crate::capture::CAPTURE_WAIT) {
            return Err(crate::capture::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
        }
        self.with(Ok(Swap::default()), |m| m.swap_in_all())
    }
    fn swap_in_waiting(&self, until: std::time::Instant) -> Result<Swap, CUresult> {
        if !crate::capture::legacy_usable(crate::capture::CAPTURE_WAIT) {
            return Err(crate::capture::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
        }
        self.with(Ok(Swap::default()), |m| m.swap_in_until(Some(until)))
    }
    fn evict(&self, need: u64) -> Result<Swap, CUresult> {
        if !crate::capture::legacy_usable(crate::capture::CAPTURE_WAIT) {
            return Err(crate::capture::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
        }
        self.with(Ok(Swap::default()), |m| m.evict(need))
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
                None => drv.host_free(p),
            }
            done += size;
        }
        Ok(done)
    }
    fn trim_spare_buffers(&self) -> u64 {
        self.with(0, |m| m.release_spares())
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
    fn drain(&self) -> Result<(), CUresult> {
        crate::ffi::inside(|| match AppContext::enter(self.0) {
            Some(_ctx) => {
                let probing = crate::gate::GATE.is_open();
                let patience = if probing {
                    crate::capture::IDLE_PROBE
                } else {
                    crate::capture::CAPTURE_WAIT
                };
                let sync = || call!(cuCtxSynchronize: fn()());
                match crate::capture::sync_when_quiet(patience, sync) {
                    Err(crate::capture::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED) if probing => Ok(()),
                    r => r,
                }
            }
            None => Ok(()),
        })
    }
}

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

/// After the driver made a context on `dev`: the device gets its allocator and turn,
/// so no work on it runs before the process holds it.
fn context_created(r: CUresult, pctx: *mut CUcontext, dev: CUdevice) -> CUresult {
    if r == CUDA_SUCCESS {
        if let Some(d) = usize::try_from(dev).ok().filter(|&d| d < MAX_DEVICES) {
            let ctx = if pctx.is_null() {
                null_mut()
            } else {
                // SAFETY: the driver just wrote the context through the caller's pointer.
                unsafe { *pctx }
            };
            ensure_device(d, ctx);
            // The newest context is the one the shim's threads swap and drain in: an
            // earlier one may have been destroyed (`cuCtxDestroy`) or reset since.
            if !ctx.is_null() {
                APP_CTX[d].store(ctx, Ordering::Release);
            }
        }
    }
    r
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
    context_created(unsafe { real(pctx, dev) }, pctx, dev)
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
    context_created(unsafe { real(pctx, flags, dev) }, pctx, dev)
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
    context_created(
        unsafe { real(pctx, params, num_params, flags, dev) },
        pctx,
        dev,
    )
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
    context_created(unsafe { real(pctx, params, flags, dev) }, pctx, dev)
}

// ---------------------------------------------------------------------------------
// Modules: their code and constants take device memory no swap frees.

/// Each loaded module or library the shim counted: handle → (device, bytes), so an
/// unload gives back exactly what its load added.
static MODULES: Mutex<std::collections::BTreeMap<usize, (usize, u64)>> =
    Mutex::new(std::collections::BTreeMap::new());

fn modules() -> MutexGuard<'static, std::collections::BTreeMap<usize, (usize, u64)>> {
    MODULES.lock().unwrap_or_else(|p| p.into_inner())
}

/// Runs `load`, a module or library load into the calling thread's current context
/// that writes its handle through `handle`, and counts the device memory it took as
/// the process's memory no swap frees on that GPU (reported to the arbiter with the
/// contexts' memory): the drop in free memory around the load, less what this
/// process's own allocator mapped or unmapped meanwhile (both read under the
/// allocator's lock, so a swap of its own never counts). Other processes allocating
/// or freeing during the load can still move the figure; a negative one counts 0.
fn counted_load(handle: *mut *mut c_void, load: impl FnOnce() -> CUresult) -> CUresult {
    let target = current_mem_device()
        .and_then(|d| client::global().and_then(|c| c.turn_for(d)).map(|t| (d, t)));
    let Some((d, turn)) = target else {
        return load();
    };
    let snapshot = || {
        let guard = mem_lock(d);
        let own = guard.as_ref().map_or(0, |m| m.figures().resident);
        free_memory().map(|f| (f, own))
    };
    let before = snapshot();
    let r = load();
    if r != CUDA_SUCCESS || handle.is_null() {
        return r;
    }
    // SAFETY: the driver just wrote the handle through the caller's pointer.
    let h = unsafe { *handle } as usize;
    let bytes = match (before, snapshot()) {
        (Some((free0, own0)), Some((free1, own1))) => {
            let took =
                i128::from(free0) - i128::from(free1) - (i128::from(own1) - i128::from(own0));
            u64::try_from(took.max(0)).unwrap_or(0)
        }
        _ => 0,
    };
    if bytes > 0 {
        crate::kdebug!("GPU {d}: a module load took {bytes} bytes of device memory");
        turn.add_context_bytes(bytes as i64);
    }
    modules().insert(h, (d, bytes));
    r
}

/// Runs `unload` of module or library `h`; on success gives back what its load was
/// counted.
fn counted_unload(h: *mut c_void, unload: impl FnOnce() -> CUresult) -> CUresult {
    let r = unload();
    if r == CUDA_SUCCESS {
        if let Some((d, bytes)) = modules().remove(&(h as usize)) {
            if let Some(t) = client::global().and_then(|c| c.turn_for(d)) {
                t.add_context_bytes(-(bytes as i64));
            }
        }
    }
    r
}

/// # Safety
/// `real` is the driver's original of this entry point; the other arguments are the
/// application's, valid as `cuda.h` documents them.
pub unsafe fn module_load(
    real: Real<unsafe extern "C" fn(*mut *mut c_void, *const c_char) -> CUresult>,
    module: *mut *mut c_void,
    fname: *const c_char,
) -> CUresult {
    // SAFETY: forwarding the caller's arguments.
    counted_load(module, || unsafe { real(module, fname) })
}

/// `cuModuleLoadData` and `cuModuleLoadFatBinary`.
/// # Safety
/// `real` is the driver's original of this entry point; the other arguments are the
/// application's, valid as `cuda.h` documents them.
pub unsafe fn module_load_data(
    real: Real<unsafe extern "C" fn(*mut *mut c_void, *const c_void) -> CUresult>,
    module: *mut *mut c_void,
    image: *const c_void,
) -> CUresult {
    // SAFETY: forwarding the caller's arguments.
    counted_load(module, || unsafe { real(module, image) })
}

/// # Safety
/// `real` is the driver's original of this entry point; the other arguments are the
/// application's, valid as `cuda.h` documents them.
pub unsafe fn module_load_data_ex(
    real: Real<
        unsafe extern "C" fn(
            *mut *mut c_void,
            *const c_void,
            Uint,
            *mut c_int,
            *mut *mut c_void,
        ) -> CUresult,
    >,
    module: *mut *mut c_void,
    image: *const c_void,
    n: Uint,
    options: *mut c_int,
    values: *mut *mut c_void,
) -> CUresult {
    // SAFETY: forwarding the caller's arguments.
    counted_load(module, || unsafe {
        real(module, image, n, options, values)
    })
}

/// `cuModuleUnload` and `cuLibraryUnload`.
/// # Safety
/// `real` is the driver's original of this entry point; the other arguments are the
/// application's, valid as `cuda.h` documents them.
pub unsafe fn module_unload(
    real: Real<unsafe extern "C" fn(*mut c_void) -> CUresult>,
    module: *mut c_void,
) -> CUresult {
    // SAFETY: forwarding the caller's argument.
    counted_unload(module, || unsafe { real(module) })
}

/// `cuLibraryLoadData` (`code`: an image) and `cuLibraryLoadFromFile` (`code`: a
/// file name).
/// # Safety
/// `real` is the driver's original of this entry point; the other arguments are the
/// application's, valid as `cuda.h` documents them.
#[allow(clippy::too_many_arguments)] // cuda.h's signature
pub unsafe fn library_load(
    real: Real<
        unsafe extern "C" fn(
            *mut *mut c_void,
            *const c_void,
            *mut c_int,
            *mut *mut c_void,
            Uint,
            *mut c_int,
            *mut *mut c_void,
            Uint,
        ) -> CUresult,
    >,
    library: *mut *mut c_void,
    code: *const c_void,
    jit_options: *mut c_int,
    jit_values: *mut *mut c_void,
    n_jit: Uint,
    lib_options: *mut c_int,
    lib_values: *mut *mut c_void,
    n_lib: Uint,
) -> CUresult {
    // SAFETY: forwarding the caller's arguments.
    counted_load(library, || unsafe {
        real(
            library,
            code,
            jit_options,
            jit_values,
            n_jit,
            lib_options,
            lib_values,
            n_lib,
        )
    })
}

fn map_proc(symbol: *const c_char, pfn: *mut *mut c_void, flags: u64) {
    if symbol.is_null() || pfn.is_null() {
        return;
    }
    // SAFETY: pfn is the caller's out-pointer, just written by the driver.
    let driver_fn = unsafe { *pfn };
    // SAFETY: the caller passed a NUL-terminated symbol name.
    let name = unsafe { CStr::from_ptr(symbol) }.to_string_lossy();
    crate::real::load();
    if let Resolution::Wrapper(i) = resolve(&name, driver_fn, flags, crate::real::original) {
        crate::stats::PROCADDR_WRAPPED.fetch_add(1, Ordering::Relaxed);
        // SAFETY: as above.
        unsafe { *pfn = wrapper(i) };
    }
}

/// # Safety
/// `real` is the driver's original of this entry point; the other arguments are the
/// application's, valid as `cuda.h` documents them.
pub unsafe fn get_proc_address(
    real: Real<unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64) -> CUresult>,
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    cuda_version: c_int,
    flags: u64,
) -> CUresult {
    // SAFETY: forwarding the caller's arguments.
    let r = unsafe { real(symbol, pfn, cuda_version, flags) };
    if r == CUDA_SUCCESS {
        map_proc(symbol, pfn, flags);
    }
    r
}

/// # Safety
/// `real` is the driver's original of this entry point; the other arguments are the
/// application's, valid as `cuda.h` documents them.
pub unsafe fn get_proc_address_v2(
    real: Real<
        unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64, *mut c_int) -> CUresult,
    >,
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    cuda_version: c_int,
    flags: u64,
    status: *mut c_int,
) -> CUresult {
    // SAFETY: forwarding the caller's arguments.
    let r = unsafe { real(symbol, pfn, cuda_version, flags, status) };
    if r == CUDA_SUCCESS {
        map_proc(symbol, pfn, flags);
    }
    r
}

/// What this process may hold on device `d` (the arbiter's capacity), or no limit
/// when unmanaged.
fn limit_of(d: usize) -> u64 {
    client::global()
        .and_then(|c| c.turn_for(d))
        .map_or(u64::MAX, |t| t.capacity())
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
    let r = match m.alloc(size) {
        Err(CUDA_ERROR_OUT_OF_MEMORY) if m.figures().working_set + size <= limit_of(d) => {
            // Within what this application may use, but the GPU is physically full of
            // others' memory: reserve now, back it at the next turn (the arbiter makes
            // room then).
            m.set_backing_allowed(false);
            let r = m.alloc(size);
            m.set_backing_allowed(true);
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
/// now is usable when the stream gets there); what the shim does not manage goes to the
/// original `cuMemAlloc_v2`.
/// # Safety
/// `dptr` is the application's out-pointer.
unsafe fn alloc_now(dptr: *mut CUdeviceptr, size: usize) -> CUresult {
    let p = original(Sym::cuMemAlloc_v2);
    if p.is_null() {
        return CUDA_ERROR_NOT_FOUND;
    }
    // SAFETY: the original cuMemAlloc_v2, cuda.h's signature.
    let real_alloc = unsafe {
        std::mem::transmute::<*mut c_void, unsafe extern "C" fn(*mut CUdeviceptr, usize) -> CUresult>(
            p,
        )
    };
    // SAFETY: the caller's out-pointer and size.
    unsafe { mem_alloc(real_alloc, dptr, size) }
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
    unsafe { alloc_now(dptr, size) }
}

/// # Safety
/// `real` is the driver's original of this entry point; the other arguments are the
/// application's, valid as `cuda.h` documents them.
pub unsafe fn mem_alloc_from_pool(
    _real: Real<unsafe extern "C" fn(*mut CUdeviceptr, usize, CUmemoryPool, CUstream) -> CUresult>,
    dptr: *mut CUdeviceptr,
    size: usize,
    _pool: CUmemoryPool,
    _stream: CUstream,
) -> CUresult {
    // SAFETY: the caller's arguments; pools are served by the shim's allocator.
    unsafe { alloc_now(dptr, size) }
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
        Ok(()) => CUDA_SUCCESS,
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
        Some(crate::capture::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED) if crate::capture::active() => {
            defer()
        }
        Some(r) => r,
        // SAFETY: forwarding the caller's argument.
        None => unsafe { real(dptr) },
    }
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
    let t = turn.info().total_memory;
    let reserve = t.saturating_sub(turn.capacity());
    let used = turn.figures().working_set;
    // SAFETY: both out-pointers checked non-null.
    unsafe {
        *total = t as usize;
        *free = t.saturating_sub(used).saturating_sub(reserve) as usize;
    }
    CUDA_SUCCESS
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
    let found = seen_devices().find_map(|d| mem_lock(d).as_ref().and_then(|m| m.range_of(dptr)));
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

/// # Safety
/// `real` is the driver's original of this entry point; the other arguments are the
/// application's, valid as `cuda.h` documents them.
pub unsafe fn app_mem_create(
    real: Real<
        unsafe extern "C" fn(
            *mut CUmemGenericAllocationHandle,
            usize,
            *const CUmemAllocationProp,
            u64,
        ) -> CUresult,
    >,
    handle: *mut CUmemGenericAllocationHandle,
    size: usize,
    prop: *const CUmemAllocationProp,
    flags: u64,
) -> CUresult {
    // SAFETY: forwarding the caller's arguments.
    let r = unsafe { real(handle, size, prop, flags) };
    if r == CUDA_SUCCESS && !handle.is_null() && !prop.is_null() {
        // SAFETY: the driver just wrote the handle; prop is the caller's, just read by
        // the driver.
        let (h, loc) = unsafe { (*handle, (*prop).location) };
        let device = (loc.type_ == CU_MEM_LOCATION_TYPE_DEVICE)
            .then(|| usize::try_from(loc.id).ok())
            .flatten()
            .filter(|&d| d < MAX_DEVICES);
        if let Some(d) = device {
            // Counted on the device the memory lives on (its turn must be held to use it).
            if ensure_device(d, current_context()) {
                if let Some(m) = mem_lock(d).as_mut() {
                    m.external_created(h, size as u64);
                    if let Some(t) = client::global().and_then(|c| c.turn_for(d)) {
                        t.claim(&crate::gate::GATE);
                    }
                }
            }
        }
    }
    r
}

/// # Safety
/// `real` is the driver's original of this entry point; the other arguments are the
/// application's, valid as `cuda.h` documents them.
pub unsafe fn app_mem_release(
    real: Real<unsafe extern "C" fn(CUmemGenericAllocationHandle) -> CUresult>,
    handle: CUmemGenericAllocationHandle,
) -> CUresult {
    // SAFETY: forwarding the caller's argument.
    let r = unsafe { real(handle) };
    if r == CUDA_SUCCESS {
        for d in seen_devices() {
            if let Some(m) = mem_lock(d).as_mut() {
                m.external_released(handle);
            }
        }
    }
    r
}
