//! The shim's own `dlsym`, so `dlopen("libcuda.so.1")` + `dlsym(handle, "cuX")` returns
//! the shim's wrapper, not the driver's function — to the application only.
//!
//! The export is unversioned, so it satisfies both `dlsym@GLIBC_2.2.5` (`GLIBC_2.17` on
//! aarch64) and `dlsym@@GLIBC_2.34` references: glibc binds a versioned reference to an
//! unversioned definition in an earlier object (the preload). On x86-64 and aarch64 it
//! is a naked trampoline: names the shim does not wrap are forwarded with a tail jump,
//! so glibc still sees the application's return address and `RTLD_NEXT` keeps its
//! meaning for the caller.
//!
//! **Who asks.** A driver proxy or another interposer that sits *below* the shim (the
//! library the shim opened as `libcuda.so.1`, forwarding to the real driver with
//! `dlsym`) must get the driver's own functions: handed the shim's wrappers it would
//! call back up into the shim, which calls it again, until the stack runs out. A lookup
//! is answered by glibc alone (the tail jump) when
//! - the calling thread is inside the shim (a hook calling down into the driver, or
//!   the shim loading the driver, whose constructors run then), or
//! - the caller's return address (passed by the trampoline) lies in a driver-side
//!   object: one the shim's originals live in (the library it opened as the driver, or
//!   whichever object that library's symbols resolved to).
//!
//! The driver-side objects' address spans are computed once, after the driver is
//! loaded ([`driver_side`]); a lookup then costs a few comparisons and no lock. Names
//! the shim does not wrap never get this far.
//!
//! NVML's memory and process queries are answered the same way, with the view's
//! wrappers ([`crate::nvml`]), to every caller outside the shim (NVML has no proxy
//! below the shim to tell apart; finding one would load the CUDA driver, which a
//! process that only reads NVML never loads).

use std::ffi::{c_char, c_int, c_void, CStr};
use std::ptr::null_mut;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Once;

use crate::exports::wrapper;
use crate::real::real_dlsym;
use crate::real::REAL;
use crate::symbols::lookup;

/// At most this many driver-side objects are told apart (a driver and a proxy or two).
const MAX_SPANS: usize = 8;
static SPAN_START: [AtomicUsize; MAX_SPANS] = [const { AtomicUsize::new(0) }; MAX_SPANS];
static SPAN_END: [AtomicUsize; MAX_SPANS] = [const { AtomicUsize::new(0) }; MAX_SPANS];
static SPANS: AtomicUsize = AtomicUsize::new(0);
static SPANS_ONCE: Once = Once::new();

/// Whether `addr` (a caller's return address) lies in a driver-side object. Loads the
/// driver first if nobody has: a proxy's constructor may look its driver up before
/// the application ever called the shim.
pub fn driver_side(addr: usize) -> bool {
    SPANS_ONCE.call_once(|| {
        crate::real::load();
        crate::ffi::inside(find_driver_objects);
    });
    let n = SPANS.load(Ordering::Acquire);
    (0..n).any(|i| {
        SPAN_START[i].load(Ordering::Relaxed) <= addr && addr < SPAN_END[i].load(Ordering::Relaxed)
    })
}

/// Records the address span of every loaded object (not the program, not the shim)
/// that holds one of the originals.
fn find_driver_objects() {
    let originals: Vec<usize> = REAL
        .iter()
        .map(|p| p.load(Ordering::Acquire) as usize)
        .filter(|&p| p != 0)
        .collect();
    let own = find_driver_objects as *const () as usize;
    let mut spans: Vec<(usize, usize)> = Vec::new();
    let mut state = (originals, own, &mut spans);
    unsafe extern "C" fn each(
        info: *mut libc::dl_phdr_info,
        _size: libc::size_t,
        data: *mut c_void,
    ) -> c_int {
        // SAFETY: data is the `state` tuple below, alive for the whole iteration.
        let (originals, own, spans) =
            unsafe { &mut *(data as *mut (Vec<usize>, usize, &mut Vec<(usize, usize)>)) };
        // SAFETY: glibc passes a valid dl_phdr_info for the duration of the callback.
        let info = unsafe { &*info };
        // SAFETY: dlpi_name is a NUL-terminated string (empty for the program).
        let program = info.dlpi_name.is_null() || unsafe { *info.dlpi_name } == 0;
        let (mut lo, mut hi) = (usize::MAX, 0usize);
        for k in 0..info.dlpi_phnum as usize {
            // SAFETY: dlpi_phdr points to dlpi_phnum program headers.
            let ph = unsafe { &*info.dlpi_phdr.add(k) };
            if ph.p_type == libc::PT_LOAD {
                let start = info.dlpi_addr as usize + ph.p_vaddr as usize;
                lo = lo.min(start);
                hi = hi.max(start + ph.p_memsz as usize);
            }
        }
        let span = lo..hi;
        if !program
            && !span.contains(own)
            && originals.iter().any(|p| span.contains(p))
            && spans.len() < MAX_SPANS
        {
            spans.push((lo, hi));
        }
        0
    }
    // SAFETY: `each` only reads glibc's info and writes `state`, which outlives the call.
    unsafe { libc::dl_iterate_phdr(Some(each), &mut state as *mut _ as *mut c_void) };
    for (i, &(lo, hi)) in spans.iter().enumerate() {
        SPAN_START[i].store(lo, Ordering::Relaxed);
        SPAN_END[i].store(hi, Ordering::Relaxed);
    }
    SPANS.store(spans.len(), Ordering::Release);
    crate::kdebug!(
        "dlsym: {} driver-side object(s) get the driver's own functions",
        spans.len()
    );
}

