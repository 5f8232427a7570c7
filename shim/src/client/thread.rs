//! A turn's thread: reads the arbiter's messages and answers them, ticks (the idle
//! detector), bounds the submission queue while a turn is held, and reconnects when
//! the arbiter restarts.

use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};

use super::*;

impl Client {
    fn handle(&self, turn: &Turn, msg: ArbiterMsg) {
        let k = turn.slot;
        crate::kdebug!("arbiter (slot {k}): {msg:?}");
        match msg {
            ArbiterMsg::Grant {
                exclusive,
                waiting,
                pipelined,
                tq_ms,
                group,
            } => {
                lock(&self.state).slots[k].ts.group = group;
                self.on_grant(k, exclusive, waiting, pipelined, tq_ms)
            }
            ArbiterMsg::Drop { need_bytes, .. } => self.on_drop(k, need_bytes),
            ArbiterMsg::Contended {
                waiting,
                need_bytes,
            } => {
                let mut st = lock(&self.state);
                let ts = &mut st.slots[k].ts;
                ts.contended = waiting;
                ts.contended_need = need_bytes;
                // Others wait: the buffers the coming swap-out needs are pinned now,
                // in the background, so the release does not wait for pinning.
                let target = if waiting > 0 { need_bytes } else { 0 };
                if turn.pin_target.swap(target, Ordering::AcqRel) != target {
                    self.wake_pinning();
                }
            }
            ArbiterMsg::Reclaim { need_bytes } => self.on_reclaim(k, need_bytes),
            ArbiterMsg::Revoked { reason } => self.on_revoked(k, &reason),
            ArbiterMsg::Settings(s) => crate::kinfo!(
                "scheduler {} TQ {} ms",
                if s.scheduler_on { "on" } else { "off" },
                s.tq_ms
            ),
            ArbiterMsg::Error { code, message } => {
                crate::kwarn!("arbiter error {code:?}: {message}");
                *lock(&turn.last_error) = Some(format!("{code:?}: {message}"));
            }
            ArbiterMsg::Admitted { ok, message, .. } => turn.on_admitted(ok, message),
            ArbiterMsg::Waiting {
                holder,
                other_holders,
                ahead,
                quantum_left_ms,
            } => {
                let now = Instant::now();
                lock(&turn.view).why = Some(crate::status::Why {
                    holder,
                    other_holders,
                    ahead,
                    quantum_end: quantum_left_ms.map(|ms| now + Duration::from_millis(ms)),
                });
            }
            // Oversubscribed: a swap-out of this client may come at any time (a drop, a
            // reclaim, an idle eviction), whether it holds the GPU or not; its pinned
            // buffers are prepared in the background. No longer: the spares go back.
            ArbiterMsg::Room {
                others_unswappable_bytes,
                keep,
            } => {
                *lock(&turn.keep) = keep;
                turn.others_fixed
                    .store(others_unswappable_bytes, Ordering::Relaxed);
                turn.update_limit();
            }
            ArbiterMsg::Pressure {
                oversubscribed,
                idle_evict_ms,
                shared,
            } => {
                lock(&self.state).slots[turn.slot].ts.idle_evict = (oversubscribed
                    && idle_evict_ms > 0)
                    .then(|| Duration::from_millis(idle_evict_ms));
                crate::kdebug!(
                    "GPU {}: {}oversubscribed",
                    turn.info.ordinal,
                    if oversubscribed { "" } else { "no longer " }
                );
                turn.pressure.store(oversubscribed, Ordering::Release);
                turn.shared.store(shared, Ordering::Release);
                if !oversubscribed && !shared {
                    turn.pin_trim.store(true, Ordering::Release);
                }
                self.wake_pinning();
            }
            ArbiterMsg::Pong { token } => turn.on_pong(token),
            // The swap pool's and the NVML view's answers come on their own
            // connections (`crate::pool`, `crate::view`).
            ArbiterMsg::PoolReclaim { bytes } => {
                self.spill_want.fetch_max(bytes, Ordering::AcqRel);
                self.wake_pinning();
            }
            ArbiterMsg::PoolOpened { .. }
            | ArbiterMsg::PoolLent { .. }
            | ArbiterMsg::PoolSpilled { .. }
            | ArbiterMsg::PoolRefused { .. }
            | ArbiterMsg::View { .. } => {}
            // Said right after `registered`, where `register` applies it; one that
            // came later still applies (only ever to the process's own wait).
            ArbiterMsg::Bounds { hint_wait_ms } => register::apply_bounds(hint_wait_ms),
            ArbiterMsg::Checkpointed { restored } => {
                turn.on_checkpointed(restored);
                // What the pinning thread put off while checkpointed goes on.
                if restored {
                    self.wake_pinning();
                }
            }
            ArbiterMsg::Registered { .. } => {}
        }
    }

