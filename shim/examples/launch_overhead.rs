//! `launch-overhead`: the median time `cuLaunchKernel` adds through the shim while the
//! process may run work (gate open), against calling the driver directly, in one run.
//!
//! Loads the driver (`libcuda.so.1` from `LD_LIBRARY_PATH`, e.g. the simulator) and the
//! shim (`RTLD_LOCAL`, so it does not interpose on this process; its exported wrapper is
//! called explicitly), then alternates batches of launches through each. The shim runs
//! unmanaged here (no arbiter), which takes the same open-gate path as a holder.
//!
//! Usage: `launch_overhead [SHIM_PATH]` (default: `libkiwi.so` next to the examples
//! directory). Prints one JSON line.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::time::Instant;

type Launch = unsafe extern "C" fn(
    *mut c_void,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    *mut c_void,
    *mut *mut c_void,
    *mut *mut c_void,
) -> c_int;

fn sym<T: Copy>(h: *mut c_void, name: &CStr) -> T {
    // SAFETY: dlsym on a live handle with a NUL-terminated name.
    let p = unsafe { libc::dlsym(h, name.as_ptr()) };
    assert!(!p.is_null(), "{name:?} not found");
    assert_eq!(std::mem::size_of::<T>(), std::mem::size_of::<*mut c_void>());
    // SAFETY: T is the function-pointer type of this symbol (cuda.h).
    unsafe { std::mem::transmute_copy(&p) }
}

fn open(path: &CStr, flags: c_int) -> *mut c_void {
    // SAFETY: dlopen with a NUL-terminated path.
    let h = unsafe { libc::dlopen(path.as_ptr(), flags) };
    if h.is_null() {
        // SAFETY: dlerror's message is NUL-terminated.
        let e = unsafe { CStr::from_ptr(libc::dlerror()) };
        panic!("dlopen {path:?}: {e:?}");
    }
    h
}

fn check(r: c_int, what: &str) {
    assert_eq!(r, 0, "{what} failed with CUDA error {r}");
}

fn main() {
    let shim = std::env::args().nth(1).unwrap_or_else(|| {
        let exe = std::env::current_exe().unwrap();
        exe.parent()
            .and_then(|d| d.parent())
            .unwrap()
            .join("libkiwi.so")
            .display()
            .to_string()
    });
    std::env::set_var("KIWI_ARBITER_TIMEOUT", "0");
    std::env::set_var("KIWI_SOCKET_DIR", "/nonexistent-kiwi-bench");
    std::env::set_var("KIWI_LOG", "error");
    let cuda = open(c"libcuda.so.1", libc::RTLD_NOW | libc::RTLD_GLOBAL);
    let cshim = std::ffi::CString::new(shim.clone()).unwrap();
    let kiwi = open(&cshim, libc::RTLD_NOW | libc::RTLD_LOCAL);

    let init: unsafe extern "C" fn(c_uint) -> c_int = sym(kiwi, c"cuInit");
    let dev_get: unsafe extern "C" fn(*mut c_int, c_int) -> c_int = sym(cuda, c"cuDeviceGet");
    let ctx_create: unsafe extern "C" fn(*mut *mut c_void, c_uint, c_int) -> c_int =
        sym(cuda, c"cuCtxCreate_v2");
    let load: unsafe extern "C" fn(*mut *mut c_void, *const c_void) -> c_int =
        sym(cuda, c"cuModuleLoadData");
    let get_fn: unsafe extern "C" fn(*mut *mut c_void, *mut c_void, *const c_char) -> c_int =
        sym(cuda, c"cuModuleGetFunction");
    let sync: unsafe extern "C" fn() -> c_int = sym(cuda, c"cuCtxSynchronize");
    let direct: Launch = sym(cuda, c"cuLaunchKernel");
    let through: Launch = sym(kiwi, c"cuLaunchKernel");

    let ptx =
        c".version 7.0\n.target sm_52\n.address_size 64\n.visible .entry kiwi_spin() { ret; }\n";
    let (mut dev, mut ctx, mut module, mut f) = (
        0,
        std::ptr::null_mut(),
        std::ptr::null_mut(),
        std::ptr::null_mut(),
    );
    // SAFETY: driver calls with valid out-pointers, in cuInit → context → module order.
    unsafe {
        check(init(0), "cuInit");
        check(dev_get(&mut dev, 0), "cuDeviceGet");
        check(ctx_create(&mut ctx, 0, dev), "cuCtxCreate");
        check(load(&mut module, ptx.as_ptr().cast()), "cuModuleLoadData");
        check(
            get_fn(&mut f, module, c"kiwi_spin".as_ptr()),
            "cuModuleGetFunction",
        );
    }
    let mut ns: u64 = 0;
    let mut params = [&mut ns as *mut u64 as *mut c_void];
    const BATCH: usize = 200;
    const ROUNDS: usize = 300;
    let mut per = |launch: Launch| -> f64 {
        let t = Instant::now();
        for _ in 0..BATCH {
            // SAFETY: a valid function and parameter array; null stream and extra.
            let r = unsafe {
                launch(
                    f,
                    1,
                    1,
                    1,
                    1,
                    1,
                    1,
                    0,
                    std::ptr::null_mut(),
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            };
            assert_eq!(r, 0);
        }
        let e = t.elapsed().as_nanos() as f64 / BATCH as f64;
        // SAFETY: plain synchronize (not timed): keeps the driver's queue short.
        unsafe { check(sync(), "cuCtxSynchronize") };
        e
    };
    let (mut d, mut s) = (Vec::new(), Vec::new());
    for _ in 0..10 {
        per(direct);
        per(through);
    }
    for _ in 0..ROUNDS {
        d.push(per(direct));
        s.push(per(through));
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(|a, b| a.partial_cmp(b).unwrap());
        v[v.len() / 2]
    };
    let (md, ms) = (median(&mut d), median(&mut s));
    let added = ms - md;
    println!(
        "{{\"scenario\":\"launch-overhead\",\"metric\":\"added_ns_per_launch\",\"value\":{added:.1},\"unit\":\"ns\",\"baseline\":{md:.1},\"ratio\":{:.4}}}",
        ms / md
    );
}
