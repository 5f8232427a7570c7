//! Physical device memory: one `cuMemAlloc`, `cuMemCreate` or managed allocation,
//! accounted on its GPU in the machine segment and placed in the GPU's memory file
//! (`crate::backing`), or in a slab of small allocations; shareable memory moved
//! into a `memfd` at its first export (and imported memory mapped from one);
//! managed memory's blocks migrated between the host and the devices. A [`Piece`]
//! is a resolved part of it that work is using.
//!
//! Shareable VMM memory (`cuMemCreate` asking for
//! `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`) lives in its GPU's file like any
//! other until its first `cuMemExportToShareableHandle`, which moves its bytes into a
//! `memfd` (waiting for the copies and kernels touching it to finish their part,
//! holding new ones off meanwhile) and hands out a duplicate of that fd. Another
//! process that received it (`SCM_RIGHTS`) imports it with
//! `cuMemImportFromShareableHandle` and maps the same bytes. The capacity stays
//! accounted to the exporter (as a real GPU counts an allocation once).

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use kiwi_sim_core::{Machine, MachineError, GRANULARITY};

use crate::abi::*;
use crate::backing::Backing;

/// Name prefix of the memfd holding shareable memory: `kiwi-sim:<machine>:gpu<N>`.
const MEMFD_PREFIX: &str = "kiwi-sim:";

/// [`Phys::users`]: a move into a memfd waits for the pieces alive to go; new ones
/// wait, except on threads that hold pieces already (they must go on to drop them).
const MOVE_PENDING: u64 = 1 << 62;
/// [`Phys::users`]: the bytes are moving into a memfd; no piece may be made.
const MOVE_RUNNING: u64 = 1 << 63;

