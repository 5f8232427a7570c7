//! The gate's state: open or closed (for all GPUs or some), the submission counters,
//! and the queue bound. While this process may run work (it holds the GPU, or the
//! arbiter said everyone fits, or it runs unmanaged) and its memory is resident, the
//! gate is open and [`Gate::try_enter`] costs two atomic operations (and, while a GPU
//! is held, the queue bound's count: one more add): no lock, no allocation, no system
//! call. What a submission does when the gate is closed (ask the client for the turn,
//! look at captures) is the hooked behaviour's: [`crate::submit`]. The gate uses no
//! other module of the shim: the client opens and closes it.
//!
//! Closing is a two-sided handshake: the closer sets `state` closed, then waits until
//! no submission is between its check and its driver call (`inflight` = 0); a
//! submitter announces itself in `inflight`, then re-checks `state`. Both sides use
//! SeqCst, so at least one of them sees the other. A paused gate ([`Gate::pause`]) is
//! open to everything but the fast path: the next submission reopens it.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, Ordering};

/// Low 32 bits: submissions in flight. High 32 bits: submissions so far (wrapping).
const ENTER: u64 = (1 << 32) | 1;
const INFLIGHT_MASK: u64 = 0xffff_ffff;

/// `Gate::state`: closed (for all GPUs, or open for some: `devices`).
const CLOSED: u8 = 0;
/// Open: the fast path admits.
const OPEN: u8 = 1;
/// Open, but the next submission takes the slow path once, which reopens the gate and
/// tells the client when the pause of the process ended ([`Gate::pause`]).
const PAUSED: u8 = 2;

pub struct Gate {
    /// [`CLOSED`], [`OPEN`] or [`PAUSED`].
    state: AtomicU8,
    /// Devices (bit per ordinal) whose work may run while `open` is false: set when the
    /// process holds the turns it needs but has contexts on GPUs it does not use
    /// ([`Gate::open_devices`]). Only the slow path reads it.
    devices: AtomicU64,
    counter: AtomicU64,
    /// Submissions that took the slow path (counted on entry, before they wait): with
    /// the fast path's count, [`Gate::token`]. Only the slow path writes it.
    slow: AtomicU32,
}

impl Default for Gate {
    fn default() -> Self {
        Self::new()
    }
}

impl Gate {
    pub const fn new() -> Self {
        Self {
            state: AtomicU8::new(CLOSED),
            devices: AtomicU64::new(0),
            counter: AtomicU64::new(0),
            slow: AtomicU32::new(0),
        }
    }

    /// Enters if open; the caller must [`Gate::exit`] after its driver call.
    #[inline(always)]
    pub fn try_enter(&self) -> bool {
        if self.state.load(Ordering::SeqCst) != OPEN {
            return false;
        }
        self.counter.fetch_add(ENTER, Ordering::SeqCst);
        if self.state.load(Ordering::SeqCst) == OPEN {
            return true;
        }
        self.counter.fetch_sub(1, Ordering::SeqCst);
        false
    }

    #[inline(always)]
    pub fn exit(&self) {
        self.counter.fetch_sub(1, Ordering::Release);
    }

    /// Open (paused included: every submission is admitted).
    pub fn is_open(&self) -> bool {
        self.state.load(Ordering::SeqCst) != CLOSED
    }

    pub fn open(&self) {
        self.devices.store(u64::MAX, Ordering::SeqCst);
        self.state.store(OPEN, Ordering::SeqCst);
    }

