//! What each exported `cu*` entry point does: `api::cuX` is the body of the export
//! `cuX` that `crate::exports` generates from its declaration list (which runs it
//! through `guard`, so no panic crosses the C ABI). Bodies read caller memory only
//! through the `ffi` helpers. A body with a final `pt: bool` serves an export and
//! its `_ptsz`/`_ptds` twin: `pt` is true for the twin, whose NULL stream is the
//! calling thread's per-thread default stream.
#![allow(non_snake_case, clippy::too_many_arguments)]

use std::ffi::{c_char, c_void};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use kiwi_sim_core::{ident, knobs, GRANULARITY};

use crate::abi::*;
use crate::capture;
use crate::driver::{self, driver, Driver};
use crate::exec::{Builtin, Context, Event, EventState, Op, Side, Stream, BUILTINS};
use crate::ffi::{c_str, out, read, write_c_string};
use crate::memop::{self, Api, MemOp, Submitter};
use crate::memory::{Access, HostMap};

/// The driver version the simulator claims (CUDA 12.4).
pub const DRIVER_VERSION: i32 = 12040;

// ---------------------------------------------------------------- init, devices

pub(crate) fn cuInit(flags: u32) -> Result<(), CUresult> {
    if flags != 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let d = driver::init()?;
    // The restore thread of the checkpoint API, once (as the real driver's).
    static STARTED: std::sync::Once = std::sync::Once::new();
    STARTED.call_once(|| crate::checkpoint::start(d));
    Ok(())
}

pub(crate) fn cuDriverGetVersion(v: *mut i32) -> Result<(), CUresult> {
    out(v, DRIVER_VERSION)
}

pub(crate) fn cuDeviceGet(dev: *mut CUdevice, ordinal: i32) -> Result<(), CUresult> {
    let d = driver()?;
    d.device(ordinal)?;
    out(dev, ordinal)
}

pub(crate) fn cuDeviceGetCount(count: *mut i32) -> Result<(), CUresult> {
    out(count, driver()?.gpus as i32)
}

pub(crate) fn cuDeviceGetName(name: *mut c_char, len: i32, dev: CUdevice) -> Result<(), CUresult> {
    driver()?.device(dev)?;
    write_c_string(name, len, ident::DEVICE_NAME)
}

fn device_uuid(uuid: *mut CUuuid, dev: CUdevice) -> Result<(), CUresult> {
    let d = driver()?;
    let g = d.device(dev)?;
    out(
        uuid,
        CUuuid {
            bytes: ident::gpu_uuid(&d.name, g),
        },
    )
}

pub(crate) fn cuDeviceGetUuid(uuid: *mut CUuuid, dev: CUdevice) -> Result<(), CUresult> {
    device_uuid(uuid, dev)
}

pub(crate) fn cuDeviceGetUuid_v2(uuid: *mut CUuuid, dev: CUdevice) -> Result<(), CUresult> {
    device_uuid(uuid, dev)
}

pub(crate) fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: CUdevice) -> Result<(), CUresult> {
    let d = driver()?;
    let g = d.device(dev)?;
    let cap = d
        .machine
        .capacity(g)
        .map_err(|_| CUDA_ERROR_INVALID_DEVICE)?;
    out(bytes, cap as usize)
}

pub(crate) fn attribute_value(d: &Driver, a: i32, g: u32) -> Result<i32, CUresult> {
    use crate::abi::attr::*;
    Ok(match a {
        MAX_THREADS_PER_BLOCK => 1024,
        MAX_BLOCK_DIM_X | MAX_BLOCK_DIM_Y => 1024,
        MAX_BLOCK_DIM_Z => 64,
        MAX_GRID_DIM_X => i32::MAX,
        MAX_GRID_DIM_Y | MAX_GRID_DIM_Z => 65535,
        MAX_SHARED_MEMORY_PER_BLOCK => 48 << 10,
        TOTAL_CONSTANT_MEMORY => 64 << 10,
        WARP_SIZE => 32,
        MAX_PITCH => i32::MAX,
        MAX_REGISTERS_PER_BLOCK | MAX_REGISTERS_PER_MULTIPROCESSOR => 65536,
        CLOCK_RATE => 1_755_000,
        TEXTURE_ALIGNMENT => 512,
        GPU_OVERLAP | CONCURRENT_KERNELS | UNIFIED_ADDRESSING | CAN_MAP_HOST_MEMORY => 1,
        MULTIPROCESSOR_COUNT => 108,
        INTEGRATED | COMPUTE_MODE | ECC_ENABLED | PCI_DOMAIN_ID | PCI_DEVICE_ID => 0,
        PCI_BUS_ID => ident::pci_bus(g) as i32,
        MEMORY_CLOCK_RATE => 1_593_000,
        GLOBAL_MEMORY_BUS_WIDTH => 5120,
        L2_CACHE_SIZE => 40 << 20,
        MAX_THREADS_PER_MULTIPROCESSOR => 2048,
        ASYNC_ENGINE_COUNT => 2,
        COMPUTE_CAPABILITY_MAJOR => 8,
        COMPUTE_CAPABILITY_MINOR => 0,
        STREAM_PRIORITIES_SUPPORTED | COOPERATIVE_LAUNCH | HOST_REGISTER_SUPPORTED => 1,
        MAX_SHARED_MEMORY_PER_MULTIPROCESSOR => 164 << 10,
        MAX_SHARED_MEMORY_PER_BLOCK_OPTIN => 163 << 10,
        VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED | MEMORY_POOLS_SUPPORTED => 1,
        HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED => 1,
        MANAGED_MEMORY | CONCURRENT_MANAGED_ACCESS => 0,
        MAX_BLOCKS_PER_MULTIPROCESSOR => 32,
        // Registered host memory is reached at its host address
        // (`cuMemHostGetDevicePointer` gives the host pointer back).
        CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM => 1,
        // Stream memory operations: the v2 API with 64-bit words, NOR and flushes;
        // the v1 API only with `NVreg_EnableStreamMemOPs=1` (`crate::memop`).
        CAN_USE_64_BIT_STREAM_MEM_OPS | CAN_USE_STREAM_WAIT_VALUE_NOR => 1,
        CAN_FLUSH_REMOTE_WRITES => 1,
        CAN_USE_STREAM_MEM_OPS_V1
        | CAN_USE_64_BIT_STREAM_MEM_OPS_V1
        | CAN_USE_STREAM_WAIT_VALUE_NOR_V1 => i32::from(memop::V1_ENABLED),
        a if a > 0 && a < MAX => {
            let _ = d;
            0
        }
        _ => return Err(CUDA_ERROR_INVALID_VALUE),
    })
}

pub(crate) fn cuDeviceGetAttribute(
    pi: *mut i32,
    attrib: i32,
    dev: CUdevice,
) -> Result<(), CUresult> {
    let d = driver()?;
    let g = d.device(dev)?;
    out(pi, attribute_value(d, attrib, g)?)
}

pub(crate) fn cuDeviceComputeCapability(
    major: *mut i32,
    minor: *mut i32,
    dev: CUdevice,
) -> Result<(), CUresult> {
    driver()?.device(dev)?;
    out(major, 8)?;
    out(minor, 0)
}

pub(crate) fn cuDeviceGetPCIBusId(
    bus: *mut c_char,
    len: i32,
    dev: CUdevice,
) -> Result<(), CUresult> {
    let g = driver()?.device(dev)?;
    // cuda's form has a 4-digit domain: 0000:BB:00.0
    let id = ident::pci_bus_id(g);
    write_c_string(bus, len, &id[4..])
}

pub(crate) fn cuDeviceCanAccessPeer(
    can: *mut i32,
    dev: CUdevice,
    peer: CUdevice,
) -> Result<(), CUresult> {
    let d = driver()?;
    d.device(dev)?;
    d.device(peer)?;
    out(can, 0)
}

// ---------------------------------------------------------------- contexts

/// The primary context of `dev`, created on first use; `retain` counts a reference
/// (`cuDevicePrimaryCtxRetain`), the runtime's private lookup does not.
pub(crate) fn primary_context(
    pctx: *mut CUcontext,
    dev: CUdevice,
    retain: bool,
) -> Result<(), CUresult> {
    let d = driver()?;
    let g = d.device(dev)?;
    if pctx.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let mut p = d.primary[g as usize]
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let ctx = match &p.ctx {
        Some(c) => c.clone(),
        None => {
            // A context costs device memory from its creation on: out of memory
            // when the GPU cannot hold it (Driver API reference,
            // cuDevicePrimaryCtxRetain: CUDA_ERROR_OUT_OF_MEMORY).
            d.charge_context(g)?;
            let c = Context::new(d, g, p.flags, true);
            c.charged.store(true, Ordering::Release);
            d.register_context(&c);
            p.ctx = Some(c.clone());
            c
        }
    };
    if !ctx.charged.load(Ordering::Acquire) {
        // Reset, now activated again: it costs its memory again.
        d.charge_context(g)?;
        ctx.charged.store(true, Ordering::Release);
    }
    if retain {
        p.refs += 1;
    }
    out(pctx, ctx.handle() as CUcontext)
}

pub(crate) fn cuDevicePrimaryCtxRetain(
    pctx: *mut CUcontext,
    dev: CUdevice,
) -> Result<(), CUresult> {
    primary_context(pctx, dev, true)
}

fn primary_release(dev: CUdevice) -> Result<(), CUresult> {
    let d = driver()?;
    let g = d.device(dev)?;
    let mut p = d.primary[g as usize]
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if p.refs == 0 {
        return Err(CUDA_ERROR_INVALID_CONTEXT);
    }
    p.refs -= 1;
    // "The context is automatically reset once the last reference to it is
    // released" (Driver API reference, cuDevicePrimaryCtxRelease): its memory,
    // modules and limits go; the next retain activates the same handle again.
    let last = (p.refs == 0).then(|| p.ctx.clone()).flatten();
    drop(p);
    if let Some(c) = last {
        reset_context(d, g, &c);
    }
    Ok(())
}

pub(crate) fn cuDevicePrimaryCtxRelease_v2(dev: CUdevice) -> Result<(), CUresult> {
    primary_release(dev)
}

pub(crate) fn cuDevicePrimaryCtxRelease(dev: CUdevice) -> Result<(), CUresult> {
    primary_release(dev)
}

fn primary_reset(dev: CUdevice) -> Result<(), CUresult> {
    let d = driver()?;
    let g = d.device(dev)?;
    let ctx = d.primary[g as usize]
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .ctx
        .clone();
    if let Some(c) = ctx {
        reset_context(d, g, &c);
    }
    Ok(())
}

/// A primary context reset (`cuDevicePrimaryCtxReset`, or its last release): its
/// work waited for, its allocations, modules and limits gone, its memory given back
/// until it is activated again (the next retain, or the runtime's lookup).
fn reset_context(d: &Driver, g: u32, c: &Arc<Context>) {
    c.wait_all();
    c.clear_local_storage();
    d.drop_modules_of(c.handle());
    d.mem.free_owned_by(c.handle());
    c.sticky.store(CUDA_SUCCESS, Ordering::Release);
    c.release_limits();
    d.uncharge_context(g, &c.charged);
}

pub(crate) fn cuDevicePrimaryCtxReset_v2(dev: CUdevice) -> Result<(), CUresult> {
    primary_reset(dev)
}

pub(crate) fn cuDevicePrimaryCtxReset(dev: CUdevice) -> Result<(), CUresult> {
    primary_reset(dev)
}

