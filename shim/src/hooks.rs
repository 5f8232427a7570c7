//! The bodies of the `hook` exports: `cuInit` (start the client), context creation
//! (a device's allocator and turn), allocation (served by [`crate::mem`] through the
//! per-device state of [`crate::devices`]), module loads and memory info. The
//! application's own VMM handles are [`crate::appvmm`]'s.

use std::ffi::{c_char, c_int, c_void};
use std::ptr::null_mut;
use std::sync::atomic::Ordering;
use std::sync::{Mutex, MutexGuard};

use crate::client;
use crate::cuda::*;
use crate::devices::{
    current_context, current_device, current_mem_device, mem_lock, seen_devices, with_owner,
    FREE_STREAM,
};
use crate::real::call_real as call;
use crate::real::original_of;
use crate::room::{self, free_and_own, took_between};
use crate::symbols::Sym;

// ---------------------------------------------------------------------------------
// Hooks. Each receives the original and the caller's arguments.

type Real<A> = A;

/// `cuInit`: the real one first, then (once) the client.
/// # Safety
/// `real` is the driver's original of this entry point; the other arguments are the
/// application's, valid as `cuda.h` documents them.
pub unsafe fn init(real: Real<unsafe extern "C" fn(Uint) -> CUresult>, flags: Uint) -> CUresult {
    // SAFETY: forwarding the caller's argument.
    let r = unsafe { real(flags) };
    if r != CUDA_SUCCESS {
        return r;
    }
    client::on_init(|| {
        let mut n: c_int = 0;
        call!(cuDeviceGetCount: fn(*mut c_int)(&mut n))?;
        if n > 0 {
            Ok(())
        } else {
            Err(CUDA_ERROR_NO_DEVICE)
        }
    })
}

/// A context creation on `dev` writing through `pctx`: it waits for room when the GPU
/// is full of others' memory ([`crate::room`]), then the device gets its allocator and
/// turn.
fn made(
    dev: CUdevice,
    pctx: *mut CUcontext,
    undo: room::Undo,
    create: impl FnMut() -> CUresult,
) -> CUresult {
    let before = room::counted_now(dev);
    let r = room::create_context(dev, pctx, create);
    room::context_created(r, pctx, dev, before, undo)
}

/// # Safety
/// `real` is the driver's original of this entry point; the other arguments are the
/// application's, valid as `cuda.h` documents them.
pub unsafe fn primary_ctx_retain(
    real: Real<unsafe extern "C" fn(*mut CUcontext, CUdevice) -> CUresult>,
    pctx: *mut CUcontext,
    dev: CUdevice,
) -> CUresult {
    // SAFETY: forwarding the caller's arguments.
    made(dev, pctx, room::Undo::ReleasePrimary, || unsafe {
        real(pctx, dev)
    })
}

/// # Safety
/// `real` is the driver's original of this entry point; the other arguments are the
/// application's, valid as `cuda.h` documents them.
pub unsafe fn ctx_create_v2(
    real: Real<unsafe extern "C" fn(*mut CUcontext, Uint, CUdevice) -> CUresult>,
    pctx: *mut CUcontext,
    flags: Uint,
    dev: CUdevice,
) -> CUresult {
    // SAFETY: forwarding the caller's arguments.
    made(dev, pctx, room::Undo::Destroy, || unsafe {
        real(pctx, flags, dev)
    })
}

/// # Safety
/// `real` is the driver's original of this entry point; the other arguments are the
/// application's, valid as `cuda.h` documents them.
pub unsafe fn ctx_create_v3(
    real: Real<unsafe extern "C" fn(*mut CUcontext, Opaque, c_int, Uint, CUdevice) -> CUresult>,
    pctx: *mut CUcontext,
    params: Opaque,
    num_params: c_int,
    flags: Uint,
    dev: CUdevice,
) -> CUresult {
    // SAFETY: forwarding the caller's arguments.
    made(dev, pctx, room::Undo::Destroy, || unsafe {
        real(pctx, params, num_params, flags, dev)
    })
}

/// # Safety
/// `real` is the driver's original of this entry point; the other arguments are the
/// application's, valid as `cuda.h` documents them.
pub unsafe fn ctx_create_v4(
    real: Real<unsafe extern "C" fn(*mut CUcontext, Opaque, Uint, CUdevice) -> CUresult>,
    pctx: *mut CUcontext,
    params: Opaque,
    flags: Uint,
    dev: CUdevice,
) -> CUresult {
    // SAFETY: forwarding the caller's arguments.
    made(dev, pctx, room::Undo::Destroy, || unsafe {
        real(pctx, params, flags, dev)
    })
}

// ---------------------------------------------------------------------------------
// Modules: their code and constants take device memory no swap frees.

/// What a module was counted: its device, its bytes, and the context it was loaded
/// into (destroying that context unloads it).
#[derive(Clone, Copy)]
struct Counted {
    device: usize,
    bytes: u64,
    ctx: usize,
    /// Its lazily loaded code was measured (a `cuModuleGetFunction` took memory):
    /// later ones are not, as each measurement can count another process's
    /// allocation made in the same moment, and the driver loads a module's other
    /// kernels into the memory its first took (2 MiB pages) where they fit.
    code: bool,
    /// The library it belongs to (0: none): a library's module in a context
    /// (`cuLibraryGetModule`) or a kernel's function (`cuKernelGetFunction`) is
    /// given back when the library is unloaded.
    library: usize,
}

