//! Stream-ordered memory pools (`cuMemPool*`, `cuDeviceGet/SetMemPool`,
//! `cuMemAllocFromPoolAsync`). Owns the pools of this process; which pool each
//! stream-ordered allocation came from is `pool_usage`'s.
//!
//! Model: every allocation from a pool is its own physical allocation, taken at the
//! call (so out-of-memory is reported there) and given back when the stream reaches
//! the free; a pool caches nothing, so its reserved memory is its used memory and
//! `cuMemPoolTrimTo` has nothing to release. The release threshold and reuse
//! policies are kept and reported back. Each device has a default pool, which is
//! its current pool until `cuDeviceSetMemPool`, and which cannot be destroyed
//! (Driver API reference, `cuMemPoolDestroy`, `cuDeviceGetDefaultMemPool`).

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use crate::abi::*;
use crate::driver::{driver, Driver};
use crate::ffi::{out, read};
use crate::pool_usage::Usage;

/// `CU_MEMPOOL_ATTR_*`.
mod attr {
    pub const REUSE_FOLLOW_EVENT_DEPENDENCIES: i32 = 1;
    // 2: REUSE_ALLOW_OPPORTUNISTIC, within the range above.
    pub const REUSE_ALLOW_INTERNAL_DEPENDENCIES: i32 = 3;
    pub const RELEASE_THRESHOLD: i32 = 4;
    pub const RESERVED_MEM_CURRENT: i32 = 5;
    pub const RESERVED_MEM_HIGH: i32 = 6;
    pub const USED_MEM_CURRENT: i32 = 7;
    pub const USED_MEM_HIGH: i32 = 8;
}

/// `CUmemPoolProps` (88 bytes on LP64).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CUmemPoolProps {
    pub alloc_type: i32,
    pub handle_types: i32,
    pub location: CUmemLocation,
    pub win32_security_attributes: *mut c_void,
    pub max_size: usize,
    pub usage: u16,
    pub reserved: [u8; 54],
}

const _: () = assert!(std::mem::size_of::<CUmemPoolProps>() == 88);

pub struct Pool {
    pub device: u32,
    pub default: bool,
    /// Reuse policies (three booleans) and the release threshold.
    reuse: Mutex<[i32; 3]>,
    release_threshold: AtomicU64,
    usage: Arc<Usage>,
}

impl Pool {
    fn new(device: u32, default: bool) -> Arc<Pool> {
        Arc::new(Pool {
            device,
            default,
            reuse: Mutex::new([1, 1, 1]),
            release_threshold: AtomicU64::new(0),
            usage: Arc::default(),
        })
    }

    fn handle(self: &Arc<Self>) -> usize {
        Arc::as_ptr(self) as usize
    }
}

struct Pools {
    by_handle: HashMap<usize, Arc<Pool>>,
    /// Per device: (default pool, current pool).
    devices: Vec<(Arc<Pool>, Arc<Pool>)>,
}

fn pools(d: &Driver) -> std::sync::MutexGuard<'static, Pools> {
    static P: OnceLock<Mutex<Pools>> = OnceLock::new();
    P.get_or_init(|| {
        let mut by_handle = HashMap::new();
        let devices = (0..d.gpus)
            .map(|g| {
                let p = Pool::new(g, true);
                by_handle.insert(p.handle(), p.clone());
                (p.clone(), p)
            })
            .collect();
        Mutex::new(Pools { by_handle, devices })
    })
    .lock()
    .unwrap_or_else(|e| e.into_inner())
}

/// The pool behind a `CUmemoryPool` handle.
pub fn pool(handle: *mut c_void) -> Result<Arc<Pool>, CUresult> {
    let d = driver()?;
    pools(d)
        .by_handle
        .get(&(handle as usize))
        .cloned()
        .ok_or(CUDA_ERROR_INVALID_VALUE)
}

/// The current pool of device `g` (what `cuMemAllocAsync` allocates from).
pub fn current(g: u32) -> Result<Arc<Pool>, CUresult> {
    let d = driver()?;
    Ok(pools(d).devices[g as usize].1.clone())
}

/// Records that `ptr` (`bytes` long) came from `pool`.
pub fn note_alloc(pool: &Arc<Pool>, ptr: u64, bytes: u64) {
    crate::pool_usage::note_alloc(pool.handle(), &pool.usage, ptr, bytes);
}

