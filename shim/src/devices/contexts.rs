//! The application's contexts on each device: which live (every one is drained, not
//! only the newest), what a further one costs as memory no swap frees, the one the
//! shim's threads work in ([`AppContext`]), and the queue bound's wait for the calling
//! thread's context, bounded on a drainer thread where the process spans GPUs.

use super::*;

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
pub(super) fn synchronize_others(d: usize, current: CUcontext) -> Result<(), CUresult> {
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
            Err(CUDA_ERROR_INVALID_CONTEXT | CUDA_ERROR_CONTEXT_IS_DESTROYED) => {
                live().retain(|&(_, l, _)| l != c)
            }
            r => r?,
        }
    }
    Ok(())
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

/// The application's context on a device, current on this thread until dropped; then
/// the thread's own context is current again. Swaps and drains run on the shim's
/// threads and on application threads waiting for their turn: an application thread
/// must find the context it had (its next launch goes to that context's device).
pub(super) struct AppContext {
    previous: CUcontext,
    switched: bool,
}

impl AppContext {
    /// `None` when the device has no context yet.
    pub(super) fn enter(d: usize) -> Option<AppContext> {
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
