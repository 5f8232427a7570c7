//! Where this process's simulated device memory lives: extents of each GPU's
//! memory file (`kiwi-sim-<name>.gpu<N>.mem`, see `kiwi_sim_core::machine`), never
//! the process's own memory.
//!
//! A GPU's memory exists before anyone allocates it and is no process's memory:
//! nothing of it is charged to the allocating process's memory cgroup, and a
//! fresh allocation pays no page faults. So each physical allocation maps
//! (`MAP_SHARED`) granules of its GPU's file, which the machine segment's allocator
//! hands out and takes back (a dead process's too). Freed granules keep their pages:
//! the next allocation on that GPU, by any process, reuses populated pages, charged
//! to whoever touched them first (a memory cgroup's first-touch rule;
//! `kiwi-sim populate` makes that a process outside the tenants).
//!
//! Each process maps each GPU's whole file once ([`window`], at its first use,
//! never unmapped): an extent of one run of granules is reached there, so memory
//! the process used before is mapped already (freeing and allocating again costs
//! no page-table work). An extent in several runs (a fragmented file) gets an
//! address of its own with the runs mapped side by side. Small allocations
//! ([`small`]) share granules of this process ("slabs", in 512-byte units).
//!
//! A [`Backing`]'s bytes can move while nothing uses them: into host memory of the
//! process at a checkpoint and back to the GPU at a restore ([`to_host`],
//! [`to_device`]), into a memfd at the first export of shareable memory
//! ([`Backing::replace`]). Its host address changes with it; device addresses never
//! do.
//!
//! `KIWI_SIM_PREPARE` (backing prepared ahead for reserved ranges, and a pool of
//! freed backing) is accepted and does nothing: both made up for private memory
//! that had to be faulted in fresh, which device memory no longer is.

use std::collections::HashMap;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};

use kiwi_cuda::filemap::{self, FilePart};
use kiwi_sim_core::machine::MADV_POPULATE_WRITE;
use kiwi_sim_core::{Machine, GRANULARITY};

/// Where a [`Backing`]'s bytes are.
enum Place {
    /// Granules of the GPU's file, as runs `(first granule, granules)`; `own` when
    /// they are mapped at an address of their own (several runs), not in the
    /// process's window of the file.
    File { runs: Vec<(u64, u64)>, own: bool },
    /// A mapping of this process's own (unmapped when dropped): host memory of a
    /// checkpointed process (`checkpointed`), or a memfd's shared mapping
    /// (shareable memory exported or imported).
    Mapped { checkpointed: bool },
    /// Managed memory: a private mapping at its device address inside the device
    /// window, made `PROT_NONE` again when dropped.
    Window,
}

/// The bytes behind device memory: one physical allocation's, or a slab shared by
/// small ones.
pub struct Backing {
    pub gpu: u32,
    pub len: usize,
    host: AtomicPtr<u8>,
    place: Mutex<Place>,
}

/// A slab: one granule of this process's small allocations, in [`UNIT`]s.
struct Slab {
    backing: Arc<Backing>,
    used: [u64; UNITS / 64],
    count: usize,
}

/// Allocation unit of a slab (`cuMemAlloc` rounds sizes to it).
pub const UNIT: u64 = 512;
const UNITS: usize = (GRANULARITY / UNIT) as usize;
/// Allocations of at most this many bytes share slabs.
pub const SMALL_MAX: u64 = GRANULARITY / 2;

struct Store {
    machine: &'static Machine,
    /// Per GPU: this process's shared mapping of the whole file (address; 0 if it
    /// could not be made).
    windows: Vec<OnceLock<usize>>,
    slabs: Vec<Mutex<Vec<Slab>>>,
    /// Per GPU: the granules of the window this process has populated, a bit each.
    /// Populating again costs as much as a page-table walk of every 4 KiB page
    /// (`MADV_POPULATE_WRITE` takes each page whether mapped or not: 4.9 ms for
    /// 64 MiB here, half a copy's time), while the window's page-table entries stay
    /// as long as the file's pages do; a granule populated once is not populated
    /// again. Pages punched out since (beyond the capacity, or a reset machine's)
    /// are faulted in by the first access instead: slower, never wrong.
    populated: Vec<Mutex<Vec<u64>>>,
    /// Every backing in the GPUs' files or checkpointed, by address, for the
    /// checkpoint.
    live: Mutex<HashMap<usize, Weak<Backing>>>,
}

