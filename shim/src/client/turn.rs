//! One GPU's [`Turn`]: what the arbiter lets the process use there (capacity, the
//! others' memory no swap frees, the swap budget), the questions an application
//! thread asks it (admission, the latest room), and the swaps it does.

use super::*;

/// The driver answered a swap with `CUDA_ERROR_DEINITIALIZED`: the process is exiting.
static DRIVER_GONE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// One GPU's turn: its connection, its allocator and what the arbiter lets it use.
pub struct Turn {
    pub(super) info: DeviceInfo,
    /// Index into the process's slots (and into [`CONN_FDS`]).
    pub(super) slot: usize,
    pub(super) res: Box<dyn Residency>,
    pub(super) writer: Mutex<Option<Conn>>,
    /// GPU memory the arbiter schedules against (total − context reserve), as it said
    /// at registration: the limit until it says [`ArbiterMsg::Room`].
    pub(super) capacity: AtomicU64,
    /// The others' memory no swap frees ([`ArbiterMsg::Room`]); `u64::MAX` until the
    /// arbiter says (an arbiter that predates it never does).
    pub(super) others_fixed: AtomicU64,
    /// The largest other working set the arbiter says memory no swap frees here
    /// must leave room for ([`ArbiterMsg::Room`]'s `keep`).
    pub(super) keep: Mutex<Option<Keep>>,
    /// The arbiter enforces a node swap budget: growth must be admitted first.
    pub(super) budgeted: AtomicBool,
    /// Serializes admissions: one question in flight per turn.
    pub(super) admitting: Mutex<()>,
    /// The arbiter's answer to the admission in flight, put there by the turn's thread.
    pub(super) admitted: Mutex<Option<bool>>,
    /// The arbiter's line for the last refused admission.
    pub(super) refusal: Mutex<Option<String>>,
    pub(super) admitted_cv: Condvar,
    /// The last `ping` token sent ([`Turn::sync_room`]) and the highest `pong` the
    /// turn's thread has handled (every message the arbiter sent before it, too).
    pub(super) ping_sent: AtomicU64,
    pub(super) pong_seen: Mutex<u64>,
    pub(super) pong_cv: Condvar,
    /// What `kiwi_status_json` and the wait lines show ([`crate::status`]). A leaf
    /// lock, held only to copy a few fields: reading it never waits behind a swap.
    pub(super) view: Mutex<crate::status::View>,
    /// The last figures reported or computed (every tick), readable without the
    /// allocator's lock.
    pub(super) seen_working_set: AtomicU64,
    pub(super) seen_resident: AtomicU64,
    /// The process has memory on this GPU or submitted work to it: it needs this turn
    /// to run work. A context alone is not a claim (frameworks open every visible GPU;
    /// `torch.cuda.mem_get_info(i)` makes a context on GPU `i`). Never cleared.
    pub(super) claimed: AtomicBool,
    /// Memory of the process's contexts and loaded modules on this GPU (no swap
    /// frees it); the application's own VMM memory is added from the allocator.
    /// [`DeviceInfo::pending_bytes`], now.
    pub(super) pending: AtomicU64,
    /// Times a wait for room started or ended ([`Turn::room_waits`]).
    pub(super) room_waits: AtomicU32,
    pub(super) context_bytes: AtomicU64,
    /// The arbiter accepted `unswappable_bytes` at registration: usage reports leave
    /// the application's own VMM memory out of the working set, and `unswappable`
    /// reports carry it with the contexts'.
    pub(super) reports_unswappable: AtomicBool,
    /// The arbiter accepted `pipelined` at registration: a drop is answered with
    /// `drained` before the swap-out.
    pub(super) pipelined: AtomicBool,
    /// Bytes to evict that others waiting for this GPU need (`contended`; 0: nobody
    /// waits): their pinned buffers are prepared ahead by the pinning thread.
    pub(super) pin_target: AtomicU64,
    /// The GPU is oversubscribed (`pressure`): the buffers of a full swap-out are
    /// prepared ahead, whoever holds it.
    pub(super) pressure: AtomicBool,
    /// Another process is registered on the GPU (`pressure`'s `shared`): it may ask
    /// for the GPU at any moment, so the buffers of a full swap-out are prepared as
    /// the working set grows, before anyone asks (issue #28).
    pub(super) shared: AtomicBool,
    /// The pressure ended: the pinning thread frees the spare buffers.
    pub(super) pin_trim: AtomicBool,
    /// The pinning thread pinned some buffers ahead and has not yet found all it
    /// needs prepared (then it says so once, in the log).
    pub(super) pinning: AtomicBool,
    /// Pinning ahead was held back because host memory is short (said once per spell).
    pub(super) pin_held_back: AtomicBool,
    /// The node's swap budget the arbiter announced (`u64::MAX`: none).
    pub(super) swap_budget: AtomicU64,
    /// A release or a swap of this turn is under way: the pinning thread starts no
    /// step meanwhile (it would compete for the allocator's lock and the CPU with the
    /// critical path).
    pub(super) swapping: AtomicU32,
    /// The driver's checkpoints of this process, as the arbiter tells them.
    pub(super) checkpoint: Arc<CheckpointNote>,
    /// The last error the arbiter sent on this turn's connection: why it closed it,
    /// said in the line that tells the connection was lost.
    pub(super) last_error: Mutex<Option<String>>,
}

