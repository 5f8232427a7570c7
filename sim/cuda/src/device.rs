//! What the driver says about itself and its devices: `cuInit`, the driver version,
//! device enumeration, names, UUIDs, memory, attributes and PCI ids, and the error
//! strings. Bodies of the exports `crate::exports` lists.

use std::ffi::c_char;

use kiwi_sim_core::ident;

use crate::abi::*;
use crate::driver::{self, driver, Driver};
use crate::ffi::{out, write_c_string};
use crate::memop;

/// The driver version the simulator claims (CUDA 12.4).
pub const DRIVER_VERSION: i32 = 12040;

/// `cuInit`.
pub(crate) fn init(flags: u32) -> Result<(), CUresult> {
    if flags != 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let d = driver::init()?;
    // The restore thread of the checkpoint API, once (as the real driver's).
    static STARTED: std::sync::Once = std::sync::Once::new();
    STARTED.call_once(|| crate::checkpoint::start(d));
    Ok(())
}

/// `cuDeviceGet`.
pub(crate) fn get(dev: *mut CUdevice, ordinal: i32) -> Result<(), CUresult> {
    let d = driver()?;
    d.device(ordinal)?;
    out(dev, ordinal)
}

/// `cuDeviceGetCount`.
pub(crate) fn count(count: *mut i32) -> Result<(), CUresult> {
    out(count, driver()?.gpus as i32)
}

/// `cuDeviceGetName`.
pub(crate) fn name(name: *mut c_char, len: i32, dev: CUdevice) -> Result<(), CUresult> {
    driver()?.device(dev)?;
    write_c_string(name, len, ident::DEVICE_NAME)
}

/// `cuDeviceGetUuid` and its `_v2`.
pub(crate) fn uuid(uuid: *mut CUuuid, dev: CUdevice) -> Result<(), CUresult> {
    let d = driver()?;
    let g = d.device(dev)?;
    out(
        uuid,
        CUuuid {
            bytes: ident::gpu_uuid(&d.name, g),
        },
    )
}

/// `cuDeviceTotalMem_v2`.
pub(crate) fn total_mem(bytes: *mut usize, dev: CUdevice) -> Result<(), CUresult> {
    let d = driver()?;
    let g = d.device(dev)?;
    let cap = d
        .machine
        .capacity(g)
        .map_err(|_| CUDA_ERROR_INVALID_DEVICE)?;
    out(bytes, cap as usize)
}

