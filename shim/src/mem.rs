//! The VMM-backed allocator and swapper. Every allocation the application makes gets a
//! reserved virtual range of its own that never moves; physical memory is mapped into
//! it while resident and unmapped (contents kept in a pinned host buffer) while
//! swapped out, so device pointers stay valid across swaps.
//!
//! - Large allocations (more than half a granule) are split into segments of at most
//!   [`SEGMENT_MAX`] bytes, each with its own physical handle, so a partial eviction
//!   (`need_bytes`) need not move the whole allocation.
//! - Small allocations are carved out of shared one-granule chunks (256-byte aligned),
//!   so ten thousand 4 KiB allocations cost twenty 2 MiB handles, not ten thousand.
//! - Pinned host buffers are allocated when a swap-out needs more than the spare ones
//!   and reused for every later swap: a segment holds one only while it is swapped
//!   out; swapped back in, the buffer becomes a spare that any later swap-out may use
//!   (best fit). So the pinned memory is the most ever swapped out at once (at most
//!   the working set: spares past it are freed), not every segment ever swapped out,
//!   and a steady workload allocates no pinned memory (and on the simulator, touches
//!   no fresh page) while it swaps.
//! - Swaps are pipelined through [`Driver::to_host_async`] /
//!   [`Driver::to_device_async`] and [`Driver::wait_copies`]: while one segment's
//!   copy runs, the next segment's pinned buffer is allocated (swap-out) or its
//!   physical memory created and mapped (swap-in). A segment is unmapped only after its
//!   copy completed.
//! - Allocation never waits: when backing is not allowed (another process holds the
//!   GPU) the range is reserved and left unbacked until the next grant.
//!
//! Its parts: the allocator here, `driver` (the [`Driver`] it runs over), `swap` (the
//! swap engine), `host` (the host buffers swap-outs copy into), `access` (other
//! devices' access, kept across swaps), `share` (allocations shared through CUDA IPC),
//! `app` (the application's own VMM handles).
//!
//! This module does not talk to the arbiter and does not decide when to swap: the
//! client ([`crate::client`]) does. The driver sits behind [`Driver`] so the logic is
//! tested against a fake that checks every byte.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use crate::cuda::{CUresult, CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_OUT_OF_MEMORY};
use crate::live::Dead;

/// Largest physical handle a large allocation is split into.
pub const SEGMENT_MAX: u64 = 64 << 20;
/// Alignment of small allocations (what `cuMemAlloc` guarantees).
pub const SMALL_ALIGN: u64 = 256;
/// How long a swap-in waiting for room ([`Memory::swap_in_until`]) goes on with no
/// segment finding any. A previous holder's swap-out frees a segment every few ms
/// (64 MiB at 4 GB/s: 16 ms) once its queue drained (tens of ms); room that does not
/// come for this long is held by memory the arbiter cannot see, and the caller tells
/// it so ([`crate::client`]'s `no_room`) rather than wait out the whole deadline.
pub const ROOM_STALL: Duration = Duration::from_millis(200);

struct Chunk {
    /// Free ranges (offset, length), sorted by offset, coalesced.
    free: Vec<(u64, u64)>,
    used: u64,
}

struct Segment {
    va: u64,
    size: u64,
    handle: Option<u64>,
    /// The segment's contents while it is swapped out (`None` while resident, and for
    /// a segment never backed yet: it has no contents).
    host: Option<HostBuf>,
    /// LRU epoch: when the segment was last made resident or allocated.
    touch: u64,
    /// Sub-allocation state when this is a small-allocation chunk.
    chunk: Option<Chunk>,
    /// Other devices' access the application asked for (`cuMemSetAccess` on an
    /// allocation this segment holds), applied whenever it is mapped.
    access: Vec<Grant>,
    /// Pins of shared (IPC) allocations this segment holds: never evicted while > 0.
    pins: u32,
    /// The ranges the application declared dead (`kiwiMemDiscard`): a swap-out
    /// copies only the rest.
    dead: Dead,
    /// While swapped out: the pieces (offset, length) the host buffer holds, when
    /// not the whole segment (dead bytes were left behind).
    pieces: Option<Vec<(u64, u64)>>,
    /// The application's own handle, mapped by it whole at `va` (its range, not the
    /// allocator's): recreated with these properties on a swap-in.
    app: Option<AppProp>,
    /// While swapped out, instead of `host`: its contents moved to the node's disk
    /// tier ([`Driver::host_spill`]), by handle.
    spilled: Option<u64>,
}

