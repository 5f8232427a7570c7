//! One GPU's part in gang turns (issue #41): a job whose clients span several GPUs
//! (the ranks of a DDP job, one process with contexts on two GPUs) has kernels that
//! wait for each other across GPUs, so its GPUs are granted together
//! ([`crate::gang`] decides whom, for the whole node). Here each GPU keeps:
//!
//! - each client's group ([`GpuScheduler::set_gang`]), set only while its group
//!   spans two GPUs or more: a member waits for its group's turn, never for a grant
//!   of its own;
//! - a [`Reserve`]: `Claimed(g)` (group `g` waits for its turn: nobody is granted
//!   here, and a holder outside `g` is asked to drop at its quantum's end, as if
//!   someone waited), `Running(g)` (`g`'s turn: only its members are granted);
//! - whether a group waits for this GPU while another group has it
//!   ([`GpuScheduler::set_gang_wanted`]): its holder's quantum then ends as if
//!   someone waited here, so the waiting group's turn comes.
//!
//! A GPU where a member runs beside anyone else is taken in turns even when the
//! working sets fit ([`GpuScheduler::takes_turns`]): shared, the member's
//! collectives spin whenever a peer's GPU is busy with someone else. Where nobody
//! else runs (the job alone on its GPUs), or the scheduler is off, reservations
//! change nothing: every request is granted at once.

use super::*;

/// A claimed GPU is filled by a client outside any group only while the group's wait
/// for its other GPUs leaves at least a quantum over this (a shorter turn would be
/// mostly its swaps).
const MIN_BACKFILL_TQS: u64 = 2;

/// A group of clients granted together, numbered by [`crate::gang::Gangs`].
pub type GangId = u64;

/// Whom a GPU's exclusive turns belong to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Reserve {
    /// Round-robin among clients outside any group.
    #[default]
    Free,
    /// Held for a group whose turn has not started: nobody is granted.
    Claimed(GangId),
    /// The group's turn: only its members are granted.
    Running(GangId),
}

impl GpuScheduler {
    pub(super) fn gang_of(&self, id: ClientId) -> Option<GangId> {
        self.clients.get(&id).and_then(|c| c.gang)
    }

    /// Who may be granted next: the first in line that the reservation allows. On a
    /// GPU a group claims, nobody, except that a client outside any group may fill
    /// it while the group waits for its other GPUs, when that wait (the claim's
    /// alignment) leaves it at least [`MIN_BACKFILL_TQS`] of a quantum: it is then
    /// dropped when the wait ends ([`GpuScheduler::drop_due`]).
    pub(super) fn next_in_line(&self, now: Nanos) -> Option<ClientId> {
        let want = match self.reserve {
            Reserve::Claimed(_) => {
                let room = self.claim_aligned.map_or(0, |t| t.saturating_sub(now));
                if room < self.tq_ns() / MIN_BACKFILL_TQS || !self.holders.is_empty() {
                    return None;
                }
                None
            }
            Reserve::Free => None,
            Reserve::Running(g) => Some(g),
        };
        self.queue
            .iter()
            .copied()
            .find(|&id| self.gang_of(id) == want)
    }

    /// Whose needs a dropped holder is told to make room for: a claiming group's
    /// first waiting member, else the first in line.
    pub(super) fn next_for_need(&self) -> Option<ClientId> {
        if let Reserve::Claimed(g) | Reserve::Running(g) = self.reserve {
            if let Some(id) = self
                .queue
                .iter()
                .copied()
                .find(|&id| self.gang_of(id) == Some(g))
            {
                return Some(id);
            }
        }
        self.queue.front().copied()
    }

    /// Someone waits for the GPU: a client in line, a group that claimed it beside
    /// a holder of another, or a group that wants it while another group has it.
    /// A holder's quantum ends (a drop) only then.
    pub(super) fn contended_now(&self) -> bool {
        if !self.queue.is_empty() {
            return true;
        }
        match self.reserve {
            Reserve::Claimed(g) => self.holders.keys().any(|&id| self.gang_of(id) != Some(g)),
            _ => self.gang_wanted,
        }
    }

