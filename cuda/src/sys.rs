//! The C ABI of the CUDA driver, as `cuda.h` (CUDA 12.x) defines it: handle types,
//! result codes, flags, attributes and the structs Kiwi reads or writes, under
//! `cuda.h`'s own names. Nothing here calls anything.
//!
//! `CUresult` is a C enum with no negative value, which GCC and Clang give the type
//! `unsigned int` (bindgen's and cudarc's choice too): here `u32`, everywhere in Kiwi.
//! Every `pub const` below and every struct's size and field offsets are checked
//! against NVIDIA's real header by `tests/cuda_h.rs`; a value this file spells
//! differently from `cuda.h` fails there.

#![allow(non_camel_case_types)]

use std::ffi::{c_int, c_uint, c_void, CStr};

pub type CUresult = u32;
pub type CUdevice = c_int;
pub type CUdeviceptr = u64;
pub type CUcontext = *mut c_void;
pub type CUstream = *mut c_void;
pub type CUevent = *mut c_void;
pub type CUmodule = *mut c_void;
pub type CUfunction = *mut c_void;
pub type CUlibrary = *mut c_void;
pub type CUkernel = *mut c_void;
pub type CUgraphExec = *mut c_void;
pub type CUmemoryPool = *mut c_void;
pub type CUmemGenericAllocationHandle = u64;
pub type CUhostFn = Option<unsafe extern "C" fn(user_data: *mut c_void)>;
pub type CUstreamCallback =
    Option<unsafe extern "C" fn(stream: CUstream, status: CUresult, user_data: *mut c_void)>;

/// `cuGetProcAddress_v2(symbol, pfn, cudaVersion, flags, symbolStatus)` (CUDA 12):
/// how the CUDA runtime reaches every other entry point.
pub type PFN_cuGetProcAddress_v2 = unsafe extern "C" fn(
    symbol: *const std::ffi::c_char,
    pfn: *mut *mut c_void,
    cuda_version: c_int,
    flags: u64,
    symbol_status: *mut c_int,
) -> CUresult;

/// Declares each result code once: the constant, and its row in [`RESULT_CODES`]
/// (the name `cuGetErrorName` gives, the description `cuGetErrorString` gives).
macro_rules! result_codes {
    ($($name:ident = $code:literal, $description:literal;)*) => {
        $(pub const $name: CUresult = $code;)*

        /// (code, name, description) of every result code above.
        pub(crate) const RESULT_CODES: &[(CUresult, &CStr, &CStr)] =
            &[$(($name, cstr(concat!(stringify!($name), "\0")), $description)),*];
    };
}

