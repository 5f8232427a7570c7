//! Device memory as the API sees it: `cuMemAlloc*` and `cuMemFree*` (stream-ordered
//! ones included), what a pointer is (`cuMemGetAddressRange`, `cuPointerGetAttribute*`),
//! managed memory (allocation, prefetch, advice) and the legacy IPC handles. Bodies
//! of the exports `crate::exports` lists; the address space is `crate::memory`'s.

use std::ffi::c_void;

use crate::abi::*;
use crate::capture;
use crate::driver::{self, driver, Driver};
use crate::exec::Op;
use crate::ffi::{out, read};
use crate::stream::{enqueue, Issue};

/// `cuMemGetInfo_v2`: free is the capacity less what every process holds.
pub(crate) fn get_info(free: *mut usize, total: *mut usize) -> Result<(), CUresult> {
    let d = driver()?;
    let ctx = driver::current()?;
    let u = d
        .machine
        .usage(ctx.device)
        .map_err(|_| CUDA_ERROR_INVALID_DEVICE)?;
    out(free, u.free() as usize)?;
    out(total, u.capacity as usize)
}

/// `cuMemAlloc_v2`.
pub(crate) fn alloc(dptr: *mut CUdeviceptr, size: usize) -> Result<(), CUresult> {
    let d = driver()?;
    let ctx = driver::current()?;
    capture::refuse_unsafe()?;
    if dptr.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let p = d.mem.alloc_linear(ctx.device, size as u64, ctx.handle())?;
    out(dptr, p)
}

/// `cuMemAllocPitch_v2`: rows of `width` bytes, 512 bytes apart at least.
pub(crate) fn alloc_pitch(
    dptr: *mut CUdeviceptr,
    pitch: *mut usize,
    width: usize,
    height: usize,
    elem: u32,
) -> Result<(), CUresult> {
    let d = driver()?;
    let ctx = driver::current()?;
    capture::refuse_unsafe()?;
    if !matches!(elem, 4 | 8 | 16) || width == 0 || height == 0 || pitch.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let p = width.next_multiple_of(512);
    let size = p.checked_mul(height).ok_or(CUDA_ERROR_INVALID_VALUE)?;
    if dptr.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let a = d.mem.alloc_linear(ctx.device, size as u64, ctx.handle())?;
    out(dptr, a)?;
    out(pitch, p)
}

/// `cuMemFree_v2`.
pub(crate) fn free(ptr: CUdeviceptr) -> Result<(), CUresult> {
    let d = driver()?;
    if ptr == 0 {
        return Ok(());
    }
    capture::refuse_unsafe()?;
    // Like the real driver, freeing waits for work that may still use it.
    if let Ok(ctx) = driver::current_unchecked() {
        ctx.wait_all();
    }
    d.mem.free_linear(ptr)?;
    crate::pool_usage::note_free(ptr);
    Ok(())
}

/// `cuMemGetAddressRange_v2`: either out-pointer may be NULL.
pub(crate) fn address_range(
    base: *mut CUdeviceptr,
    size: *mut usize,
    ptr: CUdeviceptr,
) -> Result<(), CUresult> {
    let d = driver()?;
    let (b, s) = d.mem.address_range(ptr).ok_or(CUDA_ERROR_NOT_FOUND)?;
    if !base.is_null() {
        out(base, b)?;
    }
    if !size.is_null() {
        out(size, s as usize)?;
    }
    Ok(())
}

/// `cuMemAllocAsync` (`pool` `None`: the device's current pool) and
/// `cuMemAllocFromPoolAsync`.
pub(crate) fn alloc_async(
    dptr: *mut CUdeviceptr,
    size: usize,
    pool: Option<*mut c_void>,
    stream: CUstream,
    pt: bool,
) -> Result<(), CUresult> {
    let d = driver()?;
    let s = d.stream(stream, pt)?;
    if dptr.is_null() || size == 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let pool = match pool {
        Some(h) => crate::pool::pool(h)?,
        None => crate::pool::current(s.ctx.device)?,
    };
    // Memory is taken at once (so OUT_OF_MEMORY is reported here), on the pool's
    // device; the pointer is usable by work queued after this call, as with a real
    // pool.
    let p = d
        .mem
        .alloc_linear(pool.device, size as u64, s.ctx.handle())?;
    crate::pool::note_alloc(&pool, p, size as u64);
    out(dptr, p)
}

