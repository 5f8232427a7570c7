//! Every symbol `libkiwi.so` exports in the driver's name, generated from the one
//! declaration list below: its C signature and its gate class.
//!
//! - `pass`: forwarded unchanged (exported so lookups resolve consistently, and so the
//!   shim has the original at hand).
//! - `submit`: work submission; waits for this process's turn and for its memory to be
//!   resident ([`crate::gate::submit`]).
//! - `hook`: a function of [`crate::hooks`] decides (allocation, info, lookup).
//!
//! `dlsym` ([`crate::dl`]) and `cuGetProcAddress` ([`crate::procaddr`]) map names and
//! original pointers to these wrappers through [`SYMBOLS`] and [`REAL`], so all three
//! paths into the driver meet the same code.

#![allow(non_snake_case, clippy::too_many_arguments)]

use std::ffi::{c_char, c_int, c_void};
use std::ptr::null_mut;
use std::sync::atomic::AtomicPtr;

use crate::cuda::*;
use crate::hooks;

/// How an export treats its call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Class {
    Pass,
    Submit,
    Hook,
}

/// One export: its NUL-terminated name and gate class.
#[derive(Debug)]
pub struct SymInfo {
    name: &'static str,
    pub class: Class,
}

impl SymInfo {
    /// The name without the trailing NUL.
    pub fn name(&self) -> &'static str {
        &self.name[..self.name.len() - 1]
    }

    pub fn cname(&self) -> &'static std::ffi::CStr {
        std::ffi::CStr::from_bytes_with_nul(self.name.as_bytes()).expect("names end in NUL")
    }
}

macro_rules! exports {
    (@fn pass $name:ident ($($arg:ident : $ty:ty),*)) => {
        /// # Safety
        /// C ABI export: arguments as `cuda.h` documents them; forwarded unchanged.
        #[cfg_attr(not(test), no_mangle)]
        pub unsafe extern "C" fn $name($($arg: $ty),*) -> CUresult {
            let p = crate::real::original(Sym::$name as usize);
            if p.is_null() {
                return crate::real::missing(stringify!($name));
            }
            // SAFETY: p is the real driver's symbol of this very name, whose C signature
            // is the one declared here (cuda.h).
            let real = unsafe {
                std::mem::transmute::<*mut c_void, unsafe extern "C" fn($($ty),*) -> CUresult>(p)
            };
            // SAFETY: the caller's arguments, forwarded unchanged.
            unsafe { real($($arg),*) }
        }
    };
    (@fn submit $name:ident ($($arg:ident : $ty:ty),*)) => {
        /// # Safety
        /// C ABI export: arguments as `cuda.h` documents them; runs once this process
        /// holds the GPU and its memory is resident.
        #[cfg_attr(not(test), no_mangle)]
        pub unsafe extern "C" fn $name($($arg: $ty),*) -> CUresult {
            let p = crate::real::original(Sym::$name as usize);
            if p.is_null() {
                return crate::real::missing(stringify!($name));
            }
            // SAFETY: as for `pass`: the real symbol of this name and signature.
            let real = unsafe {
                std::mem::transmute::<*mut c_void, unsafe extern "C" fn($($ty),*) -> CUresult>(p)
            };
            if crate::ffi::reentered() {
                // SAFETY: the driver calling itself through an export: forward unchanged.
                return unsafe { real($($arg),*) };
            }
            // SAFETY: the caller's arguments, forwarded unchanged once admitted.
            crate::gate::submit(stringify!($name), || unsafe { real($($arg),*) })
        }
    };
    (@fn hook $name:ident ($($arg:ident : $ty:ty),*) => $hook:path) => {
        /// # Safety
        /// C ABI export: arguments as `cuda.h` documents them.
        #[cfg_attr(not(test), no_mangle)]
        pub unsafe extern "C" fn $name($($arg: $ty),*) -> CUresult {
            let p = crate::real::original(Sym::$name as usize);
            if p.is_null() {
                return crate::real::missing(stringify!($name));
            }
            // SAFETY: as for `pass`: the real symbol of this name and signature.
            let real = unsafe {
                std::mem::transmute::<*mut c_void, unsafe extern "C" fn($($ty),*) -> CUresult>(p)
            };
            if crate::ffi::reentered() {
                // SAFETY: the driver calling itself through an export: forward unchanged.
                return unsafe { real($($arg),*) };
            }
            // SAFETY: the hook receives the caller's arguments and the original.
            crate::ffi::guarded(stringify!($name), || unsafe { $hook(real, $($arg),*) })
        }
    };
    ($( $class:ident $name:ident ( $($arg:ident : $ty:ty),* ) $(=> $hook:path)? ; )*) => {
        /// Index of every export into [`SYMBOLS`] and [`REAL`].
        #[allow(non_camel_case_types)]
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub enum Sym { $($name),* }

        pub const COUNT: usize = [$(stringify!($name)),*].len();

        /// Every export, in [`Sym`] order.
        pub static SYMBOLS: [SymInfo; COUNT] = [
            $( SymInfo { name: concat!(stringify!($name), "\0"), class: exports!(@class $class) } ),*
        ];

        /// The real driver's function behind each export (null until loaded, or when the
        /// driver lacks it).
        pub static REAL: [AtomicPtr<c_void>; COUNT] = [const { AtomicPtr::new(null_mut()) }; COUNT];

        const ALL: [Sym; COUNT] = [$(Sym::$name),*];

        /// The shim's wrapper for export `index`.
        pub fn wrapper(index: usize) -> *mut c_void {
            match ALL[index] {
                $( Sym::$name => $name as *mut c_void, )*
            }
        }

        $( exports!(@fn $class $name ($($arg : $ty),*) $(=> $hook)?); )*
    };
    (@class pass) => { Class::Pass };
    (@class submit) => { Class::Submit };
    (@class hook) => { Class::Hook };
}

