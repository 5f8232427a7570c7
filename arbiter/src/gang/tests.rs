//! Gang turns on real schedulers with simulated time: clients that answer every drop
//! with a release after a short while, and an invariant checked after every step.

use super::*;
use kiwi_protocol::{ArbiterMsg, Settings, Usage};
use proptest::prelude::*;

use crate::sched::ClientInfo;

const GIB: u64 = 1 << 30;
const MS: u64 = 1_000_000;

/// A node of simulated GPUs and the clients on them.
struct Node {
    scheds: BTreeMap<String, GpuScheduler>,
    gangs: Gangs,
    /// Each client's GPU and group key.
    clients: BTreeMap<ClientId, (String, Option<String>)>,
    /// Who holds, by GPU (from the grants and releases seen).
    holding: BTreeSet<ClientId>,
    /// Drops to answer: (when, client).
    drops: Vec<(Nanos, ClientId)>,
    /// Grants seen: (when, client, GPU).
    grants: Vec<(Nanos, ClientId, String)>,
    /// Each client's last grant's `group` and `exclusive` flags.
    group_flag: BTreeMap<ClientId, bool>,
    exclusive_flag: BTreeMap<ClientId, bool>,
    /// Reclaims sent: (when, client).
    reclaims: Vec<(Nanos, ClientId)>,
    /// Drops sent: (when, client).
    dropped_at: Vec<(Nanos, ClientId)>,
    turns_logged: Vec<(Nanos, String, String)>,
    now: Nanos,
    /// How long a dropped client takes to release.
    release_after: Nanos,
}

impl Node {
    fn new(gpus: &[&str], tq_ms: u64) -> Self {
        let scheds = gpus
            .iter()
            .map(|g| {
                let s = GpuScheduler::new(
                    10 * GIB,
                    10 * GIB,
                    Settings {
                        scheduler_on: true,
                        tq_ms,
                    },
                    2_000,
                );
                (g.to_string(), s)
            })
            .collect();
        Node {
            scheds,
            gangs: Gangs::default(),
            clients: BTreeMap::new(),
            holding: BTreeSet::new(),
            drops: Vec::new(),
            grants: Vec::new(),
            group_flag: BTreeMap::new(),
            exclusive_flag: BTreeMap::new(),
            reclaims: Vec::new(),
            dropped_at: Vec::new(),
            turns_logged: Vec::new(),
            now: 1_000 * MS,
            release_after: 5 * MS,
        }
    }

    fn apply(&mut self, outs: Outs) {
        for (gpu, os) in outs {
            self.apply_gpu(&gpu, os);
        }
    }

    fn apply_gpu(&mut self, gpu: &str, outs: Vec<Output>) {
        for o in outs {
            match o {
                Output::Send(
                    id,
                    ArbiterMsg::Grant {
                        group, exclusive, ..
                    },
                ) => {
                    self.group_flag.insert(id, group);
                    self.exclusive_flag.insert(id, exclusive);
                    self.holding.insert(id);
                    self.grants.push((self.now, id, gpu.to_string()));
                }
                Output::Send(id, ArbiterMsg::Drop { .. }) => {
                    self.dropped_at.push((self.now, id));
                    self.drops.push((self.now + self.release_after, id));
                }
                Output::Send(id, ArbiterMsg::Reclaim { .. }) => {
                    self.reclaims.push((self.now, id));
                }
                Output::Send(id, ArbiterMsg::Revoked { .. }) => {
                    self.holding.remove(&id);
                }
                Output::Log(None, EventKind::GroupTurn { group, .. }) => {
                    self.turns_logged.push((self.now, group, gpu.to_string()));
                }
                _ => {}
            }
        }
    }

    /// Runs one scheduler input on `gpu`, then the coordinator, as the server does.
    fn on(&mut self, gpu: &str, f: impl FnOnce(&mut GpuScheduler, Nanos) -> Vec<Output>) {
        let now = self.now;
        let outs = f(self.scheds.get_mut(gpu).expect("gpu"), now);
        self.apply_gpu(gpu, outs);
        let outs = self.gangs.step(&mut self.scheds, now);
        self.apply(outs);
    }

