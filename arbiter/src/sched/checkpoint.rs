//! Whole-process eviction (issue #25): when a holder's room is short by more than
//! the others' swappable memory can give, the rest is their processes' memory no swap
//! frees (contexts, modules). Once paging has settled (nobody else holds, drains or
//! owes a reclaim), the scheduler picks clients that do not hold the GPU and have
//! sent nothing for [`CHECKPOINT_IDLE_NS`] (idle ones before waiters, least recently
//! heard from first) until their memory no swap frees covers the shortfall; each is first asked to reclaim everything it has resident (its shim's
//! fast path), and once it answered, the daemon has the driver checkpoint its process
//! ([`Output::Checkpoint`], [`crate::checkpoint`]). Its memory no swap frees then no
//! longer counts on the GPU ([`GpuScheduler::fixed`]) while it does not wait for a
//! turn (a waiter needs it back first).
//!
//! A checkpointed client is restored ([`Output::Restore`]) before it is granted the
//! GPU again, and whenever nobody holds, drains or waits for
//! [`RESTORE_WHEN_IDLE_NS`] and its memory fits: a thread of it blocked in a driver
//! call outside any turn (`cudaDeviceSynchronize` from a notebook cell, say) waits at
//! most until the GPU is idle, and then goes on. A refusal that will not change
//! (managed or IPC memory, no CUDA state) marks the client as never to be tried
//! again; others (a lock that timed out, no room to restore yet) are retried after
//! [`RETRY_NS`]. Every attempt is in the event log.

use super::*;

/// Where a client's process stands with whole-process eviction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Ckpt {
    /// Running as usual.
    None,
    /// Chosen: its reclaim is asked; the checkpoint starts when it answers.
    Wanted,
    /// The daemon is checkpointing it.
    Checkpointing,
    /// Off the GPU: its memory no swap frees does not count.
    Checkpointed,
    /// The daemon is restoring it (its memory counts again).
    Restoring,
    /// The driver refused it for good (managed or IPC memory, no CUDA state).
    Refused,
}

/// How long nobody must hold, drain or wait before checkpointed clients are restored:
/// long enough that a notebook's next cell, a moment later, does not pay a restore and
/// a checkpoint of the others again.
pub const RESTORE_WHEN_IDLE_NS: u64 = 1_000_000_000;

/// How long a client must have sent nothing before it is checkpointed: one that
/// just asked, released or changed its memory is at work, maybe inside a driver call
/// that a lock would make wait for the whole checkpoint.
pub const CHECKPOINT_IDLE_NS: u64 = 500_000_000;

/// Pause before a failed checkpoint of a client is tried again.
pub(super) const RETRY_NS: u64 = 1_000_000_000;
/// Pause before a restore that found no room is tried again: the others were asked
/// to reclaim the room meanwhile.
pub(super) const RESTORE_RETRY_NS: u64 = 250_000_000;

/// The window over which evictions are counted, for a tenant on whose behalf they
/// are made and for each process evicted.
pub const EVICTION_WINDOW_NS: u64 = 10_000_000_000;

/// Checkpoints chosen on behalf of one tenant (the connections of one container
/// socket, or of one uid on the node's socket), at most, per [`EVICTION_WINDOW_NS`]:
/// a tenant that asks over and over (by `no_room`s, or by processes started over
/// and over) gets no more than a holder beside a few newcomers needs.
pub const TENANT_EVICTIONS: usize = 4;

/// Checkpoints of one process, at most, per [`EVICTION_WINDOW_NS`]: each costs it a
/// checkpoint and a restore (about half a second on an H100 for a context); what
/// others' shortfalls may cost it is bounded whoever asks.
pub const VICTIM_EVICTIONS: usize = 2;

/// Why a checkpoint or restore failed: one line, and whether it never will succeed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointFailure {
    pub reason: String,
    pub permanent: bool,
}

impl GpuScheduler {
    fn retry_due(c: &Client) -> Nanos {
        let pause = if c.ckpt == Ckpt::Checkpointed {
            RESTORE_RETRY_NS
        } else {
            RETRY_NS
        };
        c.ckpt_failed_at.map_or(0, |t| t.saturating_add(pause))
    }

