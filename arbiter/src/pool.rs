//! The node's swap pool: host memory the arbiter owns and lends to clients as memfds.
//!
//! GPU memory swapped out to the host must not be charged to the tenant's own memory
//! cgroup: a memory cgroup charges a page to the cgroup of the task that first faults
//! it in (or `fallocate`s it), and a shared page stays charged there wherever it is
//! mapped later ("first touch", see FIELD-NOTES "Host memory, cgroups and the swap
//! store"). So the arbiter, in Kiwi's own cgroup, creates the memory itself: every
//! slice is a fresh memfd whose pages this module populates *before* it is lent, on
//! the pool's background thread (ahead of need) or on the taker's blocking thread (what
//! was not ready). A client maps the descriptor it is lent `MAP_SHARED` and copies
//! swapped-out GPU memory into it without ever faulting in a page of its own.
//!
//! This module owns:
//!
//! - **The memory and its bound.** At most [`PoolConfig::size`] bytes exist at once,
//!   counting slices ready, lent, being populated and waiting to be scrubbed; every
//!   memfd holds at least 2 MiB, so at most `size / 2 MiB` memfds are open. A take past
//!   the size is refused ([`PoolError::Full`], naming the largest holders).
//! - **Readiness.** The background thread keeps
//!   `ready >= min(max(floor, wanted - lent), size - lent)` ([`Pool::set_wanted`]) and
//!   frees ready slices beyond that.
//! - **Isolation between tenants.** A lent memfd is sealed against growing and
//!   shrinking, and against further seals (so a client cannot add a write seal that
//!   would stop the scrub). A returned slice is never lent again: a client may keep its
//!   mapping or a duplicate of the descriptor, so on return the background thread
//!   scrubs it (`fallocate(PUNCH_HOLE | KEEP_SIZE)` over the whole file: its pages are
//!   freed, and anything still mapping it reads zeros or faults in new pages charged to
//!   itself), then closes the pool's descriptor. New slices are always fresh memfds
//!   (`MFD_CLOEXEC`), never reachable by path. A client can return only what was lent
//!   to it; unknown ids are ignored.
//! - **Never scrubbed under a live client.** A slice is scrubbed only when its client
//!   gave it back, its process has exited, or the answer to its spill was sent
//!   ([`Pool::spill_sent`]); a connection that closes under a live process leaves
//!   what it was lent to the process ([`Pool::release_owner`], [`Pool::reap`]).
//! - **Page size.** Detected at start ([`PageMode::detect`]): hugetlb pages when enough
//!   are free for a slice, else transparent huge pages when `shmem_enabled` allows them
//!   for a memfd (`always`/`within_size`/`force`; `advise`, with `MADV_HUGEPAGE`),
//!   else 4 KiB pages. Every page is faulted in for write through a temporary mapping
//!   (`MADV_POPULATE_WRITE`), which clears it here: pages `fallocate` gives tmpfs are
//!   not cleared until their first fault, which would be the client's.
//! - **The disk tier** (optional, [`Pool::enable_spill`], `[arbiter] spill_dir` and
//!   `spill_budget`). A client that no longer uses some lent slices (unregistered and
//!   unmapped) has the pool move them to disk ([`Pool::spill`]): each slice is copied
//!   to a spill file of its own (a nameless `O_TMPFILE` in the directory, see
//!   `pool/spill.rs`), then taken back exactly as a [`Pool::give`] takes it (scrubbed,
//!   never lent again), and the client is sent a *read-only* descriptor of the file,
//!   from which it reads its data back itself at swap-in. The pool owns the spill files
//!   and their bound: the bytes in them at once (at most [`SpillConfig::budget`], and
//!   never past the disk's free space less a reserve of `min(5%, 1 GiB)`), and its own
//!   read-write descriptor of each, closed when the client gives the spill id back or
//!   its connection goes (the file's blocks are freed once the client's descriptor is
//!   closed too). The client's descriptor is a separate read-only open, so the client
//!   cannot write to the file or grow it past what the budget counted. Spilled bytes
//!   are host memory no longer: they are not part of the lent or populated figures,
//!   nor of the size.
//!
//! Everything here is thread-safe and blocking: tokio code calls [`Pool::take`] (which
//! may populate) and [`Pool::spill`] (which writes to disk) from `spawn_blocking`;
//! [`Pool::give`], [`Pool::release_owner`], [`Pool::set_wanted`] and [`Pool::stats`]
//! only take the pool's lock briefly.
//!
//! The pool's books (`State`: every byte it holds, by where it is) and its handle
//! are defined here; each part is its own file: `slices.rs` (a slice's memfd: page
//! modes, creating and populating, cutting, sealing, scrubbing), `lend.rs` (takes,
//! returns, orphans, kept slices), `background.rs` (the thread that scrubs and keeps
//! slices ready), `disk_tier.rs` (spilling lent slices to disk, over `spill.rs`'s
//! files; its books, `DiskTier`, are its own) and `stats.rs` (the figures).