/// `cuMemFreeAsync`: freed when its turn in the stream comes.
pub(crate) fn free_async(ptr: CUdeviceptr, stream: CUstream, pt: bool) -> Result<(), CUresult> {
    let d = driver()?;
    let s = d.stream(stream, pt)?;
    if !d.mem.is_linear_start(ptr) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    capture::submit(&s.ctx, &s, Op::Free { ptr }).map(|_| ())
}

// ---------------------------------------------------------------- managed memory

/// `cuMemAllocManaged`.
pub(crate) fn alloc_managed(
    dptr: *mut CUdeviceptr,
    size: usize,
    flags: u32,
) -> Result<(), CUresult> {
    let d = driver()?;
    let ctx = driver::current()?;
    capture::refuse_unsafe()?;
    if dptr.is_null() || !matches!(flags, CU_MEM_ATTACH_GLOBAL | CU_MEM_ATTACH_HOST) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let p = d.mem.alloc_managed(ctx.device, size as u64, ctx.handle())?;
    out(dptr, p)
}

/// The device of a `CUmemLocation` (the host: `CU_DEVICE_CPU`), for the `_v2` calls
/// that take one where v1 took a device.
pub(crate) fn location_device(loc: CUmemLocation) -> Result<i32, CUresult> {
    match loc.type_ {
        CU_MEM_LOCATION_TYPE_DEVICE => Ok(loc.id),
        CU_MEM_LOCATION_TYPE_HOST => Ok(CU_DEVICE_CPU),
        _ => Err(CUDA_ERROR_INVALID_VALUE),
    }
}

/// `cuMemPrefetchAsync` (and `_v2`, through [`location_device`]): a prefetch of
/// managed memory moves its blocks to `device` or the host when its turn in the
/// stream comes (`crate::phys::Phys::migrate`): device memory is taken or given back
/// then.
pub(crate) fn prefetch(
    ptr: CUdeviceptr,
    n: usize,
    device: i32,
    stream: CUstream,
    pt: bool,
) -> Result<(), CUresult> {
    let d = driver()?;
    if device != CU_DEVICE_CPU {
        d.device(device)?;
    }
    match d.mem.pointer_info(ptr) {
        Some(i) if i.managed && ptr + n as u64 <= i.start + i.size => {}
        _ => return Err(CUDA_ERROR_INVALID_VALUE),
    }
    let to = (device != CU_DEVICE_CPU).then_some(device as u32);
    let op = Op::Migrate {
        ptr,
        n: n as u64,
        to,
    };
    enqueue(Issue::Async(stream), op, pt)
}

/// `cuMemAdvise` (and `_v2`, through [`location_device`]).
pub(crate) fn advise(ptr: CUdeviceptr, n: usize, advice: i32, device: i32) -> Result<(), CUresult> {
    let d = driver()?;
    if !(1..=6).contains(&advice) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    if device != CU_DEVICE_CPU {
        d.device(device)?;
    }
    // Advice applies to managed memory (the simulated device has no pageable
    // memory access); it changes nothing here, managed memory being always resident.
    match d.mem.pointer_info(ptr) {
        Some(i) if i.managed && n > 0 && ptr + n as u64 <= i.start + i.size => Ok(()),
        _ => Err(CUDA_ERROR_INVALID_VALUE),
    }
}

// ---------------------------------------------------------------- pointer attributes

