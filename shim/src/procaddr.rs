//! `cuGetProcAddress` / `cuGetProcAddress_v2`: the path the CUDA runtime, cuBLAS and
//! gpuburst take to every entry point. The real driver answers first (so the CUDA
//! version and the per-thread-stream flag select exactly the variant the driver
//! would); the shim then swaps the driver's function for its own wrapper of that same
//! function, found by address. When the address is unknown (a driver handing out
//! internal entry points), the wrapper is chosen by name: the requested base name, the
//! `_ptsz`/`_ptds` variant when the per-thread flag is set, and among its `_vN`
//! variants the one the driver chose: the driver is asked the same name at every
//! CUDA version ([`VERSIONS`]), and its distinct answers, oldest first, are its
//! variants in order (`cuMemPrefetchAsync` for a caller of CUDA 8.0's signature,
//! `cuMemPrefetchAsync_v2` for 12.2's). Where those answers do not line up with the
//! variants the shim knows, the newest.
//! Owns the rule ([`resolve`]); the hook bodies that apply it live with the wrappers
//! they hand out, in [`crate::exports`].

use std::ffi::c_void;

use crate::cuda::CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM;
use crate::symbols::{Class, SYMBOLS};

/// Which function a lookup should hand out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resolution {
    /// The shim's wrapper of export `index`.
    Wrapper(usize),
    /// The driver's own function (the shim does not wrap it).
    Driver,
}

/// Splits `cuMemcpyHtoDAsync_v2_ptsz` into (`cuMemcpyHtoDAsync`, version 2, per-thread).
pub fn split_name(name: &str) -> (&str, u32, bool) {
    let (rest, per_thread) = match name
        .strip_suffix("_ptsz")
        .or_else(|| name.strip_suffix("_ptds"))
    {
        Some(r) => (r, true),
        None => (name, false),
    };
    if let Some(pos) = rest.rfind("_v") {
        if let Ok(v) = rest[pos + 2..].parse::<u32>() {
            return (&rest[..pos], v, per_thread);
        }
    }
    (rest, 1, per_thread)
}

/// Every CUDA version a variant of an entry point could be introduced at (x.y for x
/// in 2..=13, y in 0..=9), oldest first: the driver is asked at each to tell its
/// variants apart ([`resolve`]).
pub fn versions() -> impl Iterator<Item = i32> {
    (2..=13).flat_map(|major| (0..=9).map(move |minor| major * 1000 + minor * 10))
}

/// The driver's distinct answers for one name and flags over [`versions`], oldest
/// first: `ask(version)` is its `cuGetProcAddress` answer (null: none).
pub fn variants_by_version(ask: impl Fn(i32) -> *mut c_void) -> Vec<*mut c_void> {
    let mut out: Vec<*mut c_void> = Vec::new();
    for v in versions() {
        let p = ask(v);
        if !p.is_null() && !out.contains(&p) {
            out.push(p);
        }
    }
    out
}

