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

#[test]
fn fitting_clients_run_together() {
    let mut s = sched(1000 * MIB, 30_000, 5_000);
    reg(&mut s, 0, 1, 400 * MIB);
    reg(&mut s, 0, 2, 400 * MIB);
    assert_eq!(granted(&s.request(1, 1), 1), Some(false));
    assert_eq!(granted(&s.request(2, 2), 2), Some(false));
    assert_eq!(s.holders(), vec![1, 2]);
    assert_eq!(s.next_deadline(), None, "no timers while everything fits");
}

#[test]
fn seed_timeline_tq_then_early_release() {
    // T1: A asks and gets the GPU; T2: B asks and waits; T3 = T1 + TQ: A is dropped,
    // B runs; T4: B releases early; A resumes.
    let tq = 2_000;
    let mut s = sched(1000 * MIB, tq, 500);
    reg(&mut s, 0, 1, 700 * MIB);
    reg(&mut s, 0, 2, 700 * MIB);
    let t1 = SEC;
    assert_eq!(granted(&s.request(t1, 1), 1), Some(true));
    s.usage(t1, 1, usage(700 * MIB, 700 * MIB));
    let t2 = t1 + SEC / 2;
    let outs = s.request(t2, 2);
    assert_eq!(granted(&outs, 2), None, "B must wait while A holds");
    assert!(sent(&outs, 1)
        .iter()
        .any(|m| matches!(m, ArbiterMsg::Contended { waiting: 1, need_bytes } if *need_bytes == 400 * MIB)));
    let t3 = t1 + tq * MS;
    assert_eq!(s.next_deadline(), Some(t3));
    assert!(s.tick(t3 - 1).is_empty());
    let outs = s.tick(t3);
    // B needs 700 MiB; free is 300 MiB: A must evict 400 MiB.
    assert_eq!(dropped(&outs, 1), Some(400 * MIB));
    let outs = s.release(t3 + 10 * MS, 1, usage(700 * MIB, 300 * MIB));
    assert_eq!(granted(&outs, 2), Some(true));
    let outs = s.request(t3 + 11 * MS, 1);
    assert_eq!(granted(&outs, 1), None, "A waits for B now");
    let t4 = t3 + SEC;
    let outs = s.release(t4, 2, usage(700 * MIB, 700 * MIB));
    // A needs its 400 MiB back; B released early with 700 resident: A is granted at
    // once and B is asked to evict 400 MiB.
    assert!(sent(&outs, 2)
        .iter()
        .any(|m| matches!(m, ArbiterMsg::Reclaim { need_bytes } if *need_bytes == 400 * MIB)));
    assert_eq!(granted(&outs, 1), Some(true));
}

#[test]
fn residency_over_capacity_is_evicted_at_the_next_drop() {
    // Two 8 MiB clients on 14 MiB. B was asked to reclaim while it waited, but was
    // granted before its answer came, and swapped back in: both are resident (16 MiB).
    // Each hand-off must now shed the 2 MiB overflow, not alternate with it forever.
    let mut s = sched(14 * MIB, 5, 500);
    reg(&mut s, 0, 1, 8 * MIB);
    reg(&mut s, 0, 2, 8 * MIB);
    assert_eq!(granted(&s.request(0, 1), 1), Some(true));
    s.usage(0, 1, usage(8 * MIB, 8 * MIB));
    s.request(1, 2);
    s.usage(1, 2, usage(8 * MIB, 8 * MIB));
    let outs = s.tick(5 * MS);
    assert_eq!(dropped(&outs, 1), Some(2 * MIB), "{outs:?}");
    let outs = s.release(6 * MS, 1, usage(8 * MIB, 6 * MIB));
    assert_eq!(granted(&outs, 2), Some(true));
    // Back within capacity: the next drop asks for nothing more than A's swap-in needs.
    s.request(7 * MS, 1);
    let outs = s.tick(11 * MS);
    assert_eq!(dropped(&outs, 2), Some(2 * MIB), "{outs:?}");
}

#[test]
fn holder_hears_when_the_next_ones_needs_grow() {
    let mut s = sched(1000 * MIB, 30_000, 5_000);
    reg(&mut s, 0, 1, 700 * MIB);
    reg(&mut s, 0, 2, 400 * MIB);
    s.request(0, 1);
    s.usage(0, 1, usage(700 * MIB, 700 * MIB));
    // B asks with 400 MiB allocated: 100 MiB must go.
    let outs = s.request(1, 2);
    assert!(
        sent(&outs, 1).iter().any(
            |m| matches!(m, ArbiterMsg::Contended { waiting: 1, need_bytes } if *need_bytes == 100 * MIB)
        ),
        "{outs:?}"
    );
    // B allocates more while waiting: A hears it must free 400 MiB.
    let outs = s.usage(2, 2, usage(700 * MIB, 0));
    assert!(
        sent(&outs, 1).iter().any(
            |m| matches!(m, ArbiterMsg::Contended { waiting: 1, need_bytes } if *need_bytes == 400 * MIB)
        ),
        "{outs:?}"
    );
    // Nothing changed: nothing resent.
    assert!(sent(&s.usage(3, 2, usage(700 * MIB, 0)), 1).is_empty());
}

#[test]
fn lone_holder_keeps_the_gpu_past_tq() {
    let mut s = sched(1000 * MIB, 1_000, 500);
    reg(&mut s, 0, 1, 700 * MIB);
    reg(&mut s, 0, 2, 700 * MIB);
    s.request(0, 1);
    assert_eq!(s.next_deadline(), None);
    assert!(s.tick(100 * SEC).is_empty());
    // Somebody arrives long after TQ: the holder is dropped right away.
    let outs = s.request(100 * SEC, 2);
    assert!(dropped(&outs, 1).is_some());
}

#[test]
fn ignoring_a_drop_costs_the_gpu_after_grace() {
    let mut s = sched(1000 * MIB, 1_000, 300);
    reg(&mut s, 0, 1, 700 * MIB);
    reg(&mut s, 0, 2, 700 * MIB);
    s.request(0, 1);
    s.request(1, 2);
    let outs = s.tick(SEC);
    assert!(dropped(&outs, 1).is_some());
    assert_eq!(s.next_deadline(), Some(SEC + 300 * MS));
    let outs = s.tick(SEC + 300 * MS);
    assert!(sent(&outs, 1)
        .iter()
        .any(|m| matches!(m, ArbiterMsg::Revoked { .. })));
    assert_eq!(granted(&outs, 2), Some(true));
    assert!(outs
        .iter()
        .any(|o| matches!(o, Output::Log(Some(1), EventKind::Revoke))));
}

#[test]
fn exit_of_holder_grants_next_at_once() {
    let mut s = sched(1000 * MIB, 30_000, 5_000);
    reg(&mut s, 0, 1, 700 * MIB);
    reg(&mut s, 0, 2, 700 * MIB);
    reg(&mut s, 0, 3, 700 * MIB);
    s.request(0, 1);
    s.usage(0, 1, usage(700 * MIB, 700 * MIB));
    s.request(1, 2);
    let outs = s.exit(2, 1);
    assert_eq!(granted(&outs, 2), Some(true));
}

#[test]
fn scheduler_off_grants_everyone() {
    let mut s = sched(1000 * MIB, 30_000, 5_000);
    reg(&mut s, 0, 1, 700 * MIB);
    reg(&mut s, 0, 2, 700 * MIB);
    s.request(0, 1);
    assert_eq!(granted(&s.request(1, 2), 2), None);
    let outs = s.set_scheduler(2, false);
    assert_eq!(granted(&outs, 2), Some(false));
    assert!(sent(&outs, 1).iter().any(|m| matches!(
        m,
        ArbiterMsg::Settings(Settings {
            scheduler_on: false,
            ..
        })
    )));
    // Back on: the two running side by side no longer fit; one is dropped.
    let outs = s.set_scheduler(3, true);
    let drops: Vec<_> = [1, 2]
        .iter()
        .filter(|&&id| dropped(&outs, id).is_some())
        .collect();
    assert_eq!(drops.len(), 1, "{outs:?}");
}

#[test]
fn growing_past_capacity_drops_all_but_one() {
    let mut s = sched(1000 * MIB, 30_000, 5_000);
    reg(&mut s, 0, 1, 400 * MIB);
    reg(&mut s, 0, 2, 400 * MIB);
    s.request(0, 1);
    s.request(0, 2);
    s.usage(0, 1, usage(400 * MIB, 400 * MIB));
    s.usage(0, 2, usage(400 * MIB, 400 * MIB));
    let outs = s.usage(5, 2, usage(800 * MIB, 400 * MIB));
    let drops: Vec<_> = outs
        .iter()
        .filter(|o| {
            matches!(
                o,
                Output::Send(
                    _,
                    ArbiterMsg::Drop {
                        reason: DropReason::NoLongerFits,
                        ..
                    }
                )
            )
        })
        .collect();
    assert_eq!(drops.len(), 1, "{outs:?}");
    assert!(s.holds_exclusive(2) != s.holds_exclusive(1));
}

#[test]
fn tq_change_applies_to_current_holder() {
    let mut s = sched(1000 * MIB, 30_000, 5_000);
    reg(&mut s, 0, 1, 700 * MIB);
    reg(&mut s, 0, 2, 700 * MIB);
    s.request(0, 1);
    s.request(0, 2);
    assert_eq!(s.next_deadline(), Some(30 * SEC));
    s.set_tq(SEC, 2_000);
    assert_eq!(s.next_deadline(), Some(2 * SEC));
}

#[test]
fn resumed_holders_rebuild_state() {
    let mut s = sched(1000 * MIB, 30_000, 5_000);
    let holding = Some(Resume {
        holding: true,
        waiting: false,
    });
    let waiting = Some(Resume {
        holding: false,
        waiting: true,
    });
    s.register(
        0,
        1,
        ClientInfo::default(),
        usage(700 * MIB, 700 * MIB),
        holding,
    );
    let outs = s.register(0, 2, ClientInfo::default(), usage(700 * MIB, 0), waiting);
    assert_eq!(granted(&outs, 2), None);
    assert_eq!(s.holders(), vec![1]);
    assert_eq!(s.queue(), vec![2]);
    assert!(s.holds_exclusive(1));
}