impl Segment {
    /// `size` bytes at `va`, last touched at `touch`, never backed: no handle, no
    /// contents, no grants, pins or dead ranges.
    fn unbacked(va: u64, size: u64, touch: u64) -> Self {
        Segment {
            va,
            size,
            handle: None,
            host: None,
            touch,
            chunk: None,
            access: Vec::new(),
            pins: 0,
            dead: Dead::default(),
            pieces: None,
            app: None,
            spilled: None,
        }
    }
}

enum Alloc {
    Large {
        reserved: u64,
        size: u64,
        segs: Vec<usize>,
    },
    Small {
        seg: usize,
        off: u64,
        size: u64,
    },
}

/// Outcome of a swap.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Swap {
    /// Bytes copied (dead bytes, `kiwiMemDiscard`, are not).
    pub bytes: u64,
    pub duration: Duration,
    /// Bytes of GPU memory released (swap-out) or backed (swap-in): at least `bytes`,
    /// more when dead bytes moved without a copy.
    pub moved: u64,
}

/// Working set and residency, as reported to the arbiter.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Figures {
    /// Bytes the application's allocations occupy (granule-rounded, chunks whole) plus
    /// the application's own VMM handles.
    pub working_set: u64,
    /// Of those, bytes in GPU memory now.
    pub resident: u64,
    /// Of both, the application's own VMM handles: never swapped (the arbiter counts
    /// them as memory no swap frees, apart from the working set).
    pub external: u64,
}

pub struct Memory<D: Driver> {
    drv: D,
    gran: u64,
    segs: Vec<Option<Segment>>,
    free_slots: Vec<usize>,
    /// Allocation base pointer → allocation.
    allocs: BTreeMap<u64, Alloc>,
    /// Chunks that may have room.
    chunks: Vec<usize>,
    /// Whether new allocations may be backed now (this process may use the GPU).
    backing_allowed: bool,
    /// Working-set limit: an allocation past it fails with out-of-memory.
    limit: u64,
    epoch: u64,
    working_set: u64,
    resident: u64,
    /// The application's own VMM handles: handle → bytes (counted, never swapped).
    external: HashMap<u64, u64>,
    external_bytes: u64,
    /// Other devices' access to every mapping (`cuCtxEnablePeerAccess` from their
    /// contexts), applied whenever a segment is mapped.
    peers: Vec<Grant>,
    /// Pinned host buffers no segment holds, for the next swap-out.
    spare: Vec<HostBuf>,
    /// Bytes of pinned buffers the swap-out under way allocated on its critical path
    /// (none spare), and the time that took: logged at its end (`KIWI_LOG=debug`).
    pinned_now: u64,
    pinning_time: Duration,
    /// Bytes of every host buffer (held and spare, pinned or pageable).
    host_bytes: u64,
    /// Bytes of the swap-out under way copied into pageable buffers (none pinned was
    /// ready), logged at its end.
    pageable_now: u64,
    /// Buffers a segment let go while the pinning thread registered them: freed (or
    /// made spares) when the registration ends.
    limbo: Vec<HostBuf>,
    /// Allocations shared through IPC ([`crate::ipc`]): base → share.
    shared: HashMap<u64, Shared>,
    /// Bytes of the segments pinned by shared allocations (never evicted; reported
    /// as memory no swap frees).
    pinned: u64,
    /// The application's own mapped handles that swap ([`Memory::adopt_app`]): their
    /// address → segment.
    app_segs: BTreeMap<u64, usize>,
}

fn round_up(v: u64, to: u64) -> u64 {
    v.div_ceil(to) * to
}

impl<D: Driver> Memory<D> {
    pub fn new(drv: D) -> Result<Self, CUresult> {
        let gran = drv.granularity()?.max(SMALL_ALIGN);
        Ok(Self {
            drv,
            gran,
            segs: Vec::new(),
            free_slots: Vec::new(),
            allocs: BTreeMap::new(),
            chunks: Vec::new(),
            backing_allowed: true,
            limit: u64::MAX,
            epoch: 1,
            working_set: 0,
            resident: 0,
            external: HashMap::new(),
            external_bytes: 0,
            peers: Vec::new(),
            spare: Vec::new(),
            pinned_now: 0,
            pinning_time: Duration::ZERO,
            host_bytes: 0,
            pageable_now: 0,
            limbo: Vec::new(),
            shared: HashMap::new(),
            pinned: 0,
            app_segs: BTreeMap::new(),
        })
    }

