//! The arbiter client: one connection per process to `<socket dir>/client/arbiter.sock`,
//! the process's turn on the GPU, and what happens on grant, drop, contention,
//! reclaim and revoke. A background thread reads the arbiter's messages, does the
//! swaps, releases early when the process idles while others wait, batches usage
//! reports, and reconnects when the arbiter restarts.
//!
//! Lock order: `state` → residency (the allocator's own lock) → `writer`.
//!
//! This module owns the protocol conversation and the turn state; it does not know how
//! memory is swapped ([`Residency`]) or how submissions are admitted ([`Gate`]).

use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicI32, AtomicU8, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use kiwi_protocol::blocking::Connection;
use kiwi_protocol::{
    ArbiterMsg, ClientMsg, ProtocolError, Register, Resume, SwapDirection, Usage, PROTOCOL_VERSION,
};

use crate::cuda::{
    CUresult, CUDA_ERROR_NOT_INITIALIZED, CUDA_ERROR_OUT_OF_MEMORY, CUDA_ERROR_SYSTEM_NOT_READY,
    CUDA_SUCCESS,
};
use crate::env::ShimEnv;
use crate::gate::Gate;
use crate::mem::{Figures, Swap};
use crate::stats;

type Conn = Connection<ClientMsg, ArbiterMsg>;

/// How long a swap-in waits for others' evictions to make room before giving the turn
/// back.
const MAKE_ROOM_WAIT: Duration = Duration::from_secs(15);

/// What the client needs from the allocator: residency, eviction, draining.
pub trait Residency: Send + Sync {
    fn figures(&self) -> Figures;
    fn set_limit(&self, limit: u64);
    fn set_backing_allowed(&self, allowed: bool);
    fn all_resident(&self) -> bool;
    fn swap_in_all(&self) -> Result<Swap, CUresult>;
    fn evict(&self, need: u64) -> Result<Swap, CUresult>;
    /// Waits until this process's queued GPU work is done.
    fn drain(&self) -> Result<(), CUresult>;
}

/// The GPU this process registers with.
#[derive(Debug, Clone)]
pub struct DeviceInfo {
    pub uuid: String,
    pub total_memory: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Not holding, not asking.
    Idle,
    /// Asked; waiting for a grant.
    Requested,
    /// Granted (exclusively or shared).
    Holding,
}

struct State {
    phase: Phase,
    exclusive: bool,
    /// Clients waiting behind us, as the arbiter last said.
    contended: u32,
    /// Bytes to evict when releasing early (from the contention notice).
    contended_need: u64,
    /// Threads of this process blocked waiting for the GPU.
    want: u32,
    oom_retries: u32,
    last_usage: Option<Usage>,
    idle_mark: u32,
    idle_since: Instant,
}

/// The process's connection to its arbiter.
pub struct Client {
    env: ShimEnv,
    info: DeviceInfo,
    gate: &'static Gate,
    res: Box<dyn Residency>,
    state: Mutex<State>,
    cv: Condvar,
    writer: Mutex<Option<Conn>>,
    /// GPU memory the arbiter schedules against (total − context reserve).
    capacity: std::sync::atomic::AtomicU64,
}

/// Why the client could not start.
#[derive(Debug)]
pub enum StartError {
    Protocol(ProtocolError),
    Refused(String),
}

impl std::fmt::Display for StartError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StartError::Protocol(e) => write!(f, "{e}"),
            StartError::Refused(m) => write!(f, "refused: {m}"),
        }
    }
}

impl From<ProtocolError> for StartError {
    fn from(e: ProtocolError) -> Self {
        StartError::Protocol(e)
    }
}

impl From<std::io::Error> for StartError {
    fn from(e: std::io::Error) -> Self {
        StartError::Protocol(ProtocolError::Io(e))
    }
}

/// Raw fds of the connection, closed in a forked child so the child holds nothing.
static CONN_FDS: [AtomicI32; 2] = [AtomicI32::new(-1), AtomicI32::new(-1)];

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic elsewhere must not take every later CUDA call down with it.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn usage_of(f: Figures) -> Usage {
    Usage {
        working_set_bytes: f.working_set,
        resident_bytes: f.resident,
    }
}

