//! NVML's C types, as NVIDIA's `nvml.h` declares them: the one copy in
//! [`kiwi_nvml::sys`] (issue #40), and the simulator's own handle representation.

pub(crate) use kiwi_nvml::sys::{
    EventData, Memory, MemoryV2, NvmlReturn, PciInfo, ProcessInfoV1, ProcessInfoV2,
    ProcessUtilizationSample, TemperatureV1, Utilization, CLOCKS_EVENT_REASON_GPU_IDLE,
    EVENT_TYPE_XID_CRITICAL_ERROR, NO_MIG_INSTANCE, NVML_CLOCK_COUNT, NVML_COMPUTEMODE_DEFAULT,
    NVML_DEVICE_ARCH_AMPERE, NVML_DEVICE_MIG_DISABLE, NVML_ECC_COUNTER_TYPE_COUNT,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH, NVML_ERROR_DRIVER_NOT_LOADED,
    NVML_ERROR_FUNCTION_NOT_FOUND, NVML_ERROR_GPU_IS_LOST, NVML_ERROR_INSUFFICIENT_SIZE,
    NVML_ERROR_INVALID_ARGUMENT, NVML_ERROR_NOT_FOUND, NVML_ERROR_NOT_SUPPORTED,
    NVML_ERROR_NO_PERMISSION, NVML_ERROR_TIMEOUT, NVML_ERROR_UNINITIALIZED, NVML_ERROR_UNKNOWN,
    NVML_FEATURE_DISABLED, NVML_FEATURE_ENABLED, NVML_MEMORY_ERROR_TYPE_COUNT, NVML_MEMORY_V2,
    NVML_PCIE_UTIL_COUNT, NVML_PSTATE_0, NVML_SUCCESS, NVML_TEMPERATURE_GPU, NVML_TEMPERATURE_V1,
};

/// `nvmlDevice_t`: an opaque pointer. Ours are `index + 1` (never NULL).
pub(crate) type Device = usize;
/// `nvmlEventSet_t`: an opaque pointer (a boxed event set, see `crate::events`).
pub(crate) type EventSet = usize;
