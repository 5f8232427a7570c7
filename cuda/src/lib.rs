//! The CUDA driver API as Kiwi speaks it, written once, in three layers (as cudarc
//! splits its driver bindings):
//!
//! - [`sys`]: the C ABI of `cuda.h` (CUDA 12): handle types, result codes, flags,
//!   attributes and the structs Kiwi reads or writes. Nothing there calls anything.
//!   `tests/cuda_h.rs` checks every value and layout against NVIDIA's real header.
//! - [`result`]: a result code as a Rust `Result` ([`result::check`]) and the names
//!   and descriptions of the codes Kiwi knows (`cuGetErrorName`/`cuGetErrorString`).
//! - [`loader`]: `libcuda.so.1` (or any library standing for it) opened with
//!   `dlopen` at run time, so nothing that uses this crate needs CUDA to build, and
//!   its entry points resolved by name.
//!
//! Beside them, [`filemap`]: host memory made of files mapped side by side at one
//! address (the shim's swap-out buffers and spilled memory, the simulator's device
//! memory), here because all its users link this crate.
//!
//! The shim (`libkiwi.so`), the simulator's `libcuda.so.1`, gpuburst and the arbiter's
//! checkpointer all use it. It owns no state and no policy: which entry points a user
//! resolves, and how it calls them, are the user's. No serde, no async runtime, and
//! nothing on a path a launch takes allocates or locks, so the shim can link it.

pub mod filemap;
pub mod loader;
pub mod result;
pub mod sys;

pub use loader::{Library, LoadError, LIBCUDA};
pub use result::{check, CudaError};

/// A device UUID as `nvidia-smi -L` writes it: `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`.
pub fn format_uuid(u: &sys::CUuuid) -> String {
    let h = |r: std::ops::Range<usize>| -> String {
        u.bytes[r].iter().map(|b| format!("{b:02x}")).collect()
    };
    format!(
        "GPU-{}-{}-{}-{}-{}",
        h(0..4),
        h(4..6),
        h(6..8),
        h(8..10),
        h(10..16)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuid_format_matches_nvidia_smi() {
        let u = sys::CUuuid {
            bytes: [
                0x8a, 0x3c, 0x01, 0x02, 0xab, 0xcd, 0xef, 0x01, 0x23, 0x45, 0x67, 0x89, 0xaa, 0xbb,
                0xcc, 0xdd,
            ],
        };
        assert_eq!(format_uuid(&u), "GPU-8a3c0102-abcd-ef01-2345-6789aabbccdd");
    }
}
