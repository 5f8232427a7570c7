//! [`Driver`]: the driver calls the allocator needs, behind a trait so the logic is
//! tested against a fake that checks every byte (`fake.rs`); `crate::devices`
//! implements it over the real driver.

use super::*;

/// The driver calls the allocator needs. Device, context and access flags are the
/// implementation's business.
pub trait Driver: Send {
    fn granularity(&self) -> Result<u64, CUresult>;
    fn reserve(&self, size: u64, align: u64) -> Result<u64, CUresult>;
    fn free_va(&self, va: u64, size: u64) -> Result<(), CUresult>;
    fn create(&self, size: u64) -> Result<u64, CUresult>;
    /// Physical memory as the application asked for it (its own `cuMemCreate`,
    /// recreated on a swap-in). The default makes the allocator's own kind.
    fn create_like(&self, size: u64, prop: &AppProp) -> Result<u64, CUresult> {
        let _ = prop;
        self.create(size)
    }
    fn release(&self, handle: u64) -> Result<(), CUresult>;
    /// Maps `handle` at `va` and grants read-write access.
    fn map(&self, va: u64, size: u64, handle: u64) -> Result<(), CUresult>;
    fn unmap(&self, va: u64, size: u64) -> Result<(), CUresult>;
    /// A page-locked host buffer of `size` bytes, for swap copies.
    fn host_alloc(&self, size: u64) -> Result<*mut u8, CUresult>;
    /// Frees a buffer [`Driver::host_alloc`] returned for `size` bytes, or one
    /// [`Driver::pageable_alloc`] returned that [`Driver::host_register`] page-locked.
    fn host_free(&self, p: *mut u8, size: u64);
    /// A pageable host buffer of `size` bytes (plain memory, not page-locked), for a
    /// swap-out that must not wait for page-locking; `None`: the driver offers no
    /// such buffer (the swap-out page-locks as before).
    fn pageable_alloc(&self, size: u64) -> Option<*mut u8> {
        let _ = size;
        None
    }
    /// Frees a buffer [`Driver::pageable_alloc`] returned for `size` bytes that was
    /// not registered.
    fn pageable_free(&self, p: *mut u8, size: u64) {
        let _ = (p, size);
    }
    /// Page-locks, in place, a buffer [`Driver::pageable_alloc`] returned for `size`
    /// bytes, its contents kept: afterwards it copies at pinned speed and is freed
    /// with [`Driver::host_free`].
    fn host_register(&self, p: *mut u8, size: u64) -> Result<(), CUresult> {
        let _ = (p, size);
        Err(crate::cuda::CUDA_ERROR_NOT_SUPPORTED)
    }
    /// Copies `n` bytes of device memory at `src` to the host.
    ///
    /// # Safety
    /// `dst` points to at least `n` writable bytes.
    unsafe fn to_host(&self, dst: *mut u8, src: u64, n: u64) -> Result<(), CUresult>;
    /// Copies `n` host bytes to device memory at `dst`.
    ///
    /// # Safety
    /// `src` points to at least `n` readable bytes.
    unsafe fn to_device(&self, dst: u64, src: *const u8, n: u64) -> Result<(), CUresult>;
    /// Starts copying `n` bytes of device memory at `src` to the pinned host buffer
    /// `dst`; the copy is complete when [`Driver::wait_copies`] returns. The swapper
    /// starts one copy, does other driver work (allocating the next pinned buffer),
    /// then waits: a driver with a copy engine (a dedicated stream) overlaps the two.
    /// The default copies synchronously.
    ///
    /// # Safety
    /// `dst` points to at least `n` writable bytes that stay valid and untouched until
    /// [`Driver::wait_copies`] returns.
    unsafe fn to_host_async(&self, dst: *mut u8, src: u64, n: u64) -> Result<(), CUresult> {
        // SAFETY: the caller's contract is to_host's.
        unsafe { self.to_host(dst, src, n) }
    }
    /// Starts copying `n` pinned host bytes to device memory at `dst`; complete when
    /// [`Driver::wait_copies`] returns. The default copies synchronously.
    ///
    /// # Safety
    /// `src` points to at least `n` readable bytes that stay valid and unchanged until
    /// [`Driver::wait_copies`] returns.
    unsafe fn to_device_async(&self, dst: u64, src: *const u8, n: u64) -> Result<(), CUresult> {
        // SAFETY: the caller's contract is to_device's.
        unsafe { self.to_device(dst, src, n) }
    }
    /// Waits until every copy started with `to_host_async` / `to_device_async` is
    /// complete; the error of a failed one. The default has nothing to wait for.
    fn wait_copies(&self) -> Result<(), CUresult> {
        Ok(())
    }
    /// Whether the copies started so far are complete, without waiting; `None`: the
    /// driver cannot tell (the default).
    fn copies_done(&self) -> Option<bool> {
        None
    }
    /// Moves the contents of the pinned buffer `p` ([`Driver::host_alloc`], `size`
    /// bytes, no copy in flight) to the node's disk tier and frees the buffer: a
    /// handle for [`Driver::spilled_to_device`]. `None` (the default): it stays as
    /// it was.
    fn host_spill(&self, p: *mut u8, size: u64) -> Option<u64> {
        let _ = (p, size);
        None
    }
    /// Whether [`Driver::host_spill`] may move buffer `p` (it is the node's swap
    /// pool's: the process's own memory never goes to the disk tier). The default:
    /// none may.
    fn host_spillable(&self, p: *mut u8) -> bool {
        let _ = p;
        false
    }
    /// Copies `pieces` (offset, length) of the spilled contents `h` to device memory
    /// at `va` + offset, synchronously.
    fn spilled_to_device(&self, h: u64, va: u64, pieces: &[(u64, u64)]) -> Result<(), CUresult> {
        let _ = (h, va, pieces);
        Err(crate::cuda::CUDA_ERROR_NOT_SUPPORTED)
    }
    /// Forgets spilled contents (read back, or their segment freed).
    fn spill_free(&self, h: u64) {
        let _ = h;
    }
    /// Waits until every piece of work of this process's context is done.
    fn sync(&self) -> Result<(), CUresult>;
    /// Grants other devices access to the mapping at `va` (`cuMemSetAccess`), beyond
    /// the read-write access [`Driver::map`] gives the owning device. The default does
    /// nothing.
    fn set_access(&self, _va: u64, _size: u64, _grants: &[Grant]) -> Result<(), CUresult> {
        Ok(())
    }
}