static STORE: OnceLock<Store> = OnceLock::new();

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Sets up the store for `machine` (at driver start).
pub fn init(machine: &'static Machine) {
    let gpus = machine.gpu_count() as usize;
    let _ = STORE.set(Store {
        machine,
        windows: (0..gpus).map(|_| OnceLock::new()).collect(),
        slabs: (0..gpus).map(|_| Mutex::new(Vec::new())).collect(),
        populated: (0..gpus).map(|_| Mutex::new(Vec::new())).collect(),
        live: Mutex::new(HashMap::new()),
    });
}

fn store() -> &'static Store {
    STORE.get().expect("backing::init runs at driver start")
}

/// This process's mapping of `gpu`'s whole memory file.
fn window(gpu: u32) -> Option<*mut u8> {
    let s = store();
    let w = *s.windows.get(gpu as usize)?.get_or_init(|| {
        let Ok((_, len)) = s.machine.mem_file(gpu) else {
            return 0;
        };
        // Only the granules this process is given are ever touched through it.
        s.machine.map_mem_file(gpu, len).map_or(0, |p| p as usize)
    });
    (w != 0).then_some(w as *mut u8)
}

/// Faults `[p, p+len)` in writable now, so copies and kernels do not (pages this
/// process mapped before cost only a walk of its page tables).
pub fn populate(p: *mut u8, len: usize) {
    // SAFETY: advice on a mapping the caller owns; populating never changes bytes.
    unsafe { libc::madvise(p.cast(), len, MADV_POPULATE_WRITE) };
}

/// Populates the granule runs of `gpu`'s file mapped at `host`: those of
/// the window this process has not populated before, or all of an own mapping.
fn populate_runs(gpu: u32, runs: &[(u64, u64)], host: *mut u8, own: bool) {
    let len = runs.iter().map(|r| r.1).sum::<u64>() * GRANULARITY;
    let (true, [(first, n)], Some(done)) = (!own, runs, store().populated.get(gpu as usize)) else {
        populate(host, len as usize);
        return;
    };
    let mut done = lock(done);
    let end = (first + n) as usize;
    if done.len() * 64 < end {
        done.resize(end.div_ceil(64), 0);
    }
    let mut g = *first as usize;
    while g < end {
        if done[g / 64] & (1 << (g % 64)) != 0 {
            g += 1;
            continue;
        }
        let start = g;
        while g < end && done[g / 64] & (1 << (g % 64)) == 0 {
            done[g / 64] |= 1 << (g % 64);
            g += 1;
        }
        // SAFETY: inside the run, which `host` maps (its first granule at `host`).
        let at = unsafe { host.add((start as u64 - first) as usize * GRANULARITY as usize) };
        populate(at, (g - start) * GRANULARITY as usize);
    }
}

/// Maps the granule runs of `gpu`'s file: in the process's window when one run,
/// else side by side at an address of their own. Returns (address, own).
fn map_runs(gpu: u32, runs: &[(u64, u64)]) -> Option<(*mut u8, bool)> {
    if let [(first, _)] = runs {
        // SAFETY: the run lies inside the file, which the window maps whole.
        return Some((
            unsafe { window(gpu)?.add((first * GRANULARITY) as usize) },
            false,
        ));
    }
    let (file, _) = store().machine.mem_file(gpu).ok()?;
    let parts: Vec<FilePart> = runs
        .iter()
        .map(|&(first, n)| FilePart {
            fd: file.as_raw_fd(),
            offset: first * GRANULARITY,
            len: (n * GRANULARITY) as usize,
        })
        .collect();
    let (base, _) = filemap::map_side_by_side(
        &parts,
        libc::PROT_READ | libc::PROT_WRITE,
        libc::MAP_SHARED | libc::MAP_NORESERVE,
    )
    .ok()?;
    Some((base, true))
}

impl Backing {
    /// `granules` of `gpu`'s file for this process, mapped and populated; `None`
    /// when the file has no room (or the mapping fails).
    pub fn in_file(gpu: u32, granules: u64) -> Option<Arc<Backing>> {
        let machine = store().machine;
        let runs = machine.extent_alloc(gpu, granules).ok()?;
        let Some((host, own)) = map_runs(gpu, &runs) else {
            machine.extent_free(gpu, &runs);
            return None;
        };
        let len = (granules * GRANULARITY) as usize;
        populate_runs(gpu, &runs, host, own);
        let b = Arc::new(Backing {
            gpu,
            len,
            host: AtomicPtr::new(host),
            place: Mutex::new(Place::File { runs, own }),
        });
        lock(&store().live).insert(Arc::as_ptr(&b) as usize, Arc::downgrade(&b));
        Some(b)
    }