/// Each kernel handle's library (`cuLibraryGetKernel`), so what its function's
/// code took is given back with the library.
static KERNELS: Mutex<std::collections::BTreeMap<usize, usize>> =
    Mutex::new(std::collections::BTreeMap::new());

fn kernels() -> MutexGuard<'static, std::collections::BTreeMap<usize, usize>> {
    KERNELS.lock().unwrap_or_else(|p| p.into_inner())
}

/// Each loaded module or library the shim counted, by handle, so an unload (or its
/// context's destruction) gives back exactly what its load added.
static MODULES: Mutex<std::collections::BTreeMap<usize, Counted>> =
    Mutex::new(std::collections::BTreeMap::new());

fn modules() -> MutexGuard<'static, std::collections::BTreeMap<usize, Counted>> {
    MODULES.lock().unwrap_or_else(|p| p.into_inner())
}

/// Bytes each context's limits were counted, and on which device, by (context,
/// `CUlimit`): a later value replaces the earlier one's count.
static LIMITS: Mutex<std::collections::BTreeMap<(usize, c_int), (usize, u64)>> =
    Mutex::new(std::collections::BTreeMap::new());

/// `CU_LIMIT_STACK_SIZE`: bytes per resident thread.
const CU_LIMIT_STACK_SIZE: c_int = 0;

/// The device memory `value` of `limit` may take, to ask room for: a stack size is
/// per resident thread (SMs × threads per SM, as the device reports them); the FIFO
/// and heap sizes are bytes.
fn limit_estimate(limit: c_int, value: usize) -> u64 {
    if limit != CU_LIMIT_STACK_SIZE {
        return value as u64;
    }
    let mut dev: CUdevice = 0;
    let (mut sms, mut threads): (c_int, c_int) = (0, 0);
    if call!(cuCtxGetDevice: fn(*mut CUdevice)(&mut dev)).is_ok() {
        // CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, _MAX_THREADS_PER_MULTIPROCESSOR.
        let _ = call!(cuDeviceGetAttribute: fn(*mut c_int, c_int, CUdevice)(&mut sms, 16, dev));
        let _ = call!(cuDeviceGetAttribute: fn(*mut c_int, c_int, CUdevice)(&mut threads, 39, dev));
    }
    (value as u64)
        .saturating_mul(sms.max(1) as u64)
        .saturating_mul(threads.max(1) as u64)
}

/// `cuCtxSetLimit`: a stack, printf FIFO or malloc heap size takes device memory the
/// driver reserves at once (out of memory when it does not fit). That memory is
/// counted as this process's memory no swap frees, replacing the count of the
/// limit's earlier value; an out of memory because others' memory is resident
/// waits for room as a module load does ([`room::retry_with_room`]).
///
/// # Safety
/// `real` is the driver's original of this entry point.
pub unsafe fn ctx_set_limit(
    real: Real<unsafe extern "C" fn(c_int, usize) -> CUresult>,
    limit: c_int,
    value: usize,
) -> CUresult {
    let target = current_mem_device()
        .and_then(|d| client::global().and_then(|c| c.turn_for(d)).map(|t| (d, t)));
    let Some((d, turn)) = target else {
        // SAFETY: forwarding the caller's arguments.
        return unsafe { real(limit, value) };
    };
    let mut before = free_and_own(d);
    // SAFETY: forwarding the caller's arguments.
    let mut r = unsafe { real(limit, value) };
    if r == CUDA_ERROR_OUT_OF_MEMORY {
        let need = limit_estimate(limit, value);
        r = room::retry_with_room(d, need, false, "a context limit", r, || {
            before = free_and_own(d);
            // SAFETY: as above.
            unsafe { real(limit, value) }
        });
    }
    if r != CUDA_SUCCESS {
        return r;
    }
    let took = took_between(before, free_and_own(d));
    let key = (current_context() as usize, limit);
    let mut counted = LIMITS.lock().unwrap_or_else(|p| p.into_inner());
    let old = counted.get(&key).map_or(0, |&(_, b)| b);
    let new = u64::try_from((i128::from(old) + took).max(0)).unwrap_or(0);
    if new != old {
        crate::kdebug!("GPU {d}: limit {limit} = {value} takes {new} bytes of device memory");
        turn.add_context_bytes(new as i64 - old as i64);
    }
    if new == 0 {
        counted.remove(&key);
    } else {
        counted.insert(key, (d, new));
    }
    r
}

