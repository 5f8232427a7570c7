//! The C ABI of the CUDA driver, as `cuda.h` (CUDA 12.x) defines it: result codes,
//! handle types, flags and the few structs the simulator reads or writes. Values are
//! checked against the real header by the `c_program` test (it compiles a program
//! against `cuda.h` and runs it here).
#![allow(non_camel_case_types, dead_code)]

use std::ffi::c_void;

pub type CUresult = u32;
pub type CUdevice = i32;
pub type CUdeviceptr = u64;
pub type CUcontext = *mut c_void;
pub type CUstream = *mut c_void;
pub type CUevent = *mut c_void;
pub type CUmodule = *mut c_void;
pub type CUfunction = *mut c_void;
pub type CUlibrary = *mut c_void;
pub type CUkernel = *mut c_void;
pub type CUmemGenericAllocationHandle = u64;
pub type CUhostFn = Option<unsafe extern "C" fn(user_data: *mut c_void)>;
pub type CUstreamCallback =
    Option<unsafe extern "C" fn(stream: CUstream, status: CUresult, user_data: *mut c_void)>;

pub const CUDA_SUCCESS: CUresult = 0;
pub const CUDA_ERROR_INVALID_VALUE: CUresult = 1;
pub const CUDA_ERROR_OUT_OF_MEMORY: CUresult = 2;
pub const CUDA_ERROR_NOT_INITIALIZED: CUresult = 3;
pub const CUDA_ERROR_DEINITIALIZED: CUresult = 4;
pub const CUDA_ERROR_NO_DEVICE: CUresult = 100;
pub const CUDA_ERROR_INVALID_DEVICE: CUresult = 101;
pub const CUDA_ERROR_INVALID_IMAGE: CUresult = 200;
pub const CUDA_ERROR_INVALID_CONTEXT: CUresult = 201;
pub const CUDA_ERROR_CONTEXT_ALREADY_CURRENT: CUresult = 202;
pub const CUDA_ERROR_ALREADY_MAPPED: CUresult = 208;
pub const CUDA_ERROR_UNSUPPORTED_LIMIT: CUresult = 215;
pub const CUDA_ERROR_NOT_MAPPED: CUresult = 211;
pub const CUDA_ERROR_INVALID_SOURCE: CUresult = 300;
pub const CUDA_ERROR_FILE_NOT_FOUND: CUresult = 301;
pub const CUDA_ERROR_OPERATING_SYSTEM: CUresult = 304;
pub const CUDA_ERROR_INVALID_HANDLE: CUresult = 400;
pub const CUDA_ERROR_ILLEGAL_STATE: CUresult = 401;
pub const CUDA_ERROR_NOT_FOUND: CUresult = 500;
pub const CUDA_ERROR_NOT_READY: CUresult = 600;
pub const CUDA_ERROR_ILLEGAL_ADDRESS: CUresult = 700;
pub const CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES: CUresult = 701;
pub const CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE: CUresult = 708;
pub const CUDA_ERROR_CONTEXT_IS_DESTROYED: CUresult = 709;
pub const CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED: CUresult = 712;
pub const CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED: CUresult = 713;
pub const CUDA_ERROR_LAUNCH_FAILED: CUresult = 719;
pub const CUDA_ERROR_NOT_PERMITTED: CUresult = 800;
pub const CUDA_ERROR_NOT_SUPPORTED: CUresult = 801;
pub const CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED: CUresult = 900;
pub const CUDA_ERROR_STREAM_CAPTURE_INVALIDATED: CUresult = 901;
pub const CUDA_ERROR_STREAM_CAPTURE_UNJOINED: CUresult = 904;
pub const CUDA_ERROR_STREAM_CAPTURE_IMPLICIT: CUresult = 906;
pub const CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD: CUresult = 908;
pub const CUDA_ERROR_UNKNOWN: CUresult = 999;

