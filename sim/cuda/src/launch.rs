//! Modules, functions and launches as the API sees them: loading and unloading
//! modules (each costing its context device memory), finding the built-in kernels
//! by name, function and kernel attributes, kernel launches with their arguments
//! read at the call, and host functions in stream order. Bodies of the exports
//! `crate::exports` lists; the context-independent `cuLibrary*` are
//! `crate::library`'s, the kernels `crate::builtin`'s.

use std::ffi::{c_char, c_void};
use std::sync::Mutex;

use crate::abi::*;
use crate::builtin::{Builtin, BUILTINS};
use crate::capture;
use crate::driver::{self, driver};
use crate::exec::Op;
use crate::ffi::{c_str, out, read};

fn function(f: CUfunction) -> Result<Builtin, CUresult> {
    BUILTINS
        .iter()
        .find(|b| std::ptr::eq(*b as *const Builtin, f as *const Builtin))
        .copied()
        .ok_or(CUDA_ERROR_INVALID_HANDLE)
}

/// Loads a module into the current context (`cuModuleLoadData`, `…Ex`). A
/// driver-API load (`charged`) costs the context [`driver::Driver::module_memory`]
/// of device memory until it is unloaded: at once with `CUDA_MODULE_LOADING=EAGER`,
/// else (lazy loading, the driver's default since CUDA 12.2) at the module's first
/// `cuModuleGetFunction`, which loads its kernels. The runtime's private path
/// (`dark_api.rs`) is not charged (a shim cannot see it).
pub(crate) fn module_load(
    m: *mut CUmodule,
    image: *const c_void,
    charged: bool,
) -> Result<(), CUresult> {
    let d = driver()?;
    let ctx = driver::current()?;
    if m.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    if image.is_null() {
        return Err(CUDA_ERROR_INVALID_IMAGE);
    }
    let charge = if charged { d.module_memory } else { 0 };
    // Any image is accepted: entry names resolve to the built-ins.
    let h = d.new_module(ctx.handle(), ctx.device, charge, !driver::eager_loading())?;
    out(m, h as CUmodule)
}

/// `cuModuleLoad`: a file that exists, loaded as an image.
pub(crate) fn module_load_file(m: *mut CUmodule, fname: *const c_char) -> Result<(), CUresult> {
    let path = c_str(fname)?;
    if !std::path::Path::new(path).is_file() {
        return Err(CUDA_ERROR_FILE_NOT_FOUND);
    }
    module_load(m, fname.cast(), true)
}

/// `cuModuleUnload`.
pub(crate) fn module_unload(m: CUmodule) -> Result<(), CUresult> {
    if driver()?.drop_module(m as usize) {
        Ok(())
    } else {
        Err(CUDA_ERROR_INVALID_HANDLE)
    }
}

/// `cuModuleGetFunction`: a built-in by its entry name.
pub(crate) fn module_function(
    f: *mut CUfunction,
    m: CUmodule,
    name: *const c_char,
) -> Result<(), CUresult> {
    let d = driver()?;
    if !d.has_module(m as usize) {
        return Err(CUDA_ERROR_INVALID_HANDLE);
    }
    let name = c_str(name)?;
    let b = BUILTINS
        .iter()
        .find(|b| b.name() == name)
        .ok_or(CUDA_ERROR_NOT_FOUND)?;
    if f.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // Lazy loading: the module's code is loaded (its device memory taken) now.
    d.load_code(m as usize)?;
    out(f, b as *const Builtin as CUfunction)
}

/// `cuModuleGetLoadingMode`: `CU_MODULE_LAZY_LOADING` unless
/// `CUDA_MODULE_LOADING=EAGER` (the driver's default since CUDA 12.2).
pub(crate) fn loading_mode(mode: *mut u32) -> Result<(), CUresult> {
    driver()?;
    out(mode, if driver::eager_loading() { 1 } else { 2 })
}

/// `cuFuncGetAttribute`.
pub(crate) fn func_attribute(pi: *mut i32, attrib: i32, f: CUfunction) -> Result<(), CUresult> {
    driver()?;
    function(f)?;
    if let Some(v) = func_attr_set(f, attrib) {
        return out(pi, v);
    }
    let v = match attrib {
        0 => 1024,   // MAX_THREADS_PER_BLOCK
        4 => 32,     // NUM_REGS
        5 | 6 => 80, // PTX / BINARY version
        9 => -1,     // PREFERRED_SHARED_MEMORY_CARVEOUT: no preference
        1..=8 => 0,
        _ => return Err(CUDA_ERROR_INVALID_VALUE),
    };
    out(pi, v)
}

/// Values set by `cuFuncSetAttribute`, by (function, attribute).
static FUNC_ATTRS: Mutex<Vec<(usize, i32, i32)>> = Mutex::new(Vec::new());

fn func_attr_set(f: CUfunction, attrib: i32) -> Option<i32> {
    FUNC_ATTRS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .find(|(g, a, _)| *g == f as usize && *a == attrib)
        .map(|x| x.2)
}

/// `CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES`, `_PREFERRED_SHARED_MEMORY_CARVEOUT`.
const FUNC_MAX_DYNAMIC_SHARED: i32 = 8;
const FUNC_CARVEOUT: i32 = 9;