    pub fn driver(&self) -> &D {
        &self.drv
    }

    pub fn granularity(&self) -> u64 {
        self.gran
    }

    pub fn set_backing_allowed(&mut self, allowed: bool) {
        self.backing_allowed = allowed;
    }

    pub fn set_limit(&mut self, limit: u64) {
        self.limit = limit;
    }

    pub fn figures(&self) -> Figures {
        Figures {
            working_set: self.working_set + self.external_bytes,
            resident: self.resident + self.external_bytes,
            // Pinned (shared) segments stay in the working set and resident, but no
            // swap frees them: reported apart like the application's own handles.
            external: self.external_bytes + self.pinned,
        }
    }

    /// Whether every segment is backed by device memory.
    pub fn all_resident(&self) -> bool {
        self.resident == self.working_set
    }

    /// Bytes of pinned host buffers the allocator holds now (swapped-out contents and
    /// spares).
    pub fn host_buffer_bytes(&self) -> u64 {
        self.host_bytes
    }

    /// Number of physical handles the allocator holds now (for tests and stats).
    pub fn handles(&self) -> usize {
        self.segs
            .iter()
            .flatten()
            .filter(|s| s.handle.is_some())
            .count()
    }

    fn new_seg(&mut self, seg: Segment) -> usize {
        if let Some(i) = self.free_slots.pop() {
            self.segs[i] = Some(seg);
            i
        } else {
            self.segs.push(Some(seg));
            self.segs.len() - 1
        }
    }

    fn seg(&mut self, i: usize) -> &mut Segment {
        self.segs[i].as_mut().expect("live segment")
    }

    fn size_of(&self, i: usize) -> u64 {
        self.segs[i].as_ref().expect("live segment").size
    }

