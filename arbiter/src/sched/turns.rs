//! Turns: who holds the GPU, who waits for it, and who gives it back.
//!
//! The queue (FIFO), the holders (one when exclusive) and the drainers (dropped
//! `pipelined` holders that said `drained`, their release still to come) are the
//! scheduler's own fields; this part moves clients between them: requests and
//! releases, grants and hand-offs, drops at the quantum's end or when the GPU no
//! longer fits, revocations past the grace (plus a drainer's swap allowance), and
//! the pipelined hand-off.

use super::*;

/// How slow a swap-out may be before its drainer loses its turn: 1 ns a byte, 1 GB/s.
/// A first swap-out page-locks its host buffers as it copies; on an H100 (driver 580)
/// 18 GiB of them ran at 1.1–2.0 GB/s and took up to 17 s, where a grace of 5 s
/// revoked turns that were making progress (docs/gpu-validation.md). Revoking a
/// drainer frees nothing anyway: the next holder is already granted, and the
/// drainer's memory is only freed by its swap-out.
pub const SLOWEST_SWAP_OUT_NS_PER_BYTE: u64 = 1;

impl Hold {
    /// A hold granted at `since`, its quantum running from `quantum_from`: not asked
    /// to let go, nothing learned, reclaimed or allowed yet.
    pub(super) fn granted(
        since: Nanos,
        exclusive: bool,
        quantum_from: Option<Nanos>,
        backfill: bool,
    ) -> Self {
        Self {
            since,
            exclusive,
            drop_sent: None,
            drop_need: 0,
            early: false,
            quantum_from,
            learned: false,
            swap_allowance: 0,
            grown: 0,
            backfill,
        }
    }
}

impl GpuScheduler {
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

    /// The client wants the GPU.
    pub fn request(&mut self, now: Nanos, id: ClientId) -> Vec<Output> {
        if !self.clients.contains_key(&id) {
            return Vec::new();
        }
        if let Some(h) = self.holders.get(&id) {
            // Already holding (e.g. a client that lost track after a reconnect):
            // confirm idempotently.
            let exclusive = h.exclusive;
            self.send_grant(id, exclusive, false);
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
            .min(self.ledger.total())
            .saturating_mul(SLOWEST_SWAP_OUT_NS_PER_BYTE);
        self.draining.insert(id, h);
        self.finish(now)
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

    pub(super) fn tq_ns(&self) -> u64 {
        ms_to_ns(self.settings.tq_ms)
    }

    /// When a holder's quantum starts, granted at `now`: at once, unless it is a
    /// `pipelined` client (one that reports its swaps) with memory to swap in.
    pub(super) fn quantum_start(c: &Client, now: Nanos) -> Option<Nanos> {
        let resident = c.usage.resident_bytes >= c.usage.working_set_bytes;
        (resident || !c.info.pipelined).then_some(now)
    }

    /// When holder `h`'s quantum ends. One still swapping in has until the grant plus
    /// the longer of the TQ and the grace period to report its memory resident, then
    /// a whole TQ of work: so a holder holds at most that plus a TQ, whatever it
    /// reports.
    pub(super) fn quantum_end(&self, h: &Hold) -> Nanos {
        match h.quantum_from {
            Some(q) => q.saturating_add(self.tq_ns()),
            None => h.since.saturating_add(self.tq_ns().max(self.grace_ns)),
        }
    }

    /// `id` reported its memory resident (a swap-in, or usage): a holder whose quantum
    /// waited for that starts it now, if that is before its wait ran out.
    pub(super) fn resident_now(&mut self, now: Nanos, id: ClientId) {
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
        self.resume.granted();
        let quantum_from = Self::quantum_start(c, now);
        let backfill = matches!(self.reserve, Reserve::Claimed(_));
        self.holders
            .insert(id, Hold::granted(now, exclusive, quantum_from, backfill));
        c.revoked = false;
        self.log(
            Some(id),
            EventKind::Grant {
                exclusive,
                waited_ns: waited,
            },
        );
        self.send_grant(id, exclusive, pipelined);
        let contended = exclusive && !self.queue.is_empty();
        let need = if contended {
            self.queue.front().map_or(0, |&n| self.need_for(n))
        } else {
            0
        };
        self.told.set_contention(contended, need);
    }

    /// Tells holder `id` its grant (again, to one that asks while holding), with how
    /// many wait after it.
    fn send_grant(&mut self, id: ClientId, exclusive: bool, pipelined: bool) {
        let waiting = self.queue.len() as u32;
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

    pub(super) fn schedule(&mut self, now: Nanos) {
        self.settle_mode(now);
        self.resume.settle(now);
        self.ledger.forget_unseen(now);
        // Grace: a drainer whose release does not come in the grace plus the time its
        // swap-out may take loses the GPU like a holder.
        self.revoke_expired(now, |s| &mut s.draining);
        if self.shared_mode() {
            // Everyone fits (or no arbitration): grant every waiter, shared — except
            // just after a restart, while a holder the arbiter cannot see yet may
            // still be coming back.
            if self.resume.quiet_until().is_none() {
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
                if self.holders[&id].drop_sent.is_some() {
                    continue;
                }
                let resident = self.clients.get(&id).map_or(0, |c| c.usage.resident_bytes);
                let need = resident.min(overflow);
                overflow -= need;
                self.ask_to_drop(now, id, need, DropReason::NoLongerFits);
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
        self.revoke_expired(now, |s| &mut s.holders);

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
    pub(super) fn drop_holder(&mut self, now: Nanos, id: ClientId, reason: DropReason) {
        let need = self.next_for_need().map_or(0, |n| self.need_for(n));
        self.ask_to_drop(now, id, need, reason);
    }

    /// Drops holder `id`, asking it to free `need` bytes: the grace runs from `now`.
    fn ask_to_drop(&mut self, now: Nanos, id: ClientId, need: u64, reason: DropReason) {
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
    pub(super) fn grace_end(&self, h: &Hold) -> Option<Nanos> {
        let sent = h.drop_sent?;
        Some(
            sent.saturating_add(self.grace_ns)
                .saturating_add(h.swap_allowance),
        )
    }

    /// Takes the GPU from every hold in `holds` (the holders, or the drainers) whose
    /// grace ended by `now`, in client order.
    fn revoke_expired(
        &mut self,
        now: Nanos,
        holds: fn(&mut Self) -> &mut BTreeMap<ClientId, Hold>,
    ) {
        let (expired, kept): (BTreeMap<_, _>, BTreeMap<_, _>) = std::mem::take(holds(self))
            .into_iter()
            .partition(|(_, h)| self.grace_end(h).is_some_and(|end| now >= end));
        *holds(self) = kept;
        for (id, h) in expired {
            self.revoke(now, id, h);
        }
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
}