exports! {
    // --- initialisation and lookup
    hook cuInit(flags: Uint) => hooks::init;
    hook cuGetProcAddress(symbol: *const c_char, pfn: *mut *mut c_void, cuda_version: c_int, flags: u64) => hooks::get_proc_address;
    hook cuGetProcAddress_v2(symbol: *const c_char, pfn: *mut *mut c_void, cuda_version: c_int, flags: u64, status: *mut c_int) => hooks::get_proc_address_v2;

    // --- contexts: a context on a device gives the process a turn on that GPU
    hook cuDevicePrimaryCtxRetain(pctx: *mut CUcontext, dev: CUdevice) => hooks::primary_ctx_retain;
    hook cuCtxCreate_v2(pctx: *mut CUcontext, flags: Uint, dev: CUdevice) => hooks::ctx_create_v2;
    hook cuCtxCreate_v3(pctx: *mut CUcontext, params: Opaque, num_params: c_int, flags: Uint, dev: CUdevice) => hooks::ctx_create_v3;
    hook cuCtxCreate_v4(pctx: *mut CUcontext, params: Opaque, flags: Uint, dev: CUdevice) => hooks::ctx_create_v4;

    // --- allocation: VMM-backed, swappable, never waits for the GPU
    hook cuMemAlloc_v2(dptr: *mut CUdeviceptr, size: usize) => hooks::mem_alloc;
    hook cuMemAllocPitch_v2(dptr: *mut CUdeviceptr, pitch: *mut usize, width: usize, height: usize, elem: Uint) => hooks::mem_alloc_pitch;
    hook cuMemFree_v2(dptr: CUdeviceptr) => hooks::mem_free;
    hook cuMemAllocAsync(dptr: *mut CUdeviceptr, size: usize, stream: CUstream) => hooks::mem_alloc_async;
    hook cuMemAllocAsync_ptsz(dptr: *mut CUdeviceptr, size: usize, stream: CUstream) => hooks::mem_alloc_async;
    hook cuMemAllocFromPoolAsync(dptr: *mut CUdeviceptr, size: usize, pool: CUmemoryPool, stream: CUstream) => hooks::mem_alloc_from_pool;
    hook cuMemAllocFromPoolAsync_ptsz(dptr: *mut CUdeviceptr, size: usize, pool: CUmemoryPool, stream: CUstream) => hooks::mem_alloc_from_pool;
    hook cuMemFreeAsync(dptr: CUdeviceptr, stream: CUstream) => hooks::mem_free_async;
    hook cuMemFreeAsync_ptsz(dptr: CUdeviceptr, stream: CUstream) => hooks::mem_free_async;
    hook cuMemGetInfo_v2(free: *mut usize, total: *mut usize) => hooks::mem_get_info;
    hook cuMemGetAddressRange_v2(pbase: *mut CUdeviceptr, psize: *mut usize, dptr: CUdeviceptr) => hooks::mem_get_address_range;
    // The application's own VMM: passed through, its physical bytes counted.
    hook cuMemCreate(handle: *mut CUmemGenericAllocationHandle, size: usize, prop: *const CUmemAllocationProp, flags: u64) => hooks::app_mem_create;
    hook cuMemRelease(handle: CUmemGenericAllocationHandle) => hooks::app_mem_release;

    // --- originals the shim itself uses
    pass cuCtxSynchronize();
    pass cuStreamSynchronize(stream: CUstream);
    pass cuCtxGetCurrent(pctx: *mut CUcontext);
    pass cuCtxSetCurrent(ctx: CUcontext);
    pass cuCtxGetDevice(dev: *mut CUdevice);
    pass cuDeviceGet(dev: *mut CUdevice, ordinal: c_int);
    pass cuDeviceGetCount(count: *mut c_int);
    pass cuDeviceGetUuid(uuid: *mut CUuuid, dev: CUdevice);
    pass cuDeviceGetUuid_v2(uuid: *mut CUuuid, dev: CUdevice);
    pass cuDeviceTotalMem_v2(bytes: *mut usize, dev: CUdevice);
    pass cuMemAddressReserve(ptr: *mut CUdeviceptr, size: usize, align: usize, addr: CUdeviceptr, flags: u64);
    pass cuMemAddressFree(ptr: CUdeviceptr, size: usize);
    pass cuMemMap(ptr: CUdeviceptr, size: usize, offset: usize, handle: CUmemGenericAllocationHandle, flags: u64);
    pass cuMemUnmap(ptr: CUdeviceptr, size: usize);
    pass cuMemSetAccess(ptr: CUdeviceptr, size: usize, desc: *const CUmemAccessDesc, count: usize);
    pass cuMemGetAllocationGranularity(granularity: *mut usize, prop: *const CUmemAllocationProp, option: c_int);
    pass cuMemAllocHost_v2(pp: *mut *mut c_void, size: usize);
    pass cuMemFreeHost(p: *mut c_void);

    // --- work submission: kernels, graphs, host functions
    submit cuLaunchKernel(f: CUfunction, gx: Uint, gy: Uint, gz: Uint, bx: Uint, by: Uint, bz: Uint, shared: Uint, stream: CUstream, params: *mut *mut c_void, extra: *mut *mut c_void);
    submit cuLaunchKernel_ptsz(f: CUfunction, gx: Uint, gy: Uint, gz: Uint, bx: Uint, by: Uint, bz: Uint, shared: Uint, stream: CUstream, params: *mut *mut c_void, extra: *mut *mut c_void);
    submit cuLaunchKernelEx(config: Opaque, f: CUfunction, params: *mut *mut c_void, extra: *mut *mut c_void);
    submit cuLaunchKernelEx_ptsz(config: Opaque, f: CUfunction, params: *mut *mut c_void, extra: *mut *mut c_void);
    submit cuLaunchCooperativeKernel(f: CUfunction, gx: Uint, gy: Uint, gz: Uint, bx: Uint, by: Uint, bz: Uint, shared: Uint, stream: CUstream, params: *mut *mut c_void);
    submit cuLaunchCooperativeKernel_ptsz(f: CUfunction, gx: Uint, gy: Uint, gz: Uint, bx: Uint, by: Uint, bz: Uint, shared: Uint, stream: CUstream, params: *mut *mut c_void);
    submit cuLaunchHostFunc(stream: CUstream, func: CUhostFn, data: *mut c_void);
    submit cuLaunchHostFunc_ptsz(stream: CUstream, func: CUhostFn, data: *mut c_void);
    submit cuGraphLaunch(exec: CUgraphExec, stream: CUstream);
    submit cuGraphLaunch_ptsz(exec: CUgraphExec, stream: CUstream);
    submit cuGraphUpload(exec: CUgraphExec, stream: CUstream);
    submit cuGraphUpload_ptsz(exec: CUgraphExec, stream: CUstream);

    // --- copies
    submit cuMemcpy(dst: CUdeviceptr, src: CUdeviceptr, n: usize);
    submit cuMemcpy_ptds(dst: CUdeviceptr, src: CUdeviceptr, n: usize);
    submit cuMemcpyAsync(dst: CUdeviceptr, src: CUdeviceptr, n: usize, stream: CUstream);
    submit cuMemcpyAsync_ptsz(dst: CUdeviceptr, src: CUdeviceptr, n: usize, stream: CUstream);
    submit cuMemcpyPeer(dst: CUdeviceptr, dctx: CUcontext, src: CUdeviceptr, sctx: CUcontext, n: usize);
    submit cuMemcpyPeer_ptds(dst: CUdeviceptr, dctx: CUcontext, src: CUdeviceptr, sctx: CUcontext, n: usize);
    submit cuMemcpyPeerAsync(dst: CUdeviceptr, dctx: CUcontext, src: CUdeviceptr, sctx: CUcontext, n: usize, stream: CUstream);
    submit cuMemcpyPeerAsync_ptsz(dst: CUdeviceptr, dctx: CUcontext, src: CUdeviceptr, sctx: CUcontext, n: usize, stream: CUstream);
    submit cuMemcpyHtoD_v2(dst: CUdeviceptr, src: *const c_void, n: usize);
    submit cuMemcpyHtoD_v2_ptds(dst: CUdeviceptr, src: *const c_void, n: usize);
    submit cuMemcpyDtoH_v2(dst: *mut c_void, src: CUdeviceptr, n: usize);
    submit cuMemcpyDtoH_v2_ptds(dst: *mut c_void, src: CUdeviceptr, n: usize);
    submit cuMemcpyDtoD_v2(dst: CUdeviceptr, src: CUdeviceptr, n: usize);
    submit cuMemcpyDtoD_v2_ptds(dst: CUdeviceptr, src: CUdeviceptr, n: usize);
    submit cuMemcpyHtoDAsync_v2(dst: CUdeviceptr, src: *const c_void, n: usize, stream: CUstream);
    submit cuMemcpyHtoDAsync_v2_ptsz(dst: CUdeviceptr, src: *const c_void, n: usize, stream: CUstream);
    submit cuMemcpyDtoHAsync_v2(dst: *mut c_void, src: CUdeviceptr, n: usize, stream: CUstream);
    submit cuMemcpyDtoHAsync_v2_ptsz(dst: *mut c_void, src: CUdeviceptr, n: usize, stream: CUstream);
    submit cuMemcpyDtoDAsync_v2(dst: CUdeviceptr, src: CUdeviceptr, n: usize, stream: CUstream);
    submit cuMemcpyDtoDAsync_v2_ptsz(dst: CUdeviceptr, src: CUdeviceptr, n: usize, stream: CUstream);
    submit cuMemcpy2D_v2(p: Opaque);
    submit cuMemcpy2D_v2_ptds(p: Opaque);
    submit cuMemcpy2DUnaligned_v2(p: Opaque);
    submit cuMemcpy2DUnaligned_v2_ptds(p: Opaque);
    submit cuMemcpy2DAsync_v2(p: Opaque, stream: CUstream);
    submit cuMemcpy2DAsync_v2_ptsz(p: Opaque, stream: CUstream);
    submit cuMemcpy3D_v2(p: Opaque);
    submit cuMemcpy3D_v2_ptds(p: Opaque);
    submit cuMemcpy3DAsync_v2(p: Opaque, stream: CUstream);
    submit cuMemcpy3DAsync_v2_ptsz(p: Opaque, stream: CUstream);

    // --- memsets
    submit cuMemsetD8_v2(dst: CUdeviceptr, v: u8, n: usize);
    submit cuMemsetD8_v2_ptds(dst: CUdeviceptr, v: u8, n: usize);
    submit cuMemsetD16_v2(dst: CUdeviceptr, v: u16, n: usize);
    submit cuMemsetD16_v2_ptds(dst: CUdeviceptr, v: u16, n: usize);
    submit cuMemsetD32_v2(dst: CUdeviceptr, v: Uint, n: usize);
    submit cuMemsetD32_v2_ptds(dst: CUdeviceptr, v: Uint, n: usize);
    submit cuMemsetD8Async(dst: CUdeviceptr, v: u8, n: usize, stream: CUstream);
    submit cuMemsetD8Async_ptsz(dst: CUdeviceptr, v: u8, n: usize, stream: CUstream);
    submit cuMemsetD16Async(dst: CUdeviceptr, v: u16, n: usize, stream: CUstream);
    submit cuMemsetD16Async_ptsz(dst: CUdeviceptr, v: u16, n: usize, stream: CUstream);
    submit cuMemsetD32Async(dst: CUdeviceptr, v: Uint, n: usize, stream: CUstream);
    submit cuMemsetD32Async_ptsz(dst: CUdeviceptr, v: Uint, n: usize, stream: CUstream);
    submit cuMemsetD2D8_v2(dst: CUdeviceptr, pitch: usize, v: u8, w: usize, h: usize);
    submit cuMemsetD2D8_v2_ptds(dst: CUdeviceptr, pitch: usize, v: u8, w: usize, h: usize);
    submit cuMemsetD2D16_v2(dst: CUdeviceptr, pitch: usize, v: u16, w: usize, h: usize);
    submit cuMemsetD2D16_v2_ptds(dst: CUdeviceptr, pitch: usize, v: u16, w: usize, h: usize);
    submit cuMemsetD2D32_v2(dst: CUdeviceptr, pitch: usize, v: Uint, w: usize, h: usize);
    submit cuMemsetD2D32_v2_ptds(dst: CUdeviceptr, pitch: usize, v: Uint, w: usize, h: usize);
    submit cuMemsetD2D8Async(dst: CUdeviceptr, pitch: usize, v: u8, w: usize, h: usize, stream: CUstream);
    submit cuMemsetD2D8Async_ptsz(dst: CUdeviceptr, pitch: usize, v: u8, w: usize, h: usize, stream: CUstream);
    submit cuMemsetD2D16Async(dst: CUdeviceptr, pitch: usize, v: u16, w: usize, h: usize, stream: CUstream);
    submit cuMemsetD2D16Async_ptsz(dst: CUdeviceptr, pitch: usize, v: u16, w: usize, h: usize, stream: CUstream);
    submit cuMemsetD2D32Async(dst: CUdeviceptr, pitch: usize, v: Uint, w: usize, h: usize, stream: CUstream);
    submit cuMemsetD2D32Async_ptsz(dst: CUdeviceptr, pitch: usize, v: Uint, w: usize, h: usize, stream: CUstream);

    // --- prefetches and stream memory operations
    submit cuMemPrefetchAsync(ptr: CUdeviceptr, n: usize, dev: CUdevice, stream: CUstream);
    submit cuMemPrefetchAsync_ptsz(ptr: CUdeviceptr, n: usize, dev: CUdevice, stream: CUstream);
    submit cuMemPrefetchAsync_v2(ptr: CUdeviceptr, n: usize, loc: CUmemLocation, flags: Uint, stream: CUstream);
    submit cuMemPrefetchAsync_v2_ptsz(ptr: CUdeviceptr, n: usize, loc: CUmemLocation, flags: Uint, stream: CUstream);
    submit cuStreamWaitValue32(stream: CUstream, addr: CUdeviceptr, value: u32, flags: Uint);
    submit cuStreamWaitValue32_ptsz(stream: CUstream, addr: CUdeviceptr, value: u32, flags: Uint);
    submit cuStreamWaitValue32_v2(stream: CUstream, addr: CUdeviceptr, value: u32, flags: Uint);
    submit cuStreamWaitValue32_v2_ptsz(stream: CUstream, addr: CUdeviceptr, value: u32, flags: Uint);
    submit cuStreamWaitValue64(stream: CUstream, addr: CUdeviceptr, value: u64, flags: Uint);
    submit cuStreamWaitValue64_ptsz(stream: CUstream, addr: CUdeviceptr, value: u64, flags: Uint);
    submit cuStreamWaitValue64_v2(stream: CUstream, addr: CUdeviceptr, value: u64, flags: Uint);
    submit cuStreamWaitValue64_v2_ptsz(stream: CUstream, addr: CUdeviceptr, value: u64, flags: Uint);
    submit cuStreamWriteValue32(stream: CUstream, addr: CUdeviceptr, value: u32, flags: Uint);
    submit cuStreamWriteValue32_ptsz(stream: CUstream, addr: CUdeviceptr, value: u32, flags: Uint);
    submit cuStreamWriteValue32_v2(stream: CUstream, addr: CUdeviceptr, value: u32, flags: Uint);
    submit cuStreamWriteValue32_v2_ptsz(stream: CUstream, addr: CUdeviceptr, value: u32, flags: Uint);
    submit cuStreamWriteValue64(stream: CUstream, addr: CUdeviceptr, value: u64, flags: Uint);
    submit cuStreamWriteValue64_ptsz(stream: CUstream, addr: CUdeviceptr, value: u64, flags: Uint);
    submit cuStreamWriteValue64_v2(stream: CUstream, addr: CUdeviceptr, value: u64, flags: Uint);
    submit cuStreamWriteValue64_v2_ptsz(stream: CUstream, addr: CUdeviceptr, value: u64, flags: Uint);
    submit cuStreamBatchMemOp(stream: CUstream, count: Uint, params: Opaque, flags: Uint);
    submit cuStreamBatchMemOp_ptsz(stream: CUstream, count: Uint, params: Opaque, flags: Uint);
    submit cuStreamBatchMemOp_v2(stream: CUstream, count: Uint, params: Opaque, flags: Uint);
    submit cuStreamBatchMemOp_v2_ptsz(stream: CUstream, count: Uint, params: Opaque, flags: Uint);
}