/// Connects and registers; returns (reader, writer, capacity).
fn register(
    env: &ShimEnv,
    info: &DeviceInfo,
    figures: Figures,
    resume: Option<Resume>,
) -> Result<(Conn, Conn, u64), StartError> {
    let stream = UnixStream::connect(env.client_socket())?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    let writer_stream = stream.try_clone()?;
    let mut conn = Conn::new(stream);
    let name = std::env::args()
        .next()
        .map(|a| a.rsplit('/').next().unwrap_or(&a).to_string());
    let pod_name = std::env::var("KIWI_POD_NAME")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok());
    conn.send(&ClientMsg::Register(Register {
        version: PROTOCOL_VERSION,
        pid: std::process::id(),
        gpu_uuid: info.uuid.clone(),
        gpu_total_memory: info.total_memory,
        working_set_bytes: figures.working_set,
        resident_bytes: figures.resident,
        container_id: std::env::var("KIWI_CONTAINER_ID").ok(),
        pod_name,
        pod_namespace: std::env::var("KIWI_POD_NAMESPACE").ok(),
        name,
        resume,
    }))?;
    let capacity = match conn.recv()? {
        ArbiterMsg::Registered {
            client_id,
            settings,
            capacity_bytes,
        } => {
            crate::kinfo!(
                "registered with the arbiter as client {client_id} (scheduler {}, TQ {} ms, capacity {capacity_bytes} bytes)",
                if settings.scheduler_on { "on" } else { "off" },
                settings.tq_ms
            );
            capacity_bytes
        }
        ArbiterMsg::Error { code, message } => {
            return Err(StartError::Refused(format!("{code:?}: {message}")))
        }
        other => return Err(StartError::Refused(format!("unexpected reply {other:?}"))),
    };
    conn.stream().set_read_timeout(None)?;
    CONN_FDS[0].store(conn.stream().as_raw_fd(), Ordering::Relaxed);
    CONN_FDS[1].store(writer_stream.as_raw_fd(), Ordering::Relaxed);
    Ok((conn, Conn::new(writer_stream), capacity))
}

