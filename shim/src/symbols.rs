//! The declaration list of every driver entry point the shim knows: its C signature,
//! its gate class and, for `pass` and `driver` entries, why it needs no gate.
//!
//! - `pass`: forwarded unchanged (exported so lookups resolve consistently, and so the
//!   shim has the original at hand).
//! - `submit`: work submission; waits for this process's turn and for its memory to be
//!   resident ([`crate::submit`]).
//! - `hook`: a function of the hooked behaviour (`hooks`, `attrs`, `capture`, `ipc`,
//!   and the lookups in `exports`) decides (allocation, info, lookup).
//! - `driver`: not exported: the application reaches the driver's own function. Listed
//!   so that every `cuda.h` function taking device memory, an array, a stream, an
//!   executable graph or a VMM handle is classified here (`exports_coverage.rs` checks
//!   it against the real `cuda.h`).
//!
//! Every `pass` and `driver` entry says why in its doc comment (kept as
//! [`SymInfo::reason`]): nothing passes the gate without a written reason.
//!
//! The list is written once, in `for_each_export!`, and expanded twice: here into the
//! table ([`Sym`], [`SYMBOLS`]) that the real driver ([`crate::real`]) resolves, and in
//! [`crate::exports`] into the `extern "C"` wrappers. Hook paths in the list are
//! resolved where it is expanded into wrappers; here they are only parsed.

/// How an export treats its call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Class {
    Pass,
    Submit,
    Hook,
    /// Not exported: the driver's own function answers.
    Driver,
}

/// One entry of the list: its NUL-terminated name, gate class and reason.
#[derive(Debug)]
pub struct SymInfo {
    name: &'static str,
    pub class: Class,
    /// Why a `pass` or `driver` entry needs no gate (its doc comment).
    pub reason: &'static str,
    /// The declared parameter types (`stringify!`ed), checked against `cuda.h`.
    pub params: &'static [&'static str],
}

impl SymInfo {
    /// The name without the trailing NUL.
    pub fn name(&self) -> &'static str {
        &self.name[..self.name.len() - 1]
    }

    pub fn cname(&self) -> &'static std::ffi::CStr {
        std::ffi::CStr::from_bytes_with_nul(self.name.as_bytes()).expect("names end in NUL")
    }

    /// Whether `libkiwi.so` exports a wrapper of this name.
    pub fn exported(&self) -> bool {
        self.class != Class::Driver
    }
}

