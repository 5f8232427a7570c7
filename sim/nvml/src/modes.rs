//! Modes and error counters: compute mode, persistence, display, ECC (mode and
//! counts), MIG (mode, and whether a handle is a MIG device), and the driver model,
//! which Linux does not have (`NOT_SUPPORTED`). Values from `crate::model`.

use std::ffi::c_uint;

use crate::abi::*;
use crate::ffi::{out, out_pair};
use crate::model;
use crate::state::Gpu;

fn feature(enabled: bool) -> c_uint {
    if enabled {
        NVML_FEATURE_ENABLED
    } else {
        NVML_FEATURE_DISABLED
    }
}

pub(crate) fn compute_mode(handle: Device, mode: *mut c_uint) -> Result<(), NvmlReturn> {
    Gpu::of(handle)?;
    out(mode, NVML_COMPUTEMODE_DEFAULT)
}

pub(crate) fn persistence_mode(handle: Device, mode: *mut c_uint) -> Result<(), NvmlReturn> {
    Gpu::of(handle)?;
    out(mode, feature(model::PERSISTENCE_MODE_ENABLED))
}

/// `nvmlDeviceGetDisplayMode` (a display connected) and `..DisplayActive` (one
/// initialized): neither on a datacenter board.
pub(crate) fn display(handle: Device, state: *mut c_uint) -> Result<(), NvmlReturn> {
    Gpu::of(handle)?;
    out(state, feature(model::DISPLAY_ATTACHED))
}

pub(crate) fn ecc_mode(
    handle: Device,
    current: *mut c_uint,
    pending: *mut c_uint,
) -> Result<(), NvmlReturn> {
    Gpu::of(handle)?;
    let ecc = feature(model::ECC_ENABLED);
    out_pair(current, ecc, pending, ecc)
}

/// `nvmlDeviceGetTotalEccErrors` of either error type (corrected, uncorrected) and
/// either counter (volatile, aggregate).
pub(crate) fn total_ecc_errors(
    handle: Device,
    error_type: c_uint,
    counter_type: c_uint,
    count: *mut u64,
) -> Result<(), NvmlReturn> {
    Gpu::of(handle)?;
    if error_type >= NVML_MEMORY_ERROR_TYPE_COUNT || counter_type >= NVML_ECC_COUNTER_TYPE_COUNT {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    out(count, model::ECC_ERRORS)
}

/// `nvmlDeviceGetMigMode`: capable, and off now and after the next reset.
pub(crate) fn mig_mode(
    handle: Device,
    current: *mut c_uint,
    pending: *mut c_uint,
) -> Result<(), NvmlReturn> {
    Gpu::of(handle)?;
    out_pair(
        current,
        NVML_DEVICE_MIG_DISABLE,
        pending,
        NVML_DEVICE_MIG_DISABLE,
    )
}

/// `nvmlDeviceIsMigDeviceHandle`: MIG is off, so no handle is a MIG device's.
pub(crate) fn is_mig_device_handle(handle: Device, is_mig: *mut c_uint) -> Result<(), NvmlReturn> {
    Gpu::of(handle)?;
    out(is_mig, 0)
}

/// `nvmlDeviceGetDriverModel` and `_v2`: `NOT_SUPPORTED` (Windows only).
pub(crate) fn driver_model(
    handle: Device,
    current: *mut c_uint,
    pending: *mut c_uint,
) -> Result<(), NvmlReturn> {
    Gpu::of(handle)?;
    match model::DRIVER_MODEL {
        Some(m) => out_pair(current, m, pending, m),
        None => Err(NVML_ERROR_NOT_SUPPORTED),
    }
}