impl Client {
    /// Connects to the arbiter, waiting up to `KIWI_ARBITER_TIMEOUT` (a log line every
    /// 10 s), registers, and starts the background thread.
    pub fn start(
        env: ShimEnv,
        info: DeviceInfo,
        gate: &'static Gate,
        res: Box<dyn Residency>,
    ) -> Result<Arc<Client>, StartError> {
        let started = Instant::now();
        let mut next_log = started;
        let (reader, writer, capacity) = loop {
            match register(&env, &info, res.figures(), None) {
                Ok(r) => break r,
                Err(e) => {
                    let now = Instant::now();
                    if now.duration_since(started) >= env.arbiter_timeout {
                        return Err(e);
                    }
                    if now >= next_log {
                        crate::kwarn!(
                            "waiting for the Kiwi arbiter at {} ({e}); giving up after {:?}",
                            env.client_socket().display(),
                            env.arbiter_timeout
                        );
                        next_log = now + Duration::from_secs(10);
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        };
        res.set_limit(capacity);
        res.set_backing_allowed(false);
        gate.close();
        let client = Arc::new(Client {
            env,
            info,
            gate,
            res,
            state: Mutex::new(State {
                phase: Phase::Idle,
                exclusive: false,
                contended: 0,
                contended_need: 0,
                want: 0,
                oom_retries: 0,
                last_usage: None,
                idle_mark: 0,
                idle_since: Instant::now(),
            }),
            cv: Condvar::new(),
            writer: Mutex::new(Some(writer)),
            capacity: std::sync::atomic::AtomicU64::new(capacity),
        });
        let c = client.clone();
        std::thread::Builder::new()
            .name("kiwi-arbiter".into())
            .spawn(move || c.run(reader))?;
        Ok(client)
    }

    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    pub fn capacity(&self) -> u64 {
        self.capacity.load(Ordering::Relaxed)
    }

    pub fn figures(&self) -> Figures {
        self.res.figures()
    }

    fn send(&self, msg: &ClientMsg) {
        let mut w = lock(&self.writer);
        if let Some(conn) = w.as_mut() {
            if let Err(e) = conn.send(msg) {
                crate::kdebug!("send to the arbiter failed: {e}");
                // The reader notices the broken connection and reconnects.
                let _ = conn.stream().shutdown(std::net::Shutdown::Both);
                *w = None;
            }
        }
    }

    /// Blocks until this process may submit work (the gate is open) or fails.
    pub fn acquire(&self) -> Result<(), CUresult> {
        let mut st = lock(&self.state);
        st.want += 1;
        let result = loop {
            if self.gate.is_open() {
                break Ok(());
            }
            match st.phase {
                Phase::Holding => match self.make_resident() {
                    Ok(()) => {
                        self.gate.open();
                        break Ok(());
                    }
                    Err(CUDA_ERROR_OUT_OF_MEMORY) if st.oom_retries < 3 => {
                        // Others' memory is in the way: give the turn back so the arbiter
                        // (which now knows our working set) makes room, and ask again.
                        st.oom_retries += 1;
                        crate::kwarn!("GPU memory is full while holding; releasing to make room");
                        self.give_back_locked(&mut st, 0, false);
                    }
                    Err(e) => break Err(e),
                },
                Phase::Idle => {
                    st.phase = Phase::Requested;
                    let u = usage_of(self.res.figures());
                    if st.last_usage != Some(u) {
                        self.send(&ClientMsg::Usage(u));
                        st.last_usage = Some(u);
                    }
                    self.send(&ClientMsg::Request);
                }
                Phase::Requested => {
                    st = self
                        .cv
                        .wait_timeout(st, Duration::from_secs(1))
                        .unwrap_or_else(|p| p.into_inner())
                        .0;
                }
            }
        };
        st.want -= 1;
        result
    }

    /// Swaps everything back in (reporting the swap) unless it is all resident. Out of
    /// memory is retried for a while: right after a grant the previous holder may still
    /// be evicting what the arbiter asked of it.
    fn make_resident(&self) -> Result<(), CUresult> {
        if self.res.all_resident() {
            return Ok(());
        }
        let deadline = Instant::now() + MAKE_ROOM_WAIT;
        let mut total = Swap::default();
        let s = loop {
            match self.res.swap_in_all() {
                Ok(s) => {
                    total.bytes += s.bytes;
                    total.duration += s.duration;
                    break total;
                }
                Err(CUDA_ERROR_OUT_OF_MEMORY) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => return Err(e),
            }
        };
        if s.bytes > 0 {
            stats::SWAP_IN_BYTES.fetch_add(s.bytes, Ordering::Relaxed);
            self.send(&ClientMsg::Swapped {
                direction: SwapDirection::In,
                bytes: s.bytes,
                duration_ns: s.duration.as_nanos() as u64,
            });
            crate::kinfo!("swapped in {} bytes in {:?}", s.bytes, s.duration);
        }
        Ok(())
    }

    /// Stops admitting, drains, evicts `need` bytes, releases; asks again if threads
    /// still want the GPU.
    fn give_back_locked(&self, st: &mut State, need: u64, early: bool) {
        self.gate.close_and_wait();
        if let Err(e) = self.res.drain() {
            crate::kwarn!("draining before release failed with CUDA error {e}");
        }
        self.res.set_backing_allowed(false);
        if need > 0 {
            match self.res.evict(need) {
                Ok(s) if s.bytes > 0 => {
                    stats::SWAP_OUT_BYTES.fetch_add(s.bytes, Ordering::Relaxed);
                    self.send(&ClientMsg::Swapped {
                        direction: SwapDirection::Out,
                        bytes: s.bytes,
                        duration_ns: s.duration.as_nanos() as u64,
                    });
                    crate::kinfo!("swapped out {} bytes in {:?}", s.bytes, s.duration);
                }
                Ok(_) => {}
                Err(e) => crate::kerror!("swap-out failed with CUDA error {e}"),
            }
        }
        st.phase = Phase::Idle;
        stats::RELEASES.fetch_add(1, Ordering::Relaxed);
        if early {
            stats::EARLY_RELEASES.fetch_add(1, Ordering::Relaxed);
        }
        let u = usage_of(self.res.figures());
        self.send(&ClientMsg::Release(u));
        st.last_usage = Some(u);
        if st.want > 0 {
            st.phase = Phase::Requested;
            self.send(&ClientMsg::Request);
        }
    }

    fn on_grant(&self, exclusive: bool, waiting: u32) {
        let mut st = lock(&self.state);
        stats::GRANTS.fetch_add(1, Ordering::Relaxed);
        st.phase = Phase::Holding;
        st.exclusive = exclusive;
        st.contended = waiting;
        st.idle_since = Instant::now();
        // Bound the queue before the gate opens: waiting threads queue at once.
        crate::gate::THROTTLE.store(exclusive || waiting > 0, Ordering::Relaxed);
        self.res.set_backing_allowed(true);
        match self.make_resident() {
            Ok(()) => {
                st.oom_retries = 0;
                self.gate.open();
            }
            Err(CUDA_ERROR_OUT_OF_MEMORY) if st.oom_retries < 3 => {
                st.oom_retries += 1;
                crate::kwarn!("no room to swap in after a grant; releasing and asking again");
                self.give_back_locked(&mut st, 0, false);
            }
            Err(e) => crate::kerror!("swap-in after a grant failed with CUDA error {e}"),
        }
        drop(st);
        self.cv.notify_all();
    }

    fn on_reclaim(&self, need: u64) {
        let mut st = lock(&self.state);
        if st.phase != Phase::Holding {
            let _ = self.res.drain();
            match self.res.evict(need) {
                Ok(s) if s.bytes > 0 => {
                    stats::SWAP_OUT_BYTES.fetch_add(s.bytes, Ordering::Relaxed);
                    self.send(&ClientMsg::Swapped {
                        direction: SwapDirection::Out,
                        bytes: s.bytes,
                        duration_ns: s.duration.as_nanos() as u64,
                    });
                    crate::kinfo!("reclaim: swapped out {} bytes in {:?}", s.bytes, s.duration);
                }
                Ok(_) => {}
                Err(e) => crate::kerror!("swap-out for a reclaim failed with CUDA error {e}"),
            }
        }
        let u = usage_of(self.res.figures());
        self.send(&ClientMsg::Reclaimed(u));
        st.last_usage = Some(u);
    }

    fn on_revoked(&self, reason: &str) {
        crate::kwarn!("the arbiter revoked this process's turn: {reason}");
        let mut st = lock(&self.state);
        self.gate.close_and_wait();
        let _ = self.res.drain();
        self.res.set_backing_allowed(false);
        st.phase = Phase::Idle;
        if st.want > 0 {
            st.phase = Phase::Requested;
            self.send(&ClientMsg::Request);
        }
    }

    fn handle(&self, msg: ArbiterMsg) {
        crate::kdebug!("arbiter: {msg:?}");
        match msg {
            ArbiterMsg::Grant {
                exclusive, waiting, ..
            } => self.on_grant(exclusive, waiting),
            ArbiterMsg::Drop { need_bytes, .. } => {
                let mut st = lock(&self.state);
                if st.phase == Phase::Holding {
                    self.give_back_locked(&mut st, need_bytes, false);
                } else if st.phase == Phase::Idle {
                    // Not holding and not asking: a drop that crossed our (early)
                    // release, or an arbiter that thinks we hold. Answering is harmless.
                    let u = usage_of(self.res.figures());
                    self.send(&ClientMsg::Release(u));
                }
                // Not holding but asking again: our earlier release answered the drop; a
                // second release would cancel the pending request.
            }
            ArbiterMsg::Contended {
                waiting,
                need_bytes,
            } => {
                let mut st = lock(&self.state);
                st.contended = waiting;
                st.contended_need = need_bytes;
            }
            ArbiterMsg::Reclaim { need_bytes } => self.on_reclaim(need_bytes),
            ArbiterMsg::Revoked { reason } => self.on_revoked(&reason),
            ArbiterMsg::Settings(s) => crate::kinfo!(
                "scheduler {} TQ {} ms",
                if s.scheduler_on { "on" } else { "off" },
                s.tq_ms
            ),
            ArbiterMsg::Error { code, message } => {
                crate::kwarn!("arbiter error {code:?}: {message}")
            }
            ArbiterMsg::Registered { .. } | ArbiterMsg::Pong { .. } => {}
        }
    }

    /// Periodic duties: usage reports (batched) and the early release of an idle holder.
    fn tick(&self) {
        let mut st = lock(&self.state);
        let now = Instant::now();
        let subs = self.gate.submissions();
        if subs != st.idle_mark || crate::gate::QUEUE_BOUND.syncing() {
            // A thread waiting in the queue bound is working, not idle.
            st.idle_mark = subs;
            st.idle_since = now;
        }
        if st.phase == Phase::Holding
            && st.contended > 0
            && st.want == 0
            && now.duration_since(st.idle_since) >= self.env.idle
        {
            // Idle means nothing submitted *and* the queued work done: drain (the gate
            // stays open, the app may go on) and look at how long it took. Work still
            // running restarts the idle clock from its completion.
            let t = Instant::now();
            if let Err(e) = self.res.drain() {
                crate::kwarn!("draining an idle holder failed with CUDA error {e}");
            }
            let after = self.gate.submissions();
            if t.elapsed() > Duration::from_millis(2) || after != subs {
                st.idle_mark = after;
                st.idle_since = Instant::now();
                return;
            }
            crate::kinfo!(
                "idle for {:?} while {} wait: releasing early",
                now.duration_since(st.idle_since),
                st.contended
            );
            let need = st.contended_need;
            self.give_back_locked(&mut st, need, true);
            return;
        }
        let u = usage_of(self.res.figures());
        if st.last_usage != Some(u) {
            st.last_usage = Some(u);
            self.send(&ClientMsg::Usage(u));
        }
    }

    fn run(self: Arc<Self>, mut conn: Conn) {
        let tick = (self.env.idle / 4).clamp(Duration::from_millis(1), Duration::from_millis(20));
        loop {
            match conn.recv_timeout(tick) {
                Ok(Some(msg)) => {
                    self.handle(msg);
                    // Drain whatever else arrived before ticking.
                    while let Ok(Some(m)) = conn.try_decode() {
                        self.handle(m);
                    }
                }
                Ok(None) => {}
                Err(e) => {
                    crate::kwarn!("lost the arbiter ({e}); reconnecting");
                    conn = self.reconnect();
                }
            }
            self.tick();
            self.refresh_throttle();
        }
    }

    /// Keeps the submission queue short while we hold the GPU exclusively: a drop can
    /// come at any time then, and work queued before anyone waited must drain too.
    /// (Sharing, when everything fits, is never dropped: no bound.)
    fn refresh_throttle(&self) {
        let st = lock(&self.state);
        let on = st.phase == Phase::Holding && (st.exclusive || st.contended > 0);
        crate::gate::THROTTLE.store(on, Ordering::Relaxed);
    }

    /// Reconnects with backoff (50 ms … 1 s) and re-registers with what we held.
    fn reconnect(&self) -> Conn {
        *lock(&self.writer) = None;
        let mut backoff = Duration::from_millis(50);
        loop {
            std::thread::sleep(backoff);
            backoff = (backoff * 2).min(Duration::from_secs(1));
            let resume = {
                let st = lock(&self.state);
                Resume {
                    holding: st.phase == Phase::Holding,
                    waiting: st.phase == Phase::Requested,
                }
            };
            match register(&self.env, &self.info, self.res.figures(), Some(resume)) {
                Ok((reader, writer, capacity)) => {
                    stats::RECONNECTS.fetch_add(1, Ordering::Relaxed);
                    self.capacity.store(capacity, Ordering::Relaxed);
                    self.res.set_limit(capacity);
                    let st = lock(&self.state);
                    *lock(&self.writer) = Some(writer);
                    if st.phase == Phase::Requested {
                        self.send(&ClientMsg::Request);
                    }
                    crate::kwarn!("reconnected to the arbiter (holding: {})", resume.holding);
                    return reader;
                }
                Err(e) => crate::kdebug!("reconnect failed: {e}"),
            }
        }
    }
}

// ---------------------------------------------------------------------------------
// The process-wide client and its start-up state machine.

const UNSTARTED: u8 = 0;
const STARTING: u8 = 1;
const MANAGED: u8 = 2;
const UNMANAGED: u8 = 3;
const FAILED: u8 = 4;
const FORKED: u8 = 5;

static MODE: AtomicU8 = AtomicU8::new(UNSTARTED);
static CLIENT: OnceLock<Arc<Client>> = OnceLock::new();

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
    // The child inherited the parent's connection and turn: it holds nothing and talks
    // to nobody (a data-loader worker that never touches CUDA must cost the arbiter
    // nothing). Only async-signal-safe work here.
    MODE.store(FORKED, Ordering::Release);
    for fd in &CONN_FDS {
        let fd = fd.swap(-1, Ordering::Relaxed);
        if fd >= 0 {
            // SAFETY: closing a descriptor this process owns (inherited from the parent).
            unsafe { libc::close(fd) };
        }
    }
    crate::gate::GATE.open();
}

extern "C" {
    fn pthread_atfork(
        prepare: Option<extern "C" fn()>,
        parent: Option<extern "C" fn()>,
        child: Option<extern "C" fn()>,
    ) -> libc::c_int;
}

/// Starts the client once (at `cuInit`). `setup` finds the device and builds the
/// allocator's residency. Returns the CUDA result `cuInit` should give.
pub fn on_init(
    setup: impl FnOnce() -> Result<(DeviceInfo, Box<dyn Residency>), CUresult>,
) -> CUresult {
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
    crate::stats::register_exit_hook();
    let env = ShimEnv::from_env();
    let (info, res) = match setup() {
        Ok(x) => x,
        Err(e) => {
            crate::kwarn!("no GPU to manage (CUDA error {e}); running unmanaged");
            MODE.store(UNMANAGED, Ordering::Release);
            crate::gate::GATE.open();
            return CUDA_SUCCESS;
        }
    };
    let require = env.require_arbiter;
    let path = env.client_socket();
    match Client::start(env, info, &crate::gate::GATE, res) {
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

/// The submission slow path: waits for this process's turn.
pub fn acquire(gate: &Gate) -> Result<(), CUresult> {
    loop {
        match MODE.load(Ordering::Acquire) {
            MANAGED => {
                return match CLIENT.get() {
                    Some(c) => c.acquire(),
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
