//! Room for memory the shim cannot page (issue #24): a context, a module load or the
//! application's own physical memory (`cuMemCreate`) that finds the GPU full of other
//! processes' memory asks the arbiter for room and waits for its turn, instead of
//! failing (a newcomer's first CUDA call used to fail because an idle tenant's
//! memory was resident).
//!
//! Every way a context is made meets [`create_context`]: `cuDevicePrimaryCtxRetain`,
//! `cuCtxCreate` (v2–v4) and the private entry point NVIDIA's CUDA runtime makes its
//! primary context through (slot 2 of the `CUDART_INTERFACE` export table, which
//! [`get_export_table`] patches in place: the runtime's integrity check hashes the
//! table's address, so the table cannot be replaced by a copy). Module loads and
//! `cuMemCreate` call [`retry_with_room`] from their hooks.
//!
//! On `CUDA_ERROR_OUT_OF_MEMORY` from the driver, in a managed process: the device's
//! turn is registered if the process has none yet (before any context:
//! [`crate::devices::turn_for_room`]), with what is needed pending — an estimate for
//! a context or a module, the size for `cuMemCreate` — reported as working set not
//! resident: to the arbiter the process is a client with memory to bring in, so a GPU
//! that no longer fits makes it wait its turn like any waiter, and its grant reclaims
//! from the others the room it needs. The call is tried again while the turn is held,
//! every few ms while the others' memory leaves, telling the arbiter `no_room` for
//! what is pending every 250 ms (memory it cannot see, such as a process outside
//! Kiwi: the arbiter learns it, and turns sharers into turns or reclaims more). A
//! context, once made, is counted as memory no swap frees at its measured cost (the
//! estimate where no twin fits to measure it by); a module by its measured drop in
//! free memory; the application's VMM memory as such. What could never fit, even
//! with every other process's swappable memory out (the arbiter's `room` says the
//! others' memory no swap frees), fails at once with the driver's out of memory:
//! PyTorch frees its cache and tries again on such an error. What would leave
//! another client's working set no room, ever, beside every process's memory no
//! swap frees (the arbiter's `room` names the largest, where it cannot evict whole
//! processes) fails at once too, with a line naming it ([`blocked_line`]). After 10
//! s of holding the turn without room, the call fails the same way, with a line. An
//! unmanaged process fails as it would without Kiwi.

use std::ffi::c_void;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crate::client;
use crate::cuda::*;
use crate::devices::{free_memory, mem_lock, nvml_free, MAX_DEVICES};

/// What a context is counted while it waits for room, before it can be measured: an
/// H100's contexts cost 300–500 MiB (issue #24); a short estimate costs `no_room`
/// rounds, a long one an extra segment or two of the idle tenant's memory swapped.
const CONTEXT_ESTIMATE: u64 = 512 << 20;
/// What a module load waits for room for: its size is not known before it is
/// loaded; one segment of the others' memory, and `no_room` asks for more.
pub(crate) const MODULE_ESTIMATE: u64 = 64 << 20;
/// How often a held turn tries the creation again while room is being made.
const RETRY: Duration = Duration::from_millis(5);
/// How long the creation is tried while the turn is held before it fails with the
/// driver's out-of-memory: by then every other client's swappable memory was asked
/// for (a `no_room` every 250 ms), so what blocks it is memory no swap frees.
const HELD_LIMIT: Duration = Duration::from_secs(10);