/// One pointer attribute of `ptr`; `CUDA_ERROR_INVALID_VALUE` for an address the
/// simulator does not know or an attribute it does not answer.
fn pointer_attribute(
    d: &Driver,
    data: *mut c_void,
    attribute: i32,
    ptr: u64,
) -> Result<(), CUresult> {
    use crate::abi::ptr_attr::*;
    if data.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    if let Some(i) = d.mem.pointer_info(ptr) {
        return match attribute {
            CONTEXT => {
                let ctx = if i.owner != 0 {
                    i.owner
                } else {
                    driver::current_handle()
                };
                out(data.cast::<CUcontext>(), ctx as CUcontext)
            }
            MEMORY_TYPE => out(
                data.cast::<u32>(),
                if i.managed {
                    CU_MEMORYTYPE_UNIFIED
                } else {
                    CU_MEMORYTYPE_DEVICE
                },
            ),
            DEVICE_POINTER => out(data.cast::<u64>(), ptr),
            HOST_POINTER if i.managed => out(data.cast::<u64>(), ptr),
            HOST_POINTER => Err(CUDA_ERROR_INVALID_VALUE),
            BUFFER_ID => out(data.cast::<u64>(), i.start),
            IS_MANAGED => out(data.cast::<i32>(), i32::from(i.managed)),
            DEVICE_ORDINAL => out(data.cast::<i32>(), i.gpu as i32),
            RANGE_START_ADDR => out(data.cast::<u64>(), i.start),
            RANGE_SIZE => out(data.cast::<usize>(), i.size as usize),
            MAPPED => out(data.cast::<i32>(), i32::from(i.mapped)),
            MEMPOOL_HANDLE => out(
                data.cast::<*mut c_void>(),
                crate::pool_usage::pool_of(i.start).unwrap_or(0) as *mut c_void,
            ),
            _ => Err(CUDA_ERROR_INVALID_VALUE),
        };
    }
    // Pinned or registered host memory is visible to the device at its address.
    let (start, len) = d
        .mem
        .host
        .range(ptr as usize)
        .ok_or(CUDA_ERROR_INVALID_VALUE)?;
    match attribute {
        CONTEXT => out(
            data.cast::<CUcontext>(),
            driver::current_handle() as CUcontext,
        ),
        MEMORY_TYPE => out(data.cast::<u32>(), CU_MEMORYTYPE_HOST),
        DEVICE_POINTER | HOST_POINTER => out(data.cast::<u64>(), ptr),
        IS_MANAGED => out(data.cast::<i32>(), 0),
        DEVICE_ORDINAL => out(
            data.cast::<i32>(),
            driver::current().map(|c| c.device as i32).unwrap_or(0),
        ),
        RANGE_START_ADDR => out(data.cast::<u64>(), start as u64),
        RANGE_SIZE => out(data.cast::<usize>(), len),
        MAPPED => out(data.cast::<i32>(), 1),
        MEMPOOL_HANDLE => out(data.cast::<*mut c_void>(), std::ptr::null_mut()),
        _ => Err(CUDA_ERROR_INVALID_VALUE),
    }
}

/// `cuPointerGetAttribute`.
pub(crate) fn get_attribute(
    data: *mut c_void,
    attribute: i32,
    ptr: CUdeviceptr,
) -> Result<(), CUresult> {
    pointer_attribute(driver()?, data, attribute, ptr)
}

/// The default an attribute reads for a pointer the driver does not know: "the
/// attributes are assigned default NULL values and CUDA_SUCCESS is returned"
/// (Driver API reference, `cuPointerGetAttributes`), i.e. zero of the attribute's
/// size; the device ordinal reads -2 (no device), as the runtime reports it.
fn unknown_pointer_default(data: *mut c_void, attribute: i32) -> Result<(), CUresult> {
    use crate::abi::ptr_attr::*;
    match attribute {
        CONTEXT | HOST_POINTER | MEMPOOL_HANDLE => out(data.cast::<usize>(), 0),
        MEMORY_TYPE | IS_MANAGED | MAPPED => out(data.cast::<u32>(), 0),
        DEVICE_POINTER | BUFFER_ID | RANGE_START_ADDR => out(data.cast::<u64>(), 0),
        RANGE_SIZE => out(data.cast::<usize>(), 0),
        DEVICE_ORDINAL => out(data.cast::<i32>(), -2),
        _ => Err(CUDA_ERROR_INVALID_VALUE),
    }
}