pub fn get_default(out_pool: *mut *mut c_void, dev: CUdevice) -> Result<(), CUresult> {
    let d = driver()?;
    let g = d.device(dev)?;
    let h = pools(d).devices[g as usize].0.handle();
    out(out_pool, h as *mut c_void)
}

pub fn get_current(out_pool: *mut *mut c_void, dev: CUdevice) -> Result<(), CUresult> {
    let d = driver()?;
    let g = d.device(dev)?;
    let h = pools(d).devices[g as usize].1.handle();
    out(out_pool, h as *mut c_void)
}

pub fn set_current(dev: CUdevice, handle: *mut c_void) -> Result<(), CUresult> {
    let d = driver()?;
    let g = d.device(dev)?;
    let p = pool(handle)?;
    if p.device != g {
        return Err(CUDA_ERROR_INVALID_DEVICE);
    }
    pools(d).devices[g as usize].1 = p;
    Ok(())
}

pub fn create(out_pool: *mut *mut c_void, props: *const CUmemPoolProps) -> Result<(), CUresult> {
    let d = driver()?;
    let p = read(props)?;
    if p.alloc_type != CU_MEM_ALLOCATION_TYPE_PINNED
        || p.location.type_ != CU_MEM_LOCATION_TYPE_DEVICE
        || p.handle_types != 0
    {
        // Shareable (IPC) pools are not simulated.
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let g = d
        .device(p.location.id)
        .map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
    let pool = Pool::new(g, false);
    let h = pool.handle();
    pools(d).by_handle.insert(h, pool);
    out(out_pool, h as *mut c_void)
}

pub fn destroy(handle: *mut c_void) -> Result<(), CUresult> {
    let d = driver()?;
    let mut ps = pools(d);
    let p = ps
        .by_handle
        .get(&(handle as usize))
        .cloned()
        .ok_or(CUDA_ERROR_INVALID_VALUE)?;
    if p.default {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    ps.by_handle.remove(&(handle as usize));
    // A device whose current pool this was goes back to its default.
    for (def, cur) in ps.devices.iter_mut() {
        if Arc::ptr_eq(cur, &p) {
            *cur = def.clone();
        }
    }
    Ok(())
}

/// `cuMemPoolTrimTo`: pools cache nothing here, so there is never anything to trim.
pub fn trim_to(handle: *mut c_void) -> Result<(), CUresult> {
    pool(handle).map(|_| ())
}

pub fn set_attribute(handle: *mut c_void, a: i32, value: *mut c_void) -> Result<(), CUresult> {
    let p = pool(handle)?;
    match a {
        attr::REUSE_FOLLOW_EVENT_DEPENDENCIES..=attr::REUSE_ALLOW_INTERNAL_DEPENDENCIES => {
            let v = read(value.cast::<i32>())?;
            p.reuse.lock().unwrap_or_else(|e| e.into_inner())[(a - 1) as usize] = v;
        }
        attr::RELEASE_THRESHOLD => {
            p.release_threshold
                .store(read(value.cast::<u64>())?, Ordering::Release);
        }
        // Only a high-water mark can be reset, and only to zero.
        attr::RESERVED_MEM_HIGH | attr::USED_MEM_HIGH => {
            if read(value.cast::<u64>())? != 0 {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            p.usage
                .high
                .store(p.usage.used.load(Ordering::Acquire), Ordering::Release);
        }
        _ => return Err(CUDA_ERROR_INVALID_VALUE),
    }
    Ok(())
}

pub fn get_attribute(handle: *mut c_void, a: i32, value: *mut c_void) -> Result<(), CUresult> {
    let p = pool(handle)?;
    match a {
        attr::REUSE_FOLLOW_EVENT_DEPENDENCIES..=attr::REUSE_ALLOW_INTERNAL_DEPENDENCIES => {
            let v = p.reuse.lock().unwrap_or_else(|e| e.into_inner())[(a - 1) as usize];
            out(value.cast::<i32>(), v)
        }
        attr::RELEASE_THRESHOLD => out(
            value.cast::<u64>(),
            p.release_threshold.load(Ordering::Acquire),
        ),
        // Nothing is cached: reserved is used.
        attr::RESERVED_MEM_CURRENT | attr::USED_MEM_CURRENT => {
            out(value.cast::<u64>(), p.usage.used.load(Ordering::Acquire))
        }
        attr::RESERVED_MEM_HIGH | attr::USED_MEM_HIGH => {
            out(value.cast::<u64>(), p.usage.high.load(Ordering::Acquire))
        }
        _ => Err(CUDA_ERROR_INVALID_VALUE),
    }
}
