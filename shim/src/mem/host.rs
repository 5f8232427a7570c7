//! The host buffers of [`Memory`]'s swap-outs: pinned spares reused best-fit, pageable
//! buffers registered in place by the pinning thread, and the trimming that keeps
//! them no larger than the working set.

use super::*;

/// A host buffer: held by a swapped-out segment (its contents) or spare. Spares are
/// always pinned; a segment's may be pageable (a swap-out that found no pinned buffer
/// ready), until the pinning thread registers it in place
/// ([`Memory::register_next`]).
pub(super) struct HostBuf {
    pub(super) ptr: *mut u8,
    /// Bytes allocated (at least the size of the segment it holds).
    pub(super) cap: u64,
    /// Page-locked (allocated so, or registered in place).
    pub(super) pinned: bool,
    /// Being registered in place by the pinning thread, outside the allocator's lock:
    /// it must not be freed until that ends ([`Memory::finish_register`]).
    pub(super) registering: bool,
}

impl HostBuf {
    pub(super) fn pinned(ptr: *mut u8, cap: u64) -> Self {
        Self {
            ptr,
            cap,
            pinned: true,
            registering: false,
        }
    }
}
// SAFETY: the buffer is plain memory owned by the allocator (a segment or the spares);
// only the thread holding the allocator's lock touches it.
unsafe impl Send for HostBuf {}

impl<D: Driver> Memory<D> {
    /// A spare pinned buffer for `size` bytes: the exact size if there is one, else the
    /// smallest larger one.
    pub(super) fn take_spare(&mut self, size: u64) -> Option<HostBuf> {
        let k = self
            .spare
            .iter()
            .enumerate()
            .filter(|(_, b)| b.cap >= size)
            .min_by_key(|(_, b)| b.cap)
            .map(|(k, _)| k)?;
        Some(self.spare.swap_remove(k))
    }

    pub(super) fn new_host_buf(&mut self, size: u64) -> Result<HostBuf, CUresult> {
        let t = Instant::now();
        let ptr = self.drv.host_alloc(size)?;
        self.host_bytes += size;
        self.pinned_now += size;
        self.pinning_time += t.elapsed();
        Ok(HostBuf::pinned(ptr, size))
    }

    /// A buffer for a swap-out that found no pinned one ready: pageable when the
    /// driver offers it (a pageable copy runs several times faster than page-locking
    /// fresh memory: docs/benchmarks.md, `swap_out_after_growth`), registered in
    /// place later, off the critical path; else pinned now.
    pub(super) fn swap_out_buf(&mut self, size: u64) -> Result<HostBuf, CUresult> {
        match self.drv.pageable_alloc(size) {
            Some(ptr) => {
                self.host_bytes += size;
                self.pageable_now += size;
                Ok(HostBuf {
                    ptr,
                    cap: size,
                    pinned: false,
                    registering: false,
                })
            }
            None => self.new_host_buf(size),
        }
    }

    /// A buffer no segment holds any more: a pinned one becomes a spare, a pageable
    /// one is freed (one the pinning thread is registering waits in `limbo`).
    pub(super) fn recycle(&mut self, b: HostBuf) {
        if b.registering {
            self.limbo.push(b);
        } else if b.pinned {
            self.spare.push(b);
        } else {
            self.drv.pageable_free(b.ptr, b.cap);
            self.host_bytes -= b.cap;
        }
    }

    /// The next swapped-out segment's pageable buffer to register in place, marked
    /// as being registered: `(ptr, cap)`. The caller registers it without the
    /// allocator's lock (page-locking runs at a few GB/s), then calls
    /// [`Memory::finish_register`].
    pub fn register_next(&mut self) -> Option<(*mut u8, u64)> {
        let b = self
            .segs
            .iter_mut()
            .flatten()
            .filter_map(|s| s.host.as_mut())
            .find(|b| !b.pinned && !b.registering)?;
        b.registering = true;
        Some((b.ptr, b.cap))
    }

    /// Ends the registration [`Memory::register_next`] started for the buffer at
    /// `ptr`: pinned when `ok`. A buffer its segment let go meanwhile is now freed,
    /// or kept as a spare when it got pinned.
    pub fn finish_register(&mut self, ptr: *mut u8, ok: bool) {
        let held = self
            .segs
            .iter_mut()
            .flatten()
            .filter_map(|s| s.host.as_mut())
            .find(|b| b.ptr == ptr);
        if let Some(b) = held {
            b.registering = false;
            b.pinned = ok;
            return;
        }
        if let Some(k) = self.limbo.iter().position(|b| b.ptr == ptr) {
            let mut b = self.limbo.swap_remove(k);
            b.registering = false;
            b.pinned = ok;
            self.recycle(b);
            self.trim_spare();
        }
    }

    /// Bytes of swapped-out contents in pageable buffers, not yet registered.
    pub fn pageable_bytes(&self) -> u64 {
        self.segs
            .iter()
            .flatten()
            .filter_map(|s| s.host.as_ref())
            .filter(|b| !b.pinned)
            .map(|b| b.cap)
            .sum()
    }

    /// Frees spare pinned buffers (largest first) while all pinned buffers together
    /// exceed the working set: more is never needed at once.
    pub(super) fn trim_spare(&mut self) {
        while self.host_bytes > self.working_set {
            let Some(k) = (0..self.spare.len()).max_by_key(|&k| self.spare[k].cap) else {
                break;
            };
            let b = self.spare.swap_remove(k);
            self.drv.host_free(b.ptr, b.cap);
            self.host_bytes -= b.cap;
        }
    }
}
