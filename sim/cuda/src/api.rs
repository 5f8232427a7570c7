//! The exported `cu*` entry points. Each one runs through [`guard`] (no panic
//! crosses the C ABI) and reads caller memory only through the `ffi` helpers.
//! Stream-taking calls have `_ptsz`/`_ptds` twins whose NULL stream is the calling
//! thread's per-thread default stream.
#![allow(non_snake_case, clippy::too_many_arguments)]

use std::ffi::{c_char, c_void};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use kiwi_sim_core::{ident, GRANULARITY};

use crate::abi::*;
use crate::capture;
use crate::driver::{self, driver, Driver};
use crate::exec::{Builtin, Context, Event, EventState, Op, Side, Stream};
use crate::ffi::{c_str, guard, out, read, write_c_string};
use crate::memory::Access;

/// The driver version the simulator claims (CUDA 12.4).
pub const DRIVER_VERSION: i32 = 12040;

// ---------------------------------------------------------------- init, devices

#[no_mangle]
extern "C" fn cuInit(flags: u32) -> CUresult {
    guard(|| {
        if flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        driver::init().map(|_| ())
    })
}

#[no_mangle]
extern "C" fn cuDriverGetVersion(v: *mut i32) -> CUresult {
    guard(|| out(v, DRIVER_VERSION))
}

#[no_mangle]
extern "C" fn cuDeviceGet(dev: *mut CUdevice, ordinal: i32) -> CUresult {
    guard(|| {
        let d = driver()?;
        d.device(ordinal)?;
        out(dev, ordinal)
    })
}

#[no_mangle]
extern "C" fn cuDeviceGetCount(count: *mut i32) -> CUresult {
    guard(|| out(count, driver()?.gpus as i32))
}

#[no_mangle]
extern "C" fn cuDeviceGetName(name: *mut c_char, len: i32, dev: CUdevice) -> CUresult {
    guard(|| {
        driver()?.device(dev)?;
        write_c_string(name, len, ident::DEVICE_NAME)
    })
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

#[no_mangle]
extern "C" fn cuDeviceGetUuid(uuid: *mut CUuuid, dev: CUdevice) -> CUresult {
    guard(|| device_uuid(uuid, dev))
}

#[no_mangle]
extern "C" fn cuDeviceGetUuid_v2(uuid: *mut CUuuid, dev: CUdevice) -> CUresult {
    guard(|| device_uuid(uuid, dev))
}

#[no_mangle]
extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: CUdevice) -> CUresult {
    guard(|| {
        let d = driver()?;
        let g = d.device(dev)?;
        let cap = d
            .machine
            .capacity(g)
            .map_err(|_| CUDA_ERROR_INVALID_DEVICE)?;
        out(bytes, cap as usize)
    })
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
        MANAGED_MEMORY | CONCURRENT_MANAGED_ACCESS => 0,
        MAX_BLOCKS_PER_MULTIPROCESSOR => 32,
        a if a > 0 && a < MAX => {
            let _ = d;
            0
        }
        _ => return Err(CUDA_ERROR_INVALID_VALUE),
    })
}

#[no_mangle]
extern "C" fn cuDeviceGetAttribute(pi: *mut i32, attrib: i32, dev: CUdevice) -> CUresult {
    guard(|| {
        let d = driver()?;
        let g = d.device(dev)?;
        out(pi, attribute_value(d, attrib, g)?)
    })
}

#[no_mangle]
extern "C" fn cuDeviceComputeCapability(
    major: *mut i32,
    minor: *mut i32,
    dev: CUdevice,
) -> CUresult {
    guard(|| {
        driver()?.device(dev)?;
        out(major, 8)?;
        out(minor, 0)
    })
}

#[no_mangle]
extern "C" fn cuDeviceGetPCIBusId(bus: *mut c_char, len: i32, dev: CUdevice) -> CUresult {
    guard(|| {
        let g = driver()?.device(dev)?;
        // cuda's form has a 4-digit domain: 0000:BB:00.0
        let id = ident::pci_bus_id(g);
        write_c_string(bus, len, &id[4..])
    })
}

#[no_mangle]
extern "C" fn cuDeviceCanAccessPeer(can: *mut i32, dev: CUdevice, peer: CUdevice) -> CUresult {
    guard(|| {
        let d = driver()?;
        d.device(dev)?;
        d.device(peer)?;
        out(can, 0)
    })
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
            let c = Context::new(d, g, p.flags, true);
            d.register_context(&c);
            p.ctx = Some(c.clone());
            c
        }
    };
    if retain {
        p.refs += 1;
    }
    out(pctx, ctx.handle() as CUcontext)
}

#[no_mangle]
extern "C" fn cuDevicePrimaryCtxRetain(pctx: *mut CUcontext, dev: CUdevice) -> CUresult {
    guard(|| primary_context(pctx, dev, true))
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
    // The context (and its memory) stays until reset or exit: a documented
    // simplification; the next retain gets the same context back.
    p.refs -= 1;
    Ok(())
}

#[no_mangle]
extern "C" fn cuDevicePrimaryCtxRelease_v2(dev: CUdevice) -> CUresult {
    guard(|| primary_release(dev))
}

#[no_mangle]
extern "C" fn cuDevicePrimaryCtxRelease(dev: CUdevice) -> CUresult {
    guard(|| primary_release(dev))
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
        c.wait_all();
        c.clear_local_storage();
        d.mem.free_owned_by(c.handle());
        c.sticky.store(CUDA_SUCCESS, Ordering::Release);
    }
    Ok(())
}

#[no_mangle]
extern "C" fn cuDevicePrimaryCtxReset_v2(dev: CUdevice) -> CUresult {
    guard(|| primary_reset(dev))
}

#[no_mangle]
extern "C" fn cuDevicePrimaryCtxReset(dev: CUdevice) -> CUresult {
    guard(|| primary_reset(dev))
}

#[no_mangle]
extern "C" fn cuDevicePrimaryCtxGetState(
    dev: CUdevice,
    flags: *mut u32,
    active: *mut i32,
) -> CUresult {
    guard(|| {
        let d = driver()?;
        let g = d.device(dev)?;
        let p = d.primary[g as usize]
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        out(flags, p.flags)?;
        out(active, i32::from(p.refs > 0))
    })
}

#[no_mangle]
extern "C" fn cuDevicePrimaryCtxSetFlags_v2(dev: CUdevice, flags: u32) -> CUresult {
    guard(|| {
        let d = driver()?;
        let g = d.device(dev)?;
        d.primary[g as usize]
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .flags = flags;
        Ok(())
    })
}

#[no_mangle]
extern "C" fn cuCtxCreate_v2(pctx: *mut CUcontext, flags: u32, dev: CUdevice) -> CUresult {
    guard(|| {
        let d = driver()?;
        let g = d.device(dev)?;
        if pctx.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let c = Context::new(d, g, flags, false);
        d.register_context(&c);
        out(pctx, c.handle() as CUcontext)?;
        driver::push_current(c);
        Ok(())
    })
}

#[no_mangle]
extern "C" fn cuCtxDestroy_v2(ctx: CUcontext) -> CUresult {
    guard(|| {
        let d = driver()?;
        let c = d.context(ctx as usize)?;
        if c.primary {
            return Err(CUDA_ERROR_INVALID_CONTEXT);
        }
        c.wait_all();
        c.clear_local_storage();
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
        driver::forget_current(ctx as usize);
        Ok(())
    })
}

#[no_mangle]
extern "C" fn cuCtxSetCurrent(ctx: CUcontext) -> CUresult {
    guard(|| {
        let d = driver()?;
        if ctx.is_null() {
            driver::set_current(None);
            return Ok(());
        }
        driver::set_current(Some(d.context(ctx as usize)?));
        Ok(())
    })
}

#[no_mangle]
extern "C" fn cuCtxGetCurrent(pctx: *mut CUcontext) -> CUresult {
    guard(|| {
        driver()?;
        out(pctx, driver::current_handle() as CUcontext)
    })
}

#[no_mangle]
extern "C" fn cuCtxPushCurrent_v2(ctx: CUcontext) -> CUresult {
    guard(|| {
        let c = driver()?.context(ctx as usize)?;
        driver::push_current(c);
        Ok(())
    })
}

#[no_mangle]
extern "C" fn cuCtxPopCurrent_v2(pctx: *mut CUcontext) -> CUresult {
    guard(|| {
        driver()?;
        let c = driver::pop_current().ok_or(CUDA_ERROR_INVALID_CONTEXT)?;
        if !pctx.is_null() {
            out(pctx, c.handle() as CUcontext)?;
        }
        Ok(())
    })
}