/// Runs `op`, a call that may take device memory no swap frees in the calling
/// thread's current context (`what`: a module load, or the lazy load of a module's
/// code), and counts what it took as the process's memory no swap frees on that GPU
/// (reported to the arbiter with the contexts' memory): the drop in free memory
/// around the call, less what this process's own allocator mapped or unmapped
/// meanwhile (both read under the allocator's lock, so a swap of its own never
/// counts). Other processes allocating or freeing during the call can still move the
/// figure; a negative one counts 0. An out of memory because others' memory is
/// resident waits for room ([`room::retry_with_room`]). Returns the result and, on
/// success in a managed process, the device and the bytes counted.
fn counted(what: &str, mut op: impl FnMut() -> CUresult) -> (CUresult, Option<(usize, u64)>) {
    let target = current_mem_device()
        .and_then(|d| client::global().and_then(|c| c.turn_for(d)).map(|t| (d, t)));
    let Some((d, turn)) = target else {
        return (op(), None);
    };
    let snapshot = || free_and_own(d);
    let mut before = snapshot();
    let mut r = op();
    if r == CUDA_ERROR_OUT_OF_MEMORY {
        // The GPU is full of others' memory: wait for room, measuring around the try
        // that works.
        r = room::retry_with_room(d, room::MODULE_ESTIMATE, false, what, r, || {
            before = snapshot();
            op()
        });
    }
    if r != CUDA_SUCCESS {
        return (r, None);
    }
    let bytes = u64::try_from(took_between(before, snapshot()).max(0)).unwrap_or(0);
    if bytes > 0 {
        crate::kdebug!("GPU {d}: {what} took {bytes} bytes of device memory");
        turn.add_context_bytes(bytes as i64);
    }
    (r, Some((d, bytes)))
}

/// Runs `load`, a module or library load into the calling thread's current context
/// that writes its handle through `handle`, counting the device memory it took
/// ([`counted`]) until it is unloaded.
fn counted_load(handle: *mut *mut c_void, load: impl FnMut() -> CUresult) -> CUresult {
    let (r, took) = counted("a module", load);
    if let Some((d, bytes)) = took.filter(|_| !handle.is_null()) {
        // SAFETY: the driver just wrote the handle through the caller's pointer.
        let h = unsafe { *handle } as usize;
        let ctx = current_context() as usize;
        modules().insert(
            h,
            Counted {
                device: d,
                bytes,
                ctx,
                code: false,
                library: 0,
            },
        );
    }
    r
}

/// Whether the driver loads modules lazily (`cuModuleGetLoadingMode`, the default
/// since CUDA 12.2 unless `CUDA_MODULE_LOADING=EAGER`): a module's kernels are then
/// loaded, and take device memory, at its first `cuModuleGetFunction`. Asked once.
fn lazy_loading() -> bool {
    static LAZY: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *LAZY.get_or_init(|| {
        let f = crate::real::lookup(c"cuModuleGetLoadingMode");
        if f.is_null() {
            return false;
        }
        // SAFETY: the driver's cuModuleGetLoadingMode, with cuda.h's signature.
        let f = unsafe {
            std::mem::transmute::<*mut c_void, unsafe extern "C" fn(*mut c_int) -> CUresult>(f)
        };
        let mut mode: c_int = 0;
        // SAFETY: a valid out pointer; CU_MODULE_LAZY_LOADING is 2.
        crate::ffi::inside(|| unsafe { f(&mut mode) }) == CUDA_SUCCESS && mode == 2
    })
}

/// `cuModuleGetFunction`: with lazy loading, the first for a module (or kernel)
/// loads its code, taking device memory no swap frees: counted with the module's
/// load (given back at its unload) until one took some ([`Counted::code`]), and
/// waiting for room like a module load whenever the GPU is full of others' memory.
/// Eager loading took it all at the load.
///
/// # Safety
/// `real` is the driver's original of this entry point; the other arguments are the
/// application's, valid as `cuda.h` documents them.
pub unsafe fn module_get_function(
    real: Real<unsafe extern "C" fn(*mut *mut c_void, *mut c_void, *const c_char) -> CUresult>,
    func: *mut *mut c_void,
    module: *mut c_void,
    name: *const c_char,
) -> CUresult {
    // SAFETY: forwarding the caller's arguments.
    code_loaded(module as usize, 0, || unsafe { real(func, module, name) })
}

/// Runs `get`, a call that may load code lazily into the current context (a
/// module's first function, a library's module there, a kernel's function), where
/// the driver loads lazily: what it takes is counted under `key` (with `library`,
/// given back when that is unloaded) until some was ([`Counted::code`]), and an out
/// of memory waits for room like a module load, whenever it comes.
fn code_loaded(key: usize, library: usize, mut get: impl FnMut() -> CUresult) -> CUresult {
    if !lazy_loading() {
        return get();
    }
    if modules().get(&key).is_some_and(|c| c.code) {
        let r = get();
        if r != CUDA_ERROR_OUT_OF_MEMORY {
            return r;
        }
        // More code that does not fit: it waits for room (and is measured) below.
    }
    let (r, took) = counted("a module's code (loaded lazily)", get);
    if let Some((d, bytes)) = took {
        let ctx = current_context() as usize;
        let mut m = modules();
        let c = m.entry(key).or_insert(Counted {
            device: d,
            bytes: 0,
            ctx,
            code: false,
            library,
        });
        c.bytes += bytes;
        c.code |= bytes > 0;
        if c.library == 0 {
            c.library = library;
        }
        if c.bytes == 0 && c.library == 0 {
            m.remove(&key);
        }
    }
    r
}

