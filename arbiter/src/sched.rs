//! The Kiwi Scheduler for one GPU, as a pure state machine.
//!
//! No I/O and no clock: every input carries `now` (monotonic nanoseconds) and every
//! decision comes back as [`Output`]s — messages to send and events to log. The
//! daemon ([`crate::server`]) feeds it socket traffic and calls [`GpuScheduler::tick`]
//! at [`GpuScheduler::next_deadline`]. Property tests drive it with simulated time.
//!
//! Rules (DESIGN.md, "Arbiter semantics"):
//! - While the registered working sets fit in `capacity` (or the scheduler is off),
//!   every request is granted at once, shared.
//! - Otherwise one holder at a time, FIFO. A holder is asked to drop after TQ only when
//!   someone waits; a lone holder keeps the GPU. Holders hear when others start
//!   waiting, so an idle holder releases early.
//! - Room for the next holder: a dropped holder is told how many bytes the next one
//!   needs, and so is a holder that hears others wait (for an early release). Whatever
//!   is still missing at grant time is reclaimed from idle clients, least recently
//!   active first, in parallel with the grant: room-making never delays a grant (the
//!   new holder's swap-in waits for the memory to come free).
//! - Memory that no swap frees counts: each client's reported non-swappable bytes
//!   (its contexts, modules, own VMM memory) and at least the GPU's context reserve
//!   ([`GpuScheduler::fixed`]). Working sets fit when Σ working sets ≤ total − that.
//! - An exclusive holder that is not all resident (its swap-in found no room: memory
//!   of others still there) gets room made for it: whatever is still missing, less
//!   reclaims already asked, is reclaimed from idle clients, least recently active
//!   first. The holder waits for it; it is never failed.
//! - A holder that ignores a drop for `grace` loses the GPU (it is told so). A client
//!   that goes away releases everything at once.
//! - Pipelined hand-off (clients that registered `pipelined`): a dropped holder that
//!   says `drained` (its work is done, its swap-out starts) leaves the holders for
//!   `draining` until its release. The next in line is granted at once
//!   (`grant {pipelined}`) if it registered `pipelined` too and no other swap-out is
//!   under way; otherwise at the release, as before. The drainer's memory still counts
//!   until its release (with what its drop asked freed), and the grace still applies,
//!   plus the time its swap-out may take at 1 GB/s (a first swap-out page-locks as it
//!   copies). A `drained` that crosses the drainer's revocation is ignored.
//! - Idle eviction (`idle_evict`): on an oversubscribed GPU, a client that neither
//!   holds nor waits, has memory resident and has sent nothing for the idle time is
//!   asked to reclaim all of it, one at a time, least recently seen first, only while
//!   no hand-off is under way (no drop outstanding, nobody draining, no reclaim
//!   younger than the grace unanswered), and never a member of a group whose turn
//!   has this GPU (it released early and comes back in that turn; its peers may be
//!   waiting for it). `pipelined` clients hear `pressure` whenever
//!   the GPU starts or stops being oversubscribed, and at registration if it is.
//! - After an arbiter restart a client may say it still holds the GPU (`resume
//!   {holding}`). The claim is believed only while nothing can refute it: inside the
//!   post-restart window and before this scheduler granted anyone itself. Otherwise the
//!   client is told `revoked` and queued like any other request (a tenant cannot jump
//!   the queue by re-registering as a holder).

use std::collections::{BTreeMap, VecDeque};

use kiwi_protocol::{
    ArbiterMsg, ClientState, ClientStatus, DropReason, ErrorCode, EventKind, GpuStatus, Keep,
    Register, Settings, Usage, ViewProcess, MAX_VIEW_PROCESSES,
};

/// Connection-scoped client id, assigned by the server.
pub type ClientId = u64;
/// Monotonic nanoseconds.
pub type Nanos = u64;

/// What the scheduler asks the server to do.
#[derive(Debug, Clone, PartialEq)]
pub enum Output {
    Send(ClientId, ArbiterMsg),
    Log(Option<ClientId>, EventKind),
    /// Have the driver checkpoint client `id`'s process (host pid `pid`), then call
    /// [`GpuScheduler::checkpoint_done`] (see [`checkpoint`]).
    Checkpoint {
        id: ClientId,
        pid: u32,
    },
    /// Have the driver restore and unlock it, then call
    /// [`GpuScheduler::restore_done`].
    Restore {
        id: ClientId,
        pid: u32,
    },
}

/// Identity and labels of a client, fixed at registration.
#[derive(Debug, Clone, Default)]
pub struct ClientInfo {
    pub pid: u32,
    pub host_pid: u32,
    pub name: Option<String>,
    pub container_id: Option<String>,
    pub pod_name: Option<String>,
    pub pod_namespace: Option<String>,
    /// It asked to be told why it waits ([`ArbiterMsg::Waiting`]).
    pub wait_info: bool,
    /// Its GPU memory that no swap frees, as registered (`None`: it does not report).
    pub unswappable: Option<u64>,
    /// It takes part in pipelined hand-offs (`drained`, `grant {pipelined}`,
    /// `pressure`).
    pub pipelined: bool,
    /// It asked for [`ArbiterMsg::Room`].
    pub room_info: bool,
    /// It takes [`ArbiterMsg::Checkpointed`] (it registered with `bounds`).
    pub notices: bool,
    /// Whose connection it came on: its container socket's, or its uid's on the
    /// node's socket (set by the server). Evictions made on its behalf are counted
    /// per tenant ([`checkpoint::TENANT_EVICTIONS`]).
    pub tenant: Option<String>,
}

impl ClientInfo {
    pub fn from_register(r: &Register, host_pid: u32) -> Self {
        Self {
            pid: r.pid,
            host_pid,
            name: r.name.clone(),
            container_id: r.container_id.clone(),
            pod_name: r.pod_name.clone(),
            pod_namespace: r.pod_namespace.clone(),
            wait_info: r.wait_info,
            unswappable: r.unswappable_bytes,
            pipelined: r.pipelined,
            room_info: r.room_info,
            notices: r.bounds,
            tenant: None,
        }
    }

    /// How a waiter is told who holds the GPU: the pod name, else the program name.
    fn display_name(&self, id: ClientId) -> String {
        self.pod_name
            .clone()
            .or_else(|| self.name.clone())
            .unwrap_or_else(|| format!("client {id}"))
    }
}

/// What a `room_info` client is told in [`ArbiterMsg::Room`]: the others' memory no
/// swap frees, and the working set it must leave room for.
type RoomView = (u64, Option<Keep>);

/// What a waiter hears in [`ArbiterMsg::Waiting`]: the holder shown, how many others
/// hold, its place in the queue, when the holder's quantum ends (absolute).
type WaitView = (Option<ClientId>, u32, u32, Option<Nanos>);

#[derive(Debug, Clone)]
struct Client {
    info: ClientInfo,
    usage: Usage,
    /// When the current wait began.
    requested_at: Option<Nanos>,
    /// Last time it held or released the GPU: the LRU key for reclaiming.
    last_active: Nanos,
    waited_ns: u64,
    held_ns: u64,
    /// What it was last told while waiting (`wait_info` clients only).
    told: Option<WaitView>,
    /// GPU memory of its that no swap frees (contexts, modules, its own VMM memory):
    /// what it reported, plus `unreported`.
    unswappable: u64,
    /// That memory as it reported it.
    reported_unswappable: u64,
    /// GPU memory the driver counts for its process beyond its reports (code NVIDIA's
    /// runtime 13 loads inside launches): learned by [`GpuScheduler::reconcile`].
    unreported: u64,
    /// Its reports of memory no swap frees beyond what the driver shows its process
    /// holds at all (a claim no process backs): not counted
    /// ([`GpuScheduler::reconcile`]).
    overclaimed: u64,
    /// The last [`RECONCILE_LOOKS`] looks at the driver's figure for its process
    /// while no swap of it was asked: (the driver's figure, what its reports
    /// claimed then: resident + memory no swap frees). Not started over when its
    /// reports change: a client that changes them at every look must not escape.
    looks: VecDeque<(u64, u64)>,
    /// The driver's figure for its process at the last look (`None`: not looked
    /// at yet, or its host pid is unknown).
    driver_bytes: Option<u64>,
    /// When checkpoints of its process were chosen, within the last
    /// [`checkpoint::EVICTION_WINDOW_NS`]: what others' shortfalls cost it.
    evicted_at: VecDeque<Nanos>,
    /// When the event log was last told why nobody was checkpointed for it.
    eviction_noted: Option<Nanos>,
    /// The last [`ArbiterMsg::Room`] it was sent (`room_info` clients), and when.
    room_told: Option<RoomView>,
    room_sent: Option<Nanos>,
    /// Bytes it was asked to reclaim and has not answered yet.
    reclaim_pending: u64,
    /// When that reclaim was asked (a hand-off in progress for idle eviction, for at
    /// most the grace period: a client that never answers cannot stop it for good).
    reclaim_sent: Option<Nanos>,
    /// Last time it asked for the GPU, got or gave it back, or changed its memory:
    /// what idle eviction measures.
    last_seen: Nanos,
    /// Its turn was revoked and it has not been granted since: a `drained` that
    /// crossed the revocation is ignored, not answered with an error.
    revoked: bool,
    /// Where its process stands with whole-process eviction ([`checkpoint`]), and when
    /// a checkpoint or restore of it last failed (retried after a pause).
    ckpt: checkpoint::Ckpt,
    ckpt_failed_at: Option<Nanos>,
    /// Its group, while the group spans several GPUs ([`gang`]): it is granted only
    /// in its group's turn.
    gang: Option<GangId>,
}

impl Client {
    /// Its process is checkpointed and it does not wait for a turn: none of its
    /// memory is on the GPU (a waiter's must come back first).
    fn off_gpu(&self) -> bool {
        self.ckpt == checkpoint::Ckpt::Checkpointed && self.requested_at.is_none()
    }
}

#[derive(Debug, Clone, Copy)]
struct Hold {
    since: Nanos,
    exclusive: bool,
    drop_sent: Option<Nanos>,
    /// Bytes its drop asked it to evict (what a drainer is freeing).
    drop_need: u64,
    /// It gives the GPU back early (idle while others wait), not for a drop: its
    /// `drained` came first, its release is an early one.
    early: bool,
    /// When its quantum started: at the grant, or, for a `pipelined` client that had
    /// memory to swap in, when it reported that memory resident (`None` until then).
    /// A quantum spent swapping in would leave a short-TQ holder no time to work.
    quantum_from: Option<Nanos>,
    /// Its `no_room` taught the scheduler memory it cannot see: later reports in the
    /// same hold only reclaim (one may cross the reclaim's answer, and the room it saw
    /// taken would be counted twice).
    learned: bool,
    /// Time past the grace a drainer has to swap out ([`SLOWEST_SWAP_OUT_NS_PER_BYTE`]
    /// for what it has resident when it says `drained`); 0 for a holder.
    swap_allowance: Nanos,
    /// Bytes reclaimed from others for its growth within this hold
    /// ([`GpuScheduler::growth_ask`]).
    grown: u64,
    /// Granted on a GPU a group had claimed, until the group's turn could start
    /// ([`GpuScheduler::drop_due`]): it holds no longer than the claim's alignment.
    backfill: bool,
}

