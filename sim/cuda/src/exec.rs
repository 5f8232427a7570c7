//! Contexts and their executors: asynchronous work in submission order.
//!
//! Each context has two executor lanes, each one worker thread that runs queued work
//! (kernels, async copies and memsets, event records, host functions, stream waits,
//! stream memory operations, async frees) in submission order: the legacy lane (the
//! legacy stream, blocking streams, per-thread streams) and the non-blocking lane
//! (`CU_STREAM_NON_BLOCKING` streams), so a non-blocking stream is not ordered with
//! the legacy stream, as on hardware. Streams of one lane are serialized (documented
//! simplification: stream order is kept, concurrency within a lane is not
//! modelled; a stream memory wait holds its whole lane). Each lane's queue is
//! bounded at [`QUEUE_DEPTH`] pending operations; a submission blocks while it is
//! full, as a launch does on hardware.
//!
//! The submission path takes one uncontended mutex, writes into a preallocated ring
//! and wakes the worker only when it sleeps: no syscall and no allocation while the
//! worker is busy.
//!
//! What an operation does when its turn comes is the kernels' (`crate::builtin`),
//! the copies' and memsets' (`crate::transfer`) and the stream memory operations'
//! (`crate::memop`); this module orders and runs them, and keeps each context's
//! sticky error and limits.

use std::collections::{HashMap, VecDeque};
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use kiwi_sim_core::{monotonic_ns, LinkDir};

use crate::abi::*;
use crate::builtin::Builtin;
use crate::hw::Hw;
use crate::memop::{self, MemOp};
use crate::memory::Fault;
use crate::transfer::{self, Memset2D, Side};

/// Most operations queued on one context before submission blocks.
pub const QUEUE_DEPTH: usize = 1024;

/// One queued operation (cloned when a captured graph is replayed).
#[derive(Clone)]
pub enum Op {
    Kernel {
        kind: Builtin,
        args: [u64; 3],
    },
    /// Between device memory and a host address, the way `dir` says.
    HostCopy {
        dir: LinkDir,
        device: u64,
        host: usize,
        n: u64,
    },
    DtoD {
        dst: u64,
        src: u64,
        n: u64,
    },
    HtoH {
        dst: usize,
        src: usize,
        n: u64,
    },
    Memset {
        dst: u64,
        value: u32,
        elem: u8,
        count: u64,
    },
    /// 2D copy, row by row (`cuMemcpy2D*`).
    Copy2D {
        src: Side,
        dst: Side,
        width: u64,
        height: u64,
    },
    /// 2D memset (`cuMemsetD2D*`).
    Memset2D(Memset2D),
    EventRecord {
        event: Arc<Event>,
        generation: u64,
    },
    WaitFor {
        ctx: Arc<Context>,
        lane: usize,
        seq: u64,
    },
    HostFn {
        f: unsafe extern "C" fn(*mut c_void),
        data: usize,
    },
    Callback {
        f: unsafe extern "C" fn(CUstream, CUresult, *mut c_void),
        stream: usize,
        data: usize,
    },
    Free {
        ptr: u64,
    },
    /// `cuMemPrefetchAsync` of managed memory: its blocks move to a device (`to`) or
    /// the host (`None`) over the link, in stream order.
    Migrate {
        ptr: u64,
        n: u64,
        to: Option<u32>,
    },
    /// A stream memory operation (`cuStreamWaitValue*`, `cuStreamWriteValue*`): a
    /// wait keeps the stream, and with it the lane, busy until its condition holds.
    MemOp(MemOp),
    /// The operations of one `cuStreamBatchMemOp`, in array order.
    MemOps(Arc<[MemOp]>),
    /// Keeps stream order for work that has nothing to do here.
    Nop,
}

struct Queue {
    ops: VecDeque<(u64, Op)>,
    worker_idle: bool,
    shutdown: bool,
    space_waiters: usize,
}

