//! Copies and memsets as the API sees them, 1D and 2D, synchronous and in stream
//! order: what each checks when it is called (a bad range is
//! `CUDA_ERROR_INVALID_VALUE` at once) and the operation it queues. Bodies of the
//! exports `crate::exports` lists; the executors move the bytes (`crate::transfer`).

use kiwi_sim_core::LinkDir;

use crate::abi::*;
use crate::driver::{self, driver, Driver};
use crate::exec::Op;
use crate::ffi::read;
use crate::stream::{enqueue, Issue};
use crate::transfer::{Memset2D, Side};

/// Validates device ranges at submission: a bad pointer is `CUDA_ERROR_INVALID_VALUE`
/// right away (memory freed or unmapped after submission fails at execution with a
/// sticky `CUDA_ERROR_ILLEGAL_ADDRESS`).
fn check_range(d: &Driver, ptr: u64, n: u64, write: bool) -> Result<(), CUresult> {
    // The copy runs on the current context's device: a VMM mapping must grant it.
    let dev = driver::current_unchecked()?.device;
    d.mem
        .resolve(ptr, n, write, dev)
        .map(|_| ())
        .map_err(|_| CUDA_ERROR_INVALID_VALUE)
}

/// `cuMemcpy`, `cuMemcpyAsync`: unified addresses, either side host or device.
pub(crate) fn memcpy(dst: u64, src: u64, n: usize, on: Issue, pt: bool) -> Result<(), CUresult> {
    let d = driver()?;
    if n == 0 {
        return Ok(());
    }
    let n = n as u64;
    let dd = d.mem.is_device_address(dst);
    let sd = d.mem.is_device_address(src);
    if (!dd && dst == 0) || (!sd && src == 0) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    if dd {
        check_range(d, dst, n, true)?;
    }
    if sd {
        check_range(d, src, n, false)?;
    }
    let op = match (dd, sd) {
        (true, true) => Op::DtoD { dst, src, n },
        (true, false) => Op::HostCopy {
            dir: LinkDir::HostToDevice,
            device: dst,
            host: src as usize,
            n,
        },
        (false, true) => Op::HostCopy {
            dir: LinkDir::DeviceToHost,
            device: src,
            host: dst as usize,
            n,
        },
        (false, false) => Op::HtoH {
            dst: dst as usize,
            src: src as usize,
            n,
        },
    };
    enqueue(on, op, pt)
}

/// `cuMemcpyHtoD_v2`, `cuMemcpyDtoH_v2` and their `Async`: between device memory
/// at `device` and the host pointer `host`, the way `dir` says.
pub(crate) fn host_copy(
    dir: LinkDir,
    device: u64,
    host: usize,
    n: usize,
    on: Issue,
    pt: bool,
) -> Result<(), CUresult> {
    let d = driver()?;
    if n == 0 {
        return Ok(());
    }
    if host == 0 || d.mem.is_device_address(host as u64) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    check_range(d, device, n as u64, dir == LinkDir::HostToDevice)?;
    let op = Op::HostCopy {
        dir,
        device,
        host,
        n: n as u64,
    };
    enqueue(on, op, pt)
}

/// `cuMemcpyDtoD_v2` and its `Async`.
pub(crate) fn dtod(dst: u64, src: u64, n: usize, on: Issue, pt: bool) -> Result<(), CUresult> {
    let d = driver()?;
    if n == 0 {
        return Ok(());
    }
    check_range(d, src, n as u64, false)?;
    check_range(d, dst, n as u64, true)?;
    let op = Op::DtoD {
        dst,
        src,
        n: n as u64,
    };
    enqueue(on, op, pt)
}

/// `cuMemsetD8/16/32`, sync and `Async`: `count` elements of `elem` bytes.
pub(crate) fn memset(
    dst: u64,
    value: u32,
    elem: u8,
    count: usize,
    on: Issue,
    pt: bool,
) -> Result<(), CUresult> {
    let d = driver()?;
    if count == 0 {
        return Ok(());
    }
    if !dst.is_multiple_of(u64::from(elem)) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let n = (count as u64)
        .checked_mul(u64::from(elem))
        .ok_or(CUDA_ERROR_INVALID_VALUE)?;
    check_range(d, dst, n, true)?;
    let op = Op::Memset {
        dst,
        value,
        elem,
        count: count as u64,
    };
    enqueue(on, op, pt)
}