/// Kiwi's own C functions, for the Python package (`python/kiwi`) and other
/// callers that find them with `dlsym(RTLD_DEFAULT, …)`; documented in
/// `docs/shim.md`. Defined in [`crate::status`].
pub use crate::status::{kiwi_explain, kiwi_status_json};

/// The export named `name`, if any.
pub fn lookup(name: &[u8]) -> Option<usize> {
    if !name.starts_with(b"cu") {
        return None;
    }
    SYMBOLS.iter().position(|s| s.name().as_bytes() == name)
}

/// The real driver's function behind export `s` (loading the driver if needed).
pub fn original(s: Sym) -> *mut c_void {
    crate::real::original(s as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

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
            let work = n.starts_with("cuLaunch")
                || n.starts_with("cuGraphLaunch")
                || n.starts_with("cuGraphUpload")
                || n.starts_with("cuMemcpy")
                || n.starts_with("cuMemset")
                || n.starts_with("cuMemPrefetch")
                || n.starts_with("cuStreamWaitValue")
                || n.starts_with("cuStreamWriteValue")
                || n.starts_with("cuStreamBatchMemOp");
            assert_eq!(work, s.class == Class::Submit, "{n}");
        }
    }

    #[test]
    fn every_per_thread_variant_has_its_legacy_twin() {
        for s in &SYMBOLS {
            let n = s.name();
            if let Some(base) = n.strip_suffix("_ptsz").or_else(|| n.strip_suffix("_ptds")) {
                let twin = lookup(base.as_bytes()).unwrap_or_else(|| panic!("{n} without {base}"));
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
    }
}
