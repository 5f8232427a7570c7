//! One GPU in use ([`Device`]): its primary context, the kernels, the memory and
//! the host model of that memory (each allocation's value), and the launches of
//! `kiwi_fill`, `kiwi_add` and `kiwi_spin` over it. `grow:` phases add to it.

use std::ffi::c_void;

use crate::cu;
use crate::driver::{CUdevice, CUdeviceptr, Cuda, CudaError, Handle};
use crate::kernels::{Ptx, BLOCK, GRID};
use crate::memory::{self, AllocMode, Expandable, Source};

use super::Options;

/// splitmix64: the per-(burst, allocation) values derived from the seed.
pub fn mix(seed: u64, a: u64, b: u64) -> u32 {
    let mut z = seed
        .wrapping_add(a.wrapping_mul(0x9e37_79b9_7f4a_7c15))
        .wrapping_add(b.wrapping_mul(0xbf58_476d_1ce4_e5b9));
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    (z ^ (z >> 31)) as u32
}

/// Allocation sizes for `mem` bytes: three small ones, the rest in ≤ 256 MiB chunks
/// (all multiples of 4).
pub fn plan_allocations(mem: u64) -> Vec<u64> {
    const CHUNK: u64 = 256 << 20;
    const SMALL: u64 = 64 << 10;
    let mem = mem / 4 * 4;
    let mut out = Vec::new();
    let mut left = mem;
    if mem >= 4 * SMALL {
        out.extend(std::iter::repeat_n(SMALL, 3));
        left -= 3 * SMALL;
    }
    while left > 0 {
        let n = left.min(CHUNK);
        out.push(n);
        left -= n;
    }
    out
}

/// The four kernels, as loaded into one device's context.
pub(super) struct Kernels {
    pub(super) fill: Handle,
    pub(super) add: Handle,
    pub(super) checksum: Handle,
    pub(super) spin: Handle,
}

/// One allocation and its host model: every one of its `words` holds `value`.
pub(super) struct Allocation {
    pub(super) ptr: CUdeviceptr,
    pub(super) words: u64,
    pub(super) value: u32,
    pub(super) source: Source,
}

/// Launches `f` on the legacy stream, `grid` × `block` threads.
pub(super) fn launch(
    cuda: &Cuda,
    f: Handle,
    grid: u32,
    block: u32,
    args: &mut [*mut c_void],
) -> Result<(), CudaError> {
    cu!(
        cuda,
        launch_kernel,
        "cuLaunchKernel",
        f,
        grid,
        1,
        1,
        block,
        1,
        1,
        0,
        std::ptr::null_mut(),
        args.as_mut_ptr(),
        std::ptr::null_mut()
    )
}

/// A `kiwi_spin` of `ns` on the GPU.
pub(super) fn spin(cuda: &Cuda, k: &Kernels, ns: u64) -> Result<(), CudaError> {
    let mut ns = ns;
    launch(cuda, k.spin, 1, 1, &mut [(&mut ns as *mut u64).cast()])
}

/// `kiwi_fill` or `kiwi_add` (`f`) of `value` over every word of `a`.
pub(super) fn mem_kernel(
    cuda: &Cuda,
    f: Handle,
    a: &Allocation,
    value: u32,
) -> Result<(), CudaError> {
    let mut ptr = a.ptr;
    let mut v = value;
    let mut words = a.words;
    launch(
        cuda,
        f,
        GRID,
        BLOCK,
        &mut [
            (&mut ptr as *mut u64).cast(),
            (&mut v as *mut u32).cast(),
            (&mut words as *mut u64).cast(),
        ],
    )
}

/// Checksums every allocation of one device on the GPU and compares with the host
/// One GPU in use: its primary context, its copy of the module, its memory and
/// the host model of that memory.
pub(super) struct Device {
    pub(super) ordinal: i32,
    pub(super) dev: CUdevice,
    pub(super) ctx: Handle,
    pub(super) k: Kernels,
    pub(super) allocs: Vec<Allocation>,
    pub(super) sums: CUdeviceptr,
    /// `--prealloc`: the part of the preallocation past `--mem` (never touched).
    pub(super) tail: Option<(CUdeviceptr, u64)>,
    /// `--alloc vmm`: the device's application-managed address range.
    pub(super) space: Option<Expandable>,
}

/// Makes `d`'s context current. With one device it is current from the start
/// and stays so: no call is made (the single-device program is unchanged).
pub(super) fn make_current(cuda: &Cuda, devs: &[Device], d: &Device) -> Result<(), CudaError> {
    if devs.len() > 1 {
        cu!(cuda, ctx_set_current, "cuCtxSetCurrent", d.ctx)?;
    }
    Ok(())
}

/// `ordinal`'s device and a reference on its primary context (also `cuprobe`'s).
pub fn retain_primary(cuda: &Cuda, ordinal: i32) -> Result<(CUdevice, Handle), CudaError> {
    let mut dev = 0;
    cu!(cuda, device_get, "cuDeviceGet", &mut dev, ordinal)?;
    let mut ctx: Handle = std::ptr::null_mut();
    cu!(
        cuda,
        primary_ctx_retain,
        "cuDevicePrimaryCtxRetain",
        &mut ctx,
        dev
    )?;
    Ok((dev, ctx))
}

