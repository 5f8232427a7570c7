//! Giving turns back: a release (early, or for a drop) drains, evicts and says
//! `release`; drops of turns whose work may wait for another GPU's are settled
//! together ([`Client::settle`]); reclaims and revocations.

use super::*;

/// How a release's drain went before [`Client::give_back`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Drained {
    /// Not tried: `give_back` drains.
    No,
    /// Done, with the gate closed since.
    Yes,
    /// Not done within [`PEER_WAIT`] (or failed): nothing is evicted.
    Stuck,
}

impl Client {
    /// Stops admitting, drains the GPU, evicts `need` bytes and releases the turn.
    /// Threads that still want the GPU ask again from [`Client::acquire`], in order.
    /// `dropped`: the arbiter asked for it (a drop); a pipelined client then says
    /// `drained` as soon as its work is done, before its swap-out, so the next holder
    /// can start swapping in while the memory is freed segment by segment.
    pub(super) fn give_back(
        &self,
        st: &mut State,
        k: usize,
        need: u64,
        early: bool,
        dropped: bool,
    ) {
        self.give_back_drained(st, k, need, early, dropped, Drained::No)
    }

    /// [`Client::give_back`] after a drain tried already (`drained`).
    fn give_back_drained(
        &self,
        st: &mut State,
        k: usize,
        need: u64,
        early: bool,
        dropped: bool,
        drained: Drained,
    ) {
        self.gate.close_and_wait();
        let turn = st.slots[k].turn.clone();
        let _swapping = Swapping::enter(&turn);
        turn.res.set_backing_allowed(false);
        // Dropped, or releasing early while others wait: the next holder's swap-in may
        // start beside this swap-out.
        let announce = (dropped || (early && st.slots[k].ts.contended > 0))
            && turn.pipelined.load(Ordering::Relaxed)
            && self.env.pipelined;
        // The idle detector saw the queued work done and nothing was submitted since
        // (the gate is closed now): no drain needed.
        let done = drained == Drained::Yes
            || (st.slots[k].ts.work_done.map(|w| w.0) == Some(self.gate.submissions())
                && !crate::capture::active());
        if done {
            if announce {
                turn.send(&ClientMsg::Drained);
            }
            turn.evict(need);
        } else if drained == Drained::Stuck {
            crate::kwarn!(
                "GPU {}: its queued work still waits after {PEER_WAIT:?}, likely for a peer on another GPU that is not running now; released with its memory resident (nothing swapped out under running work), the next turn finishes it",
                turn.info.ordinal
            );
        } else {
            let limit = st.bounded(k).then_some(PEER_WAIT);
            Self::drain_then_evict(&turn, need, "release", announce, limit);
        }
        // What went out into pageable buffers is registered in place now.
        self.wake_pinning();
        stats::RELEASES.fetch_add(1, Ordering::Relaxed);
        if early {
            stats::EARLY_RELEASES.fetch_add(1, Ordering::Relaxed);
        }
        let u = turn.usage();
        turn.send(&ClientMsg::Release(u));
        lock(&turn.view).stop(Instant::now());
        let ts = &mut st.slots[k].ts;
        ts.phase = Phase::Idle;
        ts.short_since = None;
        ts.work_done = None;
        ts.last_usage = Some(u);
    }

    pub(super) fn on_drop(&self, k: usize, need: u64) {
        let mut st = lock(&self.state);
        match st.slots[k].ts.phase {
            Phase::Holding if st.bounded(k) => {
                st.slots[k].ts.drop_pending = Some(need);
                if !st.settling {
                    st = self.settle(st);
                }
            }
            Phase::Holding => self.give_back(&mut st, k, need, false, true),
            // Not holding and not asking: a drop that crossed our (early) release, or an
            // arbiter that thinks we hold. Answering is harmless.
            Phase::Idle => {
                let turn = st.slots[k].turn.clone();
                turn.send(&ClientMsg::Release(turn.usage()));
            }
            // Not holding but asking again: our earlier release answered the drop; a
            // second release would cancel the pending request.
            Phase::Requested => {}
        }
        drop(st);
        self.cv.notify_all();
    }

