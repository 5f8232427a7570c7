//! The arbiter client: the process's turns on the GPUs it uses. Each GPU the process
//! gets a context on has a [`Turn`]: its own connection to
//! `<socket dir>/client/arbiter.sock` (the protocol registers one GPU per connection),
//! its own background thread that reads the arbiter's messages, does that GPU's swaps,
//! releases early when the process idles while others wait, batches usage reports and
//! reconnects when the arbiter restarts.
//!
//! The process runs work only while it holds **every** one of its turns (the gate is
//! process-wide, so the launch path stays two atomic operations). Turns are acquired in
//! one fixed order, by GPU UUID, the same in every process: a process never holds or
//! keeps a GPU later in that order while it waits for an earlier one, so two processes
//! sharing the same GPUs cannot wait for each other.
//!
//! Lock order: `state` → residency (an allocator's own lock) → a turn's `writer`.
//!
//! This module owns the protocol conversation and the turn state; it does not know how
//! memory is swapped ([`Residency`]) or how submissions are admitted ([`Gate`]). Its
//! parts: `turn` (one GPU's [`Turn`]), `register` (registration and its fallbacks),
//! `room` (the room-making protocol of a held turn), `pinning` (the pinning thread);
//! the acquisition, the turn threads and their message handling are here.

use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use kiwi_protocol::blocking::Connection;
use kiwi_protocol::{
    ArbiterMsg, ClientMsg, ErrorCode, Keep, ProtocolError, Register, Resume, SwapDirection, Usage,
    PROTOCOL_VERSION,
};

use crate::cuda::{
    CUresult, CUDA_ERROR_NOT_INITIALIZED, CUDA_ERROR_OUT_OF_MEMORY, CUDA_ERROR_SYSTEM_NOT_READY,
    CUDA_ERROR_TIMEOUT, CUDA_SUCCESS,
};
use crate::env::ShimEnv;
use crate::gate::Gate;
use crate::idle::IdleLearner;
use crate::mem::{Figures, Swap};
use crate::stats;

type Conn = Connection<ClientMsg, ArbiterMsg>;

mod pinning;
mod register;
mod room;
mod turn;

pub use register::StartError;
use register::{next_message, register};
pub use room::{pending_short_of_room, report_now};
use turn::Swapping;
pub use turn::{Admission, Turn};

/// Most GPUs one process can hold turns on (device ordinals below this are managed).
pub const MAX_TURNS: usize = 64;

/// How long a holder waits for room to swap in before it says so on stderr (it keeps
/// waiting: the arbiter is making room).
const SHORT_OF_ROOM_LOG: Duration = Duration::from_secs(2);
/// How long an allocation waits for the arbiter's swap admission before going ahead.
const ADMIT_WAIT: Duration = Duration::from_secs(10);
/// How long `cuMemGetInfo` waits for the arbiter's latest word on the others' memory
/// ([`Turn::sync_room`]); a round trip takes well under a millisecond.
const SYNC_WAIT: Duration = Duration::from_millis(250);
/// Pinned buffers the pinning thread prepares per step before it looks at its work
/// again (one segment's buffer): it pins without any of the shim's locks held, so
/// nothing waits behind it, and a step is short enough that a new target (a drop, the
/// pressure ending) is seen soon.
const PIN_STEP: u64 = 64 << 20;
/// How long a swap-in after a pipelined grant retries, at short intervals, for the
/// memory the previous holder frees segment by segment (and no longer than
/// [`crate::mem::ROOM_STALL`] with none coming); after that it waits as any
/// short-of-room turn does (a retry per tick, `no_room` to the arbiter). Under the
/// arbiter's grace (5 s).
const PIPELINED_WAIT: Duration = Duration::from_secs(2);
/// How often the pinning thread looks again while a turn wants buffers ready.
const PIN_RECHECK: Duration = Duration::from_millis(200);
/// How long a registration that asked for `room_info` waits for `room` after
/// `registered` (a conforming arbiter sends both at once).
const ROOM_WAIT: Duration = Duration::from_secs(1);
/// How often a held turn short of room tells the arbiter again ([`ClientMsg::NoRoom`]):
/// a reclaim answered without freeing enough (memory outside Kiwi grew meanwhile) is
/// then made again.
pub const NO_ROOM_RESEND: Duration = Duration::from_millis(250);
/// A submission that waited this long says why, once ([`Client::acquire`]).
pub const EXPLAIN_AFTER: Duration = Duration::from_secs(1);
/// The device of a submission from a thread with no current context: it needs the
/// turn of every GPU the process has a context on.
pub const ANY_DEVICE: usize = usize::MAX;

