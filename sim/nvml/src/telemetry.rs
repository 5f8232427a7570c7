//! Sensors and rates: utilization (GPU, memory, encoder, decoder), temperature,
//! power draw and limits, fans, clocks, clock event reasons, performance state and
//! the PCIe link. Each checks the handle as the driver does (uninitialized, invalid,
//! lost), then answers `crate::model`'s value.

use std::ffi::c_uint;

use crate::abi::*;
use crate::ffi::{out, out_pair, read, struct_version};
use crate::model;
use crate::state::Gpu;

pub(crate) fn utilization_rates(handle: Device, u: *mut Utilization) -> Result<(), NvmlReturn> {
    Gpu::of(handle)?;
    out(
        u,
        Utilization {
            gpu: model::GPU_UTILIZATION_PERCENT,
            memory: model::MEMORY_UTILIZATION_PERCENT,
        },
    )
}

/// `nvmlDeviceGetEncoderUtilization` and `nvmlDeviceGetDecoderUtilization`.
pub(crate) fn codec_utilization(
    handle: Device,
    utilization: *mut c_uint,
    sampling_period_us: *mut c_uint,
) -> Result<(), NvmlReturn> {
    Gpu::of(handle)?;
    out_pair(
        utilization,
        model::CODEC_UTILIZATION_PERCENT,
        sampling_period_us,
        model::CODEC_SAMPLING_PERIOD_US,
    )
}

/// `nvmlDeviceGetTemperature`: the GPU die is the one sensor.
pub(crate) fn temperature(
    handle: Device,
    sensor: c_uint,
    temp: *mut c_uint,
) -> Result<(), NvmlReturn> {
    Gpu::of(handle)?;
    if sensor != NVML_TEMPERATURE_GPU {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    out(temp, model::TEMPERATURE_C)
}

/// `nvmlDeviceGetTemperatureV`: `version` must be `nvmlTemperature_v1`.
pub(crate) fn temperature_v(handle: Device, t: *mut TemperatureV1) -> Result<(), NvmlReturn> {
    Gpu::of(handle)?;
    if struct_version(t)? != NVML_TEMPERATURE_V1 {
        return Err(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    }
    let sensor = read(t)?.sensor_type;
    if sensor != NVML_TEMPERATURE_GPU {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    out(
        t,
        TemperatureV1 {
            version: NVML_TEMPERATURE_V1,
            sensor_type: sensor,
            temperature: model::TEMPERATURE_C as i32,
        },
    )
}

/// `nvmlDeviceGetFanSpeed` and `_v2`: `NOT_SUPPORTED`, the board has no fan.
pub(crate) fn fan_speed(handle: Device, speed: *mut c_uint) -> Result<(), NvmlReturn> {
    Gpu::of(handle)?;
    match model::FAN_SPEED_PERCENT {
        Some(v) => out(speed, v),
        None => Err(NVML_ERROR_NOT_SUPPORTED),
    }
}

pub(crate) fn fan_count(handle: Device, n: *mut c_uint) -> Result<(), NvmlReturn> {
    Gpu::of(handle)?;
    out(n, model::FANS)
}

/// `nvmlDeviceGetPowerUsage`, milliwatts.
pub(crate) fn power_usage(handle: Device, mw: *mut c_uint) -> Result<(), NvmlReturn> {
    Gpu::of(handle)?;
    out(mw, model::POWER_DRAW_MW)
}

/// `nvmlDeviceGetPowerManagementLimit`, `..DefaultLimit` and `nvmlDeviceGetEnforcedPowerLimit`:
/// one limit, the board's default, milliwatts.
pub(crate) fn power_limit(handle: Device, mw: *mut c_uint) -> Result<(), NvmlReturn> {
    Gpu::of(handle)?;
    out(mw, model::POWER_LIMIT_MW)
}

pub(crate) fn power_limit_constraints(
    handle: Device,
    min_mw: *mut c_uint,
    max_mw: *mut c_uint,
) -> Result<(), NvmlReturn> {
    Gpu::of(handle)?;
    out_pair(
        min_mw,
        model::POWER_LIMIT_MIN_MW,
        max_mw,
        model::POWER_LIMIT_MW,
    )
}

fn clock_of(clock_type: c_uint) -> Result<(u32, u32), NvmlReturn> {
    if clock_type >= NVML_CLOCK_COUNT {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    Ok(model::CLOCKS_MHZ[clock_type as usize])
}

/// `nvmlDeviceGetClockInfo`: the current clock of a domain, MHz.
pub(crate) fn clock(
    handle: Device,
    clock_type: c_uint,
    mhz: *mut c_uint,
) -> Result<(), NvmlReturn> {
    Gpu::of(handle)?;
    out(mhz, clock_of(clock_type)?.0)
}

/// `nvmlDeviceGetMaxClockInfo`: the highest clock of a domain, MHz.
pub(crate) fn max_clock(
    handle: Device,
    clock_type: c_uint,
    mhz: *mut c_uint,
) -> Result<(), NvmlReturn> {
    Gpu::of(handle)?;
    out(mhz, clock_of(clock_type)?.1)
}

/// `nvmlDeviceGetCurrentClocksEventReasons` (and its old name `..ThrottleReasons`):
/// the clocks are down because the GPU is idle.
pub(crate) fn clocks_event_reasons(handle: Device, reasons: *mut u64) -> Result<(), NvmlReturn> {
    Gpu::of(handle)?;
    out(reasons, CLOCKS_EVENT_REASON_GPU_IDLE)
}

pub(crate) fn performance_state(handle: Device, p: *mut c_uint) -> Result<(), NvmlReturn> {
    Gpu::of(handle)?;
    out(p, NVML_PSTATE_0)
}

/// `nvmlDeviceGet{Curr,Max}PcieLinkGeneration`.
pub(crate) fn pcie_generation(handle: Device, generation: *mut c_uint) -> Result<(), NvmlReturn> {
    Gpu::of(handle)?;
    out(generation, model::PCIE_GENERATION)
}

/// `nvmlDeviceGet{Curr,Max}PcieLinkWidth`.
pub(crate) fn pcie_width(handle: Device, lanes: *mut c_uint) -> Result<(), NvmlReturn> {
    Gpu::of(handle)?;
    out(lanes, model::PCIE_WIDTH)
}

/// `nvmlDeviceGetPcieThroughput`: TX or RX over the last sample period, KB/s.
pub(crate) fn pcie_throughput(
    handle: Device,
    counter: c_uint,
    kbps: *mut c_uint,
) -> Result<(), NvmlReturn> {
    Gpu::of(handle)?;
    if counter >= NVML_PCIE_UTIL_COUNT {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    out(kbps, model::PCIE_THROUGHPUT_KBPS)
}
