//! `kiwi-device-plugin`: advertises each GPU to the kubelet as N virtual GPUs
//! (`<GPU-UUID>::<n>` under `kiwi.dev/gpu`), so the Kubernetes scheduler can place
//! several Pods on one GPU; `Allocate` answers with `KIWI_VISIBLE_DEVICES`, which
//! `kiwi-runtime` acts on.
//!
//! Finding GPUs and probing their health is the `kiwi-nvml` crate's (one
//! [`kiwi_nvml::GpuDiscovery`] trait: NVML, the GPU list file, a fake for tests).
//! Modules by concern: [`api`] (the kubelet's v1beta1 protocol, generated), [`health`]
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
pub mod health;
pub mod kubelet;
pub mod metrics;
pub mod plugin;
pub mod server;
pub mod settings;

pub use server::{run, PluginError, Settings};
