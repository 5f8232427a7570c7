//! The application's own VMM memory (`cuMemCreate`, `cuMemMap`, …: PyTorch's
//! `expandable_segments`, NCCL ≥ 2.19, vLLM). The application gets handles the shim
//! owns (values with [`KEY_TAG`]), so that a handle it maps whole, once, swaps like
//! the shim's own allocations ([`Memory::adopt_app`]): a swap-out copies its bytes
//! out and releases its physical memory; a swap-in creates it again with the same
//! properties, at the same address, with the same access. The handle the
//! application holds stays valid throughout: it names the shim's record, never the
//! driver's handle of the moment.
//!
//! A handle stays resident, counted as memory no swap frees (as every such handle
//! was before), while it is unmapped, mapped in part or more than once, exported
//! (`cuMemExportToShareableHandle`, a dma-buf of its range, a multicast binding),
//! or made for sparse arrays (`usage` flags): another process or object may hold
//! its physical memory, which CUDA cannot revoke. A call that needs the physical
//! memory of a handle that is swapped out (a second mapping, an export, an unmap
//! while the application keeps the handle) waits for the process's turn like any
//! submission ([`crate::submit`]): the swap-in brings it back.
//!
//! Handles from other processes (`cuMemImportFromShareableHandle`), host memory
//! and multicast objects are the driver's, passed through untouched.

use std::collections::BTreeMap;
use std::ffi::{c_int, c_void};
use std::sync::{Mutex, MutexGuard};

use crate::client;
use crate::cuda::*;
use crate::devices::{current_context, ensure_device, mem_lock, MAX_DEVICES};
use crate::mem::{AppProp, Memory};
use crate::real::call_real as call;
use crate::room;

type Real<A> = A;

/// The high bits of every handle value the shim gives the application: a kernel
/// address, which no driver handle (a user-space pointer or a small number) is.
const KEY_TAG: u64 = 0xffff_c1a0_0000_0000;
const KEY_MASK: u64 = 0xffff_ffff_0000_0000;

fn is_key(h: u64) -> bool {
    h & KEY_MASK == KEY_TAG
}

/// Where an application handle's physical memory is.
#[derive(Debug, Clone, PartialEq, Eq)]
enum State {
    /// Created, not mapped: the driver's handle, counted as memory no swap frees.
    Unmapped { real: u64 },
    /// Mapped whole at `va`, once: a segment of its device's allocator, which holds
    /// the driver's handle while resident.
    Swaps { va: u64 },
    /// Resident for good (see the module's doc): the driver's handle and the
    /// application's mappings of it. The shim holds the driver's reference until the
    /// application released the handle.
    Fixed { real: u64, maps: Vec<(u64, u64)> },
}

struct Entry {
    device: usize,
    size: u64,
    prop: AppProp,
    /// The application's references: one from `cuMemCreate`, one per
    /// `cuMemRetainAllocationHandle`, less its `cuMemRelease`s. At 0 the record
    /// lives on only while mapped (as the driver keeps a mapped handle's memory).
    refs: u32,
    state: State,
}

struct Registry {
    entries: BTreeMap<u64, Entry>,
    /// Every mapping of an application handle the shim owns: address → (size, key).
    maps: BTreeMap<u64, (u64, u64)>,
    next: u64,
}

static REGISTRY: Mutex<Registry> = Mutex::new(Registry {
    entries: BTreeMap::new(),
    maps: BTreeMap::new(),
    next: 0,
});

fn registry() -> MutexGuard<'static, Registry> {
    REGISTRY.lock().unwrap_or_else(|p| p.into_inner())
}

impl Registry {
    /// The mapping holding `ptr`: (address, size, key).
    fn mapping_at(&self, ptr: u64) -> Option<(u64, u64, u64)> {
        let (&va, &(size, key)) = self.maps.range(..=ptr).next_back()?;
        (ptr < va + size).then_some((va, size, key))
    }

