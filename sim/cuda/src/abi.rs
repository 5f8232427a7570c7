//! The C ABI of the CUDA driver, as `cuda.h` (CUDA 12.x) defines it: `kiwi_cuda::sys`
//! (result codes, handle types, flags, attributes and the structs the simulator reads
//! or writes; checked against the real header by kiwi-cuda's `cuda_h` test) and the
//! table `cuGetErrorName` / `cuGetErrorString` answer from. The `c_program` test
//! (sim/core) compiles a program against `cuda.h` and runs it here.

pub use kiwi_cuda::result::ERRORS;
pub use kiwi_cuda::sys::*;

/// `CUDA_MEMCPY2D` (`_v2`, size_t fields).
pub use kiwi_cuda::sys::CUDA_MEMCPY2D as CudaMemcpy2D;

/// `CU_MEMHOSTALLOC_DEVICEMAP` / `CU_MEMHOSTREGISTER_DEVICEMAP` (the same bit):
/// the host memory is mapped into the device address space.
pub const CU_MEMHOST_DEVICEMAP: u32 = CU_MEMHOSTREGISTER_DEVICEMAP;
