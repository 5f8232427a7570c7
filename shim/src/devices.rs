//! The process's per-device state: each device's allocator ([`crate::mem`] over the
//! real driver, [`RealDriver`]), the application's context on it, the device's
//! identity and turn registration with the client, whether its physical memory is
//! created exportable (CUDA IPC), and the accessors the hooked behaviour shares
//! (`hooks`, `attrs`, `ipc`): by pointer, by device, the current device.
//!
//! Its parts: `driver` ([`RealDriver`]), `pinned` (page-locked swap buffers),
//! `contexts` (the application's live contexts, the one the shim works in, the queue
//! bound's wait), `drainer` (synchronizations bounded in time, one thread per device),
//! `cost` (what a context costs, measured on twins or from NVML's looks) and
//! `residency` (the [`Residency`] the client swaps and drains through).

use std::ffi::{c_int, c_void};
use std::ptr::null_mut;
use std::sync::atomic::{AtomicPtr, AtomicU64, AtomicU8, Ordering};
use std::sync::{Mutex, MutexGuard};

use crate::client::{self, DeviceInfo, Residency};
use crate::cuda::*;
use crate::mem::{Driver, Figures, Memory, Swap};
use crate::real::call_real as call;

mod contexts;
mod cost;
mod drainer;
mod driver;
mod pinned;
mod residency;

pub(crate) use contexts::{context_destroyed, context_made, note_context_cost};
pub use contexts::{synchronize_current, synchronize_current_within};
use contexts::{synchronize_others, AppContext};
pub(crate) use cost::{
    context_cost, creation_cost, free_memory, note_creation_drop, nvml_free, nvml_look,
};
pub use driver::RealDriver;
pub(crate) use driver::FREE_STREAM;
use residency::DeviceResidency;

/// Most device ordinals the shim manages (one allocator and one turn each).
pub(crate) const MAX_DEVICES: usize = client::MAX_TURNS;

/// Each device's allocator (created when the process first gets a context or
/// allocates on it).
static MEMS: [Mutex<Option<Memory<RealDriver>>>; MAX_DEVICES] =
    [const { Mutex::new(None) }; MAX_DEVICES];
/// The application's context on each device, made current on the shim's own threads
/// before they swap or drain.
pub(crate) static APP_CTX: [AtomicPtr<c_void>; MAX_DEVICES] =
    [const { AtomicPtr::new(null_mut()) }; MAX_DEVICES];
/// Devices with an allocator (bit per ordinal), so lookups by pointer visit only those.
static DEVICES_SEEN: AtomicU64 = AtomicU64::new(0);
/// Devices whose VMM is unavailable (bit per ordinal): their allocations pass through.
static VMM_UNAVAILABLE: AtomicU64 = AtomicU64::new(0);

pub(crate) fn mem_lock(d: usize) -> MutexGuard<'static, Option<Memory<RealDriver>>> {
    MEMS[d].lock().unwrap_or_else(|p| p.into_inner())
}

/// Ordinals of the devices that have an allocator.
pub(crate) fn seen_devices() -> impl Iterator<Item = usize> {
    let bits = DEVICES_SEEN.load(Ordering::Acquire);
    (0..MAX_DEVICES).filter(move |d| bits & (1 << d) != 0)
}

pub(crate) fn current_context() -> CUcontext {
    let mut ctx: CUcontext = null_mut();
    let _ = call!(cuCtxGetCurrent: fn(*mut CUcontext)(&mut ctx));
    ctx
}

/// The device of the calling thread's current context (where its next launch goes).
pub(crate) fn current_device() -> Option<usize> {
    let mut d: CUdevice = 0;
    call!(cuCtxGetDevice: fn(*mut CUdevice)(&mut d)).ok()?;
    usize::try_from(d).ok().filter(|&d| d < MAX_DEVICES)
}

/// Whether every allocation of every device is resident (slow paths only: it takes
/// each allocator's lock).
pub(crate) fn all_resident() -> bool {
    seen_devices().all(|d| mem_lock(d).as_ref().is_none_or(|m| m.all_resident()))
}

/// The identity the arbiter knows device `d` by.
fn device_info(d: usize) -> Result<DeviceInfo, CUresult> {
    let dev = d as CUdevice;
    let mut uuid = CUuuid::default();
    call!(cuDeviceGetUuid_v2: fn(*mut CUuuid, CUdevice)(&mut uuid, dev))
        .or_else(|_| call!(cuDeviceGetUuid: fn(*mut CUuuid, CUdevice)(&mut uuid, dev)))?;
    let mut total: usize = 0;
    call!(cuDeviceTotalMem_v2: fn(*mut usize, CUdevice)(&mut total, dev))?;
    Ok(DeviceInfo {
        ordinal: d,
        uuid: format_uuid(&uuid),
        total_memory: total as u64,
        context_bytes: 0,
        pending_bytes: 0,
    })
}

