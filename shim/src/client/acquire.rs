//! Acquiring the turns: the submission slow path's wait ([`Client::acquire`]), one
//! pass over the claimed turns in acquisition order, requests, grants (a pipelined
//! swap-in among them) and the opening of the gate once every claimed turn is held
//! and resident.

use super::*;

/// How long a swap-in after a pipelined grant retries, at short intervals, for the
/// memory the previous holder frees segment by segment (and no longer than
/// [`crate::mem::ROOM_STALL`] with none coming); after that it waits as any
/// short-of-room turn does (a retry per tick, `no_room` to the arbiter). Under the
/// arbiter's grace (5 s).
const PIPELINED_WAIT: Duration = Duration::from_secs(2);

/// The outcome of one pass over the turns in acquisition order.
enum Step {
    Ready,
    Wait,
    Fail(CUresult),
}

impl Client {
    /// Blocks until this process may submit work (the gate is open) or fails. A wait
    /// past [`EXPLAIN_AFTER`] logs one line saying why (once per wait of the process,
    /// however many threads wait), and the grant that ends it one more. This is the
    /// slow path: the gate's fast path never comes here.
    ///
    /// `device`: the GPU the waiting submission goes to, when the gate is open for
    /// some GPUs only ([`Gate::open_devices`]); its turn is claimed first
    /// ([`ANY_DEVICE`]: every turn). `None`: the gate is closed for all.
    pub fn acquire(&self, device: Option<usize>) -> Result<(), CUresult> {
        let mut st = lock(&self.state);
        match device {
            Some(ANY_DEVICE) => self.turns().for_each(|t| t.claim(self.gate)),
            Some(d) => {
                if let Some(t) = self.turn_for(d) {
                    t.claim(self.gate);
                }
            }
            None => {}
        }
        st.want += 1;
        let started = Instant::now();
        // Wanted again after an early release: the pause ends here, not when the
        // submission gets through.
        self.learn_after_release(&mut st, started);
        let result = loop {
            let admitted = match device {
                Some(d) => self.gate.is_open() || self.gate.admits(d),
                None => self.gate.is_open() || self.gate.partial(),
            };
            if admitted {
                break Ok(());
            }
            match self.step(&mut st) {
                // Residency changed under us (an allocation left unbacked): go round.
                Step::Ready if !self.open_gate(&st) => {}
                Step::Ready => break Ok(()),
                Step::Fail(e) => break Err(e),
                Step::Wait => {
                    let waited = started.elapsed();
                    if waited >= EXPLAIN_AFTER && st.explained.is_none() {
                        st.explained = self.explain_wait(&st, started);
                    }
                    let next = EXPLAIN_AFTER
                        .checked_sub(waited)
                        .filter(|d| !d.is_zero())
                        .unwrap_or(Duration::from_secs(1));
                    st = self
                        .cv
                        .wait_timeout(st, next)
                        .unwrap_or_else(|p| p.into_inner())
                        .0;
                }
            }
        };
        if let Some((k, since)) = st.explained.take() {
            if result.is_ok() {
                st.slots[k].turn.explain_grant(since.elapsed());
            }
        }
        st.want -= 1;
        result
    }

    /// Logs why the process waits: the first turn in order it does not hold, with
    /// what the arbiter last said about it. `None` when every turn is held (the wait is
    /// a swap-in, not the arbiter's).
    fn explain_wait(&self, st: &State, since: Instant) -> Option<(usize, Instant)> {
        let k = st
            .order
            .iter()
            .copied()
            .find(|&k| st.slots[k].turn.claimed() && st.slots[k].ts.phase != Phase::Holding)?;
        st.slots[k].turn.explain_wait();
        Some((k, since))
    }

    /// One pass over the claimed turns in acquisition order: held turns are made
    /// resident; at the first turn not held, every later turn still held is given back
    /// (nothing is held past a turn we wait for) and the turn is requested.
    fn step(&self, st: &mut State) -> Step {
        for pos in 0..st.order.len() {
            let k = st.order[pos];
            if !st.slots[k].turn.claimed() {
                continue;
            }
            match st.slots[k].ts.phase {
                Phase::Holding => match st.slots[k].turn.make_resident() {
                    Ok(()) => {
                        st.slots[k].ts.short_since = None;
                        Self::memory_in(&mut st.slots[k].ts);
                    }
                    Err(CUDA_ERROR_OUT_OF_MEMORY) => {
                        // Others' memory is still in the way: the turn waits (never the
                        // application's call failing) while the arbiter makes room.
                        self.short_of_room(st, k);
                        return Step::Wait;
                    }
                    Err(e) => return Step::Fail(e),
                },
                Phase::Idle | Phase::Requested => {
                    let later: Vec<usize> = st.order[pos + 1..].to_vec();
                    for j in later {
                        if st.holding(j) {
                            self.give_back(st, j, 0, false, false);
                        }
                    }
                    if st.slots[k].ts.phase == Phase::Idle {
                        self.request(st, k);
                    }
                    return Step::Wait;
                }
            }
        }
        Step::Ready
    }