    fn check_limit(&self, more: u64) -> Result<(), CUresult> {
        let after = self.working_set + self.external_bytes + more;
        if after > self.limit {
            crate::kinfo!(
                "allocation of {more} bytes refused: working set would be {after} > limit {}",
                self.limit
            );
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
        Ok(())
    }

    /// Backs segment `i` with a fresh physical handle, mapped read-write (its contents,
    /// if it has any, are still in its host buffer).
    fn map_fresh(&mut self, i: usize) -> Result<(), CUresult> {
        let (va, size) = {
            let s = self.seg(i);
            if s.handle.is_some() {
                return Ok(());
            }
            (s.va, s.size)
        };
        let h = match self.seg(i).app {
            Some(p) => self.drv.create_like(size, &p)?,
            None => self.drv.create(size)?,
        };
        if let Err(e) = self.drv.map(va, size, h) {
            let _ = self.drv.release(h);
            return Err(e);
        }
        let epoch = self.epoch;
        let s = self.seg(i);
        s.handle = Some(h);
        s.touch = epoch;
        self.resident += size;
        self.reapply_access(i);
        Ok(())
    }

    /// Undoes [`Self::map_fresh`] (after a failed copy-in: the contents stay in the
    /// host buffer).
    fn unmap_fresh(&mut self, i: usize) {
        let s = self.seg(i);
        let (va, size) = (s.va, s.size);
        if let Some(h) = s.handle.take() {
            let _ = self.drv.unmap(va, size);
            let _ = self.drv.release(h);
            self.resident -= size;
        }
    }

    /// Bytes the working set would grow by if `size` bytes were allocated now: a new
    /// chunk for a small allocation no chunk has room for, the granule-rounded size for
    /// a large one.
    pub fn growth(&self, size: u64) -> u64 {
        if size == 0 {
            0
        } else if size <= self.gran / 2 {
            let need = round_up(size, SMALL_ALIGN);
            let fits = self.chunks.iter().any(|&c| {
                self.segs[c]
                    .as_ref()
                    .and_then(|s| s.chunk.as_ref())
                    .is_some_and(|ch| ch.free.iter().any(|&(_, len)| len >= need))
            });
            if fits {
                0
            } else {
                self.gran
            }
        } else {
            round_up(size, self.gran)
        }
    }

    /// Allocates `size` bytes; the address never changes until it is freed.
    pub fn alloc(&mut self, size: u64) -> Result<u64, CUresult> {
        if size == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if size <= self.gran / 2 {
            self.alloc_small(size)
        } else {
            self.alloc_large(size)
        }
    }

    fn alloc_large(&mut self, size: u64) -> Result<u64, CUresult> {
        let reserved = round_up(size, self.gran);
        self.check_limit(reserved)?;
        let base = self.drv.reserve(reserved, self.gran)?;
        let mut segs = Vec::new();
        let mut off = 0;
        let seg_max = round_up(SEGMENT_MAX, self.gran);
        while off < reserved {
            let len = seg_max.min(reserved - off);
            let i = self.new_seg(Segment::unbacked(base + off, len, self.epoch));
            segs.push(i);
            off += len;
        }
        self.working_set += reserved;
        let mapped = if self.backing_allowed {
            segs.iter().try_for_each(|&i| self.map_fresh(i))
        } else {
            Ok(())
        };
        self.allocs.insert(
            base,
            Alloc::Large {
                reserved,
                size,
                segs,
            },
        );
        if let Err(e) = mapped {
            // Undo everything: the caller gets an error and no address.
            let _ = self.free(base);
            return Err(e);
        }
        Ok(base)
    }

    fn alloc_small(&mut self, size: u64) -> Result<u64, CUresult> {
        let need = round_up(size, SMALL_ALIGN);
        for ci in 0..self.chunks.len() {
            let seg = self.chunks[ci];
            let s = self.segs[seg].as_mut().expect("live chunk");
            let chunk = s.chunk.as_mut().expect("chunk");
            if let Some(pos) = chunk.free.iter().position(|&(_, len)| len >= need) {
                let (off, len) = chunk.free[pos];
                if len == need {
                    chunk.free.remove(pos);
                } else {
                    chunk.free[pos] = (off + need, len - need);
                }
                chunk.used += need;
                let va = s.va + off;
                self.allocs.insert(va, Alloc::Small { seg, off, size });
                return Ok(va);
            }
        }
        // A new chunk.
        self.check_limit(self.gran)?;
        let va = self.drv.reserve(self.gran, self.gran)?;
        let seg = self.new_seg(Segment {
            chunk: Some(Chunk {
                free: vec![(need, self.gran - need)],
                used: need,
            }),
            ..Segment::unbacked(va, self.gran, self.epoch)
        });
        self.working_set += self.gran;
        if self.backing_allowed {
            if let Err(e) = self.map_fresh(seg) {
                self.destroy_seg(seg);
                let _ = self.drv.free_va(va, self.gran);
                return Err(e);
            }
        }
        self.chunks.push(seg);
        self.allocs.insert(va, Alloc::Small { seg, off: 0, size });
        Ok(va)
    }

    /// Unmaps and releases a segment's handle and host buffer; forgets the segment.
    fn destroy_seg(&mut self, i: usize) {
        let Some(s) = self.segs[i].take() else {
            return;
        };
        if let Some(h) = s.handle {
            let _ = self.drv.unmap(s.va, s.size);
            let _ = self.drv.release(h);
            self.resident -= s.size;
        }
        if let Some(b) = s.host {
            self.recycle(b);
        }
        if let Some(h) = s.spilled {
            self.drv.spill_free(h);
        }
        self.working_set -= s.size;
        self.free_slots.push(i);
        self.trim_spare();
    }

    /// Whether `ptr` is the base of an allocation this allocator made.
    pub fn owns(&self, ptr: u64) -> bool {
        self.allocs.contains_key(&ptr)
    }

    /// Frees the allocation at `ptr`. Work that may still use it is waited for first
    /// ([`Driver::sync`], as `cuMemFree` does): a small allocation's range goes back
    /// to its chunk and is handed out again at once, and a kernel queued before the
    /// free would otherwise write into the next allocation there. When the wait fails
    /// the allocation stays allocated and the error is returned.
    pub fn free(&mut self, ptr: u64) -> Result<(), CUresult> {
        let mapped = match self.allocs.get(&ptr) {
            None => return Err(CUDA_ERROR_INVALID_VALUE),
            Some(Alloc::Large { segs, .. }) => segs
                .iter()
                .any(|&i| self.segs[i].as_ref().is_some_and(|s| s.handle.is_some())),
            Some(Alloc::Small { seg, .. }) => {
                self.segs[*seg].as_ref().is_some_and(|s| s.handle.is_some())
            }
        };
        if mapped {
            self.drv.sync()?;
        }
        self.forget_share(ptr);
        let Some(a) = self.allocs.remove(&ptr) else {
            return Err(CUDA_ERROR_INVALID_VALUE);
        };
        match a {
            Alloc::Large { reserved, segs, .. } => {
                for i in segs {
                    self.destroy_seg(i);
                }
                self.drv.free_va(ptr, reserved)?;
            }
            Alloc::Small { seg, off, size } => {
                let len = round_up(size, SMALL_ALIGN);
                let s = self.seg(seg);
                let chunk = s.chunk.as_mut().expect("chunk");
                chunk.used -= len;
                let pos = chunk.free.partition_point(|&(o, _)| o < off);
                chunk.free.insert(pos, (off, len));
                // Coalesce with the neighbours.
                if pos + 1 < chunk.free.len() && off + len == chunk.free[pos + 1].0 {
                    chunk.free[pos].1 += chunk.free[pos + 1].1;
                    chunk.free.remove(pos + 1);
                }
                if pos > 0 && chunk.free[pos - 1].0 + chunk.free[pos - 1].1 == off {
                    chunk.free[pos - 1].1 += chunk.free[pos].1;
                    chunk.free.remove(pos);
                }
                if chunk.used == 0 {
                    let (va, size) = (s.va, s.size);
                    self.chunks.retain(|&c| c != seg);
                    self.destroy_seg(seg);
                    self.drv.free_va(va, size)?;
                }
            }
        }
        Ok(())
    }

    /// The allocation containing `ptr`: (base, size).
    pub fn range_of(&self, ptr: u64) -> Option<(u64, u64)> {
        let (&base, a) = self.allocs.range(..=ptr).next_back()?;
        let size = match a {
            Alloc::Large { size, .. } | Alloc::Small { size, .. } => *size,
        };
        (ptr < base + size).then_some((base, size))
    }

    /// Declares `[ptr, ptr + bytes)` dead at submission token `token`
    /// (`kiwiMemDiscard`): a swap-out while the token is unchanged copies none of it
    /// (only whole bytes of the segments it covers are affected; a segment's dead and
    /// live parts are told apart to the byte), and a swap-in gives it back with
    /// undefined contents. The range must lie inside one allocation of this
    /// allocator, else `CUDA_ERROR_INVALID_VALUE` and nothing is marked. Returns the
    /// bytes marked (a segment whose list of ranges is full ignores the rest: a
    /// discard ignored is always safe). `None`: the range is checked, nothing marked.
    pub fn discard(&mut self, ptr: u64, bytes: u64, token: Option<u64>) -> Result<u64, CUresult> {
        let end = ptr.checked_add(bytes).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let (base, size) = self.range_of(ptr).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if bytes == 0 || end > base + size {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let Some(token) = token else {
            return Ok(0);
        };
        let segs: Vec<usize> = match &self.allocs[&base] {
            Alloc::Large { segs, .. } => segs.clone(),
            Alloc::Small { seg, .. } => vec![*seg],
        };
        let mut marked = 0;
        for i in segs {
            let s = self.seg(i);
            let (from, to) = (ptr.max(s.va), end.min(s.va + s.size));
            if from < to && s.dead.add(token, from - s.va, to - from) {
                marked += to - from;
            }
        }
        Ok(marked)
    }

    /// The pieces of segment `i` a swap-out at `token` copies.
    fn live_pieces(&self, i: usize, token: Option<u64>) -> Vec<(u64, u64)> {
        let s = self.segs[i].as_ref().expect("live segment");
        s.dead.live_pieces(token, s.size)
    }
}

mod access;
mod app;
mod driver;
mod host;
mod share;
mod swap;

pub use access::Grant;
pub use app::AppProp;
pub use driver::Driver;
use host::HostBuf;
use share::Shared;
pub use share::{PinError, SharedLayout};

#[cfg(test)]
pub mod fake;
#[cfg(test)]
mod tests;
