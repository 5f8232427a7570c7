//! Shared logic of the Kiwi GPU simulator.
//!
//! The simulator is two C-ABI libraries (`libcuda.so.1` from `sim/cuda`, and
//! `libnvidia-ml.so.1` from `sim/nvml`) plus this crate, which both depend on.
//! This crate owns everything that is not ABI glue:
//!
//! - [`knobs`]: the `KIWI_SIM_*` environment knobs;
//! - [`machine`]: the named shared-memory segment that makes one simulated GPU the
//!   same GPU for every process naming it (capacity, per-process use, faults), the
//!   cross-process kernel lock and each GPU's PCIe link (one queue per direction);
//! - [`trace`]: the kernel trace format, its writer, and the analysis helper that
//!   answers "did A and B ever run kernels at the same time?";
//! - [`install`]: putting the two cdylibs together in `target/<profile>/sim/`;
//! - [`ident`]: GPU UUIDs and PCI identities, identical for both stand-ins;
//! - [`dma`]: how host↔device copies move their bytes (the copy engine);
//! - [`integrity`]: the answer to the CUDA runtime's integrity check.
//!
//! It must not export any `cu*`/`nvml*` symbol: test binaries link it.

pub mod dma;
pub mod harness;
pub mod ident;
pub mod install;
pub mod integrity;
pub mod knobs;
pub mod machine;
pub mod trace;

pub use install::{ensure_sim_dir, install_sim_dir, profile_dir_of_current_exe};
pub use knobs::{KnobError, SimConfig};
pub use machine::{FaultState, GpuUsage, LinkDir, Machine, MachineError, ProcessUsage};
pub use trace::{monotonic_ns, TraceRecord};

/// Granularity of VMM allocations and mappings on current NVIDIA GPUs (2 MiB).
pub const GRANULARITY: u64 = 2 << 20;