    /// An open gate sends the next submission through the slow path once, which
    /// calls [`Gate::resume`]: the process's queued work was seen done, and the
    /// client wants to know to the microsecond when the process submits again (its
    /// pauses set how long it may idle before releasing early, `crate::idle`)
    /// without a clock read on the fast path. False if the gate was not open.
    pub fn pause(&self) -> bool {
        self.state
            .compare_exchange(OPEN, PAUSED, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
    }

    /// Reopens a paused gate; true for the one caller that did it. A gate closed
    /// since the pause stays closed.
    pub fn resume(&self) -> bool {
        self.state
            .compare_exchange(PAUSED, OPEN, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
    }

    /// Opens for the work of the devices in `mask` only: the fast path stays closed
    /// and a submission enters through [`Gate::try_enter_device`].
    pub fn open_devices(&self, mask: u64) {
        self.state.store(CLOSED, Ordering::SeqCst);
        self.devices.store(mask, Ordering::SeqCst);
    }

    /// Whether the gate is open for only some devices (submissions must say which).
    pub fn partial(&self) -> bool {
        self.devices.load(Ordering::SeqCst) != 0 && self.state.load(Ordering::SeqCst) == CLOSED
    }

    /// Whether work on device `d` may run now.
    pub fn admits(&self, d: usize) -> bool {
        d < 64 && self.devices.load(Ordering::SeqCst) & (1u64 << d) != 0
    }

    /// [`Gate::try_enter`] for a submission to device `d` (the same handshake on the
    /// device mask); the caller must [`Gate::exit`] after its driver call.
    pub fn try_enter_device(&self, d: usize) -> bool {
        if !self.admits(d) {
            return false;
        }
        self.counter.fetch_add(ENTER, Ordering::SeqCst);
        if self.admits(d) {
            return true;
        }
        self.counter.fetch_sub(1, Ordering::SeqCst);
        false
    }

    /// Stops admitting and waits for submissions already past the check.
    pub fn close_and_wait(&self) {
        self.close();
        self.wait_in_flight();
    }

    /// Stops admitting without waiting (memory became non-resident: the next submission
    /// must take the slow path).
    pub fn close(&self) {
        self.state.store(CLOSED, Ordering::SeqCst);
        self.devices.store(0, Ordering::SeqCst);
    }

    /// Stops admitting work on device `d` (a context on it that this process has not
    /// used yet) and waits for submissions already past the check; the others' work
    /// goes on through [`Gate::try_enter_device`].
    pub fn exclude_and_wait(&self, d: usize) {
        let was_open = self.state.swap(CLOSED, Ordering::SeqCst) != CLOSED;
        let bit = 1u64 << (d & 63);
        if was_open {
            self.devices.store(!bit, Ordering::SeqCst);
        } else {
            self.devices.fetch_and(!bit, Ordering::SeqCst);
        }
        self.wait_in_flight();
    }

    /// The closer's side of the handshake (module docs): waits until no submission is
    /// between its check and its driver call. Spins briefly (a driver call is short),
    /// then yields.
    fn wait_in_flight(&self) {
        let mut spins = 0u32;
        while self.counter.load(Ordering::SeqCst) & INFLIGHT_MASK != 0 {
            spins += 1;
            if spins < 100 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    }

    /// Submissions so far (wrapping at 2^32): the idle detector watches it change.
    /// A submission counts from the moment it enters, before its driver call has
    /// queued its work: see [`Gate::in_flight`].
    pub fn submissions(&self) -> u32 {
        (self.counter.load(Ordering::Relaxed) >> 32) as u32
    }

    /// A submission took the slow path: it counts for [`Gate::token`] from now on,
    /// before it waits for the turn (it may run after the next swap-in).
    #[inline]
    pub fn note_slow(&self) {
        self.slow.fetch_add(1, Ordering::SeqCst);
    }

    /// The submission token: changes with every submission the application tries,
    /// through the fast path or the slow one, run or still waiting. A discard
    /// (`kiwiMemDiscard`, [`crate::live`]) holds while the token is the one it was
    /// made at: any kernel or copy since could have written the range.
    pub fn token(&self) -> u64 {
        let fast = self.counter.load(Ordering::SeqCst) >> 32;
        (fast << 32) | u64::from(self.slow.load(Ordering::SeqCst))
    }

    /// Whether a submission is between entering and its driver call's return: its
    /// work may not be queued yet, so a drain now could return before it and see the
    /// process idle while that work is about to run.
    pub fn in_flight(&self) -> bool {
        self.counter.load(Ordering::SeqCst) & INFLIGHT_MASK != 0
    }

    /// Waits, at most `limit`, until no submission is in its driver call; false if
    /// one still was. Submissions keep entering meanwhile (the gate stays open).
    pub fn wait_no_call_in_flight(&self, limit: std::time::Duration) -> bool {
        let deadline = std::time::Instant::now() + limit;
        while self.in_flight() {
            if std::time::Instant::now() >= deadline {
                return false;
            }
            std::thread::yield_now();
        }
        true
    }
}

/// The process's gate.
pub static GATE: Gate = Gate::new();

/// Set by the client while this process holds a GPU (exclusively or shared): then the
/// queue of submitted work is bounded ([`QUEUE_BOUND`]), so a drop drains quickly
/// however long the application's kernels are and however much it queued at once.
pub static THROTTLE: AtomicBool = AtomicBool::new(false);

/// The adaptive bound on queued work while holding a GPU: after every `limit`
/// submissions the submitting thread waits for the queue to empty. The wait is
/// timed: longer than the target halves the limit, much shorter doubles it, so the
/// queue holds about the target of GPU time whatever the kernels' length.
pub struct QueueBound {
    since_sync: AtomicU64,
    limit: AtomicU64,
    /// Threads waiting in the bound right now: the application is busy, not idle.
    syncing: AtomicU64,
    /// The target, in microseconds ([`QueueBound::EXCLUSIVE`] or [`QueueBound::SHARED`]).
    target_us: AtomicU64,
}

impl QueueBound {
    /// GPU time a drop may have to drain while a drop is coming (others wait, or we
    /// hold exclusively): tens of milliseconds.
    pub const EXCLUSIVE: std::time::Duration = std::time::Duration::from_millis(25);
    /// While sharing (everything fits) no drop is due, but a newcomer that does not fit
    /// makes one come (at once for all but one holder): the queue stays well under the
    /// 250 ms drop-latency goal even with other sharers' kernels interleaved, and a
    /// sync bubble every 100 ms costs nothing measurable.
    pub const SHARED: std::time::Duration = std::time::Duration::from_millis(100);
    const MAX: u64 = 1024;

    pub const fn new() -> Self {
        Self {
            since_sync: AtomicU64::new(0),
            limit: AtomicU64::new(8),
            syncing: AtomicU64::new(0),
            target_us: AtomicU64::new(Self::EXCLUSIVE.as_micros() as u64),
        }
    }

    /// The GPU time the queue should hold at most.
    pub fn target(&self) -> std::time::Duration {
        std::time::Duration::from_micros(self.target_us.load(Ordering::Relaxed))
    }

    /// Sets the target; returns whether it changed.
    pub fn set_target(&self, t: std::time::Duration) -> bool {
        let us = t.as_micros() as u64;
        self.target_us.swap(us, Ordering::Relaxed) != us
    }

    /// Counts a submission; every `limit`-th waits for the queue with `sync` (out of
    /// line: the launch path while holding a GPU pays one atomic add and a compare).
    /// `sync` says whether it waited (false: it could not, the wait is not timed);
    /// the caller ([`crate::submit`]) knows how to wait.
    #[inline(always)]
    pub fn after_submit(&self, sync: impl FnOnce() -> bool) {
        let n = self.since_sync.fetch_add(1, Ordering::Relaxed) + 1;
        if n >= self.limit.load(Ordering::Relaxed) {
            self.wait_for_queue(sync);
        }
    }

    #[cold]
    #[inline(never)]
    fn wait_for_queue(&self, sync: impl FnOnce() -> bool) {
        self.since_sync.store(0, Ordering::Relaxed);
        let t = std::time::Instant::now();
        self.syncing.fetch_add(1, Ordering::SeqCst);
        if !sync() {
            self.syncing.fetch_sub(1, Ordering::SeqCst);
            return;
        }
        self.syncing.fetch_sub(1, Ordering::SeqCst);
        self.adapt(t.elapsed());
    }

    /// Whether a submitting thread is waiting in the bound (the app is busy).
    pub fn syncing(&self) -> bool {
        self.syncing.load(Ordering::SeqCst) > 0
    }

    /// Adjusts the limit after a wait of `waited` for `limit` submissions.
    pub fn adapt(&self, waited: std::time::Duration) {
        let limit = self.limit.load(Ordering::Relaxed);
        let target = self.target();
        let next = if waited > target {
            (limit / 2).max(1)
        } else if waited < target / 4 {
            (limit * 2).min(Self::MAX)
        } else {
            limit
        };
        self.limit.store(next, Ordering::Relaxed);
    }

    pub fn limit(&self) -> u64 {
        self.limit.load(Ordering::Relaxed)
    }
}

impl Default for QueueBound {
    fn default() -> Self {
        Self::new()
    }
}

/// The process's queue bound.
pub static QUEUE_BOUND: QueueBound = QueueBound::new();

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queue_bound_adapts_to_kernel_length() {
        let b = QueueBound::new();
        // Long kernels: every wait is long, the limit falls to a handful.
        for _ in 0..10 {
            b.adapt(std::time::Duration::from_millis(200));
        }
        assert_eq!(b.limit(), 1);
        // Short kernels: waits are tiny, the limit climbs to the driver's depth.
        for _ in 0..20 {
            b.adapt(std::time::Duration::from_micros(100));
        }
        assert_eq!(b.limit(), QueueBound::MAX);
        // In the target band it stays.
        b.adapt(QueueBound::EXCLUSIVE / 2);
        assert_eq!(b.limit(), QueueBound::MAX);
    }

    #[test]
    fn queue_bound_target_follows_sharing() {
        let b = QueueBound::new();
        assert_eq!(b.target(), QueueBound::EXCLUSIVE);
        assert!(b.set_target(QueueBound::SHARED));
        assert!(!b.set_target(QueueBound::SHARED));
        // 100 ms of work per wait: within the shared target it keeps the limit...
        b.adapt(std::time::Duration::from_millis(100));
        assert_eq!(b.limit(), 8);
        // ...and once a drop may come, the same wait halves it.
        assert!(b.set_target(QueueBound::EXCLUSIVE));
        b.adapt(std::time::Duration::from_millis(100));
        assert_eq!(b.limit(), 4);
    }
    use std::sync::Arc;

    #[test]
    fn a_submission_is_in_flight_until_it_exits() {
        let g = Gate::new();
        g.open();
        assert!(!g.in_flight());
        assert!(g.try_enter());
        // Counted at once, its work not yet queued.
        assert_eq!(g.submissions(), 1);
        assert!(g.in_flight());
        assert!(!g.wait_no_call_in_flight(std::time::Duration::from_millis(2)));
        g.exit();
        assert!(!g.in_flight());
        assert!(g.wait_no_call_in_flight(std::time::Duration::ZERO));
        assert_eq!(g.submissions(), 1);
    }

    #[test]
    fn closed_gate_refuses_and_counts_nothing() {
        let g = Gate::new();
        assert!(!g.try_enter());
        g.open();
        assert!(g.try_enter());
        assert!(g.try_enter());
        g.exit();
        g.exit();
        assert_eq!(g.submissions(), 2);
        g.close_and_wait();
        assert!(!g.try_enter());
        assert_eq!(g.submissions(), 2);
    }

    #[test]
    fn a_paused_gate_sends_one_submission_the_slow_way_and_a_close_wins() {
        let g = Gate::new();
        assert!(!g.pause(), "a closed gate does not pause");
        g.open();
        assert!(g.pause());
        assert!(g.is_open() && !g.partial(), "paused is open, not partly");
        assert!(!g.try_enter(), "the fast path refuses while paused");
        assert!(g.resume(), "the first submission reopens it");
        assert!(!g.resume(), "only once");
        assert!(g.try_enter());
        g.exit();
        assert!(g.pause());
        g.close();
        assert!(!g.resume(), "closed since the pause: stays closed");
        assert!(!g.is_open() && !g.try_enter());
    }

    #[test]
    fn close_waits_for_inflight_submissions() {
        let g = Arc::new(Gate::new());
        g.open();
        assert!(g.try_enter());
        let exited = Arc::new(AtomicBool::new(false));
        let (g2, exited2) = (g.clone(), exited.clone());
        let closer = std::thread::spawn(move || {
            g2.close_and_wait();
            // Returned only after the submission in flight left.
            exited2.load(Ordering::SeqCst)
        });
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(
            !closer.is_finished(),
            "close returned while a submission was in flight"
        );
        exited.store(true, Ordering::SeqCst);
        g.exit();
        assert!(closer.join().unwrap());
    }

    #[test]
    fn no_submission_runs_after_close_returns() {
        // Hammer the handshake: after close_and_wait returns, no thread may be inside.
        let g = Arc::new(Gate::new());
        let inside = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let workers: Vec<_> = (0..3)
            .map(|_| {
                let (g, inside, stop) = (g.clone(), inside.clone(), stop.clone());
                std::thread::spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        if g.try_enter() {
                            inside.fetch_add(1, Ordering::SeqCst);
                            inside.fetch_sub(1, Ordering::SeqCst);
                            g.exit();
                        }
                    }
                })
            })
            .collect();
        for _ in 0..2000 {
            g.open();
            std::hint::spin_loop();
            g.close_and_wait();
            assert_eq!(inside.load(Ordering::SeqCst), 0);
        }
        stop.store(true, Ordering::Relaxed);
        for w in workers {
            w.join().unwrap();
        }
    }
}