thread_local! {
    /// Pieces of shareable memory this thread holds (see [`MOVE_PENDING`]).
    static HELD: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Accounts `size` bytes on `gpu` of `machine`, as CUDA errors.
fn reserve(machine: &Machine, gpu: u32, size: u64) -> Result<(), CUresult> {
    machine.reserve(gpu, size).map_err(|e| match e {
        MachineError::OutOfMemory { .. } | MachineError::TooManyProcesses(_) => {
            CUDA_ERROR_OUT_OF_MEMORY
        }
        MachineError::NoSuchGpu { .. } => CUDA_ERROR_INVALID_DEVICE,
        _ => CUDA_ERROR_OPERATING_SYSTEM,
    })
}

/// Physical device memory: one `cuMemAlloc` or one `cuMemCreate`.
pub struct Phys {
    pub gpu: u32,
    pub size: u64,
    /// Where the bytes are: from `offset` of this backing on.
    backing: Arc<Backing>,
    offset: u64,
    /// A small allocation in one of the process's slabs (`crate::backing::small`).
    small: bool,
    machine: &'static Machine,
    /// Created asking for the POSIX fd handle type (or imported): exportable.
    shareable: bool,
    /// The memfd holding the bytes: imported memory's from the start; this
    /// process's own shareable memory's from its first export ([`Phys::share`]).
    fd: std::sync::OnceLock<OwnedFd>,
    /// Shareable memory: pieces alive (low bits) and the move's flags
    /// ([`MOVE_PENDING`], [`MOVE_RUNNING`]).
    users: AtomicU64,
    /// Serializes moves into a memfd.
    moving: Mutex<()>,
    /// Whether this process accounted the capacity (false for imported memory, which
    /// the exporter accounts, and for managed memory, accounted by `blocks`).
    accounted: bool,
    /// Managed memory: where each [`MANAGED_BLOCK`] is, a device's ordinal or
    /// [`ON_HOST`]; only the blocks on a device are accounted there.
    blocks: Option<Mutex<Vec<u8>>>,
}

/// Managed memory moves between the host and the devices in blocks of this size (the
/// driver's unit of migration, a 2 MiB virtual-address block).
pub const MANAGED_BLOCK: u64 = 2 << 20;
/// [`Phys::blocks`]: a block on the host.
const ON_HOST: u8 = u8::MAX;

impl Phys {
    /// Accounts `size` bytes on `gpu` and takes their place in the GPU's memory file
    /// (moved into a memfd when first exported, if `shareable`). Allocations of at
    /// most [`crate::backing::SMALL_MAX`] share the process's slabs (never
    /// shareable ones: they are `cuMemCreate`'s, whole granules).
    pub fn new(
        machine: &'static Machine,
        gpu: u32,
        size: u64,
        shareable: bool,
    ) -> Result<Arc<Phys>, CUresult> {
        reserve(machine, gpu, size)?;
        let small = !shareable && size <= crate::backing::SMALL_MAX;
        let placed = if small {
            crate::backing::small(gpu, size)
        } else {
            Backing::in_file(gpu, size.max(1).div_ceil(GRANULARITY)).map(|b| (b, 0))
        };
        let Some((backing, offset)) = placed else {
            machine.release(gpu, size);
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        };
        Ok(Arc::new(Phys {
            gpu,
            size,
            backing,
            offset,
            small,
            machine,
            shareable,
            fd: Default::default(),
            users: AtomicU64::new(0),
            moving: Mutex::new(()),
            accounted: true,
            blocks: None,
        }))
    }

    /// A new memfd of `size` bytes named after the machine and the GPU (so an
    /// importer can tell where the memory lives).
    fn memfd(machine: &Machine, gpu: u32, size: u64) -> Result<OwnedFd, CUresult> {
        let name = std::ffi::CString::new(format!("{MEMFD_PREFIX}{}:gpu{gpu}", machine.name()))
            .expect("machine names hold no NUL");
        // SAFETY: a NUL-terminated name; creates a new anonymous file.
        let raw = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
        if raw < 0 {
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
        // SAFETY: memfd_create just returned this descriptor, owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: a valid fd we own.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), size as libc::off_t) } != 0 {
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
        Ok(fd)
    }

    /// Imports shareable memory another process exported: `fd` must be a simulator
    /// memfd of this machine; it is duplicated (the caller keeps its own).
    pub fn import(machine: &'static Machine, fd: RawFd) -> Result<Arc<Phys>, CUresult> {
        let link = std::fs::read_link(format!("/proc/self/fd/{fd}"))
            .map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
        let link = link.to_string_lossy();
        let gpu = link
            .strip_prefix("/memfd:")
            .and_then(|l| l.strip_prefix(MEMFD_PREFIX))
            .map(|l| l.trim_end_matches(" (deleted)"))
            .and_then(|l| l.rsplit_once(":gpu"))
            .filter(|(name, _)| *name == machine.name())
            .and_then(|(_, g)| g.parse::<u32>().ok())
            .filter(|&g| g < machine.settings().gpus)
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        // SAFETY: fcntl on a descriptor number; an invalid one fails with EBADF.
        let raw = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
        if raw < 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: fcntl just made this descriptor; we own it.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let size = std::fs::File::from(fd.try_clone().map_err(|_| CUDA_ERROR_INVALID_VALUE)?)
            .metadata()
            .map_err(|_| CUDA_ERROR_INVALID_VALUE)?
            .len();
        if size == 0 || !size.is_multiple_of(GRANULARITY) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let host = Self::map_shared(&fd, size).ok_or(CUDA_ERROR_OUT_OF_MEMORY)?;
        // The exporter accounts it.
        Ok(Arc::new(Phys {
            gpu,
            size,
            backing: Backing::mapped(gpu, host, size as usize),
            offset: 0,
            small: false,
            machine,
            shareable: true,
            fd: fd.into(),
            users: AtomicU64::new(0),
            moving: Mutex::new(()),
            accounted: false,
            blocks: None,
        }))
    }

    /// Maps all of `fd` shared, its pages populated writable. `MAP_POPULATE` alone
    /// maps a shared file's pages read-only (the kernel does not dirty them for
    /// nothing), so the first store to each page faulted again: populating and then
    /// filling 1 GiB took ~10% longer than with the pages populated writable.
    fn map_shared(fd: &OwnedFd, size: u64) -> Option<*mut u8> {
        let len = size as usize;
        // SAFETY: a shared mapping of a file we hold open, of its whole length.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return None;
        }
        // SAFETY: advice on the mapping just made.
        if unsafe { libc::madvise(p, len, kiwi_sim_core::machine::MADV_POPULATE_WRITE) } != 0 {
            // Kernels before 5.14 refuse it (EINVAL): populate read-only, mapping the
            // file again over the same range.
            // SAFETY: replaces exactly the mapping made above, of the same file.
            let q = unsafe {
                libc::mmap(
                    p,
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED | libc::MAP_POPULATE | libc::MAP_FIXED,
                    fd.as_raw_fd(),
                    0,
                )
            };
            if q == libc::MAP_FAILED {
                // SAFETY: unmapping the mapping made above, which nothing references.
                unsafe { libc::munmap(p, len) };
                return None;
            }
        }
        Some(p.cast())
    }

    /// Is this memory shared with another process (exported, or imported)?
    pub fn is_shared(&self) -> bool {
        self.fd.get().is_some()
    }

    /// A new descriptor of shareable memory's memfd (`cuMemExportToShareableHandle`);
    /// `None` for memory created without the POSIX fd handle type.
    pub fn export(&self) -> Option<Result<RawFd, CUresult>> {
        if !self.shareable {
            return None;
        }
        Some(self.share().and_then(|fd| {
            // SAFETY: duplicating a descriptor we own; the copy is the caller's.
            let raw = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 0) };
            if raw < 0 {
                Err(CUDA_ERROR_OUT_OF_MEMORY)
            } else {
                Ok(raw)
            }
        }))
    }

    /// The memfd holding this shareable memory, moving the bytes into one first if
    /// they still live in private memory. The move waits until no piece of this
    /// memory is alive (every copy and kernel touching it finished its part) and
    /// holds new ones off meanwhile, so no store is lost to it; it replaces the
    /// private mapping at the same address, so `host` stays valid.
    fn share(&self) -> Result<&OwnedFd, CUresult> {
        if let Some(fd) = self.fd.get() {
            return Ok(fd);
        }
        let _one = self.moving.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(fd) = self.fd.get() {
            return Ok(fd);
        }
        self.users.fetch_or(MOVE_PENDING, Ordering::SeqCst);
        while self
            .users
            .compare_exchange(
                MOVE_PENDING,
                MOVE_PENDING | MOVE_RUNNING,
                Ordering::SeqCst,
                Ordering::SeqCst,
            )
            .is_err()
        {
            std::thread::sleep(std::time::Duration::from_micros(20));
        }
        let moved = self.move_to_memfd();
        // Nobody could take a piece while it ran: clearing both flags is all.
        self.users
            .fetch_and(!(MOVE_PENDING | MOVE_RUNNING), Ordering::SeqCst);
        let fd = moved?;
        Ok(self.fd.get_or_init(|| fd))
    }

    /// Copies the bytes into a new memfd and moves the backing there (its granules
    /// go back to the GPU's file).
    fn move_to_memfd(&self) -> Result<OwnedFd, CUresult> {
        let len = self.backing.len;
        let fd = Self::memfd(self.machine, self.gpu, len as u64)?;
        let tmp = Self::map_shared(&fd, len as u64).ok_or(CUDA_ERROR_OUT_OF_MEMORY)?;
        // SAFETY: both mappings are `len` long and distinct; no piece of this memory
        // is alive, so nothing writes it meanwhile (see `share`).
        unsafe { kiwi_sim_core::dma::copy(tmp, self.backing.host(), len) };
        self.backing.replace(tmp);
        Ok(fd)
    }

    /// Counts a new piece of this memory, waiting while its bytes move.
    fn enter(&self) {
        if !self.shareable {
            return;
        }
        let held = HELD.get();
        loop {
            let s = self.users.load(Ordering::SeqCst);
            let held_off = s & MOVE_RUNNING != 0 || (s & MOVE_PENDING != 0 && held == 0);
            if held_off {
                std::thread::sleep(std::time::Duration::from_micros(20));
            } else if self
                .users
                .compare_exchange_weak(s, s + 1, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
            {
                break;
            }
        }
        HELD.set(held + 1);
    }

    fn leave(&self) {
        if self.shareable {
            self.users.fetch_sub(1, Ordering::SeqCst);
            HELD.set(HELD.get() - 1);
        }
    }

    /// Managed memory: maps `size` bytes read-write at `addr`, a page-aligned range
    /// of the (PROT_NONE) device window reserved for it, so host and device use the
    /// same pointer. Nothing is accounted on a device yet: as with the driver, pages
    /// take device memory when a device touches them or a prefetch moves them there
    /// ([`Phys::migrate`]), and an allocation may exceed what a device has free.
    pub fn new_in_window(
        machine: &'static Machine,
        gpu: u32,
        size: u64,
        addr: u64,
    ) -> Result<Arc<Phys>, CUresult> {
        let map_len = size as usize;
        // SAFETY: replaces part of our own PROT_NONE window reservation, at a range
        // the VA allocator handed out exclusively for this allocation.
        let p = unsafe {
            libc::mmap(
                addr as *mut libc::c_void,
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
        Ok(Arc::new(Phys {
            gpu,
            size,
            backing: Backing::window(gpu, p.cast(), map_len),
            offset: 0,
            small: false,
            machine,
            shareable: false,
            fd: Default::default(),
            users: AtomicU64::new(0),
            moving: Mutex::new(()),
            accounted: false,
            blocks: Some(Mutex::new(vec![
                ON_HOST;
                size.div_ceil(MANAGED_BLOCK) as usize
            ])),
        }))
    }

    /// Managed memory: moves the blocks overlapping `[off, off+len)` to device `to`,
    /// or to the host (`None`), accounting each on the device it goes to and
    /// releasing it from the one it leaves; returns the bytes moved. A block that
    /// finds no room on the device stays where it is (the device reaches it over the
    /// link): the driver may evict other managed memory for it, the simulator does
    /// not, which is stricter. Not managed memory: 0.
    pub fn migrate(&self, off: u64, len: u64, to: Option<u32>) -> u64 {
        let Some(blocks) = &self.blocks else {
            return 0;
        };
        let mut b = blocks.lock().unwrap_or_else(|e| e.into_inner());
        let dest = to.map_or(ON_HOST, |d| d as u8);
        let first = (off / MANAGED_BLOCK) as usize;
        let last = (off + len.max(1))
            .div_ceil(MANAGED_BLOCK)
            .min(b.len() as u64) as usize;
        let mut moved = 0;
        for (i, at) in b.iter_mut().enumerate().take(last).skip(first) {
            if *at == dest {
                continue;
            }
            let bytes = MANAGED_BLOCK.min(self.size - i as u64 * MANAGED_BLOCK);
            if let Some(d) = to {
                if self.machine.reserve(d, bytes).is_err() {
                    continue;
                }
            }
            if *at != ON_HOST {
                self.machine.release(u32::from(*at), bytes);
            }
            *at = dest;
            moved += bytes;
        }
        moved
    }

    /// Host address of byte `offset`.
    pub fn host_ptr(&self, offset: u64) -> *mut u8 {
        debug_assert!(offset <= self.size);
        // SAFETY: offset is within the allocation, which lies inside its backing's
        // mapping (callers resolve ranges first).
        unsafe { self.backing.host().add((self.offset + offset) as usize) }
    }
}

impl Drop for Phys {
    fn drop(&mut self) {
        if self.small {
            crate::backing::small_free(&self.backing, self.offset, self.size);
        }
        if self.accounted {
            self.machine.release(self.gpu, self.size);
        }
        if self.blocks.is_some() {
            self.migrate(0, self.size, None);
        }
    }
}

/// A piece of a resolved device range.
///
/// While a piece of shareable memory is alive its bytes stay where they are (see
/// [`Phys::share`]); it is dropped on the thread that made it (it is not `Send`).
pub struct Piece {
    pub phys: Arc<Phys>,
    pub offset: u64,
    pub len: u64,
    _this_thread: std::marker::PhantomData<*const ()>,
}

impl Piece {
    pub fn new((phys, offset, len): Found) -> Piece {
        phys.enter();
        Piece {
            phys,
            offset,
            len,
            _this_thread: std::marker::PhantomData,
        }
    }
}

impl Drop for Piece {
    fn drop(&mut self) {
        self.phys.leave();
    }
}

/// What `Memory::resolve` finds before making pieces: (memory, offset, length).
pub type Found = (Arc<Phys>, u64, u64);
