//! Host memory for swap-outs, borrowed from the node's swap pool (issue #37): the
//! arbiter lends populated memfds (slices) over a connection of this process's own
//! (`pool_open`), whose pages are charged to Kiwi, not to this process's memory
//! cgroup. A buffer is one or more slices mapped `MAP_SHARED` back to back; when it is
//! freed it is unmapped and its slices are given back (the arbiter scrubs them and
//! never lends them again). Where the pool cannot lend (an arbiter without one, its
//! refusal, a lost connection) the caller falls back to this process's own memory,
//! and a refusal that a swap-out meets says so on stderr.
//!
//! Buffers prepared ahead (the pinning thread marks itself with [`mark_ahead`]) ask
//! with `ahead`, which the arbiter refuses first when the pool runs low.
//! `KIWI_SWAP_POOL=0` turns borrowing off.
//!
//! The disk tier: asked by the arbiter (`pool_reclaim`), the pinning thread moves a
//! swapped-out buffer's slices to disk ([`spill`]: `pool_spill`); the arbiter writes
//! them to spill files and hands back one read-only descriptor per slice, from which
//! the swap-in reads the contents back ([`read_back`]) before giving the ids back
//! ([`forget`]). Only this process's own contents are reachable through them.

use std::cell::Cell;
use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use kiwi_cuda::filemap::{self, FilePart};
use kiwi_protocol::blocking::Connection;
use kiwi_protocol::{ArbiterMsg, ClientMsg, MAX_POOL_GIVE_IDS, MAX_POOL_TAKE_BYTES};

type Conn = Connection<ClientMsg, ArbiterMsg>;

/// How long an answer of the arbiter may take (a take may populate memory first).
const ANSWER_WAIT: Duration = Duration::from_secs(10);
/// After a failure to reach the pool, how long before trying again.
const RETRY_AFTER: Duration = Duration::from_secs(5);
/// How often a refusal is said on stderr.
const SAY_EVERY: Duration = Duration::from_secs(10);

thread_local! {
    static AHEAD: Cell<bool> = const { Cell::new(false) };
}

/// Marks this thread as preparing buffers ahead of need (the pinning thread).
pub fn mark_ahead() {
    AHEAD.with(|a| a.set(true));
}

struct Mapping {
    len: usize,
    ids: Vec<u64>,
    /// The connection the slices were lent on: ids mean nothing to another one.
    generation: u64,
}

/// The pool connection, held across a round trip to the arbiter (a take may wait
/// for the arbiter to populate memory).
#[derive(Default)]
struct State {
    conn: Option<Conn>,
    generation: u64,
    retry_at: Option<Instant>,
    said_at: Option<Instant>,
}

/// Contents moved to the disk tier: the spill files (descriptor, length, id) in the
/// order of the buffer's slices.
struct Disk {
    files: Vec<(OwnedFd, u64, u64)>,
    generation: u64,
}

/// What this process maps and owes the arbiter: held for moments only, never across
/// a round trip, so that freeing a buffer (a turn's thread, after a swap-in) never
/// waits behind a take in flight.
#[derive(Default)]
struct Books {
    maps: HashMap<usize, Mapping>,
    /// Spilled contents by handle ([`spill`]).
    disk: HashMap<u64, Disk>,
    next_disk: u64,
    /// Slices unmapped while the connection was busy: (connection, ids), given back
    /// with the next message.
    owed: Vec<(u64, Vec<u64>)>,
    /// Bumped when the connection changes; the owed ids of older ones are dropped.
    generation: u64,
}

static STATE: Mutex<Option<State>> = Mutex::new(None);
static BOOKS: Mutex<Option<Books>> = Mutex::new(None);
/// Swap-outs on the critical path waiting for the connection.
static CRITICAL: AtomicUsize = AtomicUsize::new(0);
/// The pool connection's descriptor, closed in a forked child ([`close_in_child`]).
static CONN_FD: AtomicI32 = AtomicI32::new(-1);

/// In a forked child (async-signal-safe): closes the inherited pool connection, so the
/// arbiter sees it close when the parent goes. The child never borrows.
pub fn close_in_child() {
    let fd = CONN_FD.swap(-1, Ordering::Relaxed);
    if fd >= 0 {
        // SAFETY: closing a descriptor this process inherited; nothing in the child
        // uses it (its allocator is off).
        unsafe { libc::close(fd) };
    }
}

