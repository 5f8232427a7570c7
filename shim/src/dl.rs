//! The shim's own `dlsym`, so `dlopen("libcuda.so.1")` + `dlsym(handle, "cuX")` returns
//! the shim's wrapper, not the driver's function.
//!
//! The export is unversioned, so it satisfies both `dlsym@GLIBC_2.2.5` (`GLIBC_2.17` on
//! aarch64) and `dlsym@@GLIBC_2.34` references: glibc binds a versioned reference to an
//! unversioned definition in an earlier object (the preload). On x86-64 and aarch64 it
//! is a naked trampoline: names the shim does not wrap are forwarded with a tail jump,
//! so glibc still sees the application's return address and `RTLD_NEXT` keeps its
//! meaning for the caller.

use std::ffi::{c_char, c_void, CStr};
use std::ptr::null_mut;

use crate::exports::{lookup, wrapper};
use crate::real::real_dlsym;

/// Our wrapper for `name` when the shim wraps it and the target handle provides it;
/// null means "let glibc answer". Also makes sure glibc's `dlsym` is known, because the
/// trampoline jumps to it.
///
/// # Safety
/// `name` is null or a NUL-terminated string; `handle` is whatever the caller passed.
pub unsafe extern "C" fn dlsym_hook(handle: *mut c_void, name: *const c_char) -> *mut c_void {
    let real = real_dlsym();
    if name.is_null() {
        return null_mut();
    }
    // SAFETY: the caller passed a NUL-terminated symbol name.
    let bytes = unsafe { CStr::from_ptr(name) }.to_bytes();
    let Some(index) = lookup(bytes) else {
        return null_mut();
    };
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
/// the shim rather than the caller.)
#[no_mangle]
pub unsafe extern "C" fn dlsym(handle: *mut c_void, name: *const c_char) -> *mut c_void {
    // SAFETY: same contract as ours.
    let w = unsafe { dlsym_hook(handle, name) };
    if !w.is_null() {
        return w;
    }
    // SAFETY: glibc's dlsym with the caller's arguments.
    unsafe { real_dlsym()(handle, name) }
}
