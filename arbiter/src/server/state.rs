//! Everything the daemon knows ([`State`], behind one mutex in [`Shared`]) and how a
//! scheduler step's outputs leave it ([`State::dispatch`]): messages straight to the
//! target's socket, events to the log and metrics, checkpoints to their task, and
//! then the groups' turns moved on ([`crate::gang`]).

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Mutex};

use kiwi_protocol::{ArbiterMsg, ErrorCode, Settings};
use tokio::sync::{watch, Notify, Semaphore};

use super::limits::{FrameBudget, Limits, Throttle};
use super::peer::Peer;
use super::{checkpoints, containers, pool, ServerConfig};
use crate::clock::monotonic_ns;
use crate::events::{EventLog, Tenant};
use crate::gang::{self, Gangs};
use crate::gpus;
use crate::metrics::{ArbiterMetrics, NodeSwap};
use crate::sched::{ClientId, GpuScheduler, Output};
use crate::swap;

pub(super) struct ClientConn {
    pub(super) peer: Arc<Peer>,
    pub(super) gpu: Option<String>,
    /// Its connection's cap group: whose share of the event log its events take
    /// ([`crate::events`]).
    pub(super) tenant: Tenant,
    /// The connecting process (host pid, start time), read when it connected: the
    /// only process a checkpoint of this client may touch ([`checkpoints`]).
    pub(super) process: Option<(u32, u64)>,
}

pub(super) struct Gpu {
    pub(super) index: u32,
    pub(super) sched: GpuScheduler,
}

/// Everything the daemon knows, behind one mutex: steps are microseconds long.
pub(super) struct State {
    pub(super) cfg: ServerConfig,
    pub(super) defaults: Settings,
    pub(super) gpus: BTreeMap<String, Gpu>,
    pub(super) clients: HashMap<ClientId, ClientConn>,
    pub(super) events: EventLog,
    pub(super) metrics: ArbiterMetrics,
    pub(super) next_client: ClientId,
    /// End of the post-restart window: claims to hold a GPU are believed until then.
    pub(super) resume_until: u64,
    /// Checkpoints and restores the schedulers asked for, to the task that runs them.
    pub(super) checkpoint_jobs: Option<tokio::sync::mpsc::UnboundedSender<checkpoints::Job>>,
    /// Groups of clients granted their GPUs together ([`crate::gang`]), moved on
    /// after every scheduler step ([`State::dispatch_leaving`]); `settling` while it
    /// moves them (its own outputs do not move them again).
    pub(super) gangs: Gangs,
    pub(super) settling: bool,
}

impl gang::Scheds for BTreeMap<String, Gpu> {
    fn sched(&mut self, gpu: &str) -> Option<&mut GpuScheduler> {
        self.get_mut(gpu).map(|g| &mut g.sched)
    }
}

impl gpus::Entries for BTreeMap<String, Gpu> {
    fn entry(&self, uuid: &str) -> Option<(u32, u64)> {
        self.get(uuid).map(|g| (g.index, g.sched.total()))
    }
    fn count(&self) -> usize {
        self.len()
    }
    fn index_used(&self, index: u32) -> bool {
        self.values().any(|g| g.index == index)
    }
}

impl State {
    /// What client `id`'s tenant may see of GPU `uuid` ([`ArbiterMsg::View`]): its
    /// own clients there, none of another tenant's.
    pub(super) fn view(&self, id: ClientId, uuid: String) -> ArbiterMsg {
        let Some(tenant) = self.clients.get(&id).map(|c| c.tenant.clone()) else {
            return ArbiterMsg::Error {
                code: ErrorCode::NotRegistered,
                message: "this connection is closing".into(),
            };
        };
        let host = tenant.starts_with("uid ");
        let Some(g) = self.gpus.get(&uuid) else {
            return ArbiterMsg::View {
                gpu_uuid: uuid,
                known: false,
                unswappable_bytes: 0,
                processes: Vec::new(),
                host,
            };
        };
        let (unswappable_bytes, processes) = g
            .sched
            .view(|other| self.clients.get(&other).is_some_and(|c| c.tenant == tenant));
        ArbiterMsg::View {
            gpu_uuid: uuid,
            known: true,
            unswappable_bytes,
            processes,
            host,
        }
    }

