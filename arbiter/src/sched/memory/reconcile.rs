//! The driver's per-process figures (NVML) checked against the clients' reports
//! ([`GpuScheduler::reconcile`]): memory a client's process holds beyond its reports
//! counts as its memory no swap frees, a claim no process backs does not, and the
//! processes that are no client count in the ledger ([`Ledger`]'s `outside_kiwi`).

use super::*;

/// How often the server gives each GPU's scheduler the driver's per-process figures
/// ([`GpuScheduler::reconcile`]).
pub const RECONCILE_INTERVAL_NS: u64 = 1_000_000_000;

/// Looks in a row, the client's reports unchanged, before its process's memory
/// beyond them is counted ([`GpuScheduler::reconcile`]).
pub const RECONCILE_LOOKS: usize = 3;

/// Memory the driver counts for a process beyond its reports that is not counted:
/// allocation granularity and the driver's own bookkeeping
/// ([`GpuScheduler::reconcile`]).
pub const UNREPORTED_SLACK: u64 = 64 << 20;

impl GpuScheduler {
    /// The driver's figure of each process's memory on this GPU (`(host pid, bytes)`,
    /// from NVML), looked at every [`RECONCILE_INTERVAL_NS`], checks what each
    /// client's reports claim (its resident memory and its memory no swap frees)
    /// against what its process holds, over the last [`RECONCILE_LOOKS`] looks while
    /// no swap, reclaim or checkpoint of it was under way:
    ///
    /// - What its process holds beyond its reports is memory no swap frees that the
    ///   shim could not see — NVIDIA's runtime 13 loads kernel code inside launches
    ///   (190 MiB for PyTorch's first kernels on an H200, docs/gpu-validation.md) —
    ///   and is counted as such: the least figure of the looks less the least claim
    ///   (a figure that leads a report by a moment shows in one look, not in all; a
    ///   client that changes its reports at every look, claiming its memory one
    ///   second and not the next, is counted at what it claimed least).
    /// - Memory no swap frees it reports beyond what its process holds at all, in
    ///   every look, is a claim no process backs (a client of a process with no GPU
    ///   memory): not counted, so it keeps nobody checkpointed or waiting. Judged
    ///   only where the driver lists the processes of some client of this GPU: where
    ///   it lists none (a driver that does not say), no claim is doubted.
    ///
    /// Moves of less than [`UNREPORTED_SLACK`] are noise.
    pub fn reconcile(&mut self, now: Nanos, procs: &[(u32, u64)]) -> Vec<Output> {
        let listing = procs
            .iter()
            .any(|&(pid, _)| pid != 0 && self.clients.values().any(|c| c.info.host_pid == pid));
        self.ledger.listing = listing;
        let mut changed = Vec::new();
        let mut doubted = Vec::new();
        for (&id, c) in self.clients.iter_mut() {
            if c.info.host_pid == 0 {
                continue;
            }
            let found = procs
                .iter()
                .find(|&&(pid, _)| pid == c.info.host_pid)
                .map(|&(_, bytes)| bytes);
            // A process NVML does not list holds nothing on this GPU, where NVML
            // lists the others'.
            let Some(bytes) = found.or(listing.then_some(0)) else {
                c.looks.clear();
                c.driver_bytes = None;
                continue;
            };
            c.driver_bytes = Some(bytes);
            let busy = c.reclaim_pending > 0
                || c.ckpt != checkpoint::Ckpt::None
                || self.draining.contains_key(&id)
                || self.holders.get(&id).is_some_and(|h| h.drop_sent.is_some());
            if busy {
                c.looks.clear();
                continue;
            }
            let claimed = c
                .usage
                .resident_bytes
                .saturating_add(c.reported_unswappable);
            c.looks.push_back((bytes, claimed));
            if c.looks.len() > RECONCILE_LOOKS {
                c.looks.pop_front();
            }
            if c.looks.len() < RECONCILE_LOOKS {
                continue;
            }
            let least_held = c.looks.iter().map(|l| l.0).min().unwrap_or(0);
            let least_claimed = c.looks.iter().map(|l| l.1).min().unwrap_or(0);
            let beyond = least_held.saturating_sub(least_claimed);
            let unreported = if beyond >= UNREPORTED_SLACK {
                beyond.min(self.ledger.total)
            } else {
                0
            };
            // Its memory no swap frees that no look found held, at any claim.
            let unbacked = c
                .looks
                .iter()
                .map(|&(held, claimed)| claimed.saturating_sub(held).min(c.reported_unswappable))
                .min()
                .unwrap_or(0);
            let overclaimed = if listing && unbacked >= UNREPORTED_SLACK {
                unbacked
            } else {
                0
            };
            if overclaimed.abs_diff(c.overclaimed) >= UNREPORTED_SLACK
                || (overclaimed == 0) != (c.overclaimed == 0)
            {
                c.overclaimed = overclaimed;
                c.unswappable = Self::counted_unswappable(c, self.ledger.total);
                doubted.push((id, overclaimed));
            }
            if unreported.abs_diff(c.unreported) >= UNREPORTED_SLACK
                || (unreported == 0) != (c.unreported == 0)
            {
                c.unreported = unreported;
                c.unswappable = Self::counted_unswappable(c, self.ledger.total);
                changed.push((id, unreported));
            }
        }
        let outside = self.reconcile_outside(procs);
        if changed.is_empty() && doubted.is_empty() && outside.is_none() {
            return Vec::new();
        }
        for (id, bytes) in changed {
            self.log(Some(id), EventKind::Unreported { bytes });
        }
        for (id, bytes) in doubted {
            self.log(Some(id), EventKind::Unbacked { bytes });
        }
        if let Some(bytes) = outside {
            self.log(None, EventKind::OutsideKiwi { bytes });
        }
        self.finish(now)
    }

