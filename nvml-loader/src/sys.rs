//! NVML's C ABI, once (issue #40): return codes, structures, enumeration values,
//! struct version words and the signatures [`crate::Nvml`] calls, as NVIDIA's
//! `nvml.h` declares them (checked against the header in NVIDIA/go-nvml and the ctypes
//! structures of PyPI's `nvidia-ml-py`). The simulator's `libnvidia-ml.so.1`
//! implements these structures, the shim's NVML view (`shim/src/nvml.rs`) rewrites
//! them, and the loader reads them. Layout only: no behaviour lives here, and the
//! sizes are asserted at compile time (LP64: x86_64, aarch64).

use std::ffi::{c_char, c_int, c_uint, c_ulonglong, c_void};
use std::mem::size_of;

/// `nvmlReturn_t`.
pub type NvmlReturn = c_uint;
pub const NVML_SUCCESS: NvmlReturn = 0;
pub const NVML_ERROR_UNINITIALIZED: NvmlReturn = 1;
pub const NVML_ERROR_INVALID_ARGUMENT: NvmlReturn = 2;
pub const NVML_ERROR_NOT_SUPPORTED: NvmlReturn = 3;
pub const NVML_ERROR_NO_PERMISSION: NvmlReturn = 4;
pub const NVML_ERROR_NOT_FOUND: NvmlReturn = 6;
pub const NVML_ERROR_INSUFFICIENT_SIZE: NvmlReturn = 7;
pub const NVML_ERROR_DRIVER_NOT_LOADED: NvmlReturn = 9;
pub const NVML_ERROR_TIMEOUT: NvmlReturn = 10;
pub const NVML_ERROR_FUNCTION_NOT_FOUND: NvmlReturn = 13;
pub const NVML_ERROR_GPU_IS_LOST: NvmlReturn = 15;
pub const NVML_ERROR_ARGUMENT_VERSION_MISMATCH: NvmlReturn = 25;
pub const NVML_ERROR_UNKNOWN: NvmlReturn = 999;

/// `nvmlDevice_t`: an opaque pointer.
pub type Device = *mut c_void;
/// `nvmlEventSet_t`: an opaque pointer.
pub type EventSet = *mut c_void;

/// `NVML_DEVICE_UUID_V2_BUFFER_SIZE`, `NVML_DEVICE_NAME_V2_BUFFER_SIZE`,
/// `NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE`.
pub const UUID_BUFFER_SIZE: usize = 96;
pub const NAME_BUFFER_SIZE: usize = 96;
pub const DRIVER_VERSION_BUFFER_SIZE: usize = 80;

/// `NVML_STRUCT_VERSION(data, ver)`: the struct's size with the version in the top byte.
pub const fn struct_version(size: usize, version: u32) -> c_uint {
    size as c_uint | (version << 24)
}

/// `nvmlMemory_t` (`nvmlDeviceGetMemoryInfo`).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct Memory {
    pub total: c_ulonglong,
    pub free: c_ulonglong,
    pub used: c_ulonglong,
}

/// `nvmlMemory_v2_t` (`nvmlDeviceGetMemoryInfo_v2`).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct MemoryV2 {
    pub version: c_uint,
    pub total: c_ulonglong,
    pub reserved: c_ulonglong,
    pub free: c_ulonglong,
    pub used: c_ulonglong,
}

/// `nvmlMemory_v2`.
pub const NVML_MEMORY_V2: c_uint = struct_version(size_of::<MemoryV2>(), 2);

/// `nvmlProcessInfo_v1_t`: what the unversioned `nvmlDevice*RunningProcesses` fill.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct ProcessInfoV1 {
    pub pid: c_uint,
    pub used_gpu_memory: c_ulonglong,
}

/// `nvmlProcessInfo_v2_t`, also `nvmlProcessInfo_t`: what the `_v2` and `_v3`
/// `nvmlDevice*RunningProcesses` fill.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct ProcessInfoV2 {
    pub pid: c_uint,
    pub used_gpu_memory: c_ulonglong,
    pub gpu_instance_id: c_uint,
    pub compute_instance_id: c_uint,
}

/// `nvmlProcessInfo_t`.
pub type ProcessInfo = ProcessInfoV2;

