//! gpuburst's program: allocate and fill memory, alternate CPU phases with GPU
//! bursts of real kernels, and verify every byte with `kiwi_checksum` against a
//! host-side model.
//!
//! Memory is `--mem` bytes in allocations of at most 256 MiB plus three small ones
//! (so allocators with size classes are exercised). Each allocation holds one u32
//! value in every word: `kiwi_fill` sets it from the seed, each burst's `kiwi_add`
//! adds a per-(burst, allocation) delta, and the host model tracks the value, so
//! the expected checksum of an allocation is `words × value`.
//!
//! The wait before a burst: the burst starts with a 1 ms `kiwi_spin` that the
//! program waits for; wait = (time from submitting it to its completion) − 1 ms.
//! Under Kiwi this is the time spent waiting for the GPU.
//!
//! `--device 1,0` uses several GPUs: `--mem` is allocated on each, and every burst
//! does its part on each device in the listed order (its context made current),
//! then synchronizes them all; verification covers every device.
//!
//! `--exchange FILE:RANK` ([`crate::exchange`]) ends every burst (a step) on each
//! device with a write of the step into its rank's slot and a wait for the peer's,
//! enqueued on the legacy stream after the step's work; the step's synchronization
//! then polls `cuStreamQuery` so that a peer that never comes fails the program
//! after `--exchange-timeout-ms` instead of hanging it.
//!
//! `--alloc device|vmm|managed` ([`crate::memory`]) says how the memory is
//! allocated: `cuMemAlloc`, the application's own virtual memory as PyTorch's
//! `expandable_segments` manages it, or managed memory (also read back on the host
//! at every verification). `--ipc export:FILE` / `--ipc import:FILE`
//! ([`crate::ipc`]) make two programs a CUDA IPC pair: the exporter shares one more
//! allocation, the importer opens it, and both verify it, read only. A verification
//! that fails names the device, the allocation and the first wrong word.
//!
//! Its parts: [`options`](Options) the command line; `phases` what a run is made of;
//! `device` a GPU in use and its memory; `step` a GPU phase; `verify` the checksums;
//! `shared` the memory of an IPC pair; `discard` `--discard`'s answers; `report`
//! the lines printed; `run` the run loop over them.

mod device;
mod discard;
mod options;
mod phases;
mod report;
mod run;
mod shared;
mod step;
mod verify;

pub use device::{mix, plan_allocations, retain_primary};
/// CLOCK_MONOTONIC in ns (the arbiter's and the simulator's clock).
pub use kiwi_protocol::monotonic_ns;
pub use options::{parse_devices, Options, USAGE};
pub use phases::{parse_script, Phase};
pub use run::run;

use crate::driver::CudaError;

/// How gpuburst ended badly.
#[derive(Debug)]
pub enum Failure {
    /// A driver call failed (exit code 2).
    Cuda(CudaError),
    /// Device memory did not hold what the program wrote (exit code 3).
    Mismatch(String),
    /// Bad input at run time (`--start-on-stdin` got no start time, an unusable
    /// `--exchange` file or a driver without its entry points; exit code 1).
    Input(String),
    /// An `--exchange` step did not finish within `--exchange-timeout-ms` (exit
    /// code 4).
    Timeout(String),
}

impl From<CudaError> for Failure {
    fn from(e: CudaError) -> Self {
        Failure::Cuda(e)
    }
}
