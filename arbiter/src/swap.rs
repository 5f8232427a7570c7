//! The node's host-RAM swap budget, enforced through admission.
//!
//! GPU memory that does not fit in a GPU lives in host RAM while its owner waits. The
//! node's **swap need** is the least host RAM that must hold such memory:
//!
//! ```text
//! need = Σ over GPUs g of max(0, Σ over clients c on g of working_set(c) − capacity(g))
//! ```
//!
//! where `capacity(g)` is what the scheduler schedules against (total − context
//! reserve). With a budget configured (`kiwi-arbiter --swap-budget`), a client asks
//! before its working set grows ([`kiwi_protocol::ClientMsg::Admit`]). The request is
//! admitted when the need it leads to is within the budget, or when it does not raise
//! the need at all (shrinking, or growth that still fits in the GPU), so a node that is
//! already over budget (clients registered with large working sets, the budget
//! lowered by a restart) never blocks a client from giving memory back.
//!
//! An admitted working set is counted at once (see [`crate::sched::GpuScheduler::admit`])
//! under the daemon's state lock, so two clients racing for the last of the budget
//! cannot both be admitted. Usage reports are never refused: memory an application
//! allocated without asking (its own VMM mappings) is counted as reported.

use crate::sched::{ClientId, GpuScheduler};

/// The answer to one admission request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Admission {
    pub ok: bool,
    /// Node swap need now.
    pub need_before: u64,
    /// Node swap need with the requested working set.
    pub need_after: u64,
    /// The budget; `u64::MAX` when unlimited.
    pub budget: u64,
}

/// The admission rule: within the budget, or not raising the need.
pub fn admissible(budget: Option<u64>, need_before: u64, need_after: u64) -> bool {
    match budget {
        None => true,
        Some(b) => need_after <= b || need_after <= need_before,
    }
}

/// The node's swap need over `gpus`.
pub fn node_swap_need<'a>(gpus: impl IntoIterator<Item = &'a GpuScheduler>) -> u64 {
    gpus.into_iter()
        .map(GpuScheduler::swap_need)
        .fold(0u64, u64::saturating_add)
}

/// Host RAM holding swapped-out memory now, over `gpus`.
pub fn node_swapped_bytes<'a>(gpus: impl IntoIterator<Item = &'a GpuScheduler>) -> u64 {
    gpus.into_iter()
        .map(GpuScheduler::swapped_bytes)
        .fold(0u64, u64::saturating_add)
}