/// (code, name, description) for `cuGetErrorName` / `cuGetErrorString`.
pub const ERRORS: &[(CUresult, &std::ffi::CStr, &std::ffi::CStr)] = &[
    (CUDA_SUCCESS, c"CUDA_SUCCESS", c"no error"),
    (
        CUDA_ERROR_INVALID_VALUE,
        c"CUDA_ERROR_INVALID_VALUE",
        c"invalid argument",
    ),
    (
        CUDA_ERROR_OUT_OF_MEMORY,
        c"CUDA_ERROR_OUT_OF_MEMORY",
        c"out of memory",
    ),
    (
        CUDA_ERROR_NOT_INITIALIZED,
        c"CUDA_ERROR_NOT_INITIALIZED",
        c"initialization error",
    ),
    (
        CUDA_ERROR_DEINITIALIZED,
        c"CUDA_ERROR_DEINITIALIZED",
        c"driver shutting down",
    ),
    (
        CUDA_ERROR_NO_DEVICE,
        c"CUDA_ERROR_NO_DEVICE",
        c"no CUDA-capable device is detected",
    ),
    (
        CUDA_ERROR_INVALID_DEVICE,
        c"CUDA_ERROR_INVALID_DEVICE",
        c"invalid device ordinal",
    ),
    (
        CUDA_ERROR_INVALID_IMAGE,
        c"CUDA_ERROR_INVALID_IMAGE",
        c"device kernel image is invalid",
    ),
    (
        CUDA_ERROR_INVALID_CONTEXT,
        c"CUDA_ERROR_INVALID_CONTEXT",
        c"invalid device context",
    ),
    (
        CUDA_ERROR_CONTEXT_ALREADY_CURRENT,
        c"CUDA_ERROR_CONTEXT_ALREADY_CURRENT",
        c"context already current",
    ),
    (
        CUDA_ERROR_ALREADY_MAPPED,
        c"CUDA_ERROR_ALREADY_MAPPED",
        c"resource already mapped",
    ),
    (
        CUDA_ERROR_UNSUPPORTED_LIMIT,
        c"CUDA_ERROR_UNSUPPORTED_LIMIT",
        c"limit is not supported on this architecture",
    ),
    (
        CUDA_ERROR_NOT_MAPPED,
        c"CUDA_ERROR_NOT_MAPPED",
        c"resource not mapped",
    ),
    (
        CUDA_ERROR_INVALID_SOURCE,
        c"CUDA_ERROR_INVALID_SOURCE",
        c"device kernel image is invalid",
    ),
    (
        CUDA_ERROR_FILE_NOT_FOUND,
        c"CUDA_ERROR_FILE_NOT_FOUND",
        c"file not found",
    ),
    (
        CUDA_ERROR_OPERATING_SYSTEM,
        c"CUDA_ERROR_OPERATING_SYSTEM",
        c"OS call failed or operation not supported on this OS",
    ),
    (
        CUDA_ERROR_INVALID_HANDLE,
        c"CUDA_ERROR_INVALID_HANDLE",
        c"invalid resource handle",
    ),
    (
        CUDA_ERROR_ILLEGAL_STATE,
        c"CUDA_ERROR_ILLEGAL_STATE",
        c"the operation cannot be performed in the present state",
    ),
    (
        CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
        c"CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
        c"operation not permitted when stream is capturing",
    ),
    (
        CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,
        c"CUDA_ERROR_STREAM_CAPTURE_INVALIDATED",
        c"operation failed due to a previous error during capture",
    ),
    (
        CUDA_ERROR_STREAM_CAPTURE_UNJOINED,
        c"CUDA_ERROR_STREAM_CAPTURE_UNJOINED",
        c"capture sequence contains a fork that was not joined to the primary stream",
    ),
    (
        CUDA_ERROR_STREAM_CAPTURE_IMPLICIT,
        c"CUDA_ERROR_STREAM_CAPTURE_IMPLICIT",
        c"operation would make the legacy stream depend on a capturing blocking stream",
    ),
    (
        CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD,
        c"CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD",
        c"attempt to terminate a thread-local capture sequence from another thread",
    ),
    (
        CUDA_ERROR_NOT_FOUND,
        c"CUDA_ERROR_NOT_FOUND",
        c"named symbol not found",
    ),
    (
        CUDA_ERROR_NOT_READY,
        c"CUDA_ERROR_NOT_READY",
        c"device not ready",
    ),
    (
        CUDA_ERROR_ILLEGAL_ADDRESS,
        c"CUDA_ERROR_ILLEGAL_ADDRESS",
        c"an illegal memory access was encountered",
    ),
    (
        CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES,
        c"CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES",
        c"too many resources requested for launch",
    ),
    (
        CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE,
        c"CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE",
        c"primary context active",
    ),
    (
        CUDA_ERROR_CONTEXT_IS_DESTROYED,
        c"CUDA_ERROR_CONTEXT_IS_DESTROYED",
        c"context is destroyed",
    ),
    (
        CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED,
        c"CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED",
        c"part or all of the requested memory range is already mapped",
    ),
    (
        CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED,
        c"CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED",
        c"pointer does not correspond to a registered memory region",
    ),
    (
        CUDA_ERROR_LAUNCH_FAILED,
        c"CUDA_ERROR_LAUNCH_FAILED",
        c"unspecified launch failure",
    ),
    (
        CUDA_ERROR_NOT_PERMITTED,
        c"CUDA_ERROR_NOT_PERMITTED",
        c"operation not permitted",
    ),
    (
        CUDA_ERROR_NOT_SUPPORTED,
        c"CUDA_ERROR_NOT_SUPPORTED",
        c"operation not supported",
    ),
    (CUDA_ERROR_UNKNOWN, c"CUDA_ERROR_UNKNOWN", c"unknown error"),
];