const fn cstr(s: &'static str) -> &'static CStr {
    match CStr::from_bytes_with_nul(s.as_bytes()) {
        Ok(c) => c,
        Err(_) => panic!("not a NUL-terminated string"),
    }
}

result_codes! {
    CUDA_SUCCESS = 0, c"no error";
    CUDA_ERROR_INVALID_VALUE = 1, c"invalid argument";
    CUDA_ERROR_OUT_OF_MEMORY = 2, c"out of memory";
    CUDA_ERROR_NOT_INITIALIZED = 3, c"initialization error";
    CUDA_ERROR_DEINITIALIZED = 4, c"driver shutting down";
    CUDA_ERROR_NO_DEVICE = 100, c"no CUDA-capable device is detected";
    CUDA_ERROR_INVALID_DEVICE = 101, c"invalid device ordinal";
    CUDA_ERROR_INVALID_IMAGE = 200, c"device kernel image is invalid";
    CUDA_ERROR_INVALID_CONTEXT = 201, c"invalid device context";
    CUDA_ERROR_CONTEXT_ALREADY_CURRENT = 202, c"context already current";
    CUDA_ERROR_MAP_FAILED = 205, c"mapping of buffer object failed";
    CUDA_ERROR_ALREADY_MAPPED = 208, c"resource already mapped";
    CUDA_ERROR_NOT_MAPPED = 211, c"resource not mapped";
    CUDA_ERROR_UNSUPPORTED_LIMIT = 215, c"limit is not supported on this architecture";
    CUDA_ERROR_INVALID_SOURCE = 300, c"device kernel image is invalid";
    CUDA_ERROR_FILE_NOT_FOUND = 301, c"file not found";
    CUDA_ERROR_OPERATING_SYSTEM = 304, c"OS call failed or operation not supported on this OS";
    CUDA_ERROR_INVALID_HANDLE = 400, c"invalid resource handle";
    CUDA_ERROR_ILLEGAL_STATE = 401, c"the operation cannot be performed in the present state";
    CUDA_ERROR_NOT_FOUND = 500, c"named symbol not found";
    CUDA_ERROR_NOT_READY = 600, c"device not ready";
    CUDA_ERROR_ILLEGAL_ADDRESS = 700, c"an illegal memory access was encountered";
    CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES = 701, c"too many resources requested for launch";
    CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED = 704, c"peer access is already enabled";
    CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE = 708, c"primary context active";
    CUDA_ERROR_CONTEXT_IS_DESTROYED = 709, c"context is destroyed";
    CUDA_ERROR_TOO_MANY_PEERS = 711, c"peer mapping resources exhausted";
    CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712,
        c"part or all of the requested memory range is already mapped";
    CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED = 713,
        c"pointer does not correspond to a registered memory region";
    CUDA_ERROR_LAUNCH_FAILED = 719, c"unspecified launch failure";
    CUDA_ERROR_NOT_PERMITTED = 800, c"operation not permitted";
    CUDA_ERROR_NOT_SUPPORTED = 801, c"operation not supported";
    CUDA_ERROR_SYSTEM_NOT_READY = 802, c"system not yet initialized";
    CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED = 900,
        c"operation not permitted when stream is capturing";
    CUDA_ERROR_STREAM_CAPTURE_INVALIDATED = 901,
        c"operation failed due to a previous error during capture";
    CUDA_ERROR_STREAM_CAPTURE_UNJOINED = 904,
        c"capture sequence contains a fork that was not joined to the primary stream";
    CUDA_ERROR_STREAM_CAPTURE_IMPLICIT = 906,
        c"operation would make the legacy stream depend on a capturing blocking stream";
    CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD = 908,
        c"attempt to terminate a thread-local capture sequence from another thread";
    CUDA_ERROR_TIMEOUT = 909, c"wait operation timed out";
    CUDA_ERROR_UNKNOWN = 999, c"unknown error";
}

/// `CU_STREAM_LEGACY` and `CU_STREAM_PER_THREAD`: special stream handles.
pub const CU_STREAM_LEGACY: usize = 1;
pub const CU_STREAM_PER_THREAD: usize = 2;
pub const CU_STREAM_NON_BLOCKING: c_uint = 1;
pub const CU_STREAM_CAPTURE_STATUS_NONE: c_int = 0;
pub const CU_STREAM_CAPTURE_STATUS_ACTIVE: c_int = 1;
pub const CU_STREAM_CAPTURE_STATUS_INVALIDATED: c_int = 2;
pub const CU_STREAM_CAPTURE_MODE_GLOBAL: c_uint = 0;
pub const CU_STREAM_CAPTURE_MODE_THREAD_LOCAL: c_uint = 1;
pub const CU_STREAM_CAPTURE_MODE_RELAXED: c_uint = 2;

pub const CU_EVENT_DISABLE_TIMING: c_uint = 2;

/// `cuGetProcAddress` flags and symbol statuses.
pub const CU_GET_PROC_ADDRESS_DEFAULT: u64 = 0;
pub const CU_GET_PROC_ADDRESS_LEGACY_STREAM: u64 = 1;
pub const CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM: u64 = 2;
pub const CU_GET_PROC_ADDRESS_SUCCESS: c_int = 0;
pub const CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND: c_int = 1;
pub const CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT: c_int = 2;

/// Virtual memory management: allocation types, locations, handle types, access.
pub const CU_MEM_ALLOCATION_TYPE_PINNED: c_int = 1;
pub const CU_MEM_LOCATION_TYPE_DEVICE: c_int = 1;
pub const CU_MEM_LOCATION_TYPE_HOST: c_int = 2;
/// Shareable as a file descriptor.
pub const CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR: c_int = 1;
pub const CU_MEM_ACCESS_FLAGS_PROT_NONE: c_int = 0;
pub const CU_MEM_ACCESS_FLAGS_PROT_READ: c_int = 1;
pub const CU_MEM_ACCESS_FLAGS_PROT_READWRITE: c_int = 3;
pub const CU_MEM_ALLOC_GRANULARITY_MINIMUM: c_int = 0;
pub const CU_MEM_ALLOC_GRANULARITY_RECOMMENDED: c_int = 1;

/// The one `cuIpcOpenMemHandle` flag.
pub const CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS: c_uint = 1;

/// `cuLaunchKernel`'s `extra` array markers (pointers in `cuda.h`).
pub const CU_LAUNCH_PARAM_END: usize = 0;
pub const CU_LAUNCH_PARAM_BUFFER_POINTER: usize = 1;
pub const CU_LAUNCH_PARAM_BUFFER_SIZE: usize = 2;

/// The host memory is mapped into the device address space (`cuMemHostAlloc`,
/// `cuMemHostRegister`: the same bit).
pub const CU_MEMHOSTALLOC_DEVICEMAP: c_uint = 0x02;
pub const CU_MEMHOSTREGISTER_DEVICEMAP: c_uint = 0x02;
/// The registration counts in every context.
pub const CU_MEMHOSTREGISTER_PORTABLE: c_uint = 0x01;
/// The device may only read the registered range.
pub const CU_MEMHOSTREGISTER_READ_ONLY: c_uint = 0x08;

/// `CUstreamWaitValue_flags`: the condition (low bits) and the flush bit.
pub const CU_STREAM_WAIT_VALUE_GEQ: c_uint = 0x0;
pub const CU_STREAM_WAIT_VALUE_EQ: c_uint = 0x1;
pub const CU_STREAM_WAIT_VALUE_AND: c_uint = 0x2;
pub const CU_STREAM_WAIT_VALUE_NOR: c_uint = 0x3;
pub const CU_STREAM_WAIT_VALUE_FLUSH: c_uint = 1 << 30;
/// `CUstreamWriteValue_flags` (`NO_MEMORY_BARRIER`: "not supported in the v2 API").
pub const CU_STREAM_WRITE_VALUE_DEFAULT: c_uint = 0x0;
pub const CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER: c_uint = 0x1;
/// `CUstreamBatchMemOpType` (`BARRIER` only in the `_v2` API).
pub const CU_STREAM_MEM_OP_WAIT_VALUE_32: c_uint = 1;
pub const CU_STREAM_MEM_OP_WRITE_VALUE_32: c_uint = 2;
pub const CU_STREAM_MEM_OP_FLUSH_REMOTE_WRITES: c_uint = 3;
pub const CU_STREAM_MEM_OP_WAIT_VALUE_64: c_uint = 4;
pub const CU_STREAM_MEM_OP_WRITE_VALUE_64: c_uint = 5;
pub const CU_STREAM_MEM_OP_BARRIER: c_uint = 6;
/// `CUstreamMemoryBarrier_flags`.
pub const CU_STREAM_MEMORY_BARRIER_TYPE_SYS: c_uint = 0x0;
pub const CU_STREAM_MEMORY_BARRIER_TYPE_GPU: c_uint = 0x1;

/// Managed memory.
pub const CU_MEM_ATTACH_GLOBAL: c_uint = 1;
pub const CU_MEM_ATTACH_HOST: c_uint = 2;
pub const CU_DEVICE_CPU: CUdevice = -1;

/// `CUmemorytype`.
pub const CU_MEMORYTYPE_HOST: c_uint = 1;
pub const CU_MEMORYTYPE_DEVICE: c_uint = 2;
pub const CU_MEMORYTYPE_ARRAY: c_uint = 3;
pub const CU_MEMORYTYPE_UNIFIED: c_uint = 4;

/// `CUprocessState` (`cuCheckpointProcessGetState`).
pub const CU_PROCESS_STATE_RUNNING: c_uint = 0;
pub const CU_PROCESS_STATE_LOCKED: c_uint = 1;
pub const CU_PROCESS_STATE_CHECKPOINTED: c_uint = 2;
pub const CU_PROCESS_STATE_FAILED: c_uint = 3;

/// `CU_POINTER_ATTRIBUTE_*` Kiwi asks or answers.
pub mod ptr_attr {
    pub const CONTEXT: i32 = 1;
    pub const MEMORY_TYPE: i32 = 2;
    pub const DEVICE_POINTER: i32 = 3;
    pub const HOST_POINTER: i32 = 4;
    pub const BUFFER_ID: i32 = 7;
    pub const IS_MANAGED: i32 = 8;
    pub const DEVICE_ORDINAL: i32 = 9;
    pub const RANGE_START_ADDR: i32 = 11;
    pub const RANGE_SIZE: i32 = 12;
    pub const MAPPED: i32 = 13;
    pub const MEMPOOL_HANDLE: i32 = 17;
}

/// `CU_DEVICE_ATTRIBUTE_*` Kiwi asks or answers.
pub mod attr {
    pub const MAX_THREADS_PER_BLOCK: i32 = 1;
    pub const MAX_BLOCK_DIM_X: i32 = 2;
    pub const MAX_BLOCK_DIM_Y: i32 = 3;
    pub const MAX_BLOCK_DIM_Z: i32 = 4;
    pub const MAX_GRID_DIM_X: i32 = 5;
    pub const MAX_GRID_DIM_Y: i32 = 6;
    pub const MAX_GRID_DIM_Z: i32 = 7;
    pub const MAX_SHARED_MEMORY_PER_BLOCK: i32 = 8;
    pub const TOTAL_CONSTANT_MEMORY: i32 = 9;
    pub const WARP_SIZE: i32 = 10;
    pub const MAX_PITCH: i32 = 11;
    pub const MAX_REGISTERS_PER_BLOCK: i32 = 12;
    pub const CLOCK_RATE: i32 = 13;
    pub const TEXTURE_ALIGNMENT: i32 = 14;
    pub const GPU_OVERLAP: i32 = 15;
    pub const MULTIPROCESSOR_COUNT: i32 = 16;
    pub const INTEGRATED: i32 = 18;
    pub const CAN_MAP_HOST_MEMORY: i32 = 19;
    pub const COMPUTE_MODE: i32 = 20;
    pub const CONCURRENT_KERNELS: i32 = 31;
    pub const ECC_ENABLED: i32 = 32;
    pub const PCI_BUS_ID: i32 = 33;
    pub const PCI_DEVICE_ID: i32 = 34;
    pub const MEMORY_CLOCK_RATE: i32 = 36;
    pub const GLOBAL_MEMORY_BUS_WIDTH: i32 = 37;
    pub const L2_CACHE_SIZE: i32 = 38;
    pub const MAX_THREADS_PER_MULTIPROCESSOR: i32 = 39;
    pub const ASYNC_ENGINE_COUNT: i32 = 40;
    pub const UNIFIED_ADDRESSING: i32 = 41;
    pub const PCI_DOMAIN_ID: i32 = 50;
    pub const COMPUTE_CAPABILITY_MAJOR: i32 = 75;
    pub const COMPUTE_CAPABILITY_MINOR: i32 = 76;
    pub const STREAM_PRIORITIES_SUPPORTED: i32 = 78;
    pub const MAX_SHARED_MEMORY_PER_MULTIPROCESSOR: i32 = 81;
    pub const MAX_REGISTERS_PER_MULTIPROCESSOR: i32 = 82;
    pub const MANAGED_MEMORY: i32 = 83;
    pub const CONCURRENT_MANAGED_ACCESS: i32 = 89;
    pub const CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM: i32 = 91;
    pub const CAN_USE_STREAM_MEM_OPS_V1: i32 = 92;
    pub const CAN_USE_64_BIT_STREAM_MEM_OPS_V1: i32 = 93;
    pub const CAN_USE_STREAM_WAIT_VALUE_NOR_V1: i32 = 94;
    pub const COOPERATIVE_LAUNCH: i32 = 95;
    pub const MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: i32 = 97;
    pub const CAN_FLUSH_REMOTE_WRITES: i32 = 98;
    pub const HOST_REGISTER_SUPPORTED: i32 = 99;
    pub const VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED: i32 = 102;
    pub const HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED: i32 = 103;
    pub const MAX_BLOCKS_PER_MULTIPROCESSOR: i32 = 106;
    pub const MEMORY_POOLS_SUPPORTED: i32 = 115;
    pub const CAN_USE_64_BIT_STREAM_MEM_OPS: i32 = 122;
    pub const CAN_USE_STREAM_WAIT_VALUE_NOR: i32 = 123;
    /// One past the largest attribute of CUDA 12.9.
    pub const MAX: i32 = 144;
}

/// `CUuuid`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CUuuid {
    pub bytes: [u8; 16],
}

