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
//! - A segment's pinned host buffer is allocated at its first swap-out and reused for
//!   every later one; it is freed with the allocation.
//! - Allocation never waits: when backing is not allowed (another process holds the
//!   GPU) the range is reserved and left unbacked until the next grant.
//!
//! This module does not talk to the arbiter and does not decide when to swap: the
//! client ([`crate::client`]) does. The driver sits behind [`Driver`] so the logic is
//! tested against a fake that checks every byte.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use crate::cuda::{CUresult, CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_OUT_OF_MEMORY};

/// Largest physical handle a large allocation is split into.
pub const SEGMENT_MAX: u64 = 64 << 20;
/// Alignment of small allocations (what `cuMemAlloc` guarantees).
pub const SMALL_ALIGN: u64 = 256;

/// The driver calls the allocator needs. Device, context and access flags are the
/// implementation's business.
pub trait Driver: Send {
    fn granularity(&self) -> Result<u64, CUresult>;
    fn reserve(&self, size: u64, align: u64) -> Result<u64, CUresult>;
    fn free_va(&self, va: u64, size: u64) -> Result<(), CUresult>;
    fn create(&self, size: u64) -> Result<u64, CUresult>;
    fn release(&self, handle: u64) -> Result<(), CUresult>;
    /// Maps `handle` at `va` and grants read-write access.
    fn map(&self, va: u64, size: u64, handle: u64) -> Result<(), CUresult>;
    fn unmap(&self, va: u64, size: u64) -> Result<(), CUresult>;
    fn host_alloc(&self, size: u64) -> Result<*mut u8, CUresult>;
    fn host_free(&self, p: *mut u8);
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
    /// Waits until every piece of work of this process's context is done.
    fn sync(&self) -> Result<(), CUresult>;
}

/// A pinned host buffer owned by one segment.
struct HostBuf(*mut u8);
// SAFETY: the buffer is plain memory owned by its segment; only the thread holding the
// allocator's lock touches it.
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
    host: Option<HostBuf>,
    /// The host buffer holds the segment's contents (it was swapped out with data).
    has_data: bool,
    /// LRU epoch: when the segment was last made resident or allocated.
    touch: u64,
    /// Sub-allocation state when this is a small-allocation chunk.
    chunk: Option<Chunk>,
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
    pub bytes: u64,
    pub duration: Duration,
}

