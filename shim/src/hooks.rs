//! The bodies of the `hook` exports: `cuInit` (start the client), the lookups
//! (`cuGetProcAddress`), allocation (served by [`crate::mem`]), memory info, and the
//! application's own VMM handles. Also the real [`Driver`] and the process's allocator.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::ptr::null_mut;
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::Mutex;

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
        let prop = CUmemAllocationProp::device(self.device);
        let mut h: CUmemGenericAllocationHandle = 0;
        call!(cuMemCreate: fn(*mut CUmemGenericAllocationHandle, usize, *const CUmemAllocationProp, u64)
            (&mut h, size as usize, &prop, 0))?;
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
    fn sync(&self) -> Result<(), CUresult> {
        call!(cuCtxSynchronize: fn()())
    }
}

/// The process's allocator (created at the first allocation, on the device of the
/// current context).
static MEM: Mutex<Option<Memory<RealDriver>>> = Mutex::new(None);
/// The application's context, made current on the shim's own thread before it swaps.
static APP_CTX: AtomicPtr<c_void> = AtomicPtr::new(null_mut());

fn current_context() -> CUcontext {
    let mut ctx: CUcontext = null_mut();
    let _ = call!(cuCtxGetCurrent: fn(*mut CUcontext)(&mut ctx));
    ctx
}

fn current_device() -> Option<CUdevice> {
    let mut d: CUdevice = 0;
    call!(cuCtxGetDevice: fn(*mut CUdevice)(&mut d)).ok()?;
    Some(d)
}

/// Makes the application's context current on this thread (the shim's own thread).
/// Waits for the work queued on the calling thread's current context: the queue
/// bound ([`crate::gate::QueueBound`]) calls it from the submitting thread, without
/// switching that thread's context.
pub fn synchronize_current() -> Result<(), CUresult> {
    crate::ffi::inside(|| call!(cuCtxSynchronize: fn()()))
}

fn enter_app_context() {
    let ctx = APP_CTX.load(Ordering::Acquire);
    if !ctx.is_null() && current_context() != ctx {
        let _ = call!(cuCtxSetCurrent: fn(CUcontext)(ctx));
    }
}

/// Runs `f` on the allocator, creating it on first use. `None` when the shim does not
/// manage this allocation (no context, another device, allocator disabled).
fn with_mem<T>(f: impl FnOnce(&mut Memory<RealDriver>) -> T) -> Option<T> {
    if !client::allocator_enabled() {
        return None;
    }
    let ctx = current_context();
    if ctx.is_null() {
        return None;
    }
    let device = current_device()?;
    let mut guard = MEM.lock().unwrap_or_else(|p| p.into_inner());
    if guard.is_none() {
        let m = match Memory::new(RealDriver { device }) {
            Ok(m) => m,
            Err(e) => {
                crate::kwarn!(
                    "VMM unavailable (CUDA error {e}); allocations pass through unswappable"
                );
                return None;
            }
        };
        *guard = Some(m);
        if let Some(c) = client::global() {
            let mut m = guard.take().expect("just set");
            m.set_limit(c.capacity());
            // Until the first grant, memory is reserved but not backed.
            m.set_backing_allowed(crate::gate::GATE.is_open());
            *guard = Some(m);
        }
        let _ = APP_CTX.compare_exchange(null_mut(), ctx, Ordering::AcqRel, Ordering::Acquire);
    }
    let m = guard.as_mut().expect("allocator exists");
    if m.driver().device != device {
        crate::kdebug!("allocation on device {device}: not managed (the shim manages one GPU)");
        return None;
    }
    Some(f(m))
}

/// [`Residency`] over the process's allocator; drives the driver from the shim's thread.
struct GlobalResidency;

impl GlobalResidency {
    fn with<T>(&self, default: T, f: impl FnOnce(&mut Memory<RealDriver>) -> T) -> T {
        let mut guard = MEM.lock().unwrap_or_else(|p| p.into_inner());
        match guard.as_mut() {
            Some(m) => {
                enter_app_context();
                crate::ffi::inside(|| f(m))
            }
            None => default,
        }
    }
}