/// Decides client `id`'s request to grow (or shrink) its working set on `target` to
/// `working_set` bytes. `all` is every GPU of the node, `target` among them. Changes
/// nothing: on `ok` the caller records the working set with
/// [`GpuScheduler::admit`] before it lets go of the state.
///
/// The need is counted as [`GpuScheduler::admission_need`] counts it: the requester's
/// own working set as it reports it, every other client's only as far as an
/// admission or memory its process is seen to hold (`held(host pid)`: the swap
/// pool's lending) backs it.
pub fn decide<'a>(
    budget: Option<u64>,
    all: impl IntoIterator<Item = &'a GpuScheduler>,
    target: &GpuScheduler,
    id: ClientId,
    working_set: u64,
    held: &dyn Fn(u32) -> u64,
) -> Admission {
    let need_before = all
        .into_iter()
        .map(|g| g.admission_need(id, None, held))
        .fold(0u64, u64::saturating_add);
    let need_after = need_before
        .saturating_sub(target.admission_need(id, None, held))
        .saturating_add(target.admission_need(id, Some(working_set), held));
    Admission {
        ok: admissible(budget, need_before, need_after),
        need_before,
        need_after,
        budget: budget.unwrap_or(u64::MAX),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sched::{ClientInfo, Nanos};
    use kiwi_protocol::{ArbiterMsg, Settings, Usage};

    const MIB: u64 = 1 << 20;

    fn gpu(capacity: u64, budget: Option<u64>) -> GpuScheduler {
        GpuScheduler::new(
            capacity,
            capacity,
            Settings {
                scheduler_on: true,
                tq_ms: 30_000,
            },
            5_000,
        )
        .with_swap_budget(budget)
    }

    fn reg(g: &mut GpuScheduler, id: ClientId, ws: u64, resident: u64) {
        g.register(
            0,
            id,
            ClientInfo::default(),
            Usage {
                working_set_bytes: ws,
                resident_bytes: resident,
            },
            None,
        );
    }

    /// What the server does with an Admit: decide over every GPU, record when ok.
    fn admit(
        budget: Option<u64>,
        gpus: &mut [GpuScheduler],
        on: usize,
        id: ClientId,
        ws: u64,
    ) -> Admission {
        let a = decide(budget, gpus.iter(), &gpus[on], id, ws, &|_| u64::MAX);
        if a.ok {
            let now: Nanos = 1;
            gpus[on].admit(now, id, ws);
        }
        a
    }

    #[test]
    fn need_is_the_overflow_summed_over_gpus() {
        let mut gpus = [gpu(1000 * MIB, None), gpu(500 * MIB, None)];
        assert_eq!(node_swap_need(gpus.iter()), 0);
        reg(&mut gpus[0], 1, 600 * MIB, 600 * MIB);
        reg(&mut gpus[0], 2, 300 * MIB, 0);
        // GPU 0 fits (900 of 1000): no need, even though client 2 is not resident.
        assert_eq!(gpus[0].swap_need(), 0);
        assert_eq!(node_swapped_bytes(gpus.iter()), 300 * MIB);
        reg(&mut gpus[1], 3, 700 * MIB, 500 * MIB);
        assert_eq!(node_swap_need(gpus.iter()), 200 * MIB);
        reg(&mut gpus[0], 4, 250 * MIB, 0);
        // GPU 0: 1150 − 1000; GPU 1: 700 − 500. A GPU under capacity never offsets
        // another's overflow.
        assert_eq!(node_swap_need(gpus.iter()), 150 * MIB + 200 * MIB);
        assert_eq!(gpus[0].swap_need_with(4, 0), 0);
        assert_eq!(gpus[0].swap_need_with(4, 400 * MIB), 300 * MIB);
        // A client unknown to the GPU counts as new.
        assert_eq!(gpus[1].swap_need_with(99, 10 * MIB), 210 * MIB);
    }

    #[test]
    fn admission_rule() {
        assert!(admissible(None, 0, u64::MAX));
        assert!(admissible(Some(100), 0, 100));
        assert!(!admissible(Some(100), 0, 101));
        // Over budget already: what does not raise the need is admitted.
        assert!(admissible(Some(100), 300, 300));
        assert!(admissible(Some(100), 300, 200));
        assert!(!admissible(Some(100), 300, 301));
        // A zero budget: nothing may spill.
        assert!(admissible(Some(0), 0, 0));
        assert!(!admissible(Some(0), 0, 1));
    }

    #[test]
    fn growth_that_fits_is_admitted_past_the_budget_refused() {
        let budget = Some(100 * MIB);
        let mut gpus = [gpu(1000 * MIB, budget), gpu(1000 * MIB, budget)];
        reg(&mut gpus[0], 1, 0, 0);
        reg(&mut gpus[0], 2, 0, 0);
        reg(&mut gpus[1], 3, 0, 0);
        // Fits in the GPU: no swap needed at all.
        let a = admit(budget, &mut gpus, 0, 1, 800 * MIB);
        assert!(a.ok);
        assert_eq!((a.need_before, a.need_after), (0, 0));
        // 800 + 250 = 1050: 50 MiB of swap, within the 100 MiB budget.
        let a = admit(budget, &mut gpus, 0, 2, 250 * MIB);
        assert!(a.ok, "{a:?}");
        assert_eq!(a.need_after, 50 * MIB);
        assert_eq!(a.budget, 100 * MIB);
        // The other GPU spills 60 MiB more: 110 > 100, refused, nothing changes.
        let a = admit(budget, &mut gpus, 1, 3, 1060 * MIB);
        assert!(!a.ok, "{a:?}");
        assert_eq!(a.need_before, 50 * MIB);
        assert_eq!(a.need_after, 110 * MIB);
        assert_eq!(
            gpus[1].swap_need_with(3, 0),
            0,
            "client 3 still has nothing"
        );
        assert_eq!(node_swap_need(gpus.iter()), 50 * MIB);
        // 50 MiB more fits exactly.
        assert!(admit(budget, &mut gpus, 1, 3, 1050 * MIB).ok);
        assert_eq!(node_swap_need(gpus.iter()), 100 * MIB);
    }

    #[test]
    fn shrinking_is_always_admitted() {
        let budget = Some(10 * MIB);
        // Registered over budget (e.g. before a restart lowered it).
        let mut gpus = [gpu(1000 * MIB, budget)];
        reg(&mut gpus[0], 1, 900 * MIB, 900 * MIB);
        reg(&mut gpus[0], 2, 400 * MIB, 0);
        assert_eq!(node_swap_need(gpus.iter()), 300 * MIB);
        // Growing is refused, by any amount.
        assert!(!admit(budget, &mut gpus, 0, 2, 400 * MIB + 1).ok);
        // Staying put, shrinking a little, shrinking to nothing: all admitted.
        assert!(admit(budget, &mut gpus, 0, 2, 400 * MIB).ok);
        assert!(admit(budget, &mut gpus, 0, 2, 350 * MIB).ok);
        assert_eq!(node_swap_need(gpus.iter()), 250 * MIB);
        assert!(admit(budget, &mut gpus, 0, 1, 0).ok);
        assert_eq!(node_swap_need(gpus.iter()), 0);
        // And now there is room again.
        assert!(admit(budget, &mut gpus, 0, 2, 1010 * MIB).ok);
        assert!(!admit(budget, &mut gpus, 0, 2, 1010 * MIB + 1).ok);
    }

    #[test]
    fn racing_clients_cannot_both_take_the_last_of_the_budget() {
        let budget = Some(100 * MIB);
        let mut gpus = [gpu(1000 * MIB, budget)];
        reg(&mut gpus[0], 1, 500 * MIB, 500 * MIB);
        reg(&mut gpus[0], 2, 500 * MIB, 500 * MIB);
        // Both ask for 80 MiB more (each alone would be within budget).
        let first = admit(budget, &mut gpus, 0, 1, 580 * MIB);
        let second = admit(budget, &mut gpus, 0, 2, 580 * MIB);
        assert!(first.ok);
        assert_eq!(first.need_after, 80 * MIB);
        assert!(!second.ok, "{second:?}");
        assert_eq!(second.need_before, 80 * MIB, "the first is counted at once");
        assert_eq!(second.need_after, 160 * MIB);
        // The second can have what is left.
        assert!(admit(budget, &mut gpus, 0, 2, 520 * MIB).ok);
        assert_eq!(node_swap_need(gpus.iter()), 100 * MIB);
    }

    #[test]
    fn admitted_working_set_keeps_residency_and_usage_overrides_it() {
        let mut gpus = [gpu(1000 * MIB, Some(0))];
        reg(&mut gpus[0], 1, 100 * MIB, 100 * MIB);
        assert!(admit(Some(0), &mut gpus, 0, 1, 900 * MIB).ok);
        let st = gpus[0].status(1, 0, "GPU-x");
        assert_eq!(st.clients[0].working_set_bytes, 900 * MIB);
        assert_eq!(st.clients[0].resident_bytes, 100 * MIB);
        // A usage report beyond anything admitted is still taken as reported.
        gpus[0].usage(
            2,
            1,
            Usage {
                working_set_bytes: 1200 * MIB,
                resident_bytes: 1000 * MIB,
            },
        );
        assert_eq!(node_swap_need(gpus.iter()), 200 * MIB);
    }

    #[test]
    fn a_claim_nothing_backs_never_refuses_another_tenants_growth() {
        let budget = Some(100 * MIB);
        let mut gpus = [gpu(1000 * MIB, budget), gpu(1000 * MIB, budget)];
        // A tenant reports 3 GiB on GPU 0, nothing of it admitted or seen held.
        reg(&mut gpus[0], 1, 3000 * MIB, 0);
        reg(&mut gpus[0], 2, 0, 0);
        reg(&mut gpus[1], 3, 0, 0);
        assert_eq!(
            node_swap_need(gpus.iter()),
            2000 * MIB,
            "status shows the claim"
        );
        let nothing_held = |_: u32| 0;
        for (on, id) in [(0, 2), (1, 3)] {
            let a = decide(budget, gpus.iter(), &gpus[on], id, 900 * MIB, &nothing_held);
            assert!(a.ok, "client {id}: {a:?}");
            assert_eq!(a.need_before, 0);
        }
        // What the pool lends its process backs its claim, up to what it claims.
        let held = |pid: u32| if pid == 7 { 1500 * MIB } else { 0 };
        let mut g = gpu(1000 * MIB, budget);
        g.register(
            0,
            1,
            ClientInfo {
                host_pid: 7,
                ..ClientInfo::default()
            },
            Usage {
                working_set_bytes: 3000 * MIB,
                resident_bytes: 0,
            },
            None,
        );
        reg(&mut g, 2, 0, 0);
        let gs = [g];
        let a = decide(budget, gs.iter(), &gs[0], 2, 100 * MIB, &held);
        assert_eq!(
            (a.ok, a.need_before, a.need_after),
            (false, 500 * MIB, 600 * MIB)
        );
        // And its own admission backs it.
        let mut gpus = [gpu(1000 * MIB, budget)];
        reg(&mut gpus[0], 1, 0, 0);
        reg(&mut gpus[0], 2, 0, 0);
        assert!(decide(budget, gpus.iter(), &gpus[0], 1, 1050 * MIB, &nothing_held).ok);
        gpus[0].admit(1, 1, 1050 * MIB);
        let a = decide(budget, gpus.iter(), &gpus[0], 2, 100 * MIB, &nothing_held);
        assert_eq!((a.ok, a.need_after), (false, 150 * MIB));
    }

    #[test]
    fn registered_tells_the_budget_only_when_set() {
        for budget in [None, Some(64 * MIB)] {
            let mut g = gpu(1000 * MIB, budget);
            let outs = g.register(0, 1, ClientInfo::default(), Usage::default(), None);
            let told = outs.iter().find_map(|o| match o {
                crate::sched::Output::Send(
                    1,
                    ArbiterMsg::Registered {
                        swap_budget_bytes, ..
                    },
                ) => Some(*swap_budget_bytes),
                _ => None,
            });
            assert_eq!(told, Some(budget));
        }
    }
}