/// `nvmlProcessDetail_v1_t` (`nvmlDeviceGetRunningProcessDetailList`, drivers ≥ 550).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct ProcessDetailV1 {
    pub pid: c_uint,
    pub used_gpu_memory: c_ulonglong,
    pub gpu_instance_id: c_uint,
    pub compute_instance_id: c_uint,
    pub used_gpu_cc_protected_memory: c_ulonglong,
}

/// `nvmlProcessDetailList_v1_t`: `mode` 0 lists compute processes, 1 graphics, 2 MPS.
#[repr(C)]
#[derive(Debug)]
pub struct ProcessDetailListV1 {
    pub version: c_uint,
    pub mode: c_uint,
    pub num_proc_array_entries: c_uint,
    pub proc_array: *mut ProcessDetailV1,
}

/// `nvmlProcessDetailList_v1`.
pub const NVML_PROCESS_DETAIL_LIST_V1: c_uint = struct_version(size_of::<ProcessDetailListV1>(), 1);

/// What `usedGpuMemory` holds where NVML cannot tell (no permission, WDDM).
pub const VALUE_NOT_AVAILABLE: c_ulonglong = c_ulonglong::MAX;

/// `gpuInstanceId` and `computeInstanceId` of a process on a GPU without MIG.
pub const NO_MIG_INSTANCE: c_uint = 0xFFFF_FFFF;

/// `nvmlProcessUtilizationSample_t`.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct ProcessUtilizationSample {
    pub pid: c_uint,
    /// CPU time stamp, microseconds since the Unix epoch.
    pub time_stamp: c_ulonglong,
    pub sm_util: c_uint,
    pub mem_util: c_uint,
    pub enc_util: c_uint,
    pub dec_util: c_uint,
}

/// `nvmlUtilization_t`.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct Utilization {
    pub gpu: c_uint,
    pub memory: c_uint,
}

/// `nvmlTemperature_v1_t` (`nvmlDeviceGetTemperatureV`).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct TemperatureV1 {
    pub version: c_uint,
    pub sensor_type: c_uint,
    pub temperature: c_int,
}

/// `nvmlTemperature_v1`.
pub const NVML_TEMPERATURE_V1: c_uint = struct_version(size_of::<TemperatureV1>(), 1);

/// `nvmlPciInfo_t` (the v3 layout `nvmlDeviceGetPciInfo_v3` and `_v2` fill).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct PciInfo {
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
#[derive(Debug, Clone, Copy)]
pub struct EventData {
    pub device: Device,
    pub event_type: c_ulonglong,
    pub event_data: c_ulonglong,
    pub gpu_instance_id: c_uint,
    pub compute_instance_id: c_uint,
}

/// `nvmlEventTypeXidCriticalError`.
pub const EVENT_TYPE_XID_CRITICAL_ERROR: c_ulonglong = 0x0000_0000_0000_0008;

/// `nvmlEnableState_t`.
pub const NVML_FEATURE_DISABLED: c_uint = 0;
pub const NVML_FEATURE_ENABLED: c_uint = 1;

/// `nvmlTemperatureSensors_t`: the one sensor, the GPU die.
pub const NVML_TEMPERATURE_GPU: c_uint = 0;

/// `nvmlClockType_t`: graphics, SM, memory, video (`NVML_CLOCK_COUNT` = 4).
pub const NVML_CLOCK_COUNT: c_uint = 4;

/// `nvmlPcieUtilCounter_t`: TX and RX bytes (`NVML_PCIE_UTIL_COUNT` = 2).
pub const NVML_PCIE_UTIL_COUNT: c_uint = 2;

/// `nvmlMemoryErrorType_t` and `nvmlEccCounterType_t` each have two values.
pub const NVML_MEMORY_ERROR_TYPE_COUNT: c_uint = 2;
pub const NVML_ECC_COUNTER_TYPE_COUNT: c_uint = 2;

/// `nvmlPstates_t`: `NVML_PSTATE_0`, maximum performance.
pub const NVML_PSTATE_0: c_uint = 0;

/// `nvmlComputeMode_t`: `NVML_COMPUTEMODE_DEFAULT`.
pub const NVML_COMPUTEMODE_DEFAULT: c_uint = 0;

