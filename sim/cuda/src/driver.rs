//! Process-wide driver state: the machine segment, memory, contexts, streams,
//! events and modules, plus each thread's context stack.
//!
//! `cuInit` creates the state once; every other call before it fails with
//! `CUDA_ERROR_NOT_INITIALIZED`, as on the real driver.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock};

use kiwi_sim_core::trace::TraceWriter;
use kiwi_sim_core::{Machine, MachineError, SimConfig};

use crate::abi::*;
use crate::exec::{Context, Event, Op, Stream};
use crate::hw::Hw;
use crate::memory::Memory;

/// A loaded module: the context it was loaded into and the device memory it was
/// charged there (given back when it is unloaded or its context goes).
pub struct Module {
    pub ctx: usize,
    pub gpu: u32,
    pub charged: u64,
    /// What its code will cost once loaded, while it is not yet (lazy loading: the
    /// driver loads a module's kernels at its first `cuModuleGetFunction`).
    pub deferred: u64,
}

/// Objects C holds by handle, the object's address: contexts, streams, events,
/// graphs and their instantiations.
pub struct Handles<T>(RwLock<HashMap<usize, Arc<T>>>);

impl<T> Handles<T> {
    fn new() -> Self {
        Handles(RwLock::new(HashMap::new()))
    }

    /// Adds `obj`; returns its handle.
    pub fn add(&self, obj: Arc<T>) -> usize {
        let h = Arc::as_ptr(&obj) as usize;
        self.0
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(h, obj);
        h
    }

    /// The object of handle `h`, if there is one.
    pub fn get(&self, h: usize) -> Option<Arc<T>> {
        self.0
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&h)
            .cloned()
    }

    /// Removes handle `h`; the object, if there was one.
    pub fn remove(&self, h: usize) -> Option<Arc<T>> {
        self.0.write().unwrap_or_else(|e| e.into_inner()).remove(&h)
    }

    /// Keeps the objects `keep` accepts.
    pub fn retain(&self, mut keep: impl FnMut(&Arc<T>) -> bool) {
        self.0
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|_, o| keep(o));
    }

    /// Every object, at this moment.
    pub fn all(&self) -> Vec<Arc<T>> {
        self.0
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .cloned()
            .collect()
    }
}

pub struct Primary {
    pub ctx: Option<Arc<Context>>,
    pub refs: u32,
    pub flags: u32,
}

/// Everything `cuInit` sets up: the simulated hardware as this process sees it
/// ([`Hw`], which every `Driver` derefs to) and the registry of its contexts,
/// streams, events, modules and graphs.
pub struct Driver {
    pub hw: Hw,
    pub primary: Vec<Mutex<Primary>>,
    pub contexts: Handles<Context>,
    pub streams: Handles<Stream>,
    pub events: Handles<Event>,
    pub modules: Mutex<HashMap<usize, Module>>,
    /// Device memory each driver-API module load costs (`KIWI_SIM_MODULE_MEMORY`).
    pub module_memory: u64,
    /// `KIWI_SIM_FAIL_MEMCREATE` (fault injection, see `kiwi_sim_core::knobs`) and
    /// the process's `cuMemCreate` calls so far.
    pub fail_memcreate_every: u64,
    pub memcreate_calls: AtomicU64,
    /// Captured graphs and their instantiations: handle → operations.
    pub graphs: Handles<Vec<Op>>,
    pub graph_execs: Handles<Vec<Op>>,
    next_module: AtomicU64,
    /// The checkpoint API (`KIWI_SIM_CHECKPOINT`), and what a checkpoint and a
    /// restore of this process cost: seconds plus bytes at bytes/s (0: free).
    pub checkpoint_api: bool,
    pub checkpoint_s: f64,
    pub checkpoint_bps: f64,
    pub restore_s: f64,
    pub restore_bps: f64,
}

impl std::ops::Deref for Driver {
    type Target = Hw;
    fn deref(&self) -> &Hw {
        &self.hw
    }
}

static DRIVER: OnceLock<Result<Driver, CUresult>> = OnceLock::new();

/// Set in a child forked after `cuInit`: the child has the parent's driver state but
/// none of its executor threads, so (as with the real driver) it cannot use CUDA.
static FORKED: AtomicBool = AtomicBool::new(false);

extern "C" fn after_fork_in_child() {
    FORKED.store(true, Ordering::Relaxed);
}

