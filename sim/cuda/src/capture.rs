//! Stream capture, as strict as the real driver. Owns the process-wide list of
//! capture sequences in progress, each thread's capture mode, and the rules that
//! refuse calls during a capture.
//!
//! Sources: **measured** on an H100, driver 580.159.04, with
//! `scripts/gpu-capture-rules.py` (the table in `docs/gpu-validation.md`; a capture
//! begun on a blocking stream, one call made from the capturing thread in `GLOBAL`
//! or `THREAD_LOCAL` capture, or from another thread in `GLOBAL` or `RELAXED` mode);
//! where the table has no row, CUDA C++ Programming Guide, "CUDA Graphs" → "Stream
//! Capture" → "Prohibited and Unhandled Operations" and "Invalidation", and the
//! Driver API reference of `cuStreamBeginCapture`, `cuThreadExchangeStreamCaptureMode`,
//! `cuStreamEndCapture`, `cuStreamIsCapturing`, `cuStreamGetCaptureInfo`. The rules:
//!
//! 1. Querying, synchronizing or asking the flags of a stream being captured
//!    (`cuStreamQuery`, `cuStreamSynchronize`, `cuStreamGetFlags`) is refused in
//!    every mode, from every thread (measured: `cuStreamQuery`, `cuStreamGetFlags`;
//!    synchronizing: Guide). Its priority, context and capture status may be asked.
//! 2. Synchronizing a broader handle that encompasses a capture, the context
//!    (`cuCtxSynchronize`), is refused in every mode (measured; Guide: also while
//!    only a non-blocking stream of the context captures).
//! 3. While a stream not created `CU_STREAM_NON_BLOCKING` is captured, any use of
//!    its context's legacy stream is refused with `CUDA_ERROR_STREAM_CAPTURE_IMPLICIT`
//!    in every mode: enqueuing to it (`cuMemcpyHtoDAsync(.., NULL)`), querying it,
//!    and so every synchronous call (`cuMemcpyDtoH`), which runs on it (measured);
//!    synchronizing it (Guide). `cuStreamIsCapturing` / `cuStreamGetCaptureInfo` of
//!    the legacy stream then fail with that error too but invalidate nothing (Driver
//!    API reference).
//! 4. "Potentially unsafe API calls" are prohibited by the calling thread's capture
//!    mode (`cuThreadExchangeStreamCaptureMode`): in `GLOBAL` mode (the default)
//!    while this thread has a capture not begun `RELAXED` or any thread has a
//!    `GLOBAL` one; in `THREAD_LOCAL` mode only by this thread's own; never in
//!    `RELAXED` mode. Measured: `cuMemAlloc`, `cuMemHostAlloc`, and querying or
//!    synchronizing work that is not being captured (`cuStreamQuery` and
//!    `cuStreamSynchronize` of a stream that does not capture, `cuEventQuery`). By
//!    extension (not measured): `cuEventSynchronize`, `cuMemAllocPitch`,
//!    `cuMemAllocManaged`, `cuMemAllocHost`, `cuMemHostRegister`, and freeing
//!    (`cuMemFree`, `cuMemFreeHost`, `cuMemHostUnregister`; Guide).
//! 5. Querying or synchronizing an event last recorded inside a capture is refused
//!    in every mode (the reference of `cuThreadExchangeStreamCaptureMode`).
//!
//! Allowed in every mode (measured): `cuStreamGetPriority`, `cuStreamGetCtx`,
//! `cuStreamIsCapturing` of the capturing stream; `cuStreamGetFlags` of another;
//! `cuEventRecord` and async copies on a non-blocking stream that does not capture;
//! `cuCtxGetCurrent`, `cuCtxSetCurrent`, `cuCtxGetDevice`, `cuMemGetInfo`,
//! `cuMemCreate`, `cuMemAddressReserve`.
//!
//! Each refused call returns `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED` (rule 3:
//! `CUDA_ERROR_STREAM_CAPTURE_IMPLICIT`) and invalidates the captures it conflicts
//! with ("Invalidation"; measured: the capture's status is `INVALIDATED` after the
//! call): further work on their streams fails with
//! `CUDA_ERROR_STREAM_CAPTURE_INVALIDATED`, and `cuStreamEndCapture` ends them with
//! that error and a NULL graph. Captured work never runs until the graph is launched.

use std::cell::Cell;
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::abi::*;
use crate::exec::{Context, Op, Stream};
use crate::ffi::out;

/// Streams with a capture sequence in progress.
static CAPTURING: Mutex<Vec<Arc<Stream>>> = Mutex::new(Vec::new());
/// `CAPTURING.len()`, read without the lock on every submission.
static ACTIVE: AtomicUsize = AtomicUsize::new(0);
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

