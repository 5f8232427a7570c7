//! Stream memory operations (`cuStreamWaitValue32/64`, `cuStreamWriteValue32/64`,
//! `cuStreamBatchMemOp`, their `_v2` and per-thread names): which the driver takes
//! at submission, and what the GPU does when the stream reaches one. A wait keeps
//! its stream busy until its condition on a word in memory holds; a write stores a
//! word. This is how NCCL and others make one GPU's stream wait for another's, with
//! no kernel.
//!
//! A wait reads the word as a GPU does, from the memory itself at every poll (an
//! atomic load, [`POLL`] apart, sleeping between): a word in host memory that
//! another process maps too (a `MAP_SHARED` file both registered with
//! `DEVICEMAP`), or in device memory another process imported, is seen once that
//! process stores it, by a CPU store or its own stream's write. A write is an atomic
//! store with release ordering, after a full fence unless the v1 API's
//! `CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER` asked for none.
//!
//! What the driver takes (Driver API reference, "Stream Memory Operations";
//! `cuda.h` 12.9): the word aligned to its size; device memory of the stream's
//! context (not managed memory), a VMM mapping the stream's device may access
//! (imported ones included), or host memory allocated or registered with
//! `DEVICEMAP`, addressed by its device pointer (`cuMemHostGetDevicePointer`: the
//! host pointer here). Everything else, and any flag bit but the documented ones, is
//! `CUDA_ERROR_INVALID_VALUE`. The v1 entry points (`cuStreamWaitValue32` without
//! `_v2`) need the kernel module parameter `NVreg_EnableStreamMemOPs=1`; the
//! simulated machine has the default (off), so they are `CUDA_ERROR_NOT_SUPPORTED`
//! ([`V1_ENABLED`]), as on a stock driver, while the v2 API needs nothing.
//!
//! Below the executors (`crate::exec` runs the operations, `crate::stream` builds
//! them) and over the device address space (`crate::memory`).

use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use crate::abi::*;
use crate::hw::Hw;
use crate::memory::{Fault, Memory};

/// How long a wait sleeps between two reads of its word: short next to what the
/// operations it orders take (a copy, a kernel), long enough that a waiting stream
/// costs its executor thread almost no CPU.
pub const POLL: Duration = Duration::from_micros(50);

/// Whether the v1 entry points work: the driver's `NVreg_EnableStreamMemOPs`, off
/// by default (then `CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1` reads 0 and
/// every v1 call is `CUDA_ERROR_NOT_SUPPORTED`: NVIDIA/Fuser#3907 met it on a
/// driver 550 H100 with a `cuStreamWriteValue32` found by `dlsym`). The v2 API,
/// what `cuda.h` 12 names and `cuGetProcAddress` gives from CUDA 11.7 on, always
/// works.
pub const V1_ENABLED: bool = false;

/// `cuStreamBatchMemOp` takes fewer operations than this ("Must be less than 256").
pub const BATCH_LIMIT: u32 = 256;

/// Which API a call came through.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Api {
    /// `cuStreamWaitValue32`, ... (CUDA 8.0).
    V1,
    /// `cuStreamWaitValue32_v2`, ... (CUDA 11.7; plain `cuStreamWaitValue32` in
    /// `cuda.h` 12).
    V2,
}

/// The stream a memory operation is submitted to: its device and context.
#[derive(Clone, Copy, Debug)]
pub struct Submitter {
    pub device: u32,
    /// The context's handle (`CUcontext`).
    pub ctx: usize,
}

/// The word a memory operation reads or writes, as checked at submission.
#[derive(Clone, Copy, Debug)]
pub struct Word {
    /// Its device address (for mapped host memory, the host address).
    pub addr: u64,
    /// 8 bytes (`*Value64`), else 4.
    pub wide: bool,
    /// Host memory mapped into the device (`DEVICEMAP`); else device memory.
    pub host: bool,
}

impl Word {
    fn size(self) -> u64 {
        if self.wide {
            8
        } else {
            4
        }
    }

    /// The bits a value of this width has.
    fn mask(self) -> u64 {
        if self.wide {
            u64::MAX
        } else {
            u64::from(u32::MAX)
        }
    }
}

/// A wait's condition (`CUstreamWaitValue_flags`, the low bits).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cond {
    /// `(int32_t)(*addr - value) >= 0` (`int64_t` for 64-bit words): a cyclic
    /// greater-or-equal.
    Geq,
    /// `*addr == value`.
    Eq,
    /// `(*addr & value) != 0`.
    And,
    /// `~(*addr | value) != 0`.
    Nor,
}