pub(crate) fn cuDevicePrimaryCtxGetState(
    dev: CUdevice,
    flags: *mut u32,
    active: *mut i32,
) -> Result<(), CUresult> {
    let d = driver()?;
    let g = d.device(dev)?;
    let p = d.primary[g as usize]
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    out(flags, p.flags)?;
    out(active, i32::from(p.refs > 0))
}

pub(crate) fn cuDevicePrimaryCtxSetFlags_v2(dev: CUdevice, flags: u32) -> Result<(), CUresult> {
    let d = driver()?;
    let g = d.device(dev)?;
    d.primary[g as usize]
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .flags = flags;
    Ok(())
}

pub(crate) fn cuCtxCreate_v2(
    pctx: *mut CUcontext,
    flags: u32,
    dev: CUdevice,
) -> Result<(), CUresult> {
    let d = driver()?;
    let g = d.device(dev)?;
    if pctx.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    d.charge_context(g)?;
    let c = Context::new(d, g, flags, false);
    c.charged.store(true, Ordering::Release);
    d.register_context(&c);
    out(pctx, c.handle() as CUcontext)?;
    driver::push_current(c);
    Ok(())
}

pub(crate) fn cuCtxDestroy_v2(ctx: CUcontext) -> Result<(), CUresult> {
    let d = driver()?;
    let c = d.context(ctx as usize)?;
    if c.primary {
        return Err(CUDA_ERROR_INVALID_CONTEXT);
    }
    c.wait_all();
    c.clear_local_storage();
    d.drop_modules_of(c.handle());
    c.destroyed.store(true, Ordering::Release);
    d.contexts
        .write()
        .unwrap_or_else(|e| e.into_inner())
        .remove(&(ctx as usize));
    d.streams
        .write()
        .unwrap_or_else(|e| e.into_inner())
        .retain(|_, s| !Arc::ptr_eq(&s.ctx, &c));
    c.shut_down();
    d.mem.free_owned_by(ctx as usize);
    c.release_limits();
    d.uncharge_context(c.device, &c.charged);
    driver::forget_current(ctx as usize);
    Ok(())
}

pub(crate) fn cuCtxSetCurrent(ctx: CUcontext) -> Result<(), CUresult> {
    let d = driver()?;
    if ctx.is_null() {
        driver::set_current(None);
        return Ok(());
    }
    driver::set_current(Some(d.context(ctx as usize)?));
    Ok(())
}

pub(crate) fn cuCtxGetCurrent(pctx: *mut CUcontext) -> Result<(), CUresult> {
    driver()?;
    out(pctx, driver::current_handle() as CUcontext)
}

pub(crate) fn cuCtxPushCurrent_v2(ctx: CUcontext) -> Result<(), CUresult> {
    let c = driver()?.context(ctx as usize)?;
    driver::push_current(c);
    Ok(())
}

pub(crate) fn cuCtxPopCurrent_v2(pctx: *mut CUcontext) -> Result<(), CUresult> {
    driver()?;
    let c = driver::pop_current().ok_or(CUDA_ERROR_INVALID_CONTEXT)?;
    if !pctx.is_null() {
        out(pctx, c.handle() as CUcontext)?;
    }
    Ok(())
}

pub(crate) fn cuCtxSynchronize() -> Result<(), CUresult> {
    let d = driver()?;
    let ctx = driver::current_unchecked()?;
    capture::refuse_context_wide(&ctx)?;
    // Fault injection (KIWI_SIM_FAIL_SYNC): the file's removal arms exactly one
    // failure, without waiting for the queued work.
    if d.fail_sync
        .as_ref()
        .is_some_and(|p| std::fs::remove_file(p).is_ok())
    {
        return Err(CUDA_ERROR_UNKNOWN);
    }
    ctx.synchronize()
}

pub(crate) fn cuCtxGetDevice(dev: *mut CUdevice) -> Result<(), CUresult> {
    driver()?;
    out(dev, driver::current_unchecked()?.device as CUdevice)
}

pub(crate) fn cuCtxGetFlags(flags: *mut u32) -> Result<(), CUresult> {
    driver()?;
    out(flags, driver::current_unchecked()?.flags)
}

pub(crate) fn cuCtxGetApiVersion(ctx: CUcontext, version: *mut u32) -> Result<(), CUresult> {
    let d = driver()?;
    if !ctx.is_null() {
        d.context(ctx as usize)?;
    } else {
        driver::current_unchecked()?;
    }
    out(version, 3020)
}

pub(crate) fn cuCtxGetStreamPriorityRange(
    least: *mut i32,
    greatest: *mut i32,
) -> Result<(), CUresult> {
    driver()?;
    if !least.is_null() {
        out(least, 0)?;
    }
    if !greatest.is_null() {
        out(greatest, -5)?;
    }
    Ok(())
}

pub(crate) fn cuCtxGetLimit(value: *mut usize, limit: u32) -> Result<(), CUresult> {
    driver()?;
    let ctx = driver::current_unchecked()?;
    out(value, ctx.limit(limit)? as usize)
}

pub(crate) fn cuCtxSetLimit(limit: u32, value: usize) -> Result<(), CUresult> {
    driver()?;
    driver::current_unchecked()?.set_limit(limit, value as u64)
}

// ---------------------------------------------------------------- device memory

pub(crate) fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> Result<(), CUresult> {
    let d = driver()?;
    let ctx = driver::current()?;
    let u = d
        .machine
        .usage(ctx.device)
        .map_err(|_| CUDA_ERROR_INVALID_DEVICE)?;
    out(free, u.free() as usize)?;
    out(total, u.capacity as usize)
}

pub(crate) fn cuMemAlloc_v2(dptr: *mut CUdeviceptr, size: usize) -> Result<(), CUresult> {
    let d = driver()?;
    let ctx = driver::current()?;
    capture::refuse_unsafe()?;
    if dptr.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let p = d.mem.alloc_linear(ctx.device, size as u64, ctx.handle())?;
    out(dptr, p)
}

pub(crate) fn cuMemAllocPitch_v2(
    dptr: *mut CUdeviceptr,
    pitch: *mut usize,
    width: usize,
    height: usize,
    elem: u32,
) -> Result<(), CUresult> {
    let d = driver()?;
    let ctx = driver::current()?;
    capture::refuse_unsafe()?;
    if !matches!(elem, 4 | 8 | 16) || width == 0 || height == 0 || pitch.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let p = width.next_multiple_of(512);
    let size = p.checked_mul(height).ok_or(CUDA_ERROR_INVALID_VALUE)?;
    if dptr.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let a = d.mem.alloc_linear(ctx.device, size as u64, ctx.handle())?;
    out(dptr, a)?;
    out(pitch, p)
}

pub(crate) fn cuMemFree_v2(ptr: CUdeviceptr) -> Result<(), CUresult> {
    let d = driver()?;
    if ptr == 0 {
        return Ok(());
    }
    capture::refuse_unsafe()?;
    // Like the real driver, freeing waits for work that may still use it.
    if let Ok(ctx) = driver::current_unchecked() {
        ctx.wait_all();
    }
    d.mem.free_linear(ptr)?;
    crate::pool_usage::note_free(ptr);
    Ok(())
}

pub(crate) fn cuMemGetAddressRange_v2(
    base: *mut CUdeviceptr,
    size: *mut usize,
    ptr: CUdeviceptr,
) -> Result<(), CUresult> {
    let d = driver()?;
    let (b, s) = d.mem.address_range(ptr).ok_or(CUDA_ERROR_NOT_FOUND)?;
    if !base.is_null() {
        out(base, b)?;
    }
    if !size.is_null() {
        out(size, s as usize)?;
    }
    Ok(())
}

fn alloc_async(
    dptr: *mut CUdeviceptr,
    size: usize,
    pool: Option<*mut c_void>,
    stream: CUstream,
    pt: bool,
) -> Result<(), CUresult> {
    let d = driver()?;
    let s = d.stream(stream, pt)?;
    if dptr.is_null() || size == 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let pool = match pool {
        Some(h) => crate::pool::pool(h)?,
        None => crate::pool::current(s.ctx.device)?,
    };
    // Memory is taken at once (so OUT_OF_MEMORY is reported here), on the pool's
    // device; the pointer is usable by work queued after this call, as with a real
    // pool.
    let p = d
        .mem
        .alloc_linear(pool.device, size as u64, s.ctx.handle())?;
    crate::pool::note_alloc(&pool, p, size as u64);
    out(dptr, p)
}

pub(crate) fn cuMemAllocAsync(
    dptr: *mut CUdeviceptr,
    size: usize,
    stream: CUstream,
    pt: bool,
) -> Result<(), CUresult> {
    alloc_async(dptr, size, None, stream, pt)
}

pub(crate) fn cuMemAllocFromPoolAsync(
    dptr: *mut CUdeviceptr,
    size: usize,
    pool: *mut c_void,
    stream: CUstream,
    pt: bool,
) -> Result<(), CUresult> {
    alloc_async(dptr, size, Some(pool), stream, pt)
}

pub(crate) fn cuDeviceGetDefaultMemPool(
    pool: *mut *mut c_void,
    dev: CUdevice,
) -> Result<(), CUresult> {
    crate::pool::get_default(pool, dev)
}

pub(crate) fn cuDeviceGetMemPool(pool: *mut *mut c_void, dev: CUdevice) -> Result<(), CUresult> {
    crate::pool::get_current(pool, dev)
}

pub(crate) fn cuDeviceSetMemPool(dev: CUdevice, pool: *mut c_void) -> Result<(), CUresult> {
    crate::pool::set_current(dev, pool)
}

pub(crate) fn cuMemPoolCreate(
    pool: *mut *mut c_void,
    props: *const crate::pool::CUmemPoolProps,
) -> Result<(), CUresult> {
    crate::pool::create(pool, props)
}

pub(crate) fn cuMemPoolDestroy(pool: *mut c_void) -> Result<(), CUresult> {
    crate::pool::destroy(pool)
}

pub(crate) fn cuMemPoolSetAttribute(
    pool: *mut c_void,
    attr: i32,
    value: *mut c_void,
) -> Result<(), CUresult> {
    crate::pool::set_attribute(pool, attr, value)
}

pub(crate) fn cuMemPoolGetAttribute(
    pool: *mut c_void,
    attr: i32,
    value: *mut c_void,
) -> Result<(), CUresult> {
    crate::pool::get_attribute(pool, attr, value)
}

/// Pools cache nothing here, so there is never anything to trim.
pub(crate) fn cuMemPoolTrimTo(pool: *mut c_void, _keep: usize) -> Result<(), CUresult> {
    crate::pool::pool(pool).map(|_| ())
}

fn free_async(ptr: CUdeviceptr, stream: CUstream, pt: bool) -> Result<(), CUresult> {
    let d = driver()?;
    let s = d.stream(stream, pt)?;
    if !d.mem.is_linear_start(ptr) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    crate::capture::submit(&s.ctx, &s, Op::Free { ptr }).map(|_| ())
}

pub(crate) fn cuMemFreeAsync(ptr: CUdeviceptr, stream: CUstream, pt: bool) -> Result<(), CUresult> {
    free_async(ptr, stream, pt)
}

// ---------------------------------------------------------------- managed memory, pointers

pub(crate) fn cuMemAllocManaged(
    dptr: *mut CUdeviceptr,
    size: usize,
    flags: u32,
) -> Result<(), CUresult> {
    let d = driver()?;
    let ctx = driver::current()?;
    capture::refuse_unsafe()?;
    if dptr.is_null() || !matches!(flags, CU_MEM_ATTACH_GLOBAL | CU_MEM_ATTACH_HOST) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let p = d.mem.alloc_managed(ctx.device, size as u64, ctx.handle())?;
    out(dptr, p)
}

