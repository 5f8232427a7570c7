//! The CUDA driver, loaded at run time as the CUDA runtime loads it: `dlopen
//! ("libcuda.so.1")`, `dlsym` of `cuGetProcAddress_v2` only, and every other entry
//! point through it by base name (CUDA 12.0, default flags). A failing call becomes
//! a [`CudaError`] naming the call and the error (`cuGetErrorName`).
#![allow(non_snake_case)]

use std::ffi::{c_char, c_void, CStr, CString};
use std::fmt;

pub type CUresult = u32;
pub type CUdevice = i32;
pub type CUdeviceptr = u64;
pub type Handle = *mut c_void;

pub const CUDA_SUCCESS: CUresult = 0;
pub const CUDA_ERROR_NOT_READY: CUresult = 600;

/// `CUmemAllocationProp`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct MemAllocationProp {
    pub type_: i32,
    pub requested_handle_types: i32,
    pub location_type: i32,
    pub location_id: i32,
    pub win32_handle_meta_data: *mut c_void,
    pub alloc_flags: [u8; 8],
}

impl MemAllocationProp {
    /// Pinned device memory on `device`.
    pub fn device(device: i32) -> Self {
        MemAllocationProp {
            type_: 1,
            requested_handle_types: 0,
            location_type: 1,
            location_id: device,
            win32_handle_meta_data: std::ptr::null_mut(),
            alloc_flags: [0; 8],
        }
    }
}

/// `CUmemAccessDesc`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct MemAccessDesc {
    pub location_type: i32,
    pub location_id: i32,
    pub flags: i32,
}

/// `CUipcMemHandle`: 64 opaque bytes, passed by value.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IpcMemHandle {
    pub reserved: [u8; 64],
}

/// `CU_MEM_ATTACH_GLOBAL`: managed memory any stream of any device may reach.
pub const CU_MEM_ATTACH_GLOBAL: u32 = 0x1;
/// `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`: the only `cuIpcOpenMemHandle` flag.
pub const CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS: u32 = 0x1;
/// `CU_MEM_ACCESS_FLAGS_PROT_READWRITE`.
pub const CU_MEM_ACCESS_FLAGS_PROT_READWRITE: i32 = 3;
/// `CU_MEM_ALLOC_GRANULARITY_RECOMMENDED`.
pub const CU_MEM_ALLOC_GRANULARITY_RECOMMENDED: i32 = 1;

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

/// Why the driver could not be loaded.
#[derive(Debug)]
pub enum LoadError {
    Dlopen(String),
    Missing(String),
}

impl fmt::Display for LoadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LoadError::Dlopen(e) => write!(f, "cannot load libcuda.so.1: {e}"),
            LoadError::Missing(s) => write!(f, "libcuda.so.1 has no entry point {s}"),
        }
    }
}

impl std::error::Error for LoadError {}

type GetProcAddress =
    unsafe extern "C" fn(*const c_char, *mut *mut c_void, i32, u64, *mut i32) -> CUresult;

macro_rules! driver_api {
    ($($field:ident = $name:literal : fn($($arg:ty),*);)*) => {
        /// Entry points of the loaded driver.
        pub struct Cuda {
            handle: *mut c_void,
            pub get_proc_address: GetProcAddress,
            $(pub $field: unsafe extern "C" fn($($arg),*) -> CUresult,)*
        }

        impl Cuda {
            fn resolve_all(handle: *mut c_void, gpa: GetProcAddress) -> Result<Cuda, LoadError> {
                Ok(Cuda {
                    handle,
                    get_proc_address: gpa,
                    $($field: {
                        let p = resolve(gpa, $name, 12000, 0)
                            .ok_or_else(|| LoadError::Missing($name.to_string()))?;
                        // SAFETY: the driver returned this entry point for this base
                        // name; its C signature is the one declared here (cuda.h).
                        unsafe { std::mem::transmute::<*mut c_void, unsafe extern "C" fn($($arg),*) -> CUresult>(p) }
                    },)*
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
    device_get_uuid = "cuDeviceGetUuid": fn(*mut [u8; 16], CUdevice);
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

/// Resolves `name` through `cuGetProcAddress_v2`.
pub fn resolve(gpa: GetProcAddress, name: &str, version: i32, flags: u64) -> Option<*mut c_void> {
    let c = CString::new(name).ok()?;
    let mut p: *mut c_void = std::ptr::null_mut();
    let mut status = 0i32;
    // SAFETY: valid C string and out-pointers for the duration of the call.
    let r = unsafe { gpa(c.as_ptr(), &mut p, version, flags, &mut status) };
    (r == CUDA_SUCCESS && !p.is_null()).then_some(p)
}

// SAFETY: the driver's entry points are thread-safe C functions.
unsafe impl Send for Cuda {}
// SAFETY: as above.
unsafe impl Sync for Cuda {}

fn dlerror() -> String {
    // SAFETY: dlerror returns NULL or a valid C string owned by libc.
    let e = unsafe { libc::dlerror() };
    if e.is_null() {
        "unknown dlopen error".into()
    } else {
        // SAFETY: non-NULL, NUL-terminated.
        unsafe { CStr::from_ptr(e) }.to_string_lossy().into_owned()
    }
}

impl Cuda {
    /// Loads `libcuda.so.1` from the library search path.
    pub fn load() -> Result<Cuda, LoadError> {
        // SAFETY: dlopen of a library by its soname; the handle is kept for the life
        // of the process (never dlclosed).
        let h =
            unsafe { libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
        if h.is_null() {
            return Err(LoadError::Dlopen(dlerror()));
        }
        // SAFETY: looking up a symbol in the handle we just opened.
        let p = unsafe { libc::dlsym(h, c"cuGetProcAddress_v2".as_ptr()) };
        if p.is_null() {
            return Err(LoadError::Missing("cuGetProcAddress_v2".into()));
        }
        // SAFETY: cuGetProcAddress_v2 has this signature in cuda.h (CUDA 12).
        let gpa = unsafe { std::mem::transmute::<*mut c_void, GetProcAddress>(p) };
        Self::resolve_all(h, gpa)
    }

    /// The entry points of `--exchange` (CUDA 12.0 resolves the base names to
    /// `cuMemHostRegister_v2`, `cuMemHostGetDevicePointer_v2`,
    /// `cuStreamWriteValue32_v2` and `cuStreamWaitValue32_v2`). The error names the
    /// first one the driver lacks.
    pub fn exchange_api(&self) -> Result<ExchangeApi, LoadError> {
        let get = |name: &str| {
            resolve(self.get_proc_address, name, 12000, 0)
                .ok_or_else(|| LoadError::Missing(name.to_string()))
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
        // SAFETY: a valid handle and C string.
        let p = unsafe { libc::dlsym(self.handle, c.as_ptr()) };
        (!p.is_null()).then_some(p)
    }

    /// The name of a result code (`cuGetErrorName`).
    pub fn error_name(&self, code: CUresult) -> String {
        let mut s: *const c_char = std::ptr::null();
        // SAFETY: valid out-pointer; the driver returns a static string or NULL.
        let r = unsafe { (self.get_error_name)(code, &mut s) };
        if r != CUDA_SUCCESS || s.is_null() {
            return format!("CUDA error {code}");
        }
        // SAFETY: a static NUL-terminated string from the driver.
        unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned()
    }

    /// Turns a result code into `Result`, naming the call.
    pub fn check(&self, call: &'static str, code: CUresult) -> Result<(), CudaError> {
        if code == CUDA_SUCCESS {
            Ok(())
        } else {
            Err(CudaError {
                call,
                code,
                name: self.error_name(code),
            })
        }
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
