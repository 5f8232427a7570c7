//! `cuGetProcAddress` / `cuGetProcAddress_v2`: the path the CUDA runtime, cuBLAS and
//! the Kiwi shim take to every entry point. Base names (`"cuMemAlloc"`) map to the
//! newest implemented versioned symbol (`cuMemAlloc_v2`) whose introduction version
//! is at most the requested CUDA version; with
//! `CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM` the `_ptsz`/`_ptds` variant is
//! returned where one exists. Unknown names give `CUDA_ERROR_NOT_FOUND` and NULL.

use std::collections::HashMap;
use std::ffi::{c_char, c_void};
use std::sync::OnceLock;

use crate::abi::*;
use crate::ffi::{c_str, out};

struct Table {
    /// base name → [(min version, address)], sorted by version.
    by_base: HashMap<&'static str, Vec<(i32, usize)>>,
    /// base name → [(min version, per-thread variant address)], sorted by version.
    per_thread: HashMap<&'static str, Vec<(i32, usize)>>,
}

/// `cuMemAlloc_v2` → `cuMemAlloc`; names without a `_vN` suffix are their own base.
pub fn base_name(symbol: &str) -> &str {
    if let Some(i) = symbol.rfind("_v") {
        let tail = &symbol[i + 2..];
        if !tail.is_empty() && tail.bytes().all(|b| b.is_ascii_digit()) {
            return &symbol[..i];
        }
    }
    symbol
}

/// The entry points, registered once by the C ABI layer (`crate::exports`) when the
/// library is loaded: (symbol, minimum version, address) and the per-thread twins
/// (base name, minimum version, symbol, address).
type Exports = (
    Vec<(&'static str, i32, usize)>,
    Vec<(&'static str, i32, &'static str, usize)>,
);
static EXPORTS: OnceLock<Exports> = OnceLock::new();

/// Called by `crate::exports` at load time, before any lookup.
pub fn register(exports: Exports) {
    let _ = EXPORTS.set(exports);
}

fn table() -> &'static Table {
    static T: OnceLock<Table> = OnceLock::new();
    T.get_or_init(|| {
        let (all, twins) = EXPORTS
            .get()
            .map_or((&[][..], &[][..]), |(a, t)| (&a[..], &t[..]));
        let mut by_base: HashMap<&'static str, Vec<(i32, usize)>> = HashMap::new();
        for &(sym, ver, addr) in all {
            by_base.entry(base_name(sym)).or_default().push((ver, addr));
        }
        for v in by_base.values_mut() {
            v.sort();
        }
        let mut per_thread: HashMap<&'static str, Vec<(i32, usize)>> = HashMap::new();
        for &(base, ver, _, addr) in twins {
            per_thread.entry(base).or_default().push((ver, addr));
        }
        for v in per_thread.values_mut() {
            v.sort();
        }
        Table {
            by_base,
            per_thread,
        }
    })
}

/// `cuGetProcAddress` (`status` NULL) and `cuGetProcAddress_v2`.
pub fn get_proc_address(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: i32,
    flags: u64,
    status: *mut i32,
) -> Result<(), CUresult> {
    let set_status = |s: i32| {
        if !status.is_null() {
            let _ = out(status, s);
        }
    };
    let name = c_str(symbol)?;
    if pfn.is_null() || flags > 2 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    out(pfn, std::ptr::null_mut())?;
    let t = table();
    // Callers are meant to pass base names; accept a full versioned name as well.
    let base = if t.by_base.contains_key(name) {
        name
    } else {
        base_name(name)
    };
    let Some(versions) = t.by_base.get(base) else {
        set_status(CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND);
        return Err(CUDA_ERROR_NOT_FOUND);
    };
    let Some(&(_, addr)) = versions.iter().rev().find(|(v, _)| *v <= version) else {
        set_status(CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT);
        return Err(CUDA_ERROR_NOT_FOUND);
    };
    let addr = if flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM != 0 {
        t.per_thread
            .get(base)
            .and_then(|v| v.iter().rev().find(|(ver, _)| *ver <= version))
            .map(|&(_, a)| a)
            .unwrap_or(addr)
    } else {
        addr
    };
    out(pfn, addr as *mut c_void)?;
    set_status(CU_GET_PROC_ADDRESS_SUCCESS);
    Ok(())
}