/// `cuLibraryGetModule`: the library's module in the current context, which loads
/// its code there (eagerly now, or lazily at the module's first function):
/// counted as the module's, and given back when the library is unloaded.
///
/// # Safety
/// `real` is the driver's original of this entry point; the other arguments are the
/// application's, valid as `cuda.h` documents them.
pub unsafe fn library_get_module(
    real: Real<unsafe extern "C" fn(*mut *mut c_void, *mut c_void) -> CUresult>,
    module: *mut *mut c_void,
    library: *mut c_void,
) -> CUresult {
    // SAFETY: forwarding the caller's arguments.
    let (r, took) = counted("a library's code", || unsafe { real(module, library) });
    if let Some((d, bytes)) = took.filter(|_| !module.is_null()) {
        // SAFETY: the driver just wrote the module through the caller's pointer.
        let h = unsafe { *module } as usize;
        let ctx = current_context() as usize;
        let mut m = modules();
        let c = m.entry(h).or_insert(Counted {
            device: d,
            bytes: 0,
            ctx,
            code: false,
            library: library as usize,
        });
        c.bytes += bytes;
        c.library = library as usize;
    }
    r
}

/// `cuLibraryGetKernel`: which library the kernel is of, so its functions' code is
/// given back with it.
///
/// # Safety
/// `real` is the driver's original of this entry point; the other arguments are the
/// application's, valid as `cuda.h` documents them.
pub unsafe fn library_get_kernel(
    real: Real<unsafe extern "C" fn(*mut *mut c_void, *mut c_void, *const c_char) -> CUresult>,
    kernel: *mut *mut c_void,
    library: *mut c_void,
    name: *const c_char,
) -> CUresult {
    // SAFETY: forwarding the caller's arguments.
    let r = unsafe { real(kernel, library, name) };
    if r == CUDA_SUCCESS && !kernel.is_null() {
        // SAFETY: the driver just wrote the kernel through the caller's pointer.
        let k = unsafe { *kernel } as usize;
        kernels().insert(k, library as usize);
    }
    r
}

/// `cuKernelGetFunction`: the kernel's function in the current context, whose code
/// is loaded there now with lazy loading ([`code_loaded`], under the function).
///
/// # Safety
/// `real` is the driver's original of this entry point; the other arguments are the
/// application's, valid as `cuda.h` documents them.
pub unsafe fn kernel_get_function(
    real: Real<unsafe extern "C" fn(*mut *mut c_void, *mut c_void) -> CUresult>,
    func: *mut *mut c_void,
    kernel: *mut c_void,
) -> CUresult {
    let library = kernels().get(&(kernel as usize)).copied().unwrap_or(0);
    // Counted under the kernel and context (the function is known only after),
    // with the top bit set, which no handle has (user-space addresses).
    let key = (kernel as usize ^ current_context() as usize) | (1 << (usize::BITS - 1));
    // SAFETY: forwarding the caller's arguments.
    code_loaded(key, library, || unsafe { real(func, kernel) })
}

/// `cuLibraryUnload`: gives back what the library's load, its modules in every
/// context and its kernels' code were counted.
///
/// # Safety
/// `real` is the driver's original of this entry point; `library` is the
/// application's.
pub unsafe fn library_unload(
    real: Real<unsafe extern "C" fn(*mut c_void) -> CUresult>,
    library: *mut c_void,
) -> CUresult {
    // SAFETY: forwarding the caller's argument.
    let r = unsafe { real(library) };
    if r != CUDA_SUCCESS {
        return r;
    }
    let lib = library as usize;
    let gone: Vec<Counted> = {
        let mut m = modules();
        let gone = m
            .iter()
            .filter(|(&h, c)| h == lib || c.library == lib)
            .map(|(_, c)| *c)
            .collect();
        m.retain(|&h, c| h != lib && c.library != lib);
        gone
    };
    kernels().retain(|_, l| *l != lib);
    for c in gone {
        give_back(c.device, c.bytes);
    }
    r
}

/// Runs `unload` of module or library `h`; on success gives back what its load was
/// counted.
fn counted_unload(h: *mut c_void, unload: impl FnOnce() -> CUresult) -> CUresult {
    let r = unload();
    if r == CUDA_SUCCESS {
        if let Some(m) = modules().remove(&(h as usize)) {
            give_back(m.device, m.bytes);
        }
    }
    r
}

/// Gives back `bytes` counted as memory no swap frees on device `d`.
fn give_back(d: usize, bytes: u64) {
    if bytes == 0 {
        return;
    }
    if let Some(t) = client::global().and_then(|c| c.turn_for(d)) {
        t.add_context_bytes(-(bytes as i64));
    }
}

