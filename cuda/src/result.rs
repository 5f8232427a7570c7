//! Result codes as Rust results: [`check`] turns a `CUresult` into
//! `Result<(), CudaError>`, and a [`CudaError`] names itself from the one table of
//! codes Kiwi knows ([`ERRORS`], declared with the constants in [`crate::sys`]), the
//! table the simulator's `cuGetErrorName` and `cuGetErrorString` answer from.
//! Nothing here allocates, except formatting.

use std::ffi::CStr;
use std::fmt;

use crate::sys::{CUresult, CUDA_SUCCESS};

/// (code, name, description) of every result code in [`crate::sys`], as
/// `cuGetErrorName` and `cuGetErrorString` give them.
pub const ERRORS: &[(CUresult, &CStr, &CStr)] = crate::sys::RESULT_CODES;

/// The name of `code` (`"CUDA_ERROR_OUT_OF_MEMORY"`), if Kiwi knows it.
pub fn error_name(code: CUresult) -> Option<&'static CStr> {
    ERRORS.iter().find(|e| e.0 == code).map(|e| e.1)
}

/// The description of `code` (`"out of memory"`), if Kiwi knows it.
pub fn error_string(code: CUresult) -> Option<&'static CStr> {
    ERRORS.iter().find(|e| e.0 == code).map(|e| e.2)
}

/// A result other than `CUDA_SUCCESS`, as the driver returned it.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
#[repr(transparent)]
pub struct CudaError(pub CUresult);

impl CudaError {
    /// The driver's code.
    pub fn code(self) -> CUresult {
        self.0
    }

    /// Its name, if Kiwi knows it.
    pub fn name(self) -> Option<&'static str> {
        error_name(self.0).and_then(|c| c.to_str().ok())
    }

    /// Its description, if Kiwi knows it.
    pub fn description(self) -> Option<&'static str> {
        error_string(self.0).and_then(|c| c.to_str().ok())
    }
}

/// The code's name (`CUDA_ERROR_OUT_OF_MEMORY`), else `CUresult <n>`.
impl fmt::Display for CudaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            Some(name) => f.write_str(name),
            None => write!(f, "CUresult {}", self.0),
        }
    }
}

impl fmt::Debug for CudaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CudaError({self} = {})", self.0)
    }
}

impl std::error::Error for CudaError {}

/// `Ok(())` for `CUDA_SUCCESS`, else the error.
#[inline]
pub fn check(code: CUresult) -> Result<(), CudaError> {
    if code == CUDA_SUCCESS {
        Ok(())
    } else {
        Err(CudaError(code))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sys::*;

    #[test]
    fn check_passes_success_and_names_the_failure() {
        assert_eq!(check(CUDA_SUCCESS), Ok(()));
        let e = check(CUDA_ERROR_OUT_OF_MEMORY).unwrap_err();
        assert_eq!(e.code(), 2);
        assert_eq!(e.to_string(), "CUDA_ERROR_OUT_OF_MEMORY");
        assert_eq!(e.description(), Some("out of memory"));
        assert_eq!(format!("{e:?}"), "CudaError(CUDA_ERROR_OUT_OF_MEMORY = 2)");
        assert_eq!(CudaError(12345).to_string(), "CUresult 12345");
        assert_eq!(CudaError(12345).name(), None);
    }

    #[test]
    fn the_table_has_each_code_once_and_every_name_is_its_constant() {
        let mut codes: Vec<CUresult> = ERRORS.iter().map(|e| e.0).collect();
        codes.sort_unstable();
        codes.dedup();
        assert_eq!(codes.len(), ERRORS.len());
        assert_eq!(error_name(CUDA_ERROR_TIMEOUT), Some(c"CUDA_ERROR_TIMEOUT"));
        assert_eq!(
            error_name(CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD),
            Some(c"CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD")
        );
        assert_eq!(error_string(CUDA_SUCCESS), Some(c"no error"));
        for (code, name, description) in ERRORS {
            let name = name.to_str().unwrap();
            assert!(name.starts_with("CUDA_"), "{name}");
            assert!(
                !description.is_empty(),
                "{name} ({code}) has no description"
            );
        }
    }
}
