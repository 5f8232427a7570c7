//! The idle detector: a held turn's periodic duties (usage reports, the retry of a
//! swap-in short of room) and its early release when the process idles while others
//! wait, with the idle threshold learned from the process's own pauses
//! ([`crate::idle`]); the idle eviction of a holder alone on an oversubscribed GPU.

use super::*;

/// A drain that took this long waited for work: the queue ran dry as it returned.
const MIN_WAITED_DRAIN: Duration = Duration::from_millis(1);
/// How long the idle detector waits for a submission's driver call to return before
/// its drain; longer, it looks again at the next tick.
const SETTLE_MAX: Duration = Duration::from_millis(5);

impl Client {
    /// Periodic duties of turn `k`: usage reports (batched), the retry of a swap-in
    /// short of room, and the early release of an idle holder.
    ///
    /// Idle means nothing submitted *and* the queued work done, for `KIWI_IDLE_MS`.
    /// The submission count says the first. Once it stopped moving between two looks,
    /// a drain (with the gate open: the application may go on) says the second, and
    /// when: the work was done by the drain's end, and the idle clock runs from there.
    /// A submission during the drain, a thread waiting in the queue bound or a capture
    /// in progress means busy. No timing threshold: a drain that a loaded machine slows
    /// down only starts the clock as much later, and it is taken once per quiet period.
    /// The drain starts only once no submission is in its driver call (counted on
    /// entry, its work perhaps not queued yet): a drain started before could return
    /// before that work exists, and the release that followed skipped its drain and
    /// swapped out memory under it (a runtime program's graph launch,
    /// `tests/tests/cudart.rs`, failed with `cudaErrorIllegalAddress` in 3 of 33 local
    /// runs). It waits for such a call to return rather than give up the look
    /// (treating it as busy cost the learner pauses: `handoff.rs`'s
    /// `a_holder_with_short_pauses_releases_before_idle_ms` then failed 2 runs of 5).
    pub(super) fn tick(&self, k: usize) {
        let mut st = lock(&self.state);
        let subs = self.gate.submissions();
        let moved = subs != st.idle_mark || crate::gate::QUEUE_BOUND.syncing();
        st.idle_mark = subs;
        if moved {
            let now = Instant::now();
            st.quiet_since = now;
            self.learn_pauses(&mut st, subs, now, false);
        }
        if st.slots[k].ts.phase == Phase::Holding && st.slots[k].ts.short_since.is_some() {
            self.retry_short(&mut st, k);
        }
        let turn = st.slots[k].turn.clone();
        // A thread waiting for room (`crate::room`) is not idle: the arbiter is making
        // room for it (a large reclaim can take seconds). The idle clock starts anew
        // when the wait ends, as after a submission.
        let room_waits = turn.room_waits();
        if room_waits != st.slots[k].ts.room_mark || turn.waits_for_room() {
            st.slots[k].ts.room_mark = room_waits;
            st.slots[k].ts.work_done = None;
        }
        let ts = &st.slots[k].ts;
        // Once the submission count stopped moving, a drain says whether the work is
        // done, and when: the idle clock of an early release runs from there, and the
        // pause that follows is learned (see `learn_pauses`). Whoever waits, while the
        // threshold is learned; with a fixed one (`KIWI_IDLE_MIN_MS` at or above
        // `KIWI_IDLE_MS`), only while others wait and an early release can still come
        // before the quantum ends, and, nobody waiting, once quiet for the idle period
        // (so that a holder idle long before anyone asks releases at once when
        // someone does).
        let threshold = self.idle_threshold(&st);
        let learning = self.env.idle_min < self.env.idle;
        let before_quantum_end = ts
            .quantum_end
            .is_none_or(|end| Instant::now() + threshold < end);
        // A thread of the holder waiting for room for memory no swap frees
        // (`crate::room`) is not idle: the arbiter is making room for it.
        if ts.phase == Phase::Holding
            && ts.short_since.is_none()
            && !turn.waits_for_room()
            && !moved
            && ts.work_done.map(|w| w.0) != Some(subs)
            && (learning
                || (ts.contended > 0 && before_quantum_end)
                || st.quiet_since.elapsed() >= self.env.idle)
        {
            // Not under the state lock: a drop or a waiting thread must not wait for it.
            let bounded = st.bounded(k);
            drop(st);
            let settled = self.gate.wait_no_call_in_flight(SETTLE_MAX);
            let capturing = crate::capture::active();
            let start = Instant::now();
            // A queue that may wait for another GPU's work is looked at, not waited
            // for: not done within the slice is busy.
            let mut whole = true;
            let r = if bounded {
                turn.res.drain_within(PEER_SLICE).map(|w| whole = w)
            } else {
                turn.res.drain()
            };
            let end = Instant::now();
            st = lock(&self.state);
            match r {
                // The application destroyed its context, or the driver is shutting
                // down (at exit): nothing is left to drain, and nothing to say.
                Err(
                    crate::cuda::CUDA_ERROR_CONTEXT_IS_DESTROYED
                    | crate::cuda::CUDA_ERROR_DEINITIALIZED,
                ) => {}
                // Not seen done: the release drains again (and evicts nothing if that
                // fails too, see drain_then_evict).
                Err(e) => crate::kwarn!("draining an idle holder failed with CUDA error {e}"),
                Ok(()) => {}
            }
            let quiet = settled
                && r.is_ok()
                && whole
                && self.gate.submissions() == subs
                && !crate::gate::QUEUE_BOUND.syncing()
                && !capturing
                && !crate::capture::active();
            if quiet && st.slots[k].ts.phase == Phase::Holding {
                st.slots[k].ts.work_done = Some((subs, end));
                // Learn to the microsecond when this pause ends.
                self.gate.pause();
            } else if settled
                && r.is_ok()
                && whole
                && st.slots[k].ts.phase == Phase::Holding
                && self.gate.submissions() != subs
                && end - start >= MIN_WAITED_DRAIN
            {
                // The drain waited for the work, so the queue ran dry as it returned,
                // and the process had submitted again by now: a pause of at most this
                // (a loop that resubmits at once is seen here, not by the gate).
                let now = Instant::now();
                let gap = now - end;
                crate::kdebug!("a pause of at most {gap:?} ended");
                st.pauses.pause(gap, now);
            }
        }
        let ts = &st.slots[k].ts;
        if let (Phase::Holding, Some((mark, done))) = (ts.phase, ts.work_done) {
            let idle = done.elapsed();
            if ts.contended > 0
                && st.want == 0
                && !turn.waits_for_room()
                && mark == self.gate.submissions()
                && idle >= threshold
            {
                crate::kinfo!(
                    "GPU {}: idle for {idle:?} (threshold {threshold:?}) while {} wait: releasing early",
                    turn.info.ordinal,
                    ts.contended
                );
                let need = ts.contended_need;
                st.released_idle = Some((mark, done));
                self.give_back(&mut st, k, need, true, false);
                drop(st);
                self.cv.notify_all();
                return;
            }
            // Alone on an oversubscribed GPU and idle past the arbiter's idle eviction
            // delay: give it back with everything swapped out, while nobody waits, so
            // the next notebook that asks pays only its own swap-in.
            if let Some(evict_after) = ts.idle_evict {
                if ts.contended == 0
                    && st.want == 0
                    && mark == self.gate.submissions()
                    && idle >= evict_after
                {
                    crate::kinfo!(
                        "GPU {}: idle for {idle:?} on an oversubscribed GPU: swapping out and giving it back ahead of the next request",
                        turn.info.ordinal
                    );
                    self.give_back(&mut st, k, u64::MAX, true, false);
                    drop(st);
                    self.cv.notify_all();
                    return;
                }
            }
        }
        Self::report(&turn, &mut st.slots[k].ts);
    }

