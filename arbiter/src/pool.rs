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
//!   for a memfd (`always`/`within_size`/`force`: `fallocate`; `advise`: a temporary
//!   mapping with `MADV_HUGEPAGE` and `MADV_POPULATE_WRITE`), else 4 KiB pages.
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

/// How the pool's pages are made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PageMode {
    /// 4 KiB pages, populated with `fallocate`.
    Small,
    /// Transparent huge pages by `fallocate` (`shmem_enabled` is `always`,
    /// `within_size` or `force`).
    ThpFallocate,
    /// Transparent huge pages through a temporary mapping with `MADV_HUGEPAGE` and
    /// `MADV_POPULATE_WRITE` (`shmem_enabled` is `advise`).
    ThpAdvise,
    /// Reserved hugetlb pages (`MFD_HUGETLB`) of `page` bytes, populated with
    /// `fallocate`.
    HugeTlb { page: u64 },
}

impl PageMode {
    /// The mode this host allows for slices of `slice` bytes (see the module doc).
    pub fn detect(slice: u64) -> PageMode {
        let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        let shmem =
            std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/shmem_enabled").ok();
        Self::detect_from(&meminfo, shmem.as_deref(), slice)
    }

    /// [`PageMode::detect`] from the text of `/proc/meminfo` and of
    /// `/sys/kernel/mm/transparent_hugepage/shmem_enabled` (`None`: no THP).
    pub fn detect_from(meminfo: &str, shmem_enabled: Option<&str>, slice: u64) -> PageMode {
        let page = meminfo_bytes(meminfo, "Hugepagesize").unwrap_or(0);
        let free = meminfo_bytes(meminfo, "HugePages_Free").unwrap_or(0);
        if page > 0 && slice.is_multiple_of(page) && free.saturating_mul(page) >= slice {
            return PageMode::HugeTlb { page };
        }
        // The selected setting is the bracketed word: "always within_size [advise] never".
        let selected = shmem_enabled.and_then(|s| {
            let start = s.find('[')?;
            let end = s[start..].find(']')?;
            Some(&s[start + 1..start + end])
        });
        match selected {
            Some("always" | "within_size" | "force") => PageMode::ThpFallocate,
            Some("advise") => PageMode::ThpAdvise,
            _ => PageMode::Small,
        }
    }

    /// The name stats report: `"4KiB"`, `"thp"` or `"hugetlb"`.
    pub fn name(self) -> &'static str {
        match self {
            PageMode::Small => "4KiB",
            PageMode::ThpFallocate | PageMode::ThpAdvise => "thp",
            PageMode::HugeTlb { .. } => "hugetlb",
        }
    }

    /// What every take and slice is a multiple of.
    fn unit(self) -> u64 {
        match self {
            PageMode::HugeTlb { page } => page.max(UNIT),
            _ => UNIT,
        }
    }
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

/// One slice lent: its id (for [`Pool::give`]), its size, and a duplicate of the
/// pool's descriptor for sending to the client (the pool keeps its own to scrub it).
#[derive(Debug)]
pub struct Lent {
    pub id: u64,
    pub bytes: u64,
    pub fd: OwnedFd,
}

/// Where and how much the pool may spill (`[arbiter] spill_dir`, `spill_budget`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpillConfig {
    /// The directory spill files are made in (nameless `O_TMPFILE`s: nothing of them
    /// is ever visible there).
    pub dir: PathBuf,
    /// The most bytes in spill files at once. None: bounded only by the disk's free
    /// space (less its reserve).
    pub budget: Option<u64>,
}

/// A slice written to its spill file, not committed yet ([`Pool::spill`]).
struct Written {
    from: u64,
    bytes: u64,
    /// The pool's read-write descriptor and the client's read-only one.
    file: OwnedFd,
    client: OwnedFd,
}

/// One slice moved to disk.
#[derive(Debug)]
pub struct Spilled {
    /// The slice id it replaces.
    pub from: u64,
    /// Its new id (give it back with [`Pool::give`] when read back).
    pub id: u64,
    pub bytes: u64,
    /// Read-only descriptor of the spill file (for the client).
    pub fd: OwnedFd,
}