/// Decides what `cuGetProcAddress(name, .., flags)` returns, given the driver's answer
/// `driver_fn`, the originals behind the exports (`original(i)`), and, asked only
/// when the answer is an address the shim does not know and the name has several
/// variants, the driver's answers for the name by version ([`variants_by_version`]).
pub fn resolve(
    name: &str,
    driver_fn: *mut c_void,
    flags: u64,
    original: impl Fn(usize) -> *mut c_void,
    by_version: impl FnOnce() -> Vec<*mut c_void>,
) -> Resolution {
    if driver_fn.is_null() {
        return Resolution::Driver;
    }
    if let Some(i) = (0..SYMBOLS.len()).find(|&i| original(i) == driver_fn) {
        // A `driver` entry has no wrapper: the driver's own function it is.
        return if SYMBOLS[i].exported() {
            Resolution::Wrapper(i)
        } else {
            Resolution::Driver
        };
    }
    // Unknown address: choose by name among the exports of the same base name.
    let (base, _, _) = split_name(name);
    let want_pt = flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM != 0;
    let mut candidates: Vec<(u32, usize)> = Vec::new();
    let mut any_pt_variant = false;
    for (i, s) in SYMBOLS.iter().enumerate() {
        let (b, v, pt) = split_name(s.name());
        if b != base || !s.exported() {
            continue;
        }
        any_pt_variant |= pt;
        if pt != want_pt || original(i).is_null() {
            continue;
        }
        candidates.push((v, i));
    }
    candidates.sort_unstable();
    let mut best = candidates.last().copied();
    if candidates.len() > 1 {
        // The driver's k-th variant (by the version it came with) is the shim's k-th,
        // when both have the same number.
        let answers = by_version();
        if answers.len() == candidates.len() {
            if let Some(k) = answers.iter().position(|&a| a == driver_fn) {
                best = Some(candidates[k]);
            }
        }
    }
    match best {
        Some((_, i)) => {
            if SYMBOLS[i].class == Class::Submit {
                crate::kdebug!(
                    "cuGetProcAddress({name}): driver address unknown, using {}",
                    SYMBOLS[i].name()
                );
            }
            Resolution::Wrapper(i)
        }
        None if want_pt && any_pt_variant => {
            // A per-thread variant the driver has but we could not match: hand out the
            // driver's function rather than change stream semantics.
            Resolution::Driver
        }
        None => Resolution::Driver,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::symbols::{lookup, Sym, COUNT};

    fn fake_originals() -> Vec<usize> {
        (0..COUNT).map(|i| 0x1000 + i * 16).collect()
    }

    #[test]
    fn names_split() {
        assert_eq!(
            split_name("cuMemcpyHtoDAsync_v2_ptsz"),
            ("cuMemcpyHtoDAsync", 2, true)
        );
        assert_eq!(split_name("cuLaunchKernel"), ("cuLaunchKernel", 1, false));
        assert_eq!(split_name("cuMemcpy_ptds"), ("cuMemcpy", 1, true));
        assert_eq!(
            split_name("cuGetProcAddress_v2"),
            ("cuGetProcAddress", 2, false)
        );
    }

    #[test]
    fn known_address_maps_to_its_own_wrapper_including_ptsz() {
        let o = fake_originals();
        let orig = |i: usize| o[i] as *mut c_void;
        let ptsz = Sym::cuLaunchKernel_ptsz as usize;
        // The driver answered the per-thread variant: we must hand out its wrapper.
        assert_eq!(
            resolve("cuLaunchKernel", orig(ptsz), 2, orig, Vec::new),
            Resolution::Wrapper(ptsz)
        );
        let legacy = Sym::cuLaunchKernel as usize;
        assert_eq!(
            resolve("cuLaunchKernel", orig(legacy), 0, orig, Vec::new),
            Resolution::Wrapper(legacy)
        );
        let v2 = Sym::cuMemAlloc_v2 as usize;
        assert_eq!(
            resolve("cuMemAlloc", orig(v2), 0, orig, Vec::new),
            Resolution::Wrapper(v2)
        );
    }

    #[test]
    fn unknown_address_falls_back_by_name_and_flag() {
        let o = fake_originals();
        let orig = |i: usize| o[i] as *mut c_void;
        let internal = 0xdead_0000usize as *mut c_void;
        assert_eq!(
            resolve("cuMemcpyHtoDAsync", internal, 2, orig, Vec::new),
            Resolution::Wrapper(lookup(b"cuMemcpyHtoDAsync_v2_ptsz").unwrap())
        );
        assert_eq!(
            resolve("cuMemcpyHtoDAsync", internal, 0, orig, Vec::new),
            Resolution::Wrapper(lookup(b"cuMemcpyHtoDAsync_v2").unwrap())
        );
        assert_eq!(
            resolve("cuStreamWaitValue32", internal, 0, orig, Vec::new),
            Resolution::Wrapper(lookup(b"cuStreamWaitValue32_v2").unwrap())
        );
        // Not ours at all.
        assert_eq!(
            resolve("cuDeviceGetName", internal, 0, orig, Vec::new),
            Resolution::Driver
        );
        // Classified but left to the driver, by address or by name.
        let query = Sym::cuStreamQuery as usize;
        assert_eq!(
            resolve("cuStreamQuery", orig(query), 0, orig, Vec::new),
            Resolution::Driver
        );
        assert_eq!(
            resolve("cuStreamQuery", internal, 0, orig, Vec::new),
            Resolution::Driver
        );
        // The driver said "no such symbol".
        assert_eq!(
            resolve("cuLaunchKernel", std::ptr::null_mut(), 0, orig, Vec::new),
            Resolution::Driver
        );
    }

    #[test]
    fn an_unknown_address_is_the_variant_the_driver_chose_for_the_version() {
        // A driver handing out internal addresses: cuMemPrefetchAsync since 8.0,
        // its _v2 (another signature) since 12.2.
        let o = fake_originals();
        let orig = |i: usize| o[i] as *mut c_void;
        let (v1, v2) = (0xa000usize as *mut c_void, 0xb000usize as *mut c_void);
        let ask = |v: i32| match v {
            ..8000 => std::ptr::null_mut(),
            8000..12020 => v1,
            _ => v2,
        };
        let by_version = || variants_by_version(ask);
        assert_eq!(by_version(), vec![v1, v2]);
        assert_eq!(
            resolve("cuMemPrefetchAsync", v1, 0, orig, by_version),
            Resolution::Wrapper(Sym::cuMemPrefetchAsync as usize)
        );
        assert_eq!(
            resolve("cuMemPrefetchAsync", v2, 0, orig, by_version),
            Resolution::Wrapper(Sym::cuMemPrefetchAsync_v2 as usize)
        );
        // A driver with a variant the shim does not know: the newest, as before.
        let v3 = 0xc000usize as *mut c_void;
        let three = || vec![v1, v2, v3];
        assert_eq!(
            resolve("cuMemPrefetchAsync", v1, 0, orig, three),
            Resolution::Wrapper(Sym::cuMemPrefetchAsync_v2 as usize)
        );
    }

    #[test]
    fn per_thread_request_never_gets_a_legacy_wrapper() {
        // Originals present only for the legacy variant: a per-thread request with an
        // unknown address must not be served the legacy wrapper.
        let o = fake_originals();
        let only_legacy = |i: usize| {
            if crate::symbols::SYMBOLS[i].name().ends_with("_ptsz") {
                std::ptr::null_mut()
            } else {
                o[i] as *mut c_void
            }
        };
        assert_eq!(
            resolve(
                "cuLaunchKernel",
                0xbeef_0000usize as *mut c_void,
                2,
                only_legacy,
                Vec::new
            ),
            Resolution::Driver
        );
    }
}