/// How slow a swap-out may be before its drainer loses its turn: 1 ns a byte, 1 GB/s.
/// A first swap-out page-locks its host buffers as it copies; on an H100 (driver 580)
/// 18 GiB of them ran at 1.1–2.0 GB/s and took up to 17 s, where a grace of 5 s
/// revoked turns that were making progress (docs/gpu-validation.md). Revoking a
/// drainer frees nothing anyway: the next holder is already granted, and the
/// drainer's memory is only freed by its swap-out.
pub const SLOWEST_SWAP_OUT_NS_PER_BYTE: u64 = 1;

/// One GPU's scheduler.
#[derive(Debug, Clone)]
pub struct GpuScheduler {
    total: u64,
    capacity: u64,
    settings: Settings,
    grace_ns: u64,
    clients: BTreeMap<ClientId, Client>,
    queue: VecDeque<ClientId>,
    holders: BTreeMap<ClientId, Hold>,
    /// Dropped holders that said `drained`: swapping out, their release still to come.
    draining: BTreeMap<ClientId, Hold>,
    /// Idle eviction after this long without a word (0: off).
    idle_evict_ns: u64,
    /// What `pipelined` clients were last told: the GPU is oversubscribed.
    pressure: bool,
    /// When that was broadcast ([`STATE_INTERVAL_NS`] apart at least).
    pressure_sent: Option<Nanos>,
    /// The GPU was last told shared (more than one client, `pressure`).
    shared: bool,
    /// What holders were last told: someone waits, and the bytes the next one needs.
    contended: bool,
    contended_need: u64,
    /// After an arbiter restart, resumed waiters are not granted until the resumed
    /// holder (still running on the GPU) had time to re-register.
    quiet_until: Option<Nanos>,
    resume_seen: bool,
    /// Claims to hold (`resume {holding}`) are believed only before this time: the
    /// end of the post-restart window.
    resume_until: Nanos,
    /// Whether this scheduler granted the GPU itself: from then on it knows who holds,
    /// and a claim to hold is refuted.
    granted_own: bool,
    /// The node's swap budget, told to clients at registration (enforced node-wide by
    /// the server, see [`crate::swap`]).
    swap_budget: Option<u64>,
    /// The queue and holders as waiters were last told about them (queue length,
    /// first, last, shown holder, holders, quantum end): unchanged, nobody's
    /// [`ArbiterMsg::Waiting`] can have changed, and the pass over the queue is skipped.
    waiters_seen: Option<WaitersSeen>,
    /// GPU memory no client accounts for (a process outside Kiwi, a context measured
    /// short), learned from a holder's `no_room` and counted as fixed, and when it
    /// was last learned: forgotten [`UNSEEN_TTL_NS`] later (that memory may be gone;
    /// if not, the next `no_room` learns it again).
    unseen: u64,
    unseen_at: Nanos,
    /// GPU memory of processes that are no client of this GPU (run without Kiwi, or
    /// refused), as NVML counts it ([`GpuScheduler::reconcile`]), counted as fixed;
    /// and the looks at each such process since it was first listed.
    outside_kiwi: u64,
    outside_looks: BTreeMap<u32, Vec<u64>>,
    /// Whole processes may be checkpointed to make room (the daemon has the driver's
    /// checkpoint API, [`crate::checkpoint`]).
    checkpoint_on: bool,
    /// Since when nobody holds, drains or waits: checkpointed clients are restored
    /// [`checkpoint::RESTORE_WHEN_IDLE_NS`] later.
    idle_since: Option<Nanos>,
    /// When checkpoints were chosen on each tenant's behalf, within the last
    /// [`checkpoint::EVICTION_WINDOW_NS`].
    evicted_for: BTreeMap<String, VecDeque<Nanos>>,
    /// The GPU may run shared: it has not been oversubscribed for
    /// [`STATE_INTERVAL_NS`] ([`GpuScheduler::settle_mode`]), as of
    /// `oversubscribed_at`, when it last was.
    relaxed: bool,
    oversubscribed_at: Nanos,
    /// NVML listed the process of some client of this GPU at the last look: the
    /// driver's per-process figures are there to check claims against.
    listing: bool,
    /// Gang turns ([`gang`]): whom exclusive turns belong to, and whether a group
    /// waits for this GPU while another group has it.
    reserve: Reserve,
    gang_wanted: bool,
    /// While a group claims this GPU: the holders outside it are not dropped before
    /// this (the latest quantum end on the group's other GPUs), so it is not left
    /// idle while the group waits for them ([`GpuScheduler::set_claim_aligned`]).
    claim_aligned: Option<Nanos>,
    out: Vec<Output>,
}

type WaitersSeen = (
    usize,
    Option<ClientId>,
    Option<ClientId>,
    Option<ClientId>,
    usize,
    Option<Nanos>,
);

/// What the driver may show free while an allocation of a holder's still fails
/// (granularity, fragmentation, the driver's own bookkeeping): beyond it, free memory
/// contradicts a `no_room`.
pub const NO_ROOM_SLACK: u64 = 256 << 20;

/// The most a holder's growth is reclaimed ahead of it at once: 1/16 of the GPU
/// ([`GpuScheduler::growth_ask`]; 5 GiB of an 80 GB GPU, about 0.2 s of PCIe).
pub const GROWTH_AHEAD_DIVISOR: u64 = 16;

/// How often the server gives each GPU's scheduler the driver's per-process figures
/// ([`GpuScheduler::reconcile`]).
pub const RECONCILE_INTERVAL_NS: u64 = 1_000_000_000;

/// Looks in a row, the client's reports unchanged, before its process's memory
/// beyond them is counted ([`GpuScheduler::reconcile`]).
pub const RECONCILE_LOOKS: usize = 3;

/// Memory the driver counts for a process beyond its reports that is not counted:
/// allocation granularity and the driver's own bookkeeping
/// ([`GpuScheduler::reconcile`]).
pub const UNREPORTED_SLACK: u64 = 64 << 20;

/// How long memory learned from `no_room` ([`GpuScheduler::no_room`]) is counted.
pub const UNSEEN_TTL_NS: u64 = 60_000_000_000;

/// Least time between two `pressure` broadcasts of a GPU, and between two `room`
/// messages to one client: a client flipping its usage or its memory no swap frees
/// thousands of times a second must not make the arbiter send every other client a
/// message per flip (issue #27, item 3); the latest state follows when the interval
/// ends ([`GpuScheduler::next_deadline`]). A client's `ping` gets its due `room`
/// first, at once ([`GpuScheduler::flush_room`]).
pub const STATE_INTERVAL_NS: u64 = 250_000_000;

/// Longest wait for a resumed holder to re-register after an arbiter restart.
const RESUME_WINDOW_NS: u64 = 2_000_000_000;

/// How long after the arbiter starts a client's claim to still hold the GPU is
/// believed. Shims reconnect with a backoff of at most 1 s, so a real holder comes
/// back well within it.
pub const RESUME_CLAIM_WINDOW_NS: u64 = 5_000_000_000;

fn ms_to_ns(ms: u64) -> u64 {
    ms.saturating_mul(1_000_000)
}

impl GpuScheduler {
    /// `capacity`: total minus the context reserve.
    pub fn new(total: u64, capacity: u64, settings: Settings, grace_ms: u64) -> Self {
        Self {
            total,
            capacity,
            settings,
            grace_ns: ms_to_ns(grace_ms),
            clients: BTreeMap::new(),
            queue: VecDeque::new(),
            holders: BTreeMap::new(),
            draining: BTreeMap::new(),
            idle_evict_ns: 0,
            pressure: false,
            pressure_sent: None,
            shared: false,
            contended: false,
            contended_need: 0,
            quiet_until: None,
            resume_seen: false,
            resume_until: RESUME_CLAIM_WINDOW_NS,
            granted_own: false,
            swap_budget: None,
            waiters_seen: None,
            unseen: 0,
            unseen_at: 0,
            outside_kiwi: 0,
            outside_looks: BTreeMap::new(),
            checkpoint_on: false,
            idle_since: None,
            evicted_for: BTreeMap::new(),
            listing: false,
            relaxed: true,
            oversubscribed_at: 0,
            reserve: Reserve::Free,
            gang_wanted: false,
            claim_aligned: None,
            out: Vec::new(),
        }
    }

    /// Sets the node's swap budget that [`ArbiterMsg::Registered`] tells clients
    /// (`None`: unlimited, the field is left out).
    pub fn with_swap_budget(mut self, budget: Option<u64>) -> Self {
        self.swap_budget = budget;
        self
    }

    /// Turns idle eviction on: a client idle this long on an oversubscribed GPU is
    /// asked to swap out (0: off, the default).
    /// Whole idle processes may be checkpointed to make room (the daemon has the
    /// driver's checkpoint API).
    pub fn with_checkpoint(mut self, on: bool) -> Self {
        self.checkpoint_on = on;
        self
    }

    pub fn with_idle_evict(mut self, idle_ms: u64) -> Self {
        self.idle_evict_ns = ms_to_ns(idle_ms);
        self
    }

    /// Sets the end of the post-restart window (default: [`RESUME_CLAIM_WINDOW_NS`]
    /// after time 0): claims to hold the GPU are refused from then on.
    pub fn with_resume_window(mut self, until: Nanos) -> Self {
        self.resume_until = until;
        self
    }

    /// Total GPU memory scheduled against, as registered.
    pub fn total(&self) -> u64 {
        self.total
    }

    /// Raises the GPU's size (a later registration reported more, still within what
    /// the arbiter knows the GPU has). Never lowers it.
    pub fn raise_total(&mut self, now: Nanos, total: u64, capacity: u64) -> Vec<Output> {
        if total > self.total {
            self.total = total;
            self.capacity = self.capacity.max(capacity);
        }
        self.finish(now)
    }

    /// Whether a claim to hold the GPU made now would be believed (see the module docs).
    pub fn believes_resume(&self, now: Nanos) -> bool {
        now < self.resume_until && !self.granted_own
    }

