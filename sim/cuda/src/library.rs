//! Context-independent loading (CUDA 12.0+): `cuLibraryLoadData`/`FromFile`,
//! `cuLibraryGetKernel`, `cuKernelGetFunction` and the rest. NVIDIA's runtime 12.x
//! loads every fatbin a program registers this way and launches its kernels by
//! their `CUkernel` handles (without these entry points `cudaLaunchKernel` fails
//! with `cudaErrorCallRequiresNewerDriver`), so this is where a PyTorch kernel's code
//! comes from.
//!
//! The runtime 12.9 loads each registered fatbin with `cuLibraryLoadData` and, at a
//! kernel's first launch, takes the library's module in the current context
//! (`cuLibraryGetModule`) and the kernel's function there (`cuModuleGetFunction`);
//! it launches that function. A library's code is loaded into a context (a module
//! there, costing that context [`crate::driver::Driver::module_memory`] of device
//! memory until the library is unloaded or the context goes) at its first use in
//! it (lazy loading, the driver's default since CUDA 12.2; the CUDA programming
//! guide, "Lazy Loading"): that module's first `cuModuleGetFunction`, a
//! `cuKernelGetFunction`, or a launch of a `CUkernel` handle, which the driver
//! accepts as a function. A load that does not fit is `CUDA_ERROR_OUT_OF_MEMORY`
//! from that call, a launch included, and the code stays unloaded there (a later
//! call tries again). With `CUDA_MODULE_LOADING=EAGER` the library's load takes the
//! current context's at once, and `cuLibraryGetModule` another's. Any image is
//! accepted; its kernels are the built-ins.

use std::collections::HashMap;
use std::ffi::{c_char, c_void};
use std::sync::Mutex;

use crate::abi::*;
use crate::builtin::{Builtin, BUILTINS};
use crate::driver::{self, driver, Driver};
use crate::ffi::{c_str, out};

/// A loaded library: its module in each context it was loaded into.
struct Library {
    modules: HashMap<usize, usize>,
}

/// A kernel handle: its library and built-in.
#[derive(Clone, Copy)]
struct Kernel {
    library: usize,
    kind: Builtin,
}

#[derive(Default)]
struct Registry {
    libraries: HashMap<usize, Library>,
    /// By handle; each library's kernels get their handles at its first
    /// `cuLibraryGetKernel` of that name, the same handle after.
    kernels: HashMap<usize, Kernel>,
}

static REGISTRY: Mutex<Option<Registry>> = Mutex::new(None);

fn with<R>(f: impl FnOnce(&mut Registry) -> R) -> R {
    let mut g = REGISTRY.lock().unwrap_or_else(|e| e.into_inner());
    f(g.get_or_insert_with(Registry::default))
}

/// Library `lib`'s module in context `ctx` (on `gpu`), made there if it is not (or
/// its module went with a reset of the context). `code`: its code is loaded now
/// (a kernel's function or launch); else only with eager loading, and lazily at the
/// module's first `cuModuleGetFunction` (the runtime's path: `cuLibraryGetModule`,
/// then `cuModuleGetFunction` at a kernel's first launch). Out of memory when the
/// code does not fit.
fn module_in(d: &Driver, lib: usize, ctx: usize, gpu: u32, code: bool) -> Result<usize, CUresult> {
    let known = with(|r| r.libraries.get(&lib).map(|l| l.modules.get(&ctx).copied()))
        .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
    if let Some(m) = known.filter(|&m| d.has_module(m)) {
        if code {
            d.load_code(m)?;
        }
        return Ok(m);
    }
    let m = d.new_module(ctx, gpu, d.module_memory, !code && !driver::eager_loading())?;
    let kept = with(|r| match r.libraries.get_mut(&lib) {
        Some(l) => {
            l.modules.insert(ctx, m);
            true
        }
        None => false,
    });
    if !kept {
        // Unloaded meanwhile by another thread.
        d.drop_module(m);
        return Err(CUDA_ERROR_INVALID_HANDLE);
    }
    Ok(m)
}

/// [`module_in`] the calling thread's current context.
fn module_in_current(d: &Driver, lib: usize, code: bool) -> Result<usize, CUresult> {
    let ctx = driver::current()?;
    module_in(d, lib, ctx.handle(), ctx.device, code)
}

/// The built-in of kernel handle `f`, its library loaded into context `ctx` (on
/// `gpu`) first; `None` when `f` is no kernel handle (a `CUfunction`).
pub(crate) fn launch_kernel(
    d: &Driver,
    f: CUfunction,
    ctx: usize,
    gpu: u32,
) -> Result<Option<Builtin>, CUresult> {
    let Some(k) = with(|r| r.kernels.get(&(f as usize)).copied()) else {
        return Ok(None);
    };
    module_in(d, k.library, ctx, gpu, true)?;
    Ok(Some(k.kind))
}

/// The built-in of kernel handle `k` (`cuKernelGetAttribute` and friends).
pub(crate) fn kernel_kind(k: CUkernel) -> Result<Builtin, CUresult> {
    kernel(k).map(|k| k.kind)
}

fn kernel(k: CUkernel) -> Result<Kernel, CUresult> {
    with(|r| r.kernels.get(&(k as usize)).copied()).ok_or(CUDA_ERROR_INVALID_HANDLE)
}

