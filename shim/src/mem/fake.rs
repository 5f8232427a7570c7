//! A fake driver keeping "device memory" in host vectors: physical handles hold
//! bytes, mappings place them at virtual addresses, and every access to an
//! unmapped address is an error, as on a real GPU. Pinned host buffers are tracked:
//! a copy to or from anything but a live buffer, or a double free, panics. With
//! `asynchronous`, `to_host_async` / `to_device_async` only queue the copy and
//! `wait_copies` runs the queue, as a copy engine would: a swapper that unmapped a
//! segment before waiting for its copy would read an unmapped address.

use super::access::merge_grant;
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
    /// Offer pageable buffers ([`Driver::pageable_alloc`]); off: none, as a driver
    /// without the path.
    pub pageable: bool,
    /// Live pageable buffers not registered (address → length); also in `host`.
    pub unregistered: BTreeMap<usize, usize>,
    pub pageable_allocs: u64,
    pub registrations: u64,
    /// Offer a disk tier ([`Driver::host_spill`]); off: none.
    pub spill: bool,
    /// Spilled contents by handle.
    pub disk: HashMap<u64, Vec<u8>>,
    /// Host buffers that are "the process's own memory" (never spillable).
    pub own: std::collections::HashSet<usize>,
    pub next_disk: u64,
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

    /// With pageable buffers offered, copies at once or queued.
    pub fn with_pageable(physical_limit: u64, asynchronous: bool) -> Self {
        let d = Self::new(physical_limit);
        {
            let mut st = d.st.borrow_mut();
            st.pageable = true;
            st.asynchronous = asynchronous;
        }
        d
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
        let (&base, &(size, h)) = st.maps.range(..=va).next_back().ok_or::<CUresult>(700)?;
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

    /// Frees any host buffer (pinned or pageable) this driver allocated.
    fn host_free_any(&self, p: *mut u8, size: u64) {
        let mut st = self.st.borrow_mut();
        assert!(st.pending.is_empty(), "host buffer freed under a copy");
        let len = st.host.remove(&(p as usize)).expect("double or bad free");
        assert_eq!(len as u64, size, "freed with another size than allocated");
        st.host_used -= len as u64;
        // SAFETY: `p` came from a Box<[u8]> of `len` bytes (host_alloc or
        // pageable_alloc), freed once.
        drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(p, len)) });
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
        let v = st.handles.remove(&handle).ok_or::<CUresult>(1)?;
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
    fn pageable_alloc(&self, size: u64) -> Option<*mut u8> {
        if !self.st.borrow().pageable {
            return None;
        }
        let mut st = self.st.borrow_mut();
        st.pageable_allocs += 1;
        st.host_used += size;
        let v = vec![0u8; size as usize].into_boxed_slice();
        let p = Box::into_raw(v) as *mut u8;
        st.host.insert(p as usize, size as usize);
        st.unregistered.insert(p as usize, size as usize);
        Some(p)
    }
    fn pageable_free(&self, p: *mut u8, size: u64) {
        let len = self
            .st
            .borrow_mut()
            .unregistered
            .remove(&(p as usize))
            .expect("pageable_free of a buffer that is registered or not pageable");
        assert_eq!(len as u64, size);
        self.host_free_any(p, size);
    }
    fn host_register(&self, p: *mut u8, size: u64) -> Result<(), CUresult> {
        let mut st = self.st.borrow_mut();
        let len = st
            .unregistered
            .remove(&(p as usize))
            .expect("register of a buffer that is not pageable or registered already");
        assert_eq!(len as u64, size);
        st.registrations += 1;
        Ok(())
    }
    fn host_free(&self, p: *mut u8, size: u64) {
        assert!(
            !self.st.borrow().unregistered.contains_key(&(p as usize)),
            "host_free of a pageable buffer that was never registered"
        );
        self.host_free_any(p, size);
    }
    unsafe fn to_host(&self, dst: *mut u8, src: u64, n: u64) -> Result<(), CUresult> {
        self.check_host(dst as usize, n);
        let data = self.peek(src, n as usize)?;
        // SAFETY: dst lies in a live host buffer of at least n bytes (checked).
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), dst, n as usize) };
        Ok(())
    }
    // `p` is checked to be a live buffer this fake allocated before it is read.
    #[allow(clippy::not_unsafe_ptr_arg_deref)]
    fn host_spill(&self, p: *mut u8, size: u64) -> Option<u64> {
        if !self.st.borrow().spill {
            return None;
        }
        self.check_host(p as usize, size);
        // SAFETY: `p` is a live host buffer of `size` bytes (checked above).
        let data = unsafe { std::slice::from_raw_parts(p, size as usize) }.to_vec();
        self.host_free(p, size);
        let mut st = self.st.borrow_mut();
        let h = st.next_disk;
        st.next_disk += 1;
        st.disk.insert(h, data);
        Some(h)
    }
    fn host_spillable(&self, p: *mut u8) -> bool {
        let st = self.st.borrow();
        st.spill && !st.own.contains(&(p as usize))
    }
    fn spilled_to_device(&self, h: u64, va: u64, pieces: &[(u64, u64)]) -> Result<(), CUresult> {
        let data = self
            .st
            .borrow()
            .disk
            .get(&h)
            .cloned()
            .expect("a live spill handle");
        for &(off, n) in pieces {
            self.poke(va + off, &data[off as usize..(off + n) as usize])?;
        }
        Ok(())
    }
    fn spill_free(&self, h: u64) {
        assert!(
            self.st.borrow_mut().disk.remove(&h).is_some(),
            "double or bad spill free"
        );
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
                Pending::ToDevice { dst, src, n } => unsafe { self.to_device(dst, src as _, n) },
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