    /// GPU memory scheduled against (total − context reserve).
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// GPU memory no swap frees: the clients' reported non-swappable bytes, or the
    /// context reserve (total − capacity) when that is more. The reserve was sized
    /// for contexts, which clients now report: counting both would count each
    /// context twice. So it is a floor, for what nobody reports (shims that predate
    /// the report, a context before its turn's first report).
    pub fn fixed(&self) -> u64 {
        // A checkpointed process's memory is off the GPU until it is restored; one
        // that waits for its turn needs it back first, so it counts.
        let reported = self
            .clients
            .values()
            .filter(|c| !c.off_gpu())
            .map(|c| c.unswappable)
            .fold(0u64, u64::saturating_add);
        // The reserve stands in for clients that do not report (shims that predate
        // the report); with every client reporting, the reports are the truth.
        let floor = if self.clients.values().any(|c| c.info.unswappable.is_none()) {
            self.total.saturating_sub(self.capacity)
        } else {
            0
        };
        reported
            .max(floor)
            .saturating_add(self.unseen)
            .saturating_add(self.outside_kiwi)
            .min(self.total)
    }

    /// GPU memory the working sets are scheduled against: total − [`Self::fixed`].
    pub fn room(&self) -> u64 {
        self.total.saturating_sub(self.fixed())
    }

    /// Bytes of this GPU's working sets that do not fit in its room: the least host
    /// RAM that must hold its swapped-out memory.
    pub fn swap_need(&self) -> u64 {
        self.working_sets().saturating_sub(self.room())
    }

    /// [`Self::swap_need`] if client `id`'s working set were `working_set` bytes.
    pub fn swap_need_with(&self, id: ClientId, working_set: u64) -> u64 {
        let current = self
            .clients
            .get(&id)
            .map_or(0, |c| c.usage.working_set_bytes);
        self.working_sets()
            .saturating_sub(current)
            .saturating_add(working_set)
            .saturating_sub(self.room())
    }

    /// Bytes of working sets whose swap-outs the pool should be ready for: every
    /// client's when the GPU is shared (anyone may be asked for it), else none.
    pub fn shared_working_sets(&self) -> u64 {
        if self.clients.len() < 2 {
            return 0;
        }
        self.working_sets()
    }

    /// GPU memory process `host_pid` holds on this GPU: the driver's figure where it
    /// has one, else what its client reports resident and unswappable. What a
    /// checkpoint of the process would keep in its host memory.
    pub fn process_device_bytes(&self, host_pid: u32) -> u64 {
        self.clients
            .values()
            .filter(|c| host_pid != 0 && c.info.host_pid == host_pid)
            .map(|c| {
                c.driver_bytes
                    .unwrap_or(c.usage.resident_bytes.saturating_add(c.unswappable))
            })
            .fold(0u64, u64::saturating_add)
    }

    /// Whether client `id` registered with `bounds` (it takes this version's notices).
    pub fn takes_notices(&self, id: ClientId) -> bool {
        self.clients.get(&id).is_some_and(|c| c.info.notices)
    }

    /// Client `id`'s working set as last reported or admitted (0: not registered here).
    pub fn working_set_of(&self, id: ClientId) -> u64 {
        self.clients
            .get(&id)
            .map_or(0, |c| c.usage.working_set_bytes)
    }

    /// Bytes swapped out to host memory now, over all clients (working set − resident).
    pub fn swapped_bytes(&self) -> u64 {
        self.clients
            .values()
            .map(|c| {
                c.usage
                    .working_set_bytes
                    .saturating_sub(c.usage.resident_bytes)
            })
            .fold(0u64, u64::saturating_add)
    }

    /// Whether every registered working set fits at once, next to the memory no
    /// swap frees.
    pub fn fits(&self) -> bool {
        self.working_sets() <= self.room()
    }

    fn working_sets(&self) -> u64 {
        self.clients
            .values()
            .map(|c| c.usage.working_set_bytes)
            .fold(0u64, u64::saturating_add)
    }

    fn resident(&self) -> u64 {
        self.clients
            .values()
            .filter(|c| !c.off_gpu())
            .map(|c| c.usage.resident_bytes)
            .fold(0u64, u64::saturating_add)
    }

    /// No arbitration needed: everybody runs side by side. Back from oversubscribed
    /// only once the working sets have fit for [`STATE_INTERVAL_NS`]
    /// ([`GpuScheduler::settle_mode`]).
    fn shared_mode(&self) -> bool {
        !self.settings.scheduler_on || (!self.takes_turns() && self.relaxed)
    }

    /// Whether the GPU must be taken in turns: its working sets do not fit, or a
    /// member of a group on several GPUs ([`gang`]) runs here beside others. Shared,
    /// that member's collectives would spin whenever a peer's GPU is busy with
    /// someone else: a 2-GPU job beside a notebook on each GPU whose memory fit ran
    /// 32.2 s shared against 25.8 s in turns (`kiwi-bench gang`'s shapes), and the
    /// notebooks finished sooner too.
    fn takes_turns(&self) -> bool {
        !self.fits() || (self.clients.len() >= 2 && self.clients.values().any(|c| c.gang.is_some()))
    }

    /// Hysteresis between shared and exclusive: a GPU that stops fitting turns
    /// exclusive at once (the memory is needed now), and shared again only once it
    /// has fit for [`STATE_INTERVAL_NS`]. A tenant that flips its working set across
    /// the room (40,000 times in 3 s, issue #38) otherwise turned every flip into a
    /// `drop` for each sharer and a grant after it: 20,000 drops, and an honest
    /// notebook whose unread replies passed the cap lost its connection 5 times.
    fn settle_mode(&mut self, now: Nanos) {
        if self.settings.scheduler_on && self.takes_turns() {
            self.oversubscribed_at = now;
            self.relaxed = false;
        } else if !self.relaxed
            && (!self.settings.scheduler_on
                || now >= self.oversubscribed_at.saturating_add(STATE_INTERVAL_NS))
        {
            self.relaxed = true;
        }
    }

    /// Bytes that must leave GPU memory before `next` can bring all of its own in:
    /// what residency would exceed the room by (every client's non-swappable memory
    /// stays). Residency can already be over the room
    /// (a client swaps in on a grant given while its answer to a reclaim was still on
    /// the way): that overflow must go too, or it stays for good.
    fn need_for(&self, next: ClientId) -> u64 {
        let Some(c) = self.clients.get(&next) else {
            return 0;
        };
        let missing = c
            .usage
            .working_set_bytes
            .saturating_sub(c.usage.resident_bytes);
        self.resident()
            .saturating_add(missing)
            .saturating_sub(self.room())
    }

    /// Current holders (one when exclusive), for tests and status.
    pub fn holders(&self) -> Vec<ClientId> {
        self.holders.keys().copied().collect()
    }

    /// Whether `id` holds an exclusive grant.
    pub fn holds_exclusive(&self, id: ClientId) -> bool {
        self.holders.get(&id).is_some_and(|h| h.exclusive)
    }

    pub fn queue(&self) -> Vec<ClientId> {
        self.queue.iter().copied().collect()
    }

    /// Where client `id` stands for the swap pool's disk tier, which takes the
    /// processes idle longest first: `None` while it holds the GPU (or is not
    /// registered here), else whether it waits for it and its last activity.
    pub fn activity(&self, id: ClientId) -> Option<(bool, Nanos)> {
        let c = self.clients.get(&id)?;
        if self.holders.contains_key(&id) {
            return None;
        }
        Some((c.requested_at.is_some(), c.last_seen))
    }

    fn send(&mut self, id: ClientId, msg: ArbiterMsg) {
        self.out.push(Output::Send(id, msg));
    }

    fn log(&mut self, id: Option<ClientId>, kind: EventKind) {
        self.out.push(Output::Log(id, kind));
    }

    fn finish(&mut self, now: Nanos) -> Vec<Output> {
        self.schedule(now);
        self.start_checkpoints(now);
        self.restore_when_idle(now);
        self.notify_waiters(now);
        self.notify_pressure(now);
        self.notify_room(now, None);
        self.idle_evict(now);
        std::mem::take(&mut self.out)
    }

    /// The GPU swaps: the scheduler is on and the working sets do not fit.
    pub fn oversubscribed(&self) -> bool {
        self.settings.scheduler_on && !self.fits()
    }

    /// What the next swap-outs here will need in host memory: the resident bytes of
    /// the holders, when the GPU is oversubscribed (0 otherwise). The swap pool's
    /// disk tier keeps that much free ahead, so a dropped holder's swap-out does not
    /// wait for a spill.
    pub fn next_swap_out(&self) -> u64 {
        if !self.oversubscribed() {
            return 0;
        }
        self.holders
            .keys()
            .filter_map(|id| self.clients.get(id))
            .map(|c| c.usage.resident_bytes)
            .fold(0u64, u64::saturating_add)
    }

    /// More than one client is registered: the GPU is shared, whether or not its
    /// working sets fit.
    fn shared_now(&self) -> bool {
        self.clients.len() > 1
    }

    // ---- inputs -------------------------------------------------------------