/// `cuFuncSetAttribute`: the maximum dynamic shared memory and the carveout.
pub(crate) fn func_set_attribute(f: CUfunction, attrib: i32, value: i32) -> Result<(), CUresult> {
    driver()?;
    function(f)?;
    let ok = match attrib {
        // The opt-in maximum minus the built-ins' static shared memory (none).
        FUNC_MAX_DYNAMIC_SHARED => (0..=163 << 10).contains(&value),
        FUNC_CARVEOUT => (-1..=100).contains(&value),
        _ => false,
    };
    if !ok {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let mut v = FUNC_ATTRS.lock().unwrap_or_else(|e| e.into_inner());
    v.retain(|(g, a, _)| !(*g == f as usize && *a == attrib));
    v.push((f as usize, attrib, value));
    Ok(())
}

/// The function of kernel handle `k`, asked about device `dev`: every built-in has
/// the same attributes on every device, so a kernel's (`cuKernelGetAttribute`,
/// `cuKernelSetAttribute`) are its function's.
pub(crate) fn function_of_kernel(k: CUkernel, dev: CUdevice) -> Result<CUfunction, CUresult> {
    let d = driver()?;
    if dev < 0 || dev as u32 >= d.gpus {
        return Err(CUDA_ERROR_INVALID_DEVICE);
    }
    crate::library::kernel_kind(k).map(Builtin::handle)
}

/// Reads the kernel's arguments now (as the driver does at launch).
fn kernel_args(
    kind: Builtin,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> Result<[u64; 3], CUresult> {
    let sizes = kind.param_sizes();
    let mut args = [0u64; 3];
    let rd = |p: *const u8, size: usize| -> Result<u64, CUresult> {
        Ok(match size {
            4 => u64::from(read(p.cast::<u32>())?),
            _ => read(p.cast::<u64>())?,
        })
    };
    if !params.is_null() {
        for (i, &sz) in sizes.iter().enumerate() {
            // SAFETY: kernelParams holds one pointer per kernel parameter.
            let p = read(unsafe { params.add(i) })?;
            args[i] = rd(p.cast(), sz)?;
        }
        return Ok(args);
    }
    if extra.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // extra: {CU_LAUNCH_PARAM_BUFFER_POINTER, buf, CU_LAUNCH_PARAM_BUFFER_SIZE, &size, END}
    let (mut buf, mut size) = (std::ptr::null::<u8>(), None);
    let mut i = 0;
    loop {
        // SAFETY: extra is a key/value list terminated by CU_LAUNCH_PARAM_END.
        let key = read(unsafe { extra.add(i) })? as usize;
        match key {
            CU_LAUNCH_PARAM_END => break,
            CU_LAUNCH_PARAM_BUFFER_POINTER => {
                // SAFETY: as above, the value follows its key.
                buf = read(unsafe { extra.add(i + 1) })?.cast();
            }
            CU_LAUNCH_PARAM_BUFFER_SIZE => {
                // SAFETY: as above.
                let sp = read(unsafe { extra.add(i + 1) })?;
                size = Some(read(sp.cast::<usize>())?);
            }
            _ => return Err(CUDA_ERROR_INVALID_VALUE),
        }
        i += 2;
    }
    let size = size.ok_or(CUDA_ERROR_INVALID_VALUE)?;
    let mut off = 0usize;
    for (i, &sz) in sizes.iter().enumerate() {
        off = off.next_multiple_of(sz);
        if off + sz > size || buf.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: within the caller's buffer of `size` bytes (checked above).
        args[i] = rd(unsafe { buf.add(off) }, sz)?;
        off += sz;
    }
    Ok(args)
}

/// `cuLaunchKernel`, `cuLaunchCooperativeKernel` (no `extra`) and, through
/// [`launch_ex`], `cuLaunchKernelEx`: `f` is a `CUfunction` or a `CUkernel`.
pub(crate) fn launch(
    f: CUfunction,
    grid: [u32; 3],
    block: [u32; 3],
    stream: CUstream,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
    pt: bool,
) -> Result<(), CUresult> {
    let d = driver()?;
    let s = d.stream(stream, pt)?;
    // A `CUkernel` (the runtime's launches) loads its library's code into the
    // stream's context now, with lazy loading: out of memory when it does not fit.
    let kind = match crate::library::launch_kernel(d, f, s.ctx.handle(), s.ctx.device)? {
        Some(kind) => kind,
        None => function(f)?,
    };
    if grid.contains(&0) || block.contains(&0) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    if block.iter().map(|&b| u64::from(b)).product::<u64>() > 1024 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let args = kernel_args(kind, params, extra)?;
    s.ctx.check()?;
    capture::submit(&s.ctx, &s, Op::Kernel { kind, args }).map(|_| ())
}

/// `cuLaunchKernelEx`: the grid, block and stream of its launch configuration.
pub(crate) fn launch_ex(
    cfg: *const CUlaunchConfig,
    f: CUfunction,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
    pt: bool,
) -> Result<(), CUresult> {
    if cfg.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: a non-NULL config points to a CUlaunchConfig (C API contract).
    let c = unsafe { &*cfg };
    launch(
        f,
        [c.grid_dim_x, c.grid_dim_y, c.grid_dim_z],
        [c.block_dim_x, c.block_dim_y, c.block_dim_z],
        c.h_stream,
        params,
        extra,
        pt,
    )
}

/// `cuLaunchHostFunc`.
pub(crate) fn host_func(
    s: CUstream,
    f: CUhostFn,
    data: *mut c_void,
    pt: bool,
) -> Result<(), CUresult> {
    let f = f.ok_or(CUDA_ERROR_INVALID_VALUE)?;
    let d = driver()?;
    let st = d.stream(s, pt)?;
    st.ctx.check()?;
    let op = Op::HostFn {
        f,
        data: data as usize,
    };
    capture::submit(&st.ctx, &st, op).map(|_| ())
}