/// Runs `create`, a context creation on device `dev` that writes the context through
/// `pctx`; on out of memory in a managed process, makes room as the module docs say.
pub(crate) fn create_context(
    dev: CUdevice,
    pctx: *mut CUcontext,
    mut create: impl FnMut() -> CUresult,
) -> CUresult {
    let d = usize::try_from(dev).ok().filter(|&d| d < MAX_DEVICES);
    // The process's first context there: what its creation takes is what a context
    // costs, where no twin fits to measure it by (`devices::context_cost`).
    let uuid = d
        .filter(|&d| crate::devices::APP_CTX[d].load(Ordering::Acquire).is_null())
        .and_then(crate::devices::device_uuid);
    // Measured on every try, the one made after waiting for room included (not
    // measured, a context made then counted the 512 MiB estimate: two newcomers
    // beside an idle holder were refused for a holder one 300 MiB context could not
    // block).
    let mut create = || {
        let before = uuid.as_deref().and_then(crate::devices::nvml_look);
        let r = create();
        if let (Some(d), Some(b), true) = (d, before, r == CUDA_SUCCESS) {
            if let Some(a) = uuid.as_deref().and_then(crate::devices::nvml_look) {
                let me = std::process::id();
                crate::devices::note_creation_drop(d, crate::devices::creation_cost(&b, &a, me));
            }
        }
        r
    };
    let r = create();
    if r != CUDA_ERROR_OUT_OF_MEMORY || pctx.is_null() {
        return r;
    }
    let Some(d) = d else {
        return r;
    };
    let r = retry_with_room(d, CONTEXT_ESTIMATE, false, "a context", r, create);
    if r == CUDA_SUCCESS {
        if let Some(turn) = client::global().and_then(|c| c.turn_for(d)) {
            // SAFETY: the driver just wrote the context through the caller's pointer.
            let counted = match crate::devices::context_cost(d, unsafe { *pctx }) {
                // No room for a twin to measure it by (the room made was for one
                // context): the estimate, never 0, or the arbiter would count room
                // that is not there.
                0 => {
                    crate::kinfo!(
                        "GPU {d}: counting the context's estimate, {} MiB, as memory no swap frees",
                        CONTEXT_ESTIMATE >> 20
                    );
                    CONTEXT_ESTIMATE
                }
                measured => measured,
            };
            turn.add_context_bytes(counted as i64);
            crate::devices::note_context_cost(d, counted);
            client::report_now(d);
        }
    }
    r
}

/// Runs `op` again — memory the shim cannot page (a context, a module load, the
/// application's own `cuMemCreate`) on device `d` whose first try, `first`, was the
/// driver's out of memory — once this process holds the GPU's turn and the arbiter
/// made room for `need` more bytes (`exact`: what it takes; else an estimate); as
/// the module docs say. Returns `op`'s last result (`first` when the process is not
/// managed).
pub(crate) fn retry_with_room(
    d: usize,
    need: u64,
    exact: bool,
    what: &str,
    first: CUresult,
    mut op: impl FnMut() -> CUresult,
) -> CUresult {
    if first != CUDA_ERROR_OUT_OF_MEMORY
        || client::global().is_none()
        || !client::allocator_enabled()
    {
        return first;
    }
    let Some(turn) = crate::devices::turn_for_room(d, need) else {
        return first;
    };
    if !turn.could_fit(need) {
        // Not even with every other process's memory swapped out: out of memory now
        // (an application that frees its cache and tries again, as PyTorch does, must
        // not wait for room that cannot come).
        turn.set_pending(0);
        client::report_now(d);
        return first;
    }
    // What it takes at least: its size, or more than the GPU had free when the
    // driver refused it (NVML counts without a context). Each refusal while room is
    // made raises that bound, to within the step the others' memory leaves by.
    let uuid = turn.info().uuid.clone();
    let mut least = if exact {
        Some(need)
    } else {
        nvml_free(&uuid).map(|free| free + 1)
    };
    if let Some(line) = least.and_then(|l| blocked_line(turn, d, what, l)) {
        crate::kerror!("{line}");
        turn.set_pending(0);
        client::report_now(d);
        return first;
    }
    crate::kinfo!(
        "GPU {d}: no room for {what} of {} MiB (others' memory is resident): waiting for this GPU's turn while the arbiter makes room",
        need >> 20
    );
    let started = Instant::now();
    let mut held = Duration::ZERO;
    let mut told: Option<Instant> = None;
    let result = loop {
        if let Err(e) = client::acquire(&crate::gate::GATE, Some(d)) {
            crate::kwarn!("GPU {d}: waiting for room for {what} failed (CUDA error {e})");
            break first;
        }
        let free_before = if exact { None } else { nvml_free(&uuid) };
        let tried = Instant::now();
        let r = op();
        if r != CUDA_ERROR_OUT_OF_MEMORY {
            break r;
        }
        // Free memory only grows while room is made; the lesser reading is the one
        // the refusal certainly saw.
        if let (Some(b), Some(a)) = (free_before, nvml_free(&uuid)) {
            least = Some(least.unwrap_or(0).max(b.min(a) + 1));
        }
        // Checked on every refusal: the others' figures change while it waits too.
        if let Some(line) = least.and_then(|l| blocked_line(turn, d, what, l)) {
            crate::kerror!("{line}");
            break r;
        }
        let now = Instant::now();
        if told.is_none_or(|t| now.duration_since(t) >= client::NO_ROOM_RESEND) {
            client::pending_short_of_room(d);
            told = Some(now);
        }
        std::thread::sleep(RETRY);
        held += tried.elapsed();
        if held >= HELD_LIMIT {
            crate::kerror!(
                "GPU {d}: no room for {what} after holding the GPU for {held:?}: memory no swap frees (other processes' contexts, or memory outside Kiwi) fills it; out of memory"
            );
            break r;
        }
    };
    // Said before the wait ends: the idle detector may release the turn after.
    if result == CUDA_SUCCESS {
        crate::kinfo!("GPU {d}: room made for {what} in {:?}", started.elapsed());
    }
    turn.set_pending(0);
    client::report_now(d);
    result
}

