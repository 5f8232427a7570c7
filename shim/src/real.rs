//! The real driver: glibc's own `dlsym`, `libcuda.so.1` (opened once through
//! [`kiwi_cuda::Library`], its symbols looked up with glibc's `dlsym`), and the
//! original function pointers behind every entry of the declaration list
//! ([`crate::symbols`]), resolved once ([`REAL`]). Owns nothing else. The bottom
//! layer: it uses only the list and the leaves.

use std::ffi::{c_char, c_void, CStr};
use std::ptr::null_mut;
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::{Once, OnceLock};

use kiwi_cuda::loader::DlsymFn;
use kiwi_cuda::{Library, LoadError, LIBCUDA};

use crate::cuda::{CUresult, CUDA_ERROR_NOT_FOUND};
use crate::symbols::{Sym, COUNT, SYMBOLS};

/// glibc's `dlsym`. Read by the `dlsym` trampoline in [`crate::dl`], so it must stay a
/// plain pointer-sized static.
pub static REAL_DLSYM: AtomicPtr<c_void> = AtomicPtr::new(null_mut());

/// The real driver's function behind each export (null until loaded, or when the
/// driver lacks it), in [`Sym`] order.
pub static REAL: [AtomicPtr<c_void>; COUNT] = [const { AtomicPtr::new(null_mut()) }; COUNT];

/// The real driver, opened once (never closed), its symbols looked up with glibc's
/// own `dlsym` ([`real_dlsym`]).
static DRIVER: OnceLock<Library> = OnceLock::new();
static LOAD: Once = Once::new();

unsafe extern "C" fn dlsym_unavailable(_: *mut c_void, _: *const c_char) -> *mut c_void {
    null_mut()
}

/// glibc's `dlsym`, found with `dlvsym` (never interposed): the newest version first,
/// then the architecture's base version.
pub fn real_dlsym() -> DlsymFn {
    let mut p = REAL_DLSYM.load(Ordering::Acquire);
    if p.is_null() {
        #[cfg(target_arch = "aarch64")]
        const BASE: &CStr = c"GLIBC_2.17";
        #[cfg(not(target_arch = "aarch64"))]
        const BASE: &CStr = c"GLIBC_2.2.5";
        for version in [c"GLIBC_2.34", BASE] {
            // SAFETY: dlvsym with RTLD_NEXT and NUL-terminated strings; returns a pointer or null.
            p = unsafe { libc::dlvsym(libc::RTLD_NEXT, c"dlsym".as_ptr(), version.as_ptr()) };
            if !p.is_null() {
                break;
            }
        }
        if p.is_null() {
            p = dlsym_unavailable as *mut c_void;
        }
        REAL_DLSYM.store(p, Ordering::Release);
    }
    // SAFETY: p is glibc's dlsym (or our null-returning stand-in), both with dlsym's signature.
    unsafe { std::mem::transmute::<*mut c_void, DlsymFn>(p) }
}

/// Opens the real driver and resolves every original, once.
pub fn load() {
    // Marked as inside the shim: a driver (or a proxy standing for it) that looks up
    // `cu*` names while it is being loaded is below the shim and gets its own
    // ([`crate::dl`]).
    LOAD.call_once(|| crate::ffi::inside(load_now));
}

fn load_now() {
    let env = crate::env::ShimEnv::from_env();
    let path = env
        .real_libcuda
        .clone()
        .unwrap_or_else(|| LIBCUDA.to_string());
    let lib = match Library::open_with(&path, real_dlsym()) {
        Ok(lib) => lib,
        Err(LoadError::BadName(_)) => {
            crate::kerror!("KIWI_REAL_LIBCUDA={path:?} is not a valid path");
            return;
        }
        Err(LoadError::Open { reason, .. }) => {
            crate::kerror!("cannot load the real CUDA driver {path:?}: {reason}");
            return;
        }
        Err(e) => {
            crate::kerror!("cannot load the real CUDA driver {path:?}: {e}");
            return;
        }
    };
    let lib = DRIVER.get_or_init(|| lib);
    for (i, s) in SYMBOLS.iter().enumerate() {
        REAL[i].store(lib.symbol(s.cname()), Ordering::Release);
    }
    crate::kdebug!("real driver {path} loaded");
}

/// The original behind export `index`, or null when the driver lacks it.
#[inline(always)]
pub fn original(index: usize) -> *mut c_void {
    let p = REAL[index].load(Ordering::Relaxed);
    if !p.is_null() {
        return p;
    }
    load();
    REAL[index].load(Ordering::Acquire)
}

/// The real driver's function behind export `s` (loading the driver if needed).
/// Calls the driver's own `$sym` (cuda.h's signature given) and turns its result into
/// `Result<(), CUresult>`; `CUDA_ERROR_NOT_FOUND` if the driver lacks it. The shim's
/// own driver calls (not the application's) go through it.
macro_rules! call_real {
    ($sym:ident : fn($($ty:ty),*) ($($arg:expr),*)) => {{
        let p = $crate::real::original_of($crate::symbols::Sym::$sym);
        if p.is_null() {
            Err($crate::cuda::CUDA_ERROR_NOT_FOUND)
        } else {
            // SAFETY: the driver's own symbol of this name, with cuda.h's signature.
            let f = unsafe {
                std::mem::transmute::<
                    *mut std::ffi::c_void,
                    unsafe extern "C" fn($($ty),*) -> $crate::cuda::CUresult,
                >(p)
            };
            // SAFETY: arguments valid per cuda.h (pointers to live locals or buffers).
            match unsafe { f($($arg),*) } {
                $crate::cuda::CUDA_SUCCESS => Ok(()),
                e => Err(e),
            }
        }
    }};
}
pub(crate) use call_real;

pub fn original_of(s: Sym) -> *mut c_void {
    original(s as usize)
}

/// A driver function the shim calls but does not export (`cuCtxDestroy_v2` for its
/// context probe), or null.
pub fn lookup(name: &CStr) -> *mut c_void {
    load();
    DRIVER.get().map_or(null_mut(), |lib| lib.symbol(name))
}

/// What an export answers when the real driver lacks its symbol.
#[cold]
pub fn missing(name: &str) -> CUresult {
    crate::kwarn!("{name}: the real driver does not provide it");
    CUDA_ERROR_NOT_FOUND
}