    /// Chooses processes to checkpoint for holder `holder`, which is `short` bytes
    /// short beyond what the others' swappable memory can give.
    pub(super) fn checkpoint_for(&mut self, now: Nanos, holder: ClientId, short: u64) {
        if !self.checkpoint_on || short == 0 {
            return;
        }
        // What would stay short with every other process checkpointed is memory no
        // eviction frees (processes outside Kiwi, ones the driver refuses): the
        // holder would lack it alone too, so nobody pays a checkpoint for it.
        if short > self.checkpointable_besides(now, holder) {
            return;
        }
        // A claim the driver contradicts costs nobody anything: a process that holds
        // no GPU memory at all (no context) has nothing to swap in. Where the driver
        // lists processes, a holder not looked at yet is looked at first (within
        // [`RECONCILE_INTERVAL_NS`]; its next `no_room` asks again). Judged by the
        // last look taken while nothing of it was being swapped or checkpointed (a
        // process just restored holds nothing at a look taken while it was
        // checkpointed; the soak found one refused so).
        let Some(h) = self.clients.get(&holder) else {
            return;
        };
        match (h.driver_bytes, h.looks.back()) {
            (None, _) if self.ledger.listing() && h.info.host_pid != 0 => return,
            (Some(_), Some(&(0, _))) => {
                self.note_eviction_limit(
                    now,
                    holder,
                    "the driver shows its process holding no GPU memory".into(),
                );
                return;
            }
            _ => {}
        }
        let window_start = now.saturating_sub(EVICTION_WINDOW_NS);
        let tenant = self.tenant_of(holder);
        self.evicted_for.retain(|_, times| {
            while times.front().is_some_and(|&t| t < window_start) {
                times.pop_front();
            }
            !times.is_empty()
        });
        let mut allowed =
            TENANT_EVICTIONS.saturating_sub(self.evicted_for.get(&tenant).map_or(0, VecDeque::len));
        if allowed == 0 {
            self.note_eviction_limit(
                now,
                holder,
                format!(
                    "{tenant} had {TENANT_EVICTIONS} processes checkpointed in the last {} s",
                    EVICTION_WINDOW_NS / 1_000_000_000
                ),
            );
            return;
        }
        let coming: u64 = self
            .clients
            .values()
            .filter(|c| matches!(c.ckpt, Ckpt::Wanted | Ckpt::Checkpointing))
            .map(|c| self.checkpoint_frees(now, c))
            .fold(0, u64::saturating_add);
        let mut need = short.saturating_sub(coming);
        if need == 0 {
            return;
        }
        let front = self.queue.front().copied();
        let mut spared = false;
        // Idle clients first, then waiters (whose turn, and restore, comes sooner);
        // least recently heard from first.
        let frees: BTreeMap<ClientId, u64> = self
            .clients
            .iter()
            .map(|(&id, c)| (id, self.checkpoint_frees(now, c)))
            .collect();
        let mut victims: Vec<(bool, Nanos, ClientId)> = Vec::new();
        for (&id, c) in self.clients.iter_mut() {
            while c.evicted_at.front().is_some_and(|&t| t < window_start) {
                c.evicted_at.pop_front();
            }
            let eligible = id != holder
                && Some(id) != front
                && !self.holders.contains_key(&id)
                && !self.draining.contains_key(&id)
                && c.ckpt == Ckpt::None
                && frees.get(&id).is_some_and(|&f| f > 0)
                && now >= Self::retry_due(c)
                && now >= c.last_seen.saturating_add(CHECKPOINT_IDLE_NS);
            if !eligible {
                continue;
            }
            if c.evicted_at.len() >= VICTIM_EVICTIONS {
                spared = true;
                continue;
            }
            victims.push((c.requested_at.is_some(), c.last_seen, id));
        }
        victims.sort();
        for (_, _, id) in victims {
            if need == 0 || allowed == 0 {
                break;
            }
            let frees = frees.get(&id).copied().unwrap_or(0);
            let Some(c) = self.clients.get_mut(&id) else {
                continue;
            };
            c.ckpt = Ckpt::Wanted;
            c.evicted_at.push_back(now);
            allowed -= 1;
            self.evicted_for
                .entry(tenant.clone())
                .or_default()
                .push_back(now);
            need = need.saturating_sub(frees);
            // Its swappable memory leaves first, by its shim's own fast path.
            let left = c.usage.resident_bytes.saturating_sub(c.reclaim_pending);
            if left > 0 {
                c.reclaim_pending = c.reclaim_pending.saturating_add(left);
                c.reclaim_sent = Some(now);
                self.log(
                    Some(id),
                    EventKind::Reclaim {
                        need_bytes: left,
                        idle: false,
                    },
                );
                self.send(id, ArbiterMsg::Reclaim { need_bytes: left });
            }
        }
        if need > 0 && spared {
            self.note_eviction_limit(
                now,
                holder,
                format!(
                    "the others' processes were checkpointed {VICTIM_EVICTIONS} times each in the last {} s",
                    EVICTION_WINDOW_NS / 1_000_000_000
                ),
            );
        }
    }