/// One in-order executor of a context: its queue, worker thread and completion
/// counter. Sequence numbers count per lane.
struct Lane {
    queue: Mutex<Queue>,
    work_cv: Condvar,
    space_cv: Condvar,
    submitted: AtomicU64,
    completed: AtomicU64,
    done_mx: Mutex<()>,
    done_cv: Condvar,
    waiters: AtomicUsize,
    worker: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Lane {
    fn new() -> Lane {
        Lane {
            queue: Mutex::new(Queue {
                ops: VecDeque::with_capacity(QUEUE_DEPTH),
                worker_idle: false,
                shutdown: false,
                space_waiters: 0,
            }),
            work_cv: Condvar::new(),
            space_cv: Condvar::new(),
            submitted: AtomicU64::new(0),
            completed: AtomicU64::new(0),
            done_mx: Mutex::new(()),
            done_cv: Condvar::new(),
            waiters: AtomicUsize::new(0),
            worker: Mutex::new(None),
        }
    }
}

/// The lane of the legacy stream and of every stream ordered with it (blocking
/// streams, the per-thread stream).
pub const LEGACY_LANE: usize = 0;
/// The lane of `CU_STREAM_NON_BLOCKING` streams: not ordered with the legacy stream
/// (Driver API reference, "Stream synchronization behavior").
pub const NON_BLOCKING_LANE: usize = 1;
const LANES: usize = 2;

/// A CUDA context.
pub struct Context {
    pub device: u32,
    pub flags: u32,
    pub primary: bool,
    driver: &'static Hw,
    lanes: [Lane; LANES],
    /// Sticky error (e.g. `CUDA_ERROR_ILLEGAL_ADDRESS`): every later call fails with it.
    pub sticky: AtomicU32,
    pub destroyed: AtomicBool,
    /// Whether the device memory this context costs is charged to the process now
    /// (`Driver::charge_context`): from creation to destruction, or for a primary
    /// context from activation to reset.
    pub charged: AtomicBool,
    /// The legacy NULL stream of this context.
    pub null_stream: Mutex<Option<Arc<Stream>>>,
    /// Context-local storage of the runtime's private interface (`dark_api`):
    /// key → (value, destructor called when the context is reset or destroyed).
    pub local_storage: Mutex<HashMap<usize, (usize, Option<ClsDestructor>)>>,
    /// `cuCtxSetLimit` values, by `CUlimit`.
    limits: Mutex<[u64; LIMITS]>,
}

/// `CU_LIMIT_*` from `STACK_SIZE` (0) to `CIG_SHMEM_FALLBACK_ENABLED` (9).
const LIMITS: usize = 10;
/// Defaults of an A100 (CUDA 12): stack 1 KiB, printf FIFO 1 MiB, malloc heap
/// 8 MiB, sync depth 2, pending launches 2048, L2 fetch 64 B, persisting L2 0,
/// shared memory of a CIG context (not one: 0), CIG off, CIG fallback on.
const LIMIT_DEFAULTS: [u64; LIMITS] = [1024, 1 << 20, 8 << 20, 2, 2048, 64, 0, 0, 0, 1];

/// Threads resident at once, as `cuDeviceGetAttribute` reports the simulated device
/// (108 SMs × 2048 threads): the driver sizes the stack for each.
const RESIDENT_THREADS: u64 = 108 * 2048;

/// Device memory a limit's value takes beyond its default (which the context's own
/// memory covers): the stack per resident thread (`STACK_SIZE`), the printf FIFO and
/// the malloc heap (`PRINTF_FIFO_SIZE`, `MALLOC_HEAP_SIZE`), as the driver reserves
/// them when the limit is set; the other limits take none.
fn limit_bytes(limit: u32, value: u64) -> u64 {
    let over = value.saturating_sub(LIMIT_DEFAULTS.get(limit as usize).copied().unwrap_or(0));
    match limit {
        0 => over.saturating_mul(RESIDENT_THREADS),
        1 | 2 => over,
        _ => 0,
    }
}

/// Destructor of a context-local storage entry: (context, key, value).
pub type ClsDestructor = extern "C" fn(CUcontext, *mut c_void, *mut c_void);

/// A capture sequence in progress on a stream (see `capture`).
pub struct Capture {
    /// The operations captured so far, in stream order.
    pub ops: Vec<Op>,
    /// `CU_STREAM_CAPTURE_MODE_*` the sequence began with.
    pub mode: u32,
    /// The thread that began it (`capture::thread_id`).
    pub thread: u64,
    /// Unique id (`cuStreamGetCaptureInfo`).
    pub id: u64,
    /// Set by a prohibited call: the capture can only be ended, with an error.
    pub invalidated: bool,
}

/// A stream: the context it belongs to and its last submitted operation.
pub struct Stream {
    pub ctx: Arc<Context>,
    /// The lane this stream's work runs on, and its last operation there.
    pub lane: usize,
    pub last_seq: AtomicU64,
    pub flags: u32,
    pub priority: i32,
    /// The context's legacy NULL stream.
    pub legacy: bool,
    /// Set while the stream is being captured into a graph (checked without the
    /// lock on every submission).
    pub capturing: AtomicBool,
    /// The capture sequence in progress.
    pub captured: Mutex<Option<Capture>>,
}

impl Stream {
    pub fn new(ctx: Arc<Context>, flags: u32, priority: i32) -> Stream {
        Stream {
            ctx,
            lane: if flags & CU_STREAM_NON_BLOCKING != 0 {
                NON_BLOCKING_LANE
            } else {
                LEGACY_LANE
            },
            last_seq: AtomicU64::new(0),
            flags,
            priority,
            legacy: false,
            capturing: AtomicBool::new(false),
            captured: Mutex::new(None),
        }
    }