/// `CUmemLocation`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CUmemLocation {
    pub type_: c_int,
    pub id: c_int,
}

impl CUmemLocation {
    /// Device `ordinal`.
    pub fn device(ordinal: CUdevice) -> Self {
        Self {
            type_: CU_MEM_LOCATION_TYPE_DEVICE,
            id: ordinal,
        }
    }
}

/// `allocFlags` of `CUmemAllocationProp`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CUmemAllocFlags {
    pub compression_type: u8,
    pub gpu_direct_rdma_capable: u8,
    pub usage: u16,
    pub reserved: [u8; 4],
}

/// `CUmemAllocationProp` (32 bytes on LP64).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CUmemAllocationProp {
    pub type_: c_int,
    pub requested_handle_types: c_int,
    pub location: CUmemLocation,
    pub win32_handle_meta_data: *mut c_void,
    pub alloc_flags: CUmemAllocFlags,
}

impl CUmemAllocationProp {
    /// Plain (pinned) device memory on `device`, no export handle.
    pub fn device(device: CUdevice) -> Self {
        Self {
            type_: CU_MEM_ALLOCATION_TYPE_PINNED,
            requested_handle_types: 0,
            location: CUmemLocation::device(device),
            win32_handle_meta_data: std::ptr::null_mut(),
            alloc_flags: CUmemAllocFlags::default(),
        }
    }
}