/// What a turn needs from its GPU's allocator: residency, eviction, draining.
pub trait Residency: Send + Sync {
    fn figures(&self) -> Figures;
    fn set_limit(&self, limit: u64);
    fn set_backing_allowed(&self, allowed: bool);
    fn all_resident(&self) -> bool;
    fn swap_in_all(&self) -> Result<Swap, CUresult>;
    /// Swaps everything in while another process frees the memory it needs, segment
    /// by segment: out of memory is tried again, at short intervals, until `until`.
    fn swap_in_waiting(&self, until: Instant) -> Result<Swap, CUresult> {
        let _ = until;
        self.swap_in_all()
    }
    fn evict(&self, need: u64) -> Result<Swap, CUresult>;
    /// Allocates up to about `budget` bytes of the pinned buffers `evict(need)` will
    /// need; returns the bytes allocated (0: ready). Called from the pinning thread:
    /// it must not hold the allocator's lock while it pins.
    fn prepare_swap_out(&self, need: u64, budget: u64) -> Result<u64, CUresult> {
        let _ = (need, budget);
        Ok(0)
    }
    /// Page-locks in place up to about `budget` bytes of the pageable buffers that
    /// hold swapped-out contents (a swap-out that found no pinned buffer ready copied
    /// into plain memory), so their swap-in copies at pinned speed; returns the bytes
    /// registered (0: none left). Called from the pinning thread, without the
    /// allocator's lock held while it registers.
    fn register_swapped(&self, budget: u64) -> Result<u64, CUresult> {
        let _ = budget;
        Ok(0)
    }
    /// Frees the spare pinned buffers (none holds swapped-out contents); returns the
    /// bytes freed.
    fn trim_spare_buffers(&self) -> u64 {
        0
    }
    /// Gives back up to about `budget` bytes of the node's swap pool: spare buffers,
    /// then swapped-out contents moved to the pool's disk tier (the arbiter's
    /// `pool_reclaim`); returns the bytes given back (0: nothing more can be).
    /// Called from the pinning thread.
    fn spill(&self, budget: u64) -> u64 {
        let _ = budget;
        0
    }
    /// Waits until this process's queued GPU work on this GPU is done.
    fn drain(&self) -> Result<(), CUresult>;
    /// [`Residency::drain`] for at most `limit`: `Ok(false)` when the work was not
    /// done by then (it may wait for work not yet submitted: a peer's part of a
    /// collective on another GPU).
    fn drain_within(&self, limit: Duration) -> Result<bool, CUresult> {
        let _ = limit;
        self.drain().map(|()| true)
    }
    /// Runs `f` with the allocator locked, so its residency cannot change meanwhile
    /// (an allocation left unbacked closes the gate under that lock), passing whether
    /// everything is resident; returns `f`'s answer.
    fn locked(&self, f: &mut dyn FnMut(bool) -> bool) -> bool {
        f(self.all_resident())
    }
}

/// A GPU this process uses.
#[derive(Debug, Clone)]
pub struct DeviceInfo {
    /// The device ordinal as this process sees it (after `CUDA_VISIBLE_DEVICES`).
    pub ordinal: usize,
    pub uuid: String,
    pub total_memory: u64,
    /// Device memory the process's context on it costs (measured when the turn is
    /// made: see `hooks::context_cost`); memory no swap frees.
    pub context_bytes: u64,
    /// Memory the process needs on this GPU and cannot take yet: a context, a module
    /// or its own VMM memory waiting for room ([`crate::room`]). Reported as working set not resident, so the
    /// arbiter makes room for it as for memory to swap in.
    pub pending_bytes: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Not holding, not asking.
    Idle,
    /// Asked; waiting for a grant.
    Requested,
    /// Granted (exclusively or shared).
    Holding,
}

