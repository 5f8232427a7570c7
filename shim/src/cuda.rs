//! The CUDA driver ABI the shim speaks: `kiwi_cuda::sys` (handle types, result codes,
//! the structs the VMM calls take; written once for all of Kiwi and checked against
//! `cuda.h` there), and the two spellings the declaration list (`symbols.rs`) uses
//! for parameters it only forwards. Nothing here calls anything.

#![allow(non_camel_case_types)]

use std::ffi::{c_uint, c_void};

pub use kiwi_cuda::format_uuid;
pub use kiwi_cuda::sys::*;

/// Pointers to structs the shim only forwards (launch configs, memcpy descriptors,
/// batch memory ops): opaque here.
pub type Opaque = *const c_void;

/// `unsigned int`, so that signatures read like `cuda.h`.
pub type Uint = c_uint;
