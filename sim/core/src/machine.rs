//! The simulated machine: one named shared-memory segment per `KIWI_SIM_NAME`.
//!
//! The segment (`/dev/shm/kiwi-sim-<name>`) makes a simulated GPU the *same* GPU for
//! every process naming it. Per GPU it holds the capacity, a table of per-process use
//! (pid + process start time, so a reused pid is not mistaken for the old process)
//! and a fault flag. Every change happens under an exclusive `flock` on the segment
//! file, so the kernel releases the lock if its holder dies; entries of dead processes
//! are reclaimed before an allocation is refused and whenever use is read, as a real
//! driver frees the memory of a killed process.
//!
//! Kernels of different processes on one GPU never overlap: [`Machine::kernel_lock`]
//! takes a per-process mutex and then an `flock` on `kiwi-sim-<name>.gpu<N>.lock`.
//!
//! Each GPU has one PCIe link, full duplex: per direction, the time until which the
//! copies already queued keep it busy ([`Machine::link_reserve`]), shared by every
//! process, so concurrent copies in one direction share its bandwidth.
//!
//! Device memory contents live in one file per GPU next to the segment,
//! `kiwi-sim-<name>.gpu<N>.mem` (sparse, created with the segment, removed by
//! [`reset`]): a GPU's memory exists before anyone allocates it and is no process's
//! memory. The segment keeps the allocator of that file: per GPU a table of 2 MiB
//! granules, each free or owned by a process (pid + start time, as the usage table's
//! entries), handed out as extents ([`Machine::extent_alloc`]) and reclaimed when
//! their owner is dead. Freed granules keep their pages, so the next allocation
//! reuses populated memory; [`Machine::populate`] fills a GPU's file ahead.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

use crate::knobs::{validate_name, SimConfig, MAX_GPUS};

mod extents;

/// Most processes one simulated GPU tracks at once.
pub const MAX_PROCS: usize = 256;
const MAGIC: u64 = 0x4b49_5749_5349_4d31; // "KIWISIM1"
const LAYOUT_VERSION: u64 = 8;

/// Errors of the machine segment.
#[derive(Debug, thiserror::Error)]
pub enum MachineError {
    #[error("out of memory on simulated GPU {gpu}: {requested} bytes requested, {free} of {capacity} free")]
    OutOfMemory {
        gpu: u32,
        requested: u64,
        free: u64,
        capacity: u64,
    },
    #[error("simulated GPU {gpu} does not exist (the machine has {count})")]
    NoSuchGpu { gpu: u32, count: u32 },
    #[error("simulated GPU {0} tracks too many processes")]
    TooManyProcesses(u32),
    #[error("invalid machine name {name:?}: {reason}")]
    BadName { name: String, reason: String },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the memory file of simulated GPU {gpu} has no {granules} free granules of 2 MiB")]
    FileFull { gpu: u32, granules: u64 },
    #[error("{0}: not a Kiwi simulator segment (or another layout version); remove it with `kiwi-sim reset`")]
    Corrupt(PathBuf),
}

#[repr(C)]
struct ProcSlot {
    pid: AtomicU64,
    start_time: AtomicU64,
    bytes: AtomicU64,
}

#[repr(C)]
struct GpuSlot {
    capacity: AtomicU64,
    fault_xid: AtomicU64,
    fault_lost: AtomicU64,
    fault_generation: AtomicU64,
    /// The most physical memory ever in use at once (all processes), so tests can
    /// check a GPU was never oversubscribed.
    peak: AtomicU64,
    /// Processes blocked on the kernel lock right now, and kernels started so far:
    /// the kernel lock's fairness (see [`Machine::kernel_lock`]).
    kernel_waiters: AtomicU64,
    kernel_turns: AtomicU64,
    /// Per [`LinkDir`]: the `CLOCK_MONOTONIC` ns until which the link's direction is
    /// busy with the copies reserved so far (see [`Machine::link_reserve`]).
    link_busy_until: [AtomicU64; 2],
    procs: [ProcSlot; MAX_PROCS],
    /// Granules of the GPU's memory file, and where their table (one `AtomicU16`
    /// each: 0 free, else 1 + the index of its owner in `owners`) starts, in bytes
    /// from the segment's start.
    granules: AtomicU64,
    granule_table: AtomicU64,
    /// Processes owning granules (`bytes` counts their granules).
    owners: [ProcSlot; MAX_PROCS],
}

