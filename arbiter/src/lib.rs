//! kiwi-arbiter: the Kiwi Scheduler daemon.
//!
//! - [`sched`]: one GPU's scheduler as a pure state machine (no I/O, injected clock).
//! - [`gpus`]: the node's GPUs (from NVML when it loads) and the rule a registration's
//!   GPU UUID and size must pass.
//! - [`swap`]: the node's host-RAM swap budget: swap need and the admission rule.
//! - [`events`]: the per-GPU event log read by `kiwictl timeline`.
//! - [`metrics`]: Prometheus metrics (`--metrics-addr`).
//! - [`server`]: the tokio daemon: client and control sockets, timers, dispatch.
//! - [`daemon`]: binding the sockets on a directory, serving, cleaning up.
//! - [`checkpoint`]: whole-process eviction through the driver's checkpoint API.
//! - [`clock`]: CLOCK_MONOTONIC in nanoseconds, the clock of every timestamp.

pub mod checkpoint;
pub mod clock;
pub mod daemon;
pub mod events;
pub mod gang;
pub mod gpus;
pub mod metrics;
pub mod pool;
pub mod sched;
pub mod server;
pub mod swap;

pub use daemon::run_daemon;
pub use server::{serve, ServerConfig};
