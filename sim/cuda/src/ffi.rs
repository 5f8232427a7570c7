//! Helpers for the C boundary: every export runs its body through [`guard`] so a
//! panic becomes `CUDA_ERROR_UNKNOWN` instead of unwinding into C, and reads/writes
//! caller pointers only through the checked helpers here.

use crate::abi::*;
use std::panic::{catch_unwind, AssertUnwindSafe};

/// Runs an export's body; a panic turns into `CUDA_ERROR_UNKNOWN`.
#[inline]
pub fn guard(f: impl FnOnce() -> Result<(), CUresult>) -> CUresult {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => CUDA_SUCCESS,
        Ok(Err(e)) => e,
        Err(_) => CUDA_ERROR_UNKNOWN,
    }
}

/// Writes `v` through a caller's out-pointer; NULL is `CUDA_ERROR_INVALID_VALUE`.
#[inline]
pub fn out<T>(p: *mut T, v: T) -> Result<(), CUresult> {
    if p.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: the C API contract: a non-NULL out-pointer points to writable storage
    // for a T (we use write_unaligned so even a misaligned one is not UB here).
    unsafe { p.write_unaligned(v) };
    Ok(())
}

/// Reads a T from a caller's in-pointer; NULL is `CUDA_ERROR_INVALID_VALUE`.
#[inline]
pub fn read<T: Copy>(p: *const T) -> Result<T, CUresult> {
    if p.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: the C API contract: a non-NULL in-pointer points to a readable T.
    Ok(unsafe { p.read_unaligned() })
}

/// Reads a NUL-terminated C string argument.
pub fn c_str<'a>(p: *const std::ffi::c_char) -> Result<&'a str, CUresult> {
    if p.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: the C API contract: a non-NULL string argument is NUL-terminated and
    // lives for the duration of the call.
    unsafe { std::ffi::CStr::from_ptr(p) }
        .to_str()
        .map_err(|_| CUDA_ERROR_INVALID_VALUE)
}

/// Copies `s` (truncated, NUL-terminated) into a caller's `len`-byte buffer.
pub fn write_c_string(buf: *mut std::ffi::c_char, len: i32, s: &str) -> Result<(), CUresult> {
    if buf.is_null() || len <= 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let n = s.len().min(len as usize - 1);
    // SAFETY: the caller gave a buffer of `len` bytes; we write n + 1 <= len bytes.
    unsafe {
        std::ptr::copy_nonoverlapping(s.as_ptr(), buf.cast::<u8>(), n);
        *buf.add(n) = 0;
    }
    Ok(())
}
