//! Streams and events as the API sees them: creating, destroying, synchronizing and
//! querying them, waits between them, callbacks, the stream memory operations'
//! submission, and [`enqueue`], the way every stream-ordered call of the other API
//! areas queues its work on a stream handle. Bodies of the exports `crate::exports`
//! lists; the executors are `crate::exec`'s.

use std::ffi::c_void;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use crate::abi::*;
use crate::capture;
use crate::driver::{self, driver, Driver};
use crate::exec::{Context, Event, EventState, Op, Stream};
use crate::ffi::{out, read};
use crate::memop::{self, Api, MemOp, Submitter};

/// How a stream-ordered call runs: synchronous calls run on the NULL stream (the
/// legacy or, through a `_ptds` export, the per-thread default stream) and return
/// once it ran; `…Async` calls queue on their stream and return.
#[derive(Clone, Copy)]
pub enum Issue {
    Sync,
    Async(CUstream),
}

/// Queues `op` on the stream `on` names (`pt`: a NULL stream is the per-thread
/// default stream) and, for synchronous calls, waits for it.
pub(crate) fn enqueue(on: Issue, op: Op, pt: bool) -> Result<(), CUresult> {
    let (stream, sync) = match on {
        Issue::Sync => (std::ptr::null_mut(), true),
        Issue::Async(s) => (s, false),
    };
    let d = driver()?;
    let s = d.stream(stream, pt)?;
    s.ctx.check()?;
    if sync {
        // A synchronous call on a capturing (per-thread) stream; the legacy
        // stream's rule is checked at submission.
        capture::refuse_stream_use(&s)?;
    }
    let seq = capture::submit(&s.ctx, &s, op)?;
    if sync {
        s.ctx.wait_for(s.lane, seq);
        s.ctx.check()?;
    }
    Ok(())
}

// ---------------------------------------------------------------- streams

/// `cuStreamCreate` (priority 0) and `cuStreamCreateWithPriority`.
pub(crate) fn create(ph: *mut CUstream, flags: u32, priority: i32) -> Result<(), CUresult> {
    let d = driver()?;
    let ctx = driver::current()?;
    if ph.is_null() || flags & !CU_STREAM_NON_BLOCKING != 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let h = d
        .streams
        .add(Arc::new(Stream::new(ctx, flags, priority.clamp(-5, 0))));
    out(ph, h as CUstream)
}

/// `cuStreamDestroy_v2`: pending work still completes; the handle is gone at once.
pub(crate) fn destroy(s: CUstream) -> Result<(), CUresult> {
    driver()?
        .streams
        .remove(s as usize)
        .map(drop)
        .ok_or(CUDA_ERROR_INVALID_HANDLE)
}