    /// Checks a registration's GPU against what the arbiter knows ([`gpus`]) and
    /// creates its entry if it is the GPU's first client.
    pub(super) fn admit_gpu(
        &mut self,
        now: u64,
        uuid: &str,
        claimed: u64,
    ) -> Result<(), gpus::Refusal> {
        let reserve_for = |total: u64| {
            kiwi_config::context_reserve_bytes(
                &kiwi_config::ArbiterConfig {
                    reserve_mib: self.cfg.reserve_mib,
                    ..Default::default()
                },
                total,
            )
        };
        match self.cfg.gpus.check(&self.gpus, uuid, claimed)? {
            gpus::Admit::Join { raise_to: None } => {}
            gpus::Admit::Join {
                raise_to: Some(total),
            } => {
                let capacity = total - reserve_for(total);
                self.step(uuid, |s| s.raise_total(now, total, capacity));
                log_line!(
                    "INFO",
                    "GPU {uuid}: {} MiB, as a later client reported",
                    total >> 20
                );
            }
            gpus::Admit::Create { index, total } => {
                let reserve = reserve_for(total);
                let sched =
                    GpuScheduler::new(total, total - reserve, self.defaults, self.cfg.grace_ms)
                        .with_swap_budget(self.cfg.swap_budget_bytes)
                        .with_idle_evict(self.cfg.idle_evict_ms)
                        .with_resume_window(self.resume_until)
                        .with_checkpoint(self.checkpoint_jobs.is_some());
                log_line!(
                    "INFO",
                    "new GPU {uuid} (index {index}): {} MiB, {} MiB schedulable",
                    total >> 20,
                    (total - reserve) >> 20
                );
                self.gpus.insert(uuid.to_string(), Gpu { index, sched });
            }
        }
        Ok(())
    }

    /// Drops `uuid`'s entry once its last client left, unless the GPUs come from
    /// NVML: made-up GPUs must not pile up, and a GPU's size is asked again.
    pub(super) fn forget_gpu_if_unused(&mut self, uuid: &str) {
        if self.cfg.gpus.keeps_empty_entries() {
            return;
        }
        if self.gpus.get(uuid).is_some_and(|g| g.sched.is_empty()) {
            self.gpus.remove(uuid);
            self.metrics.forget_gpu(uuid);
            log_line!("INFO", "GPU {uuid} has no clients left; forgotten");
        }
    }

    /// Steps GPU `gpu`'s scheduler with `input` (none when the GPU has no entry) and
    /// dispatches its outputs.
    pub(super) fn step(&mut self, gpu: &str, input: impl FnOnce(&mut GpuScheduler) -> Vec<Output>) {
        let outs = self
            .gpus
            .get_mut(gpu)
            .map(|g| input(&mut g.sched))
            .unwrap_or_default();
        self.dispatch(gpu, outs);
    }

    /// Applies scheduler outputs: messages to peers, events to the log.
    pub(super) fn dispatch(&mut self, gpu: &str, outs: Vec<Output>) {
        self.dispatch_leaving(gpu, outs, None)
    }

    /// [`State::dispatch`] for the outputs of a client's exit: `leaving` is that
    /// client, no longer in `clients`, and its tenant.
    pub(super) fn dispatch_leaving(
        &mut self,
        gpu: &str,
        outs: Vec<Output>,
        leaving: Option<(ClientId, &Tenant)>,
    ) {
        let now = monotonic_ns();
        // Messages first: a waiting client's grant must not wait for bookkeeping.
        for o in &outs {
            if let Output::Send(id, msg) = o {
                if let Some(c) = self.clients.get(id) {
                    c.peer.send(msg);
                }
            }
        }
        for o in outs {
            match o {
                Output::Log(id, kind) => {
                    self.metrics.observe(now, gpu, id, &kind);
                    let tenant = id.and_then(|id| match leaving {
                        Some((l, t)) if l == id => Some(t),
                        _ => self.clients.get(&id).map(|c| &c.tenant),
                    });
                    self.events.push(now, gpu, id, tenant, kind);
                }
                Output::Checkpoint { id, pid } | Output::Restore { id, pid } => {
                    let task = match o {
                        Output::Restore { .. } => checkpoints::Task::Restore,
                        _ => checkpoints::Task::Checkpoint,
                    };
                    if let Some(tx) = &self.checkpoint_jobs {
                        let _ = tx.send(checkpoints::Job {
                            gpu: gpu.to_string(),
                            id,
                            pid,
                            task,
                        });
                    }
                }
                Output::Send(..) => {}
            }
        }
        // Any step may move a group's turn on (a release ends it, a request claims).
        if !self.settling {
            self.settling = true;
            let outs = self.gangs.step(&mut self.gpus, now);
            for (u, o) in outs {
                self.dispatch(&u, o);
            }
            self.settling = false;
        }
    }

    /// Puts client `id` (registered on `gpu`) in group `key` and dispatches what that
    /// changes.
    pub(super) fn join_group(&mut self, now: u64, id: ClientId, key: &str, gpu: &str) {
        let (joined, outs) = self.gangs.join(&mut self.gpus, now, id, key, gpu);
        if !joined {
            log_line!(
                "WARN",
                "client {id}: the node keeps {} groups already; granted on its own",
                gang::MAX_GROUPS
            );
        }
        for (u, o) in outs {
            self.dispatch(&u, o);
        }
    }