/// `cuPointerGetAttributes`.
pub(crate) fn get_attributes(
    n: u32,
    attributes: *const i32,
    data: *mut *mut c_void,
    ptr: CUdeviceptr,
) -> Result<(), CUresult> {
    let d = driver()?;
    if n == 0 || attributes.is_null() || data.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let known = d.mem.pointer_info(ptr).is_some() || d.mem.host.range(ptr as usize).is_some();
    for i in 0..n as usize {
        // SAFETY: the caller passes arrays of `n` attributes and `n` data pointers.
        let (a, slot) = unsafe { (read(attributes.add(i))?, read(data.add(i))?) };
        // An attribute that does not apply (the host pointer of device memory)
        // reads its NULL default here, where cuPointerGetAttribute fails.
        if !known || pointer_attribute(d, slot, a, ptr).is_err() {
            unknown_pointer_default(slot, a)?;
        }
    }
    Ok(())
}

// ---------------------------------------------------------------- legacy IPC

/// `cuIpcGetMemHandle`: only the base of a `cuMemAlloc` allocation can be exported
/// (Driver API reference: "a pointer to the base of an existing device memory
/// allocation created with cuMemAlloc"); VMM mappings (`cuMemCreate`), pool and
/// managed memory, and interior pointers are `CUDA_ERROR_INVALID_VALUE`, as the
/// real driver answers (VMM memory is shared through `cuMemExportToShareableHandle`
/// instead). The handle names this process and the allocation; opening it
/// (`cuIpcOpenMemHandle`) is not simulated: a simulated allocation's bytes live in
/// its own process.
pub(crate) fn ipc_get_handle(handle: *mut [u8; 64], ptr: CUdeviceptr) -> Result<(), CUresult> {
    let d = driver()?;
    driver::current()?;
    if handle.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let info = d.mem.pointer_info(ptr).ok_or(CUDA_ERROR_INVALID_VALUE)?;
    if !d.mem.is_linear_start(ptr) || info.managed || crate::pool_usage::pool_of(ptr).is_some() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    crate::checkpoint::IPC_EXPORTED.store(true, std::sync::atomic::Ordering::SeqCst);
    let mut h = [0u8; 64];
    h[..8].copy_from_slice(b"KIWISIM\0");
    h[8..12].copy_from_slice(&std::process::id().to_le_bytes());
    h[16..24].copy_from_slice(&ptr.to_le_bytes());
    h[24..32].copy_from_slice(&info.size.to_le_bytes());
    out(handle, h)
}

/// `cuIpcOpenMemHandle` (v1 and `_v2`): opening a legacy IPC handle is not simulated
/// (a `cuMemAlloc` allocation's bytes are private to its process): a valid call is
/// `CUDA_ERROR_NOT_SUPPORTED`, so a program can tell it from a refused handle. VMM
/// memory is shared through `cuMemExportToShareableHandle` instead.
pub(crate) fn ipc_open_handle(pdptr: *mut CUdeviceptr, flags: u32) -> Result<(), CUresult> {
    driver()?;
    driver::current()?;
    if pdptr.is_null() || flags & !CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS != 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    Err(CUDA_ERROR_NOT_SUPPORTED)
}

/// `cuIpcCloseMemHandle`: nothing is ever opened (above), so no pointer is one.
pub(crate) fn ipc_close_handle() -> Result<(), CUresult> {
    driver()?;
    driver::current()?;
    Err(CUDA_ERROR_INVALID_VALUE)
}