/// `cuCtxDestroy_v2`: the driver unloads the context's modules and frees what its
/// limits reserved, so what they were counted is given back. (The context's own
/// cost stays counted: the shim swaps through the primary context where the
/// application has no other; `docs/shim.md`, Limits.)
///
/// # Safety
/// `real` is the driver's original of this entry point; `ctx` is the application's.
pub unsafe fn ctx_destroy(
    real: Real<unsafe extern "C" fn(CUcontext) -> CUresult>,
    ctx: CUcontext,
) -> CUresult {
    // SAFETY: forwarding the caller's argument.
    let r = unsafe { real(ctx) };
    if r != CUDA_SUCCESS || ctx.is_null() {
        return r;
    }
    let key = ctx as usize;
    let gone: Vec<Counted> = {
        let mut m = modules();
        let gone = m.values().filter(|c| c.ctx == key).copied().collect();
        m.retain(|_, c| c.ctx != key);
        gone
    };
    for c in gone {
        give_back(c.device, c.bytes);
    }
    let limits: Vec<(usize, u64)> = {
        let mut l = LIMITS.lock().unwrap_or_else(|p| p.into_inner());
        let gone = l
            .iter()
            .filter(|((c, _), _)| *c == key)
            .map(|(_, &v)| v)
            .collect();
        l.retain(|(c, _), _| *c != key);
        gone
    };
    for (d, bytes) in limits {
        give_back(d, bytes);
    }
    room::context_destroyed(key);
    r
}

/// # Safety
/// `real` is the driver's original of this entry point; the other arguments are the
/// application's, valid as `cuda.h` documents them.
pub unsafe fn module_load(
    real: Real<unsafe extern "C" fn(*mut *mut c_void, *const c_char) -> CUresult>,
    module: *mut *mut c_void,
    fname: *const c_char,
) -> CUresult {
    // SAFETY: forwarding the caller's arguments.
    counted_load(module, || unsafe { real(module, fname) })
}

/// `cuModuleLoadData` and `cuModuleLoadFatBinary`.
/// # Safety
/// `real` is the driver's original of this entry point; the other arguments are the
/// application's, valid as `cuda.h` documents them.
pub unsafe fn module_load_data(
    real: Real<unsafe extern "C" fn(*mut *mut c_void, *const c_void) -> CUresult>,
    module: *mut *mut c_void,
    image: *const c_void,
) -> CUresult {
    // SAFETY: forwarding the caller's arguments.
    counted_load(module, || unsafe { real(module, image) })
}

/// # Safety
/// `real` is the driver's original of this entry point; the other arguments are the
/// application's, valid as `cuda.h` documents them.
pub unsafe fn module_load_data_ex(
    real: Real<
        unsafe extern "C" fn(
            *mut *mut c_void,
            *const c_void,
            Uint,
            *mut c_int,
            *mut *mut c_void,
        ) -> CUresult,
    >,
    module: *mut *mut c_void,
    image: *const c_void,
    n: Uint,
    options: *mut c_int,
    values: *mut *mut c_void,
) -> CUresult {
    // SAFETY: forwarding the caller's arguments.
    counted_load(module, || unsafe {
        real(module, image, n, options, values)
    })
}

/// `cuModuleUnload` and `cuLibraryUnload`.
/// # Safety
/// `real` is the driver's original of this entry point; the other arguments are the
/// application's, valid as `cuda.h` documents them.
pub unsafe fn module_unload(
    real: Real<unsafe extern "C" fn(*mut c_void) -> CUresult>,
    module: *mut c_void,
) -> CUresult {
    // SAFETY: forwarding the caller's argument.
    counted_unload(module, || unsafe { real(module) })
}

/// `cuLibraryLoadData` (`code`: an image) and `cuLibraryLoadFromFile` (`code`: a
/// file name).
/// # Safety
/// `real` is the driver's original of this entry point; the other arguments are the
/// application's, valid as `cuda.h` documents them.
#[allow(clippy::too_many_arguments)] // cuda.h's signature
pub unsafe fn library_load(
    real: Real<
        unsafe extern "C" fn(
            *mut *mut c_void,
            *const c_void,
            *mut c_int,
            *mut *mut c_void,
            Uint,
            *mut c_int,
            *mut *mut c_void,
            Uint,
        ) -> CUresult,
    >,
    library: *mut *mut c_void,
    code: *const c_void,
    jit_options: *mut c_int,
    jit_values: *mut *mut c_void,
    n_jit: Uint,
    lib_options: *mut c_int,
    lib_values: *mut *mut c_void,
    n_lib: Uint,
) -> CUresult {
    // SAFETY: forwarding the caller's arguments.
    counted_load(library, || unsafe {
        real(
            library,
            code,
            jit_options,
            jit_values,
            n_jit,
            lib_options,
            lib_values,
            n_lib,
        )
    })
}

/// The capacity the arbiter schedules GPU `d` against, when the process has a turn
/// on it; `None`: unmanaged there (no arbiter, or the arbiter refused this GPU), so
/// nobody will make room on it.
fn capacity_of(d: usize) -> Option<u64> {
    client::global()
        .and_then(|c| c.turn_for(d))
        .map(|t| t.capacity())
}

/// Under a node swap budget, growth of the working set is admitted by the arbiter
/// first. Asked without the allocator's lock held: the answer comes through the turn's
/// thread, which may need that lock for a swap meanwhile. `Err`: refused.
fn admit(d: usize, size: u64) -> Result<Option<client::Admission>, CUresult> {
    let Some(turn) = client::global()
        .and_then(|c| c.turn_for(d))
        .filter(|t| t.budgeted())
    else {
        return Ok(None);
    };
    let Some((ws, growth)) = mem_lock(d)
        .as_ref()
        .map(|m| (m.figures().working_set, m.growth(size)))
    else {
        return Ok(None);
    };
    if growth == 0 || ws + growth > turn.capacity() {
        // Nothing to admit, or the allocator refuses it on its own (past the GPU).
        return Ok(None);
    }
    turn.admit(ws + growth)
        .map(Some)
        .ok_or(CUDA_ERROR_OUT_OF_MEMORY)
}

