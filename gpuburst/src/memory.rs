//! How gpuburst allocates its memory (`--alloc`), and reading it back.
//!
//! - `device` (the default): one `cuMemAlloc` per allocation.
//! - `vmm`: the application manages its own virtual memory, as PyTorch's
//!   `expandable_segments` does: one address range reserved per device
//!   (`cuMemAddressReserve`, as large as the device's memory), grown by mapping
//!   physical handles of its own, [`SEGMENT`] bytes each (`cuMemCreate`, `cuMemMap`,
//!   `cuMemSetAccess` read-write for the device), as the allocations need them. The
//!   allocations are carved out of the range one after another, so a kernel over one
//!   of them crosses handles. A growth past the range reserves another.
//! - `managed`: one `cuMemAllocManaged(CU_MEM_ATTACH_GLOBAL)` per allocation. Its
//!   bytes are reachable from the host at the same address: verification also reads
//!   every word there ([`host_mismatch`]).
//!
//! This module owns the allocation calls and their undoing; what the allocations
//! hold (the values, the kernels) is `burst`'s.

use crate::cu;
use crate::driver::{
    CUdeviceptr, CUmemLocation, Cuda, CudaError, MemAccessDesc, MemAllocationProp,
};
use crate::driver::{
    CU_MEM_ACCESS_FLAGS_PROT_READWRITE, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED, CU_MEM_ATTACH_GLOBAL,
};

/// Bytes of each physical handle `--alloc vmm` maps: PyTorch's segment size for its
/// large pool (rounded up to the device's granularity).
pub const SEGMENT: u64 = 20 << 20;
/// Alignment of the allocations carved out of an expandable range.
const CARVE_ALIGN: u64 = 512;

/// `--alloc`: how the program's memory is allocated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AllocMode {
    #[default]
    Device,
    Vmm,
    Managed,
}

impl AllocMode {
    /// Parses `device`, `vmm` or `managed`.
    pub fn parse(s: &str) -> Result<AllocMode, String> {
        match s {
            "device" => Ok(AllocMode::Device),
            "vmm" => Ok(AllocMode::Vmm),
            "managed" => Ok(AllocMode::Managed),
            other => Err(format!(
                "--alloc: {other:?} is not one of device, vmm, managed"
            )),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            AllocMode::Device => "device",
            AllocMode::Vmm => "vmm",
            AllocMode::Managed => "managed",
        }
    }
}

/// Where one allocation's memory came from, which says how it is given back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// `cuMemAlloc` (also a `--prealloc` buffer).
    Device,
    /// Carved out of the device's [`Expandable`] range.
    Vmm,
    /// `cuMemAllocManaged`.
    Managed,
    /// `cuMemAlloc`, shared with an importer (`--ipc export:`): never changed.
    Exported,
    /// Another process's memory (`--ipc import:`): never changed, closed with
    /// `cuIpcCloseMemHandle`.
    Imported,
}

impl Source {
    /// Whether the program keeps its values as they are (shared memory: the
    /// importer only reads it, so neither side changes it).
    pub fn fixed(self) -> bool {
        matches!(self, Source::Exported | Source::Imported)
    }

    /// A word for messages.
    pub fn name(self) -> &'static str {
        match self {
            Source::Device => "cuMemAlloc",
            Source::Vmm => "cuMemCreate/cuMemMap",
            Source::Managed => "cuMemAllocManaged",
            Source::Exported => "cuMemAlloc, exported",
            Source::Imported => "cuIpcOpenMemHandle",
        }
    }
}

fn round_up(n: u64, to: u64) -> u64 {
    n.div_ceil(to) * to
}

/// One device's application-managed virtual memory (`--alloc vmm`).
pub struct Expandable {
    ordinal: i32,
    segment: u64,
    /// What each reservation is at least: the device's memory, as PyTorch reserves.
    reserve: u64,
    /// Reserved ranges (base, size); allocations come from the last one.
    ranges: Vec<(CUdeviceptr, u64)>,
    /// Mapped physical handles: (address, size, handle).
    handles: Vec<(CUdeviceptr, u64, u64)>,
    /// The next free byte of the last range.
    next: CUdeviceptr,
    /// The end of the last range's mapped part.
    mapped_end: CUdeviceptr,
}