#[test]
fn resumed_waiter_does_not_jump_a_resumed_holder() {
    // After a restart the waiter may re-register before the holder: it must not be
    // granted while the holder may still be running.
    let mut s = sched(1000 * MIB, 30_000, 5_000);
    let waiting = Some(Resume {
        holding: false,
        waiting: true,
    });
    let outs = s.register(0, 2, ClientInfo::default(), usage(700 * MIB, 0), waiting);
    assert_eq!(granted(&outs, 2), None);
    assert_eq!(s.next_deadline(), Some(2 * SEC));
    let holding = Some(Resume {
        holding: true,
        waiting: false,
    });
    s.register(
        SEC / 10,
        1,
        ClientInfo::default(),
        usage(700 * MIB, 700 * MIB),
        holding,
    );
    assert_eq!(s.holders(), vec![1]);
    assert_eq!(s.queue(), vec![2]);
    // Had no holder come back, the waiter is granted once the window closes.
    let mut s = sched(1000 * MIB, 30_000, 5_000);
    s.register(0, 2, ClientInfo::default(), usage(700 * MIB, 0), waiting);
    reg(&mut s, 0, 3, 700 * MIB);
    assert!(s.tick(SEC).is_empty());
    assert_eq!(granted(&s.tick(2 * SEC), 2), Some(true));
}

