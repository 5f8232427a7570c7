//! Stream capture as the shim sees it. Owns the capture sequences this process has in
//! progress (begun and not yet ended through the shim's `cuStreamBeginCapture*` /
//! `cuStreamEndCapture` hooks) and the rules the shim follows because of them:
//!
//! - While any stream of the process captures, the shim never synchronizes the context
//!   (the driver refuses `cuCtxSynchronize` with `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`
//!   and invalidates the capture): the queue bound skips its wait, and a drain (a drop,
//!   a reclaim) waits until the captures end, for at most [`CAPTURE_WAIT`], which is
//!   under the arbiter's default grace of 5 s.
//! - The shim uses the legacy stream (its swap copies) only while no blocking stream
//!   captures (using it then is refused and invalidates the capture too).
//! - A submission into a capturing stream is recorded by the driver, not run: it
//!   neither waits in the gate nor counts toward the queue bound ([`is_captured`], asked
//!   only on the gate's slow path and only while [`active`]).
//! - The shim's own potentially unsafe calls (pinning swap buffers, waiting for a
//!   stream that does not capture: the real driver refuses both during another
//!   stream's `GLOBAL` capture and invalidates it, measured on an H100, driver 580,
//!   `docs/gpu-validation.md`) run in the `RELAXED` capture mode, so they never
//!   invalidate the application's captures: the shim's own threads are `RELAXED` for
//!   good ([`relax_this_thread`]), an application thread while it runs the shim's
//!   work ([`Relaxed`]). The calls that break a capture in every mode (querying,
//!   synchronizing or asking the flags of the capturing stream, the legacy stream
//!   while a blocking stream captures, `cuCtxSynchronize`) stay avoided while
//!   captures are in progress, as above.
//!
//! Nothing here is on the launch hot path: [`active`] is one atomic load, read on slow
//! paths only.

use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::cuda::*;
use crate::real::call_real as real;

/// How long a drain or swap waits for the process's captures to end before it gives
/// up (the swap is then refused, never forced through a capture): under the arbiter's
/// default grace (5 s), so a drop that arrives during a capture is answered when the
/// capture ends, in time.
pub const CAPTURE_WAIT: Duration = Duration::from_secs(4);
/// How long the idle detector's drain (the gate open) waits for captures: a capture
/// in progress is work in progress, and a drain that takes this long says "busy".
pub const IDLE_PROBE: Duration = Duration::from_millis(5);

/// Capture sequences in progress (a begin that is under way counts already).
static CAPTURES: AtomicU32 = AtomicU32::new(0);
/// The shim's own synchronizations past their check of [`CAPTURES`].
static SHIM_SYNCS: AtomicU32 = AtomicU32::new(0);
static SEQS: Mutex<Vec<Seq>> = Mutex::new(Vec::new());
/// Signalled (under [`SEQS`]) when a sequence ends.
static ENDED: Condvar = Condvar::new();
static NEXT_THREAD: AtomicU64 = AtomicU64::new(1);
/// Work deferred until no capture is in progress (frees that would synchronize).
type Deferred = Box<dyn FnOnce() + Send>;
static AFTER: Mutex<Vec<Deferred>> = Mutex::new(Vec::new());

thread_local! {
    static THREAD: u64 = NEXT_THREAD.fetch_add(1, Ordering::Relaxed);
}

fn thread_id() -> u64 {
    THREAD.with(|t| *t)
}

/// One capture sequence in progress.
struct Seq {
    /// The stream handle (the per-thread stream as `CU_STREAM_PER_THREAD`).
    stream: usize,
    /// The thread that began it.
    thread: u64,
    /// Begun not `RELAXED`: only its own thread may end it.
    owned: bool,
    /// A blocking stream: the legacy stream may not be used meanwhile.
    blocking: bool,
}

impl Seq {
    fn matches(&self, s: StreamArg) -> bool {
        self.stream == s.normalized()
            && (s.normalized() != CU_STREAM_PER_THREAD || self.thread == thread_id())
    }
}

fn seqs() -> MutexGuard<'static, Vec<Seq>> {
    SEQS.lock().unwrap_or_else(|p| p.into_inner())
}

/// Whether any stream of this process captures (one atomic load).
#[inline]
pub fn active() -> bool {
    CAPTURES.load(Ordering::SeqCst) > 0
}

/// A stream argument as an entry point received it.
#[derive(Clone, Copy, Debug)]
pub struct StreamArg {
    pub handle: CUstream,
    /// Received through a `_ptsz`/`_ptds` entry point: NULL is the per-thread stream.
    pub per_thread: bool,
}

