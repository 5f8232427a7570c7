//! Host memory backing this process's simulated device memory: freed backing kept
//! for reuse by size, and backing prepared ahead, in the background, for the device
//! address ranges the process reserved (`cuMemAddressReserve`) and never mapped (a
//! range a swap-out unmapped comes back on its own freed backing, pooled).
//! Fresh anonymous memory must be faulted in and zeroed by the kernel, which costs
//! host time a GPU never spends (a swap-in of 500 MiB would pay ~100 ms of page
//! faults); GPU memory from `cuMemCreate` is uninitialized anyway, so stale bytes of
//! reused backing are fine.
//!
//! Why prepared ahead: a GPU's memory exists before anyone allocates it, and
//! `cuMemCreate` on an H100 costs 15 µs plus 0.04 µs per 2 MiB (the
//! `KIWI_SIM_MEMCREATE_US*` model), while faulting in fresh host pages costs the
//! hosts these tests run on 2.8–5 GB/s. A newcomer that reserved 1 GiB and waited
//! for its turn then paid ~365 ms of page faults inside its first hand-off, a cost no
//! GPU has (issue #28, `handoff_at_newcomer_start`). Backing is prepared for what a
//! process reserved, less what it mapped and what the pool of freed backing already
//! holds, at most [`PREPARE_MAX`]; on with `KIWI_SIM_PREPARE=1` (off by default: the work
//! slowed hand-offs in the busy-machine demo test on 2 cores; the benchmarks turn it on).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// `madvise` advice (Linux 5.14): fault the range in writable now.
pub const MADV_POPULATE_WRITE: libc::c_int = 23;

/// Most bytes the pool of freed backing keeps; beyond it freed backing goes back to
/// the kernel.
const POOL_MAX_BYTES: usize = 4 << 30;
/// Most bytes prepared ahead (with the pool's): host memory each process may hold
/// for memory it has not allocated yet (an application's own reservations can be
/// far larger than what it maps: PyTorch's expandable segments).
const PREPARE_MAX: usize = 1 << 30;
/// Bytes the background thread prepares in one step (the shim's segments are at
/// most this; a larger allocation is backed fresh).
const STEP: usize = 64 << 20;
/// Bytes populated at a time by the preparing thread.
const PART: usize = 4 << 20;
/// How long a reservation stays unmapped before backing is prepared for it: most
/// are mapped at once (an allocation backed on the spot), and preparing for those
/// only made the thread populate and give back memory beside the application's own
/// work (a loaded host's hint answers came late: `shim/tests/discard.rs`). A
/// newcomer waiting for its turn waits far longer.
const DELAY: Duration = Duration::from_millis(100);

struct State {
    /// Freed backing stores by length.
    by_len: BTreeMap<usize, Vec<usize>>,
    pooled: usize,
    /// Prepared (populated, unused) ranges: (start, length), each a whole mapping
    /// or the tail of one.
    prepared: Vec<(usize, usize)>,
    ready: usize,
    /// Bytes reserved (`cuMemAddressReserve`) and never mapped.
    unmapped: usize,
    /// When a reservation last raised [`State::unmapped`].
    raised_at: Option<Instant>,
}

static STATE: Mutex<State> = Mutex::new(State {
    by_len: BTreeMap::new(),
    pooled: 0,
    prepared: Vec::new(),
    ready: 0,
    unmapped: 0,
    raised_at: None,
});
static WORK: Condvar = Condvar::new();
/// Whether preparing ahead is on (the driver's `KIWI_SIM_PREPARE`).
static ON: AtomicBool = AtomicBool::new(false);
/// The process whose preparing thread runs (a forked child starts its own).
static THREAD_PID: AtomicU32 = AtomicU32::new(0);

fn state() -> MutexGuard<'static, State> {
    STATE.lock().unwrap_or_else(|e| e.into_inner())
}

/// Turns preparing ahead on or off (at driver start).
pub fn set_prepare(on: bool) {
    ON.store(on, Ordering::Relaxed);
}

impl State {
    /// What the background thread should have ready.
    fn target(&self) -> usize {
        self.unmapped.min(PREPARE_MAX).saturating_sub(self.pooled)
    }
}

/// A fresh private anonymous mapping of `len` bytes, populated writable; `None`
/// when the kernel refuses it.
pub fn fresh(len: usize) -> Option<*mut libc::c_void> {
    fresh_in(len, len)
}

