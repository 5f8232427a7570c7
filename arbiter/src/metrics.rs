//! The arbiter's Prometheus metrics (`--metrics-addr`).
//!
//! Counters and histograms move as the schedulers log events (see
//! [`ArbiterMetrics::observe`]); gauges — holder, queue, settings, per-client memory
//! and times — are refreshed from a status snapshot at each scrape, so clients that
//! left disappear from the output.

use std::collections::HashMap;

use kiwi_metrics::Registrar;
use kiwi_protocol::{ClientState, DropReason, EventKind, GpuStatus};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct GpuLabels {
    gpu: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SwapLabels {
    gpu: String,
    direction: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PoolLabels {
    state: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ClientLabels {
    gpu: String,
    client: String,
    pid: String,
    name: String,
    pod: String,
    namespace: String,
}

type FGauge = Gauge<f64, AtomicU64>;

/// The node's swap figures (see [`crate::swap`]), exported at each scrape.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NodeSwap {
    /// `None`: unlimited (exported as 0).
    pub budget_bytes: Option<u64>,
    /// Σ over GPUs of the working sets that do not fit.
    pub need_bytes: u64,
    /// Σ over clients of working set − resident.
    pub in_use_bytes: u64,
    /// The swap pool, when there is one.
    pub pool: Option<PoolFigures>,
}

/// The swap pool's figures ([`crate::pool::PoolStats`]), exported at each scrape.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolFigures {
    pub size: u64,
    pub populated: u64,
    pub ready: u64,
    pub lent: u64,
    pub scrubbing: u64,
    /// Bytes on the disk tier (0 without one).
    pub spilled: u64,
}
type FCounter = Counter<f64, AtomicU64>;

/// Everything the arbiter exports.
pub struct ArbiterMetrics {
    registry: Registry,
    grants: Family<GpuLabels, Counter>,
    drops_tq: Family<GpuLabels, Counter>,
    drops_no_fit: Family<GpuLabels, Counter>,
    early_releases: Family<GpuLabels, Counter>,
    revocations: Family<GpuLabels, Counter>,
    group_turns: Family<GpuLabels, Counter>,
    checkpoints: Family<GpuLabels, Counter>,
    checkpoint_bytes: Family<GpuLabels, Counter>,
    restores: Family<GpuLabels, Counter>,
    checkpoints_skipped: Family<GpuLabels, Counter>,
    swap_bytes: Family<SwapLabels, Counter>,
    swap_seconds: Family<SwapLabels, FCounter>,
    handoff_seconds: Family<GpuLabels, Histogram>,
    wait_seconds: Family<GpuLabels, Histogram>,
    holder: Family<GpuLabels, Gauge>,
    holders: Family<GpuLabels, Gauge>,
    queue_length: Family<GpuLabels, Gauge>,
    clients: Family<GpuLabels, Gauge>,
    scheduler_on: Family<GpuLabels, Gauge>,
    tq_seconds: Family<GpuLabels, FGauge>,
    capacity_bytes: Family<GpuLabels, Gauge>,
    client_resident: Family<ClientLabels, Gauge>,
    client_swapped: Family<ClientLabels, Gauge>,
    client_waited: Family<ClientLabels, FGauge>,
    client_held: Family<ClientLabels, FGauge>,
    client_holding: Family<ClientLabels, Gauge>,
    swap_budget: Gauge,
    swap_need: Gauge,
    swap_in_use: Gauge,
    swap_pool: Family<PoolLabels, Gauge>,
    admissions_refused: Counter,
    disconnects: Family<ReasonLabels, Counter>,
    /// Per GPU: when the GPU was last given back, to time the next hand-off.
    last_release_ns: HashMap<String, u64>,
    /// Per GPU: the client of its last exclusive grant. A release by another client
    /// (a pipelined hand-off: the drop's release comes after the next grant) starts
    /// no hand-off.
    last_exclusive: HashMap<String, u64>,
}

fn latency_histogram() -> Histogram {
    // 10 µs … ~80 s.
    Histogram::new(exponential_buckets(1e-5, 4.0, 12))
}

impl Default for ArbiterMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl ArbiterMetrics {
    pub fn new() -> Self {
        // Added in the order of the exposition.
        let mut r = Registrar::with_prefix("kiwi");
        Self {
            grants: r.add("grants", "GPU grants"),
            drops_tq: r.add(
                "drops_tq",
                "Holders asked to give the GPU back because their TQ ended while others waited",
            ),
            drops_no_fit: r.add(
                "drops_no_fit",
                "Holders asked to yield because the working sets stopped fitting",
            ),
            early_releases: r.add(
                "early_releases",
                "Holders that gave the GPU back before being asked",
            ),
            revocations: r.add("revocations", "Holders that ignored a drop past the grace period"),
            group_turns: r.add(
                "group_turns",
                "Turns of a group (one job on several GPUs) that started on this GPU, granted together with its other GPUs",
            ),
            checkpoints: r.add(
                "checkpoints",
                "Whole processes the driver checkpointed to host memory to make room",
            ),
            checkpoint_bytes: r.add(
                "checkpoint_bytes",
                "GPU memory no swap frees (contexts, modules) that checkpoints took off the GPU",
            ),
            restores: r.add("restores", "Checkpointed processes restored"),
            checkpoints_skipped: r.add(
                "checkpoints_skipped",
                "Checkpoints or restores the driver refused or the arbiter skipped",
            ),
            swap_bytes: r.add("swap_bytes", "Bytes swapped between GPU and host"),
            swap_seconds: r.add("swap_seconds", "Seconds spent swapping"),
            handoff_seconds: r.add_metric(
                "handoff_seconds",
                "From a holder giving the GPU back to the next exclusive grant",
                Family::new_with_constructor(latency_histogram as fn() -> _),
            ),
            wait_seconds: r.add_metric(
                "wait_seconds",
                "Time from a request to its grant",
                Family::new_with_constructor(latency_histogram as fn() -> _),
            ),
            holder: r.add("holder_client", "Client id of the exclusive holder (0: none)"),
            holders: r.add("holders", "Clients holding the GPU"),
            queue_length: r.add("queue_length", "Clients waiting for the GPU"),
            clients: r.add("clients", "Registered clients"),
            scheduler_on: r.add("scheduler_on", "1 when the Kiwi scheduler is on"),
            tq_seconds: r.add("tq_seconds", "Time quantum"),
            capacity_bytes: r.add(
                "capacity_bytes",
                "GPU memory scheduled against (total minus context reserve)",
            ),
            client_resident: r.add("client_resident_bytes", "A client's bytes in GPU memory"),
            client_swapped: r.add(
                "client_swapped_bytes",
                "A client's bytes swapped out to host memory",
            ),
            client_waited: r.add("client_waited_seconds", "Total time a client waited for the GPU"),
            client_held: r.add("client_held_seconds", "Total time a client held the GPU"),
            client_holding: r.add("client_holding", "1 while a client holds the GPU"),
            swap_budget: r.add(
                "swap_budget_bytes",
                "Host RAM the node lends as GPU swap, over all GPUs (0: unlimited)",
            ),
            swap_pool: r.add(
                "swap_pool_bytes",
                "The node's swap pool by state: size, populated, ready (populated, not lent), lent, scrubbing (returned, not scrubbed yet)",
            ),
            swap_need: r.add(
                "swap_need_bytes",
                "Node swap need: working sets that do not fit in their GPU, summed over GPUs",
            ),
            swap_in_use: r.add(
                "swap_in_use_bytes",
                "Bytes of GPU memory swapped out to host memory now, over all clients",
            ),
            admissions_refused: r.add(
                "swap_admissions_refused",
                "Working-set growths refused because they would exceed the swap budget",
            ),
            disconnects: r.add(
                "client_disconnects",
                "Client connections the arbiter closed, by reason (a client's own close is not counted)",
            ),
            last_release_ns: HashMap::new(),
            last_exclusive: HashMap::new(),
            registry: r.finish(),
        }
    }

    /// Counts an `admit` refused for the swap budget.
    pub fn admission_refused(&self) {
        self.admissions_refused.inc();
    }

    /// Counts a client connection the arbiter closed, by why (a fixed set of
    /// labels: see `server::client::Closed`).
    pub fn disconnect(&self, reason: &'static str) {
        self.disconnects
            .get_or_create(&ReasonLabels {
                reason: reason.to_string(),
            })
            .inc();
    }

    /// Counts one logged scheduler event of `client`.
    pub fn observe(&mut self, t_ns: u64, gpu: &str, client: Option<u64>, kind: &EventKind) {
        let g = GpuLabels {
            gpu: gpu.to_string(),
        };
        match kind {
            EventKind::Grant {
                exclusive,
                waited_ns,
            } => {
                self.grants.get_or_create(&g).inc();
                self.wait_seconds
                    .get_or_create(&g)
                    .observe(*waited_ns as f64 / 1e9);
                if !*exclusive {
                    self.last_exclusive.remove(gpu);
                }
                if *exclusive {
                    if let Some(c) = client {
                        self.last_exclusive.insert(gpu.to_string(), c);
                    }
                    if let Some(r) = self.last_release_ns.remove(gpu) {
                        self.handoff_seconds
                            .get_or_create(&g)
                            .observe(t_ns.saturating_sub(r) as f64 / 1e9);
                    }
                }
            }
            EventKind::Drop { reason, .. } => match reason {
                DropReason::TqExpired => {
                    self.drops_tq.get_or_create(&g).inc();
                }
                DropReason::NoLongerFits => {
                    self.drops_no_fit.get_or_create(&g).inc();
                }
            },
            EventKind::Release { early, .. } => {
                if *early {
                    self.early_releases.get_or_create(&g).inc();
                }
                if self.starts_handoff(gpu, client) {
                    self.last_release_ns.insert(gpu.to_string(), t_ns);
                }
            }
            EventKind::Revoke => {
                self.revocations.get_or_create(&g).inc();
                if self.starts_handoff(gpu, client) {
                    self.last_release_ns.insert(gpu.to_string(), t_ns);
                }
            }
            EventKind::Exit => {
                self.last_release_ns.entry(gpu.to_string()).or_insert(t_ns);
            }
            EventKind::Checkpoint { bytes, .. } => {
                self.checkpoints.get_or_create(&g).inc();
                self.checkpoint_bytes.get_or_create(&g).inc_by(*bytes);
            }
            EventKind::Restore { .. } => {
                self.restores.get_or_create(&g).inc();
            }
            EventKind::GroupTurn { .. } => {
                self.group_turns.get_or_create(&g).inc();
            }
            EventKind::CheckpointSkipped { .. } => {
                self.checkpoints_skipped.get_or_create(&g).inc();
            }
            EventKind::SwapOut { bytes, duration_ns }
            | EventKind::SwapIn { bytes, duration_ns } => {
                let s = SwapLabels {
                    gpu: gpu.to_string(),
                    direction: if matches!(kind, EventKind::SwapOut { .. }) {
                        "out".into()
                    } else {
                        "in".into()
                    },
                };
                self.swap_bytes.get_or_create(&s).inc_by(*bytes);
                self.swap_seconds
                    .get_or_create(&s)
                    .inc_by(*duration_ns as f64 / 1e9);
            }
            _ => {}
        }
    }

    /// Drops every series of a GPU the arbiter forgot (no NVML, no clients left), so
    /// made-up GPU UUIDs cannot grow the metrics without bound.
    pub fn forget_gpu(&mut self, gpu: &str) {
        let g = GpuLabels {
            gpu: gpu.to_string(),
        };
        for f in [
            &self.grants,
            &self.drops_tq,
            &self.drops_no_fit,
            &self.early_releases,
            &self.revocations,
            &self.group_turns,
            &self.checkpoints,
            &self.checkpoint_bytes,
            &self.restores,
            &self.checkpoints_skipped,
        ] {
            f.remove(&g);
        }
        self.handoff_seconds.remove(&g);
        self.wait_seconds.remove(&g);
        for direction in ["out", "in"] {
            let s = SwapLabels {
                gpu: gpu.to_string(),
                direction: direction.into(),
            };
            self.swap_bytes.remove(&s);
            self.swap_seconds.remove(&s);
        }
        self.last_release_ns.remove(gpu);
        self.last_exclusive.remove(gpu);
    }

    /// Whether `client` giving the GPU back starts a hand-off: not when the GPU was
    /// granted to someone else since (a pipelined hand-off, already done).
    fn starts_handoff(&self, gpu: &str, client: Option<u64>) -> bool {
        match (self.last_exclusive.get(gpu), client) {
            (Some(holder), Some(c)) => *holder == c,
            _ => true,
        }
    }

    /// Refreshes the gauges from live state and encodes everything.
    pub fn render(&self, gpus: &[GpuStatus], swap: &NodeSwap) -> String {
        let clamp = |b: u64| b.min(i64::MAX as u64) as i64;
        self.swap_budget.set(clamp(swap.budget_bytes.unwrap_or(0)));
        self.swap_need.set(clamp(swap.need_bytes));
        self.swap_in_use.set(clamp(swap.in_use_bytes));
        self.swap_pool.clear();
        if let Some(p) = swap.pool {
            for (state, v) in [
                ("size", p.size),
                ("populated", p.populated),
                ("ready", p.ready),
                ("lent", p.lent),
                ("scrubbing", p.scrubbing),
                ("spilled", p.spilled),
            ] {
                self.swap_pool
                    .get_or_create(&PoolLabels {
                        state: state.into(),
                    })
                    .set(clamp(v));
            }
        }
        for f in [
            &self.holder,
            &self.holders,
            &self.queue_length,
            &self.clients,
            &self.scheduler_on,
            &self.capacity_bytes,
        ] {
            f.clear();
        }
        self.tq_seconds.clear();
        for f in [
            &self.client_resident,
            &self.client_swapped,
            &self.client_holding,
        ] {
            f.clear();
        }
        self.client_waited.clear();
        self.client_held.clear();
        for g in gpus {
            let l = GpuLabels {
                gpu: g.uuid.clone(),
            };
            let exclusive = g
                .clients
                .iter()
                .find(|c| c.state == ClientState::Holding)
                .map_or(0, |c| c.id as i64);
            self.holder.get_or_create(&l).set(exclusive);
            self.holders.get_or_create(&l).set(g.holders.len() as i64);
            self.queue_length
                .get_or_create(&l)
                .set(g.queue.len() as i64);
            self.clients.get_or_create(&l).set(g.clients.len() as i64);
            self.scheduler_on
                .get_or_create(&l)
                .set(g.settings.scheduler_on as i64);
            self.tq_seconds
                .get_or_create(&l)
                .set(g.settings.tq_ms as f64 / 1000.0);
            self.capacity_bytes
                .get_or_create(&l)
                .set(g.capacity_bytes as i64);
            for c in &g.clients {
                let cl = ClientLabels {
                    gpu: g.uuid.clone(),
                    client: c.id.to_string(),
                    pid: c.host_pid.to_string(),
                    name: c.name.clone().unwrap_or_default(),
                    pod: c.pod_name.clone().unwrap_or_default(),
                    namespace: c.pod_namespace.clone().unwrap_or_default(),
                };
                self.client_resident
                    .get_or_create(&cl)
                    .set(c.resident_bytes as i64);
                self.client_swapped
                    .get_or_create(&cl)
                    .set(c.swapped_bytes as i64);
                self.client_waited
                    .get_or_create(&cl)
                    .set(c.waited_ns as f64 / 1e9);
                self.client_held
                    .get_or_create(&cl)
                    .set(c.held_ns as f64 / 1e9);
                self.client_holding
                    .get_or_create(&cl)
                    .set(matches!(c.state, ClientState::Holding | ClientState::Running) as i64);
            }
        }
        kiwi_metrics::render(&self.registry)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn swap_gauges_and_refusals_are_exported() {
        let m = ArbiterMetrics::new();
        m.admission_refused();
        let out = m.render(
            &[],
            &NodeSwap {
                budget_bytes: Some(100 << 20),
                need_bytes: 54 << 20,
                in_use_bytes: 950 << 20,
                pool: Some(PoolFigures {
                    size: 8 << 30,
                    lent: 3 << 20,
                    spilled: 5 << 20,
                    ..PoolFigures::default()
                }),
            },
        );
        assert!(out.contains("kiwi_swap_budget_bytes 104857600"), "{out}");
        assert!(
            out.contains("kiwi_swap_pool_bytes{state=\"size\"} 8589934592"),
            "{out}"
        );
        assert!(
            out.contains("kiwi_swap_pool_bytes{state=\"lent\"} 3145728"),
            "{out}"
        );
        assert!(
            out.contains("kiwi_swap_pool_bytes{state=\"spilled\"} 5242880"),
            "{out}"
        );
        assert!(out.contains("kiwi_swap_need_bytes 56623104"), "{out}");
        assert!(out.contains("kiwi_swap_in_use_bytes 996147200"), "{out}");
        assert!(
            out.contains("kiwi_swap_admissions_refused_total 1"),
            "{out}"
        );
        let out = m.render(&[], &NodeSwap::default());
        assert!(out.contains("kiwi_swap_budget_bytes 0"), "{out}");
    }
}

#[cfg(test)]
mod handoff_tests {
    use super::*;

    fn grant(m: &mut ArbiterMetrics, t: u64, c: u64) {
        m.observe(
            t,
            "GPU-0",
            Some(c),
            &EventKind::Grant {
                exclusive: true,
                waited_ns: 0,
            },
        );
    }

    fn release(m: &mut ArbiterMetrics, t: u64, c: u64) {
        m.observe(
            t,
            "GPU-0",
            Some(c),
            &EventKind::Release {
                early: false,
                resident_bytes: 0,
            },
        );
    }

    fn handoff_sum(m: &ArbiterMetrics) -> String {
        let out = m.render(&[], &NodeSwap::default());
        out.lines()
            .filter(|l| {
                l.starts_with("kiwi_handoff_seconds_sum")
                    || l.starts_with("kiwi_handoff_seconds_count")
            })
            .collect::<Vec<_>>()
            .join(" ")
    }

    #[test]
    fn checkpoints_and_restores_are_counted() {
        let mut m = ArbiterMetrics::new();
        for kind in [
            EventKind::Checkpoint {
                bytes: 300 << 20,
                duration_ns: 1,
            },
            EventKind::Restore {
                bytes: 300 << 20,
                duration_ns: 1,
            },
            EventKind::CheckpointSkipped {
                reason: "lock: CUDA_ERROR_NOT_READY".into(),
            },
            EventKind::GroupTurn {
                group: "uid 0 / J".into(),
                gpus: 2,
            },
        ] {
            m.observe(1, "GPU-0", Some(1), &kind);
        }
        let out = m.render(&[], &NodeSwap::default());
        for want in [
            "kiwi_checkpoints_total{gpu=\"GPU-0\"} 1",
            "kiwi_checkpoint_bytes_total{gpu=\"GPU-0\"} 314572800",
            "kiwi_restores_total{gpu=\"GPU-0\"} 1",
            "kiwi_checkpoints_skipped_total{gpu=\"GPU-0\"} 1",
            "kiwi_group_turns_total{gpu=\"GPU-0\"} 1",
        ] {
            assert!(out.contains(want), "{want} in\n{out}");
        }
    }

    /// A pipelined hand-off grants B before A's release: A's release must not start
    /// a "hand-off" that B's whole quantum would be counted in (B's exit keeps an
    /// earlier release's time).
    #[test]
    fn a_release_after_a_pipelined_grant_times_no_handoff() {
        let mut m = ArbiterMetrics::new();
        let s = 1_000_000_000;
        grant(&mut m, 0, 1);
        grant(&mut m, 10 * s, 2); // pipelined: A (1) still swapping out
        release(&mut m, 10 * s + s / 10, 1);
        // B's process ends: the hand-off to the next starts now, not at A's release.
        m.observe(20 * s, "GPU-0", Some(2), &EventKind::Exit);
        grant(&mut m, 20 * s + s / 100, 1);
        let h = handoff_sum(&m);
        assert!(
            h.contains("kiwi_handoff_seconds_count{gpu=\"GPU-0\"} 1"),
            "{h}"
        );
        assert!(
            h.contains("kiwi_handoff_seconds_sum{gpu=\"GPU-0\"} 0.01"),
            "{h}"
        );
    }
}