    fn add(&mut self, id: ClientId, gpu: &str, group: Option<&str>, ws: u64) {
        let now = self.now;
        self.clients
            .insert(id, (gpu.to_string(), group.map(str::to_string)));
        let usage = Usage {
            working_set_bytes: ws,
            resident_bytes: ws,
        };
        self.on(gpu, |s, now| {
            s.register(now, id, ClientInfo::default(), usage, None)
        });
        if let Some(key) = group {
            let (ok, outs) = self.gangs.join(&mut self.scheds, now, id, key, gpu);
            assert!(ok);
            self.apply(outs);
        }
    }

    /// Job J (rank 1 on a, rank 2 on b) and a notebook on each GPU (5 on a, 6 on
    /// b), none asking yet; TQ 100 ms. Any two overfill a GPU.
    fn job_beside_notebooks() -> Self {
        let mut n = Node::new(&["a", "b"], 100);
        n.add(1, "a", Some("J"), 6 * GIB);
        n.add(2, "b", Some("J"), 6 * GIB);
        n.add(5, "a", None, 6 * GIB);
        n.add(6, "b", None, 6 * GIB);
        n
    }

    fn gpu_of(&self, id: ClientId) -> String {
        self.clients[&id].0.clone()
    }

    fn request(&mut self, id: ClientId) {
        let gpu = self.gpu_of(id);
        self.on(&gpu, |s, now| s.request(now, id));
    }

    fn release(&mut self, id: ClientId) {
        let gpu = self.gpu_of(id);
        self.holding.remove(&id);
        let ws = self.scheds[&gpu].working_set_of(id);
        let usage = Usage {
            working_set_bytes: ws,
            resident_bytes: 0,
        };
        self.on(&gpu, |s, now| s.release(now, id, usage));
    }

    fn exit(&mut self, id: ClientId) {
        let gpu = self.gpu_of(id);
        self.holding.remove(&id);
        self.on(&gpu, |s, now| s.exit(now, id));
        let outs = self.gangs.leave(&mut self.scheds, self.now, id);
        self.apply(outs);
        self.clients.remove(&id);
    }

    /// Advances time to `until`, answering drops and ticking deadlines.
    fn run_until(&mut self, until: Nanos, mut on_release: impl FnMut(&mut Node, ClientId)) {
        loop {
            let next_drop = self.drops.iter().map(|d| d.0).min();
            let next_tick = self.scheds.values().filter_map(|s| s.next_deadline()).min();
            let next = [next_drop, next_tick].into_iter().flatten().min();
            let Some(t) = next.filter(|&t| t <= until) else {
                self.now = until;
                return;
            };
            self.now = self.now.max(t);
            if let Some(k) = self.drops.iter().position(|d| d.0 <= self.now) {
                let (_, id) = self.drops.remove(k);
                if self.holding.contains(&id) {
                    self.release(id);
                    on_release(self, id);
                }
            } else {
                let gpus: Vec<String> = self.scheds.keys().cloned().collect();
                for g in gpus {
                    self.on(&g, |s, now| s.tick(now));
                }
            }
            self.check_invariant();
        }
    }

    /// No member of a ganged group holds a GPU while a peer of it waits in a queue
    /// with someone outside the group holding that peer's GPU: nobody spins
    /// against a peer that waits.
    fn check_invariant(&self) {
        for (&id, (gpu, key)) in &self.clients {
            let Some(key) = key else { continue };
            if !self.scheds[gpu].holds_exclusive(id) || self.gangs.ganged_key(id).is_none() {
                continue;
            }
            for (&peer, (pgpu, pkey)) in &self.clients {
                if peer == id || pkey.as_deref() != Some(key) || pgpu == gpu {
                    continue;
                }
                let s = &self.scheds[pgpu];
                let outsider_holds = s.holders().iter().any(|h| {
                    self.clients
                        .get(h)
                        .is_some_and(|(_, k)| k.as_deref() != Some(key.as_str()))
                });
                assert!(
                    !(s.queue().contains(&peer) && outsider_holds),
                    "t={} ms: {id} holds {gpu} while its peer {peer} waits behind another \
                     tenant on {pgpu} (holders {:?})",
                    self.now / MS,
                    s.holders()
                );
            }
        }
    }
}

/// Every client of the scenario asks again as soon as it released: all are busy.
fn busy(n: &mut Node, id: ClientId) {
    n.request(id);
}

