//! The one way Kiwi loads the CUDA driver: `dlopen` of `libcuda.so.1` (or a path to a
//! library standing for it: the simulator, a proxy) at run time, as the CUDA runtime
//! does (`RTLD_NOW | RTLD_GLOBAL`), and never `dlclose`d (a driver does not survive
//! being unloaded under its own threads). Entry points are resolved by name with
//! `dlsym`, or with a `dlsym` the caller gives (an interposer that exports `dlsym`
//! itself must resolve with glibc's), or through the driver's `cuGetProcAddress_v2`.
//!
//! What a user resolves and how it calls it stay the user's; this module only opens
//! and looks up. Loading allocates (names, error text); a lookup by `&CStr` does not.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::ptr::NonNull;

use crate::sys::{PFN_cuGetProcAddress_v2, CUDA_SUCCESS};

/// The driver's soname.
pub const LIBCUDA: &str = "libcuda.so.1";

/// `dlsym`'s signature.
pub type DlsymFn = unsafe extern "C" fn(*mut c_void, *const c_char) -> *mut c_void;

/// Why a library or one of its entry points could not be had.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LoadError {
    /// `dlopen` failed; `reason` is `dlerror`'s text.
    #[error("cannot load {library}: {reason}")]
    Open { library: String, reason: String },
    /// The name or path cannot be passed to `dlopen` (it holds a NUL byte).
    #[error("{0:?} is not a valid library name or path")]
    BadName(String),
    /// The library has no such entry point.
    #[error("{library} has no entry point {symbol}")]
    Missing { library: String, symbol: String },
}

/// An opened library, never closed.
#[derive(Debug)]
pub struct Library {
    handle: NonNull<c_void>,
    name: String,
    dlsym: DlsymFn,
}

// SAFETY: a dlopen handle is process-wide and `dlsym` on it is thread-safe; the
// library is never closed, so the handle stays valid wherever it is used.
unsafe impl Send for Library {}
// SAFETY: as above; `&Library` only looks symbols up.
unsafe impl Sync for Library {}

impl Library {
    /// Opens `name` (a soname such as [`LIBCUDA`], searched as `dlopen` searches, or a
    /// path) and looks its symbols up with `dlsym`.
    pub fn open(name: &str) -> Result<Library, LoadError> {
        Self::open_with(name, libc::dlsym)
    }

    /// Opens the driver, `libcuda.so.1`.
    pub fn libcuda() -> Result<Library, LoadError> {
        Self::open(LIBCUDA)
    }

