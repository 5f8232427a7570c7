//! Unit and property tests of the scheduling core, with simulated time.

use super::*;
use kiwi_protocol::{ArbiterMsg, DropReason, Resume};
use proptest::prelude::*;
use std::collections::BTreeSet;

const MIB: u64 = 1 << 20;
const SEC: u64 = 1_000_000_000;
const MS: u64 = 1_000_000;

fn sched(capacity: u64, tq_ms: u64, grace_ms: u64) -> GpuScheduler {
    GpuScheduler::new(
        capacity,
        capacity,
        Settings {
            scheduler_on: true,
            tq_ms,
        },
        grace_ms,
    )
}

fn usage(ws: u64, resident: u64) -> Usage {
    Usage {
        working_set_bytes: ws,
        resident_bytes: resident,
    }
}

fn sent(outs: &[Output], to: ClientId) -> Vec<ArbiterMsg> {
    outs.iter()
        .filter_map(|o| match o {
            Output::Send(id, m) if *id == to => Some(m.clone()),
            _ => None,
        })
        .collect()
}

fn granted(outs: &[Output], to: ClientId) -> Option<bool> {
    sent(outs, to).iter().find_map(|m| match m {
        ArbiterMsg::Grant { exclusive, .. } => Some(*exclusive),
        _ => None,
    })
}

fn dropped(outs: &[Output], to: ClientId) -> Option<u64> {
    sent(outs, to).iter().find_map(|m| match m {
        ArbiterMsg::Drop { need_bytes, .. } => Some(*need_bytes),
        _ => None,
    })
}

fn reg(s: &mut GpuScheduler, now: Nanos, id: ClientId, ws: u64) {
    s.register(now, id, ClientInfo::default(), usage(ws, 0), None);
}

// ---- helpers the parts' tests share ----------------------------------------

fn revoked(outs: &[Output], to: ClientId) -> bool {
    sent(outs, to)
        .iter()
        .any(|m| matches!(m, ArbiterMsg::Revoked { .. }))
}

fn reclaims(outs: &[Output], to: ClientId) -> u64 {
    sent(outs, to)
        .iter()
        .map(|m| match m {
            ArbiterMsg::Reclaim { need_bytes } => *need_bytes,
            _ => 0,
        })
        .sum()
}

fn grant_msg(outs: &[Output], to: ClientId) -> Option<(bool, bool)> {
    sent(outs, to).iter().find_map(|m| match m {
        ArbiterMsg::Grant {
            exclusive,
            pipelined,
            ..
        } => Some((*exclusive, *pipelined)),
        _ => None,
    })
}

fn logged(outs: &[Output]) -> Vec<(Option<ClientId>, EventKind)> {
    outs.iter()
        .filter_map(|o| match o {
            Output::Log(id, k) => Some((*id, k.clone())),
            _ => None,
        })
        .collect()
}

fn waiting(outs: &[Output], to: ClientId) -> Vec<(Option<String>, u32, Option<u64>)> {
    sent(outs, to)
        .into_iter()
        .filter_map(|m| match m {
            ArbiterMsg::Waiting {
                holder,
                ahead,
                quantum_left_ms,
                ..
            } => Some((holder, ahead, quantum_left_ms)),
            _ => None,
        })
        .collect()
}

// ---- property tests ---------------------------------------------------------

/// How a simulated client behaves.
#[derive(Debug, Clone, Copy)]
enum Behaviour {
    /// Answers drops and reclaims after `delay_ms` (< grace).
    Cooperative { delay_ms: u64 },
    /// Never answers a drop or a reclaim.
    Stubborn,
}

