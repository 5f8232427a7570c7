//! Device memory of this process: the device virtual address space, its regions
//! (`cuMemAlloc` allocations, managed memory, VMM reservations and their mappings
//! with each device's access) and resolving a device address range to the pieces
//! of physical memory behind it; the pinned host ranges the device reaches
//! ([`HostRanges`]).
//!
//! Model (see `docs/simulator.md`):
//! - Device addresses live in a window of this process's address space that is
//!   reserved `PROT_NONE` (near `0x7000_0000_0000`, 2 TiB): the host can never get
//!   memory there, and host code that dereferences a device pointer segfaults as it
//!   would with a real GPU.
//! - Contents of each physical allocation ([`Phys`]) live in its GPU's memory file,
//!   shared by every process of the machine (`crate::backing`): a GPU's memory is
//!   not the allocating process's memory, and pages freed by anyone are reused
//!   without page faults. Capacity is accounted in the shared machine segment: a
//!   physical allocation that does not fit fails with `CUDA_ERROR_OUT_OF_MEMORY`,
//!   across processes.
//! - `cuMemAlloc` allocations are accounted at their size rounded up to 512 bytes;
//!   their addresses are 512-byte aligned (2 MiB aligned from 2 MiB up).
//! - VMM: reserve VA, create physical (2 MiB granularity), map at offset 0, set
//!   access (required after every map), unmap exactly whole mappings; a physical
//!   allocation is freed when neither its handle nor any mapping is left. Shareable
//!   handles are exported and imported as `memfd`s ([`Phys::export`]).

use std::collections::{BTreeMap, HashMap};
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use kiwi_sim_core::{Machine, GRANULARITY};

use crate::abi::*;
use crate::host_ranges::HostRanges;
use crate::phys::{Found, Phys, Piece};

/// Preferred start of the device address window.
pub const VA_HINT: u64 = 0x7000_0000_0000;
/// Size of the device address window.
pub const VA_LEN: u64 = 2 << 40;
/// Alignment (and accounting unit) of `cuMemAlloc` allocations.
pub const SMALL_ALIGN: u64 = 512;

/// A device address's allocation (or VMM mapping).
pub struct PointerInfo {
    pub start: u64,
    pub size: u64,
    pub gpu: u32,
    /// Owning context handle (0 for VMM mappings, which belong to no context).
    pub owner: usize,
    pub managed: bool,
    pub mapped: bool,
}

/// Device access to a mapping, as `cuMemSetAccess` set it.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Access {
    None,
    Read,
    ReadWrite,
}

struct Mapping {
    size: u64,
    phys: Arc<Phys>,
    /// Access of each device (by ordinal), as `cuMemSetAccess` granted it: a
    /// mapping is reachable only from the devices it names (Driver API reference,
    /// `cuMemSetAccess`, `cuMemMap`).
    access: Vec<Access>,
}

enum RegionKind {
    /// `cuMemAlloc*`: always mapped read-write.
    Linear {
        phys: Arc<Phys>,
        owner: usize,
        managed: bool,
    },
    /// `cuMemAddressReserve`: mappings keyed by start address.
    Reserved { mappings: BTreeMap<u64, Mapping> },
}

struct Region {
    size: u64,
    kind: RegionKind,
}

/// Why a device range could not be used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// No allocation or mapping there (freed, unmapped, never allocated).
    Unmapped,
    /// Mapped, but `cuMemSetAccess` did not grant this access.
    NoAccess,
}

struct VaSpace {
    regions: BTreeMap<u64, Region>,
    /// Free VA ranges: start → size.
    free: BTreeMap<u64, u64>,
}

impl VaSpace {
    /// Records a `cuMemAlloc*` allocation at `at`.
    fn insert_linear(&mut self, at: u64, size: u64, phys: Arc<Phys>, owner: usize, managed: bool) {
        let kind = RegionKind::Linear {
            phys,
            owner,
            managed,
        };
        self.regions.insert(at, Region { size, kind });
    }
}