impl StreamArg {
    pub fn new(handle: CUstream, per_thread: bool) -> Self {
        Self { handle, per_thread }
    }

    /// The handle every entry point reads the same way: NULL through a per-thread entry
    /// point is `CU_STREAM_PER_THREAD`.
    pub fn normalized(self) -> usize {
        match self.handle as usize {
            0 if self.per_thread => CU_STREAM_PER_THREAD,
            h => h,
        }
    }

    pub fn handle_for_legacy_entry(self) -> CUstream {
        self.normalized() as CUstream
    }

    fn is_legacy(self) -> bool {
        matches!(self.normalized(), 0 | CU_STREAM_LEGACY)
    }
}

/// The stream of a `CUlaunchConfig` (`cuLaunchKernelEx`): `hStream` follows seven
/// 32-bit fields, at offset 32 on LP64.
pub fn launch_config_stream(config: Opaque, per_thread: bool) -> Option<StreamArg> {
    if config.is_null() {
        return None;
    }
    // SAFETY: the application's CUlaunchConfig, which cuda.h lays out as seven
    // unsigned ints and then the stream handle (pointer-aligned, offset 32); the
    // driver reads the same field of the same struct in this call.
    let h = unsafe { *(config.cast::<u8>().add(32).cast::<CUstream>()) };
    Some(StreamArg::new(h, per_thread))
}

/// Whether `s` is capturing now, as the driver says.
fn driver_says_capturing(s: StreamArg) -> bool {
    if s.is_legacy() {
        // The legacy stream cannot be captured.
        return false;
    }
    let mut status: c_int = CU_STREAM_CAPTURE_STATUS_NONE;
    real!(cuStreamIsCapturing: fn(CUstream, *mut c_int)(s.handle_for_legacy_entry(), &mut status))
        .map(|()| status != CU_STREAM_CAPTURE_STATUS_NONE)
        .unwrap_or(false)
}

/// Whether a submission into `s` is recorded into a capture (slow path only).
pub fn is_captured(s: Option<StreamArg>) -> bool {
    active() && s.is_some_and(driver_says_capturing)
}

/// Runs the shim's synchronization `f` unless a capture is in progress (then `None`,
/// and the driver is not called). A capture begun while `f` runs waits for it
/// ([`begin_with`]), so the two never cross.
pub fn sync_unless_capturing(
    f: impl FnOnce() -> Result<(), CUresult>,
) -> Option<Result<(), CUresult>> {
    SHIM_SYNCS.fetch_add(1, Ordering::SeqCst);
    let r = (!active()).then(f);
    SHIM_SYNCS.fetch_sub(1, Ordering::SeqCst);
    r
}

/// Waits until no capture is in progress, for at most `patience`. False at once when
/// this thread itself began a capture that only it may end (waiting would deadlock).
pub fn quiesce(patience: Duration) -> bool {
    let deadline = Instant::now() + patience;
    let me = thread_id();
    let mut g = seqs();
    loop {
        if !active() {
            return true;
        }
        if g.iter().any(|s| s.owned && s.thread == me) {
            return false;
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return false;
        }
        g = ENDED
            .wait_timeout(g, left.min(Duration::from_millis(50)))
            .unwrap_or_else(|p| p.into_inner())
            .0;
    }
}

