//! Every symbol `libcuda.so.1` exports, generated from the one declaration list
//! below (as the shim's `shim/src/exports.rs` and the simulator's NVML,
//! `sim/nvml/src/exports.rs`): each entry is the C signature, the CUDA version that
//! introduced the symbol (what `cuGetProcAddress` matches the requested version
//! against), optionally its per-thread-default-stream twin (`_ptsz`/`_ptds`), and
//! the function of an area module that does what it does, with the arguments it is
//! given. Versioned names share a function where they behave alike (`_v2` and v1
//! differ only in how they are called), and so do calls that differ only in a
//! constant (the element size of a memset, sync or async).
//!
//! An entry `cuX(args) = VERSION => area::f(exprs);` exports `cuX`, which runs
//! `area::f(exprs)` through [`guard`] (no panic crosses the C ABI). With
//! `, per_thread cuX_ptsz` it also exports the twin; both call `area::f(exprs, pt)`,
//! with `pt` false for `cuX` and true for the twin, whose NULL stream is then the
//! calling thread's per-thread default stream. Every entry passes the checkpoint
//! gate (`crate::checkpoint::enter`) first, but those after `@ungated`.
//! [`exports`] and [`per_thread_exports`] are the tables `cuGetProcAddress`
//! (`crate::procaddr`) resolves names through.
//!
//! The areas: `device` (init, devices, error strings), `context`, `alloc` (device
//! and managed memory, pointers, legacy IPC), `pool`, `pinned` (page-locked host
//! memory), `copy` (copies and memsets), `vmm`, `stream` (streams, events, stream
//! memory operations), `graph` (capture and graphs), `launch` (modules, functions,
//! launches), `library` (`cuLibrary*`, `cuKernel*`), `procaddr`, `dark_api`,
//! `checkpoint`.

#![allow(non_snake_case, clippy::too_many_arguments)]

use std::ffi::{c_char, c_void};
use std::ptr::null_mut;

use kiwi_sim_core::LinkDir::{DeviceToHost, HostToDevice};

use crate::abi::*;
use crate::alloc::location_device;
use crate::device::{ErrorText, DRIVER_VERSION};
use crate::ffi::{guard, out};
use crate::memop::Api::{V1, V2};
use crate::procaddr::{self, base_name};
use crate::stream::Issue;
use crate::stream::ValueOp::{Wait, Write};
// The areas the declaration list calls into.
use crate::{alloc, checkpoint, context, copy, dark_api, device, graph, launch, library};
use crate::{pinned, pool, stream, vmm};