thread_local! {
    static THREAD_ID: u64 = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    static THREAD_MODE: Cell<u32> = const { Cell::new(CU_STREAM_CAPTURE_MODE_GLOBAL) };
}

/// Whether any capture is in progress in this process (the cheap first check).
#[inline]
pub fn active() -> bool {
    ACTIVE.load(Ordering::Acquire) > 0
}

fn thread_id() -> u64 {
    THREAD_ID.with(|t| *t)
}

fn capturing() -> std::sync::MutexGuard<'static, Vec<Arc<Stream>>> {
    CAPTURING.lock().unwrap_or_else(|e| e.into_inner())
}

/// Invalidates the captures of `streams` and refuses the call with `code`.
fn refuse(streams: &[Arc<Stream>], code: CUresult) -> Result<(), CUresult> {
    for s in streams {
        s.with_capture(|c| c.invalidated = true);
    }
    Err(code)
}

/// The captures matching `f`, refused with `code` if there is any.
fn refuse_if(code: CUresult, f: impl Fn(&Stream) -> bool) -> Result<(), CUresult> {
    if !active() {
        return Ok(());
    }
    let hit: Vec<Arc<Stream>> = capturing().iter().filter(|s| f(s)).cloned().collect();
    if hit.is_empty() {
        Ok(())
    } else {
        refuse(&hit, code)
    }
}

fn same_context(s: &Stream, ctx: &Context) -> bool {
    std::ptr::eq(Arc::as_ptr(&s.ctx), ctx)
}

/// Rule 1: synchronizing, querying or asking the flags of `st` while it is captured.
pub fn refuse_stream_use(st: &Arc<Stream>) -> Result<(), CUresult> {
    if st.is_capturing() {
        return refuse(
            std::slice::from_ref(st),
            CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
        );
    }
    Ok(())
}

/// Querying or synchronizing `st` (`cuStreamQuery`, `cuStreamSynchronize`): rule 1
/// when it captures; otherwise rule 3 when it is the legacy stream, and rule 4 (it
/// waits for work that is not captured).
pub fn refuse_stream_wait(st: &Arc<Stream>) -> Result<(), CUresult> {
    if !active() {
        return Ok(());
    }
    refuse_stream_use(st)?;
    if st.legacy {
        refuse_legacy(&st.ctx)?;
    }
    refuse_unsafe()
}

/// Rule 2: a call that waits for the whole context.
pub fn refuse_context_wide(ctx: &Context) -> Result<(), CUresult> {
    refuse_if(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, |s| {
        same_context(s, ctx)
    })
}

/// Whether `s` is a blocking stream of `ctx` that captures (rule 3's condition).
fn blocks_legacy(s: &Stream, ctx: &Context) -> bool {
    same_context(s, ctx) && s.flags & CU_STREAM_NON_BLOCKING == 0
}

/// Rule 3: using the legacy stream of `ctx`.
pub fn refuse_legacy(ctx: &Context) -> Result<(), CUresult> {
    refuse_if(CUDA_ERROR_STREAM_CAPTURE_IMPLICIT, |s| {
        blocks_legacy(s, ctx)
    })
}

/// Queues `op` on `stream` of `ctx` (`Context::submit`) after rule 3: work on the
/// legacy stream while another stream of the context captures in global or
/// thread-local mode is refused, and that capture invalidated. A capturing stream
/// records `op` instead.
pub fn submit(ctx: &Context, stream: &Stream, op: Op) -> Result<u64, CUresult> {
    if stream.legacy && !stream.is_capturing() && active() {
        refuse_legacy(ctx)?;
    }
    ctx.submit(stream, op)
}

/// Rule 3 for the capture-status queries of the legacy stream of `ctx`
/// (`cuStreamIsCapturing`, `cuStreamGetCaptureInfo`): refused, nothing invalidated
/// (Driver API reference, `cuStreamIsCapturing`).
pub fn legacy_status_implicit(ctx: &Context) -> Result<(), CUresult> {
    if active() && capturing().iter().any(|s| blocks_legacy(s, ctx)) {
        return Err(CUDA_ERROR_STREAM_CAPTURE_IMPLICIT);
    }
    Ok(())
}