/// This process's free memory and its own allocator's resident bytes on device `d`,
/// read together under the allocator's lock: around a call, the drop in the first
/// less the growth of the second is what the call took (a swap of its own never
/// counts).
pub(crate) fn free_and_own(d: usize) -> Option<(u64, u64)> {
    let guard = mem_lock(d);
    let own = guard.as_ref().map_or(0, |m| m.figures().resident);
    free_memory().map(|f| (f, own))
}

/// The device memory the call between two [`free_and_own`] snapshots took (negative:
/// gave back).
pub(crate) fn took_between(before: Option<(u64, u64)>, after: Option<(u64, u64)>) -> i128 {
    match (before, after) {
        (Some((free0, own0)), Some((free1, own1))) => {
            i128::from(free0) - i128::from(free1) - (i128::from(own1) - i128::from(own0))
        }
        _ => 0,
    }
}

/// Code loaded at a launch, counted as memory no swap frees, by context: its
/// device and bytes (given back when the context is destroyed).
static LAUNCH_CODE: std::sync::Mutex<std::collections::BTreeMap<usize, (usize, u64)>> =
    std::sync::Mutex::new(std::collections::BTreeMap::new());

/// A launch (`name`, run by `launch`) that the driver refused with out of memory,
/// `first`: with lazy loading a `CUkernel`'s code is loaded into the context at its
/// first launch there (the driver accepts a kernel handle as a function), which
/// fails while others' memory fills the GPU, though it would not if the process were
/// alone. It waits for room as a module load does ([`retry_with_room`]), tried again
/// through the gate once this process holds the GPU; what the launch that works
/// took is counted as the context's memory no swap frees. Any other call's out of
/// memory is the application's.
#[cold]
#[inline(never)]
pub(crate) fn launch_out_of_memory(
    name: &str,
    first: CUresult,
    launch: &mut dyn FnMut() -> CUresult,
) -> CUresult {
    if first != CUDA_ERROR_OUT_OF_MEMORY || !name.starts_with("cuLaunch") {
        return first;
    }
    let Some(d) = crate::devices::current_mem_device() else {
        return first;
    };
    let Some(turn) = client::global().and_then(|c| c.turn_for(d)) else {
        return first;
    };
    let mut before = None;
    let r = retry_with_room(
        d,
        MODULE_ESTIMATE,
        false,
        "a kernel's code (loaded at its launch)",
        first,
        || {
            before = free_and_own(d);
            let gate = &crate::gate::GATE;
            if !(gate.try_enter() || gate.try_enter_device(d)) {
                // The turn went again before the try: wait for it again.
                return CUDA_ERROR_OUT_OF_MEMORY;
            }
            let r = launch();
            gate.exit();
            r
        },
    );
    if r == CUDA_SUCCESS {
        let bytes = u64::try_from(took_between(before, free_and_own(d)).max(0)).unwrap_or(0);
        if bytes > 0 {
            crate::kdebug!("GPU {d}: {name} loaded code of {bytes} bytes");
            turn.add_context_bytes(bytes as i64);
            let ctx = crate::devices::current_context() as usize;
            let mut m = LAUNCH_CODE.lock().unwrap_or_else(|p| p.into_inner());
            m.entry(ctx).or_insert((d, 0)).1 += bytes;
        }
    }
    r
}

