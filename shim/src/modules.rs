//! Memory no swap frees that the application's calls make, counted as the process's
//! (reported to the arbiter with its contexts' memory) and given back when it goes:
//! modules (`cuModuleLoad*`), libraries (`cuLibraryLoad*`, the runtime 12.x's
//! loading) and the code loaded lazily into a context (a module's first function, a
//! library's module there, a kernel's function), and a context's limits
//! (`cuCtxSetLimit`). Each such call that finds the GPU full of others' memory waits
//! for room ([`crate::room`]). A context's destruction gives back what was counted
//! for it.

use std::ffi::{c_char, c_int, c_void};
use std::sync::{Mutex, MutexGuard};

use crate::client;
use crate::cuda::*;
use crate::devices::{current_context, current_mem_device};
use crate::real::call_real as call;
use crate::room::{self, free_and_own, took_between};

type Real<A> = A;

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
    let prior = limit_now(limit);
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
    let old = LIMITS
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get(&key)
        .map_or(0, |&(_, b)| b);
    let new = u64::try_from((i128::from(old) + took).max(0)).unwrap_or(0);
    if new != old {
        crate::kdebug!("GPU {d}: limit {limit} = {value} takes {new} bytes of device memory");
        turn.add_context_bytes(new as i64 - old as i64);
    }
    // Made at once, where it leaves another's working set no room ever: the
    // earlier value back, and out of memory.
    if let Some(prior) = prior.filter(|_| new > old) {
        let undo = || {
            // SAFETY: the driver's own function, setting the value the limit had.
            let _ = unsafe { real(limit, prior) };
        };
        if room::taken_back_if_blocking(d, "a context limit", new - old, undo) {
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
    }
    let mut counted = LIMITS.lock().unwrap_or_else(|p| p.into_inner());
    if new == 0 {
        counted.remove(&key);
    } else {
        counted.insert(key, (d, new));
    }
    r
}

/// The current context's value of `limit` (`cuCtxGetLimit`), `None` where the
/// driver does not say.
fn limit_now(limit: c_int) -> Option<usize> {
    let f = crate::real::lookup(c"cuCtxGetLimit");
    if f.is_null() {
        return None;
    }
    // SAFETY: the driver's cuCtxGetLimit, with cuda.h's signature.
    let f = unsafe {
        std::mem::transmute::<*mut c_void, unsafe extern "C" fn(*mut usize, c_int) -> CUresult>(f)
    };
    let mut v: usize = 0;
    // SAFETY: a valid out pointer.
    (crate::ffi::inside(|| unsafe { f(&mut v, limit) }) == CUDA_SUCCESS).then_some(v)
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
        crate::stats::CODE_BYTES.fetch_add(bytes, std::sync::atomic::Ordering::Relaxed);
    }
    (r, Some((d, bytes)))
}