    /// A mapping of `len` bytes at `host` that this backing owns from now on: a
    /// memfd's shared mapping (imported memory).
    pub fn mapped(gpu: u32, host: *mut u8, len: usize) -> Arc<Backing> {
        Arc::new(Backing {
            gpu,
            len,
            host: AtomicPtr::new(host),
            place: Mutex::new(Place::Mapped {
                checkpointed: false,
            }),
        })
    }

    /// Managed memory's private mapping at its device address, `len` bytes.
    pub fn window(gpu: u32, host: *mut u8, len: usize) -> Arc<Backing> {
        Arc::new(Backing {
            gpu,
            len,
            host: AtomicPtr::new(host),
            place: Mutex::new(Place::Window),
        })
    }

    /// Host address of the first byte (changes only while nothing uses the bytes).
    pub fn host(&self) -> *mut u8 {
        self.host.load(Ordering::Acquire)
    }

    /// Moves the bytes to `host`, a mapping of `len` bytes holding a copy of them
    /// that this backing owns from now on (a memfd's, at the first export); the
    /// granules go back to the file. The caller makes sure nothing uses the bytes.
    pub fn replace(&self, host: *mut u8) {
        let mut place = lock(&self.place);
        let old = std::mem::replace(
            &mut *place,
            Place::Mapped {
                checkpointed: false,
            },
        );
        let old_host = self.host.swap(host, Ordering::AcqRel);
        self.let_go(old, old_host);
    }

    /// Gives up what `place` held at `host`: granules back to the file, an own
    /// mapping unmapped.
    fn let_go(&self, place: Place, host: *mut u8) {
        match place {
            Place::File { runs, own } => {
                if own {
                    // SAFETY: our own mapping of the runs, which nothing uses now.
                    unsafe { libc::munmap(host.cast(), self.len) };
                }
                store().machine.extent_free(self.gpu, &runs);
            }
            Place::Mapped { .. } => {
                // SAFETY: our own mapping, which nothing uses now.
                unsafe { libc::munmap(host.cast(), self.len) };
            }
            Place::Window => {
                // SAFETY: turns our own part of the device window back into an
                // inaccessible reservation (never unmapped: the window stays whole).
                unsafe {
                    libc::mmap(
                        host.cast(),
                        self.len,
                        libc::PROT_NONE,
                        libc::MAP_PRIVATE
                            | libc::MAP_ANONYMOUS
                            | libc::MAP_FIXED
                            | libc::MAP_NORESERVE,
                        -1,
                        0,
                    )
                };
            }
        }
    }

    /// Checkpoint: the bytes move into a private mapping of this process and the
    /// granules go back to the file. `false` (nothing changed) when host memory
    /// could not be had.
    fn move_to_host(&self) -> bool {
        let mut place = lock(&self.place);
        if !matches!(*place, Place::File { .. }) {
            return true;
        }
        // SAFETY: a fresh private anonymous mapping; no existing memory is affected.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                self.len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return false;
        }
        let old_host = self.host();
        // SAFETY: both ranges are `len` long and distinct; nothing uses the bytes
        // (the process is locked, its work done).
        unsafe { kiwi_sim_core::dma::copy(p.cast(), old_host, self.len) };
        let old = std::mem::replace(&mut *place, Place::Mapped { checkpointed: true });
        self.host.store(p.cast(), Ordering::Release);
        self.let_go(old, old_host);
        true
    }

    /// Restore: the bytes of a checkpointed backing move back into granules of the
    /// GPU's file. `false` (nothing changed) when the file has no room.
    fn move_to_device(&self) -> bool {
        let mut place = lock(&self.place);
        if !matches!(*place, Place::Mapped { checkpointed: true }) {
            return true;
        }
        let machine = store().machine;
        let granules = self.len as u64 / GRANULARITY;
        let Ok(runs) = machine.extent_alloc(self.gpu, granules) else {
            return false;
        };
        let Some((host, own)) = map_runs(self.gpu, &runs) else {
            machine.extent_free(self.gpu, &runs);
            return false;
        };
        populate_runs(self.gpu, &runs, host, own);
        let old_host = self.host();
        // SAFETY: both ranges are `len` long and distinct; nothing uses the bytes.
        unsafe { kiwi_sim_core::dma::copy(host, old_host, self.len) };
        let old = std::mem::replace(&mut *place, Place::File { runs, own });
        self.host.store(host, Ordering::Release);
        self.let_go(old, old_host);
        true
    }
}