#[repr(C)]
struct Segment {
    magic: AtomicU64,
    version: AtomicU64,
    gpus: AtomicU64,
    pcie_bits: AtomicU64,
    hbm_bits: AtomicU64,
    /// Device memory each context costs (`KIWI_SIM_CONTEXT_MEMORY`), in bytes.
    context_bytes: AtomicU64,
    /// Length of the segment file: this struct and the granule tables after it.
    total_len: AtomicU64,
    /// `CLOCK_MONOTONIC` ns of the last open, extent taken or given back, or
    /// populate: how long the machine has been idle (see [`sweep_idle_machines`]).
    last_active: AtomicU64,
    gpu: [GpuSlot; MAX_GPUS as usize],
}

/// Granules in the memory file of a GPU of `capacity` bytes: twice the capacity's
/// (sub-allocations and allocations rounded up to whole granules must never run out
/// before the capacity does; the file is sparse, only touched pages cost) and a few
/// more for the processes' small-allocation granules.
pub fn file_granules(capacity: u64) -> u64 {
    2 * capacity.div_ceil(crate::GRANULARITY) + 16
}

/// Settings fixed when the segment was created (they win over later processes' knobs).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MachineSettings {
    pub gpus: u32,
    pub pcie_gbps: f64,
    pub hbm_gbps: f64,
    /// Device memory each context costs, in bytes.
    pub context_memory: u64,
}

/// One process's use of a GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcessUsage {
    pub pid: u32,
    pub bytes: u64,
}

/// A GPU's capacity and use, after dead processes were reclaimed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuUsage {
    pub capacity: u64,
    pub used: u64,
    /// The most ever in use at once since the machine was created.
    pub peak: u64,
    pub processes: Vec<ProcessUsage>,
}

impl GpuUsage {
    pub fn free(&self) -> u64 {
        self.capacity.saturating_sub(self.used)
    }
}

/// A direction of a GPU's PCIe link (full duplex: the two never wait for each other).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkDir {
    HostToDevice = 0,
    DeviceToHost = 1,
}

/// A GPU's fault flag, as `kiwi-sim fault` sets it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FaultState {
    /// Xid of the last fault (0: none).
    pub xid: u64,
    /// The GPU is lost ("fallen off the bus"): NVML refuses handles for it.
    pub lost: bool,
    /// Bumped on every `set_fault`, so event waiters see each fault once.
    pub generation: u64,
}

/// A mapped machine segment.
pub struct Machine {
    name: String,
    path: PathBuf,
    file: File,
    seg: *const Segment,
    /// Length of the mapping at `seg` (the whole segment file).
    seg_len: usize,
    kernel_locks: Vec<KernelLock>,
    /// Each GPU's memory file.
    mem_files: Vec<File>,
    me: (u64, u64),
}

// SAFETY: the mapping is shared memory accessed only through atomics; the pointer
// stays valid for the life of `Machine` (unmapped in Drop).
unsafe impl Send for Machine {}
// SAFETY: as above, all access to the segment goes through atomics.
unsafe impl Sync for Machine {}

struct KernelLock {
    in_process: Mutex<()>,
    file: File,
    /// The turn (`GpuSlot::kernel_turns`) of this process's last kernel.
    last_turn: AtomicU64,
}

/// Held while a kernel runs; releases the GPU's cross-process lock on drop.
pub struct KernelGuard<'a> {
    _in_process: MutexGuard<'a, ()>,
    fd: i32,
    turn: u64,
    last_turn: &'a AtomicU64,
}

