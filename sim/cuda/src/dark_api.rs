//! `cuGetExportTable`: the private tables NVIDIA's CUDA runtime (`libcudart`) asks
//! the driver for before anything else works (without them `cudaGetDeviceCount`
//! fails with `cudaErrorNotSupported`). A table is an array of pointer-sized slots;
//! most start with their own size in bytes. The layouts and meanings were learned
//! from ZLUDA's `dark_api` (vosen/ZLUDA), which reverse-engineered them; this is our
//! own implementation of what the runtime 12.x uses:
//!
//! | table | uuid | slots used |
//! | --- | --- | --- |
//! | `CUDART_INTERFACE` | `6bd5fb6c-5bf4-e74a-8987-d93912fd9df9` | 0 size; 1, 6, 8 module from a fatbin; 2 primary context (not retained); 7 no-op; 12 load compilers |
//! | `TOOLS_RUNTIME_CALLBACK_HOOKS` | `a094798c-2e74-2e74-93f2-0800200c0a66` | 0 size; 2, 6 scratch buffers |
//! | `TOOLS_TLS` | `42d85a81-23f6-cb47-8298-f6e78a3aecdc` | 0 size |
//! | `CONTEXT_LOCAL_STORAGE_V0301` | `c693336e-1121-df11-a8c3-68f355d89593` | 0 put, 1 delete, 2 get (a miss is `CUDA_ERROR_INVALID_HANDLE`) |
//! | `INTEGRITY_CHECK` | `d4082055-bde6-704b-8d34-ba123c66e1f2` | 0 size; 1 the check (`kiwi_sim_core::integrity`) |
//! | `CONTEXT_CHECKS` | `263e8860-7cd2-6143-92f6-bbd5006dfa7e` | 0 size; 2 context check; 3 flag check |
//!
//! Any other uuid is `CUDA_ERROR_INVALID_VALUE` with a NULL table, as the real
//! driver answers for tables it does not have.

use std::cell::UnsafeCell;
use std::ffi::c_void;

use kiwi_sim_core::ident;
use kiwi_sim_core::integrity::{integrity_answer, CheckInput, DeviceHashInfo};

use crate::abi::*;
use crate::context::primary_context;
use crate::device::{attribute_value, DRIVER_VERSION};
use crate::driver::{self, driver};
use crate::exec::{ClsDestructor, Context};
use crate::ffi::{guard, out, read};
use crate::launch::module_load;

/// One table: pointer-sized slots, immutable.
#[repr(transparent)]
struct Table<const N: usize>([*const c_void; N]);

// SAFETY: the slots are function addresses and integers, never written after
// construction.
unsafe impl<const N: usize> Sync for Table<N> {}

impl<const N: usize> Table<N> {
    /// A table of `slots` (index, function), the others NULL.
    const fn new(slots: &[(usize, *const c_void)]) -> Self {
        let mut t = [std::ptr::null(); N];
        let mut i = 0;
        while i < slots.len() {
            t[slots[i].0] = slots[i].1;
            i += 1;
        }
        Table(t)
    }

    /// A table whose slot 0 holds its size in bytes, as the runtime expects, and
    /// `slots` after it.
    const fn sized(slots: &[(usize, *const c_void)]) -> Self {
        let mut t = Self::new(slots);
        t.0[0] = (N * std::mem::size_of::<usize>()) as *const c_void;
        t
    }

    fn start(&'static self) -> *const c_void {
        self.0.as_ptr().cast()
    }
}

const CUDART_INTERFACE_ID: [u8; 16] = [
    0x6b, 0xd5, 0xfb, 0x6c, 0x5b, 0xf4, 0xe7, 0x4a, 0x89, 0x87, 0xd9, 0x39, 0x12, 0xfd, 0x9d, 0xf9,
];
const TOOLS_RUNTIME_CALLBACK_HOOKS_ID: [u8; 16] = [
    0xa0, 0x94, 0x79, 0x8c, 0x2e, 0x74, 0x2e, 0x74, 0x93, 0xf2, 0x08, 0x00, 0x20, 0x0c, 0x0a, 0x66,
];
const TOOLS_TLS_ID: [u8; 16] = [
    0x42, 0xd8, 0x5a, 0x81, 0x23, 0xf6, 0xcb, 0x47, 0x82, 0x98, 0xf6, 0xe7, 0x8a, 0x3a, 0xec, 0xdc,
];
const CONTEXT_LOCAL_STORAGE_V0301_ID: [u8; 16] = [
    0xc6, 0x93, 0x33, 0x6e, 0x11, 0x21, 0xdf, 0x11, 0xa8, 0xc3, 0x68, 0xf3, 0x55, 0xd8, 0x95, 0x93,
];
const INTEGRITY_CHECK_ID: [u8; 16] = [
    0xd4, 0x08, 0x20, 0x55, 0xbd, 0xe6, 0x70, 0x4b, 0x8d, 0x34, 0xba, 0x12, 0x3c, 0x66, 0xe1, 0xf2,
];
const CONTEXT_CHECKS_ID: [u8; 16] = [
    0x26, 0x3e, 0x88, 0x60, 0x7c, 0xd2, 0x61, 0x43, 0x92, 0xf6, 0xbb, 0xd5, 0x00, 0x6d, 0xfa, 0x7e,
];

