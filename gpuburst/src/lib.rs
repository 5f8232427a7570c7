//! gpuburst: a sample GPU program that behaves like a notebook or a training loop
//! (CPU phases alternating with GPU bursts of real kernels, every byte verified at
//! the end), and `cuprobe`, a scripted exerciser of driver-API behaviours.
//!
//! Both find the driver the way the CUDA runtime does ([`driver`]): `dlopen
//! ("libcuda.so.1")`, then `cuGetProcAddress_v2` for every entry point. They run
//! unchanged on a real NVIDIA GPU (the PTX in [`kernels`] is JIT-compiled there)
//! and on the Kiwi simulator (which resolves the same entry names to built-ins).

// `cu!` passes its arguments straight to a C entry point inside `unsafe`: that is
// its purpose, and every call site passes plain values and live pointers.
#![allow(clippy::macro_metavars_in_unsafe)]

pub mod burst;
pub mod driver;
pub mod exchange;
pub mod ipc;
pub mod kernels;
pub mod memory;