/// Retains `ordinal`'s primary context, makes it current, loads the module and
/// allocates and fills `--mem` bytes there. The allocations' values are numbered
/// from `first_index` (the allocations of earlier devices), so no two allocations
/// of the program hold the same value sequence.
pub(super) fn open_device(
    cuda: &Cuda,
    o: &Options,
    ordinal: i32,
    first_index: usize,
) -> Result<Device, CudaError> {
    let (dev, ctx) = retain_primary(cuda, ordinal)?;
    cu!(cuda, ctx_set_current, "cuCtxSetCurrent", ctx)?;
    let ptx = Ptx::load(cuda, o.library)?;
    let k = Kernels {
        fill: ptx.kernel(cuda, c"kiwi_fill")?,
        add: ptx.kernel(cuda, c"kiwi_add")?,
        checksum: ptx.kernel(cuda, c"kiwi_checksum")?,
        spin: ptx.kernel(cuda, c"kiwi_spin")?,
    };
    let mut tail = None;
    let pre = match o.prealloc {
        Some(f) => {
            let (mut free, mut total) = (0usize, 0usize);
            cu!(cuda, mem_get_info, "cuMemGetInfo_v2", &mut free, &mut total)?;
            let size = ((free as f64 * f) as u64 / 256 * 256).max(o.mem);
            let mut ptr = 0;
            cu!(cuda, mem_alloc, "cuMemAlloc_v2", &mut ptr, size as usize)?;
            tail = (size > o.mem).then(|| (ptr + o.mem, size - o.mem));
            vec![(ptr, o.mem)]
        }
        None => Vec::new(),
    };
    let planned = if pre.is_empty() {
        plan_allocations(o.mem)
    } else {
        Vec::new()
    };
    let mut space = match o.alloc {
        AllocMode::Vmm => Some(Expandable::new(cuda, ordinal, dev)?),
        _ => None,
    };
    let mut allocs = Vec::with_capacity(pre.len() + planned.len());
    for (i, &(ptr, bytes)) in pre.iter().enumerate() {
        allocs.push(Allocation {
            ptr,
            words: bytes / 4,
            value: mix(o.seed, 0, (first_index + i) as u64),
            source: Source::Device,
        });
    }
    for (i, &bytes) in planned.iter().enumerate() {
        let (ptr, source) = memory::allocate(cuda, o.alloc, space.as_mut(), bytes)?;
        allocs.push(Allocation {
            ptr,
            words: bytes / 4,
            value: mix(o.seed, 0, (first_index + i) as u64),
            source,
        });
    }
    let mut sums = 0;
    cu!(
        cuda,
        mem_alloc,
        "cuMemAlloc_v2",
        &mut sums,
        8 * allocs.len()
    )?;
    for a in &allocs {
        mem_kernel(cuda, k.fill, a, a.value)?;
    }
    Ok(Device {
        ordinal,
        dev,
        ctx,
        k,
        allocs,
        sums,
        tail,
        space,
    })
}

/// `--script grow:MIB`: `bytes` more on the first device, allocated in the chunks
/// of `--mem` and filled (each with its own value, checked by every verification);
/// the checksums' buffer grows with them.
pub(super) fn grow(
    cuda: &Cuda,
    o: &Options,
    devs: &mut [Device],
    bytes: u64,
) -> Result<(), CudaError> {
    let Some(first) = devs.first() else {
        return Ok(());
    };
    make_current(cuda, devs, first)?;
    let first_index: usize = devs.iter().map(|d| d.allocs.len()).sum();
    let d = &mut devs[0];
    for (index, chunk) in (first_index..).zip(plan_allocations(bytes)) {
        let (ptr, source) = memory::allocate(cuda, o.alloc, d.space.as_mut(), chunk)?;
        let a = Allocation {
            ptr,
            words: chunk / 4,
            value: mix(o.seed, 0, index as u64),
            source,
        };
        mem_kernel(cuda, d.k.fill, &a, a.value)?;
        d.allocs.push(a);
    }
    resize_sums(cuda, d)?;
    cu!(cuda, ctx_synchronize, "cuCtxSynchronize")
}

/// A new checksums' buffer for `d`'s allocations, which grew. Its context is current.
pub(super) fn resize_sums(cuda: &Cuda, d: &mut Device) -> Result<(), CudaError> {
    cu!(cuda, mem_free, "cuMemFree_v2", d.sums)?;
    cu!(
        cuda,
        mem_alloc,
        "cuMemAlloc_v2",
        &mut d.sums,
        8 * d.allocs.len()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocations_cover_the_memory() {
        for mem in [4096u64, 1 << 20, 700 << 20, (256 << 20) + 4] {
            let p = plan_allocations(mem);
            assert_eq!(p.iter().sum::<u64>(), mem / 4 * 4, "{mem}");
            assert!(p.iter().all(|&s| s <= 256 << 20 && s % 4 == 0 && s > 0));
        }
        assert_eq!(plan_allocations(700 << 20).len(), 6);
    }
}
