//! The application's own VMM handles in [`Memory`]: counted while they do not swap
//! ([`Memory::external_created`]), a segment at the application's address while
//! they do ([`Memory::adopt_app`], driven by [`crate::appvmm`]).

use super::*;

/// The properties of an application's own `cuMemCreate`, kept to recreate its
/// physical memory on a swap-in. The Windows-only metadata pointer is always null.
#[derive(Clone, Copy, Debug)]
pub struct AppProp(pub crate::cuda::CUmemAllocationProp);
// SAFETY: plain values; its one pointer (Windows metadata) is nulled when stored.
unsafe impl Send for AppProp {}

impl AppProp {
    pub fn new(mut p: crate::cuda::CUmemAllocationProp) -> Self {
        p.win32_handle_meta_data = std::ptr::null_mut();
        Self(p)
    }
}

impl<D: Driver> Memory<D> {
    /// The application's own mapped handle holding `ptr`, if it swaps.
    pub(super) fn app_seg_at(&self, ptr: u64) -> Option<usize> {
        let (_, &i) = self.app_segs.range(..=ptr).next_back()?;
        let s = self.segs[i].as_ref().expect("live segment");
        (ptr < s.va + s.size).then_some(i)
    }

    /// The application mapped its own handle `handle` (`size` bytes, counted by
    /// [`Memory::external_created`]) whole at `va`: from now on it is a segment of the
    /// working set that swaps like the allocator's own, its physical memory recreated
    /// with `prop` at `va` on each swap-in. The caller owns the handle values the
    /// application sees ([`crate::hooks`]'s VMM hooks).
    pub fn adopt_app(&mut self, va: u64, size: u64, handle: u64, prop: AppProp) {
        self.external_released(handle);
        let epoch = self.epoch;
        let i = self.new_seg(Segment {
            handle: Some(handle),
            app: Some(prop),
            ..Segment::unbacked(va, size, epoch)
        });
        self.working_set += size;
        self.resident += size;
        self.app_segs.insert(va, i);
    }

    /// The physical handle of the application's swapping mapping at `va` (`None`:
    /// swapped out), or `Err` when there is no such mapping.
    pub fn app_handle(&self, va: u64) -> Result<Option<u64>, CUresult> {
        let &i = self.app_segs.get(&va).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        Ok(self.segs[i].as_ref().expect("live segment").handle)
    }

    /// The application's mapping at `va` stops swapping (it maps the handle a second
    /// time, or exports it): its resident handle is counted as memory no swap frees
    /// again ([`Memory::external_created`]) and returned. Swapped out: `Ok(None)`,
    /// nothing changed (the caller makes it resident first).
    pub fn unadopt_app(&mut self, va: u64) -> Result<Option<u64>, CUresult> {
        let Some(h) = self.app_handle(va)? else {
            return Ok(None);
        };
        let i = self.app_segs.remove(&va).expect("checked above");
        let s = self.segs[i].take().expect("live segment");
        self.working_set -= s.size;
        self.resident -= s.size;
        self.free_slots.push(i);
        self.external_created(h, s.size);
        Ok(Some(h))
    }

    /// The application unmaps its swapping mapping at `va`. Resident: the mapping
    /// goes and the handle is returned, counted as memory no swap frees again when
    /// `keep` (the application still holds a reference), released otherwise.
    /// Swapped out: its contents go only when `!keep` (`Ok(None)`); with `keep` it
    /// is an error the caller avoids by making it resident first.
    pub fn unmap_app(&mut self, va: u64, keep: bool) -> Result<Option<u64>, CUresult> {
        let h = self.app_handle(va)?;
        if h.is_none() && keep {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let &i = self.app_segs.get(&va).expect("checked above");
        let size = self.size_of(i);
        if let Some(h) = h {
            self.drv.unmap(va, size)?;
            if !keep {
                let _ = self.drv.release(h);
            }
            self.resident -= size;
        }
        self.app_segs.remove(&va);
        let s = self.segs[i].take().expect("live segment");
        if let Some(b) = s.host {
            self.recycle(b);
        }
        if let Some(h) = s.spilled {
            self.drv.spill_free(h);
        }
        self.working_set -= size;
        self.free_slots.push(i);
        self.trim_spare();
        match h {
            Some(h) if keep => {
                self.external_created(h, size);
                Ok(Some(h))
            }
            _ => Ok(None),
        }
    }

    /// The application created a physical handle of its own.
    pub fn external_created(&mut self, handle: u64, size: u64) {
        if self.external.insert(handle, size).is_none() {
            self.external_bytes += size;
        }
    }

    /// The application released one of its own handles.
    pub fn external_released(&mut self, handle: u64) {
        if let Some(size) = self.external.remove(&handle) {
            self.external_bytes -= size;
        }
    }
}