/// Runs the context-wide synchronization `f` once no capture is in progress, waiting
/// at most `patience`; `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED` (the driver not called)
/// when the captures outlast it.
pub fn sync_when_quiet(
    patience: Duration,
    f: impl Fn() -> Result<(), CUresult>,
) -> Result<(), CUresult> {
    let deadline = Instant::now() + patience;
    loop {
        if let Some(r) = sync_unless_capturing(&f) {
            return r;
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() || !quiesce(left) {
            return Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
        }
    }
}

/// Whether the legacy stream may be used (no blocking stream captures); otherwise
/// waits for that, at most `patience`.
pub fn legacy_usable(patience: Duration) -> bool {
    let blocked = || active() && seqs().iter().any(|s| s.blocking);
    if !blocked() {
        return true;
    }
    quiesce(patience) || !blocked()
}

/// Puts the calling thread, one of the shim's own, in the `RELAXED` capture mode for
/// good (called once, at its start): its potentially unsafe calls then never
/// invalidate the application's captures, whenever those begin.
pub fn relax_this_thread() {
    let mut mode = CU_STREAM_CAPTURE_MODE_RELAXED;
    if let Err(e) = real!(cuThreadExchangeStreamCaptureMode: fn(*mut Uint)(&mut mode)) {
        crate::kwarn!("cannot put a shim thread in the relaxed capture mode (CUDA error {e})");
    }
}

/// The calling thread in the `RELAXED` capture mode until dropped: the shim's own
/// potentially unsafe calls on an application thread (pinning swap buffers, waiting
/// for a stream) then never invalidate the application's captures. Switched whether
/// or not a capture is in progress: one may begin on another thread meanwhile.
pub struct Relaxed(Option<Uint>);

impl Relaxed {
    pub fn enter() -> Relaxed {
        let mut mode = CU_STREAM_CAPTURE_MODE_RELAXED;
        let ok = real!(cuThreadExchangeStreamCaptureMode: fn(*mut Uint)(&mut mode)).is_ok();
        // Already relaxed (a shim thread): nothing to restore.
        Relaxed(
            ok.then_some(mode)
                .filter(|&m| m != CU_STREAM_CAPTURE_MODE_RELAXED),
        )
    }
}

impl Drop for Relaxed {
    fn drop(&mut self) {
        if let Some(mut old) = self.0 {
            let _ = real!(cuThreadExchangeStreamCaptureMode: fn(*mut Uint)(&mut old));
        }
    }
}

/// Whether `s` is a blocking stream (the per-thread stream is).
fn blocking(s: StreamArg) -> bool {
    if s.normalized() == CU_STREAM_PER_THREAD {
        return true;
    }
    let mut flags: Uint = 0;
    real!(cuStreamGetFlags: fn(CUstream, *mut Uint)(s.handle_for_legacy_entry(), &mut flags))
        .map(|()| flags & CU_STREAM_NON_BLOCKING == 0)
        .unwrap_or(true)
}

/// One sequence fewer; wakes the waiters, and runs the deferred work after the last.
fn finished(g: MutexGuard<'static, Vec<Seq>>) {
    let last = CAPTURES.fetch_sub(1, Ordering::SeqCst) == 1;
    let run = if last { take_after() } else { Vec::new() };
    drop(g);
    ENDED.notify_all();
    for f in run {
        f();
    }
}

fn take_after() -> Vec<Deferred> {
    std::mem::take(&mut *AFTER.lock().unwrap_or_else(|p| p.into_inner()))
}

/// Runs `f` once no capture is in progress: now, or when the last one ends (on the
/// thread that ends it).
pub fn after_captures(f: Deferred) {
    let g = seqs();
    AFTER.lock().unwrap_or_else(|p| p.into_inner()).push(f);
    // Ended meanwhile: nobody else will run it.
    let run = if active() { Vec::new() } else { take_after() };
    drop(g);
    for f in run {
        f();
    }
}

/// A capture begins on `s` (mode `mode`) through the driver call `f`.
fn begin_with(s: StreamArg, mode: Uint, f: impl FnOnce() -> CUresult) -> CUresult {
    CAPTURES.fetch_add(1, Ordering::SeqCst);
    // A shim synchronization already past its check finishes first: the capture then
    // begins after it, as the application asked, and never crosses it.
    let mut spins = 0u32;
    while SHIM_SYNCS.load(Ordering::SeqCst) > 0 {
        spins += 1;
        if spins < 100 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(200));
        }
    }
    // Asked before the capture begins: the real driver invalidates a capture whose
    // stream is asked for its flags (seen on an H100, driver 580; docs/gpu-validation.md).
    let blocking = blocking(s);
    let r = f();
    let mut g = seqs();
    if r == CUDA_SUCCESS {
        g.push(Seq {
            stream: s.normalized(),
            thread: thread_id(),
            owned: mode != CU_STREAM_CAPTURE_MODE_RELAXED,
            blocking,
        });
        crate::kdebug!("capture begun on stream {:#x}", s.normalized());
    } else {
        finished(g);
    }
    r
}

/// A capture ends on `s` (the driver's answer `r`): whether it is over is what the
/// driver says (a wrong thread leaves it going on).
fn ended(s: StreamArg, r: CUresult) -> CUresult {
    let over = match r {
        CUDA_SUCCESS | CUDA_ERROR_STREAM_CAPTURE_INVALIDATED => true,
        CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD => false,
        _ => !driver_says_capturing(s),
    };
    if over {
        let mut g = seqs();
        if let Some(i) = g.iter().position(|q| q.matches(s)) {
            g.remove(i);
            crate::kdebug!("capture ended on stream {:#x} ({r})", s.normalized());
            finished(g);
        }
    }
    r
}

// ---------------------------------------------------------------------------------
// Hooks (see `exports.rs`). Each receives the original and the caller's arguments.

