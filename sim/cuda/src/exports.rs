//! Every symbol `libcuda.so.1` exports, generated from the one declaration list
//! below (as the shim's `shim/src/exports.rs`): each entry is the C signature, the
//! CUDA version that introduced the symbol (what `cuGetProcAddress` matches the
//! requested version against), and optionally its per-thread-default-stream twin
//! (`_ptsz`/`_ptds`).
//!
//! An entry `cuX(args) = VERSION;` exports `cuX`, which runs `crate::api::cuX(args)`
//! (`= VERSION in module;`: `crate::module::cuX(args)`, for the lookups that sit
//! above `api`: `procaddr`, `dark_api`)
//! through [`guard`] (no panic crosses the C ABI). With `, per_thread cuX_ptsz` it
//! also exports the twin; both run `crate::api::cuX(args, pt)`, with `pt` false for
//! `cuX` and true for the twin, whose NULL stream is then the calling thread's
//! per-thread default stream. Every entry passes the checkpoint gate
//! (`crate::checkpoint::enter`) first, but those after `@ungated`, which name their
//! module. [`exports`] and [`per_thread_exports`] are the tables
//! `cuGetProcAddress` (`crate::procaddr`) resolves names through.

#![allow(non_snake_case, clippy::too_many_arguments)]

use std::ffi::{c_char, c_void};

use crate::abi::*;
use crate::api;
use crate::checkpoint;
use crate::dark_api;
use crate::ffi::guard;
use crate::library;
use crate::procaddr::{self, base_name};

macro_rules! exports {
    (@fn $name:ident ($($arg:ident : $ty:ty),* $(,)?) [] []) => {
        #[no_mangle]
        extern "C" fn $name($($arg: $ty),*) -> CUresult {
            guard(|| {
                let _in = checkpoint::enter();
                api::$name($($arg),*)
            })
        }
    };
    (@fn $name:ident ($($arg:ident : $ty:ty),* $(,)?) [] [$module:ident]) => {
        #[no_mangle]
        extern "C" fn $name($($arg: $ty),*) -> CUresult {
            guard(|| {
                let _in = checkpoint::enter();
                $module::$name($($arg),*)
            })
        }
    };
    (@fn $name:ident ($($arg:ident : $ty:ty),* $(,)?) [$pt:ident] []) => {
        #[no_mangle]
        extern "C" fn $name($($arg: $ty),*) -> CUresult {
            guard(|| {
                let _in = checkpoint::enter();
                api::$name($($arg,)* false)
            })
        }
        #[no_mangle]
        extern "C" fn $pt($($arg: $ty),*) -> CUresult {
            guard(|| {
                let _in = checkpoint::enter();
                api::$name($($arg,)* true)
            })
        }
    };
    (@ungated $module:ident $name:ident ($($arg:ident : $ty:ty),* $(,)?)) => {
        #[no_mangle]
        extern "C" fn $name($($arg: $ty),*) -> CUresult {
            guard(|| $module::$name($($arg),*))
        }
    };
    (
        $( $name:ident $args:tt = $ver:literal $(, per_thread $pt:ident)? $(in $m:ident)? ; )*
        @ungated $( $module:ident :: $uname:ident $uargs:tt = $uver:literal ; )*
    ) => {
        $( exports!(@fn $name $args [$($pt)?] [$($m)?]); )*
        $( exports!(@ungated $module $uname $uargs); )*

        /// Every export but the per-thread twins: (symbol, minimum CUDA version,
        /// address). `procaddr` derives base names from the symbols.
        pub fn exports() -> Vec<(&'static str, i32, usize)> {
            vec![
                $((stringify!($name), $ver, $name as *const () as usize),)*
                $((stringify!($uname), $uver, $uname as *const () as usize),)*
            ]
        }

        /// Per-thread-default-stream twins: (base name, minimum CUDA version,
        /// symbol, address); the version is the legacy symbol's. A base name may
        /// have several (e.g. `cuMemPrefetchAsync` and its `_v2`).
        // One push per entry with a twin: generated, so not a `vec![]` literal.
        #[allow(clippy::vec_init_then_push)]
        pub fn per_thread_exports() -> Vec<(&'static str, i32, &'static str, usize)> {
            let mut v = Vec::new();
            $($(
                v.push((
                    base_name(stringify!($name)),
                    $ver,
                    stringify!($pt),
                    $pt as *const () as usize,
                ));
            )?)*
            v
        }
    };
}