fn lock() -> MutexGuard<'static, Option<State>> {
    STATE.lock().unwrap_or_else(|p| p.into_inner())
}

fn books() -> MutexGuard<'static, Option<Books>> {
    BOOKS.lock().unwrap_or_else(|p| p.into_inner())
}

/// The connection's lock. A swap-out on the critical path waits for it (at most one
/// round trip: freeing never holds it), and says so first, so that the thread preparing
/// ahead stands back rather than taking it again (`None`: it stands back now).
fn lock_for(ahead: bool) -> Option<MutexGuard<'static, Option<State>>> {
    if ahead {
        if CRITICAL.load(Ordering::Acquire) > 0 {
            return None;
        }
        return Some(lock());
    }
    CRITICAL.fetch_add(1, Ordering::AcqRel);
    let g = lock();
    CRITICAL.fetch_sub(1, Ordering::AcqRel);
    Some(g)
}

fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("KIWI_SWAP_POOL").map_or(true, |v| v != "0"))
}

/// Whether `p` is a buffer [`map`] returned and [`unmap`] has not taken back.
pub fn owns(p: *mut u8) -> bool {
    books()
        .as_ref()
        .is_some_and(|b| b.maps.contains_key(&(p as usize)))
}

/// A buffer of at least `size` bytes of the node's swap pool, mapped read-write,
/// its page-table entries made now when `populate` (a caller that page-locks the
/// buffer next leaves that to the driver, which faults the pages in as it locks
/// them: populating first walked every page twice); `None`: none could be borrowed
/// (the caller uses its own memory).
pub fn map(size: u64, populate: bool) -> Option<*mut u8> {
    if !enabled() || size == 0 || size > MAX_POOL_TAKE_BYTES {
        return None;
    }
    let ahead = AHEAD.with(Cell::get);
    let mut g = lock_for(ahead)?;
    let st = g.get_or_insert_with(State::default);
    if st.conn.is_none() {
        if st.retry_at.is_some_and(|t| Instant::now() < t) {
            return None;
        }
        match open() {
            Ok(c) => {
                st.conn = Some(c);
                st.generation += 1;
                st.retry_at = None;
                books().get_or_insert_with(Books::default).generation = st.generation;
                // Slices an earlier arbiter lent and this process still maps: the
                // new one counts them against its pool.
                tell_kept(st);
            }
            Err(why) => {
                crate::kdebug!(
                    "swap pool unavailable ({why}); swapping into this process's memory"
                );
                st.retry_at = Some(Instant::now() + RETRY_AFTER);
                return None;
            }
        }
    }
    give_owed(st);
    let conn = st.conn.as_mut()?;
    let answer = conn
        .send(&ClientMsg::PoolTake { bytes: size, ahead })
        .and_then(|()| conn.recv());
    match answer {
        Ok(ArbiterMsg::PoolLent { slices }) => {
            let fds: Vec<Option<OwnedFd>> = slices.iter().map(|_| conn.take_fd()).collect();
            let ids: Vec<u64> = slices.iter().map(|s| s.id).collect();
            let lens: Vec<u64> = slices.iter().map(|s| s.bytes).collect();
            match map_slices(&fds, &lens, size, populate) {
                Some((p, len)) => {
                    let generation = st.generation;
                    books().get_or_insert_with(Books::default).maps.insert(
                        p as usize,
                        Mapping {
                            len,
                            ids,
                            generation,
                        },
                    );
                    Some(p)
                }
                None => {
                    let _ = conn.send(&ClientMsg::PoolGive { ids });
                    None
                }
            }
        }
        Ok(ArbiterMsg::PoolRefused { message }) => {
            if !ahead && st.said_at.is_none_or(|t| t.elapsed() >= SAY_EVERY) {
                st.said_at = Some(Instant::now());
                crate::kwarn!("{message}; this swap-out uses the process's own memory (its memory limit pays for it)");
            }
            None
        }
        Ok(other) => {
            crate::kwarn!("the swap pool answered {other:?}; swapping into this process's memory");
            drop_conn(st);
            None
        }
        Err(e) => {
            crate::kdebug!("lost the swap pool ({e}); swapping into this process's memory");
            drop_conn(st);
            None
        }
    }
}