/// Device `d`'s UUID as NVML names it (`GPU-…`); `None` where the driver cannot say.
pub(crate) fn device_uuid(d: usize) -> Option<String> {
    device_info(d).ok().map(|i| i.uuid)
}

/// Creates device `d`'s allocator. Managed processes create it with backing not
/// allowed: nothing is backed before the device's turn is held.
fn create_mem(d: usize, ctx: CUcontext, backing_allowed: bool) -> bool {
    let mut guard = mem_lock(d);
    if guard.is_some() {
        return true;
    }
    match Memory::new(RealDriver {
        device: d as CUdevice,
    }) {
        Ok(mut m) => {
            m.set_backing_allowed(backing_allowed);
            *guard = Some(m);
            if !ctx.is_null() {
                let _ = APP_CTX[d].compare_exchange(
                    null_mut(),
                    ctx,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                );
            }
            DEVICES_SEEN.fetch_or(1 << d, Ordering::AcqRel);
            true
        }
        Err(e) => {
            if VMM_UNAVAILABLE.fetch_or(1 << d, Ordering::AcqRel) & (1 << d) == 0 {
                crate::kwarn!(
                    "GPU {d}: VMM unavailable (CUDA error {e}); its allocations pass through unswappable"
                );
            }
            false
        }
    }
}

/// Makes sure device `d` (where the process has context `ctx`) has its allocator and,
/// when managed, its turn. False when the shim does not manage the device's memory.
pub(crate) fn ensure_device(d: usize, ctx: CUcontext) -> bool {
    if !client::allocator_enabled() || VMM_UNAVAILABLE.load(Ordering::Acquire) & (1 << d) != 0 {
        return false;
    }
    if mem_lock(d).is_some() {
        return true;
    }
    let Some(c) = client::global() else {
        return create_mem(d, ctx, true);
    };
    let mut info = match device_info(d) {
        Ok(i) => i,
        Err(e) => {
            crate::kwarn!("GPU {d}: cannot identify it (CUDA error {e}); not managed");
            return false;
        }
    };
    info.context_bytes = context_cost(d, ctx);
    note_context_cost(d, info.context_bytes);
    let added = c.add_device(info, || {
        create_mem(d, ctx, false).then(|| Box::new(DeviceResidency(d)) as Box<dyn Residency>)
    });
    if added == client::Added::Unmanaged {
        if let Some(m) = mem_lock(d).as_mut() {
            m.set_backing_allowed(true);
        }
    }
    mem_lock(d).is_some()
}

/// Device `d`'s turn, for memory the shim cannot page that does not fit yet (a
/// context, a module, the application's own VMM memory: [`crate::room`]): registered
/// now, before any context, when the process has none there; either way with
/// `estimate` bytes pending (reported as working set not resident, so the
/// arbiter makes room for them). The caller clears them (`set_pending(0)`). `None`
/// when the shim does not manage the device.
pub(crate) fn turn_for_room(d: usize, estimate: u64) -> Option<&'static client::Turn> {
    let c = client::global()?;
    if VMM_UNAVAILABLE.load(Ordering::Acquire) & (1 << d) != 0 {
        return None;
    }
    if let Some(t) = c.turn_for(d) {
        t.set_pending(estimate);
        client::report_now(d);
        return Some(t);
    }
    let mut info = match device_info(d) {
        Ok(i) => i,
        Err(e) => {
            crate::kwarn!("GPU {d}: cannot identify it (CUDA error {e}); not managed");
            return None;
        }
    };
    info.pending_bytes = estimate;
    let added = c.add_device(info, || {
        create_mem(d, null_mut(), false).then(|| Box::new(DeviceResidency(d)) as Box<dyn Residency>)
    });
    if added == client::Added::Unmanaged {
        if let Some(m) = mem_lock(d).as_mut() {
            m.set_backing_allowed(true);
        }
        return None;
    }
    c.turn_for(d).map(|t| &**t)
}

/// The current context's device, when the shim manages its memory: its allocator
/// (and, managed, its turn) is created on first use. `None`: no context, allocator
/// disabled, VMM unavailable.
pub(crate) fn current_mem_device() -> Option<usize> {
    if !client::allocator_enabled() {
        return None;
    }
    let ctx = current_context();
    if ctx.is_null() {
        return None;
    }
    let d = current_device()?;
    ensure_device(d, ctx).then_some(d)
}