fn init_driver() -> Result<Driver, CUresult> {
    let cfg = SimConfig::from_env().map_err(|e| {
        eprintln!("kiwi-sim libcuda: {e}");
        CUDA_ERROR_INVALID_VALUE
    })?;
    let machine = Machine::open(&cfg).map_err(|e| {
        eprintln!("kiwi-sim libcuda: {e}");
        CUDA_ERROR_OPERATING_SYSTEM
    })?;
    // The driver lives for the whole process.
    let machine: &'static Machine = Box::leak(Box::new(machine));
    let settings = machine.settings();
    let trace = match &cfg.trace {
        Some(p) => Some(TraceWriter::open(p).map_err(|e| {
            eprintln!("kiwi-sim libcuda: KIWI_SIM_TRACE={}: {e}", p.display());
            CUDA_ERROR_OPERATING_SYSTEM
        })?),
        None => None,
    };
    let mem = Memory::new(machine)?;
    // SAFETY: registers a handler that only stores to an atomic (async-signal-safe).
    unsafe { libc::pthread_atfork(None, None, Some(after_fork_in_child)) };
    Ok(Driver {
        hw: Hw {
            machine,
            name: cfg.name.clone(),
            gpus: settings.gpus,
            pcie_bps: settings.pcie_gbps * 1e9,
            hbm_bps: settings.hbm_gbps * 1e9,
            context_memory: cfg
                .process_context_memory
                .unwrap_or(settings.context_memory),
            memcreate_s: cfg.memcreate_us * 1e-6,
            memcreate_s_per_2mib: cfg.memcreate_us_per_2mib * 1e-6,
            pin_bps: cfg.pin_gbps * 1e9,
            pin_populated_bps: cfg.pin_populated_gbps * 1e9,
            pageable_h2d_bps: cfg.pageable_h2d_gbps * 1e9,
            pageable_d2h_bps: cfg.pageable_d2h_gbps * 1e9,
            trace,
            fail_sync: cfg.fail_sync.clone(),
            mem,
        },
        primary: (0..settings.gpus)
            .map(|_| {
                Mutex::new(Primary {
                    ctx: None,
                    refs: 0,
                    flags: 0,
                })
            })
            .collect(),
        contexts: Handles::new(),
        streams: Handles::new(),
        events: Handles::new(),
        modules: Mutex::new(HashMap::new()),
        module_memory: cfg.module_memory,
        fail_memcreate_every: cfg.fail_memcreate_every,
        memcreate_calls: AtomicU64::new(0),
        graphs: Handles::new(),
        graph_execs: Handles::new(),
        next_module: AtomicU64::new(1),
        checkpoint_api: cfg.checkpoint,
        checkpoint_s: cfg.checkpoint_ms * 1e-3,
        checkpoint_bps: cfg.checkpoint_gbps * 1e9,
        restore_s: cfg.restore_ms * 1e-3,
        restore_bps: cfg.restore_gbps * 1e9,
    })
}

/// `cuInit`: idempotent; the first call's outcome sticks.
pub fn init() -> Result<&'static Driver, CUresult> {
    if FORKED.load(Ordering::Relaxed) {
        return Err(CUDA_ERROR_NOT_INITIALIZED);
    }
    match DRIVER.get_or_init(init_driver) {
        Ok(d) => Ok(d),
        Err(e) => Err(*e),
    }
}

/// The driver, or `CUDA_ERROR_NOT_INITIALIZED` before `cuInit`.
#[inline]
pub fn driver() -> Result<&'static Driver, CUresult> {
    if FORKED.load(Ordering::Relaxed) {
        return Err(CUDA_ERROR_NOT_INITIALIZED);
    }
    match DRIVER.get() {
        Some(Ok(d)) => Ok(d),
        Some(Err(e)) => Err(*e),
        None => Err(CUDA_ERROR_NOT_INITIALIZED),
    }
}

thread_local! {
    /// This thread's context stack (top = current).
    static CTX_STACK: RefCell<Vec<Arc<Context>>> = const { RefCell::new(Vec::new()) };
    /// Per-thread default streams, by context handle.
    static PT_STREAMS: RefCell<HashMap<usize, Arc<Stream>>> = RefCell::new(HashMap::new());
}

impl Driver {
    pub fn device(&self, dev: CUdevice) -> Result<u32, CUresult> {
        if dev < 0 || dev as u32 >= self.gpus {
            return Err(CUDA_ERROR_INVALID_DEVICE);
        }
        Ok(dev as u32)
    }