/// Calls `$m! { … }` with the declaration list: `class name(params) [=> hook];`,
/// each entry with its doc comment.
macro_rules! for_each_export {
    ($m:ident) => {
        $m! {
            // --- initialisation and lookup
            hook cuInit(flags: Uint) => hooks::init;
            hook cuGetProcAddress(symbol: *const c_char, pfn: *mut *mut c_void, cuda_version: c_int, flags: u64) => proc_address::get_proc_address;
            hook cuGetExportTable(table: *mut *const c_void, id: *const CUuuid) => room::get_export_table;
            hook cuGetProcAddress_v2(symbol: *const c_char, pfn: *mut *mut c_void, cuda_version: c_int, flags: u64, status: *mut c_int) => proc_address::get_proc_address_v2;

            // --- contexts: a context on a device gives the process a turn on that GPU
            hook cuDevicePrimaryCtxRetain(pctx: *mut CUcontext, dev: CUdevice) => hooks::primary_ctx_retain;
            hook cuCtxCreate_v2(pctx: *mut CUcontext, flags: Uint, dev: CUdevice) => hooks::ctx_create_v2;
            hook cuCtxCreate_v3(pctx: *mut CUcontext, params: Opaque, num_params: c_int, flags: Uint, dev: CUdevice) => hooks::ctx_create_v3;
            hook cuCtxCreate_v4(pctx: *mut CUcontext, params: Opaque, flags: Uint, dev: CUdevice) => hooks::ctx_create_v4;
            /// Its modules and limits leave the GPU with it: their counts are given back; runs no work.
            hook cuCtxDestroy_v2(ctx: CUcontext) => modules::ctx_destroy;
            /// The primary context's modules and limits leave the GPU with it: their counts are given back; runs no work.
            hook cuDevicePrimaryCtxReset_v2(dev: CUdevice) => modules::primary_ctx_reset;
            hook cuDevicePrimaryCtxRelease_v2(dev: CUdevice) => modules::primary_ctx_release;

            // --- allocation: VMM-backed, swappable, never waits for the GPU
            hook cuMemAlloc_v2(dptr: *mut CUdeviceptr, size: usize) => hooks::mem_alloc;
            hook cuMemAllocPitch_v2(dptr: *mut CUdeviceptr, pitch: *mut usize, width: usize, height: usize, elem: Uint) => hooks::mem_alloc_pitch;
            hook cuMemFree_v2(dptr: CUdeviceptr) => hooks::mem_free;
            /// Managed memory: the driver's, counted in the working set and moved to the
            /// host at each swap-out (`managed.rs`).
            hook cuMemAllocManaged(dptr: *mut CUdeviceptr, size: usize, flags: Uint) => hooks::mem_alloc_managed;
            hook cuMemAllocAsync(dptr: *mut CUdeviceptr, size: usize, stream: CUstream) => hooks::mem_alloc_async;
            hook cuMemAllocAsync_ptsz(dptr: *mut CUdeviceptr, size: usize, stream: CUstream) => hooks::mem_alloc_async;
            hook cuMemAllocFromPoolAsync(dptr: *mut CUdeviceptr, size: usize, pool: CUmemoryPool, stream: CUstream) => hooks::mem_alloc_from_pool;
            hook cuMemAllocFromPoolAsync_ptsz(dptr: *mut CUdeviceptr, size: usize, pool: CUmemoryPool, stream: CUstream) => hooks::mem_alloc_from_pool;
            /// A pool's statistics: the memory the shim serves for it added.
            hook cuMemPoolGetAttribute(pool: CUmemoryPool, attr: c_int, value: *mut c_void) => pools::get_attribute;
            /// Resetting a pool's high-water mark resets the shim's too.
            hook cuMemPoolSetAttribute(pool: CUmemoryPool, attr: c_int, value: *mut c_void) => pools::set_attribute;
            hook cuMemFreeAsync(dptr: CUdeviceptr, stream: CUstream) => hooks::mem_free_async;
            hook cuMemFreeAsync_ptsz(dptr: CUdeviceptr, stream: CUstream) => hooks::mem_free_async_ptsz;
            hook cuMemGetInfo_v2(free: *mut usize, total: *mut usize) => hooks::mem_get_info;
            hook cuMemGetAddressRange_v2(pbase: *mut CUdeviceptr, psize: *mut usize, dptr: CUdeviceptr) => hooks::mem_get_address_range;
            // The application's own VMM: handles the shim owns; a handle mapped whole, once, swaps (`appvmm.rs`).
            hook cuMemCreate(handle: *mut CUmemGenericAllocationHandle, size: usize, prop: *const CUmemAllocationProp, flags: u64) => appvmm::create;
            hook cuMemRelease(handle: CUmemGenericAllocationHandle) => appvmm::release;
            hook cuMemMap(ptr: CUdeviceptr, size: usize, offset: usize, handle: CUmemGenericAllocationHandle, flags: u64) => appvmm::map;
            hook cuMemUnmap(ptr: CUdeviceptr, size: usize) => appvmm::unmap;
            hook cuMemRetainAllocationHandle(handle: *mut CUmemGenericAllocationHandle, addr: *mut c_void) => appvmm::retain;
            hook cuMemGetAllocationPropertiesFromHandle(prop: *mut CUmemAllocationProp, handle: CUmemGenericAllocationHandle) => appvmm::properties;
            /// Another process may map the memory: it stays resident for good (`appvmm.rs`); runs no work.
            hook cuMemExportToShareableHandle(shareable: *mut c_void, handle: CUmemGenericAllocationHandle, handle_type: c_int, flags: u64) => appvmm::export;
            /// A dma-buf of a range: over a swapping mapping, resident for good first (`appvmm.rs`); runs no work.
            hook cuMemGetHandleForAddressRange(out: *mut c_void, ptr: CUdeviceptr, size: usize, handle_type: c_int, flags: u64) => appvmm::handle_for_address_range;
            /// A multicast object maps the memory: resident for good (`appvmm.rs`); runs no work.
            hook cuMulticastBindMem(mc: CUmemGenericAllocationHandle, mc_offset: usize, handle: CUmemGenericAllocationHandle, offset: usize, size: usize, flags: u64) => appvmm::multicast_bind_mem;

            // --- a context's limits: the memory they take is counted as memory no swap frees
            hook cuCtxSetLimit(limit: c_int, value: usize) => modules::ctx_set_limit;

            // --- modules: their device memory is counted as memory no swap frees
            hook cuModuleLoad(module: *mut *mut c_void, fname: *const c_char) => modules::module_load;
            hook cuModuleLoadData(module: *mut *mut c_void, image: *const c_void) => modules::module_load_data;
            hook cuModuleLoadDataEx(module: *mut *mut c_void, image: *const c_void, n: Uint, options: *mut c_int, values: *mut *mut c_void) => modules::module_load_data_ex;
            hook cuModuleLoadFatBinary(module: *mut *mut c_void, image: *const c_void) => modules::module_load_data;
            hook cuModuleUnload(module: *mut c_void) => modules::module_unload;
            /// With lazy loading, a module's code is loaded (takes device memory) at its first function; runs no work.
            hook cuModuleGetFunction(func: *mut *mut c_void, module: *mut c_void, name: *const c_char) => modules::module_get_function;
            hook cuLibraryLoadData(library: *mut *mut c_void, code: *const c_void, jit_options: *mut c_int, jit_values: *mut *mut c_void, n_jit: Uint, lib_options: *mut c_int, lib_values: *mut *mut c_void, n_lib: Uint) => modules::library_load;
            hook cuLibraryLoadFromFile(library: *mut *mut c_void, file: *const c_void, jit_options: *mut c_int, jit_values: *mut *mut c_void, n_jit: Uint, lib_options: *mut c_int, lib_values: *mut *mut c_void, n_lib: Uint) => modules::library_load;
            /// The library's modules and its kernels' code leave every context with it: their counts are given back; runs no work.
            hook cuLibraryUnload(library: *mut c_void) => modules::library_unload;
            /// The library's module in the current context: its code is loaded there (eagerly, or at the module's first function); runs no work.
            hook cuLibraryGetModule(module: *mut *mut c_void, library: *mut c_void) => modules::library_get_module;
            /// Remembers the kernel's library, so its code's count goes with it; runs no work.
            hook cuLibraryGetKernel(kernel: *mut *mut c_void, library: *mut c_void, name: *const c_char) => modules::library_get_kernel;
            /// With lazy loading, the kernel's code is loaded into the current context now; runs no work.
            hook cuKernelGetFunction(func: *mut *mut c_void, kernel: *mut c_void) => modules::kernel_get_function;

            // --- originals the shim itself uses
            /// Waits for the context's queued work (the shim drains with it); runs no work of its own.
            pass cuCtxSynchronize();
            /// Waits for a stream's queued work (the shim's swap copies use it); runs no work of its own.
            pass cuStreamSynchronize(stream: CUstream);
            /// Waits for a stream's queued work (per-thread default stream); runs no work of its own.
            pass cuStreamSynchronize_ptsz(stream: CUstream);
            /// Sets the calling thread's capture mode (the shim's own threads go `RELAXED` around
            /// swap work, so they never invalidate a capture); runs no work.
            pass cuThreadExchangeStreamCaptureMode(mode: *mut Uint);
            /// Reads the calling thread's context; runs no work.
            pass cuCtxGetCurrent(pctx: *mut CUcontext);
            /// Sets the calling thread's context (the shim switches for swaps); runs no work.
            pass cuCtxSetCurrent(ctx: CUcontext);
            /// Reads the current context's device; runs no work.
            pass cuCtxGetDevice(dev: *mut CUdevice);
            /// Names a device; runs no work.
            pass cuDeviceGet(dev: *mut CUdevice, ordinal: c_int);
            /// Counts devices; runs no work.
            pass cuDeviceGetCount(count: *mut c_int);
            /// Reads a device's UUID (the arbiter's GPU key); runs no work.
            pass cuDeviceGetUuid(uuid: *mut CUuuid, dev: CUdevice);
            /// Reads a device's UUID (the arbiter's GPU key); runs no work.
            pass cuDeviceGetUuid_v2(uuid: *mut CUuuid, dev: CUdevice);
            /// Reads a device's memory size; runs no work.
            pass cuDeviceTotalMem_v2(bytes: *mut usize, dev: CUdevice);
            /// Reads a device attribute (the SMs and threads a stack limit is sized for); runs no work.
            pass cuDeviceGetAttribute(value: *mut c_int, attrib: c_int, dev: CUdevice);
            /// The application's own VMM (PyTorch expandable segments, NCCL): reserves addresses, runs no work.
            pass cuMemAddressReserve(ptr: *mut CUdeviceptr, size: usize, align: usize, addr: CUdeviceptr, flags: u64);
            /// The application's own VMM: frees an address range, runs no work.
            pass cuMemAddressFree(ptr: CUdeviceptr, size: usize);
            /// Access to a mapping: on a shim allocation recorded and re-applied after every swap-in (`attrs.rs`), on the application's own VMM passed through; runs no work.
            hook cuMemSetAccess(ptr: CUdeviceptr, size: usize, desc: *const CUmemAccessDesc, count: usize) => attrs::mem_set_access;
            /// Peer access: the shim's mappings on the peer's device grant the current device access, now and after every swap-in (`attrs.rs`); runs no work.
            hook cuCtxEnablePeerAccess(peer: CUcontext, flags: Uint) => attrs::ctx_enable_peer_access;
            /// Peer access: the grant is withdrawn from the shim's mappings (`attrs.rs`); runs no work.
            hook cuCtxDisablePeerAccess(peer: CUcontext) => attrs::ctx_disable_peer_access;
            /// Reads the VMM granularity; runs no work.
            pass cuMemGetAllocationGranularity(granularity: *mut usize, prop: *const CUmemAllocationProp, option: c_int);
            /// Pinned host memory: lives in host RAM, never swapped; runs no work.
            pass cuMemAllocHost_v2(pp: *mut *mut c_void, size: usize);
            /// Frees pinned host memory; runs no work.
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

            // --- launches of the legacy execution control API (block shape and parameters set
            // beforehand with cuFuncSetBlockShape / cuParamSet*), and multi-device launches
            submit cuLaunch(f: CUfunction);
            submit cuLaunchGrid(f: CUfunction, grid_width: c_int, grid_height: c_int);
            submit cuLaunchGridAsync(f: CUfunction, grid_width: c_int, grid_height: c_int, stream: CUstream);
            submit cuLaunchCooperativeKernelMultiDevice(list: Opaque, num_devices: Uint, flags: Uint);

            // --- host callbacks, external semaphores, graphics interop and sparse mappings:
            // stream operations the GPU executes in order with the application's work
            submit cuStreamAddCallback(stream: CUstream, callback: *mut c_void, data: *mut c_void, flags: Uint);
            submit cuStreamAddCallback_ptsz(stream: CUstream, callback: *mut c_void, data: *mut c_void, flags: Uint);
            submit cuSignalExternalSemaphoresAsync(sems: Opaque, params: Opaque, num: Uint, stream: CUstream);
            submit cuSignalExternalSemaphoresAsync_ptsz(sems: Opaque, params: Opaque, num: Uint, stream: CUstream);
            submit cuWaitExternalSemaphoresAsync(sems: Opaque, params: Opaque, num: Uint, stream: CUstream);
            submit cuWaitExternalSemaphoresAsync_ptsz(sems: Opaque, params: Opaque, num: Uint, stream: CUstream);
            submit cuGraphicsMapResources(count: Uint, resources: *mut *mut c_void, stream: CUstream);
            submit cuGraphicsMapResources_ptsz(count: Uint, resources: *mut *mut c_void, stream: CUstream);
            submit cuGraphicsUnmapResources(count: Uint, resources: *mut *mut c_void, stream: CUstream);
            submit cuGraphicsUnmapResources_ptsz(count: Uint, resources: *mut *mut c_void, stream: CUstream);
            submit cuMemMapArrayAsync(list: Opaque, count: Uint, stream: CUstream);
            submit cuMemMapArrayAsync_ptsz(list: Opaque, count: Uint, stream: CUstream);
            // With CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD it uploads the graph on a stream.
            submit cuGraphInstantiateWithParams(exec: *mut CUgraphExec, graph: *mut c_void, params: *mut c_void);
            submit cuGraphInstantiateWithParams_ptsz(exec: *mut CUgraphExec, graph: *mut c_void, params: *mut c_void);

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
            submit cuMemcpy3DPeer(p: Opaque);
            submit cuMemcpy3DPeer_ptds(p: Opaque);
            submit cuMemcpy3DPeerAsync(p: Opaque, stream: CUstream);
            submit cuMemcpy3DPeerAsync_ptsz(p: Opaque, stream: CUstream);
            submit cuMemcpyBatchAsync(dsts: *mut CUdeviceptr, srcs: *mut CUdeviceptr, sizes: *mut usize, count: usize, attrs: Opaque, attrs_idxs: *mut usize, num_attrs: usize, fail_idx: *mut usize, stream: CUstream);
            submit cuMemcpyBatchAsync_ptsz(dsts: *mut CUdeviceptr, srcs: *mut CUdeviceptr, sizes: *mut usize, count: usize, attrs: Opaque, attrs_idxs: *mut usize, num_attrs: usize, fail_idx: *mut usize, stream: CUstream);
            submit cuMemcpy3DBatchAsync(num_ops: usize, ops: Opaque, fail_idx: *mut usize, flags: u64, stream: CUstream);
            submit cuMemcpy3DBatchAsync_ptsz(num_ops: usize, ops: Opaque, fail_idx: *mut usize, flags: u64, stream: CUstream);
            submit cuMemBatchDecompressAsync(params: Opaque, count: usize, flags: Uint, error_index: *mut usize, stream: CUstream);
            submit cuMemBatchDecompressAsync_ptsz(params: Opaque, count: usize, flags: Uint, error_index: *mut usize, stream: CUstream);

            // --- array copies
            submit cuMemcpyHtoA_v2(dst: CUarray, dst_offset: usize, src: *const c_void, n: usize);
            submit cuMemcpyHtoA_v2_ptds(dst: CUarray, dst_offset: usize, src: *const c_void, n: usize);
            submit cuMemcpyAtoH_v2(dst: *mut c_void, src: CUarray, src_offset: usize, n: usize);
            submit cuMemcpyAtoH_v2_ptds(dst: *mut c_void, src: CUarray, src_offset: usize, n: usize);
            submit cuMemcpyDtoA_v2(dst: CUarray, dst_offset: usize, src: CUdeviceptr, n: usize);
            submit cuMemcpyDtoA_v2_ptds(dst: CUarray, dst_offset: usize, src: CUdeviceptr, n: usize);
            submit cuMemcpyAtoD_v2(dst: CUdeviceptr, src: CUarray, src_offset: usize, n: usize);
            submit cuMemcpyAtoD_v2_ptds(dst: CUdeviceptr, src: CUarray, src_offset: usize, n: usize);
            submit cuMemcpyAtoA_v2(dst: CUarray, dst_offset: usize, src: CUarray, src_offset: usize, n: usize);
            submit cuMemcpyAtoA_v2_ptds(dst: CUarray, dst_offset: usize, src: CUarray, src_offset: usize, n: usize);
            submit cuMemcpyHtoAAsync_v2(dst: CUarray, dst_offset: usize, src: *const c_void, n: usize, stream: CUstream);
            submit cuMemcpyHtoAAsync_v2_ptsz(dst: CUarray, dst_offset: usize, src: *const c_void, n: usize, stream: CUstream);
            submit cuMemcpyAtoHAsync_v2(dst: *mut c_void, src: CUarray, src_offset: usize, n: usize, stream: CUstream);
            submit cuMemcpyAtoHAsync_v2_ptsz(dst: *mut c_void, src: CUarray, src_offset: usize, n: usize, stream: CUstream);

            // --- the legacy 32-bit entry points (CUDA < 3.2 ABI) the driver still exports
            submit cuMemcpyHtoD(dst: CUdeviceptr_v1, src: *const c_void, n: Uint);
            submit cuMemcpyDtoH(dst: *mut c_void, src: CUdeviceptr_v1, n: Uint);
            submit cuMemcpyDtoD(dst: CUdeviceptr_v1, src: CUdeviceptr_v1, n: Uint);
            submit cuMemcpyHtoDAsync(dst: CUdeviceptr_v1, src: *const c_void, n: Uint, stream: CUstream);
            submit cuMemcpyDtoHAsync(dst: *mut c_void, src: CUdeviceptr_v1, n: Uint, stream: CUstream);
            submit cuMemcpyDtoDAsync(dst: CUdeviceptr_v1, src: CUdeviceptr_v1, n: Uint, stream: CUstream);
            submit cuMemcpyHtoA(dst: CUarray, dst_offset: Uint, src: *const c_void, n: Uint);
            submit cuMemcpyAtoH(dst: *mut c_void, src: CUarray, src_offset: Uint, n: Uint);
            submit cuMemcpyDtoA(dst: CUarray, dst_offset: Uint, src: CUdeviceptr_v1, n: Uint);
            submit cuMemcpyAtoD(dst: CUdeviceptr_v1, src: CUarray, src_offset: Uint, n: Uint);
            submit cuMemcpyAtoA(dst: CUarray, dst_offset: Uint, src: CUarray, src_offset: Uint, n: Uint);
            submit cuMemcpyHtoAAsync(dst: CUarray, dst_offset: Uint, src: *const c_void, n: Uint, stream: CUstream);
            submit cuMemcpyAtoHAsync(dst: *mut c_void, src: CUarray, src_offset: Uint, n: Uint, stream: CUstream);
            submit cuMemcpy2D(p: Opaque);
            submit cuMemcpy2DUnaligned(p: Opaque);
            submit cuMemcpy2DAsync(p: Opaque, stream: CUstream);
            submit cuMemcpy3D(p: Opaque);
            submit cuMemcpy3DAsync(p: Opaque, stream: CUstream);
            submit cuMemsetD8(dst: CUdeviceptr_v1, v: u8, n: Uint);
            submit cuMemsetD16(dst: CUdeviceptr_v1, v: u16, n: Uint);
            submit cuMemsetD32(dst: CUdeviceptr_v1, v: Uint, n: Uint);
            submit cuMemsetD2D8(dst: CUdeviceptr_v1, pitch: Uint, v: u8, w: Uint, h: Uint);
            submit cuMemsetD2D16(dst: CUdeviceptr_v1, pitch: Uint, v: u16, w: Uint, h: Uint);
            submit cuMemsetD2D32(dst: CUdeviceptr_v1, pitch: Uint, v: Uint, w: Uint, h: Uint);

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

            // --- left to the driver (not exported): each runs no work the gate must hold back
            /// The device's current pool (what cuMemAllocAsync allocates from); runs no work.
            driver cuDeviceGetMemPool;
            /// Arrays: made and described by the driver in its own memory (not swappable, docs/shim.md); runs no work.
            driver cuArray3DCreate;
            /// Arrays: made and described by the driver in its own memory (not swappable, docs/shim.md); runs no work.
            driver cuArray3DCreate_v2;
            /// Arrays: made and described by the driver in its own memory (not swappable, docs/shim.md); runs no work.
            driver cuArray3DGetDescriptor;
            /// Arrays: made and described by the driver in its own memory (not swappable, docs/shim.md); runs no work.
            driver cuArray3DGetDescriptor_v2;
            /// Arrays: made and described by the driver in its own memory (not swappable, docs/shim.md); runs no work.
            driver cuArrayCreate;
            /// Arrays: made and described by the driver in its own memory (not swappable, docs/shim.md); runs no work.
            driver cuArrayCreate_v2;
            /// Arrays: made and described by the driver in its own memory (not swappable, docs/shim.md); runs no work.
            driver cuArrayDestroy;
            /// Arrays: made and described by the driver in its own memory (not swappable, docs/shim.md); runs no work.
            driver cuArrayGetDescriptor;
            /// Arrays: made and described by the driver in its own memory (not swappable, docs/shim.md); runs no work.
            driver cuArrayGetDescriptor_v2;
            /// Arrays: made and described by the driver in its own memory (not swappable, docs/shim.md); runs no work.
            driver cuArrayGetMemoryRequirements;
            /// Arrays: made and described by the driver in its own memory (not swappable, docs/shim.md); runs no work.
            driver cuArrayGetPlane;
            /// Arrays: made and described by the driver in its own memory (not swappable, docs/shim.md); runs no work.
            driver cuArrayGetSparseProperties;
            /// Marks a point in the stream; runs no work and touches no memory.
            driver cuEventRecord;
            /// Marks a point in the stream; runs no work and touches no memory.
            driver cuEventRecordWithFlags;
            /// Marks a point in the stream; runs no work and touches no memory.
            driver cuEventRecordWithFlags_ptsz;
            /// Marks a point in the stream; runs no work and touches no memory.
            driver cuEventRecord_ptsz;
            /// Maps imported external memory: the driver's, not swappable; runs no work.
            driver cuExternalMemoryGetMappedBuffer;
            /// Builds or reads a graph node; runs nothing until cuGraphLaunch (gated).
            driver cuGraphAddMemFreeNode;
            /// Edits an executable graph; runs nothing until cuGraphLaunch (gated).
            driver cuGraphExecBatchMemOpNodeSetParams;
            /// Edits an executable graph; runs nothing until cuGraphLaunch (gated).
            driver cuGraphExecChildGraphNodeSetParams;
            /// Destroys or reads an executable graph; runs no work.
            driver cuGraphExecDestroy;
            /// Edits an executable graph; runs nothing until cuGraphLaunch (gated).
            driver cuGraphExecEventRecordNodeSetEvent;
            /// Edits an executable graph; runs nothing until cuGraphLaunch (gated).
            driver cuGraphExecEventWaitNodeSetEvent;
            /// Edits an executable graph; runs nothing until cuGraphLaunch (gated).
            driver cuGraphExecExternalSemaphoresSignalNodeSetParams;
            /// Edits an executable graph; runs nothing until cuGraphLaunch (gated).
            driver cuGraphExecExternalSemaphoresWaitNodeSetParams;
            /// Destroys or reads an executable graph; runs no work.
            driver cuGraphExecGetFlags;
            /// Edits an executable graph; runs nothing until cuGraphLaunch (gated).
            driver cuGraphExecHostNodeSetParams;
            /// Edits an executable graph; runs nothing until cuGraphLaunch (gated).
            driver cuGraphExecKernelNodeSetParams;
            /// Edits an executable graph; runs nothing until cuGraphLaunch (gated).
            driver cuGraphExecKernelNodeSetParams_v2;
            /// Edits an executable graph; runs nothing until cuGraphLaunch (gated).
            driver cuGraphExecMemcpyNodeSetParams;
            /// Edits an executable graph; runs nothing until cuGraphLaunch (gated).
            driver cuGraphExecMemsetNodeSetParams;
            /// Edits an executable graph; runs nothing until cuGraphLaunch (gated).
            driver cuGraphExecNodeSetParams;
            /// Edits an executable graph; runs nothing until cuGraphLaunch (gated).
            driver cuGraphExecUpdate;
            /// Edits an executable graph; runs nothing until cuGraphLaunch (gated).
            driver cuGraphExecUpdate_v2;
            /// Builds an executable graph without uploading it (only the WithParams variant can upload: gated); runs no work.
            driver cuGraphInstantiate;
            /// Builds an executable graph without uploading it (only the WithParams variant can upload: gated); runs no work.
            driver cuGraphInstantiateWithFlags;
            /// Builds an executable graph without uploading it (only the WithParams variant can upload: gated); runs no work.
            driver cuGraphInstantiate_v2;
            /// Builds or reads a graph node; runs nothing until cuGraphLaunch (gated).
            driver cuGraphMemFreeNodeGetParams;
            /// Edits an executable graph; runs nothing until cuGraphLaunch (gated).
            driver cuGraphNodeGetEnabled;
            /// Edits an executable graph; runs nothing until cuGraphLaunch (gated).
            driver cuGraphNodeSetEnabled;
            /// Reads a mapped graphics resource; runs no work.
            driver cuGraphicsResourceGetMappedPointer_v2;
            /// Reads a mapped graphics resource; runs no work.
            driver cuGraphicsSubResourceGetMappedArray;
            /// Green contexts are not hooked (docs/shim.md, Limits); creates a stream, runs no work.
            driver cuGreenCtxStreamCreate;
            /// IPC of the shim's allocations ([`crate::ipc`]); other handles go to the driver.
            hook cuIpcCloseMemHandle(dptr: CUdeviceptr) => ipc::close_mem_handle;
            /// IPC of the shim's allocations ([`crate::ipc`]); other memory goes to the driver.
            hook cuIpcGetMemHandle(handle: *mut CUipcMemHandle, dptr: CUdeviceptr) => ipc::get_mem_handle;
            /// IPC of the shim's allocations ([`crate::ipc`]); other handles go to the driver.
            hook cuIpcOpenMemHandle(pdptr: *mut CUdeviceptr, handle: CUipcMemHandle, flags: Uint) => ipc::open_mem_handle;
            /// IPC of the shim's allocations ([`crate::ipc`]); other handles go to the driver.
            hook cuIpcOpenMemHandle_v2(pdptr: *mut CUdeviceptr, handle: CUipcMemHandle, flags: Uint) => ipc::open_mem_handle;
            /// A module's globals live in the context's module memory, never swapped; runs no work.
            driver cuLibraryGetGlobal;
            /// A module's globals live in the context's module memory, never swapped; runs no work.
            driver cuLibraryGetManaged;
            /// Managed memory (moved at swaps by Kiwi, `managed.rs`); a hint or a query, runs no work.
            driver cuMemAdvise;
            /// Managed memory (moved at swaps by Kiwi, `managed.rs`); a hint or a query, runs no work.
            driver cuMemAdvise_v2;
            /// The application's own VMM handles and mappings, passed through and not swapped; runs no work.
            driver cuMemGetAccess;
            /// Mapped host memory: lives in host RAM, never swapped; runs no work.
            driver cuMemHostGetDevicePointer_v2;
            /// The application's own VMM handles and mappings, passed through and not swapped; runs no work.
            driver cuMemImportFromShareableHandle;
            /// Sharing a pool allocation between processes: left to the driver (#13 items 6, 7); runs no work.
            driver cuMemPoolExportPointer;
            /// Sharing a pool allocation between processes: left to the driver (#13 items 6, 7); runs no work.
            driver cuMemPoolImportPointer;
            /// Managed memory (moved at swaps by Kiwi, `managed.rs`); a hint or a query, runs no work.
            driver cuMemRangeGetAttribute;
            /// Managed memory (moved at swaps by Kiwi, `managed.rs`); a hint or a query, runs no work.
            driver cuMemRangeGetAttributes;
            /// Arrays: made and described by the driver in its own memory (not swappable, docs/shim.md); runs no work.
            driver cuMipmappedArrayGetLevel;
            /// A module's globals live in the context's module memory, never swapped; runs no work.
            driver cuModuleGetGlobal_v2;
            /// NVLink multicast objects over the application's own VMM memory, not swapped; runs no work.
            driver cuMulticastAddDevice;
            /// NVLink multicast objects over the application's own VMM memory, not swapped; runs no work.
            driver cuMulticastBindAddr;
            /// NVLink multicast objects over the application's own VMM memory, not swapped; runs no work.
            driver cuMulticastCreate;
            /// NVLink multicast objects over the application's own VMM memory, not swapped; runs no work.
            driver cuMulticastUnbind;
            /// Pointer attributes: the shim answers for its own allocations (their own range, device and type, swapped out or not: `attrs.rs`); runs no work.
            hook cuPointerGetAttribute(data: *mut c_void, attribute: c_int, ptr: CUdeviceptr) => attrs::pointer_get_attribute;
            /// Pointer attributes: the shim answers for its own allocations (their own range, device and type, swapped out or not: `attrs.rs`); runs no work.
            hook cuPointerGetAttributes(n: Uint, attributes: *mut c_int, data: *mut *mut c_void, ptr: CUdeviceptr) => attrs::pointer_get_attributes;
            /// Pointer attributes: answered by the driver for now (#13 item 6); runs no work.
            driver cuPointerSetAttribute;
            /// Attaches managed memory (paged by the driver) to a stream; runs no work.
            driver cuStreamAttachMemAsync;
            /// Attaches managed memory (paged by the driver) to a stream; runs no work.
            driver cuStreamAttachMemAsync_ptsz;
            /// Stream capture: the shim tracks it (`capture.rs`): no shim sync while a stream captures.
            hook cuStreamBeginCapture(stream: CUstream) => capture::begin_v1::<false>;
            /// Stream capture: the shim tracks it (`capture.rs`): no shim sync while a stream captures.
            hook cuStreamBeginCaptureToGraph(stream: CUstream, graph: *mut c_void, deps: Opaque, dep_data: Opaque, n: usize, mode: Uint) => capture::begin_to_graph::<false>;
            /// Stream capture: the shim tracks it (`capture.rs`): no shim sync while a stream captures.
            hook cuStreamBeginCaptureToGraph_ptsz(stream: CUstream, graph: *mut c_void, deps: Opaque, dep_data: Opaque, n: usize, mode: Uint) => capture::begin_to_graph::<true>;
            /// Stream capture: the shim tracks it (`capture.rs`): no shim sync while a stream captures.
            hook cuStreamBeginCapture_ptsz(stream: CUstream) => capture::begin_v1::<true>;
            /// Stream capture: the shim tracks it (`capture.rs`): no shim sync while a stream captures.
            hook cuStreamBeginCapture_v2(stream: CUstream, mode: Uint) => capture::begin::<false>;
            /// Stream capture: the shim tracks it (`capture.rs`): no shim sync while a stream captures.
            hook cuStreamBeginCapture_v2_ptsz(stream: CUstream, mode: Uint) => capture::begin::<true>;
            /// Reads or sets a stream's properties; runs no work.
            driver cuStreamCopyAttributes;
            /// Reads or sets a stream's properties; runs no work.
            driver cuStreamCopyAttributes_ptsz;
            /// Creates or destroys a stream; runs no work.
            driver cuStreamCreate;
            /// Creates or destroys a stream; runs no work.
            driver cuStreamCreateWithPriority;
            /// Creates or destroys a stream; runs no work.
            driver cuStreamDestroy;
            /// Creates or destroys a stream; runs no work.
            driver cuStreamDestroy_v2;
            /// Stream capture: the shim tracks it (`capture.rs`): no shim sync while a stream captures.
            hook cuStreamEndCapture(stream: CUstream, graph: *mut *mut c_void) => capture::end::<false>;
            /// Stream capture: the shim tracks it (`capture.rs`): no shim sync while a stream captures.
            hook cuStreamEndCapture_ptsz(stream: CUstream, graph: *mut *mut c_void) => capture::end::<true>;
            /// Reads or sets a stream's properties; runs no work.
            driver cuStreamGetAttribute;
            /// Reads or sets a stream's properties; runs no work.
            driver cuStreamGetAttribute_ptsz;
            /// Stream capture: records work, runs none (#13 item 1 tracks capture).
            driver cuStreamGetCaptureInfo;
            /// Stream capture: records work, runs none (#13 item 1 tracks capture).
            driver cuStreamGetCaptureInfo_ptsz;
            /// Stream capture: records work, runs none (#13 item 1 tracks capture).
            driver cuStreamGetCaptureInfo_v2;
            /// Stream capture: records work, runs none (#13 item 1 tracks capture).
            driver cuStreamGetCaptureInfo_v2_ptsz;
            /// Stream capture: records work, runs none (#13 item 1 tracks capture).
            driver cuStreamGetCaptureInfo_v3;
            /// Stream capture: records work, runs none (#13 item 1 tracks capture).
            driver cuStreamGetCaptureInfo_v3_ptsz;
            /// Reads or sets a stream's properties; runs no work.
            driver cuStreamGetCtx;
            /// Reads or sets a stream's properties; runs no work.
            driver cuStreamGetCtx_ptsz;
            /// Reads or sets a stream's properties; runs no work.
            driver cuStreamGetCtx_v2;
            /// Reads or sets a stream's properties; runs no work.
            driver cuStreamGetCtx_v2_ptsz;
            /// Reads or sets a stream's properties; runs no work.
            driver cuStreamGetDevice;
            /// Reads or sets a stream's properties; runs no work.
            driver cuStreamGetDevice_ptsz;
            /// Reads or sets a stream's properties; runs no work.
            driver cuStreamGetFlags;
            /// Reads or sets a stream's properties; runs no work.
            driver cuStreamGetFlags_ptsz;
            /// Reads or sets a stream's properties; runs no work.
            driver cuStreamGetGreenCtx;
            /// Reads or sets a stream's properties; runs no work.
            driver cuStreamGetId;
            /// Reads or sets a stream's properties; runs no work.
            driver cuStreamGetId_ptsz;
            /// Reads or sets a stream's properties; runs no work.
            driver cuStreamGetPriority;
            /// Reads or sets a stream's properties; runs no work.
            driver cuStreamGetPriority_ptsz;
            /// Stream capture: records work, runs none (#13 item 1 tracks capture).
            driver cuStreamIsCapturing;
            /// Stream capture: records work, runs none (#13 item 1 tracks capture).
            driver cuStreamIsCapturing_ptsz;
            /// Asks whether a stream's work is done; runs no work.
            driver cuStreamQuery;
            /// Asks whether a stream's work is done; runs no work.
            driver cuStreamQuery_ptsz;
            /// Reads or sets a stream's properties; runs no work.
            driver cuStreamSetAttribute;
            /// Reads or sets a stream's properties; runs no work.
            driver cuStreamSetAttribute_ptsz;
            /// Stream capture: records work, runs none (#13 item 1 tracks capture).
            driver cuStreamUpdateCaptureDependencies;
            /// Stream capture: records work, runs none (#13 item 1 tracks capture).
            driver cuStreamUpdateCaptureDependencies_ptsz;
            /// Stream capture: records work, runs none (#13 item 1 tracks capture).
            driver cuStreamUpdateCaptureDependencies_v2;
            /// Stream capture: records work, runs none (#13 item 1 tracks capture).
            driver cuStreamUpdateCaptureDependencies_v2_ptsz;
            /// Orders one stream after an event; runs no work and touches no memory.
            driver cuStreamWaitEvent;
            /// Orders one stream after an event; runs no work and touches no memory.
            driver cuStreamWaitEvent_ptsz;
            /// Legacy texture and surface references: bind memory, run no work.
            driver cuSurfRefGetArray;
            /// Legacy texture and surface references: bind memory, run no work.
            driver cuSurfRefSetArray;
            /// Legacy texture and surface references: bind memory, run no work.
            driver cuTexRefGetAddress_v2;
            /// Legacy texture and surface references: bind memory, run no work.
            driver cuTexRefGetArray;
            /// Legacy texture and surface references: bind memory, run no work.
            driver cuTexRefSetAddress2D_v2;
            /// Legacy texture and surface references: bind memory, run no work.
            driver cuTexRefSetAddress2D_v3;
            /// Legacy texture and surface references: bind memory, run no work.
            driver cuTexRefSetAddress_v2;
            /// Legacy texture and surface references: bind memory, run no work.
            driver cuTexRefSetArray;

        }
    };
}
pub(crate) use for_each_export;

