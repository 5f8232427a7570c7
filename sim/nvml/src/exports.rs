//! Every symbol `libnvidia-ml.so.1` exports, generated from the one declaration list
//! below: each entry is the C signature as `nvml.h` declares it and the function of
//! an area module that implements it. Versioned names share an implementation where
//! their structures agree (`_v2` and `_v3` process lists both fill
//! `nvmlProcessInfo_v2_t`). Each runs through [`guard`]: no panic crosses the C ABI.
//!
//! Only `nvmlErrorString`, which returns a string rather than an `nvmlReturn_t`, is
//! written out by hand below the list.
//!
//! A function a tool calls that is missing here is `NVML_ERROR_FUNCTION_NOT_FOUND` to
//! it (pynvml raises `NVMLError_FunctionNotFound`, which gpustat and nvitop do not
//! treat as "not supported"): add an entry answering `NVML_ERROR_NOT_SUPPORTED`
//! rather than leave a name out.

#![allow(non_snake_case)]

use std::ffi::{c_char, c_int, c_uint};

use crate::abi::*;
use crate::ffi::guard;
use crate::memory::Contexts::{Compute, Graphics, Mps};
use crate::{device, events, memory, modes, system, telemetry};

macro_rules! exports {
    ($( $name:ident ( $($arg:ident : $ty:ty),* $(,)? ) => $($call:ident)::+ ( $($pass:expr),* $(,)? ); )*) => {
        $(
            #[no_mangle]
            extern "C" fn $name($($arg: $ty),*) -> NvmlReturn {
                guard(|| $($call)::+($($pass),*))
            }
        )*
    };
}

