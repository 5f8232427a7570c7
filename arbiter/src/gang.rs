//! Gang turns (issue #41): the clients of one job are granted their GPUs together.
//!
//! A job on several GPUs (PyTorch DDP, tensor parallelism, any NCCL collective) has
//! kernels on one GPU that spin until a peer on another GPU has written its part.
//! Under per-GPU turns one rank could hold GPU 0 while its peer waits behind another
//! tenant on GPU 1: the holder's kernel spins through its quantum and cannot drain,
//! and two such jobs crosswise wait for each other until someone's grace runs out.
//!
//! Clients with the same group key form a group (the server picks the key: a name
//! the application gives, scoped to its tenant; else its pod or container; else its
//! process). A group whose clients are on two GPUs or more is *ganged*: its members
//! are granted only in the group's turn, which starts on all its GPUs in one step.
//! Each GPU's part ([`crate::sched::Reserve`]) is a reservation the coordinator sets:
//!
//! 1. A ganged group with a member waiting for a turn *claims* its GPUs: there
//!    nobody is granted, and a holder outside the group is asked to drop at its
//!    quantum's end (as if someone waited). Claims are all or nothing, oldest waiting
//!    group first, except that the oldest group that finds a GPU of its reserved by
//!    another group claims the rest already and marks that GPU wanted (its holder's
//!    quantum ends as if someone waited). Only one group holds a partial claim, and
//!    every group it waits for holds all its GPUs, whose turns end within a quantum
//!    and the grace: no two groups wait for each other.
//! 2. Once no one outside the group holds any of its GPUs and its first waiting
//!    member can be granted on each, the turn starts: every GPU grants its member in
//!    the same step, and one [`EventKind::GroupTurn`] per GPU says so.
//! 3. The turn ends on every GPU at once: when one member is asked to drop (its
//!    quantum ended with someone waiting, the GPU stopped fitting), every member is,
//!    and none is granted again in that turn; once none holds any of the group's
//!    GPUs, the reservations go and round-robin goes on. A member's early release
//!    keeps its GPU reserved for the group (its peer may still be waiting for it):
//!    the turn ends when all have let go. Someone outside the group waiting on any
//!    of its GPUs ends the turn's quantum on all of them (a member left holding
//!    alone elsewhere would otherwise keep the whole turn).
//!
//! A GPU where a member runs beside others is taken in turns even when the working
//! sets fit ([`crate::sched`]); a job alone on its GPUs runs shared, as before.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use kiwi_protocol::{DropReason, EventKind};

use crate::sched::{ClientId, GangId, GpuScheduler, Nanos, Output, Reserve};

/// Access to the node's schedulers by GPU UUID.
pub trait Scheds {
    fn sched(&mut self, gpu: &str) -> Option<&mut GpuScheduler>;
}

impl Scheds for BTreeMap<String, GpuScheduler> {
    fn sched(&mut self, gpu: &str) -> Option<&mut GpuScheduler> {
        self.get_mut(gpu)
    }
}

/// Scheduler outputs to dispatch, by GPU.
pub type Outs = Vec<(String, Vec<Output>)>;

/// The most groups kept at once: a group lives as long as a client of it, and clients
/// are capped by the server; this bounds the map even so.
pub const MAX_GROUPS: usize = 4096;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Turn {
    Idle,
    Claimed,
    Running,
    /// Its members were asked to drop: nobody is granted on its GPUs until all let
    /// go (a member that asks again waits for the group's next turn).
    Ending,
}

#[derive(Debug)]
struct Group {
    key: String,
    /// Each member's GPU.
    members: BTreeMap<ClientId, String>,
    turn: Turn,
    /// The GPUs reserved for it now (claimed or running).
    reserved: BTreeSet<String>,
}

impl Group {
    fn gpus(&self) -> BTreeSet<String> {
        self.members.values().cloned().collect()
    }

    fn ganged(&self) -> bool {
        self.gpus().len() >= 2
    }
}

/// The node's groups and their turns.
#[derive(Debug, Default)]
pub struct Gangs {
    by_key: HashMap<String, GangId>,
    groups: BTreeMap<GangId, Group>,
    of_client: HashMap<ClientId, GangId>,
    next: GangId,
    /// GPUs marked wanted (a group waits for them while another group has them).
    wanted: BTreeSet<String>,
    /// GPUs whose group let them go in this step: set free at its end unless a
    /// waiting group claims them first (so a group next in line gets them before
    /// round-robin hands them to someone who asked later).
    freeing: BTreeSet<String>,
    /// Group turns started since the arbiter started.
    turns: u64,
    /// GPUs whose outsiders' drops are aligned to a claiming group's last quantum
    /// end ([`GpuScheduler::set_claim_aligned`]).
    aligned: BTreeSet<String>,
}