/// Allocates through the shim's allocator; `None` = not ours to serve.
fn alloc(size: u64) -> Option<Result<u64, CUresult>> {
    let d = current_mem_device()?;
    let _admission = match admit(d, size) {
        Ok(a) => a,
        Err(e) => return Some(Err(e)),
    };
    let mut guard = mem_lock(d);
    let m = guard.as_mut()?;
    // Unmanaged, nobody makes room: an allocation that cannot be backed fails now
    // with the driver's error, as it would without Kiwi (left unbacked, it failed
    // later, at the first kernel or copy, as an invalid value).
    let capacity = capacity_of(d);
    let r = match m.alloc(size) {
        Err(CUDA_ERROR_OUT_OF_MEMORY)
            if capacity.is_some_and(|c| m.figures().working_set + size <= c) =>
        {
            // Within what this application may use, but the GPU is physically full of
            // others' memory: reserve now, back it at the next turn (the arbiter makes
            // room then).
            m.set_backing_allowed(false);
            let r = m.alloc(size);
            m.set_backing_allowed(true);
            if r.is_ok() {
                crate::kdebug!(
                    "GPU {d}: {size} bytes left unbacked until the next turn (the GPU is full)"
                );
            }
            r
        }
        r => r,
    };
    if r.is_ok() {
        crate::stats::ALLOCS.fetch_add(1, Ordering::Relaxed);
        // Memory on this GPU: the process needs its turn from now on.
        if let Some(t) = client::global().and_then(|c| c.turn_for(d)) {
            t.claim(&crate::gate::GATE);
        }
        if let Some(c) = client::global() {
            c.grew(d);
        }
        // Memory left unbacked must be backed before work runs. Closed under the
        // allocator's lock: the client checks residency and opens the gate under it
        // too, so it cannot open over this memory (a sticky illegal address).
        if !m.all_resident() {
            crate::gate::GATE.close();
        }
    }
    drop(guard);
    Some(r)
}

/// # Safety
/// `real` is the driver's original of this entry point; the other arguments are the
/// application's, valid as `cuda.h` documents them.
pub unsafe fn mem_alloc(
    real: Real<unsafe extern "C" fn(*mut CUdeviceptr, usize) -> CUresult>,
    dptr: *mut CUdeviceptr,
    size: usize,
) -> CUresult {
    if dptr.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    match alloc(size as u64) {
        Some(Ok(p)) => {
            // SAFETY: dptr checked non-null; the caller's out-pointer.
            unsafe { *dptr = p };
            CUDA_SUCCESS
        }
        Some(Err(e)) => e,
        // SAFETY: forwarding the caller's arguments.
        None => unsafe { real(dptr, size) },
    }
}

/// Stream-ordered allocations are served at once by the shim's allocator (memory usable
/// now is usable when the stream gets there), counted for `pool` (`None`: the current
/// pool of the calling thread's device, which `cuMemAllocAsync` allocates from) in the
/// pool's statistics ([`crate::pools`]); what the shim does not manage goes to the
/// original `cuMemAlloc_v2`.
/// # Safety
/// `dptr` is the application's out-pointer.
unsafe fn alloc_now(dptr: *mut CUdeviceptr, size: usize, pool: Option<CUmemoryPool>) -> CUresult {
    if dptr.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    match alloc(size as u64) {
        Some(Ok(ptr)) => {
            // SAFETY: dptr checked non-null; the caller's out-pointer.
            unsafe { *dptr = ptr };
            let pool = pool.unwrap_or_else(current_pool);
            crate::pools::allocated(pool, ptr, size as u64);
            CUDA_SUCCESS
        }
        Some(Err(e)) => e,
        None => {
            let p = original_of(Sym::cuMemAlloc_v2);
            if p.is_null() {
                return CUDA_ERROR_NOT_FOUND;
            }
            // SAFETY: the original cuMemAlloc_v2, cuda.h's signature; the caller's
            // out-pointer and size.
            unsafe {
                let real = std::mem::transmute::<
                    *mut c_void,
                    unsafe extern "C" fn(*mut CUdeviceptr, usize) -> CUresult,
                >(p);
                real(dptr, size)
            }
        }
    }
}

/// The current memory pool of the calling thread's device (null when the driver
/// cannot say).
fn current_pool() -> CUmemoryPool {
    let mut dev: CUdevice = 0;
    let mut pool: CUmemoryPool = null_mut();
    if call!(cuCtxGetDevice: fn(*mut CUdevice)(&mut dev)).is_ok() {
        let _ = call!(cuDeviceGetMemPool: fn(*mut CUmemoryPool, CUdevice)(&mut pool, dev));
    }
    pool
}

