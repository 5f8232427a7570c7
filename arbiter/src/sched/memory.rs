//! The memory ledger: what GPU memory the working sets are scheduled against.
//!
//! [`Ledger`] owns the GPU's own figures: its size and capacity (never lowered), and
//! the memory no client accounts for, counted as memory no swap frees until it is
//! forgotten (learned from a holder's `no_room`, for [`UNSEEN_TTL_NS`]) or until
//! NVML stops listing it (processes outside Kiwi, `reconcile.rs`); each at most the
//! GPU's size. The clients' side (their working sets, residency and memory no swap
//! frees) is in each client; the queries here (`fixed`, `room`, `fits`, `swap_need`,
//! `need_for`) add the two up, and the inputs (`usage`, `admit`, `unswappable`,
//! `swapped`) change the clients' side.

use super::*;

mod reconcile;
pub use reconcile::{RECONCILE_INTERVAL_NS, RECONCILE_LOOKS, UNREPORTED_SLACK};

/// How long memory learned from `no_room` ([`GpuScheduler::no_room`]) is counted.
pub const UNSEEN_TTL_NS: u64 = 60_000_000_000;

/// The GPU's memory as this scheduler counts it, apart from what its clients report:
/// its size and capacity as registered (raised, never lowered), and the memory no
/// client accounts for, each at most the size. Its fields change only here and in
/// `memory/reconcile.rs`; the other parts go through its methods.
#[derive(Debug, Clone)]
pub(super) struct Ledger {
    total: u64,
    capacity: u64,
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
    /// NVML listed the process of some client of this GPU at the last look: the
    /// driver's per-process figures are there to check claims against.
    listing: bool,
}

impl Ledger {
    /// `capacity`: total minus the context reserve.
    pub(super) fn new(total: u64, capacity: u64) -> Self {
        Self {
            total,
            capacity,
            unseen: 0,
            unseen_at: 0,
            outside_kiwi: 0,
            outside_looks: BTreeMap::new(),
            listing: false,
        }
    }

    /// Total GPU memory scheduled against, as registered.
    pub(super) fn total(&self) -> u64 {
        self.total
    }

    /// GPU memory scheduled against (total − context reserve).
    pub(super) fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Memory learned from `no_room` and not forgotten yet.
    pub(super) fn unseen(&self) -> u64 {
        self.unseen
    }

    /// Memory of the processes that are no client here.
    pub(super) fn outside_kiwi(&self) -> u64 {
        self.outside_kiwi
    }

    /// Whether NVML listed the process of some client at the last look.
    pub(super) fn listing(&self) -> bool {
        self.listing
    }

    /// `no_room` taught `bytes` more of memory no client accounts for, at `now`.
    pub(super) fn learn_unseen(&mut self, now: Nanos, bytes: u64) {
        self.unseen = self.unseen.saturating_add(bytes).min(self.total);
        self.unseen_at = now;
    }

    /// Forgets the memory learned from `no_room` [`UNSEEN_TTL_NS`] after it was last
    /// learned.
    pub(super) fn forget_unseen(&mut self, now: Nanos) {
        if self.unseen > 0 && now >= self.unseen_at.saturating_add(UNSEEN_TTL_NS) {
            self.unseen = 0;
        }
    }
}

impl GpuScheduler {
    /// Total GPU memory scheduled against, as registered.
    pub fn total(&self) -> u64 {
        self.ledger.total
    }

    /// Raises the GPU's size (a later registration reported more, still within what
    /// the arbiter knows the GPU has). Never lowers it.
    pub fn raise_total(&mut self, now: Nanos, total: u64, capacity: u64) -> Vec<Output> {
        if total > self.ledger.total {
            self.ledger.total = total;
            self.ledger.capacity = self.ledger.capacity.max(capacity);
        }
        self.finish(now)
    }