    /// Charges the device memory a context costs to this process on `gpu`, when a
    /// context is created (or a reset primary context activated again). It counts
    /// toward the GPU's capacity in the machine segment like an allocation, so
    /// `cuMemGetInfo` and NVML show it and a dead process's contexts are reclaimed
    /// with its allocations; the application can never free or swap it.
    pub fn charge_context(&self, gpu: u32) -> Result<(), CUresult> {
        if self.context_memory == 0 {
            return Ok(());
        }
        self.machine
            .reserve(gpu, self.context_memory)
            .map_err(|e| match e {
                MachineError::OutOfMemory { .. } | MachineError::TooManyProcesses(_) => {
                    CUDA_ERROR_OUT_OF_MEMORY
                }
                MachineError::NoSuchGpu { .. } => CUDA_ERROR_INVALID_DEVICE,
                _ => CUDA_ERROR_OPERATING_SYSTEM,
            })
    }

    /// Gives back what [`Driver::charge_context`] took, once per charge: `charged`
    /// is the context's flag.
    pub fn uncharge_context(&self, gpu: u32, charged: &AtomicBool) {
        if charged.swap(false, Ordering::AcqRel) && self.context_memory > 0 {
            self.machine.release(gpu, self.context_memory);
        }
    }

    pub fn register_context(&self, ctx: &Arc<Context>) {
        self.contexts.add(ctx.clone());
    }

    pub fn context(&self, handle: usize) -> Result<Arc<Context>, CUresult> {
        self.contexts.get(handle).ok_or(CUDA_ERROR_INVALID_CONTEXT)
    }

    /// A module loaded into context `ctx` (on `gpu`), costing `charge` bytes of device
    /// memory there ([`Driver::module_memory`] for a driver-API load, 0 for the
    /// runtime's private path): at once (eager loading; out of memory when the charge
    /// does not fit, as `cuModuleLoad` on the real driver), or, `lazy`, at its first
    /// `cuModuleGetFunction` ([`Driver::load_code`]).
    pub fn new_module(
        &self,
        ctx: usize,
        gpu: u32,
        charge: u64,
        lazy: bool,
    ) -> Result<usize, CUresult> {
        if charge > 0 && !lazy {
            self.reserve_module(gpu, charge)?;
        }
        let id = self.next_module.fetch_add(1, Ordering::Relaxed);
        // Handles are small non-zero integers wearing a pointer type.
        let h = (id as usize) << 4;
        let (charged, deferred) = if lazy { (0, charge) } else { (charge, 0) };
        self.modules
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(
                h,
                Module {
                    ctx,
                    gpu,
                    charged,
                    deferred,
                },
            );
        Ok(h)
    }

    /// A fresh handle for a library or a kernel (`library.rs`), from the modules'
    /// sequence so that no two handles of these kinds are equal.
    pub fn new_handle(&self) -> usize {
        (self.next_module.fetch_add(1, Ordering::Relaxed) as usize) << 4
    }

    fn reserve_module(&self, gpu: u32, bytes: u64) -> Result<(), CUresult> {
        self.machine.reserve(gpu, bytes).map_err(|e| match e {
            MachineError::OutOfMemory { .. } | MachineError::TooManyProcesses(_) => {
                CUDA_ERROR_OUT_OF_MEMORY
            }
            MachineError::NoSuchGpu { .. } => CUDA_ERROR_INVALID_DEVICE,
            _ => CUDA_ERROR_OPERATING_SYSTEM,
        })
    }

    /// Loads module `h`'s code if it was deferred (lazy loading), charging its device
    /// memory now: out of memory when it does not fit, the code still not loaded (a
    /// later call tries again). `CUDA_ERROR_INVALID_HANDLE` for no such module.
    pub fn load_code(&self, h: usize) -> Result<(), CUresult> {
        let mut modules = self.modules.lock().unwrap_or_else(|e| e.into_inner());
        let m = modules.get_mut(&h).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        if m.deferred > 0 {
            self.reserve_module(m.gpu, m.deferred)?;
            m.charged += m.deferred;
            m.deferred = 0;
        }
        Ok(())
    }

    pub fn has_module(&self, h: usize) -> bool {
        self.modules
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains_key(&h)
    }