#[test]
fn crosswise_jobs_and_notebooks_take_whole_turns() {
    let mut n = Node::new(&["a", "b"], 100);
    // Job J: rank 1 on a, rank 2 on b. Job K crosswise: rank 3 on b, rank 4 on a.
    // A notebook on each GPU. Any two of 6 GiB overfill a 10 GiB GPU.
    n.add(1, "a", Some("J"), 6 * GIB);
    n.add(2, "b", Some("J"), 6 * GIB);
    n.add(3, "b", Some("K"), 6 * GIB);
    n.add(4, "a", Some("K"), 6 * GIB);
    n.add(5, "a", None, 6 * GIB);
    n.add(6, "b", None, 6 * GIB);
    for id in [5, 6, 1, 2, 3, 4] {
        n.request(id);
        n.check_invariant();
    }
    let start = n.now;
    n.run_until(start + 5_000 * MS, busy);

    // Round-robin over the three on each GPU: job J, job K, the notebook, each a
    // third of the turns (±1).
    let counts: Vec<usize> = (1..=6)
        .map(|id| n.grants.iter().filter(|g| g.1 == id).count())
        .collect();
    let (min, max) = (counts.iter().min().unwrap(), counts.iter().max().unwrap());
    assert!(
        *min >= 10 && max - min <= 1,
        "turns per client 1..=6: {counts:?}"
    );
    // Each group's grants come in pairs in one step: rank 1's with rank 2's.
    for (a, b) in [(1, 2), (3, 4)] {
        let ta: Vec<Nanos> = n.grants.iter().filter(|g| g.1 == a).map(|g| g.0).collect();
        let tb: Vec<Nanos> = n.grants.iter().filter(|g| g.1 == b).map(|g| g.0).collect();
        assert_eq!(ta, tb, "ranks {a} and {b} granted at different times");
    }
    // One GroupTurn per GPU per turn.
    let j_turns = n.turns_logged.iter().filter(|t| t.1 == "J").count();
    let j_grants = n.grants.iter().filter(|g| g.1 == 1).count();
    assert_eq!(j_turns, 2 * j_grants);
    assert!(n.gangs.turns() >= 6);
}

#[test]
fn grants_in_a_group_turn_say_so_and_others_do_not() {
    let mut n = Node::job_beside_notebooks();
    n.request(1);
    n.request(2);
    n.request(5);
    assert_eq!(n.group_flag.get(&1), Some(&true));
    assert_eq!(n.group_flag.get(&2), Some(&true));
    let t0 = n.now;
    n.run_until(t0 + 500 * MS, |_, _| {});
    assert_eq!(
        n.group_flag.get(&5),
        Some(&false),
        "the notebook's own turn"
    );
}

#[test]
fn a_member_idle_in_its_groups_turn_is_not_evicted_until_the_turn_ends() {
    let mut n = Node::new(&["a", "b"], 300);
    for s in n.scheds.values_mut() {
        *s = std::mem::replace(
            s,
            GpuScheduler::new(
                10 * GIB,
                10 * GIB,
                Settings {
                    scheduler_on: true,
                    tq_ms: 300,
                },
                2_000,
            ),
        )
        .with_idle_evict(50);
    }
    n.add(1, "a", Some("J"), 6 * GIB);
    n.add(2, "b", Some("J"), 6 * GIB);
    n.add(5, "a", None, 6 * GIB);
    n.add(6, "b", None, 6 * GIB);
    // All four, idle since registration, are evicted one by one; they answer.
    for _ in 0..4 {
        let t = n.now;
        n.run_until(t + 100 * MS, |_, _| {});
        for (_, id) in std::mem::take(&mut n.reclaims) {
            let gpu = n.gpu_of(id);
            let swapped = Usage {
                working_set_bytes: 6 * GIB,
                resident_bytes: 0,
            };
            n.on(&gpu, |s, now| s.reclaimed(now, id, swapped));
        }
    }
    n.reclaims.clear();
    n.request(1);
    n.request(2);
    n.request(6);
    // Rank 1 goes idle early, nobody waiting on a, so it keeps its memory resident
    // (its GPU stays J's); rank 2 works on; 6 waits on b.
    n.holding.remove(&1);
    let usage = Usage {
        working_set_bytes: 6 * GIB,
        resident_bytes: 6 * GIB,
    };
    n.on("a", |s, now| s.release(now, 1, usage));
    let t0 = n.now;
    n.run_until(t0 + 250 * MS, |_, _| {});
    assert!(
        !n.reclaims.iter().any(|r| r.1 == 1),
        "rank 1 was evicted in its group's turn: {:?}",
        n.reclaims
    );
    // The turn ends at its quantum (6 waits); then rank 1, idle on a GPU taken in
    // turns, is evicted like anyone idle.
    n.run_until(t0 + 2_000 * MS, |_, _| {});
    assert!(n.holding.contains(&6));
    assert!(
        n.reclaims.iter().any(|r| r.1 == 1),
        "rank 1 idle after its group's turn: {:?}",
        n.reclaims
    );
}

