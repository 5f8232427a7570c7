//! What the scheduler shows: `kiwictl status`'s snapshot, a tenant's view of the GPU
//! (issue #39), and where a client stands for the swap pool's disk tier.

use super::checkpoint::Ckpt;
use super::*;

impl GpuScheduler {
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
            total_memory_bytes: self.ledger.total(),
            capacity_bytes: self.ledger.capacity(),
            fits: self.fits(),
            holders: self.holders(),
            queue,
            clients,
            group_turn: None,
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
            self.fixed().saturating_sub(self.ledger.unseen())
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

    /// Where client `id` stands for the swap pool's disk tier, which takes the
    /// processes idle longest first: `None` while it holds the GPU, while its process
    /// is chosen for, under or back from a checkpoint (its calls may wait in the
    /// driver: a spill would wait there holding its shim's allocator), or when it is
    /// not registered here; else whether it waits for it and its last activity.
    pub fn activity(&self, id: ClientId) -> Option<(bool, Nanos)> {
        let c = self.clients.get(&id)?;
        if self.holders.contains_key(&id) || !matches!(c.ckpt, Ckpt::None | Ckpt::Refused) {
            return None;
        }
        Some((c.requested_at.is_some(), c.last_seen))
    }
}