    /// How long a contended holder must be idle before it releases early: learned
    /// from the process's pauses (`crate::idle`), between `KIWI_IDLE_MIN_MS` and
    /// `KIWI_IDLE_MS`.
    fn idle_threshold(&self, st: &State) -> Duration {
        st.pauses
            .threshold(Instant::now(), self.env.idle_min, self.env.idle)
    }

    /// The submission count moved to `subs` at `now`: a pause ended. If a holder's
    /// queued work had been seen done, it lasted from then until now, to the
    /// microsecond when the paused gate says so (`exact`), and to the millisecond when
    /// a tick saw it while others wait (the thread then looks every millisecond); a
    /// tick's look at other times (every 20 ms) says too little to learn from. So does
    /// one that followed an early release (see [`Client::learn_after_release`]).
    pub(super) fn learn_pauses(&self, st: &mut State, subs: u32, now: Instant, exact: bool) {
        let mut longest: Option<Duration> = None;
        for slot in &mut st.slots {
            if slot.ts.phase != Phase::Holding {
                continue;
            }
            if let Some((mark, done)) = slot.ts.work_done {
                if mark != subs {
                    slot.ts.work_done = None;
                    if exact || slot.ts.contended > 0 {
                        let gap = now.saturating_duration_since(done);
                        longest = Some(longest.map_or(gap, |l| l.max(gap)));
                    }
                }
            }
        }
        if let Some(gap) = longest {
            crate::kdebug!("a pause of {gap:?} ended");
            st.pauses.pause(gap, now);
        }
        if st.released_idle.is_some_and(|(mark, _)| mark != subs) {
            self.learn_after_release(st, now);
        }
    }