/// `CUmemAccessDesc`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CUmemAccessDesc {
    pub location: CUmemLocation,
    pub flags: c_int,
}

/// `CUipcMemHandle`: 64 opaque bytes, passed by value.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CUipcMemHandle {
    pub reserved: [u8; 64],
}

/// `CUDA_MEMCPY2D` (`_v2`: `size_t` fields).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CUDA_MEMCPY2D {
    pub src_x_in_bytes: usize,
    pub src_y: usize,
    pub src_memory_type: c_uint,
    pub src_host: *const c_void,
    pub src_device: CUdeviceptr,
    pub src_array: *mut c_void,
    pub src_pitch: usize,
    pub dst_x_in_bytes: usize,
    pub dst_y: usize,
    pub dst_memory_type: c_uint,
    pub dst_host: *mut c_void,
    pub dst_device: CUdeviceptr,
    pub dst_array: *mut c_void,
    pub dst_pitch: usize,
    pub width_in_bytes: usize,
    pub height: usize,
}

/// `CUlaunchConfig`.
#[repr(C)]
#[derive(Debug)]
pub struct CUlaunchConfig {
    pub grid_dim_x: c_uint,
    pub grid_dim_y: c_uint,
    pub grid_dim_z: c_uint,
    pub block_dim_x: c_uint,
    pub block_dim_y: c_uint,
    pub block_dim_z: c_uint,
    pub shared_mem_bytes: c_uint,
    pub h_stream: CUstream,
    pub attrs: *mut c_void,
    pub num_attrs: c_uint,
}