// ---------------------------------------------------------------- 2D

fn side(
    d: &Driver,
    kind: u32,
    host: usize,
    device: u64,
    x: usize,
    y: usize,
    pitch: usize,
) -> Result<Side, CUresult> {
    let (is_dev, base) = match kind {
        CU_MEMORYTYPE_HOST => (false, host as u64),
        CU_MEMORYTYPE_DEVICE => (true, device),
        // Unified addressing: the pointer is in the device field; the address
        // window tells host from device.
        CU_MEMORYTYPE_UNIFIED => (d.mem.is_device_address(device), device),
        CU_MEMORYTYPE_ARRAY => return Err(CUDA_ERROR_NOT_SUPPORTED),
        _ => return Err(CUDA_ERROR_INVALID_VALUE),
    };
    if base == 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let off = (y as u64)
        .checked_mul(pitch as u64)
        .and_then(|o| o.checked_add(x as u64))
        .ok_or(CUDA_ERROR_INVALID_VALUE)?;
    Ok(Side {
        device: is_dev,
        addr: base + off,
        pitch: pitch as u64,
    })
}

/// The bytes a 2D region spans: (height - 1) * pitch + width.
fn span_2d(pitch: u64, width: u64, height: u64) -> Result<u64, CUresult> {
    if height > 1 && pitch < width {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    (height - 1)
        .checked_mul(pitch)
        .and_then(|v| v.checked_add(width))
        .ok_or(CUDA_ERROR_INVALID_VALUE)
}

/// `cuMemcpy2D_v2`, `cuMemcpy2DUnaligned_v2`, `cuMemcpy2DAsync_v2`: host, device
/// and unified sides (arrays are `CUDA_ERROR_NOT_SUPPORTED`).
pub(crate) fn copy_2d(p: *const CudaMemcpy2D, on: Issue, pt: bool) -> Result<(), CUresult> {
    let d = driver()?;
    let c = read(p)?;
    let (w, h) = (c.width_in_bytes as u64, c.height as u64);
    let src = side(
        d,
        c.src_memory_type,
        c.src_host as usize,
        c.src_device,
        c.src_x_in_bytes,
        c.src_y,
        c.src_pitch,
    )?;
    let dst = side(
        d,
        c.dst_memory_type,
        c.dst_host as usize,
        c.dst_device,
        c.dst_x_in_bytes,
        c.dst_y,
        c.dst_pitch,
    )?;
    if w == 0 || h == 0 {
        return Ok(());
    }
    for (sd, write) in [(&src, false), (&dst, true)] {
        let span = span_2d(sd.pitch, w, h)?;
        if sd.device {
            check_range(d, sd.addr, span, write)?;
        }
    }
    let op = Op::Copy2D {
        src,
        dst,
        width: w,
        height: h,
    };
    enqueue(on, op, pt)
}

/// `cuMemsetD2D8/16/32`, sync and `Async`: `height` rows of `width` elements of
/// `elem` bytes, `pitch` bytes apart.
#[allow(clippy::too_many_arguments)]
pub(crate) fn memset_2d(
    dst: u64,
    pitch: usize,
    value: u32,
    elem: u8,
    width: usize,
    height: usize,
    on: Issue,
    pt: bool,
) -> Result<(), CUresult> {
    let d = driver()?;
    if width == 0 || height == 0 {
        return Ok(());
    }
    if !dst.is_multiple_of(u64::from(elem)) || !(pitch as u64).is_multiple_of(u64::from(elem)) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let row = (width as u64)
        .checked_mul(u64::from(elem))
        .ok_or(CUDA_ERROR_INVALID_VALUE)?;
    let span = span_2d(pitch as u64, row, height as u64)?;
    check_range(d, dst, span, true)?;
    let op = Op::Memset2D(Memset2D {
        dst,
        pitch: pitch as u64,
        value,
        elem,
        width: width as u64,
        height: height as u64,
    });
    enqueue(on, op, pt)
}