use std::collections::{HashMap, VecDeque};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Who holds lent slices: the server's connection id.
pub type Owner = u64;
/// A client process: (host pid, start time in clock ticks since boot), which tells a
/// pid reused by another process from the one that borrowed.
pub type Process = (u32, u64);

const MIB: u64 = 1 << 20;
/// Every take and every slice is a multiple of this (2 MiB: a PMD-sized huge page).
pub const UNIT: u64 = 2 * MIB;
/// The default slice: 64 MiB per memfd.
pub const DEFAULT_SLICE: u64 = 64 * MIB;
/// The least [`default_size`].
pub const MIN_DEFAULT_SIZE: u64 = 256 * MIB;
/// The most slices one [`Pool::take`] lends.
pub const MAX_SLICES_PER_TAKE: usize = 64;
/// How many holders a [`PoolError::Full`] names.
const HOLDERS_NAMED: usize = 3;
/// After a failed background populate, the thread waits this long before trying again.
const RETRY_AFTER_ERROR: Duration = Duration::from_secs(1);
/// The memfds' name (only seen in `/proc/<pid>/fd`; a memfd has no path).
const MEMFD_NAME: &std::ffi::CStr = c"kiwi-swap-pool";

/// The pool's configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolConfig {
    /// The most bytes the pool holds (ready, lent, being populated or scrubbed); > 0.
    pub size: u64,
    /// Bytes populated ready at start and kept ready.
    pub floor: u64,
    /// Bytes per slice memfd: a multiple of 2 MiB.
    pub slice: u64,
}

impl PoolConfig {
    /// A pool of `size` bytes, no floor, 64 MiB slices.
    pub fn new(size: u64) -> Self {
        PoolConfig {
            size,
            floor: 0,
            slice: DEFAULT_SLICE,
        }
    }

    /// The pool `[arbiter] swap_pool` asks for (half the host's available memory for
    /// `auto`), `floor` bytes of it populated at start; `None` when off.
    pub fn from_setting(setting: kiwi_config::SwapPool, floor: u64) -> Option<Self> {
        let size = match setting {
            kiwi_config::SwapPool::Off => return None,
            kiwi_config::SwapPool::Auto => default_size(),
            kiwi_config::SwapPool::Size(size) => size,
        };
        Some(PoolConfig {
            floor: floor.min(size),
            ..PoolConfig::new(size)
        })
    }

    fn validate(&self) -> Result<(), PoolError> {
        let bad = |why: String| Err(PoolError::Config(why));
        if self.size < UNIT {
            return bad(format!("size {} is less than one 2 MiB unit", self.size));
        }
        if self.slice == 0 || !self.slice.is_multiple_of(UNIT) {
            return bad(format!(
                "slice {} is not a positive multiple of 2 MiB",
                self.slice
            ));
        }
        if self.floor > self.size {
            return bad(format!(
                "floor {} is past the size {}",
                self.floor, self.size
            ));
        }
        Ok(())
    }
}

/// The default pool size: half of `MemAvailable` in `/proc/meminfo` at start, at least
/// [`MIN_DEFAULT_SIZE`] (also when `/proc/meminfo` cannot be read), in 2 MiB units.
pub fn default_size() -> u64 {
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    default_size_from(&meminfo)
}

/// [`default_size`] from the text of a `/proc/meminfo`.
pub fn default_size_from(meminfo: &str) -> u64 {
    let available = meminfo_bytes(meminfo, "MemAvailable").unwrap_or(0);
    round_down(available / 2, UNIT).max(MIN_DEFAULT_SIZE)
}

/// A `/proc/meminfo` field in bytes (`kB` fields are scaled, bare counts are not).
fn meminfo_bytes(meminfo: &str, field: &str) -> Option<u64> {
    meminfo.lines().find_map(|line| {
        let (name, rest) = line.split_once(':')?;
        if name.trim() != field {
            return None;
        }
        let mut words = rest.split_whitespace();
        let n: u64 = words.next()?.parse().ok()?;
        match words.next() {
            Some("kB") => n.checked_mul(1024),
            None => Some(n),
            Some(_) => None,
        }
    })
}

