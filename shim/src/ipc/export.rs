//! The exporter's side: `cuIpcGetMemHandle` makes a handle for one of the shim's
//! allocations and pins it (in the turn, if it is swapped out); the shares this
//! process exported, and the pin rule's bookkeeping the broker applies.

use super::*;

/// One shared allocation of this process.
#[derive(Clone, Copy)]
pub(super) struct Share {
    pub(super) id: u64,
    pub(super) device: usize,
    pub(super) base: u64,
    /// The pin taken by `cuIpcGetMemHandle`, not yet handed to an importer.
    pub(super) export_pin: bool,
    /// Importers with it open (one pin each).
    pub(super) conns: u32,
}

#[derive(Default)]
pub(super) struct Exports {
    pub(super) by_token: HashMap<[u8; 16], Share>,
}

static EXPORTS: OnceLock<Mutex<Exports>> = OnceLock::new();

pub(super) fn exports() -> MutexGuard<'static, Exports> {
    EXPORTS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner())
}

/// Shares kept before stale ones (freed allocations) are pruned.
const PRUNE_AT: usize = 4096;

/// Serializes the decisions to take, hand over and give back pins (held while a pin
/// waits for the turn: other exports and opens wait meanwhile).
static PIN_LOCK: Mutex<()> = Mutex::new(());

pub(super) fn pin_lock() -> MutexGuard<'static, ()> {
    PIN_LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

/// Pins the allocation at `base` on device `d` for share `id`; if it is swapped
/// out, waits for the turn as a submission to `d` would and pins it during it.
pub(super) fn pin_in_turn(d: usize, base: u64, id: u64, first: bool) -> Result<(), CUresult> {
    let try_pin = || {
        crate::devices::with_device_memory(d, |m| m.pin_shared(base, id, first))
            .unwrap_or(Err(PinError::Stale))
    };
    let gate = &crate::gate::GATE;
    for _ in 0..1000 {
        match try_pin() {
            Ok(()) => return Ok(()),
            Err(PinError::Stale) => return Err(CUDA_ERROR_INVALID_VALUE),
            Err(PinError::NotResident) => {}
        }
        // Inside the gate no drop can evict (it waits for us), and the gate opens
        // only over resident memory.
        if gate.try_enter() || gate.try_enter_device(d) {
            let r = try_pin();
            gate.exit();
            match r {
                Ok(()) => return Ok(()),
                Err(PinError::Stale) => return Err(CUDA_ERROR_INVALID_VALUE),
                Err(PinError::NotResident) => {}
            }
        }
        crate::client::acquire(gate, Some(d))?;
    }
    Err(CUDA_ERROR_OUT_OF_MEMORY)
}

pub(super) fn unpin(s: &Share) {
    crate::devices::with_device_memory(s.device, |m| m.unpin_shared(s.base, s.id));
}

/// `cuIpcGetMemHandle`.
///
/// # Safety
/// `real` is the driver's original; `handle` is the caller's out-pointer.
pub unsafe fn get_mem_handle(
    real: unsafe extern "C" fn(*mut CUipcMemHandle, CUdeviceptr) -> CUresult,
    handle: *mut CUipcMemHandle,
    dptr: CUdeviceptr,
) -> CUresult {
    let found = crate::devices::with_allocation(dptr, |d, (base, size), m| {
        (d, base, size, m.share_id(base))
    });
    let Some((d, base, size, mem_id)) = found else {
        // SAFETY: forwarding the caller's arguments.
        return unsafe { real(handle, dptr) };
    };
    if handle.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    if !exportable() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    let broker = match Broker::get() {
        Ok(b) => b,
        Err(e) => {
            crate::kerror!("cuIpcGetMemHandle: cannot start the IPC broker: {e}");
            return CUDA_ERROR_OPERATING_SYSTEM;
        }
    };
    // Deciding whether to pin and recording it happen under PIN_LOCK, as in the
    // broker: a pin is never taken twice for one slot, nor lost.
    let _pinning = pin_lock();
    let (token, share) = {
        let mut ex = exports();
        if ex.by_token.len() >= PRUNE_AT {
            prune(&mut ex);
        }
        // The live share of this allocation, if any (one whose id the allocator still
        // knows: a share of a freed allocation at the same address is stale).
        let hit = ex
            .by_token
            .iter()
            .find(|(_, s)| s.device == d && s.base == base && Some(s.id) == mem_id)
            .map(|(t, s)| (*t, *s));
        match hit {
            Some(x) => x,
            None => {
                ex.by_token
                    .retain(|_, s| !(s.device == d && s.base == base && s.conns == 0));
                let s = Share {
                    id: mem_id.unwrap_or_else(|| u64::from_le_bytes(random_bytes()) | 1),
                    device: d,
                    base,
                    export_pin: false,
                    conns: 0,
                };
                let t = random_bytes();
                ex.by_token.insert(t, s);
                (t, s)
            }
        }
    };
    if !share.export_pin && share.conns == 0 {
        if let Err(e) = pin_in_turn(d, base, share.id, true) {
            return e;
        }
        if let Some(s) = exports().by_token.get_mut(&token) {
            s.export_pin = true;
        }
    }
    let h = Handle {
        pid: std::process::id(),
        device: d as u32,
        base,
        size,
        token,
        broker: broker.id,
    };
    // SAFETY: non-null out-pointer from the caller.
    unsafe { handle.write(h.encode()) };
    crate::kdebug!(
        "cuIpcGetMemHandle: {size} bytes at {base:#x} shared (pinned while exported or open)"
    );
    CUDA_SUCCESS
}

/// Drops shares whose allocation was freed and that nobody has open.
fn prune(ex: &mut Exports) {
    ex.by_token.retain(|_, s| {
        s.conns > 0
            || crate::devices::with_device_memory(s.device, |m| m.share_id(s.base) == Some(s.id))
                .unwrap_or(false)
    });
}
