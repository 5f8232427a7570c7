//! NVML's C types, as NVIDIA's `nvml.h` declares them (checked against the header in
//! NVIDIA/go-nvml and the ctypes structures of PyPI's `nvidia-ml-py`): return codes,
//! structures, enumeration values and struct version words. Layout only: no
//! behaviour lives here, and the sizes are asserted at compile time (LP64).

use std::ffi::{c_char, c_int, c_uint};
use std::mem::size_of;

/// `nvmlReturn_t`.
pub(crate) type NvmlReturn = u32;
pub(crate) const NVML_SUCCESS: NvmlReturn = 0;
pub(crate) const NVML_ERROR_UNINITIALIZED: NvmlReturn = 1;
pub(crate) const NVML_ERROR_INVALID_ARGUMENT: NvmlReturn = 2;
pub(crate) const NVML_ERROR_NOT_SUPPORTED: NvmlReturn = 3;
pub(crate) const NVML_ERROR_NO_PERMISSION: NvmlReturn = 4;
pub(crate) const NVML_ERROR_NOT_FOUND: NvmlReturn = 6;
pub(crate) const NVML_ERROR_INSUFFICIENT_SIZE: NvmlReturn = 7;
pub(crate) const NVML_ERROR_DRIVER_NOT_LOADED: NvmlReturn = 9;
pub(crate) const NVML_ERROR_TIMEOUT: NvmlReturn = 10;
pub(crate) const NVML_ERROR_FUNCTION_NOT_FOUND: NvmlReturn = 13;
pub(crate) const NVML_ERROR_GPU_IS_LOST: NvmlReturn = 15;
pub(crate) const NVML_ERROR_ARGUMENT_VERSION_MISMATCH: NvmlReturn = 25;
pub(crate) const NVML_ERROR_UNKNOWN: NvmlReturn = 999;

/// `nvmlDevice_t`: an opaque pointer. Ours are `index + 1` (never NULL).
pub(crate) type Device = usize;
/// `nvmlEventSet_t`: an opaque pointer (a boxed event set, see `crate::events`).
pub(crate) type EventSet = usize;

/// `NVML_STRUCT_VERSION(data, ver)`: the struct's size with the version in the top byte.
const fn struct_version(size: usize, version: u32) -> c_uint {
    size as c_uint | (version << 24)
}

/// `nvmlMemory_t` (`nvmlDeviceGetMemoryInfo`).
#[repr(C)]
pub(crate) struct Memory {
    pub total: u64,
    pub free: u64,
    pub used: u64,
}

/// `nvmlMemory_v2_t` (`nvmlDeviceGetMemoryInfo_v2`).
#[repr(C)]
pub(crate) struct MemoryV2 {
    pub version: c_uint,
    pub total: u64,
    pub reserved: u64,
    pub free: u64,
    pub used: u64,
}

/// `nvmlMemory_v2`.
pub(crate) const NVML_MEMORY_V2: c_uint = struct_version(size_of::<MemoryV2>(), 2);

/// `nvmlProcessInfo_v1_t`: what the unversioned `nvmlDevice*RunningProcesses` fill.
#[repr(C)]
pub(crate) struct ProcessInfoV1 {
    pub pid: c_uint,
    pub used_gpu_memory: u64,
}

/// `nvmlProcessInfo_v2_t`, also `nvmlProcessInfo_t`: what the `_v2` and `_v3`
/// `nvmlDevice*RunningProcesses` fill.
#[repr(C)]
pub(crate) struct ProcessInfoV2 {
    pub pid: c_uint,
    pub used_gpu_memory: u64,
    pub gpu_instance_id: c_uint,
    pub compute_instance_id: c_uint,
}

/// `gpuInstanceId` and `computeInstanceId` of a process on a GPU without MIG.
pub(crate) const NO_MIG_INSTANCE: c_uint = 0xFFFF_FFFF;

/// `nvmlProcessUtilizationSample_t`.
#[repr(C)]
pub(crate) struct ProcessUtilizationSample {
    pub pid: c_uint,
    /// CPU time stamp, microseconds since the Unix epoch.
    pub time_stamp: u64,
    pub sm_util: c_uint,
    pub mem_util: c_uint,
    pub enc_util: c_uint,
    pub dec_util: c_uint,
}

