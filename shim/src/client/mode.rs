//! The process-wide client and its start-up state machine: started once at `cuInit`,
//! managed, unmanaged (no arbiter, or no GPU), failed (`KIWI_REQUIRE_ARBITER`), or a
//! forked child that holds nothing.

use super::*;

const UNSTARTED: u8 = 0;
const STARTING: u8 = 1;
const MANAGED: u8 = 2;
const UNMANAGED: u8 = 3;
const FAILED: u8 = 4;
const FORKED: u8 = 5;

static MODE: AtomicU8 = AtomicU8::new(UNSTARTED);
pub(super) static CLIENT: OnceLock<Arc<Client>> = OnceLock::new();

pub fn mode_name() -> &'static str {
    match MODE.load(Ordering::Acquire) {
        UNSTARTED => "unstarted",
        STARTING => "starting",
        MANAGED => "managed",
        UNMANAGED => "unmanaged",
        FAILED => "failed",
        _ => "forked",
    }
}

/// The client, when this process is managed by an arbiter.
pub fn global() -> Option<&'static Arc<Client>> {
    if MODE.load(Ordering::Acquire) == MANAGED {
        CLIENT.get()
    } else {
        None
    }
}

/// Whether the shim's allocator should serve allocations (not in a forked child, not
/// after a failed start).
pub fn allocator_enabled() -> bool {
    matches!(MODE.load(Ordering::Acquire), MANAGED | UNMANAGED)
}

extern "C" fn after_fork_in_child() {
    // The child inherited the parent's connections and turns: it holds nothing and
    // talks to nobody (a data-loader worker that never touches CUDA must cost the
    // arbiter nothing). Only async-signal-safe work here.
    MODE.store(FORKED, Ordering::Release);
    for fd in &CONN_FDS {
        let fd = fd.swap(-1, Ordering::Relaxed);
        if fd >= 0 {
            // SAFETY: closing a descriptor this process owns (inherited from the parent).
            unsafe { libc::close(fd) };
        }
    }
    crate::pool::close_in_child();
    crate::gate::GATE.open();
}

extern "C" {
    fn pthread_atfork(
        prepare: Option<extern "C" fn()>,
        parent: Option<extern "C" fn()>,
        child: Option<extern "C" fn()>,
    ) -> libc::c_int;
}

/// Starts the client once (at `cuInit`). `has_gpu` says whether the driver sees a GPU
/// at all. Returns the CUDA result `cuInit` should give.
pub fn on_init(has_gpu: impl FnOnce() -> Result<(), CUresult>) -> CUresult {
    loop {
        match MODE.compare_exchange(UNSTARTED, STARTING, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => break,
            Err(STARTING) => std::thread::sleep(Duration::from_millis(5)),
            Err(FAILED) => return CUDA_ERROR_SYSTEM_NOT_READY,
            Err(_) => return CUDA_SUCCESS,
        }
    }
    // SAFETY: registering a plain extern "C" handler.
    unsafe { pthread_atfork(None, None, Some(after_fork_in_child)) };
    crate::stats::register_exit_hook(|| (crate::gate::GATE.submissions(), mode_name()));
    let env = ShimEnv::from_env();
    if let Err(e) = has_gpu() {
        crate::kwarn!("no GPU to manage (CUDA error {e}); running unmanaged");
        MODE.store(UNMANAGED, Ordering::Release);
        crate::gate::GATE.open();
        return CUDA_SUCCESS;
    }
    let require = env.require_arbiter;
    let path = env.client_socket();
    match Client::start(env, &crate::gate::GATE) {
        Ok(c) => {
            let _ = CLIENT.set(c);
            MODE.store(MANAGED, Ordering::Release);
            CUDA_SUCCESS
        }
        Err(e) if require => {
            crate::kerror!(
                "the Kiwi arbiter at {} is not reachable ({e}) and KIWI_REQUIRE_ARBITER is set: failing",
                path.display()
            );
            MODE.store(FAILED, Ordering::Release);
            CUDA_ERROR_SYSTEM_NOT_READY
        }
        Err(e) => {
            crate::kwarn!(
                "WARNING: the Kiwi arbiter at {} is not reachable ({e}); this process runs UNMANAGED: \
                 no GPU sharing, no swapping. Set KIWI_REQUIRE_ARBITER=1 to fail instead.",
                path.display()
            );
            MODE.store(UNMANAGED, Ordering::Release);
            crate::gate::GATE.open();
            CUDA_SUCCESS
        }
    }
}

/// The gate was paused ([`Gate::pause`]) and a submission of this process just
/// reopened it: the process's pause ended now.
pub fn resumed() {
    let now = Instant::now();
    if let Some(c) = CLIENT.get() {
        let mut st = lock(&c.state);
        // The submission that reopened the gate is not counted yet: count it.
        let subs = c.gate.submissions().wrapping_add(1);
        c.learn_pauses(&mut st, subs, now, true);
    }
}

/// The submission slow path: waits for this process's turn(s); `device` as in
/// [`Client::acquire`].
pub fn acquire(gate: &Gate, device: Option<usize>) -> Result<(), CUresult> {
    loop {
        match MODE.load(Ordering::Acquire) {
            MANAGED => {
                return match CLIENT.get() {
                    Some(c) => c.acquire(device),
                    None => Err(CUDA_ERROR_NOT_INITIALIZED),
                }
            }
            UNMANAGED | FORKED => {
                gate.open();
                return Ok(());
            }
            STARTING => std::thread::sleep(Duration::from_millis(5)),
            FAILED => return Err(CUDA_ERROR_SYSTEM_NOT_READY),
            _ => return Err(CUDA_ERROR_NOT_INITIALIZED),
        }
    }
}