    /// Whether `next` could be granted now, nobody holding: the post-restart quiet
    /// window, a checkpointed process's restore (started here when due), and a
    /// drainer's swap-out beside which only a pipelined swap-in starts.
    pub(super) fn grantable(&mut self, now: Nanos, next: ClientId) -> bool {
        if self.resume.quiet_until().is_some_and(|q| now < q) {
            return false;
        }
        if !self.ready_for_grant(now, next) {
            return false;
        }
        // A swap-out is still under way (its client drained): only a client that takes
        // part in pipelined hand-offs and has memory to swap in starts that swap-in
        // beside it, and beside one swap-out at most. Others wait for the release, as
        // before: one with nothing swapped out would open its gate at once and its new
        // allocations and module loads meet a GPU still full of the drainer's memory.
        self.draining.is_empty()
            || (self.draining.len() == 1
                && !self.draining.contains_key(&next)
                && self.clients.get(&next).is_some_and(|c| {
                    c.info.pipelined && c.usage.working_set_bytes > c.usage.resident_bytes
                }))
    }

    /// Whether this GPU is reserved for the turn of group `gang` (claimed, running or
    /// ending): its idle members are not evicted meanwhile.
    pub(super) fn in_group_turn(&self, gang: Option<GangId>) -> bool {
        match (self.reserve, gang) {
            (Reserve::Claimed(r) | Reserve::Running(r), Some(g)) => r == g,
            _ => false,
        }
    }

    /// When holder `id`'s quantum ends for the purpose of a drop: its own end, or,
    /// while a group claims the GPU and `id` is outside it, no sooner than the
    /// claim's alignment.
    /// A holder that filled a claimed GPU ([`GpuScheduler::next_in_line`]) is due at
    /// the alignment, or at once when there is none any more (the group's other
    /// GPUs are ready).
    pub(super) fn drop_due(&self, id: ClientId, h: &Hold) -> Nanos {
        let end = self.quantum_end(h);
        match (self.reserve, self.claim_aligned) {
            (Reserve::Claimed(_), Some(t)) if h.backfill => end.min(t),
            (Reserve::Claimed(_), None) if h.backfill => h.since,
            (Reserve::Claimed(g), Some(t)) if self.gang_of(id) != Some(g) => end.max(t),
            _ => end,
        }
    }

    // ---- what the node's gang coordinator asks and sets ----------------------

    /// When the last holder outside group `g` here reaches its quantum's end (none
    /// asked to drop yet); `None`: none holds, or one is already handing over.
    pub fn outsider_quantum_end(&self, g: GangId) -> Option<Nanos> {
        let mut out = None;
        for (&id, h) in &self.holders {
            // A holder filling the claimed GPU ends with the others, not after them.
            if self.gang_of(id) == Some(g) || !h.exclusive || h.backfill {
                continue;
            }
            if h.drop_sent.is_some() {
                return None;
            }
            out = out.max(Some(self.quantum_end(h)));
        }
        out
    }

    /// A group claims all its GPUs and the holders outside it there reach their
    /// quanta's ends at different times: none is dropped before `t`, the latest, so
    /// that no GPU of the group idles while it waits for another (the group's turn
    /// could not start before anyway). `None`: each at its own end.
    pub fn set_claim_aligned(&mut self, now: Nanos, t: Option<Nanos>) -> Vec<Output> {
        if self.claim_aligned == t {
            return Vec::new();
        }
        self.claim_aligned = t;
        self.finish(now)
    }

    /// Client `id` belongs to group `gang` (`None`: to none that spans GPUs).
    pub fn set_gang(&mut self, now: Nanos, id: ClientId, gang: Option<GangId>) -> Vec<Output> {
        match self.clients.get_mut(&id) {
            Some(c) if c.gang != gang => c.gang = gang,
            _ => return Vec::new(),
        }
        self.finish(now)
    }

    pub fn reserve(&self) -> Reserve {
        self.reserve
    }

    /// Sets whom the GPU's turns belong to. Starting a group's turn
    /// (`Running`) grants its first waiting member here and starts the quantum of a
    /// member that already holds: the group's quantum starts on all its GPUs at once.
    pub fn set_reserve(&mut self, now: Nanos, reserve: Reserve) -> Vec<Output> {
        if self.reserve == reserve {
            return Vec::new();
        }
        self.reserve = reserve;
        if let Reserve::Running(g) = reserve {
            let members: Vec<ClientId> = self
                .holders
                .keys()
                .copied()
                .filter(|&id| self.gang_of(id) == Some(g))
                .collect();
            for id in members {
                let start = self
                    .clients
                    .get(&id)
                    .and_then(|c| Self::quantum_start(c, now));
                if let Some(h) = self.holders.get_mut(&id) {
                    if h.drop_sent.is_none() {
                        h.quantum_from = start;
                        h.since = now;
                    }
                }
            }
        }
        self.finish(now)
    }