/// Takes back a buffer [`map`] returned: unmaps it and gives its slices back (with
/// the connection's next message when another thread is using it: this never waits
/// for a round trip). `false`: `p` is not one (the caller frees its own memory).
pub fn unmap(p: *mut u8) -> bool {
    let (m, current) = {
        let mut b = books();
        let Some(books) = b.as_mut() else {
            return false;
        };
        let Some(m) = books.maps.remove(&(p as usize)) else {
            return false;
        };
        (m, books.generation)
    };
    // SAFETY: the mapping `map` made of `m.len` bytes at `p`; its owner is done with it
    // (and unregistered it from the driver).
    unsafe { libc::munmap(p.cast(), m.len) };
    if m.generation == current {
        if let Some(b) = books().as_mut() {
            b.owed.push((m.generation, m.ids));
        }
    }
    // Given now where the connection is free; else by whoever takes it next.
    if let Ok(mut g) = STATE.try_lock() {
        if let Some(st) = g.as_mut() {
            give_owed(st);
            if m.generation != current {
                tell_kept(st);
            }
        }
    }
    true
}

/// Moves the contents of `p`, a buffer [`map`] returned (unregistered from the
/// driver, copied to or from by nobody), to the node's disk tier: on success `p` is
/// unmapped and the handle returned reads the contents back ([`read_back`]). `None`:
/// nothing moved, `p` is as it was (no disk tier, a refusal, a connection in use by
/// a swap-out, slices lent by an earlier arbiter).
pub fn spill(p: *mut u8) -> Option<u64> {
    let (ids, len, generation) = {
        let b = books();
        let m = b.as_ref()?.maps.get(&(p as usize))?;
        (m.ids.clone(), m.len, m.generation)
    };
    if ids.is_empty() || ids.len() > kiwi_protocol::MAX_POOL_SPILL_IDS {
        return None;
    }
    let mut g = lock_for(true)?;
    let st = g.as_mut()?;
    if st.generation != generation {
        return None;
    }
    give_owed(st);
    let conn = st.conn.as_mut()?;
    let answer = conn
        .send(&ClientMsg::PoolSpill { ids: ids.clone() })
        .and_then(|()| conn.recv());
    match answer {
        Ok(ArbiterMsg::PoolSpilled { files }) => {
            let fds: Vec<Option<OwnedFd>> = files.iter().map(|_| conn.take_fd()).collect();
            let total: u64 = files.iter().map(|f| f.bytes).sum();
            if files.len() != ids.len() || fds.iter().any(Option::is_none) || total < len as u64 {
                // The arbiter took the slices back: what it sent is all there is.
                crate::kerror!(
                    "the swap pool's disk tier answered {} files ({} descriptors) for {} slices; {} bytes of swapped-out memory may be lost",
                    files.len(),
                    fds.iter().flatten().count(),
                    ids.len(),
                    len
                );
            }
            let disk = Disk {
                files: files
                    .iter()
                    .zip(fds)
                    .filter_map(|(f, fd)| Some((fd?, f.bytes, f.id)))
                    .collect(),
                generation,
            };
            let mut b = books();
            let books = b.get_or_insert_with(Books::default);
            books.maps.remove(&(p as usize));
            let h = books.next_disk;
            books.next_disk += 1;
            books.disk.insert(h, disk);
            drop(b);
            // SAFETY: the mapping `map` made of `len` bytes at `p`; its owner gave it
            // up for the spill (it is unregistered and nobody copies to or from it).
            unsafe { libc::munmap(p.cast(), len) };
            Some(h)
        }
        Ok(ArbiterMsg::PoolRefused { message }) => {
            crate::kdebug!("the swap pool's disk tier refused a spill: {message}");
            None
        }
        Ok(other) => {
            crate::kwarn!("the swap pool answered {other:?} to a spill");
            drop_conn(st);
            None
        }
        Err(e) => {
            crate::kdebug!("lost the swap pool during a spill ({e})");
            drop_conn(st);
            None
        }
    }
}

/// Runs `f` over the contents of spilled buffer `h`, mapped read-only at one
/// address (`f(address, length)`); `None` when `h` is unknown or the mapping failed.
/// The pages read are dropped from the page cache afterwards.
pub fn read_back<T>(h: u64, f: impl FnOnce(*const u8, usize) -> T) -> Option<T> {
    let files: Vec<FilePart> = {
        let b = books();
        let d = b.as_ref()?.disk.get(&h)?;
        d.files
            .iter()
            .map(|(fd, n, _)| FilePart::whole(fd.as_raw_fd(), *n as usize))
            .collect()
    };
    // The descriptors stay open meanwhile: only `forget`, on this thread's caller,
    // closes them.
    filemap::read_files(&files, f).ok()
}