    /// The processes NVML lists that are no client here: memory no swap frees, and
    /// none of Kiwi's to evict (a process run without Kiwi, a shim its GPU refused, a
    /// tool with a context). Each counts at the least of its last
    /// [`RECONCILE_LOOKS`] looks (a process about to register is listed before it
    /// does), from [`UNREPORTED_SLACK`] on. Only while every client's host pid is
    /// known: one that is not (an arbiter outside the host's pid namespace) would be
    /// counted twice. Returns the new total when it changed by the slack or more.
    fn reconcile_outside(&mut self, procs: &[(u32, u64)]) -> Option<u64> {
        let known = self.clients.values().all(|c| c.info.host_pid != 0);
        let clients: std::collections::BTreeSet<u32> =
            self.clients.values().map(|c| c.info.host_pid).collect();
        let mut listed = std::collections::BTreeSet::new();
        for &(pid, bytes) in procs {
            if !known || pid == 0 || clients.contains(&pid) || !listed.insert(pid) {
                continue;
            }
            let seen = self.ledger.outside_looks.entry(pid).or_default();
            seen.push(bytes);
            if seen.len() > RECONCILE_LOOKS {
                seen.remove(0);
            }
        }
        self.ledger
            .outside_looks
            .retain(|pid, _| listed.contains(pid));
        let outside = self
            .ledger
            .outside_looks
            .values()
            .filter(|seen| seen.len() >= RECONCILE_LOOKS)
            .map(|seen| seen.iter().copied().min().unwrap_or(0))
            .filter(|&b| b >= UNREPORTED_SLACK)
            .fold(0u64, u64::saturating_add)
            .min(self.ledger.total);
        let news = outside.abs_diff(self.ledger.outside_kiwi) >= UNREPORTED_SLACK
            || (outside == 0) != (self.ledger.outside_kiwi == 0);
        news.then(|| {
            self.ledger.outside_kiwi = outside;
            outside
        })
    }
}