/// A prefetch of managed memory moves its blocks to `device` or the host when its
/// turn in the stream comes (`memory::Phys::migrate`): device memory is taken or
/// given back then.
fn prefetch(ptr: u64, n: usize, device: i32, stream: CUstream, pt: bool) -> Result<(), CUresult> {
    let d = driver()?;
    if device != CU_DEVICE_CPU {
        d.device(device)?;
    }
    match d.mem.pointer_info(ptr) {
        Some(i) if i.managed && ptr + n as u64 <= i.start + i.size => {}
        _ => return Err(CUDA_ERROR_INVALID_VALUE),
    }
    let to = (device != CU_DEVICE_CPU).then_some(device as u32);
    enqueue(
        stream,
        pt,
        Op::Migrate {
            ptr,
            n: n as u64,
            to,
        },
        false,
    )
}

pub(crate) fn cuMemPrefetchAsync(
    ptr: CUdeviceptr,
    n: usize,
    device: CUdevice,
    s: CUstream,
    pt: bool,
) -> Result<(), CUresult> {
    prefetch(ptr, n, device, s, pt)
}

fn location_device(loc: CUmemLocation) -> Result<i32, CUresult> {
    match loc.type_ {
        CU_MEM_LOCATION_TYPE_DEVICE => Ok(loc.id),
        CU_MEM_LOCATION_TYPE_HOST => Ok(CU_DEVICE_CPU),
        _ => Err(CUDA_ERROR_INVALID_VALUE),
    }
}

pub(crate) fn cuMemPrefetchAsync_v2(
    ptr: CUdeviceptr,
    n: usize,
    loc: CUmemLocation,
    _flags: u32,
    s: CUstream,
    pt: bool,
) -> Result<(), CUresult> {
    prefetch(ptr, n, location_device(loc)?, s, pt)
}

/// One pointer attribute of `ptr`; `CUDA_ERROR_INVALID_VALUE` for an address the
/// simulator does not know or an attribute it does not answer.
fn pointer_attribute(
    d: &Driver,
    data: *mut c_void,
    attribute: i32,
    ptr: u64,
) -> Result<(), CUresult> {
    use crate::abi::ptr_attr::*;
    if data.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    if let Some(i) = d.mem.pointer_info(ptr) {
        return match attribute {
            CONTEXT => {
                let ctx = if i.owner != 0 {
                    i.owner
                } else {
                    driver::current_handle()
                };
                out(data.cast::<CUcontext>(), ctx as CUcontext)
            }
            MEMORY_TYPE => out(
                data.cast::<u32>(),
                if i.managed {
                    CU_MEMORYTYPE_UNIFIED
                } else {
                    CU_MEMORYTYPE_DEVICE
                },
            ),
            DEVICE_POINTER => out(data.cast::<u64>(), ptr),
            HOST_POINTER if i.managed => out(data.cast::<u64>(), ptr),
            HOST_POINTER => Err(CUDA_ERROR_INVALID_VALUE),
            BUFFER_ID => out(data.cast::<u64>(), i.start),
            IS_MANAGED => out(data.cast::<i32>(), i32::from(i.managed)),
            DEVICE_ORDINAL => out(data.cast::<i32>(), i.gpu as i32),
            RANGE_START_ADDR => out(data.cast::<u64>(), i.start),
            RANGE_SIZE => out(data.cast::<usize>(), i.size as usize),
            MAPPED => out(data.cast::<i32>(), i32::from(i.mapped)),
            MEMPOOL_HANDLE => out(
                data.cast::<*mut c_void>(),
                crate::pool_usage::pool_of(i.start).unwrap_or(0) as *mut c_void,
            ),
            _ => Err(CUDA_ERROR_INVALID_VALUE),
        };
    }
    // Pinned or registered host memory is visible to the device at its address.
    let (start, len) = d
        .mem
        .host_range(ptr as usize)
        .ok_or(CUDA_ERROR_INVALID_VALUE)?;
    match attribute {
        CONTEXT => out(
            data.cast::<CUcontext>(),
            driver::current_handle() as CUcontext,
        ),
        MEMORY_TYPE => out(data.cast::<u32>(), CU_MEMORYTYPE_HOST),
        DEVICE_POINTER | HOST_POINTER => out(data.cast::<u64>(), ptr),
        IS_MANAGED => out(data.cast::<i32>(), 0),
        DEVICE_ORDINAL => out(
            data.cast::<i32>(),
            driver::current().map(|c| c.device as i32).unwrap_or(0),
        ),
        RANGE_START_ADDR => out(data.cast::<u64>(), start as u64),
        RANGE_SIZE => out(data.cast::<usize>(), len),
        MAPPED => out(data.cast::<i32>(), 1),
        MEMPOOL_HANDLE => out(data.cast::<*mut c_void>(), std::ptr::null_mut()),
        _ => Err(CUDA_ERROR_INVALID_VALUE),
    }
}

pub(crate) fn cuPointerGetAttribute(
    data: *mut c_void,
    attribute: i32,
    ptr: CUdeviceptr,
) -> Result<(), CUresult> {
    pointer_attribute(driver()?, data, attribute, ptr)
}

/// The default an attribute reads for a pointer the driver does not know: "the
/// attributes are assigned default NULL values and CUDA_SUCCESS is returned"
/// (Driver API reference, `cuPointerGetAttributes`), i.e. zero of the attribute's
/// size; the device ordinal reads -2 (no device), as the runtime reports it.
fn unknown_pointer_default(data: *mut c_void, attribute: i32) -> Result<(), CUresult> {
    use crate::abi::ptr_attr::*;
    match attribute {
        CONTEXT | HOST_POINTER | MEMPOOL_HANDLE => out(data.cast::<usize>(), 0),
        MEMORY_TYPE | IS_MANAGED | MAPPED => out(data.cast::<u32>(), 0),
        DEVICE_POINTER | BUFFER_ID | RANGE_START_ADDR => out(data.cast::<u64>(), 0),
        RANGE_SIZE => out(data.cast::<usize>(), 0),
        DEVICE_ORDINAL => out(data.cast::<i32>(), -2),
        _ => Err(CUDA_ERROR_INVALID_VALUE),
    }
}

pub(crate) fn cuPointerGetAttributes(
    n: u32,
    attributes: *const i32,
    data: *mut *mut c_void,
    ptr: CUdeviceptr,
) -> Result<(), CUresult> {
    let d = driver()?;
    if n == 0 || attributes.is_null() || data.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let known = d.mem.pointer_info(ptr).is_some() || d.mem.host_range(ptr as usize).is_some();
    for i in 0..n as usize {
        // SAFETY: the caller passes arrays of `n` attributes and `n` data pointers.
        let (a, slot) = unsafe { (read(attributes.add(i))?, read(data.add(i))?) };
        // An attribute that does not apply (the host pointer of device memory)
        // reads its NULL default here, where cuPointerGetAttribute fails.
        if !known || pointer_attribute(d, slot, a, ptr).is_err() {
            unknown_pointer_default(slot, a)?;
        }
    }
    Ok(())
}

/// `cuIpcGetMemHandle`: only the base of a `cuMemAlloc` allocation can be exported
/// (Driver API reference: "a pointer to the base of an existing device memory
/// allocation created with cuMemAlloc"); VMM mappings (`cuMemCreate`), pool and
/// managed memory, and interior pointers are `CUDA_ERROR_INVALID_VALUE`, as the
/// real driver answers (VMM memory is shared through `cuMemExportToShareableHandle`
/// instead). The handle names this process and the allocation; opening it
/// (`cuIpcOpenMemHandle`) is not simulated: a simulated allocation's bytes live in
/// its own process.
pub(crate) fn cuIpcGetMemHandle(handle: *mut [u8; 64], ptr: CUdeviceptr) -> Result<(), CUresult> {
    let d = driver()?;
    driver::current()?;
    if handle.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let info = d.mem.pointer_info(ptr).ok_or(CUDA_ERROR_INVALID_VALUE)?;
    if !d.mem.is_linear_start(ptr) || info.managed || crate::pool_usage::pool_of(ptr).is_some() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    crate::checkpoint::IPC_EXPORTED.store(true, std::sync::atomic::Ordering::SeqCst);
    let mut h = [0u8; 64];
    h[..8].copy_from_slice(b"KIWISIM\0");
    h[8..12].copy_from_slice(&std::process::id().to_le_bytes());
    h[16..24].copy_from_slice(&ptr.to_le_bytes());
    h[24..32].copy_from_slice(&info.size.to_le_bytes());
    out(handle, h)
}

/// `cuIpcOpenMemHandle` (v1 and `_v2`): opening a legacy IPC handle is not simulated
/// (a `cuMemAlloc` allocation's bytes are private to its process): a valid call is
/// `CUDA_ERROR_NOT_SUPPORTED`, so a program can tell it from a refused handle. VMM
/// memory is shared through `cuMemExportToShareableHandle` instead.
pub(crate) fn cuIpcOpenMemHandle(
    pdptr: *mut CUdeviceptr,
    _handle: CUipcMemHandle,
    flags: u32,
) -> Result<(), CUresult> {
    driver()?;
    driver::current()?;
    if pdptr.is_null() || flags & !CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS != 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    Err(CUDA_ERROR_NOT_SUPPORTED)
}

pub(crate) fn cuIpcOpenMemHandle_v2(
    pdptr: *mut CUdeviceptr,
    handle: CUipcMemHandle,
    flags: u32,
) -> Result<(), CUresult> {
    cuIpcOpenMemHandle(pdptr, handle, flags)
}

/// `cuIpcCloseMemHandle`: nothing is ever opened (above), so no pointer is one.
pub(crate) fn cuIpcCloseMemHandle(_ptr: CUdeviceptr) -> Result<(), CUresult> {
    driver()?;
    driver::current()?;
    Err(CUDA_ERROR_INVALID_VALUE)
}

fn advise(ptr: u64, n: usize, advice: i32, device: i32) -> Result<(), CUresult> {
    let d = driver()?;
    if !(1..=6).contains(&advice) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    if device != CU_DEVICE_CPU {
        d.device(device)?;
    }
    // Advice applies to managed memory (the simulated device has no pageable
    // memory access); it changes nothing here, managed memory being always resident.
    match d.mem.pointer_info(ptr) {
        Some(i) if i.managed && n > 0 && ptr + n as u64 <= i.start + i.size => Ok(()),
        _ => Err(CUDA_ERROR_INVALID_VALUE),
    }
}

pub(crate) fn cuMemAdvise(
    ptr: CUdeviceptr,
    n: usize,
    advice: i32,
    device: CUdevice,
) -> Result<(), CUresult> {
    advise(ptr, n, advice, device)
}

pub(crate) fn cuMemAdvise_v2(
    ptr: CUdeviceptr,
    n: usize,
    advice: i32,
    loc: CUmemLocation,
) -> Result<(), CUresult> {
    advise(ptr, n, advice, location_device(loc)?)
}

// ---------------------------------------------------------------- pinned host memory