/// Context `ctx` was destroyed: the code its launches loaded is no longer counted.
pub(crate) fn context_destroyed(ctx: usize) {
    let gone = LAUNCH_CODE
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .remove(&ctx);
    if let Some((d, bytes)) = gone {
        if let Some(t) = client::global().and_then(|c| c.turn_for(d)) {
            t.add_context_bytes(-(bytes as i64));
        }
    }
}

/// Why memory no swap frees, at least `least` bytes of it, for `what` on device `d`
/// must not be made (issue #24, "no silent livelock"): it would leave another
/// client's working set no room, ever, beside every process's memory no swap frees,
/// on a GPU whose arbiter cannot evict whole processes ([`client::Turn::would_block`]).
/// The creation fails with the driver's out of memory, as it would where that
/// working set were resident, and this line says whose and how much.
fn blocked_line(turn: &client::Turn, d: usize, what: &str, least: u64) -> Option<String> {
    let (name, working_set, fixed) = turn.would_block(least)?;
    Some(blocked_text(
        turn,
        d,
        what,
        least,
        &name,
        working_set,
        fixed,
    ))
}

/// The same for memory already made and counted (`made` bytes of it): it is given
/// back and the creation fails.
fn blocked_after(turn: &client::Turn, d: usize, what: &str, made: u64) -> Option<String> {
    let (name, working_set, fixed) = turn.would_block(0)?;
    Some(blocked_text(turn, d, what, made, &name, working_set, fixed))
}

fn blocked_text(
    turn: &client::Turn,
    d: usize,
    what: &str,
    least: u64,
    name: &str,
    working_set: u64,
    fixed: u64,
) -> String {
    format!(
        "GPU {d}: out of memory for {what} (at least {} MiB that no swap frees): with it, memory no swap frees (contexts, modules: {} MiB of the GPU's {} MiB) would leave too little for {name}'s working set of {} MiB, which could then never be resident again; this arbiter cannot evict whole idle processes (no checkpoint API)",
        least.div_ceil(1 << 20),
        fixed >> 20,
        turn.info().total_memory >> 20,
        working_set >> 20,
    )
}

/// How a context the driver just made is taken back when keeping it would block
/// another client's working set ([`context_created`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Undo {
    /// `cuCtxCreate`: `cuCtxDestroy` (which also pops it from the thread's stack).
    Destroy,
    /// `cuDevicePrimaryCtxRetain`: the reference is released and the primary context
    /// reset (its memory given back; the driver frees it at the last release too).
    ReleasePrimary,
    /// The runtime's primary context (taken without a reference): reset.
    ResetPrimary,
}