    /// A client registered on this GPU. `resume` is set when it re-registers after an
    /// arbiter restart, carrying what it held.
    pub fn register(
        &mut self,
        now: Nanos,
        id: ClientId,
        info: ClientInfo,
        usage: Usage,
        resume: Option<kiwi_protocol::Resume>,
    ) -> Vec<Output> {
        self.log(
            Some(id),
            EventKind::Register {
                pid: info.pid,
                host_pid: info.host_pid,
                name: info.name.clone(),
                pod_name: info.pod_name.clone(),
                pod_namespace: info.pod_namespace.clone(),
                working_set_bytes: usage.working_set_bytes,
                resumed: resume.is_some(),
            },
        );
        let unswappable = info.unswappable.unwrap_or(0).min(self.total);
        if unswappable > 0 {
            self.log(Some(id), EventKind::Unswappable { bytes: unswappable });
        }
        self.clients.insert(
            id,
            Client {
                info,
                usage,
                requested_at: None,
                last_active: now,
                waited_ns: 0,
                held_ns: 0,
                told: None,
                unswappable,
                reported_unswappable: unswappable,
                unreported: 0,
                overclaimed: 0,
                looks: VecDeque::new(),
                driver_bytes: None,
                evicted_at: VecDeque::new(),
                eviction_noted: None,
                room_told: None,
                room_sent: None,
                reclaim_pending: 0,
                reclaim_sent: None,
                last_seen: now,
                revoked: false,
                ckpt: checkpoint::Ckpt::None,
                ckpt_failed_at: None,
                gang: None,
            },
        );
        self.send(
            id,
            ArbiterMsg::Registered {
                client_id: id,
                settings: self.settings,
                capacity_bytes: self.capacity,
                swap_budget_bytes: self.swap_budget,
            },
        );
        // Right after `registered`, so the client knows the others' memory before its
        // application asks how much is free.
        self.notify_room(now, None);
        // Already oversubscribed: a pipelined client prepares its swap-out from the
        // start (a change this registration makes is told to everyone in `finish`).
        if (self.pressure || self.shared) && self.clients.get(&id).is_some_and(|c| c.info.pipelined)
        {
            self.send(
                id,
                ArbiterMsg::Pressure {
                    oversubscribed: self.pressure,
                    idle_evict_ms: self.idle_evict_ns / 1_000_000,
                    shared: self.shared,
                },
            );
        }
        if let Some(r) = resume {
            let believed = self.believes_resume(now);
            if believed && !self.resume_seen {
                self.resume_seen = true;
                self.quiet_until = Some(now + self.grace_ns.min(RESUME_WINDOW_NS));
            }
            if r.holding && believed {
                self.quiet_until = None;
                // It kept working while no arbiter ran; take it as holder again. If that
                // makes two exclusive holders, the transition logic drops one.
                let exclusive = !self.shared_mode() && self.holders.is_empty();
                self.holders.insert(
                    id,
                    Hold {
                        since: now,
                        exclusive,
                        drop_sent: None,
                        drop_need: 0,
                        early: false,
                        // It was working already: its quantum runs from now.
                        quantum_from: Some(now),
                        learned: false,
                        swap_allowance: 0,
                        grown: 0,
                        backfill: false,
                    },
                );
                self.log(
                    Some(id),
                    EventKind::Grant {
                        exclusive,
                        waited_ns: 0,
                    },
                );
            } else if r.holding {
                // A claim this scheduler can refute: it is past the post-restart window
                // or granted the GPU itself since. Tell the client it holds nothing (a
                // shim then stops submitting) and queue it like any request.
                self.send(
                    id,
                    ArbiterMsg::Revoked {
                        reason: "resume refused: the arbiter did not grant this GPU to this client; waiting for a grant".into(),
                    },
                );
                return self.request(now, id);
            } else if r.waiting {
                return self.request(now, id);
            }
        }
        self.finish(now)
    }

    /// The client wants the GPU.
    pub fn request(&mut self, now: Nanos, id: ClientId) -> Vec<Output> {
        if !self.clients.contains_key(&id) {
            return Vec::new();
        }
        if let Some(h) = self.holders.get(&id) {
            // Already holding (e.g. a client that lost track after a reconnect):
            // confirm idempotently.
            let exclusive = h.exclusive;
            let waiting = self.queue.len() as u32;
            let group = exclusive && self.gang_of(id).is_some();
            self.send(
                id,
                ArbiterMsg::Grant {
                    exclusive,
                    tq_ms: self.settings.tq_ms,
                    waiting,
                    pipelined: false,
                    group,
                },
            );
            return self.finish(now);
        }
        if self.queue.contains(&id) {
            return self.finish(now);
        }
        self.log(Some(id), EventKind::Request);
        if let Some(c) = self.clients.get_mut(&id) {
            c.requested_at = Some(now);
            c.last_seen = now;
        }
        self.queue.push_back(id);
        self.finish(now)
    }

    /// The client gives the GPU back (after a drop, or early), or cancels its request.
    pub fn release(&mut self, now: Nanos, id: ClientId, usage: Usage) -> Vec<Output> {
        let Some(c) = self.clients.get_mut(&id) else {
            return Vec::new();
        };
        c.usage = usage;
        c.reclaim_pending = 0;
        c.reclaim_sent = None;
        c.last_seen = now;
        // A drainer's release ends its swap-out; it may have asked again meanwhile,
        // and stays queued then.
        if let Some(h) = self
            .holders
            .remove(&id)
            .or_else(|| self.draining.remove(&id))
        {
            let c = self.clients.get_mut(&id).expect("checked above");
            c.held_ns += now.saturating_sub(h.since);
            c.last_active = now;
            self.log(
                Some(id),
                EventKind::Release {
                    early: h.early || h.drop_sent.is_none(),
                    resident_bytes: usage.resident_bytes,
                },
            );
            if self.holders.is_empty() {
                self.handoff(now);
            }
        } else {
            self.cancel_wait(now, id);
        }
        self.finish(now)
    }

    /// Working set or residency changed.
    pub fn usage(&mut self, now: Nanos, id: ClientId, usage: Usage) -> Vec<Output> {
        let Some(c) = self.clients.get_mut(&id) else {
            return Vec::new();
        };
        if c.usage == usage {
            return Vec::new();
        }
        c.usage = usage;
        c.last_seen = now;
        if usage.resident_bytes >= usage.working_set_bytes {
            self.resident_now(now, id);
        }
        self.log(
            Some(id),
            EventKind::Usage {
                working_set_bytes: usage.working_set_bytes,
                resident_bytes: usage.resident_bytes,
            },
        );
        self.finish(now)
    }

    /// An admitted [`kiwi_protocol::ClientMsg::Admit`]: the client's working set is
    /// `working_set` from now on (resident unchanged), before its next usage report,
    /// so a second client cannot be admitted into the same room. The server decides
    /// admission ([`crate::swap::decide`]) and answers the client itself.
    pub fn admit(&mut self, now: Nanos, id: ClientId, working_set: u64) -> Vec<Output> {
        let Some(c) = self.clients.get_mut(&id) else {
            return Vec::new();
        };
        let usage = Usage {
            working_set_bytes: working_set,
            resident_bytes: c.usage.resident_bytes,
        };
        self.usage(now, id, usage)
    }

    /// Answer to a reclaim.
    pub fn reclaimed(&mut self, now: Nanos, id: ClientId, usage: Usage) -> Vec<Output> {
        let Some(c) = self.clients.get_mut(&id) else {
            return Vec::new();
        };
        c.usage = usage;
        c.reclaim_pending = 0;
        c.reclaim_sent = None;
        self.finish(now)
    }

    /// A dropped holder's queued work is done and its swap-out starts
    /// ([`kiwi_protocol::ClientMsg::Drained`]): the next in line may start its
    /// swap-in now. Refused with an error reply (and nothing else) from a client that
    /// did not register `pipelined`, does not hold the GPU, or said it already.
    ///
    /// From a holder that was not dropped and that nobody waits for any more, it is
    /// ignored: an early release that crossed the waiter's grant elsewhere or the GPU
    /// starting to fit (the shim saw someone waiting when it went idle). Its
    /// `release` follows and is taken as an early one; an error reply there only put
    /// a warning about a race into the application's stderr.
    pub fn drained(&mut self, now: Nanos, id: ClientId) -> Vec<Output> {
        let Some(c) = self.clients.get(&id) else {
            return Vec::new();
        };
        let problem = if !c.info.pipelined {
            Some("this client did not register with `pipelined`")
        } else if self.draining.contains_key(&id) {
            Some("this client said it already after its drop")
        } else if let Some(h) = self.holders.get(&id) {
            if h.drop_sent.is_none() && (!h.exclusive || !self.contended_now()) {
                return Vec::new();
            }
            None
        } else if c.revoked {
            // It was told `revoked` while its swap-out began: the message crossed it.
            return Vec::new();
        } else {
            Some("this client does not hold the GPU")
        };
        if let Some(problem) = problem {
            self.send(
                id,
                ArbiterMsg::Error {
                    code: ErrorCode::InvalidArgument,
                    message: format!("`drained` refused: {problem}"),
                },
            );
            return std::mem::take(&mut self.out);
        }
        let mut h = self.holders.remove(&id).expect("checked above");
        if h.drop_sent.is_none() {
            // An early release starting (idle while others wait): its swap-out makes
            // the room the first in line needs, within the grace as after a drop.
            h.early = true;
            h.drop_sent = Some(now);
            h.drop_need = self.next_for_need().map_or(0, |n| self.need_for(n));
        }
        // What it says it has resident, at most the GPU: a lie buys a hostile client no
        // more than a GPU's worth of swap-out time, once per turn.
        let resident = self.clients.get(&id).map_or(0, |c| c.usage.resident_bytes);
        h.swap_allowance = resident
            .min(self.total)
            .saturating_mul(SLOWEST_SWAP_OUT_NS_PER_BYTE);
        self.draining.insert(id, h);
        self.finish(now)
    }