/// `cuLibraryLoadData` (the JIT and library options are ignored).
pub(crate) fn load(lib: *mut CUlibrary, code: *const c_void) -> Result<(), CUresult> {
    let d = driver()?;
    if lib.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    if code.is_null() {
        return Err(CUDA_ERROR_INVALID_IMAGE);
    }
    let h = d.new_handle();
    with(|r| {
        r.libraries.insert(
            h,
            Library {
                modules: HashMap::new(),
            },
        )
    });
    if driver::eager_loading() {
        if let Ok(ctx) = driver::current() {
            if let Err(e) = module_in(d, h, ctx.handle(), ctx.device, true) {
                with(|r| r.libraries.remove(&h));
                return Err(e);
            }
        }
    }
    out(lib, h as CUlibrary)
}

/// `cuLibraryLoadFromFile`: a file that exists, loaded as an image.
pub(crate) fn load_from_file(lib: *mut CUlibrary, file: *const c_char) -> Result<(), CUresult> {
    if !std::path::Path::new(c_str(file)?).is_file() {
        return Err(CUDA_ERROR_FILE_NOT_FOUND);
    }
    load(lib, file.cast())
}

/// Unloads the library from every context it was loaded into, giving their memory
/// back; its kernel handles become invalid.
pub(crate) fn unload(lib: CUlibrary) -> Result<(), CUresult> {
    let d = driver()?;
    let l = with(|r| {
        let l = r.libraries.remove(&(lib as usize))?;
        r.kernels.retain(|_, k| k.library != lib as usize);
        Some(l)
    })
    .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
    for m in l.modules.into_values() {
        d.drop_module(m);
    }
    Ok(())
}

/// `cuLibraryGetKernel`: a built-in by its entry name, one handle per library.
pub(crate) fn get_kernel(
    k: *mut CUkernel,
    lib: CUlibrary,
    name: *const c_char,
) -> Result<(), CUresult> {
    let d = driver()?;
    if k.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let name = c_str(name)?;
    let kind = BUILTINS
        .iter()
        .copied()
        .find(|b| b.name() == name)
        .ok_or(CUDA_ERROR_NOT_FOUND)?;
    let lib = lib as usize;
    let h = with(|r| {
        if !r.libraries.contains_key(&lib) {
            return Err(CUDA_ERROR_INVALID_HANDLE);
        }
        let found = r
            .kernels
            .iter()
            .find(|(_, k)| k.library == lib && k.kind == kind)
            .map(|(&h, _)| h);
        Ok(found.unwrap_or_else(|| {
            let h = d.new_handle();
            r.kernels.insert(h, Kernel { library: lib, kind });
            h
        }))
    })?;
    out(k, h as CUkernel)
}

/// `cuLibraryGetKernelCount`: every built-in.
pub(crate) fn kernel_count(count: *mut u32, lib: CUlibrary) -> Result<(), CUresult> {
    driver()?;
    known(lib)?;
    out(count, BUILTINS.len() as u32)
}

/// `cuLibraryEnumerateKernels`: `n` must be the count.
pub(crate) fn enumerate_kernels(
    kernels: *mut CUkernel,
    n: u32,
    lib: CUlibrary,
) -> Result<(), CUresult> {
    if kernels.is_null() || n as usize != BUILTINS.len() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    for (i, b) in BUILTINS.iter().enumerate() {
        let name = std::ffi::CString::new(b.name()).map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
        // SAFETY: within the caller's array of `n` handles (checked above).
        get_kernel(unsafe { kernels.add(i) }, lib, name.as_ptr())?;
    }
    Ok(())
}

/// The library's module in the current context, made there if it is not: its code
/// is loaded now with eager loading, else at the module's first
/// `cuModuleGetFunction`.
pub(crate) fn get_module(m: *mut CUmodule, lib: CUlibrary) -> Result<(), CUresult> {
    let d = driver()?;
    if m.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let h = module_in_current(d, lib as usize, false)?;
    out(m, h as CUmodule)
}

/// `cuLibraryGetGlobal`, `cuLibraryGetManaged`: no built-in image has globals or
/// managed variables.
pub(crate) fn no_variable(lib: CUlibrary) -> Result<(), CUresult> {
    driver()?;
    known(lib)?;
    Err(CUDA_ERROR_NOT_FOUND)
}

/// A library handle that is loaded; else `CUDA_ERROR_INVALID_HANDLE`.
fn known(lib: CUlibrary) -> Result<(), CUresult> {
    if with(|r| r.libraries.contains_key(&(lib as usize))) {
        Ok(())
    } else {
        Err(CUDA_ERROR_INVALID_HANDLE)
    }
}

/// The kernel's function in the current context: its library is loaded there first
/// (its code takes device memory now; out of memory when it does not fit).
pub(crate) fn kernel_function(f: *mut CUfunction, k: CUkernel) -> Result<(), CUresult> {
    let d = driver()?;
    if f.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let kn = kernel(k)?;
    module_in_current(d, kn.library, true)?;
    out(f, kn.kind.handle())
}

/// `cuKernelGetName`.
pub(crate) fn kernel_name(name: *mut *const c_char, k: CUkernel) -> Result<(), CUresult> {
    driver()?;
    if name.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let kn = kernel(k)?;
    out(name, kn.kind.c_name())
}

/// `CU_FUNC_CACHE_PREFER_*` (0–3): a preference, nothing to do.
pub(crate) fn kernel_set_cache_config(
    k: CUkernel,
    config: i32,
    dev: CUdevice,
) -> Result<(), CUresult> {
    let d = driver()?;
    if dev < 0 || dev as u32 >= d.gpus || !(0..=3).contains(&config) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    kernel(k).map(|_| ())
}
