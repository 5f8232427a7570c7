//! The four kernels gpuburst runs, as PTX (hand-written, `.target sm_52`), loaded
//! with `cuModuleLoadData`. On a real GPU the driver JIT-compiles them; the Kiwi
//! simulator accepts any image and runs built-ins with the same entry names and
//! parameters. The PTX cannot be validated on a GPU here: it is deliberately simple
//! (grid-stride loops, one atomic add, a `%globaltimer` spin).

/// `kiwi_fill(u32* p, u32 v, u64 words)`, `kiwi_add(u32* p, u32 d, u64 words)`,
/// `kiwi_checksum(const u32* p, u64 words, u64* out)` (adds into `*out`: zero it
/// first), `kiwi_spin(u64 ns)`.
pub const PTX: &str = concat!(include_str!("kernels.ptx"), "\0");

/// Threads per block and blocks per grid for the memory kernels (grid-stride).
pub const BLOCK: u32 = 256;
pub const GRID: u32 = 1024;