/// How long a checkpoint lasts before the process says why its CUDA calls wait.
pub(super) const CHECKPOINT_LINE_AFTER: Duration = Duration::from_secs(1);

/// Whether the driver holds this process checkpointed ([`ArbiterMsg::Checkpointed`]),
/// and whether the line saying so was written.
#[derive(Default)]
pub(super) struct CheckpointNote {
    /// When the arbiter said so (monotonic ns; 0: not checkpointed).
    at: AtomicU64,
    said: AtomicBool,
}

impl CheckpointNote {
    /// Checkpointed: a line follows if it lasts [`CHECKPOINT_LINE_AFTER`], written by
    /// a thread of its own: the process's calls wait inside the driver, where the
    /// shim cannot see them, and any of its threads may be among them (one that took
    /// a lock of the shim's included). Restored: says so, if the line was written.
    fn on_checkpointed(self: &Arc<Self>, ordinal: usize, restored: bool) {
        if restored {
            let since = self.at.swap(0, Ordering::Relaxed);
            if self.said.swap(false, Ordering::Relaxed) && since > 0 {
                let ms = kiwi_protocol::monotonic_ns().saturating_sub(since) / 1_000_000;
                crate::kinfo!("GPU {ordinal}: restored after {ms} ms; CUDA calls go on");
            }
            return;
        }
        let since = kiwi_protocol::monotonic_ns().max(1);
        self.said.store(false, Ordering::Relaxed);
        self.at.store(since, Ordering::Relaxed);
        crate::kdebug!("GPU {ordinal}: checkpointed by the driver");
        let note = self.clone();
        let spawned = std::thread::Builder::new()
            .name("kiwi-ckpt-note".into())
            .spawn(move || {
                std::thread::sleep(CHECKPOINT_LINE_AFTER);
                if note.at.load(Ordering::Relaxed) == since && !note.said.swap(true, Ordering::Relaxed)
                {
                    crate::kwarn!(
                        "GPU {ordinal}: this process is checkpointed to host memory (by the driver, to make room for others on the GPU); its CUDA calls wait until it is restored: at its next turn, or as soon as the GPU has room for it"
                    );
                }
            });
        if let Err(e) = spawned {
            crate::kdebug!("no thread for the checkpoint line ({e})");
        }
    }
}

/// Marks a turn's release or swap as under way while alive ([`Turn::swapping`]).
pub(super) struct Swapping<'a>(&'a AtomicU32);

impl<'a> Swapping<'a> {
    pub(super) fn enter(turn: &'a Turn) -> Self {
        turn.swapping.fetch_add(1, Ordering::AcqRel);
        Swapping(&turn.swapping)
    }
}