#[derive(Debug, Clone)]
struct SimClient {
    ws: u64,
    resident: u64,
    behaviour: Behaviour,
    /// Time it holds the GPU before releasing on its own.
    hold_ms: u64,
    /// Time between a release and the next request.
    think_ms: u64,
    /// Takes part in pipelined hand-offs: a cooperative one says `drained` halfway
    /// between its drop and its release.
    pipelined: bool,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Action {
    Request(ClientId),
    Release(ClientId),
    Reclaimed(ClientId, u64),
    Drained(ClientId),
}

struct Sim {
    s: GpuScheduler,
    clients: BTreeMap<ClientId, SimClient>,
    agenda: Vec<(Nanos, Action)>,
    requested_at: BTreeMap<ClientId, Nanos>,
    holding: BTreeSet<ClientId>,
    max_wait: Nanos,
    grants: usize,
    pipelined_grants: usize,
    /// Clients that said `drained` and have not released (or been revoked) since.
    draining: BTreeSet<ClientId>,
    violations: Vec<String>,
}

impl Sim {
    fn apply(&mut self, now: Nanos, outs: Vec<Output>) {
        let mut work: std::collections::VecDeque<Output> = outs.into();
        while let Some(o) = work.pop_front() {
            if std::env::var("SIMLOG").is_ok() {
                eprintln!("{:>6} ms {:?}", now / MS, o);
            }
            let Output::Send(id, msg) = o else { continue };
            let Some(c) = self.clients.get(&id).cloned() else {
                continue;
            };
            match msg {
                ArbiterMsg::Grant {
                    exclusive,
                    pipelined,
                    ..
                } => {
                    self.grants += 1;
                    if pipelined {
                        self.pipelined_grants += 1;
                        if !c.pipelined || self.draining.len() != 1 || !exclusive {
                            self.violations.push(format!(
                                "t={now}: pipelined grant to {id} (pipelined: {}) beside drainers {:?}",
                                c.pipelined, self.draining
                            ));
                        }
                    }
                    let others: Vec<_> =
                        self.s.holders().into_iter().filter(|&h| h != id).collect();
                    if exclusive && !others.is_empty() {
                        self.violations.push(format!(
                            "t={now}: exclusive grant to {id} while {others:?} hold"
                        ));
                    }
                    if let Some(r) = self.requested_at.remove(&id) {
                        self.max_wait = self.max_wait.max(now - r);
                    }
                    self.holding.insert(id);
                    self.clients.get_mut(&id).unwrap().resident = c.ws;
                    work.extend(self.s.usage(now, id, usage(c.ws, c.ws)));
                    self.agenda
                        .push((now + c.hold_ms * MS, Action::Release(id)));
                }
                ArbiterMsg::Drop { need_bytes, .. } => {
                    if let Behaviour::Cooperative { delay_ms } = c.behaviour {
                        let cl = self.clients.get_mut(&id).unwrap();
                        cl.resident = cl.resident.saturating_sub(need_bytes);
                        self.agenda.retain(|(_, a)| *a != Action::Release(id));
                        if c.pipelined {
                            self.agenda
                                .push((now + delay_ms * MS / 2, Action::Drained(id)));
                        }
                        self.agenda.push((now + delay_ms * MS, Action::Release(id)));
                    }
                }
                ArbiterMsg::Error { message, .. } => {
                    self.violations
                        .push(format!("t={now}: error to honest client {id}: {message}"));
                }
                ArbiterMsg::Reclaim { need_bytes } => {
                    if let Behaviour::Cooperative { delay_ms } = c.behaviour {
                        self.agenda
                            .push((now + delay_ms * MS, Action::Reclaimed(id, need_bytes)));
                    }
                }
                ArbiterMsg::Revoked { .. } => {
                    self.holding.remove(&id);
                    self.draining.remove(&id);
                    self.agenda.retain(|(_, a)| *a != Action::Release(id));
                    self.agenda
                        .push((now + c.think_ms * MS, Action::Request(id)));
                }
                _ => {}
            }
        }
    }