pub(crate) fn attribute_value(d: &Driver, a: i32, g: u32) -> Result<i32, CUresult> {
    use crate::abi::attr::*;
    Ok(match a {
        MAX_THREADS_PER_BLOCK => 1024,
        MAX_BLOCK_DIM_X | MAX_BLOCK_DIM_Y => 1024,
        MAX_BLOCK_DIM_Z => 64,
        MAX_GRID_DIM_X => i32::MAX,
        MAX_GRID_DIM_Y | MAX_GRID_DIM_Z => 65535,
        MAX_SHARED_MEMORY_PER_BLOCK => 48 << 10,
        TOTAL_CONSTANT_MEMORY => 64 << 10,
        WARP_SIZE => 32,
        MAX_PITCH => i32::MAX,
        MAX_REGISTERS_PER_BLOCK | MAX_REGISTERS_PER_MULTIPROCESSOR => 65536,
        CLOCK_RATE => 1_755_000,
        TEXTURE_ALIGNMENT => 512,
        GPU_OVERLAP | CONCURRENT_KERNELS | UNIFIED_ADDRESSING | CAN_MAP_HOST_MEMORY => 1,
        MULTIPROCESSOR_COUNT => 108,
        INTEGRATED | COMPUTE_MODE | ECC_ENABLED | PCI_DOMAIN_ID | PCI_DEVICE_ID => 0,
        PCI_BUS_ID => ident::pci_bus(g) as i32,
        MEMORY_CLOCK_RATE => 1_593_000,
        GLOBAL_MEMORY_BUS_WIDTH => 5120,
        L2_CACHE_SIZE => 40 << 20,
        MAX_THREADS_PER_MULTIPROCESSOR => 2048,
        ASYNC_ENGINE_COUNT => 2,
        COMPUTE_CAPABILITY_MAJOR => 8,
        COMPUTE_CAPABILITY_MINOR => 0,
        STREAM_PRIORITIES_SUPPORTED | COOPERATIVE_LAUNCH | HOST_REGISTER_SUPPORTED => 1,
        MAX_SHARED_MEMORY_PER_MULTIPROCESSOR => 164 << 10,
        MAX_SHARED_MEMORY_PER_BLOCK_OPTIN => 163 << 10,
        VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED | MEMORY_POOLS_SUPPORTED => 1,
        HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED => 1,
        MANAGED_MEMORY | CONCURRENT_MANAGED_ACCESS => 0,
        MAX_BLOCKS_PER_MULTIPROCESSOR => 32,
        // Registered host memory is reached at its host address
        // (`cuMemHostGetDevicePointer` gives the host pointer back).
        CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM => 1,
        // Stream memory operations: the v2 API with 64-bit words, NOR and flushes;
        // the v1 API only with `NVreg_EnableStreamMemOPs=1` (`crate::memop`).
        CAN_USE_64_BIT_STREAM_MEM_OPS | CAN_USE_STREAM_WAIT_VALUE_NOR => 1,
        CAN_FLUSH_REMOTE_WRITES => 1,
        CAN_USE_STREAM_MEM_OPS_V1
        | CAN_USE_64_BIT_STREAM_MEM_OPS_V1
        | CAN_USE_STREAM_WAIT_VALUE_NOR_V1 => i32::from(memop::V1_ENABLED),
        a if a > 0 && a < MAX => {
            let _ = d;
            0
        }
        _ => return Err(CUDA_ERROR_INVALID_VALUE),
    })
}

/// `cuDeviceGetAttribute`.
pub(crate) fn attribute(pi: *mut i32, attrib: i32, dev: CUdevice) -> Result<(), CUresult> {
    let d = driver()?;
    let g = d.device(dev)?;
    out(pi, attribute_value(d, attrib, g)?)
}

/// `cuDeviceComputeCapability`.
pub(crate) fn compute_capability(
    major: *mut i32,
    minor: *mut i32,
    dev: CUdevice,
) -> Result<(), CUresult> {
    driver()?.device(dev)?;
    out(major, 8)?;
    out(minor, 0)
}

/// `cuDeviceGetPCIBusId`.
pub(crate) fn pci_bus_id(bus: *mut c_char, len: i32, dev: CUdevice) -> Result<(), CUresult> {
    let g = driver()?.device(dev)?;
    // cuda's form has a 4-digit domain: 0000:BB:00.0
    let id = ident::pci_bus_id(g);
    write_c_string(bus, len, &id[4..])
}

/// `cuDeviceCanAccessPeer`: never (no peer access is simulated).
pub(crate) fn can_access_peer(
    can: *mut i32,
    dev: CUdevice,
    peer: CUdevice,
) -> Result<(), CUresult> {
    let d = driver()?;
    d.device(dev)?;
    d.device(peer)?;
    out(can, 0)
}

/// Which text of a result code `cuGetErrorName` / `cuGetErrorString` answer.
pub enum ErrorText {
    Name,
    Description,
}

/// `cuGetErrorName`, `cuGetErrorString`: from the one table of `kiwi_cuda::result`;
/// an unknown code is `CUDA_ERROR_INVALID_VALUE`, with NULL written.
pub(crate) fn error_text(
    e: CUresult,
    s: *mut *const c_char,
    which: ErrorText,
) -> Result<(), CUresult> {
    match ERRORS.iter().find(|x| x.0 == e) {
        Some(x) => out(
            s,
            match which {
                ErrorText::Name => x.1.as_ptr(),
                ErrorText::Description => x.2.as_ptr(),
            },
        ),
        None => {
            let _ = out(s, std::ptr::null());
            Err(CUDA_ERROR_INVALID_VALUE)
        }
    }
}