#[test]
fn release_without_holding_cancels_the_request() {
    let mut s = sched(1000 * MIB, 30_000, 5_000);
    reg(&mut s, 0, 1, 700 * MIB);
    reg(&mut s, 0, 2, 700 * MIB);
    s.request(0, 1);
    s.request(0, 2);
    s.release(1, 2, usage(700 * MIB, 0));
    assert!(s.queue().is_empty());
    assert_eq!(s.next_deadline(), None);
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

#[test]
fn resumed_holder_first_then_waiter() {
    let mut s = sched(896 * MIB, 30_000, 5_000);
    let holding = Some(Resume {
        holding: true,
        waiting: false,
    });
    let waiting = Some(Resume {
        holding: false,
        waiting: true,
    });
    s.register(
        0,
        2,
        ClientInfo::default(),
        usage(700 * MIB, 700 * MIB),
        holding,
    );
    let outs = s.register(
        SEC / 10,
        3,
        ClientInfo::default(),
        usage(700 * MIB, 0),
        waiting,
    );
    assert_eq!(granted(&outs, 3), None, "{outs:?}");
    assert_eq!(s.holders(), vec![2]);
    assert_eq!(s.queue(), vec![3]);
}

fn revoked(outs: &[Output], to: ClientId) -> bool {
    sent(outs, to)
        .iter()
        .any(|m| matches!(m, ArbiterMsg::Revoked { .. }))
}

const HOLDING: Option<Resume> = Some(Resume {
    holding: true,
    waiting: false,
});

#[test]
fn claim_to_hold_after_the_window_is_refused_and_queued() {
    // Long after the arbiter started: A holds, B waits; H says it holds.
    let t = 60 * SEC;
    let mut s = sched(1000 * MIB, 30_000, 5_000);
    reg(&mut s, t, 1, 700 * MIB);
    reg(&mut s, t, 2, 700 * MIB);
    s.request(t, 1);
    s.request(t, 2);
    let outs = s.register(t, 3, ClientInfo::default(), usage(700 * MIB, 0), HOLDING);
    assert!(revoked(&outs, 3), "H is told it holds nothing: {outs:?}");
    assert_eq!(granted(&outs, 3), None);
    assert_eq!(s.holders(), vec![1]);
    assert_eq!(s.queue(), vec![2, 3], "H queues behind the honest waiter");
    assert!(dropped(&outs, 1).is_none(), "the holder is not disturbed");
}

#[test]
fn claim_to_hold_after_an_own_grant_is_refused() {
    // Inside the window, but the scheduler already granted the GPU itself.
    let mut s = sched(1000 * MIB, 30_000, 5_000);
    reg(&mut s, 0, 1, 700 * MIB);
    assert!(granted(&s.request(0, 1), 1).is_some());
    let outs = s.register(
        SEC / 10,
        2,
        ClientInfo::default(),
        usage(700 * MIB, 0),
        HOLDING,
    );
    assert!(revoked(&outs, 2), "{outs:?}");
    assert_eq!(s.holders(), vec![1]);
    assert_eq!(s.queue(), vec![2]);
    // The refused claimant is granted in turn, like anyone else.
    let outs = s.release(SEC, 1, usage(700 * MIB, 0));
    assert_eq!(granted(&outs, 2), Some(true));
}

#[test]
fn refused_claim_on_an_idle_gpu_is_granted_at_once() {
    // A real holder that came back too late loses nothing when nobody else wants it.
    let mut s = sched(1000 * MIB, 30_000, 5_000).with_resume_window(SEC);
    let outs = s.register(
        2 * SEC,
        1,
        ClientInfo::default(),
        usage(700 * MIB, 700 * MIB),
        HOLDING,
    );
    assert!(revoked(&outs, 1));
    assert!(granted(&outs, 1).is_some());
    assert_eq!(s.holders(), vec![1]);
}

#[test]
fn a_late_resume_does_not_hold_back_waiters() {
    // The post-restart quiet period exists only inside the window.
    let t = 60 * SEC;
    let mut s = sched(1000 * MIB, 30_000, 5_000);
    reg(&mut s, t, 1, 700 * MIB);
    let waiting = Some(Resume {
        holding: false,
        waiting: true,
    });
    s.register(t, 2, ClientInfo::default(), usage(700 * MIB, 0), waiting);
    assert_eq!(s.holders(), vec![2], "granted at once, no quiet period");
}

#[test]
fn re_registering_as_holder_does_not_starve_a_waiter() {
    // H re-registers with `holding` each time it is revoked; the honest waiter B is
    // granted within TQ + grace of asking, and H never holds next to another holder.
    let (tq, grace) = (1_000, 300);
    let t0 = 60 * SEC;
    let mut s = sched(1000 * MIB, tq, grace);
    reg(&mut s, t0, 1, 700 * MIB);
    s.request(t0, 1);
    reg(&mut s, t0, 2, 700 * MIB);
    s.request(t0, 2);
    let mut h = 3;
    let mut now = t0;
    let mut b_granted = None;
    while now < t0 + 10 * SEC && b_granted.is_none() {
        now += 10 * MS;
        let mut outs = s.tick(now);
        // A obeys drops at once; H re-registers as a holder whenever revoked.
        if dropped(&outs, 1).is_some() {
            outs.extend(s.release(now, 1, usage(700 * MIB, 0)));
        }
        if revoked(&outs, h) || s.holders().is_empty() || now == t0 + 10 * MS {
            s.exit(now, h);
            h += 1;
            outs.extend(s.register(
                now,
                h,
                ClientInfo::default(),
                usage(700 * MIB, 700 * MIB),
                HOLDING,
            ));
        }
        if granted(&outs, 2).is_some() {
            b_granted = Some(now);
        }
        let holders = s.holders();
        assert!(
            !(holders.len() > 1 && holders.contains(&h)),
            "H holds next to another holder: {holders:?}"
        );
    }
    let waited = b_granted.expect("B granted") - t0;
    assert!(
        waited <= ms_to_ns(tq + grace) + 20 * MS,
        "B waited {} ms",
        waited / MS
    );
}

fn reg_named(s: &mut GpuScheduler, now: Nanos, id: ClientId, ws: u64, pod: &str, wait_info: bool) {
    let info = ClientInfo {
        pod_name: Some(pod.into()),
        wait_info,
        ..ClientInfo::default()
    };
    s.register(now, id, info, usage(ws, 0), None);
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

fn all_waiting(outs: &[Output]) -> usize {
    outs.iter()
        .filter(|o| matches!(o, Output::Send(_, ArbiterMsg::Waiting { .. })))
        .count()
}

#[test]
fn waiters_hear_who_holds_their_place_and_the_quantum_once_per_change() {
    let mut s = sched(1000 * MIB, 30_000, 5_000);
    reg_named(&mut s, 0, 1, 700 * MIB, "nb-a", true);
    reg_named(&mut s, 0, 2, 700 * MIB, "nb-b", true);
    reg_named(&mut s, 0, 3, 700 * MIB, "nb-c", true);
    let outs = s.request(SEC, 1);
    assert_eq!(granted(&outs, 1), Some(true));
    assert!(
        waiting(&outs, 1).is_empty(),
        "a holder is not told it waits"
    );
    // B starts waiting: told at once, with A's quantum end (TQ 30 s from t = 1 s).
    let outs = s.request(2 * SEC, 2);
    assert_eq!(
        waiting(&outs, 2),
        vec![(Some("nb-a".into()), 0, Some(29_000))]
    );
    // C queues behind B; B's view did not change: only C hears.
    let outs = s.request(3 * SEC, 3);
    assert_eq!(
        waiting(&outs, 3),
        vec![(Some("nb-a".into()), 1, Some(28_000))]
    );
    assert_eq!(all_waiting(&outs), 1);
    // Steps that change nothing the waiters see tell nobody anything.
    let outs = s.usage(4 * SEC, 1, usage(700 * MIB, 700 * MIB));
    assert_eq!(all_waiting(&outs), 0);
    let outs = s.request(5 * SEC, 2);
    assert_eq!(all_waiting(&outs), 0);
    // The quantum ends: A is dropped; its quantum end did not move, nobody is told.
    let outs = s.tick(31 * SEC);
    assert!(dropped(&outs, 1).is_some());
    assert_eq!(all_waiting(&outs), 0);
    // A gives the GPU back: B holds, C is next, with B's whole quantum ahead.
    let outs = s.release(32 * SEC, 1, usage(700 * MIB, 0));
    assert_eq!(granted(&outs, 2), Some(true));
    assert!(waiting(&outs, 2).is_empty());
    assert_eq!(
        waiting(&outs, 3),
        vec![(Some("nb-b".into()), 0, Some(30_000))]
    );
    // A asks again: told it is behind C.
    let outs = s.request(33 * SEC, 1);
    assert_eq!(
        waiting(&outs, 1),
        vec![(Some("nb-b".into()), 1, Some(29_000))]
    );
    // A TQ change moves the quantum's end: both waiters hear it once.
    let outs = s.set_tq(34 * SEC, 60_000);
    assert_eq!(
        waiting(&outs, 3),
        vec![(Some("nb-b".into()), 0, Some(58_000))]
    );
    assert_eq!(
        waiting(&outs, 1),
        vec![(Some("nb-b".into()), 1, Some(58_000))]
    );
}

#[test]
fn waiting_goes_only_to_clients_that_asked() {
    let mut s = sched(1000 * MIB, 30_000, 5_000);
    reg_named(&mut s, 0, 1, 700 * MIB, "nb-a", false);
    reg_named(&mut s, 0, 2, 700 * MIB, "nb-b", false);
    s.request(SEC, 1);
    let outs = s.request(2 * SEC, 2);
    assert_eq!(all_waiting(&outs), 0, "an old shim would not decode it");
    // A program name stands in for a missing pod name.
    let info = ClientInfo {
        name: Some("train.py".into()),
        wait_info: true,
        ..ClientInfo::default()
    };
    s.register(3 * SEC, 3, info, usage(700 * MIB, 0), None);
    let outs = s.request(3 * SEC, 3);
    assert_eq!(
        waiting(&outs, 3),
        vec![(Some("nb-a".into()), 1, Some(28_000))]
    );
    s.release(4 * SEC, 1, usage(700 * MIB, 0));
    s.exit(5 * SEC, 2);
    // B left: 3 holds now (granted on B's exit); 1 asks and is told nothing.
    let outs = s.request(6 * SEC, 1);
    assert_eq!(all_waiting(&outs), 0, "1 did not ask");
    assert_eq!(s.holders(), vec![3]);
    // A newcomer that asked hears 3's program name (it has no pod name).
    reg_named(&mut s, 7 * SEC, 4, 700 * MIB, "nb-d", true);
    let outs = s.request(7 * SEC, 4);
    assert_eq!(
        waiting(&outs, 4),
        vec![(Some("train.py".into()), 1, Some(28_000))]
    );
}

#[test]
fn a_thousand_waiters_cost_one_message_each_per_hand_off_and_none_otherwise() {
    let n = 1000u64;
    let mut s = sched(1000 * MIB, 1_000, 5_000);
    for id in 0..=n {
        reg_named(&mut s, 0, id, 700 * MIB, &format!("p{id}"), true);
    }
    let mut total = 0;
    for id in 0..=n {
        total += all_waiting(&s.request(SEC, id));
    }
    // Each newcomer hears once; nobody ahead of it is told again.
    assert_eq!(total, n as usize);
    // A usage change of the holder (or anything else the waiters do not see): nothing.
    assert_eq!(
        all_waiting(&s.usage(SEC + 1, 0, usage(700 * MIB, 700 * MIB))),
        0
    );
    for id in 1..=n {
        assert_eq!(all_waiting(&s.request(SEC + 2, id)), 0);
    }
    // The hand-off: every remaining waiter moves up one place, one message each.
    let outs = s.tick(2 * SEC);
    assert!(dropped(&outs, 0).is_some());
    assert_eq!(all_waiting(&outs), 0, "the quantum's end did not move");
    let outs = s.release(2 * SEC + 1, 0, usage(700 * MIB, 0));
    assert_eq!(granted(&outs, 1), Some(true));
    assert_eq!(all_waiting(&outs), n as usize - 1);
    // One waiter in the middle gives up: only those behind it move.
    let outs = s.release(2 * SEC + 2, 500, usage(700 * MIB, 0));
    assert_eq!(all_waiting(&outs), (n - 500) as usize);
}

// ---- memory no swap frees (#13) ----------------------------------------------

/// A 4 GiB GPU with the default reserve (1/8: 512 MiB).
fn sched_4g() -> GpuScheduler {
    GpuScheduler::new(
        4096 * MIB,
        3584 * MIB,
        Settings {
            scheduler_on: true,
            tq_ms: 1_000,
        },
        500,
    )
}

fn reg_unswappable(s: &mut GpuScheduler, now: Nanos, id: ClientId, ws: u64, fixed: Option<u64>) {
    let info = ClientInfo {
        unswappable: fixed,
        ..ClientInfo::default()
    };
    s.register(now, id, info, usage(ws, 0), None);
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

/// Four 768 MiB programs with 300 MiB contexts on 4 GiB: their working sets fit in
/// total − reserve (3072 ≤ 3584 MiB), but not next to their contexts (3072 + 1200 >
/// 4096). Counting the contexts, they take turns; not counting them, all four were
/// granted at once and the last allocations ran out of GPU memory.
#[test]
fn working_sets_fit_only_next_to_every_clients_unswappable_memory() {
    let mut s = sched_4g();
    for id in 1..=4 {
        reg_unswappable(&mut s, 0, id, 768 * MIB, Some(300 * MIB));
    }
    assert_eq!(s.fixed(), 1200 * MIB);
    assert_eq!(s.room(), 2896 * MIB);
    assert!(!s.fits());
    assert_eq!(granted(&s.request(1, 1), 1), Some(true));
    assert_eq!(granted(&s.request(2, 2), 2), None, "B waits");
    // The same clients without reports: the reserve alone, and they all share.
    let mut old = sched_4g();
    for id in 1..=4 {
        reg_unswappable(&mut old, 0, id, 768 * MIB, None);
    }
    assert_eq!(old.fixed(), 512 * MIB, "the reserve");
    assert!(old.fits());
    // A context reported later counts from then on.
    let mut s = sched_4g();
    reg_unswappable(&mut s, 0, 1, 1700 * MIB, Some(0));
    reg_unswappable(&mut s, 0, 2, 1700 * MIB, Some(0));
    assert!(s.fits(), "3400 ≤ 4096: every client reports, no reserve");
    s.unswappable(1, 1, 400 * MIB);
    assert!(s.fits(), "3400 + 400 ≤ 4096");
    s.unswappable(2, 2, 400 * MIB);
    assert!(!s.fits(), "3400 + 800 > 4096: the reports pass the reserve");
    assert_eq!(s.swap_need(), 104 * MIB);
}

/// With every client reporting its memory no swap frees, the reports are the truth:
/// the context reserve (a floor for clients that predate the report) no longer
/// counts, so the room is the GPU less the reports (issue #24: a process can
/// allocate what it could without Kiwi). One client that does not report brings the
/// reserve back.
#[test]
fn reports_replace_the_reserve_unless_a_client_does_not_report() {
    let mut s = GpuScheduler::new(
        1024 * MIB,
        896 * MIB,
        Settings {
            scheduler_on: true,
            tq_ms: 1_000,
        },
        500,
    );
    reg_unswappable(&mut s, 0, 1, 400 * MIB, Some(48 * MIB));
    reg_unswappable(&mut s, 0, 2, 400 * MIB, Some(48 * MIB));
    assert_eq!(s.room(), 928 * MIB);
    assert!(s.fits());
    assert_eq!(granted(&s.request(0, 1), 1), Some(false));
    assert_eq!(granted(&s.request(0, 2), 2), Some(false));
    reg_unswappable(&mut s, 0, 3, 0, None);
    assert_eq!(s.room(), 896 * MIB);
}

/// A hand-off's need keeps everybody's unswappable memory on the GPU: the holder
/// must evict enough that the next one's working set fits beside all contexts.
#[test]
fn a_handoffs_need_counts_unswappable_memory() {
    let mut s = sched_4g();
    for id in 1..=4 {
        reg_unswappable(&mut s, 0, id, 768 * MIB, Some(300 * MIB));
    }
    assert_eq!(granted(&s.request(0, 1), 1), Some(true));
    s.usage(0, 1, usage(768 * MIB, 768 * MIB));
    // B, C, D were resident earlier (say they ran while D's context was not counted).
    s.reclaimed(0, 2, usage(768 * MIB, 768 * MIB));
    s.reclaimed(0, 3, usage(768 * MIB, 768 * MIB));
    s.request(1, 4);
    let outs = s.tick(SEC + 1);
    // Resident 3 × 768 + D's 768 = 3072 over a room of 2896 MiB.
    assert_eq!(dropped(&outs, 1), Some(176 * MIB), "{outs:?}");
    let outs = s.release(SEC + 2, 1, usage(768 * MIB, 768 * MIB));
    assert_eq!(granted(&outs, 4), Some(true));
    // A released without evicting: the idle ones make room, least recently active
    // first (B, registered first and never active since).
    assert_eq!(reclaims(&outs, 2), 176 * MIB, "{outs:?}");
}

/// An exclusive holder whose swap-in found no room (a revoked holder's memory still
/// resident, a reclaim answered with less than asked) gets that room reclaimed from
/// idle clients; reclaims already asked are not asked twice.
#[test]
fn a_holder_short_of_room_gets_it_reclaimed() {
    let mut s = sched_4g();
    reg_unswappable(&mut s, 0, 1, 2000 * MIB, Some(300 * MIB));
    reg_unswappable(&mut s, 0, 2, 2000 * MIB, Some(300 * MIB));
    assert_eq!(granted(&s.request(0, 1), 1), Some(true));
    s.usage(0, 1, usage(2000 * MIB, 2000 * MIB));
    s.request(1, 2);
    let outs = s.tick(SEC + 1);
    assert!(dropped(&outs, 1).is_some());
    // A never answers: revoked after the grace, its memory still resident. B gets
    // the GPU and A is asked to reclaim what B lacks: 2000 + 2000 − 3496.
    let outs = s.tick(SEC + 1 + 500 * MS);
    assert!(sent(&outs, 1)
        .iter()
        .any(|m| matches!(m, ArbiterMsg::Revoked { .. })));
    assert_eq!(granted(&outs, 2), Some(true));
    assert_eq!(reclaims(&outs, 1), 504 * MIB, "{outs:?}");
    // Nothing asked twice while that reclaim is pending.
    let outs = s.usage(SEC + 2, 2, usage(2000 * MIB, 1000 * MIB));
    assert_eq!(reclaims(&outs, 1), 0, "{outs:?}");
    // A evicted only 200 MiB: B is still short, and A is asked for the rest.
    let outs = s.reclaimed(SEC + 3, 1, usage(2000 * MIB, 1800 * MIB));
    assert_eq!(reclaims(&outs, 1), 304 * MIB, "{outs:?}");
    let outs = s.reclaimed(SEC + 4, 1, usage(2000 * MIB, 1496 * MIB));
    assert_eq!(reclaims(&outs, 1), 0, "room made: {outs:?}");
    s.usage(SEC + 5, 2, usage(2000 * MIB, 2000 * MIB));
    assert!(s.holds_exclusive(2));
}

/// A holder that grows its memory 20 MiB at a time beside an idle client's (PyTorch's
/// expandable segments) gets room reclaimed in batches that double within its hold,
/// up to 1/16 of the GPU, not one reclaim per piece; its next hold starts over.
#[test]
fn a_growing_holder_gets_room_reclaimed_in_doubling_batches() {
    let mut s = sched_4g();
    reg_unswappable(&mut s, 0, 1, 3480 * MIB, Some(300 * MIB));
    reg_unswappable(&mut s, 0, 2, 20 * MIB, Some(300 * MIB));
    // The idle client: all in, not asking.
    assert_eq!(granted(&s.request(0, 1), 1), Some(true));
    s.usage(0, 1, usage(3480 * MIB, 3480 * MIB));
    s.release(1, 1, usage(3480 * MIB, 3480 * MIB));
    assert_eq!(granted(&s.request(2, 2), 2), Some(true));
    // The room: 4096 − 600 of contexts. The client grows to 2000 MiB, 20 at a
    // time; every reclaim is answered at once.
    let (mut ws, mut res1, mut asked) = (20 * MIB, 3480 * MIB, Vec::new());
    let mut t = 3;
    while ws < 2000 * MIB {
        ws += 20 * MIB;
        t += 1;
        let free = ((4096 - 600) * MIB).saturating_sub(res1 + ws - 20 * MIB);
        let resident = if free >= 20 * MIB { ws } else { ws - 20 * MIB };
        let mut ask = reclaims(&s.usage(t, 2, usage(ws, resident)), 1);
        while ask > 0 {
            asked.push(ask / MIB);
            res1 -= ask.min(res1);
            ask = reclaims(&s.reclaimed(t, 1, usage(3480 * MIB, res1)), 1);
            ask += reclaims(&s.usage(t, 2, usage(ws, ws)), 1);
        }
    }
    // 2000 − (3496 − 3480) MiB had to leave: 20, 20, 40, 80, 160, then 256 a time.
    assert_eq!(asked[..5], [20, 20, 40, 80, 160], "{asked:?}");
    assert!(asked[5..].iter().all(|&a| a == 256), "{asked:?}");
    assert!(asked.len() <= 13, "{} reclaims: {asked:?}", asked.len());
    // Its next hold starts from the piece again.
    s.release(t + 1, 2, usage(ws, ws));
    assert_eq!(granted(&s.request(t + 2, 2), 2), Some(true));
    let outs = s.usage(t + 3, 2, usage(ws + 20 * MIB, ws));
    assert!(reclaims(&outs, 1) <= 40 * MIB, "{outs:?}");
}

/// A report past the GPU's size (a lie or a bug) counts as the whole GPU, no more:
/// the figures status shows stay within the GPU and no sum overflows.
#[test]
fn an_unswappable_report_past_the_gpu_counts_as_the_whole_gpu() {
    let mut s = GpuScheduler::new(
        1024 * MIB,
        896 * MIB,
        Settings {
            scheduler_on: true,
            tq_ms: 1_000,
        },
        500,
    );
    reg_unswappable(&mut s, 0, 1, 100 * MIB, Some(u64::MAX));
    assert_eq!(s.fixed(), 1024 * MIB);
    s.unswappable(0, 1, u64::MAX - 1);
    reg_unswappable(&mut s, 0, 2, 100 * MIB, Some(u64::MAX));
    assert_eq!(s.fixed(), 1024 * MIB, "clamped to the GPU");
    assert_eq!(s.room(), 0);
    assert!(!s.fits());
}

// ---- pipelined hand-offs, pressure, idle eviction (#15) ------------------------

fn reg_pipelined(s: &mut GpuScheduler, now: Nanos, id: ClientId, ws: u64, pipelined: bool) {
    let info = ClientInfo {
        pipelined,
        ..ClientInfo::default()
    };
    s.register(now, id, info, usage(ws, 0), None);
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

fn error_to(outs: &[Output], to: ClientId) -> Option<String> {
    sent(outs, to).iter().find_map(|m| match m {
        ArbiterMsg::Error { message, .. } => Some(message.clone()),
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

/// A (700 MiB) holds 1000 MiB, B (700 MiB) waits; A's TQ ends and it is dropped with
/// 400 MiB to evict. Returns the scheduler at A's drop (`t`).
fn dropped_a(a_pipelined: bool, b_pipelined: bool) -> (GpuScheduler, Nanos) {
    let mut s = sched(1000 * MIB, 1_000, 500);
    reg_pipelined(&mut s, 0, 1, 700 * MIB, a_pipelined);
    reg_pipelined(&mut s, 0, 2, 700 * MIB, b_pipelined);
    assert_eq!(granted(&s.request(0, 1), 1), Some(true));
    s.usage(0, 1, usage(700 * MIB, 700 * MIB));
    s.request(MS, 2);
    let t = SEC;
    assert_eq!(dropped(&s.tick(t), 1), Some(400 * MIB));
    (s, t)
}

#[test]
fn drained_grants_the_next_pipelined_client_before_the_release() {
    let (mut s, t) = dropped_a(true, true);
    let outs = s.drained(t + MS, 1);
    assert_eq!(grant_msg(&outs, 2), Some((true, true)), "{outs:?}");
    // What A's drop frees is what B lacks: nobody is asked to reclaim more.
    assert_eq!(reclaims(&outs, 1), 0, "{outs:?}");
    assert_eq!(s.holders(), vec![2]);
    assert!(matches!(
        logged(&outs).as_slice(),
        [(
            Some(2),
            EventKind::Grant {
                exclusive: true,
                ..
            }
        )]
    ));
    // A's release still comes, with its usage, and is taken: no second grant.
    let outs = s.release(t + 200 * MS, 1, usage(700 * MIB, 300 * MIB));
    assert_eq!(grant_msg(&outs, 2), None);
    assert!(matches!(
        logged(&outs).as_slice(),
        [(Some(1), EventKind::Release { early: false, resident_bytes })] if *resident_bytes == 300 * MIB
    ));
    assert_eq!(s.holders(), vec![2]);
    let st = s.status(t + 300 * MS, 0, "GPU-0");
    let a = st.clients.iter().find(|c| c.id == 1).unwrap();
    assert_eq!(a.resident_bytes, 300 * MIB);
    assert_eq!(a.state, ClientState::Idle);
    // B's quantum runs from its pipelined grant.
    s.request(t + 300 * MS, 1);
    assert_eq!(s.next_deadline(), Some(t + MS + SEC));
}

#[test]
fn drained_waits_for_the_release_when_the_next_client_is_not_pipelined() {
    let (mut s, t) = dropped_a(true, false);
    let outs = s.drained(t + MS, 1);
    assert_eq!(grant_msg(&outs, 2), None, "{outs:?}");
    assert!(s.holders().is_empty());
    let outs = s.release(t + 200 * MS, 1, usage(700 * MIB, 300 * MIB));
    assert_eq!(grant_msg(&outs, 2), Some((true, false)), "{outs:?}");
}

#[test]
fn a_bad_drained_is_an_error_reply_and_never_a_grant() {
    // From a client that did not register `pipelined`.
    let (mut s, t) = dropped_a(false, true);
    let outs = s.drained(t + MS, 1);
    assert!(error_to(&outs, 1)
        .unwrap()
        .contains("did not register with `pipelined`"));
    assert_eq!(grant_msg(&outs, 2), None);
    assert_eq!(s.holders(), vec![1], "nothing changed");
    assert!(logged(&outs).is_empty());

    // From a holder that was not dropped and that nobody waits for (an early release
    // that crossed the waiter's going): ignored, no error, its release follows. From
    // a waiter: refused.
    let mut s = sched(1000 * MIB, 1_000, 500);
    reg_pipelined(&mut s, 0, 1, 700 * MIB, true);
    reg_pipelined(&mut s, 0, 2, 700 * MIB, true);
    s.request(0, 1);
    assert!(s.drained(MS, 1).is_empty());
    assert_eq!(s.holders(), vec![1], "still holding");
    s.request(MS, 2);
    let outs = s.drained(2 * MS, 2);
    assert!(
        error_to(&outs, 2).unwrap().contains("does not hold"),
        "{outs:?}"
    );
    assert_eq!(grant_msg(&outs, 2), None);
    assert!(s.drained(2 * MS, 99).is_empty(), "unknown client: nothing");

    // Twice: the second is refused and grants nobody else.
    let (mut s, t) = dropped_a(true, true);
    reg_pipelined(&mut s, t, 3, 700 * MIB, true);
    s.request(t, 3);
    assert_eq!(grant_msg(&s.drained(t + MS, 1), 2), Some((true, true)));
    let outs = s.drained(t + 2 * MS, 1);
    assert!(error_to(&outs, 1).unwrap().contains("already"), "{outs:?}");
    assert_eq!(grant_msg(&outs, 3), None);
    assert_eq!(s.holders(), vec![2]);
}

#[test]
fn a_drainer_that_never_releases_is_revoked_after_the_grace_and_its_swap_out_time() {
    let (mut s, t) = dropped_a(true, true);
    s.drained(t + MS, 1);
    // A has 700 MiB resident: a swap-out at 1 GB/s may take 734 ms past the grace.
    let allowance = 700 * MIB * SLOWEST_SWAP_OUT_NS_PER_BYTE;
    let end = t + 500 * MS + allowance;
    assert_eq!(
        s.next_deadline(),
        Some(end),
        "the drop's grace and the allowance"
    );
    assert!(
        !revoked(&s.tick(t + 500 * MS), 1),
        "a slow swap-out keeps its turn"
    );
    assert!(!revoked(&s.tick(end - 1), 1));
    let outs = s.tick(end);
    assert!(revoked(&outs, 1), "{outs:?}");
    assert!(logged(&outs)
        .iter()
        .any(|(id, k)| *id == Some(1) && *k == EventKind::Revoke));
    assert!(
        sent(&outs, 1).iter().any(
            |m| matches!(m, ArbiterMsg::Revoked { reason } if reason.contains("within 1234 ms"))
        ),
        "{outs:?}"
    );
    // Its late release is still taken, and changes nothing for B.
    let outs = s.release(end + 100 * MS, 1, usage(700 * MIB, 300 * MIB));
    assert_eq!(grant_msg(&outs, 2), None);
    assert_eq!(s.holders(), vec![2]);
}

#[test]
fn a_drained_that_crossed_the_revocation_is_ignored() {
    // A holder that ignores its drop past the grace is revoked; its `drained` sent
    // meanwhile arrives after: no error (it would land in the application's stderr),
    // and nothing changes. A grant clears it: a later stray `drained` is refused.
    let (mut s, t) = dropped_a(true, true);
    let outs = s.tick(t + 500 * MS);
    assert!(revoked(&outs, 1), "{outs:?}");
    assert_eq!(grant_msg(&outs, 2), Some((true, false)), "{outs:?}");
    let outs = s.drained(t + 501 * MS, 1);
    assert!(outs.is_empty(), "{outs:?}");
    assert_eq!(s.holders(), vec![2]);
    s.request(t + 600 * MS, 1);
    s.release(t + 700 * MS, 2, usage(700 * MIB, 0));
    assert_eq!(s.holders(), vec![1]);
    s.release(t + 800 * MS, 1, usage(700 * MIB, 0));
    let outs = s.drained(t + 900 * MS, 1);
    assert!(
        error_to(&outs, 1).unwrap().contains("does not hold"),
        "{outs:?}"
    );
}

#[test]
fn a_second_drainer_waits_for_the_first_release() {
    // A drains for B; B is dropped at once (TQ 1 ms) and drains for C while A still
    // swaps out: C waits for A's release (one swap-out beside a swap-in at most).
    let mut s = sched(1000 * MIB, 1, 5_000);
    for id in 1..=3 {
        reg_pipelined(&mut s, 0, id, 700 * MIB, true);
    }
    s.request(0, 1);
    s.usage(0, 1, usage(700 * MIB, 700 * MIB));
    s.request(0, 2);
    s.request(0, 3);
    assert!(dropped(&s.tick(MS), 1).is_some());
    assert_eq!(grant_msg(&s.drained(MS, 1), 2), Some((true, true)));
    // B's quantum starts once its memory is in.
    s.usage(MS, 2, usage(700 * MIB, 700 * MIB));
    assert!(dropped(&s.tick(2 * MS), 2).is_some());
    let outs = s.drained(2 * MS, 2);
    assert_eq!(grant_msg(&outs, 3), None, "{outs:?}");
    let outs = s.release(3 * MS, 1, usage(700 * MIB, 0));
    assert_eq!(grant_msg(&outs, 3), Some((true, true)), "{outs:?}");
}

fn pressure(outs: &[Output], to: ClientId) -> Vec<bool> {
    sent(outs, to)
        .iter()
        .filter_map(|m| match m {
            ArbiterMsg::Pressure { oversubscribed, .. } => Some(*oversubscribed),
            _ => None,
        })
        .collect()
}

#[test]
fn pipelined_clients_hear_pressure_on_every_change_and_at_registration() {
    let mut s = sched(1000 * MIB, 1_000, 500);
    let outs = s.register(
        0,
        1,
        ClientInfo {
            pipelined: true,
            ..Default::default()
        },
        usage(600 * MIB, 0),
        None,
    );
    assert!(pressure(&outs, 1).is_empty(), "fits: nothing to say");
    // A second client makes the GPU oversubscribed: the pipelined one hears it, the
    // other (which never asked) does not.
    let outs = s.register(MS, 2, ClientInfo::default(), usage(600 * MIB, 0), None);
    assert_eq!(pressure(&outs, 1), vec![true]);
    assert!(pressure(&outs, 2).is_empty());
    // A pipelined client registering now hears it at once, after `registered`.
    let outs = s.register(
        2 * MS,
        3,
        ClientInfo {
            pipelined: true,
            ..Default::default()
        },
        usage(0, 0),
        None,
    );
    let to3 = sent(&outs, 3);
    assert!(matches!(to3[0], ArbiterMsg::Registered { .. }), "{to3:?}");
    assert_eq!(pressure(&outs, 3), vec![true]);
    assert!(pressure(&outs, 1).is_empty(), "no change, no repeat");
    // Shrinking back under the room ends it: within STATE_INTERVAL_NS of the last
    // broadcast it is told when the interval ends.
    let outs = s.usage(3 * MS, 2, usage(100 * MIB, 0));
    assert!(pressure(&outs, 1).is_empty(), "{outs:?}");
    let due = MS + STATE_INTERVAL_NS;
    assert_eq!(s.next_deadline(), Some(due));
    let outs = s.tick(due);
    assert_eq!(pressure(&outs, 1), vec![false]);
    assert_eq!(pressure(&outs, 3), vec![false]);
    // So does the scheduler going off.
    s.usage(due + MS, 2, usage(600 * MIB, 0));
    let outs = s.tick(due + STATE_INTERVAL_NS);
    assert_eq!(pressure(&outs, 1), vec![true]);
    let outs = s.set_scheduler(due + 2 * STATE_INTERVAL_NS, false);
    assert_eq!(pressure(&outs, 1), vec![false]);
}

/// A client flipping its usage across the room thousands of times a second makes
/// the arbiter broadcast `pressure` at most every STATE_INTERVAL_NS, and the last
/// state always follows (issue #27, item 3: 8,000 flips in 0.12 s sent 8,000
/// messages to every pipelined client, and slow readers were disconnected).
#[test]
fn a_usage_storm_sends_pressure_at_most_every_interval_and_the_last_state_follows() {
    let mut s = sched(1000 * MIB, 1_000, 500);
    let pipelined = ClientInfo {
        pipelined: true,
        ..Default::default()
    };
    s.register(0, 1, pipelined, usage(600 * MIB, 0), None);
    // The second client makes the GPU shared: told at once (it fits).
    let mut told = pressure(
        &s.register(0, 2, ClientInfo::default(), usage(100 * MIB, 0), None),
        1,
    );
    assert_eq!(told, vec![false]);
    let mut t = MS;
    for k in 0..8000u64 {
        let ws = if k % 2 == 0 { 600 } else { 100 };
        told.extend(pressure(&s.usage(t, 2, usage(ws * MIB, 0)), 1));
        t += 15_000; // 8,000 flips in 0.12 s
    }
    assert!(told.len() <= 3, "{} broadcasts: {told:?}", told.len());
    // The storm ends on "fits" (the last flip, k odd): told once due, unless that is
    // what was told last.
    if let Some(due) = s.next_deadline() {
        told.extend(pressure(&s.tick(due), 1));
    }
    assert_eq!(told.last(), Some(&false), "{told:?}");
    assert_eq!(s.next_deadline(), None);
}

fn idle_reclaim(outs: &[Output], to: ClientId) -> Option<u64> {
    let sent_bytes = reclaims(outs, to);
    let logged_idle = logged(outs).iter().any(|(id, k)| {
        *id == Some(to) && matches!(k, EventKind::Reclaim { idle: true, need_bytes } if *need_bytes == sent_bytes)
    });
    (sent_bytes > 0 && logged_idle).then_some(sent_bytes)
}

/// A (500 MiB) holds; B (600 MiB, 500 resident) went idle at time 0. 1000 MiB room:
/// oversubscribed, and nobody needed a reclaim so far.
fn idle_b(idle_ms: u64) -> GpuScheduler {
    let mut s = sched(1000 * MIB, 30_000, 500).with_idle_evict(idle_ms);
    reg(&mut s, 0, 1, 500 * MIB);
    reg(&mut s, 0, 2, 600 * MIB);
    s.usage(0, 2, usage(600 * MIB, 500 * MIB));
    let outs = s.request(0, 1);
    assert_eq!(reclaims(&outs, 2), 0, "{outs:?}");
    s.usage(0, 1, usage(500 * MIB, 500 * MIB));
    s
}

#[test]
fn an_idle_resident_client_is_evicted_when_oversubscribed() {
    let mut s = idle_b(1_000);
    assert_eq!(s.next_deadline(), Some(SEC));
    assert_eq!(idle_reclaim(&s.tick(SEC - 1), 2), None);
    let outs = s.tick(SEC);
    assert_eq!(idle_reclaim(&outs, 2), Some(500 * MIB), "{outs:?}");
    // Asked once: no repeat while its answer is on the way.
    assert_eq!(idle_reclaim(&s.tick(3 * SEC), 2), None);
    assert!(s.next_deadline().is_none_or(|d| d > 3 * SEC));
    let outs = s.reclaimed(3 * SEC, 2, usage(600 * MIB, 0));
    assert_eq!(idle_reclaim(&outs, 2), None);
    let st = s.status(4 * SEC, 0, "GPU-0");
    let b = st.clients.iter().find(|c| c.id == 2).unwrap();
    assert_eq!((b.resident_bytes, b.swapped_bytes), (0, 600 * MIB));
    assert_eq!(b.idle_since_ns, Some(0));
    let a = st.clients.iter().find(|c| c.id == 1).unwrap();
    assert_eq!(a.idle_since_ns, None, "a holder is not idle");
    // B asks later: it is granted after A and pays only its own swap-in (nobody
    // else is asked to reclaim for it once A gives the GPU back).
    s.request(5 * SEC, 2);
    let outs = s.release(6 * SEC, 1, usage(500 * MIB, 400 * MIB));
    assert_eq!(grant_msg(&outs, 2), Some((true, false)));
    assert_eq!(reclaims(&outs, 1), 0, "{outs:?}");
}

#[test]
fn no_idle_eviction_when_it_fits_when_off_or_for_a_recent_client() {
    // Off.
    let mut s = idle_b(0);
    assert_eq!(s.next_deadline(), None);
    assert_eq!(idle_reclaim(&s.tick(100 * SEC), 2), None);
    // Fits: B shrinks to 400 MiB.
    let mut s = idle_b(1_000);
    s.usage(0, 2, usage(400 * MIB, 400 * MIB));
    assert!(s.fits());
    // The end of the pressure is told when its interval ends; then nothing is due.
    assert_eq!(s.next_deadline(), Some(STATE_INTERVAL_NS));
    s.tick(STATE_INTERVAL_NS);
    assert_eq!(s.next_deadline(), None);
    assert_eq!(idle_reclaim(&s.tick(100 * SEC), 2), None);
    // Active: B changed its memory at 0.9 s: its idle time starts again.
    let mut s = idle_b(1_000);
    s.usage(900 * MS, 2, usage(600 * MIB, 450 * MIB));
    assert_eq!(idle_reclaim(&s.tick(SEC), 2), None);
    assert_eq!(s.next_deadline(), Some(1_900 * MS));
    // Waiting clients are not idle.
    let mut s = idle_b(1_000);
    s.request(0, 2);
    assert_eq!(idle_reclaim(&s.tick(100 * SEC), 2), None);
}

#[test]
fn idle_eviction_waits_for_a_free_link_and_goes_one_at_a_time() {
    // C (100 MiB, resident) went idle at 0.1 s, after B.
    let mut s = idle_b(1_000);
    reg(&mut s, 0, 3, 100 * MIB);
    s.usage(100 * MS, 3, usage(100 * MIB, 100 * MIB));
    s.set_tq(0, 1_000);

    // 1) A hand-off under way (D waits, A is dropped at its TQ): no eviction until
    // A's release ends it.
    let mut busy = s.clone();
    reg(&mut busy, 0, 4, 100 * MIB);
    busy.request(0, 4);
    let outs = busy.tick(SEC);
    assert!(dropped(&outs, 1).is_some(), "{outs:?}");
    assert_eq!(idle_reclaim(&outs, 2), None, "a drop is outstanding");
    assert_eq!(idle_reclaim(&busy.tick(SEC + 100 * MS), 2), None);
    // D's grant needs 100 MiB reclaimed (from B, least recently active): that
    // reclaim keeps the link busy until B answers it; then the rest of B goes.
    let outs = busy.release(SEC + 200 * MS, 1, usage(500 * MIB, 400 * MIB));
    assert_eq!(grant_msg(&outs, 4), Some((true, false)));
    assert_eq!(reclaims(&outs, 2), 100 * MIB);
    assert_eq!(idle_reclaim(&outs, 2), None, "{outs:?}");
    let outs = busy.reclaimed(SEC + 250 * MS, 2, usage(600 * MIB, 400 * MIB));
    assert_eq!(idle_reclaim(&outs, 2), Some(400 * MIB), "{outs:?}");

    // 2) One at a time, least recently seen first: B (seen at 0), then C (0.1 s)
    // once B answers.
    let outs = s.tick(SEC);
    assert_eq!(idle_reclaim(&outs, 2), Some(500 * MIB));
    assert_eq!(idle_reclaim(&outs, 3), None);
    let outs = s.reclaimed(SEC + 50 * MS, 2, usage(600 * MIB, 0));
    assert_eq!(idle_reclaim(&outs, 3), None, "C is idle for 1 s at 1.1 s");
    assert!(!s.fits());
    assert_eq!(s.next_deadline(), Some(1_100 * MS));
    assert_eq!(idle_reclaim(&s.tick(1_100 * MS), 3), Some(100 * MIB));
}

#[test]
fn an_unanswered_idle_reclaim_blocks_the_link_only_for_the_grace() {
    let mut s = idle_b(1_000);
    reg(&mut s, 0, 3, 100 * MIB);
    s.usage(0, 3, usage(100 * MIB, 100 * MIB));
    s.usage(0, 2, usage(600 * MIB, 599 * MIB));
    let outs = s.tick(SEC);
    // B and C were both seen at 0: the lower id goes first.
    assert_eq!(idle_reclaim(&outs, 2), Some(599 * MIB));
    // B never answers: C is asked once the grace (500 ms) has passed.
    assert_eq!(s.next_deadline(), Some(SEC + 500 * MS));
    assert_eq!(idle_reclaim(&s.tick(SEC + 499 * MS), 3), None);
    assert_eq!(idle_reclaim(&s.tick(SEC + 500 * MS), 3), Some(100 * MIB));
    assert_eq!(s.next_deadline(), None, "nothing left to evict");
}

#[test]
fn a_pipelined_holders_quantum_starts_when_its_memory_is_in() {
    // TQ 100 ms, grace 1 s: B's swap-in takes 300 ms, longer than a quantum. Counted
    // from the grant, B would be dropped before doing any work.
    let mut s = sched(1000 * MIB, 100, 1_000);
    reg_pipelined(&mut s, 0, 1, 700 * MIB, true);
    reg_pipelined(&mut s, 0, 2, 700 * MIB, true);
    s.request(0, 1);
    s.usage(0, 1, usage(700 * MIB, 700 * MIB));
    s.request(0, 2);
    assert!(dropped(&s.tick(100 * MS), 1).is_some());
    assert_eq!(grant_msg(&s.drained(110 * MS, 1), 2), Some((true, true)));
    s.release(150 * MS, 1, usage(700 * MIB, 0));
    s.request(150 * MS, 1);
    // Still swapping in at the grant + TQ: not dropped.
    assert!(dropped(&s.tick(210 * MS), 2).is_none());
    assert_eq!(s.next_deadline(), Some(110 * MS + 1_000 * MS));
    // In at 410 ms: a whole quantum from then.
    s.swapped(
        410 * MS,
        2,
        kiwi_protocol::SwapDirection::In,
        700 * MIB,
        300 * MS,
    );
    assert_eq!(s.next_deadline(), Some(510 * MS));
    assert!(dropped(&s.tick(500 * MS), 2).is_none());
    assert!(dropped(&s.tick(510 * MS), 2).is_some());
}

#[test]
fn a_holder_that_never_reports_its_memory_in_is_dropped_after_the_grace() {
    // Whatever it reports (or not), a holder holds at most max(TQ, grace) + TQ.
    let mut s = sched(1000 * MIB, 100, 1_000);
    reg_pipelined(&mut s, 0, 1, 700 * MIB, true);
    reg_pipelined(&mut s, 0, 2, 700 * MIB, true);
    s.request(0, 1);
    s.request(0, 2);
    assert!(dropped(&s.tick(999 * MS), 1).is_none());
    assert!(dropped(&s.tick(1_000 * MS), 1).is_some());
    // A report after its wait ran out does not start a new quantum.
    let mut s = sched(1000 * MIB, 100, 1_000);
    reg_pipelined(&mut s, 0, 1, 700 * MIB, true);
    reg_pipelined(&mut s, 0, 2, 700 * MIB, true);
    s.request(0, 1);
    s.request(0, 2);
    s.usage(900 * MS, 1, usage(700 * MIB, 700 * MIB));
    assert!(dropped(&s.tick(1_000 * MS), 1).is_some());
}

#[test]
fn a_client_that_does_not_report_swaps_has_its_quantum_from_the_grant() {
    let mut s = sched(1000 * MIB, 100, 1_000);
    reg_pipelined(&mut s, 0, 1, 700 * MIB, false);
    reg_pipelined(&mut s, 0, 2, 700 * MIB, false);
    s.request(0, 1);
    s.request(0, 2);
    assert!(dropped(&s.tick(100 * MS), 1).is_some());
}

#[test]
fn a_client_with_nothing_swapped_out_is_granted_at_the_release_not_at_drained() {
    // B has no memory out (nothing allocated yet, it wants to run work): granted
    // beside A's swap-out, its gate would open at once and its first allocations meet
    // a GPU still full of A's memory.
    let mut s = sched(1000 * MIB, 1, 5_000);
    reg_pipelined(&mut s, 0, 1, 700 * MIB, true);
    reg_pipelined(&mut s, 0, 2, 0, true);
    reg_pipelined(&mut s, 0, 3, 700 * MIB, true);
    s.request(0, 1);
    s.usage(0, 1, usage(700 * MIB, 700 * MIB));
    s.request(0, 2);
    assert!(dropped(&s.tick(2 * MS), 1).is_some());
    let outs = s.drained(2 * MS, 1);
    assert_eq!(grant_msg(&outs, 2), None, "{outs:?}");
    let outs = s.release(3 * MS, 1, usage(700 * MIB, 0));
    assert_eq!(grant_msg(&outs, 2), Some((true, false)), "{outs:?}");
}

#[test]
fn an_early_release_that_says_drained_hands_over_at_once_and_is_logged_early() {
    // A holder idle while B waits releases early; saying `drained` first, B (memory
    // to swap in) is granted beside its swap-out, and its release is an early one.
    let mut s = sched(1000 * MIB, 60_000, 500);
    reg_pipelined(&mut s, 0, 1, 700 * MIB, true);
    reg_pipelined(&mut s, 0, 2, 700 * MIB, true);
    s.request(0, 1);
    s.usage(0, 1, usage(700 * MIB, 700 * MIB));
    s.request(MS, 2);
    let outs = s.drained(2 * MS, 1);
    assert_eq!(grant_msg(&outs, 2), Some((true, true)), "{outs:?}");
    let outs = s.release(3 * MS, 1, usage(700 * MIB, 0));
    assert!(
        logged(&outs)
            .iter()
            .any(|(_, k)| matches!(k, EventKind::Release { early: true, .. })),
        "{outs:?}"
    );
    // Its grace runs from the `drained`, as from a drop.
    let mut s = sched(1000 * MIB, 60_000, 500);
    reg_pipelined(&mut s, 0, 1, 700 * MIB, true);
    reg_pipelined(&mut s, 0, 2, 700 * MIB, true);
    s.request(0, 1);
    s.request(MS, 2);
    s.drained(2 * MS, 1);
    assert_eq!(s.next_deadline(), Some(502 * MS));
}

fn reclaimed_bytes(outs: &[Output], to: ClientId) -> Option<u64> {
    sent(outs, to).iter().find_map(|m| match m {
        ArbiterMsg::Reclaim { need_bytes } => Some(*need_bytes),
        _ => None,
    })
}

/// Memory the scheduler cannot see (a process outside Kiwi holds 300 MiB of this
/// 1000 MiB GPU): B, granted with room for all 700 MiB as far as the scheduler knows,
/// finds room for only 400. Its `no_room` makes A (released, 700 MiB resident)
/// evict what B lacks, and from then on the 300 MiB count as fixed, so the next
/// drop asks for enough at once; forgotten after UNSEEN_TTL_NS.
#[test]
fn no_room_reclaims_what_the_holder_lacks_and_counts_the_unseen_memory() {
    let mut s = sched(1000 * MIB, 1_000, 500);
    reg(&mut s, 0, 1, 700 * MIB);
    reg(&mut s, 0, 2, 700 * MIB);
    assert_eq!(granted(&s.request(0, 1), 1), Some(true));
    s.usage(0, 1, usage(700 * MIB, 700 * MIB));
    s.request(MS, 2);
    let outs = s.tick(SEC);
    assert_eq!(dropped(&outs, 1), Some(400 * MIB));
    let outs = s.release(SEC + 10 * MS, 1, usage(700 * MIB, 300 * MIB));
    assert_eq!(granted(&outs, 2), Some(true));
    // B swapped in what fitted: 400 of its 700 MiB (the scheduler believed 700 fit).
    let t = SEC + 50 * MS;
    s.usage(t, 2, usage(700 * MIB, 400 * MIB));
    let outs = s.no_room(t, 2, 300 * MIB, || None);
    assert_eq!(reclaimed_bytes(&outs, 1), Some(300 * MIB), "{outs:?}");
    // The believed free room (1000 − 300 − 400 = 300 MiB) is taken.
    assert_eq!(s.fixed(), 300 * MIB);
    // Answered, and B's next report crossed it (B has not swapped in yet): it asks
    // again, but learns nothing more within this hold (the room it saw was freed
    // since), and A has nothing resident left to give.
    s.reclaimed(t + 20 * MS, 1, usage(700 * MIB, 0));
    let outs = s.no_room(t + 30 * MS, 2, 300 * MIB, || None);
    assert_eq!(reclaimed_bytes(&outs, 1), None, "{outs:?}");
    assert_eq!(s.fixed(), 300 * MIB);
    s.usage(t + 40 * MS, 2, usage(700 * MIB, 700 * MIB));
    // A asks again: B's drop now asks for all 700 MiB (A's 700 need 700 of the 700
    // left beside the unseen 300).
    s.request(t + 50 * MS, 1);
    let outs = s.tick(t + 50 * MS + SEC);
    assert_eq!(dropped(&outs, 2), Some(700 * MIB), "{outs:?}");
    let outs = s.release(t + 60 * MS + SEC, 2, usage(700 * MIB, 0));
    assert_eq!(granted(&outs, 1), Some(true));
    // Forgotten a TTL after it was learned.
    s.tick(t + UNSEEN_TTL_NS);
    assert_eq!(s.fixed(), 0);
}

/// A report from a client that does not hold the GPU, or was dropped, changes
/// nothing: it may have crossed the drop or the revoke.
#[test]
fn no_room_from_a_non_holder_or_a_dropped_holder_is_ignored() {
    let mut s = sched(1000 * MIB, 1_000, 500);
    reg(&mut s, 0, 1, 700 * MIB);
    reg(&mut s, 0, 2, 700 * MIB);
    s.request(0, 1);
    s.usage(0, 1, usage(700 * MIB, 700 * MIB));
    s.request(MS, 2);
    assert!(
        s.no_room(2 * MS, 2, 700 * MIB, || None).is_empty(),
        "a waiter"
    );
    assert!(
        s.no_room(2 * MS, 9, 700 * MIB, || None).is_empty(),
        "unknown"
    );
    assert!(dropped(&s.tick(SEC), 1).is_some());
    assert!(
        s.no_room(SEC + MS, 1, 100 * MIB, || None).is_empty(),
        "dropped"
    );
    assert_eq!(s.fixed(), 0);
}

/// `no_room` is checked against the holder's own reports: one that says it is all
/// resident learns nothing and makes nobody evict; one that claims more than it lacks
/// gets a reclaim of what it lacks, no more (issue #27, item 2).
#[test]
fn no_room_is_bounded_by_what_the_holders_reports_say_it_lacks() {
    let mut s = sched(1000 * MIB, 1_000, 500);
    reg(&mut s, 0, 1, 400 * MIB);
    reg(&mut s, 0, 2, 700 * MIB);
    s.request(0, 1);
    s.usage(0, 1, usage(400 * MIB, 400 * MIB));
    s.request(MS, 2);
    let outs = s.tick(SEC);
    assert!(dropped(&outs, 1).is_some(), "{outs:?}");
    let outs = s.release(SEC + MS, 1, usage(400 * MIB, 100 * MIB));
    assert_eq!(granted(&outs, 2), Some(true));
    // All in, by its own report: the claim is ignored.
    s.usage(SEC + 2 * MS, 2, usage(700 * MIB, 700 * MIB));
    let outs = s.no_room(SEC + 3 * MS, 2, 900 * MIB, || None);
    assert_eq!(reclaimed_bytes(&outs, 1), None, "{outs:?}");
    assert_eq!(s.fixed(), 0);
    // 50 MiB short by its report, 900 claimed: a reclaim of 50 at most.
    s.usage(SEC + 4 * MS, 2, usage(700 * MIB, 650 * MIB));
    let outs = s.no_room(SEC + 5 * MS, 2, 900 * MIB, || None);
    let r = reclaimed_bytes(&outs, 1).unwrap_or(0);
    assert!(r <= 50 * MIB, "reclaimed {} MiB: {outs:?}", r >> 20);
}

/// Issue #27, item 2: where the driver's count of used memory is known, a `no_room`
/// the device contradicts makes nobody evict and teaches nothing; one it confirms
/// reclaims what is missing and counts only the memory really taken by others.
#[test]
fn no_room_is_checked_against_the_drivers_used_memory() {
    let setup = || {
        let mut s = sched(4000 * MIB, 1_000, 500);
        reg(&mut s, 0, 1, 1000 * MIB);
        reg(&mut s, 0, 2, 3500 * MIB);
        s.request(0, 1);
        s.usage(0, 1, usage(1000 * MIB, 1000 * MIB));
        s.request(MS, 2);
        let outs = s.tick(SEC);
        assert!(dropped(&outs, 1).is_some(), "{outs:?}");
        let outs = s.release(SEC + MS, 1, usage(1000 * MIB, 500 * MIB));
        assert_eq!(granted(&outs, 2), Some(true));
        // B: 1000 MiB of its 3500 still out, by its own report.
        s.usage(SEC + 2 * MS, 2, usage(3500 * MIB, 2500 * MIB));
        s
    };
    // The driver shows 3000 MiB in use, what the clients account for: 1000 MiB is
    // free, so the claim is a lie but for the slack the driver may not hand out:
    // at most that is reclaimed, and nothing is learned.
    let mut s = setup();
    let outs = s.no_room(SEC + 3 * MS, 2, 1000 * MIB, || Some(3000 * MIB));
    let r = reclaimed_bytes(&outs, 1).unwrap_or(0);
    assert!(r <= crate::sched::NO_ROOM_SLACK, "{outs:?}");
    assert_eq!(s.fixed(), 0, "nothing learned");
    // Free beyond the claim and the slack: nothing at all.
    let outs = s.no_room(SEC + 4 * MS, 2, 1000 * MIB, || Some(2000 * MIB));
    assert_eq!(reclaimed_bytes(&outs, 1), None, "{outs:?}");
    // The same without the driver's count: believed, as before.
    let mut s = setup();
    let outs = s.no_room(SEC + 3 * MS, 2, 1000 * MIB, || None);
    assert!(reclaimed_bytes(&outs, 1).is_some(), "{outs:?}");
    assert_eq!(s.fixed(), 1000 * MIB, "all it believed free is counted");
    // The driver shows 3800 MiB in use: 800 MiB taken by something outside Kiwi, 200
    // free (within the slack). Missing stands; 800 is learned, not 1000.
    let mut s = setup();
    let outs = s.no_room(SEC + 3 * MS, 2, 1000 * MIB, || Some(3800 * MIB));
    assert!(reclaimed_bytes(&outs, 1).is_some(), "{outs:?}");
    assert_eq!(s.fixed(), 800 * MIB);
}

/// On a GPU believed to fit, sharers that find no room would wait for good: one
/// `no_room` makes the scheduler count the memory it cannot see, the GPU no longer
/// fits, and the sharers take turns (the one holding longest keeps it).
#[test]
fn no_room_while_sharing_turns_a_gpu_that_no_longer_fits_into_turns() {
    let mut s = sched(1000 * MIB, 1_000, 500);
    reg(&mut s, 0, 1, 400 * MIB);
    reg(&mut s, 0, 2, 400 * MIB);
    assert_eq!(granted(&s.request(0, 1), 1), Some(false));
    assert_eq!(granted(&s.request(MS, 2), 2), Some(false));
    s.usage(2 * MS, 1, usage(400 * MIB, 400 * MIB));
    s.usage(2 * MS, 2, usage(400 * MIB, 100 * MIB));
    let outs = s.no_room(3 * MS, 2, 300 * MIB, || None);
    // 1000 MiB less the 500 resident was believed free, and is taken.
    assert_eq!(s.fixed(), 500 * MIB);
    assert!(s.oversubscribed(), "{outs:?}");
    // A, holding longest, keeps the GPU; B gives it back (its 100 MiB fit beside A).
    assert_eq!(dropped(&outs, 2), Some(0), "{outs:?}");
    assert_eq!(dropped(&outs, 1), None);
}

fn room(outs: &[Output], to: ClientId) -> Vec<u64> {
    sent(outs, to)
        .iter()
        .filter_map(|m| match m {
            ArbiterMsg::Room {
                others_unswappable_bytes,
                ..
            } => Some(*others_unswappable_bytes),
            _ => None,
        })
        .collect()
}

/// `room` goes to a client at most every STATE_INTERVAL_NS, the latest value follows
/// when the interval ends, and a ping gets it at once (issue #27, item 3: a client
/// flipping its memory no swap frees would have sent every other client a message
/// per flip; the shim's `cuMemGetInfo` pings so it still counts every context that
/// finished opening before it asked).
#[test]
fn room_changes_are_coalesced_and_a_ping_gets_the_latest_at_once() {
    let mut s = sched(4096 * MIB, 1_000, 500);
    let info = |room_info| ClientInfo {
        unswappable: Some(300 * MIB),
        room_info,
        ..Default::default()
    };
    let outs = s.register(0, 1, info(true), usage(0, 0), None);
    assert_eq!(room(&outs, 1), vec![0], "told at registration");
    // A second context within the interval: deferred, and due when it ends.
    let outs = s.register(MS, 2, info(false), usage(0, 0), None);
    assert!(room(&outs, 1).is_empty(), "{outs:?}");
    assert_eq!(s.next_deadline(), Some(STATE_INTERVAL_NS));
    // The client asks (ping): at once.
    assert_eq!(room(&s.flush_room(2 * MS, 1), 1), vec![300 * MIB]);
    assert!(s.flush_room(3 * MS, 1).is_empty(), "nothing new");
    // A storm of reports from client 2: 8,001 flips in 0.12 s.
    let mut told = Vec::new();
    let mut t = 3 * MS;
    for k in 0..8001u64 {
        let bytes = if k % 2 == 0 { 400 * MIB } else { 300 * MIB };
        told.extend(room(&s.unswappable(t, 2, bytes), 1));
        t += 15_000;
    }
    assert!(told.is_empty(), "{} messages: {told:?}", told.len());
    let due = s.next_deadline().expect("the last value is due");
    assert_eq!(room(&s.tick(due), 1), vec![400 * MIB]);
    assert_eq!(s.next_deadline(), None);
}

/// Registers client `id` with host pid `pid`, `ws` all resident, and `fixed` of
/// memory no swap frees reported.
fn reg_pid(s: &mut GpuScheduler, id: ClientId, pid: u32, ws: u64, fixed: u64) {
    let info = ClientInfo {
        host_pid: pid,
        unswappable: Some(fixed),
        ..ClientInfo::default()
    };
    s.register(0, id, info, usage(ws, ws), None);
}

fn unreported(outs: &[Output]) -> Vec<(Option<ClientId>, u64)> {
    logged(outs)
        .into_iter()
        .filter_map(|(id, k)| match k {
            EventKind::Unreported { bytes } => Some((id, bytes)),
            _ => None,
        })
        .collect()
}

/// What the driver counts for a client's process beyond its reports (code loaded
/// inside launches) is counted as memory no swap frees after three looks in a row
/// with its reports unchanged, at the least the looks saw (a report lagging a swap
/// shows in one look only); a look after its reports changed starts over, and the
/// count goes once the process's figure comes down to its reports.
#[test]
fn memory_beyond_a_clients_reports_is_counted_once_stable() {
    let mut s = sched_4g();
    reg_pid(&mut s, 1, 4242, 1000 * MIB, 300 * MIB);
    reg_pid(&mut s, 2, 4343, 1000 * MIB, 300 * MIB);
    let room = s.room();
    let procs = |extra: u64| [(4242, (1300 + extra) * MIB), (4343, 1300 * MIB)];
    assert!(unreported(&s.reconcile(SEC, &procs(700))).is_empty());
    assert!(unreported(&s.reconcile(2 * SEC, &procs(190))).is_empty());
    let outs = s.reconcile(3 * SEC, &procs(200));
    assert_eq!(unreported(&outs), vec![(Some(1), 190 * MIB)]);
    assert_eq!(
        s.room(),
        room - 190 * MIB,
        "counted as memory no swap frees"
    );
    // Stable again: nothing new to say.
    assert!(unreported(&s.reconcile(4 * SEC, &procs(200))).is_empty());
    // Its reports change (the shim counted the code itself): three looks again,
    // and the count goes.
    s.unswappable(5 * SEC, 1, 500 * MIB);
    for t in 6..8 {
        assert!(unreported(&s.reconcile(t * SEC, &procs(200))).is_empty());
    }
    assert_eq!(
        unreported(&s.reconcile(8 * SEC, &procs(200))),
        vec![(Some(1), 0)]
    );
    assert_eq!(s.room(), room - 200 * MIB);
    // Within the slack: never counted.
    for t in 9..14 {
        assert!(unreported(&s.reconcile(t * SEC, &procs(200 + 60))).is_empty());
    }
}

/// A client being reclaimed, or whose process NVML does not list, is not looked
/// at: its reports lag the swap, or the figure is someone else's.
#[test]
fn a_busy_or_unlisted_client_is_not_reconciled() {
    let mut s = sched_4g();
    reg_pid(&mut s, 1, 4242, 3000 * MIB, 300 * MIB);
    reg_pid(&mut s, 2, 4343, 1000 * MIB, 300 * MIB);
    assert_eq!(granted(&s.request(0, 2), 2), Some(true));
    assert!(
        s.clients[&1].reclaim_pending > 0,
        "client 1 is being reclaimed"
    );
    for t in 1..6 {
        let outs = s.reconcile(t * SEC, &[(4242, 3900 * MIB), (4343, 1300 * MIB)]);
        assert!(unreported(&outs).is_empty(), "{outs:?}");
    }
    // A pid NVML does not list (another pid namespace): nothing, ever.
    let mut s = sched_4g();
    reg_pid(&mut s, 1, 0, 1000 * MIB, 300 * MIB);
    for t in 1..6 {
        assert!(unreported(&s.reconcile(t * SEC, &[(0, 3000 * MIB)])).is_empty());
    }
}

/// Issue #42, item 6: a process outside Kiwi that registers a client of its own
/// and changes its reports at every look (0, then 2.4 GiB resident, and back) no
/// longer escapes the driver's figure: what it holds beyond what it claimed least
/// is counted as memory no swap frees. Before, every change started the looks over
/// and nothing was ever counted.
#[test]
fn a_client_that_changes_its_reports_at_every_look_is_counted_all_the_same() {
    let mut s = sched_4g();
    reg_pid(&mut s, 1, 4242, 0, 0);
    let held = 2400 * MIB;
    let mut counted = Vec::new();
    for t in 1..8u64 {
        let resident = if t % 2 == 0 { held } else { 0 };
        s.usage(t * SEC - MS, 1, usage(held, resident));
        counted.extend(unreported(&s.reconcile(t * SEC, &[(4242, held)])));
    }
    assert_eq!(counted, vec![(Some(1), held)]);
    assert_eq!(s.clients[&1].unswappable, held);
}

/// Issue #42, item 3: memory no swap frees that a client reports and that its
/// process does not hold, at any look, is a claim no process backs: it is not
/// counted (so it keeps nobody checkpointed or waiting), and counts again once the
/// driver shows it. Only where NVML lists some client's process: a driver that
/// lists none doubts nobody.
#[test]
fn memory_no_swap_frees_that_no_process_holds_is_not_counted() {
    let unbacked = |outs: &[Output]| {
        logged(outs)
            .into_iter()
            .filter_map(|(id, k)| match k {
                EventKind::Unbacked { bytes } => Some((id, bytes)),
                _ => None,
            })
            .collect::<Vec<_>>()
    };
    let mut s = sched_4g();
    reg_pid(&mut s, 1, 4242, 1000 * MIB, 300 * MIB);
    // Client 2 claims 3.8 GiB of contexts; its process (4343) is not listed at all.
    reg_pid(&mut s, 2, 4343, 0, 3800 * MIB);
    assert_eq!(s.room(), 0, "the claim takes the whole GPU");
    let mut said = Vec::new();
    for t in 1..=3 {
        said.extend(unbacked(&s.reconcile(t * SEC, &[(4242, 1300 * MIB)])));
    }
    assert_eq!(said, vec![(Some(2), 3800 * MIB)]);
    assert_eq!(s.room(), (4096 - 300) * MIB, "only 1's context counts");
    // Its process makes a 300 MiB context: that much is backed again.
    for t in 4..=6 {
        s.reconcile(t * SEC, &[(4242, 1300 * MIB), (4343, 300 * MIB)]);
    }
    assert_eq!(s.clients[&2].unswappable, 300 * MIB);
    // A driver that lists no client's process: no claim is doubted.
    let mut s = sched_4g();
    reg_pid(&mut s, 2, 4343, 0, 3800 * MIB);
    for t in 1..=4 {
        assert!(unbacked(&s.reconcile(t * SEC, &[(999, 100 * MIB)])).is_empty());
    }
}

/// Processes NVML lists that are no client here (run without Kiwi) count as memory
/// no swap frees once listed for three looks, at the least of them; not while some
/// client's host pid is unknown (it could be one of them).
#[test]
fn processes_outside_kiwi_count_as_memory_no_swap_frees() {
    let outside = |outs: &[Output]| {
        logged(outs)
            .into_iter()
            .filter_map(|(_, k)| match k {
                EventKind::OutsideKiwi { bytes } => Some(bytes),
                _ => None,
            })
            .collect::<Vec<_>>()
    };
    let mut s = sched_4g();
    reg_pid(&mut s, 1, 4242, 1000 * MIB, 300 * MIB);
    let room = s.room();
    let procs = |other: u64| [(4242, 1300 * MIB), (777, other * MIB), (778, 10 * MIB)];
    assert!(outside(&s.reconcile(SEC, &procs(900))).is_empty());
    assert!(outside(&s.reconcile(2 * SEC, &procs(800))).is_empty());
    assert_eq!(outside(&s.reconcile(3 * SEC, &procs(900))), vec![800 * MIB]);
    assert_eq!(
        s.room(),
        room - 800 * MIB,
        "778's 10 MiB are within the slack"
    );
    // Gone from the list: no longer counted.
    let outs = s.reconcile(4 * SEC, &[(4242, 1300 * MIB)]);
    assert_eq!(outside(&outs), vec![0]);
    assert_eq!(s.room(), room);
    // A client whose host pid is unknown: nothing is counted.
    reg_pid(&mut s, 2, 0, 100 * MIB, 300 * MIB);
    for t in 5..10 {
        assert!(outside(&s.reconcile(t * SEC, &procs(900))).is_empty());
    }
}

/// Issue #38, item 1: a tenant that flips its working set across the room at every
/// message turns the GPU exclusive at once, and shared again only once it has fit
/// for [`STATE_INTERVAL_NS`]: a sharer gets one drop for a storm of flips, not one a
/// flip, and its grant back follows the quiet interval.
#[test]
fn flips_across_the_room_turn_the_gpu_exclusive_at_once_and_shared_after_an_interval() {
    let mut s = sched(1000 * MIB, 30_000, 5_000);
    reg(&mut s, 0, 1, 400 * MIB);
    reg(&mut s, 0, 2, 400 * MIB);
    reg(&mut s, 0, 3, 0);
    assert_eq!(granted(&s.request(MS, 1), 1), Some(false));
    assert_eq!(granted(&s.request(MS, 2), 2), Some(false));
    let mut drops = 0;
    let mut t = 2 * MS;
    for k in 0..8_000u64 {
        let ws = if k % 2 == 0 { 900 * MIB } else { 0 };
        let outs = s.usage(t, 3, usage(ws, 0));
        drops += [1, 2]
            .iter()
            .filter(|&&id| dropped(&outs, id).is_some())
            .count();
        t += 10_000;
    }
    assert_eq!(drops, 1, "one sharer dropped once for 8,000 flips");
    // It fits now (the last flip was to 0), but only an interval after the last
    // oversubscription does the GPU run shared again.
    let last = t - 20_000;
    assert_eq!(s.next_deadline(), Some(last + STATE_INTERVAL_NS));
    let dropped_one = if s.holders().contains(&1) { 2 } else { 1 };
    s.release(t, dropped_one, usage(400 * MIB, 400 * MIB));
    let outs = s.request(t + MS, dropped_one);
    assert_eq!(granted(&outs, dropped_one), None, "not shared yet");
    let outs = s.tick(last + STATE_INTERVAL_NS);
    assert_eq!(granted(&outs, dropped_one), Some(false), "{outs:?}");
}

/// A tenant's view (issue #39): the clients it owns, each with its working set and
/// its memory no swap frees, the largest first; and every client's memory no swap
/// frees, which a process without a turn is told is in use.
#[test]
fn a_view_lists_the_chosen_clients_and_every_clients_unswappable_memory() {
    let mut s = sched(4096 * MIB, 1_000, 500);
    for (id, pid, ws, fixed) in [(1, 11, 500, 100), (2, 22, 2000, 300), (3, 33, 900, 50)] {
        let info = ClientInfo {
            pid,
            unswappable: Some(fixed * MIB),
            ..ClientInfo::default()
        };
        s.register(0, id, info, usage(ws * MIB, 0), None);
    }
    let (fixed, mine) = s.view(|id| id != 2);
    assert_eq!(fixed, 450 * MIB, "everyone's memory no swap frees");
    let listed: Vec<(u32, u64)> = mine.iter().map(|p| (p.pid, p.used_bytes)).collect();
    assert_eq!(listed, vec![(33, 950 * MIB), (11, 600 * MIB)]);
    assert!(s.view(|_| false).1.is_empty(), "no one else's");
}
