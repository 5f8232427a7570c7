//! `libnvidia-ml.so.1` of the Kiwi GPU simulator: NVML for the simulated GPUs of the
//! machine segment, the same GPUs (same UUIDs, PCI addresses, memory and processes)
//! the simulator's `libcuda.so.1` shows. It answers what the device plugin uses
//! (identity, memory, processes, Xid events raised with `kiwi-sim fault`) and what
//! the monitoring tools call (pynvml, nvitop, gpustat: memory `_v2`, the process lists
//! in every version, utilization, sensors, clocks, power, PCIe, modes), with the
//! driver's `NVML_ERROR_NOT_SUPPORTED` where a real board of its kind says so.
//!
//! Layers, one way: `exports` (the one declaration list of C symbols, each through
//! a panic guard) → the area modules (`system`, `device`, `memory`,
//! `telemetry`, `modes`, `events`) → `state` (the machine and handles) and
//! `model` (the board's fixed answers, no C) → `kiwi_sim_core`. Only `ffi`
//! touches the caller's memory; `abi` holds `nvml.h`'s types.
//!
//! Every export catches panics and returns `NVML_ERROR_UNKNOWN` instead.

mod abi;
mod device;
mod events;
mod exports;
mod ffi;
mod memory;
mod model;
mod modes;
mod state;
mod system;
mod telemetry;