/// # Safety
/// `real` is the driver's original of this entry point; the other arguments are the
/// application's, valid as `cuda.h` documents them.
pub unsafe fn mem_alloc_async(
    _real: Real<unsafe extern "C" fn(*mut CUdeviceptr, usize, CUstream) -> CUresult>,
    dptr: *mut CUdeviceptr,
    size: usize,
    _stream: CUstream,
) -> CUresult {
    // SAFETY: the caller's arguments.
    unsafe { alloc_now(dptr, size, None) }
}

/// # Safety
/// `real` is the driver's original of this entry point; the other arguments are the
/// application's, valid as `cuda.h` documents them.
pub unsafe fn mem_alloc_from_pool(
    _real: Real<unsafe extern "C" fn(*mut CUdeviceptr, usize, CUmemoryPool, CUstream) -> CUresult>,
    dptr: *mut CUdeviceptr,
    size: usize,
    pool: CUmemoryPool,
    _stream: CUstream,
) -> CUresult {
    // SAFETY: the caller's arguments; pools are served by the shim's allocator.
    unsafe { alloc_now(dptr, size, Some(pool)) }
}

/// # Safety
/// `real` is the driver's original of this entry point; the other arguments are the
/// application's, valid as `cuda.h` documents them.
pub unsafe fn mem_alloc_pitch(
    real: Real<unsafe extern "C" fn(*mut CUdeviceptr, *mut usize, usize, usize, Uint) -> CUresult>,
    dptr: *mut CUdeviceptr,
    pitch: *mut usize,
    width: usize,
    height: usize,
    elem: Uint,
) -> CUresult {
    if dptr.is_null() || pitch.is_null() || width == 0 || height == 0 {
        return CUDA_ERROR_INVALID_VALUE;
    }
    if !matches!(elem, 4 | 8 | 16) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    let p = width.div_ceil(512) * 512;
    let Some(total) = p.checked_mul(height) else {
        return CUDA_ERROR_INVALID_VALUE;
    };
    match alloc(total as u64) {
        Some(Ok(base)) => {
            // SAFETY: both out-pointers checked non-null.
            unsafe {
                *dptr = base;
                *pitch = p;
            }
            CUDA_SUCCESS
        }
        Some(Err(e)) => e,
        // SAFETY: forwarding the caller's arguments.
        None => unsafe { real(dptr, pitch, width, height, elem) },
    }
}

fn free_ours(ptr: CUdeviceptr) -> Option<CUresult> {
    if !client::allocator_enabled() {
        return None;
    }
    with_owner(ptr, |m| match m.free(ptr) {
        Ok(()) => {
            crate::pools::freed(ptr);
            CUDA_SUCCESS
        }
        Err(e) => e,
    })
}

/// # Safety
/// `real` is the driver's original of this entry point; the other arguments are the
/// application's, valid as `cuda.h` documents them.
pub unsafe fn mem_free(
    real: Real<unsafe extern "C" fn(CUdeviceptr) -> CUresult>,
    dptr: CUdeviceptr,
) -> CUresult {
    let ours = || client::allocator_enabled() && with_owner(dptr, |_| ()).is_some();
    // Freeing waits for the context's work that may use the memory (as cuMemFree
    // does: a small allocation's range is reused at once), which no shim may do while
    // a stream captures: the free is done when the last capture ends (the memory
    // stays allocated and mapped until then, so nothing queued can touch a range
    // handed out again, nor unmapped memory).
    let defer = || {
        crate::capture::after_captures(Box::new(move || {
            if let Some(e) = free_ours(dptr).filter(|&r| r != CUDA_SUCCESS) {
                crate::kwarn!("a free deferred past a capture failed with CUDA error {e}");
            }
        }));
        CUDA_SUCCESS
    };
    if crate::capture::active() && ours() {
        return defer();
    }
    match free_ours(dptr) {
        // A capture began between the check and the wait: the allocation is intact.
        Some(crate::capture::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED) if crate::capture::active() => {
            defer()
        }
        Some(r) => r,
        None => {
            // SAFETY: forwarding the caller's argument.
            let r = unsafe { real(dptr) };
            if r == CUDA_SUCCESS {
                if let Some(d) = crate::managed::removed(dptr) {
                    client::report_now(d);
                }
            }
            r
        }
    }
}

/// `cuMemAllocManaged`: the driver's. In a managed process the allocation counts in
/// the working set of the current context's GPU, which claims it, and moves to the
/// host at its swap-outs ([`crate::managed`]).
///
/// # Safety
/// `real` is the driver's original of this entry point; the other arguments are the
/// application's, valid as `cuda.h` documents them.
pub unsafe fn mem_alloc_managed(
    real: Real<unsafe extern "C" fn(*mut CUdeviceptr, usize, Uint) -> CUresult>,
    dptr: *mut CUdeviceptr,
    size: usize,
    flags: Uint,
) -> CUresult {
    // SAFETY: forwarding the caller's arguments.
    let r = unsafe { real(dptr, size, flags) };
    if r != CUDA_SUCCESS || dptr.is_null() || !client::allocator_enabled() {
        return r;
    }
    if let Some(d) = current_mem_device() {
        // SAFETY: the driver just wrote the allocation's address there.
        crate::managed::added(d, unsafe { *dptr }, size as u64);
        if let Some(t) = client::global().and_then(|c| c.turn_for(d)) {
            t.claim(&crate::gate::GATE);
        }
        client::report_now(d);
    }
    r
}