/// Rule 4: a potentially unsafe call (allocation, freeing, waiting for work that is
/// not captured) on this thread.
pub fn refuse_unsafe() -> Result<(), CUresult> {
    if !active() {
        return Ok(());
    }
    let me = thread_id();
    match THREAD_MODE.with(Cell::get) {
        CU_STREAM_CAPTURE_MODE_RELAXED => Ok(()),
        CU_STREAM_CAPTURE_MODE_THREAD_LOCAL => {
            refuse_if(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, |s| {
                s.with_capture(|c| c.thread == me && c.mode != CU_STREAM_CAPTURE_MODE_RELAXED)
                    .unwrap_or(false)
            })
        }
        _ => refuse_if(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, |s| {
            s.with_capture(|c| {
                (c.thread == me && c.mode != CU_STREAM_CAPTURE_MODE_RELAXED)
                    || (c.thread != me && c.mode == CU_STREAM_CAPTURE_MODE_GLOBAL)
            })
            .unwrap_or(false)
        }),
    }
}

/// Rule 5: an event whose last record went into capture `id` (0: none).
pub fn refuse_captured_event(id: u64) -> Result<(), CUresult> {
    if id == 0 {
        return Ok(());
    }
    refuse_if(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, |s| {
        s.with_capture(|c| c.id == id).unwrap_or(false)
    })
}

/// The capture id of `st` if it is capturing (for event records).
pub fn capture_id(st: &Stream) -> u64 {
    if !st.is_capturing() {
        return 0;
    }
    st.with_capture(|c| c.id).unwrap_or(0)
}

/// `cuStreamBeginCapture_v2`.
pub fn begin(st: &Arc<Stream>, mode: u32) -> Result<(), CUresult> {
    if mode > CU_STREAM_CAPTURE_MODE_RELAXED {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let mut list = capturing();
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    if !st.begin_capture(mode, thread_id(), id) {
        return Err(CUDA_ERROR_ILLEGAL_STATE);
    }
    list.push(st.clone());
    ACTIVE.store(list.len(), Ordering::Release);
    Ok(())
}

/// `cuStreamEndCapture`: the captured operations, or the error that ended it.
pub fn end(st: &Arc<Stream>) -> Result<Vec<Op>, CUresult> {
    let mut list = capturing();
    let me = thread_id();
    let wrong_thread = st
        .with_capture(|c| c.mode != CU_STREAM_CAPTURE_MODE_RELAXED && c.thread != me)
        .ok_or(CUDA_ERROR_ILLEGAL_STATE)?;
    if wrong_thread {
        // Driver API reference, cuStreamEndCapture: a sequence not begun RELAXED
        // must be ended by the thread that began it; it stays active.
        return Err(CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD);
    }
    let cap = st.end_capture().ok_or(CUDA_ERROR_ILLEGAL_STATE)?;
    list.retain(|s| !Arc::ptr_eq(s, st));
    ACTIVE.store(list.len(), Ordering::Release);
    if cap.invalidated {
        return Err(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
    }
    Ok(cap.ops)
}

/// (`CU_STREAM_CAPTURE_STATUS_*`, capture id) of `st`.
pub fn status(st: &Stream) -> (i32, u64) {
    if !st.is_capturing() {
        return (CU_STREAM_CAPTURE_STATUS_NONE, 0);
    }
    st.with_capture(|c| {
        let s = if c.invalidated {
            CU_STREAM_CAPTURE_STATUS_INVALIDATED
        } else {
            CU_STREAM_CAPTURE_STATUS_ACTIVE
        };
        (s, c.id)
    })
    .unwrap_or((CU_STREAM_CAPTURE_STATUS_NONE, 0))
}

/// `cuStreamGetCaptureInfo` (all versions). A capture here is linear and its graph
/// exists only once it ends: `graph` is NULL and the dependency set is empty.
pub fn info(
    st: &Stream,
    status_out: *mut i32,
    id_out: *mut u64,
    graph_out: *mut *mut c_void,
    deps_out: *mut *const c_void,
    edges_out: *mut *const c_void,
    count_out: *mut usize,
) -> Result<(), CUresult> {
    let (s, id) = status(st);
    out(status_out, s)?;
    if !id_out.is_null() && s != CU_STREAM_CAPTURE_STATUS_NONE {
        out(id_out, id)?;
    }
    if s != CU_STREAM_CAPTURE_STATUS_ACTIVE {
        return Ok(());
    }
    if !graph_out.is_null() {
        out(graph_out, std::ptr::null_mut())?;
    }
    if !deps_out.is_null() {
        out(deps_out, std::ptr::null())?;
    }
    if !edges_out.is_null() {
        out(edges_out, std::ptr::null())?;
    }
    if !count_out.is_null() {
        out(count_out, 0)?;
    }
    Ok(())
}

/// `cuThreadExchangeStreamCaptureMode`: sets this thread's mode, returns the old one.
pub fn exchange_mode(mode: *mut u32) -> Result<(), CUresult> {
    let new = crate::ffi::read(mode)?;
    if new > CU_STREAM_CAPTURE_MODE_RELAXED {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let old = THREAD_MODE.with(|m| m.replace(new));
    out(mode, old)
}
