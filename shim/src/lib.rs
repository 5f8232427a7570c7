//! `libkiwi.so`: the CUDA driver interposer that makes a GPU process swappable and
//! makes its work wait for its turn.
//!
//! Loaded with `LD_PRELOAD` or `/etc/ld.so.preload`, it exports the driver's entry
//! points ([`exports`]), its own `dlsym` ([`dl`]) and `cuGetProcAddress`
//! ([`procaddr`]), so every path into the driver meets the shim; and NVML's memory
//! and process queries ([`nvml`]), answered for the process's own view ([`view`]). Allocations are
//! VMM-backed and swappable at stable addresses ([`mem`]); submissions pass a gate
//! ([`gate`], its slow path [`submit`]) that is open only while this process holds
//! the GPU and its memory is resident; the arbiter conversation lives in [`client`].
//!
//! The modules form one-way layers: the C ABI → the hooked behaviour → the
//! mechanisms (gate, memory, turns) → the real driver, with leaves anyone may use
//! (`docs/shim.md` draws them; a unit test, `layers.rs`, enforces them).
//!
//! ## Environment (what `kiwictl run` sets)
//!
//! | variable | meaning |
//! | --- | --- |
//! | `LD_PRELOAD` | the shim: `/usr/local/lib/kiwi/libkiwi.so` (host), `target/<profile>/libkiwi.so` (tree) |
//! | `KIWI_SOCKET_DIR` | socket directory; the shim connects to `<dir>/client/arbiter.sock` (default `/run/kiwi`) |
//! | `KIWI_ARBITER_TIMEOUT` | seconds to wait for the arbiter at `cuInit` (default 30), then unmanaged |
//! | `KIWI_REQUIRE_ARBITER` | `1`: fail `cuInit` instead of running unmanaged |
//! | `KIWI_IDLE_MS` | idle time after which a contended holder releases early (default 100) |
//! | `KIWI_IDLE_MIN_MS` | the shortest such idle time, whatever the process's pauses (default 10) |
//! | `KIWI_PIPELINED` | `0`: no pipelined hand-offs (the next holder's swap-in waits for this one's whole swap-out; default on) |
//! | `KIWI_REAL_LIBCUDA` | path of the real driver (default `libcuda.so.1`) |
//! | `KIWI_LOG` | `error`, `warn` (default), `info`, `debug`; the two lines explaining a wait show unless it is `warn` or `error` |
//! | `KIWI_IPC_TIMEOUT_MS` | how long `cuIpcOpenMemHandle` waits for the exporter (default 30000) |
//! | `KIWI_STATS` | file the shim writes its counters to at exit |
//! | `KIWI_HINT_WAIT_MS` | how long a swap-out waits for the application to say which memory is dead (default 10); at most the arbiter's `--max-hint-wait-ms` (default 100), which the shim is told at registration: the next tenant waits for that swap-out |
//! | `KIWI_SWAP_PAGEABLE` | `1`: a swap-out that finds no pinned buffer ready copies into pageable memory, registered in place afterwards (default `0`: it page-locks one on its critical path; see `docs/shim.md`) |
//! | `KIWI_SWAP_POOL` | `0`: swap into this process's own memory, not the node's swap pool (default: borrow the pool's slices where the arbiter has one; see `pool`) |
//! | `KIWI_NVML_VIEW` | `0`: NVML in this process tells the physical GPU (every tenant's memory and processes) instead of this process's view, the one `cuMemGetInfo` gives (default on; see `view`) |
//! | `KIWI_POD_NAME`, `KIWI_POD_NAMESPACE`, `KIWI_CONTAINER_ID` | shown by `kiwictl status` |

pub mod appvmm;
pub mod attrs;
pub mod capture;
pub mod client;
pub mod cuda;
pub mod devices;
pub mod dl;
pub mod env;
pub mod exports;
pub mod ffi;
pub mod gate;
pub mod hint;
pub mod hooks;
pub mod idle;
pub mod ipc;
#[cfg(test)]
mod layers;
pub mod live;
pub mod log;
pub mod managed;
pub mod mem;
pub mod modules;
pub mod nvml;
pub mod pool;
pub mod pools;
pub mod procaddr;
pub mod real;
pub mod room;
pub mod stats;
pub mod status;
pub mod submit;
pub mod symbols;
pub mod view;
