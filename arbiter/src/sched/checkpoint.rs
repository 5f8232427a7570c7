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
        let coming: u64 = self
            .clients
            .values()
            .filter(|c| matches!(c.ckpt, Ckpt::Wanted | Ckpt::Checkpointing))
            .map(|c| c.unswappable)
            .fold(0, u64::saturating_add);
        let mut need = short.saturating_sub(coming);
        if need == 0 {
            return;
        }
        let front = self.queue.front().copied();
        // Idle clients first, then waiters (whose turn, and restore, comes sooner);
        // least recently heard from first.
        let mut victims: Vec<(bool, Nanos, ClientId)> = self
            .clients
            .iter()
            .filter(|(&id, c)| {
                id != holder
                    && Some(id) != front
                    && !self.holders.contains_key(&id)
                    && !self.draining.contains_key(&id)
                    && c.ckpt == Ckpt::None
                    && c.unswappable > 0
                    && now >= Self::retry_due(c)
                    && now >= c.last_seen.saturating_add(CHECKPOINT_IDLE_NS)
            })
            .map(|(&id, c)| (c.requested_at.is_some(), c.last_seen, id))
            .collect();
        victims.sort();
        for (_, _, id) in victims {
            if need == 0 {
                break;
            }
            let Some(c) = self.clients.get_mut(&id) else {
                continue;
            };
            c.ckpt = Ckpt::Wanted;
            need = need.saturating_sub(c.unswappable);
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
    }

    /// Starts the checkpoints of chosen clients whose reclaim was answered.
    pub(super) fn start_checkpoints(&mut self, _now: Nanos) {
        let ready: Vec<ClientId> = self
            .clients
            .iter()
            .filter(|(_, c)| c.ckpt == Ckpt::Wanted && c.reclaim_pending == 0)
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
        self.total
            .saturating_sub(self.fixed())
            .saturating_sub(self.resident())
    }

    /// Checkpointed clients the idle GPU can take back, least recently active first,
    /// as long as each fits (`now`: only those whose retry pause is over).
    fn restorable_when_idle(&self, now: Option<Nanos>) -> Vec<ClientId> {
        let mut free = self.free_by_count();
        let mut ids: Vec<(Nanos, ClientId)> = self
            .clients
            .iter()
            .filter(|(_, c)| c.ckpt == Ckpt::Checkpointed)
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
    /// [`RESTORE_WHEN_IDLE_NS`].
    pub(super) fn restore_when_idle(&mut self, now: Nanos) {
        if !(self.holders.is_empty() && self.draining.is_empty() && self.queue.is_empty()) {
            self.idle_since = None;
            return;
        }
        let since = *self.idle_since.get_or_insert(now);
        if now < since.saturating_add(RESTORE_WHEN_IDLE_NS) {
            return;
        }
        for id in self.restorable_when_idle(Some(now)) {
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
            for id in self.restorable_when_idle(None) {
                let due = Self::retry_due(&self.clients[&id]);
                at(due.max(since.saturating_add(RESTORE_WHEN_IDLE_NS)));
            }
        }
        if let Some(c) = self.queue.front().and_then(|id| self.clients.get(id)) {
            if c.ckpt == Ckpt::Checkpointed && c.ckpt_failed_at.is_some() {
                at(Self::retry_due(c));
            }
        }
        d
    }

    /// What client `id`, in its turn, cannot have because no checkpoint takes it off
    /// the GPU: the memory no swap frees of the clients the driver refused.
    pub(super) fn unmovable_besides(&self, id: ClientId) -> u64 {
        self.clients
            .iter()
            .filter(|(&other, c)| other != id && c.ckpt == Ckpt::Refused)
            .map(|(_, c)| c.unswappable)
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

    /// The daemon's checkpoint of client `id` ended: `Ok` with its duration, or why
    /// not.
    pub fn checkpoint_done(
        &mut self,
        now: Nanos,
        id: ClientId,
        outcome: Result<u64, CheckpointFailure>,
    ) -> Vec<Output> {
        let Some(c) = self.clients.get_mut(&id) else {
            return Vec::new();
        };
        if c.ckpt != Ckpt::Checkpointing {
            return self.finish(now);
        }
        let kind = match outcome {
            Ok(duration_ns) => {
                c.ckpt = Ckpt::Checkpointed;
                EventKind::Checkpoint {
                    bytes: c.unswappable,
                    duration_ns,
                }
            }
            Err(f) => {
                c.ckpt = if f.permanent {
                    Ckpt::Refused
                } else {
                    Ckpt::None
                };
                c.ckpt_failed_at = Some(now);
                EventKind::CheckpointSkipped { reason: f.reason }
            }
        };
        self.log(Some(id), kind);
        self.finish(now)
    }

    /// The daemon's restore of client `id` ended: `Ok` with its duration (the client
    /// may be granted now), or why not (tried again after [`RETRY_NS`]).
    pub fn restore_done(
        &mut self,
        now: Nanos,
        id: ClientId,
        outcome: Result<u64, CheckpointFailure>,
    ) -> Vec<Output> {
        let Some(c) = self.clients.get_mut(&id) else {
            return Vec::new();
        };
        if c.ckpt != Ckpt::Restoring {
            return self.finish(now);
        }
        let kind = match outcome {
            Ok(duration_ns) => {
                c.ckpt = Ckpt::None;
                c.ckpt_failed_at = None;
                EventKind::Restore {
                    bytes: c.unswappable,
                    duration_ns,
                }
            }
            Err(f) => {
                c.ckpt = Ckpt::Checkpointed;
                c.ckpt_failed_at = Some(now);
                let need = c.unswappable;
                self.log(Some(id), EventKind::CheckpointSkipped { reason: f.reason });
                // No room for it yet (others' memory is resident): the clients that
                // do not hold the GPU give it.
                if !f.permanent {
                    let need = need.saturating_sub(self.freeing());
                    let _ = self.reclaim_bytes(now, id, need);
                }
                return self.finish(now);
            }
        };
        self.log(Some(id), kind);
        self.finish(now)
    }
}