/// `CUstreamBatchMemOpParams`, a 48-byte union in `cuda.h`, read through the
/// layout its members share: `waitValue` and `writeValue` are `{operation, address,
/// value (32-bit, little-endian, or value64), flags, alias}`; `flushRemoteWrites`
/// and `memoryBarrier` are `{operation, flags}` (here `op_flags`, at offset 4, where
/// the value operations have padding).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CUstreamBatchMemOpParams {
    pub operation: c_uint,
    pub op_flags: c_uint,
    pub address: CUdeviceptr,
    pub value: u64,
    pub flags: c_uint,
    pub _pad: c_uint,
    /// "For driver internal use. Initial value is unimportant."
    pub alias: CUdeviceptr,
    pub _rest: u64,
}

/// `CUcheckpointLockArgs` (cuda.h 12.8+); the other checkpoint argument structs are
/// 8 reserved words, all zero.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct CUcheckpointLockArgs {
    pub timeout_ms: c_uint,
    pub reserved0: c_uint,
    pub reserved1: [u64; 7],
}

const _: () = assert!(std::mem::size_of::<CUDA_MEMCPY2D>() == 128);
const _: () = assert!(std::mem::size_of::<CUstreamBatchMemOpParams>() == 48);
const _: () = assert!(std::mem::size_of::<CUmemAllocationProp>() == 32);
const _: () = assert!(std::mem::size_of::<CUmemAccessDesc>() == 12);
const _: () = assert!(std::mem::size_of::<CUmemLocation>() == 8);
const _: () = assert!(std::mem::size_of::<CUlaunchConfig>() == 56);
const _: () = assert!(std::mem::size_of::<CUcheckpointLockArgs>() == 64);
