//! The FFI boundary: no panic crosses it, and a thread already inside the shim calls
//! the driver straight through (the driver may call its own exports, which resolve to
//! ours because we are preloaded).

use std::cell::Cell;
use std::panic::{catch_unwind, AssertUnwindSafe};

use crate::cuda::{CUresult, CUDA_ERROR_UNKNOWN};

thread_local! {
    static DEPTH: Cell<u32> = const { Cell::new(0) };
}

/// Whether this thread is already inside a shim hook.
#[inline(always)]
pub fn reentered() -> bool {
    DEPTH.with(|d| d.get() != 0)
}

struct DepthGuard;

impl DepthGuard {
    fn enter() -> Self {
        DEPTH.with(|d| d.set(d.get() + 1));
        DepthGuard
    }
}

impl Drop for DepthGuard {
    fn drop(&mut self) {
        DEPTH.with(|d| d.set(d.get().saturating_sub(1)));
    }
}

/// Runs `f` as the body of export `name`: marked as inside the shim, a panic turned
/// into `CUDA_ERROR_UNKNOWN` and a log line.
pub fn guarded(name: &str, f: impl FnOnce() -> CUresult) -> CUresult {
    let _depth = DepthGuard::enter();
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(p) => {
            let what = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            crate::kerror!("internal error in {name}: {what}; returning CUDA_ERROR_UNKNOWN");
            CUDA_ERROR_UNKNOWN
        }
    }
}

/// Runs `f` marked as inside the shim (the shim's own threads use it around driver calls).
pub fn inside<T>(f: impl FnOnce() -> T) -> T {
    let _depth = DepthGuard::enter();
    f()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn panic_becomes_unknown_and_depth_unwinds() {
        let prev = std::panic::take_hook();
        std::panic::set_hook(Box::new(|_| {}));
        let r = guarded("cuTest", || panic!("boom"));
        std::panic::set_hook(prev);
        assert_eq!(r, CUDA_ERROR_UNKNOWN);
        assert!(!reentered());
        assert_eq!(guarded("cuTest", || if reentered() { 7 } else { 0 }), 7);
        assert!(!reentered());
    }
}