    /// The mappings wholly inside `[ptr, ptr + size)`, in address order; `Err` when
    /// one overlaps an end of it (a partial unmap, which the driver refuses too).
    fn mappings_in(&self, ptr: u64, size: u64) -> Result<Vec<(u64, u64, u64)>, CUresult> {
        let end = ptr.checked_add(size).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if let Some((va, _, _)) = self.mapping_at(ptr) {
            if va != ptr {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
        }
        let mut out = Vec::new();
        for (&va, &(len, key)) in self.maps.range(ptr..end) {
            if va + len > end {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            out.push((va, len, key));
        }
        Ok(out)
    }
}

/// Runs `f` on the allocator of `d` (`None`: it has none).
fn with_mem<T>(
    d: usize,
    f: impl FnOnce(&mut Memory<crate::devices::RealDriver>) -> T,
) -> Option<T> {
    mem_lock(d).as_mut().map(f)
}

/// Whether a handle made with `prop` may swap: device memory of no special usage.
fn swappable(prop: &CUmemAllocationProp) -> bool {
    prop.location.type_ == CU_MEM_LOCATION_TYPE_DEVICE && prop.alloc_flags.usage == 0
}

/// Grants device `d` read-write access to `[va, va + size)`.
fn owner_access(va: u64, size: u64, d: usize) -> Result<(), CUresult> {
    let desc = CUmemAccessDesc {
        location: CUmemLocation {
            type_: CU_MEM_LOCATION_TYPE_DEVICE,
            id: d as c_int,
        },
        flags: CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    };
    call!(cuMemSetAccess: fn(CUdeviceptr, usize, *const CUmemAccessDesc, usize)
        (va, size as usize, &desc, 1))
}

/// Makes the handle `key` resident for good ([`State::Fixed`]) and runs `op` with
/// the driver's handle; a handle swapped out is first brought back by waiting for
/// the process's turn (named `name` in the wait lines).
fn with_fixed(
    key: u64,
    name: &'static str,
    op: impl Fn(&mut Registry, u64) -> CUresult,
) -> CUresult {
    // None: swapped out.
    let attempt = || -> Option<CUresult> {
        let mut reg = registry();
        let Some(e) = reg.entries.get_mut(&key).filter(|e| e.refs > 0) else {
            return Some(CUDA_ERROR_INVALID_VALUE);
        };
        let real = match e.state {
            State::Unmapped { real } => {
                e.state = State::Fixed {
                    real,
                    maps: Vec::new(),
                };
                real
            }
            State::Fixed { real, .. } => real,
            State::Swaps { va } => match with_mem(e.device, |m| m.unadopt_app(va)) {
                Some(Ok(Some(real))) => {
                    e.state = State::Fixed {
                        real,
                        maps: vec![(va, e.size)],
                    };
                    real
                }
                Some(Ok(None)) => return None,
                Some(Err(code)) => return Some(code),
                None => return Some(CUDA_ERROR_INVALID_VALUE),
            },
        };
        Some(op(&mut reg, real))
    };
    if let Some(r) = attempt() {
        return r;
    }
    // Inside the gate this process holds its turns and its memory is in.
    crate::submit::submit(
        name,
        || None,
        || attempt().unwrap_or(CUDA_ERROR_OUT_OF_MEMORY),
    )
}

/// `cuMemCreate`: the driver's memory (waiting for room when the GPU is full of
/// others' memory), counted on its device, under a handle the shim owns.
/// # Safety
/// `real` is the driver's original of this entry point; the other arguments are the
/// application's, valid as `cuda.h` documents them.
pub unsafe fn create(
    real: Real<
        unsafe extern "C" fn(
            *mut CUmemGenericAllocationHandle,
            usize,
            *const CUmemAllocationProp,
            u64,
        ) -> CUresult,
    >,
    handle: *mut CUmemGenericAllocationHandle,
    size: usize,
    prop: *const CUmemAllocationProp,
    flags: u64,
) -> CUresult {
    // SAFETY: forwarding the caller's arguments.
    let mut r = unsafe { real(handle, size, prop, flags) };
    if handle.is_null() || prop.is_null() {
        return r;
    }
    // SAFETY: the caller's property struct, just read by the driver.
    let p = unsafe { *prop };
    let device = (p.location.type_ == CU_MEM_LOCATION_TYPE_DEVICE)
        .then(|| usize::try_from(p.location.id).ok())
        .flatten()
        .filter(|&d| d < MAX_DEVICES);
    let Some(d) = device else {
        return r;
    };
    if r == CUDA_ERROR_OUT_OF_MEMORY {
        let what = "the application's own memory (cuMemCreate)";
        // SAFETY: forwarding the caller's arguments again.
        r = room::retry_with_room(d, size as u64, true, what, r, || unsafe {
            real(handle, size, prop, flags)
        });
    }
    if r != CUDA_SUCCESS || !ensure_device(d, current_context()) {
        return r;
    }
    // SAFETY: the driver just wrote the handle.
    let h = unsafe { *handle };
    let counted = with_mem(d, |m| m.external_created(h, size as u64)).is_some();
    if !counted {
        return r;
    }
    if let Some(t) = client::global().and_then(|c| c.turn_for(d)) {
        t.claim(&crate::gate::GATE);
    }
    if !swappable(&p) {
        return r;
    }
    let mut reg = registry();
    reg.next += 1;
    let key = KEY_TAG | (reg.next & !KEY_MASK);
    reg.entries.insert(
        key,
        Entry {
            device: d,
            size: size as u64,
            prop: AppProp::new(p),
            refs: 1,
            state: State::Unmapped { real: h },
        },
    );
    // SAFETY: the caller's out-pointer, checked non-null.
    unsafe { *handle = key };
    r
}

/// `cuMemRelease`: one of the application's references goes; the physical memory
/// with the last one, once unmapped (as the driver does).
/// # Safety
/// As [`create`].
pub unsafe fn release(
    real: Real<unsafe extern "C" fn(CUmemGenericAllocationHandle) -> CUresult>,
    handle: CUmemGenericAllocationHandle,
) -> CUresult {
    if !is_key(handle) {
        // SAFETY: forwarding the caller's argument.
        let r = unsafe { real(handle) };
        if r == CUDA_SUCCESS {
            for d in crate::devices::seen_devices() {
                with_mem(d, |m| m.external_released(handle));
            }
        }
        return r;
    }
    let mut reg = registry();
    let Some(e) = reg.entries.get_mut(&handle).filter(|e| e.refs > 0) else {
        return CUDA_ERROR_INVALID_VALUE;
    };
    e.refs -= 1;
    if e.refs > 0 {
        return CUDA_SUCCESS;
    }
    let (d, state) = (e.device, e.state.clone());
    match state {
        State::Unmapped { real: h } => {
            reg.entries.remove(&handle);
            with_mem(d, |m| m.external_released(h));
            // SAFETY: the driver's handle the shim held for the application.
            unsafe { real(h) }
        }
        State::Fixed { real: h, maps } => {
            if maps.is_empty() {
                reg.entries.remove(&handle);
                with_mem(d, |m| m.external_released(h));
            }
            // SAFETY: as above; a mapping keeps the memory until it is unmapped.
            unsafe { real(h) }
        }
        // The mapping holds it; the unmap frees it.
        State::Swaps { .. } => CUDA_SUCCESS,
    }
}

/// `cuMemMap`: a handle the shim owns mapped whole, once, swaps from now on; any
/// other mapping makes it resident for good.
/// # Safety
/// As [`create`].
pub unsafe fn map(
    real: Real<
        unsafe extern "C" fn(
            CUdeviceptr,
            usize,
            usize,
            CUmemGenericAllocationHandle,
            u64,
        ) -> CUresult,
    >,
    ptr: CUdeviceptr,
    size: usize,
    offset: usize,
    handle: CUmemGenericAllocationHandle,
    flags: u64,
) -> CUresult {
    if !is_key(handle) {
        // SAFETY: forwarding the caller's arguments.
        return unsafe { real(ptr, size, offset, handle, flags) };
    }
    let record = |reg: &mut Registry, real_h: u64| {
        // SAFETY: the caller's arguments, with the driver's handle for the shim's.
        let r = unsafe { real(ptr, size, offset, real_h, flags) };
        if r == CUDA_SUCCESS {
            if let Some(State::Fixed { maps, .. }) =
                reg.entries.get_mut(&handle).map(|e| &mut e.state)
            {
                maps.push((ptr, size as u64));
            }
            reg.maps.insert(ptr, (size as u64, handle));
        }
        r
    };
    {
        let mut reg = registry();
        let Some(e) = reg.entries.get_mut(&handle).filter(|e| e.refs > 0) else {
            return CUDA_ERROR_INVALID_VALUE;
        };
        if let State::Unmapped { real: h } = e.state {
            let whole = offset == 0 && size as u64 == e.size && flags == 0;
            if !whole {
                e.state = State::Fixed {
                    real: h,
                    maps: Vec::new(),
                };
                return record(&mut reg, h);
            }
            // SAFETY: as in `record`.
            let r = unsafe { real(ptr, size, 0, h, 0) };
            if r != CUDA_SUCCESS {
                return r;
            }
            let (d, n, prop) = (e.device, e.size, e.prop);
            // The owning device's access now, not at the application's
            // `cuMemSetAccess`: a swap-out in between copies through it.
            if owner_access(ptr, n, d).is_ok() {
                e.state = State::Swaps { va: ptr };
                with_mem(d, |m| m.adopt_app(ptr, n, h, prop));
            } else {
                e.state = State::Fixed {
                    real: h,
                    maps: vec![(ptr, n)],
                };
            }
            reg.maps.insert(ptr, (n, handle));
            return r;
        }
    }
    with_fixed(handle, "cuMemMap", record)
}

/// `cuMemUnmap`: the application's mappings in the range go; a swapping handle the
/// application still holds becomes an unmapped one (made resident first), one it
/// released goes with its contents.
/// # Safety
/// As [`create`].
pub unsafe fn unmap(
    real: Real<unsafe extern "C" fn(CUdeviceptr, usize) -> CUresult>,
    ptr: CUdeviceptr,
    size: usize,
) -> CUresult {
    let attempt = || -> Option<CUresult> {
        let mut reg = registry();
        let ours = match reg.mappings_in(ptr, size as u64) {
            Ok(v) => v,
            Err(e) => return Some(e),
        };
        if ours.is_empty() {
            drop(reg);
            // SAFETY: forwarding the caller's arguments.
            return Some(unsafe { real(ptr, size) });
        }
        // A swapped-out handle the application keeps must come back first (its
        // contents live on in the driver's handle): nothing is changed before.
        let must_wait = ours.iter().any(|&(va, _, key)| {
            reg.entries.get(&key).is_some_and(|e| {
                e.refs > 0
                    && e.state == State::Swaps { va }
                    && with_mem(e.device, |m| m.app_handle(va)) == Some(Ok(None))
            })
        });
        if must_wait {
            return None;
        }
        let mut r = CUDA_SUCCESS;
        let mut at = ptr;
        for &(va, len, key) in &ours {
            if va > at {
                // A gap the driver mapped (not a handle the shim owns).
                // SAFETY: an address range of the caller's.
                r = r.max(unsafe { real(at, (va - at) as usize) });
            }
            at = va + len;
            r = r.max(unmap_one(&mut reg, real, va, len, key));
        }
        if at < ptr + size as u64 {
            // SAFETY: as above.
            r = r.max(unsafe { real(at, (ptr + size as u64 - at) as usize) });
        }
        Some(r)
    };
    if let Some(r) = attempt() {
        return r;
    }
    crate::submit::submit(
        "cuMemUnmap",
        || None,
        || attempt().unwrap_or(CUDA_ERROR_OUT_OF_MEMORY),
    )
}

/// Unmaps the application's mapping of `key` at `va` (`len` bytes).
fn unmap_one(
    reg: &mut Registry,
    real: unsafe extern "C" fn(CUdeviceptr, usize) -> CUresult,
    va: u64,
    len: u64,
    key: u64,
) -> CUresult {
    let Some(e) = reg.entries.get_mut(&key) else {
        return CUDA_ERROR_INVALID_VALUE;
    };
    let keep = e.refs > 0;
    let r = match &mut e.state {
        State::Swaps { .. } => match with_mem(e.device, |m| m.unmap_app(va, keep)) {
            Some(Ok(Some(h))) => {
                e.state = State::Unmapped { real: h };
                CUDA_SUCCESS
            }
            Some(Ok(None)) => {
                reg.entries.remove(&key);
                CUDA_SUCCESS
            }
            Some(Err(code)) => return code,
            None => return CUDA_ERROR_INVALID_VALUE,
        },
        State::Fixed { real: h, maps } => {
            // SAFETY: the application's own mapping.
            let r = unsafe { real(va, len as usize) };
            if r != CUDA_SUCCESS {
                return r;
            }
            maps.retain(|&(a, _)| a != va);
            if maps.is_empty() && !keep {
                let (d, h) = (e.device, *h);
                reg.entries.remove(&key);
                with_mem(d, |m| m.external_released(h));
            }
            CUDA_SUCCESS
        }
        State::Unmapped { .. } => CUDA_ERROR_INVALID_VALUE,
    };
    reg.maps.remove(&va);
    r
}

/// `cuMemRetainAllocationHandle`: the shim's handle for an address in one of the
/// application's mappings, with one more reference.
/// # Safety
/// As [`create`].
pub unsafe fn retain(
    real: Real<unsafe extern "C" fn(*mut CUmemGenericAllocationHandle, *mut c_void) -> CUresult>,
    handle: *mut CUmemGenericAllocationHandle,
    addr: *mut c_void,
) -> CUresult {
    let mut reg = registry();
    let Some((_, _, key)) = reg.mapping_at(addr as u64) else {
        drop(reg);
        // SAFETY: forwarding the caller's arguments.
        return unsafe { real(handle, addr) };
    };
    if handle.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    if let Some(e) = reg.entries.get_mut(&key) {
        e.refs += 1;
    }
    // SAFETY: the caller's out-pointer, checked non-null.
    unsafe { *handle = key };
    CUDA_SUCCESS
}

/// `cuMemGetAllocationPropertiesFromHandle`: the properties the application asked for.
/// # Safety
/// As [`create`].
pub unsafe fn properties(
    real: Real<
        unsafe extern "C" fn(*mut CUmemAllocationProp, CUmemGenericAllocationHandle) -> CUresult,
    >,
    prop: *mut CUmemAllocationProp,
    handle: CUmemGenericAllocationHandle,
) -> CUresult {
    if !is_key(handle) {
        // SAFETY: forwarding the caller's arguments.
        return unsafe { real(prop, handle) };
    }
    let reg = registry();
    let Some(e) = reg.entries.get(&handle).filter(|e| e.refs > 0) else {
        return CUDA_ERROR_INVALID_VALUE;
    };
    if prop.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    // SAFETY: the caller's out-pointer, checked non-null.
    unsafe { *prop = e.prop.0 };
    CUDA_SUCCESS
}

/// `cuMemExportToShareableHandle`: another process may map the memory from now on,
/// so it stays resident for good; exported is the driver's handle.
/// # Safety
/// As [`create`].
pub unsafe fn export(
    real: Real<
        unsafe extern "C" fn(*mut c_void, CUmemGenericAllocationHandle, c_int, u64) -> CUresult,
    >,
    shareable: *mut c_void,
    handle: CUmemGenericAllocationHandle,
    handle_type: c_int,
    flags: u64,
) -> CUresult {
    if !is_key(handle) {
        // SAFETY: forwarding the caller's arguments.
        return unsafe { real(shareable, handle, handle_type, flags) };
    }
    with_fixed(handle, "cuMemExportToShareableHandle", |_, h| {
        // SAFETY: the caller's arguments, with the driver's handle for the shim's.
        unsafe { real(shareable, h, handle_type, flags) }
    })
}

/// `cuMulticastBindMem`: a multicast object maps the memory: resident for good.
/// # Safety
/// As [`create`].
pub unsafe fn multicast_bind_mem(
    real: Real<
        unsafe extern "C" fn(
            CUmemGenericAllocationHandle,
            usize,
            CUmemGenericAllocationHandle,
            usize,
            usize,
            u64,
        ) -> CUresult,
    >,
    mc: CUmemGenericAllocationHandle,
    mc_offset: usize,
    handle: CUmemGenericAllocationHandle,
    offset: usize,
    size: usize,
    flags: u64,
) -> CUresult {
    if !is_key(handle) {
        // SAFETY: forwarding the caller's arguments.
        return unsafe { real(mc, mc_offset, handle, offset, size, flags) };
    }
    with_fixed(handle, "cuMulticastBindMem", |_, h| {
        // SAFETY: as in `export`.
        unsafe { real(mc, mc_offset, h, offset, size, flags) }
    })
}

/// The key of the swapping mapping holding `[ptr, ptr + size)` (`None`: none does).
fn swapping_at(ptr: u64, size: u64) -> Option<(u64, u64, u64)> {
    let reg = registry();
    let (va, len, key) = reg.mapping_at(ptr)?;
    let e = reg.entries.get(&key)?;
    (e.state == State::Swaps { va } && ptr.saturating_add(size) <= va + len)
        .then_some((va, len, key))
}

/// `cuMemGetHandleForAddressRange` (a dma-buf of the range, for another device's
/// driver): over a swapping mapping, it is made resident for good first.
/// # Safety
/// As [`create`].
pub unsafe fn handle_for_address_range(
    real: Real<unsafe extern "C" fn(*mut c_void, CUdeviceptr, usize, c_int, u64) -> CUresult>,
    out: *mut c_void,
    ptr: CUdeviceptr,
    size: usize,
    handle_type: c_int,
    flags: u64,
) -> CUresult {
    let forward = || {
        // SAFETY: forwarding the caller's arguments.
        unsafe { real(out, ptr, size, handle_type, flags) }
    };
    match swapping_at(ptr, size as u64) {
        Some((_, _, key)) => with_fixed(key, "cuMemGetHandleForAddressRange", |_, _| forward()),
        None => forward(),
    }
}

/// `cuMemSetAccess` over one of the application's swapping mappings: recorded on
/// its segment and applied to every mapping a swap-in makes; passed to the driver
/// too while resident. `None`: not such a mapping.
pub fn set_access(
    ptr: CUdeviceptr,
    size: usize,
    descs: &[CUmemAccessDesc],
    now: impl FnOnce() -> CUresult,
) -> Option<CUresult> {
    let reg = registry();
    let (va, _, key) = reg.mapping_at(ptr)?;
    let e = reg.entries.get(&key)?;
    if e.state != (State::Swaps { va }) {
        return None;
    }
    let d = e.device;
    let mut grants = Vec::with_capacity(descs.len());
    for x in descs {
        if x.location.type_ != CU_MEM_LOCATION_TYPE_DEVICE || !matches!(x.flags, 0 | 1 | 3) {
            return Some(CUDA_ERROR_INVALID_VALUE);
        }
        // The owning device always has read-write access (the shim swaps through it).
        if x.location.id as usize != d {
            grants.push((x.location.id, x.flags));
        }
    }
    Some(
        with_mem(d, |m| {
            if m.app_handle(va) != Ok(None) {
                let r = now();
                if r != CUDA_SUCCESS {
                    return r;
                }
            }
            if grants.is_empty() {
                return CUDA_SUCCESS;
            }
            match m.set_access(ptr, size as u64, &grants) {
                Some(Ok(())) | None => CUDA_SUCCESS,
                Some(Err(e)) => e,
            }
        })
        .unwrap_or(CUDA_ERROR_INVALID_VALUE),
    )
}

/// The range of the application's swapping mapping holding `ptr` (resident or
/// not), for `cuMemGetAddressRange`.
pub fn range_of(ptr: CUdeviceptr) -> Option<(u64, u64)> {
    swapping_at(ptr, 1).map(|(va, len, _)| (va, len))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_told_apart_from_driver_handles() {
        assert!(is_key(KEY_TAG | 1));
        assert!(!is_key(0x5555_0000_1000));
        assert!(!is_key(42));
    }

    #[test]
    fn mappings_in_a_range_must_lie_wholly_inside_it() {
        let mut r = Registry {
            entries: BTreeMap::new(),
            maps: BTreeMap::new(),
            next: 0,
        };
        r.maps.insert(0x1000, (0x1000, KEY_TAG | 1));
        r.maps.insert(0x3000, (0x1000, KEY_TAG | 2));
        assert_eq!(
            r.mappings_in(0x1000, 0x3000).unwrap(),
            vec![(0x1000, 0x1000, KEY_TAG | 1), (0x3000, 0x1000, KEY_TAG | 2)]
        );
        assert_eq!(r.mappings_in(0x1800, 0x800), Err(CUDA_ERROR_INVALID_VALUE));
        assert_eq!(r.mappings_in(0x1000, 0x2800), Err(CUDA_ERROR_INVALID_VALUE));
        assert!(r.mappings_in(0x5000, 0x1000).unwrap().is_empty());
        assert_eq!(r.mapping_at(0x3fff), Some((0x3000, 0x1000, KEY_TAG | 2)));
        assert_eq!(r.mapping_at(0x2000), None);
    }
}