impl Expandable {
    /// The device's space (nothing reserved yet). Its context must be current.
    pub fn new(cuda: &Cuda, ordinal: i32, device: i32) -> Result<Expandable, CudaError> {
        let prop = MemAllocationProp::device(ordinal);
        let mut g = 0usize;
        cu!(
            cuda,
            mem_get_allocation_granularity,
            "cuMemGetAllocationGranularity",
            &mut g,
            &prop,
            CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
        )?;
        let segment = round_up(SEGMENT, (g as u64).max(1));
        let mut total = 0usize;
        cu!(
            cuda,
            device_total_mem,
            "cuDeviceTotalMem_v2",
            &mut total,
            device
        )?;
        Ok(Expandable {
            ordinal,
            segment,
            reserve: round_up(total as u64, segment),
            ranges: Vec::new(),
            handles: Vec::new(),
            next: 0,
            mapped_end: 0,
        })
    }

    /// `bytes` more, mapping the handles they need; their address.
    pub fn alloc(&mut self, cuda: &Cuda, bytes: u64) -> Result<CUdeviceptr, CudaError> {
        let fits = |s: &Expandable| {
            s.ranges
                .last()
                .is_some_and(|&(base, size)| round_up(s.next, CARVE_ALIGN) + bytes <= base + size)
        };
        if !fits(self) {
            let size = round_up(bytes, self.segment).max(self.reserve);
            let mut base = 0;
            cu!(
                cuda,
                mem_address_reserve,
                "cuMemAddressReserve",
                &mut base,
                size as usize,
                0,
                0,
                0
            )?;
            self.ranges.push((base, size));
            self.next = base;
            self.mapped_end = base;
        }
        let start = round_up(self.next, CARVE_ALIGN);
        let end = start + bytes;
        while self.mapped_end < end {
            self.map_segment(cuda)?;
        }
        self.next = end;
        Ok(start)
    }

