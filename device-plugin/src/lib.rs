//! `kiwi-device-plugin`: advertises each GPU to the kubelet as N virtual GPUs
//! (`<GPU-UUID>::<n>` under `kiwi.dev/gpu`), so the Kubernetes scheduler can place
//! several Pods on one GPU; `Allocate` answers with `KIWI_VISIBLE_DEVICES`, which
//! `kiwi-runtime` acts on.
//!
//! Modules by concern: [`api`] (the kubelet's v1beta1 protocol, generated),
//! [`gpu`] / [`nvml`] / [`topology`] (finding GPUs and their health), [`health`]
//! (the monitor thread), [`devices`] (vGPU IDs and allocation policy), [`plugin`]
//! (the gRPC service), [`kubelet`] (registration), [`server`] (life cycle),
//! [`settings`] (flags over the config file), [`metrics`], and [`fake_kubelet`] for
//! tests and the benchmark.

/// The kubelet device plugin API, v1beta1, generated from `proto/api.proto`.
#[allow(clippy::all, clippy::pedantic, missing_docs)]
pub mod api {
    tonic::include_proto!("v1beta1");
}

pub mod devices;
pub mod fake_kubelet;
pub mod gpu;
pub mod health;
pub mod kubelet;
pub mod metrics;
pub mod nvml;
pub mod plugin;
pub mod server;
pub mod settings;
pub mod topology;

pub use server::{run, PluginError, Settings};
