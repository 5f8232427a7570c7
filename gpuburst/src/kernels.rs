//! The four kernels gpuburst runs, as PTX (hand-written, `.target sm_52`), loaded
//! with `cuModuleLoadData` (or `cuLibraryLoadData`: [`Ptx`]). On a real GPU the driver JIT-compiles them; the Kiwi
//! simulator accepts any image and runs built-ins with the same entry names and
//! parameters. The PTX cannot be validated on a GPU here: it is deliberately simple
//! (grid-stride loops, one atomic add, a `%globaltimer` spin).

use std::ffi::CStr;

use crate::cu;
use crate::driver::{Cuda, CudaError, Handle};

/// `kiwi_fill(u32* p, u32 v, u64 words)`, `kiwi_add(u32* p, u32 d, u64 words)`,
/// `kiwi_checksum(const u32* p, u64 words, u64* out)` (adds into `*out`: zero it
/// first), `kiwi_spin(u64 ns)`.
pub const PTX: &str = concat!(include_str!("kernels.ptx"), "\0");

/// Threads per block and blocks per grid for the memory kernels (grid-stride).
pub const BLOCK: u32 = 256;
pub const GRID: u32 = 1024;

/// [`PTX`] loaded into the current context: a module, or a library (`--library`).
#[derive(Debug, Clone, Copy)]
pub struct Ptx {
    handle: Handle,
    library: bool,
}

impl Ptx {
    /// Loads [`PTX`]: with `cuLibraryLoadData` when `library` (CUDA 12's
    /// context-independent loading, as the runtime does), else `cuModuleLoadData`.
    pub fn load(cuda: &Cuda, library: bool) -> Result<Ptx, CudaError> {
        let mut handle: Handle = std::ptr::null_mut();
        if library {
            cu!(
                cuda,
                library_load_data,
                "cuLibraryLoadData",
                &mut handle,
                PTX.as_ptr().cast(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                0,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                0
            )?;
        } else {
            cu!(
                cuda,
                module_load_data,
                "cuModuleLoadData",
                &mut handle,
                PTX.as_ptr().cast()
            )?;
        }
        Ok(Ptx { handle, library })
    }

    /// The kernel `name`, to launch: a library's `CUkernel` (launched as a function:
    /// the driver takes it) or a module's `CUfunction`.
    pub fn kernel(&self, cuda: &Cuda, name: &CStr) -> Result<Handle, CudaError> {
        let mut f: Handle = std::ptr::null_mut();
        if self.library {
            cu!(
                cuda,
                library_get_kernel,
                "cuLibraryGetKernel",
                &mut f,
                self.handle,
                name.as_ptr()
            )?;
        } else {
            cu!(
                cuda,
                module_get_function,
                "cuModuleGetFunction",
                &mut f,
                self.handle,
                name.as_ptr()
            )?;
        }
        Ok(f)
    }
}