    /// Whose shortfalls client `id`'s are counted with: its tenant (its connection's
    /// container socket or uid), else itself.
    fn tenant_of(&self, id: ClientId) -> String {
        self.clients
            .get(&id)
            .and_then(|c| c.info.tenant.clone())
            .unwrap_or_else(|| format!("client {id}"))
    }

    /// Says in the event log (at most once per [`EVICTION_WINDOW_NS`] per client) why
    /// no process is checkpointed for holder `id`.
    fn note_eviction_limit(&mut self, now: Nanos, id: ClientId, why: String) {
        let Some(c) = self.clients.get_mut(&id) else {
            return;
        };
        if c.eviction_noted
            .is_some_and(|t| now < t.saturating_add(EVICTION_WINDOW_NS))
        {
            return;
        }
        c.eviction_noted = Some(now);
        self.log(
            Some(id),
            EventKind::CheckpointSkipped {
                reason: format!("no process checkpointed to make room for it: {why}"),
            },
        );
    }

    /// When a chosen client's reclaim counts as unanswered: past the grace period
    /// and the slowest swap-out of what it was asked for. A client that never
    /// answers (its hint provider silent, or its shim hostile) is checkpointed all
    /// the same: the driver copies its resident memory too.
    pub(super) fn reclaim_overdue_at(&self, c: &Client) -> Option<Nanos> {
        let sent = c.reclaim_sent?;
        Some(
            sent.saturating_add(self.grace_ns).saturating_add(
                c.reclaim_pending
                    .saturating_mul(crate::sched::SLOWEST_SWAP_OUT_NS_PER_BYTE),
            ),
        )
    }

    /// Starts the checkpoints of chosen clients whose reclaim was answered, or is
    /// overdue ([`GpuScheduler::reclaim_overdue_at`]).
    pub(super) fn start_checkpoints(&mut self, now: Nanos) {
        let ready: Vec<ClientId> = self
            .clients
            .iter()
            .filter(|(_, c)| {
                c.ckpt == Ckpt::Wanted
                    && (c.reclaim_pending == 0
                        || self.reclaim_overdue_at(c).is_some_and(|t| now >= t))
            })
            .map(|(&id, _)| id)
            .collect();
        for id in ready {
            let c = self.clients.get_mut(&id).expect("listed");
            let pid = c.info.host_pid;
            if pid == 0 {
                c.ckpt = Ckpt::Refused;
                self.log(
                    Some(id),
                    EventKind::CheckpointSkipped {
                        reason: "its host pid is unknown".into(),
                    },
                );
                continue;
            }
            c.ckpt = Ckpt::Checkpointing;
            self.out.push(Output::Checkpoint { id, pid });
        }
    }

    /// Whether client `id` may be granted now; a checkpointed one is restored first
    /// (and granted when [`GpuScheduler::restore_done`] says so).
    pub(super) fn ready_for_grant(&mut self, now: Nanos, id: ClientId) -> bool {
        let Some(c) = self.clients.get_mut(&id) else {
            return true;
        };
        match c.ckpt {
            Ckpt::None | Ckpt::Refused => true,
            Ckpt::Wanted => {
                c.ckpt = Ckpt::None;
                true
            }
            Ckpt::Checkpointing | Ckpt::Restoring => false,
            Ckpt::Checkpointed => {
                if now >= Self::retry_due(c) {
                    c.ckpt = Ckpt::Restoring;
                    let pid = c.info.host_pid;
                    self.out.push(Output::Restore { id, pid });
                }
                false
            }
        }
    }

