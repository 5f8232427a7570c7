//! Device memory of this process: the device virtual address space, physical
//! allocations, VMM mappings, and resolving a device address range to host bytes.
//!
//! Model (see `docs/simulator.md`):
//! - Device addresses live in a window of this process's address space that is
//!   reserved `PROT_NONE` (near `0x7000_0000_0000`, 2 TiB): the host can never get
//!   memory there, and host code that dereferences a device pointer segfaults as it
//!   would with a real GPU.
//! - Contents of each physical allocation live in its GPU's memory file, shared by
//!   every process of the machine (`crate::backing`): a GPU's memory is not the
//!   allocating process's memory, and pages freed by anyone are reused without page
//!   faults. Capacity is accounted in the shared machine segment: a physical
//!   allocation that does not fit fails with `CUDA_ERROR_OUT_OF_MEMORY`, across
//!   processes.
//! - `cuMemAlloc` allocations are accounted at their size rounded up to 512 bytes;
//!   their addresses are 512-byte aligned (2 MiB aligned from 2 MiB up).
//! - VMM: reserve VA, create physical (2 MiB granularity), map at offset 0, set
//!   access (required after every map), unmap exactly whole mappings; a physical
//!   allocation is freed when neither its handle nor any mapping is left.
//! - Shareable VMM memory (`cuMemCreate` asking for
//!   `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`) lives in its GPU's file like any
//!   other until its first `cuMemExportToShareableHandle`, which moves its bytes into
//!   a `memfd` (waiting for the copies and kernels touching it to finish their part,
//!   holding new ones off meanwhile) and hands out a duplicate of that fd. Another process that received it (`SCM_RIGHTS`) imports
//!   it with `cuMemImportFromShareableHandle` and maps the same bytes. The capacity
//!   stays accounted to the exporter (as a real GPU counts an allocation once).

use std::collections::{BTreeMap, HashMap};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use kiwi_sim_core::{Machine, MachineError, GRANULARITY};

use crate::abi::*;
use crate::backing::Backing;

/// Preferred start of the device address window.
pub const VA_HINT: u64 = 0x7000_0000_0000;
/// Size of the device address window.
pub const VA_LEN: u64 = 2 << 40;
/// Alignment (and accounting unit) of `cuMemAlloc` allocations.
pub const SMALL_ALIGN: u64 = 512;

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
    fn new_in_window(
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

/// A device address's allocation (or VMM mapping).
pub struct PointerInfo {
    pub start: u64,
    pub size: u64,
    pub gpu: u32,
    /// Owning context handle (0 for VMM mappings, which belong to no context).
    pub owner: usize,
    pub managed: bool,
    pub mapped: bool,
}

/// Device access to a mapping, as `cuMemSetAccess` set it.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Access {
    None,
    Read,
    ReadWrite,
}

struct Mapping {
    size: u64,
    phys: Arc<Phys>,
    /// Access of each device (by ordinal), as `cuMemSetAccess` granted it: a
    /// mapping is reachable only from the devices it names (Driver API reference,
    /// `cuMemSetAccess`, `cuMemMap`).
    access: Vec<Access>,
}

enum RegionKind {
    /// `cuMemAlloc*`: always mapped read-write.
    Linear {
        phys: Arc<Phys>,
        owner: usize,
        managed: bool,
    },
    /// `cuMemAddressReserve`: mappings keyed by start address.
    Reserved { mappings: BTreeMap<u64, Mapping> },
}

struct Region {
    size: u64,
    kind: RegionKind,
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
    fn new((phys, offset, len): Found) -> Piece {
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

/// What [`Memory::resolve`] finds before making pieces: (memory, offset, length).
type Found = (Arc<Phys>, u64, u64);

/// Why a device range could not be used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// No allocation or mapping there (freed, unmapped, never allocated).
    Unmapped,
    /// Mapped, but `cuMemSetAccess` did not grant this access.
    NoAccess,
}

struct VaSpace {
    regions: BTreeMap<u64, Region>,
    /// Free VA ranges: start → size.
    free: BTreeMap<u64, u64>,
}

/// All device memory of this process.
pub struct Memory {
    machine: &'static Machine,
    gpus: u32,
    pub base: u64,
    pub len: u64,
    va: RwLock<VaSpace>,
    handles: Mutex<HashMap<u64, Arc<Phys>>>,
    next_handle: AtomicU64,
    /// Pinned host allocations and registrations, by start address.
    host: Mutex<BTreeMap<usize, HostRange>>,
}

/// How the device may reach a pinned host range (`cuMemHostAlloc`,
/// `cuMemHostRegister` flags).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HostMap {
    /// `DEVICEMAP`: mapped into the device address space (at its host address, as
    /// on a 64-bit unified-addressing system whose devices can use host pointers
    /// for registered memory).
    pub device_map: bool,
    /// `CU_MEMHOSTREGISTER_READ_ONLY`: the device may only read it.
    pub read_only: bool,
}

