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

use std::collections::{HashMap, VecDeque};
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use kiwi_sim_core::{dma, monotonic_ns, LinkDir, TraceRecord};

use crate::abi::*;
use crate::hw::Hw;
use crate::memop::{self, MemOp};
use crate::memory::Fault;

/// Most operations queued on one context before submission blocks.
pub const QUEUE_DEPTH: usize = 1024;

/// The built-in kernels, found by entry name in any module.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Builtin {
    /// `kiwi_fill(u32* ptr, u32 value, u64 words)`
    Fill,
    /// `kiwi_add(u32* ptr, u32 delta, u64 words)`
    Add,
    /// `kiwi_checksum(const u32* ptr, u64 words, u64* out)`: u64 sum of the words.
    Checksum,
    /// `kiwi_spin(u64 nanoseconds)`
    Spin,
}

/// The four built-in kernels; a `CUfunction` is a pointer into this table.
pub static BUILTINS: [Builtin; 4] = [
    Builtin::Fill,
    Builtin::Add,
    Builtin::Checksum,
    Builtin::Spin,
];

impl Builtin {
    /// Its `CUfunction`: its entry of [`BUILTINS`].
    pub fn handle(self) -> CUfunction {
        let b = BUILTINS
            .iter()
            .find(|b| **b == self)
            .unwrap_or(&BUILTINS[0]);
        b as *const Builtin as CUfunction
    }

    /// Its name as a C string (`cuKernelGetName`).
    pub fn c_name(self) -> *const std::ffi::c_char {
        match self {
            Builtin::Fill => c"kiwi_fill".as_ptr(),
            Builtin::Add => c"kiwi_add".as_ptr(),
            Builtin::Checksum => c"kiwi_checksum".as_ptr(),
            Builtin::Spin => c"kiwi_spin".as_ptr(),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Builtin::Fill => "kiwi_fill",
            Builtin::Add => "kiwi_add",
            Builtin::Checksum => "kiwi_checksum",
            Builtin::Spin => "kiwi_spin",
        }
    }

    /// Parameter sizes in order (for `kernelParams` and the packed `extra` buffer).
    pub fn param_sizes(self) -> &'static [usize] {
        match self {
            Builtin::Fill | Builtin::Add => &[8, 4, 8],
            Builtin::Checksum => &[8, 8, 8],
            Builtin::Spin => &[8],
        }
    }
}

