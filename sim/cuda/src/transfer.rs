//! Copies, memsets and prefetches as an executor runs them: the bytes moved between
//! host memory and the pieces of device memory, the GPU's PCIe link reserved for a
//! copy that crosses it (shared with every process's copies in that direction),
//! pageable host memory staged at its own rate, and each operation paced to its
//! modelled duration. A range that no longer resolves is a [`Fault`]: the executor
//! makes it the context's sticky error.

use kiwi_sim_core::{dma, monotonic_ns, LinkDir};

use crate::hw::{pace, pace_until, Hw};
use crate::memory::Fault;
use crate::phys::Piece;

/// One side of a 2D copy: the address of its first byte (host or device) and pitch.
#[derive(Clone, Copy, Debug)]
pub struct Side {
    pub device: bool,
    pub addr: u64,
    pub pitch: u64,
}

/// `n` bytes between device address `device` and host address `host`, the way
/// `dir` says (`cuMemcpyHtoD*`, `cuMemcpyDtoH*`), over the link.
pub fn host_copy(
    d: &Hw,
    dev: u32,
    dir: LinkDir,
    device: u64,
    host: usize,
    n: u64,
) -> Result<(), Fault> {
    let start = monotonic_ns();
    let to_device = dir == LinkDir::HostToDevice;
    let pieces = d.mem.resolve(device, n, to_device, dev)?;
    let end = link(d, dev, dir, start, n as f64);
    let pageable_bps = if to_device {
        d.pageable_h2d_bps
    } else {
        d.pageable_d2h_bps
    };
    let end = pageable_end(d, host, n, start, end, pageable_bps);
    if to_device {
        from_host(pieces, host);
    } else {
        to_host(pieces, host);
    }
    pace_until(end);
    Ok(())
}

/// Device → device, in HBM (read and written).
pub fn dtod(d: &Hw, dev: u32, dst: u64, src: u64, n: u64) -> Result<(), Fault> {
    let start = monotonic_ns();
    let (s, t) = (
        d.mem.resolve(src, n, false, dev),
        d.mem.resolve(dst, n, true, dev),
    );
    // Both ranges stay resolved (their pieces alive) until the copy's time is up.
    let (s, t) = (s?, t?);
    copy_pieces(&s, &t);
    pace(start, 2.0 * n as f64 / d.hbm_bps);
    Ok(())
}

/// Host → host (`cuMemcpy` of two host addresses), at the link's rate.
pub fn htoh(d: &Hw, dst: usize, src: usize, n: u64) {
    let start = monotonic_ns();
    // SAFETY: both host ranges are the caller's, per the cuMemcpy contract.
    unsafe {
        std::ptr::copy(src as *const u8, dst as *mut u8, n as usize);
    }
    pace(start, n as f64 / d.pcie_bps);
}

/// `count` elements of `elem` bytes at `dst` set to `value`.
pub fn memset(d: &Hw, dev: u32, dst: u64, value: u32, elem: u8, count: u64) -> Result<(), Fault> {
    let start = monotonic_ns();
    let n = count * u64::from(elem);
    memset_range(d, dev, dst, value, elem, count)?;
    pace(start, n as f64 / d.hbm_bps);
    Ok(())
}

/// A 2D memset: `height` rows of `width` elements of `elem` bytes, `pitch` bytes
/// apart, set to `value`.
#[derive(Clone, Copy, Debug)]
pub struct Memset2D {
    pub dst: u64,
    pub pitch: u64,
    pub value: u32,
    pub elem: u8,
    pub width: u64,
    pub height: u64,
}

impl Memset2D {
    pub fn run(self, d: &Hw, dev: u32) -> Result<(), Fault> {
        let Memset2D {
            dst,
            pitch,
            value,
            elem,
            width,
            height,
        } = self;
        let start = monotonic_ns();
        let ok = (0..height)
            .all(|row| memset_range(d, dev, dst + row * pitch, value, elem, width).is_ok());
        if !ok {
            return Err(Fault::Unmapped);
        }
        pace(start, (width * u64::from(elem) * height) as f64 / d.hbm_bps);
        Ok(())
    }
}

/// A 2D copy, row by row; a copy with a host side crosses the link (reserved before
/// it starts, as for [`host_copy`]); device to device stays in HBM.
pub fn copy_2d(
    d: &Hw,
    dev: u32,
    src: Side,
    dst: Side,
    width: u64,
    height: u64,
) -> Result<(), Fault> {
    let start = monotonic_ns();
    let bytes = (width * height) as f64;
    let end = match (src.device, dst.device) {
        (false, true) => Some(link(d, dev, LinkDir::HostToDevice, start, bytes)),
        (true, false) => Some(link(d, dev, LinkDir::DeviceToHost, start, bytes)),
        _ => None,
    };
    let ok = (0..height).all(|row| {
        copy_row(
            d,
            dev,
            src.device,
            src.addr + row * src.pitch,
            dst.device,
            dst.addr + row * dst.pitch,
            width,
        )
        .is_ok()
    });
    if !ok {
        return Err(Fault::Unmapped);
    }
    match end {
        Some(end) => pace_until(end),
        None if src.device => pace(start, 2.0 * bytes / d.hbm_bps),
        None => pace(start, bytes / d.pcie_bps),
    }
    Ok(())
}

