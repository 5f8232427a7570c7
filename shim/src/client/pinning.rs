//! The pinning thread: page-locks the host buffers of the next swap-outs ahead,
//! one step at a time, outside every lock the critical path takes.

use super::*;

impl Client {
    /// Starts the pinning thread, once per process.
    pub(super) fn start_pinning(self: &Arc<Self>) {
        if self.pin_started.set(()).is_err() {
            return;
        }
        let c = self.clone();
        if let Err(e) = std::thread::Builder::new()
            .name("kiwi-pin".into())
            .spawn(move || c.pin_loop())
        {
            crate::kwarn!("cannot start the shim's pinning thread ({e}): swap buffers are pinned when a swap needs them");
        }
    }

    /// The working set on GPU `d` grew: where someone may ask for the GPU (shared or
    /// oversubscribed), the pinning thread prepares the new memory's buffers now,
    /// not at its next look ([`PIN_RECHECK`] later): a notebook that grew may be
    /// asked for the GPU 100 ms later (issue #28).
    pub fn grew(&self, d: usize) {
        if self
            .turn_for(d)
            .is_some_and(|t| t.shared.load(Ordering::Relaxed) || t.pressure.load(Ordering::Relaxed))
        {
            self.wake_pinning();
        }
    }

    /// Tells the pinning thread that a turn's target changed.
    pub(super) fn wake_pinning(&self) {
        *lock(&self.pin_work) = true;
        self.pin_cv.notify_one();
    }

    /// The pinning thread: prepares the pinned host buffers each turn's next swap-out
    /// needs, one [`PIN_STEP`] at a time over the turns, holding none of the shim's
    /// locks while it pins (page-locking runs at a few GB/s). It has its own thread so
    /// that a turn's thread (early releases, drops, grants) never waits behind it.
    /// While some turn has a target it looks again every [`PIN_RECHECK`]: the working
    /// set grows, a swap-in turns buffers back into spares.
    pub(super) fn pin_loop(&self) {
        // Pinning is a potentially unsafe call: relaxed, it never invalidates the
        // application's captures.
        crate::capture::relax_this_thread();
        // Its buffers are prepared ahead: the swap pool refuses them first.
        crate::pool::mark_ahead();
        loop {
            let busy = self.turns().any(|t| {
                t.pressure.load(Ordering::Relaxed)
                    || t.shared.load(Ordering::Relaxed)
                    || t.pin_target.load(Ordering::Relaxed) > 0
            });
            {
                let mut w = lock(&self.pin_work);
                if !*w {
                    let wait = if busy {
                        PIN_RECHECK
                    } else {
                        Duration::from_secs(3600)
                    };
                    w = self
                        .pin_cv
                        .wait_timeout(w, wait)
                        .unwrap_or_else(|p| p.into_inner())
                        .0;
                }
                *w = false;
            }
            // Checkpointed, every driver call waits for the restore, and some of this
            // thread's make them holding the allocator's lock, which the client thread
            // needs to go on (to reconnect to a restarted arbiter, say): nothing until
            // the restore wakes it.
            if self.turns().any(|t| t.checkpointed()) {
                continue;
            }
            let want = self.spill_want.swap(0, Ordering::AcqRel);
            if want > 0 {
                self.give_back_pool(want);
            }
            loop {
                let mut more = false;
                for turn in self.turns() {
                    more |= Self::pin_step(turn);
                }
                if !more {
                    break;
                }
                std::thread::yield_now();
            }
        }
    }

    /// The arbiter asked for `want` bytes of the node's swap pool back: spare buffers,
    /// then swapped-out contents moved to the pool's disk tier, from the GPUs with no
    /// swap under way.
    fn give_back_pool(&self, want: u64) {
        let t = Instant::now();
        let mut done = 0u64;
        for turn in self.turns() {
            if done >= want {
                break;
            }
            if turn.swapping.load(Ordering::Acquire) > 0 {
                continue;
            }
            done += turn.res.spill(want - done);
        }
        if done > 0 {
            stats::SPILLED_BYTES.fetch_add(done, Ordering::Relaxed);
            crate::kinfo!(
                "gave back {} MiB of the node's swap pool in {:?} (spare buffers, and swapped-out memory moved to its disk tier; it comes back from there at the next swap-in)",
                done >> 20,
                t.elapsed()
            );
        }
    }

