//! The CUDA driver, loaded at run time as the CUDA runtime loads it: `dlopen
//! ("libcuda.so.1")`, `dlsym` of `cuGetProcAddress_v2` only, and every other entry
//! point through it by base name (CUDA 12.0, default flags). A failing call becomes
//! a [`CudaError`] naming the call and the error (`cuGetErrorName`).
//!
//! The ABI (types, values, structs) and the loader are `kiwi_cuda`'s; this module
//! owns only the table of entry points gpuburst calls and how it calls them.
#![allow(non_snake_case)]

use std::ffi::{c_char, c_void, CStr, CString};
use std::fmt;

use kiwi_cuda::sys::PFN_cuGetProcAddress_v2;
use kiwi_cuda::Library;

/// `CUipcMemHandle`: 64 opaque bytes, passed by value.
pub use kiwi_cuda::sys::CUipcMemHandle as IpcMemHandle;
/// `CUmemAccessDesc`.
pub use kiwi_cuda::sys::CUmemAccessDesc as MemAccessDesc;
/// `CUmemAllocationProp` (`MemAllocationProp::device(d)`: pinned memory on `d`).
pub use kiwi_cuda::sys::CUmemAllocationProp as MemAllocationProp;
pub use kiwi_cuda::sys::CUmemLocation;
pub use kiwi_cuda::sys::{
    CUdevice, CUdeviceptr, CUresult, CUuuid, CUDA_ERROR_NOT_READY, CUDA_SUCCESS,
    CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS, CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    CU_MEM_ALLOC_GRANULARITY_RECOMMENDED, CU_MEM_ATTACH_GLOBAL,
};
pub use kiwi_cuda::LoadError;

/// Any driver handle (context, module, function, stream, event, library, kernel).
pub type Handle = *mut c_void;

/// A failed driver call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaError {
    pub call: &'static str,
    pub code: CUresult,
    pub name: String,
}

impl fmt::Display for CudaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} failed: {} ({})", self.call, self.name, self.code)
    }
}

impl std::error::Error for CudaError {}

type GetProcAddress = PFN_cuGetProcAddress_v2;

macro_rules! driver_api {
    ($($field:ident = $name:literal : fn($($arg:ty),*);)*) => {
        /// Entry points of the loaded driver.
        pub struct Cuda {
            lib: Library,
            pub get_proc_address: GetProcAddress,
            $(pub $field: unsafe extern "C" fn($($arg),*) -> CUresult,)*
        }

        impl Cuda {
            fn resolve_all(lib: Library, gpa: GetProcAddress) -> Result<Cuda, LoadError> {
                Ok(Cuda {
                    $($field: {
                        let p = resolve(gpa, $name, 12000, 0)
                            .ok_or_else(|| missing(&lib, $name))?;
                        // SAFETY: the driver returned this entry point for this base
                        // name; its C signature is the one declared here (cuda.h).
                        unsafe { std::mem::transmute::<*mut c_void, unsafe extern "C" fn($($arg),*) -> CUresult>(p) }
                    },)*
                    lib,
                    get_proc_address: gpa,
                })
            }
        }
    };
}