/// # Safety
/// `real` is the driver's original of this entry point; the other arguments are the
/// application's, valid as `cuda.h` documents them.
pub unsafe fn mem_free_async(
    real: Real<unsafe extern "C" fn(CUdeviceptr, CUstream) -> CUresult>,
    dptr: CUdeviceptr,
    stream: CUstream,
) -> CUresult {
    // SAFETY: the caller's arguments.
    unsafe { free_async(real, dptr, crate::capture::StreamArg::new(stream, false)) }
}

/// `cuMemFreeAsync_ptsz`: a NULL stream is the calling thread's per-thread stream.
/// # Safety
/// As [`mem_free_async`].
pub unsafe fn mem_free_async_ptsz(
    real: Real<unsafe extern "C" fn(CUdeviceptr, CUstream) -> CUresult>,
    dptr: CUdeviceptr,
    stream: CUstream,
) -> CUresult {
    // SAFETY: the caller's arguments.
    unsafe { free_async(real, dptr, crate::capture::StreamArg::new(stream, true)) }
}

/// A stream-ordered free of a shim allocation waits for its own stream only (work
/// queued there may still use the memory; other streams' use is ordered by the
/// application, as with the driver's pools), never for the whole context.
/// # Safety
/// `real` is the original taking `(dptr, s.handle)`.
unsafe fn free_async(
    real: Real<unsafe extern "C" fn(CUdeviceptr, CUstream) -> CUresult>,
    dptr: CUdeviceptr,
    s: crate::capture::StreamArg,
) -> CUresult {
    let ours = client::allocator_enabled() && with_owner(dptr, |_| ()).is_some();
    if !ours {
        // SAFETY: forwarding the caller's arguments.
        return unsafe { real(dptr, s.handle) };
    }
    if crate::capture::is_captured(Some(s)) {
        // A free captured into a graph happens each time the graph runs, after the
        // graph's earlier work, which the shim cannot order: the memory stays allocated
        // (and swappable) instead, never freed under a graph that still uses it.
        crate::kwarn!(
            "cuMemFreeAsync of {dptr:#x} captured into a graph: kept allocated (Kiwi does not free captured frees)"
        );
        return CUDA_SUCCESS;
    }
    // Waiting for a stream that does not capture is a potentially unsafe call: while
    // another stream captures in GLOBAL mode the driver would refuse it and invalidate
    // that capture, where the application's own stream-ordered free is allowed.
    let _relaxed = crate::capture::Relaxed::enter();
    if let Err(e) = call!(cuStreamSynchronize: fn(CUstream)(s.handle_for_legacy_entry())) {
        return e;
    }
    FREE_STREAM.set(Some(s));
    let r = free_ours(dptr).unwrap_or(CUDA_ERROR_INVALID_VALUE);
    FREE_STREAM.set(None);
    r
}

/// # Safety
/// `real` is the driver's original of this entry point; the other arguments are the
/// application's, valid as `cuda.h` documents them.
pub unsafe fn mem_get_info(
    real: Real<unsafe extern "C" fn(*mut usize, *mut usize) -> CUresult>,
    free: *mut usize,
    total: *mut usize,
) -> CUresult {
    let turn = client::global()
        .zip(current_device())
        .and_then(|(c, d)| c.turn_for(d));
    let Some(turn) = turn else {
        // SAFETY: forwarding the caller's arguments.
        return unsafe { real(free, total) };
    };
    if free.is_null() || total.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    turn.sync_room();
    let t = turn.info().total_memory;
    let reserve = t.saturating_sub(turn.told_capacity());
    let used = turn.figures().working_set;
    // SAFETY: both out-pointers checked non-null.
    unsafe {
        *total = t as usize;
        *free = t.saturating_sub(used).saturating_sub(reserve) as usize;
    }
    CUDA_SUCCESS
}

/// # Safety
/// `real` is the driver's original of this entry point; the other arguments are the
/// application's, valid as `cuda.h` documents them.
pub unsafe fn mem_get_address_range(
    real: Real<unsafe extern "C" fn(*mut CUdeviceptr, *mut usize, CUdeviceptr) -> CUresult>,
    pbase: *mut CUdeviceptr,
    psize: *mut usize,
    dptr: CUdeviceptr,
) -> CUresult {
    let found = seen_devices()
        .find_map(|d| mem_lock(d).as_ref().and_then(|m| m.range_of(dptr)))
        .or_else(|| crate::appvmm::range_of(dptr));
    match found {
        Some((base, size)) => {
            if !pbase.is_null() {
                // SAFETY: non-null out-pointer from the caller.
                unsafe { *pbase = base };
            }
            if !psize.is_null() {
                // SAFETY: non-null out-pointer from the caller.
                unsafe { *psize = size as usize };
            }
            CUDA_SUCCESS
        }
        // SAFETY: forwarding the caller's arguments.
        None => unsafe { real(pbase, psize, dptr) },
    }
}