    pub(super) fn run(
        self: Arc<Self>,
        turn: Arc<Turn>,
        reader: Option<Conn>,
        first: Option<ArbiterMsg>,
    ) {
        // Its swaps, pins and waits never invalidate the application's captures.
        crate::capture::relax_this_thread();
        let k = turn.slot;
        if let Some(m) = first {
            self.handle(&turn, m);
        }
        let conn = match reader {
            Some(c) => c,
            None => self.reconnect(&turn),
        };
        let mut inbox = Inbox::start(&turn, conn);
        // Whatever else arrived is handled before ticking, up to a bound: a stream of
        // messages never starves the idle detector.
        let mut drained = 0;
        loop {
            let wait = if drained > 0 {
                Duration::ZERO
            } else {
                self.next_tick(k)
            };
            match inbox.next(wait) {
                Ok(Some(msg)) => {
                    self.handle(&turn, msg);
                    drained += 1;
                    if drained < DRAIN_MAX {
                        continue;
                    }
                }
                Ok(None) => {}
                Err(e) => {
                    let why = lock(&turn.last_error)
                        .take()
                        .map(|w| format!("; it said {w}"))
                        .unwrap_or_default();
                    crate::kwarn!("lost the arbiter ({e}{why}); reconnecting");
                    inbox = Inbox::start(&turn, self.reconnect(&turn));
                }
            }
            drained = 0;
            self.tick(k);
            self.refresh_throttle(&lock(&self.state));
        }
    }

    /// Bounds the submission queue while we hold a GPU. Exclusive or with others
    /// waiting, a drop can come at any time: the queue holds ~25 ms. Sharing, a drop
    /// comes only when a newcomer no longer fits (for all holders but one at once),
    /// so work queued then must drain too: the queue holds ~100 ms.
    pub(super) fn refresh_throttle(&self, st: &State) {
        let (mut on, mut dropping) = (false, false);
        for ts in st.slots.iter().map(|s| &s.ts) {
            if ts.phase == Phase::Holding {
                on = true;
                dropping |= ts.exclusive || ts.contended > 0;
            }
        }
        let bound = &crate::gate::QUEUE_BOUND;
        let target = if dropping {
            crate::gate::QueueBound::EXCLUSIVE
        } else {
            crate::gate::QueueBound::SHARED
        };
        let changed = bound.set_target(target);
        if crate::gate::THROTTLE.swap(on, Ordering::Relaxed) != on || changed {
            crate::kdebug!(
                "queue bound {}",
                if on {
                    format!("{target:?}")
                } else {
                    "off".into()
                }
            );
        }
    }