/// Runs `f` on the allocator whose allocation contains `ptr` (any byte of it), with
/// its device and the allocation's (base, size); `None` when no allocation of the
/// shim's holds `ptr`. For [`crate::attrs`].
pub(crate) fn with_allocation<T>(
    ptr: CUdeviceptr,
    f: impl FnOnce(usize, (u64, u64), &mut Memory<RealDriver>) -> T,
) -> Option<T> {
    if !client::allocator_enabled() {
        return None;
    }
    for d in seen_devices() {
        let mut guard = mem_lock(d);
        if let Some(m) = guard.as_mut() {
            if let Some(range) = m.range_of(ptr) {
                return Some(crate::ffi::inside(|| f(d, range, m)));
            }
        }
    }
    None
}

/// `kiwiMemDiscard`: declares `[ptr, ptr + bytes)` of one of the shim's allocations
/// dead until the process's next submission ([`Memory::discard`], [`crate::hint`]).
/// `CUDA_ERROR_INVALID_VALUE` for a range outside the shim's allocations (null,
/// overflow, past the allocation's end); a provider's late answer is accepted and
/// ignored.
pub(crate) fn discard(ptr: CUdeviceptr, bytes: u64) -> CUresult {
    let token = crate::hint::discard_token(crate::gate::GATE.token());
    if ptr == 0 || bytes == 0 {
        return CUDA_ERROR_INVALID_VALUE;
    }
    match with_allocation(ptr, |_, _, m| m.discard(ptr, bytes, token)) {
        Some(Ok(_)) => CUDA_SUCCESS,
        Some(Err(e)) => e,
        None => CUDA_ERROR_INVALID_VALUE,
    }
}

/// Runs `f` on device `d`'s allocator, if it has one. For [`crate::attrs`].
pub(crate) fn with_device_memory<T>(
    d: usize,
    f: impl FnOnce(&mut Memory<RealDriver>) -> T,
) -> Option<T> {
    if d >= MAX_DEVICES {
        return None;
    }
    mem_lock(d).as_mut().map(|m| crate::ffi::inside(|| f(m)))
}

/// The application's context on device `d` (null when it has none). For
/// [`crate::attrs`].
pub(crate) fn app_context(d: usize) -> CUcontext {
    APP_CTX
        .get(d)
        .map_or(null_mut(), |c| c.load(Ordering::Acquire))
}

/// The device of context `ctx`: made current for the question, the thread's own
/// context restored after. For [`crate::attrs`].
pub(crate) fn device_of(ctx: CUcontext) -> Option<usize> {
    let previous = current_context();
    if previous == ctx {
        return current_device();
    }
    call!(cuCtxSetCurrent: fn(CUcontext)(ctx)).ok()?;
    let d = current_device();
    let _ = call!(cuCtxSetCurrent: fn(CUcontext)(previous));
    d
}

/// Runs `f` on the allocator that owns `ptr` (an allocation base).
pub(crate) fn with_owner<T>(
    ptr: CUdeviceptr,
    f: impl FnOnce(&mut Memory<RealDriver>) -> T,
) -> Option<T> {
    for d in seen_devices() {
        let mut guard = mem_lock(d);
        if let Some(m) = guard.as_mut().filter(|m| m.owns(ptr)) {
            return Some(f(m));
        }
    }
    None
}

/// Whether the shim's physical handles are created exportable: 0 untried, 1 yes,
/// 2 the driver refused the POSIX fd type (IPC of shim memory is off).
static EXPORTABLE: AtomicU8 = AtomicU8::new(0);

/// The properties of the shim's physical allocations on `device`: exportable as a
/// POSIX fd unless the driver refused that once.
pub fn alloc_prop(device: CUdevice) -> CUmemAllocationProp {
    let mut p = CUmemAllocationProp::device(device);
    if EXPORTABLE.load(Ordering::Relaxed) != 2 {
        p.requested_handle_types = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    }
    p
}

/// `cuMemCreate` with `prop` failed with `e`: whether to retry without the
/// shareable type (the driver does not support it here; said once).
pub fn create_refused(prop: &CUmemAllocationProp, e: CUresult) -> bool {
    if prop.requested_handle_types == 0
        || !matches!(e, CUDA_ERROR_INVALID_VALUE | CUDA_ERROR_NOT_SUPPORTED)
    {
        return false;
    }
    if EXPORTABLE.swap(2, Ordering::Relaxed) != 2 {
        crate::kwarn!(
            "the driver refuses exportable (POSIX fd) memory (CUDA error {e}): CUDA IPC of the shim's allocations is off"
        );
    }
    true
}

/// A physical handle was created exportable.
pub fn created_exportable() {
    let _ = EXPORTABLE.compare_exchange(0, 1, Ordering::Relaxed, Ordering::Relaxed);
}

/// Whether shim allocations can be shared (`IS_LEGACY_CUDA_IPC_CAPABLE`).
pub fn exportable() -> bool {
    EXPORTABLE.load(Ordering::Relaxed) != 2
}