/// Runs `load`, a module or library load into the calling thread's current context
/// that writes its handle through `handle`, counting the device memory it took
/// ([`counted`]) until it is unloaded (`unload`: the driver's function that does).
/// A load whose memory leaves another client's working set no room, ever, is
/// unloaded again and fails with out of memory ([`room::taken_back_if_blocking`]).
fn counted_load(
    handle: *mut *mut c_void,
    unload: &std::ffi::CStr,
    load: impl FnMut() -> CUresult,
) -> CUresult {
    if unload == c"cuModuleUnload" {
        crate::stats::MODULE_LOADS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
    let (r, took) = counted("a module", load);
    if let Some((d, bytes)) = took.filter(|_| !handle.is_null()) {
        // SAFETY: the driver just wrote the handle through the caller's pointer.
        let h = unsafe { *handle } as usize;
        let undo = || {
            let f = crate::real::lookup(unload);
            if !f.is_null() {
                // SAFETY: the driver's cuModuleUnload or cuLibraryUnload, both
                // `(handle) -> CUresult` as cuda.h declares them.
                let f = unsafe {
                    std::mem::transmute::<*mut c_void, unsafe extern "C" fn(*mut c_void) -> CUresult>(
                        f,
                    )
                };
                // SAFETY: the handle the driver just made, not yet the caller's.
                crate::ffi::inside(|| unsafe { f(h as *mut c_void) });
            }
        };
        if bytes > 0 && room::taken_back_if_blocking(d, "a module", bytes, undo) {
            // SAFETY: as above; the caller gets no handle with its error.
            unsafe { *handle = std::ptr::null_mut() };
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
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
    crate::stats::MODULE_GET_FUNCTIONS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
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
    crate::stats::LIBRARY_GET_MODULES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
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
    crate::stats::LIBRARY_GET_KERNELS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
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
    crate::stats::KERNEL_GET_FUNCTIONS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
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
/// limits reserved, so what they were counted is given back, and so is the context's
/// own cost where another context lives on its GPU
/// ([`crate::devices::context_destroyed`]; the last one's stays counted: the shim
/// swaps through the primary context where the application has no other).
///
/// # Safety
/// `real` is the driver's original of this entry point; `ctx` is the application's.
pub unsafe fn ctx_destroy(
    real: Real<unsafe extern "C" fn(CUcontext) -> CUresult>,
    ctx: CUcontext,
) -> CUresult {
    // SAFETY: forwarding the caller's argument.
    let r = unsafe { real(ctx) };
    if r == CUDA_SUCCESS && !ctx.is_null() {
        context_gone(ctx as usize);
        crate::devices::context_destroyed(ctx, true);
    }
    r
}

/// Context `key` is gone (destroyed, or a primary context reset): what its modules, their code, its limits and its launches' code were
/// counted is given back.
fn context_gone(key: usize) {
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
}

/// Device `dev`'s primary context, when it is active (`cuDevicePrimaryCtxGetState`);
/// its handle from a retain the driver's own release takes back at once.
fn active_primary(dev: CUdevice) -> Option<CUcontext> {
    type State = unsafe extern "C" fn(CUdevice, *mut Uint, *mut c_int) -> CUresult;
    type Retain = unsafe extern "C" fn(*mut CUcontext, CUdevice) -> CUresult;
    type Release = unsafe extern "C" fn(CUdevice) -> CUresult;
    let (state, retain, release) = (
        crate::real::lookup(c"cuDevicePrimaryCtxGetState"),
        crate::real::lookup(c"cuDevicePrimaryCtxRetain"),
        crate::real::lookup(c"cuDevicePrimaryCtxRelease_v2"),
    );
    if state.is_null() || retain.is_null() || release.is_null() {
        return None;
    }
    // SAFETY: the driver's functions of these names, with cuda.h's signatures.
    let (state, retain, release) = unsafe {
        (
            std::mem::transmute::<*mut c_void, State>(state),
            std::mem::transmute::<*mut c_void, Retain>(retain),
            std::mem::transmute::<*mut c_void, Release>(release),
        )
    };
    crate::ffi::inside(|| {
        let (mut flags, mut active): (Uint, c_int) = (0, 0);
        // SAFETY: valid out pointers; the application's device.
        if unsafe { state(dev, &mut flags, &mut active) } != CUDA_SUCCESS || active == 0 {
            return None;
        }
        let mut ctx: CUcontext = std::ptr::null_mut();
        // SAFETY: as above; an active primary context: the retain makes nothing.
        if unsafe { retain(&mut ctx, dev) } != CUDA_SUCCESS {
            return None;
        }
        // SAFETY: the reference taken just above.
        unsafe { release(dev) };
        Some(ctx)
    })
}

/// `cuDevicePrimaryCtxReset_v2` (`cudaDeviceReset`): the driver destroys the
/// device's primary context, its modules and limits with it: given back as for a
/// destroyed context.
///
/// # Safety
/// `real` is the driver's original of this entry point; `dev` is the application's.
pub unsafe fn primary_ctx_reset(
    real: Real<unsafe extern "C" fn(CUdevice) -> CUresult>,
    dev: CUdevice,
) -> CUresult {
    // SAFETY: forwarding the caller's argument.
    primary_gone_after(dev, || unsafe { real(dev) }, |_| true)
}

/// Runs `call` on device `dev`'s primary context and, where it worked and
/// `reset(dev)` says the context was reset by it, gives back what was counted for
/// the context; live again (and counted again) when it is next retained.
fn primary_gone_after(
    dev: CUdevice,
    call: impl FnOnce() -> CUresult,
    reset: impl FnOnce(CUdevice) -> bool,
) -> CUresult {
    let primary = active_primary(dev);
    let r = call();
    if let (CUDA_SUCCESS, Some(ctx)) = (r, primary) {
        if reset(dev) {
            context_gone(ctx as usize);
            crate::devices::context_destroyed(ctx, true);
        }
    }
    r
}

/// `cuDevicePrimaryCtxRelease_v2`: "the context is automatically reset once the last
/// reference to it is released" (Driver API reference): when this release was the
/// last, given back as for [`primary_ctx_reset`].
///
/// # Safety
/// `real` is the driver's original of this entry point; `dev` is the application's.
pub unsafe fn primary_ctx_release(
    real: Real<unsafe extern "C" fn(CUdevice) -> CUresult>,
    dev: CUdevice,
) -> CUresult {
    // SAFETY: forwarding the caller's argument.
    primary_gone_after(
        dev,
        || unsafe { real(dev) },
        |dev| active_primary(dev).is_none(),
    )
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
    counted_load(module, c"cuModuleUnload", || unsafe { real(module, fname) })
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
    counted_load(module, c"cuModuleUnload", || unsafe { real(module, image) })
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
    counted_load(module, c"cuModuleUnload", || unsafe {
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
    crate::stats::LIBRARY_LOADS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    // SAFETY: forwarding the caller's arguments.
    counted_load(library, c"cuLibraryUnload", || unsafe {
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