#[test]
fn a_claim_drops_the_holders_on_the_groups_gpus_together_at_the_last_quantum_end() {
    let mut n = Node::job_beside_notebooks();
    let t0 = n.now;
    n.request(5);
    n.now = t0 + 60 * MS;
    n.request(6);
    n.now = t0 + 10 * MS;
    n.request(1);
    n.request(2);
    n.run_until(t0 + 400 * MS, |_, _| {});
    let at = |id| {
        n.dropped_at
            .iter()
            .find(|d| d.1 == id)
            .map(|d| (d.0 - t0) / MS)
    };
    // Notebook 5's quantum ended at 100 ms, 6's at 160 ms: GPU a did not idle from
    // 100 ms on waiting for b; both were dropped at 160 ms.
    assert_eq!(at(5), Some(160), "notebook 5 dropped");
    assert_eq!(at(6), Some(160), "notebook 6 dropped");
    let g1 = n.grants.iter().find(|g| g.1 == 1).map(|g| (g.0 - t0) / MS);
    let g2 = n.grants.iter().find(|g| g.1 == 2).map(|g| (g.0 - t0) / MS);
    assert_eq!(g1, g2, "the job's ranks start together");
    assert_eq!(g1, Some(165), "right after both released");
}

#[test]
fn a_gpu_claimed_while_the_group_waits_for_another_is_filled_until_then() {
    let mut n = Node::job_beside_notebooks();
    let t0 = n.now;
    n.request(6);
    n.now = t0 + MS;
    n.request(1);
    n.request(2);
    // J claims a and b; it waits for 6's quantum on b (100 ms). Notebook 5 asks for
    // a meanwhile: a would idle 99 ms, so 5 fills it until then.
    n.now = t0 + 2 * MS;
    n.request(5);
    assert!(n.holding.contains(&5), "5 fills the claimed GPU");
    n.run_until(t0 + 400 * MS, |_, _| {});
    let dropped = |id| {
        n.dropped_at
            .iter()
            .find(|d| d.1 == id)
            .map(|d| (d.0 - t0) / MS)
    };
    assert_eq!(dropped(5), Some(100), "5 gives a back when J can start");
    assert_eq!(dropped(6), Some(100));
    let g1 = n.grants.iter().find(|g| g.1 == 1).map(|g| (g.0 - t0) / MS);
    let g2 = n.grants.iter().find(|g| g.1 == 2).map(|g| (g.0 - t0) / MS);
    assert_eq!(
        (g1, g2),
        (Some(105), Some(105)),
        "J starts once both released"
    );

    // Too short a wait is not filled: J claims 30 ms before 6's quantum ends, less
    // than half a quantum; 5 waits for J's turn.
    let mut n = Node::job_beside_notebooks();
    let t0 = n.now;
    n.request(6);
    n.now = t0 + 70 * MS;
    n.request(1);
    n.request(2);
    n.request(5);
    assert!(
        !n.holding.contains(&5),
        "30 ms left of the wait: not filled"
    );
}