/// The pool's figures at one moment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolStats {
    pub size: u64,
    pub floor: u64,
    pub slice: u64,
    pub wanted: u64,
    /// Ready plus lent.
    pub populated: u64,
    pub ready: u64,
    pub lent: u64,
    /// Being populated now (by the background thread and takes in flight).
    pub populating: u64,
    /// Returned and not yet scrubbed.
    pub scrubbing: u64,
    /// Memfds the pool holds open (ready, lent and waiting to be scrubbed).
    pub memfds: usize,
    /// Bytes lent per tenant, largest first; a tenant holding nothing is absent.
    pub tenants: Vec<(String, u64)>,
    /// `"4KiB"`, `"thp"` or `"hugetlb"`.
    pub page_mode: &'static str,
    /// Scrubs that failed (the slice was closed anyway; never re-lent).
    pub scrub_failures: u64,
    /// The last error populating in the background, if any.
    pub last_error: Option<String>,
    /// Bytes in spill files now (the disk tier; not part of `lent` or `populated`, not
    /// counted against `size`).
    pub spilled: u64,
    /// Spill files the pool holds open.
    pub spill_files: usize,
    /// The disk tier's budget (None: the disk's free space less its reserve, or no
    /// disk tier).
    pub spill_budget: Option<u64>,
    /// The disk tier's directory; None: no disk tier.
    pub spill_dir: Option<String>,
    /// Bytes in spill files per tenant, largest first; a tenant with none is absent.
    pub spilled_tenants: Vec<(String, u64)>,
    /// Spills that failed or were refused (each [`Pool::spill`] that stopped short).
    pub spill_failures: u64,
    /// The last spill failure's line, if any.
    pub last_spill_error: Option<String>,
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

/// A slice's contents on disk: the pool's read-write descriptor of its spill file.
#[derive(Debug)]
struct SpillFile {
    owner: Owner,
    tenant: String,
    bytes: u64,
    fd: OwnedFd,
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
    /// The disk tier; None: not enabled.
    spill: Option<SpillConfig>,
    /// Spill files by id (ids from `next_id`, shared with slices).
    spills: HashMap<u64, SpillFile>,
    spilled_bytes: u64,
    /// Bytes of spills being written now (counted against the budget).
    spilling: u64,
    spill_tenants: HashMap<String, u64>,
    spill_failures: u64,
    last_spill_error: Option<String>,
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

