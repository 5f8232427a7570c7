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
//!
//! The scheduler is one value, [`GpuScheduler`], stepped by one input at a time; its
//! parts are split by concern, each an `impl GpuScheduler` of its own file (the
//! state they share, the clients, the queue, the holders and the drainers, is
//! defined here), and where a part's state has an invariant of its own, a struct
//! that owns it:
//!
//! - `client.rs`: a client's identity and labels ([`ClientInfo`]), registration and
//!   exit.
//! - `memory.rs`: the memory ledger (its `Ledger`: the GPU's size and capacity, the
//!   memory no client accounts for); what no swap frees, the room, whether the
//!   working sets fit, swap need; usage reports and admissions. `memory/reconcile.rs`:
//!   the driver's per-process figures checked against the clients' reports.
//! - `mode.rs`: shared or in turns, with hysteresis (its `Mode`).
//! - `turns.rs`: requests, releases, grants, hand-offs (pipelined too), drops at
//!   the quantum's end, revocations past the grace.
//! - `room.rs`: making room: reclaims for the next holder and a short or growing
//!   holder, and a holder's `no_room`.
//! - `idle.rs`: idle eviction.
//! - `notify.rs`: what clients are told unasked (`pressure`, `contended`, `waiting`,
//!   `room`, settings), each only when it changed (its `Told`).
//! - `resume.rs`: the post-restart window (its `ResumeWindow`).
//! - `status.rs`: `kiwictl status`, a tenant's view, a client's activity.
//! - `checkpoint.rs`: whole-process eviction; `gang.rs`: this GPU's part in group
//!   turns.

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
    /// The working set the arbiter last admitted for it ([`GpuScheduler::admit`]):
    /// what backs its claims before its process is seen holding the memory
    /// ([`GpuScheduler::admission_need`]).
    admitted: u64,
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

/// One GPU's scheduler.
#[derive(Debug, Clone)]
pub struct GpuScheduler {
    /// The GPU's memory as scheduled against: its size, its capacity and the memory
    /// no client accounts for.
    ledger: Ledger,
    settings: Settings,
    grace_ns: u64,
    clients: BTreeMap<ClientId, Client>,
    queue: VecDeque<ClientId>,
    holders: BTreeMap<ClientId, Hold>,
    /// Dropped holders that said `drained`: swapping out, their release still to come.
    draining: BTreeMap<ClientId, Hold>,
    /// Idle eviction after this long without a word (0: off).
    idle_evict_ns: u64,
    /// What clients were last told: `pressure`, `contended`, `waiting`.
    told: Told,
    /// The post-restart window: whose claim to hold is believed, and until when
    /// resumed waiters wait.
    resume: ResumeWindow,
    /// The node's swap budget, told to clients at registration (enforced node-wide by
    /// the server, see [`crate::swap`]).
    swap_budget: Option<u64>,
    /// Whole processes may be checkpointed to make room (the daemon has the driver's
    /// checkpoint API, [`crate::checkpoint`]).
    checkpoint_on: bool,
    /// Since when nobody holds, drains or waits: checkpointed clients are restored
    /// [`checkpoint::RESTORE_WHEN_IDLE_NS`] later.
    idle_since: Option<Nanos>,
    /// When checkpoints were chosen on each tenant's behalf, within the last
    /// [`checkpoint::EVICTION_WINDOW_NS`].
    evicted_for: BTreeMap<String, VecDeque<Nanos>>,
    /// Shared or in turns, with hysteresis ([`GpuScheduler::settle_mode`]).
    mode: Mode,
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

/// Least time between two `pressure` broadcasts of a GPU, and between two `room`
/// messages to one client: a client flipping its usage or its memory no swap frees
/// thousands of times a second must not make the arbiter send every other client a
/// message per flip (issue #27, item 3); the latest state follows when the interval
/// ends ([`GpuScheduler::next_deadline`]). A client's `ping` gets its due `room`
/// first, at once ([`GpuScheduler::flush_room`]).
pub const STATE_INTERVAL_NS: u64 = 250_000_000;

fn ms_to_ns(ms: u64) -> u64 {
    ms.saturating_mul(1_000_000)
}

impl GpuScheduler {
    /// `capacity`: total minus the context reserve.
    pub fn new(total: u64, capacity: u64, settings: Settings, grace_ms: u64) -> Self {
        Self {
            ledger: Ledger::new(total, capacity),
            settings,
            grace_ns: ms_to_ns(grace_ms),
            clients: BTreeMap::new(),
            queue: VecDeque::new(),
            holders: BTreeMap::new(),
            draining: BTreeMap::new(),
            idle_evict_ns: 0,
            told: Told::default(),
            resume: ResumeWindow::new(),
            swap_budget: None,
            checkpoint_on: false,
            idle_since: None,
            evicted_for: BTreeMap::new(),
            mode: Mode::new(),
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
        self.resume.set_until(until);
        self
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
    pub fn set_tq(&mut self, now: Nanos, tq: kiwi_config::Quantum) -> Vec<Output> {
        let tq_ms = tq.as_millis();
        if self.settings.tq_ms != tq_ms {
            self.settings.tq_ms = tq_ms;
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
        if let Some(q) = self.resume.quiet_until() {
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
        if (self.oversubscribed(), self.shared_now()) != self.told.pressure() {
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
        if !self.mode.relaxed() && !self.takes_turns() {
            at(self.mode.relax_at());
        }
        d
    }
}

mod checkpoint;
pub use checkpoint::{CheckpointFailure, RESTORE_WHEN_IDLE_NS};
mod client;
pub use client::ClientInfo;
mod gang;
pub use gang::{GangId, Reserve};
mod idle;
mod memory;
use memory::Ledger;
pub use memory::{RECONCILE_INTERVAL_NS, RECONCILE_LOOKS, UNREPORTED_SLACK, UNSEEN_TTL_NS};
mod mode;
use mode::Mode;
mod notify;
use notify::{RoomView, Told, WaitView};
mod resume;
use resume::ResumeWindow;
pub use resume::RESUME_CLAIM_WINDOW_NS;
mod room;
pub use room::{GROWTH_AHEAD_DIVISOR, NO_ROOM_SLACK};
mod status;
mod turns;
pub use turns::SLOWEST_SWAP_OUT_NS_PER_BYTE;

#[cfg(test)]
mod checkpoint_tests;
#[cfg(test)]
mod tests;