impl Drop for KernelGuard<'_> {
    fn drop(&mut self) {
        self.last_turn.store(self.turn, Ordering::SeqCst);
        // SAFETY: fd belongs to the Machine that outlives this guard.
        unsafe { libc::flock(self.fd, libc::LOCK_UN) };
    }
}

/// How long a process that just ran a kernel lets a waiting process go first at most
/// (a waiter that died blocked leaves its count behind: this bounds what it costs).
const KERNEL_HANDOFF_WAIT: std::time::Duration = std::time::Duration::from_millis(2);

/// `madvise` advice (Linux 5.14): fault the range in writable now.
pub const MADV_POPULATE_WRITE: libc::c_int = 23;

/// Where segments live (tmpfs, like POSIX shm_open).
pub const SHM_DIR: &str = "/dev/shm";

/// Path of the segment for machine `name`.
pub fn segment_path(name: &str) -> PathBuf {
    Path::new(SHM_DIR).join(format!("kiwi-sim-{name}"))
}

/// Path of the socket through which process `pid` (as its own pid namespace numbers
/// it) of machine `name` serves the driver's checkpoint API (see `sim/cuda`'s
/// `checkpoint` module); another process reaches it under `/proc/<pid>/root`.
pub fn checkpoint_socket_path(name: &str, pid: u32) -> PathBuf {
    Path::new(SHM_DIR).join(format!("kiwi-sim-{name}.ckpt.{pid}"))
}

/// Path of the file holding the device memory of GPU `gpu` of machine `name`.
pub fn mem_file_path(name: &str, gpu: u32) -> PathBuf {
    Path::new(SHM_DIR).join(format!("kiwi-sim-{name}.gpu{gpu}.mem"))
}

fn kernel_lock_path(name: &str, gpu: u32) -> PathBuf {
    Path::new(SHM_DIR).join(format!("kiwi-sim-{name}.gpu{gpu}.lock"))
}

/// Start time (clock ticks since boot) of `pid`, or None if it no longer exists.
pub fn process_start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Field 2 (comm) may contain spaces and parentheses: split after the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    // rest starts at field 3 (state); starttime is field 22.
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // A zombie has exited: its memory is gone on a real GPU too.
    if fields.first() == Some(&"Z") {
        return None;
    }
    fields.get(19)?.parse().ok()
}

struct FileLock<'a>(&'a File);

impl<'a> FileLock<'a> {
    fn exclusive(f: &'a File) -> FileLock<'a> {
        loop {
            // SAFETY: a valid open fd; flock has no memory effects.
            let r = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) };
            if r == 0 || std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
                return FileLock(f);
            }
        }
    }
}

impl Drop for FileLock<'_> {
    fn drop(&mut self) {
        // SAFETY: a valid open fd.
        unsafe { libc::flock(self.0.as_raw_fd(), libc::LOCK_UN) };
    }
}

impl Machine {
    /// Opens machine `cfg.name`, creating it with `cfg`'s knobs if it does not exist.
    pub fn open(cfg: &SimConfig) -> Result<Machine, MachineError> {
        let (m, fresh) = Self::open_inner(&cfg.name, Some(cfg))?;
        m.touch();
        if fresh {
            sweep_idle_machines(&cfg.name);
        }
        Ok(m)
    }

    /// Opens an existing machine; `Ok(None)` when no process has created it yet.
    pub fn open_existing(name: &str) -> Result<Option<Machine>, MachineError> {
        validate_name(name).map_err(|reason| MachineError::BadName {
            name: name.into(),
            reason,
        })?;
        if !segment_path(name).exists() {
            return Ok(None);
        }
        let (m, _) = Self::open_inner(name, None)?;
        m.touch();
        Ok(Some(m))
    }