impl Residency for GlobalResidency {
    fn figures(&self) -> Figures {
        let guard = MEM.lock().unwrap_or_else(|p| p.into_inner());
        guard.as_ref().map(|m| m.figures()).unwrap_or_default()
    }
    fn set_limit(&self, limit: u64) {
        let mut guard = MEM.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(m) = guard.as_mut() {
            m.set_limit(limit);
        }
    }
    fn set_backing_allowed(&self, allowed: bool) {
        let mut guard = MEM.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(m) = guard.as_mut() {
            m.set_backing_allowed(allowed);
        }
    }
    fn all_resident(&self) -> bool {
        let guard = MEM.lock().unwrap_or_else(|p| p.into_inner());
        guard.as_ref().is_none_or(|m| m.all_resident())
    }
    fn swap_in_all(&self) -> Result<Swap, CUresult> {
        self.with(Ok(Swap::default()), |m| m.swap_in_all())
    }
    fn evict(&self, need: u64) -> Result<Swap, CUresult> {
        self.with(Ok(Swap::default()), |m| m.evict(need))
    }
    fn drain(&self) -> Result<(), CUresult> {
        if APP_CTX.load(Ordering::Acquire).is_null() {
            return Ok(());
        }
        enter_app_context();
        crate::ffi::inside(|| call!(cuCtxSynchronize: fn()()))
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
        let mut dev: CUdevice = 0;
        call!(cuDeviceGet: fn(*mut CUdevice, c_int)(&mut dev, 0))?;
        let mut uuid = CUuuid::default();
        call!(cuDeviceGetUuid_v2: fn(*mut CUuuid, CUdevice)(&mut uuid, dev))
            .or_else(|_| call!(cuDeviceGetUuid: fn(*mut CUuuid, CUdevice)(&mut uuid, dev)))?;
        let mut total: usize = 0;
        call!(cuDeviceTotalMem_v2: fn(*mut usize, CUdevice)(&mut total, dev))?;
        Ok((
            DeviceInfo {
                uuid: format_uuid(&uuid),
                total_memory: total as u64,
            },
            Box::new(GlobalResidency) as Box<dyn Residency>,
        ))
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

/// Allocates through the shim's allocator; `None` = not ours to serve.
fn alloc(size: u64) -> Option<Result<u64, CUresult>> {
    let r = with_mem(|m| match m.alloc(size) {
        Err(CUDA_ERROR_OUT_OF_MEMORY) if m.figures().working_set + size <= limit_of(m) => {
            // Within what this application may use, but the GPU is physically full of
            // others' memory: reserve now, back it at the next turn (the arbiter makes
            // room then).
            m.set_backing_allowed(false);
            let r = m.alloc(size);
            m.set_backing_allowed(true);
            r
        }
        r => r,
    })?;
    if r.is_ok() {
        crate::stats::ALLOCS.fetch_add(1, Ordering::Relaxed);
        // Memory left unbacked while the gate is open must be backed before work runs.
        let resident = with_mem(|m| m.all_resident()).unwrap_or(true);
        if !resident {
            crate::gate::GATE.close();
        }
    }
    Some(r)
}

fn limit_of(m: &Memory<RealDriver>) -> u64 {
    let _ = m;
    client::global().map_or(u64::MAX, |c| c.capacity())
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
    let mut guard = MEM.lock().unwrap_or_else(|p| p.into_inner());
    let m = guard.as_mut()?;
    if !m.owns(ptr) {
        return None;
    }
    Some(match m.free(ptr) {
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
    match free_ours(dptr) {
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
    let ours = {
        let guard = MEM.lock().unwrap_or_else(|p| p.into_inner());
        guard.as_ref().is_some_and(|m| m.owns(dptr))
    };
    if !ours || !client::allocator_enabled() {
        // SAFETY: forwarding the caller's arguments.
        return unsafe { real(dptr, stream) };
    }
    // Stream order: work already queued on the stream may still use the memory.
    if let Err(e) = call!(cuStreamSynchronize: fn(CUstream)(stream)) {
        return e;
    }
    free_ours(dptr).unwrap_or(CUDA_ERROR_INVALID_VALUE)
}

/// # Safety
/// `real` is the driver's original of this entry point; the other arguments are the
/// application's, valid as `cuda.h` documents them.
pub unsafe fn mem_get_info(
    real: Real<unsafe extern "C" fn(*mut usize, *mut usize) -> CUresult>,
    free: *mut usize,
    total: *mut usize,
) -> CUresult {
    let Some(c) = client::global() else {
        // SAFETY: forwarding the caller's arguments.
        return unsafe { real(free, total) };
    };
    if free.is_null() || total.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    let t = c.info().total_memory;
    let reserve = t.saturating_sub(c.capacity());
    let used = c.figures().working_set;
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
    let found = {
        let guard = MEM.lock().unwrap_or_else(|p| p.into_inner());
        guard.as_ref().and_then(|m| m.range_of(dptr))
    };
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
    if r == CUDA_SUCCESS && !handle.is_null() {
        // SAFETY: the driver just wrote the handle.
        let h = unsafe { *handle };
        let _ = with_mem(|m| m.external_created(h, size as u64));
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
        let mut guard = MEM.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(m) = guard.as_mut() {
            m.external_released(handle);
        }
    }
    r
}