    /// Reconnects with backoff (50 ms … 1 s) and re-registers with what the turn held.
    fn reconnect(&self, turn: &Turn) -> Conn {
        let k = turn.slot;
        *lock(&turn.writer) = None;
        let mut backoff = Duration::from_millis(50);
        loop {
            std::thread::sleep(backoff);
            backoff = (backoff * 2).min(Duration::from_secs(1));
            let resume = {
                let st = lock(&self.state);
                Resume {
                    holding: st.slots[k].ts.phase == Phase::Holding,
                    waiting: st.slots[k].ts.phase == Phase::Requested,
                }
            };
            let unswappable = turn.unswappable();
            match register(
                &self.env,
                &turn.info,
                k,
                turn.res.figures(),
                unswappable,
                Some(resume),
            ) {
                Ok(r) => {
                    stats::RECONNECTS.fetch_add(1, Ordering::Relaxed);
                    turn.reports_unswappable
                        .store(r.reports_unswappable, Ordering::Relaxed);
                    {
                        let mut st = lock(&self.state);
                        let ts = &mut st.slots[k].ts;
                        ts.last_unswappable = r.reports_unswappable.then_some(unswappable);
                        ts.last_usage = None;
                    }
                    turn.capacity.store(r.capacity, Ordering::Relaxed);
                    turn.others_fixed.store(
                        r.others_fixed.as_ref().map_or(u64::MAX, |r| r.0),
                        Ordering::Relaxed,
                    );
                    *lock(&turn.keep) = r.others_fixed.and_then(|r| r.1);
                    turn.budgeted
                        .store(r.swap_budget.is_some(), Ordering::Release);
                    turn.pipelined.store(r.pipelined, Ordering::Relaxed);
                    turn.swap_budget
                        .store(r.swap_budget.unwrap_or(u64::MAX), Ordering::Relaxed);
                    turn.update_limit();
                    let st = lock(&self.state);
                    *lock(&turn.writer) = Some(r.writer);
                    if st.slots[k].ts.phase == Phase::Requested {
                        turn.send(&ClientMsg::Request);
                    }
                    drop(st);
                    crate::kwarn!(
                        "GPU {}: reconnected to the arbiter (holding: {})",
                        turn.info.ordinal,
                        resume.holding
                    );
                    if let Some(m) = r.first {
                        self.handle(turn, m);
                    }
                    return r.reader;
                }
                Err(e) => crate::kdebug!("reconnect failed: {e}"),
            }
        }
    }
}

/// The most messages handled in a row before a tick.
const DRAIN_MAX: usize = 64;

/// What the reader thread hands the turn's thread.
type Received = Result<ArbiterMsg, ProtocolError>;

/// A turn's incoming messages. A reader thread of its own takes them off the
/// connection and answers an admission at once ([`Turn::admit`] waits in the
/// application's allocation for it), while the turn's thread may be in a swap of
/// seconds; every other message reaches the turn's thread in the arbiter's order.
/// Where no thread can be started, the turn's thread reads the connection itself, as
/// before (an admission then waits for its swaps).
enum Inbox {
    Thread(Receiver<Received>),
    Inline(Conn),
}

impl Inbox {
    fn start(turn: &Arc<Turn>, conn: Conn) -> Inbox {
        let (tx, rx) = mpsc::channel();
        // The connection goes to the reader through a slot, which a failed start
        // leaves full: the turn's thread then reads it itself.
        let slot = Arc::new(Mutex::new(Some(conn)));
        let taken = Arc::clone(&slot);
        let t = Arc::clone(turn);
        let spawned = std::thread::Builder::new()
            .name("kiwi-arbiter-rx".into())
            .spawn(move || {
                let Some(mut conn) = lock(&taken).take() else {
                    return;
                };
                read(&t, &mut conn, &tx);
            });
        match spawned {
            Ok(_) => Inbox::Thread(rx),
            Err(e) => {
                crate::kwarn!(
                    "cannot start the arbiter reader thread ({e}); reading on the turn's thread"
                );
                match lock(&slot).take() {
                    Some(conn) => Inbox::Inline(conn),
                    // Unreachable: a thread that never started never took it.
                    None => Inbox::Thread(rx),
                }
            }
        }
    }

    /// The next message, waiting at most `timeout`; `Ok(None)` when none came.
    fn next(&mut self, timeout: Duration) -> Result<Option<ArbiterMsg>, ProtocolError> {
        match self {
            Inbox::Thread(rx) => match rx.recv_timeout(timeout) {
                Ok(r) => r.map(Some),
                Err(RecvTimeoutError::Timeout) => Ok(None),
                Err(RecvTimeoutError::Disconnected) => Err(ProtocolError::Io(
                    std::io::Error::other("the arbiter reader thread ended"),
                )),
            },
            Inbox::Inline(conn) => next_message(conn, timeout),
        }
    }
}

/// The reader thread: until the connection fails (then the error goes to the turn's
/// thread, which reconnects and starts another) or the turn's thread is gone.
fn read(turn: &Turn, conn: &mut Conn, tx: &Sender<Received>) {
    loop {
        match next_message(conn, Duration::from_secs(1)) {
            Ok(None) => {}
            Ok(Some(ArbiterMsg::Admitted { ok, message, .. })) => turn.on_admitted(ok, message),
            Ok(Some(m)) => {
                if tx.send(Ok(m)).is_err() {
                    return;
                }
            }
            Err(e) => {
                turn.on_connection_lost();
                let _ = tx.send(Err(e));
                return;
            }
        }
    }
}