    /// GPU memory free by this scheduler's count: total less what no swap frees and
    /// what is resident.
    fn free_by_count(&self) -> u64 {
        self.ledger
            .total()
            .saturating_sub(self.fixed())
            .saturating_sub(self.resident())
    }

    /// GPU memory free beside every holder's whole working set and what the next
    /// waiter lacks: what a restore may take while others hold the GPU without
    /// making anyone short (`None`: a hand-off is under way, or nobody holds).
    fn free_beside_holders(&self) -> Option<u64> {
        if !self.draining.is_empty() || self.holders.is_empty() {
            return None;
        }
        let taken = self
            .clients
            .iter()
            .map(|(id, c)| {
                if self.holders.contains_key(id) {
                    c.usage.working_set_bytes
                } else {
                    c.usage.resident_bytes
                }
            })
            .fold(0u64, u64::saturating_add);
        let next = self
            .queue
            .front()
            .and_then(|id| self.clients.get(id))
            .map_or(0, |c| {
                c.usage
                    .working_set_bytes
                    .saturating_sub(c.usage.resident_bytes)
            });
        Some(
            self.ledger
                .total()
                .saturating_sub(self.fixed())
                .saturating_sub(taken)
                .saturating_sub(next),
        )
    }

    /// Checkpointed clients the GPU can take back within `free` bytes, least
    /// recently active first, as long as each fits (`now`: only those whose retry
    /// pause is over; `waiters`: those waiting for a turn too, whom a grant restores
    /// otherwise).
    fn restorable(&self, now: Option<Nanos>, mut free: u64, waiters: bool) -> Vec<ClientId> {
        let mut ids: Vec<(Nanos, ClientId)> = self
            .clients
            .iter()
            .filter(|(_, c)| c.ckpt == Ckpt::Checkpointed)
            .filter(|(_, c)| waiters || c.requested_at.is_none())
            .filter(|(_, c)| now.is_none_or(|n| n >= Self::retry_due(c)))
            .map(|(&id, c)| (c.last_active, id))
            .collect();
        ids.sort();
        let mut out = Vec::new();
        for (_, id) in ids {
            let need = self.clients[&id].unswappable;
            if need <= free {
                free -= need;
                out.push(id);
            }
        }
        out
    }

    /// Restores checkpointed clients once nobody has held, drained or waited for
    /// [`RESTORE_WHEN_IDLE_NS`], and, while others hold the GPU, as soon as one fits
    /// beside their whole working sets ([`GpuScheduler::free_beside_holders`]): a
    /// thread of a checkpointed process blocked in a driver call outside any turn
    /// (`cuMemGetInfo`, `cudaDeviceSynchronize` from a notebook cell) waits only as
    /// long as the GPU cannot hold its memory, not for as long as another tenant
    /// keeps the GPU or claims memory.
    pub(super) fn restore_when_idle(&mut self, now: Nanos) {
        let ids = if self.holders.is_empty() && self.draining.is_empty() && self.queue.is_empty() {
            let since = *self.idle_since.get_or_insert(now);
            if now < since.saturating_add(RESTORE_WHEN_IDLE_NS) {
                return;
            }
            self.restorable(Some(now), self.free_by_count(), true)
        } else {
            self.idle_since = None;
            match self.free_beside_holders() {
                Some(free) => self.restorable(Some(now), free, false),
                None => return,
            }
        };
        for id in ids {
            let c = self.clients.get_mut(&id).expect("listed");
            c.ckpt = Ckpt::Restoring;
            let pid = c.info.host_pid;
            self.out.push(Output::Restore { id, pid });
        }
    }