    /// A holder found no room for `missing` bytes of its working set
    /// ([`kiwi_protocol::ClientMsg::NoRoom`]), though this scheduler counted on room
    /// for it: memory it cannot see (a process outside Kiwi, a context measured short)
    /// takes the rest. Before, the holder waited with its gate closed until its TQ ran
    /// out, and so did every holder after it; on a GPU believed to fit, every sharer
    /// waited for good.
    ///
    /// When nothing is on its way out of GPU memory, the room this scheduler believed
    /// free (its room less what clients report resident) is in fact taken (the
    /// holder's driver found less than the segment it tried, at most 64 MiB): it is
    /// counted as fixed from now on, for [`UNSEEN_TTL_NS`], so later hand-offs evict
    /// enough at once and a GPU that no longer fits takes turns. Then what the holder
    /// still lacks (at most its working set) is reclaimed from clients that do not
    /// hold the GPU, beyond what is already on its way out. Silently ignored from a
    /// client that does not hold the GPU or was dropped: a report that crossed its
    /// drop or revoke is no error.
    ///
    /// `used`: the GPU's memory in use as the driver counts it (NVML; the daemon asks it
    /// outside its state lock, at most every 100 ms per connection); `None` where it is not known. With it the claim is checked
    /// against the device: what the driver shows free (less [`NO_ROOM_SLACK`]) is
    /// not missing, so nothing is reclaimed for it, and only memory the driver shows
    /// taken beyond what the clients account for (resident and reported
    /// unswappable) is learned as unseen. A holder that lies about lacking room then
    /// makes nobody evict and teaches the scheduler nothing.
    pub fn no_room(
        &mut self,
        now: Nanos,
        id: ClientId,
        missing: u64,
        used: impl FnOnce() -> Option<u64>,
    ) -> Vec<Output> {
        let Some(c) = self.clients.get_mut(&id) else {
            return Vec::new();
        };
        c.last_seen = now;
        // Checked against the client's own reports: what it lacks is at most its
        // working set less what it said is resident (a holder that says it is all in,
        // or claims more than it lacks, cannot make others evict for nothing).
        let mut missing = missing.min(
            c.usage
                .working_set_bytes
                .saturating_sub(c.usage.resident_bytes),
        );
        let (holding, learned) = self
            .holders
            .get(&id)
            .map_or((false, false), |h| (h.drop_sent.is_none(), h.learned));
        if !holding || missing == 0 {
            return Vec::new();
        }
        // And against the device, where its count is known.
        let used = used().map(|u| u.min(self.total));
        if let Some(used) = used {
            let free = (self.total - used).saturating_sub(NO_ROOM_SLACK);
            missing = missing.saturating_sub(free);
        }
        let settled = self.draining.is_empty() && self.freeing() == 0;
        // Reclaims overdue at `now` free nothing: paging has settled without them,
        // and only a checkpoint takes their memory off the GPU.
        let silent = self.freeing().saturating_sub(self.freeing_at(now));
        let settled_but_silent = self.draining.is_empty() && self.freeing_at(now) == 0;
        if settled && !learned {
            if let Some(h) = self.holders.get_mut(&id) {
                h.learned = true;
            }
            let believed_free = self.room().saturating_sub(self.resident());
            let learn = match used {
                Some(used) => {
                    let reported = self
                        .clients
                        .values()
                        .map(|c| c.unswappable)
                        .fold(0u64, u64::saturating_add);
                    let outside = used
                        .saturating_sub(self.resident())
                        .saturating_sub(reported)
                        .saturating_sub(self.unseen)
                        .saturating_sub(self.outside_kiwi);
                    believed_free.min(outside)
                }
                None => believed_free,
            };
            self.unseen = self.unseen.saturating_add(learn).min(self.total);
            self.unseen_at = now;
        }
        if missing == 0 {
            return Vec::new();
        }
        self.log(
            Some(id),
            EventKind::NoRoom {
                missing_bytes: missing,
                unseen_bytes: self.unseen,
            },
        );
        if self.holders.get(&id).is_some_and(|h| h.exclusive) {
            let need = missing.saturating_sub(self.freeing());
            let short = self.reclaim_growth(now, id, need);
            // What no swap of the others can give: their processes' contexts and
            // modules, which only a checkpoint takes off the GPU, and what a client
            // that does not answer its reclaim in time keeps. Decided once paging
            // has settled (nobody else holds, drains or owes a reclaim still in
            // time): the next `no_room`, 250 ms on, sees what paging left short.
            if settled_but_silent && self.holders.len() == 1 {
                self.checkpoint_for(now, id, short.saturating_add(silent).min(missing));
            }
        }
        self.finish(now)
    }

    /// The client's memory that no swap frees is now `bytes`
    /// ([`kiwi_protocol::ClientMsg::Unswappable`]).
    pub fn unswappable(&mut self, now: Nanos, id: ClientId, bytes: u64) -> Vec<Output> {
        let Some(c) = self.clients.get_mut(&id) else {
            return Vec::new();
        };
        // A report past the GPU's size is a lie or a bug: it cannot take more than all.
        let bytes = bytes.min(self.total);
        if c.reported_unswappable == bytes {
            return Vec::new();
        }
        c.reported_unswappable = bytes;
        c.unswappable = Self::counted_unswappable(c, self.total);
        c.last_seen = now;
        self.log(Some(id), EventKind::Unswappable { bytes });
        self.finish(now)
    }

    /// The driver's figure of each process's memory on this GPU (`(host pid, bytes)`,
    /// from NVML), looked at every [`RECONCILE_INTERVAL_NS`], checks what each
    /// client's reports claim (its resident memory and its memory no swap frees)
    /// against what its process holds, over the last [`RECONCILE_LOOKS`] looks while
    /// no swap, reclaim or checkpoint of it was under way:
    ///
    /// - What its process holds beyond its reports is memory no swap frees that the
    ///   shim could not see — NVIDIA's runtime 13 loads kernel code inside launches
    ///   (190 MiB for PyTorch's first kernels on an H200, docs/gpu-validation.md) —
    ///   and is counted as such: the least figure of the looks less the least claim
    ///   (a figure that leads a report by a moment shows in one look, not in all; a
    ///   client that changes its reports at every look, claiming its memory one
    ///   second and not the next, is counted at what it claimed least).
    /// - Memory no swap frees it reports beyond what its process holds at all, in
    ///   every look, is a claim no process backs (a client of a process with no GPU
    ///   memory): not counted, so it keeps nobody checkpointed or waiting. Judged
    ///   only where the driver lists the processes of some client of this GPU: where
    ///   it lists none (a driver that does not say), no claim is doubted.
    ///
    /// Moves of less than [`UNREPORTED_SLACK`] are noise.
    pub fn reconcile(&mut self, now: Nanos, procs: &[(u32, u64)]) -> Vec<Output> {
        let listing = procs
            .iter()
            .any(|&(pid, _)| pid != 0 && self.clients.values().any(|c| c.info.host_pid == pid));
        self.listing = listing;
        let mut changed = Vec::new();
        let mut doubted = Vec::new();
        for (&id, c) in self.clients.iter_mut() {
            if c.info.host_pid == 0 {
                continue;
            }
            let found = procs
                .iter()
                .find(|&&(pid, _)| pid == c.info.host_pid)
                .map(|&(_, bytes)| bytes);
            // A process NVML does not list holds nothing on this GPU, where NVML
            // lists the others'.
            let Some(bytes) = found.or(listing.then_some(0)) else {
                c.looks.clear();
                c.driver_bytes = None;
                continue;
            };
            c.driver_bytes = Some(bytes);
            let busy = c.reclaim_pending > 0
                || c.ckpt != checkpoint::Ckpt::None
                || self.draining.contains_key(&id)
                || self.holders.get(&id).is_some_and(|h| h.drop_sent.is_some());
            if busy {
                c.looks.clear();
                continue;
            }
            let claimed = c
                .usage
                .resident_bytes
                .saturating_add(c.reported_unswappable);
            c.looks.push_back((bytes, claimed));
            if c.looks.len() > RECONCILE_LOOKS {
                c.looks.pop_front();
            }
            if c.looks.len() < RECONCILE_LOOKS {
                continue;
            }
            let least_held = c.looks.iter().map(|l| l.0).min().unwrap_or(0);
            let least_claimed = c.looks.iter().map(|l| l.1).min().unwrap_or(0);
            let beyond = least_held.saturating_sub(least_claimed);
            let unreported = if beyond >= UNREPORTED_SLACK {
                beyond.min(self.total)
            } else {
                0
            };
            // Its memory no swap frees that no look found held, at any claim.
            let unbacked = c
                .looks
                .iter()
                .map(|&(held, claimed)| claimed.saturating_sub(held).min(c.reported_unswappable))
                .min()
                .unwrap_or(0);
            let overclaimed = if listing && unbacked >= UNREPORTED_SLACK {
                unbacked
            } else {
                0
            };
            if overclaimed.abs_diff(c.overclaimed) >= UNREPORTED_SLACK
                || (overclaimed == 0) != (c.overclaimed == 0)
            {
                c.overclaimed = overclaimed;
                c.unswappable = Self::counted_unswappable(c, self.total);
                doubted.push((id, overclaimed));
            }
            if unreported.abs_diff(c.unreported) >= UNREPORTED_SLACK
                || (unreported == 0) != (c.unreported == 0)
            {
                c.unreported = unreported;
                c.unswappable = Self::counted_unswappable(c, self.total);
                changed.push((id, unreported));
            }
        }
        let outside = self.reconcile_outside(procs);
        if changed.is_empty() && doubted.is_empty() && outside.is_none() {
            return Vec::new();
        }
        for (id, bytes) in changed {
            self.log(Some(id), EventKind::Unreported { bytes });
        }
        for (id, bytes) in doubted {
            self.log(Some(id), EventKind::Unbacked { bytes });
        }
        if let Some(bytes) = outside {
            self.log(None, EventKind::OutsideKiwi { bytes });
        }
        self.finish(now)
    }

    /// The processes NVML lists that are no client here: memory no swap frees, and
    /// none of Kiwi's to evict (a process run without Kiwi, a shim its GPU refused, a
    /// tool with a context). Each counts at the least of its last
    /// [`RECONCILE_LOOKS`] looks (a process about to register is listed before it
    /// does), from [`UNREPORTED_SLACK`] on. Only while every client's host pid is
    /// known: one that is not (an arbiter outside the host's pid namespace) would be
    /// counted twice. Returns the new total when it changed by the slack or more.
    fn reconcile_outside(&mut self, procs: &[(u32, u64)]) -> Option<u64> {
        let known = self.clients.values().all(|c| c.info.host_pid != 0);
        let clients: std::collections::BTreeSet<u32> =
            self.clients.values().map(|c| c.info.host_pid).collect();
        let mut listed = std::collections::BTreeSet::new();
        for &(pid, bytes) in procs {
            if !known || pid == 0 || clients.contains(&pid) || !listed.insert(pid) {
                continue;
            }
            let seen = self.outside_looks.entry(pid).or_default();
            seen.push(bytes);
            if seen.len() > RECONCILE_LOOKS {
                seen.remove(0);
            }
        }
        self.outside_looks.retain(|pid, _| listed.contains(pid));
        let outside = self
            .outside_looks
            .values()
            .filter(|seen| seen.len() >= RECONCILE_LOOKS)
            .map(|seen| seen.iter().copied().min().unwrap_or(0))
            .filter(|&b| b >= UNREPORTED_SLACK)
            .fold(0u64, u64::saturating_add)
            .min(self.total);
        let news = outside.abs_diff(self.outside_kiwi) >= UNREPORTED_SLACK
            || (outside == 0) != (self.outside_kiwi == 0);
        news.then(|| {
            self.outside_kiwi = outside;
            outside
        })
    }

    /// The memory no swap frees that client `c` counts for: its reports, less what
    /// no process backs, plus what its process holds beyond them.
    fn counted_unswappable(c: &Client, total: u64) -> u64 {
        c.reported_unswappable
            .saturating_sub(c.overclaimed)
            .saturating_add(c.unreported)
            .min(total)
    }

    /// A swap finished (event log only).
    pub fn swapped(
        &mut self,
        now: Nanos,
        id: ClientId,
        direction: kiwi_protocol::SwapDirection,
        bytes: u64,
        duration_ns: u64,
    ) -> Vec<Output> {
        if !self.clients.contains_key(&id) {
            return Vec::new();
        }
        let kind = match direction {
            kiwi_protocol::SwapDirection::Out => EventKind::SwapOut { bytes, duration_ns },
            kiwi_protocol::SwapDirection::In => {
                self.resident_now(now, id);
                EventKind::SwapIn { bytes, duration_ns }
            }
        };
        self.log(Some(id), kind);
        self.finish(now)
    }

