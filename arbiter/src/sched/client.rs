//! A client of this GPU: its identity and labels ([`ClientInfo`], fixed at
//! registration), and the inputs that add and remove it: registration (with a
//! resumed holder's claim after an arbiter restart, see `resume.rs`) and exit.

use super::*;

/// Identity and labels of a client, fixed at registration.
#[derive(Debug, Clone, Default)]
pub struct ClientInfo {
    pub pid: u32,
    pub host_pid: u32,
    pub name: Option<String>,
    pub container_id: Option<String>,
    pub pod_name: Option<String>,
    pub pod_namespace: Option<String>,
    /// It asked to be told why it waits ([`ArbiterMsg::Waiting`]).
    pub wait_info: bool,
    /// Its GPU memory that no swap frees, as registered (`None`: it does not report).
    pub unswappable: Option<u64>,
    /// It takes part in pipelined hand-offs (`drained`, `grant {pipelined}`,
    /// `pressure`).
    pub pipelined: bool,
    /// It asked for [`ArbiterMsg::Room`].
    pub room_info: bool,
    /// It takes [`ArbiterMsg::Checkpointed`] (it registered with `bounds`).
    pub notices: bool,
    /// Whose connection it came on: its container socket's, or its uid's on the
    /// node's socket (set by the server). Evictions made on its behalf are counted
    /// per tenant ([`checkpoint::TENANT_EVICTIONS`]).
    pub tenant: Option<String>,
}

impl ClientInfo {
    pub fn from_register(r: &Register, host_pid: u32) -> Self {
        Self {
            pid: r.pid,
            host_pid,
            name: r.name.clone(),
            container_id: r.container_id.clone(),
            pod_name: r.pod_name.clone(),
            pod_namespace: r.pod_namespace.clone(),
            wait_info: r.wait_info,
            unswappable: r.unswappable_bytes,
            pipelined: r.pipelined,
            room_info: r.room_info,
            notices: r.bounds,
            tenant: None,
        }
    }

    /// How a waiter is told who holds the GPU: the pod name, else the program name.
    pub(super) fn display_name(&self, id: ClientId) -> String {
        self.pod_name
            .clone()
            .or_else(|| self.name.clone())
            .unwrap_or_else(|| format!("client {id}"))
    }
}

impl GpuScheduler {
    /// A client registered on this GPU. `resume` is set when it re-registers after an
    /// arbiter restart, carrying what it held.
    pub fn register(
        &mut self,
        now: Nanos,
        id: ClientId,
        info: ClientInfo,
        usage: Usage,
        resume: Option<kiwi_protocol::Resume>,
    ) -> Vec<Output> {
        self.log(
            Some(id),
            EventKind::Register {
                pid: info.pid,
                host_pid: info.host_pid,
                name: info.name.clone(),
                pod_name: info.pod_name.clone(),
                pod_namespace: info.pod_namespace.clone(),
                working_set_bytes: usage.working_set_bytes,
                resumed: resume.is_some(),
            },
        );
        let unswappable = info.unswappable.unwrap_or(0).min(self.ledger.total());
        if unswappable > 0 {
            self.log(Some(id), EventKind::Unswappable { bytes: unswappable });
        }
        self.clients.insert(
            id,
            Client {
                info,
                usage,
                requested_at: None,
                last_active: now,
                waited_ns: 0,
                held_ns: 0,
                told: None,
                unswappable,
                reported_unswappable: unswappable,
                unreported: 0,
                overclaimed: 0,
                admitted: 0,
                looks: VecDeque::new(),
                driver_bytes: None,
                evicted_at: VecDeque::new(),
                eviction_noted: None,
                room_told: None,
                room_sent: None,
                reclaim_pending: 0,
                reclaim_sent: None,
                last_seen: now,
                revoked: false,
                ckpt: checkpoint::Ckpt::None,
                ckpt_failed_at: None,
                gang: None,
            },
        );
        self.send(
            id,
            ArbiterMsg::Registered {
                client_id: id,
                settings: self.settings,
                capacity_bytes: self.ledger.capacity(),
                swap_budget_bytes: self.swap_budget,
            },
        );
        // Right after `registered`, so the client knows the others' memory before its
        // application asks how much is free.
        self.notify_room(now, None);
        // Already oversubscribed: a pipelined client prepares its swap-out from the
        // start (a change this registration makes is told to everyone in `finish`).
        let (pressure, shared) = self.told.pressure();
        if (pressure || shared) && self.clients.get(&id).is_some_and(|c| c.info.pipelined) {
            self.send(
                id,
                ArbiterMsg::Pressure {
                    oversubscribed: pressure,
                    idle_evict_ms: self.idle_evict_ns / 1_000_000,
                    shared,
                },
            );
        }
        if let Some(r) = resume {
            let believed = self.believes_resume(now);
            if believed {
                self.resume.believed(now, self.grace_ns);
            }
            if r.holding && believed {
                self.resume.end_quiet();
                // It kept working while no arbiter ran; take it as holder again. If that
                // makes two exclusive holders, the transition logic drops one.
                let exclusive = !self.shared_mode() && self.holders.is_empty();
                // It was working already: its quantum runs from now.
                self.holders
                    .insert(id, Hold::granted(now, exclusive, Some(now), false));
                self.log(
                    Some(id),
                    EventKind::Grant {
                        exclusive,
                        waited_ns: 0,
                    },
                );
            } else if r.holding {
                // A claim this scheduler can refute: it is past the post-restart window
                // or granted the GPU itself since. Tell the client it holds nothing (a
                // shim then stops submitting) and queue it like any request.
                self.send(
                    id,
                    ArbiterMsg::Revoked {
                        reason: "resume refused: the arbiter did not grant this GPU to this client; waiting for a grant".into(),
                    },
                );
                return self.request(now, id);
            } else if r.waiting {
                return self.request(now, id);
            }
        }
        self.finish(now)
    }

    /// Whether no client is registered (the server may drop the GPU's entry).
    pub fn is_empty(&self) -> bool {
        self.clients.is_empty()
    }

    /// The client is gone (connection closed, process died): it releases everything.
    pub fn exit(&mut self, now: Nanos, id: ClientId) -> Vec<Output> {
        if self.clients.remove(&id).is_none() {
            return Vec::new();
        }
        self.log(Some(id), EventKind::Exit);
        // Its memory is gone with it: the next one in line is granted at once.
        self.holders.remove(&id);
        self.draining.remove(&id);
        self.queue.retain(|&q| q != id);
        self.finish(now)
    }

    /// Whether client `id` registered with `bounds` (it takes this version's notices).
    pub fn takes_notices(&self, id: ClientId) -> bool {
        self.clients.get(&id).is_some_and(|c| c.info.notices)
    }
}