/// [`fresh`], populated `part` bytes at a time: the kernel holds the process's
/// memory-map lock while it populates, and the preparing thread must not keep the
/// application's own faults and mappings waiting behind a long stretch of it.
fn fresh_in(len: usize, part: usize) -> Option<*mut libc::c_void> {
    // SAFETY: anonymous private mapping; no existing memory is affected.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return None;
    }
    for at in (0..len).step_by(part.max(4096)) {
        let n = part.min(len - at);
        // SAFETY: advice on a part of the mapping just made.
        if unsafe { libc::madvise((p as *mut u8).add(at).cast(), n, MADV_POPULATE_WRITE) } != 0 {
            // Kernels before 5.14: touch each page.
            for off in (at..at + n).step_by(4096) {
                // SAFETY: a byte of the mapping just made, which nobody else uses.
                unsafe { std::ptr::write_volatile((p as *mut u8).add(off), 0) };
            }
        }
    }
    Some(p)
}

/// Backing for `len` bytes (a multiple of the page size): freed backing of that
/// length, else prepared backing, else `None` (the caller maps it fresh).
pub fn take(len: usize) -> Option<*mut libc::c_void> {
    let mut s = state();
    if let Some(addr) = s.by_len.get_mut(&len).and_then(|v| v.pop()) {
        s.pooled -= len;
        wake(&s);
        return Some(addr as *mut libc::c_void);
    }
    let i = s.prepared.iter().position(|&(_, l)| l >= len)?;
    let (start, l) = s.prepared[i];
    if l == len {
        s.prepared.swap_remove(i);
    } else {
        s.prepared[i] = (start + len, l - len);
    }
    s.ready -= len;
    wake(&s);
    Some(start as *mut libc::c_void)
}

/// Keeps `ptr` (a private anonymous mapping of `len` bytes) for reuse; `false` if
/// the pool is full and the caller must unmap it.
pub fn put(ptr: *mut libc::c_void, len: usize) -> bool {
    let mut s = state();
    if s.pooled + len > POOL_MAX_BYTES {
        return false;
    }
    s.pooled += len;
    s.by_len.entry(len).or_default().push(ptr as usize);
    wake(&s);
    true
}

/// `bytes` more (or fewer, negative) of the address space reserved were never mapped:
/// a reservation, its release, a first map into it.
pub fn unmapped(bytes: i64) {
    let mut s = state();
    s.unmapped = s.unmapped.saturating_add_signed(bytes as isize);
    if bytes > 0 {
        s.raised_at = Some(Instant::now());
    }
    wake(&s);
}

/// Tells the preparing thread the target moved, starting it in this process first.
fn wake(s: &State) {
    if !ON.load(Ordering::Relaxed) || s.ready == s.target() {
        return;
    }
    // SAFETY: getpid has no preconditions.
    let pid = unsafe { libc::getpid() } as u32;
    if THREAD_PID.swap(pid, Ordering::AcqRel) != pid
        && std::thread::Builder::new()
            .name("kiwi-sim-prepare".into())
            .spawn(prepare_loop)
            .is_err()
    {
        ON.store(false, Ordering::Relaxed);
    }
    WORK.notify_one();
}

/// The preparing thread: populates [`STEP`]s until the target is ready, and gives
/// back what is past it (a reservation released), never holding the lock while it
/// populates.
fn prepare_loop() {
    // The lowest priority: preparing ahead must never take a core from the
    // simulated application's own threads (nor delay its answers, on a loaded host).
    // SAFETY: gettid and setpriority have no preconditions; this thread only.
    unsafe {
        let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
        libc::setpriority(libc::PRIO_PROCESS, tid, 19);
    }
    loop {
        let mut s = state();
        // A little past the target is kept (steps are whole 2 MiB pages).
        while s.ready >= s.target() && s.ready - s.target() < STEP {
            s = WORK.wait(s).unwrap_or_else(|e| e.into_inner());
        }
        if s.ready > s.target() {
            // Past it: the last prepared range goes back to the kernel.
            let (start, len) = s.prepared.pop().expect("ready > 0");
            s.ready -= len;
            drop(s);
            // SAFETY: a prepared range, removed from the list above, used by nobody.
            unsafe { libc::munmap(start as *mut libc::c_void, len) };
            continue;
        }
        if let Some(young) = s.raised_at.map(|t| t.elapsed()).filter(|&e| e < DELAY) {
            drop(s);
            std::thread::sleep(DELAY - young);
            continue;
        }
        let len = STEP.min(s.target() - s.ready).next_multiple_of(2 << 20);
        drop(s);
        let Some(p) = fresh_in(len, PART) else {
            ON.store(false, Ordering::Relaxed);
            return;
        };
        let mut s = state();
        s.prepared.push((p as usize, len));
        s.ready += len;
    }
}
