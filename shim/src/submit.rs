//! What a work submission (a `submit` export, [`crate::exports`]) does: the fast path
//! through the open gate ([`crate::gate`]), inlined into every wrapper, and the slow
//! path when it is closed: a submission into a capturing stream ([`crate::capture`])
//! is recorded by the driver, not run, so it goes straight through; any other waits
//! for this process's turn ([`crate::client`]). While a GPU is held the queue bound
//! waits for the queue here (`drain_queue`), never while a stream captures.

use std::sync::atomic::Ordering;

use crate::cuda::{CUresult, CUDA_ERROR_OUT_OF_MEMORY};
use crate::gate::{GATE, QUEUE_BOUND, THROTTLE};

/// Runs the driver call `f` once this process may submit work.
/// `stream` names the stream the work goes to (read only on the slow path: a
/// submission into a capturing stream is recorded by the driver, so it neither waits
/// for the turn nor counts toward the queue bound).
#[inline(always)]
pub fn submit(
    name: &'static str,
    stream: impl FnOnce() -> Option<crate::capture::StreamArg>,
    mut f: impl FnMut() -> CUresult,
) -> CUresult {
    if GATE.try_enter() {
        return run_admitted(name, &mut f);
    }
    submit_slow(name, stream, f)
}

/// Runs `f` once the gate admitted it (the caller entered) and leaves the gate: a
/// launch the driver found no room for waits for room ([`crate::room`]), and while a
/// GPU is held the queue bound counts the submission.
#[inline(always)]
fn run_admitted(name: &'static str, f: &mut impl FnMut() -> CUresult) -> CUresult {
    let r = f();
    GATE.exit();
    if r == CUDA_ERROR_OUT_OF_MEMORY {
        return crate::room::launch_out_of_memory(name, r, f);
    }
    if THROTTLE.load(Ordering::Relaxed) {
        QUEUE_BOUND.after_submit(drain_queue);
    }
    r
}

#[cold]
#[inline(never)]
fn submit_slow(
    name: &'static str,
    stream: impl FnOnce() -> Option<crate::capture::StreamArg>,
    mut f: impl FnMut() -> CUresult,
) -> CUresult {
    // Any submission voids the application's discards (it may write the range), even
    // one that only waits now: it runs after the swap-in, and must find its bytes.
    GATE.note_slow();
    // Only over resident memory: the driver checks a copy's or memset's pointers when
    // it records them, so a capture over swapped-out memory waits for the turn.
    if crate::capture::is_captured(stream()) && crate::devices::all_resident() {
        // Recorded into a capture, not run: nothing reaches the GPU, so no turn is
        // needed (a drop waits for the capture to end) and the queue does not grow.
        return crate::ffi::guarded(name, &mut f);
    }
    crate::ffi::guarded(name, || loop {
        // The first submission after a pause the client watches (`Gate::pause`).
        if GATE.resume() {
            crate::client::resumed();
            continue;
        }
        // Open for some GPUs only (the process has contexts on GPUs it does not use):
        // the work goes to the calling thread's current context's device.
        // No current context: it needs every turn ([`crate::client::ANY_DEVICE`]).
        let device = GATE
            .partial()
            .then(|| crate::devices::current_device().unwrap_or(crate::client::ANY_DEVICE));
        if device.is_some_and(|d| GATE.try_enter_device(d)) {
            return run_admitted(name, &mut f);
        }
        crate::stats::SLOW_SUBMITS.fetch_add(1, Ordering::Relaxed);
        if let Err(code) = crate::client::acquire(&GATE, device) {
            crate::kdebug!("{name}: refused with CUDA error {code}");
            return code;
        }
        if GATE.try_enter() || device.is_some_and(|d| GATE.try_enter_device(d)) {
            let r = f();
            GATE.exit();
            return crate::room::launch_out_of_memory(name, r, &mut f);
        }
    })
}

/// The queue bound's wait: the calling thread's context's queued work. False when it
/// could not wait (a stream captures) or did not wait to the end (a process on
/// several GPUs waits at most [`MULTI_GPU_BOUND_WAIT`]: its queue may wait for what
/// this thread submits next, [`crate::devices::synchronize_current_within`]); such a
/// wait is not timed.
/// How long the queue bound waits in a process on several GPUs. Short: the thread
/// waits between two of its submissions, and a drop that lands meanwhile closes the
/// gate before the second, on which the first GPU's queue may wait (its drain would
/// then wait for work the gate holds back).
const MULTI_GPU_BOUND_WAIT: std::time::Duration = std::time::Duration::from_millis(2);

fn drain_queue() -> bool {
    // An error here (a broken context) reaches the application on its own next
    // synchronizing call; the bound only waits. Never while a stream captures:
    // the driver would refuse and invalidate the capture (the bound resumes after).
    let limit = MULTI_GPU_BOUND_WAIT;
    let mut whole = true;
    let r = crate::capture::sync_unless_capturing(|| {
        crate::devices::synchronize_current_within(limit).map(|done| whole = done)
    });
    r.is_some() && whole
}