    /// Asks for turn `k`, after the figures that changed since last reported.
    fn request(&self, st: &mut State, k: usize) {
        let turn = st.slots[k].turn.clone();
        lock(&turn.view).start_waiting(Instant::now());
        let ts = &mut st.slots[k].ts;
        ts.phase = Phase::Requested;
        Self::report(&turn, ts);
        turn.send(&ClientMsg::Request);
    }

    /// Opens the gate when every claimed turn is held and resident: for all work
    /// when every turn is claimed, else for the work of the claimed GPUs (and of GPUs
    /// the shim does not manage). Residency is checked, and the gate opened, with
    /// every allocator locked: an allocation left unbacked closes the gate under its
    /// allocator's lock, so it cannot slip between the check and the opening (the
    /// gate would open over unmapped memory). Returns whether it opened.
    pub(super) fn open_gate(&self, st: &State) -> bool {
        fn nest(slots: &[Slot], ready: &mut dyn FnMut() -> bool) -> bool {
            match slots.split_first() {
                None => ready(),
                Some((s, rest)) => s.turn.res.locked(&mut |resident| {
                    if s.turn.claimed() && !(resident && s.ts.phase == Phase::Holding) {
                        return false;
                    }
                    nest(rest, ready)
                }),
            }
        }
        nest(&st.slots, &mut || {
            let unclaimed = st
                .slots
                .iter()
                .filter(|s| !s.turn.claimed())
                .fold(0u64, |m, s| m | 1 << s.turn.info.ordinal);
            if unclaimed == 0 {
                self.gate.open();
            } else {
                self.gate.open_devices(!unclaimed);
            }
            true
        })
    }

    pub(super) fn on_grant(
        &self,
        k: usize,
        exclusive: bool,
        waiting: u32,
        pipelined: bool,
        tq_ms: u64,
    ) {
        let mut st = lock(&self.state);
        stats::GRANTS.fetch_add(1, Ordering::Relaxed);
        lock(&st.slots[k].turn.view).granted(Instant::now(), exclusive);
        {
            let waits = st.slots[k].turn.pipelined.load(Ordering::Relaxed)
                && !st.slots[k].turn.res.all_resident();
            let ts = &mut st.slots[k].ts;
            ts.tq = Duration::from_millis(tq_ms);
            ts.quantum_waits_for_swap_in = waits;
            ts.phase = Phase::Holding;
            ts.exclusive = exclusive;
            ts.contended = waiting;
            ts.work_done = None;
            ts.quantum_end = Instant::now().checked_add(Duration::from_millis(tq_ms));
        }
        // Bound the queue before the gate opens: waiting threads queue at once.
        self.refresh_throttle(&st);
        let pos = st.position(k);
        let earlier_missing = st.order[..pos]
            .iter()
            .any(|&i| st.slots[i].turn.claimed() && !st.holding(i));
        if earlier_missing {
            // Asked for before an earlier turn was lost: holding this one while waiting
            // for that one could deadlock with another process. Give it back; it is
            // asked for again once the earlier ones are held.
            self.give_back(&mut st, k, 0, false, false);
        } else {
            let turn = st.slots[k].turn.clone();
            turn.res.set_backing_allowed(true);
            if pipelined && !turn.res.all_resident() {
                // The previous holder is still swapping out, freeing the memory this
                // swap-in needs segment by segment: swap in as it comes, waiting
                // without the state lock (a waiting thread, a message of another turn
                // go on), for at most PIPELINED_WAIT; what is left then waits as any
                // short-of-room turn does.
                drop(st);
                let r = {
                    let _swapping = Swapping::enter(&turn);
                    turn.res.swap_in_waiting(Instant::now() + PIPELINED_WAIT)
                };
                match r {
                    Ok(s) => {
                        turn.report_swap(SwapDirection::In, s);
                        lock(&turn.view).last_swap_in = Some((s.bytes, s.duration));
                    }
                    Err(e) => crate::kdebug!(
                        "GPU {}: pipelined swap-in stopped with CUDA error {e}; waiting for room",
                        turn.info.ordinal
                    ),
                }
                st = lock(&self.state);
                if st.slots[k].ts.phase != Phase::Holding {
                    drop(st);
                    self.cv.notify_all();
                    return;
                }
            }
            match turn.make_resident() {
                Ok(()) => {
                    st.slots[k].ts.short_since = None;
                    Self::memory_in(&mut st.slots[k].ts);
                    self.open_gate(&st);
                }
                // The room is still being made (the previous holder or idle clients
                // are evicting): wait for it, the turn's thread tries again each tick.
                Err(CUDA_ERROR_OUT_OF_MEMORY) => self.short_of_room(&mut st, k),
                Err(e) => crate::kerror!("swap-in after a grant failed with CUDA error {e}"),
            }
        }
        drop(st);
        self.cv.notify_all();
    }

    /// The turn's memory is all in after a grant: a quantum that waited for the
    /// swap-in starts now, as the arbiter counts it (the early-release detector works
    /// only before the quantum ends).
    pub(super) fn memory_in(ts: &mut TurnState) {
        if std::mem::take(&mut ts.quantum_waits_for_swap_in) {
            ts.quantum_end = Instant::now().checked_add(ts.tq);
        }
    }
}