    /// One step of pinning ahead for `turn`; returns whether more is left.
    pub(super) fn pin_step(turn: &Turn) -> bool {
        let ahead = turn.pressure.load(Ordering::Acquire) || turn.shared.load(Ordering::Acquire);
        if turn.pin_trim.swap(false, Ordering::AcqRel) && !ahead {
            let n = turn.res.trim_spare_buffers();
            if n > 0 {
                crate::kdebug!(
                    "GPU {}: no longer oversubscribed; freed {n} bytes of spare pinned buffers",
                    turn.info.ordinal
                );
            }
        }
        // Oversubscribed, or shared (someone may ask at any moment): the buffers of
        // a full swap-out, prepared as the working set grows.
        let target = if ahead {
            u64::MAX
        } else {
            turn.pin_target.load(Ordering::Acquire)
        }
        .min(turn.swap_budget.load(Ordering::Relaxed));
        if turn.swapping.load(Ordering::Acquire) > 0 {
            return false;
        }
        // Swapped-out contents in pageable buffers first: the next swap-in wants them
        // pinned. They are registered whatever the target (they exist already).
        match turn.res.register_swapped(PIN_STEP) {
            Ok(0) => {}
            Ok(n) => {
                crate::kdebug!(
                    "GPU {}: registered {n} bytes of swapped-out contents in place",
                    turn.info.ordinal
                );
                stats::REGISTERED_IN_PLACE_BYTES.fetch_add(n, Ordering::Relaxed);
                return true;
            }
            Err(e) => crate::kdebug!(
                "GPU {}: registering swapped-out contents in place failed with CUDA error {e}",
                turn.info.ordinal
            ),
        }
        if target == 0 {
            return false;
        }
        // Never pin ahead what the host cannot spare: two 60 GB JAX processes on an
        // H100 host of 125 GiB each pinned a full swap-out's buffers ahead, and the
        // kernel's OOM killer took one of them (exit 137). The swap-out itself still
        // gets its buffers when it comes (on its critical path).
        if let Some(avail) = host_available() {
            if !may_pin_ahead(avail, PIN_STEP) {
                if !turn.pin_held_back.swap(true, Ordering::Relaxed) {
                    crate::kinfo!(
                        "GPU {}: host memory is short ({} MiB available): not pinning swap buffers ahead",
                        turn.info.ordinal,
                        avail >> 20
                    );
                }
                return false;
            }
            turn.pin_held_back.store(false, Ordering::Relaxed);
        }
        let t = Instant::now();
        match turn.res.prepare_swap_out(target, PIN_STEP) {
            Ok(0) => {
                if turn.pinning.swap(false, Ordering::Relaxed) {
                    crate::kdebug!(
                        "GPU {}: pinning ahead done: the next swap-out's buffers are ready",
                        turn.info.ordinal
                    );
                }
                false
            }
            Ok(n) => {
                turn.pinning.store(true, Ordering::Relaxed);
                crate::kdebug!(
                    "GPU {}: pinned {n} bytes ahead in {:?}",
                    turn.info.ordinal,
                    t.elapsed()
                );
                stats::PINNED_AHEAD_BYTES.fetch_add(n, Ordering::Relaxed);
                true
            }
            Err(e) => {
                crate::kdebug!(
                    "GPU {}: pinning swap buffers ahead failed with CUDA error {e}",
                    turn.info.ordinal
                );
                false
            }
        }
    }
}

/// Host memory pinning ahead leaves alone: what the rest of the node (other
/// processes, their swap-outs, the page cache it needs) may want meanwhile.
const HOST_KEEP: u64 = 8 << 30;

/// Whether pinning `step` more bytes ahead leaves the host [`HOST_KEEP`] with
/// `available` bytes available now.
pub(super) fn may_pin_ahead(available: u64, step: u64) -> bool {
    available >= HOST_KEEP.saturating_add(step)
}