    /// A group waits for this GPU while another group has it.
    pub fn set_gang_wanted(&mut self, now: Nanos, wanted: bool) -> Vec<Output> {
        if self.gang_wanted == wanted {
            return Vec::new();
        }
        self.gang_wanted = wanted;
        self.finish(now)
    }

    /// Since when a member of group `g` waits here for a turn (`None`: none waits,
    /// or the GPU runs shared and grants at once).
    pub fn gang_waits(&self, g: GangId) -> Option<Nanos> {
        if self.shared_mode() {
            return None;
        }
        self.queue
            .iter()
            .filter_map(|id| self.clients.get(id))
            .filter(|c| c.gang == Some(g))
            .filter_map(|c| c.requested_at)
            .min()
    }

    /// Since when the longest-waiting client outside any group waits here (`None`:
    /// none waits, or the GPU runs shared).
    pub fn first_outsider_wait(&self) -> Option<Nanos> {
        if self.shared_mode() {
            return None;
        }
        self.queue
            .iter()
            .filter_map(|id| self.clients.get(id))
            .filter(|c| c.gang.is_none())
            .filter_map(|c| c.requested_at)
            .min()
    }

    /// Someone outside group `g` waits here for a turn (a client in line, or
    /// another group's member), the GPU taken in turns.
    pub fn others_wait(&self, g: GangId) -> bool {
        !self.shared_mode() && self.queue.iter().any(|&id| self.gang_of(id) != Some(g))
    }

    /// Group `g`'s turn could start here now: nobody outside it holds, and its first
    /// waiting member (if any) could be granted at once. Also starts the restore of a
    /// checkpointed member (its outputs are returned).
    pub fn gang_ready(&mut self, now: Nanos, g: GangId) -> (bool, Vec<Output>) {
        if self.shared_mode() {
            return (true, Vec::new());
        }
        if self.holders.keys().any(|&id| self.gang_of(id) != Some(g)) {
            return (false, Vec::new());
        }
        let member_holds = !self.holders.is_empty();
        let first = self
            .queue
            .iter()
            .copied()
            .find(|&id| self.gang_of(id) == Some(g));
        let ready = match first {
            Some(id) if !member_holds => self.grantable(now, id),
            _ => true,
        };
        (ready, std::mem::take(&mut self.out))
    }

    /// A member of group `g` holds the GPU here for itself, or gives it back
    /// (swapping out). A shared grant does not count: a GPU whose working sets fit
    /// keeps no group from ending its turn.
    pub fn gang_holds(&self, g: GangId) -> bool {
        self.holders
            .iter()
            .filter(|(_, h)| h.exclusive)
            .chain(self.draining.iter())
            .any(|(&id, _)| self.gang_of(id) == Some(g))
    }

    /// A member of group `g` holding here was asked to drop (its quantum ended, the
    /// GPU no longer fits): the whole group's turn ends. An early release is no drop.
    pub fn gang_dropped(&self, g: GangId) -> Option<DropReason> {
        let dropped = self
            .holders
            .iter()
            .chain(self.draining.iter())
            .any(|(&id, h)| {
                self.gang_of(id) == Some(g) && h.exclusive && h.drop_sent.is_some() && !h.early
            });
        dropped.then_some(DropReason::TqExpired)
    }

    /// Ends group `g`'s turn here: each of its holders not yet asked is asked to drop.
    pub fn drop_gang(&mut self, now: Nanos, g: GangId, reason: DropReason) -> Vec<Output> {
        let ids: Vec<ClientId> = self
            .holders
            .iter()
            .filter(|(&id, h)| self.gang_of(id) == Some(g) && h.exclusive && h.drop_sent.is_none())
            .map(|(&id, _)| id)
            .collect();
        if ids.is_empty() {
            return Vec::new();
        }
        for id in ids {
            self.drop_holder(now, id, reason);
        }
        self.finish(now)
    }
}
