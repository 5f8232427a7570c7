//! System-wide queries: init and shutdown, the driver's, NVML's and CUDA's versions,
//! and the names of processes (read from the host's `/proc`, as the driver does).

use std::ffi::{c_char, c_int, c_uint};

use crate::abi::*;
use crate::ffi::{out, write_str, write_str_cropped};
use crate::model;
use crate::state::state;

/// The driver version NVML reports (matches the CUDA stand-in's 12.4).
pub(crate) const DRIVER_VERSION: &str = "550.54.15";
/// NVML's own version: the CUDA major version, then the driver's.
const NVML_VERSION: &str = "12.550.54.15";
/// `cuDriverGetVersion` of the CUDA stand-in: 12.4.
const CUDA_DRIVER_VERSION: c_int = 12040;

pub(crate) fn init() -> Result<(), NvmlReturn> {
    crate::state::init()
}

pub(crate) fn shutdown() -> Result<(), NvmlReturn> {
    crate::state::shutdown()
}

pub(crate) fn driver_version(buf: *mut c_char, len: c_uint) -> Result<(), NvmlReturn> {
    state()?;
    write_str(buf, len, DRIVER_VERSION)
}

pub(crate) fn nvml_version(buf: *mut c_char, len: c_uint) -> Result<(), NvmlReturn> {
    state()?;
    write_str(buf, len, NVML_VERSION)
}

pub(crate) fn cuda_driver_version(v: *mut c_int) -> Result<(), NvmlReturn> {
    state()?;
    out(v, CUDA_DRIVER_VERSION)
}

/// `nvmlSystemGetProcessName`: the name cropped to the buffer; `NOT_FOUND` for a
/// pid that does not exist.
pub(crate) fn process_name(pid: c_uint, buf: *mut c_char, len: c_uint) -> Result<(), NvmlReturn> {
    state()?;
    if buf.is_null() || len == 0 {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    let name = model::process_name(pid).ok_or(NVML_ERROR_NOT_FOUND)?;
    write_str_cropped(buf, len, &name)
}

/// `nvmlErrorString`'s text for each return code (the driver's wording).
pub(crate) fn error_string(r: NvmlReturn) -> &'static std::ffi::CStr {
    match r {
        NVML_SUCCESS => c"Success",
        NVML_ERROR_UNINITIALIZED => c"Uninitialized",
        NVML_ERROR_INVALID_ARGUMENT => c"Invalid Argument",
        NVML_ERROR_NOT_SUPPORTED => c"Not Supported",
        NVML_ERROR_NO_PERMISSION => c"Insufficient Permissions",
        NVML_ERROR_NOT_FOUND => c"Not Found",
        NVML_ERROR_INSUFFICIENT_SIZE => c"Insufficient Size",
        NVML_ERROR_DRIVER_NOT_LOADED => c"Driver Not Loaded",
        NVML_ERROR_TIMEOUT => c"Timeout",
        NVML_ERROR_FUNCTION_NOT_FOUND => c"Function Not Found",
        NVML_ERROR_GPU_IS_LOST => c"GPU is lost",
        NVML_ERROR_ARGUMENT_VERSION_MISMATCH => c"Argument Version Mismatch",
        _ => c"Unknown Error",
    }
}
