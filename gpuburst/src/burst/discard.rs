//! `--discard`: answering Kiwi's questions about dead memory with the
//! preallocations' untouched parts.

use std::ffi::c_void;

use crate::driver::CUdeviceptr;

/// `--discard`: a thread that answers Kiwi's questions about dead memory (found with
/// `dlsym`, as any application would: without Kiwi there is nothing to answer) by
/// discarding `tails`, the preallocations' untouched parts.
pub(super) fn start_discarding(name: &str, tails: Vec<(CUdeviceptr, u64)>) {
    type Discard = unsafe extern "C" fn(CUdeviceptr, usize) -> i32;
    type Wait = unsafe extern "C" fn(i32) -> i64;
    type Done = unsafe extern "C" fn(i64);
    let sym = |n: &std::ffi::CStr| {
        // SAFETY: dlsym over the process's global scope with a valid C string.
        let p = unsafe { libc::dlsym(libc::RTLD_DEFAULT, n.as_ptr()) };
        (!p.is_null()).then_some(p)
    };
    let (Some(d), Some(w), Some(f)) = (
        sym(c"kiwiMemDiscard"),
        sym(c"kiwi_hint_wait"),
        sym(c"kiwi_hint_done"),
    ) else {
        eprintln!("gpuburst [{name}]: --discard: not running under Kiwi, nothing to discard");
        return;
    };
    // SAFETY: libkiwi.so exports these with these C signatures (docs/shim.md).
    let (discard, wait, done) = unsafe {
        (
            std::mem::transmute::<*mut c_void, Discard>(d),
            std::mem::transmute::<*mut c_void, Wait>(w),
            std::mem::transmute::<*mut c_void, Done>(f),
        )
    };
    std::thread::spawn(move || loop {
        // SAFETY: plain values; the shim checks the ranges.
        let id = unsafe { wait(1000) };
        if id > 0 {
            for &(ptr, bytes) in &tails {
                // SAFETY: as above. A refusal (the range freed at exit) is harmless.
                let _ = unsafe { discard(ptr, bytes as usize) };
            }
            // SAFETY: as above.
            unsafe { done(id) };
        }
    });
}