driver_api! {
    init = "cuInit": fn(u32);
    get_error_name = "cuGetErrorName": fn(CUresult, *mut *const c_char);
    device_get = "cuDeviceGet": fn(*mut CUdevice, i32);
    device_get_count = "cuDeviceGetCount": fn(*mut i32);
    device_get_name = "cuDeviceGetName": fn(*mut c_char, i32, CUdevice);
    device_total_mem = "cuDeviceTotalMem": fn(*mut usize, CUdevice);
    device_get_uuid = "cuDeviceGetUuid": fn(*mut CUuuid, CUdevice);
    primary_ctx_retain = "cuDevicePrimaryCtxRetain": fn(*mut Handle, CUdevice);
    primary_ctx_release = "cuDevicePrimaryCtxRelease": fn(CUdevice);
    ctx_create = "cuCtxCreate": fn(*mut Handle, u32, CUdevice);
    ctx_destroy = "cuCtxDestroy": fn(Handle);
    ctx_set_current = "cuCtxSetCurrent": fn(Handle);
    ctx_get_current = "cuCtxGetCurrent": fn(*mut Handle);
    ctx_synchronize = "cuCtxSynchronize": fn();
    mem_get_info = "cuMemGetInfo": fn(*mut usize, *mut usize);
    mem_alloc = "cuMemAlloc": fn(*mut CUdeviceptr, usize);
    mem_free = "cuMemFree": fn(CUdeviceptr);
    memcpy_htod = "cuMemcpyHtoD": fn(CUdeviceptr, *const c_void, usize);
    memcpy_dtoh = "cuMemcpyDtoH": fn(*mut c_void, CUdeviceptr, usize);
    memset_d32_async = "cuMemsetD32Async": fn(CUdeviceptr, u32, usize, Handle);
    memset_d32 = "cuMemsetD32": fn(CUdeviceptr, u32, usize);
    module_load_data = "cuModuleLoadData": fn(*mut Handle, *const c_void);
    module_get_function = "cuModuleGetFunction": fn(*mut Handle, Handle, *const c_char);
    library_load_data = "cuLibraryLoadData": fn(*mut Handle, *const c_void, *mut i32, *mut *mut c_void, u32, *mut i32, *mut *mut c_void, u32);
    library_get_kernel = "cuLibraryGetKernel": fn(*mut Handle, Handle, *const c_char);
    launch_kernel = "cuLaunchKernel": fn(Handle, u32, u32, u32, u32, u32, u32, u32, Handle, *mut *mut c_void, *mut *mut c_void);
    stream_create = "cuStreamCreate": fn(*mut Handle, u32);
    stream_synchronize = "cuStreamSynchronize": fn(Handle);
    stream_query = "cuStreamQuery": fn(Handle);
    stream_wait_event = "cuStreamWaitEvent": fn(Handle, Handle, u32);
    memcpy_dtoh_async = "cuMemcpyDtoHAsync": fn(*mut c_void, CUdeviceptr, usize, Handle);
    event_query = "cuEventQuery": fn(Handle);
    event_create = "cuEventCreate": fn(*mut Handle, u32);
    event_record = "cuEventRecord": fn(Handle, Handle);
    event_synchronize = "cuEventSynchronize": fn(Handle);
    event_elapsed_time = "cuEventElapsedTime": fn(*mut f32, Handle, Handle);
    mem_address_reserve = "cuMemAddressReserve": fn(*mut CUdeviceptr, usize, usize, CUdeviceptr, u64);
    mem_address_free = "cuMemAddressFree": fn(CUdeviceptr, usize);
    mem_create = "cuMemCreate": fn(*mut u64, usize, *const MemAllocationProp, u64);
    mem_release = "cuMemRelease": fn(u64);
    mem_map = "cuMemMap": fn(CUdeviceptr, usize, usize, u64, u64);
    mem_unmap = "cuMemUnmap": fn(CUdeviceptr, usize);
    mem_set_access = "cuMemSetAccess": fn(CUdeviceptr, usize, *const MemAccessDesc, usize);
    mem_get_allocation_granularity = "cuMemGetAllocationGranularity": fn(*mut usize, *const MemAllocationProp, i32);
    mem_alloc_managed = "cuMemAllocManaged": fn(*mut CUdeviceptr, usize, u32);
    ipc_get_mem_handle = "cuIpcGetMemHandle": fn(*mut IpcMemHandle, CUdeviceptr);
    ipc_open_mem_handle = "cuIpcOpenMemHandle": fn(*mut CUdeviceptr, IpcMemHandle, u32);
    ipc_close_mem_handle = "cuIpcCloseMemHandle": fn(CUdeviceptr);
}

/// Entry points only `--exchange` uses (stream memory operations, mapped host
/// memory), resolved on demand by [`Cuda::exchange_api`] so that a driver lacking
/// them still runs every other mode.
pub struct ExchangeApi {
    pub mem_host_register: unsafe extern "C" fn(*mut c_void, usize, u32) -> CUresult,
    pub mem_host_unregister: unsafe extern "C" fn(*mut c_void) -> CUresult,
    pub mem_host_get_device_pointer:
        unsafe extern "C" fn(*mut CUdeviceptr, *mut c_void, u32) -> CUresult,
    pub stream_write_value32: unsafe extern "C" fn(Handle, CUdeviceptr, u32, u32) -> CUresult,
    pub stream_wait_value32: unsafe extern "C" fn(Handle, CUdeviceptr, u32, u32) -> CUresult,
}

/// Resolves `name` through `cuGetProcAddress_v2` (`gpa`, the driver's).
pub fn resolve(gpa: GetProcAddress, name: &str, version: i32, flags: u64) -> Option<*mut c_void> {
    let c = CString::new(name).ok()?;
    // SAFETY: `gpa` is the driver's cuGetProcAddress_v2 ([`Cuda::get_proc_address`]).
    unsafe { kiwi_cuda::loader::proc_address(gpa, &c, version, flags) }.map(|p| p.as_ptr())
}

fn missing(lib: &Library, name: &str) -> LoadError {
    LoadError::Missing {
        library: lib.name().to_string(),
        symbol: name.to_string(),
    }
}