    fn open_inner(name: &str, create: Option<&SimConfig>) -> Result<(Machine, bool), MachineError> {
        validate_name(name).map_err(|reason| MachineError::BadName {
            name: name.into(),
            reason,
        })?;
        let path = segment_path(name);
        let io = |source| MachineError::Io {
            path: path.clone(),
            source,
        };
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(create.is_some())
            .truncate(false)
            .mode(0o666)
            .open(&path)
            .map_err(io)?;
        let head = std::mem::size_of::<Segment>();
        let mut mem_files = Vec::new();
        let fresh_machine;
        let (seg, seg_len) = {
            let _lock = FileLock::exclusive(&file);
            let len = file.metadata().map_err(io)?.len();
            let fresh = len == 0;
            fresh_machine = fresh;
            let total = match create {
                Some(cfg) if fresh => {
                    let tables: u64 = (0..cfg.gpus).map(|_| 2 * file_granules(cfg.memory)).sum();
                    (head as u64 + tables).next_multiple_of(8)
                }
                None if fresh => return Err(MachineError::Corrupt(path)),
                _ if len < head as u64 => return Err(MachineError::Corrupt(path)),
                _ => len,
            };
            if fresh {
                file.set_len(total).map_err(io)?;
                // umask may have narrowed the mode; other users' processes share it.
                // SAFETY: valid fd.
                unsafe { libc::fchmod(file.as_raw_fd(), 0o666) };
            }
            // SAFETY: mapping a file we hold open, of exactly `total` bytes, shared.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    total as usize,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED,
                    file.as_raw_fd(),
                    0,
                )
            };
            if p == libc::MAP_FAILED {
                return Err(io(std::io::Error::last_os_error()));
            }
            let seg = p as *const Segment;
            // SAFETY: the mapping is valid, aligned (page) and at least `head` long.
            let s = unsafe { &*seg };
            if fresh {
                let cfg = create.expect("checked above");
                s.gpus.store(u64::from(cfg.gpus), Ordering::SeqCst);
                s.pcie_bits.store(cfg.pcie_gbps.to_bits(), Ordering::SeqCst);
                s.hbm_bits.store(cfg.hbm_gbps.to_bits(), Ordering::SeqCst);
                s.context_bytes.store(cfg.context_memory, Ordering::SeqCst);
                s.total_len.store(total, Ordering::SeqCst);
                let mut table = head as u64;
                for g in 0..cfg.gpus as usize {
                    let granules = file_granules(cfg.memory);
                    s.gpu[g].capacity.store(cfg.memory, Ordering::SeqCst);
                    s.gpu[g].granules.store(granules, Ordering::SeqCst);
                    s.gpu[g].granule_table.store(table, Ordering::SeqCst);
                    table += 2 * granules;
                }
                s.version.store(LAYOUT_VERSION, Ordering::SeqCst);
                s.magic.store(MAGIC, Ordering::SeqCst);
            } else if s.magic.load(Ordering::SeqCst) != MAGIC
                || s.version.load(Ordering::SeqCst) != LAYOUT_VERSION
                || s.total_len.load(Ordering::SeqCst) != total
                || s.gpus.load(Ordering::SeqCst) > u64::from(MAX_GPUS)
                || s.gpu.iter().any(|g| {
                    let end = g
                        .granules
                        .load(Ordering::SeqCst)
                        .saturating_mul(2)
                        .saturating_add(g.granule_table.load(Ordering::SeqCst));
                    end > total
                })
            {
                // SAFETY: unmapping what we just mapped.
                unsafe { libc::munmap(p, total as usize) };
                return Err(MachineError::Corrupt(path));
            }
            // Each GPU's memory file: made (sparse, empty) with the segment, so a
            // machine created anew never sees an older one's pages or owners.
            let unmap = || {
                // SAFETY: unmapping what we just mapped; nothing else refers to it.
                unsafe { libc::munmap(p, total as usize) };
            };
            for g in 0..s.gpus.load(Ordering::SeqCst) as u32 {
                let mp = mem_file_path(name, g);
                let f = OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create(fresh)
                    .truncate(false)
                    .mode(0o666)
                    .open(&mp);
                let f = match f {
                    Ok(f) => f,
                    Err(source) => {
                        unmap();
                        return Err(MachineError::Io { path: mp, source });
                    }
                };
                if fresh {
                    let bytes =
                        s.gpu[g as usize].granules.load(Ordering::SeqCst) * crate::GRANULARITY;
                    let sized = f.set_len(0).and_then(|()| f.set_len(bytes));
                    if let Err(source) = sized {
                        unmap();
                        return Err(MachineError::Io { path: mp, source });
                    }
                    // SAFETY: valid fd.
                    unsafe { libc::fchmod(f.as_raw_fd(), 0o666) };
                }
                mem_files.push(f);
            }
            (seg, total as usize)
        };
        // SAFETY: seg valid as above.
        let gpus = unsafe { &*seg }.gpus.load(Ordering::SeqCst) as u32;
        let mut kernel_locks = Vec::new();
        for g in 0..gpus {
            let lp = kernel_lock_path(name, g);
            let f = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .mode(0o666)
                .open(&lp)
                .map_err(|source| MachineError::Io { path: lp, source })?;
            kernel_locks.push(KernelLock {
                in_process: Mutex::new(()),
                file: f,
                last_turn: AtomicU64::new(u64::MAX),
            });
        }
        let pid = std::process::id();
        let me = (u64::from(pid), process_start_time(pid).unwrap_or(0));
        let m = Machine {
            name: name.to_string(),
            path,
            file,
            seg,
            seg_len,
            kernel_locks,
            mem_files,
            me,
        };
        Ok((m, fresh_machine))
    }

    /// [`Machine::open_existing`] without stamping the machine active.
    fn open_existing_quiet(name: &str) -> Result<Option<Machine>, MachineError> {
        if !segment_path(name).exists() {
            return Ok(None);
        }
        Ok(Some(Self::open_inner(name, None)?.0))
    }

    /// See [`sweep_idle_machines`].
    fn punch_if_idle(&self) {
        let _lock = FileLock::exclusive(&self.file);
        let idle = crate::trace::monotonic_ns()
            .saturating_sub(self.seg().last_active.load(Ordering::Relaxed));
        if idle < IDLE_SWEEP_NS {
            return;
        }
        for g in 0..self.gpu_count() {
            let Ok(slot) = self.gpu(g) else { return };
            if Self::collect_garbage(slot) > 0 || self.collect_dead_owners(g, slot) > 0 {
                return;
            }
        }
        for (g, f) in self.mem_files.iter().enumerate() {
            let len = self.seg().gpu[g].granules.load(Ordering::Relaxed) * crate::GRANULARITY;
            // SAFETY: fallocate on a file we hold open; punching a hole frees its
            // pages (reads give zeros), and no living process holds memory there.
            unsafe {
                libc::fallocate(
                    f.as_raw_fd(),
                    libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                    0,
                    len as libc::off_t,
                )
            };
        }
    }

    fn seg(&self) -> &Segment {
        // SAFETY: valid for the life of self (see Machine::open).
        unsafe { &*self.seg }
    }

    /// The machine's name (`KIWI_SIM_NAME`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Path of the segment file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Number of simulated GPUs.
    pub fn gpu_count(&self) -> u32 {
        self.seg().gpus.load(Ordering::Relaxed) as u32
    }

    /// GPUs and bandwidths fixed at creation.
    pub fn settings(&self) -> MachineSettings {
        let s = self.seg();
        MachineSettings {
            gpus: self.gpu_count(),
            pcie_gbps: f64::from_bits(s.pcie_bits.load(Ordering::Relaxed)),
            hbm_gbps: f64::from_bits(s.hbm_bits.load(Ordering::Relaxed)),
            context_memory: s.context_bytes.load(Ordering::Relaxed),
        }
    }

    fn gpu(&self, gpu: u32) -> Result<&GpuSlot, MachineError> {
        let count = self.gpu_count();
        if gpu >= count {
            return Err(MachineError::NoSuchGpu { gpu, count });
        }
        Ok(&self.seg().gpu[gpu as usize])
    }

    /// Capacity of `gpu` in bytes.
    pub fn capacity(&self, gpu: u32) -> Result<u64, MachineError> {
        Ok(self.gpu(gpu)?.capacity.load(Ordering::Relaxed))
    }

    /// Frees the slots of processes that no longer exist; returns bytes in use after.
    fn collect_garbage(slot: &GpuSlot) -> u64 {
        let mut used = 0;
        for p in &slot.procs {
            let pid = p.pid.load(Ordering::Relaxed);
            if pid == 0 {
                continue;
            }
            let alive = u32::try_from(pid)
                .ok()
                .and_then(process_start_time)
                .is_some_and(|t| t == p.start_time.load(Ordering::Relaxed));
            if alive {
                used += p.bytes.load(Ordering::Relaxed);
            } else {
                p.bytes.store(0, Ordering::Relaxed);
                p.start_time.store(0, Ordering::Relaxed);
                p.pid.store(0, Ordering::Relaxed);
            }
        }
        used
    }

    /// Accounts `bytes` of physical memory on `gpu` to this process, or refuses with
    /// `OutOfMemory` when the GPU (all processes together) cannot hold them.
    pub fn reserve(&self, gpu: u32, bytes: u64) -> Result<(), MachineError> {
        let slot = self.gpu(gpu)?;
        let _lock = FileLock::exclusive(&self.file);
        let capacity = slot.capacity.load(Ordering::Relaxed);
        let fits = |used: u64| used.checked_add(bytes).is_some_and(|t| t <= capacity);
        // Fast path without /proc lookups; dead processes are reclaimed only when
        // the allocation would otherwise be refused.
        let mut used: u64 = slot
            .procs
            .iter()
            .map(|p| p.bytes.load(Ordering::Relaxed))
            .sum();
        if !fits(used) {
            used = Self::collect_garbage(slot);
        }
        if !fits(used) {
            return Err(MachineError::OutOfMemory {
                gpu,
                requested: bytes,
                free: capacity.saturating_sub(used),
                capacity,
            });
        }
        let mine = slot
            .procs
            .iter()
            .find(|p| {
                p.pid.load(Ordering::Relaxed) == self.me.0
                    && p.start_time.load(Ordering::Relaxed) == self.me.1
            })
            .or_else(|| {
                let free = slot
                    .procs
                    .iter()
                    .find(|p| p.pid.load(Ordering::Relaxed) == 0)?;
                free.start_time.store(self.me.1, Ordering::Relaxed);
                free.bytes.store(0, Ordering::Relaxed);
                free.pid.store(self.me.0, Ordering::Relaxed);
                Some(free)
            })
            .ok_or(MachineError::TooManyProcesses(gpu))?;
        mine.bytes.fetch_add(bytes, Ordering::Relaxed);
        slot.peak.fetch_max(used + bytes, Ordering::Relaxed);
        Ok(())
    }

    /// Gives back `bytes` this process had reserved on `gpu`.
    pub fn release(&self, gpu: u32, bytes: u64) {
        let Ok(slot) = self.gpu(gpu) else { return };
        let _lock = FileLock::exclusive(&self.file);
        if let Some(p) = slot.procs.iter().find(|p| {
            p.pid.load(Ordering::Relaxed) == self.me.0
                && p.start_time.load(Ordering::Relaxed) == self.me.1
        }) {
            let left = p.bytes.load(Ordering::Relaxed).saturating_sub(bytes);
            p.bytes.store(left, Ordering::Relaxed);
            if left == 0 {
                p.start_time.store(0, Ordering::Relaxed);
                p.pid.store(0, Ordering::Relaxed);
            }
        }
    }

    /// Bytes this process has reserved on `gpu` (0 for a GPU it never used).
    pub fn own_bytes(&self, gpu: u32) -> u64 {
        let Ok(slot) = self.gpu(gpu) else { return 0 };
        let _lock = FileLock::exclusive(&self.file);
        slot.procs
            .iter()
            .find(|p| {
                p.pid.load(Ordering::Relaxed) == self.me.0
                    && p.start_time.load(Ordering::Relaxed) == self.me.1
            })
            .map_or(0, |p| p.bytes.load(Ordering::Relaxed))
    }

    fn touch(&self) {
        self.seg()
            .last_active
            .store(crate::trace::monotonic_ns(), Ordering::Relaxed);
    }

    /// Capacity and use of `gpu` (dead processes reclaimed first).
    pub fn usage(&self, gpu: u32) -> Result<GpuUsage, MachineError> {
        let slot = self.gpu(gpu)?;
        let _lock = FileLock::exclusive(&self.file);
        let used = Self::collect_garbage(slot);
        let processes = slot
            .procs
            .iter()
            .filter(|p| p.pid.load(Ordering::Relaxed) != 0)
            .map(|p| ProcessUsage {
                pid: p.pid.load(Ordering::Relaxed) as u32,
                bytes: p.bytes.load(Ordering::Relaxed),
            })
            .collect();
        Ok(GpuUsage {
            capacity: slot.capacity.load(Ordering::Relaxed),
            used,
            peak: slot.peak.load(Ordering::Relaxed),
            processes,
        })
    }

    /// Raises a fault on `gpu` (`xid`, and whether the GPU is lost), or clears it with
    /// `xid == 0 && !lost`.
    pub fn set_fault(&self, gpu: u32, xid: u64, lost: bool) -> Result<(), MachineError> {
        let slot = self.gpu(gpu)?;
        let _lock = FileLock::exclusive(&self.file);
        slot.fault_xid.store(xid, Ordering::SeqCst);
        slot.fault_lost.store(u64::from(lost), Ordering::SeqCst);
        slot.fault_generation.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }

    /// The fault flag of `gpu`.
    pub fn fault(&self, gpu: u32) -> Result<FaultState, MachineError> {
        let slot = self.gpu(gpu)?;
        Ok(FaultState {
            xid: slot.fault_xid.load(Ordering::SeqCst),
            lost: slot.fault_lost.load(Ordering::SeqCst) != 0,
            generation: slot.fault_generation.load(Ordering::SeqCst),
        })
    }

    /// Reserves `gpu`'s link in direction `dir` for a copy of `duration_ns` (its bytes
    /// at the link rate) that is ready at `ready_ns` (`CLOCK_MONOTONIC`): it starts
    /// when both it is ready and the copies reserved before it in that direction are
    /// done. Returns when it ends; the caller sleeps until then. Lock-free (a CAS on
    /// the shared segment), so a copier that dies leaves nothing held: at worst the
    /// link stays busy until its copy would have ended.
    pub fn link_reserve(
        &self,
        gpu: u32,
        dir: LinkDir,
        ready_ns: u64,
        duration_ns: u64,
    ) -> Result<u64, MachineError> {
        let busy = &self.gpu(gpu)?.link_busy_until[dir as usize];
        let mut cur = busy.load(Ordering::SeqCst);
        loop {
            let end = cur.max(ready_ns).saturating_add(duration_ns);
            match busy.compare_exchange_weak(cur, end, Ordering::SeqCst, Ordering::SeqCst) {
                Ok(_) => return Ok(end),
                Err(now) => cur = now,
            }
        }
    }

    /// Takes `gpu` exclusively for one kernel: no other thread of this process and no
    /// other process runs a kernel on it until the guard drops. Released by the kernel
    /// if the holder dies.
    ///
    /// Fair between processes, as a GPU time-slices between contexts: `flock` is not
    /// (the process that just unlocked re-locks before a woken waiter runs), so a
    /// process whose kernel was the last one run lets a waiting process go first.
    pub fn kernel_lock(&self, gpu: u32) -> Result<KernelGuard<'_>, MachineError> {
        let count = self.gpu_count();
        let l = self
            .kernel_locks
            .get(gpu as usize)
            .ok_or(MachineError::NoSuchGpu { gpu, count })?;
        let slot = self.gpu(gpu)?;
        let g = l.in_process.lock().unwrap_or_else(|e| e.into_inner());
        let mine = l.last_turn.load(Ordering::SeqCst);
        let others_first = || {
            slot.kernel_waiters.load(Ordering::SeqCst) > 0
                && slot.kernel_turns.load(Ordering::SeqCst) == mine
        };
        if others_first() {
            let deadline = std::time::Instant::now() + KERNEL_HANDOFF_WAIT;
            while others_first() && std::time::Instant::now() < deadline {
                std::thread::sleep(std::time::Duration::from_micros(20));
            }
        }
        slot.kernel_waiters.fetch_add(1, Ordering::SeqCst);
        let fd = l.file.as_raw_fd();
        loop {
            // SAFETY: a valid open fd.
            let r = unsafe { libc::flock(fd, libc::LOCK_EX) };
            if r == 0 {
                break;
            }
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                slot.kernel_waiters.fetch_sub(1, Ordering::SeqCst);
                return Err(MachineError::Io {
                    path: kernel_lock_path(&self.name, gpu),
                    source: e,
                });
            }
        }
        slot.kernel_waiters.fetch_sub(1, Ordering::SeqCst);
        let turn = slot.kernel_turns.fetch_add(1, Ordering::SeqCst) + 1;
        Ok(KernelGuard {
            _in_process: g,
            fd,
            turn,
            last_turn: &l.last_turn,
        })
    }
}