    /// The process wants the GPU again (`now`) after an early release on idleness: if
    /// sooner than `KIWI_IDLE_MS` after its work was seen done, the release came too
    /// soon (a fixed threshold would not have made it), and that pause is learned.
    pub(super) fn learn_after_release(&self, st: &mut State, now: Instant) {
        let Some((_, done)) = st.released_idle.take() else {
            return;
        };
        let gap = now.saturating_duration_since(done);
        if gap < self.env.idle {
            crate::kinfo!(
                "wanted the GPU {gap:?} after its work was done, having released it early: waiting longer before the next early release"
            );
            st.pauses.pause(gap, now);
        }
    }

    /// How long turn `k`'s thread may wait for a message before its next tick: the
    /// regular tick (usage reports), 1 ms while others wait and the holder's queued
    /// work is not yet seen done, and until the end of its idle period once it is.
    pub(super) fn next_tick(&self, k: usize) -> Duration {
        let base = (self.env.idle / 4).clamp(Duration::from_millis(1), Duration::from_millis(20));
        let st = lock(&self.state);
        let idle = self.idle_threshold(&st);
        let ts = &st.slots[k].ts;
        if ts.phase != Phase::Holding {
            return base;
        }
        let now = Instant::now();
        if ts.short_since.is_some() {
            return base;
        }
        match ts.work_done {
            // Idle while others wait: every millisecond until the idle period ends, so
            // that a pause that ends in it is measured to the millisecond (see
            // `learn_pauses`).
            Some((mark, done)) if mark == self.gate.submissions() => {
                let left = (done + idle).saturating_duration_since(now);
                if ts.contended > 0 && !left.is_zero() {
                    left.min(Duration::from_millis(1))
                } else {
                    base
                }
            }
            // Not seen done yet: while others wait, an early release is due as soon
            // as it is, so the idle detector looks every millisecond (a check of one
            // atomic, and a drain once the count stopped moving).
            _ if ts.contended > 0 && ts.quantum_end.is_none_or(|end| now + idle < end) => {
                Duration::from_millis(1)
            }
            _ => base,
        }
    }
}
