//! The threads that synchronize a context with a bound on the wait
//! ([`synchronize_current_within`], [`Residency::drain_within`]): one lane per
//! device, started at its first use, so a synchronization stuck on one GPU (its queue
//! waits for a peer) does not hold back another GPU's.

use std::sync::{Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use super::MAX_DEVICES;
use crate::cuda::{CUcontext, CUresult, CUDA_SUCCESS};
use crate::real::call_real as call;

#[derive(Default)]
struct State {
    /// The context to synchronize (its address: the driver's handle).
    job: Option<usize>,
    /// Synchronizations asked and finished; the last one's result.
    asked: u64,
    done: u64,
    result: CUresult,
}

struct Lane {
    state: Mutex<State>,
    changed: Condvar,
    started: OnceLock<bool>,
}

static LANES: [Lane; MAX_DEVICES] = [const {
    Lane {
        state: Mutex::new(State {
            job: None,
            asked: 0,
            done: 0,
            result: CUDA_SUCCESS,
        }),
        changed: Condvar::new(),
        started: OnceLock::new(),
    }
}; MAX_DEVICES];

fn lock(lane: &Lane) -> std::sync::MutexGuard<'_, State> {
    lane.state.lock().unwrap_or_else(|p| p.into_inner())
}

/// Synchronizes `ctx` (a context on device `d`) on `d`'s lane, waiting at most
/// `limit`; `Ok(false)`: not finished in time, or an earlier synchronization on
/// the lane is still running (it is waited for within the limit, and counts as
/// this one not finished). `None` when no thread could be started: the caller
/// waits itself.
pub(super) fn drain(d: usize, ctx: CUcontext, limit: Duration) -> Option<Result<bool, CUresult>> {
    let lane: &'static Lane = LANES.get(d)?;
    let started = *lane.started.get_or_init(|| {
        std::thread::Builder::new()
            .name("kiwi-drainer".into())
            .spawn(move || run(lane))
            .is_ok()
    });
    if !started {
        return None;
    }
    let deadline = Instant::now() + limit;
    let mut s = lock(lane);
    let own = s.done == s.asked;
    if own {
        s.job = Some(ctx as usize);
        s.asked += 1;
        lane.changed.notify_all();
    }
    let want = s.asked;
    while s.done < want {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Some(Ok(false));
        }
        s = lane
            .changed
            .wait_timeout(s, left)
            .unwrap_or_else(|p| p.into_inner())
            .0;
    }
    Some(match s.result {
        _ if !own => Ok(false),
        CUDA_SUCCESS => Ok(true),
        e => Err(e),
    })
}

fn run(lane: &'static Lane) {
    loop {
        let ctx = {
            let mut s = lock(lane);
            loop {
                if let Some(c) = s.job.take() {
                    break c;
                }
                s = lane.changed.wait(s).unwrap_or_else(|p| p.into_inner());
            }
        };
        let r = crate::ffi::inside(|| {
            call!(cuCtxSetCurrent: fn(CUcontext)(ctx as CUcontext))?;
            let r = call!(cuCtxSynchronize: fn()());
            let _ = call!(cuCtxSetCurrent: fn(CUcontext)(std::ptr::null_mut()));
            r
        });
        let mut s = lock(lane);
        s.result = r.err().unwrap_or(CUDA_SUCCESS);
        s.done = s.asked;
        lane.changed.notify_all();
    }
}