    /// When a checkpoint-related step is due ([`GpuScheduler::next_deadline`]): an
    /// idle GPU's restores, a failed restore of the next in line tried again.
    pub(super) fn checkpoint_deadline(&self) -> Option<Nanos> {
        let mut d: Option<Nanos> = None;
        let mut at = |t: Nanos| d = Some(d.map_or(t, |x: Nanos| x.min(t)));
        if let Some(since) = self.idle_since {
            for id in self.restorable(None, self.free_by_count(), true) {
                let due = Self::retry_due(&self.clients[&id]);
                at(due.max(since.saturating_add(RESTORE_WHEN_IDLE_NS)));
            }
        }
        if let Some(free) = self.free_beside_holders() {
            for id in self.restorable(None, free, false) {
                at(Self::retry_due(&self.clients[&id]));
            }
        }
        for c in self.clients.values() {
            if c.ckpt == Ckpt::Wanted && c.reclaim_pending > 0 {
                if let Some(t) = self.reclaim_overdue_at(c) {
                    at(t);
                }
            }
        }
        if let Some(c) = self.queue.front().and_then(|id| self.clients.get(id)) {
            if c.ckpt == Ckpt::Checkpointed && c.ckpt_failed_at.is_some() {
                at(Self::retry_due(c));
            }
        }
        d
    }

    /// Whether the daemon can never checkpoint client `c`'s process: the driver
    /// refused it, or its host pid is unknown (an arbiter outside the host's pid
    /// namespace cannot name it).
    fn unmovable(c: &Client) -> bool {
        c.ckpt == Ckpt::Refused || c.info.host_pid == 0
    }

    /// What client `id`, in its turn, cannot have because neither a swap nor a
    /// checkpoint takes it off the GPU: the memory no swap frees of the clients whose
    /// processes cannot be checkpointed, the processes outside Kiwi (no client's: the
    /// arbiter evicts none of them), and its own memory beyond its reports (code
    /// loaded inside launches, [`GpuScheduler::reconcile`]: its shim subtracts only
    /// what it reported). Told as less, a tenant sizing itself from `cuMemGetInfo`
    /// (JAX's preallocation) waited for good for room only the outsider's exit makes.
    pub(super) fn unmovable_besides(&self, id: ClientId) -> u64 {
        let own = self.clients.get(&id).map_or(0, |c| c.unreported);
        self.clients
            .iter()
            .filter(|(&other, c)| other != id && Self::unmovable(c))
            .map(|(_, c)| c.unswappable)
            .fold(own, u64::saturating_add)
            .saturating_add(self.ledger.outside_kiwi())
            .min(self.ledger.total())
    }

    /// What a checkpoint of client `c`'s process takes off the GPU that no swap
    /// will: its memory no swap frees, and what it was asked to reclaim and did not
    /// answer in time (`now`); or all its process holds as the driver last counted
    /// it, when that is more (its reports may understate it: a checkpoint takes
    /// everything).
    fn checkpoint_frees(&self, now: Nanos, c: &Client) -> u64 {
        let silent = if self.reclaim_overdue_at(c).is_some_and(|t| now >= t) {
            c.reclaim_pending.min(c.usage.resident_bytes)
        } else {
            0
        };
        c.unswappable
            .saturating_add(silent)
            .max(c.driver_bytes.unwrap_or(0))
    }

    /// Memory that checkpoints of clients other than `holder` could take off the
    /// GPU at `now`, at most (those chosen or under way included).
    fn checkpointable_besides(&self, now: Nanos, holder: ClientId) -> u64 {
        self.clients
            .iter()
            .filter(|(&id, c)| id != holder && !Self::unmovable(c))
            .filter(|(_, c)| !matches!(c.ckpt, Ckpt::Checkpointed | Ckpt::Restoring))
            .map(|(_, c)| self.checkpoint_frees(now, c))
            .fold(0, u64::saturating_add)
    }

    /// The host pids of the processes checkpointed (or on their way), which a
    /// stopping daemon restores: none is left locked behind it.
    pub fn checkpointed_pids(&self) -> Vec<u32> {
        self.clients
            .values()
            .filter(|c| {
                matches!(
                    c.ckpt,
                    Ckpt::Checkpointing | Ckpt::Checkpointed | Ckpt::Restoring
                )
            })
            .map(|c| c.info.host_pid)
            .collect()
    }