impl Undo {
    fn run(self, ctx: CUcontext, dev: CUdevice) {
        type OnDevice = unsafe extern "C" fn(CUdevice) -> CUresult;
        type OnContext = unsafe extern "C" fn(CUcontext) -> CUresult;
        let device_call = |name: &std::ffi::CStr| {
            let f = crate::real::lookup(name);
            if !f.is_null() {
                // SAFETY: the driver's function of this name, `(CUdevice) -> CUresult`
                // as cuda.h declares it.
                let f = unsafe { std::mem::transmute::<*mut c_void, OnDevice>(f) };
                // SAFETY: a device ordinal the driver just made a context on.
                crate::ffi::inside(|| unsafe { f(dev) });
            }
        };
        match self {
            Undo::Destroy => {
                let f = crate::real::lookup(c"cuCtxDestroy_v2");
                if !f.is_null() {
                    // SAFETY: the driver's cuCtxDestroy_v2, with cuda.h's signature.
                    let f = unsafe { std::mem::transmute::<*mut c_void, OnContext>(f) };
                    // SAFETY: the context the driver just made for this call, which
                    // the application has not seen.
                    crate::ffi::inside(|| unsafe { f(ctx) });
                }
            }
            Undo::ReleasePrimary => {
                device_call(c"cuDevicePrimaryCtxRelease_v2");
                device_call(c"cuDevicePrimaryCtxReset_v2");
            }
            Undo::ResetPrimary => device_call(c"cuDevicePrimaryCtxReset_v2"),
        }
    }
}

/// Memory no swap frees that the driver made at once (`what`, `made` bytes of it,
/// counted already, on device `d`: the driver did not refuse it, so
/// [`retry_with_room`] never looked): if it leaves another client's working set no
/// room, ever ([`blocked_after`]), it is taken back (`undo`), its count given back,
/// the line said, and true returned: the caller fails with the driver's out of
/// memory, as a refused creation does.
pub(crate) fn taken_back_if_blocking(d: usize, what: &str, made: u64, undo: impl FnOnce()) -> bool {
    let Some(turn) = client::global().and_then(|c| c.turn_for(d)) else {
        return false;
    };
    let Some(line) = blocked_after(turn, d, what, made) else {
        return false;
    };
    crate::kerror!("{line}");
    undo();
    turn.add_context_bytes(-(made as i64));
    client::report_now(d);
    true
}

/// The memory no swap frees counted for this process on `dev` now (0 without a
/// turn there): [`context_created`] takes what a creation added from it.
pub(crate) fn counted_now(dev: CUdevice) -> u64 {
    usize::try_from(dev)
        .ok()
        .filter(|&d| d < MAX_DEVICES)
        .and_then(|d| client::global().and_then(|c| c.turn_for(d)))
        .map_or(0, |t| t.context_bytes())
}