exports! {
    // init, devices
    cuInit(flags: u32) = 2000;
    cuDriverGetVersion(v: *mut i32) = 2020;
    cuDeviceGet(dev: *mut CUdevice, ordinal: i32) = 2000;
    cuDeviceGetCount(count: *mut i32) = 2000;
    cuDeviceGetName(name: *mut c_char, len: i32, dev: CUdevice) = 2000;
    cuDeviceGetUuid(uuid: *mut CUuuid, dev: CUdevice) = 9020;
    cuDeviceGetUuid_v2(uuid: *mut CUuuid, dev: CUdevice) = 11040;
    cuDeviceTotalMem_v2(bytes: *mut usize, dev: CUdevice) = 3020;
    cuDeviceGetAttribute(pi: *mut i32, attrib: i32, dev: CUdevice) = 2000;
    cuDeviceComputeCapability(major: *mut i32, minor: *mut i32, dev: CUdevice) = 2000;
    cuDeviceGetPCIBusId(bus: *mut c_char, len: i32, dev: CUdevice) = 4010;
    cuDeviceCanAccessPeer(can: *mut i32, dev: CUdevice, peer: CUdevice) = 4000;

    // contexts
    cuDevicePrimaryCtxRetain(pctx: *mut CUcontext, dev: CUdevice) = 7000;
    cuDevicePrimaryCtxRelease_v2(dev: CUdevice) = 11000;
    cuDevicePrimaryCtxRelease(dev: CUdevice) = 7000;
    cuDevicePrimaryCtxReset_v2(dev: CUdevice) = 11000;
    cuDevicePrimaryCtxReset(dev: CUdevice) = 7000;
    cuDevicePrimaryCtxGetState(dev: CUdevice, flags: *mut u32, active: *mut i32) = 7000;
    cuDevicePrimaryCtxSetFlags_v2(dev: CUdevice, flags: u32) = 11000;
    cuCtxCreate_v2(pctx: *mut CUcontext, flags: u32, dev: CUdevice) = 3020;
    cuCtxDestroy_v2(ctx: CUcontext) = 4000;
    cuCtxSetCurrent(ctx: CUcontext) = 4000;
    cuCtxGetCurrent(pctx: *mut CUcontext) = 4000;
    cuCtxPushCurrent_v2(ctx: CUcontext) = 4000;
    cuCtxPopCurrent_v2(pctx: *mut CUcontext) = 4000;
    cuCtxSynchronize() = 2000;
    cuCtxGetDevice(dev: *mut CUdevice) = 2000;
    cuCtxGetFlags(flags: *mut u32) = 7000;
    cuCtxGetApiVersion(ctx: CUcontext, version: *mut u32) = 3020;
    cuCtxGetStreamPriorityRange(least: *mut i32, greatest: *mut i32) = 5050;
    cuCtxGetLimit(value: *mut usize, limit: u32) = 3010;
    cuCtxSetLimit(limit: u32, value: usize) = 3010;

    // device memory
    cuMemGetInfo_v2(free: *mut usize, total: *mut usize) = 3020;
    cuMemAlloc_v2(dptr: *mut CUdeviceptr, size: usize) = 3020;
    cuMemAllocPitch_v2(dptr: *mut CUdeviceptr, pitch: *mut usize, width: usize, height: usize, elem: u32) = 3020;
    cuMemFree_v2(ptr: CUdeviceptr) = 3020;
    cuMemGetAddressRange_v2(base: *mut CUdeviceptr, size: *mut usize, ptr: CUdeviceptr) = 3020;
    cuMemAllocAsync(dptr: *mut CUdeviceptr, size: usize, stream: CUstream) = 11020, per_thread cuMemAllocAsync_ptsz;
    cuMemAllocFromPoolAsync(dptr: *mut CUdeviceptr, size: usize, pool: *mut c_void, stream: CUstream) = 11020, per_thread cuMemAllocFromPoolAsync_ptsz;
    cuDeviceGetDefaultMemPool(pool: *mut *mut c_void, dev: CUdevice) = 11020;
    cuDeviceGetMemPool(pool: *mut *mut c_void, dev: CUdevice) = 11020;
    cuDeviceSetMemPool(dev: CUdevice, pool: *mut c_void) = 11020;
    cuMemPoolCreate(pool: *mut *mut c_void, props: *const crate::pool::CUmemPoolProps) = 11020;
    cuMemPoolDestroy(pool: *mut c_void) = 11020;
    cuMemPoolSetAttribute(pool: *mut c_void, attr: i32, value: *mut c_void) = 11020;
    cuMemPoolGetAttribute(pool: *mut c_void, attr: i32, value: *mut c_void) = 11020;
    cuMemPoolTrimTo(pool: *mut c_void, _keep: usize) = 11020;
    cuMemFreeAsync(ptr: CUdeviceptr, stream: CUstream) = 11020, per_thread cuMemFreeAsync_ptsz;

    // managed memory, pointers
    cuMemAllocManaged(dptr: *mut CUdeviceptr, size: usize, flags: u32) = 6000;
    cuMemPrefetchAsync(ptr: CUdeviceptr, n: usize, device: CUdevice, s: CUstream) = 8000, per_thread cuMemPrefetchAsync_ptsz;
    cuMemPrefetchAsync_v2(ptr: CUdeviceptr, n: usize, loc: CUmemLocation, _flags: u32, s: CUstream) = 12020, per_thread cuMemPrefetchAsync_v2_ptsz;
    cuPointerGetAttribute(data: *mut c_void, attribute: i32, ptr: CUdeviceptr) = 4000;
    cuPointerGetAttributes(n: u32, attributes: *const i32, data: *mut *mut c_void, ptr: CUdeviceptr) = 7000;
    cuIpcGetMemHandle(handle: *mut [u8; 64], ptr: CUdeviceptr) = 4010;
    cuIpcOpenMemHandle(pdptr: *mut CUdeviceptr, handle: CUipcMemHandle, flags: u32) = 4010;
    cuIpcOpenMemHandle_v2(pdptr: *mut CUdeviceptr, handle: CUipcMemHandle, flags: u32) = 11000;
    cuIpcCloseMemHandle(ptr: CUdeviceptr) = 4010;
    cuMemAdvise(ptr: CUdeviceptr, n: usize, advice: i32, device: CUdevice) = 8000;
    cuMemAdvise_v2(ptr: CUdeviceptr, n: usize, advice: i32, loc: CUmemLocation) = 12020;

    // pinned host memory
    cuMemAllocHost_v2(pp: *mut *mut c_void, size: usize) = 3020;
    cuMemHostAlloc(pp: *mut *mut c_void, size: usize, flags: u32) = 2020;
    cuMemFreeHost(p: *mut c_void) = 2000;
    cuMemHostRegister_v2(p: *mut c_void, size: usize, flags: u32) = 6050;
    cuMemHostUnregister(p: *mut c_void) = 4000;
    cuMemHostGetDevicePointer_v2(pdptr: *mut CUdeviceptr, p: *mut c_void, flags: u32) = 3020;

    // copies and memsets
    cuMemcpy(dst: CUdeviceptr, src: CUdeviceptr, n: usize) = 4000, per_thread cuMemcpy_ptds;
    cuMemcpyAsync(dst: CUdeviceptr, src: CUdeviceptr, n: usize, s: CUstream) = 4000, per_thread cuMemcpyAsync_ptsz;
    cuMemcpyHtoD_v2(dst: CUdeviceptr, src: *const c_void, n: usize) = 3020, per_thread cuMemcpyHtoD_v2_ptds;
    cuMemcpyDtoH_v2(dst: *mut c_void, src: CUdeviceptr, n: usize) = 3020, per_thread cuMemcpyDtoH_v2_ptds;
    cuMemcpyDtoD_v2(dst: CUdeviceptr, src: CUdeviceptr, n: usize) = 3020, per_thread cuMemcpyDtoD_v2_ptds;
    cuMemcpyHtoDAsync_v2(dst: CUdeviceptr, src: *const c_void, n: usize, s: CUstream) = 3020, per_thread cuMemcpyHtoDAsync_v2_ptsz;
    cuMemcpyDtoHAsync_v2(dst: *mut c_void, src: CUdeviceptr, n: usize, s: CUstream) = 3020, per_thread cuMemcpyDtoHAsync_v2_ptsz;
    cuMemcpyDtoDAsync_v2(dst: CUdeviceptr, src: CUdeviceptr, n: usize, s: CUstream) = 3020, per_thread cuMemcpyDtoDAsync_v2_ptsz;
    cuMemsetD8_v2(dst: CUdeviceptr, v: u8, n: usize) = 3020, per_thread cuMemsetD8_v2_ptds;
    cuMemsetD16_v2(dst: CUdeviceptr, v: u16, n: usize) = 3020, per_thread cuMemsetD16_v2_ptds;
    cuMemsetD32_v2(dst: CUdeviceptr, v: u32, n: usize) = 3020, per_thread cuMemsetD32_v2_ptds;
    cuMemsetD8Async(dst: CUdeviceptr, v: u8, n: usize, s: CUstream) = 3020, per_thread cuMemsetD8Async_ptsz;
    cuMemsetD16Async(dst: CUdeviceptr, v: u16, n: usize, s: CUstream) = 3020, per_thread cuMemsetD16Async_ptsz;
    cuMemsetD32Async(dst: CUdeviceptr, v: u32, n: usize, s: CUstream) = 3020, per_thread cuMemsetD32Async_ptsz;

    // 2D copies and memsets
    cuMemcpy2D_v2(p: *const CudaMemcpy2D) = 3020, per_thread cuMemcpy2D_v2_ptds;
    cuMemcpy2DUnaligned_v2(p: *const CudaMemcpy2D) = 3020, per_thread cuMemcpy2DUnaligned_v2_ptds;
    cuMemcpy2DAsync_v2(p: *const CudaMemcpy2D, s: CUstream) = 3020, per_thread cuMemcpy2DAsync_v2_ptsz;
    cuMemsetD2D8_v2(dst: CUdeviceptr, pitch: usize, v: u8, w: usize, h: usize) = 3020, per_thread cuMemsetD2D8_v2_ptds;
    cuMemsetD2D16_v2(dst: CUdeviceptr, pitch: usize, v: u16, w: usize, h: usize) = 3020, per_thread cuMemsetD2D16_v2_ptds;
    cuMemsetD2D32_v2(dst: CUdeviceptr, pitch: usize, v: u32, w: usize, h: usize) = 3020, per_thread cuMemsetD2D32_v2_ptds;
    cuMemsetD2D8Async(dst: CUdeviceptr, pitch: usize, v: u8, w: usize, h: usize, s: CUstream) = 3020, per_thread cuMemsetD2D8Async_ptsz;
    cuMemsetD2D16Async(dst: CUdeviceptr, pitch: usize, v: u16, w: usize, h: usize, s: CUstream) = 3020, per_thread cuMemsetD2D16Async_ptsz;
    cuMemsetD2D32Async(dst: CUdeviceptr, pitch: usize, v: u32, w: usize, h: usize, s: CUstream) = 3020, per_thread cuMemsetD2D32Async_ptsz;

    // VMM
    cuMemGetAllocationGranularity(g: *mut usize, prop: *const CUmemAllocationProp, option: i32) = 10020;
    cuMemAddressReserve(ptr: *mut CUdeviceptr, size: usize, align: usize, addr: CUdeviceptr, flags: u64) = 10020;
    cuMemAddressFree(ptr: CUdeviceptr, size: usize) = 10020;
    cuMemCreate(handle: *mut CUmemGenericAllocationHandle, size: usize, prop: *const CUmemAllocationProp, flags: u64) = 10020;
    cuMemRelease(handle: CUmemGenericAllocationHandle) = 10020;
    cuMemMap(ptr: CUdeviceptr, size: usize, offset: usize, handle: CUmemGenericAllocationHandle, flags: u64) = 10020;
    cuMemUnmap(ptr: CUdeviceptr, size: usize) = 10020;
    cuMemSetAccess(ptr: CUdeviceptr, size: usize, desc: *const CUmemAccessDesc, count: usize) = 10020;
    cuMemExportToShareableHandle(shareable: *mut c_void, handle: CUmemGenericAllocationHandle, handle_type: i32, flags: u64) = 10020;
    cuMemImportFromShareableHandle(handle: *mut CUmemGenericAllocationHandle, os_handle: *mut c_void, handle_type: i32) = 10020;

    // streams and events
    cuStreamCreate(ph: *mut CUstream, flags: u32) = 2000;
    cuStreamCreateWithPriority(ph: *mut CUstream, flags: u32, priority: i32) = 5050;
    cuStreamDestroy_v2(s: CUstream) = 4000;
    cuStreamSynchronize(s: CUstream) = 2000, per_thread cuStreamSynchronize_ptsz;
    cuStreamQuery(s: CUstream) = 2000, per_thread cuStreamQuery_ptsz;
    cuStreamWaitEvent(s: CUstream, e: CUevent, _flags: u32) = 3020, per_thread cuStreamWaitEvent_ptsz;
    cuStreamAddCallback(s: CUstream, cb: CUstreamCallback, data: *mut c_void, flags: u32) = 5000, per_thread cuStreamAddCallback_ptsz;
    cuStreamGetFlags(s: CUstream, flags: *mut u32) = 5050;
    cuStreamGetPriority(s: CUstream, prio: *mut i32) = 5050;
    cuStreamGetCtx(s: CUstream, pctx: *mut CUcontext) = 9020;

    // stream memory operations: v1 (CUDA 8.0/9.0) and v2 (CUDA 11.7)
    cuStreamWaitValue32(s: CUstream, addr: CUdeviceptr, value: u32, flags: u32) = 8000, per_thread cuStreamWaitValue32_ptsz;
    cuStreamWaitValue64(s: CUstream, addr: CUdeviceptr, value: u64, flags: u32) = 9000, per_thread cuStreamWaitValue64_ptsz;
    cuStreamWriteValue32(s: CUstream, addr: CUdeviceptr, value: u32, flags: u32) = 8000, per_thread cuStreamWriteValue32_ptsz;
    cuStreamWriteValue64(s: CUstream, addr: CUdeviceptr, value: u64, flags: u32) = 9000, per_thread cuStreamWriteValue64_ptsz;
    cuStreamBatchMemOp(s: CUstream, count: u32, params: *mut CUstreamBatchMemOpParams, flags: u32) = 8000, per_thread cuStreamBatchMemOp_ptsz;
    cuStreamWaitValue32_v2(s: CUstream, addr: CUdeviceptr, value: u32, flags: u32) = 11070, per_thread cuStreamWaitValue32_v2_ptsz;
    cuStreamWaitValue64_v2(s: CUstream, addr: CUdeviceptr, value: u64, flags: u32) = 11070, per_thread cuStreamWaitValue64_v2_ptsz;
    cuStreamWriteValue32_v2(s: CUstream, addr: CUdeviceptr, value: u32, flags: u32) = 11070, per_thread cuStreamWriteValue32_v2_ptsz;
    cuStreamWriteValue64_v2(s: CUstream, addr: CUdeviceptr, value: u64, flags: u32) = 11070, per_thread cuStreamWriteValue64_v2_ptsz;
    cuStreamBatchMemOp_v2(s: CUstream, count: u32, params: *mut CUstreamBatchMemOpParams, flags: u32) = 11070, per_thread cuStreamBatchMemOp_v2_ptsz;

    cuEventCreate(ph: *mut CUevent, flags: u32) = 2000;
    cuEventDestroy_v2(e: CUevent) = 4000;
    cuEventRecord(e: CUevent, s: CUstream) = 2000, per_thread cuEventRecord_ptsz;
    cuEventRecordWithFlags(e: CUevent, s: CUstream, _flags: u32) = 11010, per_thread cuEventRecordWithFlags_ptsz;
    cuEventQuery(e: CUevent) = 2000;
    cuEventSynchronize(e: CUevent) = 2000;
    cuEventElapsedTime(ms: *mut f32, start: CUevent, end: CUevent) = 2000;
    cuEventElapsedTime_v2(ms: *mut f32, start: CUevent, end: CUevent) = 12080;

    // graphs (stream capture)
    cuStreamBeginCapture_v2(s: CUstream, mode: u32) = 10010, per_thread cuStreamBeginCapture_v2_ptsz;
    cuStreamEndCapture(s: CUstream, graph: *mut *mut c_void) = 10000, per_thread cuStreamEndCapture_ptsz;
    cuStreamIsCapturing(s: CUstream, status: *mut i32) = 10000, per_thread cuStreamIsCapturing_ptsz;
    cuStreamGetCaptureInfo(s: CUstream, status: *mut i32, id: *mut u64) = 10010, per_thread cuStreamGetCaptureInfo_ptsz;
    cuStreamGetCaptureInfo_v2(s: CUstream, status: *mut i32, id: *mut u64, graph: *mut *mut c_void, deps: *mut *const c_void, count: *mut usize) = 11030, per_thread cuStreamGetCaptureInfo_v2_ptsz;
    cuStreamGetCaptureInfo_v3(s: CUstream, status: *mut i32, id: *mut u64, graph: *mut *mut c_void, deps: *mut *const c_void, edges: *mut *const c_void, count: *mut usize) = 12030, per_thread cuStreamGetCaptureInfo_v3_ptsz;
    cuThreadExchangeStreamCaptureMode(mode: *mut u32) = 10010;
    cuGraphInstantiateWithFlags(exec: *mut *mut c_void, graph: *mut c_void, _flags: u64) = 11040;
    cuGraphLaunch(exec: *mut c_void, s: CUstream) = 10000, per_thread cuGraphLaunch_ptsz;
    cuGraphUpload(exec: *mut c_void, s: CUstream) = 11010, per_thread cuGraphUpload_ptsz;
    cuGraphExecDestroy(exec: *mut c_void) = 10000;
    cuGraphDestroy(graph: *mut c_void) = 10000;

    // modules and launches
    cuModuleLoadData(m: *mut CUmodule, image: *const c_void) = 2000;
    cuModuleLoadDataEx(m: *mut CUmodule, image: *const c_void, _n: u32, _o: *mut i32, _v: *mut *mut c_void) = 2010;
    cuModuleLoad(m: *mut CUmodule, fname: *const c_char) = 2000;
    cuModuleUnload(m: CUmodule) = 2000;
    cuModuleGetFunction(f: *mut CUfunction, m: CUmodule, name: *const c_char) = 2000;
    cuFuncGetAttribute(pi: *mut i32, attrib: i32, f: CUfunction) = 2020;
    cuFuncSetAttribute(f: CUfunction, attrib: i32, value: i32) = 9000;
    cuModuleGetLoadingMode(mode: *mut u32) = 11070;
    cuLaunchKernel(f: CUfunction, gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32, _shmem: u32, s: CUstream, params: *mut *mut c_void, extra: *mut *mut c_void) = 4000, per_thread cuLaunchKernel_ptsz;
    cuLaunchCooperativeKernel(f: CUfunction, gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32, _shmem: u32, s: CUstream, params: *mut *mut c_void) = 9000, per_thread cuLaunchCooperativeKernel_ptsz;
    cuLaunchKernelEx(cfg: *const CUlaunchConfig, f: CUfunction, params: *mut *mut c_void, extra: *mut *mut c_void) = 11060, per_thread cuLaunchKernelEx_ptsz;
    cuLaunchHostFunc(s: CUstream, f: CUhostFn, data: *mut c_void) = 10000, per_thread cuLaunchHostFunc_ptsz;

    // context-independent loading (`library.rs`)
    cuLibraryLoadData(lib: *mut CUlibrary, code: *const c_void, jit_options: *mut i32, jit_values: *mut *mut c_void, n_jit: u32, lib_options: *mut i32, lib_values: *mut *mut c_void, n_lib: u32) = 12000 in library;
    cuLibraryLoadFromFile(lib: *mut CUlibrary, file: *const c_char, jit_options: *mut i32, jit_values: *mut *mut c_void, n_jit: u32, lib_options: *mut i32, lib_values: *mut *mut c_void, n_lib: u32) = 12000 in library;
    cuLibraryUnload(lib: CUlibrary) = 12000 in library;
    cuLibraryGetKernel(k: *mut CUkernel, lib: CUlibrary, name: *const c_char) = 12000 in library;
    cuLibraryGetKernelCount(count: *mut u32, lib: CUlibrary) = 12040 in library;
    cuLibraryEnumerateKernels(kernels: *mut CUkernel, n: u32, lib: CUlibrary) = 12040 in library;
    cuLibraryGetModule(m: *mut CUmodule, lib: CUlibrary) = 12000 in library;
    cuLibraryGetGlobal(ptr: *mut CUdeviceptr, size: *mut usize, lib: CUlibrary, name: *const c_char) = 12000 in library;
    cuLibraryGetManaged(ptr: *mut CUdeviceptr, size: *mut usize, lib: CUlibrary, name: *const c_char) = 12000 in library;
    cuKernelGetFunction(f: *mut CUfunction, k: CUkernel) = 12000 in library;
    cuKernelGetName(name: *mut *const c_char, k: CUkernel) = 12030 in library;
    cuKernelGetAttribute(pi: *mut i32, attrib: i32, k: CUkernel, dev: CUdevice) = 12000;
    cuKernelSetAttribute(attrib: i32, value: i32, k: CUkernel, dev: CUdevice) = 12000;
    cuKernelSetCacheConfig(k: CUkernel, config: i32, dev: CUdevice) = 12000 in library;

    // entry points
    cuGetExportTable(table: *mut *const c_void, id: *const CUuuid) = 3000 in dark_api;
    cuGetProcAddress(symbol: *const c_char, pfn: *mut *mut c_void, version: i32, flags: u64) = 11030 in procaddr;
    cuGetProcAddress_v2(symbol: *const c_char, pfn: *mut *mut c_void, version: i32, flags: u64, status: *mut i32) = 12000 in procaddr;

    // Past no gate: the error strings, and the checkpoint calls (made by another
    // process, about this one's gate).
    @ungated
    api::cuGetErrorName(e: CUresult, s: *mut *const c_char) = 6000;
    api::cuGetErrorString(e: CUresult, s: *mut *const c_char) = 6000;
    checkpoint::cuCheckpointProcessGetRestoreThreadId(pid: i32, tid: *mut i32) = 12080;
    checkpoint::cuCheckpointProcessGetState(pid: i32, state: *mut u32) = 12080;
    checkpoint::cuCheckpointProcessLock(pid: i32, args: *const u64) = 12080;
    checkpoint::cuCheckpointProcessCheckpoint(pid: i32, args: *const u64) = 12080;
    checkpoint::cuCheckpointProcessRestore(pid: i32, args: *const u64) = 12080;
    checkpoint::cuCheckpointProcessUnlock(pid: i32, args: *const u64) = 12080;
}

/// Hands the entry-point tables to `crate::procaddr` when the library is loaded (an
/// ELF constructor), so the lookup layer below never reaches up into this one.
extern "C" fn register_exports() {
    // A panic must not unwind out of a constructor.
    let _ = std::panic::catch_unwind(|| procaddr::register((exports(), per_thread_exports())));
}

#[used]
#[link_section = ".init_array"]
static REGISTER_EXPORTS: extern "C" fn() = register_exports;
