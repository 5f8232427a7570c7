//! Making room: reclaims from clients that do not hold the GPU, for the next holder
//! (at a hand-off), for an exclusive holder short of room or growing within its
//! turn, and for a holder's `no_room` (memory the scheduler cannot see, learned into
//! the ledger); and what is already on its way out of GPU memory.

use super::*;

/// What the driver may show free while an allocation of a holder's still fails
/// (granularity, fragmentation, the driver's own bookkeeping): beyond it, free memory
/// contradicts a `no_room`.
pub const NO_ROOM_SLACK: u64 = 256 << 20;

/// The most a holder's growth is reclaimed ahead of it at once: 1/16 of the GPU
/// ([`GpuScheduler::growth_ask`]; 5 GiB of an 80 GB GPU, about 0.2 s of PCIe).
pub const GROWTH_AHEAD_DIVISOR: u64 = 16;

impl GpuScheduler {
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
        let used = used().map(|u| u.min(self.ledger.total()));
        if let Some(used) = used {
            let free = (self.ledger.total() - used).saturating_sub(NO_ROOM_SLACK);
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
                        .saturating_sub(self.ledger.unseen())
                        .saturating_sub(self.ledger.outside_kiwi());
                    believed_free.min(outside)
                }
                None => believed_free,
            };
            self.ledger.learn_unseen(now, learn);
        }
        if missing == 0 {
            return Vec::new();
        }
        self.log(
            Some(id),
            EventKind::NoRoom {
                missing_bytes: missing,
                unseen_bytes: self.ledger.unseen(),
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

    pub(super) fn freeing(&self) -> u64 {
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
    pub(super) fn reclaim_for(&mut self, now: Nanos, next: ClientId) {
        let need = self.need_for(next).saturating_sub(self.freeing());
        let _ = self.reclaim_bytes(now, next, need);
    }

    /// Reclaims `need` bytes from clients other than `next` (none of them holding or
    /// draining), least recently active first, less what each was already asked;
    /// returns what none of them has resident to give.
    pub(super) fn reclaim_bytes(&mut self, now: Nanos, next: ClientId, mut need: u64) -> u64 {
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

    /// An exclusive holder that is not all resident found no room to swap in (the
    /// memory of others is still there): make room for what it lacks.
    pub(super) fn make_room_for_holder(&mut self, now: Nanos) {
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
        let cap = self.ledger.total() / GROWTH_AHEAD_DIVISOR;
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
}