    /// `KIWI_SIM_FAIL_MEMCREATE`: out of memory for every Nth `cuMemCreate`.
    pub fn inject_memcreate_failure(&self) -> Result<(), CUresult> {
        let n = self.memcreate_calls.fetch_add(1, Ordering::Relaxed) + 1;
        if self.fail_memcreate_every > 0 && n.is_multiple_of(self.fail_memcreate_every) {
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
        Ok(())
    }

    /// Unloads a module, giving back its device memory.
    pub fn drop_module(&self, h: usize) -> bool {
        let m = self
            .modules
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&h);
        match m {
            Some(m) => {
                if m.charged > 0 {
                    self.machine.release(m.gpu, m.charged);
                }
                true
            }
            None => false,
        }
    }

    /// Unloads every module of context `ctx` (destroyed or reset), giving back their
    /// device memory.
    pub fn drop_modules_of(&self, ctx: usize) {
        let mut modules = self.modules.lock().unwrap_or_else(|e| e.into_inner());
        modules.retain(|_, m| {
            if m.ctx != ctx {
                return true;
            }
            if m.charged > 0 {
                self.machine.release(m.gpu, m.charged);
            }
            false
        });
    }

    /// The stream for a `CUstream` argument. NULL means the legacy stream, or the
    /// per-thread stream when called through a `_ptsz`/`_ptds` entry point.
    #[inline]
    pub fn stream(&self, h: CUstream, per_thread: bool) -> Result<Arc<Stream>, CUresult> {
        let h = h as usize;
        match h {
            0 if per_thread => per_thread_stream(),
            0 | CU_STREAM_LEGACY => {
                let ctx = current()?;
                Ok(ctx.null_stream())
            }
            CU_STREAM_PER_THREAD => per_thread_stream(),
            _ => {
                let s = self.streams.get(h).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
                s.ctx.check()?;
                Ok(s)
            }
        }
    }

    pub fn event(&self, h: CUevent) -> Result<Arc<Event>, CUresult> {
        self.events.get(h as usize).ok_or(CUDA_ERROR_INVALID_HANDLE)
    }
}

/// The current context of this thread, checked for destruction and sticky errors.
#[inline]
pub fn current() -> Result<Arc<Context>, CUresult> {
    let ctx = current_unchecked()?;
    ctx.check()?;
    Ok(ctx)
}

/// `CUDA_MODULE_LOADING=EAGER`: modules load their kernels at load, not at their
/// first use. Read once, as the driver reads it at `cuInit`.
pub fn eager_loading() -> bool {
    static EAGER: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *EAGER.get_or_init(|| std::env::var("CUDA_MODULE_LOADING").is_ok_and(|v| v == "EAGER"))
}

/// The current context without the sticky-error check.
pub fn current_unchecked() -> Result<Arc<Context>, CUresult> {
    CTX_STACK
        .with(|s| s.borrow().last().cloned())
        .ok_or(CUDA_ERROR_INVALID_CONTEXT)
}

/// `cuCtxGetCurrent` without touching the registry (the fast path).
#[inline]
pub fn current_handle() -> usize {
    CTX_STACK.with(|s| s.borrow().last().map(|c| c.handle()).unwrap_or(0))
}

pub fn push_current(ctx: Arc<Context>) {
    CTX_STACK.with(|s| s.borrow_mut().push(ctx));
}

pub fn pop_current() -> Option<Arc<Context>> {
    CTX_STACK.with(|s| s.borrow_mut().pop())
}

/// `cuCtxSetCurrent`: replaces the top of the stack (NULL pops it).
pub fn set_current(ctx: Option<Arc<Context>>) {
    CTX_STACK.with(|s| {
        let mut s = s.borrow_mut();
        s.pop();
        if let Some(c) = ctx {
            s.push(c);
        }
    });
}

/// Removes a destroyed context from this thread's stack.
pub fn forget_current(handle: usize) {
    CTX_STACK.with(|s| s.borrow_mut().retain(|c| c.handle() != handle));
    PT_STREAMS.with(|m| m.borrow_mut().remove(&handle));
}

fn per_thread_stream() -> Result<Arc<Stream>, CUresult> {
    let ctx = current()?;
    let h = ctx.handle();
    Ok(PT_STREAMS.with(|m| {
        m.borrow_mut()
            .entry(h)
            .or_insert_with(|| Arc::new(Stream::new(ctx.clone(), 0, 0)))
            .clone()
    }))
}