    /// Starts capturing; false if the stream already is.
    pub fn begin_capture(&self, mode: u32, thread: u64, id: u64) -> bool {
        let mut c = self.captured.lock().unwrap_or_else(|e| e.into_inner());
        if c.is_some() {
            return false;
        }
        *c = Some(Capture {
            ops: Vec::new(),
            mode,
            thread,
            id,
            invalidated: false,
        });
        self.capturing.store(true, Ordering::Release);
        true
    }

    /// Ends capturing and returns the sequence (None if not capturing).
    pub fn end_capture(&self) -> Option<Capture> {
        let mut c = self.captured.lock().unwrap_or_else(|e| e.into_inner());
        self.capturing.store(false, Ordering::Release);
        c.take()
    }

    pub fn is_capturing(&self) -> bool {
        self.capturing.load(Ordering::Acquire)
    }

    /// Runs `f` on the capture in progress, if any.
    pub fn with_capture<R>(&self, f: impl FnOnce(&mut Capture) -> R) -> Option<R> {
        self.captured
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_mut()
            .map(f)
    }
}

/// An event: where it was last recorded and when that point completed.
pub struct Event {
    pub flags: u32,
    pub state: Mutex<EventState>,
}

#[derive(Default)]
pub struct EventState {
    pub ctx: Option<Arc<Context>>,
    /// The lane of the stream it was recorded on.
    pub lane: usize,
    /// Sequence of the record operation; `u64::MAX` while it is being submitted.
    pub seq: u64,
    /// Completion time (monotonic ns), 0 while pending.
    pub time_ns: u64,
    /// Bumped by every record, so a stale record op does not complete a newer one.
    pub generation: u64,
    /// Id of the capture sequence the last record went into (0: none).
    pub capture_id: u64,
}

impl Context {
    pub fn new(driver: &'static Hw, device: u32, flags: u32, primary: bool) -> Arc<Context> {
        let ctx = Arc::new(Context {
            device,
            flags,
            primary,
            driver,
            lanes: [Lane::new(), Lane::new()],
            sticky: AtomicU32::new(CUDA_SUCCESS),
            destroyed: AtomicBool::new(false),
            charged: AtomicBool::new(false),
            null_stream: Mutex::new(None),
            local_storage: Mutex::new(HashMap::new()),
            limits: Mutex::new(LIMIT_DEFAULTS),
        });
        *ctx.null_stream.lock().unwrap_or_else(|e| e.into_inner()) = Some(Arc::new(Stream {
            legacy: true,
            ..Stream::new(ctx.clone(), 0, 0)
        }));
        for lane in 0..LANES {
            let worker_ctx = ctx.clone();
            let handle = std::thread::Builder::new()
                .name(format!("kiwi-sim-gpu{device}.{lane}"))
                .spawn(move || worker_ctx.run_worker(lane))
                .expect("spawning the context executor thread");
            *ctx.lanes[lane]
                .worker
                .lock()
                .unwrap_or_else(|e| e.into_inner()) = Some(handle);
        }
        ctx
    }