exports! {
    // System.
    nvmlInit_v2() => system::init();
    nvmlInit() => system::init();
    nvmlInitWithFlags(_flags: c_uint) => system::init();
    nvmlShutdown() => system::shutdown();
    nvmlSystemGetDriverVersion(version: *mut c_char, length: c_uint) => system::driver_version(version, length);
    nvmlSystemGetNVMLVersion(version: *mut c_char, length: c_uint) => system::nvml_version(version, length);
    nvmlSystemGetCudaDriverVersion(v: *mut c_int) => system::cuda_driver_version(v);
    nvmlSystemGetCudaDriverVersion_v2(v: *mut c_int) => system::cuda_driver_version(v);
    nvmlSystemGetProcessName(pid: c_uint, name: *mut c_char, length: c_uint) => system::process_name(pid, name, length);

    // Identity.
    nvmlDeviceGetCount_v2(count: *mut c_uint) => device::count(count);
    nvmlDeviceGetCount(count: *mut c_uint) => device::count(count);
    nvmlDeviceGetHandleByIndex_v2(index: c_uint, d: *mut Device) => device::handle_by_index(index, d);
    nvmlDeviceGetHandleByIndex(index: c_uint, d: *mut Device) => device::handle_by_index(index, d);
    nvmlDeviceGetHandleByUUID(uuid: *const c_char, d: *mut Device) => device::handle_by_uuid(uuid, d);
    nvmlDeviceGetHandleByPciBusId_v2(bus_id: *const c_char, d: *mut Device) => device::handle_by_pci_bus_id(bus_id, d);
    nvmlDeviceGetHandleByPciBusId(bus_id: *const c_char, d: *mut Device) => device::handle_by_pci_bus_id(bus_id, d);
    nvmlDeviceGetIndex(d: Device, index: *mut c_uint) => device::index(d, index);
    nvmlDeviceGetMinorNumber(d: Device, minor: *mut c_uint) => device::minor_number(d, minor);
    nvmlDeviceGetUUID(d: Device, uuid: *mut c_char, length: c_uint) => device::uuid(d, uuid, length);
    nvmlDeviceGetName(d: Device, name: *mut c_char, length: c_uint) => device::name(d, name, length);
    nvmlDeviceGetPciInfo_v3(d: Device, pci: *mut PciInfo) => device::pci_info(d, pci);
    nvmlDeviceGetPciInfo_v2(d: Device, pci: *mut PciInfo) => device::pci_info(d, pci);
    nvmlDeviceGetCudaComputeCapability(d: Device, major: *mut c_int, minor: *mut c_int) => device::cuda_compute_capability(d, major, minor);
    nvmlDeviceGetArchitecture(d: Device, arch: *mut c_uint) => device::architecture(d, arch);

    // Memory and processes.
    nvmlDeviceGetMemoryInfo(d: Device, memory: *mut Memory) => memory::memory_info(d, memory);
    nvmlDeviceGetMemoryInfo_v2(d: Device, memory: *mut MemoryV2) => memory::memory_info_v2(d, memory);
    nvmlDeviceGetComputeRunningProcesses(d: Device, count: *mut c_uint, infos: *mut ProcessInfoV1) => memory::running_processes(d, Compute, count, infos);
    nvmlDeviceGetComputeRunningProcesses_v2(d: Device, count: *mut c_uint, infos: *mut ProcessInfoV2) => memory::running_processes(d, Compute, count, infos);
    nvmlDeviceGetComputeRunningProcesses_v3(d: Device, count: *mut c_uint, infos: *mut ProcessInfoV2) => memory::running_processes(d, Compute, count, infos);
    nvmlDeviceGetGraphicsRunningProcesses(d: Device, count: *mut c_uint, infos: *mut ProcessInfoV1) => memory::running_processes(d, Graphics, count, infos);
    nvmlDeviceGetGraphicsRunningProcesses_v2(d: Device, count: *mut c_uint, infos: *mut ProcessInfoV2) => memory::running_processes(d, Graphics, count, infos);
    nvmlDeviceGetGraphicsRunningProcesses_v3(d: Device, count: *mut c_uint, infos: *mut ProcessInfoV2) => memory::running_processes(d, Graphics, count, infos);
    nvmlDeviceGetMPSComputeRunningProcesses(d: Device, count: *mut c_uint, infos: *mut ProcessInfoV1) => memory::running_processes(d, Mps, count, infos);
    nvmlDeviceGetMPSComputeRunningProcesses_v2(d: Device, count: *mut c_uint, infos: *mut ProcessInfoV2) => memory::running_processes(d, Mps, count, infos);
    nvmlDeviceGetMPSComputeRunningProcesses_v3(d: Device, count: *mut c_uint, infos: *mut ProcessInfoV2) => memory::running_processes(d, Mps, count, infos);
    nvmlDeviceGetProcessUtilization(d: Device, samples: *mut ProcessUtilizationSample, count: *mut c_uint, last_seen_us: u64) => memory::process_utilization(d, samples, count, last_seen_us);

    // Sensors, clocks, power, PCIe.
    nvmlDeviceGetUtilizationRates(d: Device, u: *mut Utilization) => telemetry::utilization_rates(d, u);
    nvmlDeviceGetEncoderUtilization(d: Device, u: *mut c_uint, period_us: *mut c_uint) => telemetry::codec_utilization(d, u, period_us);
    nvmlDeviceGetDecoderUtilization(d: Device, u: *mut c_uint, period_us: *mut c_uint) => telemetry::codec_utilization(d, u, period_us);
    nvmlDeviceGetTemperature(d: Device, sensor: c_uint, temp: *mut c_uint) => telemetry::temperature(d, sensor, temp);
    nvmlDeviceGetTemperatureV(d: Device, temp: *mut TemperatureV1) => telemetry::temperature_v(d, temp);
    nvmlDeviceGetFanSpeed(d: Device, speed: *mut c_uint) => telemetry::fan_speed(d, speed);
    nvmlDeviceGetFanSpeed_v2(d: Device, _fan: c_uint, speed: *mut c_uint) => telemetry::fan_speed(d, speed);
    nvmlDeviceGetNumFans(d: Device, n: *mut c_uint) => telemetry::fan_count(d, n);
    nvmlDeviceGetPowerUsage(d: Device, mw: *mut c_uint) => telemetry::power_usage(d, mw);
    nvmlDeviceGetPowerManagementLimit(d: Device, mw: *mut c_uint) => telemetry::power_limit(d, mw);
    nvmlDeviceGetPowerManagementDefaultLimit(d: Device, mw: *mut c_uint) => telemetry::power_limit(d, mw);
    nvmlDeviceGetEnforcedPowerLimit(d: Device, mw: *mut c_uint) => telemetry::power_limit(d, mw);
    nvmlDeviceGetPowerManagementLimitConstraints(d: Device, min_mw: *mut c_uint, max_mw: *mut c_uint) => telemetry::power_limit_constraints(d, min_mw, max_mw);
    nvmlDeviceGetClockInfo(d: Device, clock_type: c_uint, mhz: *mut c_uint) => telemetry::clock(d, clock_type, mhz);
    nvmlDeviceGetMaxClockInfo(d: Device, clock_type: c_uint, mhz: *mut c_uint) => telemetry::max_clock(d, clock_type, mhz);
    nvmlDeviceGetCurrentClocksEventReasons(d: Device, reasons: *mut u64) => telemetry::clocks_event_reasons(d, reasons);
    nvmlDeviceGetCurrentClocksThrottleReasons(d: Device, reasons: *mut u64) => telemetry::clocks_event_reasons(d, reasons);
    nvmlDeviceGetPerformanceState(d: Device, pstate: *mut c_uint) => telemetry::performance_state(d, pstate);
    nvmlDeviceGetCurrPcieLinkGeneration(d: Device, generation: *mut c_uint) => telemetry::pcie_generation(d, generation);
    nvmlDeviceGetMaxPcieLinkGeneration(d: Device, generation: *mut c_uint) => telemetry::pcie_generation(d, generation);
    nvmlDeviceGetCurrPcieLinkWidth(d: Device, lanes: *mut c_uint) => telemetry::pcie_width(d, lanes);
    nvmlDeviceGetMaxPcieLinkWidth(d: Device, lanes: *mut c_uint) => telemetry::pcie_width(d, lanes);
    nvmlDeviceGetPcieThroughput(d: Device, counter: c_uint, kbps: *mut c_uint) => telemetry::pcie_throughput(d, counter, kbps);

    // Modes and error counters.
    nvmlDeviceGetComputeMode(d: Device, mode: *mut c_uint) => modes::compute_mode(d, mode);
    nvmlDeviceGetPersistenceMode(d: Device, mode: *mut c_uint) => modes::persistence_mode(d, mode);
    nvmlDeviceGetDisplayMode(d: Device, mode: *mut c_uint) => modes::display(d, mode);
    nvmlDeviceGetDisplayActive(d: Device, active: *mut c_uint) => modes::display(d, active);
    nvmlDeviceGetEccMode(d: Device, current: *mut c_uint, pending: *mut c_uint) => modes::ecc_mode(d, current, pending);
    nvmlDeviceGetTotalEccErrors(d: Device, error_type: c_uint, counter_type: c_uint, count: *mut u64) => modes::total_ecc_errors(d, error_type, counter_type, count);
    nvmlDeviceGetMigMode(d: Device, current: *mut c_uint, pending: *mut c_uint) => modes::mig_mode(d, current, pending);
    nvmlDeviceIsMigDeviceHandle(d: Device, is_mig: *mut c_uint) => modes::is_mig_device_handle(d, is_mig);
    nvmlDeviceGetDriverModel(d: Device, current: *mut c_uint, pending: *mut c_uint) => modes::driver_model(d, current, pending);
    nvmlDeviceGetDriverModel_v2(d: Device, current: *mut c_uint, pending: *mut c_uint) => modes::driver_model(d, current, pending);

    // Xid events.
    nvmlDeviceGetSupportedEventTypes(d: Device, types: *mut u64) => events::supported_event_types(d, types);
    nvmlEventSetCreate(set: *mut EventSet) => events::set_create(set);
    nvmlDeviceRegisterEvents(d: Device, types: u64, set: EventSet) => events::register(d, types, set);
    nvmlEventSetWait_v2(set: EventSet, data: *mut EventData, timeout_ms: c_uint) => events::wait(set, data, timeout_ms);
    nvmlEventSetWait(set: EventSet, data: *mut EventData, timeout_ms: c_uint) => events::wait(set, data, timeout_ms);
    nvmlEventSetFree(set: EventSet) => events::set_free(set);
}

/// `nvmlErrorString`: a static string for any code (it cannot fail or panic).
#[no_mangle]
extern "C" fn nvmlErrorString(r: NvmlReturn) -> *const c_char {
    system::error_string(r).as_ptr()
}