/// Our wrapper for `name` when the shim wraps it, the target handle provides it and
/// the caller is the application; null means "let glibc answer". Also makes sure
/// glibc's `dlsym` is known, because the trampoline jumps to it.
///
/// # Safety
/// `name` is null or a NUL-terminated string; `handle` is whatever the caller passed;
/// `caller` is the caller's return address (null when unknown).
pub unsafe extern "C" fn dlsym_hook(
    handle: *mut c_void,
    name: *const c_char,
    caller: *const c_void,
) -> *mut c_void {
    let real = real_dlsym();
    if name.is_null() {
        return null_mut();
    }
    // SAFETY: the caller passed a NUL-terminated symbol name.
    let bytes = unsafe { CStr::from_ptr(name) }.to_bytes();
    let Some(index) = lookup(bytes) else {
        // NVML's memory and process queries: the view's wrappers (`crate::nvml`), to
        // the application only (the shim's own lookups are made inside it).
        if let Some(index) = crate::nvml::lookup(bytes) {
            if crate::ffi::reentered() {
                return null_mut();
            }
            // SAFETY: forwarding the caller's handle and name to glibc's dlsym.
            let found = unsafe { real(handle, name) };
            if found.is_null() {
                return null_mut();
            }
            return crate::nvml::wrap_found(index, handle, found);
        }
        return null_mut();
    };
    // Below the shim: the driver's own function (see the module docs).
    if crate::ffi::reentered() || (!caller.is_null() && driver_side(caller as usize)) {
        return null_mut();
    }
    // Only when the handle really provides the symbol: a lookup that would fail keeps
    // failing.
    // SAFETY: forwarding the caller's handle and name to glibc's dlsym.
    let found = unsafe { real(handle, name) };
    if found.is_null() {
        return null_mut();
    }
    wrapper(index)
}

#[cfg(all(not(test), target_arch = "x86_64"))]
/// # Safety
/// glibc's `dlsym` contract.
#[unsafe(naked)]
#[no_mangle]
pub unsafe extern "C" fn dlsym(handle: *mut c_void, name: *const c_char) -> *mut c_void {
    core::arch::naked_asm!(
        // The return address: who is asking.
        "mov rdx, [rsp]",
        "push rdi",
        "push rsi",
        "sub rsp, 8",
        "call {hook}",
        "add rsp, 8",
        "pop rsi",
        "pop rdi",
        "test rax, rax",
        "jnz 2f",
        "jmp qword ptr [rip + {real}]",
        "2:",
        "ret",
        hook = sym dlsym_hook,
        real = sym crate::real::REAL_DLSYM,
    )
}

#[cfg(all(not(test), target_arch = "aarch64"))]
/// # Safety
/// glibc's `dlsym` contract.
#[unsafe(naked)]
#[no_mangle]
pub unsafe extern "C" fn dlsym(handle: *mut c_void, name: *const c_char) -> *mut c_void {
    core::arch::naked_asm!(
        // The return address: who is asking.
        "mov x2, x30",
        "stp x29, x30, [sp, #-32]!",
        "mov x29, sp",
        "stp x0, x1, [sp, #16]",
        "bl {hook}",
        "cbnz x0, 2f",
        "ldp x0, x1, [sp, #16]",
        "ldp x29, x30, [sp], #32",
        "adrp x16, {real}",
        "ldr x16, [x16, :lo12:{real}]",
        "br x16",
        "2:",
        "ldp x29, x30, [sp], #32",
        "ret",
        hook = sym dlsym_hook,
        real = sym crate::real::REAL_DLSYM,
    )
}

#[cfg(all(not(test), not(any(target_arch = "x86_64", target_arch = "aarch64"))))]
/// # Safety
/// glibc's `dlsym` contract. (Other architectures: `RTLD_NEXT` is resolved relative to
/// the shim rather than the caller, and only the inside-the-shim rule tells a driver
/// below the shim from the application.)
#[no_mangle]
pub unsafe extern "C" fn dlsym(handle: *mut c_void, name: *const c_char) -> *mut c_void {
    // SAFETY: same contract as ours.
    let w = unsafe { dlsym_hook(handle, name, std::ptr::null()) };
    if !w.is_null() {
        return w;
    }
    // SAFETY: glibc's dlsym with the caller's arguments.
    unsafe { real_dlsym()(handle, name) }
}