/// What the arbiter last said about one turn.
struct TurnState {
    phase: Phase,
    exclusive: bool,
    /// Clients waiting behind us, as the arbiter last said.
    contended: u32,
    /// Bytes to evict when releasing early (from the contention notice).
    contended_need: u64,
    /// Since when a held turn has found no room to swap in (it waits, the arbiter
    /// makes room), and whether that was logged.
    short_since: Option<(Instant, bool)>,
    /// When `no_room` was last sent for this shortage.
    no_room_sent: Option<Instant>,
    last_usage: Option<Usage>,
    /// The non-swappable bytes last reported.
    last_unswappable: Option<u64>,
    /// The process's submission count ([`Gate::submissions`]) up to which this GPU's
    /// queued work was seen done, and when (the end of the drain that saw it): the
    /// idle clock of an early release runs from there.
    work_done: Option<(u32, Instant)>,
    /// [`Turn::room_waits`] at the last look: a wait for room starting or ending
    /// counts as activity, as a submission does.
    room_mark: u32,
    /// When the quantum of the current grant ends (the arbiter then drops us): an
    /// early release can only come before it.
    quantum_end: Option<Instant>,
    /// The current grant's TQ, and whether its quantum waits for the swap-in: the
    /// arbiter starts a `pipelined` client's quantum when its memory is in, if it
    /// had memory out at the grant.
    tq: Duration,
    quantum_waits_for_swap_in: bool,
    /// The arbiter's idle eviction delay while the GPU is oversubscribed
    /// ([`ArbiterMsg::Pressure`]); `None`: not oversubscribed, or eviction off.
    idle_evict: Option<Duration>,
    /// The last grant was a turn of a group that spans GPUs (`Grant { group }`).
    group: bool,
    /// A drop that came while another turn's drop was settling: that one answers
    /// it (`need_bytes`).
    drop_pending: Option<u64>,
}

struct Slot {
    turn: Arc<Turn>,
    ts: TurnState,
}

struct State {
    /// Threads of this process blocked waiting for the GPU(s).
    want: u32,
    /// The process's submission count ([`Gate::submissions`]) at the last look: the
    /// idle detector drains only once it stopped moving.
    idle_mark: u32,
    /// When it last moved.
    quiet_since: Instant,
    /// The process's pauses between pieces of work, which set how long a contended
    /// holder stays idle before releasing early.
    pauses: IdleLearner,
    /// An early release on idleness: the submission count then and when the work was
    /// seen done. If the process submits again sooner than `KIWI_IDLE_MS` after that,
    /// the release came too soon, and that pause is learned.
    released_idle: Option<(u32, Instant)>,
    slots: Vec<Slot>,
    /// Slots in acquisition order: by GPU UUID, the same order in every process.
    order: Vec<usize>,
    /// The wait being explained: the slot named in its line, and when it began.
    explained: Option<(usize, Instant)>,
    /// A drop is being settled ([`Client::settle`]): the gate may open and close
    /// again meanwhile, and other drops wait for it.
    settling: bool,
}

impl State {
    fn holding(&self, k: usize) -> bool {
        self.slots[k].ts.phase == Phase::Holding
    }

    /// Whether turn `k`'s queued work may wait for work on another GPU (its group
    /// spans GPUs, or the process has turns on several): then no drain of it waits
    /// without a bound ([`PEER_WAIT`]), since the work it waits for may be held back
    /// by a closed gate, this process's or a peer's.
    fn bounded(&self, k: usize) -> bool {
        self.slots[k].ts.group || self.slots.iter().filter(|s| s.turn.claimed()).count() >= 2
    }

    /// Position of slot `k` in the acquisition order.
    fn position(&self, k: usize) -> usize {
        self.order.iter().position(|&i| i == k).unwrap_or(0)
    }
}