    /// Whether no client is registered (the server may drop the GPU's entry).
    pub fn is_empty(&self) -> bool {
        self.clients.is_empty()
    }

    /// The client is gone (connection closed, process died): it releases everything.
    pub fn exit(&mut self, now: Nanos, id: ClientId) -> Vec<Output> {
        if self.clients.remove(&id).is_none() {
            return Vec::new();
        }
        self.log(Some(id), EventKind::Exit);
        // Its memory is gone with it: the next one in line is granted at once.
        self.holders.remove(&id);
        self.draining.remove(&id);
        self.queue.retain(|&q| q != id);
        self.finish(now)
    }

    /// `kiwictl -S on|off`.
    pub fn set_scheduler(&mut self, now: Nanos, on: bool) -> Vec<Output> {
        if self.settings.scheduler_on != on {
            self.settings.scheduler_on = on;
            self.log(None, EventKind::Scheduler { on });
            self.broadcast_settings();
        }
        self.finish(now)
    }

    /// `kiwictl -T`.
    pub fn set_tq(&mut self, now: Nanos, tq_ms: u64) -> Vec<Output> {
        if self.settings.tq_ms != tq_ms {
            self.settings.tq_ms = tq_ms.max(1);
            self.log(
                None,
                EventKind::Tq {
                    tq_ms: self.settings.tq_ms,
                },
            );
            self.broadcast_settings();
        }
        self.finish(now)
    }

    /// Timers: TQ expiry, grace expiry, room-making deadline.
    pub fn tick(&mut self, now: Nanos) -> Vec<Output> {
        self.finish(now)
    }

    /// When [`Self::tick`] must next be called, if ever.
    pub fn next_deadline(&self) -> Option<Nanos> {
        let mut d: Option<Nanos> = None;
        let mut at = |t: Nanos| d = Some(d.map_or(t, |x: Nanos| x.min(t)));
        if let Some(q) = self.quiet_until {
            if !self.queue.is_empty() {
                at(q);
            }
        }
        if !self.shared_mode() {
            for (&id, h) in &self.holders {
                match self.grace_end(h) {
                    Some(end) => at(end),
                    None if self.contended_now() => at(self.drop_due(id, h)),
                    None => {}
                }
            }
        }
        for h in self.draining.values() {
            if let Some(end) = self.grace_end(h) {
                at(end);
            }
        }
        if let (Some(free), Some((due, _))) = (self.link_free_at(), self.idle_candidate()) {
            at(due.max(free));
        }
        if self.oversubscribed() != self.pressure || self.shared_now() != self.shared {
            if let Some(due) = self.pressure_due() {
                at(due);
            }
        }
        for (id, _) in self.room_changes() {
            if let Some(due) = self.room_due(id) {
                at(due);
            }
        }
        if let Some(due) = self.checkpoint_deadline() {
            at(due);
        }
        if !self.relaxed && !self.takes_turns() {
            at(self.oversubscribed_at.saturating_add(STATE_INTERVAL_NS));
        }
        d
    }

    /// When the next `pressure` broadcast may go ([`STATE_INTERVAL_NS`] after
    /// the last); `None`: at once.
    fn pressure_due(&self) -> Option<Nanos> {
        self.pressure_sent
            .map(|t| t.saturating_add(STATE_INTERVAL_NS))
    }

    fn tq_ns(&self) -> u64 {
        ms_to_ns(self.settings.tq_ms)
    }

    /// When a holder's quantum starts, granted at `now`: at once, unless it is a
    /// `pipelined` client (one that reports its swaps) with memory to swap in.
    fn quantum_start(c: &Client, now: Nanos) -> Option<Nanos> {
        let resident = c.usage.resident_bytes >= c.usage.working_set_bytes;
        (resident || !c.info.pipelined).then_some(now)
    }

    /// When holder `h`'s quantum ends. One still swapping in has until the grant plus
    /// the longer of the TQ and the grace period to report its memory resident, then
    /// a whole TQ of work: so a holder holds at most that plus a TQ, whatever it
    /// reports.
    fn quantum_end(&self, h: &Hold) -> Nanos {
        match h.quantum_from {
            Some(q) => q.saturating_add(self.tq_ns()),
            None => h.since.saturating_add(self.tq_ns().max(self.grace_ns)),
        }
    }

    /// `id` reported its memory resident (a swap-in, or usage): a holder whose quantum
    /// waited for that starts it now, if that is before its wait ran out.
    fn resident_now(&mut self, now: Nanos, id: ClientId) {
        let end = match self.holders.get(&id) {
            Some(h) if h.quantum_from.is_none() && h.drop_sent.is_none() => self.quantum_end(h),
            _ => return,
        };
        if now < end {
            if let Some(h) = self.holders.get_mut(&id) {
                h.quantum_from = Some(now);
            }
        }
    }

    fn broadcast_settings(&mut self) {
        let ids: Vec<_> = self.clients.keys().copied().collect();
        for id in ids {
            self.send(id, ArbiterMsg::Settings(self.settings));
        }
    }

    fn cancel_wait(&mut self, now: Nanos, id: ClientId) {
        let was_queued = self.queue.contains(&id);
        self.queue.retain(|&q| q != id);
        if was_queued {
            if let Some(c) = self.clients.get_mut(&id) {
                c.told = None;
                if let Some(r) = c.requested_at.take() {
                    c.waited_ns += now.saturating_sub(r);
                }
            }
        }
    }

    // ---- the decisions ------------------------------------------------------

    /// `pipelined`: granted while the previous holder still swaps out.
    fn grant(&mut self, now: Nanos, id: ClientId, exclusive: bool, pipelined: bool) {
        let Some(c) = self.clients.get_mut(&id) else {
            return;
        };
        let waited = c.requested_at.take().map_or(0, |r| now.saturating_sub(r));
        c.waited_ns += waited;
        c.told = None;
        c.last_active = now;
        c.last_seen = now;
        self.granted_own = true;
        let quantum_from = Self::quantum_start(c, now);
        self.holders.insert(
            id,
            Hold {
                since: now,
                exclusive,
                drop_sent: None,
                drop_need: 0,
                early: false,
                quantum_from,
                learned: false,
                swap_allowance: 0,
                grown: 0,
                backfill: matches!(self.reserve, Reserve::Claimed(_)),
            },
        );
        c.revoked = false;
        let waiting = self.queue.len() as u32;
        self.log(
            Some(id),
            EventKind::Grant {
                exclusive,
                waited_ns: waited,
            },
        );
        let group = exclusive && self.gang_of(id).is_some();
        self.send(
            id,
            ArbiterMsg::Grant {
                exclusive,
                tq_ms: self.settings.tq_ms,
                waiting,
                pipelined,
                group,
            },
        );
        self.contended = exclusive && waiting > 0;
        self.contended_need = if self.contended {
            self.queue.front().map_or(0, |&n| self.need_for(n))
        } else {
            0
        };
    }

    /// Grants the first in line and reclaims whatever memory it still lacks from idle
    /// clients, least recently active first.
    fn handoff(&mut self, now: Nanos) {
        if self.shared_mode() || !self.holders.is_empty() {
            return;
        }
        // The first in line that the GPU's reservation allows ([`gang`]).
        let Some(next) = self.next_in_line(now) else {
            return;
        };
        // A checkpointed process is restored before its turn.
        if !self.grantable(now, next) {
            return;
        }
        let pipelined = !self.draining.is_empty();
        self.queue.retain(|&q| q != next);
        self.reclaim_for(now, next);
        self.grant(now, next, true, pipelined);
    }

    /// Bytes on their way out of GPU memory: reclaims asked and not answered, and
    /// what drainers' drops asked them to evict.
    /// [`Self::freeing`] less the reclaims that are overdue at `now`
    /// ([`Self::reclaim_overdue_at`]): a client that never answers frees nothing,
    /// and only a checkpoint of its process takes its memory off the GPU.
    fn freeing_at(&self, now: Nanos) -> u64 {
        let overdue = self
            .clients
            .values()
            .filter(|c| self.reclaim_overdue_at(c).is_some_and(|t| now >= t))
            .map(|c| c.reclaim_pending)
            .fold(0u64, u64::saturating_add);
        self.freeing().saturating_sub(overdue)
    }

    fn freeing(&self) -> u64 {
        let reclaims = self
            .clients
            .values()
            .map(|c| c.reclaim_pending)
            .fold(0u64, u64::saturating_add);
        self.draining
            .iter()
            .map(|(id, h)| {
                let resident = self.clients.get(id).map_or(0, |c| c.usage.resident_bytes);
                h.drop_need.min(resident)
            })
            .fold(reclaims, u64::saturating_add)
    }

    /// Reclaims from clients other than `next` (none of them holding) what `next`
    /// still lacks to be all resident, less what reclaims already asked and not yet
    /// answered will free: least recently active first.
    fn reclaim_for(&mut self, now: Nanos, next: ClientId) {
        let need = self.need_for(next).saturating_sub(self.freeing());
        let _ = self.reclaim_bytes(now, next, need);
    }

    /// Reclaims `need` bytes from clients other than `next` (none of them holding or
    /// draining), least recently active first, less what each was already asked;
    /// returns what none of them has resident to give.
    fn reclaim_bytes(&mut self, now: Nanos, next: ClientId, mut need: u64) -> u64 {
        if need == 0 {
            return 0;
        }
        let mut victims: Vec<(Nanos, ClientId, u64)> = self
            .clients
            .iter()
            .filter(|(&id, _)| {
                id != next && !self.holders.contains_key(&id) && !self.draining.contains_key(&id)
            })
            .map(|(&id, c)| {
                let left = c.usage.resident_bytes.saturating_sub(c.reclaim_pending);
                (c.last_active, id, left)
            })
            .filter(|&(_, _, left)| left > 0)
            .collect();
        victims.sort();
        for (_, id, left) in victims {
            if need == 0 {
                break;
            }
            let take = left.min(need);
            need -= take;
            if let Some(c) = self.clients.get_mut(&id) {
                c.reclaim_pending = c.reclaim_pending.saturating_add(take);
                c.reclaim_sent = Some(now);
            }
            self.log(
                Some(id),
                EventKind::Reclaim {
                    need_bytes: take,
                    idle: false,
                },
            );
            self.send(id, ArbiterMsg::Reclaim { need_bytes: take });
        }
        need
    }

