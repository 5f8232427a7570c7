//! The simulated hardware as this process sees it: the machine segment, the GPUs'
//! rates and costs, the kernel trace and the device address space, and the two ways
//! a cost is paid in wall time ([`take_time`] for a call, [`pace`] for queued work).
//! Below the executors (`exec`), which run work against it, and the driver's
//! registry (`driver`), which derefs to it.

use std::time::{Duration, Instant};

use kiwi_sim_core::trace::TraceWriter;
use kiwi_sim_core::{monotonic_ns, Machine};

use crate::memory::Memory;

pub struct Hw {
    pub machine: &'static Machine,
    pub name: String,
    pub gpus: u32,
    /// Host↔device bandwidth in bytes/s.
    pub pcie_bps: f64,
    /// Device memory bandwidth in bytes/s.
    pub hbm_bps: f64,
    /// Device memory each context costs (the machine's `KIWI_SIM_CONTEXT_MEMORY`).
    pub context_memory: u64,
    /// Wall time each `cuMemCreate` call takes, in seconds (0: free, and the other
    /// VMM calls' costs off too).
    pub memcreate_s: f64,
    /// Wall time `cuMemCreate` takes per 2 MiB on top of the call's, in seconds.
    pub memcreate_s_per_2mib: f64,
    /// How fast host memory is page-locked, bytes/s (0: free), and memory already
    /// populated (`cuMemHostRegister` of pages touched before).
    pub pin_bps: f64,
    pub pin_populated_bps: f64,
    /// Copies with pageable host memory, bytes/s each way (0: at the link's rate).
    pub pageable_h2d_bps: f64,
    pub pageable_d2h_bps: f64,
    pub trace: Option<TraceWriter>,
    /// `KIWI_SIM_FAIL_SYNC` (fault injection, see `kiwi_sim_core::knobs`).
    pub fail_sync: Option<std::path::PathBuf>,
    pub mem: Memory,
}

impl Hw {
    /// Seconds page-locking `bytes` of fresh host memory takes.
    pub fn pin_seconds(&self, bytes: usize) -> f64 {
        if self.pin_bps > 0.0 {
            bytes as f64 / self.pin_bps
        } else {
            0.0
        }
    }
}

/// Makes a call that succeeded take at least `seconds` of wall time since `start`:
/// what the real driver spends page-locking host memory or creating physical
/// memory (knobs `KIWI_SIM_PIN_GBPS`, `KIWI_SIM_MEMCREATE_US_PER_2MIB`). Work the
/// simulator really did (populating pages) counts toward it.
///
/// A sleep, not a spin: the caller sees the latency it would on hardware, while the
/// host's cores (two on CI, shared by every simulated process) stay free for the
/// other processes, which on a real machine would not be slowed down by this one's
/// pinning.
pub fn take_time(start: Instant, seconds: f64) {
    if !(seconds.is_finite() && seconds > 0.0) {
        return;
    }
    let want = Duration::from_secs_f64(seconds);
    let Some(left) = want.checked_sub(start.elapsed()) else {
        return;
    };
    if left >= SLEEP_AT_LEAST {
        std::thread::sleep(left);
        return;
    }
    // A sleep overshoots by the timer slack (50 µs by default): a VMM call's tens
    // of µs are spun instead, as the driver spends them working. Not yielding: on a
    // loaded machine a yield can hand the core away for a whole time slice.
    while start.elapsed() < want {
        std::hint::spin_loop();
    }
}

/// Waits shorter than this spin rather than sleep.
const SLEEP_AT_LEAST: Duration = Duration::from_micros(200);

/// Sleeps until `seconds` of wall time have passed since `start_ns` (an executor
/// pacing work to its modelled duration).
pub fn pace(start_ns: u64, seconds: f64) {
    pace_until(start_ns + (seconds * 1e9) as u64);
}

/// Sleeps until `CLOCK_MONOTONIC` reads `target_ns`.
pub fn pace_until(target_ns: u64) {
    let now = monotonic_ns();
    if target_ns > now {
        std::thread::sleep(Duration::from_nanos(target_ns - now));
    }
}