/// How long a drain of a turn whose work may wait for another GPU's
/// ([`State::bounded`]) waits in all before it gives up: a drop then releases the
/// turn with its memory resident (nothing is evicted under work that still runs; a
/// later reclaim drains again). Well under the arbiter's grace (5 s by default).
const PEER_WAIT: Duration = Duration::from_secs(2);
/// One try of a drop's drain in such a turn; between tries the gate opens again for
/// as long, so the process's threads submit the part of a step its queue waits for
/// ([`Client::settle`]).
const PEER_SLICE: Duration = Duration::from_millis(20);

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

/// A drain that took this long waited for work: the queue ran dry as it returned.
const MIN_WAITED_DRAIN: Duration = Duration::from_millis(1);
/// How long the idle detector waits for a submission's driver call to return before
/// its drain; longer, it looks again at the next tick.
const SETTLE_MAX: Duration = Duration::from_millis(5);

/// The process's connection to its arbiter: one turn per GPU it uses.
pub struct Client {
    env: ShimEnv,
    gate: &'static Gate,
    state: Mutex<State>,
    cv: Condvar,
    /// Turns by device ordinal, readable without waiting behind a swap.
    by_device: [OnceLock<Arc<Turn>>; MAX_TURNS],
    /// The pinning thread ([`Client::pin_loop`]) has work: a turn's target changed.
    pin_work: Mutex<bool>,
    pin_cv: Condvar,
    pin_started: OnceLock<()>,
    /// Bytes of the node's swap pool the arbiter asked back (`pool_reclaim`), for
    /// the pinning thread to give back ([`Residency::spill`]).
    spill_want: AtomicU64,
}

/// Raw fds of every turn's connection (two per slot), closed in a forked child so the
/// child holds nothing.
static CONN_FDS: [AtomicI32; 2 * MAX_TURNS] = [const { AtomicI32::new(-1) }; 2 * MAX_TURNS];

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic elsewhere must not take every later CUDA call down with it.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn usage_of(f: Figures) -> Usage {
    Usage {
        working_set_bytes: f.working_set,
        resident_bytes: f.resident,
    }
}

/// What [`Client::add_device`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Added {
    /// The GPU has a turn (now or from before).
    Managed,
    /// The GPU cannot be managed (the arbiter refused it, or too many GPUs): its
    /// allocator, if any, was created with backing always allowed.
    Unmanaged,
}

/// The outcome of one pass over the turns in acquisition order.
enum Step {
    Ready,
    Wait,
    Fail(CUresult),
}