#[test]
fn a_gpu_where_a_member_runs_beside_others_takes_turns_though_everything_fits() {
    // 2 GiB each on 10 GiB GPUs: every working set fits.
    let mut n = Node::new(&["a", "b"], 100);
    n.add(1, "a", Some("J"), 2 * GIB);
    n.add(2, "b", Some("J"), 2 * GIB);
    // Alone on its GPUs, the job runs shared, as anyone whose memory fits.
    n.request(1);
    n.request(2);
    assert_eq!(n.exclusive_flag.get(&1), Some(&false));
    assert_eq!(n.exclusive_flag.get(&2), Some(&false));
    // A notebook joins GPU a: a is taken in turns (the job's rank there is asked
    // to give way at once, as when a GPU stops fitting), b stays shared.
    n.add(5, "a", None, 2 * GIB);
    n.request(5);
    let t0 = n.now;
    n.run_until(t0 + 50 * MS, |_, _| {});
    assert!(n.dropped_at.iter().any(|d| d.1 == 1), "rank 1 gave a up");
    assert!(n.holding.contains(&5));
    assert_eq!(n.exclusive_flag.get(&5), Some(&true), "a is taken in turns");
    assert!(!n.scheds["a"].holds_exclusive(1));
    // The job asks again: its turn starts when the notebook's quantum ends, on
    // both GPUs.
    n.request(1);
    n.run_until(t0 + 400 * MS, |n, id| {
        if id == 2 {
            n.request(2)
        }
    });
    assert!(
        n.turns_logged.iter().any(|t| t.1.ends_with('J')),
        "J had a group turn: {:?}",
        n.turns_logged
    );
}

#[test]
fn a_group_on_one_gpu_is_no_gang() {
    let mut n = Node::new(&["a", "b"], 100);
    n.add(1, "a", Some("J"), 6 * GIB);
    n.add(2, "a", Some("J"), 6 * GIB);
    assert_eq!(n.gangs.ganged_key(1), None);
    n.request(1);
    n.request(2);
    assert!(
        n.holding.contains(&1),
        "an ungrouped pair takes turns as before"
    );
    assert!(n.turns_logged.is_empty());
}

#[test]
fn a_group_that_loses_its_second_gpu_turns_back_into_clients() {
    let mut n = Node::job_beside_notebooks();
    n.request(6);
    assert!(n.holding.contains(&6));
    // Rank 1 waits for its group's turn: rank 2's GPU is held by the notebook.
    n.request(1);
    assert!(!n.holding.contains(&1));
    assert_eq!(n.gangs.reserved_for("a"), Some(("J", false)));
    // Rank 2 exits: rank 1 is a lone client of a free GPU and is granted.
    n.exit(2);
    assert_eq!(n.gangs.ganged_key(1), None);
    assert!(n.holding.contains(&1));
    assert_eq!(n.gangs.reserved_for("a"), None);
    assert_eq!(n.gangs.reserved_for("b"), None);
}

#[test]
fn a_claimed_gpu_drops_its_lone_holder_at_its_quantum_end() {
    let mut n = Node::job_beside_notebooks();
    n.request(6);
    // Only rank 1 asks; on b nobody waits, yet the group's claim ends 6's quantum.
    n.request(1);
    let t0 = n.now;
    n.run_until(t0 + 1_000 * MS, |_, _| {});
    let g1 = n.grants.iter().find(|g| g.1 == 1).expect("rank 1 granted");
    assert!(
        g1.0 >= t0 + 100 * MS && g1.0 <= t0 + 100 * MS + n.release_after,
        "rank 1 granted at {} ms, the notebook's quantum ended at 100 ms",
        (g1.0 - t0) / MS
    );
    assert_eq!(n.gangs.reserved_for("b"), Some(("J", true)));
    // Rank 2 asks during the turn: granted at once on the reserved GPU.
    n.request(2);
    assert!(n.holding.contains(&2));
}

#[test]
fn an_early_release_keeps_the_gpu_for_the_group_until_all_let_go() {
    let mut n = Node::job_beside_notebooks();
    n.request(1);
    n.request(2);
    assert!(n.holding.contains(&1) && n.holding.contains(&2));
    n.request(5);
    // Rank 1 goes idle and releases; its peer still works: the notebook waits.
    n.release(1);
    assert!(
        !n.holding.contains(&5),
        "GPU a stays the group's while rank 2 holds b"
    );
    n.request(1);
    assert!(
        n.holding.contains(&1),
        "rank 1 comes back into its group's turn"
    );
    n.release(1);
    n.release(2);
    assert!(n.holding.contains(&5), "all let go: the notebook's turn");
    assert_eq!(n.gangs.reserved_for("a"), None);
}