    /// When the PCIe link is free for idle eviction: after the unanswered reclaims
    /// are a grace period old. `None`: a hand-off is under way (a drop outstanding,
    /// someone draining), which only a message or the grace timer ends.
    fn link_free_at(&self) -> Option<Nanos> {
        if !self.draining.is_empty() || self.holders.values().any(|h| h.drop_sent.is_some()) {
            return None;
        }
        Some(
            self.clients
                .values()
                .filter(|c| c.reclaim_pending > 0)
                .filter_map(|c| c.reclaim_sent)
                .map(|t| t.saturating_add(self.grace_ns))
                .max()
                .unwrap_or(0),
        )
    }

    /// The next client idle eviction would ask, and when: on an oversubscribed GPU
    /// with eviction on, the client neither holding, draining nor waiting, with
    /// memory resident and no reclaim unanswered, seen least recently.
    fn idle_candidate(&self) -> Option<(Nanos, ClientId)> {
        if self.idle_evict_ns == 0 || !self.oversubscribed() {
            return None;
        }
        self.clients
            .iter()
            .filter(|(id, c)| {
                c.requested_at.is_none()
                    && c.usage.resident_bytes > 0
                    && c.reclaim_pending == 0
                    && !self.holders.contains_key(id)
                    && !self.draining.contains_key(id)
                    && !self.in_group_turn(c.gang)
            })
            .map(|(&id, c)| (c.last_seen.saturating_add(self.idle_evict_ns), id))
            .min()
    }

    /// Idle eviction: asks the least recently seen idle client to swap out all it has
    /// resident, once its idle time is up and the link is free. One at a time.
    fn idle_evict(&mut self, now: Nanos) {
        let Some(free) = self.link_free_at() else {
            return;
        };
        let Some((due, id)) = self.idle_candidate() else {
            return;
        };
        if now < due.max(free) {
            return;
        }
        let Some(c) = self.clients.get_mut(&id) else {
            return;
        };
        let bytes = c.usage.resident_bytes;
        c.reclaim_pending = bytes;
        c.reclaim_sent = Some(now);
        self.log(
            Some(id),
            EventKind::Reclaim {
                need_bytes: bytes,
                idle: true,
            },
        );
        self.send(id, ArbiterMsg::Reclaim { need_bytes: bytes });
    }

    /// Tells `pipelined` clients when the GPU starts or stops being oversubscribed.
    fn notify_pressure(&mut self, now: Nanos) {
        let (over, shared) = (self.oversubscribed(), self.shared_now());
        if (over, shared) == (self.pressure, self.shared)
            || self.pressure_due().is_some_and(|due| now < due)
        {
            return;
        }
        self.pressure = over;
        self.shared = shared;
        self.pressure_sent = Some(now);
        let ids: Vec<ClientId> = self
            .clients
            .iter()
            .filter(|(_, c)| c.info.pipelined)
            .map(|(&id, _)| id)
            .collect();
        for id in ids {
            self.send(
                id,
                ArbiterMsg::Pressure {
                    oversubscribed: over,
                    idle_evict_ms: self.idle_evict_ns / 1_000_000,
                    shared,
                },
            );
        }
    }

    /// What a tenant may see of this GPU (issue #39, [`ArbiterMsg::View`]): the
    /// memory no swap frees that a client registering now would be told the others
    /// hold, and each client `mine` accepts, by the pid it gave, with what Kiwi
    /// counts for it (its working set and its memory no swap frees). At most
    /// [`MAX_VIEW_PROCESSES`] clients, the largest first.
    pub fn view(&self, mine: impl Fn(ClientId) -> bool) -> (u64, Vec<ViewProcess>) {
        let fixed = if self.checkpoint_on {
            self.unmovable_besides(ClientId::MAX)
        } else {
            self.fixed().saturating_sub(self.unseen)
        };
        let mut processes: Vec<ViewProcess> = self
            .clients
            .iter()
            .filter(|(&id, _)| mine(id))
            .map(|(_, c)| ViewProcess {
                pid: c.info.pid,
                used_bytes: c.usage.working_set_bytes.saturating_add(c.unswappable),
            })
            .collect();
        processes.sort_by_key(|p| (std::cmp::Reverse(p.used_bytes), p.pid));
        processes.truncate(MAX_VIEW_PROCESSES);
        (fixed, processes)
    }

    /// What `room_info` client `id` is to be told: the memory no swap frees that the
    /// other clients report, and the largest other working set that must stay
    /// possible beside it (`None`: not such a client).
    fn room_for(&self, id: ClientId) -> Option<RoomView> {
        // What the clients report, not what `no_room` taught (`unseen`: a guess that
        // expires, and one a hostile holder could inflate).
        let c = self.clients.get(&id).filter(|c| c.info.room_info)?;
        if self.checkpoint_on {
            // Only what a checkpoint cannot take off the GPU stays in its way; the
            // others' working sets take turns with it, whole processes evicted.
            return Some((self.unmovable_besides(id), None));
        }
        // Its own memory beyond its reports (`reconcile`) is told too: the shim
        // subtracts only what it reported.
        let fixed = self.fixed().saturating_sub(self.unseen);
        Some((
            fixed.saturating_sub(c.reported_unswappable),
            self.keep_besides(id),
        ))
    }

    /// The largest working set of a client other than `id` (on a GPU whose
    /// processes are not evicted whole): what `id`'s memory no swap frees must leave
    /// room for. A report no one checks, but a tenant that really holds that much
    /// and idles has the same effect: the claim gives a liar no power an honest
    /// tenant lacks.
    fn keep_besides(&self, id: ClientId) -> Option<Keep> {
        self.clients
            .iter()
            .filter(|(&other, c)| other != id && !c.revoked && c.usage.working_set_bytes > 0)
            .max_by_key(|(&other, c)| (c.usage.working_set_bytes, std::cmp::Reverse(other)))
            .map(|(&other, c)| Keep {
                bytes: c.usage.working_set_bytes,
                name: c.info.display_name(other),
            })
    }

    /// The `room_info` clients whose `room` changed since they were last told, with
    /// what to tell them.
    fn room_changes(&self) -> Vec<(ClientId, RoomView)> {
        self.clients
            .iter()
            .filter_map(|(&id, c)| {
                let view = self.room_for(id)?;
                (c.room_told.as_ref() != Some(&view)).then_some((id, view))
            })
            .collect()
    }

    /// When client `id` may next be sent `room` ([`STATE_INTERVAL_NS`] after the
    /// last); `None`: at once.
    fn room_due(&self, id: ClientId) -> Option<Nanos> {
        self.clients
            .get(&id)?
            .room_sent
            .map(|t| t.saturating_add(STATE_INTERVAL_NS))
    }

    /// Tells `room_info` clients the memory no swap frees that the other clients
    /// report, when it changed since they were last told: at most every
    /// [`STATE_INTERVAL_NS`] each, but `now` for `urgent` (a client that asked).
    fn notify_room(&mut self, now: Nanos, urgent: Option<ClientId>) {
        for (id, (others, keep)) in self.room_changes() {
            if urgent != Some(id) && self.room_due(id).is_some_and(|due| now < due) {
                continue;
            }
            if let Some(c) = self.clients.get_mut(&id) {
                c.room_told = Some((others, keep.clone()));
                c.room_sent = Some(now);
            }
            self.send(
                id,
                ArbiterMsg::Room {
                    others_unswappable_bytes: others,
                    keep,
                },
            );
        }
    }

    /// Client `id` pinged: its `room`, if one is due, goes now, before the answer
    /// (the shim's `cuMemGetInfo` counts every registration that finished before it).
    pub fn flush_room(&mut self, now: Nanos, id: ClientId) -> Vec<Output> {
        let view = self.room_for(id);
        if view.is_some() && view != self.clients[&id].room_told {
            self.notify_room(now, Some(id));
        }
        // `room` messages only (to `id`, and to others whose interval ended).
        std::mem::take(&mut self.out)
    }

    /// An exclusive holder that is not all resident found no room to swap in (the
    /// memory of others is still there): make room for what it lacks.
    fn make_room_for_holder(&mut self, now: Nanos) {
        let short: Vec<ClientId> = self
            .holders
            .iter()
            .filter(|(_, h)| h.exclusive && h.drop_sent.is_none())
            .map(|(&id, _)| id)
            .filter(|id| self.need_bytes_to_complete(*id) > 0)
            .collect();
        for id in short {
            let need = self.need_for(id).saturating_sub(self.freeing());
            let _ = self.reclaim_growth(now, id, need);
        }
    }

    /// Reclaims for exclusive holder `id`, which lacks `need` more bytes within its
    /// turn (its working set grew); returns what nobody had to give towards `need`.
    /// Frameworks grow piece by piece (PyTorch's expandable segments map 20 MiB at a
    /// time), and asking for each piece alone costs a reclaim's round trip per
    /// piece: on an H100, 5,030 reclaims of 20 MiB and hand-offs of up to 5 s
    /// (docs/gpu-validation.md). So the ask doubles within a hold: at least what was
    /// reclaimed for it so far, up to 1/[`GROWTH_AHEAD_DIVISOR`] of the GPU. What the
    /// holder leaves unused of it is swapped back in at the others' turns.
    fn reclaim_growth(&mut self, now: Nanos, id: ClientId, need: u64) -> u64 {
        if need == 0 {
            return 0;
        }
        let cap = self.total / GROWTH_AHEAD_DIVISOR;
        let ask = match self.holders.get(&id) {
            Some(h) if h.exclusive => need.max(h.grown.min(cap)),
            _ => need,
        };
        let short = self.reclaim_bytes(now, id, ask);
        if let Some(h) = self.holders.get_mut(&id) {
            h.grown = h.grown.saturating_add(ask - short);
        }
        short.saturating_sub(ask - need)
    }