/// All device memory of this process.
pub struct Memory {
    machine: &'static Machine,
    gpus: u32,
    pub base: u64,
    pub len: u64,
    va: RwLock<VaSpace>,
    handles: Mutex<HashMap<u64, Arc<Phys>>>,
    next_handle: AtomicU64,
    /// Pinned host allocations and registrations.
    pub host: HostRanges,
}

fn round_up(v: u64, to: u64) -> u64 {
    v.div_ceil(to) * to
}

impl Memory {
    pub fn new(machine: &'static Machine) -> Result<Memory, CUresult> {
        // SAFETY: a PROT_NONE reservation; the kernel treats the address as a hint.
        let p = unsafe {
            libc::mmap(
                VA_HINT as *mut libc::c_void,
                VA_LEN as usize,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(CUDA_ERROR_OPERATING_SYSTEM);
        }
        crate::backing::init(machine);
        // Start on a 2 MiB boundary and keep address 0 impossible.
        let base = round_up(p as u64, GRANULARITY);
        let len = VA_LEN - (base - p as u64);
        let mut free = BTreeMap::new();
        free.insert(base, len);
        Ok(Memory {
            machine,
            gpus: machine.settings().gpus,
            base,
            len,
            va: RwLock::new(VaSpace {
                regions: BTreeMap::new(),
                free,
            }),
            handles: Mutex::new(HashMap::new()),
            next_handle: AtomicU64::new(1),
            host: HostRanges::default(),
        })
    }

    /// Is `addr` inside the device address window (i.e. not a host address)?
    pub fn is_device_address(&self, addr: u64) -> bool {
        addr >= self.base && addr < self.base + self.len
    }

    fn va_alloc(va: &mut VaSpace, size: u64, align: u64, fixed: Option<u64>) -> Option<u64> {
        let found = va.free.iter().find_map(|(&start, &len)| {
            let at = match fixed {
                Some(f) => {
                    if f >= start
                        && f.checked_add(size).is_some_and(|e| e <= start + len)
                        && f.is_multiple_of(align)
                    {
                        f
                    } else {
                        return None;
                    }
                }
                None => round_up(start, align),
            };
            (at + size <= start + len).then_some((start, len, at))
        });
        let (start, len, at) = found?;
        va.free.remove(&start);
        if at > start {
            va.free.insert(start, at - start);
        }
        if at + size < start + len {
            va.free.insert(at + size, start + len - at - size);
        }
        Some(at)
    }

    fn va_free(va: &mut VaSpace, mut start: u64, mut size: u64) {
        // Coalesce with neighbours.
        if let Some((&ps, &pl)) = va.free.range(..start).next_back() {
            if ps + pl == start {
                va.free.remove(&ps);
                start = ps;
                size += pl;
            }
        }
        if let Some(&nl) = va.free.get(&(start + size)) {
            va.free.remove(&(start + size));
            size += nl;
        }
        va.free.insert(start, size);
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, VaSpace> {
        self.va.write().unwrap_or_else(|e| e.into_inner())
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, VaSpace> {
        self.va.read().unwrap_or_else(|e| e.into_inner())
    }

    /// A size this address space can take: 0 (or, with `granules`, not a whole
    /// number of granules) is invalid, more than the window out of memory.
    fn check_size(&self, size: u64, granules: bool) -> Result<(), CUresult> {
        if size == 0 || granules && !size.is_multiple_of(GRANULARITY) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if size > self.len {
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
        Ok(())
    }

    /// A fresh address for a `cuMemAlloc*` allocation of `size` bytes (a multiple
    /// of `unit`): 2 MiB aligned from 2 MiB up, else `unit` aligned.
    fn va_alloc_linear(va: &mut VaSpace, size: u64, unit: u64) -> Result<u64, CUresult> {
        let align = if size >= GRANULARITY {
            GRANULARITY
        } else {
            unit
        };
        Self::va_alloc(va, size, align, None).ok_or(CUDA_ERROR_OUT_OF_MEMORY)
    }

    /// `cuMemAlloc`: physical memory on `gpu` at a fresh address, owned by context `owner`.
    pub fn alloc_linear(&self, gpu: u32, size: u64, owner: usize) -> Result<u64, CUresult> {
        self.check_size(size, false)?;
        let accounted = round_up(size, SMALL_ALIGN);
        let phys = Phys::new(self.machine, gpu, accounted, false)?;
        let mut va = self.write();
        let at = Self::va_alloc_linear(&mut va, accounted, SMALL_ALIGN)?;
        va.insert_linear(at, accounted, phys, owner, false);
        Ok(at)
    }

    /// `cuMemFree`: `ptr` must be the start of a `cuMemAlloc` allocation.
    pub fn free_linear(&self, ptr: u64) -> Result<(), CUresult> {
        let mut va = self.write();
        match va.regions.get(&ptr) {
            Some(Region {
                kind: RegionKind::Linear { .. },
                ..
            }) => {}
            _ => return Err(CUDA_ERROR_INVALID_VALUE),
        }
        let r = va.regions.remove(&ptr).expect("checked above");
        Self::va_free(&mut va, ptr, r.size);
        drop(va);
        drop(r); // releases capacity outside the VA lock
        Ok(())
    }

    /// `cuMemAllocManaged`: memory reachable at one address from host and device.
    pub fn alloc_managed(&self, gpu: u32, size: u64, owner: usize) -> Result<u64, CUresult> {
        self.check_size(size, false)?;
        let accounted = round_up(size, 4096);
        let mut va = self.write();
        let at = Self::va_alloc_linear(&mut va, accounted, 4096)?;
        let phys = match Phys::new_in_window(self.machine, gpu, accounted, at) {
            Ok(p) => p,
            Err(e) => {
                Self::va_free(&mut va, at, accounted);
                return Err(e);
            }
        };
        va.insert_linear(at, accounted, phys, owner, true);
        Ok(at)
    }

    /// Moves managed memory `[ptr, ptr+n)` to device `to` or the host (`None`), as
    /// `cuMemPrefetchAsync` does when its turn in the stream comes: the bytes moved;
    /// `None` when the range is not inside one managed allocation.
    pub fn migrate(&self, ptr: u64, n: u64, to: Option<u32>) -> Option<u64> {
        let va = self.read();
        let (&start, r) = va.regions.range(..=ptr).next_back()?;
        match &r.kind {
            RegionKind::Linear {
                phys,
                managed: true,
                ..
            } if ptr.checked_add(n)? <= start + r.size => Some(phys.migrate(ptr - start, n, to)),
            _ => None,
        }
    }

    /// What `cuPointerGetAttribute` needs to know about a device address.
    pub fn pointer_info(&self, ptr: u64) -> Option<PointerInfo> {
        let va = self.read();
        let (&start, r) = va.regions.range(..=ptr).next_back()?;
        if ptr >= start + r.size {
            return None;
        }
        match &r.kind {
            RegionKind::Linear {
                phys,
                owner,
                managed,
            } => Some(PointerInfo {
                start,
                size: r.size,
                gpu: phys.gpu,
                owner: *owner,
                managed: *managed,
                mapped: true,
            }),
            RegionKind::Reserved { mappings } => {
                let (&ms, m) = mappings.range(..=ptr).next_back()?;
                (ptr < ms + m.size).then_some(PointerInfo {
                    start: ms,
                    size: m.size,
                    gpu: m.phys.gpu,
                    owner: 0,
                    managed: false,
                    mapped: true,
                })
            }
        }
    }

    /// Is `ptr` the start of a live `cuMemAlloc` allocation?
    pub fn is_linear_start(&self, ptr: u64) -> bool {
        matches!(
            self.read().regions.get(&ptr),
            Some(Region {
                kind: RegionKind::Linear { .. },
                ..
            })
        )
    }

    /// Does this process hold memory the driver's checkpoint refuses: managed memory,
    /// or VMM memory exported to or imported from another process?
    pub fn holds_unmovable(&self) -> bool {
        let shared = |p: &Phys| p.is_shared();
        let va = self.read();
        let in_regions = va.regions.values().any(|r| match &r.kind {
            RegionKind::Linear { managed, .. } => *managed,
            RegionKind::Reserved { mappings } => mappings.values().any(|m| shared(&m.phys)),
        });
        drop(va);
        in_regions
            || self
                .handles
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .values()
                .any(|p| shared(p))
    }

    /// Checkpoint: every byte of this process's device memory moves into its host
    /// memory, the GPUs' files get their granules back (`false`: host memory ran
    /// out).
    pub fn to_host(&self) -> bool {
        crate::backing::to_host()
    }

    /// Restore: the checkpointed bytes move back into the GPUs' files (`false`: a
    /// file had no room).
    pub fn to_device(&self) -> bool {
        crate::backing::to_device()
    }

    /// Frees every `cuMemAlloc` allocation owned by context `owner` (context destroy).
    pub fn free_owned_by(&self, owner: usize) {
        let mut va = self.write();
        let mine: Vec<u64> = va
            .regions
            .iter()
            .filter(|(_, r)| matches!(r.kind, RegionKind::Linear { owner: o, .. } if o == owner))
            .map(|(&a, _)| a)
            .collect();
        let mut dropped = Vec::new();
        for a in mine {
            if let Some(r) = va.regions.remove(&a) {
                Self::va_free(&mut va, a, r.size);
                dropped.push(r);
            }
        }
        drop(va);
        drop(dropped);
    }

    /// `cuMemGetAddressRange`: the allocation (or mapping) containing `ptr`.
    pub fn address_range(&self, ptr: u64) -> Option<(u64, u64)> {
        let va = self.read();
        let (&start, r) = va.regions.range(..=ptr).next_back()?;
        if ptr >= start + r.size {
            return None;
        }
        match &r.kind {
            RegionKind::Linear { .. } => Some((start, r.size)),
            RegionKind::Reserved { mappings } => {
                let (&ms, m) = mappings.range(..=ptr).next_back()?;
                (ptr < ms + m.size).then_some((ms, m.size))
            }
        }
    }

    /// `cuMemAddressReserve`.
    pub fn reserve(&self, size: u64, align: u64, hint: u64) -> Result<u64, CUresult> {
        self.check_size(size, true)?;
        let align = if align == 0 { GRANULARITY } else { align };
        if !align.is_power_of_two() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let align = align.max(GRANULARITY);
        let mut va = self.write();
        // The hint is honoured when that range is free, as the real driver does.
        let at = (hint != 0)
            .then(|| Self::va_alloc(&mut va, size, align, Some(hint)))
            .flatten()
            .or_else(|| Self::va_alloc(&mut va, size, align, None))
            .ok_or(CUDA_ERROR_OUT_OF_MEMORY)?;
        va.regions.insert(
            at,
            Region {
                size,
                kind: RegionKind::Reserved {
                    mappings: BTreeMap::new(),
                },
            },
        );
        Ok(at)
    }

    /// `cuMemAddressFree`: exactly a reservation, with nothing mapped in it.
    pub fn unreserve(&self, ptr: u64, size: u64) -> Result<(), CUresult> {
        let mut va = self.write();
        match va.regions.get(&ptr) {
            Some(Region {
                size: s,
                kind: RegionKind::Reserved { mappings },
                ..
            }) if *s == size => {
                if !mappings.is_empty() {
                    return Err(CUDA_ERROR_INVALID_VALUE);
                }
            }
            _ => return Err(CUDA_ERROR_INVALID_VALUE),
        }
        va.regions.remove(&ptr);
        Self::va_free(&mut va, ptr, size);
        Ok(())
    }

    /// `cuMemCreate`: physical memory on `gpu`, returned as a handle; `shareable`
    /// when the POSIX fd handle type was requested.
    pub fn create(&self, gpu: u32, size: u64, shareable: bool) -> Result<u64, CUresult> {
        self.check_size(size, true)?;
        let phys = Phys::new(self.machine, gpu, size, shareable)?;
        Ok(self.add_handle(phys))
    }

    fn add_handle(&self, phys: Arc<Phys>) -> u64 {
        let h = self.next_handle.fetch_add(1, Ordering::Relaxed);
        self.handles
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(h, phys);
        h
    }

    /// `cuMemExportToShareableHandle` with the POSIX fd type: a new descriptor of
    /// the handle's memory. A handle created without that type is
    /// `CUDA_ERROR_INVALID_VALUE`, as is an unknown handle.
    pub fn export_fd(&self, handle: u64) -> Result<RawFd, CUresult> {
        let phys = self.handle(handle).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        phys.export().ok_or(CUDA_ERROR_INVALID_VALUE)?
    }

    /// The physical memory of a `cuMemCreate` (or imported) handle.
    fn handle(&self, handle: u64) -> Option<Arc<Phys>> {
        self.handles
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&handle)
            .cloned()
    }

    /// `cuMemImportFromShareableHandle` with the POSIX fd type: a new handle of the
    /// memory behind `fd` (which stays the caller's).
    pub fn import_fd(&self, fd: RawFd) -> Result<u64, CUresult> {
        let phys = Phys::import(self.machine, fd)?;
        Ok(self.add_handle(phys))
    }

    /// `cuMemRelease`: drops the handle (memory lives on while mapped); returns the
    /// handle's size.
    pub fn release(&self, handle: u64) -> Result<u64, CUresult> {
        let p = self
            .handles
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&handle)
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        Ok(p.size)
    }

    /// `cuMemMap(ptr, size, 0, handle, 0)`.
    pub fn map(&self, ptr: u64, size: u64, offset: u64, handle: u64) -> Result<(), CUresult> {
        if offset != 0
            || size == 0
            || !size.is_multiple_of(GRANULARITY)
            || !ptr.is_multiple_of(GRANULARITY)
        {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let phys = self.handle(handle).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        if size > phys.size {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        self.with_reservation(ptr, size, |mappings| {
            // No overlap with an existing mapping.
            if let Some((&ms, m)) = mappings.range(..ptr + size).next_back() {
                if ms + m.size > ptr {
                    return Err(CUDA_ERROR_ALREADY_MAPPED);
                }
            }
            mappings.insert(
                ptr,
                Mapping {
                    size,
                    phys,
                    access: vec![Access::None; self.gpus as usize],
                },
            );
            Ok(())
        })
    }

    /// Visits the mappings that exactly tile `[ptr, ptr+size)`; refuses ranges with
    /// gaps or cutting through a mapping.
    fn tiled(
        mappings: &mut BTreeMap<u64, Mapping>,
        ptr: u64,
        size: u64,
    ) -> Result<Vec<u64>, CUresult> {
        let mut at = ptr;
        let mut keys = Vec::new();
        for (&ms, m) in mappings.range(ptr..ptr + size) {
            if ms != at {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            at = ms + m.size;
            keys.push(ms);
        }
        if at != ptr + size || keys.is_empty() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        Ok(keys)
    }

    /// Runs `f` on the mappings of the reservation `[ptr, ptr+size)` lies in, under
    /// the address space's write lock: a range outside every reservation, past its
    /// end, empty, or in linear memory is `CUDA_ERROR_INVALID_VALUE`.
    fn with_reservation<R>(
        &self,
        ptr: u64,
        size: u64,
        f: impl FnOnce(&mut BTreeMap<u64, Mapping>) -> Result<R, CUresult>,
    ) -> Result<R, CUresult> {
        let mut va = self.write();
        let (&start, region) = va
            .regions
            .range_mut(..=ptr)
            .next_back()
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if size == 0 || ptr + size > start + region.size {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        match &mut region.kind {
            RegionKind::Reserved { mappings } => f(mappings),
            RegionKind::Linear { .. } => Err(CUDA_ERROR_INVALID_VALUE),
        }
    }

    /// `cuMemSetAccess`: `(device, access)` for each descriptor; devices not named
    /// keep their access.
    pub fn set_access(
        &self,
        ptr: u64,
        size: u64,
        grants: &[(u32, Access)],
    ) -> Result<(), CUresult> {
        self.with_reservation(ptr, size, |mappings| {
            for k in Self::tiled(mappings, ptr, size)? {
                let m = mappings.get_mut(&k).expect("tiled keys exist");
                for &(dev, a) in grants {
                    m.access[dev as usize] = a;
                }
            }
            Ok(())
        })
    }

    /// `cuMemUnmap`: must cover exactly whole mappings.
    pub fn unmap(&self, ptr: u64, size: u64) -> Result<(), CUresult> {
        let dropped = self.with_reservation(ptr, size, |mappings| {
            let keys = Self::tiled(mappings, ptr, size)?;
            Ok(keys
                .into_iter()
                .filter_map(|k| mappings.remove(&k))
                .collect::<Vec<_>>())
        })?;
        drop(dropped); // may free physical memory: outside the VA lock
        Ok(())
    }

    /// Resolves `[addr, addr+len)` for an access by device `dev` (`write` for
    /// stores).
    pub fn resolve(&self, addr: u64, len: u64, write: bool, dev: u32) -> Result<Vec<Piece>, Fault> {
        // Pieces are made after the VA lock is let go: making one may wait for a move
        // into a memfd, which waits for pieces held elsewhere.
        let found = self.find(addr, len, write, dev)?;
        Ok(found.into_iter().map(Piece::new).collect())
    }

    /// The physical memory behind `[addr, addr+len)`: (memory, offset, length) of
    /// each piece.
    fn find(&self, addr: u64, len: u64, write: bool, dev: u32) -> Result<Vec<Found>, Fault> {
        let va = self.read();
        let (&start, r) = va
            .regions
            .range(..=addr)
            .next_back()
            .ok_or(Fault::Unmapped)?;
        let end = addr.checked_add(len).ok_or(Fault::Unmapped)?;
        if end > start + r.size {
            return Err(Fault::Unmapped);
        }
        match &r.kind {
            RegionKind::Linear { phys, managed, .. } => {
                // A device's access faults managed pages in, as the driver migrates
                // them on a GPU page fault.
                if *managed {
                    phys.migrate(addr - start, len, Some(dev));
                }
                Ok(vec![(phys.clone(), addr - start, len)])
            }
            RegionKind::Reserved { mappings } => {
                let mut pieces = Vec::new();
                let mut at = addr;
                let first = mappings.range(..=addr).next_back().map(|(&k, _)| k);
                let iter = first.into_iter().flat_map(|f| mappings.range(f..end));
                for (&ms, m) in iter {
                    if ms > at {
                        return Err(Fault::Unmapped);
                    }
                    if ms + m.size <= at {
                        continue;
                    }
                    let ok = match m.access.get(dev as usize).copied().unwrap_or(Access::None) {
                        Access::ReadWrite => true,
                        Access::Read => !write,
                        Access::None => false,
                    };
                    if !ok {
                        return Err(Fault::NoAccess);
                    }
                    let take = (ms + m.size).min(end) - at;
                    pieces.push((m.phys.clone(), at - ms, take));
                    at += take;
                    if at == end {
                        break;
                    }
                }
                if at != end {
                    return Err(Fault::Unmapped);
                }
                Ok(pieces)
            }
        }
    }
}
