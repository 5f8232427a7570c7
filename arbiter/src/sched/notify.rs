//! What the scheduler tells clients unasked, each only when it changed since it was
//! last told ([`Told`]): `pressure` to `pipelined` clients, `contended` to holders,
//! `waiting` to waiters that asked, `room` to `room_info` clients (at most every
//! [`STATE_INTERVAL_NS`] for `pressure` and `room`), and new settings to everyone.

use super::*;

/// What a `room_info` client is told in [`ArbiterMsg::Room`]: the others' memory no
/// swap frees, and the working set it must leave room for.
pub(super) type RoomView = (u64, Option<Keep>);

/// What a waiter hears in [`ArbiterMsg::Waiting`]: the holder shown, how many others
/// hold, its place in the queue, when the holder's quantum ends (absolute).
pub(super) type WaitView = (Option<ClientId>, u32, u32, Option<Nanos>);

type WaitersSeen = (
    usize,
    Option<ClientId>,
    Option<ClientId>,
    Option<ClientId>,
    usize,
    Option<Nanos>,
);

/// What clients were last told of the GPU's state: a notice goes only when the state
/// differs from it (and `pressure` at most every [`STATE_INTERVAL_NS`]).
#[derive(Debug, Clone, Default)]
pub(super) struct Told {
    /// What `pipelined` clients were last told: the GPU is oversubscribed.
    pressure: bool,
    /// When that was broadcast ([`STATE_INTERVAL_NS`] apart at least).
    pressure_sent: Option<Nanos>,
    /// The GPU was last told shared (more than one client, `pressure`).
    shared: bool,
    /// What holders were last told: someone waits, and the bytes the next one needs.
    contended: bool,
    contended_need: u64,
    /// The queue and holders as waiters were last told about them (queue length,
    /// first, last, shown holder, holders, quantum end): unchanged, nobody's
    /// [`ArbiterMsg::Waiting`] can have changed, and the pass over the queue is skipped.
    waiters_seen: Option<WaitersSeen>,
}

impl Told {
    /// What `pipelined` clients were last told: (oversubscribed, shared).
    pub(super) fn pressure(&self) -> (bool, bool) {
        (self.pressure, self.shared)
    }

    /// A grant told its holder whether someone waits, and the bytes the next one
    /// needs.
    pub(super) fn set_contention(&mut self, contended: bool, need: u64) {
        self.contended = contended;
        self.contended_need = need;
    }
}

impl GpuScheduler {
    /// When the next `pressure` broadcast may go ([`STATE_INTERVAL_NS`] after
    /// the last); `None`: at once.
    pub(super) fn pressure_due(&self) -> Option<Nanos> {
        self.told
            .pressure_sent
            .map(|t| t.saturating_add(STATE_INTERVAL_NS))
    }

    /// Tells `pipelined` clients when the GPU starts or stops being oversubscribed.
    pub(super) fn notify_pressure(&mut self, now: Nanos) {
        let (over, shared) = (self.oversubscribed(), self.shared_now());
        if (over, shared) == (self.told.pressure, self.told.shared)
            || self.pressure_due().is_some_and(|due| now < due)
        {
            return;
        }
        self.told.pressure = over;
        self.told.shared = shared;
        self.told.pressure_sent = Some(now);
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

    pub(super) fn broadcast_settings(&mut self) {
        let ids: Vec<_> = self.clients.keys().copied().collect();
        for id in ids {
            self.send(id, ArbiterMsg::Settings(self.settings));
        }
    }

    /// What `room_info` client `id` is to be told: the memory no swap frees that the
    /// other clients report, and the largest other working set that must stay
    /// possible beside it (`None`: not such a client).
    pub(super) fn room_for(&self, id: ClientId) -> Option<RoomView> {
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
        let fixed = self.fixed().saturating_sub(self.ledger.unseen());
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
    pub(super) fn room_changes(&self) -> Vec<(ClientId, RoomView)> {
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
    pub(super) fn room_due(&self, id: ClientId) -> Option<Nanos> {
        self.clients
            .get(&id)?
            .room_sent
            .map(|t| t.saturating_add(STATE_INTERVAL_NS))
    }

    /// Tells `room_info` clients the memory no swap frees that the other clients
    /// report, when it changed since they were last told: at most every
    /// [`STATE_INTERVAL_NS`] each, but `now` for `urgent` (a client that asked).
    pub(super) fn notify_room(&mut self, now: Nanos, urgent: Option<ClientId>) {
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

    /// Tells holders when someone starts (or stops) waiting, with what the next
    /// holder needs, so an idle holder can release early and evict just that.
    pub(super) fn notify_contention(&mut self) {
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
        if contended == self.told.contended && need == self.told.contended_need {
            return;
        }
        self.told.contended = contended;
        self.told.contended_need = need;
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
    pub(super) fn notify_waiters(&mut self, now: Nanos) {
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
        if self.told.waiters_seen == Some(seen) {
            return;
        }
        self.told.waiters_seen = Some(seen);
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
}