impl Gangs {
    pub fn is_empty(&self) -> bool {
        self.groups.is_empty()
    }

    /// Group turns started so far.
    pub fn turns(&self) -> u64 {
        self.turns
    }

    /// The group key of client `id`, if its group spans GPUs (for status).
    pub fn ganged_key(&self, id: ClientId) -> Option<&str> {
        let g = self.groups.get(self.of_client.get(&id)?)?;
        g.ganged().then_some(g.key.as_str())
    }

    /// The key of the group whose turn GPU `gpu` is reserved for, and whether that
    /// turn runs (for status).
    pub fn reserved_for(&self, gpu: &str) -> Option<(&str, bool)> {
        self.groups
            .values()
            .find(|g| g.reserved.contains(gpu))
            .map(|g| (g.key.as_str(), g.turn == Turn::Running))
    }

    /// Client `id` registered on `gpu` with group key `key`. Refused (`false`, nothing
    /// changed) when the node already keeps [`MAX_GROUPS`] groups and this would be a
    /// new one: the client then belongs to none.
    pub fn join(
        &mut self,
        scheds: &mut impl Scheds,
        now: Nanos,
        id: ClientId,
        key: &str,
        gpu: &str,
    ) -> (bool, Outs) {
        let gid = match self.by_key.get(key) {
            Some(&g) => g,
            None => {
                if self.groups.len() >= MAX_GROUPS {
                    return (false, Vec::new());
                }
                let g = self.next;
                self.next += 1;
                self.by_key.insert(key.to_string(), g);
                self.groups.insert(
                    g,
                    Group {
                        key: key.to_string(),
                        members: BTreeMap::new(),
                        turn: Turn::Idle,
                        reserved: BTreeSet::new(),
                    },
                );
                g
            }
        };
        self.of_client.insert(id, gid);
        let group = self.groups.get_mut(&gid).expect("inserted");
        group.members.insert(id, gpu.to_string());
        let mut outs = Vec::new();
        if group.ganged() {
            // Newly ganged or not, every member is marked (a no-op where it is).
            let members: Vec<(ClientId, String)> =
                group.members.iter().map(|(i, u)| (*i, u.clone())).collect();
            for (m, u) in members {
                if let Some(s) = scheds.sched(&u) {
                    outs.push((u.clone(), s.set_gang(now, m, Some(gid))));
                }
            }
        }
        outs.extend(self.step(scheds, now));
        (true, outs)
    }

    /// Client `id` left (its scheduler already forgot it).
    pub fn leave(&mut self, scheds: &mut impl Scheds, now: Nanos, id: ClientId) -> Outs {
        let Some(gid) = self.of_client.remove(&id) else {
            return Vec::new();
        };
        let mut outs = Vec::new();
        let Some(group) = self.groups.get_mut(&gid) else {
            return outs;
        };
        group.members.remove(&id);
        if !group.ganged() {
            let members: Vec<(ClientId, String)> =
                group.members.iter().map(|(i, u)| (*i, u.clone())).collect();
            for (m, u) in members {
                if let Some(s) = scheds.sched(&u) {
                    outs.push((u.clone(), s.set_gang(now, m, None)));
                }
            }
            self.release(gid, None);
            if let Some(g) = self.groups.get_mut(&gid) {
                g.turn = Turn::Idle;
            }
        } else {
            // Reservations of GPUs it no longer uses go.
            let keep = group.gpus();
            self.release(gid, Some(&keep));
        }
        if self.groups.get(&gid).is_some_and(|g| g.members.is_empty()) {
            let g = self.groups.remove(&gid).expect("checked");
            self.by_key.remove(&g.key);
        }
        outs.extend(self.step(scheds, now));
        outs
    }

    /// Gives back group `gid`'s reservations, except those of GPUs in `keep`: they
    /// are set free at the end of the step ([`Gangs::step`]).
    fn release(&mut self, gid: GangId, keep: Option<&BTreeSet<String>>) {
        let Some(group) = self.groups.get_mut(&gid) else {
            return;
        };
        let gone: Vec<String> = group
            .reserved
            .iter()
            .filter(|u| keep.is_none_or(|k| !k.contains(*u)))
            .cloned()
            .collect();
        for u in gone {
            group.reserved.remove(&u);
            self.freeing.insert(u);
        }
    }

