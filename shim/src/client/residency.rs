//! What a turn needs from its GPU's allocator ([`Residency`]): residency, eviction,
//! draining, and the pinning thread's preparations. `crate::devices` implements it over
//! the real driver; the client never sees how memory is swapped.

use super::*;

/// What a turn needs from its GPU's allocator: residency, eviction, draining.
pub trait Residency: Send + Sync {
    fn figures(&self) -> Figures;
    fn set_limit(&self, limit: u64);
    fn set_backing_allowed(&self, allowed: bool);
    fn all_resident(&self) -> bool;
    fn swap_in_all(&self) -> Result<Swap, CUresult>;
    /// Swaps everything in while another process frees the memory it needs, segment
    /// by segment: out of memory is tried again, at short intervals, until `until`.
    fn swap_in_waiting(&self, until: Instant) -> Result<Swap, CUresult> {
        let _ = until;
        self.swap_in_all()
    }
    fn evict(&self, need: u64) -> Result<Swap, CUresult>;
    /// Allocates up to about `budget` bytes of the pinned buffers `evict(need)` will
    /// need; returns the bytes allocated (0: ready). Called from the pinning thread:
    /// it must not hold the allocator's lock while it pins.
    fn prepare_swap_out(&self, need: u64, budget: u64) -> Result<u64, CUresult> {
        let _ = (need, budget);
        Ok(0)
    }
    /// Page-locks in place up to about `budget` bytes of the pageable buffers that
    /// hold swapped-out contents (a swap-out that found no pinned buffer ready copied
    /// into plain memory), so their swap-in copies at pinned speed; returns the bytes
    /// registered (0: none left). Called from the pinning thread, without the
    /// allocator's lock held while it registers.
    fn register_swapped(&self, budget: u64) -> Result<u64, CUresult> {
        let _ = budget;
        Ok(0)
    }
    /// Frees the spare pinned buffers (none holds swapped-out contents); returns the
    /// bytes freed.
    fn trim_spare_buffers(&self) -> u64 {
        0
    }
    /// Gives back up to about `budget` bytes of the node's swap pool: spare buffers,
    /// then swapped-out contents moved to the pool's disk tier (the arbiter's
    /// `pool_reclaim`); returns the bytes given back (0: nothing more can be).
    /// Called from the pinning thread.
    fn spill(&self, budget: u64) -> u64 {
        let _ = budget;
        0
    }
    /// Waits until this process's queued GPU work on this GPU is done.
    fn drain(&self) -> Result<(), CUresult>;
    /// [`Residency::drain`] for at most `limit`: `Ok(false)` when the work was not
    /// done by then (it may wait for work not yet submitted: a peer's part of a
    /// collective on another GPU).
    fn drain_within(&self, limit: Duration) -> Result<bool, CUresult> {
        let _ = limit;
        self.drain().map(|()| true)
    }
    /// Runs `f` with the allocator locked, so its residency cannot change meanwhile
    /// (an allocation left unbacked closes the gate under that lock), passing whether
    /// everything is resident; returns `f`'s answer.
    fn locked(&self, f: &mut dyn FnMut(bool) -> bool) -> bool {
        f(self.all_resident())
    }
}
