//! The application's managed memory (`cuMemAllocManaged`; issue #24, item 3): the
//! driver pages it between the host and the GPU by itself, so the shim does not own
//! it, but it counts in the working set of the GPU it was allocated on, and a
//! swap-out moves it to the host with a prefetch (`cuMemPrefetchAsync` to the CPU),
//! freeing the device memory it took for the next holder; the swap-in prefetches it
//! back, so the application's kernels do not fault it in page by page. The
//! application's own prefetches and advice go to the driver unchanged.

use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::client::MAX_TURNS as MAX_DEVICES;
use crate::cuda::*;
use crate::real::call_real as call;

#[derive(Default)]
struct Device {
    /// The live managed allocations made with this device current: start → size.
    allocs: BTreeMap<u64, u64>,
    /// A swap-out moved them to the host; the next swap-in moves them back.
    out: bool,
}

static DEVICES: [Mutex<Device>; MAX_DEVICES] = [const {
    Mutex::new(Device {
        allocs: BTreeMap::new(),
        out: false,
    })
}; MAX_DEVICES];

fn dev(d: usize) -> MutexGuard<'static, Device> {
    DEVICES[d].lock().unwrap_or_else(|e| e.into_inner())
}

/// An allocation of `size` bytes at `ptr`, made with device `d` current.
pub fn added(d: usize, ptr: u64, size: u64) {
    if d < MAX_DEVICES {
        dev(d).allocs.insert(ptr, size);
    }
}

/// `ptr` was freed: the device it counted on, if it was a managed allocation.
pub fn removed(ptr: u64) -> Option<usize> {
    (0..MAX_DEVICES).find(|&d| dev(d).allocs.remove(&ptr).is_some())
}

/// Device `d`'s managed bytes: (all of them, those on the GPU as far as the shim
/// moved them).
pub fn bytes(d: usize) -> (u64, u64) {
    let g = dev(d);
    let total: u64 = g.allocs.values().sum();
    (total, if g.out { 0 } else { total })
}

/// Whether device `d`'s managed memory is where the application's work needs it.
pub fn resident(d: usize) -> bool {
    let g = dev(d);
    !g.out || g.allocs.is_empty()
}

/// Moves device `d`'s managed memory to the host (`to_host`) or back to the device,
/// with a prefetch of each allocation on the legacy stream, and waits for them; the
/// caller has the application's context of `d` current and its work drained.
/// Returns the bytes prefetched (0 when already there) and how long it took.
pub fn migrate(d: usize, to_host: bool) -> Result<(u64, Duration), CUresult> {
    let start = Instant::now();
    let mut g = dev(d);
    if g.out == to_host || g.allocs.is_empty() {
        return Ok((0, Duration::ZERO));
    }
    let target = if to_host {
        CU_DEVICE_CPU
    } else {
        d as CUdevice
    };
    let mut bytes = 0;
    for (&ptr, &size) in &g.allocs {
        call!(cuMemPrefetchAsync: fn(CUdeviceptr, usize, CUdevice, CUstream)(
            ptr,
            size as usize,
            target,
            std::ptr::null_mut()
        ))?;
        bytes += size;
    }
    call!(cuStreamSynchronize: fn(CUstream)(std::ptr::null_mut()))?;
    g.out = to_host;
    Ok((bytes, start.elapsed()))
}