impl Cond {
    /// Whether the condition holds for the word's current value (both of the word's
    /// width).
    fn holds(self, current: u64, value: u64, word: Word) -> bool {
        match self {
            Cond::Geq if word.wide => current.wrapping_sub(value) as i64 >= 0,
            Cond::Geq => (current as u32).wrapping_sub(value as u32) as i32 >= 0,
            Cond::Eq => current == value,
            Cond::And => current & value != 0,
            Cond::Nor => !(current | value) & word.mask() != 0,
        }
    }
}

/// One stream memory operation.
#[derive(Clone, Copy, Debug)]
pub enum MemOp {
    /// The stream waits until `cond` holds for the word.
    Wait { word: Word, value: u64, cond: Cond },
    /// Stores `value`; `barrier`: after a full fence (the default).
    Write {
        word: Word,
        value: u64,
        barrier: bool,
    },
    /// `CU_STREAM_MEM_OP_FLUSH_REMOTE_WRITES`, `CU_STREAM_MEM_OP_BARRIER`: a full
    /// fence (the stream's earlier writes are visible before its later ones).
    Fence,
}

/// Checks the word a memory operation names: aligned to its size, and memory the
/// submitting stream's device may reach (see the module's documentation). Returns
/// it with `value` taken at its width.
fn word(
    mem: &Memory,
    by: Submitter,
    addr: u64,
    value: u64,
    wide: bool,
    write: bool,
) -> Result<(Word, u64), CUresult> {
    let mut w = Word {
        addr,
        wide,
        host: false,
    };
    if addr == 0 || !addr.is_multiple_of(w.size()) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    if mem.is_device_address(addr) {
        let info = mem.pointer_info(addr).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        // `cuMemAlloc*` memory has an owner: it must be the stream's context, on
        // its device. VMM mappings (owner 0) say which devices may reach them.
        let foreign = info.owner != 0 && (info.owner != by.ctx || info.gpu != by.device);
        if info.managed || foreign {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        mem.resolve(addr, w.size(), write, by.device)
            .map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
    } else {
        match mem.host.map(addr as usize, w.size() as usize) {
            Some(m) if m.device_map && !(write && m.read_only) => w.host = true,
            _ => return Err(CUDA_ERROR_INVALID_VALUE),
        }
    }
    Ok((w, value & w.mask()))
}

/// `cuStreamWaitValue32/64`: a wait on the word at `addr` (`value` is taken at the
/// word's width).
pub fn wait(
    mem: &Memory,
    by: Submitter,
    addr: u64,
    value: u64,
    flags: u32,
    wide: bool,
) -> Result<MemOp, CUresult> {
    // The flush bit is taken: the simulated device reports
    // CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES, and its writes are never
    // reordered, so a wait's flush has nothing more to do.
    let cond = match flags & !CU_STREAM_WAIT_VALUE_FLUSH {
        CU_STREAM_WAIT_VALUE_GEQ => Cond::Geq,
        CU_STREAM_WAIT_VALUE_EQ => Cond::Eq,
        CU_STREAM_WAIT_VALUE_AND => Cond::And,
        CU_STREAM_WAIT_VALUE_NOR => Cond::Nor,
        _ => return Err(CUDA_ERROR_INVALID_VALUE),
    };
    let (word, value) = word(mem, by, addr, value, wide, false)?;
    Ok(MemOp::Wait { word, value, cond })
}

/// `cuStreamWriteValue32/64`: a store of `value` (at the word's width) to `addr`.
/// `CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER` is the v1 API's only ("This flag is
/// not supported in the v2 API", `cuda.h`).
pub fn write(
    mem: &Memory,
    by: Submitter,
    addr: u64,
    value: u64,
    flags: u32,
    wide: bool,
    api: Api,
) -> Result<MemOp, CUresult> {
    let barrier = match (flags, api) {
        (CU_STREAM_WRITE_VALUE_DEFAULT, _) => true,
        (CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER, Api::V1) => false,
        _ => return Err(CUDA_ERROR_INVALID_VALUE),
    };
    let (word, value) = word(mem, by, addr, value, wide, true)?;
    Ok(MemOp::Write {
        word,
        value,
        barrier,
    })
}

/// One entry of a `cuStreamBatchMemOp` array: the single calls' rules for waits and
/// writes; a flush takes no flags; a barrier (v2 only) is system- or GPU-scoped;
/// any other operation is `CUDA_ERROR_INVALID_VALUE`.
pub fn batch_entry(
    mem: &Memory,
    by: Submitter,
    p: &CUstreamBatchMemOpParams,
    api: Api,
) -> Result<MemOp, CUresult> {
    match p.operation {
        CU_STREAM_MEM_OP_WAIT_VALUE_32 => wait(mem, by, p.address, p.value, p.flags, false),
        CU_STREAM_MEM_OP_WAIT_VALUE_64 => wait(mem, by, p.address, p.value, p.flags, true),
        CU_STREAM_MEM_OP_WRITE_VALUE_32 => write(mem, by, p.address, p.value, p.flags, false, api),
        CU_STREAM_MEM_OP_WRITE_VALUE_64 => write(mem, by, p.address, p.value, p.flags, true, api),
        CU_STREAM_MEM_OP_FLUSH_REMOTE_WRITES if p.op_flags == 0 => Ok(MemOp::Fence),
        CU_STREAM_MEM_OP_BARRIER
            if api == Api::V2
                && matches!(
                    p.op_flags,
                    CU_STREAM_MEMORY_BARRIER_TYPE_SYS | CU_STREAM_MEMORY_BARRIER_TYPE_GPU
                ) =>
        {
            Ok(MemOp::Fence)
        }
        _ => Err(CUDA_ERROR_INVALID_VALUE),
    }
}

/// Runs `op` for a stream of device `dev` when the stream reaches it. A wait
/// returns once its condition holds, or early when `broken()` says the context
/// failed (a GPU abandons a faulted context's work). A word whose memory went away
/// since submission (freed, unmapped, unregistered) is a fault, as for a kernel.
pub fn run(hw: &Hw, dev: u32, op: &MemOp, broken: &dyn Fn() -> bool) -> Result<(), Fault> {
    match *op {
        MemOp::Wait { word, value, cond } => loop {
            if cond.holds(load(hw, dev, word)?, value, word) || broken() {
                return Ok(());
            }
            std::thread::sleep(POLL);
        },
        MemOp::Write {
            word,
            value,
            barrier,
        } => {
            if barrier {
                fence(Ordering::SeqCst);
            }
            store(hw, dev, word, value)
        }
        MemOp::Fence => {
            fence(Ordering::SeqCst);
            Ok(())
        }
    }
}

/// Runs `f` on the address where this process reaches `word`'s bytes, while they
/// stay there: the device's view of mapped host memory (its pages, even if the
/// process unmapped them, see `HostRanges::with_mapped`) under the host registry,
/// or device memory's backing, holding the resolved piece.
fn with_word<R>(
    hw: &Hw,
    dev: u32,
    word: Word,
    write: bool,
    f: impl FnOnce(*mut u8) -> R,
) -> Result<R, Fault> {
    if word.host {
        let len = word.size() as usize;
        return hw
            .mem
            .host
            .with_mapped(word.addr as usize, len, write, f)
            .ok_or(Fault::Unmapped);
    }
    let pieces = hw.mem.resolve(word.addr, word.size(), write, dev)?;
    // An aligned word never straddles two mappings (they start on 2 MiB boundaries).
    match pieces.as_slice() {
        [p] if p.len == word.size() => Ok(f(p.phys.host_ptr(p.offset))),
        _ => Err(Fault::Unmapped),
    }
}

/// The word's current value (acquire: what its writer stored before it is visible
/// to the work after the wait).
fn load(hw: &Hw, dev: u32, word: Word) -> Result<u64, Fault> {
    with_word(hw, dev, word, false, |p| {
        debug_assert!((p as usize).is_multiple_of(word.size() as usize));
        if word.wide {
            // SAFETY: `p` is where this process reaches the word, aligned to 8
            // (device memory is at least 512-byte aligned in its backing and the
            // word's address was checked at submission; mapped host memory is at
            // its own address or at the same offset in a page-aligned alias), and
            // stays mapped while `with_word` runs this. Other processes and threads
            // access it only atomically or through the CPU's coherent stores.
            unsafe { AtomicU64::from_ptr(p.cast()).load(Ordering::Acquire) }
        } else {
            // SAFETY: as above, aligned to 4.
            u64::from(unsafe { AtomicU32::from_ptr(p.cast()).load(Ordering::Acquire) })
        }
    })
}

/// Stores `value` in the word (release: the stream's earlier work is visible to
/// whoever sees the value).
fn store(hw: &Hw, dev: u32, word: Word, value: u64) -> Result<(), Fault> {
    with_word(hw, dev, word, true, |p| {
        debug_assert!((p as usize).is_multiple_of(word.size() as usize));
        if word.wide {
            // SAFETY: as in `load`; the word is writable by the device (checked at
            // submission and again by `with_word`).
            unsafe { AtomicU64::from_ptr(p.cast()).store(value, Ordering::Release) }
        } else {
            // SAFETY: as above, aligned to 4.
            unsafe { AtomicU32::from_ptr(p.cast()).store(value as u32, Ordering::Release) }
        }
    })
}