    pub(super) fn resolve_gpu(&self, sel: &str) -> Option<String> {
        if self.gpus.contains_key(sel) {
            return Some(sel.to_string());
        }
        let idx: u32 = sel.parse().ok()?;
        self.gpus
            .iter()
            .find(|(_, g)| g.index == idx)
            .map(|(u, _)| u.clone())
    }

    pub(super) fn gpu_statuses(&self, now: u64) -> Vec<kiwi_protocol::GpuStatus> {
        self.gpus
            .keys()
            .filter_map(|u| self.gpu_status(now, u))
            .collect()
    }

    /// GPU `uuid`'s status: its scheduler's, with the groups of its clients and of
    /// its turn.
    pub(super) fn gpu_status(&self, now: u64, uuid: &str) -> Option<kiwi_protocol::GpuStatus> {
        let g = self.gpus.get(uuid)?;
        let mut s = g.sched.status(now, g.index, uuid);
        for c in &mut s.clients {
            c.group = self.gangs.ganged_key(c.id).map(str::to_string);
        }
        s.group_turn =
            self.gangs
                .reserved_for(uuid)
                .map(|(group, running)| kiwi_protocol::GroupTurn {
                    group: group.to_string(),
                    running,
                });
        Some(s)
    }

    /// The node's swap figures for status and metrics.
    pub(super) fn node_swap(&self) -> NodeSwap {
        let scheds = || self.gpus.values().map(|g| &g.sched);
        NodeSwap {
            budget_bytes: self.cfg.swap_budget_bytes,
            need_bytes: swap::node_swap_need(scheds()),
            in_use_bytes: swap::node_swapped_bytes(scheds()),
            pool: None,
        }
    }

    pub(super) fn next_deadline(&self) -> Option<u64> {
        self.gpus
            .values()
            .filter_map(|g| g.sched.next_deadline())
            .min()
    }
}

pub(super) struct Shared {
    pub(super) state: Mutex<State>,
    /// Wakes the timer task when a deadline may have moved.
    pub(super) timer: Notify,
    /// Open client connections per peer group (see [`peer_group`]).
    pub(super) groups: Mutex<HashMap<String, usize>>,
    /// Bytes of partly received frames, over every client connection.
    pub(super) partial: FrameBudget,
    /// Warnings about peers (bad frames, limits), over every connection.
    pub(super) warn: Mutex<Throttle>,
    pub(super) limits: Limits,
    /// Places under the node's connection cap; each container socket holds one.
    pub(super) conn_limit: Arc<Semaphore>,
    pub(super) conn_limit_total: usize,
    /// The daemon's stop signal, for listeners started later (container sockets).
    pub(super) stop: watch::Receiver<bool>,
    /// The container sockets being served, by key.
    pub(super) containers: Mutex<HashMap<String, containers::Served>>,
    /// The node's swap pool, when configured.
    pub(super) pool: Option<Arc<crate::pool::Pool>>,
    /// What each process borrows from the pool, for the disk tier ([`pool::Book`]).
    pub(super) pool_book: pool::Book,
}

impl Shared {
    /// Everything the daemon knows at start: no GPU, no client; `conns` places under
    /// the node's connection cap.
    pub(super) fn new(
        cfg: &ServerConfig,
        defaults: Settings,
        conns: usize,
        limits: Limits,
        pool: Option<Arc<crate::pool::Pool>>,
        stop: watch::Receiver<bool>,
        checkpoint_jobs: Option<tokio::sync::mpsc::UnboundedSender<checkpoints::Job>>,
    ) -> Self {
        Shared {
            conn_limit: Arc::new(Semaphore::new(conns)),
            conn_limit_total: conns,
            stop,
            containers: Mutex::new(HashMap::new()),
            pool,
            pool_book: pool::Book::default(),
            groups: Mutex::new(HashMap::new()),
            partial: FrameBudget {
                used: AtomicUsize::new(0),
                limit: cfg.partial_frame_budget_bytes,
            },
            warn: Mutex::new(Throttle::new(20)),
            limits,
            state: Mutex::new(State {
                events: EventLog::with_max_bytes(cfg.event_log_capacity, cfg.event_log_max_bytes),
                metrics: ArbiterMetrics::new(),
                cfg: cfg.clone(),
                defaults,
                gpus: BTreeMap::new(),
                clients: HashMap::new(),
                next_client: 1,
                resume_until: monotonic_ns() + crate::sched::RESUME_CLAIM_WINDOW_NS,
                checkpoint_jobs,
                gangs: Gangs::default(),
                settling: false,
            }),
            timer: Notify::new(),
        }
    }

    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}
