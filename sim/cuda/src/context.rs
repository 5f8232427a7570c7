//! Contexts as the API sees them: primary contexts (retain, release, reset, state,
//! flags), created contexts, each thread's current context, synchronization and
//! limits. Bodies of the exports `crate::exports` lists; the executors are
//! `crate::exec`'s.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::abi::*;
use crate::capture;
use crate::driver::{self, driver, Driver};
use crate::exec::Context;
use crate::ffi::out;

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

/// `cuDevicePrimaryCtxRelease` and its `_v2`.
pub(crate) fn primary_release(dev: CUdevice) -> Result<(), CUresult> {
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

/// `cuDevicePrimaryCtxReset` and its `_v2`.
pub(crate) fn primary_reset(dev: CUdevice) -> Result<(), CUresult> {
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

/// `cuDevicePrimaryCtxGetState`.
pub(crate) fn primary_state(
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

/// `cuDevicePrimaryCtxSetFlags_v2`.
pub(crate) fn primary_set_flags(dev: CUdevice, flags: u32) -> Result<(), CUresult> {
    let d = driver()?;
    let g = d.device(dev)?;
    d.primary[g as usize]
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .flags = flags;
    Ok(())
}

/// `cuCtxCreate_v2`: a new context, current on this thread.
pub(crate) fn create(pctx: *mut CUcontext, flags: u32, dev: CUdevice) -> Result<(), CUresult> {
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

/// `cuCtxDestroy_v2` (a primary context cannot be destroyed).
pub(crate) fn destroy(ctx: CUcontext) -> Result<(), CUresult> {
    let d = driver()?;
    let c = d.context(ctx as usize)?;
    if c.primary {
        return Err(CUDA_ERROR_INVALID_CONTEXT);
    }
    c.wait_all();
    c.clear_local_storage();
    d.drop_modules_of(c.handle());
    c.destroyed.store(true, Ordering::Release);
    d.contexts.remove(ctx as usize);
    d.streams.retain(|s| !Arc::ptr_eq(&s.ctx, &c));
    c.shut_down();
    d.mem.free_owned_by(ctx as usize);
    c.release_limits();
    d.uncharge_context(c.device, &c.charged);
    driver::forget_current(ctx as usize);
    Ok(())
}

/// `cuCtxSetCurrent` (NULL: none).
pub(crate) fn set_current(ctx: CUcontext) -> Result<(), CUresult> {
    let d = driver()?;
    if ctx.is_null() {
        driver::set_current(None);
        return Ok(());
    }
    driver::set_current(Some(d.context(ctx as usize)?));
    Ok(())
}

/// `cuCtxGetCurrent`.
pub(crate) fn get_current(pctx: *mut CUcontext) -> Result<(), CUresult> {
    driver()?;
    out(pctx, driver::current_handle() as CUcontext)
}

/// `cuCtxPushCurrent_v2`.
pub(crate) fn push_current(ctx: CUcontext) -> Result<(), CUresult> {
    let c = driver()?.context(ctx as usize)?;
    driver::push_current(c);
    Ok(())
}

/// `cuCtxPopCurrent_v2`.
pub(crate) fn pop_current(pctx: *mut CUcontext) -> Result<(), CUresult> {
    driver()?;
    let c = driver::pop_current().ok_or(CUDA_ERROR_INVALID_CONTEXT)?;
    if !pctx.is_null() {
        out(pctx, c.handle() as CUcontext)?;
    }
    Ok(())
}

/// `cuCtxSynchronize`.
pub(crate) fn synchronize() -> Result<(), CUresult> {
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

/// `cuCtxGetDevice`.
pub(crate) fn device(dev: *mut CUdevice) -> Result<(), CUresult> {
    driver()?;
    out(dev, driver::current_unchecked()?.device as CUdevice)
}

/// `cuCtxGetFlags`.
pub(crate) fn flags(flags: *mut u32) -> Result<(), CUresult> {
    driver()?;
    out(flags, driver::current_unchecked()?.flags)
}

/// `cuCtxGetApiVersion` of `ctx` (NULL: the current one).
pub(crate) fn api_version(ctx: CUcontext, version: *mut u32) -> Result<(), CUresult> {
    let d = driver()?;
    if !ctx.is_null() {
        d.context(ctx as usize)?;
    } else {
        driver::current_unchecked()?;
    }
    out(version, 3020)
}

/// `cuCtxGetStreamPriorityRange`: 0 (least) to -5 (greatest); either may be NULL.
pub(crate) fn stream_priority_range(least: *mut i32, greatest: *mut i32) -> Result<(), CUresult> {
    driver()?;
    if !least.is_null() {
        out(least, 0)?;
    }
    if !greatest.is_null() {
        out(greatest, -5)?;
    }
    Ok(())
}

/// `cuCtxGetLimit`.
pub(crate) fn limit(value: *mut usize, limit: u32) -> Result<(), CUresult> {
    driver()?;
    let ctx = driver::current_unchecked()?;
    out(value, ctx.limit(limit)? as usize)
}

/// `cuCtxSetLimit`.
pub(crate) fn set_limit(limit: u32, value: usize) -> Result<(), CUresult> {
    driver()?;
    driver::current_unchecked()?.set_limit(limit, value as u64)
}