/// Why the pool refused.
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    #[error("swap pool: bad configuration: {0}")]
    Config(String),
    /// The disk tier refused or failed: none configured, its directory missing or not
    /// usable, its budget full, the disk too full, or an I/O error on a spill file.
    /// `reason` is one line and names the directory where one is involved.
    #[error("swap pool spill: {reason}")]
    Spill { reason: String },
    #[error(
        "swap pool full: {bytes} bytes asked, {lent} of {size} lent (largest holders: {})",
        holders_text(holders)
    )]
    Full {
        size: u64,
        lent: u64,
        /// The request, rounded up.
        bytes: u64,
        /// The largest holders (tenant, bytes lent), largest first.
        holders: Vec<(String, u64)>,
    },
    #[error("swap pool: {bytes} bytes in one take is past the limit of {max} (64 slices)")]
    TooLarge { bytes: u64, max: u64 },
    #[error("swap pool is shut down")]
    ShutDown,
    #[error("swap pool: {op}: {source}")]
    Io {
        op: &'static str,
        #[source]
        source: io::Error,
    },
}

fn holders_text(holders: &[(String, u64)]) -> String {
    if holders.is_empty() {
        return "none".into();
    }
    holders
        .iter()
        .map(|(t, b)| format!("{t} {b}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// One memfd of the pool.
#[derive(Debug)]
struct Slice {
    fd: OwnedFd,
    bytes: u64,
}

#[derive(Debug)]
struct Held {
    owner: Owner,
    tenant: String,
    slice: Slice,
}

#[derive(Debug, Default)]
struct State {
    ready: Vec<Slice>,
    ready_bytes: u64,
    lent: HashMap<u64, Held>,
    lent_bytes: u64,
    /// Slices an earlier arbiter lent that a client still maps (it says so after a
    /// restart, [`Pool::keep`]): counted against the size, by owner.
    kept: HashMap<Owner, (String, u64)>,
    kept_bytes: u64,
    /// What was lent on connections that closed while their process lived, by that
    /// process: never scrubbed under it (it may hold swapped-out memory there), counted
    /// against the size, until the process exits ([`Pool::reap`]).
    orphans: HashMap<Process, Vec<Held>>,
    orphan_bytes: u64,
    /// Slices spilled whose answer is not sent yet, by owner: still lent, scrubbed
    /// only once the client has its spill files ([`Pool::spill_sent`]).
    unsent: HashMap<Owner, Vec<u64>>,
    tenants: HashMap<String, u64>,
    /// Bytes of takes in flight (slices chosen or being populated, not yet lent).
    reserved: u64,
    /// Bytes of takes in flight still to be populated (part of `reserved`).
    take_populating: u64,
    /// Bytes the background thread is populating now.
    populating: u64,
    /// Returned slices waiting for the thread; `scrubbing` also counts the one in hand.
    scrub: VecDeque<Slice>,
    scrubbing: u64,
    wanted: u64,
    next_id: u64,
    stopping: bool,
    /// The thread has exited: a return is scrubbed on the returner's thread.
    stopped: bool,
    /// The thread is waiting with nothing to do.
    idle: bool,
    retry_at: Option<Instant>,
    last_error: Option<String>,
    scrub_failures: u64,
    /// The disk tier's books: its configuration and spill files.
    disk: DiskTier,
}

impl State {
    /// Every byte the pool accounts for; never past the size.
    fn held(&self) -> u64 {
        self.ready_bytes
            + self.lent_bytes
            + self.kept_bytes
            + self.orphan_bytes
            + self.reserved
            + self.populating
            + self.scrubbing
    }

    fn committed(&self) -> u64 {
        self.lent_bytes + self.kept_bytes + self.orphan_bytes + self.reserved
    }

    fn add_tenant(&mut self, tenant: &str, bytes: u64) {
        *self.tenants.entry(tenant.to_string()).or_default() += bytes;
    }

    fn sub_tenant(&mut self, tenant: &str, bytes: u64) {
        if let Some(t) = self.tenants.get_mut(tenant) {
            *t = t.saturating_sub(bytes);
            if *t == 0 {
                self.tenants.remove(tenant);
            }
        }
    }

    /// Forgets what `owner` said it keeps; the bytes.
    fn unkeep(&mut self, owner: Owner) -> u64 {
        match self.kept.remove(&owner) {
            Some((tenant, b)) => {
                self.kept_bytes -= b;
                self.sub_tenant(&tenant, b);
                b
            }
            None => 0,
        }
    }

    /// What the thread keeps ready: `min(max(floor, wanted - lent), size - lent)`.
    fn ready_target(&self, cfg: &PoolConfig) -> u64 {
        let committed = self.committed();
        cfg.floor
            .max(self.wanted.saturating_sub(committed))
            .min(cfg.size.saturating_sub(committed))
    }

    fn holders(&self) -> Vec<(String, u64)> {
        largest_first(&self.tenants)
    }

    /// Takes `id` back from `owner` into the scrub queue; its bytes, 0 when `id` is not
    /// lent to `owner`.
    fn give_back(&mut self, owner: Owner, id: u64) -> u64 {
        match self.lent.get(&id) {
            Some(h) if h.owner == owner => {}
            _ => return 0,
        }
        let Some(held) = self.lent.remove(&id) else {
            return 0;
        };
        let bytes = held.slice.bytes;
        self.lent_bytes -= bytes;
        if let Some(t) = self.tenants.get_mut(&held.tenant) {
            *t = t.saturating_sub(bytes);
            if *t == 0 {
                self.tenants.remove(&held.tenant);
            }
        }
        self.scrubbing += bytes;
        self.scrub.push_back(held.slice);
        self.idle = false;
        bytes
    }
}

#[derive(Debug)]
struct Inner {
    cfg: PoolConfig,
    mode: PageMode,
    state: Mutex<State>,
    /// Signalled on every change the thread or a waiting take may act on.
    changed: Condvar,
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn wait<'a>(&self, st: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        self.changed
            .wait(st)
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn wait_timeout<'a>(&self, st: MutexGuard<'a, State>, d: Duration) -> MutexGuard<'a, State> {
        self.changed
            .wait_timeout(st, d)
            .unwrap_or_else(PoisonError::into_inner)
            .0
    }
}

/// The node's swap pool. See the module doc.
#[derive(Debug)]
pub struct Pool {
    inner: Arc<Inner>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Pool {
    /// Starts the pool with the page mode this host allows ([`PageMode::detect`]); the
    /// background thread populates `floor` at once.
    pub fn start(cfg: PoolConfig) -> Result<Arc<Pool>, PoolError> {
        cfg.validate()?;
        Self::start_with(cfg, PageMode::detect(cfg.slice))
    }

    /// [`Pool::start`] with the page mode chosen by the caller (tests, an operator's
    /// override). Hugetlb needs `slice` to be a multiple of its page.
    pub fn start_with(cfg: PoolConfig, mode: PageMode) -> Result<Arc<Pool>, PoolError> {
        cfg.validate()?;
        if !cfg.slice.is_multiple_of(mode.unit()) {
            return Err(PoolError::Config(format!(
                "slice {} is not a multiple of the huge page ({})",
                cfg.slice,
                mode.unit()
            )));
        }
        let inner = Arc::new(Inner {
            cfg,
            mode,
            state: Mutex::new(State {
                next_id: 1,
                ..State::default()
            }),
            changed: Condvar::new(),
        });
        let for_thread = Arc::clone(&inner);
        let handle = std::thread::Builder::new()
            .name("kiwi-swap-pool".into())
            .spawn(move || background(&for_thread))
            .map_err(|source| PoolError::Io {
                op: "spawning the populating thread",
                source,
            })?;
        Ok(Arc::new(Pool {
            inner,
            thread: Mutex::new(Some(handle)),
        }))
    }

    /// The page mode in use.
    pub fn page_mode(&self) -> PageMode {
        self.inner.mode
    }

    /// The configuration.
    pub fn config(&self) -> PoolConfig {
        self.inner.cfg
    }

    /// Stops the thread (after it has scrubbed what was returned), frees every ready
    /// slice and drops every spill file (clients keep what they read through their own
    /// descriptors). Lent slices stay lent until given back (then scrubbed on the
    /// returner's thread) or until the pool is dropped. Takes and spills fail from now
    /// on. Idempotent; also run on drop.
    pub fn shutdown(&self) {
        let mut st = self.inner.lock();
        st.stopping = true;
        let ready = std::mem::take(&mut st.ready);
        st.ready_bytes = 0;
        let spills = st.disk.take_all();
        drop(st);
        self.inner.changed.notify_all();
        drop(ready);
        drop(spills);
        let handle = self
            .thread
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(h) = handle {
            let _ = h.join();
        }
        // Whatever was returned after the thread's last look.
        let st = self.inner.lock();
        self.after_return(st);
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn round_up(n: u64, unit: u64) -> u64 {
    n.div_ceil(unit).saturating_mul(unit)
}

fn round_down(n: u64, unit: u64) -> u64 {
    n / unit * unit
}

fn io_err(op: &'static str) -> PoolError {
    PoolError::Io {
        op,
        source: io::Error::last_os_error(),
    }
}

/// Retries `f` (a libc call returning -1 on error) while it fails with EINTR.
fn retry_eintr(mut f: impl FnMut() -> libc::c_int) -> libc::c_int {
    loop {
        let r = f();
        if r != -1 || io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
            return r;
        }
    }
}

mod background;
use background::background;
mod disk_tier;
use disk_tier::DiskTier;
pub use disk_tier::{SpillConfig, Spilled};
mod lend;
pub use lend::Lent;
mod slices;
pub use slices::PageMode;
mod spill;
mod stats;
use stats::largest_first;
pub use stats::PoolStats;

#[cfg(test)]
mod tests;
