//! `libcuda.so.1` of the Kiwi GPU simulator: the CUDA driver API's C ABI over
//! simulated GPUs whose capacity and kernel exclusivity are shared by every process
//! naming the same machine (`KIWI_SIM_NAME`). See `docs/simulator.md`.
//!
//! Modules, in one-way layers (a module uses only those below it; the test
//! `sim/core/tests/layers.rs` checks it):
//!
//! 1. `exports`: the one declaration list of every exported symbol, its version,
//!    per-thread twin and the function that does what it does; the C ABI and the
//!    checkpoint gate every call passes.
//! 2. `procaddr` (`cuGetProcAddress`, over the tables `exports` registers at load
//!    time) and `dark_api` (`cuGetExportTable`: the CUDA runtime's private tables).
//! 3. The API, one module an area: `device` (init, devices, error strings),
//!    `context`, `alloc` (device and managed memory, pointers, legacy IPC), `pinned`
//!    (page-locked host memory), `copy` (copies and memsets), `vmm`, `graph`
//!    (stream capture and graphs), `launch` (modules, functions, launches); below
//!    them `stream` (streams, events, stream memory operations, and `enqueue`, how
//!    the other areas queue work on a stream) and `library` (`cuLibrary*`,
//!    `cuKernel*`).
//! 4. `capture` (stream capture and its rules, every submission's way in),
//!    `checkpoint` (`cuCheckpointProcess*`: the restore thread and the gate's state),
//!    `pool` (stream-ordered memory pools).
//! 5. `driver`: the process's registry (contexts, streams, events, modules, graphs)
//!    and each thread's context stack.
//! 6. `exec`: contexts' executors, streams, events.
//! 7. What executed work does: `builtin` (the built-in kernels), `transfer` (copies,
//!    memsets, prefetches: bytes, link, pacing), `memop` (stream memory operations:
//!    what submission takes, what a wait and a write do when their stream reaches
//!    them).
//! 8. `hw` (the machine, rates and costs and paying them in wall time, the trace, the
//!    address space as this process sees them), `pool_usage` (which pool each
//!    allocation came from).
//! 9. `memory` (device address space, VMM).
//! 10. `phys` (physical allocations, shareable and managed memory, the pieces work
//!     uses), `host_ranges` (pinned host memory the device reaches), `ffi` (the panic
//!     guard and pointer helpers), `abi` (types and values of `cuda.h`).
//! 11. `backing` (where device memory lives: extents of each GPU's memory file,
//!     slabs of small allocations, moves to host memory at a checkpoint).
//!
//! This crate is only ever built as a cdylib, so no test binary contains `cu*`
//! symbols; shared logic lives in `kiwi-sim-core`.

mod abi;
mod alloc;
mod backing;
mod builtin;
mod capture;
mod checkpoint;
mod context;
mod copy;
mod dark_api;
mod device;
mod driver;
mod exec;
mod exports;
mod ffi;
mod graph;
mod host_ranges;
mod hw;
mod launch;
mod library;
mod memop;
mod memory;
mod phys;
mod pinned;
mod pool;
mod pool_usage;
mod procaddr;
mod stream;
mod transfer;
mod vmm;
