//! Idle eviction (`idle_evict`): on an oversubscribed GPU, a client that neither
//! holds nor waits, has memory resident and has sent nothing for the idle time is
//! asked to reclaim all of it, one at a time, only while the PCIe link is free of
//! hand-offs.

use super::*;

impl GpuScheduler {
    /// When the PCIe link is free for idle eviction: after the unanswered reclaims
    /// are a grace period old. `None`: a hand-off is under way (a drop outstanding,
    /// someone draining), which only a message or the grace timer ends.
    pub(super) fn link_free_at(&self) -> Option<Nanos> {
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
    pub(super) fn idle_candidate(&self) -> Option<(Nanos, ClientId)> {
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
    pub(super) fn idle_evict(&mut self, now: Nanos) {
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
}
