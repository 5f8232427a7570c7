//! Stream-ordered pools' statistics (issue #24): the shim serves every
//! `cuMemAllocAsync` and `cuMemAllocFromPoolAsync` from its own allocator, so the
//! driver's pool never sees that memory and its `CU_MEMPOOL_ATTR_RESERVED_MEM_*` and
//! `USED_MEM_*` read 0 (RMM, CuPy and PyTorch's async backend report what they
//! read). This module counts, per pool, the bytes the shim serves for it, and adds
//! them to what the driver says: `cuMemPoolGetAttribute` then tells the truth, and
//! resetting a high-water mark (`cuMemPoolSetAttribute`, value 0) resets the shim's
//! too. A free returns its memory at once, so reserved is used.

use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::sync::{Mutex, MutexGuard};

use crate::cuda::*;

type Real<A> = A;

/// `CUmemPool_attribute` values (cuda.h).
const RESERVED_MEM_CURRENT: c_int = 5;
const RESERVED_MEM_HIGH: c_int = 6;
const USED_MEM_CURRENT: c_int = 7;
const USED_MEM_HIGH: c_int = 8;

#[derive(Default)]
struct Counts {
    /// Pool (handle address) → (bytes now, high-water mark).
    pools: HashMap<usize, (u64, u64)>,
    /// Allocation → (its pool, bytes).
    allocs: HashMap<u64, (usize, u64)>,
}

static COUNTS: Mutex<Option<Counts>> = Mutex::new(None);

fn counts() -> MutexGuard<'static, Option<Counts>> {
    COUNTS.lock().unwrap_or_else(|p| p.into_inner())
}

/// The shim served `bytes` at `ptr` for `pool`.
pub(crate) fn allocated(pool: CUmemoryPool, ptr: CUdeviceptr, bytes: u64) {
    if pool.is_null() {
        return;
    }
    let mut g = counts();
    let c = g.get_or_insert_with(Counts::default);
    let key = pool as usize;
    let e = c.pools.entry(key).or_default();
    e.0 += bytes;
    e.1 = e.1.max(e.0);
    c.allocs.insert(ptr, (key, bytes));
}

/// The shim freed `ptr` (any allocation: those of no pool are not counted).
pub(crate) fn freed(ptr: CUdeviceptr) {
    let mut g = counts();
    let Some(c) = g.as_mut() else {
        return;
    };
    if let Some((pool, bytes)) = c.allocs.remove(&ptr) {
        if let Some(e) = c.pools.get_mut(&pool) {
            e.0 = e.0.saturating_sub(bytes);
        }
    }
}

/// What the shim holds for `pool`: (bytes now, high-water mark).
fn figures(pool: CUmemoryPool) -> (u64, u64) {
    counts()
        .as_ref()
        .and_then(|c| c.pools.get(&(pool as usize)).copied())
        .unwrap_or_default()
}

/// `cuMemPoolGetAttribute`: the driver's answer, plus the shim's bytes for the
/// reserved and used figures.
/// # Safety
/// `real` is the driver's original; `value` is the application's out-pointer, valid
/// for the attribute's type (`cuuint64_t` for the figures).
pub unsafe fn get_attribute(
    real: Real<unsafe extern "C" fn(CUmemoryPool, c_int, *mut c_void) -> CUresult>,
    pool: CUmemoryPool,
    attr: c_int,
    value: *mut c_void,
) -> CUresult {
    // SAFETY: the caller's arguments, forwarded.
    let r = unsafe { real(pool, attr, value) };
    if r != CUDA_SUCCESS || value.is_null() {
        return r;
    }
    let (now, high) = figures(pool);
    let add = match attr {
        RESERVED_MEM_CURRENT | USED_MEM_CURRENT => now,
        RESERVED_MEM_HIGH | USED_MEM_HIGH => high,
        _ => return r,
    };
    // SAFETY: the driver accepted `value` for this attribute: a `cuuint64_t`.
    unsafe {
        let v = value.cast::<u64>();
        v.write_unaligned(v.read_unaligned().saturating_add(add));
    }
    r
}

/// `cuMemPoolSetAttribute`: resetting a high-water mark (to 0, the only value the
/// driver takes) resets the shim's to what it holds now.
/// # Safety
/// As [`get_attribute`].
pub unsafe fn set_attribute(
    real: Real<unsafe extern "C" fn(CUmemoryPool, c_int, *mut c_void) -> CUresult>,
    pool: CUmemoryPool,
    attr: c_int,
    value: *mut c_void,
) -> CUresult {
    // SAFETY: the caller's arguments, forwarded.
    let r = unsafe { real(pool, attr, value) };
    if r == CUDA_SUCCESS && matches!(attr, RESERVED_MEM_HIGH | USED_MEM_HIGH) {
        if let Some(e) = counts()
            .as_mut()
            .and_then(|c| c.pools.get_mut(&(pool as usize)))
        {
            e.1 = e.0;
        }
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    unsafe extern "C" fn driver_says(_: CUmemoryPool, attr: c_int, v: *mut c_void) -> CUresult {
        if attr > USED_MEM_HIGH {
            return CUDA_ERROR_INVALID_VALUE;
        }
        // SAFETY: the test passes a u64.
        unsafe { *v.cast::<u64>() = 1000 };
        CUDA_SUCCESS
    }

    fn get(pool: CUmemoryPool, attr: c_int) -> (CUresult, u64) {
        let mut v = 0u64;
        // SAFETY: a stand-in driver and a live u64.
        let r = unsafe { get_attribute(driver_says, pool, attr, (&mut v as *mut u64).cast()) };
        (r, v)
    }

    #[test]
    fn the_shims_bytes_are_added_per_pool_and_high_water_marks_reset() {
        let (p, q) = (0x1000 as CUmemoryPool, 0x2000 as CUmemoryPool);
        allocated(p, 0xa000, 300);
        allocated(p, 0xb000, 200);
        allocated(q, 0xc000, 7);
        assert_eq!(get(p, USED_MEM_CURRENT), (CUDA_SUCCESS, 1500));
        assert_eq!(get(p, RESERVED_MEM_CURRENT).1, 1500);
        freed(0xa000);
        freed(0xdead); // not a pool allocation: nothing
        assert_eq!(get(p, USED_MEM_CURRENT).1, 1200);
        assert_eq!(get(p, USED_MEM_HIGH).1, 1500);
        assert_eq!(get(q, RESERVED_MEM_HIGH).1, 1007);
        // Other attributes and the driver's refusals pass through.
        assert_eq!(get(p, 4).1, 1000);
        assert_eq!(get(p, 9).0, CUDA_ERROR_INVALID_VALUE);
        let mut zero = 0u64;
        // SAFETY: as above.
        let r = unsafe {
            set_attribute(
                driver_says,
                p,
                USED_MEM_HIGH,
                (&mut zero as *mut u64).cast(),
            )
        };
        assert_eq!(r, CUDA_SUCCESS);
        assert_eq!(get(p, USED_MEM_HIGH).1, 1200);
    }
}