impl Drop for Swapping<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A growth the arbiter admitted (or that needs no admission); hold it until the
/// allocation is made, so admissions of one process do not overtake each other.
pub struct Admission(#[allow(dead_code)] Option<MutexGuard<'static, ()>>);

impl Turn {
    /// The arbiter says the driver checkpointed this process (`restored: false`) or
    /// restored it.
    pub(super) fn on_checkpointed(&self, restored: bool) {
        self.checkpoint.on_checkpointed(self.info.ordinal, restored);
    }

    /// The arbiter said the driver holds this process checkpointed, and not yet that
    /// it was restored.
    pub(super) fn checkpointed(&self) -> bool {
        self.checkpoint.at.load(Ordering::Relaxed) != 0
    }

    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// What this process's working set on the GPU can be resident beside the others,
    /// as the application is told (`cuMemGetInfo`): the GPU's total less the others'
    /// memory no swap frees and its own contexts and modules (its own VMM memory is in
    /// its working set), once the arbiter said the others' ([`ArbiterMsg::Room`]);
    /// before, or with an arbiter that predates it, total less the arbiter's context
    /// reserve.
    pub fn told_capacity(&self) -> u64 {
        match self.others_fixed.load(Ordering::Relaxed) {
            u64::MAX => self.capacity.load(Ordering::Relaxed),
            others => self
                .info
                .total_memory
                .saturating_sub(others)
                .saturating_sub(self.context_bytes.load(Ordering::Relaxed)),
        }
    }

    /// The most this process's working set on the GPU may be (past it an allocation
    /// fails with out of memory): [`Turn::told_capacity`], but never less than the
    /// total less the arbiter's context reserve. The others' reports only ever raise
    /// the limit (a process alone may take 90% of the GPU): they are claims no one
    /// checks, and a tenant claiming the whole GPU must not make every other tenant's
    /// allocations fail; at worst the others are told less is free.
    pub fn capacity(&self) -> u64 {
        self.told_capacity()
            .max(self.capacity.load(Ordering::Relaxed))
    }

    /// Whether `more` bytes beside this process's memory on the GPU could ever be
    /// resident in its turn, with every other process's swappable memory out: false
    /// only once the arbiter said the others' memory no swap frees
    /// ([`ArbiterMsg::Room`]) and it leaves too little.
    pub fn could_fit(&self, more: u64) -> bool {
        self.others_fixed.load(Ordering::Relaxed) == u64::MAX
            || self.figures().working_set.saturating_add(more) <= self.capacity()
    }

    /// The other client whose working set `more` bytes of memory no swap frees,
    /// added here, would make impossible: it could never again be resident in its
    /// turn beside every process's memory no swap frees (the arbiter said whose and
    /// how much, [`ArbiterMsg::Room`], where it cannot evict whole processes). With
    /// the figures of the line that says so: (its name, its working set, every
    /// process's memory no swap frees with `more`).
    pub fn would_block(&self, more: u64) -> Option<(String, u64, u64)> {
        let others = self.others_fixed.load(Ordering::Relaxed);
        if others == u64::MAX {
            return None;
        }
        let keep = lock(&self.keep).clone()?;
        let fixed = others
            .saturating_add(self.context_bytes.load(Ordering::Relaxed))
            .saturating_add(self.res.figures().external)
            .saturating_add(more);
        (fixed.saturating_add(keep.bytes) > self.info.total_memory)
            .then_some((keep.name, keep.bytes, fixed))
    }

    /// The allocator's limit follows [`Turn::capacity`].
    pub(super) fn update_limit(&self) {
        self.res.set_limit(self.capacity());
    }

    pub fn figures(&self) -> Figures {
        self.res.figures()
    }

    /// Whether the process needs this turn to run work ([`Turn::claim`]).
    pub fn claimed(&self) -> bool {
        self.claimed.load(Ordering::SeqCst)
    }

    /// The process has memory on this GPU or submits work to it: from now on its work
    /// waits for this turn. The first claim closes the gate (the turn is not held: a
    /// turn is asked for only once claimed). Callers that changed the allocator claim
    /// under its lock, so the claim cannot cross [`Client`] opening the gate.
    pub fn claim(&self, gate: &Gate) {
        if !self.claimed.swap(true, Ordering::SeqCst) {
            gate.close();
            crate::kdebug!("GPU {}: claimed (memory or work on it)", self.info.ordinal);
        }
    }

    /// Whether the arbiter enforces a node swap budget (growth must be admitted).
    pub fn budgeted(&self) -> bool {
        self.budgeted.load(Ordering::Acquire)
    }

    /// Asks the arbiter whether this GPU's working set may grow to `working_set`
    /// bytes without the node's swap need passing its budget. `None`: refused, the
    /// allocation fails with out-of-memory. Without a budget, or when the arbiter does
    /// not answer (it is restarting), the growth goes ahead.
    pub fn admit(&'static self, working_set: u64) -> Option<Admission> {
        if !self.budgeted() {
            return Some(Admission(None));
        }
        let guard = lock(&self.admitting);
        *lock(&self.admitted) = None;
        if !self.try_send(&ClientMsg::Admit {
            working_set_bytes: working_set,
        }) {
            // No arbiter to ask now (it is restarting): the growth goes ahead, as
            // the usage report that follows tells the next one.
            return Some(Admission(Some(guard)));
        }
        let deadline = Instant::now() + ADMIT_WAIT;
        let mut answer = lock(&self.admitted);
        while answer.is_none() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                crate::kwarn!(
                    "GPU {}: the arbiter did not answer a swap admission in {ADMIT_WAIT:?}; allocating anyway",
                    self.info.ordinal
                );
                return Some(Admission(Some(guard)));
            }
            answer = self
                .admitted_cv
                .wait_timeout(answer, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        if answer.take() == Some(true) {
            Some(Admission(Some(guard)))
        } else {
            match lock(&self.refusal).take() {
                Some(why) => crate::kwarn!("GPU {}: {why}: out of memory", self.info.ordinal),
                None => crate::kwarn!(
                    "GPU {}: growing to {working_set} bytes would pass the node's swap budget in host RAM: out of memory",
                    self.info.ordinal
                ),
            }
            None
        }
    }

    /// Brings the others' memory no swap frees ([`ArbiterMsg::Room`]) up to date
    /// before the application is told what is free: a `ping` is answered after every
    /// message the arbiter queued for this client before it, so a context another
    /// process finished opening before this call is counted (as the driver would
    /// count it). Bounded by [`SYNC_WAIT`]: a turn's thread busy with a swap, or an
    /// arbiter away, leaves the last value told.
    pub fn sync_room(&self) {
        if self.others_fixed.load(Ordering::Relaxed) == u64::MAX {
            return;
        }
        let token = self.ping_sent.fetch_add(1, Ordering::Relaxed) + 1;
        self.send(&ClientMsg::Ping { token });
        let deadline = Instant::now() + SYNC_WAIT;
        let mut seen = lock(&self.pong_seen);
        while *seen < token {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                crate::kdebug!(
                    "GPU {}: the arbiter did not answer a ping in {SYNC_WAIT:?}; telling the last free memory it said",
                    self.info.ordinal
                );
                return;
            }
            seen = self
                .pong_cv
                .wait_timeout(seen, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    pub(super) fn on_pong(&self, token: u64) {
        let mut seen = lock(&self.pong_seen);
        *seen = (*seen).max(token);
        self.pong_cv.notify_all();
    }

    /// The connection an admission was asked on is gone: no answer comes, the growth
    /// goes ahead (as when the arbiter does not answer in time).
    pub(super) fn on_connection_lost(&self) {
        self.on_admitted(true, None);
    }

    pub(super) fn on_admitted(&self, ok: bool, message: Option<String>) {
        *lock(&self.refusal) = message;
        *lock(&self.admitted) = Some(ok);
        self.admitted_cv.notify_all();
    }

    pub(super) fn send(&self, msg: &ClientMsg) {
        self.try_send(msg);
    }

    /// [`Turn::send`], saying whether the message went out (false: no connection now,
    /// the arbiter is away or restarting).
    fn try_send(&self, msg: &ClientMsg) -> bool {
        let mut w = lock(&self.writer);
        let Some(conn) = w.as_mut() else {
            return false;
        };
        if let Err(e) = conn.send(msg) {
            crate::kdebug!("send to the arbiter (GPU {}) failed: {e}", self.info.uuid);
            // The reader notices the broken connection and reconnects.
            let _ = conn.stream().shutdown(std::net::Shutdown::Both);
            *w = None;
            return false;
        }
        true
    }

    /// Memory of the process's contexts, modules and limits on this GPU, as counted.
    pub fn context_bytes(&self) -> u64 {
        self.context_bytes.load(Ordering::Relaxed)
    }

    /// Adds (or, negative, removes) memory of a context or module of the process on
    /// this GPU; reported from the turn's thread at its next tick.
    pub fn add_context_bytes(&self, delta: i64) {
        let _ = self
            .context_bytes
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
                Some(v.saturating_add_signed(delta))
            });
        if self.others_fixed.load(Ordering::Relaxed) != u64::MAX {
            self.update_limit();
        }
    }

    /// This process's memory on this GPU that no swap frees: contexts, modules and
    /// the application's own VMM memory.
    pub fn unswappable(&self) -> u64 {
        self.context_bytes.load(Ordering::Relaxed) + self.res.figures().external
    }

    /// Sets the memory this turn waits for room for ([`DeviceInfo::pending_bytes`]);
    /// sent with the next usage report.
    pub fn set_pending(&self, bytes: u64) {
        let was = self.pending.swap(bytes, Ordering::Relaxed);
        if (was == 0) != (bytes == 0) {
            self.room_waits.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A thread of this process waits for room on this GPU ([`Turn::set_pending`]).
    pub(super) fn waits_for_room(&self) -> bool {
        self.pending.load(Ordering::Relaxed) > 0
    }

    /// Room waits started or ended on this GPU so far ([`Turn::set_pending`]).
    pub(super) fn room_waits(&self) -> u32 {
        self.room_waits.load(Ordering::Relaxed)
    }

    pub(super) fn usage(&self) -> Usage {
        let mut f = self.res.figures();
        if self.reports_unswappable.load(Ordering::Relaxed) {
            // Reported apart, as memory no swap frees.
            f.working_set -= f.external;
            f.resident -= f.external;
        }
        f.working_set = f
            .working_set
            .saturating_add(self.pending.load(Ordering::Relaxed));
        let u = usage_of(f);
        self.seen_working_set
            .store(u.working_set_bytes, Ordering::Relaxed);
        self.seen_resident
            .store(u.resident_bytes, Ordering::Relaxed);
        u
    }

    /// What this turn shows: its view, and its last known (working set, resident).
    pub fn view(&self) -> (crate::status::View, u64, u64) {
        (
            lock(&self.view).clone(),
            self.seen_working_set.load(Ordering::Relaxed),
            self.seen_resident.load(Ordering::Relaxed),
        )
    }

    /// Logs the wait line ([`crate::status::explain_wait`]) when it is shown.
    pub(super) fn explain_wait(&self) {
        if crate::log::explain_enabled() {
            let (v, _, _) = self.view();
            crate::status::explain_wait(self.info.ordinal, &self.info.uuid, &v);
        }
    }

    /// Logs the grant line ([`crate::status::explain_grant`]) when it is shown.
    pub(super) fn explain_grant(&self, waited: Duration) {
        if crate::log::explain_enabled() {
            let (v, _, _) = self.view();
            crate::status::explain_grant(self.info.ordinal, &self.info.uuid, &v, waited);
        }
    }

    /// Reports a finished swap to the arbiter (and the counters).
    /// A swap that moved memory without copying a byte (all of it dead,
    /// `kiwiMemDiscard`) is reported too: the arbiter starts a quantum that waited for
    /// the swap-in when it hears of it.
    pub(super) fn report_swap(&self, direction: SwapDirection, s: Swap) {
        if s.bytes == 0 && s.moved == 0 {
            return;
        }
        let counter = match direction {
            SwapDirection::Out => &stats::SWAP_OUT_BYTES,
            SwapDirection::In => &stats::SWAP_IN_BYTES,
        };
        counter.fetch_add(s.bytes, Ordering::Relaxed);
        self.send(&ClientMsg::Swapped {
            direction,
            bytes: s.bytes,
            duration_ns: s.duration.as_nanos() as u64,
        });
        let dead = s.moved.saturating_sub(s.bytes);
        crate::kinfo!(
            "GPU {}: swapped {} {} bytes in {:?}{}",
            self.info.ordinal,
            if direction == SwapDirection::Out {
                "out"
            } else {
                "in"
            },
            s.bytes,
            s.duration,
            if dead > 0 {
                format!(" ({dead} dead bytes moved without a copy)")
            } else {
                String::new()
            }
        );
    }

    /// Evicts `need` bytes (least recently used first) and reports it.
    pub(super) fn evict(&self, need: u64) {
        if need == 0 {
            return;
        }
        if DRIVER_GONE.load(Ordering::Relaxed) {
            return;
        }
        let _swapping = Swapping::enter(self);
        match self.res.evict(need) {
            Ok(s) => self.report_swap(SwapDirection::Out, s),
            // The driver is shutting down: the process is exiting, and its memory
            // goes with it. Said once; the arbiter's reclaims until the process is
            // gone are not errors (an H100 run printed 460 such lines at one exit).
            Err(crate::cuda::CUDA_ERROR_DEINITIALIZED) => {
                if !DRIVER_GONE.swap(true, Ordering::Relaxed) {
                    crate::kdebug!(
                        "GPU {}: the driver is shutting down (the process exits): no more swaps",
                        self.info.ordinal
                    );
                }
            }
            Err(e) => crate::kerror!(
                "GPU {}: swap-out failed with CUDA error {e}",
                self.info.ordinal
            ),
        }
    }

    /// Swaps everything back in (reporting the swap) unless it is all resident. One
    /// attempt, never a sleep: out of memory (right after a grant the previous holder
    /// or an idle client may still be evicting what the arbiter asked of it) keeps
    /// what was swapped in and returns the error; the caller then waits for room
    /// without holding a lock ([`Client::short_of_room`]) and the turn's thread tries
    /// again at each tick.
    pub(super) fn make_resident(&self) -> Result<(), CUresult> {
        if self.res.all_resident() {
            return Ok(());
        }
        let _swapping = Swapping::enter(self);
        let s = self.res.swap_in_all()?;
        self.report_swap(SwapDirection::In, s);
        lock(&self.view).last_swap_in = Some((s.bytes, s.duration));
        self.usage();
        Ok(())
    }
}