/// A prefetch of managed memory: its blocks moved at the link's rate (a prefetch is
/// a bulk transfer; the driver migrates faulted pages slower, which is not
/// modelled).
pub fn migrate(d: &Hw, ptr: u64, n: u64, to: Option<u32>) {
    let start = monotonic_ns();
    let moved = d.mem.migrate(ptr, n, to).unwrap_or(0);
    pace(start, moved as f64 / d.pcie_bps);
}

/// Reserves GPU `dev`'s PCIe link in direction `dir` for `bytes` (at the link rate)
/// for a copy ready at `start_ns`, behind every copy already queued in that
/// direction by any process; returns when the copy ends (see
/// `Machine::link_reserve`).
fn link(d: &Hw, dev: u32, dir: LinkDir, start_ns: u64, bytes: f64) -> u64 {
    let ns = (bytes / d.pcie_bps * 1e9) as u64;
    d.machine
        .link_reserve(dev, dir, start_ns, ns)
        .unwrap_or(start_ns + ns)
}

/// When a host↔device copy of `n` bytes at host address `host`, started at `start`
/// and done on the link by `link_end`, ends: then, for pinned (allocated or
/// registered) host memory; no sooner than at `pageable_bps` for pageable memory,
/// which the driver stages through its own pinned buffers.
fn pageable_end(d: &Hw, host: usize, n: u64, start: u64, link_end: u64, pageable_bps: f64) -> u64 {
    let pinned = d
        .mem
        .host
        .range(host)
        .is_some_and(|(s, l)| host.saturating_add(n as usize) <= s + l);
    if pinned || pageable_bps <= 0.0 {
        return link_end;
    }
    link_end.max(start + (n as f64 / pageable_bps * 1e9) as u64)
}

/// Copies host memory from `src` on into the device pieces, in order, letting each
/// go once it is written.
fn from_host(pieces: Vec<Piece>, src: usize) {
    let mut at = src;
    for p in pieces {
        // SAFETY: host source readable per the caller's contract; device piece
        // resolved and kept alive by `p.phys`.
        unsafe { dma::copy(p.phys.host_ptr(p.offset), at as *const u8, p.len as usize) };
        at += p.len as usize;
    }
}

/// Copies the device pieces, in order, into host memory from `dst` on, letting each
/// go once it is read.
fn to_host(pieces: Vec<Piece>, dst: usize) {
    let mut at = dst;
    for p in pieces {
        // SAFETY: as for `from_host`, in the other direction.
        unsafe { dma::copy(at as *mut u8, p.phys.host_ptr(p.offset), p.len as usize) };
        at += p.len as usize;
    }
}

/// Copies the device pieces `s` into the device pieces `t` (which may overlap).
fn copy_pieces(s: &[Piece], t: &[Piece]) {
    let (mut si, mut so, mut di, mut doff) = (0, 0u64, 0, 0u64);
    while si < s.len() && di < t.len() {
        let (a, b) = (&s[si], &t[di]);
        let n = (a.len - so).min(b.len - doff);
        // SAFETY: both pieces resolved and alive; `copy` tolerates overlap.
        unsafe {
            std::ptr::copy(
                a.phys.host_ptr(a.offset + so),
                b.phys.host_ptr(b.offset + doff),
                n as usize,
            )
        };
        so += n;
        doff += n;
        if so == a.len {
            si += 1;
            so = 0;
        }
        if doff == b.len {
            di += 1;
            doff = 0;
        }
    }
}

/// Copies `n` bytes between any combination of host and device addresses.
fn copy_row(
    d: &Hw,
    dev: u32,
    src_dev: bool,
    src: u64,
    dst_dev: bool,
    dst: u64,
    n: u64,
) -> Result<(), Fault> {
    match (src_dev, dst_dev) {
        (true, true) => {
            let s = d.mem.resolve(src, n, false, dev)?;
            let t = d.mem.resolve(dst, n, true, dev)?;
            copy_pieces(&s, &t);
        }
        (false, true) => from_host(d.mem.resolve(dst, n, true, dev)?, src as usize),
        (true, false) => to_host(d.mem.resolve(src, n, false, dev)?, dst as usize),
        (false, false) => {
            // SAFETY: both host ranges are the caller's, per the cuMemcpy2D contract.
            unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, n as usize) };
        }
    }
    Ok(())
}

fn fill_pattern(bytes: &mut [u8], pattern: &[u8; 4], phase: usize) {
    if pattern.iter().all(|&b| b == pattern[0]) {
        bytes.fill(pattern[0]);
        return;
    }
    for (i, b) in bytes.iter_mut().enumerate() {
        *b = pattern[(phase + i) % 4];
    }
}

/// Fills `count` elements of `elem` bytes at device address `dst` with `value`.
fn memset_range(d: &Hw, dev: u32, dst: u64, value: u32, elem: u8, count: u64) -> Result<(), Fault> {
    let n = count * u64::from(elem);
    let pattern: [u8; 4] = match elem {
        1 => [value as u8; 4],
        2 => {
            let b = (value as u16).to_le_bytes();
            [b[0], b[1], b[0], b[1]]
        }
        _ => value.to_le_bytes(),
    };
    let mut phase = 0usize;
    for p in d.mem.resolve(dst, n, true, dev)? {
        // SAFETY: resolved, writable device piece kept alive by p.phys.
        let bytes =
            unsafe { std::slice::from_raw_parts_mut(p.phys.host_ptr(p.offset), p.len as usize) };
        fill_pattern(bytes, &pattern, phase);
        phase = (phase + bytes.len()) % 4;
    }
    Ok(())
}