/// After the driver made a context on `dev`: the device gets its allocator and turn,
/// so no work on it runs before the process holds it. The process's first context
/// there, made at once while another client's memory was partly swapped out (the
/// driver did not refuse it, so [`retry_with_room`] never looked), is checked as a
/// refused one is: if it leaves another client's working set no room, ever
/// ([`blocked_after`]), it is taken back (`undo`), its count (what it added to
/// `before`) given back, and the creation fails with the driver's out of memory and
/// the line.
pub(crate) fn context_created(
    r: CUresult,
    pctx: *mut CUcontext,
    dev: CUdevice,
    before: u64,
    undo: Undo,
) -> CUresult {
    if r != CUDA_SUCCESS {
        return r;
    }
    let Some(d) = usize::try_from(dev).ok().filter(|&d| d < MAX_DEVICES) else {
        return r;
    };
    let ctx = if pctx.is_null() {
        std::ptr::null_mut()
    } else {
        // SAFETY: the driver just wrote the context through the caller's pointer.
        unsafe { *pctx }
    };
    let first = crate::devices::APP_CTX[d].load(Ordering::Acquire).is_null();
    crate::devices::ensure_device(d, ctx);
    if first && !ctx.is_null() {
        let made = counted_now(dev).saturating_sub(before);
        if taken_back_if_blocking(d, "a context", made, || undo.run(ctx, dev)) {
            crate::devices::APP_CTX[d].store(std::ptr::null_mut(), Ordering::Release);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
    }
    // The newest context is the one the shim's threads swap and drain in: an
    // earlier one may have been destroyed (`cuCtxDestroy`) or reset since. Drains
    // wait for every live one.
    if !ctx.is_null() {
        let previous = crate::devices::APP_CTX[d].swap(ctx, Ordering::AcqRel);
        // A further context costs what the first did; one that leaves another
        // client's working set no room, ever, is taken back as the first would be.
        let extra = crate::devices::context_made(d, ctx);
        if extra > 0 && taken_back_if_blocking(d, "a context", extra, || undo.run(ctx, dev)) {
            crate::devices::context_destroyed(ctx, false);
            let _ = crate::devices::APP_CTX[d].compare_exchange(
                ctx,
                previous,
                Ordering::AcqRel,
                Ordering::Acquire,
            );
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
    }
    r
}

/// The `CUDART_INTERFACE` export table's id (`6bd5fb6c-5bf4-e74a-8987-d93912fd9df9`).
const CUDART_INTERFACE: [u8; 16] = [
    0x6b, 0xd5, 0xfb, 0x6c, 0x5b, 0xf4, 0xe7, 0x4a, 0x89, 0x87, 0xd9, 0x39, 0x12, 0xfd, 0x9d, 0xf9,
];
/// The table's slot the runtime makes its primary context through: `(CUcontext*,
/// CUdevice) -> CUresult`, without taking a reference (ZLUDA's `dark_api`).
const PRIMARY_SLOT: usize = 2;
/// The driver's function of that slot, before the patch (0: not patched).
static PRIMARY_ORIGINAL: AtomicUsize = AtomicUsize::new(0);

/// `cuGetExportTable`: the driver's answer; the `CUDART_INTERFACE` table's primary
/// context slot is patched, once, to go through [`create_context`].
///
/// # Safety
/// `real` is the driver's original of this entry point; the other arguments are the
/// application's, valid as `cuda.h` documents them.
pub unsafe fn get_export_table(
    real: unsafe extern "C" fn(*mut *const c_void, *const CUuuid) -> CUresult,
    table: *mut *const c_void,
    id: *const CUuuid,
) -> CUresult {
    // SAFETY: forwarding the caller's arguments.
    let r = unsafe { real(table, id) };
    if r != CUDA_SUCCESS || table.is_null() || id.is_null() {
        return r;
    }
    // SAFETY: the caller's id, valid as cuda.h says; the table the driver just wrote.
    let (uuid, start) = unsafe { ((*id).bytes, *table as *mut usize) };
    if uuid != CUDART_INTERFACE || start.is_null() {
        return r;
    }
    patch_primary_slot(start);
    r
}

/// Points slot [`PRIMARY_SLOT`] of the table at `start` (its slot 0: its size in
/// bytes) at [`primary_context`], keeping the driver's function. Leaves the table as
/// it is when it looks different from what the runtime 12.x gets, or its page cannot
/// be made writable.
fn patch_primary_slot(start: *mut usize) {
    let ours = primary_context as *const () as usize;
    // SAFETY: the driver's table: slot 0 holds its size in bytes (every CUDART_INTERFACE
    // table the runtime 12.x uses), read before any other slot.
    let size = unsafe { start.read() };
    let word = std::mem::size_of::<usize>();
    if !(((PRIMARY_SLOT + 1) * word)..=4096).contains(&size) {
        crate::kdebug!("CUDART_INTERFACE table of {size} bytes: not patched");
        return;
    }
    // SAFETY: within the table's size, checked above.
    let slot = unsafe { start.add(PRIMARY_SLOT) };
    // SAFETY: as above.
    let current = unsafe { slot.read() };
    if current == ours || current == 0 {
        return;
    }
    if PRIMARY_ORIGINAL
        .compare_exchange(0, current, Ordering::AcqRel, Ordering::Acquire)
        .is_err_and(|was| was != current)
    {
        crate::kdebug!("a second CUDART_INTERFACE table with another function: not patched");
        return;
    }
    if let Err(e) = write_word(slot, ours) {
        crate::kdebug!(
            "cannot patch the CUDART_INTERFACE table ({e}): contexts it makes do not wait for room"
        );
    }
}

/// Writes `value` at `at`, in a page that may be read-only (the driver's relocated
/// tables): it is made writable for the write and given its protection back.
fn write_word(at: *mut usize, value: usize) -> std::io::Result<()> {
    let prot = protection_of(at as usize)?;
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as usize;
    let base = (at as usize) & !(page - 1);
    let writable = prot & libc::PROT_WRITE != 0;
    if !writable {
        // SAFETY: one page of a mapping of this process (found in /proc/self/maps),
        // given read and write for one aligned word store.
        if unsafe { libc::mprotect(base as *mut c_void, page, prot | libc::PROT_WRITE) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    // SAFETY: an aligned slot of the table, writable now; the runtime reads the
    // table only after cuGetExportTable returns.
    unsafe { std::ptr::write_volatile(at, value) };
    if !writable {
        // SAFETY: as above, the page's own protection back.
        unsafe { libc::mprotect(base as *mut c_void, page, prot) };
    }
    Ok(())
}

/// The protection (`PROT_*`) of the mapping holding `addr`, from `/proc/self/maps`.
fn protection_of(addr: usize) -> std::io::Result<i32> {
    let maps = std::fs::read_to_string("/proc/self/maps")?;
    for line in maps.lines() {
        let mut f = line.split_whitespace();
        let (Some(range), Some(perms)) = (f.next(), f.next()) else {
            continue;
        };
        let Some((lo, hi)) = range.split_once('-') else {
            continue;
        };
        let (Ok(lo), Ok(hi)) = (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16))
        else {
            continue;
        };
        if (lo..hi).contains(&addr) {
            let p = perms.as_bytes();
            let mut prot = 0;
            if p.first() == Some(&b'r') {
                prot |= libc::PROT_READ;
            }
            if p.get(1) == Some(&b'w') {
                prot |= libc::PROT_WRITE;
            }
            if p.get(2) == Some(&b'x') {
                prot |= libc::PROT_EXEC;
            }
            return Ok(prot);
        }
    }
    Err(std::io::Error::other("address not mapped"))
}

/// The patched slot: the driver's function through [`create_context`], then the
/// device's allocator and turn as for every context.
extern "C" fn primary_context(pctx: *mut CUcontext, dev: CUdevice) -> CUresult {
    let f = PRIMARY_ORIGINAL.load(Ordering::Acquire);
    if f == 0 {
        return CUDA_ERROR_NOT_INITIALIZED;
    }
    // SAFETY: the driver's function of this slot, saved by the patch: `(CUcontext*,
    // CUdevice) -> CUresult`.
    let real = unsafe {
        std::mem::transmute::<usize, unsafe extern "C" fn(*mut CUcontext, CUdevice) -> CUresult>(f)
    };
    if crate::ffi::reentered() {
        // SAFETY: the driver calling itself: forwarded unchanged.
        return unsafe { real(pctx, dev) };
    }
    crate::ffi::guarded("CUDART_INTERFACE primary context", || {
        let before = counted_now(dev);
        // SAFETY: forwarding the runtime's arguments.
        let r = create_context(dev, pctx, || unsafe { real(pctx, dev) });
        context_created(r, pctx, dev, before, Undo::ResetPrimary)
    })
}