/// `NVML_DEVICE_MIG_DISABLE`.
pub const NVML_DEVICE_MIG_DISABLE: c_uint = 0;

/// `nvmlDeviceArchitecture_t`: `NVML_DEVICE_ARCH_AMPERE`.
pub const NVML_DEVICE_ARCH_AMPERE: c_uint = 7;

/// `nvmlClocksEventReasonGpuIdle` (`nvmlClocksThrottleReasonGpuIdle`).
pub const CLOCKS_EVENT_REASON_GPU_IDLE: c_ulonglong = 0x1;

// The signatures the loader calls.
pub type Init = unsafe extern "C" fn() -> NvmlReturn;
pub type Shutdown = unsafe extern "C" fn() -> NvmlReturn;
pub type ErrorString = unsafe extern "C" fn(NvmlReturn) -> *const c_char;
pub type SystemGetDriverVersion = unsafe extern "C" fn(*mut c_char, c_uint) -> NvmlReturn;
pub type DeviceGetCount = unsafe extern "C" fn(*mut c_uint) -> NvmlReturn;
pub type DeviceGetHandleByIndex = unsafe extern "C" fn(c_uint, *mut Device) -> NvmlReturn;
pub type DeviceGetHandleByUuid = unsafe extern "C" fn(*const c_char, *mut Device) -> NvmlReturn;
pub type DeviceGetString = unsafe extern "C" fn(Device, *mut c_char, c_uint) -> NvmlReturn;
pub type DeviceGetMemoryInfo = unsafe extern "C" fn(Device, *mut Memory) -> NvmlReturn;
pub type DeviceGetMemoryInfoV2 = unsafe extern "C" fn(Device, *mut MemoryV2) -> NvmlReturn;
pub type DeviceGetUint = unsafe extern "C" fn(Device, *mut c_uint) -> NvmlReturn;
pub type DeviceGetPciInfo = unsafe extern "C" fn(Device, *mut PciInfo) -> NvmlReturn;
pub type DeviceGetProcesses =
    unsafe extern "C" fn(Device, *mut c_uint, *mut ProcessInfo) -> NvmlReturn;
pub type DeviceGetProcessesV1 =
    unsafe extern "C" fn(Device, *mut c_uint, *mut ProcessInfoV1) -> NvmlReturn;
pub type DeviceGetProcessDetailList =
    unsafe extern "C" fn(Device, *mut ProcessDetailListV1) -> NvmlReturn;
pub type DeviceGetProcessUtilization = unsafe extern "C" fn(
    Device,
    *mut ProcessUtilizationSample,
    *mut c_uint,
    c_ulonglong,
) -> NvmlReturn;
pub type EventSetCreate = unsafe extern "C" fn(*mut EventSet) -> NvmlReturn;
pub type DeviceRegisterEvents = unsafe extern "C" fn(Device, c_ulonglong, EventSet) -> NvmlReturn;
pub type DeviceGetSupportedEventTypes =
    unsafe extern "C" fn(Device, *mut c_ulonglong) -> NvmlReturn;
pub type EventSetWait = unsafe extern "C" fn(EventSet, *mut EventData, c_uint) -> NvmlReturn;
pub type EventSetFree = unsafe extern "C" fn(EventSet) -> NvmlReturn;

// The sizes nvml.h gives these structures on LP64 (x86_64, aarch64).
const _: () = assert!(size_of::<Memory>() == 24);
const _: () = assert!(size_of::<MemoryV2>() == 40 && NVML_MEMORY_V2 == 0x0200_0028);
const _: () = assert!(size_of::<ProcessInfoV1>() == 16);
const _: () = assert!(size_of::<ProcessInfoV2>() == 24);
const _: () = assert!(size_of::<ProcessDetailV1>() == 32);
const _: () =
    assert!(size_of::<ProcessDetailListV1>() == 24 && NVML_PROCESS_DETAIL_LIST_V1 == 0x0100_0018);
const _: () = assert!(size_of::<ProcessUtilizationSample>() == 32);
const _: () = assert!(size_of::<Utilization>() == 8);
const _: () = assert!(size_of::<TemperatureV1>() == 12 && NVML_TEMPERATURE_V1 == 0x0100_000C);
const _: () = assert!(size_of::<PciInfo>() == 68);
const _: () = assert!(size_of::<EventData>() == 32);