/// One pinned host range.
#[derive(Clone, Copy)]
struct HostRange {
    len: usize,
    /// Allocated by us (`cuMemHostAlloc`, `cuMemAllocHost`), not registered.
    alloc: bool,
    map: HostMap,
    /// The device's own view of a registered shared mapping ([`alias_shared`]):
    /// (address of the first page's alias, first page, length of the pages).
    view: Option<(usize, usize, usize)>,
}

impl HostRange {
    /// Where the device reaches host address `ptr` of this range.
    fn device_view(&self, ptr: usize) -> usize {
        match self.view {
            Some((alias, first_page, _)) => alias + (ptr - first_page),
            None => ptr,
        }
    }
}

/// A second mapping of the pages of `[ptr, ptr+len)`, if they are one shared
/// mapping (a `MAP_SHARED` file, shared memory): (alias of the first page, first
/// page, length of the pages). The driver pins registered pages, so a GPU keeps
/// reaching them after the process unmaps its own view, until
/// `cuMemHostUnregister`; the alias is that view, and stays mapped until then. The
/// pages of a private mapping cannot be aliased (`None`): the device reaches them at
/// their own address, which the application must keep mapped while registered.
fn alias_shared(ptr: usize, len: usize) -> Option<(usize, usize, usize)> {
    let page = 4096;
    let first = ptr / page * page;
    let end = ptr.checked_add(len)?.checked_next_multiple_of(page)?;
    // Only a shared mapping holding the whole range: `mremap` of a private one with
    // an old size of 0 fails on current kernels and made an unrelated private
    // mapping on old ones.
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    let shared = maps.lines().any(|l| {
        let mut f = l.split_whitespace();
        let (Some(range), Some(perms)) = (f.next(), f.next()) else {
            return false;
        };
        let Some((a, b)) = range.split_once('-') else {
            return false;
        };
        let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16)) else {
            return false;
        };
        a <= first && end <= b && perms.as_bytes().get(3) == Some(&b's')
    });
    if !shared {
        return None;
    }
    // SAFETY: with an old size of 0, mremap leaves the mapping at `first` as it is
    // and makes a new one of the same shared pages at an address of the kernel's.
    let alias = unsafe {
        libc::mremap(
            first as *mut libc::c_void,
            0,
            end - first,
            libc::MREMAP_MAYMOVE,
        )
    };
    (alias != libc::MAP_FAILED).then_some((alias as usize, first, end - first))
}

/// Unmaps the device's view of a registration ([`alias_shared`]), if it has one.
fn unmap_view(view: Option<(usize, usize, usize)>) {
    if let Some((alias, _, len)) = view {
        // SAFETY: the alias `alias_shared` made, `len` long, which only device
        // accesses under the host registry use, and the registration is gone.
        unsafe { libc::munmap(alias as *mut libc::c_void, len) };
    }
}

fn round_up(v: u64, to: u64) -> u64 {
    v.div_ceil(to) * to
}