impl Drop for Machine {
    fn drop(&mut self) {
        // SAFETY: unmapping the mapping created in open; no references outlive self.
        unsafe { libc::munmap(self.seg as *mut libc::c_void, self.seg_len) };
    }
}

/// How long a machine must have been idle, with no living process holding memory
/// on it, before [`sweep_idle_machines`] takes its memory files' pages.
pub const IDLE_SWEEP_NS: u64 = 60_000_000_000;

/// Gives back the pages of machines nobody uses: every other machine (but `except`)
/// whose processes all died and that has been idle for [`IDLE_SWEEP_NS`] gets its
/// memory files hole-punched (the files and the segment stay; the next allocation
/// there faults pages in afresh). Run when a machine is created. Tests that never
/// reset their machines would otherwise leave their populated pages in `/dev/shm`
/// (tmpfs, RAM) for good.
pub fn sweep_idle_machines(except: &str) {
    let Ok(dir) = std::fs::read_dir(SHM_DIR) else {
        return;
    };
    for e in dir.flatten() {
        let file = e.file_name();
        let Some(name) = file
            .to_str()
            .and_then(|f| f.strip_prefix("kiwi-sim-"))
            .and_then(|f| f.strip_suffix(".gpu0.mem"))
        else {
            continue;
        };
        if name == except || validate_name(name).is_err() {
            continue;
        }
        let Ok(Some(m)) = Machine::open_existing_quiet(name) else {
            continue;
        };
        m.punch_if_idle();
    }
}

/// Removes machine `name`'s segment, lock and memory files. Processes still attached
/// keep their (now private) copy; new processes create a fresh machine.
pub fn reset(name: &str) -> Result<bool, MachineError> {
    validate_name(name).map_err(|reason| MachineError::BadName {
        name: name.into(),
        reason,
    })?;
    let path = segment_path(name);
    let existed = path.exists();
    let _ = std::fs::remove_file(&path);
    for g in 0..MAX_GPUS {
        let _ = std::fs::remove_file(kernel_lock_path(name, g));
        let _ = std::fs::remove_file(mem_file_path(name, g));
    }
    Ok(existed)
}

#[cfg(test)]
mod tests;