    /// Maps one more handle at the end of the last range's mapped part.
    fn map_segment(&mut self, cuda: &Cuda) -> Result<(), CudaError> {
        let prop = MemAllocationProp::device(self.ordinal);
        let size = self.segment;
        let mut h = 0u64;
        cu!(
            cuda,
            mem_create,
            "cuMemCreate",
            &mut h,
            size as usize,
            &prop,
            0
        )?;
        let at = self.mapped_end;
        if let Err(e) = cu!(cuda, mem_map, "cuMemMap", at, size as usize, 0, h, 0) {
            let _ = cu!(cuda, mem_release, "cuMemRelease", h);
            return Err(e);
        }
        self.handles.push((at, size, h));
        self.mapped_end += size;
        let access = MemAccessDesc {
            location: CUmemLocation::device(self.ordinal),
            flags: CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        cu!(
            cuda,
            mem_set_access,
            "cuMemSetAccess",
            at,
            size as usize,
            &access,
            1
        )
    }

    /// Bytes mapped (physical handles held).
    pub fn mapped(&self) -> u64 {
        self.handles.iter().map(|h| h.1).sum()
    }

    /// Unmaps and releases every handle, then frees the ranges (PyTorch's order).
    pub fn free(&mut self, cuda: &Cuda) -> Result<(), CudaError> {
        for (at, size, h) in self.handles.drain(..) {
            cu!(cuda, mem_unmap, "cuMemUnmap", at, size as usize)?;
            cu!(cuda, mem_release, "cuMemRelease", h)?;
        }
        for (base, size) in self.ranges.drain(..) {
            cu!(
                cuda,
                mem_address_free,
                "cuMemAddressFree",
                base,
                size as usize
            )?;
        }
        Ok(())
    }
}

/// Allocates `bytes` as `mode` says (`space`: the device's expandable range, for
/// `vmm`); the address and its source.
pub fn allocate(
    cuda: &Cuda,
    mode: AllocMode,
    space: Option<&mut Expandable>,
    bytes: u64,
) -> Result<(CUdeviceptr, Source), CudaError> {
    let mut ptr = 0;
    match (mode, space) {
        (AllocMode::Vmm, Some(s)) => return Ok((s.alloc(cuda, bytes)?, Source::Vmm)),
        (AllocMode::Managed, _) => {
            cu!(
                cuda,
                mem_alloc_managed,
                "cuMemAllocManaged",
                &mut ptr,
                bytes as usize,
                CU_MEM_ATTACH_GLOBAL
            )?;
            return Ok((ptr, Source::Managed));
        }
        _ => cu!(cuda, mem_alloc, "cuMemAlloc_v2", &mut ptr, bytes as usize)?,
    }
    Ok((ptr, Source::Device))
}

/// Gives back one allocation of `source` (a `Vmm` one goes with its range, an
/// `Imported` one is closed by `ipc`).
pub fn free(cuda: &Cuda, ptr: CUdeviceptr, source: Source) -> Result<(), CudaError> {
    match source {
        Source::Device | Source::Managed | Source::Exported => {
            cu!(cuda, mem_free, "cuMemFree_v2", ptr)
        }
        Source::Vmm | Source::Imported => Ok(()),
    }
}

/// Bytes read back from the device at a time when a checksum mismatch is located.
const LOCATE_CHUNK: u64 = 4 << 20;

/// The first word of `[ptr, ptr + 4·words)` that is not `value` (its index and what
/// it holds), read back with `cuMemcpyDtoH`; `None` when every word is.
pub fn locate(
    cuda: &Cuda,
    ptr: CUdeviceptr,
    words: u64,
    value: u32,
) -> Result<Option<(u64, u32)>, CudaError> {
    let mut buf = vec![0u32; (LOCATE_CHUNK / 4).min(words) as usize];
    let mut at = 0u64;
    while at < words {
        let n = (words - at).min(buf.len() as u64) as usize;
        cu!(
            cuda,
            memcpy_dtoh,
            "cuMemcpyDtoH",
            buf.as_mut_ptr().cast(),
            ptr + 4 * at,
            4 * n
        )?;
        if let Some(i) = buf[..n].iter().position(|&w| w != value) {
            return Ok(Some((at + i as u64, buf[i])));
        }
        at += n as u64;
    }
    Ok(None)
}

/// Managed memory read on the host, where it is reachable at its device address:
/// the first word of `[ptr, ptr + 4·words)` that is not `value` (its index and what
/// it holds); `None` when every word is. Compared a chunk at a time with a buffer of
/// the expected words (a `memcmp`), so that a debug build is fast too.
///
/// # Safety
/// `[ptr, ptr + 4·words)` is one live managed allocation of this process, and no
/// work that writes it is running on any device (the caller synchronized).
pub unsafe fn host_mismatch(ptr: CUdeviceptr, words: u64, value: u32) -> Option<(u64, u32)> {
    const CHUNK: usize = 1 << 18;
    let want = vec![value; CHUNK.min(words as usize)];
    let mut at = 0usize;
    while (at as u64) < words {
        let n = (words as usize - at).min(CHUNK);
        // SAFETY: inside the managed allocation (the caller's contract), which is
        // mapped read-write on the host at its device address and 4-byte aligned;
        // nothing writes it meanwhile.
        let got = unsafe { std::slice::from_raw_parts((ptr as *const u32).add(at), n) };
        if got != &want[..n] {
            let i = got.iter().zip(&want).position(|(g, w)| g != w).unwrap_or(0);
            return Some(((at + i) as u64, got[i]));
        }
        at += n;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_parse() {
        assert_eq!(AllocMode::parse("device"), Ok(AllocMode::Device));
        assert_eq!(AllocMode::parse("vmm"), Ok(AllocMode::Vmm));
        assert_eq!(AllocMode::parse("managed"), Ok(AllocMode::Managed));
        for bad in ["", "VMM", "unified", "device,vmm"] {
            let e = AllocMode::parse(bad).unwrap_err();
            assert!(e.starts_with("--alloc"), "{bad}: {e}");
        }
        for m in [AllocMode::Device, AllocMode::Vmm, AllocMode::Managed] {
            assert_eq!(AllocMode::parse(m.name()), Ok(m));
        }
    }

    #[test]
    fn a_host_mismatch_is_found_where_it_is() {
        let mut words = vec![7u32; (1 << 18) + 100];
        let ptr = words.as_ptr() as CUdeviceptr;
        // SAFETY: our own live buffer, unchanged during the call.
        assert_eq!(unsafe { host_mismatch(ptr, words.len() as u64, 7) }, None);
        words[(1 << 18) + 3] = 8;
        let ptr = words.as_ptr() as CUdeviceptr;
        // SAFETY: as above.
        let m = unsafe { host_mismatch(ptr, words.len() as u64, 7) };
        assert_eq!(m, Some(((1 << 18) + 3, 8)));
        // SAFETY: as above; a prefix of it.
        assert_eq!(unsafe { host_mismatch(ptr, 1 << 18, 7) }, None);
    }
}
