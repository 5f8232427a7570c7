//! Page-locked host memory of this process, as the device reaches it: every range
//! `cuMemHostAlloc` / `cuMemAllocHost` allocated or `cuMemHostRegister` registered,
//! with how the device may reach it (`DEVICEMAP`, read-only) and, for a registered
//! shared mapping, the device's own view of its pages. Device accesses to host
//! memory (stream memory operations on mapped host words) run under this registry,
//! so a range is neither unregistered nor freed under them.

use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard};

use crate::abi::*;

/// How the device may reach a pinned host range (`cuMemHostAlloc`,
/// `cuMemHostRegister` flags).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HostMap {
    /// `DEVICEMAP`: mapped into the device address space (at its host address, as
    /// on a 64-bit unified-addressing system whose devices can use host pointers
    /// for registered memory).
    pub device_map: bool,
    /// `CU_MEMHOSTREGISTER_READ_ONLY`: the device may only read it.
    pub read_only: bool,
}

/// One pinned host range.
#[derive(Clone, Copy)]
struct HostRange {
    len: usize,
    /// Allocated by us (`cuMemHostAlloc`, `cuMemAllocHost`), not registered.
    alloc: bool,
    map: HostMap,
    /// The device's own view of a registered shared mapping ([`alias_shared`]):
    /// (address of the first page's alias, first page, length of the pages).
    view: Option<(usize, usize, usize)>,
}

impl HostRange {
    /// Where the device reaches host address `ptr` of this range.
    fn device_view(&self, ptr: usize) -> usize {
        match self.view {
            Some((alias, first_page, _)) => alias + (ptr - first_page),
            None => ptr,
        }
    }
}

/// A second mapping of the pages of `[ptr, ptr+len)`, if they are one shared
/// mapping (a `MAP_SHARED` file, shared memory): (alias of the first page, first
/// page, length of the pages). The driver pins registered pages, so a GPU keeps
/// reaching them after the process unmaps its own view, until
/// `cuMemHostUnregister`; the alias is that view, and stays mapped until then. The
/// pages of a private mapping cannot be aliased (`None`): the device reaches them at
/// their own address, which the application must keep mapped while registered.
fn alias_shared(ptr: usize, len: usize) -> Option<(usize, usize, usize)> {
    let page = 4096;
    let first = ptr / page * page;
    let end = ptr.checked_add(len)?.checked_next_multiple_of(page)?;
    // Only a shared mapping holding the whole range: `mremap` of a private one with
    // an old size of 0 fails on current kernels and made an unrelated private
    // mapping on old ones.
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    let shared = maps.lines().any(|l| {
        let mut f = l.split_whitespace();
        let (Some(range), Some(perms)) = (f.next(), f.next()) else {
            return false;
        };
        let Some((a, b)) = range.split_once('-') else {
            return false;
        };
        let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16)) else {
            return false;
        };
        a <= first && end <= b && perms.as_bytes().get(3) == Some(&b's')
    });
    if !shared {
        return None;
    }
    // SAFETY: with an old size of 0, mremap leaves the mapping at `first` as it is
    // and makes a new one of the same shared pages at an address of the kernel's.
    let alias = unsafe {
        libc::mremap(
            first as *mut libc::c_void,
            0,
            end - first,
            libc::MREMAP_MAYMOVE,
        )
    };
    (alias != libc::MAP_FAILED).then_some((alias as usize, first, end - first))
}

/// Unmaps the device's view of a registration ([`alias_shared`]), if it has one.
fn unmap_view(view: Option<(usize, usize, usize)>) {
    if let Some((alias, _, len)) = view {
        // SAFETY: the alias `alias_shared` made, `len` long, which only device
        // accesses under the host registry use, and the registration is gone.
        unsafe { libc::munmap(alias as *mut libc::c_void, len) };
    }
}

/// The registry: pinned host allocations and registrations, by start address.
#[derive(Default)]
pub struct HostRanges(Mutex<BTreeMap<usize, HostRange>>);

impl HostRanges {
    fn lock(&self) -> MutexGuard<'_, BTreeMap<usize, HostRange>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records pinned host memory we allocated (`alloc = true`) or a registration,
    /// and how the device may reach it: a registration mapped into the device
    /// (`DEVICEMAP`) of a shared mapping gets the device's own view of its pages
    /// ([`alias_shared`]).
    pub fn add(&self, ptr: usize, len: usize, alloc: bool, map: HostMap) -> Result<(), CUresult> {
        let view = (map.device_map && !alloc)
            .then(|| alias_shared(ptr, len))
            .flatten();
        let mut h = self.lock();
        if let Some((&s, r)) = h.range(..ptr + len).next_back() {
            if s + r.len > ptr {
                drop(h);
                unmap_view(view);
                return Err(CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED);
            }
        }
        h.insert(
            ptr,
            HostRange {
                len,
                alloc,
                map,
                view,
            },
        );
        Ok(())
    }

    /// Removes a pinned host entry that starts at `ptr`; returns its length.
    pub fn remove(&self, ptr: usize, alloc: bool) -> Result<usize, CUresult> {
        let mut h = self.lock();
        match h.get(&ptr) {
            Some(&HostRange {
                len,
                alloc: a,
                view,
                ..
            }) if a == alloc => {
                h.remove(&ptr);
                // Under the registry: no device access is using the view.
                unmap_view(view);
                Ok(len)
            }
            _ if alloc => Err(CUDA_ERROR_INVALID_VALUE),
            _ => Err(CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED),
        }
    }

    /// The pinned or registered host range containing `ptr`: (start, len).
    pub fn range(&self, ptr: usize) -> Option<(usize, usize)> {
        let h = self.lock();
        let (&s, r) = h.range(..=ptr).next_back()?;
        (ptr < s + r.len).then_some((s, r.len))
    }

    /// How the device may reach `[ptr, ptr+len)`, when one pinned host range holds
    /// all of it.
    pub fn map(&self, ptr: usize, len: usize) -> Option<HostMap> {
        let h = self.lock();
        Self::holding(&h, ptr, len).map(|r| r.map)
    }

    /// Runs `f` on the device's view of host address `ptr` while `[ptr, ptr+len)` is
    /// host memory mapped into the device (`DEVICEMAP`, and writable by it if
    /// `write`), holding the registry so the range is neither unregistered nor freed
    /// (`cuMemFreeHost` unmaps only after removing it here) until `f` returns;
    /// `None` when it is not (any more). The view is the range's alias when it is a
    /// registered shared mapping (still there if the process unmapped its own), else
    /// `ptr` itself.
    pub fn with_mapped<R>(
        &self,
        ptr: usize,
        len: usize,
        write: bool,
        f: impl FnOnce(*mut u8) -> R,
    ) -> Option<R> {
        let h = self.lock();
        let r = Self::holding(&h, ptr, len)?;
        (r.map.device_map && !(write && r.map.read_only)).then(|| f(r.device_view(ptr) as *mut u8))
    }

    fn holding(h: &BTreeMap<usize, HostRange>, ptr: usize, len: usize) -> Option<&HostRange> {
        let (&s, r) = h.range(..=ptr).next_back()?;
        let end = ptr.checked_add(len)?;
        (end <= s + r.len).then_some(r)
    }
}