/// Memory this process may still take on the host: `MemAvailable` of
/// `/proc/meminfo`, or less where its memory cgroup limits it (pinned memory is
/// charged there, and a pod over its limit is killed). `None` where neither can be
/// read.
fn host_available() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok();
    let host = meminfo.as_deref().and_then(mem_available);
    let own = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    let cgroup = cgroup_files(&own).into_iter().find_map(|(max, cur)| {
        let max = std::fs::read_to_string(max).ok()?;
        let cur = std::fs::read_to_string(cur).ok()?;
        Some(kiwi_units::cgroup::room(&max, &cur))
    });
    match (host, cgroup.flatten()) {
        (Some(h), Some(c)) => Some(h.min(c)),
        (h, c) => h.or(c),
    }
}

/// Where this process's memory limit and use may be read, from its
/// `/proc/self/cgroup` text, first found first: cgroup v2 (`0::PATH`:
/// `memory.max`, `memory.current`) and v1 (the `memory` controller's line:
/// `memory.limit_in_bytes`, `memory.usage_in_bytes`), each under its path, then at
/// the mount's root (a container's own cgroup, mounted there with a cgroup
/// namespace or by its runtime).
pub(super) fn cgroup_files(own: &str) -> Vec<(String, String)> {
    let mut files = Vec::new();
    for c in kiwi_units::cgroup::memory_cgroups(own) {
        let root = match c.mount {
            "" => "/sys/fs/cgroup".to_string(),
            mount => format!("/sys/fs/cgroup/{mount}"),
        };
        let path = c.path.trim_end_matches('/');
        for dir in [format!("{root}{path}"), root] {
            files.push((
                format!("{dir}/{}", c.limit_file),
                format!("{dir}/{}", c.usage_file),
            ));
        }
    }
    files.dedup();
    files
}

/// `MemAvailable` in bytes from `/proc/meminfo`'s text.
pub(super) fn mem_available(meminfo: &str) -> Option<u64> {
    meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|v| v.trim().strip_suffix("kB"))
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map(|kb| kb << 10)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_memory_figures_are_read_and_pinning_ahead_keeps_a_margin() {
        let meminfo =
            "MemTotal:       131072000 kB\nMemFree:         1000 kB\nMemAvailable:   10485760 kB\n";
        assert_eq!(mem_available(meminfo), Some(10 << 30));
        assert_eq!(mem_available("MemTotal: 5 kB\n"), None);
        // Where to read them: v2 under the process's path, then the root; v1 the
        // memory controller's likewise; other controllers are not looked at.
        let v2 = cgroup_files("0::/kubepods/pod1/abc\n");
        assert_eq!(
            v2,
            vec![
                (
                    "/sys/fs/cgroup/kubepods/pod1/abc/memory.max".to_string(),
                    "/sys/fs/cgroup/kubepods/pod1/abc/memory.current".to_string()
                ),
                (
                    "/sys/fs/cgroup/memory.max".to_string(),
                    "/sys/fs/cgroup/memory.current".to_string()
                ),
            ]
        );
        assert_eq!(cgroup_files("0::/\n").len(), 1);
        let v1 = cgroup_files("5:cpu,cpuacct:/x\n4:memory:/process_api/52dc\n0::/\n");
        assert_eq!(
            v1[0],
            (
                "/sys/fs/cgroup/memory/process_api/52dc/memory.limit_in_bytes".to_string(),
                "/sys/fs/cgroup/memory/process_api/52dc/memory.usage_in_bytes".to_string()
            )
        );
        assert_eq!(v1[1].0, "/sys/fs/cgroup/memory/memory.limit_in_bytes");
        assert_eq!(v1[2].0, "/sys/fs/cgroup/memory.max");
        assert!(cgroup_files("garbage\n\n").is_empty());
        assert!(may_pin_ahead(10 << 30, 64 << 20));
        assert!(!may_pin_ahead(8 << 30, 64 << 20));
        assert!(!may_pin_ahead(0, 64 << 20));
    }
}