    /// Moves every group's turn on after any scheduler step: ends turns, claims GPUs
    /// for waiting groups, starts turns whose GPUs are ready. Cheap without groups.
    pub fn step(&mut self, scheds: &mut impl Scheds, now: Nanos) -> Outs {
        let mut outs = Vec::new();
        if self.groups.is_empty()
            && self.wanted.is_empty()
            && self.freeing.is_empty()
            && self.aligned.is_empty()
        {
            return outs;
        }
        let ids: Vec<GangId> = self.groups.keys().copied().collect();
        let mut wanted: BTreeSet<String> = BTreeSet::new();

        // 1. Running turns: end them when nobody of the group holds any more, drop
        //    every member when one is dropped.
        for &gid in &ids {
            let g = &self.groups[&gid];
            if !matches!(g.turn, Turn::Running | Turn::Ending) {
                continue;
            }
            let gpus = g.gpus();
            let holds = gpus
                .iter()
                .any(|u| scheds.sched(u).is_some_and(|s| s.gang_holds(gid)));
            if !holds {
                self.release(gid, None);
                self.groups.get_mut(&gid).expect("listed").turn = Turn::Idle;
                continue;
            }
            let dropped = gpus
                .iter()
                .find_map(|u| scheds.sched(u).and_then(|s| s.gang_dropped(gid)));
            if let (Some(reason), Turn::Running) = (dropped, g.turn) {
                self.groups.get_mut(&gid).expect("listed").turn = Turn::Ending;
                for u in gpus {
                    if let Some(s) = scheds.sched(&u) {
                        let mut o = s.drop_gang(now, gid, reason);
                        o.extend(s.set_reserve(now, Reserve::Claimed(gid)));
                        outs.push((u.clone(), o));
                    }
                }
            }
        }

        // 1b. A member that holds a GPU taken in turns outside its group's turn (it
        //     was granted before its group spanned GPUs, or kept when its shared GPU
        //     stopped fitting) is asked to drop at once: its work may wait for peers
        //     that are not running, and the longer it runs the likelier it is caught
        //     mid-exchange by a drop it cannot drain (two such members crosswise
        //     hold memory each other's peers need, for good). Its group's turn
        //     brings it back.
        for &gid in &ids {
            let g = &self.groups[&gid];
            if matches!(g.turn, Turn::Running | Turn::Ending) || !g.ganged() {
                continue;
            }
            for u in g.gpus() {
                if let Some(s) = scheds.sched(&u) {
                    let o = s.drop_gang(now, gid, DropReason::NoLongerFits);
                    outs.push((u.clone(), o));
                }
            }
        }

        // 2. Who waits for a turn: first the groups a member of which already holds a
        //    GPU outside a turn of theirs (it was granted before its group spanned
        //    GPUs, or while its GPU ran shared): its work may wait for its peers', and
        //    a member dropped there cannot drain, so its memory would stay and block
        //    whoever comes next (two such jobs crosswise block each other for good);
        //    then the oldest.
        let mut waiting: Vec<(bool, Nanos, GangId)> = Vec::new();
        for &gid in &ids {
            let g = &self.groups[&gid];
            if matches!(g.turn, Turn::Running | Turn::Ending) || !g.ganged() {
                continue;
            }
            let since = g
                .gpus()
                .iter()
                .filter_map(|u| scheds.sched(u).and_then(|s| s.gang_waits(gid)))
                .min();
            let started = g
                .gpus()
                .iter()
                .any(|u| scheds.sched(u).is_some_and(|s| s.gang_holds(gid)));
            match since {
                Some(t) => waiting.push((!started, t, gid)),
                None if g.turn == Turn::Claimed => {
                    self.release(gid, None);
                    self.groups.get_mut(&gid).expect("listed").turn = Turn::Idle;
                }
                None => {}
            }
        }
        waiting.sort();

        // 3. Claims, in the order the groups began to wait: all or nothing, except
        //    that the oldest group that cannot have them all claims those it can.
        //    A GPU is not claimed ahead of a client outside any group that asked for
        //    it earlier (it is served first, round-robin as before); one another
        //    group has is marked wanted, so that group's quantum ends.
        let mut owner: BTreeMap<String, GangId> = BTreeMap::new();
        for (&gid, g) in &self.groups {
            for u in &g.reserved {
                owner.insert(u.clone(), gid);
            }
        }
        let mut partial_taken = false;
        for &(fresh, since, gid) in &waiting {
            let gpus = self.groups[&gid].gpus();
            let mut blocked = false;
            let mut free = Vec::new();
            for u in &gpus {
                match owner.get(u) {
                    Some(&o) if o == gid => {}
                    Some(_) => {
                        blocked = true;
                        wanted.insert(u.clone());
                    }
                    None => {
                        // A started group finishes first, whoever asked earlier.
                        let earlier = fresh
                            && scheds
                                .sched(u)
                                .and_then(|s| s.first_outsider_wait())
                                .is_some_and(|t| t < since);
                        if earlier {
                            blocked = true;
                        } else {
                            free.push(u.clone());
                        }
                    }
                }
            }
            if blocked && partial_taken {
                // Not the oldest blocked group: it holds nothing meanwhile.
                self.release(gid, None);
                self.groups.get_mut(&gid).expect("listed").turn = Turn::Idle;
                continue;
            }
            partial_taken |= blocked;
            let g = self.groups.get_mut(&gid).expect("listed");
            g.turn = Turn::Claimed;
            for u in free {
                owner.insert(u.clone(), gid);
                g.reserved.insert(u.clone());
                self.freeing.remove(&u);
                if let Some(s) = scheds.sched(&u) {
                    outs.push((u.clone(), s.set_reserve(now, Reserve::Claimed(gid))));
                }
            }
        }
        // GPUs let go and claimed by nobody: round-robin as before.
        for u in std::mem::take(&mut self.freeing) {
            if owner.contains_key(&u) {
                continue;
            }
            if let Some(s) = scheds.sched(&u) {
                outs.push((u.clone(), s.set_reserve(now, Reserve::Free)));
            }
        }

        // 3b. A group that claims all its GPUs waits for the last of the holders
        //     outside it: the others are dropped no sooner, so their GPUs do not
        //     idle meanwhile (with per-GPU quanta out of step, each GPU of a
        //     2-GPU job idled up to a quantum before every turn of the job).
        let mut aligned: BTreeMap<String, Nanos> = BTreeMap::new();
        for &(_, _, gid) in &waiting {
            let g = &self.groups[&gid];
            if g.turn != Turn::Claimed || g.reserved != g.gpus() {
                continue;
            }
            let ends: Vec<Nanos> = g
                .reserved
                .iter()
                .filter_map(|u| scheds.sched(u).and_then(|s| s.outsider_quantum_end(gid)))
                .collect();
            let Some(last) = ends.iter().copied().max() else {
                continue;
            };
            for u in &g.reserved {
                aligned.insert(u.clone(), last);
            }
        }
        for u in std::mem::take(&mut self.aligned) {
            if !aligned.contains_key(&u) {
                if let Some(s) = scheds.sched(&u) {
                    outs.push((u.clone(), s.set_claim_aligned(now, None)));
                }
            }
        }
        for (u, &t) in &aligned {
            if let Some(s) = scheds.sched(u) {
                outs.push((u.clone(), s.set_claim_aligned(now, Some(t))));
            }
        }
        self.aligned = aligned.into_keys().collect();

        // 4. Start the turns whose GPUs are all claimed and ready.
        for &(_, _, gid) in &waiting {
            let g = &self.groups[&gid];
            if g.turn != Turn::Claimed || g.reserved != g.gpus() {
                continue;
            }
            let gpus = g.gpus();
            let mut ready = true;
            for u in &gpus {
                let Some(s) = scheds.sched(u) else {
                    ready = false;
                    continue;
                };
                let (ok, o) = s.gang_ready(now, gid);
                if !o.is_empty() {
                    outs.push((u.clone(), o));
                }
                ready &= ok;
            }
            if !ready {
                continue;
            }
            let key = g.key.clone();
            let n = gpus.len() as u32;
            self.groups.get_mut(&gid).expect("listed").turn = Turn::Running;
            self.turns += 1;
            for u in gpus {
                if let Some(s) = scheds.sched(&u) {
                    let mut o = vec![Output::Log(
                        None,
                        EventKind::GroupTurn {
                            group: key.clone(),
                            gpus: n,
                        },
                    )];
                    o.extend(s.set_reserve(now, Reserve::Running(gid)));
                    outs.push((u, o));
                }
            }
        }

        // 5. GPUs a group waits for while another group has them; and every GPU of
        //    a running turn when someone outside the group waits on any of them (a
        //    member holding alone on another GPU would keep the whole turn, the GPU
        //    the waiter needs included, past its quantum).
        for (&gid, g) in &self.groups {
            if g.turn == Turn::Running
                && g.reserved
                    .iter()
                    .any(|u| scheds.sched(u).is_some_and(|s| s.others_wait(gid)))
            {
                wanted.extend(g.reserved.iter().cloned());
            }
        }
        let before = std::mem::take(&mut self.wanted);
        for u in before.symmetric_difference(&wanted) {
            if let Some(s) = scheds.sched(u) {
                outs.push((u.clone(), s.set_gang_wanted(now, wanted.contains(u))));
            }
        }
        self.wanted = wanted;
        outs.retain(|(_, o)| !o.is_empty());
        outs
    }
}

#[cfg(test)]
mod tests;