    /// Answers the drops of turns whose work may wait for another GPU's
    /// ([`State::bounded`]): drains every held turn's queue with the gate closed, each
    /// within [`PEER_SLICE`]. A queue that is not done may wait for what the
    /// process's threads were about to submit to another GPU (NCCL from one thread
    /// launches a collective's kernels device by device; a rank's step writes for its
    /// peer, then waits): the gate then opens again for a slice, every turn still
    /// held, and the drains are tried again, for [`PEER_WAIT`] in all. Then each turn
    /// with a drop pending is given back: swapped out if its queue drained, else
    /// released with its memory resident (its work may wait for a peer process that
    /// the drop stopped too; waiting for it would hold this turn, and the peer's next
    /// turn with it, for good). Drops that come meanwhile are answered here too.
    fn settle<'a>(&'a self, mut st: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        st.settling = true;
        let start = Instant::now();
        let drained = loop {
            self.gate.close_and_wait();
            let mut all = Drained::Yes;
            for j in 0..st.slots.len() {
                if !st.holding(j) || !st.slots[j].turn.claimed() {
                    continue;
                }
                match st.slots[j].turn.res.drain_within(PEER_SLICE) {
                    Ok(true) => {}
                    Ok(false) => all = Drained::No,
                    Err(e) => {
                        crate::kerror!(
                            "GPU {}: draining before a release failed with CUDA error {e}: nothing swapped out, its memory stays resident",
                            st.slots[j].turn.info.ordinal
                        );
                        all = Drained::Stuck;
                        break;
                    }
                }
            }
            if all != Drained::No {
                break all;
            }
            if start.elapsed() >= PEER_WAIT {
                break Drained::Stuck;
            }
            // Let the threads submit what the queues wait for, the turns still held.
            self.open_gate(&st);
            drop(st);
            self.cv.notify_all();
            std::thread::sleep(PEER_SLICE);
            st = lock(&self.state);
        };
        self.gate.close_and_wait();
        for j in 0..st.slots.len() {
            let Some(need) = st.slots[j].ts.drop_pending.take() else {
                continue;
            };
            match st.slots[j].ts.phase {
                Phase::Holding => self.give_back_drained(&mut st, j, need, false, true, drained),
                // Revoked meanwhile, or released: answering is harmless (see on_drop).
                Phase::Idle => {
                    let turn = st.slots[j].turn.clone();
                    turn.send(&ClientMsg::Release(turn.usage()));
                }
                Phase::Requested => {}
            }
        }
        st.settling = false;
        // Turns still held and not dropped go on.
        self.open_gate(&st);
        st
    }

    /// Drains, then evicts `need` bytes (saying `drained` in between when `announce`).
    /// A failed drain evicts nothing: work still
    /// queued may read or write the memory, so copying it out then unmapping it could
    /// lose what that work writes (or fault it). The memory stays resident and the
    /// caller's answer (`release`, `reclaimed`) says so; the arbiter then asks this
    /// idle client to evict with a `reclaim` when the next holder needs the room,
    /// which drains again.
    /// `limit`: the drain waits at most that long ([`State::bounded`]); not done by
    /// then counts as failed.
    fn drain_then_evict(
        turn: &Turn,
        need: u64,
        before: &str,
        announce: bool,
        limit: Option<Duration>,
    ) {
        let r = match limit {
            None => turn.res.drain(),
            Some(l) => match turn.res.drain_within(l) {
                Ok(true) => Ok(()),
                Ok(false) => Err(CUDA_ERROR_TIMEOUT),
                Err(e) => Err(e),
            },
        };
        match r {
            Ok(()) => {
                if announce {
                    turn.send(&ClientMsg::Drained);
                }
                turn.evict(need)
            }
            Err(CUDA_ERROR_TIMEOUT) => crate::kwarn!(
                "GPU {}: its queued work still waits after {PEER_WAIT:?} before {before}, likely for a peer on another GPU that is not running now: nothing swapped out, its memory stays resident",
                turn.info.ordinal
            ),
            Err(e) if need > 0 => crate::kerror!(
                "GPU {}: draining before {before} failed with CUDA error {e}: nothing swapped out, its memory stays resident",
                turn.info.ordinal
            ),
            Err(e) => crate::kwarn!(
                "GPU {}: draining before {before} failed with CUDA error {e}",
                turn.info.ordinal
            ),
        }
    }

    pub(super) fn on_reclaim(&self, k: usize, need: u64) {
        let mut st = lock(&self.state);
        let turn = st.slots[k].turn.clone();
        if !st.holding(k) {
            let limit = st.bounded(k).then_some(PEER_WAIT);
            Self::drain_then_evict(&turn, need, "a reclaim", false, limit);
            self.wake_pinning();
        }
        let u = turn.usage();
        turn.send(&ClientMsg::Reclaimed(u));
        st.slots[k].ts.last_usage = Some(u);
    }

    pub(super) fn on_revoked(&self, k: usize, reason: &str) {
        crate::kwarn!("the arbiter revoked this process's turn: {reason}");
        let mut st = lock(&self.state);
        self.gate.close_and_wait();
        let turn = st.slots[k].turn.clone();
        let _ = if st.bounded(k) {
            turn.res.drain_within(PEER_WAIT).map(|_| ())
        } else {
            turn.res.drain()
        };
        turn.res.set_backing_allowed(false);
        lock(&turn.view).stop(Instant::now());
        st.slots[k].ts.phase = Phase::Idle;
        st.slots[k].ts.short_since = None;
        drop(st);
        self.cv.notify_all();
    }
}