    fn schedule(&mut self, now: Nanos) {
        self.settle_mode(now);
        if self.quiet_until.is_some_and(|q| now >= q) {
            self.quiet_until = None;
        }
        if self.unseen > 0 && now >= self.unseen_at.saturating_add(UNSEEN_TTL_NS) {
            self.unseen = 0;
        }
        // Grace: a drainer whose release does not come in the grace plus the time its
        // swap-out may take loses the GPU like a holder.
        let expired: Vec<ClientId> = self
            .draining
            .iter()
            .filter(|(_, h)| self.grace_end(h).is_some_and(|end| now >= end))
            .map(|(id, _)| *id)
            .collect();
        for id in expired {
            let h = self.draining.remove(&id).expect("listed");
            self.revoke(now, id, h);
        }
        if self.shared_mode() {
            // Everyone fits (or no arbitration): grant every waiter, shared — except
            // just after a restart, while a holder the arbiter cannot see yet may
            // still be coming back.
            if self.quiet_until.is_none() {
                let queued: Vec<ClientId> = self.queue.drain(..).collect();
                for id in queued {
                    if self.ready_for_grant(now, id) {
                        self.grant(now, id, false, false);
                    } else {
                        self.queue.push_back(id);
                    }
                }
            }
            for h in self.holders.values_mut() {
                h.drop_sent = None;
            }
            self.notify_contention();
            return;
        }

        // Several holders left over from shared mode (or resumed): keep the longest
        // holder, drop the others so their memory makes room.
        if !self.holders.is_empty() {
            let keep = self
                .holders
                .iter()
                .min_by_key(|(id, h)| (!h.exclusive, h.since, **id))
                .map(|(id, _)| *id)
                .expect("non-empty");
            let mut overflow = self
                .resident()
                .saturating_add(self.need_bytes_to_complete(keep))
                .saturating_sub(self.room());
            let others: Vec<ClientId> = self
                .holders
                .keys()
                .copied()
                .filter(|&i| i != keep)
                .collect();
            for id in others {
                let h = self.holders.get_mut(&id).expect("listed");
                if h.drop_sent.is_some() {
                    continue;
                }
                h.drop_sent = Some(now);
                let resident = self.clients.get(&id).map_or(0, |c| c.usage.resident_bytes);
                let need = resident.min(overflow);
                h.drop_need = need;
                overflow -= need;
                self.log(
                    Some(id),
                    EventKind::Drop {
                        need_bytes: need,
                        reason: DropReason::NoLongerFits,
                    },
                );
                self.send(
                    id,
                    ArbiterMsg::Drop {
                        need_bytes: need,
                        reason: DropReason::NoLongerFits,
                    },
                );
            }
            let start = self
                .clients
                .get(&keep)
                .and_then(|c| Self::quantum_start(c, now));
            if let Some(h) = self.holders.get_mut(&keep) {
                if !h.exclusive {
                    h.exclusive = true;
                    h.since = now;
                    h.quantum_from = start;
                }
            }
        }

        // Grace: a holder that ignored its drop loses the GPU.
        let expired: Vec<ClientId> = self
            .holders
            .iter()
            .filter(|(_, h)| self.grace_end(h).is_some_and(|end| now >= end))
            .map(|(id, _)| *id)
            .collect();
        for id in expired {
            let h = self.holders.remove(&id).expect("listed");
            self.revoke(now, id, h);
        }

        // Nobody holds: hand over to the first in line.
        self.handoff(now);
        self.make_room_for_holder(now);

        // TQ: drop the holder only when someone waits.
        if self.contended_now() {
            let due: Vec<ClientId> = self
                .holders
                .iter()
                .filter(|(&id, h)| h.drop_sent.is_none() && now >= self.drop_due(id, h))
                .map(|(id, _)| *id)
                .collect();
            for id in due {
                self.drop_holder(now, id, DropReason::TqExpired);
            }
        }
        self.notify_contention();
    }

    /// Asks holder `id` to give the GPU back, telling it the bytes the next one
    /// needs.
    fn drop_holder(&mut self, now: Nanos, id: ClientId, reason: DropReason) {
        let need = self.next_for_need().map_or(0, |n| self.need_for(n));
        if let Some(h) = self.holders.get_mut(&id) {
            h.drop_sent = Some(now);
            h.drop_need = need;
        }
        self.log(
            Some(id),
            EventKind::Drop {
                need_bytes: need,
                reason,
            },
        );
        self.send(
            id,
            ArbiterMsg::Drop {
                need_bytes: need,
                reason,
            },
        );
    }

    /// When a hold that was asked to let go loses the GPU: the grace after its drop,
    /// plus a drainer's swap allowance (none for a holder). Every revocation deadline
    /// is this one.
    fn grace_end(&self, h: &Hold) -> Option<Nanos> {
        let sent = h.drop_sent?;
        Some(
            sent.saturating_add(self.grace_ns)
                .saturating_add(h.swap_allowance),
        )
    }

    /// Takes the GPU from a holder (or drainer) that ignored its drop past the grace.
    fn revoke(&mut self, now: Nanos, id: ClientId, h: Hold) {
        if let Some(c) = self.clients.get_mut(&id) {
            c.held_ns += now.saturating_sub(h.since);
            c.last_active = now;
            c.last_seen = now;
            c.revoked = true;
        }
        self.log(Some(id), EventKind::Revoke);
        self.send(
            id,
            ArbiterMsg::Revoked {
                reason: format!(
                    "did not release the GPU within {} ms of being asked",
                    (self.grace_ns + h.swap_allowance) / 1_000_000
                ),
            },
        );
    }

    fn need_bytes_to_complete(&self, id: ClientId) -> u64 {
        self.clients.get(&id).map_or(0, |c| {
            c.usage
                .working_set_bytes
                .saturating_sub(c.usage.resident_bytes)
        })
    }

    /// Tells holders when someone starts (or stops) waiting, with what the next
    /// holder needs, so an idle holder can release early and evict just that.
    fn notify_contention(&mut self) {
        let waiting = if self.shared_mode() {
            0
        } else if self.queue.is_empty() && self.contended_now() {
            // A group waits for the GPU, though none of its members here does yet.
            1
        } else {
            self.queue.len() as u32
        };
        let contended = waiting > 0;
        let need = if contended {
            self.next_for_need().map_or(0, |n| self.need_for(n))
        } else {
            0
        };
        // Tell again when the next one's needs change (it allocated since asking), so
        // an early release evicts enough in one go.
        if contended == self.contended && need == self.contended_need {
            return;
        }
        self.contended = contended;
        self.contended_need = need;
        let holders: Vec<ClientId> = self.holders.keys().copied().collect();
        for id in holders {
            self.send(
                id,
                ArbiterMsg::Contended {
                    waiting,
                    need_bytes: need,
                },
            );
        }
    }

    /// Tells each waiter that asked for it (`wait_info`) who holds the GPU, its place
    /// in the queue and when the holder's quantum ends, when that changed since it
    /// was last told: one message per waiter per change, never a repeat. Cost: O(1)
    /// when neither the queue nor the holder changed (the common step); otherwise one
    /// pass over the queue, and one message to each waiter whose view moved: a
    /// hand-off moves everyone up one place, so n waiters get one message each
    /// (~100 bytes; 1,000 waiters: ~100 KB per hand-off, at most one hand-off per
    /// quantum or early release).
    fn notify_waiters(&mut self, now: Nanos) {
        let shown = self
            .holders
            .iter()
            .min_by_key(|(id, h)| (!h.exclusive, h.since, **id))
            .map(|(id, h)| (*id, *h));
        let arbitrating = self.settings.scheduler_on && self.takes_turns();
        // The quantum ends at since + TQ (a lone holder has no deadline, but with
        // someone waiting it has one). A drop sent sooner (no longer fits) ends it then.
        let deadline = shown.and_then(|(_, h)| {
            let tq_end = self.quantum_end(&h);
            match h.drop_sent {
                Some(sent) => Some(sent.min(tq_end)),
                None if arbitrating => Some(tq_end),
                None => None,
            }
        });
        let holder = shown.map(|(id, _)| id);
        let seen = (
            self.queue.len(),
            self.queue.front().copied(),
            self.queue.back().copied(),
            holder,
            self.holders.len(),
            deadline,
        );
        if self.waiters_seen == Some(seen) {
            return;
        }
        self.waiters_seen = Some(seen);
        let others = self.holders.len().saturating_sub(1) as u32;
        let name = holder.and_then(|h| self.clients.get(&h).map(|c| c.info.display_name(h)));
        let mut tell = Vec::new();
        for (place, id) in self.queue.iter().enumerate() {
            let Some(c) = self.clients.get_mut(id) else {
                continue;
            };
            let view = (holder, others, place as u32, deadline);
            if !c.info.wait_info || c.told == Some(view) {
                continue;
            }
            c.told = Some(view);
            tell.push((*id, place as u32));
        }
        for (id, ahead) in tell {
            self.send(
                id,
                ArbiterMsg::Waiting {
                    holder: name.clone(),
                    other_holders: others,
                    ahead,
                    quantum_left_ms: deadline.map(|d| d.saturating_sub(now) / 1_000_000),
                },
            );
        }
    }

    // ---- status -------------------------------------------------------------

    /// A snapshot for `kiwictl status`.
    pub fn status(&self, now: Nanos, index: u32, uuid: &str) -> GpuStatus {
        let clients = self
            .clients
            .iter()
            .map(|(&id, c)| {
                let draining = self.draining.get(&id);
                let (state, held_extra) = match self.holders.get(&id) {
                    Some(h) if h.exclusive => (ClientState::Holding, now.saturating_sub(h.since)),
                    Some(h) => (ClientState::Running, now.saturating_sub(h.since)),
                    None if c.requested_at.is_some() => (ClientState::Waiting, 0),
                    // Giving the GPU back, swapping out: its hold ends at its release.
                    None => (
                        ClientState::Idle,
                        draining.map_or(0, |h| now.saturating_sub(h.since)),
                    ),
                };
                let idle = state == ClientState::Idle && draining.is_none();
                let wait_extra = c.requested_at.map_or(0, |r| now.saturating_sub(r));
                ClientStatus {
                    id,
                    pid: c.info.pid,
                    host_pid: c.info.host_pid,
                    name: c.info.name.clone(),
                    container_id: c.info.container_id.clone(),
                    pod_name: c.info.pod_name.clone(),
                    pod_namespace: c.info.pod_namespace.clone(),
                    state,
                    working_set_bytes: c.usage.working_set_bytes,
                    resident_bytes: c.usage.resident_bytes,
                    swapped_bytes: c
                        .usage
                        .working_set_bytes
                        .saturating_sub(c.usage.resident_bytes),
                    waited_ns: c.waited_ns + wait_extra,
                    held_ns: c.held_ns + held_extra,
                    idle_since_ns: idle.then_some(c.last_seen),
                    checkpointed: c.ckpt == checkpoint::Ckpt::Checkpointed,
                    group: None,
                }
            })
            .collect();
        let queue: Vec<u64> = self.queue.iter().copied().collect();
        GpuStatus {
            index,
            uuid: uuid.to_string(),
            settings: self.settings,
            total_memory_bytes: self.total,
            capacity_bytes: self.capacity,
            fits: self.fits(),
            holders: self.holders(),
            queue,
            clients,
            group_turn: None,
        }
    }
}

mod checkpoint;
pub use checkpoint::{CheckpointFailure, RESTORE_WHEN_IDLE_NS};
mod gang;
pub use gang::{GangId, Reserve};

#[cfg(test)]
mod checkpoint_tests;
#[cfg(test)]
mod tests;