impl Client {
    /// Waits until the arbiter's socket accepts connections, up to
    /// `KIWI_ARBITER_TIMEOUT` (a log line every 10 s). GPUs register later, as the
    /// process gets a context on each ([`Client::add_device`]).
    pub fn start(env: ShimEnv, gate: &'static Gate) -> Result<Arc<Client>, StartError> {
        crate::hint::set_wait(env.hint_wait);
        let started = Instant::now();
        let mut next_log = started;
        loop {
            match UnixStream::connect(env.client_socket()) {
                // A connection that closes before registering costs the arbiter nothing.
                Ok(_) => break,
                Err(e) => {
                    let now = Instant::now();
                    if now.duration_since(started) >= env.arbiter_timeout {
                        return Err(e.into());
                    }
                    if now >= next_log {
                        crate::kwarn!(
                            "waiting for the Kiwi arbiter at {} ({e}); giving up after {:?}",
                            env.client_socket().display(),
                            env.arbiter_timeout
                        );
                        next_log = now + Duration::from_secs(10);
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        }
        // Nothing may run until the GPUs it touches are held.
        gate.close();
        Ok(Arc::new(Client {
            env,
            gate,
            state: Mutex::new(State {
                want: 0,
                idle_mark: 0,
                quiet_since: Instant::now(),
                pauses: IdleLearner::default(),
                released_idle: None,
                slots: Vec::new(),
                order: Vec::new(),
                explained: None,
                settling: false,
            }),
            cv: Condvar::new(),
            by_device: [const { OnceLock::new() }; MAX_TURNS],
            pin_work: Mutex::new(false),
            pin_cv: Condvar::new(),
            pin_started: OnceLock::new(),
            spill_want: AtomicU64::new(0),
        }))
    }

    /// Every turn of the process, by device ordinal (no lock taken).
    pub fn turns(&self) -> impl Iterator<Item = &Arc<Turn>> {
        self.by_device.iter().filter_map(|t| t.get())
    }

    /// The turn of device `ordinal`, if the process has one.
    pub fn turn_for(&self, ordinal: usize) -> Option<&Arc<Turn>> {
        self.by_device.get(ordinal)?.get()
    }

    /// Gives the process a turn on `info`'s GPU (once per GPU): builds its allocator
    /// with `make_res`, registers with the arbiter and starts the turn's thread. Until
    /// the new turn is held, no work of the process runs.
    pub fn add_device(
        self: &Arc<Self>,
        info: DeviceInfo,
        make_res: impl FnOnce() -> Option<Box<dyn Residency>>,
    ) -> Added {
        let mut st = lock(&self.state);
        if self.turn_for(info.ordinal).is_some() {
            return Added::Managed;
        }
        let slot = st.slots.len();
        if info.ordinal >= MAX_TURNS || slot >= MAX_TURNS {
            crate::kwarn!(
                "GPU {} ({}): more GPUs than the shim manages ({MAX_TURNS}); running it unmanaged",
                info.ordinal,
                info.uuid
            );
            return Added::Unmanaged;
        }
        let Some(res) = make_res() else {
            return Added::Unmanaged;
        };
        res.set_backing_allowed(false);
        let mut figures = res.figures();
        figures.working_set = figures.working_set.saturating_add(info.pending_bytes);
        let unswappable = info.context_bytes + figures.external;
        let (reader, writer, capacity, budget, reports, pipelined, others_fixed, first) =
            match register(&self.env, &info, slot, figures, unswappable, None) {
                Ok(r) => (
                    Some(r.reader),
                    Some(r.writer),
                    r.capacity,
                    r.swap_budget,
                    r.reports_unswappable,
                    r.pipelined,
                    r.others_fixed,
                    r.first,
                ),
                Err(StartError::Refused(m)) => {
                    crate::kerror!(
                    "GPU {} ({}): the arbiter refused it ({m}); running it UNMANAGED: no sharing, no swapping",
                    info.ordinal,
                    info.uuid
                );
                    res.set_backing_allowed(true);
                    return Added::Unmanaged;
                }
                Err(e) => {
                    // The arbiter answered at start: it is restarting. The turn's thread
                    // connects as soon as it is back.
                    crate::kwarn!(
                        "GPU {}: cannot reach the arbiter ({e}); will retry",
                        info.ordinal
                    );
                    (
                        None,
                        None,
                        info.total_memory,
                        None,
                        false,
                        false,
                        None,
                        None,
                    )
                }
            };
        let ordinal = info.ordinal;
        let context_bytes = info.context_bytes;
        let pending_bytes = info.pending_bytes;
        let turn = Arc::new(Turn {
            info,
            slot,
            res,
            writer: Mutex::new(writer),
            capacity: AtomicU64::new(capacity),
            others_fixed: AtomicU64::new(others_fixed.as_ref().map_or(u64::MAX, |r| r.0)),
            keep: Mutex::new(others_fixed.and_then(|r| r.1)),
            budgeted: AtomicBool::new(budget.is_some()),
            admitting: Mutex::new(()),
            admitted: Mutex::new(None),
            refusal: Mutex::new(None),
            admitted_cv: Condvar::new(),
            ping_sent: AtomicU64::new(0),
            pong_seen: Mutex::new(0),
            pong_cv: Condvar::new(),
            view: Mutex::new(crate::status::View::default()),
            seen_working_set: AtomicU64::new(0),
            seen_resident: AtomicU64::new(0),
            claimed: AtomicBool::new(false),
            context_bytes: AtomicU64::new(context_bytes),
            pending: AtomicU64::new(pending_bytes),
            room_waits: AtomicU32::new(0),
            reports_unswappable: AtomicBool::new(reports),
            pipelined: AtomicBool::new(pipelined),
            pin_target: AtomicU64::new(0),
            pressure: AtomicBool::new(false),
            shared: AtomicBool::new(false),
            pin_trim: AtomicBool::new(false),
            pinning: AtomicBool::new(false),
            pin_held_back: AtomicBool::new(false),
            swap_budget: AtomicU64::new(budget.unwrap_or(u64::MAX)),
            swapping: AtomicU32::new(0),
            checkpoint: Arc::default(),
            last_error: Mutex::new(None),
        });
        turn.update_limit();
        turn.usage();
        // A context is not a claim: the process's other GPUs go on; work submitted to
        // this one waits (and claims it) until its turn is held.
        self.gate.exclude_and_wait(ordinal);
        st.slots.push(Slot {
            turn: turn.clone(),
            ts: TurnState {
                phase: Phase::Idle,
                exclusive: false,
                contended: 0,
                contended_need: 0,
                short_since: None,
                no_room_sent: None,
                last_usage: None,
                last_unswappable: reports.then_some(unswappable),
                work_done: None,
                room_mark: 0,
                quantum_end: None,
                tq: Duration::ZERO,
                quantum_waits_for_swap_in: false,
                idle_evict: None,
                group: false,
                drop_pending: None,
            },
        });
        let mut order: Vec<usize> = (0..st.slots.len()).collect();
        order.sort_by(|&a, &b| st.slots[a].turn.info.uuid.cmp(&st.slots[b].turn.info.uuid));
        st.order = order;
        let _ = self.by_device[ordinal].set(turn.clone());
        stats::GPUS.fetch_add(1, Ordering::Relaxed);
        drop(st);
        self.start_pinning();
        let c = self.clone();
        if let Err(e) = std::thread::Builder::new()
            .name(format!("kiwi-gpu{ordinal}"))
            .spawn(move || c.run(turn, reader, first))
        {
            crate::kerror!("cannot start the shim's thread for GPU {ordinal}: {e}");
        }
        Added::Managed
    }

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

    /// Sends this turn's non-swappable bytes and usage where they changed since last
    /// reported.
    fn report(turn: &Turn, ts: &mut TurnState) {
        if turn.reports_unswappable.load(Ordering::Relaxed) {
            let n = turn.unswappable();
            if ts.last_unswappable != Some(n) {
                turn.send(&ClientMsg::Unswappable { bytes: n });
                ts.last_unswappable = Some(n);
            }
        }
        let u = turn.usage();
        if ts.last_usage != Some(u) {
            turn.send(&ClientMsg::Usage(u));
            ts.last_usage = Some(u);
        }
    }

    fn request(&self, st: &mut State, k: usize) {
        let turn = st.slots[k].turn.clone();
        lock(&turn.view).start_waiting(Instant::now());
        let ts = &mut st.slots[k].ts;
        ts.phase = Phase::Requested;
        if turn.reports_unswappable.load(Ordering::Relaxed) {
            let n = turn.unswappable();
            if ts.last_unswappable != Some(n) {
                turn.send(&ClientMsg::Unswappable { bytes: n });
                ts.last_unswappable = Some(n);
            }
        }
        let u = turn.usage();
        if ts.last_usage != Some(u) {
            turn.send(&ClientMsg::Usage(u));
            ts.last_usage = Some(u);
        }
        turn.send(&ClientMsg::Request);
    }

    /// Opens the gate when every claimed turn is held and resident: for all work
    /// when every turn is claimed, else for the work of the claimed GPUs (and of GPUs
    /// the shim does not manage). Residency is checked, and the gate opened, with
    /// every allocator locked: an allocation left unbacked closes the gate under its
    /// allocator's lock, so it cannot slip between the check and the opening (the
    /// gate would open over unmapped memory). Returns whether it opened.
    fn open_gate(&self, st: &State) -> bool {
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

    /// Stops admitting, drains the GPU, evicts `need` bytes and releases the turn.
    /// Threads that still want the GPU ask again from [`Client::acquire`], in order.
    /// `dropped`: the arbiter asked for it (a drop); a pipelined client then says
    /// `drained` as soon as its work is done, before its swap-out, so the next holder
    /// can start swapping in while the memory is freed segment by segment.
    fn give_back(&self, st: &mut State, k: usize, need: u64, early: bool, dropped: bool) {
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

    fn on_grant(&self, k: usize, exclusive: bool, waiting: u32, pipelined: bool, tq_ms: u64) {
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
    fn memory_in(ts: &mut TurnState) {
        if std::mem::take(&mut ts.quantum_waits_for_swap_in) {
            ts.quantum_end = Instant::now().checked_add(ts.tq);
        }
    }

    fn on_drop(&self, k: usize, need: u64) {
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

    fn on_reclaim(&self, k: usize, need: u64) {
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

    fn on_revoked(&self, k: usize, reason: &str) {
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
            ArbiterMsg::Checkpointed { restored } => turn.on_checkpointed(restored),
            ArbiterMsg::Registered { .. } => {}
        }
    }

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
    fn tick(&self, k: usize) {
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
    fn learn_pauses(&self, st: &mut State, subs: u32, now: Instant, exact: bool) {
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
    fn learn_after_release(&self, st: &mut State, now: Instant) {
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
    fn next_tick(&self, k: usize) -> Duration {
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

    fn run(self: Arc<Self>, turn: Arc<Turn>, reader: Option<Conn>, first: Option<ArbiterMsg>) {
        // Its swaps, pins and waits never invalidate the application's captures.
        crate::capture::relax_this_thread();
        let k = turn.slot;
        if let Some(m) = first {
            self.handle(&turn, m);
        }
        let mut conn = match reader {
            Some(c) => c,
            None => self.reconnect(&turn),
        };
        loop {
            match next_message(&mut conn, self.next_tick(k)) {
                Ok(Some(msg)) => {
                    self.handle(&turn, msg);
                    // Drain whatever else arrived before ticking.
                    while let Ok(Some(m)) = conn.try_decode() {
                        self.handle(&turn, m);
                    }
                }
                Ok(None) => {}
                Err(e) => {
                    let why = lock(&turn.last_error)
                        .take()
                        .map(|w| format!("; it said {w}"))
                        .unwrap_or_default();
                    crate::kwarn!("lost the arbiter ({e}{why}); reconnecting");
                    conn = self.reconnect(&turn);
                }
            }
            self.tick(k);
            self.refresh_throttle(&lock(&self.state));
        }
    }

    /// Bounds the submission queue while we hold a GPU. Exclusive or with others
    /// waiting, a drop can come at any time: the queue holds ~25 ms. Sharing, a drop
    /// comes only when a newcomer no longer fits (for all holders but one at once),
    /// so work queued then must drain too: the queue holds ~100 ms.
    fn refresh_throttle(&self, st: &State) {
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

// ---------------------------------------------------------------------------------
// The process-wide client and its start-up state machine.

const UNSTARTED: u8 = 0;
const STARTING: u8 = 1;
const MANAGED: u8 = 2;
const UNMANAGED: u8 = 3;
const FAILED: u8 = 4;
const FORKED: u8 = 5;

static MODE: AtomicU8 = AtomicU8::new(UNSTARTED);
static CLIENT: OnceLock<Arc<Client>> = OnceLock::new();

pub fn mode_name() -> &'static str {
    match MODE.load(Ordering::Acquire) {
        UNSTARTED => "unstarted",
        STARTING => "starting",
        MANAGED => "managed",
        UNMANAGED => "unmanaged",
        FAILED => "failed",
        _ => "forked",
    }
}

/// The client, when this process is managed by an arbiter.
pub fn global() -> Option<&'static Arc<Client>> {
    if MODE.load(Ordering::Acquire) == MANAGED {
        CLIENT.get()
    } else {
        None
    }
}

/// Whether the shim's allocator should serve allocations (not in a forked child, not
/// after a failed start).
pub fn allocator_enabled() -> bool {
    matches!(MODE.load(Ordering::Acquire), MANAGED | UNMANAGED)
}

extern "C" fn after_fork_in_child() {
    // The child inherited the parent's connections and turns: it holds nothing and
    // talks to nobody (a data-loader worker that never touches CUDA must cost the
    // arbiter nothing). Only async-signal-safe work here.
    MODE.store(FORKED, Ordering::Release);
    for fd in &CONN_FDS {
        let fd = fd.swap(-1, Ordering::Relaxed);
        if fd >= 0 {
            // SAFETY: closing a descriptor this process owns (inherited from the parent).
            unsafe { libc::close(fd) };
        }
    }
    crate::pool::close_in_child();
    crate::gate::GATE.open();
}

extern "C" {
    fn pthread_atfork(
        prepare: Option<extern "C" fn()>,
        parent: Option<extern "C" fn()>,
        child: Option<extern "C" fn()>,
    ) -> libc::c_int;
}

/// Starts the client once (at `cuInit`). `has_gpu` says whether the driver sees a GPU
/// at all. Returns the CUDA result `cuInit` should give.
pub fn on_init(has_gpu: impl FnOnce() -> Result<(), CUresult>) -> CUresult {
    loop {
        match MODE.compare_exchange(UNSTARTED, STARTING, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => break,
            Err(STARTING) => std::thread::sleep(Duration::from_millis(5)),
            Err(FAILED) => return CUDA_ERROR_SYSTEM_NOT_READY,
            Err(_) => return CUDA_SUCCESS,
        }
    }
    // SAFETY: registering a plain extern "C" handler.
    unsafe { pthread_atfork(None, None, Some(after_fork_in_child)) };
    crate::stats::register_exit_hook(|| (crate::gate::GATE.submissions(), mode_name()));
    let env = ShimEnv::from_env();
    if let Err(e) = has_gpu() {
        crate::kwarn!("no GPU to manage (CUDA error {e}); running unmanaged");
        MODE.store(UNMANAGED, Ordering::Release);
        crate::gate::GATE.open();
        return CUDA_SUCCESS;
    }
    let require = env.require_arbiter;
    let path = env.client_socket();
    match Client::start(env, &crate::gate::GATE) {
        Ok(c) => {
            let _ = CLIENT.set(c);
            MODE.store(MANAGED, Ordering::Release);
            CUDA_SUCCESS
        }
        Err(e) if require => {
            crate::kerror!(
                "the Kiwi arbiter at {} is not reachable ({e}) and KIWI_REQUIRE_ARBITER is set: failing",
                path.display()
            );
            MODE.store(FAILED, Ordering::Release);
            CUDA_ERROR_SYSTEM_NOT_READY
        }
        Err(e) => {
            crate::kwarn!(
                "WARNING: the Kiwi arbiter at {} is not reachable ({e}); this process runs UNMANAGED: \
                 no GPU sharing, no swapping. Set KIWI_REQUIRE_ARBITER=1 to fail instead.",
                path.display()
            );
            MODE.store(UNMANAGED, Ordering::Release);
            crate::gate::GATE.open();
            CUDA_SUCCESS
        }
    }
}

/// The gate was paused ([`Gate::pause`]) and a submission of this process just
/// reopened it: the process's pause ended now.
pub fn resumed() {
    let now = Instant::now();
    if let Some(c) = CLIENT.get() {
        let mut st = lock(&c.state);
        // The submission that reopened the gate is not counted yet: count it.
        let subs = c.gate.submissions().wrapping_add(1);
        c.learn_pauses(&mut st, subs, now, true);
    }
}

/// The submission slow path: waits for this process's turn(s); `device` as in
/// [`Client::acquire`].
pub fn acquire(gate: &Gate, device: Option<usize>) -> Result<(), CUresult> {
    loop {
        match MODE.load(Ordering::Acquire) {
            MANAGED => {
                return match CLIENT.get() {
                    Some(c) => c.acquire(device),
                    None => Err(CUDA_ERROR_NOT_INITIALIZED),
                }
            }
            UNMANAGED | FORKED => {
                gate.open();
                return Ok(());
            }
            STARTING => std::thread::sleep(Duration::from_millis(5)),
            FAILED => return Err(CUDA_ERROR_SYSTEM_NOT_READY),
            _ => return Err(CUDA_ERROR_NOT_INITIALIZED),
        }
    }
}