#[no_mangle]
extern "C" fn cuCtxSynchronize() -> CUresult {
    guard(|| {
        driver()?;
        let ctx = driver::current_unchecked()?;
        capture::refuse_context_wide(&ctx)?;
        ctx.synchronize()
    })
}

#[no_mangle]
extern "C" fn cuCtxGetDevice(dev: *mut CUdevice) -> CUresult {
    guard(|| {
        driver()?;
        out(dev, driver::current_unchecked()?.device as CUdevice)
    })
}

#[no_mangle]
extern "C" fn cuCtxGetFlags(flags: *mut u32) -> CUresult {
    guard(|| {
        driver()?;
        out(flags, driver::current_unchecked()?.flags)
    })
}

#[no_mangle]
extern "C" fn cuCtxGetApiVersion(ctx: CUcontext, version: *mut u32) -> CUresult {
    guard(|| {
        let d = driver()?;
        if !ctx.is_null() {
            d.context(ctx as usize)?;
        } else {
            driver::current_unchecked()?;
        }
        out(version, 3020)
    })
}

#[no_mangle]
extern "C" fn cuCtxGetStreamPriorityRange(least: *mut i32, greatest: *mut i32) -> CUresult {
    guard(|| {
        driver()?;
        if !least.is_null() {
            out(least, 0)?;
        }
        if !greatest.is_null() {
            out(greatest, -5)?;
        }
        Ok(())
    })
}

#[no_mangle]
extern "C" fn cuCtxGetLimit(value: *mut usize, limit: u32) -> CUresult {
    guard(|| {
        driver()?;
        let ctx = driver::current_unchecked()?;
        out(value, ctx.limit(limit)? as usize)
    })
}

#[no_mangle]
extern "C" fn cuCtxSetLimit(limit: u32, value: usize) -> CUresult {
    guard(|| {
        driver()?;
        driver::current_unchecked()?.set_limit(limit, value as u64)
    })
}

// ---------------------------------------------------------------- device memory

#[no_mangle]
extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CUresult {
    guard(|| {
        let d = driver()?;
        let ctx = driver::current()?;
        let u = d
            .machine
            .usage(ctx.device)
            .map_err(|_| CUDA_ERROR_INVALID_DEVICE)?;
        out(free, u.free() as usize)?;
        out(total, u.capacity as usize)
    })
}

#[no_mangle]
extern "C" fn cuMemAlloc_v2(dptr: *mut CUdeviceptr, size: usize) -> CUresult {
    guard(|| {
        let d = driver()?;
        let ctx = driver::current()?;
        capture::refuse_unsafe()?;
        if dptr.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let p = d.mem.alloc_linear(ctx.device, size as u64, ctx.handle())?;
        out(dptr, p)
    })
}

#[no_mangle]
extern "C" fn cuMemAllocPitch_v2(
    dptr: *mut CUdeviceptr,
    pitch: *mut usize,
    width: usize,
    height: usize,
    elem: u32,
) -> CUresult {
    guard(|| {
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
    })
}

#[no_mangle]
extern "C" fn cuMemFree_v2(ptr: CUdeviceptr) -> CUresult {
    guard(|| {
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
        crate::pool::note_free(ptr);
        Ok(())
    })
}

