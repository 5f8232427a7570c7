//! The pinning thread: page-locks the host buffers of the next swap-outs ahead,
//! one step at a time, outside every lock the critical path takes.

use super::*;

impl Client {
    /// Starts the pinning thread, once per process.
    pub(super) fn start_pinning(self: &Arc<Self>) {
        if self.pin_started.set(()).is_err() {
            return;
        }
        let c = self.clone();
        if let Err(e) = std::thread::Builder::new()
            .name("kiwi-pin".into())
            .spawn(move || c.pin_loop())
        {
            crate::kwarn!("cannot start the shim's pinning thread ({e}): swap buffers are pinned when a swap needs them");
        }
    }

    /// The working set on GPU `d` grew: where someone may ask for the GPU (shared or
    /// oversubscribed), the pinning thread prepares the new memory's buffers now,
    /// not at its next look ([`PIN_RECHECK`] later): a notebook that grew may be
    /// asked for the GPU 100 ms later (issue #28).
    pub fn grew(&self, d: usize) {
        if self
            .turn_for(d)
            .is_some_and(|t| t.shared.load(Ordering::Relaxed) || t.pressure.load(Ordering::Relaxed))
        {
            self.wake_pinning();
        }
    }

    /// Tells the pinning thread that a turn's target changed.
    pub(super) fn wake_pinning(&self) {
        *lock(&self.pin_work) = true;
        self.pin_cv.notify_one();
    }

    /// The pinning thread: prepares the pinned host buffers each turn's next swap-out
    /// needs, one [`PIN_STEP`] at a time over the turns, holding none of the shim's
    /// locks while it pins (page-locking runs at a few GB/s). It has its own thread so
    /// that a turn's thread (early releases, drops, grants) never waits behind it.
    /// While some turn has a target it looks again every [`PIN_RECHECK`]: the working
    /// set grows, a swap-in turns buffers back into spares.
    pub(super) fn pin_loop(&self) {
        // Pinning is a potentially unsafe call: relaxed, it never invalidates the
        // application's captures.
        crate::capture::relax_this_thread();
        loop {
            let busy = self.turns().any(|t| {
                t.pressure.load(Ordering::Relaxed)
                    || t.shared.load(Ordering::Relaxed)
                    || t.pin_target.load(Ordering::Relaxed) > 0
            });
            {
                let mut w = lock(&self.pin_work);
                if !*w {
                    let wait = if busy {
                        PIN_RECHECK
                    } else {
                        Duration::from_secs(3600)
                    };
                    w = self
                        .pin_cv
                        .wait_timeout(w, wait)
                        .unwrap_or_else(|p| p.into_inner())
                        .0;
                }
                *w = false;
            }
            loop {
                let mut more = false;
                for turn in self.turns() {
                    more |= Self::pin_step(turn);
                }
                if !more {
                    break;
                }
                std::thread::yield_now();
            }
        }
    }

    /// One step of pinning ahead for `turn`; returns whether more is left.
    pub(super) fn pin_step(turn: &Turn) -> bool {
        let ahead = turn.pressure.load(Ordering::Acquire) || turn.shared.load(Ordering::Acquire);
        if turn.pin_trim.swap(false, Ordering::AcqRel) && !ahead {
            let n = turn.res.trim_spare_buffers();
            if n > 0 {
                crate::kdebug!(
                    "GPU {}: no longer oversubscribed; freed {n} bytes of spare pinned buffers",
                    turn.info.ordinal
                );
            }
        }
        // Oversubscribed, or shared (someone may ask at any moment): the buffers of
        // a full swap-out, prepared as the working set grows.
        let target = if ahead {
            u64::MAX
        } else {
            turn.pin_target.load(Ordering::Acquire)
        }
        .min(turn.swap_budget.load(Ordering::Relaxed));
        if turn.swapping.load(Ordering::Acquire) > 0 {
            return false;
        }
        // Swapped-out contents in pageable buffers first: the next swap-in wants them
        // pinned. They are registered whatever the target (they exist already).
        match turn.res.register_swapped(PIN_STEP) {
            Ok(0) => {}
            Ok(n) => {
                crate::kdebug!(
                    "GPU {}: registered {n} bytes of swapped-out contents in place",
                    turn.info.ordinal
                );
                stats::REGISTERED_IN_PLACE_BYTES.fetch_add(n, Ordering::Relaxed);
                return true;
            }
            Err(e) => crate::kdebug!(
                "GPU {}: registering swapped-out contents in place failed with CUDA error {e}",
                turn.info.ordinal
            ),
        }
        if target == 0 {
            return false;
        }
        let t = Instant::now();
        match turn.res.prepare_swap_out(target, PIN_STEP) {
            Ok(0) => {
                if turn.pinning.swap(false, Ordering::Relaxed) {
                    crate::kdebug!(
                        "GPU {}: pinning ahead done: the next swap-out's buffers are ready",
                        turn.info.ordinal
                    );
                }
                false
            }
            Ok(n) => {
                turn.pinning.store(true, Ordering::Relaxed);
                crate::kdebug!(
                    "GPU {}: pinned {n} bytes ahead in {:?}",
                    turn.info.ordinal,
                    t.elapsed()
                );
                stats::PINNED_AHEAD_BYTES.fetch_add(n, Ordering::Relaxed);
                true
            }
            Err(e) => {
                crate::kdebug!(
                    "GPU {}: pinning swap buffers ahead failed with CUDA error {e}",
                    turn.info.ordinal
                );
                false
            }
        }
    }
}
