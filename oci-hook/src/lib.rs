//! Kiwi's way into containers: the `kiwi-runtime` runc wrapper, the `kiwi-hook` OCI
//! hook, and the CDI spec generator behind `kiwictl cdi generate`.
//!
//! The wrapper edits a claimed container's `config.json` (device nodes, device-cgroup
//! allow rules, driver libraries, the hook) and then `exec`s the real runtime; the hook
//! runs inside the container's mount namespace before `pivot_root` and binds the shim,
//! the arbiter's client socket directory and `/etc/ld.so.preload`. A container whose
//! process environment claims no vGPU (`KIWI_VISIBLE_DEVICES`) is never touched.
//!
//! Modules, by concern:
//! - [`attach`]: the container's own client socket (recorded, asked of the arbiter, dropped).
//! - [`claim`]: parsing `KIWI_VISIBLE_DEVICES`.
//! - [`gpu`]: turning a claim into host device nodes (GPU discovery and the GPU list
//!   file are the `kiwi-nvml` crate's, shared with the device plugin).
//! - [`spec`]: reading, editing and writing back an OCI `config.json`.
//! - [`runc_args`]: the runc-compatible command line the wrapper accepts.
//! - [`runtime`]: what `kiwi-runtime` does before it execs the real runtime.
//! - [`driver`]: finding the driver's user-space files on the host.
//! - [`hook`]: what `kiwi-hook` does inside the container's mount namespace.
//! - [`securejoin`]: resolving container paths without escaping the rootfs.
//! - [`cdi`]: the CDI spec for runtimes that speak CDI.
//! - [`log`]: the one-line log both binaries append to.

pub mod attach;
pub mod cdi;
pub mod claim;
pub mod driver;
pub mod gpu;
pub mod hook;
pub mod log;
pub mod runc_args;
pub mod runtime;
pub mod securejoin;
pub mod spec;

/// The environment variable that claims vGPUs in a container's process env.
pub const CLAIM_ENV: &str = "KIWI_VISIBLE_DEVICES";
/// Set for NVIDIA's container toolkit when the real runtime is `nvidia-container-runtime`.
pub const NVIDIA_VISIBLE_DEVICES_ENV: &str = "NVIDIA_VISIBLE_DEVICES";
