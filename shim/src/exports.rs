//! Every symbol `libkiwi.so` exports in the driver's name: the `extern "C"` wrappers,
//! generated from the declaration list of [`crate::symbols`] (its C signature and
//! gate class), and Kiwi's own C functions (`kiwi_status_json`, `kiwi_explain`,
//! `kiwiMemDiscard`, `kiwi_hint_wait`, `kiwi_hint_done`).
//!
//! - `pass`: forwarded unchanged to the original ([`crate::real`]).
//! - `submit`: work submission; waits for this process's turn and for its memory to be
//!   resident ([`crate::submit`]).
//! - `hook`: a function of the hooked behaviour decides (allocation, info, lookup).
//! - `driver`: no wrapper: the application reaches the driver's own function.
//!
//! `dlsym` ([`crate::dl`]) and `cuGetProcAddress` ([`crate::procaddr`]) map names and
//! original pointers to these wrappers through [`crate::symbols::SYMBOLS`] and
//! [`wrapper`], so all three paths into the driver meet the same code. This is the top
//! layer: nothing in the shim uses it but the C ABI's own modules.

#![allow(non_snake_case, clippy::too_many_arguments)]

use std::ffi::{c_char, c_int, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr::null_mut;
use std::time::Instant;

use crate::cuda::*;
use crate::symbols::{Sym, ALL};
// The hook paths of the declaration list resolve here.
use crate::{appvmm, attrs, capture, hooks, ipc, modules, pools, room};

/// `CUarray`: an opaque driver handle.
type CUarray = *mut c_void;
/// `CUdeviceptr_v1`: the 32-bit device pointer of the legacy (CUDA < 3.2) entry points.
#[allow(non_camel_case_types)]
type CUdeviceptr_v1 = u32;

macro_rules! exports {
    (@fn driver $name:ident) => {};
    (@fn pass $name:ident ($($arg:ident : $ty:ty),*)) => {
        /// # Safety
        /// C ABI export: arguments as `cuda.h` documents them; forwarded unchanged.
        #[cfg_attr(not(test), no_mangle)]
        pub unsafe extern "C" fn $name($($arg: $ty),*) -> CUresult {
            let real = exports!(@real $name ($($ty),*));
            // SAFETY: the caller's arguments, forwarded unchanged.
            unsafe { real($($arg),*) }
        }
    };
    // The original behind `$name` as its C signature; an export whose driver lacks it
    // returns `CUDA_ERROR_NOT_FOUND` (`crate::real::missing`).
    (@real $name:ident ($($ty:ty),*)) => {{
        let p = crate::real::original(Sym::$name as usize);
        if p.is_null() {
            return crate::real::missing(stringify!($name));
        }
        // SAFETY: p is the real driver's symbol of this very name, whose C signature is
        // the one declared here (cuda.h).
        unsafe {
            std::mem::transmute::<*mut c_void, unsafe extern "C" fn($($ty),*) -> CUresult>(p)
        }
    }};
    // The driver calling itself through an export: forwarded unchanged.
    (@reentered $real:ident ($($arg:ident),*)) => {
        if crate::ffi::reentered() {
            // SAFETY: the driver's own call, its arguments forwarded unchanged.
            return unsafe { $real($($arg),*) };
        }
    };
    (@fn submit $name:ident ($($arg:ident : $ty:ty),*)) => {
        /// # Safety
        /// C ABI export: arguments as `cuda.h` documents them; runs once this process
        /// holds the GPU and its memory is resident.
        #[cfg_attr(not(test), no_mangle)]
        pub unsafe extern "C" fn $name($($arg: $ty),*) -> CUresult {
            let real = exports!(@real $name ($($ty),*));
            exports!(@reentered real ($($arg),*));
            // SAFETY: the caller's arguments, forwarded unchanged once admitted (or at once
            // when recorded into a capture).
            crate::submit::submit(
                stringify!($name),
                || exports!(@stream $name ($($arg)*)),
                // SAFETY: as above.
                || unsafe { real($($arg),*) },
            )
        }
    };
    // The stream a submission goes to, for the gate's slow path (a submission into a
    // capturing stream is recorded, not run): the argument named `stream`, or the
    // `hStream` of a `cuLaunchKernelEx` config; NULL through a `_ptsz`/`_ptds` entry
    // point is the per-thread stream.
    (@stream $name:ident ()) => { None };
    (@stream $name:ident ($a:ident $($rest:ident)*)) => { exports!(@stream_is $name $a ($a) ($($rest)*)) };
    (@stream_is $name:ident stream ($s:ident) $rest:tt) => {
        Some(crate::capture::StreamArg::new($s, exports!(@per_thread $name)))
    };
    (@stream_is $name:ident config ($s:ident) $rest:tt) => {
        crate::capture::launch_config_stream($s, exports!(@per_thread $name))
    };
    (@stream_is $name:ident $other:ident ($s:ident) ($($rest:ident)*)) => { exports!(@stream $name ($($rest)*)) };
    (@per_thread $name:ident) => {
        stringify!($name).ends_with("_ptsz") || stringify!($name).ends_with("_ptds")
    };
    (@fn hook $name:ident ($($arg:ident : $ty:ty),*) => $hook:path) => {
        /// # Safety
        /// C ABI export: arguments as `cuda.h` documents them.
        #[cfg_attr(not(test), no_mangle)]
        pub unsafe extern "C" fn $name($($arg: $ty),*) -> CUresult {
            let real = exports!(@real $name ($($ty),*));
            exports!(@reentered real ($($arg),*));
            // SAFETY: the hook receives the caller's arguments and the original.
            crate::ffi::guarded(stringify!($name), || unsafe { $hook(real, $($arg),*) })
        }
    };
    ($( $(#[doc = $doc:literal])* $class:ident $name:ident $(( $($arg:ident : $ty:ty),* ))? $(=> $hook:path)? ; )*) => {
        /// The shim's wrapper for export `index` (null for a `driver` entry, which has none).
        pub fn wrapper(index: usize) -> *mut c_void {
            match ALL[index] {
                $( Sym::$name => exports!(@wrapper $class $name), )*
            }
        }

        $( exports!(@fn $class $name $(($($arg : $ty),*))? $(=> $hook)?); )*
    };
    (@wrapper driver $name:ident) => { null_mut() };
    (@wrapper $class:ident $name:ident) => { $name as *mut c_void };
}

crate::symbols::for_each_export!(exports);

/// The `cuGetProcAddress*` hooks: the driver answers, then its function is swapped
/// for the shim's wrapper ([`crate::procaddr::resolve`]). They hand out this module's
/// wrappers, so they live with them.
mod proc_address {
    use std::ffi::{c_char, c_int, c_void, CStr};
    use std::sync::atomic::Ordering;

    use super::{wrapper, ALL};
    use crate::cuda::{CUresult, CUDA_SUCCESS};
    use crate::procaddr::{resolve, Resolution};

    fn map_proc(symbol: *const c_char, pfn: *mut *mut c_void, flags: u64) {
        if symbol.is_null() || pfn.is_null() {
            return;
        }
        // SAFETY: pfn is the caller's out-pointer, just written by the driver.
        let driver_fn = unsafe { *pfn };
        // SAFETY: the caller passed a NUL-terminated symbol name.
        let name = unsafe { CStr::from_ptr(symbol) }.to_string_lossy();
        crate::real::load();
        // A driver whose table takes its own functions' addresses through the symbol
        // table (the simulator) hands out the shim's wrappers already, the preloaded
        // definitions winning: exactly the variant it chose.
        if !driver_fn.is_null() && (0..ALL.len()).any(|j| wrapper(j) == driver_fn) {
            crate::stats::PROCADDR_WRAPPED.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let by_version = || {
            crate::procaddr::variants_by_version(|v| {
                let mut p: *mut c_void = std::ptr::null_mut();
                let r = crate::real::call_real!(cuGetProcAddress: fn(*const c_char, *mut *mut c_void, c_int, u64)
                    (symbol, &mut p, v, flags));
                if r.is_ok() {
                    p
                } else {
                    std::ptr::null_mut()
                }
            })
        };
        if let Resolution::Wrapper(i) =
            resolve(&name, driver_fn, flags, crate::real::original, by_version)
        {
            crate::stats::PROCADDR_WRAPPED.fetch_add(1, Ordering::Relaxed);
            // SAFETY: as above.
            unsafe { *pfn = wrapper(i) };
        }
    }

    /// # Safety
    /// `real` is the driver's original of this entry point; the other arguments are the
    /// application's, valid as `cuda.h` documents them.
    pub unsafe fn get_proc_address(
        real: unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64) -> CUresult,
        symbol: *const c_char,
        pfn: *mut *mut c_void,
        cuda_version: c_int,
        flags: u64,
    ) -> CUresult {
        // SAFETY: forwarding the caller's arguments.
        let r = unsafe { real(symbol, pfn, cuda_version, flags) };
        if r == CUDA_SUCCESS {
            map_proc(symbol, pfn, flags);
        }
        r
    }

    /// # Safety
    /// `real` is the driver's original of this entry point; the other arguments are the
    /// application's, valid as `cuda.h` documents them.
    pub unsafe fn get_proc_address_v2(
        real: unsafe extern "C" fn(
            *const c_char,
            *mut *mut c_void,
            c_int,
            u64,
            *mut c_int,
        ) -> CUresult,
        symbol: *const c_char,
        pfn: *mut *mut c_void,
        cuda_version: c_int,
        flags: u64,
        status: *mut c_int,
    ) -> CUresult {
        // SAFETY: forwarding the caller's arguments.
        let r = unsafe { real(symbol, pfn, cuda_version, flags, status) };
        if r == CUDA_SUCCESS {
            map_proc(symbol, pfn, flags);
        }
        r
    }
}

// ---------------------------------------------------------------------------------
// Kiwi's own C functions, for the Python package (`python/kiwi`) and other callers
// that find them with `dlsym(RTLD_DEFAULT, …)`; documented in `docs/shim.md`. The
// wording is [`crate::status`]'s.

/// This process's GPUs as JSON (see `docs/shim.md`).
pub fn status_json() -> String {
    let now = Instant::now();
    let gpus: Vec<serde_json::Value> = crate::client::global()
        .map(|c| {
            c.turns()
                .map(|t| {
                    let (v, working_set, resident) = t.view();
                    let info = t.info();
                    crate::status::gpu_json(
                        info.ordinal,
                        &info.uuid,
                        &v,
                        working_set,
                        resident,
                        now,
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    serde_json::json!({
        "kiwi": crate::status::STATUS_VERSION,
        "pid": std::process::id(),
        "mode": crate::client::mode_name(),
        "gpus": gpus,
    })
    .to_string()
}

/// Copies `json` into `buf` (`len` bytes) with a NUL when it fits whole; else writes
/// an empty string (when `len > 0`). Returns `json`'s length, without the NUL.
///
/// # Safety
/// `buf` is null or valid for writes of `len` bytes.
unsafe fn copy_out(json: &str, buf: *mut c_char, len: usize) -> isize {
    let n = json.len();
    if buf.is_null() || len == 0 {
        return n as isize;
    }
    if n < len {
        // SAFETY: the caller's buffer holds `len` > n bytes: the JSON and its NUL fit.
        unsafe {
            std::ptr::copy_nonoverlapping(json.as_ptr(), buf.cast::<u8>(), n);
            *buf.add(n) = 0;
        }
    } else {
        // SAFETY: `len` ≥ 1: the first byte is the caller's.
        unsafe { *buf = 0 };
    }
    n as isize
}

/// `ssize_t kiwi_status_json(char *buf, size_t len)`: writes this process's GPUs as
/// JSON, NUL-terminated, into `buf` when it fits (`return value < len`); returns the
/// JSON's length in bytes without the NUL (call again with a larger buffer when it is
/// `>= len`; `buf` may be NULL to ask the length), or -1 on an internal error. Never
/// blocks behind a swap; thread-safe.
///
/// # Safety
/// `buf` is NULL or valid for writes of `len` bytes.
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn kiwi_status_json(buf: *mut c_char, len: usize) -> isize {
    match catch_unwind(AssertUnwindSafe(status_json)) {
        // SAFETY: the caller's promise about `buf`, passed on.
        Ok(json) => unsafe { copy_out(&json, buf, len) },
        Err(_) => -1,
    }
}

/// `int kiwi_explain(int on)`: shows (`on` ≠ 0) or silences the shim's two lines
/// that explain a wait on stderr, whatever `KIWI_LOG` said (`on` < 0: leaves it as
/// it is). Returns 1 when they were shown, 0 when not. `%load_ext kiwi` silences
/// them while its own live line is on.
#[cfg_attr(not(test), no_mangle)]
pub extern "C" fn kiwi_explain(on: std::ffi::c_int) -> std::ffi::c_int {
    let was = catch_unwind(|| {
        if on < 0 {
            crate::log::explain_enabled()
        } else {
            crate::log::set_explain(on != 0)
        }
    });
    std::ffi::c_int::from(was.unwrap_or(false))
}

/// `CUresult kiwiMemDiscard(CUdeviceptr ptr, size_t bytes)`: declares the contents of
/// `[ptr, ptr + bytes)` dead (issue #26). A swap-out leaves those bytes behind (their
/// memory comes back uninitialised) until the process's next submission of any kind,
/// which voids every discard: a stale hint can never lose data. The range must lie
/// inside one allocation of the shim's, else `CUDA_ERROR_INVALID_VALUE` and nothing
/// is discarded. Found with `dlsym`: without Kiwi the application skips it.
#[cfg_attr(not(test), no_mangle)]
pub extern "C" fn kiwiMemDiscard(ptr: CUdeviceptr, bytes: usize) -> CUresult {
    crate::ffi::guarded("kiwiMemDiscard", || {
        crate::devices::discard(ptr, bytes as u64)
    })
}

/// `int64_t kiwi_hint_wait(int timeout_ms)`: waits, at most `timeout_ms`, until a
/// swap-out asks which memory is dead; returns the question's id (> 0), or 0 when
/// none came. The calling thread then answers with `kiwiMemDiscard` calls and
/// `kiwi_hint_done(id)`; the swap-out waits `KIWI_HINT_WAIT_MS` (10 ms) at most, and
/// discards that come later are ignored. For the Python package's thread.
#[cfg_attr(not(test), no_mangle)]
pub extern "C" fn kiwi_hint_wait(timeout_ms: c_int) -> i64 {
    let limit = std::time::Duration::from_millis(timeout_ms.max(0) as u64);
    catch_unwind(|| crate::hint::provider_wait(limit) as i64).unwrap_or(0)
}

/// `void kiwi_hint_done(int64_t id)`: the answer to question `id` is complete.
#[cfg_attr(not(test), no_mangle)]
pub extern "C" fn kiwi_hint_done(id: i64) {
    let _ = catch_unwind(|| crate::hint::done(id.max(0) as u64));
}

#[cfg(test)]
#[path = "exports_coverage.rs"]
mod coverage;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::symbols::{lookup, Class, Sym, COUNT, SYMBOLS};

    #[test]
    fn names_are_unique_and_match_the_enum() {
        let mut names: Vec<&str> = SYMBOLS.iter().map(|s| s.name()).collect();
        assert_eq!(
            SYMBOLS[Sym::cuLaunchKernel as usize].name(),
            "cuLaunchKernel"
        );
        assert_eq!(
            SYMBOLS[Sym::cuMemcpyHtoDAsync_v2_ptsz as usize].name(),
            "cuMemcpyHtoDAsync_v2_ptsz"
        );
        names.sort_unstable();
        let n = names.len();
        names.dedup();
        assert_eq!(names.len(), n, "duplicate export");
        assert_eq!(n, COUNT);
    }

    #[test]
    fn every_launch_copy_and_memset_is_gated() {
        for s in &SYMBOLS {
            let n = s.name();
            let (base, _, _) = crate::procaddr::split_name(n);
            let work = coverage::is_work(n)
                || [
                    "cuStreamAddCallback",
                    "cuSignalExternalSemaphoresAsync",
                    "cuWaitExternalSemaphoresAsync",
                    "cuGraphicsMapResources",
                    "cuGraphicsUnmapResources",
                    "cuMemMapArrayAsync",
                    "cuGraphInstantiateWithParams",
                ]
                .contains(&base);
            assert_eq!(work, s.class == Class::Submit, "{n}");
        }
    }

    #[test]
    fn every_pass_through_says_why() {
        for s in &SYMBOLS {
            let passes = matches!(s.class, Class::Pass | Class::Driver);
            assert!(
                !passes || s.reason.trim().len() >= 10,
                "{}: a pass-through needs a reason in its doc comment",
                s.name()
            );
        }
    }

    #[test]
    fn every_per_thread_variant_has_its_legacy_twin() {
        for s in &SYMBOLS {
            let n = s.name();
            if let Some(base) = n.strip_suffix("_ptsz").or_else(|| n.strip_suffix("_ptds")) {
                let twin = SYMBOLS
                    .iter()
                    .position(|t| t.name() == base)
                    .unwrap_or_else(|| panic!("{n} without {base}"));
                assert_eq!(SYMBOLS[twin].class, s.class, "{n}");
            }
        }
    }

    #[test]
    fn lookup_finds_exports_only() {
        assert_eq!(lookup(b"cuMemAlloc_v2"), Some(Sym::cuMemAlloc_v2 as usize));
        assert_eq!(lookup(b"cuMemAlloc"), None);
        assert_eq!(lookup(b"malloc"), None);
        assert_eq!(wrapper(Sym::cuInit as usize), cuInit as *mut c_void);
        // Classified, but left to the driver: no wrapper, so dlsym answers the driver's.
        assert_eq!(SYMBOLS[Sym::cuStreamQuery as usize].class, Class::Driver);
        assert_eq!(lookup(b"cuStreamQuery"), None);
        assert!(wrapper(Sym::cuStreamQuery as usize).is_null());
    }

    #[test]
    fn status_copies_whole_or_not_at_all() {
        let json = r#"{"kiwi":1}"#;
        let mut buf = [0x55 as c_char; 16];
        // SAFETY: buf is 16 bytes long.
        assert_eq!(unsafe { copy_out(json, buf.as_mut_ptr(), 16) }, 10);
        assert_eq!(buf[10], 0);
        // SAFETY: as above; a short length leaves an empty string.
        assert_eq!(unsafe { copy_out(json, buf.as_mut_ptr(), 10) }, 10);
        assert_eq!(buf[0], 0);
        // SAFETY: NULL asks the length.
        assert_eq!(unsafe { copy_out(json, std::ptr::null_mut(), 0) }, 10);
        let v: serde_json::Value = serde_json::from_str(&status_json()).unwrap();
        assert_eq!(v["kiwi"], 1);
        assert_eq!(v["gpus"], serde_json::json!([]));
    }
}