    /// The driver holds client `id`'s process checkpointed, though this scheduler did
    /// not put it there: a daemon restarted after the one that did was killed before
    /// restoring it, and learns so when the client comes back. It is restored as any
    /// other: before its next grant, or once the GPU can take its memory back (at
    /// once if it was granted the GPU meanwhile: its calls wait in the driver).
    pub fn found_checkpointed(&mut self, now: Nanos, id: ClientId) -> Vec<Output> {
        let holds = self.holders.contains_key(&id);
        if let Some(c) = self.clients.get_mut(&id) {
            if matches!(c.ckpt, Ckpt::None | Ckpt::Wanted | Ckpt::Refused) {
                // Its shim may not know (the notice died with the arbiter before):
                // it puts off what would wait in the driver.
                if c.info.notices {
                    let notice = ArbiterMsg::Checkpointed { restored: false };
                    self.out.push(Output::Send(id, notice));
                }
                c.reclaim_pending = 0;
                c.reclaim_sent = None;
                c.ckpt = if holds {
                    let pid = c.info.host_pid;
                    self.out.push(Output::Restore { id, pid });
                    Ckpt::Restoring
                } else {
                    Ckpt::Checkpointed
                };
            }
        }
        self.finish(now)
    }

    /// The driver runs client `id`'s process, which came back after a restart: its
    /// shim is told so, in case the arbiter before died between a restore and its
    /// notice.
    pub fn found_running(&mut self, now: Nanos, id: ClientId) -> Vec<Output> {
        if self.clients.get(&id).is_some_and(|c| c.info.notices) {
            let notice = ArbiterMsg::Checkpointed { restored: true };
            self.out.push(Output::Send(id, notice));
        }
        self.finish(now)
    }

    /// The daemon's checkpoint of client `id` ended: `Ok` with its duration, or why
    /// not.
    pub fn checkpoint_done(
        &mut self,
        now: Nanos,
        id: ClientId,
        outcome: Result<u64, CheckpointFailure>,
    ) -> Vec<Output> {
        self.job_done(now, id, Ckpt::Checkpointing, outcome)
    }

    /// The daemon's restore of client `id` ended: `Ok` with its duration (the client
    /// may be granted now), or why not (tried again after [`RETRY_NS`]).
    pub fn restore_done(
        &mut self,
        now: Nanos,
        id: ClientId,
        outcome: Result<u64, CheckpointFailure>,
    ) -> Vec<Output> {
        self.job_done(now, id, Ckpt::Restoring, outcome)
    }

    /// The daemon's `job` on client `id` (`Checkpointing` or `Restoring`) ended. The
    /// outcome is stale, and ignored, when the client is gone or its state moved on.
    fn job_done(
        &mut self,
        now: Nanos,
        id: ClientId,
        job: Ckpt,
        outcome: Result<u64, CheckpointFailure>,
    ) -> Vec<Output> {
        let Some(c) = self.clients.get_mut(&id) else {
            return Vec::new();
        };
        if c.ckpt != job {
            return self.finish(now);
        }
        let restored = job == Ckpt::Restoring;
        let bytes = c.unswappable;
        let kind = match outcome {
            Ok(duration_ns) => {
                if c.info.notices {
                    self.out
                        .push(Output::Send(id, ArbiterMsg::Checkpointed { restored }));
                }
                if restored {
                    c.ckpt = Ckpt::None;
                    c.ckpt_failed_at = None;
                    EventKind::Restore { bytes, duration_ns }
                } else {
                    c.ckpt = Ckpt::Checkpointed;
                    // Whatever it did not reclaim went with its process.
                    c.reclaim_pending = 0;
                    c.reclaim_sent = None;
                    EventKind::Checkpoint { bytes, duration_ns }
                }
            }
            Err(f) => {
                c.ckpt = match job {
                    Ckpt::Restoring => Ckpt::Checkpointed,
                    _ if f.permanent => Ckpt::Refused,
                    _ => Ckpt::None,
                };
                c.ckpt_failed_at = Some(now);
                self.log(Some(id), EventKind::CheckpointSkipped { reason: f.reason });
                // No room for a restore yet (others' memory is resident): the clients
                // that do not hold the GPU give it.
                if restored && !f.permanent {
                    let need = bytes.saturating_sub(self.freeing());
                    let _ = self.reclaim_bytes(now, id, need);
                }
                return self.finish(now);
            }
        };
        self.log(Some(id), kind);
        self.finish(now)
    }
}