    /// GPU memory scheduled against (total − context reserve).
    pub fn capacity(&self) -> u64 {
        self.ledger.capacity
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
            self.ledger.total.saturating_sub(self.ledger.capacity)
        } else {
            0
        };
        reported
            .max(floor)
            .saturating_add(self.ledger.unseen)
            .saturating_add(self.ledger.outside_kiwi)
            .min(self.ledger.total)
    }

    /// GPU memory the working sets are scheduled against: total − [`Self::fixed`].
    pub fn room(&self) -> u64 {
        self.ledger.total.saturating_sub(self.fixed())
    }

    /// Bytes of this GPU's working sets that do not fit in its room: the least host
    /// RAM that must hold its swapped-out memory.
    pub fn swap_need(&self) -> u64 {
        self.working_sets().saturating_sub(self.room())
    }

    /// [`Self::swap_need`] as an admission of client `requester` counts it, with its
    /// working set `working_set` (`None`: as it stands; it need not be on this GPU).
    /// Every other client's working set counts only as far as something backs it:
    /// what the arbiter admitted for it, or what its process is seen to hold (the
    /// driver's figure on this GPU, plus `held(host pid)`: the swap pool's memory lent
    /// to it). A report no allocation backs is a claim no one checks; counted, one
    /// tenant claiming a GPU's worth would make every other tenant's allocations on
    /// the node fail. What is not counted is at worst swapped into its owner's own
    /// memory when the pool runs short.
    pub fn admission_need(
        &self,
        requester: ClientId,
        working_set: Option<u64>,
        held: &dyn Fn(u32) -> u64,
    ) -> u64 {
        let others = self
            .clients
            .iter()
            .filter(|(&id, _)| id != requester)
            .map(|(_, c)| {
                let seen = c
                    .driver_bytes
                    .unwrap_or(0)
                    .saturating_add(held(c.info.host_pid));
                c.usage.working_set_bytes.min(c.admitted.max(seen))
            })
            .fold(0u64, u64::saturating_add);
        let own = working_set.unwrap_or_else(|| self.working_set_of(requester));
        others.saturating_add(own).saturating_sub(self.room())
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

    pub(super) fn resident(&self) -> u64 {
        self.clients
            .values()
            .filter(|c| !c.off_gpu())
            .map(|c| c.usage.resident_bytes)
            .fold(0u64, u64::saturating_add)
    }

    /// Bytes that must leave GPU memory before `next` can bring all of its own in:
    /// what residency would exceed the room by (every client's non-swappable memory
    /// stays). Residency can already be over the room
    /// (a client swaps in on a grant given while its answer to a reclaim was still on
    /// the way): that overflow must go too, or it stays for good.
    pub(super) fn need_for(&self, next: ClientId) -> u64 {
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

    pub(super) fn need_bytes_to_complete(&self, id: ClientId) -> u64 {
        self.clients.get(&id).map_or(0, |c| {
            c.usage
                .working_set_bytes
                .saturating_sub(c.usage.resident_bytes)
        })
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
        c.admitted = working_set;
        let usage = Usage {
            working_set_bytes: working_set,
            resident_bytes: c.usage.resident_bytes,
        };
        self.usage(now, id, usage)
    }

    /// The client's memory that no swap frees is now `bytes`
    /// ([`kiwi_protocol::ClientMsg::Unswappable`]).
    pub fn unswappable(&mut self, now: Nanos, id: ClientId, bytes: u64) -> Vec<Output> {
        let Some(c) = self.clients.get_mut(&id) else {
            return Vec::new();
        };
        // A report past the GPU's size is a lie or a bug: it cannot take more than all.
        let bytes = bytes.min(self.ledger.total);
        if c.reported_unswappable == bytes {
            return Vec::new();
        }
        c.reported_unswappable = bytes;
        c.unswappable = Self::counted_unswappable(c, self.ledger.total);
        c.last_seen = now;
        self.log(Some(id), EventKind::Unswappable { bytes });
        self.finish(now)
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
}