    fn run(&mut self, until: Nanos) {
        let mut now = 0;
        while now < until {
            let next_action = self.agenda.iter().map(|(t, _)| *t).min();
            let next = match (next_action, self.s.next_deadline()) {
                (Some(a), Some(d)) => a.min(d),
                (Some(a), None) => a,
                (None, Some(d)) => d,
                (None, None) => break,
            };
            now = next.max(now);
            let outs = self.s.tick(now);
            self.apply(now, outs);
            let due: Vec<_> = {
                let (due, rest): (Vec<_>, Vec<_>) =
                    self.agenda.drain(..).partition(|(t, _)| *t <= now);
                self.agenda = rest;
                due
            };
            for (_, a) in due {
                if std::env::var("SIMLOG").is_ok() {
                    eprintln!("{:>6} ms ACTION {:?}", now / MS, a);
                }
                let outs = match a {
                    Action::Request(id) => {
                        self.requested_at.entry(id).or_insert(now);
                        self.s.request(now, id)
                    }
                    Action::Drained(id) => {
                        if !self.holding.contains(&id) {
                            continue;
                        }
                        self.draining.insert(id);
                        self.s.drained(now, id)
                    }
                    Action::Release(id) => {
                        self.draining.remove(&id);
                        if !self.holding.remove(&id) {
                            continue;
                        }
                        let c = &self.clients[&id];
                        let out = self.s.release(now, id, usage(c.ws, c.resident));
                        self.agenda
                            .push((now + c.think_ms * MS, Action::Request(id)));
                        out
                    }
                    Action::Reclaimed(id, need) => {
                        let cl = self.clients.get_mut(&id).unwrap();
                        cl.resident = cl.resident.saturating_sub(need);
                        let u = usage(cl.ws, cl.resident);
                        self.s.reclaimed(now, id, u)
                    }
                };
                self.apply(now, outs);
            }
        }
        // Anyone still waiting must not have waited past the bound either.
        for (&id, &r) in &self.requested_at {
            let _ = id;
            self.max_wait = self.max_wait.max(now.saturating_sub(r));
        }
    }
}

fn behaviour() -> impl Strategy<Value = Behaviour> {
    prop_oneof![
        4 => (0u64..400).prop_map(|d| Behaviour::Cooperative { delay_ms: d }),
        1 => Just(Behaviour::Stubborn),
    ]
}

fn sim_client(capacity: u64, must_overflow: bool) -> impl Strategy<Value = SimClient> {
    sim_client_p(capacity, must_overflow, Just(false))
}

fn sim_client_p(
    capacity: u64,
    must_overflow: bool,
    pipelined: impl Strategy<Value = bool>,
) -> impl Strategy<Value = SimClient> {
    let ws = if must_overflow {
        (capacity / 2 + 1)..=capacity
    } else {
        1..=capacity / 8
    };
    (ws, behaviour(), 1u64..5_000, 0u64..3_000, pipelined).prop_map(
        |(ws, behaviour, hold_ms, think_ms, pipelined)| SimClient {
            ws,
            resident: 0,
            behaviour,
            hold_ms,
            think_ms,
            pipelined,
        },
    )
}

fn build(
    clients: Vec<SimClient>,
    starts: Vec<u64>,
    tq_ms: u64,
    grace_ms: u64,
    capacity: u64,
) -> Sim {
    let mut s = sched(capacity, tq_ms, grace_ms);
    let mut map = BTreeMap::new();
    let mut agenda = Vec::new();
    for (i, (c, start)) in clients.into_iter().zip(starts).enumerate() {
        let id = i as ClientId + 1;
        let info = ClientInfo {
            pipelined: c.pipelined,
            ..ClientInfo::default()
        };
        s.register(0, id, info, usage(c.ws, 0), None);
        agenda.push((start * MS, Action::Request(id)));
        map.insert(id, c);
    }
    Sim {
        s,
        clients: map,
        agenda,
        requested_at: BTreeMap::new(),
        holding: BTreeSet::new(),
        max_wait: 0,
        grants: 0,
        pipelined_grants: 0,
        draining: BTreeSet::new(),
        violations: Vec::new(),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// When the working sets exceed capacity, no exclusive grant is ever issued while
    /// another client holds, and every waiter is granted within
    /// (clients − 1) × (TQ + grace), even with clients that ignore drops.
    #[test]
    fn exclusion_and_bounded_wait_when_oversubscribed(
        clients in proptest::collection::vec(sim_client(1000 * MIB, true), 2..6),
        starts in proptest::collection::vec(0u64..3_000, 6),
        tq_ms in 50u64..3_000,
        grace_ms in 450u64..1_500,
    ) {
        let n = clients.len() as u64;
        let mut sim = build(clients, starts, tq_ms, grace_ms, 1000 * MIB);
        sim.run(120 * SEC);
        prop_assert!(sim.violations.is_empty(), "{:?}", sim.violations);
        prop_assert!(sim.grants > 0);
        let bound = (n - 1) * (tq_ms + grace_ms) * MS;
        prop_assert!(sim.max_wait <= bound, "waited {} ms > bound {} ms", sim.max_wait / MS, bound / MS);
        // Whenever it settles, at most one client holds.
        prop_assert!(sim.s.holders().len() <= 1);
    }

    /// The same with clients that take part in pipelined hand-offs (some, all or none):
    /// a drainer's successor is granted before the drainer's release, but never
    /// beside another holder, never beside two swap-outs, only if it registered
    /// `pipelined`, and no honest client is ever answered with an error.
    #[test]
    fn pipelined_handoffs_keep_exclusion_and_bounded_wait(
        clients in proptest::collection::vec(sim_client_p(1000 * MIB, true, any::<bool>()), 2..6),
        starts in proptest::collection::vec(0u64..3_000, 6),
        tq_ms in 50u64..3_000,
        grace_ms in 450u64..1_500,
    ) {
        let n = clients.len() as u64;
        let mut sim = build(clients, starts, tq_ms, grace_ms, 1000 * MIB);
        sim.run(120 * SEC);
        prop_assert!(sim.violations.is_empty(), "{:?}", sim.violations);
        prop_assert!(sim.grants > 0);
        let bound = (n - 1) * (tq_ms + grace_ms) * MS;
        prop_assert!(sim.max_wait <= bound, "waited {} ms > bound {} ms", sim.max_wait / MS, bound / MS);
        prop_assert!(sim.s.holders().len() <= 1);
    }

    /// When everything fits, every request is granted at once, shared, and nobody is
    /// ever dropped.
    #[test]
    fn concurrency_when_working_sets_fit(
        clients in proptest::collection::vec(sim_client(1000 * MIB, false), 2..8),
        starts in proptest::collection::vec(0u64..3_000, 8),
        tq_ms in 50u64..3_000,
    ) {
        let mut sim = build(clients, starts, tq_ms, 500, 1000 * MIB);
        sim.run(60 * SEC);
        prop_assert_eq!(sim.max_wait, 0);
        prop_assert!(sim.grants > 0);
        prop_assert!(sim.violations.is_empty());
        prop_assert!(sim.s.holders().iter().all(|&h| !sim.s.holds_exclusive(h)));
    }
}

mod idle;
mod memory;
mod notify;
mod pipelined;
mod resume;
mod room;
mod turns;
