//! Allocations of [`Memory`] shared through CUDA IPC ([`crate::ipc`]): their pins
//! keep them resident while another process may map them.

use super::*;

/// One allocation shared through IPC: the share's id ([`crate::ipc`]) and the pins
/// it holds (one per importer with it open, or one for an export not yet opened).
pub(super) struct Shared {
    id: u64,
    pins: u32,
}

/// What an importer needs of a pinned shared allocation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharedLayout {
    pub base: u64,
    pub size: u64,
    /// Offset of `base` in the first segment (a small allocation in its chunk).
    pub offset: u64,
    /// The segments holding it, in address order: (size, physical handle).
    pub segments: Vec<(u64, u64)>,
}

/// Why a shared allocation could not be pinned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PinError {
    /// Some of it is swapped out (or never backed): pin it during the turn.
    NotResident,
    /// No such allocation, or it is no longer the one that share was made of.
    Stale,
}

/// IPC sharing ([`crate::ipc`]): a pinned segment is never evicted, so its physical
/// handles (which importers mapped) stay the same until the last pin goes.
impl<D: Driver> Memory<D> {
    fn alloc_segments(&self, base: u64) -> Option<(u64, Vec<usize>)> {
        match self.allocs.get(&base)? {
            Alloc::Large { size, segs, .. } => Some((*size, segs.clone())),
            Alloc::Small { seg, size, .. } => Some((*size, vec![*seg])),
        }
    }

    /// The id of the share of the allocation at `base`, if it was ever pinned.
    pub fn share_id(&self, base: u64) -> Option<u64> {
        self.shared.get(&base).map(|s| s.id)
    }

    /// Pins the allocation at `base` for share `id` (`first`: the share may be
    /// new). Every segment holding it must be resident.
    pub fn pin_shared(&mut self, base: u64, id: u64, first: bool) -> Result<(), PinError> {
        let (_, segs) = self.alloc_segments(base).ok_or(PinError::Stale)?;
        match self.shared.get(&base) {
            Some(s) if s.id != id => return Err(PinError::Stale),
            None if !first => return Err(PinError::Stale),
            _ => {}
        }
        if segs
            .iter()
            .any(|&i| self.segs[i].as_ref().is_none_or(|s| s.handle.is_none()))
        {
            return Err(PinError::NotResident);
        }
        for i in segs {
            let s = self.seg(i);
            s.pins += 1;
            if s.pins == 1 {
                let size = s.size;
                self.pinned += size;
            }
        }
        self.shared
            .entry(base)
            .or_insert(Shared { id, pins: 0 })
            .pins += 1;
        Ok(())
    }

    /// Gives back one pin of share `id` on the allocation at `base` (nothing when
    /// that share is gone: the allocation was freed).
    pub fn unpin_shared(&mut self, base: u64, id: u64) {
        match self.shared.get_mut(&base) {
            Some(s) if s.id == id && s.pins > 0 => s.pins -= 1,
            _ => return,
        }
        self.unpin_segments(base, 1);
    }

    fn unpin_segments(&mut self, base: u64, n: u32) {
        let Some((_, segs)) = self.alloc_segments(base) else {
            return;
        };
        for i in segs {
            let s = self.seg(i);
            let before = s.pins;
            s.pins = s.pins.saturating_sub(n);
            if before > 0 && s.pins == 0 {
                let size = s.size;
                self.pinned -= size;
            }
        }
    }

    /// The layout of the allocation at `base` while share `id` pins it.
    pub fn shared_layout(&self, base: u64, id: u64) -> Option<SharedLayout> {
        self.shared
            .get(&base)
            .filter(|s| s.id == id && s.pins > 0)?;
        let (size, segs) = self.alloc_segments(base)?;
        let mut segments = Vec::with_capacity(segs.len());
        for &i in &segs {
            let s = self.segs[i].as_ref()?;
            segments.push((s.size, s.handle?));
        }
        let first = self.segs[*segs.first()?].as_ref()?.va;
        Some(SharedLayout {
            base,
            size,
            offset: base - first,
            segments,
        })
    }

    /// The allocation at `base` is being freed: its share (if any) ends.
    pub(super) fn forget_share(&mut self, base: u64) {
        if let Some(s) = self.shared.remove(&base) {
            self.unpin_segments(base, s.pins);
        }
    }
}
