//! Which stream-ordered pool each live allocation came from, and each pool's bytes
//! in use: the bookkeeping a free updates wherever it runs (an executor reaching a
//! `cuMemFreeAsync`, or `cuMemFree`). Below `exec`, which frees, and `pool`, which
//! owns the pools.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex};

/// A pool's bytes in use now, and the most since its high-water mark was reset.
#[derive(Default)]
pub struct Usage {
    pub used: AtomicU64,
    pub high: AtomicU64,
}

/// Allocation address → (pool handle, its usage, bytes).
type Allocations = HashMap<u64, (usize, Arc<Usage>, u64)>;

static ALLOCATIONS: LazyLock<Mutex<Allocations>> = LazyLock::new(Default::default);

fn allocations() -> std::sync::MutexGuard<'static, Allocations> {
    ALLOCATIONS.lock().unwrap_or_else(|e| e.into_inner())
}

/// Records that `ptr` (`bytes` long) came from pool `handle`.
pub fn note_alloc(handle: usize, usage: &Arc<Usage>, ptr: u64, bytes: u64) {
    let used = usage.used.fetch_add(bytes, Ordering::AcqRel) + bytes;
    usage.high.fetch_max(used, Ordering::AcqRel);
    allocations().insert(ptr, (handle, usage.clone(), bytes));
}

/// Forgets `ptr` when it is freed.
pub fn note_free(ptr: u64) {
    if let Some((_, usage, bytes)) = allocations().remove(&ptr) {
        usage.used.fetch_sub(bytes, Ordering::AcqRel);
    }
}

/// The handle of the pool `ptr` was allocated from, if any.
pub fn pool_of(ptr: u64) -> Option<usize> {
    allocations().get(&ptr).map(|(h, _, _)| *h)
}