/// `CU_STREAM_LEGACY` and `CU_STREAM_PER_THREAD` special handles.
pub const CU_STREAM_LEGACY: usize = 1;
pub const CU_STREAM_PER_THREAD: usize = 2;
pub const CU_STREAM_NON_BLOCKING: u32 = 1;
pub const CU_STREAM_CAPTURE_STATUS_NONE: i32 = 0;
pub const CU_STREAM_CAPTURE_STATUS_ACTIVE: i32 = 1;
pub const CU_STREAM_CAPTURE_STATUS_INVALIDATED: i32 = 2;
pub const CU_STREAM_CAPTURE_MODE_GLOBAL: u32 = 0;
pub const CU_STREAM_CAPTURE_MODE_THREAD_LOCAL: u32 = 1;
pub const CU_STREAM_CAPTURE_MODE_RELAXED: u32 = 2;

pub const CU_EVENT_DISABLE_TIMING: u32 = 2;

pub const CU_GET_PROC_ADDRESS_DEFAULT: u64 = 0;
pub const CU_GET_PROC_ADDRESS_LEGACY_STREAM: u64 = 1;
pub const CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM: u64 = 2;
pub const CU_GET_PROC_ADDRESS_SUCCESS: i32 = 0;
pub const CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND: i32 = 1;
pub const CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT: i32 = 2;

pub const CU_MEM_ALLOCATION_TYPE_PINNED: i32 = 1;
pub const CU_MEM_LOCATION_TYPE_DEVICE: i32 = 1;
/// `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`: shareable as a file descriptor.
pub const CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR: i32 = 1;
/// `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`, the one `cuIpcOpenMemHandle` flag.
pub const CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS: u32 = 1;
pub const CU_MEM_ACCESS_FLAGS_PROT_NONE: i32 = 0;
pub const CU_MEM_ACCESS_FLAGS_PROT_READ: i32 = 1;
pub const CU_MEM_ACCESS_FLAGS_PROT_READWRITE: i32 = 3;

pub const CU_LAUNCH_PARAM_END: usize = 0;
pub const CU_LAUNCH_PARAM_BUFFER_POINTER: usize = 1;
pub const CU_LAUNCH_PARAM_BUFFER_SIZE: usize = 2;

/// `CU_MEMHOSTALLOC_DEVICEMAP` / `CU_MEMHOSTREGISTER_DEVICEMAP` (the same bit):
/// the host memory is mapped into the device address space.
pub const CU_MEMHOST_DEVICEMAP: u32 = 0x02;
/// `CU_MEMHOSTREGISTER_READ_ONLY`: the device may only read the registered range.
pub const CU_MEMHOSTREGISTER_READ_ONLY: u32 = 0x08;

/// `CUstreamWaitValue_flags`: the condition (low bits) and the flush bit.
pub const CU_STREAM_WAIT_VALUE_GEQ: u32 = 0x0;
pub const CU_STREAM_WAIT_VALUE_EQ: u32 = 0x1;
pub const CU_STREAM_WAIT_VALUE_AND: u32 = 0x2;
pub const CU_STREAM_WAIT_VALUE_NOR: u32 = 0x3;
pub const CU_STREAM_WAIT_VALUE_FLUSH: u32 = 1 << 30;
/// `CUstreamWriteValue_flags` (`NO_MEMORY_BARRIER`: "not supported in the v2 API").
pub const CU_STREAM_WRITE_VALUE_DEFAULT: u32 = 0x0;
pub const CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER: u32 = 0x1;
/// `CUstreamBatchMemOpType`.
pub const CU_STREAM_MEM_OP_WAIT_VALUE_32: u32 = 1;
pub const CU_STREAM_MEM_OP_WRITE_VALUE_32: u32 = 2;
pub const CU_STREAM_MEM_OP_FLUSH_REMOTE_WRITES: u32 = 3;
pub const CU_STREAM_MEM_OP_WAIT_VALUE_64: u32 = 4;
pub const CU_STREAM_MEM_OP_WRITE_VALUE_64: u32 = 5;
/// Only in the `_v2` API.
pub const CU_STREAM_MEM_OP_BARRIER: u32 = 6;
/// `CUstreamMemoryBarrier_flags`.
pub const CU_STREAM_MEMORY_BARRIER_TYPE_SYS: u32 = 0x0;
pub const CU_STREAM_MEMORY_BARRIER_TYPE_GPU: u32 = 0x1;

