//! `libcuda.so.1` of the Kiwi GPU simulator: the CUDA driver API's C ABI over
//! simulated GPUs whose capacity and kernel exclusivity are shared by every process
//! naming the same machine (`KIWI_SIM_NAME`). See `docs/simulator.md`.
//!
//! Modules: `abi` (types and values of `cuda.h`), `ffi` (the panic guard and
//! pointer helpers), `driver` (process state, context stacks), `memory` (device
//! address space, VMM), `exec` (contexts' executors, streams, events, built-in
//! kernels), `exports` (the one declaration list of every exported symbol, its
//! version and per-thread twin), `api` (what each export does), `procaddr`
//! (`cuGetProcAddress`) and `dark_api`
//! (`cuGetExportTable`: the CUDA runtime's private tables), `capture` (stream
//! capture and its rules), `pool` (stream-ordered memory pools), `checkpoint`
//! (`cuCheckpointProcess*`: the restore thread and the gate every call passes).
//!
//! This crate is only ever built as a cdylib, so no test binary contains `cu*`
//! symbols; shared logic lives in `kiwi-sim-core`.

mod abi;
mod api;
mod capture;
mod checkpoint;
mod dark_api;
mod driver;
mod exec;
mod exports;
mod ffi;
mod memory;
mod pool;
mod procaddr;
