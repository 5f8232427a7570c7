//! Helpers for the C boundary: [`guard`], which every export runs its body through
//! so a panic becomes `NVML_ERROR_UNKNOWN` instead of unwinding into C, and the only
//! places that read or write the caller's memory (out-pointers, strings, and NVML's
//! sized arrays). The exports' modules call these and never dereference a caller's
//! pointer themselves.

use std::ffi::{c_char, c_uint, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};

use crate::abi::*;

/// Runs an export's body; a panic turns into `NVML_ERROR_UNKNOWN`.
pub(crate) fn guard(f: impl FnOnce() -> Result<(), NvmlReturn>) -> NvmlReturn {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => NVML_SUCCESS,
        Ok(Err(e)) => e,
        Err(_) => NVML_ERROR_UNKNOWN,
    }
}

/// Writes `v` through a caller's out-pointer; NULL is `NVML_ERROR_INVALID_ARGUMENT`.
pub(crate) fn out<T>(p: *mut T, v: T) -> Result<(), NvmlReturn> {
    if p.is_null() {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    // SAFETY: NVML's contract: a non-NULL out-pointer points to storage for a T
    // (written unaligned, so even a misaligned one is no UB here).
    unsafe { p.write_unaligned(v) };
    Ok(())
}

/// Writes a query's two answers (current and pending mode, major and minor, low and
/// high): either pointer NULL is `NVML_ERROR_INVALID_ARGUMENT`, and then neither is
/// written.
pub(crate) fn out_pair<T, U>(p: *mut T, v: T, q: *mut U, w: U) -> Result<(), NvmlReturn> {
    if p.is_null() || q.is_null() {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    out(p, v)?;
    out(q, w)
}

/// Reads a T from a caller's in/out pointer; NULL is `NVML_ERROR_INVALID_ARGUMENT`.
pub(crate) fn read<T: Copy>(p: *const T) -> Result<T, NvmlReturn> {
    if p.is_null() {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    // SAFETY: NVML's contract: a non-NULL in/out pointer points to a readable T.
    Ok(unsafe { p.read_unaligned() })
}

/// Reads the `version` word that versioned structures (`nvmlMemory_v2_t`,
/// `nvmlTemperature_v1_t`) start with; NULL is `NVML_ERROR_INVALID_ARGUMENT`.
pub(crate) fn struct_version<T>(p: *const T) -> Result<c_uint, NvmlReturn> {
    read(p.cast::<c_uint>())
}

/// A NUL-terminated string argument.
pub(crate) fn c_str<'a>(p: *const c_char) -> Result<&'a str, NvmlReturn> {
    if p.is_null() {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    // SAFETY: NVML's contract: a non-NULL string argument is NUL-terminated and lives
    // for the duration of the call.
    unsafe { CStr::from_ptr(p) }
        .to_str()
        .map_err(|_| NVML_ERROR_INVALID_ARGUMENT)
}

/// Copies `s` and its NUL into a caller's `len`-byte buffer:
/// `NVML_ERROR_INSUFFICIENT_SIZE` when it does not fit (identity strings: UUID,
/// name, versions).
pub(crate) fn write_str(buf: *mut c_char, len: c_uint, s: &str) -> Result<(), NvmlReturn> {
    if buf.is_null() {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    if (len as usize) < s.len() + 1 {
        return Err(NVML_ERROR_INSUFFICIENT_SIZE);
    }
    copy_with_nul(buf, s.as_bytes());
    Ok(())
}

/// Copies as much of `s` as fits in a caller's `len`-byte buffer, NUL-terminated
/// (`nvmlSystemGetProcessName` crops the name to the buffer).
pub(crate) fn write_str_cropped(buf: *mut c_char, len: c_uint, s: &str) -> Result<(), NvmlReturn> {
    if buf.is_null() || len == 0 {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    let n = s.len().min(len as usize - 1);
    copy_with_nul(buf, &s.as_bytes()[..n]);
    Ok(())
}

fn copy_with_nul(buf: *mut c_char, bytes: &[u8]) {
    // SAFETY: both callers checked that the caller's buffer holds at least
    // bytes.len() + 1 bytes.
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), buf.cast::<u8>(), bytes.len());
        *buf.add(bytes.len()) = 0;
    }
}

/// A fixed-size, NUL-padded `char[N]` field holding `s` (cropped to N - 1 bytes).
pub(crate) fn fill_chars<const N: usize>(s: &str) -> [c_char; N] {
    let mut a = [0 as c_char; N];
    for (i, b) in s.bytes().take(N - 1).enumerate() {
        a[i] = b as c_char;
    }
    a
}

/// NVML's sized-array protocol (process lists, utilization samples): `*count` comes
/// in as the room in `items` and goes out as the number of entries there are. When
/// they do not fit, `NVML_ERROR_INSUFFICIENT_SIZE` with the count needed (so a first
/// call with `*count == 0` and NULL `items` asks how many); when none, success and 0.
pub(crate) fn write_array<T>(
    count: *mut c_uint,
    items: *mut T,
    values: Vec<T>,
) -> Result<(), NvmlReturn> {
    let room = read(count)? as usize;
    out(count, values.len() as c_uint)?;
    if values.len() > room {
        return Err(NVML_ERROR_INSUFFICIENT_SIZE);
    }
    if values.is_empty() {
        return Ok(());
    }
    if items.is_null() {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    for (k, v) in values.into_iter().enumerate() {
        // SAFETY: NVML's contract: `items` holds `room` entries, and k < len <= room.
        unsafe { items.add(k).write_unaligned(v) };
    }
    Ok(())
}
