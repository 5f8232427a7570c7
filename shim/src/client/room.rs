//! The room-making protocol of a held turn: a swap-in short of room says `no_room`
//! (at most every 250 ms) and retries; memory the shim cannot page asks the same
//! ([`crate::room`]).

use super::*;

/// Sends GPU `ordinal`'s figures to the arbiter where they changed (a context's
/// pending bytes: [`crate::room`]).
pub fn report_now(ordinal: usize) {
    let Some(c) = CLIENT.get() else { return };
    let mut st = lock(&c.state);
    if let Some(k) = st.slots.iter().position(|s| s.turn.info.ordinal == ordinal) {
        let turn = st.slots[k].turn.clone();
        Client::report(&turn, &mut st.slots[k].ts);
    }
}

/// Memory the shim cannot page on GPU `ordinal` that cannot be had while its turn is
/// held ([`crate::room`]): says `no_room` for the turn's pending bytes (after the usage that
/// counts them), so the arbiter learns the memory it cannot see and reclaims what
/// the context lacks from the clients that do not hold the GPU, or turns sharers
/// into turns. Nothing when the turn is not held (dropped meanwhile: the next wait
/// asks again).
pub fn pending_short_of_room(ordinal: usize) {
    let Some(c) = CLIENT.get() else { return };
    let mut st = lock(&c.state);
    let Some(k) = st.slots.iter().position(|s| s.turn.info.ordinal == ordinal) else {
        return;
    };
    if !st.holding(k) {
        return;
    }
    let turn = st.slots[k].turn.clone();
    Client::report(&turn, &mut st.slots[k].ts);
    let missing = turn.pending.load(Ordering::Relaxed);
    if missing > 0 && turn.pipelined.load(Ordering::Relaxed) {
        turn.send(&ClientMsg::NoRoom {
            missing_bytes: missing,
        });
    }
}

impl Client {
    /// A held turn whose swap-in found no room: it waits (the gate stays closed, no
    /// lock is held while waiting) and tells the arbiter its residency at once, so
    /// the arbiter reclaims what is missing from idle clients
    /// (`GpuScheduler::make_room_for_holder`); the turn's thread tries again at each
    /// tick ([`Client::retry_short`]).
    pub(super) fn short_of_room(&self, st: &mut State, k: usize) {
        let turn = st.slots[k].turn.clone();
        let ts = &mut st.slots[k].ts;
        let starts = ts.short_since.is_none();
        if starts {
            ts.short_since = Some((Instant::now(), false));
            crate::kdebug!(
                "GPU {}: no room to swap in yet; waiting for the arbiter to make room",
                turn.info.ordinal
            );
        }
        Self::report(&turn, ts);
        Self::tell_no_room(&turn, ts, starts);
    }

    /// Tells the arbiter (`no_room`) what this held turn still lacks, when a shortage
    /// starts and then at most every [`NO_ROOM_RESEND`] while it lasts: the arbiter
    /// made the room it counted on, so memory it cannot see (a process outside Kiwi,
    /// a context measured short) holds the rest, and only this report lets it reclaim
    /// that from the clients that do not hold the GPU. Sent after the usage report,
    /// so the arbiter knows the working set it bounds the reclaim by.
    pub(super) fn tell_no_room(turn: &Turn, ts: &mut TurnState, starts: bool) {
        if !turn.pipelined.load(Ordering::Relaxed) {
            return;
        }
        if !starts
            && ts
                .no_room_sent
                .is_some_and(|t| t.elapsed() < NO_ROOM_RESEND)
        {
            return;
        }
        let f = turn.figures();
        let missing = f.working_set.saturating_sub(f.resident);
        if missing > 0 {
            turn.send(&ClientMsg::NoRoom {
                missing_bytes: missing,
            });
            ts.no_room_sent = Some(Instant::now());
        }
    }

    /// The turn's thread, each tick while a held turn is short of room: swaps in
    /// what fits now; once all is resident the gate opens for the waiting threads.
    /// Says on stderr, once, when the wait passes [`SHORT_OF_ROOM_LOG`].
    pub(super) fn retry_short(&self, st: &mut State, k: usize) {
        let turn = st.slots[k].turn.clone();
        match turn.make_resident() {
            Ok(()) => {
                Self::memory_in(&mut st.slots[k].ts);
                if let Some((since, true)) = st.slots[k].ts.short_since {
                    crate::kinfo!(
                        "GPU {}: room made after {:?}; swapped in",
                        turn.info.ordinal,
                        since.elapsed()
                    );
                }
                st.slots[k].ts.short_since = None;
                self.open_gate(st);
                self.cv.notify_all();
            }
            Err(CUDA_ERROR_OUT_OF_MEMORY) => {
                let ts = &mut st.slots[k].ts;
                if let Some((since, logged @ false)) = ts.short_since.as_mut() {
                    if since.elapsed() >= SHORT_OF_ROOM_LOG {
                        *logged = true;
                        let f = turn.figures();
                        crate::kwarn!(
                            "GPU {}: no room to swap in {} MiB for {:?}: others' memory is still on the GPU; waiting for the arbiter to make room (the application's calls wait, they do not fail)",
                            turn.info.ordinal,
                            (f.working_set - f.resident) >> 20,
                            since.elapsed()
                        );
                    }
                }
                Self::report(&turn, ts);
                Self::tell_no_room(&turn, ts, false);
            }
            Err(e) => {
                crate::kerror!(
                    "GPU {}: swap-in failed with CUDA error {e}",
                    turn.info.ordinal
                );
                st.slots[k].ts.short_since = None;
                self.cv.notify_all();
            }
        }
    }
}
