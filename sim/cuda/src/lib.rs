//! `libcuda.so.1` of the Kiwi GPU simulator: the CUDA driver API's C ABI over
//! simulated GPUs whose capacity and kernel exclusivity are shared by every process
//! naming the same machine (`KIWI_SIM_NAME`). See `docs/simulator.md`.
//!
//! Modules, in one-way layers (a module uses only those below it; the test
//! `sim/core/tests/layers.rs` checks it):
//!
//! 1. `exports`: the one declaration list of every exported symbol, its version and
//!    per-thread twin, the C ABI and the checkpoint gate every call passes.
//! 2. `procaddr` (`cuGetProcAddress`, over the tables `exports` registers at load
//!    time) and `dark_api` (`cuGetExportTable`: the CUDA runtime's private tables).
//! 3. `api`: what each export does.
//! 4. `capture` (stream capture and its rules, every submission's way in),
//!    `checkpoint` (`cuCheckpointProcess*`: the restore thread and the gate's state),
//!    `pool` (stream-ordered memory pools).
//! 5. `driver`: the process's registry (contexts, streams, events, modules, graphs)
//!    and each thread's context stack.
//! 6. `exec`: contexts' executors, streams, events, built-in kernels.
//! 7. `memop` (stream memory operations: what submission takes, what a wait and
//!    a write do when their stream reaches them).
//! 8. `hw` (the machine, rates and costs, the trace, the address space as this
//!    process sees them), `pool_usage` (which pool each allocation came from).
//! 9. `memory` (device address space, VMM), `ffi` (the panic guard and pointer
//!    helpers), `abi` (types and values of `cuda.h`).
//! 10. `backing` (where device memory lives: extents of each GPU's memory file,
//!     slabs of small allocations, moves to host memory at a checkpoint).
//!
//! This crate is only ever built as a cdylib, so no test binary contains `cu*`
//! symbols; shared logic lives in `kiwi-sim-core`.

mod abi;
mod api;
mod backing;
mod capture;
mod checkpoint;
mod dark_api;
mod driver;
mod exec;
mod exports;
mod ffi;
mod hw;
mod library;
mod memop;
mod memory;
mod pool;
mod pool_usage;
mod procaddr;