macro_rules! exports {
    // One export: the gate, then the call.
    (@fn $name:ident ($($arg:ident : $ty:ty),*) [] {$($call:tt)*} ($($pass:expr),*)) => {
        #[no_mangle]
        extern "C" fn $name($($arg: $ty),*) -> CUresult {
            guard(|| {
                let _in = checkpoint::enter();
                $($call)*($($pass),*)
            })
        }
    };
    // An export and its per-thread twin: the call gets `pt` last.
    (@fn $name:ident ($($arg:ident : $ty:ty),*) [$pt:ident] {$($call:tt)*} ($($pass:expr),*)) => {
        #[no_mangle]
        extern "C" fn $name($($arg: $ty),*) -> CUresult {
            guard(|| {
                let _in = checkpoint::enter();
                $($call)*($($pass,)* false)
            })
        }
        #[no_mangle]
        extern "C" fn $pt($($arg: $ty),*) -> CUresult {
            guard(|| {
                let _in = checkpoint::enter();
                $($call)*($($pass,)* true)
            })
        }
    };
    // Past no gate.
    (@ungated $name:ident ($($arg:ident : $ty:ty),*) {$($call:tt)*} ($($pass:expr),*)) => {
        #[no_mangle]
        extern "C" fn $name($($arg: $ty),*) -> CUresult {
            guard(|| $($call)*($($pass),*))
        }
    };
    (
        $(
            $name:ident ( $($arg:ident : $ty:ty),* $(,)? ) = $ver:literal $(, per_thread $pt:ident)?
                => $($call:ident)::+ ( $($pass:expr),* $(,)? );
        )*
        @ungated
        $(
            $uname:ident ( $($uarg:ident : $uty:ty),* $(,)? ) = $uver:literal
                => $($ucall:ident)::+ ( $($upass:expr),* $(,)? );
        )*
    ) => {
        $( exports!(@fn $name ($($arg: $ty),*) [$($pt)?] {$($call)::+} ($($pass),*)); )*
        $( exports!(@ungated $uname ($($uarg: $uty),*) {$($ucall)::+} ($($upass),*)); )*

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
    cuInit(flags: u32) = 2000 => device::init(flags);
    cuDriverGetVersion(v: *mut i32) = 2020 => out(v, DRIVER_VERSION);
    cuDeviceGet(dev: *mut CUdevice, ordinal: i32) = 2000 => device::get(dev, ordinal);
    cuDeviceGetCount(count: *mut i32) = 2000 => device::count(count);
    cuDeviceGetName(name: *mut c_char, len: i32, dev: CUdevice) = 2000 => device::name(name, len, dev);
    cuDeviceGetUuid(uuid: *mut CUuuid, dev: CUdevice) = 9020 => device::uuid(uuid, dev);
    cuDeviceGetUuid_v2(uuid: *mut CUuuid, dev: CUdevice) = 11040 => device::uuid(uuid, dev);
    cuDeviceTotalMem_v2(bytes: *mut usize, dev: CUdevice) = 3020 => device::total_mem(bytes, dev);
    cuDeviceGetAttribute(pi: *mut i32, attrib: i32, dev: CUdevice) = 2000 => device::attribute(pi, attrib, dev);
    cuDeviceComputeCapability(major: *mut i32, minor: *mut i32, dev: CUdevice) = 2000 => device::compute_capability(major, minor, dev);
    cuDeviceGetPCIBusId(bus: *mut c_char, len: i32, dev: CUdevice) = 4010 => device::pci_bus_id(bus, len, dev);
    cuDeviceCanAccessPeer(can: *mut i32, dev: CUdevice, peer: CUdevice) = 4000 => device::can_access_peer(can, dev, peer);

    // contexts
    cuDevicePrimaryCtxRetain(pctx: *mut CUcontext, dev: CUdevice) = 7000 => context::primary_context(pctx, dev, true);
    cuDevicePrimaryCtxRelease_v2(dev: CUdevice) = 11000 => context::primary_release(dev);
    cuDevicePrimaryCtxRelease(dev: CUdevice) = 7000 => context::primary_release(dev);
    cuDevicePrimaryCtxReset_v2(dev: CUdevice) = 11000 => context::primary_reset(dev);
    cuDevicePrimaryCtxReset(dev: CUdevice) = 7000 => context::primary_reset(dev);
    cuDevicePrimaryCtxGetState(dev: CUdevice, flags: *mut u32, active: *mut i32) = 7000 => context::primary_state(dev, flags, active);
    cuDevicePrimaryCtxSetFlags_v2(dev: CUdevice, flags: u32) = 11000 => context::primary_set_flags(dev, flags);
    cuCtxCreate_v2(pctx: *mut CUcontext, flags: u32, dev: CUdevice) = 3020 => context::create(pctx, flags, dev);
    cuCtxDestroy_v2(ctx: CUcontext) = 4000 => context::destroy(ctx);
    cuCtxSetCurrent(ctx: CUcontext) = 4000 => context::set_current(ctx);
    cuCtxGetCurrent(pctx: *mut CUcontext) = 4000 => context::get_current(pctx);
    cuCtxPushCurrent_v2(ctx: CUcontext) = 4000 => context::push_current(ctx);
    cuCtxPopCurrent_v2(pctx: *mut CUcontext) = 4000 => context::pop_current(pctx);
    cuCtxSynchronize() = 2000 => context::synchronize();
    cuCtxGetDevice(dev: *mut CUdevice) = 2000 => context::device(dev);
    cuCtxGetFlags(flags: *mut u32) = 7000 => context::flags(flags);
    cuCtxGetApiVersion(ctx: CUcontext, version: *mut u32) = 3020 => context::api_version(ctx, version);
    cuCtxGetStreamPriorityRange(least: *mut i32, greatest: *mut i32) = 5050 => context::stream_priority_range(least, greatest);
    cuCtxGetLimit(value: *mut usize, limit: u32) = 3010 => context::limit(value, limit);
    cuCtxSetLimit(limit: u32, value: usize) = 3010 => context::set_limit(limit, value);

    // device memory
    cuMemGetInfo_v2(free: *mut usize, total: *mut usize) = 3020 => alloc::get_info(free, total);
    cuMemAlloc_v2(dptr: *mut CUdeviceptr, size: usize) = 3020 => alloc::alloc(dptr, size);
    cuMemAllocPitch_v2(dptr: *mut CUdeviceptr, pitch: *mut usize, width: usize, height: usize, elem: u32) = 3020 => alloc::alloc_pitch(dptr, pitch, width, height, elem);
    cuMemFree_v2(ptr: CUdeviceptr) = 3020 => alloc::free(ptr);
    cuMemGetAddressRange_v2(base: *mut CUdeviceptr, size: *mut usize, ptr: CUdeviceptr) = 3020 => alloc::address_range(base, size, ptr);
    cuMemAllocAsync(dptr: *mut CUdeviceptr, size: usize, stream: CUstream) = 11020, per_thread cuMemAllocAsync_ptsz => alloc::alloc_async(dptr, size, None, stream);
    cuMemAllocFromPoolAsync(dptr: *mut CUdeviceptr, size: usize, pool: *mut c_void, stream: CUstream) = 11020, per_thread cuMemAllocFromPoolAsync_ptsz => alloc::alloc_async(dptr, size, Some(pool), stream);
    cuDeviceGetDefaultMemPool(pool: *mut *mut c_void, dev: CUdevice) = 11020 => pool::get_default(pool, dev);
    cuDeviceGetMemPool(pool: *mut *mut c_void, dev: CUdevice) = 11020 => pool::get_current(pool, dev);
    cuDeviceSetMemPool(dev: CUdevice, pool: *mut c_void) = 11020 => pool::set_current(dev, pool);
    cuMemPoolCreate(pool: *mut *mut c_void, props: *const pool::CUmemPoolProps) = 11020 => pool::create(pool, props);
    cuMemPoolDestroy(pool: *mut c_void) = 11020 => pool::destroy(pool);
    cuMemPoolSetAttribute(pool: *mut c_void, attr: i32, value: *mut c_void) = 11020 => pool::set_attribute(pool, attr, value);
    cuMemPoolGetAttribute(pool: *mut c_void, attr: i32, value: *mut c_void) = 11020 => pool::get_attribute(pool, attr, value);
    cuMemPoolTrimTo(pool: *mut c_void, _keep: usize) = 11020 => pool::trim_to(pool);
    cuMemFreeAsync(ptr: CUdeviceptr, stream: CUstream) = 11020, per_thread cuMemFreeAsync_ptsz => alloc::free_async(ptr, stream);

    // managed memory, pointers
    cuMemAllocManaged(dptr: *mut CUdeviceptr, size: usize, flags: u32) = 6000 => alloc::alloc_managed(dptr, size, flags);
    cuMemPrefetchAsync(ptr: CUdeviceptr, n: usize, device: CUdevice, s: CUstream) = 8000, per_thread cuMemPrefetchAsync_ptsz => alloc::prefetch(ptr, n, device, s);
    cuMemPrefetchAsync_v2(ptr: CUdeviceptr, n: usize, loc: CUmemLocation, _flags: u32, s: CUstream) = 12020, per_thread cuMemPrefetchAsync_v2_ptsz => alloc::prefetch(ptr, n, location_device(loc)?, s);
    cuPointerGetAttribute(data: *mut c_void, attribute: i32, ptr: CUdeviceptr) = 4000 => alloc::get_attribute(data, attribute, ptr);
    cuPointerGetAttributes(n: u32, attributes: *const i32, data: *mut *mut c_void, ptr: CUdeviceptr) = 7000 => alloc::get_attributes(n, attributes, data, ptr);
    cuIpcGetMemHandle(handle: *mut [u8; 64], ptr: CUdeviceptr) = 4010 => alloc::ipc_get_handle(handle, ptr);
    cuIpcOpenMemHandle(pdptr: *mut CUdeviceptr, _handle: CUipcMemHandle, flags: u32) = 4010 => alloc::ipc_open_handle(pdptr, flags);
    cuIpcOpenMemHandle_v2(pdptr: *mut CUdeviceptr, _handle: CUipcMemHandle, flags: u32) = 11000 => alloc::ipc_open_handle(pdptr, flags);
    cuIpcCloseMemHandle(_ptr: CUdeviceptr) = 4010 => alloc::ipc_close_handle();
    cuMemAdvise(ptr: CUdeviceptr, n: usize, advice: i32, device: CUdevice) = 8000 => alloc::advise(ptr, n, advice, device);
    cuMemAdvise_v2(ptr: CUdeviceptr, n: usize, advice: i32, loc: CUmemLocation) = 12020 => alloc::advise(ptr, n, advice, location_device(loc)?);

    // pinned host memory
    cuMemAllocHost_v2(pp: *mut *mut c_void, size: usize) = 3020 => pinned::alloc(pp, size, 0);
    cuMemHostAlloc(pp: *mut *mut c_void, size: usize, flags: u32) = 2020 => pinned::alloc(pp, size, flags);
    cuMemFreeHost(p: *mut c_void) = 2000 => pinned::free(p);
    cuMemHostRegister_v2(p: *mut c_void, size: usize, flags: u32) = 6050 => pinned::register(p, size, flags);
    cuMemHostUnregister(p: *mut c_void) = 4000 => pinned::unregister(p);
    cuMemHostGetDevicePointer_v2(pdptr: *mut CUdeviceptr, p: *mut c_void, flags: u32) = 3020 => pinned::device_pointer(pdptr, p, flags);

    // copies and memsets: synchronous ones on the NULL stream (`Issue::Sync`)
    cuMemcpy(dst: CUdeviceptr, src: CUdeviceptr, n: usize) = 4000, per_thread cuMemcpy_ptds => copy::memcpy(dst, src, n, Issue::Sync);
    cuMemcpyAsync(dst: CUdeviceptr, src: CUdeviceptr, n: usize, s: CUstream) = 4000, per_thread cuMemcpyAsync_ptsz => copy::memcpy(dst, src, n, Issue::Async(s));
    cuMemcpyHtoD_v2(dst: CUdeviceptr, src: *const c_void, n: usize) = 3020, per_thread cuMemcpyHtoD_v2_ptds => copy::host_copy(HostToDevice, dst, src as usize, n, Issue::Sync);
    cuMemcpyDtoH_v2(dst: *mut c_void, src: CUdeviceptr, n: usize) = 3020, per_thread cuMemcpyDtoH_v2_ptds => copy::host_copy(DeviceToHost, src, dst as usize, n, Issue::Sync);
    cuMemcpyDtoD_v2(dst: CUdeviceptr, src: CUdeviceptr, n: usize) = 3020, per_thread cuMemcpyDtoD_v2_ptds => copy::dtod(dst, src, n, Issue::Sync);
    cuMemcpyHtoDAsync_v2(dst: CUdeviceptr, src: *const c_void, n: usize, s: CUstream) = 3020, per_thread cuMemcpyHtoDAsync_v2_ptsz => copy::host_copy(HostToDevice, dst, src as usize, n, Issue::Async(s));
    cuMemcpyDtoHAsync_v2(dst: *mut c_void, src: CUdeviceptr, n: usize, s: CUstream) = 3020, per_thread cuMemcpyDtoHAsync_v2_ptsz => copy::host_copy(DeviceToHost, src, dst as usize, n, Issue::Async(s));
    cuMemcpyDtoDAsync_v2(dst: CUdeviceptr, src: CUdeviceptr, n: usize, s: CUstream) = 3020, per_thread cuMemcpyDtoDAsync_v2_ptsz => copy::dtod(dst, src, n, Issue::Async(s));
    cuMemsetD8_v2(dst: CUdeviceptr, v: u8, n: usize) = 3020, per_thread cuMemsetD8_v2_ptds => copy::memset(dst, v.into(), 1, n, Issue::Sync);
    cuMemsetD16_v2(dst: CUdeviceptr, v: u16, n: usize) = 3020, per_thread cuMemsetD16_v2_ptds => copy::memset(dst, v.into(), 2, n, Issue::Sync);
    cuMemsetD32_v2(dst: CUdeviceptr, v: u32, n: usize) = 3020, per_thread cuMemsetD32_v2_ptds => copy::memset(dst, v, 4, n, Issue::Sync);
    cuMemsetD8Async(dst: CUdeviceptr, v: u8, n: usize, s: CUstream) = 3020, per_thread cuMemsetD8Async_ptsz => copy::memset(dst, v.into(), 1, n, Issue::Async(s));
    cuMemsetD16Async(dst: CUdeviceptr, v: u16, n: usize, s: CUstream) = 3020, per_thread cuMemsetD16Async_ptsz => copy::memset(dst, v.into(), 2, n, Issue::Async(s));
    cuMemsetD32Async(dst: CUdeviceptr, v: u32, n: usize, s: CUstream) = 3020, per_thread cuMemsetD32Async_ptsz => copy::memset(dst, v, 4, n, Issue::Async(s));

    // 2D copies and memsets
    cuMemcpy2D_v2(p: *const CudaMemcpy2D) = 3020, per_thread cuMemcpy2D_v2_ptds => copy::copy_2d(p, Issue::Sync);
    cuMemcpy2DUnaligned_v2(p: *const CudaMemcpy2D) = 3020, per_thread cuMemcpy2DUnaligned_v2_ptds => copy::copy_2d(p, Issue::Sync);
    cuMemcpy2DAsync_v2(p: *const CudaMemcpy2D, s: CUstream) = 3020, per_thread cuMemcpy2DAsync_v2_ptsz => copy::copy_2d(p, Issue::Async(s));
    cuMemsetD2D8_v2(dst: CUdeviceptr, pitch: usize, v: u8, w: usize, h: usize) = 3020, per_thread cuMemsetD2D8_v2_ptds => copy::memset_2d(dst, pitch, v.into(), 1, w, h, Issue::Sync);
    cuMemsetD2D16_v2(dst: CUdeviceptr, pitch: usize, v: u16, w: usize, h: usize) = 3020, per_thread cuMemsetD2D16_v2_ptds => copy::memset_2d(dst, pitch, v.into(), 2, w, h, Issue::Sync);
    cuMemsetD2D32_v2(dst: CUdeviceptr, pitch: usize, v: u32, w: usize, h: usize) = 3020, per_thread cuMemsetD2D32_v2_ptds => copy::memset_2d(dst, pitch, v, 4, w, h, Issue::Sync);
    cuMemsetD2D8Async(dst: CUdeviceptr, pitch: usize, v: u8, w: usize, h: usize, s: CUstream) = 3020, per_thread cuMemsetD2D8Async_ptsz => copy::memset_2d(dst, pitch, v.into(), 1, w, h, Issue::Async(s));
    cuMemsetD2D16Async(dst: CUdeviceptr, pitch: usize, v: u16, w: usize, h: usize, s: CUstream) = 3020, per_thread cuMemsetD2D16Async_ptsz => copy::memset_2d(dst, pitch, v.into(), 2, w, h, Issue::Async(s));
    cuMemsetD2D32Async(dst: CUdeviceptr, pitch: usize, v: u32, w: usize, h: usize, s: CUstream) = 3020, per_thread cuMemsetD2D32Async_ptsz => copy::memset_2d(dst, pitch, v, 4, w, h, Issue::Async(s));

    // VMM
    cuMemGetAllocationGranularity(g: *mut usize, prop: *const CUmemAllocationProp, option: i32) = 10020 => vmm::granularity(g, prop, option);
    cuMemAddressReserve(ptr: *mut CUdeviceptr, size: usize, align: usize, addr: CUdeviceptr, flags: u64) = 10020 => vmm::reserve(ptr, size, align, addr, flags);
    cuMemAddressFree(ptr: CUdeviceptr, size: usize) = 10020 => vmm::unreserve(ptr, size);
    cuMemCreate(handle: *mut CUmemGenericAllocationHandle, size: usize, prop: *const CUmemAllocationProp, flags: u64) = 10020 => vmm::create(handle, size, prop, flags);
    cuMemRelease(handle: CUmemGenericAllocationHandle) = 10020 => vmm::release(handle);
    cuMemMap(ptr: CUdeviceptr, size: usize, offset: usize, handle: CUmemGenericAllocationHandle, flags: u64) = 10020 => vmm::map(ptr, size, offset, handle, flags);
    cuMemUnmap(ptr: CUdeviceptr, size: usize) = 10020 => vmm::unmap(ptr, size);
    cuMemSetAccess(ptr: CUdeviceptr, size: usize, desc: *const CUmemAccessDesc, count: usize) = 10020 => vmm::set_access(ptr, size, desc, count);
    cuMemExportToShareableHandle(shareable: *mut c_void, handle: CUmemGenericAllocationHandle, handle_type: i32, flags: u64) = 10020 => vmm::export(shareable, handle, handle_type, flags);
    cuMemImportFromShareableHandle(handle: *mut CUmemGenericAllocationHandle, os_handle: *mut c_void, handle_type: i32) = 10020 => vmm::import(handle, os_handle, handle_type);

    // streams and events
    cuStreamCreate(ph: *mut CUstream, flags: u32) = 2000 => stream::create(ph, flags, 0);
    cuStreamCreateWithPriority(ph: *mut CUstream, flags: u32, priority: i32) = 5050 => stream::create(ph, flags, priority);
    cuStreamDestroy_v2(s: CUstream) = 4000 => stream::destroy(s);
    cuStreamSynchronize(s: CUstream) = 2000, per_thread cuStreamSynchronize_ptsz => stream::synchronize(s);
    cuStreamQuery(s: CUstream) = 2000, per_thread cuStreamQuery_ptsz => stream::query(s);
    cuStreamWaitEvent(s: CUstream, e: CUevent, _flags: u32) = 3020, per_thread cuStreamWaitEvent_ptsz => stream::wait_event(s, e);
    cuStreamAddCallback(s: CUstream, cb: CUstreamCallback, data: *mut c_void, flags: u32) = 5000, per_thread cuStreamAddCallback_ptsz => stream::add_callback(s, cb, data, flags);
    cuStreamGetFlags(s: CUstream, flags: *mut u32) = 5050 => stream::flags(s, flags);
    cuStreamGetPriority(s: CUstream, prio: *mut i32) = 5050 => stream::priority(s, prio);
    cuStreamGetCtx(s: CUstream, pctx: *mut CUcontext) = 9020 => stream::context(s, pctx);

    // stream memory operations: v1 (CUDA 8.0/9.0) and v2 (CUDA 11.7); 64-bit words
    // are `wide`
    cuStreamWaitValue32(s: CUstream, addr: CUdeviceptr, value: u32, flags: u32) = 8000, per_thread cuStreamWaitValue32_ptsz => stream::value_op(Wait, s, addr, value.into(), flags, false, V1);
    cuStreamWaitValue64(s: CUstream, addr: CUdeviceptr, value: u64, flags: u32) = 9000, per_thread cuStreamWaitValue64_ptsz => stream::value_op(Wait, s, addr, value, flags, true, V1);
    cuStreamWriteValue32(s: CUstream, addr: CUdeviceptr, value: u32, flags: u32) = 8000, per_thread cuStreamWriteValue32_ptsz => stream::value_op(Write, s, addr, value.into(), flags, false, V1);
    cuStreamWriteValue64(s: CUstream, addr: CUdeviceptr, value: u64, flags: u32) = 9000, per_thread cuStreamWriteValue64_ptsz => stream::value_op(Write, s, addr, value, flags, true, V1);
    cuStreamBatchMemOp(s: CUstream, count: u32, params: *mut CUstreamBatchMemOpParams, flags: u32) = 8000, per_thread cuStreamBatchMemOp_ptsz => stream::batch_mem_op(s, count, params, flags, V1);
    cuStreamWaitValue32_v2(s: CUstream, addr: CUdeviceptr, value: u32, flags: u32) = 11070, per_thread cuStreamWaitValue32_v2_ptsz => stream::value_op(Wait, s, addr, value.into(), flags, false, V2);
    cuStreamWaitValue64_v2(s: CUstream, addr: CUdeviceptr, value: u64, flags: u32) = 11070, per_thread cuStreamWaitValue64_v2_ptsz => stream::value_op(Wait, s, addr, value, flags, true, V2);
    cuStreamWriteValue32_v2(s: CUstream, addr: CUdeviceptr, value: u32, flags: u32) = 11070, per_thread cuStreamWriteValue32_v2_ptsz => stream::value_op(Write, s, addr, value.into(), flags, false, V2);
    cuStreamWriteValue64_v2(s: CUstream, addr: CUdeviceptr, value: u64, flags: u32) = 11070, per_thread cuStreamWriteValue64_v2_ptsz => stream::value_op(Write, s, addr, value, flags, true, V2);
    cuStreamBatchMemOp_v2(s: CUstream, count: u32, params: *mut CUstreamBatchMemOpParams, flags: u32) = 11070, per_thread cuStreamBatchMemOp_v2_ptsz => stream::batch_mem_op(s, count, params, flags, V2);

    cuEventCreate(ph: *mut CUevent, flags: u32) = 2000 => stream::event_create(ph, flags);
    cuEventDestroy_v2(e: CUevent) = 4000 => stream::event_destroy(e);
    cuEventRecord(e: CUevent, s: CUstream) = 2000, per_thread cuEventRecord_ptsz => stream::event_record(e, s);
    cuEventRecordWithFlags(e: CUevent, s: CUstream, _flags: u32) = 11010, per_thread cuEventRecordWithFlags_ptsz => stream::event_record(e, s);
    cuEventQuery(e: CUevent) = 2000 => stream::event_query(e);
    cuEventSynchronize(e: CUevent) = 2000 => stream::event_synchronize(e);
    cuEventElapsedTime(ms: *mut f32, start: CUevent, end: CUevent) = 2000 => stream::elapsed_time(ms, start, end);
    cuEventElapsedTime_v2(ms: *mut f32, start: CUevent, end: CUevent) = 12080 => stream::elapsed_time(ms, start, end);

    // graphs (stream capture)
    cuStreamBeginCapture_v2(s: CUstream, mode: u32) = 10010, per_thread cuStreamBeginCapture_v2_ptsz => graph::begin_capture(s, mode);
    cuStreamEndCapture(s: CUstream, graph: *mut *mut c_void) = 10000, per_thread cuStreamEndCapture_ptsz => graph::end_capture(s, graph);
    cuStreamIsCapturing(s: CUstream, status: *mut i32) = 10000, per_thread cuStreamIsCapturing_ptsz => graph::is_capturing(s, status);
    cuStreamGetCaptureInfo(s: CUstream, status: *mut i32, id: *mut u64) = 10010, per_thread cuStreamGetCaptureInfo_ptsz => graph::capture_info(s, status, id, null_mut(), null_mut(), null_mut(), null_mut());
    cuStreamGetCaptureInfo_v2(s: CUstream, status: *mut i32, id: *mut u64, graph: *mut *mut c_void, deps: *mut *const c_void, count: *mut usize) = 11030, per_thread cuStreamGetCaptureInfo_v2_ptsz => graph::capture_info(s, status, id, graph, deps, null_mut(), count);
    cuStreamGetCaptureInfo_v3(s: CUstream, status: *mut i32, id: *mut u64, graph: *mut *mut c_void, deps: *mut *const c_void, edges: *mut *const c_void, count: *mut usize) = 12030, per_thread cuStreamGetCaptureInfo_v3_ptsz => graph::capture_info(s, status, id, graph, deps, edges, count);
    cuThreadExchangeStreamCaptureMode(mode: *mut u32) = 10010 => graph::exchange_mode(mode);
    cuGraphInstantiateWithFlags(exec: *mut *mut c_void, graph: *mut c_void, _flags: u64) = 11040 => graph::instantiate(exec, graph);
    cuGraphLaunch(exec: *mut c_void, s: CUstream) = 10000, per_thread cuGraphLaunch_ptsz => graph::launch(exec, s);
    cuGraphUpload(exec: *mut c_void, s: CUstream) = 11010, per_thread cuGraphUpload_ptsz => graph::upload(exec, s);
    cuGraphExecDestroy(exec: *mut c_void) = 10000 => graph::exec_destroy(exec);
    cuGraphDestroy(graph: *mut c_void) = 10000 => graph::destroy(graph);

    // modules and launches
    cuModuleLoadData(m: *mut CUmodule, image: *const c_void) = 2000 => launch::module_load(m, image, true);
    cuModuleLoadDataEx(m: *mut CUmodule, image: *const c_void, _n: u32, _o: *mut i32, _v: *mut *mut c_void) = 2010 => launch::module_load(m, image, true);
    cuModuleLoad(m: *mut CUmodule, fname: *const c_char) = 2000 => launch::module_load_file(m, fname);
    cuModuleUnload(m: CUmodule) = 2000 => launch::module_unload(m);
    cuModuleGetFunction(f: *mut CUfunction, m: CUmodule, name: *const c_char) = 2000 => launch::module_function(f, m, name);
    cuFuncGetAttribute(pi: *mut i32, attrib: i32, f: CUfunction) = 2020 => launch::func_attribute(pi, attrib, f);
    cuFuncSetAttribute(f: CUfunction, attrib: i32, value: i32) = 9000 => launch::func_set_attribute(f, attrib, value);
    cuModuleGetLoadingMode(mode: *mut u32) = 11070 => launch::loading_mode(mode);
    cuLaunchKernel(f: CUfunction, gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32, _shmem: u32, s: CUstream, params: *mut *mut c_void, extra: *mut *mut c_void) = 4000, per_thread cuLaunchKernel_ptsz => launch::launch(f, [gx, gy, gz], [bx, by, bz], s, params, extra);
    cuLaunchCooperativeKernel(f: CUfunction, gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32, _shmem: u32, s: CUstream, params: *mut *mut c_void) = 9000, per_thread cuLaunchCooperativeKernel_ptsz => launch::launch(f, [gx, gy, gz], [bx, by, bz], s, params, null_mut());
    cuLaunchKernelEx(cfg: *const CUlaunchConfig, f: CUfunction, params: *mut *mut c_void, extra: *mut *mut c_void) = 11060, per_thread cuLaunchKernelEx_ptsz => launch::launch_ex(cfg, f, params, extra);
    cuLaunchHostFunc(s: CUstream, f: CUhostFn, data: *mut c_void) = 10000, per_thread cuLaunchHostFunc_ptsz => launch::host_func(s, f, data);

    // context-independent loading
    cuLibraryLoadData(lib: *mut CUlibrary, code: *const c_void, _jit_options: *mut i32, _jit_values: *mut *mut c_void, _n_jit: u32, _lib_options: *mut i32, _lib_values: *mut *mut c_void, _n_lib: u32) = 12000 => library::load(lib, code);
    cuLibraryLoadFromFile(lib: *mut CUlibrary, file: *const c_char, _jit_options: *mut i32, _jit_values: *mut *mut c_void, _n_jit: u32, _lib_options: *mut i32, _lib_values: *mut *mut c_void, _n_lib: u32) = 12000 => library::load_from_file(lib, file);
    cuLibraryUnload(lib: CUlibrary) = 12000 => library::unload(lib);
    cuLibraryGetKernel(k: *mut CUkernel, lib: CUlibrary, name: *const c_char) = 12000 => library::get_kernel(k, lib, name);
    cuLibraryGetKernelCount(count: *mut u32, lib: CUlibrary) = 12040 => library::kernel_count(count, lib);
    cuLibraryEnumerateKernels(kernels: *mut CUkernel, n: u32, lib: CUlibrary) = 12040 => library::enumerate_kernels(kernels, n, lib);
    cuLibraryGetModule(m: *mut CUmodule, lib: CUlibrary) = 12000 => library::get_module(m, lib);
    cuLibraryGetGlobal(_ptr: *mut CUdeviceptr, _size: *mut usize, lib: CUlibrary, _name: *const c_char) = 12000 => library::no_variable(lib);
    cuLibraryGetManaged(_ptr: *mut CUdeviceptr, _size: *mut usize, lib: CUlibrary, _name: *const c_char) = 12000 => library::no_variable(lib);
    cuKernelGetFunction(f: *mut CUfunction, k: CUkernel) = 12000 => library::kernel_function(f, k);
    cuKernelGetName(name: *mut *const c_char, k: CUkernel) = 12030 => library::kernel_name(name, k);
    cuKernelGetAttribute(pi: *mut i32, attrib: i32, k: CUkernel, dev: CUdevice) = 12000 => launch::func_attribute(pi, attrib, launch::function_of_kernel(k, dev)?);
    cuKernelSetAttribute(attrib: i32, value: i32, k: CUkernel, dev: CUdevice) = 12000 => launch::func_set_attribute(launch::function_of_kernel(k, dev)?, attrib, value);
    cuKernelSetCacheConfig(k: CUkernel, config: i32, dev: CUdevice) = 12000 => library::kernel_set_cache_config(k, config, dev);

    // entry points
    cuGetExportTable(table: *mut *const c_void, id: *const CUuuid) = 3000 => dark_api::export_table(table, id);
    cuGetProcAddress(symbol: *const c_char, pfn: *mut *mut c_void, version: i32, flags: u64) = 11030 => procaddr::get_proc_address(symbol, pfn, version, flags, null_mut());
    cuGetProcAddress_v2(symbol: *const c_char, pfn: *mut *mut c_void, version: i32, flags: u64, status: *mut i32) = 12000 => procaddr::get_proc_address(symbol, pfn, version, flags, status);

    // Past no gate: the error strings, and the checkpoint calls (made by another
    // process, about this one's gate).
    @ungated
    cuGetErrorName(e: CUresult, s: *mut *const c_char) = 6000 => device::error_text(e, s, ErrorText::Name);
    cuGetErrorString(e: CUresult, s: *mut *const c_char) = 6000 => device::error_text(e, s, ErrorText::Description);
    cuCheckpointProcessGetRestoreThreadId(pid: i32, tid: *mut i32) = 12080 => checkpoint::restore_thread_id(pid, tid);
    cuCheckpointProcessGetState(pid: i32, state: *mut u32) = 12080 => checkpoint::get_state(pid, state);
    cuCheckpointProcessLock(pid: i32, args: *const u64) = 12080 => checkpoint::lock_process(pid, args);
    cuCheckpointProcessCheckpoint(pid: i32, args: *const u64) = 12080 => checkpoint::request(pid, args, checkpoint::OP_CHECKPOINT);
    cuCheckpointProcessRestore(pid: i32, args: *const u64) = 12080 => checkpoint::request(pid, args, checkpoint::OP_RESTORE);
    cuCheckpointProcessUnlock(pid: i32, args: *const u64) = 12080 => checkpoint::request(pid, args, checkpoint::OP_UNLOCK);
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
