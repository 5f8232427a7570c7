//! Kiwi's one GPU crate: NVML loaded with `dlopen` at run time, so the programs that
//! use it build and run on machines without the NVIDIA driver, and GPU discovery on
//! top of it. Shared by `kiwi-device-plugin` (discovery and health), `kiwi-oci`
//! (kiwi-runtime, kiwi-hook and `kiwictl cdi generate`: the GPUs a claim names),
//! `kiwi-arbiter` (each GPU's UUID and memory) and the shim (free memory without a
//! context, which uses [`Nvml`] only).
//!
//! Modules, lowest layer first:
//! - [`sys`]: NVML's C ABI, once (the loader, the shim's NVML view and the simulator's
//!   `libnvidia-ml.so.1` share it).
//! - [`nvml`] (re-exported here): [`Nvml`], whose methods return `Result`s.
//! - [`gpu`]: what a GPU is ([`Gpu`]), the rule a UUID must pass, and the one
//!   discovery trait, [`GpuDiscovery`].
//! - [`list`]: the GPU list file's one format and parser, and [`GpuListSource`].
//! - [`source`]: [`NvmlSource`], discovery and health through NVML.
//! - [`fake`]: [`FakeGpus`], an in-memory source for tests.
//! - [`topology`]: PCI bus ids and NUMA nodes from sysfs.
//!
//! Nothing here knows of vGPUs, the kubelet, containers or device nodes on the host;
//! no async runtime, so the shim's `cdylib` can depend on it.

pub mod fake;
pub mod gpu;
pub mod list;
pub mod nvml;
pub mod source;
pub mod sys;
pub mod topology;

pub use fake::{fake_uuid, FakeGpus};
pub use gpu::{minor_for_uuid, validate_uuid, Fault, Gpu, GpuDiscovery, GpuError, Probe};
pub use list::{parse_gpu_list, read_gpu_list, GpuListSource};
pub use nvml::{DeviceHandle, Event, EventSet, LoadError, Nvml, NvmlError, NVML_LIBRARY};
pub use source::NvmlSource;