/// Forgets spilled buffer `h` (read back, or its memory freed): its files are closed
/// and their ids given back with the connection's next message.
pub fn forget(h: u64) {
    let owed = {
        let mut b = books();
        let Some(books) = b.as_mut() else {
            return;
        };
        let Some(d) = books.disk.remove(&h) else {
            return;
        };
        let ids: Vec<u64> = d.files.iter().map(|f| f.2).collect();
        if d.generation == books.generation {
            books.owed.push((d.generation, ids));
        }
        d.files
    };
    drop(owed);
    if let Ok(mut g) = STATE.try_lock() {
        if let Some(st) = g.as_mut() {
            give_owed(st);
        }
    }
}

/// Gives back the slices unmapped since the last message, on the connection they
/// were lent on (older ones' ids mean nothing to this arbiter: dropped).
fn give_owed(st: &mut State) {
    let owed = std::mem::take(&mut books().get_or_insert_with(Books::default).owed);
    let generation = st.generation;
    let Some(conn) = st.conn.as_mut() else {
        return;
    };
    for (_, ids) in owed.into_iter().filter(|(g, _)| *g == generation) {
        for ids in ids.chunks(MAX_POOL_GIVE_IDS) {
            if conn
                .send(&ClientMsg::PoolGive { ids: ids.to_vec() })
                .is_err()
            {
                drop_conn(st);
                return;
            }
        }
    }
}

/// Tells the pool connection how much this process maps of slices lent on earlier
/// connections (0 included, so a figure said before is withdrawn).
fn tell_kept(st: &mut State) {
    let generation = st.generation;
    let kept: u64 = books().as_ref().map_or(0, |b| {
        b.maps
            .values()
            .filter(|m| m.generation != generation)
            .map(|m| m.len as u64)
            .sum()
    });
    if let Some(conn) = st.conn.as_mut() {
        if conn.send(&ClientMsg::PoolKept { bytes: kept }).is_err() {
            drop_conn(st);
        }
    }
}

/// Forgets a broken connection (its lent slices stay mapped until freed) and tries
/// again later.
fn drop_conn(st: &mut State) {
    CONN_FD.store(-1, Ordering::Relaxed);
    st.conn = None;
    st.retry_at = Some(Instant::now() + RETRY_AFTER);
}

/// Opens a pool connection.
fn open() -> Result<Conn, String> {
    let path = crate::env::ShimEnv::from_env().client_socket();
    let stream = UnixStream::connect(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    stream
        .set_read_timeout(Some(ANSWER_WAIT))
        .map_err(|e| e.to_string())?;
    CONN_FD.store(stream.as_raw_fd(), Ordering::Relaxed);
    let mut conn = Conn::new(stream);
    match conn.call(&ClientMsg::PoolOpen) {
        Ok(ArbiterMsg::PoolOpened { .. }) => Ok(conn),
        Ok(ArbiterMsg::Error { message, .. }) => Err(message),
        Ok(other) => Err(format!("unexpected answer {other:?}")),
        Err(e) => Err(e.to_string()),
    }
}

/// Maps the slices back to back at one address: `(address, length)`; `None` if a
/// descriptor is missing or a mapping fails (nothing stays mapped then).
fn map_slices(
    fds: &[Option<OwnedFd>],
    lens: &[u64],
    size: u64,
    populate: bool,
) -> Option<(*mut u8, usize)> {
    let total: u64 = lens.iter().sum();
    if total < size || lens.iter().any(|l| l % 4096 != 0) {
        return None;
    }
    let files: Vec<FilePart> = fds
        .iter()
        .zip(lens)
        .map(|(fd, &l)| Some(FilePart::whole(fd.as_ref()?.as_raw_fd(), l as usize)))
        .collect::<Option<_>>()?;
    let (base, len) =
        filemap::map_side_by_side(&files, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED)
            .ok()?;
    // Page-table entries now, not at the first copy: the pages exist (the arbiter
    // populated them), so this allocates nothing this process is charged for.
    if populate {
        // SAFETY: advice on the mapping just made.
        unsafe {
            libc::madvise(base.cast(), len, 23 /* MADV_POPULATE_WRITE */)
        };
    }
    Some((base, len))
}