    /// Opens `name` as [`Library::open`] does, looking its symbols up with `dlsym`
    /// (an interposer exporting `dlsym` passes glibc's own).
    pub fn open_with(name: &str, dlsym: DlsymFn) -> Result<Library, LoadError> {
        let cname = CString::new(name).map_err(|_| LoadError::BadName(name.to_string()))?;
        // SAFETY: dlopen with a NUL-terminated name; loading runs the library's
        // initializers, which have no preconditions on the loading process.
        let h = unsafe { libc::dlopen(cname.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
        match NonNull::new(h) {
            Some(handle) => Ok(Library {
                handle,
                name: name.to_string(),
                dlsym,
            }),
            None => Err(LoadError::Open {
                library: name.to_string(),
                reason: dlerror(),
            }),
        }
    }

    /// The name or path it was opened by.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The `dlopen` handle (valid for the life of the process).
    pub fn handle(&self) -> *mut c_void {
        self.handle.as_ptr()
    }

    /// The address of `name`, or null when the library has none.
    pub fn symbol(&self, name: &CStr) -> *mut c_void {
        // SAFETY: a live dlopen handle and a NUL-terminated name.
        unsafe { (self.dlsym)(self.handle.as_ptr(), name.as_ptr()) }
    }

    /// Entry point `name` as a `T`, the function pointer type of its C signature.
    ///
    /// # Safety
    ///
    /// `T` must be a function pointer type (`unsafe extern "C" fn(..) -> ..`) matching
    /// the C declaration of `name` in the library; calling it is then as safe as
    /// calling the C function.
    pub unsafe fn get<T: Copy>(&self, name: &CStr) -> Result<T, LoadError> {
        const {
            assert!(std::mem::size_of::<T>() == std::mem::size_of::<*mut c_void>());
        }
        let p = self.symbol(name);
        if p.is_null() {
            return Err(LoadError::Missing {
                library: self.name.clone(),
                symbol: name.to_string_lossy().into_owned(),
            });
        }
        // SAFETY: `T` is pointer-sized (checked above) and, by the caller's contract,
        // the function pointer type of this symbol.
        Ok(unsafe { std::mem::transmute_copy::<*mut c_void, T>(&p) })
    }
}

/// Resolves `name` through the driver's `cuGetProcAddress_v2` for CUDA version
/// `cuda_version` (12000 for 12.0) and `flags` (`CU_GET_PROC_ADDRESS_*`), as the
/// CUDA runtime reaches every entry point; `None` when the driver has no such entry.
///
/// # Safety
///
/// `gpa` must be a driver's `cuGetProcAddress_v2`.
pub unsafe fn proc_address(
    gpa: PFN_cuGetProcAddress_v2,
    name: &CStr,
    cuda_version: c_int,
    flags: u64,
) -> Option<NonNull<c_void>> {
    let mut p: *mut c_void = std::ptr::null_mut();
    let mut status: c_int = 0;
    // SAFETY: `gpa` is cuGetProcAddress_v2 (the caller's contract); a NUL-terminated
    // name and out-pointers valid for the call.
    let r = unsafe { gpa(name.as_ptr(), &mut p, cuda_version, flags, &mut status) };
    if r == CUDA_SUCCESS {
        NonNull::new(p)
    } else {
        None
    }
}

/// `dlerror`'s text for the last failure on this thread.
fn dlerror() -> String {
    // SAFETY: dlerror returns NULL or a NUL-terminated string owned by libc.
    let e = unsafe { libc::dlerror() };
    if e.is_null() {
        "unknown dlopen error".into()
    } else {
        // SAFETY: non-NULL and NUL-terminated, valid until the next dl* call here.
        unsafe { CStr::from_ptr(e) }.to_string_lossy().into_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_is_an_open_error_with_dlerror_text() {
        let e = Library::open("libkiwi-no-such-library.so.7").unwrap_err();
        let LoadError::Open { library, reason } = &e else {
            panic!("{e:?}")
        };
        assert_eq!(library, "libkiwi-no-such-library.so.7");
        assert!(reason.contains("libkiwi-no-such-library.so.7"), "{reason}");
        assert!(e
            .to_string()
            .starts_with("cannot load libkiwi-no-such-library.so.7: "));
        assert!(matches!(
            Library::open("lib\0cuda"),
            Err(LoadError::BadName(_))
        ));
    }

    #[test]
    fn symbols_resolve_typed_and_a_missing_one_is_named() {
        // libc is always loaded: open it by its soname and call a function through
        // the loader.
        let libc = Library::open("libc.so.6").expect("libc.so.6");
        assert!(!libc.handle().is_null());
        assert!(!libc.symbol(c"getpid").is_null());
        // SAFETY: getpid's C signature.
        let getpid: unsafe extern "C" fn() -> c_int = unsafe { libc.get(c"getpid") }.unwrap();
        // SAFETY: getpid has no preconditions.
        assert_eq!(unsafe { getpid() } as u32, std::process::id());
        // SAFETY: never called.
        let missing = unsafe { libc.get::<unsafe extern "C" fn()>(c"cuKiwiNoSuchEntry") };
        assert_eq!(
            missing.unwrap_err().to_string(),
            "libc.so.6 has no entry point cuKiwiNoSuchEntry"
        );
    }

    #[test]
    fn proc_address_asks_the_driver_and_maps_failure_to_none() {
        unsafe extern "C" fn gpa(
            symbol: *const c_char,
            pfn: *mut *mut c_void,
            _v: c_int,
            _f: u64,
            status: *mut c_int,
        ) -> crate::sys::CUresult {
            // SAFETY: the caller passes a C string and valid out-pointers.
            unsafe {
                *status = 0;
                if CStr::from_ptr(symbol) == c"cuInit" {
                    *pfn = 0x1000 as *mut c_void;
                    CUDA_SUCCESS
                } else {
                    *pfn = std::ptr::null_mut();
                    crate::sys::CUDA_ERROR_NOT_FOUND
                }
            }
        }
        // SAFETY: a stand-in with cuGetProcAddress_v2's signature and contract.
        unsafe {
            assert_eq!(
                proc_address(gpa, c"cuInit", 12000, 0).map(|p| p.as_ptr() as usize),
                Some(0x1000)
            );
            assert_eq!(proc_address(gpa, c"cuNothing", 12000, 0), None);
        }
    }
}
