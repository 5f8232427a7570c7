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
    /// Frees a buffer [`Driver::host_alloc`] returned for `size` bytes.
    fn host_free(&self, p: *mut u8, size: u64);
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
    /// Waits until every piece of work of this process's context is done.
    fn sync(&self) -> Result<(), CUresult>;
    /// Grants other devices access to the mapping at `va` (`cuMemSetAccess`), beyond
    /// the read-write access [`Driver::map`] gives the owning device. The default does
    /// nothing.
    fn set_access(&self, _va: u64, _size: u64, _grants: &[Grant]) -> Result<(), CUresult> {
        Ok(())
    }
}

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

/// Access of one other device to a mapping: (device ordinal, `CUmemAccess_flags`:
/// 0 none, 1 read, 3 read-write). The application's `cuMemSetAccess` and
/// `cuCtxEnablePeerAccess` are recorded as grants and applied to every new mapping,
/// so they survive swaps.
pub type Grant = (i32, i32);

/// Sets `device`'s entry in `grants` (a later grant replaces an earlier one).
fn merge_grant(grants: &mut Vec<Grant>, g: Grant) {
    match grants.iter_mut().find(|x| x.0 == g.0) {
        Some(x) => x.1 = g.1,
        None => grants.push(g),
    }
}

/// A pinned host buffer: held by a swapped-out segment (its contents) or spare.
struct HostBuf {
    ptr: *mut u8,
    /// Bytes allocated (at least the size of the segment it holds).
    cap: u64,
}
// SAFETY: the buffer is plain memory owned by the allocator (a segment or the spares);
// only the thread holding the allocator's lock touches it.
unsafe impl Send for HostBuf {}

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
    /// Bytes of every pinned host buffer (held and spare).
    host_bytes: u64,
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
    fn reapply_access(&mut self, i: usize) {
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

    /// A spare pinned buffer for `size` bytes: the exact size if there is one, else the
    /// smallest larger one.
    fn take_spare(&mut self, size: u64) -> Option<HostBuf> {
        let k = self
            .spare
            .iter()
            .enumerate()
            .filter(|(_, b)| b.cap >= size)
            .min_by_key(|(_, b)| b.cap)
            .map(|(k, _)| k)?;
        Some(self.spare.swap_remove(k))
    }

    fn new_host_buf(&mut self, size: u64) -> Result<HostBuf, CUresult> {
        let t = Instant::now();
        let ptr = self.drv.host_alloc(size)?;
        self.host_bytes += size;
        self.pinned_now += size;
        self.pinning_time += t.elapsed();
        Ok(HostBuf { ptr, cap: size })
    }

    /// Frees spare pinned buffers (largest first) while all pinned buffers together
    /// exceed the working set: more is never needed at once.
    fn trim_spare(&mut self) {
        while self.host_bytes > self.working_set {
            let Some(k) = (0..self.spare.len()).max_by_key(|&k| self.spare[k].cap) else {
                break;
            };
            let b = self.spare.swap_remove(k);
            self.drv.host_free(b.ptr, b.cap);
            self.host_bytes -= b.cap;
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
            let i = self.new_seg(Segment {
                va: base + off,
                size: len,
                handle: None,
                host: None,
                touch: self.epoch,
                chunk: None,
                access: Vec::new(),
                pins: 0,
                dead: Dead::default(),
                pieces: None,
                app: None,
            });
            segs.push(i);
            off += len;
        }
        self.working_set += reserved;
        if self.backing_allowed {
            for k in 0..segs.len() {
                if let Err(e) = self.map_fresh(segs[k]) {
                    // Undo everything: the caller gets an error and no address.
                    self.allocs.insert(
                        base,
                        Alloc::Large {
                            reserved,
                            size,
                            segs,
                        },
                    );
                    let _ = self.free(base);
                    return Err(e);
                }
            }
        }
        self.allocs.insert(
            base,
            Alloc::Large {
                reserved,
                size,
                segs,
            },
        );
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
            va,
            size: self.gran,
            handle: None,
            host: None,
            touch: self.epoch,
            chunk: Some(Chunk {
                free: vec![(need, self.gran - need)],
                used: need,
            }),
            access: Vec::new(),
            pins: 0,
            dead: Dead::default(),
            pieces: None,
            app: None,
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
            self.spare.push(b);
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

    /// Brings every segment back into GPU memory at its own address. While one
    /// segment's contents are copied in, the next one's physical memory is created and
    /// mapped. On error the segments done so far stay resident and the rest stay out,
    /// consistent (a later call goes on with the rest).
    pub fn swap_in_all(&mut self) -> Result<Swap, CUresult> {
        self.swap_in_until(None)
    }

    /// [`Memory::swap_in_all`] for a swap-in that runs while another process frees
    /// the memory it needs, segment by segment (a pipelined hand-off): a segment whose
    /// physical memory cannot be created yet (out of memory) is tried again after a
    /// short pause (0.5 ms, doubling to 2 ms) until `deadline`, or until no room came
    /// for [`ROOM_STALL`]; then the error is returned as by `swap_in_all`. `None`: one
    /// try.
    pub fn swap_in_until(&mut self, deadline: Option<Instant>) -> Result<Swap, CUresult> {
        let start = Instant::now();
        let resident_before = self.resident;
        self.epoch += 1;
        let todo: Vec<usize> = (0..self.segs.len())
            .filter(|&i| self.segs[i].as_ref().is_some_and(|s| s.handle.is_none()))
            .collect();
        let mut bytes = 0;
        for (k, &i) in todo.iter().enumerate() {
            // Each segment that found room restarts the stall window.
            let deadline = deadline.map(|d| d.min(Instant::now() + ROOM_STALL));
            // Mapped during the previous copy, unless there was no room yet.
            self.map_fresh_until(i, deadline)?;
            let next = todo.get(k + 1).copied();
            let (va, host, pieces) = {
                let s = self.seg(i);
                let pieces = s.pieces.clone().unwrap_or_else(|| vec![(0, s.size)]);
                (s.va, s.host.as_ref().map(|b| b.ptr), pieces)
            };
            if let Some(host) = host {
                for &(off, len) in &pieces {
                    // SAFETY: the segment's host buffer holds at least its size (the
                    // pieces lie inside it); it stays in the segment, untouched,
                    // until the copy is waited for below.
                    let r = unsafe {
                        self.drv
                            .to_device_async(va + off, host.add(off as usize), len)
                    };
                    if let Err(e) = r {
                        let _ = self.drv.wait_copies();
                        self.unmap_fresh(i);
                        return Err(e);
                    }
                }
            }
            // While the copy runs: the next segment's memory. Waiting for room, it is
            // tried again while the copy runs (the memory may come free meanwhile),
            // else after it.
            let mapped_next = next.map(|n| self.map_during_copy(n, deadline));
            if host.is_some() {
                if let Err(e) = self.drv.wait_copies() {
                    self.unmap_fresh(i);
                    if let (Some(n), Some(Ok(()))) = (next, &mapped_next) {
                        self.unmap_fresh(n);
                    }
                    return Err(e);
                }
                let s = self.seg(i);
                let b = s.host.take().expect("checked above");
                s.pieces = None;
                self.spare.push(b);
                bytes += pieces.iter().map(|p| p.1).sum::<u64>();
            }
            match mapped_next {
                Some(Err(CUDA_ERROR_OUT_OF_MEMORY)) | Some(Ok(())) | None => {}
                Some(Err(e)) => return Err(e),
            }
        }
        Ok(Swap {
            bytes,
            duration: start.elapsed(),
            moved: self.resident - resident_before,
        })
    }

    /// [`Memory::map_fresh`] while a copy runs; waiting for room (`deadline`), tried
    /// again on out-of-memory every 0.5 ms until the copy is done (when the driver can
    /// tell), so that creating the memory overlaps the copy.
    fn map_during_copy(&mut self, i: usize, deadline: Option<Instant>) -> Result<(), CUresult> {
        loop {
            let r = self.map_fresh(i);
            let waiting = deadline.is_some_and(|d| Instant::now() < d);
            if r != Err(CUDA_ERROR_OUT_OF_MEMORY)
                || !waiting
                || self.drv.copies_done() != Some(false)
            {
                return r;
            }
            std::thread::sleep(Duration::from_micros(500));
        }
    }

    /// [`Memory::map_fresh`], tried again on out-of-memory until `deadline`.
    fn map_fresh_until(&mut self, i: usize, deadline: Option<Instant>) -> Result<(), CUresult> {
        let mut pause = Duration::from_micros(500);
        loop {
            match self.map_fresh(i) {
                Err(CUDA_ERROR_OUT_OF_MEMORY) if deadline.is_some_and(|d| Instant::now() < d) => {
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(Duration::from_millis(2));
                }
                r => return r,
            }
        }
    }

    /// Evicts at least `need` bytes (all of them for `u64::MAX`), least recently used
    /// first. The caller has drained the GPU work of this process. While one segment
    /// is copied out, the next one's pinned buffer is allocated (when no spare fits).
    /// On error the segments done so far stay out and the rest stay resident.
    pub fn evict(&mut self, need: u64) -> Result<Swap, CUresult> {
        self.evict_live(need, None)
    }

    /// [`Memory::evict`] at submission token `token`: the bytes declared dead at that
    /// token ([`Memory::discard`]) are not copied, and segments with no live byte go
    /// first (they cost no copy and no host buffer). `None`: every byte is copied.
    /// [`Swap::bytes`] counts the bytes copied.
    pub fn evict_live(&mut self, need: u64, token: Option<u64>) -> Result<Swap, CUresult> {
        let start = Instant::now();
        let resident_before = self.resident;
        let victims = self.victims(need, token);
        let pieces: Vec<Vec<(u64, u64)>> = victims
            .iter()
            .map(|&i| self.live_pieces(i, token))
            .collect();
        // Spare buffers first, largest segments first (so a large spare is not taken by
        // a small segment while a large one goes without); new ones while copying. A
        // segment with nothing live needs none.
        let mut bufs: Vec<Option<HostBuf>> = victims.iter().map(|_| None).collect();
        for k in self.largest_first(&victims) {
            if !pieces[k].is_empty() {
                bufs[k] = self.take_spare(self.size_of(victims[k]));
            }
        }
        let spared = bufs.iter().flatten().map(|b| b.cap).sum::<u64>();
        (self.pinned_now, self.pinning_time) = (0, Duration::ZERO);
        let r = self.evict_planned(&victims, &pieces, &mut bufs);
        // Buffers prepared for segments that were not reached.
        self.spare.extend(bufs.into_iter().flatten());
        self.trim_spare();
        crate::kdebug!(
            "swap-out of {} MiB in {:?}: {} MiB into buffers pinned ahead, {} MiB pinned now in {:?}",
            r.as_ref().map_or(0, |b| b >> 20),
            start.elapsed(),
            spared >> 20,
            self.pinned_now >> 20,
            self.pinning_time
        );
        Ok(Swap {
            bytes: r?,
            duration: start.elapsed(),
            moved: resident_before - self.resident,
        })
    }

    /// Allocates, ahead of time, the pinned buffers that `evict(need)` would have to
    /// allocate now (what no spare covers), at most `budget` bytes of them in this
    /// call; returns the bytes allocated (0: nothing left to prepare). A client that
    /// calls it while it still holds the GPU (a little at a time, once others wait)
    /// moves the pinned allocation off the critical path of its next release.
    pub fn prepare_swap_out(&mut self, need: u64, budget: u64) -> Result<u64, CUresult> {
        let mut done = 0;
        for size in self.swap_out_shortfall(need) {
            // At least one buffer per call, however small the budget.
            if done > 0 && done + size > budget {
                break;
            }
            let b = self.new_host_buf(size)?;
            self.spare.push(b);
            done += size;
        }
        Ok(done)
    }

    /// The sizes of the pinned buffers `evict(need)` would have to allocate now (what
    /// no spare covers), largest first. [`Memory::prepare_swap_out`] allocates them
    /// under the allocator's lock; a caller that must not hold it that long (pinning
    /// runs at a few GB/s) allocates them through its own driver handle and hands
    /// them over with [`Memory::add_spare`].
    pub fn swap_out_shortfall(&self, need: u64) -> Vec<u64> {
        let victims = self.victims(need, None);
        let mut caps: Vec<u64> = self.spare.iter().map(|b| b.cap).collect();
        let mut missing = Vec::new();
        for k in self.largest_first(&victims) {
            let size = self.size_of(victims[k]);
            // The spare evict would take (see take_spare), if any.
            let fit = (0..caps.len())
                .filter(|&c| caps[c] >= size)
                .min_by_key(|&c| caps[c]);
            match fit {
                Some(c) => {
                    caps.swap_remove(c);
                }
                None => missing.push(size),
            }
        }
        missing
    }

    /// Takes a pinned buffer of `cap` bytes, allocated with this allocator's driver
    /// (`host_alloc`) outside its lock, as a spare; trimmed at once if the spares then
    /// pass the working set.
    ///
    /// # Safety
    /// `ptr` came from `host_alloc(cap)` of this allocator's driver, is not freed and
    /// is owned by nobody else from now on.
    pub unsafe fn add_spare(&mut self, ptr: *mut u8, cap: u64) {
        self.host_bytes += cap;
        self.spare.push(HostBuf { ptr, cap });
        self.trim_spare();
    }

    /// Frees every spare pinned buffer (those holding a swapped-out segment's contents
    /// stay); returns the bytes freed. For a GPU that stopped being oversubscribed:
    /// no swap is due, the pinned host RAM goes back to the node.
    pub fn release_spares(&mut self) -> u64 {
        let mut freed = 0;
        for b in std::mem::take(&mut self.spare) {
            self.drv.host_free(b.ptr, b.cap);
            self.host_bytes -= b.cap;
            freed += b.cap;
        }
        freed
    }

    /// The resident segments `evict(need)` takes: those with nothing live at `token`
    /// first, then least recently used first, until `need` bytes.
    fn victims(&self, need: u64, token: Option<u64>) -> Vec<usize> {
        let mut order: Vec<(bool, u64, usize)> = self
            .segs
            .iter()
            .enumerate()
            .filter_map(|(i, s)| {
                s.as_ref()
                    .filter(|s| s.handle.is_some() && s.pins == 0)
                    .map(|s| (s.dead.live_bytes(token, s.size) > 0, s.touch, i))
            })
            .collect();
        order.sort_unstable();
        let mut victims = Vec::new();
        let mut planned = 0;
        for (_, _, i) in order {
            if planned >= need {
                break;
            }
            planned += self.size_of(i);
            victims.push(i);
        }
        victims
    }

    /// Indices into `victims`, largest segment first.
    fn largest_first(&self, victims: &[usize]) -> Vec<usize> {
        let mut by_size: Vec<usize> = (0..victims.len()).collect();
        by_size.sort_by_key(|&k| std::cmp::Reverse(self.size_of(victims[k])));
        by_size
    }

    /// Copies out and releases each victim, `pieces[k]` of victim `k` (none: nothing
    /// live, released without a copy or a buffer). Returns the bytes copied.
    fn evict_planned(
        &mut self,
        victims: &[usize],
        pieces: &[Vec<(u64, u64)>],
        bufs: &mut [Option<HostBuf>],
    ) -> Result<u64, CUresult> {
        let mut bytes = 0;
        let needs_buf = |k: usize| pieces.get(k).is_some_and(|p| !p.is_empty());
        if let (Some(&first), Some(slot @ None)) = (victims.first(), bufs.first_mut()) {
            if needs_buf(0) {
                *slot = Some(self.new_host_buf(self.size_of(first))?);
            }
        }
        for (k, &i) in victims.iter().enumerate() {
            let (va, size, handle) = {
                let s = self.seg(i);
                (s.va, s.size, s.handle.expect("victims are resident"))
            };
            let buf = bufs[k].take();
            debug_assert_eq!(buf.is_some(), needs_buf(k), "prepared in the previous step");
            let give_back = |m: &mut Self, buf: Option<HostBuf>| m.spare.extend(buf);
            if let Some(b) = &buf {
                for &(off, len) in &pieces[k] {
                    // SAFETY: the buffer holds at least `size` bytes (the pieces lie
                    // inside the segment); it is kept aside, untouched, until the copy
                    // is waited for below.
                    let r = unsafe {
                        self.drv
                            .to_host_async(b.ptr.add(off as usize), va + off, len)
                    };
                    if let Err(e) = r {
                        let _ = self.drv.wait_copies();
                        give_back(self, buf);
                        return Err(e);
                    }
                }
            }
            // While the copy runs: the next segment's buffer, if no spare fit.
            let mut next_err = None;
            if let Some(slot @ None) = bufs.get_mut(k + 1) {
                if needs_buf(k + 1) {
                    match self.new_host_buf(self.size_of(victims[k + 1])) {
                        Ok(b) => *slot = Some(b),
                        Err(e) => next_err = Some(e),
                    }
                }
            }
            if let Err(e) = self.drv.wait_copies() {
                give_back(self, buf);
                return Err(e);
            }
            // Unmapped only now: the copy has read every live byte.
            if let Err(e) = self.drv.unmap(va, size) {
                give_back(self, buf);
                return Err(e);
            }
            let _ = self.drv.release(handle);
            let copied: u64 = pieces[k].iter().map(|p| p.1).sum();
            let s = self.seg(i);
            s.handle = None;
            s.pieces = (buf.is_some() && copied < size).then(|| pieces[k].clone());
            s.host = buf;
            self.resident -= size;
            bytes += copied;
            if let Some(e) = next_err {
                return Err(e);
            }
        }
        Ok(bytes)
    }

    /// The application's own mapped handle holding `ptr`, if it swaps.
    fn app_seg_at(&self, ptr: u64) -> Option<usize> {
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
            va,
            size,
            handle: Some(handle),
            host: None,
            touch: epoch,
            chunk: None,
            access: Vec::new(),
            pins: 0,
            dead: Dead::default(),
            pieces: None,
            app: Some(prop),
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
        self.spare.extend(s.host);
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

/// One allocation shared through IPC: the share's id ([`crate::ipc`]) and the pins
/// it holds (one per importer with it open, or one for an export not yet opened).
struct Shared {
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
    fn forget_share(&mut self, base: u64) {
        if let Some(s) = self.shared.remove(&base) {
            self.unpin_segments(base, s.pins);
        }
    }
}

#[cfg(test)]
pub mod fake {
    //! A fake driver keeping "device memory" in host vectors: physical handles hold
    //! bytes, mappings place them at virtual addresses, and every access to an
    //! unmapped address is an error, as on a real GPU. Pinned host buffers are tracked:
    //! a copy to or from anything but a live buffer, or a double free, panics. With
    //! `asynchronous`, `to_host_async` / `to_device_async` only queue the copy and
    //! `wait_copies` runs the queue, as a copy engine would: a swapper that unmapped a
    //! segment before waiting for its copy would read an unmapped address.

    use super::*;
    use std::cell::RefCell;

    enum Pending {
        ToHost { dst: usize, src: u64, n: u64 },
        ToDevice { dst: u64, src: usize, n: u64 },
    }

    #[derive(Default)]
    pub struct State {
        pub next_va: u64,
        pub next_handle: u64,
        pub handles: HashMap<u64, Vec<u8>>,
        /// va → (size, handle)
        pub maps: BTreeMap<u64, (u64, u64)>,
        pub reserved: BTreeMap<u64, u64>,
        pub physical_used: u64,
        pub physical_limit: u64,
        pub syncs: u64,
        pub host_allocs: u64,
        /// Live pinned host buffers: address → length.
        pub host: BTreeMap<usize, usize>,
        pub host_used: u64,
        pub host_limit: u64,
        /// Queue copies until `wait_copies` (a copy engine) instead of copying at once.
        pub asynchronous: bool,
        pending: Vec<Pending>,
        /// Driver calls (allocations, maps) made while a copy was in flight.
        pub overlapped: u64,
        /// Copies started (both directions).
        pub copies: u64,
        /// Fail the copy with this number (counting from 1) at its execution.
        pub fail_copy: Option<u64>,
        /// Other devices' access per mapping (va → grants); a new mapping has none.
        pub access: BTreeMap<u64, Vec<Grant>>,
    }

    pub struct FakeDriver {
        pub st: RefCell<State>,
    }

    // SAFETY: tests use a FakeDriver from one thread at a time.
    unsafe impl Send for FakeDriver {}

    pub const GRAN: u64 = 2 << 20;

    impl FakeDriver {
        pub fn new(physical_limit: u64) -> Self {
            Self {
                st: RefCell::new(State {
                    next_va: 0x7000_0000_0000,
                    next_handle: 1,
                    physical_limit,
                    host_limit: u64::MAX,
                    ..Default::default()
                }),
            }
        }

        /// The same with copies queued until `wait_copies`.
        pub fn asynchronous(physical_limit: u64) -> Self {
            let d = Self::new(physical_limit);
            d.st.borrow_mut().asynchronous = true;
            d
        }

        /// Writes bytes as a kernel would (across mappings); fails on unmapped memory.
        pub fn poke(&self, va: u64, data: &[u8]) -> Result<(), CUresult> {
            let mut done = 0usize;
            while done < data.len() {
                let at = va + done as u64;
                let (h, off, avail) = self.locate(at)?;
                let n = avail.min((data.len() - done) as u64) as usize;
                let mut st = self.st.borrow_mut();
                st.handles.get_mut(&h).unwrap()[off as usize..off as usize + n]
                    .copy_from_slice(&data[done..done + n]);
                done += n;
            }
            Ok(())
        }

        pub fn peek(&self, va: u64, n: usize) -> Result<Vec<u8>, CUresult> {
            let mut out = Vec::with_capacity(n);
            while out.len() < n {
                let at = va + out.len() as u64;
                let (h, off, avail) = self.locate(at)?;
                let k = avail.min((n - out.len()) as u64) as usize;
                let st = self.st.borrow();
                out.extend_from_slice(&st.handles[&h][off as usize..off as usize + k]);
            }
            Ok(out)
        }

        /// The mapping holding `va`: (handle, offset in it, bytes left in it).
        fn locate(&self, va: u64) -> Result<(u64, u64, u64), CUresult> {
            let st = self.st.borrow();
            let (&base, &(size, h)) = st.maps.range(..=va).next_back().ok_or(700)?;
            if va >= base + size {
                return Err(700);
            }
            Ok((h, va - base, base + size - va))
        }

        /// Panics unless `[p, p+n)` lies in one live pinned buffer.
        fn check_host(&self, p: usize, n: u64) {
            let st = self.st.borrow();
            let ok = st
                .host
                .range(..=p)
                .next_back()
                .is_some_and(|(&s, &l)| p + n as usize <= s + l);
            assert!(
                ok,
                "copy with a host range outside every live pinned buffer"
            );
        }

        /// Counts a driver call made while a copy is queued.
        fn note_overlap(&self) {
            let mut st = self.st.borrow_mut();
            if !st.pending.is_empty() {
                st.overlapped += 1;
            }
        }

        fn start_copy(&self) -> Result<(), CUresult> {
            let mut st = self.st.borrow_mut();
            st.copies += 1;
            if st.fail_copy == Some(st.copies) {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            Ok(())
        }
    }

    impl Driver for FakeDriver {
        fn granularity(&self) -> Result<u64, CUresult> {
            Ok(GRAN)
        }
        fn reserve(&self, size: u64, align: u64) -> Result<u64, CUresult> {
            let mut st = self.st.borrow_mut();
            let va = round_up(st.next_va, align);
            st.next_va = va + size + align;
            st.reserved.insert(va, size);
            Ok(va)
        }
        fn free_va(&self, va: u64, size: u64) -> Result<(), CUresult> {
            let mut st = self.st.borrow_mut();
            match st.reserved.remove(&va) {
                Some(s) if s == size => Ok(()),
                _ => Err(1),
            }
        }
        fn create(&self, size: u64) -> Result<u64, CUresult> {
            self.note_overlap();
            let mut st = self.st.borrow_mut();
            if st.physical_used + size > st.physical_limit {
                return Err(CUDA_ERROR_OUT_OF_MEMORY);
            }
            st.physical_used += size;
            let h = st.next_handle;
            st.next_handle += 1;
            // Fresh physical memory holds garbage, not the old contents.
            st.handles.insert(h, vec![0xee; size as usize]);
            Ok(h)
        }
        fn release(&self, handle: u64) -> Result<(), CUresult> {
            let mut st = self.st.borrow_mut();
            let v = st.handles.remove(&handle).ok_or(1)?;
            st.physical_used -= v.len() as u64;
            Ok(())
        }
        fn map(&self, va: u64, size: u64, handle: u64) -> Result<(), CUresult> {
            let mut st = self.st.borrow_mut();
            assert!(st.handles.contains_key(&handle));
            let inside = st
                .reserved
                .range(..=va)
                .next_back()
                .is_some_and(|(&b, &s)| va + size <= b + s);
            assert!(inside, "map outside a reservation");
            assert!(st.maps.insert(va, (size, handle)).is_none(), "double map");
            Ok(())
        }
        fn unmap(&self, va: u64, size: u64) -> Result<(), CUresult> {
            let mut st = self.st.borrow_mut();
            st.access.remove(&va);
            match st.maps.remove(&va) {
                Some((s, _)) if s == size => Ok(()),
                _ => Err(1),
            }
        }
        fn host_alloc(&self, size: u64) -> Result<*mut u8, CUresult> {
            self.note_overlap();
            let mut st = self.st.borrow_mut();
            if st.host_used + size > st.host_limit {
                return Err(CUDA_ERROR_OUT_OF_MEMORY);
            }
            st.host_allocs += 1;
            st.host_used += size;
            let v = vec![0u8; size as usize].into_boxed_slice();
            let p = Box::into_raw(v) as *mut u8;
            st.host.insert(p as usize, size as usize);
            Ok(p)
        }
        fn host_free(&self, p: *mut u8, size: u64) {
            let mut st = self.st.borrow_mut();
            assert!(st.pending.is_empty(), "pinned buffer freed under a copy");
            let len = st.host.remove(&(p as usize)).expect("double or bad free");
            assert_eq!(len as u64, size, "freed with another size than allocated");
            st.host_used -= len as u64;
            // SAFETY: `p` came from host_alloc's Box<[u8]> of `len` bytes, freed once.
            drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(p, len)) });
        }
        unsafe fn to_host(&self, dst: *mut u8, src: u64, n: u64) -> Result<(), CUresult> {
            self.check_host(dst as usize, n);
            let data = self.peek(src, n as usize)?;
            // SAFETY: dst lies in a live host buffer of at least n bytes (checked).
            unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), dst, n as usize) };
            Ok(())
        }
        unsafe fn to_device(&self, dst: u64, src: *const u8, n: u64) -> Result<(), CUresult> {
            self.check_host(src as usize, n);
            // SAFETY: src lies in a live host buffer of at least n bytes (checked).
            let data = unsafe { std::slice::from_raw_parts(src, n as usize) };
            self.poke(dst, data)
        }
        unsafe fn to_host_async(&self, dst: *mut u8, src: u64, n: u64) -> Result<(), CUresult> {
            self.start_copy()?;
            if !self.st.borrow().asynchronous {
                // SAFETY: the caller's contract.
                return unsafe { self.to_host(dst, src, n) };
            }
            self.check_host(dst as usize, n);
            // A bad device range is refused at submission, as the driver does.
            self.locate(src)?;
            self.st.borrow_mut().pending.push(Pending::ToHost {
                dst: dst as usize,
                src,
                n,
            });
            Ok(())
        }
        unsafe fn to_device_async(&self, dst: u64, src: *const u8, n: u64) -> Result<(), CUresult> {
            self.start_copy()?;
            if !self.st.borrow().asynchronous {
                // SAFETY: the caller's contract.
                return unsafe { self.to_device(dst, src, n) };
            }
            self.check_host(src as usize, n);
            self.locate(dst)?;
            self.st.borrow_mut().pending.push(Pending::ToDevice {
                dst,
                src: src as usize,
                n,
            });
            Ok(())
        }
        fn wait_copies(&self) -> Result<(), CUresult> {
            let pending = std::mem::take(&mut self.st.borrow_mut().pending);
            let mut r = Ok(());
            for p in pending {
                // The buffers were checked at submission and must still be live.
                let done = match p {
                    // SAFETY: a live pinned buffer of at least n bytes (checked again).
                    Pending::ToHost { dst, src, n } => unsafe { self.to_host(dst as _, src, n) },
                    // SAFETY: as above.
                    Pending::ToDevice { dst, src, n } => unsafe {
                        self.to_device(dst, src as _, n)
                    },
                };
                r = r.and(done);
            }
            r
        }
        fn sync(&self) -> Result<(), CUresult> {
            self.st.borrow_mut().syncs += 1;
            Ok(())
        }
        fn set_access(&self, va: u64, size: u64, grants: &[Grant]) -> Result<(), CUresult> {
            let mut st = self.st.borrow_mut();
            // As the driver: only whole mappings (the shim passes segments).
            if st.maps.get(&va).map(|m| m.0) != Some(size) {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            let a = st.access.entry(va).or_default();
            for &g in grants {
                merge_grant(a, g);
            }
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::fake::*;
    use super::*;

    fn pattern(seed: u64, n: usize) -> Vec<u8> {
        (0..n)
            .map(|i| ((i as u64).wrapping_mul(31).wrapping_add(seed) % 251) as u8)
            .collect()
    }

    /// Both kinds of driver: copies at once, and copies queued until waited for.
    fn drivers(physical_limit: u64) -> [FakeDriver; 2] {
        [
            FakeDriver::new(physical_limit),
            FakeDriver::asynchronous(physical_limit),
        ]
    }

    #[test]
    fn swap_keeps_addresses_and_bytes() {
        for d in drivers(1 << 30) {
            let mut m = Memory::new(d).unwrap();
            let big = m.alloc(150 << 20).unwrap();
            let small = m.alloc(4096).unwrap();
            let data = pattern(7, 150 << 20);
            m.driver().poke(big, &data).unwrap();
            m.driver().poke(small, &pattern(9, 4096)).unwrap();
            assert!(m.all_resident());
            assert_eq!(m.figures().working_set, (150 << 20) + GRAN);

            let out = m.evict(u64::MAX).unwrap();
            assert_eq!(out.bytes, (150 << 20) + GRAN);
            assert_eq!(m.figures().resident, 0);
            assert_eq!(m.driver().st.borrow().physical_used, 0);
            // Touching swapped-out memory is an illegal address, as on the GPU.
            assert_eq!(m.driver().peek(big, 1), Err(700));

            let back = m.swap_in_all().unwrap();
            assert_eq!(back.bytes, (150 << 20) + GRAN);
            assert!(m.all_resident());
            assert_eq!(m.driver().peek(big, data.len()).unwrap(), data);
            assert_eq!(m.driver().peek(small, 4096).unwrap(), pattern(9, 4096));
        }
    }

    /// A discard at the current token: the swap-out copies only the live bytes, a
    /// wholly dead segment needs no copy and no host buffer, the live bytes come back
    /// intact; at another token (a submission since) every byte is copied.
    #[test]
    fn discarded_bytes_are_not_copied_while_the_token_holds() {
        for d in drivers(1 << 30) {
            let mut m = Memory::new(d).unwrap();
            // 150 MiB: segments of 64, 64 and 22 MiB.
            let big = m.alloc(150 << 20).unwrap();
            let data = pattern(3, 150 << 20);
            m.driver().poke(big, &data).unwrap();
            // Live: the first 10 MiB; dead: the rest (one whole segment and a half).
            assert_eq!(
                m.discard(big + (10 << 20), 140 << 20, Some(5)),
                Ok(140 << 20)
            );
            let out = m.evict_live(u64::MAX, Some(5)).unwrap();
            assert_eq!(out.bytes, 10 << 20, "only the live bytes were copied");
            assert_eq!(
                m.host_buffer_bytes(),
                64 << 20,
                "one buffer: the live segment's"
            );
            assert_eq!(m.driver().st.borrow().physical_used, 0);
            let back = m.swap_in_all().unwrap();
            assert_eq!(back.bytes, 10 << 20);
            assert_eq!(
                m.driver().peek(big, 10 << 20).unwrap(),
                data[..10 << 20].to_vec()
            );

            // Another token: the marks are stale, everything is copied and kept.
            m.driver().poke(big, &data).unwrap();
            assert_eq!(m.discard(big, 150 << 20, Some(6)), Ok(150 << 20));
            let out = m.evict_live(u64::MAX, Some(7)).unwrap();
            assert_eq!(out.bytes, 150 << 20);
            m.swap_in_all().unwrap();
            assert_eq!(m.driver().peek(big, data.len()).unwrap(), data);
            // Without a token (a caller that cannot tell) too.
            assert_eq!(m.discard(big, 150 << 20, Some(8)), Ok(150 << 20));
            assert_eq!(m.evict(u64::MAX).unwrap().bytes, 150 << 20);
            m.swap_in_all().unwrap();
            assert_eq!(m.driver().peek(big, data.len()).unwrap(), data);
        }
    }

    /// A partial eviction takes the wholly dead segments first: they free GPU memory
    /// without a copy.
    #[test]
    fn partial_eviction_takes_dead_segments_first() {
        for d in drivers(1 << 30) {
            let mut m = Memory::new(d).unwrap();
            let old = m.alloc(64 << 20).unwrap();
            m.epoch += 5;
            let newer = m.alloc(64 << 20).unwrap();
            m.driver().poke(old, &[9; 64]).unwrap();
            m.discard(newer, 64 << 20, Some(1)).unwrap();
            let out = m.evict_live(10 << 20, Some(1)).unwrap();
            assert_eq!(out.bytes, 0, "the dead segment went, uncopied");
            assert_eq!(m.driver().peek(newer, 1), Err(700));
            assert_eq!(m.driver().peek(old, 64).unwrap(), vec![9; 64]);
            assert_eq!(m.figures().resident, 64 << 20);
        }
    }

    /// Small allocations share a chunk: discarding one leaves its neighbours' bytes
    /// copied. Bad ranges are refused and mark nothing.
    #[test]
    fn discards_inside_a_chunk_and_bad_ranges() {
        for d in drivers(1 << 30) {
            let mut m = Memory::new(d).unwrap();
            let a = m.alloc(4096).unwrap();
            let b = m.alloc(4096).unwrap();
            m.driver().poke(a, &pattern(1, 4096)).unwrap();
            m.driver().poke(b, &pattern(2, 4096)).unwrap();
            let inval = Err(CUDA_ERROR_INVALID_VALUE);
            assert_eq!(m.discard(a, 4097, Some(1)), inval, "past the allocation");
            assert_eq!(m.discard(a, 0, Some(1)), inval);
            assert_eq!(m.discard(u64::MAX - 1, 10, Some(1)), inval, "overflow");
            assert_eq!(m.discard(12345, 10, Some(1)), inval, "not the shim's");
            assert_eq!(m.discard(a, 4096, None), Ok(0), "checked, not marked");
            assert_eq!(m.discard(a, 4096, Some(1)), Ok(4096));
            let out = m.evict_live(u64::MAX, Some(1)).unwrap();
            assert_eq!(out.bytes, GRAN - 4096);
            m.swap_in_all().unwrap();
            assert_eq!(m.driver().peek(b, 4096).unwrap(), pattern(2, 4096));
        }
    }

    #[test]
    fn host_buffers_are_allocated_once_and_reused() {
        for d in drivers(1 << 30) {
            let mut m = Memory::new(d).unwrap();
            let p = m.alloc(100 << 20).unwrap();
            for round in 0..50u64 {
                m.driver()
                    .poke(p + round * 4096, &[round as u8; 16])
                    .unwrap();
                m.evict(u64::MAX).unwrap();
                m.swap_in_all().unwrap();
                assert_eq!(
                    m.driver().peek(p + round * 4096, 16).unwrap(),
                    vec![round as u8; 16]
                );
            }
            // 100 MiB = two segments (64 + 36 MiB): two pinned buffers, ever.
            assert_eq!(m.driver().st.borrow().host_allocs, 2);
            assert_eq!(m.host_buffer_bytes(), 100 << 20);
        }
    }

    #[test]
    fn partial_eviction_is_lru_first() {
        for d in drivers(1 << 30) {
            let mut m = Memory::new(d).unwrap();
            let old = m.alloc(64 << 20).unwrap();
            m.evict(u64::MAX).unwrap();
            m.swap_in_all().unwrap(); // `old` touched at epoch 2
            let _ = old;
            m.epoch += 5;
            let newer = m.alloc(64 << 20).unwrap(); // touched later
            let out = m.evict(10 << 20).unwrap();
            assert_eq!(out.bytes, 64 << 20, "one segment is enough");
            assert_eq!(m.driver().peek(old, 1), Err(700), "the older one went");
            assert!(m.driver().peek(newer, 1).is_ok());
        }
    }

    /// Partial evictions that take turns over the segments (LRU) reuse the buffers the
    /// others left: pinned memory is the most ever out at once, and no byte is lost.
    #[test]
    fn spare_host_buffers_serve_other_segments() {
        for d in drivers(1 << 30) {
            let mut m = Memory::new(d).unwrap();
            // Four segments: 3 × 64 MiB and a 14 MiB tail, then a small chunk.
            let big = m.alloc(206 << 20).unwrap();
            let small = m.alloc(4096).unwrap();
            let mut data = pattern(3, 206 << 20);
            m.driver().poke(big, &data).unwrap();
            m.driver().poke(small, &pattern(4, 4096)).unwrap();
            let mut most_out = 0;
            for round in 0..12u64 {
                // Half of it, least recently used first: a different half each time.
                let out = m.evict(100 << 20).unwrap();
                assert!(out.bytes >= 100 << 20);
                most_out = most_out.max(out.bytes);
                m.swap_in_all().unwrap();
                assert!(m.all_resident());
                let at = ((round * 17) << 20) as usize % data.len();
                data[at] = data[at].wrapping_add(1);
                m.driver().poke(big + at as u64, &data[at..at + 1]).unwrap();
                assert!(m.host_buffer_bytes() <= m.figures().working_set);
            }
            assert_eq!(m.driver().peek(big, data.len()).unwrap(), data);
            assert_eq!(m.driver().peek(small, 4096).unwrap(), pattern(4, 4096));
            // Segments that were never out before took the spares: what is pinned is
            // the most that was out at once, not every segment.
            let st = m.driver().st.borrow();
            assert_eq!(st.host_used, most_out);
            assert!(st.host_used < m.figures().working_set);
            // 64 + 64 + 14 + 2 MiB: one buffer per segment of the largest eviction.
            assert_eq!(st.host_allocs, 4);
            assert_eq!(st.host_used, m.host_buffer_bytes());
        }
    }

    #[test]
    fn freeing_allocations_trims_spare_host_buffers() {
        for d in drivers(1 << 30) {
            let mut m = Memory::new(d).unwrap();
            let a = m.alloc(128 << 20).unwrap();
            let b = m.alloc(64 << 20).unwrap();
            m.evict(u64::MAX).unwrap();
            assert_eq!(m.host_buffer_bytes(), 192 << 20);
            m.swap_in_all().unwrap();
            m.free(a).unwrap();
            // 64 MiB of working set left: no more than that stays pinned.
            assert_eq!(m.host_buffer_bytes(), 64 << 20);
            // Freeing a swapped-out allocation returns its buffer too.
            m.evict(u64::MAX).unwrap();
            m.free(b).unwrap();
            assert_eq!(m.host_buffer_bytes(), 0);
            assert_eq!(m.driver().st.borrow().host_used, 0);
            assert!(m.driver().st.borrow().host.is_empty());
        }
    }

    /// With a copy engine, the next buffer is allocated (swap-out) and the next
    /// segment mapped (swap-in) while a copy is in flight.
    #[test]
    fn swaps_overlap_allocation_with_copies() {
        let mut m = Memory::new(FakeDriver::asynchronous(1 << 30)).unwrap();
        let p = m.alloc(256 << 20).unwrap(); // four segments
        let data = pattern(5, 256 << 20);
        m.driver().poke(p, &data).unwrap();
        m.evict(u64::MAX).unwrap();
        // Buffers 2..4 were allocated during the copies of 1..3.
        assert_eq!(m.driver().st.borrow().overlapped, 3);
        m.swap_in_all().unwrap();
        // Segments 2..4 were created during the copies of 1..3.
        assert_eq!(m.driver().st.borrow().overlapped, 6);
        assert_eq!(m.driver().peek(p, data.len()).unwrap(), data);
    }

    /// Failures in the middle of a pipelined swap leave every segment either resident
    /// or out with its contents; the next call goes on and no byte is lost.
    #[test]
    fn swap_failures_midway_lose_nothing() {
        for d in drivers(1 << 30) {
            let mut m = Memory::new(d).unwrap();
            let p = m.alloc(256 << 20).unwrap();
            let data = pattern(11, 256 << 20);
            m.driver().poke(p, &data).unwrap();

            // No pinned memory for the third buffer.
            m.driver().st.borrow_mut().host_limit = 128 << 20;
            assert_eq!(m.evict(u64::MAX), Err(CUDA_ERROR_OUT_OF_MEMORY));
            assert_eq!(m.figures().resident, 128 << 20);
            m.driver().st.borrow_mut().host_limit = u64::MAX;
            assert_eq!(m.evict(u64::MAX).unwrap().bytes, 128 << 20);
            assert_eq!(m.figures().resident, 0);

            // The second copy-in fails.
            let copies = m.driver().st.borrow().copies;
            m.driver().st.borrow_mut().fail_copy = Some(copies + 2);
            assert!(m.swap_in_all().is_err());
            assert_eq!(m.figures().resident, 64 << 20);
            m.driver().st.borrow_mut().fail_copy = None;
            // No room for the last segment.
            m.driver().st.borrow_mut().physical_limit = 192 << 20;
            assert_eq!(m.swap_in_all(), Err(CUDA_ERROR_OUT_OF_MEMORY));
            assert_eq!(m.figures().resident, 192 << 20);
            m.driver().st.borrow_mut().physical_limit = 1 << 30;
            assert_eq!(m.swap_in_all().unwrap().bytes, 64 << 20);
            assert!(m.all_resident());
            assert_eq!(m.driver().peek(p, data.len()).unwrap(), data);

            // A copy-out that fails leaves its segment resident.
            let copies = m.driver().st.borrow().copies;
            m.driver().st.borrow_mut().fail_copy = Some(copies + 3);
            assert!(m.evict(u64::MAX).is_err());
            assert_eq!(m.figures().resident, 128 << 20);
            m.driver().st.borrow_mut().fail_copy = None;
            m.evict(u64::MAX).unwrap();
            m.swap_in_all().unwrap();
            assert_eq!(m.driver().peek(p, data.len()).unwrap(), data);
            assert!(m.host_buffer_bytes() <= 256 << 20);
        }
    }

    #[test]
    fn prepared_buffers_make_the_swap_out_allocate_nothing() {
        for d in drivers(1 << 30) {
            let mut m = Memory::new(d).unwrap();
            let p = m.alloc(206 << 20).unwrap(); // 64 + 64 + 64 + 14 MiB
            let data = pattern(13, 206 << 20);
            m.driver().poke(p, &data).unwrap();
            // A little at a time: one 64 MiB buffer fits a 100 MiB budget, then the
            // second, then nothing is left (two segments cover 100 MiB).
            assert_eq!(m.prepare_swap_out(100 << 20, 100 << 20).unwrap(), 64 << 20);
            assert_eq!(m.prepare_swap_out(100 << 20, 100 << 20).unwrap(), 64 << 20);
            assert_eq!(m.prepare_swap_out(100 << 20, 100 << 20).unwrap(), 0);
            // A budget below one buffer still makes progress: one buffer per call.
            assert_eq!(m.prepare_swap_out(150 << 20, 10 << 20).unwrap(), 64 << 20);
            assert_eq!(m.prepare_swap_out(150 << 20, 64 << 20).unwrap(), 0);
            let allocs = m.driver().st.borrow().host_allocs;
            assert_eq!(m.evict(150 << 20).unwrap().bytes, 192 << 20);
            assert_eq!(m.driver().st.borrow().host_allocs, allocs, "all prepared");
            // Everything: only the 14 MiB tail is missing.
            m.swap_in_all().unwrap();
            assert_eq!(m.prepare_swap_out(u64::MAX, u64::MAX).unwrap(), 14 << 20);
            m.evict(u64::MAX).unwrap();
            assert_eq!(m.driver().st.borrow().host_allocs, allocs + 1);
            m.swap_in_all().unwrap();
            assert_eq!(m.driver().peek(p, data.len()).unwrap(), data);
            assert_eq!(m.host_buffer_bytes(), 206 << 20);
        }
    }

    /// Buffers pinned outside the allocator's lock and handed over as spares serve
    /// the next swap-out; the spares go back when no swap is due.
    #[test]
    fn buffers_pinned_elsewhere_serve_the_swap_out_and_spares_are_released() {
        for d in drivers(1 << 30) {
            let mut m = Memory::new(d).unwrap();
            let p = m.alloc(150 << 20).unwrap(); // 64 + 64 + 22 MiB
            let data = pattern(17, 150 << 20);
            m.driver().poke(p, &data).unwrap();
            let missing = m.swap_out_shortfall(u64::MAX);
            assert_eq!(missing, vec![64 << 20, 64 << 20, 22 << 20]);
            for size in missing {
                let ptr = m.driver().host_alloc(size).unwrap();
                // SAFETY: a fresh buffer of `size` bytes from this allocator's driver.
                unsafe { m.add_spare(ptr, size) };
            }
            assert!(m.swap_out_shortfall(u64::MAX).is_empty());
            let allocs = m.driver().st.borrow().host_allocs;
            assert_eq!(m.evict(u64::MAX).unwrap().bytes, 150 << 20);
            assert_eq!(
                m.driver().st.borrow().host_allocs,
                allocs,
                "all handed over"
            );
            m.swap_in_all().unwrap();
            assert_eq!(m.driver().peek(p, data.len()).unwrap(), data);
            assert_eq!(m.release_spares(), 150 << 20);
            assert_eq!(m.host_buffer_bytes(), 0);
            assert!(m.driver().st.borrow().host.is_empty());
            // A spare past the working set is trimmed at once.
            let ptr = m.driver().host_alloc(512 << 20).unwrap();
            // SAFETY: as above.
            unsafe { m.add_spare(ptr, 512 << 20) };
            assert_eq!(m.host_buffer_bytes(), 0);
        }
    }

    /// A swap-in waiting for room goes on as soon as there is some, and one that is
    /// not waiting stops at the first segment without room, as before.
    #[test]
    fn swap_in_until_waits_for_room_only_when_asked() {
        let mut m = Memory::new(FakeDriver::new(1 << 30)).unwrap();
        let p = m.alloc(128 << 20).unwrap();
        let data = pattern(19, 128 << 20);
        m.driver().poke(p, &data).unwrap();
        m.evict(u64::MAX).unwrap();
        m.driver().st.borrow_mut().physical_limit = 64 << 20;
        let t = Instant::now();
        let deadline = Some(t + Duration::from_millis(30));
        assert_eq!(m.swap_in_until(deadline), Err(CUDA_ERROR_OUT_OF_MEMORY));
        assert!(t.elapsed() >= Duration::from_millis(30), "it waited");
        assert_eq!(m.figures().resident, 64 << 20);
        m.driver().st.borrow_mut().physical_limit = 1 << 30;
        assert_eq!(m.swap_in_until(None).unwrap().bytes, 64 << 20);
        assert_eq!(m.driver().peek(p, data.len()).unwrap(), data);
    }

    /// Room that never comes stops the wait after ROOM_STALL, not at the deadline.
    #[test]
    fn a_swap_in_waiting_for_room_that_never_comes_stops_after_the_stall() {
        let mut m = Memory::new(FakeDriver::new(1 << 30)).unwrap();
        m.alloc(128 << 20).unwrap();
        m.evict(u64::MAX).unwrap();
        m.driver().st.borrow_mut().physical_limit = 64 << 20;
        let t = Instant::now();
        let deadline = Some(t + Duration::from_secs(5));
        assert_eq!(m.swap_in_until(deadline), Err(CUDA_ERROR_OUT_OF_MEMORY));
        let took = t.elapsed();
        assert!(
            took >= ROOM_STALL && took < ROOM_STALL * 5,
            "waited {took:?} with no room coming (stall {ROOM_STALL:?}, deadline 5 s)"
        );
        assert_eq!(m.figures().resident, 64 << 20, "what fitted came in");
    }

    #[test]
    fn growth_is_what_the_working_set_gains() {
        let mut m = Memory::new(FakeDriver::new(1 << 30)).unwrap();
        assert_eq!(m.growth(4096), GRAN, "no chunk yet");
        m.alloc(4096).unwrap();
        assert_eq!(m.growth(4096), 0, "room in the chunk");
        assert_eq!(m.growth(GRAN + 1), 2 * GRAN);
        let before = m.figures().working_set;
        m.alloc(GRAN + 1).unwrap();
        assert_eq!(m.figures().working_set - before, 2 * GRAN);
        assert_eq!(m.growth(0), 0);
    }

    #[test]
    fn small_allocations_share_chunks() {
        let mut m = Memory::new(FakeDriver::new(1 << 30)).unwrap();
        let ptrs: Vec<u64> = (0..10_000).map(|_| m.alloc(4096).unwrap()).collect();
        // 10,000 × 4 KiB = 40,000 KiB = 19.5 chunks of 2 MiB.
        assert_eq!(m.handles(), 20);
        let mut sorted = ptrs.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), ptrs.len(), "no address handed out twice");
        assert!(ptrs.iter().all(|p| p % SMALL_ALIGN == 0));
        assert_eq!(m.range_of(ptrs[5] + 100), Some((ptrs[5], 4096)));
        for p in &ptrs {
            m.free(*p).unwrap();
        }
        assert_eq!(m.handles(), 0);
        assert_eq!(m.figures(), Figures::default());
        assert!(m.driver().st.borrow().reserved.is_empty(), "VA returned");
    }

    #[test]
    fn unbacked_allocation_gets_memory_at_next_swap_in() {
        let mut m = Memory::new(FakeDriver::new(1 << 30)).unwrap();
        m.set_backing_allowed(false);
        let p = m.alloc(8 << 20).unwrap();
        assert!(!m.all_resident());
        assert_eq!(m.driver().peek(p, 1), Err(700));
        m.set_backing_allowed(true);
        m.swap_in_all().unwrap();
        assert!(m.all_resident());
        m.driver().poke(p, b"hello").unwrap();
        assert_eq!(m.range_of(p), Some((p, 8 << 20)));
    }

    #[test]
    fn limit_and_physical_oom() {
        let mut m = Memory::new(FakeDriver::new(64 << 20)).unwrap();
        m.set_limit(100 << 20);
        assert_eq!(m.alloc(128 << 20), Err(CUDA_ERROR_OUT_OF_MEMORY));
        // Within the limit but more than physically free: the error is out-of-memory and
        // nothing leaks.
        assert_eq!(m.alloc(80 << 20), Err(CUDA_ERROR_OUT_OF_MEMORY));
        assert_eq!(m.figures(), Figures::default());
        assert!(m.driver().st.borrow().reserved.is_empty());
        assert_eq!(m.alloc(0), Err(CUDA_ERROR_INVALID_VALUE));
        assert_eq!(m.free(12345), Err(CUDA_ERROR_INVALID_VALUE));
    }

    /// The application's `cuMemSetAccess` and peer access survive swaps: every new
    /// mapping gets them again (a mapping starts with the owning device's only).
    #[test]
    fn other_devices_access_is_reapplied_after_every_swap_in() {
        for d in drivers(1 << 30) {
            let mut m = Memory::new(d).unwrap();
            let big = m.alloc(150 << 20).unwrap(); // segments of 64, 64, 22 MiB
            let small = m.alloc(4096).unwrap();
            // A range in the first segment only; the small one's whole chunk.
            assert_eq!(
                m.set_access(big + (10 << 20), 1 << 20, &[(1, 3)]),
                Some(Ok(()))
            );
            assert_eq!(m.set_access(small, 4096, &[(2, 1)]), Some(Ok(())));
            assert_eq!(
                m.set_access(small, 8192, &[(2, 1)]),
                Some(Err(1)),
                "past the end"
            );
            assert_eq!(m.set_access(0x1000, 16, &[(1, 3)]), None, "not ours");
            m.set_peer(3, 3).unwrap();
            let expect = |m: &Memory<FakeDriver>| {
                let st = m.driver().st.borrow();
                assert_eq!(st.access[&big], vec![(1, 3), (3, 3)]);
                assert_eq!(st.access[&(big + (64 << 20))], vec![(3, 3)]);
                assert_eq!(st.access[&(big + (128 << 20))], vec![(3, 3)]);
                assert_eq!(st.access[&small], vec![(2, 1), (3, 3)]);
            };
            expect(&m);
            for _ in 0..3 {
                m.evict(u64::MAX).unwrap();
                assert!(m.driver().st.borrow().access.is_empty());
                m.swap_in_all().unwrap();
                // Grants in the order the allocator keeps them: peers first.
                let st = m.driver().st.borrow();
                assert_eq!(st.access[&big], vec![(3, 3), (1, 3)]);
                assert_eq!(st.access[&small], vec![(3, 3), (2, 1)]);
                assert_eq!(st.access[&(big + (64 << 20))], vec![(3, 3)]);
            }
            // Peer access disabled: gone from every mapping, now and after a swap.
            m.set_peer(3, 0).unwrap();
            assert_eq!(
                m.driver().st.borrow().access[&(big + (64 << 20))],
                vec![(3, 0)]
            );
            m.evict(u64::MAX).unwrap();
            m.swap_in_all().unwrap();
            let st = m.driver().st.borrow();
            assert!(!st.access.contains_key(&(big + (64 << 20))));
            assert_eq!(st.access[&big], vec![(1, 3)]);
        }
    }

    /// A small free waits for the context's work like any other (`cuMemFree` does):
    /// its range is handed out again at once, under a kernel that may still write it.
    /// Swapped out, nothing can be running on it. A failed wait frees nothing.
    #[test]
    fn small_frees_wait_for_the_work_that_may_use_them() {
        let mut m = Memory::new(FakeDriver::new(1 << 30)).unwrap();
        let keep = m.alloc(4096).unwrap();
        let x = m.alloc(4096).unwrap();
        let syncs = m.driver().st.borrow().syncs;
        m.free(x).unwrap();
        assert_eq!(m.driver().st.borrow().syncs, syncs + 1, "the free waited");
        assert_eq!(m.alloc(4096).unwrap(), x, "the range is reused at once");
        m.evict(u64::MAX).unwrap();
        let syncs = m.driver().st.borrow().syncs;
        m.free(x).unwrap();
        assert_eq!(
            m.driver().st.borrow().syncs,
            syncs,
            "nothing resident to wait for"
        );
        m.free(keep).unwrap();
        assert_eq!(m.figures(), Figures::default());
    }

    #[test]
    fn external_vmm_is_counted_not_swapped() {
        let mut m = Memory::new(FakeDriver::new(1 << 30)).unwrap();
        m.external_created(42, 4 << 20);
        m.external_created(42, 4 << 20);
        assert_eq!(m.figures().working_set, 4 << 20);
        assert_eq!(m.evict(u64::MAX).unwrap().bytes, 0);
        m.external_released(42);
        assert_eq!(m.figures().working_set, 0);
    }

    /// A shared (IPC) allocation is never evicted while pinned, counts as memory no
    /// swap frees, and is swappable again once its last pin goes; a free ends the
    /// share, and an old share's unpin then touches nothing.
    #[test]
    fn shared_allocations_stay_resident_while_pinned() {
        let mut m = Memory::new(FakeDriver::new(1 << 30)).unwrap();
        let shared = m.alloc(100 << 20).unwrap();
        let private = m.alloc(64 << 20).unwrap();
        m.driver().poke(shared, &pattern(1, 4096)).unwrap();
        assert_eq!(
            m.pin_shared(shared, 7, false),
            Err(PinError::Stale),
            "not shared yet"
        );
        m.pin_shared(shared, 7, true).unwrap();
        m.pin_shared(shared, 7, false).unwrap();
        assert_eq!(
            m.pin_shared(shared, 8, true),
            Err(PinError::Stale),
            "another share"
        );
        let layout = m.shared_layout(shared, 7).unwrap();
        assert_eq!(
            (layout.base, layout.size, layout.offset),
            (shared, 100 << 20, 0)
        );
        assert_eq!(layout.segments.len(), 2, "64 + 36 MiB segments");
        assert_eq!(m.figures().external, 100 << 20);
        // Everything that may go goes; the shared memory stays, at the same handles.
        assert_eq!(m.evict(u64::MAX).unwrap().bytes, 64 << 20);
        assert_eq!(m.shared_layout(shared, 7), Some(layout.clone()));
        assert_eq!(m.driver().peek(shared, 4096).unwrap(), pattern(1, 4096));
        m.swap_in_all().unwrap();
        m.unpin_shared(shared, 7);
        assert_eq!(
            m.evict(u64::MAX).unwrap().bytes,
            64 << 20,
            "one pin left: the private memory only"
        );
        m.unpin_shared(shared, 7);
        assert_eq!(m.figures().external, 0);
        assert_eq!(m.shared_layout(shared, 7), None);
        assert_eq!(m.evict(u64::MAX).unwrap().bytes, 100 << 20);
        // Swapped out, it cannot be pinned until it is back.
        assert_eq!(m.pin_shared(shared, 7, false), Err(PinError::NotResident));
        m.swap_in_all().unwrap();
        assert_eq!(m.driver().peek(shared, 4096).unwrap(), pattern(1, 4096));
        m.pin_shared(shared, 7, false).unwrap();
        m.free(shared).unwrap();
        assert_eq!(m.figures().external, 0, "the free ended the share");
        let again = m.alloc(100 << 20).unwrap();
        m.unpin_shared(again, 7);
        assert_eq!(m.pin_shared(again, 7, false), Err(PinError::Stale));
        m.free(again).unwrap();
        m.free(private).unwrap();
    }
}