/// One queued operation (cloned when a captured graph is replayed).
#[derive(Clone)]
pub enum Op {
    Kernel {
        kind: Builtin,
        args: [u64; 3],
    },
    /// Host → device (`src` is a host address).
    HtoD {
        dst: u64,
        src: usize,
        n: u64,
    },
    /// Device → host.
    DtoH {
        dst: usize,
        src: u64,
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
    /// 2D memset: `height` rows of `width` elements, `pitch` bytes apart.
    Memset2D {
        dst: u64,
        pitch: u64,
        value: u32,
        elem: u8,
        width: u64,
        height: u64,
    },
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

/// One side of a 2D copy: the address of its first byte (host or device) and pitch.
#[derive(Clone, Copy, Debug)]
pub struct Side {
    pub device: bool,
    pub addr: u64,
    pub pitch: u64,
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
            Op::Kernel { kind, args } => {
                if let Err(f) = self.run_kernel(kind, args) {
                    let _ = f;
                    self.fail(CUDA_ERROR_ILLEGAL_ADDRESS);
                }
            }
            Op::HtoD { dst, src, n } => {
                let start = monotonic_ns();
                match d.mem.resolve(dst, n, true, self.device) {
                    Ok(pieces) => {
                        let end = self.link(LinkDir::HostToDevice, start, n as f64);
                        let end = pageable_end(d, src, n, start, end, d.pageable_h2d_bps);
                        let mut at = src;
                        for p in pieces {
                            // SAFETY: host range validated by the caller's contract;
                            // device piece resolved and kept alive by `p.phys`.
                            unsafe {
                                dma::copy(
                                    p.phys.host_ptr(p.offset),
                                    at as *const u8,
                                    p.len as usize,
                                )
                            };
                            at += p.len as usize;
                        }
                        pace_until(end);
                    }
                    Err(_) => self.fail(CUDA_ERROR_ILLEGAL_ADDRESS),
                }
            }
            Op::DtoH { dst, src, n } => {
                let start = monotonic_ns();
                match d.mem.resolve(src, n, false, self.device) {
                    Ok(pieces) => {
                        let end = self.link(LinkDir::DeviceToHost, start, n as f64);
                        let end = pageable_end(d, dst, n, start, end, d.pageable_d2h_bps);
                        let mut at = dst;
                        for p in pieces {
                            // SAFETY: as for HtoD, in the other direction.
                            unsafe {
                                dma::copy(at as *mut u8, p.phys.host_ptr(p.offset), p.len as usize)
                            };
                            at += p.len as usize;
                        }
                        pace_until(end);
                    }
                    Err(_) => self.fail(CUDA_ERROR_ILLEGAL_ADDRESS),
                }
            }
            Op::DtoD { dst, src, n } => {
                let start = monotonic_ns();
                match (
                    d.mem.resolve(src, n, false, self.device),
                    d.mem.resolve(dst, n, true, self.device),
                ) {
                    (Ok(s), Ok(t)) => {
                        copy_pieces(&s, &t);
                        pace(start, 2.0 * n as f64 / d.hbm_bps);
                    }
                    _ => self.fail(CUDA_ERROR_ILLEGAL_ADDRESS),
                }
            }
            Op::HtoH { dst, src, n } => {
                let start = monotonic_ns();
                // SAFETY: both host ranges are the caller's, per the cuMemcpy contract.
                unsafe {
                    std::ptr::copy(src as *const u8, dst as *mut u8, n as usize);
                }
                pace(start, n as f64 / d.pcie_bps);
            }
            Op::Memset {
                dst,
                value,
                elem,
                count,
            } => {
                let start = monotonic_ns();
                let n = count * u64::from(elem);
                match memset_range(d, self.device, dst, value, elem, count) {
                    Ok(()) => pace(start, n as f64 / d.hbm_bps),
                    Err(_) => self.fail(CUDA_ERROR_ILLEGAL_ADDRESS),
                }
            }
            Op::Memset2D {
                dst,
                pitch,
                value,
                elem,
                width,
                height,
            } => {
                let start = monotonic_ns();
                let ok = (0..height).all(|row| {
                    memset_range(d, self.device, dst + row * pitch, value, elem, width).is_ok()
                });
                if ok {
                    pace(start, (width * u64::from(elem) * height) as f64 / d.hbm_bps);
                } else {
                    self.fail(CUDA_ERROR_ILLEGAL_ADDRESS);
                }
            }
            Op::Copy2D {
                src,
                dst,
                width,
                height,
            } => {
                let start = monotonic_ns();
                let bytes = (width * height) as f64;
                // A copy with a host side crosses the link (reserved before it
                // starts, as for HtoD/DtoH); device to device stays in HBM.
                let end = match (src.device, dst.device) {
                    (false, true) => Some(self.link(LinkDir::HostToDevice, start, bytes)),
                    (true, false) => Some(self.link(LinkDir::DeviceToHost, start, bytes)),
                    _ => None,
                };
                let ok = (0..height).all(|row| {
                    copy_row(
                        d,
                        self.device,
                        src.device,
                        src.addr + row * src.pitch,
                        dst.device,
                        dst.addr + row * dst.pitch,
                        width,
                    )
                    .is_ok()
                });
                if ok {
                    match end {
                        Some(end) => pace_until(end),
                        None if src.device => pace(start, 2.0 * bytes / d.hbm_bps),
                        None => pace(start, bytes / d.pcie_bps),
                    }
                } else {
                    self.fail(CUDA_ERROR_ILLEGAL_ADDRESS);
                }
            }
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
            Op::Migrate { ptr, n, to } => {
                let start = monotonic_ns();
                // Moved at the link's rate (a prefetch is a bulk transfer; the driver
                // migrates faulted pages slower, which is not modelled).
                let moved = d.mem.migrate(ptr, n, to).unwrap_or(0);
                pace(start, moved as f64 / d.pcie_bps);
            }
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

    /// Reserves this GPU's PCIe link in direction `dir` for `bytes` (at the link rate)
    /// for a copy ready at `start_ns`, behind every copy already queued in that
    /// direction by any process; returns when the copy ends (see
    /// `Machine::link_reserve`).
    fn link(&self, dir: LinkDir, start_ns: u64, bytes: f64) -> u64 {
        let d = self.driver;
        let ns = (bytes / d.pcie_bps * 1e9) as u64;
        d.machine
            .link_reserve(self.device, dir, start_ns, ns)
            .unwrap_or(start_ns + ns)
    }

    /// Runs a built-in kernel holding the device exclusively (across processes) for
    /// at least its modelled duration, then appends its trace line.
    fn run_kernel(&self, kind: Builtin, args: [u64; 3]) -> Result<(), Fault> {
        let d = self.driver;
        let guard = d.machine.kernel_lock(self.device).ok();
        let start = monotonic_ns();
        let modelled_s = match kind {
            Builtin::Spin => args[0] as f64 / 1e9,
            Builtin::Fill => {
                let (ptr, value, words) = (args[0], args[1] as u32, args[2]);
                for p in d.mem.resolve(ptr, bytes_of(words)?, true, self.device)? {
                    for_words(&p, |w| *w = value);
                }
                words as f64 * 4.0 / d.hbm_bps
            }
            Builtin::Add => {
                let (ptr, delta, words) = (args[0], args[1] as u32, args[2]);
                for p in d.mem.resolve(ptr, bytes_of(words)?, true, self.device)? {
                    for_words(&p, |w| *w = w.wrapping_add(delta));
                }
                words as f64 * 8.0 / d.hbm_bps
            }
            Builtin::Checksum => {
                let (ptr, words, out) = (args[0], args[1], args[2]);
                let mut sum = 0u64;
                for p in d.mem.resolve(ptr, bytes_of(words)?, false, self.device)? {
                    for_words(&p, |w| sum = sum.wrapping_add(u64::from(*w)));
                }
                let dst = d.mem.resolve(out, 8, true, self.device)?;
                copy_from_host(&dst, &sum.to_le_bytes());
                words as f64 * 4.0 / d.hbm_bps
            }
        };
        pace(start, modelled_s);
        let end = monotonic_ns();
        drop(guard);
        if let Some(t) = &d.trace {
            let _ = t.append(&TraceRecord {
                pid: std::process::id(),
                device: self.device,
                start_ns: start,
                end_ns: end,
                name: kind.name().to_string(),
            });
        }
        Ok(())
    }
}

/// Bytes of `words` u32 words; a count no device could hold is an illegal address.
fn bytes_of(words: u64) -> Result<u64, Fault> {
    words.checked_mul(4).ok_or(Fault::Unmapped)
}

/// Sleeps until `seconds` of wall time have passed since `start_ns`.
fn pace(start_ns: u64, seconds: f64) {
    pace_until(start_ns + (seconds * 1e9) as u64);
}

/// Sleeps until `CLOCK_MONOTONIC` reads `target_ns`.
fn pace_until(target_ns: u64) {
    let now = monotonic_ns();
    if target_ns > now {
        std::thread::sleep(Duration::from_nanos(target_ns - now));
    }
}

/// Applies `f` to each whole u32 of a piece (pieces of kernels are 4-byte multiples
/// whenever the kernel's pointer is 4-byte aligned; a misaligned tail is ignored).
fn for_words(p: &crate::memory::Piece, mut f: impl FnMut(&mut u32)) {
    let base = p.phys.host_ptr(p.offset);
    let words = (p.len / 4) as usize;
    if (base as usize).is_multiple_of(4) {
        // SAFETY: resolved piece of `p.len` bytes, aligned, kept alive by p.phys.
        let s = unsafe { std::slice::from_raw_parts_mut(base.cast::<u32>(), words) };
        s.iter_mut().for_each(f);
    } else {
        for i in 0..words {
            // SAFETY: as above, using unaligned accesses.
            unsafe {
                let w = base.add(i * 4).cast::<u32>();
                let mut v = w.read_unaligned();
                f(&mut v);
                w.write_unaligned(v);
            }
        }
    }
}

fn fill_pattern(bytes: &mut [u8], pattern: &[u8; 4], phase: usize) {
    if pattern.iter().all(|&b| b == pattern[0]) {
        bytes.fill(pattern[0]);
        return;
    }
    for (i, b) in bytes.iter_mut().enumerate() {
        *b = pattern[(phase + i) % 4];
    }
}

fn copy_from_host(dst: &[crate::memory::Piece], src: &[u8]) {
    let mut at = 0;
    for p in dst {
        // SAFETY: resolved writable piece; src has at least p.len bytes left.
        unsafe {
            std::ptr::copy_nonoverlapping(
                src.as_ptr().add(at),
                p.phys.host_ptr(p.offset),
                p.len as usize,
            )
        };
        at += p.len as usize;
    }
}

fn copy_pieces(src: &[crate::memory::Piece], dst: &[crate::memory::Piece]) {
    let (mut si, mut so, mut di, mut doff) = (0, 0u64, 0, 0u64);
    while si < src.len() && di < dst.len() {
        let s = &src[si];
        let t = &dst[di];
        let n = (s.len - so).min(t.len - doff);
        // SAFETY: both pieces resolved and alive; `copy` tolerates overlap.
        unsafe {
            std::ptr::copy(
                s.phys.host_ptr(s.offset + so),
                t.phys.host_ptr(t.offset + doff),
                n as usize,
            )
        };
        so += n;
        doff += n;
        if so == s.len {
            si += 1;
            so = 0;
        }
        if doff == t.len {
            di += 1;
            doff = 0;
        }
    }
}

/// Fills `count` elements of `elem` bytes at device address `dst` with `value`.
fn memset_range(d: &Hw, dev: u32, dst: u64, value: u32, elem: u8, count: u64) -> Result<(), Fault> {
    let n = count * u64::from(elem);
    let pattern: [u8; 4] = match elem {
        1 => [value as u8; 4],
        2 => {
            let b = (value as u16).to_le_bytes();
            [b[0], b[1], b[0], b[1]]
        }
        _ => value.to_le_bytes(),
    };
    let mut phase = 0usize;
    for p in d.mem.resolve(dst, n, true, dev)? {
        // SAFETY: resolved, writable device piece kept alive by p.phys.
        let bytes =
            unsafe { std::slice::from_raw_parts_mut(p.phys.host_ptr(p.offset), p.len as usize) };
        fill_pattern(bytes, &pattern, phase);
        phase = (phase + bytes.len()) % 4;
    }
    Ok(())
}

/// Copies `n` bytes between any combination of host and device addresses.
fn copy_row(
    d: &Hw,
    dev: u32,
    src_dev: bool,
    src: u64,
    dst_dev: bool,
    dst: u64,
    n: u64,
) -> Result<(), Fault> {
    match (src_dev, dst_dev) {
        (true, true) => {
            let s = d.mem.resolve(src, n, false, dev)?;
            let t = d.mem.resolve(dst, n, true, dev)?;
            copy_pieces(&s, &t);
        }
        (false, true) => {
            let mut at = src as usize;
            for p in d.mem.resolve(dst, n, true, dev)? {
                // SAFETY: host source readable per the caller's contract; device
                // piece resolved and alive.
                unsafe { dma::copy(p.phys.host_ptr(p.offset), at as *const u8, p.len as usize) };
                at += p.len as usize;
            }
        }
        (true, false) => {
            let mut at = dst as usize;
            for p in d.mem.resolve(src, n, false, dev)? {
                // SAFETY: as above, in the other direction.
                unsafe { dma::copy(at as *mut u8, p.phys.host_ptr(p.offset), p.len as usize) };
                at += p.len as usize;
            }
        }
        (false, false) => {
            // SAFETY: both host ranges are the caller's, per the cuMemcpy2D contract.
            unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, n as usize) };
        }
    }
    Ok(())
}

/// When a host↔device copy of `n` bytes at host address `host`, started at `start`
/// and done on the link by `link_end`, ends: then, for pinned (allocated or
/// registered) host memory; no sooner than at `pageable_bps` for pageable memory,
/// which the driver stages through its own pinned buffers.
fn pageable_end(d: &Hw, host: usize, n: u64, start: u64, link_end: u64, pageable_bps: f64) -> u64 {
    let pinned = d
        .mem
        .host_range(host)
        .is_some_and(|(s, l)| host.saturating_add(n as usize) <= s + l);
    if pinned || pageable_bps <= 0.0 {
        return link_end;
    }
    link_end.max(start + (n as f64 / pageable_bps * 1e9) as u64)
}
