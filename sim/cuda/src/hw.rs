//! The simulated hardware as this process sees it: the machine segment, the GPUs'
//! rates and costs, the kernel trace and the device address space. Below the
//! executors (`exec`), which run work against it, and the driver's registry
//! (`driver`), which derefs to it.

use kiwi_sim_core::trace::TraceWriter;
use kiwi_sim_core::Machine;

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