pub const CU_MEM_ATTACH_GLOBAL: u32 = 1;
pub const CU_MEM_ATTACH_HOST: u32 = 2;
pub const CU_DEVICE_CPU: i32 = -1;
pub const CU_MEM_LOCATION_TYPE_HOST: i32 = 2;

/// `CU_POINTER_ATTRIBUTE_*` the simulator answers.
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

pub const CU_MEMORYTYPE_HOST: u32 = 1;
pub const CU_MEMORYTYPE_DEVICE: u32 = 2;
pub const CU_MEMORYTYPE_ARRAY: u32 = 3;
pub const CU_MEMORYTYPE_UNIFIED: u32 = 4;

/// `CUDA_MEMCPY2D` (`_v2`, size_t fields).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CudaMemcpy2D {
    pub src_x_in_bytes: usize,
    pub src_y: usize,
    pub src_memory_type: u32,
    pub src_host: *const c_void,
    pub src_device: CUdeviceptr,
    pub src_array: *mut c_void,
    pub src_pitch: usize,
    pub dst_x_in_bytes: usize,
    pub dst_y: usize,
    pub dst_memory_type: u32,
    pub dst_host: *mut c_void,
    pub dst_device: CUdeviceptr,
    pub dst_array: *mut c_void,
    pub dst_pitch: usize,
    pub width_in_bytes: usize,
    pub height: usize,
}

const _: () = assert!(std::mem::size_of::<CudaMemcpy2D>() == 128);

/// `CUuuid`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CUuuid {
    pub bytes: [u8; 16],
}

/// `CUmemLocation`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CUmemLocation {
    pub type_: i32,
    pub id: i32,
}

/// `allocFlags` of `CUmemAllocationProp`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CUmemAllocFlags {
    pub compression_type: u8,
    pub gpu_direct_rdma_capable: u8,
    pub usage: u16,
    pub reserved: [u8; 4],
}

/// `CUmemAllocationProp` (32 bytes on LP64).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CUmemAllocationProp {
    pub type_: i32,
    pub requested_handle_types: i32,
    pub location: CUmemLocation,
    pub win32_handle_meta_data: *mut c_void,
    pub alloc_flags: CUmemAllocFlags,
}

/// `CUipcMemHandle`: 64 opaque bytes, passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CUipcMemHandle {
    pub reserved: [u8; 64],
}

/// `CUmemAccessDesc`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CUmemAccessDesc {
    pub location: CUmemLocation,
    pub flags: i32,
}

/// `CUlaunchConfig`.
#[repr(C)]
pub struct CUlaunchConfig {
    pub grid_dim_x: u32,
    pub grid_dim_y: u32,
    pub grid_dim_z: u32,
    pub block_dim_x: u32,
    pub block_dim_y: u32,
    pub block_dim_z: u32,
    pub shared_mem_bytes: u32,
    pub h_stream: CUstream,
    pub attrs: *mut c_void,
    pub num_attrs: u32,
}

/// `CUstreamBatchMemOpParams`, a 48-byte union in `cuda.h`, read through the
/// layout its members share: `waitValue` and `writeValue` are `{operation, address,
/// value (32-bit, little-endian, or value64), flags, alias}`; `flushRemoteWrites`
/// and `memoryBarrier` are `{operation, flags}` (here `op_flags`, at offset 4, where
/// the value operations have padding).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CUstreamBatchMemOpParams {
    pub operation: u32,
    pub op_flags: u32,
    pub address: CUdeviceptr,
    pub value: u64,
    pub flags: u32,
    pub _pad: u32,
    /// "For driver internal use. Initial value is unimportant."
    pub alias: CUdeviceptr,
    pub _rest: u64,
}

const _: () = assert!(std::mem::size_of::<CUstreamBatchMemOpParams>() == 48);
const _: () = assert!(std::mem::size_of::<CUmemAllocationProp>() == 32);
const _: () = assert!(std::mem::size_of::<CUmemAccessDesc>() == 12);
const _: () = assert!(std::mem::size_of::<CUlaunchConfig>() == 56);

/// `CU_DEVICE_ATTRIBUTE_*` values the simulator answers (others read as 0).
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
    /// One past the largest attribute of CUDA 12.9 (`CU_DEVICE_ATTRIBUTE_MAX`).
    pub const MAX: i32 = 144;
}
