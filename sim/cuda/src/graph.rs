//! Stream capture and graphs as the API sees them: beginning and ending a capture,
//! asking about it, each thread's capture mode, and instantiating, launching and
//! destroying the captured graphs. Bodies of the exports `crate::exports` lists; the
//! capture rules are `crate::capture`'s.

use std::ffi::c_void;
use std::sync::Arc;

use crate::abi::*;
use crate::capture;
use crate::driver::driver;
use crate::exec::{Op, Stream};
use crate::ffi::out;
use crate::stream::{enqueue, Issue};

/// The stream a capture call names: the legacy stream cannot be captured; the
/// per-thread stream can (NULL means it through a `_ptsz` entry point).
fn capturable(s: CUstream, pt: bool) -> Result<Arc<Stream>, CUresult> {
    if s as usize == CU_STREAM_LEGACY || s.is_null() && !pt {
        return Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    }
    driver()?.stream(s, pt)
}

/// `cuStreamBeginCapture_v2`.
pub(crate) fn begin_capture(s: CUstream, mode: u32, pt: bool) -> Result<(), CUresult> {
    capture::begin(&capturable(s, pt)?, mode)
}

/// `cuStreamEndCapture`: the captured operations become a graph.
pub(crate) fn end_capture(s: CUstream, graph: *mut *mut c_void, pt: bool) -> Result<(), CUresult> {
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
    let h = d.graphs.add(Arc::new(ops));
    out(graph, h as *mut c_void)
}

/// The stream whose capture status is asked: the legacy stream's is refused while
/// a blocking stream of its context captures (capture rule 3).
fn asked(s: CUstream, pt: bool) -> Result<Arc<Stream>, CUresult> {
    let st = driver()?.stream(s, pt)?;
    if st.legacy {
        capture::legacy_status_implicit(&st.ctx)?;
    }
    Ok(st)
}

/// `cuStreamIsCapturing`.
pub(crate) fn is_capturing(s: CUstream, status: *mut i32, pt: bool) -> Result<(), CUresult> {
    let st = asked(s, pt)?;
    out(status, capture::status(&st).0)
}

/// `cuStreamGetCaptureInfo` (its v1, `_v2` and `_v3`: what a version does not take
/// is NULL).
#[allow(clippy::too_many_arguments)]
pub(crate) fn capture_info(
    s: CUstream,
    status: *mut i32,
    id: *mut u64,
    graph: *mut *mut c_void,
    deps: *mut *const c_void,
    edges: *mut *const c_void,
    count: *mut usize,
    pt: bool,
) -> Result<(), CUresult> {
    let st = asked(s, pt)?;
    capture::info(&st, status, id, graph, deps, edges, count)
}

/// `cuThreadExchangeStreamCaptureMode`.
pub(crate) fn exchange_mode(mode: *mut u32) -> Result<(), CUresult> {
    driver()?;
    capture::exchange_mode(mode)
}

/// `cuGraphInstantiateWithFlags`.
pub(crate) fn instantiate(exec: *mut *mut c_void, graph: *mut c_void) -> Result<(), CUresult> {
    let d = driver()?;
    if exec.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let g = d
        .graphs
        .get(graph as usize)
        .ok_or(CUDA_ERROR_INVALID_VALUE)?;
    // An executable graph is a snapshot: later changes to the graph do not
    // reach it (there are none here, graphs are immutable captures).
    let h = d.graph_execs.add(Arc::new(g.as_ref().clone()));
    out(exec, h as *mut c_void)
}

fn graph_exec(exec: *mut c_void) -> Result<Arc<Vec<Op>>, CUresult> {
    driver()?
        .graph_execs
        .get(exec as usize)
        .ok_or(CUDA_ERROR_INVALID_VALUE)
}

/// `cuGraphLaunch`: replays a graph's operations on `stream`, in capture order.
pub(crate) fn launch(exec: *mut c_void, stream: CUstream, pt: bool) -> Result<(), CUresult> {
    let ops = graph_exec(exec)?;
    let d = driver()?;
    let st = d.stream(stream, pt)?;
    st.ctx.check()?;
    for op in ops.iter() {
        capture::submit(&st.ctx, &st, op.clone())?;
    }
    Ok(())
}

/// `cuGraphUpload`: nothing to upload; keeps its place in stream order only.
pub(crate) fn upload(exec: *mut c_void, stream: CUstream, pt: bool) -> Result<(), CUresult> {
    graph_exec(exec)?;
    enqueue(Issue::Async(stream), Op::Nop, pt)
}

/// `cuGraphExecDestroy`.
pub(crate) fn exec_destroy(exec: *mut c_void) -> Result<(), CUresult> {
    driver()?
        .graph_execs
        .remove(exec as usize)
        .map(drop)
        .ok_or(CUDA_ERROR_INVALID_VALUE)
}

/// `cuGraphDestroy`.
pub(crate) fn destroy(graph: *mut c_void) -> Result<(), CUresult> {
    driver()?
        .graphs
        .remove(graph as usize)
        .map(drop)
        .ok_or(CUDA_ERROR_INVALID_VALUE)
}