type Graph = *mut c_void;

// Every hook serves two entry points: the legacy-stream one (`PER_THREAD` false) and
// its `_ptsz` twin, whose NULL stream is the per-thread stream.

/// # Safety
/// `real` is the driver's original of this entry point; the other arguments are the
/// application's, valid as `cuda.h` documents them.
pub unsafe fn begin_v1<const PER_THREAD: bool>(
    real: unsafe extern "C" fn(CUstream) -> CUresult,
    stream: CUstream,
) -> CUresult {
    // SAFETY: forwarding the caller's argument.
    begin_with(
        StreamArg::new(stream, PER_THREAD),
        CU_STREAM_CAPTURE_MODE_GLOBAL,
        || unsafe { real(stream) },
    )
}

/// # Safety
/// As [`begin_v1`].
pub unsafe fn begin<const PER_THREAD: bool>(
    real: unsafe extern "C" fn(CUstream, Uint) -> CUresult,
    stream: CUstream,
    mode: Uint,
) -> CUresult {
    // SAFETY: forwarding the caller's arguments.
    begin_with(StreamArg::new(stream, PER_THREAD), mode, || unsafe {
        real(stream, mode)
    })
}

type ToGraphFn = unsafe extern "C" fn(CUstream, Graph, Opaque, Opaque, usize, Uint) -> CUresult;

/// # Safety
/// As [`begin_v1`].
pub unsafe fn begin_to_graph<const PER_THREAD: bool>(
    real: ToGraphFn,
    stream: CUstream,
    graph: Graph,
    deps: Opaque,
    dep_data: Opaque,
    n: usize,
    mode: Uint,
) -> CUresult {
    // SAFETY: forwarding the caller's arguments.
    begin_with(StreamArg::new(stream, PER_THREAD), mode, || unsafe {
        real(stream, graph, deps, dep_data, n, mode)
    })
}

/// # Safety
/// As [`begin_v1`].
pub unsafe fn end<const PER_THREAD: bool>(
    real: unsafe extern "C" fn(CUstream, *mut Graph) -> CUresult,
    stream: CUstream,
    graph: *mut Graph,
) -> CUresult {
    // SAFETY: forwarding the caller's arguments.
    ended(StreamArg::new(stream, PER_THREAD), unsafe {
        real(stream, graph)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_thread_null_is_the_per_thread_stream() {
        let null = std::ptr::null_mut();
        assert_eq!(
            StreamArg::new(null, true).normalized(),
            CU_STREAM_PER_THREAD
        );
        assert_eq!(StreamArg::new(null, false).normalized(), 0);
        assert!(StreamArg::new(null, false).is_legacy());
        assert!(!StreamArg::new(null, true).is_legacy());
        let s = 0x1234usize as CUstream;
        assert_eq!(StreamArg::new(s, true).normalized(), 0x1234);
    }

    #[test]
    fn launch_config_stream_is_read_at_offset_32() {
        #[repr(C)]
        struct LaunchConfig {
            dims: [u32; 7],
            stream: CUstream,
            attrs: *mut c_void,
            n: u32,
        }
        let c = LaunchConfig {
            dims: [1; 7],
            stream: 0xabcd as CUstream,
            attrs: std::ptr::null_mut(),
            n: 0,
        };
        let s = launch_config_stream(&c as *const LaunchConfig as Opaque, false).unwrap();
        assert_eq!(s.normalized(), 0xabcd);
        assert!(launch_config_stream(std::ptr::null(), false).is_none());
    }

    #[test]
    fn no_shim_sync_while_a_capture_is_in_progress() {
        // Without a capture the sync runs; with one (counted) it is skipped.
        assert_eq!(sync_unless_capturing(|| Ok(())), Some(Ok(())));
        CAPTURES.fetch_add(1, Ordering::SeqCst);
        let mut ran = false;
        assert_eq!(
            sync_unless_capturing(|| {
                ran = true;
                Ok(())
            }),
            None
        );
        assert!(!ran);
        assert!(!quiesce(Duration::from_millis(20)));
        assert_eq!(
            sync_when_quiet(Duration::from_millis(20), || Ok(())),
            Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED)
        );
        // The capture ends while a drain waits: the drain runs then.
        let t = std::thread::spawn(|| {
            std::thread::sleep(Duration::from_millis(50));
            finished(seqs());
        });
        assert_eq!(sync_when_quiet(Duration::from_secs(5), || Ok(())), Ok(()));
        t.join().unwrap();
        assert!(!active());
    }
}