#[no_mangle]
extern "C" fn cuMemGetAddressRange_v2(
    base: *mut CUdeviceptr,
    size: *mut usize,
    ptr: CUdeviceptr,
) -> CUresult {
    guard(|| {
        let d = driver()?;
        let (b, s) = d.mem.address_range(ptr).ok_or(CUDA_ERROR_NOT_FOUND)?;
        if !base.is_null() {
            out(base, b)?;
        }
        if !size.is_null() {
            out(size, s as usize)?;
        }
        Ok(())
    })
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

#[no_mangle]
extern "C" fn cuMemAllocAsync(dptr: *mut CUdeviceptr, size: usize, stream: CUstream) -> CUresult {
    guard(|| alloc_async(dptr, size, None, stream, false))
}

#[no_mangle]
extern "C" fn cuMemAllocAsync_ptsz(
    dptr: *mut CUdeviceptr,
    size: usize,
    stream: CUstream,
) -> CUresult {
    guard(|| alloc_async(dptr, size, None, stream, true))
}

#[no_mangle]
extern "C" fn cuMemAllocFromPoolAsync(
    dptr: *mut CUdeviceptr,
    size: usize,
    pool: *mut c_void,
    stream: CUstream,
) -> CUresult {
    guard(|| alloc_async(dptr, size, Some(pool), stream, false))
}

#[no_mangle]
extern "C" fn cuMemAllocFromPoolAsync_ptsz(
    dptr: *mut CUdeviceptr,
    size: usize,
    pool: *mut c_void,
    stream: CUstream,
) -> CUresult {
    guard(|| alloc_async(dptr, size, Some(pool), stream, true))
}

#[no_mangle]
extern "C" fn cuDeviceGetDefaultMemPool(pool: *mut *mut c_void, dev: CUdevice) -> CUresult {
    guard(|| crate::pool::get_default(pool, dev))
}

#[no_mangle]
extern "C" fn cuDeviceGetMemPool(pool: *mut *mut c_void, dev: CUdevice) -> CUresult {
    guard(|| crate::pool::get_current(pool, dev))
}

#[no_mangle]
extern "C" fn cuDeviceSetMemPool(dev: CUdevice, pool: *mut c_void) -> CUresult {
    guard(|| crate::pool::set_current(dev, pool))
}

#[no_mangle]
extern "C" fn cuMemPoolCreate(
    pool: *mut *mut c_void,
    props: *const crate::pool::CUmemPoolProps,
) -> CUresult {
    guard(|| crate::pool::create(pool, props))
}

#[no_mangle]
extern "C" fn cuMemPoolDestroy(pool: *mut c_void) -> CUresult {
    guard(|| crate::pool::destroy(pool))
}

#[no_mangle]
extern "C" fn cuMemPoolSetAttribute(pool: *mut c_void, attr: i32, value: *mut c_void) -> CUresult {
    guard(|| crate::pool::set_attribute(pool, attr, value))
}

#[no_mangle]
extern "C" fn cuMemPoolGetAttribute(pool: *mut c_void, attr: i32, value: *mut c_void) -> CUresult {
    guard(|| crate::pool::get_attribute(pool, attr, value))
}

/// Pools cache nothing here, so there is never anything to trim.
#[no_mangle]
extern "C" fn cuMemPoolTrimTo(pool: *mut c_void, _keep: usize) -> CUresult {
    guard(|| crate::pool::pool(pool).map(|_| ()))
}

fn free_async(ptr: CUdeviceptr, stream: CUstream, pt: bool) -> Result<(), CUresult> {
    let d = driver()?;
    let s = d.stream(stream, pt)?;
    if !d.mem.is_linear_start(ptr) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    s.ctx.submit(&s, Op::Free { ptr }).map(|_| ())
}

#[no_mangle]
extern "C" fn cuMemFreeAsync(ptr: CUdeviceptr, stream: CUstream) -> CUresult {
    guard(|| free_async(ptr, stream, false))
}

#[no_mangle]
extern "C" fn cuMemFreeAsync_ptsz(ptr: CUdeviceptr, stream: CUstream) -> CUresult {
    guard(|| free_async(ptr, stream, true))
}

// ---------------------------------------------------------------- managed memory, pointers

#[no_mangle]
extern "C" fn cuMemAllocManaged(dptr: *mut CUdeviceptr, size: usize, flags: u32) -> CUresult {
    guard(|| {
        let d = driver()?;
        let ctx = driver::current()?;
        capture::refuse_unsafe()?;
        if dptr.is_null() || !matches!(flags, CU_MEM_ATTACH_GLOBAL | CU_MEM_ATTACH_HOST) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let p = d.mem.alloc_managed(ctx.device, size as u64, ctx.handle())?;
        out(dptr, p)
    })
}

/// Managed memory is always resident in the simulator: a prefetch only checks its
/// arguments and keeps its place in stream order.
fn prefetch(ptr: u64, n: usize, device: i32, stream: CUstream, pt: bool) -> Result<(), CUresult> {
    let d = driver()?;
    if device != CU_DEVICE_CPU {
        d.device(device)?;
    }
    match d.mem.pointer_info(ptr) {
        Some(i) if i.managed && ptr + n as u64 <= i.start + i.size => {}
        _ => return Err(CUDA_ERROR_INVALID_VALUE),
    }
    enqueue(stream, pt, Op::Nop, false)
}

#[no_mangle]
extern "C" fn cuMemPrefetchAsync(
    ptr: CUdeviceptr,
    n: usize,
    device: CUdevice,
    s: CUstream,
) -> CUresult {
    guard(|| prefetch(ptr, n, device, s, false))
}
#[no_mangle]
extern "C" fn cuMemPrefetchAsync_ptsz(
    ptr: CUdeviceptr,
    n: usize,
    device: CUdevice,
    s: CUstream,
) -> CUresult {
    guard(|| prefetch(ptr, n, device, s, true))
}

fn location_device(loc: CUmemLocation) -> Result<i32, CUresult> {
    match loc.type_ {
        CU_MEM_LOCATION_TYPE_DEVICE => Ok(loc.id),
        CU_MEM_LOCATION_TYPE_HOST => Ok(CU_DEVICE_CPU),
        _ => Err(CUDA_ERROR_INVALID_VALUE),
    }
}

#[no_mangle]
extern "C" fn cuMemPrefetchAsync_v2(
    ptr: CUdeviceptr,
    n: usize,
    loc: CUmemLocation,
    _flags: u32,
    s: CUstream,
) -> CUresult {
    guard(|| prefetch(ptr, n, location_device(loc)?, s, false))
}
#[no_mangle]
extern "C" fn cuMemPrefetchAsync_v2_ptsz(
    ptr: CUdeviceptr,
    n: usize,
    loc: CUmemLocation,
    _flags: u32,
    s: CUstream,
) -> CUresult {
    guard(|| prefetch(ptr, n, location_device(loc)?, s, true))
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
                crate::pool::pool_of(i.start).unwrap_or(0) as *mut c_void,
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

#[no_mangle]
extern "C" fn cuPointerGetAttribute(
    data: *mut c_void,
    attribute: i32,
    ptr: CUdeviceptr,
) -> CUresult {
    guard(|| pointer_attribute(driver()?, data, attribute, ptr))
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

#[no_mangle]
extern "C" fn cuPointerGetAttributes(
    n: u32,
    attributes: *const i32,
    data: *mut *mut c_void,
    ptr: CUdeviceptr,
) -> CUresult {
    guard(|| {
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
    })
}

/// `cuIpcGetMemHandle`: only the base of a `cuMemAlloc` allocation can be exported
/// (Driver API reference: "a pointer to the base of an existing device memory
/// allocation created with cuMemAlloc"); VMM mappings (`cuMemCreate`), pool and
/// managed memory, and interior pointers are `CUDA_ERROR_INVALID_VALUE`, as the
/// real driver answers (VMM memory is shared through `cuMemExportToShareableHandle`
/// instead). The handle names this process and the allocation; opening it
/// (`cuIpcOpenMemHandle`) is not simulated: a simulated allocation's bytes live in
/// its own process.
#[no_mangle]
extern "C" fn cuIpcGetMemHandle(handle: *mut [u8; 64], ptr: CUdeviceptr) -> CUresult {
    guard(|| {
        let d = driver()?;
        driver::current()?;
        if handle.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let info = d.mem.pointer_info(ptr).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if !d.mem.is_linear_start(ptr) || info.managed || crate::pool::pool_of(ptr).is_some() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let mut h = [0u8; 64];
        h[..8].copy_from_slice(b"KIWISIM\0");
        h[8..12].copy_from_slice(&std::process::id().to_le_bytes());
        h[16..24].copy_from_slice(&ptr.to_le_bytes());
        h[24..32].copy_from_slice(&info.size.to_le_bytes());
        out(handle, h)
    })
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

#[no_mangle]
extern "C" fn cuMemAdvise(ptr: CUdeviceptr, n: usize, advice: i32, device: CUdevice) -> CUresult {
    guard(|| advise(ptr, n, advice, device))
}

#[no_mangle]
extern "C" fn cuMemAdvise_v2(
    ptr: CUdeviceptr,
    n: usize,
    advice: i32,
    loc: CUmemLocation,
) -> CUresult {
    guard(|| advise(ptr, n, advice, location_device(loc)?))
}

// ---------------------------------------------------------------- pinned host memory

fn host_alloc(pp: *mut *mut c_void, size: usize) -> Result<(), CUresult> {
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
    d.mem.host_add(p as usize, size, true)?;
    out(pp, p)
}

#[no_mangle]
extern "C" fn cuMemAllocHost_v2(pp: *mut *mut c_void, size: usize) -> CUresult {
    guard(|| host_alloc(pp, size))
}

#[no_mangle]
extern "C" fn cuMemHostAlloc(pp: *mut *mut c_void, size: usize, flags: u32) -> CUresult {
    guard(|| {
        if flags & !0x7 != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        host_alloc(pp, size)
    })
}

#[no_mangle]
extern "C" fn cuMemFreeHost(p: *mut c_void) -> CUresult {
    guard(|| {
        let d = driver()?;
        capture::refuse_unsafe()?;
        let len = d.mem.host_remove(p as usize, true)?;
        // SAFETY: unmapping a mapping host_alloc created with this length.
        unsafe { libc::munmap(p, len) };
        Ok(())
    })
}

#[no_mangle]
extern "C" fn cuMemHostRegister_v2(p: *mut c_void, size: usize, flags: u32) -> CUresult {
    guard(|| {
        let d = driver()?;
        driver::current()?;
        if p.is_null() || size == 0 || flags & !0xf != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        d.mem.host_add(p as usize, size, false)
    })
}

#[no_mangle]
extern "C" fn cuMemHostUnregister(p: *mut c_void) -> CUresult {
    guard(|| driver()?.mem.host_remove(p as usize, false).map(|_| ()))
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
    let seq = s.ctx.submit(&s, op)?;
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

#[no_mangle]
extern "C" fn cuMemcpy(dst: CUdeviceptr, src: CUdeviceptr, n: usize) -> CUresult {
    guard(|| memcpy(dst, src, n, NULL_STREAM, false, true))
}
#[no_mangle]
extern "C" fn cuMemcpy_ptds(dst: CUdeviceptr, src: CUdeviceptr, n: usize) -> CUresult {
    guard(|| memcpy(dst, src, n, NULL_STREAM, true, true))
}
#[no_mangle]
extern "C" fn cuMemcpyAsync(dst: CUdeviceptr, src: CUdeviceptr, n: usize, s: CUstream) -> CUresult {
    guard(|| memcpy(dst, src, n, s, false, false))
}
#[no_mangle]
extern "C" fn cuMemcpyAsync_ptsz(
    dst: CUdeviceptr,
    src: CUdeviceptr,
    n: usize,
    s: CUstream,
) -> CUresult {
    guard(|| memcpy(dst, src, n, s, true, false))
}
#[no_mangle]
extern "C" fn cuMemcpyHtoD_v2(dst: CUdeviceptr, src: *const c_void, n: usize) -> CUresult {
    guard(|| htod(dst, src, n, NULL_STREAM, false, true))
}
#[no_mangle]
extern "C" fn cuMemcpyHtoD_v2_ptds(dst: CUdeviceptr, src: *const c_void, n: usize) -> CUresult {
    guard(|| htod(dst, src, n, NULL_STREAM, true, true))
}
#[no_mangle]
extern "C" fn cuMemcpyDtoH_v2(dst: *mut c_void, src: CUdeviceptr, n: usize) -> CUresult {
    guard(|| dtoh(dst, src, n, NULL_STREAM, false, true))
}
#[no_mangle]
extern "C" fn cuMemcpyDtoH_v2_ptds(dst: *mut c_void, src: CUdeviceptr, n: usize) -> CUresult {
    guard(|| dtoh(dst, src, n, NULL_STREAM, true, true))
}
#[no_mangle]
extern "C" fn cuMemcpyDtoD_v2(dst: CUdeviceptr, src: CUdeviceptr, n: usize) -> CUresult {
    guard(|| dtod(dst, src, n, NULL_STREAM, false, true))
}
#[no_mangle]
extern "C" fn cuMemcpyDtoD_v2_ptds(dst: CUdeviceptr, src: CUdeviceptr, n: usize) -> CUresult {
    guard(|| dtod(dst, src, n, NULL_STREAM, true, true))
}
#[no_mangle]
extern "C" fn cuMemcpyHtoDAsync_v2(
    dst: CUdeviceptr,
    src: *const c_void,
    n: usize,
    s: CUstream,
) -> CUresult {
    guard(|| htod(dst, src, n, s, false, false))
}
#[no_mangle]
extern "C" fn cuMemcpyHtoDAsync_v2_ptsz(
    dst: CUdeviceptr,
    src: *const c_void,
    n: usize,
    s: CUstream,
) -> CUresult {
    guard(|| htod(dst, src, n, s, true, false))
}
#[no_mangle]
extern "C" fn cuMemcpyDtoHAsync_v2(
    dst: *mut c_void,
    src: CUdeviceptr,
    n: usize,
    s: CUstream,
) -> CUresult {
    guard(|| dtoh(dst, src, n, s, false, false))
}
#[no_mangle]
extern "C" fn cuMemcpyDtoHAsync_v2_ptsz(
    dst: *mut c_void,
    src: CUdeviceptr,
    n: usize,
    s: CUstream,
) -> CUresult {
    guard(|| dtoh(dst, src, n, s, true, false))
}
#[no_mangle]
extern "C" fn cuMemcpyDtoDAsync_v2(
    dst: CUdeviceptr,
    src: CUdeviceptr,
    n: usize,
    s: CUstream,
) -> CUresult {
    guard(|| dtod(dst, src, n, s, false, false))
}
#[no_mangle]
extern "C" fn cuMemcpyDtoDAsync_v2_ptsz(
    dst: CUdeviceptr,
    src: CUdeviceptr,
    n: usize,
    s: CUstream,
) -> CUresult {
    guard(|| dtod(dst, src, n, s, true, false))
}
#[no_mangle]
extern "C" fn cuMemsetD8_v2(dst: CUdeviceptr, v: u8, n: usize) -> CUresult {
    guard(|| memset(dst, u32::from(v), 1, n, NULL_STREAM, false, true))
}
#[no_mangle]
extern "C" fn cuMemsetD8_v2_ptds(dst: CUdeviceptr, v: u8, n: usize) -> CUresult {
    guard(|| memset(dst, u32::from(v), 1, n, NULL_STREAM, true, true))
}
#[no_mangle]
extern "C" fn cuMemsetD16_v2(dst: CUdeviceptr, v: u16, n: usize) -> CUresult {
    guard(|| memset(dst, u32::from(v), 2, n, NULL_STREAM, false, true))
}
#[no_mangle]
extern "C" fn cuMemsetD16_v2_ptds(dst: CUdeviceptr, v: u16, n: usize) -> CUresult {
    guard(|| memset(dst, u32::from(v), 2, n, NULL_STREAM, true, true))
}
#[no_mangle]
extern "C" fn cuMemsetD32_v2(dst: CUdeviceptr, v: u32, n: usize) -> CUresult {
    guard(|| memset(dst, v, 4, n, NULL_STREAM, false, true))
}
#[no_mangle]
extern "C" fn cuMemsetD32_v2_ptds(dst: CUdeviceptr, v: u32, n: usize) -> CUresult {
    guard(|| memset(dst, v, 4, n, NULL_STREAM, true, true))
}
#[no_mangle]
extern "C" fn cuMemsetD8Async(dst: CUdeviceptr, v: u8, n: usize, s: CUstream) -> CUresult {
    guard(|| memset(dst, u32::from(v), 1, n, s, false, false))
}
#[no_mangle]
extern "C" fn cuMemsetD8Async_ptsz(dst: CUdeviceptr, v: u8, n: usize, s: CUstream) -> CUresult {
    guard(|| memset(dst, u32::from(v), 1, n, s, true, false))
}
#[no_mangle]
extern "C" fn cuMemsetD16Async(dst: CUdeviceptr, v: u16, n: usize, s: CUstream) -> CUresult {
    guard(|| memset(dst, u32::from(v), 2, n, s, false, false))
}
#[no_mangle]
extern "C" fn cuMemsetD16Async_ptsz(dst: CUdeviceptr, v: u16, n: usize, s: CUstream) -> CUresult {
    guard(|| memset(dst, u32::from(v), 2, n, s, true, false))
}
#[no_mangle]
extern "C" fn cuMemsetD32Async(dst: CUdeviceptr, v: u32, n: usize, s: CUstream) -> CUresult {
    guard(|| memset(dst, v, 4, n, s, false, false))
}
#[no_mangle]
extern "C" fn cuMemsetD32Async_ptsz(dst: CUdeviceptr, v: u32, n: usize, s: CUstream) -> CUresult {
    guard(|| memset(dst, v, 4, n, s, true, false))
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

#[no_mangle]
extern "C" fn cuMemcpy2D_v2(p: *const CudaMemcpy2D) -> CUresult {
    guard(|| copy_2d(p, NULL_STREAM, false, true))
}
#[no_mangle]
extern "C" fn cuMemcpy2D_v2_ptds(p: *const CudaMemcpy2D) -> CUresult {
    guard(|| copy_2d(p, NULL_STREAM, true, true))
}
#[no_mangle]
extern "C" fn cuMemcpy2DUnaligned_v2(p: *const CudaMemcpy2D) -> CUresult {
    guard(|| copy_2d(p, NULL_STREAM, false, true))
}
#[no_mangle]
extern "C" fn cuMemcpy2DUnaligned_v2_ptds(p: *const CudaMemcpy2D) -> CUresult {
    guard(|| copy_2d(p, NULL_STREAM, true, true))
}
#[no_mangle]
extern "C" fn cuMemcpy2DAsync_v2(p: *const CudaMemcpy2D, s: CUstream) -> CUresult {
    guard(|| copy_2d(p, s, false, false))
}
#[no_mangle]
extern "C" fn cuMemcpy2DAsync_v2_ptsz(p: *const CudaMemcpy2D, s: CUstream) -> CUresult {
    guard(|| copy_2d(p, s, true, false))
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

#[no_mangle]
extern "C" fn cuMemsetD2D8_v2(
    dst: CUdeviceptr,
    pitch: usize,
    v: u8,
    w: usize,
    h: usize,
) -> CUresult {
    guard(|| memset_2d(dst, pitch, u32::from(v), 1, w, h, NULL_STREAM, false, true))
}
#[no_mangle]
extern "C" fn cuMemsetD2D8_v2_ptds(
    dst: CUdeviceptr,
    pitch: usize,
    v: u8,
    w: usize,
    h: usize,
) -> CUresult {
    guard(|| memset_2d(dst, pitch, u32::from(v), 1, w, h, NULL_STREAM, true, true))
}
#[no_mangle]
extern "C" fn cuMemsetD2D16_v2(
    dst: CUdeviceptr,
    pitch: usize,
    v: u16,
    w: usize,
    h: usize,
) -> CUresult {
    guard(|| memset_2d(dst, pitch, u32::from(v), 2, w, h, NULL_STREAM, false, true))
}
#[no_mangle]
extern "C" fn cuMemsetD2D16_v2_ptds(
    dst: CUdeviceptr,
    pitch: usize,
    v: u16,
    w: usize,
    h: usize,
) -> CUresult {
    guard(|| memset_2d(dst, pitch, u32::from(v), 2, w, h, NULL_STREAM, true, true))
}
#[no_mangle]
extern "C" fn cuMemsetD2D32_v2(
    dst: CUdeviceptr,
    pitch: usize,
    v: u32,
    w: usize,
    h: usize,
) -> CUresult {
    guard(|| memset_2d(dst, pitch, v, 4, w, h, NULL_STREAM, false, true))
}
#[no_mangle]
extern "C" fn cuMemsetD2D32_v2_ptds(
    dst: CUdeviceptr,
    pitch: usize,
    v: u32,
    w: usize,
    h: usize,
) -> CUresult {
    guard(|| memset_2d(dst, pitch, v, 4, w, h, NULL_STREAM, true, true))
}
#[no_mangle]
extern "C" fn cuMemsetD2D8Async(
    dst: CUdeviceptr,
    pitch: usize,
    v: u8,
    w: usize,
    h: usize,
    s: CUstream,
) -> CUresult {
    guard(|| memset_2d(dst, pitch, u32::from(v), 1, w, h, s, false, false))
}
#[no_mangle]
extern "C" fn cuMemsetD2D8Async_ptsz(
    dst: CUdeviceptr,
    pitch: usize,
    v: u8,
    w: usize,
    h: usize,
    s: CUstream,
) -> CUresult {
    guard(|| memset_2d(dst, pitch, u32::from(v), 1, w, h, s, true, false))
}
#[no_mangle]
extern "C" fn cuMemsetD2D16Async(
    dst: CUdeviceptr,
    pitch: usize,
    v: u16,
    w: usize,
    h: usize,
    s: CUstream,
) -> CUresult {
    guard(|| memset_2d(dst, pitch, u32::from(v), 2, w, h, s, false, false))
}
#[no_mangle]
extern "C" fn cuMemsetD2D16Async_ptsz(
    dst: CUdeviceptr,
    pitch: usize,
    v: u16,
    w: usize,
    h: usize,
    s: CUstream,
) -> CUresult {
    guard(|| memset_2d(dst, pitch, u32::from(v), 2, w, h, s, true, false))
}
#[no_mangle]
extern "C" fn cuMemsetD2D32Async(
    dst: CUdeviceptr,
    pitch: usize,
    v: u32,
    w: usize,
    h: usize,
    s: CUstream,
) -> CUresult {
    guard(|| memset_2d(dst, pitch, v, 4, w, h, s, false, false))
}
#[no_mangle]
extern "C" fn cuMemsetD2D32Async_ptsz(
    dst: CUdeviceptr,
    pitch: usize,
    v: u32,
    w: usize,
    h: usize,
    s: CUstream,
) -> CUresult {
    guard(|| memset_2d(dst, pitch, v, 4, w, h, s, true, false))
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

#[no_mangle]
extern "C" fn cuMemGetAllocationGranularity(
    g: *mut usize,
    prop: *const CUmemAllocationProp,
    option: i32,
) -> CUresult {
    guard(|| {
        let d = driver()?;
        check_prop(d, prop)?;
        if !matches!(option, 0 | 1) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        out(g, GRANULARITY as usize)
    })
}

#[no_mangle]
extern "C" fn cuMemAddressReserve(
    ptr: *mut CUdeviceptr,
    size: usize,
    align: usize,
    addr: CUdeviceptr,
    flags: u64,
) -> CUresult {
    guard(|| {
        let d = driver()?;
        if ptr.is_null() || flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let at = d.mem.reserve(size as u64, align as u64, addr)?;
        out(ptr, at)
    })
}

#[no_mangle]
extern "C" fn cuMemAddressFree(ptr: CUdeviceptr, size: usize) -> CUresult {
    guard(|| driver()?.mem.unreserve(ptr, size as u64))
}

#[no_mangle]
extern "C" fn cuMemCreate(
    handle: *mut CUmemGenericAllocationHandle,
    size: usize,
    prop: *const CUmemAllocationProp,
    flags: u64,
) -> CUresult {
    guard(|| {
        let d = driver()?;
        let g = check_prop(d, prop)?;
        if handle.is_null() || flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let h = d.mem.create(g, size as u64)?;
        out(handle, h)
    })
}

#[no_mangle]
extern "C" fn cuMemRelease(handle: CUmemGenericAllocationHandle) -> CUresult {
    guard(|| driver()?.mem.release(handle))
}

#[no_mangle]
extern "C" fn cuMemMap(
    ptr: CUdeviceptr,
    size: usize,
    offset: usize,
    handle: CUmemGenericAllocationHandle,
    flags: u64,
) -> CUresult {
    guard(|| {
        let d = driver()?;
        if flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        d.mem.map(ptr, size as u64, offset as u64, handle)
    })
}

#[no_mangle]
extern "C" fn cuMemUnmap(ptr: CUdeviceptr, size: usize) -> CUresult {
    guard(|| driver()?.mem.unmap(ptr, size as u64))
}

#[no_mangle]
extern "C" fn cuMemSetAccess(
    ptr: CUdeviceptr,
    size: usize,
    desc: *const CUmemAccessDesc,
    count: usize,
) -> CUresult {
    guard(|| {
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
        d.mem.set_access(ptr, size as u64, &grants)
    })
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

#[no_mangle]
extern "C" fn cuStreamCreate(ph: *mut CUstream, flags: u32) -> CUresult {
    guard(|| stream_create(ph, flags, 0))
}

#[no_mangle]
extern "C" fn cuStreamCreateWithPriority(ph: *mut CUstream, flags: u32, priority: i32) -> CUresult {
    guard(|| stream_create(ph, flags, priority))
}

#[no_mangle]
extern "C" fn cuStreamDestroy_v2(s: CUstream) -> CUresult {
    guard(|| {
        let d = driver()?;
        // Pending work still completes; the handle is gone at once.
        d.streams
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&(s as usize))
            .map(|_| ())
            .ok_or(CUDA_ERROR_INVALID_HANDLE)
    })
}

fn stream_sync(s: CUstream, pt: bool) -> Result<(), CUresult> {
    let d = driver()?;
    let legacy = s.is_null() && !pt || s as usize == CU_STREAM_LEGACY;
    let st = d.stream(s, pt)?;
    if legacy {
        capture::refuse_legacy(&st.ctx)?;
    } else {
        capture::refuse_stream_use(&st)?;
    }
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

#[no_mangle]
extern "C" fn cuStreamSynchronize(s: CUstream) -> CUresult {
    guard(|| stream_sync(s, false))
}

#[no_mangle]
extern "C" fn cuStreamSynchronize_ptsz(s: CUstream) -> CUresult {
    guard(|| stream_sync(s, true))
}

fn stream_query(s: CUstream, pt: bool) -> Result<(), CUresult> {
    let d = driver()?;
    let st = d.stream(s, pt)?;
    st.ctx.check()?;
    if st.legacy {
        capture::refuse_legacy(&st.ctx)?;
    } else {
        capture::refuse_stream_use(&st)?;
    }
    if st.ctx.is_done(st.lane, st.last_seq.load(Ordering::Acquire)) {
        Ok(())
    } else {
        Err(CUDA_ERROR_NOT_READY)
    }
}

#[no_mangle]
extern "C" fn cuStreamQuery(s: CUstream) -> CUresult {
    guard(|| stream_query(s, false))
}

#[no_mangle]
extern "C" fn cuStreamQuery_ptsz(s: CUstream) -> CUresult {
    guard(|| stream_query(s, true))
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
    st.ctx
        .submit(&st, Op::WaitFor { ctx, lane, seq })
        .map(|_| ())
}

#[no_mangle]
extern "C" fn cuStreamWaitEvent(s: CUstream, e: CUevent, _flags: u32) -> CUresult {
    guard(|| stream_wait_event(s, e, false))
}

#[no_mangle]
extern "C" fn cuStreamWaitEvent_ptsz(s: CUstream, e: CUevent, _flags: u32) -> CUresult {
    guard(|| stream_wait_event(s, e, true))
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
    st.ctx
        .submit(
            &st,
            Op::Callback {
                f,
                stream: s as usize,
                data: data as usize,
            },
        )
        .map(|_| ())
}

#[no_mangle]
extern "C" fn cuStreamAddCallback(
    s: CUstream,
    cb: CUstreamCallback,
    data: *mut c_void,
    flags: u32,
) -> CUresult {
    guard(|| add_callback(s, cb, data, flags, false))
}

#[no_mangle]
extern "C" fn cuStreamAddCallback_ptsz(
    s: CUstream,
    cb: CUstreamCallback,
    data: *mut c_void,
    flags: u32,
) -> CUresult {
    guard(|| add_callback(s, cb, data, flags, true))
}

#[no_mangle]
extern "C" fn cuStreamGetFlags(s: CUstream, flags: *mut u32) -> CUresult {
    guard(|| out(flags, driver()?.stream(s, false)?.flags))
}

#[no_mangle]
extern "C" fn cuStreamGetPriority(s: CUstream, prio: *mut i32) -> CUresult {
    guard(|| out(prio, driver()?.stream(s, false)?.priority))
}

#[no_mangle]
extern "C" fn cuStreamGetCtx(s: CUstream, pctx: *mut CUcontext) -> CUresult {
    guard(|| {
        let st = driver()?.stream(s, false)?;
        out(pctx, st.ctx.handle() as CUcontext)
    })
}

#[no_mangle]
extern "C" fn cuEventCreate(ph: *mut CUevent, flags: u32) -> CUresult {
    guard(|| {
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
    })
}

#[no_mangle]
extern "C" fn cuEventDestroy_v2(e: CUevent) -> CUresult {
    guard(|| {
        driver()?
            .events
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&(e as usize))
            .map(|_| ())
            .ok_or(CUDA_ERROR_INVALID_HANDLE)
    })
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
    let got = st.ctx.submit(
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

#[no_mangle]
extern "C" fn cuEventRecord(e: CUevent, s: CUstream) -> CUresult {
    guard(|| event_record(e, s, false))
}

#[no_mangle]
extern "C" fn cuEventRecord_ptsz(e: CUevent, s: CUstream) -> CUresult {
    guard(|| event_record(e, s, true))
}

#[no_mangle]
extern "C" fn cuEventRecordWithFlags(e: CUevent, s: CUstream, _flags: u32) -> CUresult {
    guard(|| event_record(e, s, false))
}

#[no_mangle]
extern "C" fn cuEventRecordWithFlags_ptsz(e: CUevent, s: CUstream, _flags: u32) -> CUresult {
    guard(|| event_record(e, s, true))
}

#[no_mangle]
extern "C" fn cuEventQuery(e: CUevent) -> CUresult {
    guard(|| {
        let ev = driver()?.event(e)?;
        let g = ev.state.lock().unwrap_or_else(|e| e.into_inner());
        capture::refuse_captured_event(g.capture_id)?;
        match &g.ctx {
            None => Ok(()),
            Some(_) if g.time_ns != 0 => Ok(()),
            Some(c) if c.is_done(g.lane, event_seq(&g, c)) => c.check(),
            Some(_) => Err(CUDA_ERROR_NOT_READY),
        }
    })
}

#[no_mangle]
extern "C" fn cuEventSynchronize(e: CUevent) -> CUresult {
    guard(|| {
        let ev = driver()?.event(e)?;
        let (ctx, lane, seq) = {
            let g = ev.state.lock().unwrap_or_else(|e| e.into_inner());
            capture::refuse_captured_event(g.capture_id)?;
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
    })
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

#[no_mangle]
extern "C" fn cuEventElapsedTime(ms: *mut f32, start: CUevent, end: CUevent) -> CUresult {
    guard(|| elapsed(ms, start, end))
}

#[no_mangle]
extern "C" fn cuEventElapsedTime_v2(ms: *mut f32, start: CUevent, end: CUevent) -> CUresult {
    guard(|| elapsed(ms, start, end))
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

#[no_mangle]
extern "C" fn cuStreamBeginCapture_v2(s: CUstream, mode: u32) -> CUresult {
    guard(|| begin_capture(s, mode, false))
}
#[no_mangle]
extern "C" fn cuStreamBeginCapture_v2_ptsz(s: CUstream, mode: u32) -> CUresult {
    guard(|| begin_capture(s, mode, true))
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

#[no_mangle]
extern "C" fn cuStreamEndCapture(s: CUstream, graph: *mut *mut c_void) -> CUresult {
    guard(|| end_capture(s, graph, false))
}
#[no_mangle]
extern "C" fn cuStreamEndCapture_ptsz(s: CUstream, graph: *mut *mut c_void) -> CUresult {
    guard(|| end_capture(s, graph, true))
}

fn is_capturing(s: CUstream, status: *mut i32, pt: bool) -> Result<(), CUresult> {
    let st = driver()?.stream(s, pt)?;
    out(status, capture::status(&st).0)
}

#[no_mangle]
extern "C" fn cuStreamIsCapturing(s: CUstream, status: *mut i32) -> CUresult {
    guard(|| is_capturing(s, status, false))
}
#[no_mangle]
extern "C" fn cuStreamIsCapturing_ptsz(s: CUstream, status: *mut i32) -> CUresult {
    guard(|| is_capturing(s, status, true))
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
    capture::info(&st, status, id, graph, deps, edges, count)
}

#[no_mangle]
extern "C" fn cuStreamGetCaptureInfo(s: CUstream, status: *mut i32, id: *mut u64) -> CUresult {
    let n = std::ptr::null_mut();
    guard(|| capture_info(s, status, id, n, n.cast(), n.cast(), n.cast(), false))
}
#[no_mangle]
extern "C" fn cuStreamGetCaptureInfo_ptsz(s: CUstream, status: *mut i32, id: *mut u64) -> CUresult {
    let n = std::ptr::null_mut();
    guard(|| capture_info(s, status, id, n, n.cast(), n.cast(), n.cast(), true))
}
#[no_mangle]
extern "C" fn cuStreamGetCaptureInfo_v2(
    s: CUstream,
    status: *mut i32,
    id: *mut u64,
    graph: *mut *mut c_void,
    deps: *mut *const c_void,
    count: *mut usize,
) -> CUresult {
    let n = std::ptr::null_mut();
    guard(|| capture_info(s, status, id, graph, deps, n, count, false))
}
#[no_mangle]
extern "C" fn cuStreamGetCaptureInfo_v2_ptsz(
    s: CUstream,
    status: *mut i32,
    id: *mut u64,
    graph: *mut *mut c_void,
    deps: *mut *const c_void,
    count: *mut usize,
) -> CUresult {
    let n = std::ptr::null_mut();
    guard(|| capture_info(s, status, id, graph, deps, n, count, true))
}
#[no_mangle]
extern "C" fn cuStreamGetCaptureInfo_v3(
    s: CUstream,
    status: *mut i32,
    id: *mut u64,
    graph: *mut *mut c_void,
    deps: *mut *const c_void,
    edges: *mut *const c_void,
    count: *mut usize,
) -> CUresult {
    guard(|| capture_info(s, status, id, graph, deps, edges, count, false))
}
#[no_mangle]
extern "C" fn cuStreamGetCaptureInfo_v3_ptsz(
    s: CUstream,
    status: *mut i32,
    id: *mut u64,
    graph: *mut *mut c_void,
    deps: *mut *const c_void,
    edges: *mut *const c_void,
    count: *mut usize,
) -> CUresult {
    guard(|| capture_info(s, status, id, graph, deps, edges, count, true))
}

#[no_mangle]
extern "C" fn cuThreadExchangeStreamCaptureMode(mode: *mut u32) -> CUresult {
    guard(|| {
        driver()?;
        capture::exchange_mode(mode)
    })
}

#[no_mangle]
extern "C" fn cuGraphInstantiateWithFlags(
    exec: *mut *mut c_void,
    graph: *mut c_void,
    _flags: u64,
) -> CUresult {
    guard(|| {
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
    })
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
        st.ctx.submit(&st, op.clone())?;
    }
    Ok(())
}

#[no_mangle]
extern "C" fn cuGraphLaunch(exec: *mut c_void, s: CUstream) -> CUresult {
    guard(|| graph_launch(exec, s, false))
}
#[no_mangle]
extern "C" fn cuGraphLaunch_ptsz(exec: *mut c_void, s: CUstream) -> CUresult {
    guard(|| graph_launch(exec, s, true))
}

fn graph_upload(exec: *mut c_void, stream: CUstream, pt: bool) -> Result<(), CUresult> {
    graph_exec(exec)?;
    // Nothing to upload: keeps its place in stream order only.
    enqueue(stream, pt, Op::Nop, false)
}

#[no_mangle]
extern "C" fn cuGraphUpload(exec: *mut c_void, s: CUstream) -> CUresult {
    guard(|| graph_upload(exec, s, false))
}
#[no_mangle]
extern "C" fn cuGraphUpload_ptsz(exec: *mut c_void, s: CUstream) -> CUresult {
    guard(|| graph_upload(exec, s, true))
}

#[no_mangle]
extern "C" fn cuGraphExecDestroy(exec: *mut c_void) -> CUresult {
    guard(|| {
        driver()?
            .graph_execs
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&(exec as usize))
            .map(|_| ())
            .ok_or(CUDA_ERROR_INVALID_VALUE)
    })
}

#[no_mangle]
extern "C" fn cuGraphDestroy(graph: *mut c_void) -> CUresult {
    guard(|| {
        driver()?
            .graphs
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&(graph as usize))
            .map(|_| ())
            .ok_or(CUDA_ERROR_INVALID_VALUE)
    })
}

// ---------------------------------------------------------------- modules and launches

/// The four built-in kernels; a `CUfunction` is a pointer into this table.
static FUNCTIONS: [Builtin; 4] = [
    Builtin::Fill,
    Builtin::Add,
    Builtin::Checksum,
    Builtin::Spin,
];

fn function(f: CUfunction) -> Result<Builtin, CUresult> {
    FUNCTIONS
        .iter()
        .find(|b| std::ptr::eq(*b as *const Builtin, f as *const Builtin))
        .copied()
        .ok_or(CUDA_ERROR_INVALID_HANDLE)
}

pub(crate) fn module_load(m: *mut CUmodule, image: *const c_void) -> Result<(), CUresult> {
    let d = driver()?;
    driver::current()?;
    if m.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    if image.is_null() {
        return Err(CUDA_ERROR_INVALID_IMAGE);
    }
    // Any image is accepted: entry names resolve to the built-ins.
    out(m, d.new_module() as CUmodule)
}

#[no_mangle]
extern "C" fn cuModuleLoadData(m: *mut CUmodule, image: *const c_void) -> CUresult {
    guard(|| module_load(m, image))
}

#[no_mangle]
extern "C" fn cuModuleLoadDataEx(
    m: *mut CUmodule,
    image: *const c_void,
    _n: u32,
    _o: *mut i32,
    _v: *mut *mut c_void,
) -> CUresult {
    guard(|| module_load(m, image))
}

#[no_mangle]
extern "C" fn cuModuleLoad(m: *mut CUmodule, fname: *const c_char) -> CUresult {
    guard(|| {
        let path = c_str(fname)?;
        if !std::path::Path::new(path).is_file() {
            return Err(CUDA_ERROR_FILE_NOT_FOUND);
        }
        module_load(m, fname.cast())
    })
}

#[no_mangle]
extern "C" fn cuModuleUnload(m: CUmodule) -> CUresult {
    guard(|| {
        if driver()?.drop_module(m as usize) {
            Ok(())
        } else {
            Err(CUDA_ERROR_INVALID_HANDLE)
        }
    })
}

#[no_mangle]
extern "C" fn cuModuleGetFunction(
    f: *mut CUfunction,
    m: CUmodule,
    name: *const c_char,
) -> CUresult {
    guard(|| {
        let d = driver()?;
        if !d.has_module(m as usize) {
            return Err(CUDA_ERROR_INVALID_HANDLE);
        }
        let name = c_str(name)?;
        let b = FUNCTIONS
            .iter()
            .find(|b| b.name() == name)
            .ok_or(CUDA_ERROR_NOT_FOUND)?;
        out(f, b as *const Builtin as CUfunction)
    })
}

#[no_mangle]
extern "C" fn cuFuncGetAttribute(pi: *mut i32, attrib: i32, f: CUfunction) -> CUresult {
    guard(|| {
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
    })
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

#[no_mangle]
extern "C" fn cuFuncSetAttribute(f: CUfunction, attrib: i32, value: i32) -> CUresult {
    guard(|| {
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
    })
}

/// `CU_MODULE_LAZY_LOADING` unless `CUDA_MODULE_LOADING=EAGER` (the driver's
/// default since CUDA 12.2).
#[no_mangle]
extern "C" fn cuModuleGetLoadingMode(mode: *mut u32) -> CUresult {
    guard(|| {
        driver()?;
        let eager = std::env::var("CUDA_MODULE_LOADING").is_ok_and(|v| v == "EAGER");
        out(mode, if eager { 1 } else { 2 })
    })
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
    let kind = function(f)?;
    if grid.contains(&0) || block.contains(&0) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    if block.iter().map(|&b| u64::from(b)).product::<u64>() > 1024 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let args = kernel_args(kind, params, extra)?;
    let s = d.stream(stream, pt)?;
    s.ctx.check()?;
    s.ctx.submit(&s, Op::Kernel { kind, args }).map(|_| ())
}

#[no_mangle]
extern "C" fn cuLaunchKernel(
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
) -> CUresult {
    guard(|| launch(f, [gx, gy, gz], [bx, by, bz], s, params, extra, false))
}

#[no_mangle]
extern "C" fn cuLaunchKernel_ptsz(
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
) -> CUresult {
    guard(|| launch(f, [gx, gy, gz], [bx, by, bz], s, params, extra, true))
}

#[no_mangle]
extern "C" fn cuLaunchCooperativeKernel(
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
) -> CUresult {
    guard(|| {
        launch(
            f,
            [gx, gy, gz],
            [bx, by, bz],
            s,
            params,
            std::ptr::null_mut(),
            false,
        )
    })
}

#[no_mangle]
extern "C" fn cuLaunchCooperativeKernel_ptsz(
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
) -> CUresult {
    guard(|| {
        launch(
            f,
            [gx, gy, gz],
            [bx, by, bz],
            s,
            params,
            std::ptr::null_mut(),
            true,
        )
    })
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

#[no_mangle]
extern "C" fn cuLaunchKernelEx(
    cfg: *const CUlaunchConfig,
    f: CUfunction,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> CUresult {
    guard(|| launch_ex(cfg, f, params, extra, false))
}

#[no_mangle]
extern "C" fn cuLaunchKernelEx_ptsz(
    cfg: *const CUlaunchConfig,
    f: CUfunction,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> CUresult {
    guard(|| launch_ex(cfg, f, params, extra, true))
}

fn host_func(s: CUstream, f: CUhostFn, data: *mut c_void, pt: bool) -> Result<(), CUresult> {
    let f = f.ok_or(CUDA_ERROR_INVALID_VALUE)?;
    let d = driver()?;
    let st = d.stream(s, pt)?;
    st.ctx.check()?;
    st.ctx
        .submit(
            &st,
            Op::HostFn {
                f,
                data: data as usize,
            },
        )
        .map(|_| ())
}

#[no_mangle]
extern "C" fn cuLaunchHostFunc(s: CUstream, f: CUhostFn, data: *mut c_void) -> CUresult {
    guard(|| host_func(s, f, data, false))
}

#[no_mangle]
extern "C" fn cuLaunchHostFunc_ptsz(s: CUstream, f: CUhostFn, data: *mut c_void) -> CUresult {
    guard(|| host_func(s, f, data, true))
}

// ---------------------------------------------------------------- errors, entry points

#[no_mangle]
extern "C" fn cuGetErrorName(e: CUresult, s: *mut *const c_char) -> CUresult {
    guard(|| match ERRORS.iter().find(|x| x.0 == e) {
        Some(x) => out(s, x.1.as_ptr()),
        None => {
            let _ = out(s, std::ptr::null());
            Err(CUDA_ERROR_INVALID_VALUE)
        }
    })
}

#[no_mangle]
extern "C" fn cuGetErrorString(e: CUresult, s: *mut *const c_char) -> CUresult {
    guard(|| match ERRORS.iter().find(|x| x.0 == e) {
        Some(x) => out(s, x.2.as_ptr()),
        None => {
            let _ = out(s, std::ptr::null());
            Err(CUDA_ERROR_INVALID_VALUE)
        }
    })
}

#[no_mangle]
extern "C" fn cuGetExportTable(table: *mut *const c_void, id: *const CUuuid) -> CUresult {
    guard(|| crate::dark_api::export_table(table, id))
}

#[no_mangle]
extern "C" fn cuGetProcAddress(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: i32,
    flags: u64,
) -> CUresult {
    guard(|| crate::procaddr::get_proc_address(symbol, pfn, version, flags, std::ptr::null_mut()))
}

#[no_mangle]
extern "C" fn cuGetProcAddress_v2(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: i32,
    flags: u64,
    status: *mut i32,
) -> CUresult {
    guard(|| crate::procaddr::get_proc_address(symbol, pfn, version, flags, status))
}

/// Every export: (symbol, minimum CUDA version, address). `procaddr` derives base
/// names from the symbols.
pub fn exports() -> Vec<(&'static str, i32, usize)> {
    macro_rules! table {
        ($($name:ident = $ver:expr),* $(,)?) => {
            vec![$((stringify!($name), $ver, $name as *const () as usize)),*]
        };
    }
    table![
        cuInit = 2000,
        cuDriverGetVersion = 2020,
        cuDeviceGet = 2000,
        cuDeviceGetCount = 2000,
        cuDeviceGetName = 2000,
        cuDeviceGetUuid = 9020,
        cuDeviceGetUuid_v2 = 11040,
        cuDeviceTotalMem_v2 = 3020,
        cuDeviceGetAttribute = 2000,
        cuDeviceComputeCapability = 2000,
        cuDeviceGetPCIBusId = 4010,
        cuDeviceCanAccessPeer = 4000,
        cuDevicePrimaryCtxRetain = 7000,
        cuDevicePrimaryCtxRelease = 7000,
        cuDevicePrimaryCtxRelease_v2 = 11000,
        cuDevicePrimaryCtxReset = 7000,
        cuDevicePrimaryCtxReset_v2 = 11000,
        cuDevicePrimaryCtxGetState = 7000,
        cuDevicePrimaryCtxSetFlags_v2 = 11000,
        cuCtxCreate_v2 = 3020,
        cuCtxDestroy_v2 = 4000,
        cuCtxSetCurrent = 4000,
        cuCtxGetCurrent = 4000,
        cuCtxPushCurrent_v2 = 4000,
        cuCtxPopCurrent_v2 = 4000,
        cuCtxSynchronize = 2000,
        cuCtxGetDevice = 2000,
        cuCtxGetFlags = 7000,
        cuCtxGetApiVersion = 3020,
        cuCtxGetStreamPriorityRange = 5050,
        cuMemGetInfo_v2 = 3020,
        cuMemAlloc_v2 = 3020,
        cuMemAllocPitch_v2 = 3020,
        cuMemFree_v2 = 3020,
        cuMemGetAddressRange_v2 = 3020,
        cuMemAllocAsync = 11020,
        cuMemFreeAsync = 11020,
        cuMemAllocFromPoolAsync = 11020,
        cuDeviceGetDefaultMemPool = 11020,
        cuDeviceGetMemPool = 11020,
        cuDeviceSetMemPool = 11020,
        cuMemPoolCreate = 11020,
        cuMemPoolDestroy = 11020,
        cuMemPoolSetAttribute = 11020,
        cuMemPoolGetAttribute = 11020,
        cuMemPoolTrimTo = 11020,
        cuPointerGetAttributes = 7000,
        cuIpcGetMemHandle = 4010,
        cuMemAdvise = 8000,
        cuMemAdvise_v2 = 12020,
        cuCtxGetLimit = 3010,
        cuCtxSetLimit = 3010,
        cuFuncSetAttribute = 9000,
        cuModuleGetLoadingMode = 11070,
        cuMemAllocManaged = 6000,
        cuMemPrefetchAsync = 8000,
        cuMemPrefetchAsync_v2 = 12020,
        cuPointerGetAttribute = 4000,
        cuMemAllocHost_v2 = 3020,
        cuMemHostAlloc = 2020,
        cuMemFreeHost = 2000,
        cuMemHostRegister_v2 = 6050,
        cuMemHostUnregister = 4000,
        cuMemcpy = 4000,
        cuMemcpyAsync = 4000,
        cuMemcpyHtoD_v2 = 3020,
        cuMemcpyDtoH_v2 = 3020,
        cuMemcpyDtoD_v2 = 3020,
        cuMemcpyHtoDAsync_v2 = 3020,
        cuMemcpyDtoHAsync_v2 = 3020,
        cuMemcpyDtoDAsync_v2 = 3020,
        cuMemsetD8_v2 = 3020,
        cuMemsetD16_v2 = 3020,
        cuMemsetD32_v2 = 3020,
        cuMemsetD8Async = 3020,
        cuMemsetD16Async = 3020,
        cuMemsetD32Async = 3020,
        cuMemcpy2D_v2 = 3020,
        cuMemcpy2DUnaligned_v2 = 3020,
        cuMemcpy2DAsync_v2 = 3020,
        cuMemsetD2D8_v2 = 3020,
        cuMemsetD2D16_v2 = 3020,
        cuMemsetD2D32_v2 = 3020,
        cuMemsetD2D8Async = 3020,
        cuMemsetD2D16Async = 3020,
        cuMemsetD2D32Async = 3020,
        cuMemGetAllocationGranularity = 10020,
        cuMemAddressReserve = 10020,
        cuMemAddressFree = 10020,
        cuMemCreate = 10020,
        cuMemRelease = 10020,
        cuMemMap = 10020,
        cuMemUnmap = 10020,
        cuMemSetAccess = 10020,
        cuStreamCreate = 2000,
        cuStreamCreateWithPriority = 5050,
        cuStreamDestroy_v2 = 4000,
        cuStreamSynchronize = 2000,
        cuStreamQuery = 2000,
        cuStreamWaitEvent = 3020,
        cuStreamAddCallback = 5000,
        cuStreamGetFlags = 5050,
        cuStreamGetPriority = 5050,
        cuStreamGetCtx = 9020,
        cuStreamBeginCapture_v2 = 10010,
        cuStreamEndCapture = 10000,
        cuStreamIsCapturing = 10000,
        cuStreamGetCaptureInfo = 10010,
        cuStreamGetCaptureInfo_v2 = 11030,
        cuStreamGetCaptureInfo_v3 = 12030,
        cuThreadExchangeStreamCaptureMode = 10010,
        cuGraphInstantiateWithFlags = 11040,
        cuGraphLaunch = 10000,
        cuGraphUpload = 11010,
        cuGraphExecDestroy = 10000,
        cuGraphDestroy = 10000,
        cuEventCreate = 2000,
        cuEventDestroy_v2 = 4000,
        cuEventRecord = 2000,
        cuEventRecordWithFlags = 11010,
        cuEventQuery = 2000,
        cuEventSynchronize = 2000,
        cuEventElapsedTime = 2000,
        cuEventElapsedTime_v2 = 12080,
        cuModuleLoadData = 2000,
        cuModuleLoadDataEx = 2010,
        cuModuleLoad = 2000,
        cuModuleUnload = 2000,
        cuModuleGetFunction = 2000,
        cuFuncGetAttribute = 2020,
        cuLaunchKernel = 4000,
        cuLaunchKernelEx = 11060,
        cuLaunchCooperativeKernel = 9000,
        cuLaunchHostFunc = 10000,
        cuGetErrorName = 6000,
        cuGetErrorString = 6000,
        cuGetExportTable = 3000,
        cuGetProcAddress = 11030,
        cuGetProcAddress_v2 = 12000,
    ]
}

/// Per-thread-default-stream variants: (base name, minimum CUDA version, symbol,
/// address). A base name may have several (e.g. `cuMemPrefetchAsync` and its `_v2`).
pub fn per_thread_exports() -> Vec<(&'static str, i32, &'static str, usize)> {
    macro_rules! table {
        ($($base:literal @ $ver:expr => $name:ident),* $(,)?) => {
            vec![$(($base, $ver, stringify!($name), $name as *const () as usize)),*]
        };
    }
    table![
        "cuMemcpy" @ 4000 => cuMemcpy_ptds,
        "cuMemcpyHtoD" @ 3020 => cuMemcpyHtoD_v2_ptds,
        "cuMemcpyDtoH" @ 3020 => cuMemcpyDtoH_v2_ptds,
        "cuMemcpyDtoD" @ 3020 => cuMemcpyDtoD_v2_ptds,
        "cuMemsetD8" @ 3020 => cuMemsetD8_v2_ptds,
        "cuMemsetD16" @ 3020 => cuMemsetD16_v2_ptds,
        "cuMemsetD32" @ 3020 => cuMemsetD32_v2_ptds,
        "cuMemcpy2D" @ 3020 => cuMemcpy2D_v2_ptds,
        "cuMemcpy2DUnaligned" @ 3020 => cuMemcpy2DUnaligned_v2_ptds,
        "cuMemcpy2DAsync" @ 3020 => cuMemcpy2DAsync_v2_ptsz,
        "cuMemsetD2D8" @ 3020 => cuMemsetD2D8_v2_ptds,
        "cuMemsetD2D16" @ 3020 => cuMemsetD2D16_v2_ptds,
        "cuMemsetD2D32" @ 3020 => cuMemsetD2D32_v2_ptds,
        "cuMemsetD2D8Async" @ 3020 => cuMemsetD2D8Async_ptsz,
        "cuMemsetD2D16Async" @ 3020 => cuMemsetD2D16Async_ptsz,
        "cuMemsetD2D32Async" @ 3020 => cuMemsetD2D32Async_ptsz,
        "cuMemcpyAsync" @ 4000 => cuMemcpyAsync_ptsz,
        "cuMemcpyHtoDAsync" @ 3020 => cuMemcpyHtoDAsync_v2_ptsz,
        "cuMemcpyDtoHAsync" @ 3020 => cuMemcpyDtoHAsync_v2_ptsz,
        "cuMemcpyDtoDAsync" @ 3020 => cuMemcpyDtoDAsync_v2_ptsz,
        "cuMemsetD8Async" @ 3020 => cuMemsetD8Async_ptsz,
        "cuMemsetD16Async" @ 3020 => cuMemsetD16Async_ptsz,
        "cuMemsetD32Async" @ 3020 => cuMemsetD32Async_ptsz,
        "cuMemAllocAsync" @ 11020 => cuMemAllocAsync_ptsz,
        "cuMemFreeAsync" @ 11020 => cuMemFreeAsync_ptsz,
        "cuMemAllocFromPoolAsync" @ 11020 => cuMemAllocFromPoolAsync_ptsz,
        "cuMemPrefetchAsync" @ 12020 => cuMemPrefetchAsync_v2_ptsz,
        "cuStreamSynchronize" @ 2000 => cuStreamSynchronize_ptsz,
        "cuStreamQuery" @ 2000 => cuStreamQuery_ptsz,
        "cuStreamWaitEvent" @ 3020 => cuStreamWaitEvent_ptsz,
        "cuStreamAddCallback" @ 5000 => cuStreamAddCallback_ptsz,
        "cuEventRecord" @ 2000 => cuEventRecord_ptsz,
        "cuEventRecordWithFlags" @ 11010 => cuEventRecordWithFlags_ptsz,
        "cuLaunchKernel" @ 4000 => cuLaunchKernel_ptsz,
        "cuLaunchKernelEx" @ 11060 => cuLaunchKernelEx_ptsz,
        "cuLaunchCooperativeKernel" @ 9000 => cuLaunchCooperativeKernel_ptsz,
        "cuLaunchHostFunc" @ 10000 => cuLaunchHostFunc_ptsz,
        "cuStreamBeginCapture" @ 10010 => cuStreamBeginCapture_v2_ptsz,
        "cuStreamEndCapture" @ 10000 => cuStreamEndCapture_ptsz,
        "cuStreamIsCapturing" @ 10000 => cuStreamIsCapturing_ptsz,
        "cuStreamGetCaptureInfo" @ 10010 => cuStreamGetCaptureInfo_ptsz,
        "cuStreamGetCaptureInfo" @ 11030 => cuStreamGetCaptureInfo_v2_ptsz,
        "cuStreamGetCaptureInfo" @ 12030 => cuStreamGetCaptureInfo_v3_ptsz,
        "cuGraphLaunch" @ 10000 => cuGraphLaunch_ptsz,
        "cuGraphUpload" @ 11010 => cuGraphUpload_ptsz,
        "cuMemPrefetchAsync" @ 8000 => cuMemPrefetchAsync_ptsz,
    ]
}