/// Makes a call that succeeded take at least `seconds` of wall time since `start`:
/// what the real driver spends page-locking host memory or creating physical
/// memory (knobs `KIWI_SIM_PIN_GBPS`, `KIWI_SIM_MEMCREATE_US_PER_2MIB`). Work the
/// simulator really did (populating pages) counts toward it.
///
/// A sleep, not a spin: the caller sees the latency it would on hardware, while the
/// host's cores (two on CI, shared by every simulated process) stay free for the
/// other processes, which on a real machine would not be slowed down by this one's
/// pinning.
pub(crate) fn take_time(start: std::time::Instant, seconds: f64) {
    if !(seconds.is_finite() && seconds > 0.0) {
        return;
    }
    let want = std::time::Duration::from_secs_f64(seconds);
    let Some(left) = want.checked_sub(start.elapsed()) else {
        return;
    };
    if left >= SLEEP_AT_LEAST {
        std::thread::sleep(left);
        return;
    }
    // A sleep overshoots by the timer slack (50 µs by default): a VMM call's tens
    // of µs are spun instead, as the driver spends them working. Not yielding: on a
    // loaded machine a yield can hand the core away for a whole time slice.
    while start.elapsed() < want {
        std::hint::spin_loop();
    }
}

/// Waits shorter than this spin rather than sleep.
const SLEEP_AT_LEAST: std::time::Duration = std::time::Duration::from_micros(200);

/// Seconds page-locking `bytes` of host memory takes.
fn pin_seconds(d: &Driver, bytes: usize) -> f64 {
    if d.pin_bps > 0.0 {
        bytes as f64 / d.pin_bps
    } else {
        0.0
    }
}

fn host_alloc(pp: *mut *mut c_void, size: usize, map: HostMap) -> Result<(), CUresult> {
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
    d.mem.host_add(p as usize, size, true, map)?;
    out(pp, p)?;
    take_time(start, pin_seconds(d, size));
    Ok(())
}

pub(crate) fn cuMemAllocHost_v2(pp: *mut *mut c_void, size: usize) -> Result<(), CUresult> {
    host_alloc(pp, size, HostMap::default())
}

pub(crate) fn cuMemHostAlloc(
    pp: *mut *mut c_void,
    size: usize,
    flags: u32,
) -> Result<(), CUresult> {
    if flags & !0x7 != 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let map = HostMap {
        device_map: flags & CU_MEMHOST_DEVICEMAP != 0,
        read_only: false,
    };
    host_alloc(pp, size, map)
}

pub(crate) fn cuMemFreeHost(p: *mut c_void) -> Result<(), CUresult> {
    let d = driver()?;
    capture::refuse_unsafe()?;
    let len = d.mem.host_remove(p as usize, true)?;
    // SAFETY: unmapping a mapping host_alloc created with this length.
    unsafe { libc::munmap(p, len) };
    Ok(())
}