impl Drop for Backing {
    fn drop(&mut self) {
        if let Some(s) = STORE.get() {
            lock(&s.live).remove(&(self as *const Backing as usize));
        }
        let place = std::mem::replace(
            self.place.get_mut().unwrap_or_else(|e| e.into_inner()),
            Place::Mapped {
                checkpointed: false,
            },
        );
        self.let_go(place, self.host());
    }
}

/// Every backing of this process that is in a GPU's file.
fn live() -> Vec<Arc<Backing>> {
    lock(&store().live)
        .values()
        .filter_map(Weak::upgrade)
        .collect()
}

/// Checkpoint: every byte of device memory moves into host memory of this process
/// and its granules go back to the files, as the driver's checkpoint moves device
/// memory into host memory. `false` when host memory ran out (what moved stays
/// moved; a restore brings it back).
pub fn to_host() -> bool {
    live().iter().all(|b| b.move_to_host())
}

/// Restore: every checkpointed byte moves back into the GPUs' files. `false` when a
/// file has no room (what moved stays; the rest can be tried again).
pub fn to_device() -> bool {
    live().iter().all(|b| b.move_to_device())
}

/// `size` bytes (a multiple of [`UNIT`], at most [`SMALL_MAX`]) in one of this
/// process's slabs on `gpu`: (the slab, offset).
pub fn small(gpu: u32, size: u64) -> Option<(Arc<Backing>, u64)> {
    let units = size.div_ceil(UNIT) as usize;
    let mut slabs = lock(store().slabs.get(gpu as usize)?);
    for s in slabs.iter_mut() {
        if let Some(at) = s.take(units) {
            return Some((s.backing.clone(), at as u64 * UNIT));
        }
    }
    let backing = Backing::in_file(gpu, 1)?;
    let mut s = Slab {
        backing,
        used: [0; UNITS / 64],
        count: 0,
    };
    let at = s.take(units).expect("a new slab has room");
    let b = s.backing.clone();
    slabs.push(s);
    Some((b, at as u64 * UNIT))
}

/// Gives back a [`small`] allocation. A slab left empty goes back to the file,
/// unless it is the only empty one (kept for the next small allocation).
pub fn small_free(slab: &Arc<Backing>, offset: u64, size: u64) {
    let Some(slabs) = store().slabs.get(slab.gpu as usize) else {
        return;
    };
    let mut slabs = lock(slabs);
    let Some(i) = slabs.iter().position(|s| Arc::ptr_eq(&s.backing, slab)) else {
        return;
    };
    let first = (offset / UNIT) as usize;
    let units = size.div_ceil(UNIT) as usize;
    slabs[i].give(first, units);
    if slabs[i].count == 0 && slabs.iter().filter(|s| s.count == 0).count() > 1 {
        slabs.swap_remove(i);
    }
}

impl Slab {
    fn is_used(&self, u: usize) -> bool {
        self.used[u / 64] & (1 << (u % 64)) != 0
    }

    fn set(&mut self, u: usize, on: bool) {
        if on {
            self.used[u / 64] |= 1 << (u % 64);
        } else {
            self.used[u / 64] &= !(1 << (u % 64));
        }
    }

    /// The first free stretch of `units`, taken.
    fn take(&mut self, units: usize) -> Option<usize> {
        if UNITS - self.count < units {
            return None;
        }
        let mut start = 0;
        while start + units <= UNITS {
            match (start..start + units).find(|&u| self.is_used(u)) {
                Some(u) => start = u + 1,
                None => {
                    for u in start..start + units {
                        self.set(u, true);
                    }
                    self.count += units;
                    return Some(start);
                }
            }
        }
        None
    }

    fn give(&mut self, first: usize, units: usize) {
        for u in first..(first + units).min(UNITS) {
            if self.is_used(u) {
                self.set(u, false);
                self.count -= 1;
            }
        }
    }
}
