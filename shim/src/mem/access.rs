//! Other devices' access to [`Memory`]'s mappings: the application's
//! `cuMemSetAccess` and peer access, recorded as grants and applied to every
//! mapping the allocator makes, so they survive swaps.

use super::*;

/// Access of one other device to a mapping: (device ordinal, `CUmemAccess_flags`:
/// 0 none, 1 read, 3 read-write). The application's `cuMemSetAccess` and
/// `cuCtxEnablePeerAccess` are recorded as grants and applied to every new mapping,
/// so they survive swaps.
pub type Grant = (i32, i32);

/// Sets `device`'s entry in `grants` (a later grant replaces an earlier one).
pub(super) fn merge_grant(grants: &mut Vec<Grant>, g: Grant) {
    match grants.iter_mut().find(|x| x.0 == g.0) {
        Some(x) => x.1 = g.1,
        None => grants.push(g),
    }
}

impl<D: Driver> Memory<D> {
    /// The other devices' access segment `i` must have: the peers', overridden by
    /// what the application asked for on its allocations.
    fn grants_of(&self, i: usize) -> Vec<Grant> {
        let mut g = self.peers.clone();
        for &a in &self.segs[i].as_ref().expect("live segment").access {
            merge_grant(&mut g, a);
        }
        g
    }

    /// Applies the recorded access to segment `i`, freshly mapped (a new mapping gives
    /// only the owning device access). A failure is logged, not returned: the
    /// application's data is intact and this device's work goes on; another device's
    /// access then fails with the driver's own error.
    pub(super) fn reapply_access(&mut self, i: usize) {
        let g = self.grants_of(i);
        if g.is_empty() {
            return;
        }
        let (va, size) = {
            let s = self.seg(i);
            (s.va, s.size)
        };
        if let Err(e) = self.drv.set_access(va, size, &g) {
            crate::kwarn!(
                "re-granting other devices' access to {size} bytes at {va:#x} after mapping failed with CUDA error {e}"
            );
        }
    }

    /// The segments holding any byte of `[ptr, ptr+size)`, which must lie inside one
    /// allocation; `None` when `ptr` is in no allocation of this allocator.
    fn segments_in(&self, ptr: u64, size: u64) -> Option<Result<Vec<usize>, CUresult>> {
        if let Some(i) = self.app_seg_at(ptr) {
            let s = self.segs[i].as_ref().expect("live segment");
            if size == 0 || ptr.checked_add(size).is_none_or(|end| end > s.va + s.size) {
                return Some(Err(CUDA_ERROR_INVALID_VALUE));
            }
            return Some(Ok(vec![i]));
        }
        let (&base, a) = self.allocs.range(..=ptr).next_back()?;
        let (asize, segs) = match a {
            Alloc::Large { size, segs, .. } => (*size, segs.clone()),
            Alloc::Small { seg, size, .. } => (*size, vec![*seg]),
        };
        if ptr >= base + asize {
            return None;
        }
        if size == 0 || ptr.checked_add(size).is_none_or(|end| end > base + asize) {
            return Some(Err(CUDA_ERROR_INVALID_VALUE));
        }
        let hit = segs
            .into_iter()
            .filter(|&i| {
                let s = self.segs[i].as_ref().expect("live segment");
                s.va < ptr + size && ptr < s.va + s.size
            })
            .collect();
        Some(Ok(hit))
    }

    /// The application's `cuMemSetAccess(ptr, size, grants)` on memory of this
    /// allocator: recorded on every segment holding the range (a small allocation's
    /// whole shared chunk, a large one's whole 64 MiB segments) and applied now to
    /// those that are mapped; every later mapping of them gets it too. `None`: `ptr`
    /// is not this allocator's (the driver's business).
    pub fn set_access(
        &mut self,
        ptr: u64,
        size: u64,
        grants: &[Grant],
    ) -> Option<Result<(), CUresult>> {
        let segs = match self.segments_in(ptr, size)? {
            Ok(s) => s,
            Err(e) => return Some(Err(e)),
        };
        for &i in &segs {
            let s = self.seg(i);
            for &g in grants {
                merge_grant(&mut s.access, g);
            }
            if s.handle.is_some() {
                let (va, size) = (s.va, s.size);
                if let Err(e) = self.drv.set_access(va, size, grants) {
                    return Some(Err(e));
                }
            }
        }
        Some(Ok(()))
    }

    /// Another device's context enabled (`flags` 3) or disabled (0) peer access to
    /// this device: applied to every mapped segment now (where the application set no
    /// access of its own for that device) and to every later mapping.
    pub fn set_peer(&mut self, device: i32, flags: i32) -> Result<(), CUresult> {
        if flags == 0 {
            self.peers.retain(|g| g.0 != device);
        } else {
            merge_grant(&mut self.peers, (device, flags));
        }
        let mut r = Ok(());
        for i in 0..self.segs.len() {
            let Some(s) = self.segs[i].as_ref() else {
                continue;
            };
            if s.handle.is_none() || s.access.iter().any(|g| g.0 == device) {
                continue;
            }
            let (va, size) = (s.va, s.size);
            r = r.and(self.drv.set_access(va, size, &[(device, flags)]));
        }
        r
    }
}