#[test]
fn a_member_granted_before_its_group_spanned_gpus_is_dropped_when_it_does() {
    let mut n = Node::new(&["a", "b"], 10_000);
    n.add(2, "b", Some("J"), 6 * GIB);
    n.add(6, "b", None, 6 * GIB);
    n.add(5, "a", None, 6 * GIB);
    // Rank 1 alone in its group: an ordinary client, granted on its own.
    n.request(2);
    assert!(n.scheds["b"].holds_exclusive(2));
    assert!(n.drops.is_empty());
    // Rank 0 registers on GPU a: the group spans two GPUs, and rank 1 holds b
    // outside any turn of its group: asked to drop at once, not at its 10 s quantum.
    n.add(1, "a", Some("J"), 6 * GIB);
    assert_eq!(n.drops.iter().map(|d| d.1).collect::<Vec<_>>(), vec![2]);
    // Back in the group's turn, both ranks together.
    n.request(1);
    let t0 = n.now;
    n.run_until(t0 + 100 * MS, |n, id| n.request(id));
    assert!(n.scheds["a"].holds_exclusive(1) && n.scheds["b"].holds_exclusive(2));
    assert_eq!(n.gangs.reserved_for("a"), Some(("J", true)));
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Random groups over three GPUs, random request and release patterns: the
    /// invariant holds at every step, and every client that keeps asking is granted.
    #[test]
    fn random_groups_never_spin_and_all_progress(
        layout in proptest::collection::vec((0usize..3, 0usize..4), 3..9),
        tq in 20u64..200,
        release_ms in 1u64..40,
        seed in any::<u64>(),
    ) {
        let mut n = Node::new(&["a", "b", "c"], tq);
        n.release_after = release_ms * MS;
        let gpus = ["a", "b", "c"];
        let keys = [None, Some("J"), Some("K"), Some("L")];
        for (i, &(g, k)) in layout.iter().enumerate() {
            n.add(i as u64 + 1, gpus[g], keys[k], 6 * GIB);
        }
        let ids: Vec<ClientId> = n.clients.keys().copied().collect();
        for &id in &ids {
            n.request(id);
            n.check_invariant();
        }
        let mut rng = seed;
        let start = n.now;
        n.run_until(start + 20 * tq * MS * ids.len() as u64, |n, id| {
            rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            // Most ask again at once; some go idle for good.
            if (rng >> 33) % 4 != 0 {
                n.request(id);
            }
        });
        for &id in &ids {
            prop_assert!(
                n.grants.iter().any(|g| g.1 == id),
                "client {} ({:?}) never granted; layout {:?}", id, n.clients[&id], layout
            );
        }
    }
}

#[test]
fn a_turn_held_on_one_gpu_ends_at_its_quantum_when_someone_waits_on_another() {
    // Job J: rank 1 on a, ranks 2 and 4 on b (they take turns on b within J's
    // turns); a notebook, 3, on a. Ranks 1 and 2 stop; 4 then holds b alone in a
    // turn of J that still reserves a, where the notebook waits.
    let mut n = Node::new(&["a", "b"], 20);
    n.release_after = MS;
    n.add(1, "a", Some("J"), 6 * GIB);
    n.add(2, "b", Some("J"), 6 * GIB);
    n.add(3, "a", None, 6 * GIB);
    n.add(4, "b", Some("J"), 6 * GIB);
    for id in 1..=4 {
        n.request(id);
    }
    assert!(n.holding.contains(&1) && n.holding.contains(&2));
    let t0 = n.now;
    n.run_until(t0 + 200 * MS, |n, id| {
        if id == 4 || id == 3 {
            n.request(id);
        }
    });
    let when = |id| {
        n.grants
            .iter()
            .filter(|g| g.1 == id)
            .map(|g| (g.0 - t0) / MS)
            .collect::<Vec<_>>()
    };
    let (g3, g4) = (when(3), when(4));
    assert!(
        !g3.is_empty() && g3[0] <= 2 * 20 + 2,
        "the notebook waited past two quanta: granted at {g3:?} ms (rank 4 at {g4:?})"
    );
    assert!(
        g3.len() >= 2 && g4.len() >= 2,
        "turns alternate: 3 at {g3:?}, 4 at {g4:?}"
    );
}