macro_rules! table {
    ($( $(#[doc = $doc:literal])* $class:ident $name:ident $(( $($arg:ident : $ty:ty),* ))? $(=> $hook:path)? ; )*) => {
        /// Index of every export into [`SYMBOLS`] and [`crate::real::REAL`].
        #[allow(non_camel_case_types)]
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub enum Sym { $($name),* }

        pub const COUNT: usize = [$(stringify!($name)),*].len();

        /// Every export, in [`Sym`] order.
        pub static SYMBOLS: [SymInfo; COUNT] = [
            $( SymInfo {
                name: concat!(stringify!($name), "\0"),
                class: table!(@class $class),
                reason: concat!($($doc),*),
                params: &[$($(stringify!($ty)),*)?],
            } ),*
        ];

        /// Every [`Sym`], by index.
        pub const ALL: [Sym; COUNT] = [$(Sym::$name),*];
    };
    (@class driver) => { Class::Driver };
    (@class pass) => { Class::Pass };
    (@class submit) => { Class::Submit };
    (@class hook) => { Class::Hook };
}

for_each_export!(table);

/// The export named `name`, if any (never a `driver` entry: the shim has no wrapper).
pub fn lookup(name: &[u8]) -> Option<usize> {
    if !name.starts_with(b"cu") {
        return None;
    }
    SYMBOLS
        .iter()
        .position(|s| s.exported() && s.name().as_bytes() == name)
}