/// `nvmlUtilization_t`.
#[repr(C)]
pub(crate) struct Utilization {
    pub gpu: c_uint,
    pub memory: c_uint,
}

/// `nvmlTemperature_v1_t` (`nvmlDeviceGetTemperatureV`).
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct TemperatureV1 {
    pub version: c_uint,
    pub sensor_type: c_uint,
    pub temperature: c_int,
}

/// `nvmlTemperature_v1`.
pub(crate) const NVML_TEMPERATURE_V1: c_uint = struct_version(size_of::<TemperatureV1>(), 1);

/// `nvmlPciInfo_t` (the v3 layout `nvmlDeviceGetPciInfo_v3` and `_v2` fill).
#[repr(C)]
pub(crate) struct PciInfo {
    pub bus_id_legacy: [c_char; 16],
    pub domain: c_uint,
    pub bus: c_uint,
    pub device: c_uint,
    pub pci_device_id: c_uint,
    pub pci_sub_system_id: c_uint,
    pub bus_id: [c_char; 32],
}

/// `nvmlEventData_t`.
#[repr(C)]
pub(crate) struct EventData {
    pub device: Device,
    pub event_type: u64,
    pub event_data: u64,
    pub gpu_instance_id: c_uint,
    pub compute_instance_id: c_uint,
}

/// `nvmlEventTypeXidCriticalError`.
pub(crate) const EVENT_TYPE_XID_CRITICAL_ERROR: u64 = 0x8;

/// `nvmlEnableState_t`.
pub(crate) const NVML_FEATURE_DISABLED: c_uint = 0;
pub(crate) const NVML_FEATURE_ENABLED: c_uint = 1;

/// `nvmlTemperatureSensors_t`: the one sensor, the GPU die.
pub(crate) const NVML_TEMPERATURE_GPU: c_uint = 0;

/// `nvmlClockType_t`: graphics, SM, memory, video (`NVML_CLOCK_COUNT` = 4).
pub(crate) const NVML_CLOCK_COUNT: c_uint = 4;

/// `nvmlPcieUtilCounter_t`: TX and RX bytes (`NVML_PCIE_UTIL_COUNT` = 2).
pub(crate) const NVML_PCIE_UTIL_COUNT: c_uint = 2;

/// `nvmlMemoryErrorType_t` and `nvmlEccCounterType_t` each have two values.
pub(crate) const NVML_MEMORY_ERROR_TYPE_COUNT: c_uint = 2;
pub(crate) const NVML_ECC_COUNTER_TYPE_COUNT: c_uint = 2;

/// `nvmlPstates_t`: `NVML_PSTATE_0`, maximum performance.
pub(crate) const NVML_PSTATE_0: c_uint = 0;

/// `nvmlComputeMode_t`: `NVML_COMPUTEMODE_DEFAULT`.
pub(crate) const NVML_COMPUTEMODE_DEFAULT: c_uint = 0;

/// `NVML_DEVICE_MIG_DISABLE`.
pub(crate) const NVML_DEVICE_MIG_DISABLE: c_uint = 0;

/// `nvmlDeviceArchitecture_t`: `NVML_DEVICE_ARCH_AMPERE`.
pub(crate) const NVML_DEVICE_ARCH_AMPERE: c_uint = 7;

/// `nvmlClocksEventReasonGpuIdle` (`nvmlClocksThrottleReasonGpuIdle`).
pub(crate) const CLOCKS_EVENT_REASON_GPU_IDLE: u64 = 0x1;

// The sizes nvml.h gives these structures on LP64 (x86_64, aarch64).
const _: () = assert!(size_of::<Memory>() == 24);
const _: () = assert!(size_of::<MemoryV2>() == 40 && NVML_MEMORY_V2 == 0x0200_0028);
const _: () = assert!(size_of::<ProcessInfoV1>() == 16);
const _: () = assert!(size_of::<ProcessInfoV2>() == 24);
const _: () = assert!(size_of::<ProcessUtilizationSample>() == 32);
const _: () = assert!(size_of::<Utilization>() == 8);
const _: () = assert!(size_of::<TemperatureV1>() == 12 && NVML_TEMPERATURE_V1 == 0x0100_000C);
const _: () = assert!(size_of::<PciInfo>() == 68);
const _: () = assert!(size_of::<EventData>() == 32);