static CUDART_INTERFACE: Table<13> = Table::sized(&[
    (1, module_from_fatbin as *const c_void),
    (2, primary_context_unretained as *const c_void),
    (6, module_from_fatbin_ext as *const c_void),
    (7, cudart_noop as *const c_void),
    (8, module_from_fatbin_header as *const c_void),
    (12, load_compilers as *const c_void),
]);

static TOOLS_RUNTIME_CALLBACK_HOOKS: Table<7> = Table::sized(&[
    (2, callback_buffer_1 as *const c_void),
    (6, callback_buffer_2 as *const c_void),
]);

static TOOLS_TLS: Table<4> = Table::sized(&[]);

/// No size word: slot 0 is already a function.
static CONTEXT_LOCAL_STORAGE_V0301: Table<4> = Table::new(&[
    (0, cls_put as *const c_void),
    (1, cls_delete as *const c_void),
    (2, cls_get as *const c_void),
]);

static INTEGRITY_CHECK: Table<3> = Table::sized(&[(1, integrity_check as *const c_void)]);

static CONTEXT_CHECKS: Table<4> = Table::sized(&[
    (2, context_check as *const c_void),
    (3, context_flag_check as *const c_void),
]);

/// `cuGetExportTable(table, id)`.
pub(crate) fn export_table(table: *mut *const c_void, id: *const CUuuid) -> Result<(), CUresult> {
    let id = read(id)?.bytes;
    let start = match id {
        CUDART_INTERFACE_ID => CUDART_INTERFACE.start(),
        TOOLS_RUNTIME_CALLBACK_HOOKS_ID => TOOLS_RUNTIME_CALLBACK_HOOKS.start(),
        TOOLS_TLS_ID => TOOLS_TLS.start(),
        CONTEXT_LOCAL_STORAGE_V0301_ID => CONTEXT_LOCAL_STORAGE_V0301.start(),
        INTEGRITY_CHECK_ID => INTEGRITY_CHECK.start(),
        CONTEXT_CHECKS_ID => CONTEXT_CHECKS.start(),
        _ => {
            if !table.is_null() {
                out(table, std::ptr::null())?;
            }
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
    };
    out(table, start)
}

// ---------------------------------------------------------------- CUDART_INTERFACE

/// The runtime registers fatbins through these; the simulator accepts any image
/// (its kernels are built in), as `cuModuleLoadData` does, without charging module
/// memory (the runtime's modules are not seen by a shim; see `launch::module_load`).
extern "C" fn module_from_fatbin(module: *mut CUmodule, fatbin: *const c_void) -> CUresult {
    guard(|| module_load(module, fatbin, false))
}

extern "C" fn module_from_fatbin_ext(
    module: *mut CUmodule,
    fatbin: *const c_void,
    _a: *mut c_void,
    _b: *mut c_void,
    _c: u32,
) -> CUresult {
    guard(|| module_load(module, fatbin, false))
}

extern "C" fn module_from_fatbin_header(
    fatbin: *const c_void,
    module: *mut CUmodule,
    _a: *mut c_void,
    _b: *mut c_void,
    _c: u32,
) -> CUresult {
    guard(|| module_load(module, fatbin, false))
}

/// The primary context of a device without taking a reference (the runtime retains
/// it itself through `cuDevicePrimaryCtxRetain`).
extern "C" fn primary_context_unretained(pctx: *mut CUcontext, dev: CUdevice) -> CUresult {
    guard(|| primary_context(pctx, dev, false))
}

extern "C" fn cudart_noop(_arg: usize) {}

/// The real driver loads its PTX compiler here; the simulator needs none.
extern "C" fn load_compilers() -> CUresult {
    guard(|| driver().map(|_| ()))
}

// ---------------------------------------------------------------- TOOLS_RUNTIME_CALLBACK_HOOKS

/// A buffer the runtime writes its tools callback state into (the driver owns it).
struct ScratchBuffer<const N: usize>(UnsafeCell<[u32; N]>);

// SAFETY: the driver never reads or writes the buffer; only the runtime does.
unsafe impl<const N: usize> Sync for ScratchBuffer<N> {}

static BUFFER_1: ScratchBuffer<1024> = ScratchBuffer(UnsafeCell::new([0; 1024]));
static BUFFER_2: ScratchBuffer<14> = ScratchBuffer(UnsafeCell::new([0; 14]));

fn give_buffer<const N: usize>(
    b: &'static ScratchBuffer<N>,
    ptr: *mut *mut c_void,
    size: *mut usize,
) {
    let _ = out(ptr, b.0.get().cast());
    let _ = out(size, N);
}

extern "C" fn callback_buffer_1(ptr: *mut *mut c_void, size: *mut usize) {
    give_buffer(&BUFFER_1, ptr, size);
}

extern "C" fn callback_buffer_2(ptr: *mut *mut c_void, size: *mut usize) {
    give_buffer(&BUFFER_2, ptr, size);
}

// ---------------------------------------------------------------- CONTEXT_LOCAL_STORAGE_V0301

/// The context a storage call names: NULL is the calling thread's current one.
fn storage_context(ctx: CUcontext) -> Result<std::sync::Arc<Context>, CUresult> {
    let d = driver()?;
    if ctx.is_null() {
        driver::current_unchecked()
    } else {
        d.context(ctx as usize)
    }
}

extern "C" fn cls_put(
    ctx: CUcontext,
    key: *mut c_void,
    value: *mut c_void,
    dtor: Option<ClsDestructor>,
) -> CUresult {
    guard(|| {
        let c = storage_context(ctx)?;
        c.local_storage
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(key as usize, (value as usize, dtor));
        Ok(())
    })
}

extern "C" fn cls_delete(ctx: CUcontext, key: *mut c_void) -> CUresult {
    guard(|| {
        let c = storage_context(ctx)?;
        c.local_storage
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&(key as usize));
        Ok(())
    })
}