/// Working set and residency, as reported to the arbiter.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Figures {
    /// Bytes the application's allocations occupy (granule-rounded, chunks whole) plus
    /// the application's own VMM handles.
    pub working_set: u64,
    /// Of those, bytes in GPU memory now.
    pub resident: u64,
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
        }
    }

    /// Whether every segment is backed by device memory.
    pub fn all_resident(&self) -> bool {
        self.resident == self.working_set
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

    /// Backs segment `i` with a fresh physical handle (contents restored if it has any).
    fn back(&mut self, i: usize) -> Result<u64, CUresult> {
        let (va, size) = {
            let s = self.seg(i);
            if s.handle.is_some() {
                return Ok(0);
            }
            (s.va, s.size)
        };
        let h = self.drv.create(size)?;
        if let Err(e) = self.drv.map(va, size, h) {
            let _ = self.drv.release(h);
            return Err(e);
        }
        let epoch = self.epoch;
        let (has_data, host) = {
            let s = self.seg(i);
            s.handle = Some(h);
            s.touch = epoch;
            (s.has_data, s.host.as_ref().map(|b| b.0))
        };
        self.resident += size;
        if has_data {
            if let Some(host) = host {
                // SAFETY: the segment's host buffer was allocated with the segment's size.
                unsafe { self.drv.to_device(va, host, size)? };
            }
            self.seg(i).has_data = false;
            return Ok(size);
        }
        Ok(0)
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
                has_data: false,
                touch: self.epoch,
                chunk: None,
            });
            segs.push(i);
            off += len;
        }
        self.working_set += reserved;
        if self.backing_allowed {
            for k in 0..segs.len() {
                if let Err(e) = self.back(segs[k]) {
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
            has_data: false,
            touch: self.epoch,
            chunk: Some(Chunk {
                free: vec![(need, self.gran - need)],
                used: need,
            }),
        });
        self.working_set += self.gran;
        if self.backing_allowed {
            if let Err(e) = self.back(seg) {
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
            self.drv.host_free(b.0);
        }
        self.working_set -= s.size;
        self.free_slots.push(i);
    }

    /// Whether `ptr` is the base of an allocation this allocator made.
    pub fn owns(&self, ptr: u64) -> bool {
        self.allocs.contains_key(&ptr)
    }

    /// Frees the allocation at `ptr`. Work that may still use it is waited for first.
    pub fn free(&mut self, ptr: u64) -> Result<(), CUresult> {
        let Some(a) = self.allocs.remove(&ptr) else {
            return Err(CUDA_ERROR_INVALID_VALUE);
        };
        match a {
            Alloc::Large { reserved, segs, .. } => {
                if segs
                    .iter()
                    .any(|&i| self.segs[i].as_ref().is_some_and(|s| s.handle.is_some()))
                {
                    // Unmapping under a running kernel is an illegal address.
                    self.drv.sync()?;
                }
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
                    let (va, size, mapped) = (s.va, s.size, s.handle.is_some());
                    if mapped {
                        self.drv.sync()?;
                    }
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

    /// Brings every segment back into GPU memory at its own address. On error the
    /// segments done so far stay resident and the rest stay out, consistent.
    pub fn swap_in_all(&mut self) -> Result<Swap, CUresult> {
        let start = Instant::now();
        self.epoch += 1;
        let mut bytes = 0;
        for i in 0..self.segs.len() {
            if self.segs[i].as_ref().is_some_and(|s| s.handle.is_none()) {
                bytes += self.back(i)?;
            }
        }
        Ok(Swap {
            bytes,
            duration: start.elapsed(),
        })
    }

    /// Evicts at least `need` bytes (all of them for `u64::MAX`), least recently used
    /// first. The caller has drained the GPU work of this process.
    pub fn evict(&mut self, need: u64) -> Result<Swap, CUresult> {
        let start = Instant::now();
        let mut order: Vec<(u64, usize)> = self
            .segs
            .iter()
            .enumerate()
            .filter_map(|(i, s)| {
                s.as_ref()
                    .filter(|s| s.handle.is_some())
                    .map(|s| (s.touch, i))
            })
            .collect();
        order.sort_unstable();
        let mut bytes = 0;
        for (_, i) in order {
            if bytes >= need {
                break;
            }
            bytes += self.swap_out(i)?;
        }
        Ok(Swap {
            bytes,
            duration: start.elapsed(),
        })
    }

    fn swap_out(&mut self, i: usize) -> Result<u64, CUresult> {
        let (va, size, handle, host) = {
            let s = self.segs[i].as_ref().expect("live segment");
            let Some(h) = s.handle else { return Ok(0) };
            (s.va, s.size, h, s.host.as_ref().map(|b| b.0))
        };
        let host = match host {
            Some(p) => p,
            None => {
                let p = self.drv.host_alloc(size)?;
                self.seg(i).host = Some(HostBuf(p));
                p
            }
        };
        // SAFETY: the segment's host buffer was allocated with the segment's size.
        unsafe { self.drv.to_host(host, va, size)? };
        self.drv.unmap(va, size)?;
        let _ = self.drv.release(handle);
        let s = self.seg(i);
        s.handle = None;
        s.has_data = true;
        self.resident -= size;
        Ok(size)
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

#[cfg(test)]
pub mod fake {
    //! A fake driver keeping "device memory" in host vectors: physical handles hold
    //! bytes, mappings place them at virtual addresses, and every access to an
    //! unmapped address is an error, as on a real GPU.

    use super::*;
    use std::cell::RefCell;

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
                    ..Default::default()
                }),
            }
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
            match st.maps.remove(&va) {
                Some((s, _)) if s == size => Ok(()),
                _ => Err(1),
            }
        }
        fn host_alloc(&self, size: u64) -> Result<*mut u8, CUresult> {
            self.st.borrow_mut().host_allocs += 1;
            let v = vec![0u8; size as usize].into_boxed_slice();
            Ok(Box::into_raw(v) as *mut u8)
        }
        fn host_free(&self, _p: *mut u8) {
            // Leaked on purpose: the fake does not track the sizes.
        }
        unsafe fn to_host(&self, dst: *mut u8, src: u64, n: u64) -> Result<(), CUresult> {
            let data = self.peek(src, n as usize)?;
            // SAFETY: dst is a host buffer of at least n bytes from host_alloc.
            unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), dst, n as usize) };
            Ok(())
        }
        unsafe fn to_device(&self, dst: u64, src: *const u8, n: u64) -> Result<(), CUresult> {
            // SAFETY: src is a host buffer of at least n bytes from host_alloc.
            let data = unsafe { std::slice::from_raw_parts(src, n as usize) };
            self.poke(dst, data)
        }
        fn sync(&self) -> Result<(), CUresult> {
            self.st.borrow_mut().syncs += 1;
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

    #[test]
    fn swap_keeps_addresses_and_bytes() {
        let mut m = Memory::new(FakeDriver::new(1 << 30)).unwrap();
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

    #[test]
    fn host_buffers_are_allocated_once_and_reused() {
        let mut m = Memory::new(FakeDriver::new(1 << 30)).unwrap();
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
    }

    #[test]
    fn partial_eviction_is_lru_first() {
        let mut m = Memory::new(FakeDriver::new(1 << 30)).unwrap();
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
}