impl Cuda {
    /// Loads `libcuda.so.1` from the library search path (kept for the life of the
    /// process, never closed).
    pub fn load() -> Result<Cuda, LoadError> {
        let lib = Library::libcuda()?;
        // SAFETY: cuGetProcAddress_v2 has this signature in cuda.h (CUDA 12).
        let gpa = unsafe { lib.get::<GetProcAddress>(c"cuGetProcAddress_v2") }?;
        Self::resolve_all(lib, gpa)
    }

    /// The entry points of `--exchange` (CUDA 12.0 resolves the base names to
    /// `cuMemHostRegister_v2`, `cuMemHostGetDevicePointer_v2`,
    /// `cuStreamWriteValue32_v2` and `cuStreamWaitValue32_v2`). The error names the
    /// first one the driver lacks.
    pub fn exchange_api(&self) -> Result<ExchangeApi, LoadError> {
        let get = |name: &str| {
            resolve(self.get_proc_address, name, 12000, 0).ok_or_else(|| missing(&self.lib, name))
        };
        let host_register = get("cuMemHostRegister")?;
        let host_unregister = get("cuMemHostUnregister")?;
        let host_get_device_pointer = get("cuMemHostGetDevicePointer")?;
        let write_value32 = get("cuStreamWriteValue32")?;
        let wait_value32 = get("cuStreamWaitValue32")?;
        // SAFETY: each pointer is the driver's entry point for that base name at CUDA
        // 12.0; the signatures are cuda.h's (`cuMemHostRegister_v2(void *, size_t,
        // unsigned)`, `cuMemHostUnregister(void *)`, `cuMemHostGetDevicePointer_v2(
        // CUdeviceptr *, void *, unsigned)`, `cuStreamWriteValue32_v2` and
        // `cuStreamWaitValue32_v2(CUstream, CUdeviceptr, cuuint32_t, unsigned)`).
        unsafe {
            Ok(ExchangeApi {
                mem_host_register: std::mem::transmute::<
                    *mut c_void,
                    unsafe extern "C" fn(*mut c_void, usize, u32) -> CUresult,
                >(host_register),
                mem_host_unregister: std::mem::transmute::<
                    *mut c_void,
                    unsafe extern "C" fn(*mut c_void) -> CUresult,
                >(host_unregister),
                mem_host_get_device_pointer: std::mem::transmute::<
                    *mut c_void,
                    unsafe extern "C" fn(*mut CUdeviceptr, *mut c_void, u32) -> CUresult,
                >(host_get_device_pointer),
                stream_write_value32: std::mem::transmute::<
                    *mut c_void,
                    unsafe extern "C" fn(Handle, CUdeviceptr, u32, u32) -> CUresult,
                >(write_value32),
                stream_wait_value32: std::mem::transmute::<
                    *mut c_void,
                    unsafe extern "C" fn(Handle, CUdeviceptr, u32, u32) -> CUresult,
                >(wait_value32),
            })
        }
    }

    /// `dlsym` in the driver library (for tests comparing entry points).
    pub fn dlsym(&self, name: &str) -> Option<*mut c_void> {
        let c = CString::new(name).ok()?;
        let p = self.lib.symbol(&c);
        (!p.is_null()).then_some(p)
    }

    /// The name of a result code: the driver's (`cuGetErrorName`), else Kiwi's.
    pub fn error_name(&self, code: CUresult) -> String {
        let mut s: *const c_char = std::ptr::null();
        // SAFETY: valid out-pointer; the driver returns a static string or NULL.
        let r = unsafe { (self.get_error_name)(code, &mut s) };
        if r != CUDA_SUCCESS || s.is_null() {
            return match kiwi_cuda::CudaError(code).name() {
                Some(name) => name.to_string(),
                None => format!("CUDA error {code}"),
            };
        }
        // SAFETY: a static NUL-terminated string from the driver.
        unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned()
    }

    /// Turns a result code into `Result`, naming the call.
    pub fn check(&self, call: &'static str, code: CUresult) -> Result<(), CudaError> {
        kiwi_cuda::check(code).map_err(|e| CudaError {
            call,
            code: e.code(),
            name: self.error_name(e.code()),
        })
    }
}

/// Calls a driver entry point and checks its result:
/// `cu!(cuda, mem_alloc, "cuMemAlloc_v2", &mut p, n)?`.
#[macro_export]
macro_rules! cu {
    ($cuda:expr, $field:ident, $call:literal $(, $arg:expr)* $(,)?) => {{
        let c = &$cuda;
        // SAFETY: the entry point was resolved for this signature; arguments follow
        // the driver API contract (valid pointers for the call's duration).
        let r = unsafe { (c.$field)($($arg),*) };
        c.check($call, r)
    }};
}