impl Memory {
    pub fn new(machine: &'static Machine) -> Result<Memory, CUresult> {
        // SAFETY: a PROT_NONE reservation; the kernel treats the address as a hint.
        let p = unsafe {
            libc::mmap(
                VA_HINT as *mut libc::c_void,
                VA_LEN as usize,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(CUDA_ERROR_OPERATING_SYSTEM);
        }
        crate::backing::init(machine);
        // Start on a 2 MiB boundary and keep address 0 impossible.
        let base = round_up(p as u64, GRANULARITY);
        let len = VA_LEN - (base - p as u64);
        let mut free = BTreeMap::new();
        free.insert(base, len);
        Ok(Memory {
            machine,
            gpus: machine.settings().gpus,
            base,
            len,
            va: RwLock::new(VaSpace {
                regions: BTreeMap::new(),
                free,
            }),
            handles: Mutex::new(HashMap::new()),
            next_handle: AtomicU64::new(1),
            host: Mutex::new(BTreeMap::new()),
        })
    }

    /// Is `addr` inside the device address window (i.e. not a host address)?
    pub fn is_device_address(&self, addr: u64) -> bool {
        addr >= self.base && addr < self.base + self.len
    }

    fn va_alloc(va: &mut VaSpace, size: u64, align: u64, fixed: Option<u64>) -> Option<u64> {
        let found = va.free.iter().find_map(|(&start, &len)| {
            let at = match fixed {
                Some(f) => {
                    if f >= start
                        && f.checked_add(size).is_some_and(|e| e <= start + len)
                        && f.is_multiple_of(align)
                    {
                        f
                    } else {
                        return None;
                    }
                }
                None => round_up(start, align),
            };
            (at + size <= start + len).then_some((start, len, at))
        });
        let (start, len, at) = found?;
        va.free.remove(&start);
        if at > start {
            va.free.insert(start, at - start);
        }
        if at + size < start + len {
            va.free.insert(at + size, start + len - at - size);
        }
        Some(at)
    }

    fn va_free(va: &mut VaSpace, mut start: u64, mut size: u64) {
        // Coalesce with neighbours.
        if let Some((&ps, &pl)) = va.free.range(..start).next_back() {
            if ps + pl == start {
                va.free.remove(&ps);
                start = ps;
                size += pl;
            }
        }
        if let Some(&nl) = va.free.get(&(start + size)) {
            va.free.remove(&(start + size));
            size += nl;
        }
        va.free.insert(start, size);
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, VaSpace> {
        self.va.write().unwrap_or_else(|e| e.into_inner())
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, VaSpace> {
        self.va.read().unwrap_or_else(|e| e.into_inner())
    }

    /// `cuMemAlloc`: physical memory on `gpu` at a fresh address, owned by context `owner`.
    pub fn alloc_linear(&self, gpu: u32, size: u64, owner: usize) -> Result<u64, CUresult> {
        if size == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if size > self.len {
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
        let accounted = round_up(size, SMALL_ALIGN);
        let phys = Phys::new(self.machine, gpu, accounted, false)?;
        let align = if accounted >= GRANULARITY {
            GRANULARITY
        } else {
            SMALL_ALIGN
        };
        let mut va = self.write();
        let at = Self::va_alloc(&mut va, accounted, align, None).ok_or(CUDA_ERROR_OUT_OF_MEMORY)?;
        va.regions.insert(
            at,
            Region {
                size: accounted,
                kind: RegionKind::Linear {
                    phys,
                    owner,
                    managed: false,
                },
            },
        );
        Ok(at)
    }

    /// `cuMemFree`: `ptr` must be the start of a `cuMemAlloc` allocation.
    pub fn free_linear(&self, ptr: u64) -> Result<(), CUresult> {
        let mut va = self.write();
        match va.regions.get(&ptr) {
            Some(Region {
                kind: RegionKind::Linear { .. },
                ..
            }) => {}
            _ => return Err(CUDA_ERROR_INVALID_VALUE),
        }
        let r = va.regions.remove(&ptr).expect("checked above");
        Self::va_free(&mut va, ptr, r.size);
        drop(va);
        drop(r); // releases capacity outside the VA lock
        Ok(())
    }

    /// `cuMemAllocManaged`: memory reachable at one address from host and device.
    pub fn alloc_managed(&self, gpu: u32, size: u64, owner: usize) -> Result<u64, CUresult> {
        if size == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if size > self.len {
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
        let accounted = round_up(size, 4096);
        let align = if accounted >= GRANULARITY {
            GRANULARITY
        } else {
            4096
        };
        let mut va = self.write();
        let at = Self::va_alloc(&mut va, accounted, align, None).ok_or(CUDA_ERROR_OUT_OF_MEMORY)?;
        let phys = match Phys::new_in_window(self.machine, gpu, accounted, at) {
            Ok(p) => p,
            Err(e) => {
                Self::va_free(&mut va, at, accounted);
                return Err(e);
            }
        };
        va.regions.insert(
            at,
            Region {
                size: accounted,
                kind: RegionKind::Linear {
                    phys,
                    owner,
                    managed: true,
                },
            },
        );
        Ok(at)
    }

    /// Moves managed memory `[ptr, ptr+n)` to device `to` or the host (`None`), as
    /// `cuMemPrefetchAsync` does when its turn in the stream comes: the bytes moved;
    /// `None` when the range is not inside one managed allocation.
    pub fn migrate(&self, ptr: u64, n: u64, to: Option<u32>) -> Option<u64> {
        let va = self.read();
        let (&start, r) = va.regions.range(..=ptr).next_back()?;
        match &r.kind {
            RegionKind::Linear {
                phys,
                managed: true,
                ..
            } if ptr.checked_add(n)? <= start + r.size => Some(phys.migrate(ptr - start, n, to)),
            _ => None,
        }
    }

    /// What `cuPointerGetAttribute` needs to know about a device address.
    pub fn pointer_info(&self, ptr: u64) -> Option<PointerInfo> {
        let va = self.read();
        let (&start, r) = va.regions.range(..=ptr).next_back()?;
        if ptr >= start + r.size {
            return None;
        }
        match &r.kind {
            RegionKind::Linear {
                phys,
                owner,
                managed,
            } => Some(PointerInfo {
                start,
                size: r.size,
                gpu: phys.gpu,
                owner: *owner,
                managed: *managed,
                mapped: true,
            }),
            RegionKind::Reserved { mappings } => {
                let (&ms, m) = mappings.range(..=ptr).next_back()?;
                (ptr < ms + m.size).then_some(PointerInfo {
                    start: ms,
                    size: m.size,
                    gpu: m.phys.gpu,
                    owner: 0,
                    managed: false,
                    mapped: true,
                })
            }
        }
    }

    /// The pinned or registered host range containing `ptr`: (start, len).
    pub fn host_range(&self, ptr: usize) -> Option<(usize, usize)> {
        let h = self.host.lock().unwrap_or_else(|e| e.into_inner());
        let (&s, r) = h.range(..=ptr).next_back()?;
        (ptr < s + r.len).then_some((s, r.len))
    }

    /// How the device may reach `[ptr, ptr+len)`, when one pinned host range holds
    /// all of it.
    pub fn host_map(&self, ptr: usize, len: usize) -> Option<HostMap> {
        let h = self.host.lock().unwrap_or_else(|e| e.into_inner());
        Self::host_holding(&h, ptr, len).map(|r| r.map)
    }

    /// Runs `f` on the device's view of host address `ptr` while `[ptr, ptr+len)` is
    /// host memory mapped into the device (`DEVICEMAP`, and writable by it if
    /// `write`), holding the registry so the range is neither unregistered nor freed
    /// (`cuMemFreeHost` unmaps only after removing it here) until `f` returns;
    /// `None` when it is not (any more). The view is the range's alias when it is a
    /// registered shared mapping (still there if the process unmapped its own), else
    /// `ptr` itself.
    pub fn with_mapped_host<R>(
        &self,
        ptr: usize,
        len: usize,
        write: bool,
        f: impl FnOnce(*mut u8) -> R,
    ) -> Option<R> {
        let h = self.host.lock().unwrap_or_else(|e| e.into_inner());
        let r = Self::host_holding(&h, ptr, len)?;
        (r.map.device_map && !(write && r.map.read_only)).then(|| f(r.device_view(ptr) as *mut u8))
    }

    fn host_holding(h: &BTreeMap<usize, HostRange>, ptr: usize, len: usize) -> Option<&HostRange> {
        let (&s, r) = h.range(..=ptr).next_back()?;
        let end = ptr.checked_add(len)?;
        (end <= s + r.len).then_some(r)
    }

    /// Is `ptr` the start of a live `cuMemAlloc` allocation?
    pub fn is_linear_start(&self, ptr: u64) -> bool {
        matches!(
            self.read().regions.get(&ptr),
            Some(Region {
                kind: RegionKind::Linear { .. },
                ..
            })
        )
    }

    /// Does this process hold memory the driver's checkpoint refuses: managed memory,
    /// or VMM memory exported to or imported from another process?
    pub fn holds_unmovable(&self) -> bool {
        let shared = |p: &Phys| p.fd.get().is_some();
        let va = self.read();
        let in_regions = va.regions.values().any(|r| match &r.kind {
            RegionKind::Linear { managed, .. } => *managed,
            RegionKind::Reserved { mappings } => mappings.values().any(|m| shared(&m.phys)),
        });
        drop(va);
        in_regions
            || self
                .handles
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .values()
                .any(|p| shared(p))
    }

    /// Checkpoint: every byte of this process's device memory moves into its host
    /// memory, the GPUs' files get their granules back (`false`: host memory ran
    /// out).
    pub fn to_host(&self) -> bool {
        crate::backing::to_host()
    }

    /// Restore: the checkpointed bytes move back into the GPUs' files (`false`: a
    /// file had no room).
    pub fn to_device(&self) -> bool {
        crate::backing::to_device()
    }

    /// Frees every `cuMemAlloc` allocation owned by context `owner` (context destroy).
    pub fn free_owned_by(&self, owner: usize) {
        let mut va = self.write();
        let mine: Vec<u64> = va
            .regions
            .iter()
            .filter(|(_, r)| matches!(r.kind, RegionKind::Linear { owner: o, .. } if o == owner))
            .map(|(&a, _)| a)
            .collect();
        let mut dropped = Vec::new();
        for a in mine {
            if let Some(r) = va.regions.remove(&a) {
                Self::va_free(&mut va, a, r.size);
                dropped.push(r);
            }
        }
        drop(va);
        drop(dropped);
    }

    /// `cuMemGetAddressRange`: the allocation (or mapping) containing `ptr`.
    pub fn address_range(&self, ptr: u64) -> Option<(u64, u64)> {
        let va = self.read();
        let (&start, r) = va.regions.range(..=ptr).next_back()?;
        if ptr >= start + r.size {
            return None;
        }
        match &r.kind {
            RegionKind::Linear { .. } => Some((start, r.size)),
            RegionKind::Reserved { mappings } => {
                let (&ms, m) = mappings.range(..=ptr).next_back()?;
                (ptr < ms + m.size).then_some((ms, m.size))
            }
        }
    }

    /// `cuMemAddressReserve`.
    pub fn reserve(&self, size: u64, align: u64, hint: u64) -> Result<u64, CUresult> {
        if size == 0 || !size.is_multiple_of(GRANULARITY) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if size > self.len {
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
        let align = if align == 0 { GRANULARITY } else { align };
        if !align.is_power_of_two() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let align = align.max(GRANULARITY);
        let mut va = self.write();
        // The hint is honoured when that range is free, as the real driver does.
        let at = (hint != 0)
            .then(|| Self::va_alloc(&mut va, size, align, Some(hint)))
            .flatten()
            .or_else(|| Self::va_alloc(&mut va, size, align, None))
            .ok_or(CUDA_ERROR_OUT_OF_MEMORY)?;
        va.regions.insert(
            at,
            Region {
                size,
                kind: RegionKind::Reserved {
                    mappings: BTreeMap::new(),
                },
            },
        );
        Ok(at)
    }

    /// `cuMemAddressFree`: exactly a reservation, with nothing mapped in it.
    pub fn unreserve(&self, ptr: u64, size: u64) -> Result<(), CUresult> {
        let mut va = self.write();
        match va.regions.get(&ptr) {
            Some(Region {
                size: s,
                kind: RegionKind::Reserved { mappings },
                ..
            }) if *s == size => {
                if !mappings.is_empty() {
                    return Err(CUDA_ERROR_INVALID_VALUE);
                }
            }
            _ => return Err(CUDA_ERROR_INVALID_VALUE),
        }
        va.regions.remove(&ptr);
        Self::va_free(&mut va, ptr, size);
        Ok(())
    }

    /// `cuMemCreate`: physical memory on `gpu`, returned as a handle; `shareable`
    /// when the POSIX fd handle type was requested.
    pub fn create(&self, gpu: u32, size: u64, shareable: bool) -> Result<u64, CUresult> {
        if size == 0 || !size.is_multiple_of(GRANULARITY) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if size > self.len {
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
        let phys = Phys::new(self.machine, gpu, size, shareable)?;
        Ok(self.add_handle(phys))
    }

    fn add_handle(&self, phys: Arc<Phys>) -> u64 {
        let h = self.next_handle.fetch_add(1, Ordering::Relaxed);
        self.handles
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(h, phys);
        h
    }

    /// `cuMemExportToShareableHandle` with the POSIX fd type: a new descriptor of
    /// the handle's memory. A handle created without that type is
    /// `CUDA_ERROR_INVALID_VALUE`, as is an unknown handle.
    pub fn export_fd(&self, handle: u64) -> Result<RawFd, CUresult> {
        let phys = self
            .handles
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&handle)
            .cloned()
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        phys.export().ok_or(CUDA_ERROR_INVALID_VALUE)?
    }

    /// `cuMemImportFromShareableHandle` with the POSIX fd type: a new handle of the
    /// memory behind `fd` (which stays the caller's).
    pub fn import_fd(&self, fd: RawFd) -> Result<u64, CUresult> {
        let phys = Phys::import(self.machine, fd)?;
        Ok(self.add_handle(phys))
    }

    /// `cuMemRelease`: drops the handle (memory lives on while mapped); returns the
    /// handle's size.
    pub fn release(&self, handle: u64) -> Result<u64, CUresult> {
        let p = self
            .handles
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&handle)
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        Ok(p.size)
    }

    /// `cuMemMap(ptr, size, 0, handle, 0)`.
    pub fn map(&self, ptr: u64, size: u64, offset: u64, handle: u64) -> Result<(), CUresult> {
        if offset != 0
            || size == 0
            || !size.is_multiple_of(GRANULARITY)
            || !ptr.is_multiple_of(GRANULARITY)
        {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let phys = self
            .handles
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&handle)
            .cloned()
            .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        if size > phys.size {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let mut va = self.write();
        let (&start, region) = va
            .regions
            .range_mut(..=ptr)
            .next_back()
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if ptr + size > start + region.size {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let RegionKind::Reserved { mappings } = &mut region.kind else {
            return Err(CUDA_ERROR_INVALID_VALUE);
        };
        // No overlap with an existing mapping.
        if let Some((&ms, m)) = mappings.range(..ptr + size).next_back() {
            if ms + m.size > ptr {
                return Err(CUDA_ERROR_ALREADY_MAPPED);
            }
        }
        mappings.insert(
            ptr,
            Mapping {
                size,
                phys,
                access: vec![Access::None; self.gpus as usize],
            },
        );
        drop(va);
        Ok(())
    }

    /// Visits the mappings that exactly tile `[ptr, ptr+size)`; refuses ranges with
    /// gaps or cutting through a mapping.
    fn tiled(
        mappings: &mut BTreeMap<u64, Mapping>,
        ptr: u64,
        size: u64,
    ) -> Result<Vec<u64>, CUresult> {
        let mut at = ptr;
        let mut keys = Vec::new();
        for (&ms, m) in mappings.range(ptr..ptr + size) {
            if ms != at {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            at = ms + m.size;
            keys.push(ms);
        }
        if at != ptr + size || keys.is_empty() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        Ok(keys)
    }

    fn with_reservation<R>(
        &self,
        ptr: u64,
        size: u64,
        f: impl FnOnce(&mut BTreeMap<u64, Mapping>) -> Result<R, CUresult>,
    ) -> Result<R, CUresult> {
        let mut va = self.write();
        let (&start, region) = va
            .regions
            .range_mut(..=ptr)
            .next_back()
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if size == 0 || ptr + size > start + region.size {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        match &mut region.kind {
            RegionKind::Reserved { mappings } => f(mappings),
            RegionKind::Linear { .. } => Err(CUDA_ERROR_INVALID_VALUE),
        }
    }

    /// `cuMemSetAccess`: `(device, access)` for each descriptor; devices not named
    /// keep their access.
    pub fn set_access(
        &self,
        ptr: u64,
        size: u64,
        grants: &[(u32, Access)],
    ) -> Result<(), CUresult> {
        self.with_reservation(ptr, size, |mappings| {
            for k in Self::tiled(mappings, ptr, size)? {
                let m = mappings.get_mut(&k).expect("tiled keys exist");
                for &(dev, a) in grants {
                    m.access[dev as usize] = a;
                }
            }
            Ok(())
        })
    }

    /// `cuMemUnmap`: must cover exactly whole mappings.
    pub fn unmap(&self, ptr: u64, size: u64) -> Result<(), CUresult> {
        let dropped = self.with_reservation(ptr, size, |mappings| {
            let keys = Self::tiled(mappings, ptr, size)?;
            Ok(keys
                .into_iter()
                .filter_map(|k| mappings.remove(&k))
                .collect::<Vec<_>>())
        })?;
        drop(dropped); // may free physical memory: outside the VA lock
        Ok(())
    }

    /// Resolves `[addr, addr+len)` for an access by device `dev` (`write` for
    /// stores).
    pub fn resolve(&self, addr: u64, len: u64, write: bool, dev: u32) -> Result<Vec<Piece>, Fault> {
        // Pieces are made after the VA lock is let go: making one may wait for a move
        // into a memfd, which waits for pieces held elsewhere.
        let found = self.find(addr, len, write, dev)?;
        Ok(found.into_iter().map(Piece::new).collect())
    }

    /// The physical memory behind `[addr, addr+len)`: (memory, offset, length) of
    /// each piece.
    fn find(&self, addr: u64, len: u64, write: bool, dev: u32) -> Result<Vec<Found>, Fault> {
        let va = self.read();
        let (&start, r) = va
            .regions
            .range(..=addr)
            .next_back()
            .ok_or(Fault::Unmapped)?;
        let end = addr.checked_add(len).ok_or(Fault::Unmapped)?;
        if end > start + r.size {
            return Err(Fault::Unmapped);
        }
        match &r.kind {
            RegionKind::Linear { phys, managed, .. } => {
                // A device's access faults managed pages in, as the driver migrates
                // them on a GPU page fault.
                if *managed {
                    phys.migrate(addr - start, len, Some(dev));
                }
                Ok(vec![(phys.clone(), addr - start, len)])
            }
            RegionKind::Reserved { mappings } => {
                let mut pieces = Vec::new();
                let mut at = addr;
                let first = mappings.range(..=addr).next_back().map(|(&k, _)| k);
                let iter = first.into_iter().flat_map(|f| mappings.range(f..end));
                for (&ms, m) in iter {
                    if ms > at {
                        return Err(Fault::Unmapped);
                    }
                    if ms + m.size <= at {
                        continue;
                    }
                    let ok = match m.access.get(dev as usize).copied().unwrap_or(Access::None) {
                        Access::ReadWrite => true,
                        Access::Read => !write,
                        Access::None => false,
                    };
                    if !ok {
                        return Err(Fault::NoAccess);
                    }
                    let take = (ms + m.size).min(end) - at;
                    pieces.push((m.phys.clone(), at - ms, take));
                    at += take;
                    if at == end {
                        break;
                    }
                }
                if at != end {
                    return Err(Fault::Unmapped);
                }
                Ok(pieces)
            }
        }
    }

    /// Records pinned host memory we allocated (`alloc = true`) or a registration,
    /// and how the device may reach it: a registration mapped into the device
    /// (`DEVICEMAP`) of a shared mapping gets the device's own view of its pages
    /// ([`alias_shared`]).
    pub fn host_add(
        &self,
        ptr: usize,
        len: usize,
        alloc: bool,
        map: HostMap,
    ) -> Result<(), CUresult> {
        let view = (map.device_map && !alloc)
            .then(|| alias_shared(ptr, len))
            .flatten();
        let mut h = self.host.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((&s, r)) = h.range(..ptr + len).next_back() {
            if s + r.len > ptr {
                drop(h);
                unmap_view(view);
                return Err(CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED);
            }
        }
        h.insert(
            ptr,
            HostRange {
                len,
                alloc,
                map,
                view,
            },
        );
        Ok(())
    }

    /// Removes a pinned host entry that starts at `ptr`; returns its length.
    pub fn host_remove(&self, ptr: usize, alloc: bool) -> Result<usize, CUresult> {
        let mut h = self.host.lock().unwrap_or_else(|e| e.into_inner());
        match h.get(&ptr) {
            Some(&HostRange {
                len,
                alloc: a,
                view,
                ..
            }) if a == alloc => {
                h.remove(&ptr);
                // Under the registry: no device access is using the view.
                unmap_view(view);
                Ok(len)
            }
            _ if alloc => Err(CUDA_ERROR_INVALID_VALUE),
            _ => Err(CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED),
        }
    }
}