extern "C" fn cls_get(value: *mut *mut c_void, ctx: CUcontext, key: *mut c_void) -> CUresult {
    guard(|| {
        let c = storage_context(ctx)?;
        let v = c
            .local_storage
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&(key as usize))
            .map(|e| e.0)
            // The runtime relies on a miss being an error: it then creates its
            // per-context state and puts it.
            .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        out(value, v as *mut c_void)
    })
}

// ---------------------------------------------------------------- INTEGRITY_CHECK

extern "C" fn integrity_check(version: u32, unix_seconds: u64, result: *mut [u64; 2]) -> CUresult {
    guard(|| {
        let d = driver()?;
        let devices = (0..d.gpus)
            .map(|g| {
                use crate::abi::attr::{PCI_BUS_ID, PCI_DEVICE_ID, PCI_DOMAIN_ID};
                Ok(DeviceHashInfo {
                    uuid: ident::gpu_uuid(&d.name, g),
                    pci_domain: attribute_value(d, PCI_DOMAIN_ID, g)?,
                    pci_bus: attribute_value(d, PCI_BUS_ID, g)?,
                    pci_device: attribute_value(d, PCI_DEVICE_ID, g)?,
                })
            })
            .collect::<Result<Vec<_>, CUresult>>()?;
        // SAFETY: pthread_self has no preconditions.
        let thread = unsafe { libc::pthread_self() } as u32;
        let input = CheckInput {
            version,
            unix_seconds,
            driver_version: DRIVER_VERSION as u32,
            pid: std::process::id(),
            thread,
            cudart_table: CUDART_INTERFACE.start() as u64,
            integrity_table: INTEGRITY_CHECK.start() as u64,
            check_fn: INTEGRITY_CHECK.0[1] as u64,
        };
        out(result, integrity_answer(&input, &devices))
    })
}

// ---------------------------------------------------------------- CONTEXT_CHECKS

/// The runtime asks whether a context carries flags it must refuse; none do here.
extern "C" fn context_check(
    _ctx: CUcontext,
    result: *mut u32,
    _detail: *mut *const c_void,
) -> CUresult {
    guard(|| out(result, 0))
}

extern "C" fn context_flag_check() -> u32 {
    0
}