/// `cuStreamSynchronize`.
pub(crate) fn synchronize(s: CUstream, pt: bool) -> Result<(), CUresult> {
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

/// `cuStreamQuery`.
pub(crate) fn query(s: CUstream, pt: bool) -> Result<(), CUresult> {
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

/// `cuStreamWaitEvent`: later work on `s` waits for the event's last record.
pub(crate) fn wait_event(s: CUstream, e: CUevent, pt: bool) -> Result<(), CUresult> {
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
    capture::submit(&st.ctx, &st, Op::WaitFor { ctx, lane, seq }).map(|_| ())
}

/// `cuStreamAddCallback` (`flags` must be 0).
pub(crate) fn add_callback(
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
    let st = driver()?.stream(s, pt)?;
    let op = Op::Callback {
        f,
        stream: s as usize,
        data: data as usize,
    };
    capture::submit(&st.ctx, &st, op).map(|_| ())
}

/// `cuStreamGetFlags`.
pub(crate) fn flags(s: CUstream, flags: *mut u32) -> Result<(), CUresult> {
    let st = driver()?.stream(s, false)?;
    // Refused on a capturing stream, and the capture invalidated (capture rule 1,
    // measured on an H100).
    capture::refuse_stream_use(&st)?;
    out(flags, st.flags)
}

/// `cuStreamGetPriority`.
pub(crate) fn priority(s: CUstream, prio: *mut i32) -> Result<(), CUresult> {
    out(prio, driver()?.stream(s, false)?.priority)
}

/// `cuStreamGetCtx`.
pub(crate) fn context(s: CUstream, pctx: *mut CUcontext) -> Result<(), CUresult> {
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

/// What a single stream memory operation does with its word.
#[derive(Clone, Copy)]
pub enum ValueOp {
    /// `cuStreamWaitValue32/64`: wait until it meets the condition `flags` name.
    Wait,
    /// `cuStreamWriteValue32/64`: store `value`.
    Write,
}

/// `cuStreamWaitValue32/64`, `cuStreamWriteValue32/64` (`wide`: 64), v1 and `_v2`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn value_op(
    what: ValueOp,
    stream: CUstream,
    addr: CUdeviceptr,
    value: u64,
    flags: u32,
    wide: bool,
    api: Api,
    pt: bool,
) -> Result<(), CUresult> {
    memops(stream, pt, api, |d, by| {
        match what {
            ValueOp::Wait => memop::wait(&d.mem, by, addr, value, flags, wide),
            ValueOp::Write => memop::write(&d.mem, by, addr, value, flags, wide, api),
        }
        .map(Op::MemOp)
    })
}

/// `cuStreamBatchMemOp`, v1 and `_v2`: 1 to 255 operations ("Must be less than
/// 256"), `flags` 0; every entry is checked before any is queued, so a refused batch
/// queues nothing.
pub(crate) fn batch_mem_op(
    stream: CUstream,
    count: u32,
    params: *mut CUstreamBatchMemOpParams,
    flags: u32,
    api: Api,
    pt: bool,
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

// ---------------------------------------------------------------- events

/// `cuEventCreate`.
pub(crate) fn event_create(ph: *mut CUevent, flags: u32) -> Result<(), CUresult> {
    let d = driver()?;
    driver::current()?;
    if ph.is_null() || flags & !0x7 != 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let h = d.events.add(Arc::new(Event {
        flags,
        state: Mutex::new(EventState::default()),
    }));
    out(ph, h as CUevent)
}

/// `cuEventDestroy_v2`.
pub(crate) fn event_destroy(e: CUevent) -> Result<(), CUresult> {
    driver()?
        .events
        .remove(e as usize)
        .map(drop)
        .ok_or(CUDA_ERROR_INVALID_HANDLE)
}

/// `cuEventRecord`, `cuEventRecordWithFlags`.
pub(crate) fn event_record(e: CUevent, s: CUstream, pt: bool) -> Result<(), CUresult> {
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
    let got = capture::submit(
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

/// `cuEventQuery`.
pub(crate) fn event_query(e: CUevent) -> Result<(), CUresult> {
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

/// `cuEventSynchronize`.
pub(crate) fn event_synchronize(e: CUevent) -> Result<(), CUresult> {
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

/// When an event's last record completed (0: not yet); an event never recorded is
/// `CUDA_ERROR_INVALID_HANDLE`.
fn recorded_at(ev: &Event) -> Result<u64, CUresult> {
    let g = ev.state.lock().unwrap_or_else(|e| e.into_inner());
    if g.ctx.is_none() {
        return Err(CUDA_ERROR_INVALID_HANDLE);
    }
    Ok(g.time_ns)
}

/// `cuEventElapsedTime` and its `_v2`.
pub(crate) fn elapsed_time(ms: *mut f32, start: CUevent, end: CUevent) -> Result<(), CUresult> {
    let d = driver()?;
    let (a, b) = (d.event(start)?, d.event(end)?);
    if (a.flags | b.flags) & CU_EVENT_DISABLE_TIMING != 0 {
        return Err(CUDA_ERROR_INVALID_HANDLE);
    }
    let (ta, tb) = (recorded_at(&a)?, recorded_at(&b)?);
    if ta == 0 || tb == 0 {
        return Err(CUDA_ERROR_NOT_READY);
    }
    out(ms, (tb as f64 - ta as f64) as f32 / 1e6)
}