pub(crate) fn cuMemHostRegister_v2(
    p: *mut c_void,
    size: usize,
    flags: u32,
) -> Result<(), CUresult> {
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
    d.mem.host_add(p as usize, size, false, map)?;
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
    take_time(start, pin_seconds(d, size - populated) + populated_s);
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

pub(crate) fn cuMemHostUnregister(p: *mut c_void) -> Result<(), CUresult> {
    let d = driver()?;
    capture::refuse_unsafe()?;
    d.mem.host_remove(p as usize, false).map(|_| ())
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
pub(crate) fn cuMemHostGetDevicePointer_v2(
    pdptr: *mut CUdeviceptr,
    p: *mut c_void,
    flags: u32,
) -> Result<(), CUresult> {
    let d = driver()?;
    driver::current()?;
    if pdptr.is_null() || p.is_null() || flags != 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    match d.mem.host_map(p as usize, 1) {
        Some(m) if m.device_map => out(pdptr, p as CUdeviceptr),
        _ => Err(CUDA_ERROR_INVALID_VALUE),
    }
}

// ---------------------------------------------------------------- copies and memsets

/// Validates device ranges at submission: a bad pointer is `CUDA_ERROR_INVALID_VALUE`
/// right away (memory freed or unmapped after submission fails at execution with a
/// sticky `CUDA_ERROR_ILLEGAL_ADDRESS`).
fn check_range(d: &Driver, ptr: u64, n: u64, write: bool) -> Result<(), CUresult> {
    // The copy runs on the current context's device: a VMM mapping must grant it.
    let dev = driver::current_unchecked()?.device;
    d.mem
        .resolve(ptr, n, write, dev)
        .map(|_| ())
        .map_err(|_| CUDA_ERROR_INVALID_VALUE)
}

fn copy_op(d: &Driver, dst: u64, src: u64, n: u64) -> Result<Op, CUresult> {
    let dd = d.mem.is_device_address(dst);
    let sd = d.mem.is_device_address(src);
    if (!dd && dst == 0) || (!sd && src == 0) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    if dd {
        check_range(d, dst, n, true)?;
    }
    if sd {
        check_range(d, src, n, false)?;
    }
    Ok(match (dd, sd) {
        (true, true) => Op::DtoD { dst, src, n },
        (true, false) => Op::HtoD {
            dst,
            src: src as usize,
            n,
        },
        (false, true) => Op::DtoH {
            dst: dst as usize,
            src,
            n,
        },
        (false, false) => Op::HtoH {
            dst: dst as usize,
            src: src as usize,
            n,
        },
    })
}

/// Queues `op` on `stream` and, for synchronous calls, waits for it.
fn enqueue(stream: CUstream, pt: bool, op: Op, sync: bool) -> Result<(), CUresult> {
    let d = driver()?;
    let s = d.stream(stream, pt)?;
    s.ctx.check()?;
    if sync {
        // A synchronous call on a capturing (per-thread) stream; the legacy
        // stream's rule is checked at submission.
        capture::refuse_stream_use(&s)?;
    }
    let seq = crate::capture::submit(&s.ctx, &s, op)?;
    if sync {
        s.ctx.wait_for(s.lane, seq);
        s.ctx.check()?;
    }
    Ok(())
}

fn memcpy(
    dst: u64,
    src: u64,
    n: usize,
    stream: CUstream,
    pt: bool,
    sync: bool,
) -> Result<(), CUresult> {
    let d = driver()?;
    if n == 0 {
        return Ok(());
    }
    let op = copy_op(d, dst, src, n as u64)?;
    enqueue(stream, pt, op, sync)
}

fn htod(
    dst: u64,
    src: *const c_void,
    n: usize,
    stream: CUstream,
    pt: bool,
    sync: bool,
) -> Result<(), CUresult> {
    let d = driver()?;
    if n == 0 {
        return Ok(());
    }
    if src.is_null() || d.mem.is_device_address(src as u64) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    check_range(d, dst, n as u64, true)?;
    let op = Op::HtoD {
        dst,
        src: src as usize,
        n: n as u64,
    };
    enqueue(stream, pt, op, sync)
}

fn dtoh(
    dst: *mut c_void,
    src: u64,
    n: usize,
    stream: CUstream,
    pt: bool,
    sync: bool,
) -> Result<(), CUresult> {
    let d = driver()?;
    if n == 0 {
        return Ok(());
    }
    if dst.is_null() || d.mem.is_device_address(dst as u64) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    check_range(d, src, n as u64, false)?;
    let op = Op::DtoH {
        dst: dst as usize,
        src,
        n: n as u64,
    };
    enqueue(stream, pt, op, sync)
}

fn dtod(
    dst: u64,
    src: u64,
    n: usize,
    stream: CUstream,
    pt: bool,
    sync: bool,
) -> Result<(), CUresult> {
    let d = driver()?;
    if n == 0 {
        return Ok(());
    }
    check_range(d, src, n as u64, false)?;
    check_range(d, dst, n as u64, true)?;
    let op = Op::DtoD {
        dst,
        src,
        n: n as u64,
    };
    enqueue(stream, pt, op, sync)
}

fn memset(
    dst: u64,
    value: u32,
    elem: u8,
    count: usize,
    stream: CUstream,
    pt: bool,
    sync: bool,
) -> Result<(), CUresult> {
    let d = driver()?;
    if count == 0 {
        return Ok(());
    }
    if !dst.is_multiple_of(u64::from(elem)) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let n = (count as u64)
        .checked_mul(u64::from(elem))
        .ok_or(CUDA_ERROR_INVALID_VALUE)?;
    check_range(d, dst, n, true)?;
    let op = Op::Memset {
        dst,
        value,
        elem,
        count: count as u64,
    };
    enqueue(stream, pt, op, sync)
}

const NULL_STREAM: CUstream = std::ptr::null_mut();

pub(crate) fn cuMemcpy(
    dst: CUdeviceptr,
    src: CUdeviceptr,
    n: usize,
    pt: bool,
) -> Result<(), CUresult> {
    memcpy(dst, src, n, NULL_STREAM, pt, true)
}

pub(crate) fn cuMemcpyAsync(
    dst: CUdeviceptr,
    src: CUdeviceptr,
    n: usize,
    s: CUstream,
    pt: bool,
) -> Result<(), CUresult> {
    memcpy(dst, src, n, s, pt, false)
}

pub(crate) fn cuMemcpyHtoD_v2(
    dst: CUdeviceptr,
    src: *const c_void,
    n: usize,
    pt: bool,
) -> Result<(), CUresult> {
    htod(dst, src, n, NULL_STREAM, pt, true)
}

pub(crate) fn cuMemcpyDtoH_v2(
    dst: *mut c_void,
    src: CUdeviceptr,
    n: usize,
    pt: bool,
) -> Result<(), CUresult> {
    dtoh(dst, src, n, NULL_STREAM, pt, true)
}

pub(crate) fn cuMemcpyDtoD_v2(
    dst: CUdeviceptr,
    src: CUdeviceptr,
    n: usize,
    pt: bool,
) -> Result<(), CUresult> {
    dtod(dst, src, n, NULL_STREAM, pt, true)
}

pub(crate) fn cuMemcpyHtoDAsync_v2(
    dst: CUdeviceptr,
    src: *const c_void,
    n: usize,
    s: CUstream,
    pt: bool,
) -> Result<(), CUresult> {
    htod(dst, src, n, s, pt, false)
}

pub(crate) fn cuMemcpyDtoHAsync_v2(
    dst: *mut c_void,
    src: CUdeviceptr,
    n: usize,
    s: CUstream,
    pt: bool,
) -> Result<(), CUresult> {
    dtoh(dst, src, n, s, pt, false)
}

pub(crate) fn cuMemcpyDtoDAsync_v2(
    dst: CUdeviceptr,
    src: CUdeviceptr,
    n: usize,
    s: CUstream,
    pt: bool,
) -> Result<(), CUresult> {
    dtod(dst, src, n, s, pt, false)
}

pub(crate) fn cuMemsetD8_v2(dst: CUdeviceptr, v: u8, n: usize, pt: bool) -> Result<(), CUresult> {
    memset(dst, u32::from(v), 1, n, NULL_STREAM, pt, true)
}

pub(crate) fn cuMemsetD16_v2(dst: CUdeviceptr, v: u16, n: usize, pt: bool) -> Result<(), CUresult> {
    memset(dst, u32::from(v), 2, n, NULL_STREAM, pt, true)
}

pub(crate) fn cuMemsetD32_v2(dst: CUdeviceptr, v: u32, n: usize, pt: bool) -> Result<(), CUresult> {
    memset(dst, v, 4, n, NULL_STREAM, pt, true)
}

pub(crate) fn cuMemsetD8Async(
    dst: CUdeviceptr,
    v: u8,
    n: usize,
    s: CUstream,
    pt: bool,
) -> Result<(), CUresult> {
    memset(dst, u32::from(v), 1, n, s, pt, false)
}

pub(crate) fn cuMemsetD16Async(
    dst: CUdeviceptr,
    v: u16,
    n: usize,
    s: CUstream,
    pt: bool,
) -> Result<(), CUresult> {
    memset(dst, u32::from(v), 2, n, s, pt, false)
}

pub(crate) fn cuMemsetD32Async(
    dst: CUdeviceptr,
    v: u32,
    n: usize,
    s: CUstream,
    pt: bool,
) -> Result<(), CUresult> {
    memset(dst, v, 4, n, s, pt, false)
}

// ---------------------------------------------------------------- 2D copies and memsets

fn side(
    d: &Driver,
    kind: u32,
    host: usize,
    device: u64,
    x: usize,
    y: usize,
    pitch: usize,
) -> Result<Side, CUresult> {
    let (is_dev, base) = match kind {
        CU_MEMORYTYPE_HOST => (false, host as u64),
        CU_MEMORYTYPE_DEVICE => (true, device),
        // Unified addressing: the pointer is in the device field; the address
        // window tells host from device.
        CU_MEMORYTYPE_UNIFIED => (d.mem.is_device_address(device), device),
        CU_MEMORYTYPE_ARRAY => return Err(CUDA_ERROR_NOT_SUPPORTED),
        _ => return Err(CUDA_ERROR_INVALID_VALUE),
    };
    if base == 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let off = (y as u64)
        .checked_mul(pitch as u64)
        .and_then(|o| o.checked_add(x as u64))
        .ok_or(CUDA_ERROR_INVALID_VALUE)?;
    Ok(Side {
        device: is_dev,
        addr: base + off,
        pitch: pitch as u64,
    })
}

/// The bytes a 2D region spans: (height - 1) * pitch + width.
fn span_2d(pitch: u64, width: u64, height: u64) -> Result<u64, CUresult> {
    if height > 1 && pitch < width {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    (height - 1)
        .checked_mul(pitch)
        .and_then(|v| v.checked_add(width))
        .ok_or(CUDA_ERROR_INVALID_VALUE)
}

fn copy_2d(p: *const CudaMemcpy2D, stream: CUstream, pt: bool, sync: bool) -> Result<(), CUresult> {
    let d = driver()?;
    let c = read(p)?;
    let (w, h) = (c.width_in_bytes as u64, c.height as u64);
    let src = side(
        d,
        c.src_memory_type,
        c.src_host as usize,
        c.src_device,
        c.src_x_in_bytes,
        c.src_y,
        c.src_pitch,
    )?;
    let dst = side(
        d,
        c.dst_memory_type,
        c.dst_host as usize,
        c.dst_device,
        c.dst_x_in_bytes,
        c.dst_y,
        c.dst_pitch,
    )?;
    if w == 0 || h == 0 {
        return Ok(());
    }
    for (sd, write) in [(&src, false), (&dst, true)] {
        let span = span_2d(sd.pitch, w, h)?;
        if sd.device {
            check_range(d, sd.addr, span, write)?;
        }
    }
    enqueue(
        stream,
        pt,
        Op::Copy2D {
            src,
            dst,
            width: w,
            height: h,
        },
        sync,
    )
}

pub(crate) fn cuMemcpy2D_v2(p: *const CudaMemcpy2D, pt: bool) -> Result<(), CUresult> {
    copy_2d(p, NULL_STREAM, pt, true)
}

pub(crate) fn cuMemcpy2DUnaligned_v2(p: *const CudaMemcpy2D, pt: bool) -> Result<(), CUresult> {
    copy_2d(p, NULL_STREAM, pt, true)
}

pub(crate) fn cuMemcpy2DAsync_v2(
    p: *const CudaMemcpy2D,
    s: CUstream,
    pt: bool,
) -> Result<(), CUresult> {
    copy_2d(p, s, pt, false)
}

#[allow(clippy::too_many_arguments)]
fn memset_2d(
    dst: u64,
    pitch: usize,
    value: u32,
    elem: u8,
    width: usize,
    height: usize,
    stream: CUstream,
    pt: bool,
    sync: bool,
) -> Result<(), CUresult> {
    let d = driver()?;
    if width == 0 || height == 0 {
        return Ok(());
    }
    if !dst.is_multiple_of(u64::from(elem)) || !(pitch as u64).is_multiple_of(u64::from(elem)) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let row = (width as u64)
        .checked_mul(u64::from(elem))
        .ok_or(CUDA_ERROR_INVALID_VALUE)?;
    let span = span_2d(pitch as u64, row, height as u64)?;
    check_range(d, dst, span, true)?;
    let op = Op::Memset2D {
        dst,
        pitch: pitch as u64,
        value,
        elem,
        width: width as u64,
        height: height as u64,
    };
    enqueue(stream, pt, op, sync)
}

pub(crate) fn cuMemsetD2D8_v2(
    dst: CUdeviceptr,
    pitch: usize,
    v: u8,
    w: usize,
    h: usize,
    pt: bool,
) -> Result<(), CUresult> {
    memset_2d(dst, pitch, u32::from(v), 1, w, h, NULL_STREAM, pt, true)
}

pub(crate) fn cuMemsetD2D16_v2(
    dst: CUdeviceptr,
    pitch: usize,
    v: u16,
    w: usize,
    h: usize,
    pt: bool,
) -> Result<(), CUresult> {
    memset_2d(dst, pitch, u32::from(v), 2, w, h, NULL_STREAM, pt, true)
}

pub(crate) fn cuMemsetD2D32_v2(
    dst: CUdeviceptr,
    pitch: usize,
    v: u32,
    w: usize,
    h: usize,
    pt: bool,
) -> Result<(), CUresult> {
    memset_2d(dst, pitch, v, 4, w, h, NULL_STREAM, pt, true)
}

pub(crate) fn cuMemsetD2D8Async(
    dst: CUdeviceptr,
    pitch: usize,
    v: u8,
    w: usize,
    h: usize,
    s: CUstream,
    pt: bool,
) -> Result<(), CUresult> {
    memset_2d(dst, pitch, u32::from(v), 1, w, h, s, pt, false)
}

pub(crate) fn cuMemsetD2D16Async(
    dst: CUdeviceptr,
    pitch: usize,
    v: u16,
    w: usize,
    h: usize,
    s: CUstream,
    pt: bool,
) -> Result<(), CUresult> {
    memset_2d(dst, pitch, u32::from(v), 2, w, h, s, pt, false)
}

pub(crate) fn cuMemsetD2D32Async(
    dst: CUdeviceptr,
    pitch: usize,
    v: u32,
    w: usize,
    h: usize,
    s: CUstream,
    pt: bool,
) -> Result<(), CUresult> {
    memset_2d(dst, pitch, v, 4, w, h, s, pt, false)
}

// ---------------------------------------------------------------- VMM

fn check_prop(d: &Driver, prop: *const CUmemAllocationProp) -> Result<u32, CUresult> {
    let p = read(prop)?;
    if p.type_ != CU_MEM_ALLOCATION_TYPE_PINNED || p.location.type_ != CU_MEM_LOCATION_TYPE_DEVICE {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    d.device(p.location.id)
        .map_err(|_| CUDA_ERROR_INVALID_DEVICE)
}

pub(crate) fn cuMemGetAllocationGranularity(
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

pub(crate) fn cuMemAddressReserve(
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

pub(crate) fn cuMemAddressFree(ptr: CUdeviceptr, size: usize) -> Result<(), CUresult> {
    driver()?.mem.unreserve(ptr, size as u64)
}

pub(crate) fn cuMemCreate(
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
    let start = std::time::Instant::now();
    let h = d.mem.create(g, size as u64, shareable)?;
    out(handle, h)?;
    // Mostly the call, little per page (KIWI_SIM_MEMCREATE_US, _PER_2MIB).
    take_time(
        start,
        d.memcreate_s + (size as u64 / GRANULARITY) as f64 * d.memcreate_s_per_2mib,
    );
    Ok(())
}

/// Charges a VMM call's measured cost (`kiwi_sim_core::knobs::VMM_*`), when
/// `cuMemCreate`'s is on.
fn vmm_call(d: &Driver, start: std::time::Instant, us: f64) {
    if d.memcreate_s > 0.0 {
        take_time(start, us * 1e-6);
    }
}

/// `cuMemExportToShareableHandle`: the POSIX fd type only (others are
/// `CUDA_ERROR_NOT_SUPPORTED` here), of a handle created asking for it (else
/// `CUDA_ERROR_INVALID_VALUE`); writes a new descriptor (an `int`) the caller owns.
pub(crate) fn cuMemExportToShareableHandle(
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
pub(crate) fn cuMemImportFromShareableHandle(
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

pub(crate) fn cuMemRelease(handle: CUmemGenericAllocationHandle) -> Result<(), CUresult> {
    let start = std::time::Instant::now();
    let d = driver()?;
    let pages = d.mem.release(handle)? / GRANULARITY;
    vmm_call(
        d,
        start,
        knobs::VMM_RELEASE_US + pages as f64 * knobs::VMM_RELEASE_US_PER_2MIB,
    );
    Ok(())
}

pub(crate) fn cuMemMap(
    ptr: CUdeviceptr,
    size: usize,
    offset: usize,
    handle: CUmemGenericAllocationHandle,
    flags: u64,
) -> Result<(), CUresult> {
    let start = std::time::Instant::now();
    let d = driver()?;
    if flags != 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    d.mem.map(ptr, size as u64, offset as u64, handle)?;
    vmm_call(d, start, knobs::VMM_MAP_US);
    Ok(())
}

pub(crate) fn cuMemUnmap(ptr: CUdeviceptr, size: usize) -> Result<(), CUresult> {
    let start = std::time::Instant::now();
    let d = driver()?;
    d.mem.unmap(ptr, size as u64)?;
    vmm_call(d, start, knobs::VMM_UNMAP_US);
    Ok(())
}

pub(crate) fn cuMemSetAccess(
    ptr: CUdeviceptr,
    size: usize,
    desc: *const CUmemAccessDesc,
    count: usize,
) -> Result<(), CUresult> {
    let start = std::time::Instant::now();
    let d = driver()?;
    if desc.is_null() || count == 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // Each descriptor grants one device its access.
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

// ---------------------------------------------------------------- streams and events

fn register_stream(d: &Driver, s: Arc<Stream>) -> usize {
    let h = Arc::as_ptr(&s) as usize;
    d.streams
        .write()
        .unwrap_or_else(|e| e.into_inner())
        .insert(h, s);
    h
}

fn stream_create(ph: *mut CUstream, flags: u32, priority: i32) -> Result<(), CUresult> {
    let d = driver()?;
    let ctx = driver::current()?;
    if ph.is_null() || flags & !CU_STREAM_NON_BLOCKING != 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let s = Arc::new(Stream::new(ctx, flags, priority.clamp(-5, 0)));
    let h = register_stream(d, s);
    out(ph, h as CUstream)
}

pub(crate) fn cuStreamCreate(ph: *mut CUstream, flags: u32) -> Result<(), CUresult> {
    stream_create(ph, flags, 0)
}

pub(crate) fn cuStreamCreateWithPriority(
    ph: *mut CUstream,
    flags: u32,
    priority: i32,
) -> Result<(), CUresult> {
    stream_create(ph, flags, priority)
}

pub(crate) fn cuStreamDestroy_v2(s: CUstream) -> Result<(), CUresult> {
    let d = driver()?;
    // Pending work still completes; the handle is gone at once.
    d.streams
        .write()
        .unwrap_or_else(|e| e.into_inner())
        .remove(&(s as usize))
        .map(|_| ())
        .ok_or(CUDA_ERROR_INVALID_HANDLE)
}

fn stream_sync(s: CUstream, pt: bool) -> Result<(), CUresult> {
    let d = driver()?;
    let legacy = s.is_null() && !pt || s as usize == CU_STREAM_LEGACY;
    let st = d.stream(s, pt)?;
    capture::refuse_stream_wait(&st)?;
    // The legacy stream waits for all work of the blocking streams of the context
    // (its lane, in submission order), not for non-blocking streams.
    let seq = if legacy {
        st.ctx.submitted(st.lane)
    } else {
        st.last_seq.load(Ordering::Acquire)
    };
    st.ctx.wait_for(st.lane, seq);
    st.ctx.check()
}

pub(crate) fn cuStreamSynchronize(s: CUstream, pt: bool) -> Result<(), CUresult> {
    stream_sync(s, pt)
}

fn stream_query(s: CUstream, pt: bool) -> Result<(), CUresult> {
    let d = driver()?;
    let st = d.stream(s, pt)?;
    st.ctx.check()?;
    capture::refuse_stream_wait(&st)?;
    if st.ctx.is_done(st.lane, st.last_seq.load(Ordering::Acquire)) {
        Ok(())
    } else {
        Err(CUDA_ERROR_NOT_READY)
    }
}

pub(crate) fn cuStreamQuery(s: CUstream, pt: bool) -> Result<(), CUresult> {
    stream_query(s, pt)
}

fn stream_wait_event(s: CUstream, e: CUevent, pt: bool) -> Result<(), CUresult> {
    let d = driver()?;
    let st = d.stream(s, pt)?;
    if st.legacy {
        capture::refuse_legacy(&st.ctx)?;
    }
    let ev = d.event(e)?;
    let (ctx, lane, seq) = {
        let g = ev.state.lock().unwrap_or_else(|e| e.into_inner());
        match &g.ctx {
            Some(c) => (c.clone(), g.lane, event_seq(&g, c)),
            None => return Ok(()), // never recorded: nothing to wait for
        }
    };
    if Arc::ptr_eq(&ctx, &st.ctx) && lane == st.lane {
        // Same executor lane: submission order already puts the record first.
        return Ok(());
    }
    crate::capture::submit(&st.ctx, &st, Op::WaitFor { ctx, lane, seq }).map(|_| ())
}

pub(crate) fn cuStreamWaitEvent(
    s: CUstream,
    e: CUevent,
    _flags: u32,
    pt: bool,
) -> Result<(), CUresult> {
    stream_wait_event(s, e, pt)
}

fn add_callback(
    s: CUstream,
    cb: CUstreamCallback,
    data: *mut c_void,
    flags: u32,
    pt: bool,
) -> Result<(), CUresult> {
    let f = cb.ok_or(CUDA_ERROR_INVALID_VALUE)?;
    if flags != 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let d = driver()?;
    let st = d.stream(s, pt)?;
    crate::capture::submit(
        &st.ctx,
        &st,
        Op::Callback {
            f,
            stream: s as usize,
            data: data as usize,
        },
    )
    .map(|_| ())
}

pub(crate) fn cuStreamAddCallback(
    s: CUstream,
    cb: CUstreamCallback,
    data: *mut c_void,
    flags: u32,
    pt: bool,
) -> Result<(), CUresult> {
    add_callback(s, cb, data, flags, pt)
}

pub(crate) fn cuStreamGetFlags(s: CUstream, flags: *mut u32) -> Result<(), CUresult> {
    let st = driver()?.stream(s, false)?;
    // Refused on a capturing stream, and the capture invalidated (capture rule 1,
    // measured on an H100).
    capture::refuse_stream_use(&st)?;
    out(flags, st.flags)
}

pub(crate) fn cuStreamGetPriority(s: CUstream, prio: *mut i32) -> Result<(), CUresult> {
    out(prio, driver()?.stream(s, false)?.priority)
}

pub(crate) fn cuStreamGetCtx(s: CUstream, pctx: *mut CUcontext) -> Result<(), CUresult> {
    let st = driver()?.stream(s, false)?;
    out(pctx, st.ctx.handle() as CUcontext)
}

// ---------------------------------------------------------------- stream memory operations

/// Queues the stream memory operation `build` makes (`crate::memop` checks what it
/// names) on `stream`: captured like any work while the stream captures (a batch
/// memory-operation node). The v1 API is refused first, as by a driver without
/// `NVreg_EnableStreamMemOPs=1` ([`memop::V1_ENABLED`]).
fn memops(
    stream: CUstream,
    pt: bool,
    api: Api,
    build: impl FnOnce(&Driver, Submitter) -> Result<Op, CUresult>,
) -> Result<(), CUresult> {
    let d = driver()?;
    let s = d.stream(stream, pt)?;
    s.ctx.check()?;
    if api == Api::V1 && !memop::V1_ENABLED {
        return Err(CUDA_ERROR_NOT_SUPPORTED);
    }
    let by = Submitter {
        device: s.ctx.device,
        ctx: s.ctx.handle(),
    };
    let op = build(d, by)?;
    capture::submit(&s.ctx, &s, op).map(|_| ())
}

fn wait_value(
    stream: CUstream,
    addr: CUdeviceptr,
    value: u64,
    flags: u32,
    wide: bool,
    pt: bool,
    api: Api,
) -> Result<(), CUresult> {
    memops(stream, pt, api, |d, by| {
        memop::wait(&d.mem, by, addr, value, flags, wide).map(Op::MemOp)
    })
}

fn write_value(
    stream: CUstream,
    addr: CUdeviceptr,
    value: u64,
    flags: u32,
    wide: bool,
    pt: bool,
    api: Api,
) -> Result<(), CUresult> {
    memops(stream, pt, api, |d, by| {
        memop::write(&d.mem, by, addr, value, flags, wide, api).map(Op::MemOp)
    })
}

/// `cuStreamBatchMemOp`: 1 to 255 operations ("Must be less than 256"), `flags` 0;
/// every entry is checked before any is queued, so a refused batch queues nothing.
fn batch_mem_op(
    stream: CUstream,
    count: u32,
    params: *mut CUstreamBatchMemOpParams,
    flags: u32,
    pt: bool,
    api: Api,
) -> Result<(), CUresult> {
    memops(stream, pt, api, |d, by| {
        if params.is_null() || count == 0 || count >= memop::BATCH_LIMIT || flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let ops = (0..count as usize)
            .map(|i| {
                // SAFETY: the caller passes an array of `count` entries.
                let p = read(unsafe { params.add(i) })?;
                memop::batch_entry(&d.mem, by, &p, api)
            })
            .collect::<Result<Vec<MemOp>, CUresult>>()?;
        Ok(Op::MemOps(ops.into()))
    })
}

pub(crate) fn cuStreamWaitValue32(
    s: CUstream,
    addr: CUdeviceptr,
    value: u32,
    flags: u32,
    pt: bool,
) -> Result<(), CUresult> {
    wait_value(s, addr, value.into(), flags, false, pt, Api::V1)
}

pub(crate) fn cuStreamWaitValue32_v2(
    s: CUstream,
    addr: CUdeviceptr,
    value: u32,
    flags: u32,
    pt: bool,
) -> Result<(), CUresult> {
    wait_value(s, addr, value.into(), flags, false, pt, Api::V2)
}

pub(crate) fn cuStreamWaitValue64(
    s: CUstream,
    addr: CUdeviceptr,
    value: u64,
    flags: u32,
    pt: bool,
) -> Result<(), CUresult> {
    wait_value(s, addr, value, flags, true, pt, Api::V1)
}

pub(crate) fn cuStreamWaitValue64_v2(
    s: CUstream,
    addr: CUdeviceptr,
    value: u64,
    flags: u32,
    pt: bool,
) -> Result<(), CUresult> {
    wait_value(s, addr, value, flags, true, pt, Api::V2)
}

pub(crate) fn cuStreamWriteValue32(
    s: CUstream,
    addr: CUdeviceptr,
    value: u32,
    flags: u32,
    pt: bool,
) -> Result<(), CUresult> {
    write_value(s, addr, value.into(), flags, false, pt, Api::V1)
}

pub(crate) fn cuStreamWriteValue32_v2(
    s: CUstream,
    addr: CUdeviceptr,
    value: u32,
    flags: u32,
    pt: bool,
) -> Result<(), CUresult> {
    write_value(s, addr, value.into(), flags, false, pt, Api::V2)
}

pub(crate) fn cuStreamWriteValue64(
    s: CUstream,
    addr: CUdeviceptr,
    value: u64,
    flags: u32,
    pt: bool,
) -> Result<(), CUresult> {
    write_value(s, addr, value, flags, true, pt, Api::V1)
}

pub(crate) fn cuStreamWriteValue64_v2(
    s: CUstream,
    addr: CUdeviceptr,
    value: u64,
    flags: u32,
    pt: bool,
) -> Result<(), CUresult> {
    write_value(s, addr, value, flags, true, pt, Api::V2)
}

pub(crate) fn cuStreamBatchMemOp(
    s: CUstream,
    count: u32,
    params: *mut CUstreamBatchMemOpParams,
    flags: u32,
    pt: bool,
) -> Result<(), CUresult> {
    batch_mem_op(s, count, params, flags, pt, Api::V1)
}

pub(crate) fn cuStreamBatchMemOp_v2(
    s: CUstream,
    count: u32,
    params: *mut CUstreamBatchMemOpParams,
    flags: u32,
    pt: bool,
) -> Result<(), CUresult> {
    batch_mem_op(s, count, params, flags, pt, Api::V2)
}

pub(crate) fn cuEventCreate(ph: *mut CUevent, flags: u32) -> Result<(), CUresult> {
    let d = driver()?;
    driver::current()?;
    if ph.is_null() || flags & !0x7 != 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let e = Arc::new(Event {
        flags,
        state: Mutex::new(EventState::default()),
    });
    let h = Arc::as_ptr(&e) as usize;
    d.events
        .write()
        .unwrap_or_else(|e| e.into_inner())
        .insert(h, e);
    out(ph, h as CUevent)
}

pub(crate) fn cuEventDestroy_v2(e: CUevent) -> Result<(), CUresult> {
    driver()?
        .events
        .write()
        .unwrap_or_else(|e| e.into_inner())
        .remove(&(e as usize))
        .map(|_| ())
        .ok_or(CUDA_ERROR_INVALID_HANDLE)
}

fn event_record(e: CUevent, s: CUstream, pt: bool) -> Result<(), CUresult> {
    let d = driver()?;
    let ev = d.event(e)?;
    let st = d.stream(s, pt)?;
    let capture_id = capture::capture_id(&st);
    // The lock is not held across submission (which may block on a full queue while
    // the executor needs this lock); the generation ties the op to this record.
    let generation = {
        let mut g = ev.state.lock().unwrap_or_else(|e| e.into_inner());
        g.generation += 1;
        g.ctx = Some(st.ctx.clone());
        g.lane = st.lane;
        g.seq = u64::MAX;
        g.time_ns = 0;
        g.capture_id = capture_id;
        g.generation
    };
    let got = crate::capture::submit(
        &st.ctx,
        &st,
        Op::EventRecord {
            event: ev.clone(),
            generation,
        },
    );
    let mut g = ev.state.lock().unwrap_or_else(|e| e.into_inner());
    match got {
        Ok(seq) => {
            if g.generation == generation {
                g.seq = seq;
            }
            Ok(())
        }
        Err(e) => {
            if g.generation == generation {
                g.ctx = None;
            }
            Err(e)
        }
    }
}

/// The sequence an event waits for (a record still being submitted counts as
/// "everything submitted so far").
fn event_seq(g: &EventState, ctx: &Context) -> u64 {
    if g.seq == u64::MAX {
        ctx.submitted(g.lane)
    } else {
        g.seq
    }
}

pub(crate) fn cuEventRecord(e: CUevent, s: CUstream, pt: bool) -> Result<(), CUresult> {
    event_record(e, s, pt)
}

pub(crate) fn cuEventRecordWithFlags(
    e: CUevent,
    s: CUstream,
    _flags: u32,
    pt: bool,
) -> Result<(), CUresult> {
    event_record(e, s, pt)
}

/// The capture rules of querying or synchronizing `ev`: rule 5 when its last record
/// was captured, else rule 4 (it waits for work that is not captured).
fn refuse_event_wait(ev: &Event) -> Result<(), CUresult> {
    if !capture::active() {
        return Ok(());
    }
    let id = ev
        .state
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .capture_id;
    capture::refuse_captured_event(id)?;
    capture::refuse_unsafe()
}

pub(crate) fn cuEventQuery(e: CUevent) -> Result<(), CUresult> {
    let ev = driver()?.event(e)?;
    refuse_event_wait(&ev)?;
    let g = ev.state.lock().unwrap_or_else(|e| e.into_inner());
    match &g.ctx {
        None => Ok(()),
        Some(_) if g.time_ns != 0 => Ok(()),
        Some(c) if c.is_done(g.lane, event_seq(&g, c)) => c.check(),
        Some(_) => Err(CUDA_ERROR_NOT_READY),
    }
}

pub(crate) fn cuEventSynchronize(e: CUevent) -> Result<(), CUresult> {
    let ev = driver()?.event(e)?;
    refuse_event_wait(&ev)?;
    let (ctx, lane, seq) = {
        let g = ev.state.lock().unwrap_or_else(|e| e.into_inner());
        let seq = g.ctx.as_ref().map(|c| event_seq(&g, c)).unwrap_or(0);
        (g.ctx.clone(), g.lane, seq)
    };
    match ctx {
        None => Ok(()),
        Some(c) => {
            c.wait_for(lane, seq);
            c.check()
        }
    }
}

fn elapsed(ms: *mut f32, start: CUevent, end: CUevent) -> Result<(), CUresult> {
    let d = driver()?;
    let (a, b) = (d.event(start)?, d.event(end)?);
    if (a.flags | b.flags) & CU_EVENT_DISABLE_TIMING != 0 {
        return Err(CUDA_ERROR_INVALID_HANDLE);
    }
    let ta = {
        let g = a.state.lock().unwrap_or_else(|e| e.into_inner());
        if g.ctx.is_none() {
            return Err(CUDA_ERROR_INVALID_HANDLE);
        }
        g.time_ns
    };
    let tb = {
        let g = b.state.lock().unwrap_or_else(|e| e.into_inner());
        if g.ctx.is_none() {
            return Err(CUDA_ERROR_INVALID_HANDLE);
        }
        g.time_ns
    };
    if ta == 0 || tb == 0 {
        return Err(CUDA_ERROR_NOT_READY);
    }
    out(ms, (tb as f64 - ta as f64) as f32 / 1e6)
}

pub(crate) fn cuEventElapsedTime(
    ms: *mut f32,
    start: CUevent,
    end: CUevent,
) -> Result<(), CUresult> {
    elapsed(ms, start, end)
}

pub(crate) fn cuEventElapsedTime_v2(
    ms: *mut f32,
    start: CUevent,
    end: CUevent,
) -> Result<(), CUresult> {
    elapsed(ms, start, end)
}

// ---------------------------------------------------------------- graphs (stream capture)

/// The stream a capture call names: the legacy stream cannot be captured; the
/// per-thread stream can (NULL means it through a `_ptsz` entry point).
fn capturable(s: CUstream, pt: bool) -> Result<Arc<Stream>, CUresult> {
    if s as usize == CU_STREAM_LEGACY || s.is_null() && !pt {
        return Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    }
    driver()?.stream(s, pt)
}

fn begin_capture(s: CUstream, mode: u32, pt: bool) -> Result<(), CUresult> {
    capture::begin(&capturable(s, pt)?, mode)
}

pub(crate) fn cuStreamBeginCapture_v2(s: CUstream, mode: u32, pt: bool) -> Result<(), CUresult> {
    begin_capture(s, mode, pt)
}

fn end_capture(s: CUstream, graph: *mut *mut c_void, pt: bool) -> Result<(), CUresult> {
    let d = driver()?;
    if graph.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let st = capturable(s, pt)?;
    let ops = match capture::end(&st) {
        Ok(ops) => ops,
        Err(e) => {
            // An invalidated capture ends with a NULL graph (Driver API reference).
            if e == CUDA_ERROR_STREAM_CAPTURE_INVALIDATED {
                out(graph, std::ptr::null_mut())?;
            }
            return Err(e);
        }
    };
    let g = Arc::new(ops);
    let h = Arc::as_ptr(&g) as usize;
    d.graphs
        .write()
        .unwrap_or_else(|e| e.into_inner())
        .insert(h, g);
    out(graph, h as *mut c_void)
}

pub(crate) fn cuStreamEndCapture(
    s: CUstream,
    graph: *mut *mut c_void,
    pt: bool,
) -> Result<(), CUresult> {
    end_capture(s, graph, pt)
}

fn is_capturing(s: CUstream, status: *mut i32, pt: bool) -> Result<(), CUresult> {
    let st = driver()?.stream(s, pt)?;
    if st.legacy {
        capture::legacy_status_implicit(&st.ctx)?;
    }
    out(status, capture::status(&st).0)
}

pub(crate) fn cuStreamIsCapturing(s: CUstream, status: *mut i32, pt: bool) -> Result<(), CUresult> {
    is_capturing(s, status, pt)
}

#[allow(clippy::too_many_arguments)]
fn capture_info(
    s: CUstream,
    status: *mut i32,
    id: *mut u64,
    graph: *mut *mut c_void,
    deps: *mut *const c_void,
    edges: *mut *const c_void,
    count: *mut usize,
    pt: bool,
) -> Result<(), CUresult> {
    let st = driver()?.stream(s, pt)?;
    if st.legacy {
        capture::legacy_status_implicit(&st.ctx)?;
    }
    capture::info(&st, status, id, graph, deps, edges, count)
}

pub(crate) fn cuStreamGetCaptureInfo(
    s: CUstream,
    status: *mut i32,
    id: *mut u64,
    pt: bool,
) -> Result<(), CUresult> {
    let n = std::ptr::null_mut();
    capture_info(s, status, id, n, n.cast(), n.cast(), n.cast(), pt)
}

pub(crate) fn cuStreamGetCaptureInfo_v2(
    s: CUstream,
    status: *mut i32,
    id: *mut u64,
    graph: *mut *mut c_void,
    deps: *mut *const c_void,
    count: *mut usize,
    pt: bool,
) -> Result<(), CUresult> {
    let n = std::ptr::null_mut();
    capture_info(s, status, id, graph, deps, n, count, pt)
}

pub(crate) fn cuStreamGetCaptureInfo_v3(
    s: CUstream,
    status: *mut i32,
    id: *mut u64,
    graph: *mut *mut c_void,
    deps: *mut *const c_void,
    edges: *mut *const c_void,
    count: *mut usize,
    pt: bool,
) -> Result<(), CUresult> {
    capture_info(s, status, id, graph, deps, edges, count, pt)
}

pub(crate) fn cuThreadExchangeStreamCaptureMode(mode: *mut u32) -> Result<(), CUresult> {
    driver()?;
    capture::exchange_mode(mode)
}

pub(crate) fn cuGraphInstantiateWithFlags(
    exec: *mut *mut c_void,
    graph: *mut c_void,
    _flags: u64,
) -> Result<(), CUresult> {
    let d = driver()?;
    if exec.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let g = d
        .graphs
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .get(&(graph as usize))
        .cloned()
        .ok_or(CUDA_ERROR_INVALID_VALUE)?;
    // An executable graph is a snapshot: later changes to the graph do not
    // reach it (there are none here, graphs are immutable captures).
    let e = Arc::new(g.as_ref().clone());
    let h = Arc::as_ptr(&e) as usize;
    d.graph_execs
        .write()
        .unwrap_or_else(|e| e.into_inner())
        .insert(h, e);
    out(exec, h as *mut c_void)
}

fn graph_exec(exec: *mut c_void) -> Result<Arc<Vec<Op>>, CUresult> {
    driver()?
        .graph_execs
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .get(&(exec as usize))
        .cloned()
        .ok_or(CUDA_ERROR_INVALID_VALUE)
}

/// Replays a graph's operations on `stream`, in capture order.
fn graph_launch(exec: *mut c_void, stream: CUstream, pt: bool) -> Result<(), CUresult> {
    let ops = graph_exec(exec)?;
    let d = driver()?;
    let st = d.stream(stream, pt)?;
    st.ctx.check()?;
    for op in ops.iter() {
        crate::capture::submit(&st.ctx, &st, op.clone())?;
    }
    Ok(())
}

pub(crate) fn cuGraphLaunch(exec: *mut c_void, s: CUstream, pt: bool) -> Result<(), CUresult> {
    graph_launch(exec, s, pt)
}

fn graph_upload(exec: *mut c_void, stream: CUstream, pt: bool) -> Result<(), CUresult> {
    graph_exec(exec)?;
    // Nothing to upload: keeps its place in stream order only.
    enqueue(stream, pt, Op::Nop, false)
}

pub(crate) fn cuGraphUpload(exec: *mut c_void, s: CUstream, pt: bool) -> Result<(), CUresult> {
    graph_upload(exec, s, pt)
}

pub(crate) fn cuGraphExecDestroy(exec: *mut c_void) -> Result<(), CUresult> {
    driver()?
        .graph_execs
        .write()
        .unwrap_or_else(|e| e.into_inner())
        .remove(&(exec as usize))
        .map(|_| ())
        .ok_or(CUDA_ERROR_INVALID_VALUE)
}

pub(crate) fn cuGraphDestroy(graph: *mut c_void) -> Result<(), CUresult> {
    driver()?
        .graphs
        .write()
        .unwrap_or_else(|e| e.into_inner())
        .remove(&(graph as usize))
        .map(|_| ())
        .ok_or(CUDA_ERROR_INVALID_VALUE)
}

// ---------------------------------------------------------------- modules and launches

fn function(f: CUfunction) -> Result<Builtin, CUresult> {
    BUILTINS
        .iter()
        .find(|b| std::ptr::eq(*b as *const Builtin, f as *const Builtin))
        .copied()
        .ok_or(CUDA_ERROR_INVALID_HANDLE)
}

/// Loads a module into the current context. A driver-API load (`charged`) costs the
/// context [`driver::Driver::module_memory`] of device memory until it is unloaded:
/// at once with `CUDA_MODULE_LOADING=EAGER`, else (lazy loading, the driver's default
/// since CUDA 12.2) at the module's first `cuModuleGetFunction`, which loads its
/// kernels. The runtime's private path (`dark_api.rs`) is not charged (a shim cannot
/// see it).
pub(crate) fn module_load(
    m: *mut CUmodule,
    image: *const c_void,
    charged: bool,
) -> Result<(), CUresult> {
    let d = driver()?;
    let ctx = driver::current()?;
    if m.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    if image.is_null() {
        return Err(CUDA_ERROR_INVALID_IMAGE);
    }
    let charge = if charged { d.module_memory } else { 0 };
    // Any image is accepted: entry names resolve to the built-ins.
    let h = d.new_module(ctx.handle(), ctx.device, charge, !driver::eager_loading())?;
    out(m, h as CUmodule)
}

pub(crate) fn cuModuleLoadData(m: *mut CUmodule, image: *const c_void) -> Result<(), CUresult> {
    module_load(m, image, true)
}

pub(crate) fn cuModuleLoadDataEx(
    m: *mut CUmodule,
    image: *const c_void,
    _n: u32,
    _o: *mut i32,
    _v: *mut *mut c_void,
) -> Result<(), CUresult> {
    module_load(m, image, true)
}

pub(crate) fn cuModuleLoad(m: *mut CUmodule, fname: *const c_char) -> Result<(), CUresult> {
    let path = c_str(fname)?;
    if !std::path::Path::new(path).is_file() {
        return Err(CUDA_ERROR_FILE_NOT_FOUND);
    }
    module_load(m, fname.cast(), true)
}

pub(crate) fn cuModuleUnload(m: CUmodule) -> Result<(), CUresult> {
    if driver()?.drop_module(m as usize) {
        Ok(())
    } else {
        Err(CUDA_ERROR_INVALID_HANDLE)
    }
}

pub(crate) fn cuModuleGetFunction(
    f: *mut CUfunction,
    m: CUmodule,
    name: *const c_char,
) -> Result<(), CUresult> {
    let d = driver()?;
    if !d.has_module(m as usize) {
        return Err(CUDA_ERROR_INVALID_HANDLE);
    }
    let name = c_str(name)?;
    let b = BUILTINS
        .iter()
        .find(|b| b.name() == name)
        .ok_or(CUDA_ERROR_NOT_FOUND)?;
    if f.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // Lazy loading: the module's code is loaded (its device memory taken) now.
    d.load_code(m as usize)?;
    out(f, b as *const Builtin as CUfunction)
}

pub(crate) fn cuFuncGetAttribute(pi: *mut i32, attrib: i32, f: CUfunction) -> Result<(), CUresult> {
    driver()?;
    function(f)?;
    if let Some(v) = func_attr_set(f, attrib) {
        return out(pi, v);
    }
    let v = match attrib {
        0 => 1024,   // MAX_THREADS_PER_BLOCK
        4 => 32,     // NUM_REGS
        5 | 6 => 80, // PTX / BINARY version
        9 => -1,     // PREFERRED_SHARED_MEMORY_CARVEOUT: no preference
        1..=8 => 0,
        _ => return Err(CUDA_ERROR_INVALID_VALUE),
    };
    out(pi, v)
}

/// Values set by `cuFuncSetAttribute`, by (function, attribute).
static FUNC_ATTRS: Mutex<Vec<(usize, i32, i32)>> = Mutex::new(Vec::new());

fn func_attr_set(f: CUfunction, attrib: i32) -> Option<i32> {
    FUNC_ATTRS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .find(|(g, a, _)| *g == f as usize && *a == attrib)
        .map(|x| x.2)
}

/// `CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES`, `_PREFERRED_SHARED_MEMORY_CARVEOUT`.
const FUNC_MAX_DYNAMIC_SHARED: i32 = 8;
const FUNC_CARVEOUT: i32 = 9;

pub(crate) fn cuFuncSetAttribute(f: CUfunction, attrib: i32, value: i32) -> Result<(), CUresult> {
    driver()?;
    function(f)?;
    let ok = match attrib {
        // The opt-in maximum minus the built-ins' static shared memory (none).
        FUNC_MAX_DYNAMIC_SHARED => (0..=163 << 10).contains(&value),
        FUNC_CARVEOUT => (-1..=100).contains(&value),
        _ => false,
    };
    if !ok {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let mut v = FUNC_ATTRS.lock().unwrap_or_else(|e| e.into_inner());
    v.retain(|(g, a, _)| !(*g == f as usize && *a == attrib));
    v.push((f as usize, attrib, value));
    Ok(())
}

/// The built-in of kernel handle `k`, asked about device `dev`.
fn kernel_on(k: CUkernel, dev: CUdevice) -> Result<Builtin, CUresult> {
    let d = driver()?;
    if dev < 0 || dev as u32 >= d.gpus {
        return Err(CUDA_ERROR_INVALID_DEVICE);
    }
    crate::library::kernel_kind(k)
}

/// A kernel's attribute on device `dev`: a function's.
pub(crate) fn cuKernelGetAttribute(
    pi: *mut i32,
    attrib: i32,
    k: CUkernel,
    dev: CUdevice,
) -> Result<(), CUresult> {
    cuFuncGetAttribute(pi, attrib, kernel_on(k, dev)?.handle())
}

/// A kernel's attribute for device `dev`: set as a function's (every built-in has
/// the same limits on every device).
pub(crate) fn cuKernelSetAttribute(
    attrib: i32,
    value: i32,
    k: CUkernel,
    dev: CUdevice,
) -> Result<(), CUresult> {
    cuFuncSetAttribute(kernel_on(k, dev)?.handle(), attrib, value)
}

/// `CU_MODULE_LAZY_LOADING` unless `CUDA_MODULE_LOADING=EAGER` (the driver's
/// default since CUDA 12.2).
pub(crate) fn cuModuleGetLoadingMode(mode: *mut u32) -> Result<(), CUresult> {
    driver()?;
    out(mode, if driver::eager_loading() { 1 } else { 2 })
}

/// Reads the kernel's arguments now (as the driver does at launch).
fn kernel_args(
    kind: Builtin,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> Result<[u64; 3], CUresult> {
    let sizes = kind.param_sizes();
    let mut args = [0u64; 3];
    let rd = |p: *const u8, size: usize| -> Result<u64, CUresult> {
        Ok(match size {
            4 => u64::from(read(p.cast::<u32>())?),
            _ => read(p.cast::<u64>())?,
        })
    };
    if !params.is_null() {
        for (i, &sz) in sizes.iter().enumerate() {
            // SAFETY: kernelParams holds one pointer per kernel parameter.
            let p = read(unsafe { params.add(i) })?;
            args[i] = rd(p.cast(), sz)?;
        }
        return Ok(args);
    }
    if extra.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // extra: {CU_LAUNCH_PARAM_BUFFER_POINTER, buf, CU_LAUNCH_PARAM_BUFFER_SIZE, &size, END}
    let (mut buf, mut size) = (std::ptr::null::<u8>(), None);
    let mut i = 0;
    loop {
        // SAFETY: extra is a key/value list terminated by CU_LAUNCH_PARAM_END.
        let key = read(unsafe { extra.add(i) })? as usize;
        match key {
            CU_LAUNCH_PARAM_END => break,
            CU_LAUNCH_PARAM_BUFFER_POINTER => {
                // SAFETY: as above, the value follows its key.
                buf = read(unsafe { extra.add(i + 1) })?.cast();
            }
            CU_LAUNCH_PARAM_BUFFER_SIZE => {
                // SAFETY: as above.
                let sp = read(unsafe { extra.add(i + 1) })?;
                size = Some(read(sp.cast::<usize>())?);
            }
            _ => return Err(CUDA_ERROR_INVALID_VALUE),
        }
        i += 2;
    }
    let size = size.ok_or(CUDA_ERROR_INVALID_VALUE)?;
    let mut off = 0usize;
    for (i, &sz) in sizes.iter().enumerate() {
        off = off.next_multiple_of(sz);
        if off + sz > size || buf.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: within the caller's buffer of `size` bytes (checked above).
        args[i] = rd(unsafe { buf.add(off) }, sz)?;
        off += sz;
    }
    Ok(args)
}

fn launch(
    f: CUfunction,
    grid: [u32; 3],
    block: [u32; 3],
    stream: CUstream,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
    pt: bool,
) -> Result<(), CUresult> {
    let d = driver()?;
    let s = d.stream(stream, pt)?;
    // A `CUkernel` (the runtime's launches) loads its library's code into the
    // stream's context now, with lazy loading: out of memory when it does not fit.
    let kind = match crate::library::launch_kernel(d, f, s.ctx.handle(), s.ctx.device)? {
        Some(kind) => kind,
        None => function(f)?,
    };
    if grid.contains(&0) || block.contains(&0) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    if block.iter().map(|&b| u64::from(b)).product::<u64>() > 1024 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let args = kernel_args(kind, params, extra)?;
    s.ctx.check()?;
    crate::capture::submit(&s.ctx, &s, Op::Kernel { kind, args }).map(|_| ())
}

pub(crate) fn cuLaunchKernel(
    f: CUfunction,
    gx: u32,
    gy: u32,
    gz: u32,
    bx: u32,
    by: u32,
    bz: u32,
    _shmem: u32,
    s: CUstream,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
    pt: bool,
) -> Result<(), CUresult> {
    launch(f, [gx, gy, gz], [bx, by, bz], s, params, extra, pt)
}

pub(crate) fn cuLaunchCooperativeKernel(
    f: CUfunction,
    gx: u32,
    gy: u32,
    gz: u32,
    bx: u32,
    by: u32,
    bz: u32,
    _shmem: u32,
    s: CUstream,
    params: *mut *mut c_void,
    pt: bool,
) -> Result<(), CUresult> {
    launch(
        f,
        [gx, gy, gz],
        [bx, by, bz],
        s,
        params,
        std::ptr::null_mut(),
        pt,
    )
}

fn launch_ex(
    cfg: *const CUlaunchConfig,
    f: CUfunction,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
    pt: bool,
) -> Result<(), CUresult> {
    if cfg.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: a non-NULL config points to a CUlaunchConfig (C API contract).
    let c = unsafe { &*cfg };
    launch(
        f,
        [c.grid_dim_x, c.grid_dim_y, c.grid_dim_z],
        [c.block_dim_x, c.block_dim_y, c.block_dim_z],
        c.h_stream,
        params,
        extra,
        pt,
    )
}

pub(crate) fn cuLaunchKernelEx(
    cfg: *const CUlaunchConfig,
    f: CUfunction,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
    pt: bool,
) -> Result<(), CUresult> {
    launch_ex(cfg, f, params, extra, pt)
}

fn host_func(s: CUstream, f: CUhostFn, data: *mut c_void, pt: bool) -> Result<(), CUresult> {
    let f = f.ok_or(CUDA_ERROR_INVALID_VALUE)?;
    let d = driver()?;
    let st = d.stream(s, pt)?;
    st.ctx.check()?;
    crate::capture::submit(
        &st.ctx,
        &st,
        Op::HostFn {
            f,
            data: data as usize,
        },
    )
    .map(|_| ())
}

pub(crate) fn cuLaunchHostFunc(
    s: CUstream,
    f: CUhostFn,
    data: *mut c_void,
    pt: bool,
) -> Result<(), CUresult> {
    host_func(s, f, data, pt)
}

// ---------------------------------------------------------------- errors, entry points

pub(crate) fn cuGetErrorName(e: CUresult, s: *mut *const c_char) -> Result<(), CUresult> {
    match ERRORS.iter().find(|x| x.0 == e) {
        Some(x) => out(s, x.1.as_ptr()),
        None => {
            let _ = out(s, std::ptr::null());
            Err(CUDA_ERROR_INVALID_VALUE)
        }
    }
}

pub(crate) fn cuGetErrorString(e: CUresult, s: *mut *const c_char) -> Result<(), CUresult> {
    match ERRORS.iter().find(|x| x.0 == e) {
        Some(x) => out(s, x.2.as_ptr()),
        None => {
            let _ = out(s, std::ptr::null());
            Err(CUDA_ERROR_INVALID_VALUE)
        }
    }
}