    /// Forgets `owner`'s spill file `id`; its descriptor (to be closed outside the
    /// lock), None when `id` is no spill file of `owner`'s.
    fn drop_spill(&mut self, owner: Owner, id: u64) -> Option<OwnedFd> {
        match self.spills.get(&id) {
            Some(f) if f.owner == owner => {}
            _ => return None,
        }
        let f = self.spills.remove(&id)?;
        self.spilled_bytes -= f.bytes;
        if let Some(t) = self.spill_tenants.get_mut(&f.tenant) {
            *t = t.saturating_sub(f.bytes);
            if *t == 0 {
                self.spill_tenants.remove(&f.tenant);
            }
        }
        Some(f.fd)
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

    /// Lends `bytes` (rounded up to 2 MiB, or to the hugetlb page) to `owner`, labelled
    /// `tenant`, as at most 64 slices: ready ones first (one larger than needed is cut
    /// down), then fresh ones populated here, on the caller's (blocking) thread. Every
    /// slice is fully populated and sealed before it is lent. Refused when the lent
    /// bytes would pass the pool's size. `bytes == 0` lends nothing.
    pub fn take(&self, owner: Owner, tenant: &str, bytes: u64) -> Result<Vec<Lent>, PoolError> {
        if bytes == 0 {
            return Ok(Vec::new());
        }
        let cfg = self.inner.cfg;
        let unit = self.inner.mode.unit();
        let max = cfg.slice.saturating_mul(MAX_SLICES_PER_TAKE as u64);
        if bytes > max {
            return Err(PoolError::TooLarge { bytes, max });
        }
        let bytes = round_up(bytes, unit);

        let mut st = self.inner.lock();
        if st.stopping {
            return Err(PoolError::ShutDown);
        }
        if st.committed().saturating_add(bytes) > cfg.size {
            let mut holders = st.holders();
            holders.truncate(HOLDERS_NAMED);
            return Err(PoolError::Full {
                size: cfg.size,
                lent: st.committed(),
                bytes,
                holders,
            });
        }
        st.reserved += bytes;
        st.idle = false;

        let mut chosen: Vec<Slice> = Vec::new();
        let mut have = 0u64;
        let mut to_free: Vec<Slice> = Vec::new();
        loop {
            // Ready slices first, largest first.
            while have < bytes {
                let need = bytes - have;
                let Some(i) = largest(&st.ready) else { break };
                let use_bytes = st.ready[i].bytes.min(need);
                let after = chosen.len() + 1 + ceil_div(need - use_bytes, cfg.slice);
                if after > MAX_SLICES_PER_TAKE {
                    break;
                }
                let s = st.ready.swap_remove(i);
                st.ready_bytes -= s.bytes;
                if s.bytes > use_bytes {
                    // Cut down before it is lent; the tail's pages are freed here.
                    if truncate(&s.fd, use_bytes).is_err() {
                        to_free.push(s);
                        continue;
                    }
                }
                have += use_bytes;
                chosen.push(Slice {
                    fd: s.fd,
                    bytes: use_bytes,
                });
            }
            if have == bytes {
                break;
            }
            // Room for the rest: what is ready and unused goes first, then wait for the
            // thread to finish what it populates or scrubs.
            while st.held() > cfg.size {
                let Some(s) = st.ready.pop() else { break };
                st.ready_bytes -= s.bytes;
                to_free.push(s);
            }
            if st.held() <= cfg.size || (st.populating == 0 && st.scrubbing == 0) {
                break;
            }
            if st.stopping {
                st.reserved -= bytes;
                drop(st);
                self.inner.changed.notify_all();
                return Err(PoolError::ShutDown);
            }
            st = self.inner.wait(st);
        }
        let rest = bytes - have;
        st.take_populating += rest;
        drop(st);
        drop(to_free);

        let made = self.populate_for_take(rest, &mut chosen);
        let sealed = made.and_then(|()| {
            chosen
                .iter()
                .map(|s| {
                    seal(&s.fd)?;
                    s.fd.try_clone().map_err(|source| PoolError::Io {
                        op: "duplicating a slice's descriptor",
                        source,
                    })
                })
                .collect::<Result<Vec<OwnedFd>, PoolError>>()
        });

        let mut st = self.inner.lock();
        st.reserved -= bytes;
        st.take_populating -= rest;
        let dups = match sealed {
            Ok(dups) => dups,
            Err(e) => {
                drop(st);
                self.inner.changed.notify_all();
                // Never lent: closing them frees their pages.
                drop(chosen);
                return Err(e);
            }
        };
        let mut lent = Vec::with_capacity(chosen.len());
        for (slice, fd) in chosen.into_iter().zip(dups) {
            let id = st.next_id;
            st.next_id += 1;
            st.lent_bytes += slice.bytes;
            *st.tenants.entry(tenant.to_owned()).or_insert(0) += slice.bytes;
            lent.push(Lent {
                id,
                bytes: slice.bytes,
                fd,
            });
            st.lent.insert(
                id,
                Held {
                    owner,
                    tenant: tenant.to_owned(),
                    slice,
                },
            );
        }
        st.idle = false;
        drop(st);
        self.inner.changed.notify_all();
        Ok(lent)
    }

    /// Creates and populates fresh slices for `rest` bytes into `chosen`.
    fn populate_for_take(&self, mut rest: u64, chosen: &mut Vec<Slice>) -> Result<(), PoolError> {
        while rest > 0 {
            let n = rest.min(self.inner.cfg.slice);
            chosen.push(create_slice(self.inner.mode, n)?);
            rest -= n;
        }
        Ok(())
    }

    /// Takes back the slices `ids` lent to `owner`, and drops its spill files among
    /// `ids` ([`Pool::spill`]'s [`Spilled::id`]: the pool closes its descriptor; the
    /// file's blocks are freed once the client's is closed too); ids that are neither
    /// are ignored. Slices are scrubbed on the background thread, never lent again.
    /// Returns the bytes of *slices* taken back (host memory): spill files given back
    /// add nothing, as they were no longer lent (their bytes left the lent figure at
    /// the spill).
    pub fn give(&self, owner: Owner, ids: &[u64]) -> u64 {
        let mut st = self.inner.lock();
        let mut closing = Vec::new();
        let mut bytes = 0;
        for &id in ids {
            bytes += st.give_back(owner, id);
            closing.extend(st.drop_spill(owner, id));
        }
        self.after_return(st);
        // Closing a spill file the client has closed already frees its blocks: not
        // under the lock.
        drop(closing);
        bytes
    }

    /// `owner`'s connection closed: drops all its spill files (the client reads its
    /// own descriptors of them), and takes back everything lent to it, scrubbed,
    /// unless `alive` names its process, still running: then what it was lent is
    /// its process's until that exits ([`Pool::reap`]), unscrubbed and counted
    /// against the size, because a connection can close under a live client (a
    /// timeout, a refusal, an answer lost) whose swapped-out memory is in those
    /// slices. Returns the bytes of slices taken back now, as [`Pool::give`].
    pub fn release_owner(&self, owner: Owner, alive: Option<Process>) -> u64 {
        let mut st = self.inner.lock();
        st.unkeep(owner);
        st.unsent.remove(&owner);
        let ids: Vec<u64> = st
            .lent
            .iter()
            .filter(|(_, h)| h.owner == owner)
            .map(|(&id, _)| id)
            .collect();
        let bytes = match alive {
            Some(process) => {
                for id in ids {
                    if let Some(h) = st.lent.remove(&id) {
                        st.lent_bytes -= h.slice.bytes;
                        st.orphan_bytes += h.slice.bytes;
                        st.orphans.entry(process).or_default().push(h);
                    }
                }
                0
            }
            None => ids.iter().map(|&id| st.give_back(owner, id)).sum(),
        };
        let spill_ids: Vec<u64> = st
            .spills
            .iter()
            .filter(|(_, f)| f.owner == owner)
            .map(|(&id, _)| id)
            .collect();
        let closing: Vec<OwnedFd> = spill_ids
            .iter()
            .filter_map(|&id| st.drop_spill(owner, id))
            .collect();
        self.after_return(st);
        drop(closing);
        bytes
    }

    /// Scrubs what the processes that have exited were lent on connections that
    /// closed before them (`alive` says whether a process still runs). Returns the
    /// bytes taken back.
    pub fn reap(&self, alive: impl Fn(Process) -> bool) -> u64 {
        let mut st = self.inner.lock();
        let gone: Vec<Process> = st.orphans.keys().copied().filter(|&p| !alive(p)).collect();
        let mut bytes = 0;
        for p in gone {
            for h in st.orphans.remove(&p).unwrap_or_default() {
                let n = h.slice.bytes;
                st.orphan_bytes -= n;
                st.sub_tenant(&h.tenant, n);
                st.scrubbing += n;
                st.scrub.push_back(h.slice);
                bytes += n;
            }
        }
        if bytes > 0 {
            st.idle = false;
        }
        self.after_return(st);
        bytes
    }

    /// Bytes lent on earlier connections of `process` that closed while it lived.
    pub fn orphaned(&self, process: Process) -> u64 {
        self.inner
            .lock()
            .orphans
            .get(&process)
            .map_or(0, |v| v.iter().map(|h| h.slice.bytes).sum())
    }

    /// The answer to `owner`'s last [`Pool::spill`] is sent: the slices it moved are
    /// taken back and scrubbed now. Until then they stay lent, intact: a client that
    /// never got the answer (the arbiter died, the connection broke) still holds its
    /// memory in them. Returns the bytes taken back.
    pub fn spill_sent(&self, owner: Owner) -> u64 {
        let mut st = self.inner.lock();
        let ids = st.unsent.remove(&owner).unwrap_or_default();
        let bytes = ids.iter().map(|&id| st.give_back(owner, id)).sum();
        self.after_return(st);
        bytes
    }

    /// Enables the disk tier: checks that `cfg.dir` is a directory where an
    /// `O_TMPFILE` can be created (one is created and closed), else
    /// [`PoolError::Spill`] with a one-line reason naming the path. The tier is
    /// configured either way: while the directory is unusable (a disk not mounted
    /// yet, removed), each spill is refused with that reason, and spills work once it
    /// is back. A later call replaces the configuration (spill files already made
    /// stay, and count against the new budget).
    pub fn enable_spill(&self, cfg: SpillConfig) -> Result<(), PoolError> {
        let checked = spill::check_dir(&cfg.dir);
        self.inner.lock().spill = Some(cfg);
        checked
    }

    /// Moves the slices `ids` lent to `owner` to disk, all or none (see the module
    /// doc): each is copied to a spill file of its own; once every copy is written,
    /// each slice is taken back as by [`Pool::give`] and its file recorded under a
    /// new id, labelled `tenant`. Returns one [`Spilled`] per slice, in the order of
    /// `ids`; ids not lent to `owner` are skipped silently. On any failure nothing
    /// moved: the files written are dropped, every slice stays lent, untouched, and
    /// the error is returned (counted in [`PoolStats::spill_failures`] and kept in
    /// [`PoolStats::last_spill_error`]). All or none, because the client has given up
    /// its mapping's registration for the spill and must know which contents are
    /// where. Blocking (it writes to disk, without the pool's lock): call it from a
    /// blocking thread. Refused when no disk tier is enabled, and once the pool is
    /// shut down.
    pub fn spill(
        &self,
        owner: Owner,
        tenant: &str,
        ids: &[u64],
    ) -> Result<Vec<Spilled>, PoolError> {
        let mut written: Vec<Written> = Vec::new();
        let mut result = {
            let st = self.inner.lock();
            if st.stopping {
                return Err(PoolError::ShutDown);
            }
            if st.spill.is_none() {
                Err(no_spill_dir())
            } else {
                Ok(())
            }
        };
        if result.is_ok() {
            for &from in ids {
                match self.write_one(owner, from) {
                    Ok(Some(w)) => written.push(w),
                    Ok(None) => {}
                    Err(e) => {
                        result = Err(e);
                        break;
                    }
                }
            }
        }
        let mut st = self.inner.lock();
        st.spilling -= written.iter().map(|w| w.bytes).sum::<u64>();
        if result.is_ok() && st.stopping {
            result = Err(PoolError::ShutDown);
        }
        if result.is_ok()
            && !written
                .iter()
                .all(|w| st.lent.get(&w.from).is_some_and(|h| h.owner == owner))
        {
            // Never while the owner's connection is served one message at a time.
            result = Err(PoolError::Spill {
                reason: "a slice stopped being lent while it was written".into(),
            });
        }
        if let Err(e) = result {
            if !matches!(e, PoolError::ShutDown) {
                st.spill_failures += 1;
                st.last_spill_error = Some(e.to_string());
            }
            drop(st);
            self.inner.changed.notify_all();
            drop(written);
            return Err(e);
        }
        let mut moved = Vec::with_capacity(written.len());
        for w in written {
            // Taken back once the answer is sent ([`Pool::spill_sent`]).
            st.unsent.entry(owner).or_default().push(w.from);
            let id = st.next_id;
            st.next_id += 1;
            st.spilled_bytes += w.bytes;
            *st.spill_tenants.entry(tenant.to_owned()).or_insert(0) += w.bytes;
            st.spills.insert(
                id,
                SpillFile {
                    owner,
                    tenant: tenant.to_owned(),
                    bytes: w.bytes,
                    fd: w.file,
                },
            );
            moved.push(Spilled {
                from: w.from,
                id,
                bytes: w.bytes,
                fd: w.client,
            });
        }
        drop(st);
        self.inner.changed.notify_all();
        Ok(moved)
    }

    /// Writes one slice to a spill file of its own, its bytes reserved against the
    /// budget (`spilling`) until [`Pool::spill`] commits or drops it; `None` when
    /// `from` is not lent to `owner`.
    fn write_one(&self, owner: Owner, from: u64) -> Result<Option<Written>, PoolError> {
        let (dir, src, bytes) = {
            let mut st = self.inner.lock();
            if st.stopping {
                return Err(PoolError::ShutDown);
            }
            let Some(cfg) = st.spill.clone() else {
                return Err(no_spill_dir());
            };
            let Some(held) = st.lent.get(&from).filter(|h| h.owner == owner) else {
                return Ok(None);
            };
            let bytes = held.slice.bytes;
            if let Some(budget) = cfg.budget {
                let used = st.spilled_bytes + st.spilling;
                if used.saturating_add(bytes) > budget {
                    return Err(PoolError::Spill {
                        reason: format!(
                            "spill budget of {} is full ({} spilled)",
                            spill::mib(budget),
                            spill::mib(used)
                        ),
                    });
                }
            }
            let src = held.slice.fd.try_clone().map_err(|source| PoolError::Io {
                op: "duplicating a slice's descriptor to spill it",
                source,
            })?;
            st.spilling += bytes;
            (cfg.dir, src, bytes)
        };
        // The copy, without the lock: the owner's connection is served sequentially,
        // so the slice stays lent meanwhile (checked again at the commit all the same).
        let result = spill::write(&dir, &src, bytes);
        drop(src);
        match result {
            Ok((file, client)) => Ok(Some(Written {
                from,
                bytes,
                file,
                client,
            })),
            Err(e) => {
                self.inner.lock().spilling -= bytes;
                self.inner.changed.notify_all();
                Err(e)
            }
        }
    }

    /// Wakes the thread; once it has exited, scrubs here.
    fn after_return(&self, mut st: MutexGuard<'_, State>) {
        if st.stopped {
            let queue: Vec<Slice> = st.scrub.drain(..).collect();
            drop(st);
            let (mut done, mut failed) = (0, 0);
            for s in queue {
                done += s.bytes;
                failed += u64::from(scrub(&s).is_err());
            }
            let mut st = self.inner.lock();
            st.scrubbing -= done;
            st.scrub_failures += failed;
        } else {
            drop(st);
        }
        self.inner.changed.notify_all();
    }

    /// `owner` (a client after an arbiter restart) still maps `bytes` of slices an
    /// earlier arbiter lent it: they count against the size (as much as there is room
    /// for, ready slices given up first) until the owner says otherwise or goes.
    /// Replaces what it said before; returns the bytes counted.
    pub fn keep(&self, owner: Owner, process: Option<Process>, tenant: &str, bytes: u64) -> u64 {
        let cfg = self.inner.cfg;
        let mut st = self.inner.lock();
        st.unkeep(owner);
        // What this pool still counts for the process (lent on a connection that
        // closed under it) is not counted twice.
        let orphaned: u64 = process
            .and_then(|p| st.orphans.get(&p))
            .map_or(0, |v| v.iter().map(|h| h.slice.bytes).sum());
        let bytes = bytes.saturating_sub(orphaned);
        let busy = st.held() - st.ready_bytes;
        let counted = bytes.min(cfg.size.saturating_sub(busy));
        if counted > 0 {
            st.kept.insert(owner, (tenant.to_string(), counted));
            st.kept_bytes += counted;
            st.add_tenant(tenant, counted);
            // Ready slices past the size go back to the kernel.
            while st.held() > cfg.size {
                let Some(s) = st.ready.pop() else { break };
                st.ready_bytes -= s.bytes;
            }
        }
        st.idle = false;
        drop(st);
        self.inner.changed.notify_all();
        counted
    }

    /// How much the arbiter expects to lend soon; the thread keeps
    /// `min(max(floor, wanted - lent), size - lent)` ready.
    pub fn set_wanted(&self, bytes: u64) {
        let mut st = self.inner.lock();
        st.wanted = bytes;
        st.idle = false;
        drop(st);
        self.inner.changed.notify_all();
    }

    /// The pool's figures now.
    pub fn stats(&self) -> PoolStats {
        let cfg = self.inner.cfg;
        let st = self.inner.lock();
        PoolStats {
            size: cfg.size,
            floor: cfg.floor,
            slice: cfg.slice,
            wanted: st.wanted,
            populated: st.ready_bytes + st.lent_bytes,
            ready: st.ready_bytes,
            lent: st.lent_bytes + st.kept_bytes + st.orphan_bytes,
            populating: st.populating + st.take_populating,
            scrubbing: st.scrubbing,
            memfds: st.ready.len()
                + st.lent.len()
                + st.scrub.len()
                + st.orphans.values().map(Vec::len).sum::<usize>(),
            tenants: st.holders(),
            page_mode: self.inner.mode.name(),
            scrub_failures: st.scrub_failures,
            last_error: st.last_error.clone(),
            spilled: st.spilled_bytes,
            spill_files: st.spills.len(),
            spill_budget: st.spill.as_ref().and_then(|c| c.budget),
            spill_dir: st
                .spill
                .as_ref()
                .map(|c| c.dir.to_string_lossy().into_owned()),
            spilled_tenants: largest_first(&st.spill_tenants),
            spill_failures: st.spill_failures,
            last_spill_error: st.last_spill_error.clone(),
        }
    }

    /// Waits up to `timeout` until the background thread has nothing left to do
    /// (nothing to scrub, as much ready as it keeps). True when it got there.
    pub fn settle(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut st = self.inner.lock();
        loop {
            if st.stopped || st.idle {
                return true;
            }
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            st = self.inner.wait_timeout(st, deadline - now);
        }
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
        let spills = std::mem::take(&mut st.spills);
        st.spill_tenants.clear();
        st.spilled_bytes = 0;
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

/// What the thread does next.
enum Work {
    Scrub(Slice),
    Populate(u64),
    Free(Slice),
    Exit,
}

/// The background thread: scrubs returned slices, keeps the ready target, frees ready
/// slices past it.
fn background(inner: &Inner) {
    let cfg = inner.cfg;
    let unit = inner.mode.unit();
    loop {
        let mut st = inner.lock();
        let work = loop {
            if let Some(s) = st.scrub.pop_front() {
                break Work::Scrub(s);
            }
            if st.stopping {
                st.stopped = true;
                break Work::Exit;
            }
            let now = Instant::now();
            let retry_wait = st.retry_at.filter(|&t| t > now).map(|t| t - now);
            let target = st.ready_target(&cfg);
            if retry_wait.is_none() && st.ready_bytes + st.populating < target {
                let short = round_up(target - st.ready_bytes - st.populating, unit);
                let room = round_down(cfg.size.saturating_sub(st.held()), unit);
                let n = short.min(cfg.slice).min(room);
                if n > 0 {
                    st.populating += n;
                    break Work::Populate(n);
                }
            }
            if st.ready_bytes > target {
                let excess = st.ready_bytes - target;
                if let Some(i) = st.ready.iter().position(|s| s.bytes <= excess) {
                    let s = st.ready.swap_remove(i);
                    st.ready_bytes -= s.bytes;
                    break Work::Free(s);
                }
            }
            st.idle = true;
            inner.changed.notify_all();
            st = match retry_wait {
                Some(d) => inner.wait_timeout(st, d),
                None => inner.wait(st),
            };
        };
        st.idle = false;
        drop(st);
        match work {
            Work::Exit => {
                inner.changed.notify_all();
                return;
            }
            Work::Scrub(s) => {
                let bytes = s.bytes;
                let failed = scrub(&s).is_err();
                drop(s);
                let mut st = inner.lock();
                st.scrubbing -= bytes;
                st.scrub_failures += u64::from(failed);
            }
            Work::Free(s) => drop(s),
            Work::Populate(n) => {
                let made = create_slice(inner.mode, n);
                let mut st = inner.lock();
                st.populating -= n;
                match made {
                    Ok(s) if !st.stopping => {
                        st.ready_bytes += s.bytes;
                        st.ready.push(s);
                        st.retry_at = None;
                    }
                    Ok(s) => {
                        drop(st);
                        drop(s);
                    }
                    Err(e) => {
                        st.last_error = Some(e.to_string());
                        st.retry_at = Some(Instant::now() + RETRY_AFTER_ERROR);
                    }
                }
            }
        }
        inner.changed.notify_all();
    }
}

/// The refusal when no disk tier is enabled.
fn no_spill_dir() -> PoolError {
    PoolError::Spill {
        reason: "no spill_dir is configured".into(),
    }
}

/// `(name, bytes)` of a per-tenant map, largest first (then by name).
fn largest_first(map: &HashMap<String, u64>) -> Vec<(String, u64)> {
    let mut v: Vec<(String, u64)> = map.iter().map(|(t, b)| (t.clone(), *b)).collect();
    v.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    v
}

fn largest(slices: &[Slice]) -> Option<usize> {
    slices
        .iter()
        .enumerate()
        .max_by_key(|(_, s)| s.bytes)
        .map(|(i, _)| i)
}

fn round_up(n: u64, unit: u64) -> u64 {
    n.div_ceil(unit).saturating_mul(unit)
}

fn round_down(n: u64, unit: u64) -> u64 {
    n / unit * unit
}

fn ceil_div(n: u64, d: u64) -> usize {
    usize::try_from(n.div_ceil(d)).unwrap_or(usize::MAX)
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

/// A fresh memfd of `bytes`, every page populated by this thread (so charged to this
/// process's cgroup).
fn create_slice(mode: PageMode, bytes: u64) -> Result<Slice, PoolError> {
    let mut flags = libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING;
    if let PageMode::HugeTlb { .. } = mode {
        flags |= libc::MFD_HUGETLB;
    }
    // SAFETY: MEMFD_NAME is a valid NUL-terminated string; memfd_create takes no other
    // pointers.
    let raw = unsafe { libc::memfd_create(MEMFD_NAME.as_ptr(), flags) };
    if raw < 0 {
        return Err(io_err("memfd_create"));
    }
    // SAFETY: `raw` is a descriptor just returned to us and owned by nothing else.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    let len =
        libc::off_t::try_from(bytes).map_err(|_| PoolError::Config("slice too large".into()))?;
    // SAFETY: plain syscall on a descriptor we own.
    if retry_eintr(|| unsafe { libc::ftruncate(fd.as_raw_fd(), len) }) != 0 {
        return Err(io_err("ftruncate of a new slice"));
    }
    match mode {
        PageMode::ThpAdvise => populate_advised(&fd, bytes)?,
        PageMode::Small | PageMode::ThpFallocate | PageMode::HugeTlb { .. } => {
            // SAFETY: plain syscall on a descriptor we own.
            if retry_eintr(|| unsafe { libc::fallocate(fd.as_raw_fd(), 0, 0, len) }) != 0 {
                return Err(io_err("fallocate (populating a slice)"));
            }
        }
    }
    Ok(Slice { fd, bytes })
}

/// Populates `fd` through a temporary 2 MiB-aligned shared mapping with
/// `MADV_HUGEPAGE` and `MADV_POPULATE_WRITE` (falling back to `fallocate` on a kernel
/// without `MADV_POPULATE_WRITE`).
fn populate_advised(fd: &OwnedFd, bytes: u64) -> Result<(), PoolError> {
    let len = usize::try_from(bytes).map_err(|_| PoolError::Config("slice too large".into()))?;
    let span = len + UNIT as usize;
    // SAFETY: a fresh anonymous PROT_NONE reservation at an address of the kernel's
    // choosing; nothing else is touched.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            span,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if base == libc::MAP_FAILED {
        return Err(io_err("mmap (reserving a populating window)"));
    }
    struct Unmap(*mut libc::c_void, usize);
    impl Drop for Unmap {
        fn drop(&mut self) {
            // SAFETY: the range is the reservation made above (and the mapping placed
            // inside it), used by no one else and never referenced after this.
            unsafe { libc::munmap(self.0, self.1) };
        }
    }
    let _unmap = Unmap(base, span);
    let aligned = round_up(base as u64, UNIT) as usize as *mut libc::c_void;
    // SAFETY: MAP_FIXED at an address inside our own reservation (`aligned + len` is
    // within `base + span`), replacing only that reservation.
    let at = unsafe {
        libc::mmap(
            aligned,
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_FIXED,
            fd.as_raw_fd(),
            0,
        )
    };
    if at == libc::MAP_FAILED {
        return Err(io_err("mmap (a slice to populate)"));
    }
    // SAFETY: advice on our own mapping of `len` bytes at `aligned`.
    if unsafe { libc::madvise(aligned, len, libc::MADV_HUGEPAGE) } != 0 {
        return Err(io_err("madvise(MADV_HUGEPAGE)"));
    }
    // SAFETY: as above; POPULATE_WRITE only faults pages in, it writes no data.
    let r = retry_eintr(|| unsafe { libc::madvise(aligned, len, libc::MADV_POPULATE_WRITE) });
    if r != 0 {
        if io::Error::last_os_error().raw_os_error() != Some(libc::EINVAL) {
            return Err(io_err("madvise(MADV_POPULATE_WRITE)"));
        }
        let off = libc::off_t::try_from(bytes).unwrap_or(libc::off_t::MAX);
        // SAFETY: plain syscall on a descriptor we own.
        if retry_eintr(|| unsafe { libc::fallocate(fd.as_raw_fd(), 0, 0, off) }) != 0 {
            return Err(io_err("fallocate (populating a slice)"));
        }
    }
    Ok(())
}

fn truncate(fd: &OwnedFd, bytes: u64) -> Result<(), PoolError> {
    let len =
        libc::off_t::try_from(bytes).map_err(|_| PoolError::Config("slice too large".into()))?;
    // SAFETY: plain syscall on a descriptor we own.
    if retry_eintr(|| unsafe { libc::ftruncate(fd.as_raw_fd(), len) }) != 0 {
        return Err(io_err("ftruncate (cutting a ready slice down)"));
    }
    Ok(())
}

/// Seals a slice before it is lent: no growing, no shrinking, no further seals (a
/// write seal would stop the scrub).
fn seal(fd: &OwnedFd) -> Result<(), PoolError> {
    let seals = libc::F_SEAL_GROW | libc::F_SEAL_SHRINK | libc::F_SEAL_SEAL;
    // SAFETY: plain fcntl on a descriptor we own.
    if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
        return Err(io_err("sealing a slice"));
    }
    Ok(())
}

/// Frees every page of a returned slice (mappings and duplicates elsewhere see holes).
fn scrub(s: &Slice) -> Result<(), PoolError> {
    let len = libc::off_t::try_from(s.bytes).unwrap_or(libc::off_t::MAX);
    let mode = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
    // SAFETY: plain syscall on a descriptor we own.
    if retry_eintr(|| unsafe { libc::fallocate(s.fd.as_raw_fd(), mode, 0, len) }) != 0 {
        return Err(io_err("fallocate(PUNCH_HOLE) (scrubbing a slice)"));
    }
    Ok(())
}

mod spill;

#[cfg(test)]
mod tests;