    /// The handle value given to C (`CUcontext`).
    pub fn handle(self: &Arc<Self>) -> usize {
        Arc::as_ptr(self) as usize
    }

    pub fn null_stream(&self) -> Arc<Stream> {
        self.null_stream
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .expect("set at creation, cleared only on destroy")
    }

    /// The sticky error of this context, if any.
    pub fn check(&self) -> Result<(), CUresult> {
        if self.destroyed.load(Ordering::Acquire) {
            return Err(CUDA_ERROR_CONTEXT_IS_DESTROYED);
        }
        match self.sticky.load(Ordering::Acquire) {
            CUDA_SUCCESS => Ok(()),
            e => Err(e),
        }
    }

    /// Queues `op` on `stream` (which belongs to this context); returns its sequence.
    /// The stream capture rules are `crate::capture::submit`'s, which every
    /// submission goes through.
    pub fn submit(&self, stream: &Stream, op: Op) -> Result<u64, CUresult> {
        if stream.is_capturing() {
            // Captured into the stream's graph instead of run; sequence 0 is
            // "already complete" for anyone who waits on it.
            let mut c = stream.captured.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(cap) = c.as_mut() {
                if cap.invalidated {
                    // CUDA Programming Guide, "Invalidation": further use of a
                    // stream whose capture was invalidated is an error until
                    // cuStreamEndCapture.
                    return Err(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
                }
                cap.ops.push(op);
                return Ok(0);
            }
        }
        let l = &self.lanes[stream.lane];
        let mut q = l.queue.lock().unwrap_or_else(|e| e.into_inner());
        while q.ops.len() >= QUEUE_DEPTH && !q.shutdown {
            q.space_waiters += 1;
            q = l.space_cv.wait(q).unwrap_or_else(|e| e.into_inner());
            q.space_waiters -= 1;
        }
        if q.shutdown {
            return Err(CUDA_ERROR_CONTEXT_IS_DESTROYED);
        }
        let seq = l.submitted.load(Ordering::Relaxed) + 1;
        l.submitted.store(seq, Ordering::Release);
        stream.last_seq.store(seq, Ordering::Release);
        q.ops.push_back((seq, op));
        if q.worker_idle {
            q.worker_idle = false;
            l.work_cv.notify_one();
        }
        Ok(seq)
    }

    /// Sequence number of the last operation submitted to `lane`.
    pub fn submitted(&self, lane: usize) -> u64 {
        self.lanes[lane].submitted.load(Ordering::Acquire)
    }

    pub fn is_done(&self, lane: usize, seq: u64) -> bool {
        self.lanes[lane].completed.load(Ordering::Acquire) >= seq
    }

    /// Blocks until operation `seq` of `lane` has completed.
    pub fn wait_for(&self, lane: usize, seq: u64) {
        if self.is_done(lane, seq) {
            return;
        }
        let l = &self.lanes[lane];
        l.waiters.fetch_add(1, Ordering::SeqCst);
        let mut g = l.done_mx.lock().unwrap_or_else(|e| e.into_inner());
        while l.completed.load(Ordering::SeqCst) < seq {
            g = l.done_cv.wait(g).unwrap_or_else(|e| e.into_inner());
        }
        drop(g);
        l.waiters.fetch_sub(1, Ordering::SeqCst);
    }

    /// Waits for everything submitted so far, on every lane.
    pub fn wait_all(&self) {
        for lane in 0..LANES {
            self.wait_for(lane, self.submitted(lane));
        }
    }

    /// Waits for everything submitted so far, on every lane, until `deadline`
    /// (`None`: for as long as it takes); false when the deadline passed first.
    pub fn wait_all_until(&self, deadline: Option<std::time::Instant>) -> bool {
        let Some(deadline) = deadline else {
            self.wait_all();
            return true;
        };
        for lane in 0..LANES {
            let seq = self.submitted(lane);
            if self.is_done(lane, seq) {
                continue;
            }
            let l = &self.lanes[lane];
            l.waiters.fetch_add(1, Ordering::SeqCst);
            let mut g = l.done_mx.lock().unwrap_or_else(|e| e.into_inner());
            let mut in_time = true;
            while l.completed.load(Ordering::SeqCst) < seq {
                let now = std::time::Instant::now();
                if now >= deadline {
                    in_time = false;
                    break;
                }
                g = l
                    .done_cv
                    .wait_timeout(g, deadline - now)
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
            }
            drop(g);
            l.waiters.fetch_sub(1, Ordering::SeqCst);
            if !in_time {
                return false;
            }
        }
        true
    }

    /// Waits for everything submitted so far and returns the sticky error, if any.
    pub fn synchronize(&self) -> Result<(), CUresult> {
        self.wait_all();
        self.check()
    }

    /// `cuCtxGetLimit`.
    pub fn limit(&self, limit: u32) -> Result<u64, CUresult> {
        let l = self.limits.lock().unwrap_or_else(|e| e.into_inner());
        l.get(limit as usize)
            .copied()
            .ok_or(CUDA_ERROR_UNSUPPORTED_LIMIT)
    }

    /// `cuCtxSetLimit`: the CIG limits (7, 8) can only be read; the L2 fetch
    /// granularity is at most 128 bytes.
    pub fn set_limit(&self, limit: u32, value: u64) -> Result<(), CUresult> {
        match limit {
            0..=4 | 6 | 9 => {}
            5 if value <= 128 => {}
            5 | 7 | 8 => return Err(CUDA_ERROR_INVALID_VALUE),
            _ => return Err(CUDA_ERROR_UNSUPPORTED_LIMIT),
        }
        let mut limits = self.limits.lock().unwrap_or_else(|e| e.into_inner());
        // The device memory the new value takes, as the driver sizes it at once: the
        // call fails with out of memory, the old value kept, when it does not fit.
        let (old, new) = (
            limit_bytes(limit, limits[limit as usize]),
            limit_bytes(limit, value),
        );
        if new > old {
            self.driver
                .machine
                .reserve(self.device, new - old)
                .map_err(|_| CUDA_ERROR_OUT_OF_MEMORY)?;
        } else if old > new {
            self.driver.machine.release(self.device, old - new);
        }
        limits[limit as usize] = value;
        Ok(())
    }

    /// Gives back the device memory the limits took and restores the defaults (a
    /// destroyed context, a reset primary context).
    pub fn release_limits(&self) {
        let mut limits = self.limits.lock().unwrap_or_else(|e| e.into_inner());
        let taken: u64 = (0..LIMITS as u32)
            .map(|l| limit_bytes(l, limits[l as usize]))
            .sum();
        if taken > 0 {
            self.driver.machine.release(self.device, taken);
        }
        *limits = LIMIT_DEFAULTS;
    }

    /// Empties the context-local storage, calling each entry's destructor (outside
    /// the lock: a destructor may call back into the driver).
    pub fn clear_local_storage(self: &Arc<Self>) {
        let entries: Vec<_> = self
            .local_storage
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain()
            .collect();
        for (key, (value, dtor)) in entries {
            if let Some(f) = dtor {
                f(
                    self.handle() as CUcontext,
                    key as *mut c_void,
                    value as *mut c_void,
                );
            }
        }
    }

    /// Stops the executor after it drained its queue.
    pub fn shut_down(&self) {
        for l in &self.lanes {
            let mut q = l.queue.lock().unwrap_or_else(|e| e.into_inner());
            q.shutdown = true;
            l.work_cv.notify_all();
            l.space_cv.notify_all();
        }
        for l in &self.lanes {
            if let Some(h) = l.worker.lock().unwrap_or_else(|e| e.into_inner()).take() {
                if h.thread().id() != std::thread::current().id() {
                    let _ = h.join();
                }
            }
        }
        // Break the context ↔ null stream cycle.
        self.null_stream
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
    }

    fn run_worker(self: Arc<Self>, lane: usize) {
        let l = &self.lanes[lane];
        loop {
            let (seq, op) = {
                let mut q = l.queue.lock().unwrap_or_else(|e| e.into_inner());
                loop {
                    if let Some(item) = q.ops.pop_front() {
                        if q.space_waiters > 0 {
                            l.space_cv.notify_one();
                        }
                        break item;
                    }
                    if q.shutdown {
                        return;
                    }
                    q.worker_idle = true;
                    q = l.work_cv.wait(q).unwrap_or_else(|e| e.into_inner());
                }
            };
            // A panic in one operation must not kill the executor (waiters would hang).
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                self.execute(op);
            }));
            if r.is_err() {
                self.sticky
                    .store(CUDA_ERROR_LAUNCH_FAILED, Ordering::Release);
            }
            l.completed.store(seq, Ordering::SeqCst);
            if l.waiters.load(Ordering::SeqCst) > 0 {
                let _g = l.done_mx.lock().unwrap_or_else(|e| e.into_inner());
                l.done_cv.notify_all();
            }
        }
    }

    fn fail(&self, e: CUresult) {
        // Only the first error sticks, as on hardware.
        let _ = self
            .sticky
            .compare_exchange(CUDA_SUCCESS, e, Ordering::AcqRel, Ordering::Acquire);
    }

    /// Work whose memory went away since submission fails as on hardware: a sticky
    /// `CUDA_ERROR_ILLEGAL_ADDRESS`.
    fn or_fail(&self, r: Result<(), Fault>) {
        if r.is_err() {
            self.fail(CUDA_ERROR_ILLEGAL_ADDRESS);
        }
    }

    fn execute(&self, op: Op) {
        let broken = self.sticky.load(Ordering::Acquire) != CUDA_SUCCESS;
        let d = self.driver;
        match op {
            Op::EventRecord { event, generation } => {
                let mut st = event.state.lock().unwrap_or_else(|e| e.into_inner());
                if st.generation == generation {
                    st.time_ns = monotonic_ns();
                }
            }
            Op::WaitFor { ctx, lane, seq } => ctx.wait_for(lane, seq),
            _ if broken => {}
            Op::Kernel { kind, args } => self.or_fail(kind.run(d, self.device, args)),
            Op::HostCopy {
                dir,
                device,
                host,
                n,
            } => self.or_fail(transfer::host_copy(d, self.device, dir, device, host, n)),
            Op::DtoD { dst, src, n } => self.or_fail(transfer::dtod(d, self.device, dst, src, n)),
            Op::HtoH { dst, src, n } => transfer::htoh(d, dst, src, n),
            Op::Memset {
                dst,
                value,
                elem,
                count,
            } => self.or_fail(transfer::memset(d, self.device, dst, value, elem, count)),
            Op::Memset2D(m) => self.or_fail(m.run(d, self.device)),
            Op::Copy2D {
                src,
                dst,
                width,
                height,
            } => self.or_fail(transfer::copy_2d(d, self.device, src, dst, width, height)),
            Op::HostFn { f, data } => {
                // SAFETY: the user's host function with the user's data, as
                // cuLaunchHostFunc promises.
                unsafe { f(data as *mut c_void) }
            }
            Op::Callback { f, stream, data } => {
                // SAFETY: the user's stream callback, as cuStreamAddCallback promises.
                unsafe { f(stream as CUstream, CUDA_SUCCESS, data as *mut c_void) }
            }
            Op::Free { ptr } => {
                if d.mem.free_linear(ptr).is_ok() {
                    crate::pool_usage::note_free(ptr);
                }
            }
            Op::Migrate { ptr, n, to } => transfer::migrate(d, ptr, n, to),
            Op::MemOp(m) => self.run_memops(std::slice::from_ref(&m)),
            Op::MemOps(ms) => self.run_memops(&ms),
            Op::Nop => {}
        }
    }

    /// Runs stream memory operations in order; one whose memory went away since
    /// submission fails as a kernel would (sticky `CUDA_ERROR_ILLEGAL_ADDRESS`).
    fn run_memops(&self, ops: &[MemOp]) {
        let broken = || self.sticky.load(Ordering::Acquire) != CUDA_SUCCESS;
        for m in ops {
            if memop::run(self.driver, self.device, m, &broken).is_err() {
                self.fail(CUDA_ERROR_ILLEGAL_ADDRESS);
                return;
            }
        }
    }
}
