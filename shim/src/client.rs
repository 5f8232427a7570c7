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
//! `acquire` (the wait for the turns, requests, grants, opening the gate), `release`
//! (releases, drops and their settling, reclaims, revocations), `early_release` (the
//! idle detector), `thread` (a turn's thread: messages, ticks, reconnection), `room`
//! (the room-making protocol of a held turn), `pinning` (the pinning thread),
//! `residency` (what a turn needs of its allocator) and `mode` (the process-wide
//! client and its start-up). Here: the turn state, and adding a GPU.

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

mod acquire;
mod early_release;
mod mode;
mod pinning;
mod register;
mod release;
mod residency;
mod room;
mod thread;
mod turn;

use mode::CLIENT;
pub use mode::{acquire, allocator_enabled, global, mode_name, on_init, resumed};
pub use register::StartError;
use register::{next_message, register};
pub use residency::Residency;
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
}
