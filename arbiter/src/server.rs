//! The daemon: accepts clients on the node's client socket and on each claimed
//! container's own ([`containers`]), operators on the control socket, feeds the
//! per-GPU schedulers, runs their timers, and writes their answers.
//!
//! Latency matters on one path: a holder's release to the next holder's grant. That
//! path stays in the releasing connection's task: decode, scheduler step, and a
//! direct non-blocking write to the next holder's socket. Only a write that would
//! block is deferred to the receiving connection's own task.
//!
//! Identity comes from the socket: a client's host pid and uid are read with
//! SO_PEERCRED and a connection can only act for itself.
//!
//! The client socket is open to every tenant, so every resource a connection can
//! make the daemon hold is bounded (`docs/protocol.md`, "Limits"): descriptors
//! (client connections stop short of RLIMIT_NOFILE, leaving a reserve for the
//! control socket; at most `max_conns_per_group` per container socket, or per uid
//! on the node's socket and from the host on container sockets), time
//! (registration and each frame have deadlines), memory (one node-wide budget for
//! partly received frames) and log volume (warnings about peers are rate-limited,
//! and nothing a peer sends reaches the log unescaped).

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context as _;
use kiwi_config::SchedulerMode;
use kiwi_protocol::frame::{decode_payload, encode_into};
use kiwi_protocol::{
    ArbiterMsg, ClientMsg, ControlReply, ControlRequest, ErrorCode, FrameDecoder, ProtocolError,
    Settings, StatusReport, Usage, PROTOCOL_VERSION,
};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{watch, Notify, OwnedSemaphorePermit, Semaphore};

use crate::clock::monotonic_ns;
use crate::events::{EventLog, Tenant};
use crate::gang::{self, Gangs};
use crate::gpus;
use crate::metrics::{ArbiterMetrics, NodeSwap};
use crate::sched::{ClientId, ClientInfo, GpuScheduler, Output};
use crate::swap;

/// Runtime settings of the daemon.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub scheduler: SchedulerMode,
    /// The quantum every GPU starts with (`--tq`, `[arbiter] tq_seconds`); checked
    /// where it was read.
    pub tq: kiwi_config::Quantum,
    pub grace_ms: u64,
    /// Idle eviction (`[arbiter] idle_evict_seconds`), in ms; 0: off. See
    /// [`GpuScheduler::with_idle_evict`].
    pub idle_evict_ms: u64,
    /// Context reserve policy: explicit MiB, or the default (see `kiwi_config`).
    pub reserve_mib: Option<u64>,
    pub event_log_capacity: usize,
    /// Most simultaneous client connections; more are refused. Lowered at start to
    /// RLIMIT_NOFILE minus [`FD_RESERVE`].
    pub max_connections: usize,
    /// Most simultaneous client connections from one container (its own socket), or
    /// from one host uid on the node's socket.
    pub max_conns_per_group: usize,
    /// A connection that has not registered this long after connecting is closed.
    pub register_timeout_ms: u64,
    /// A frame that has started must be complete within this long.
    pub frame_timeout_ms: u64,
    /// Bytes of partly received frames buffered over every connection. A frame
    /// larger than [`SMALL_FRAME`] that would exceed it is refused from its header.
    pub partial_frame_budget_bytes: usize,
    /// Bound on the event log's memory, over every GPU (besides its count per GPU).
    pub event_log_max_bytes: usize,
    /// RLIMIT_NOFILE to set at start (hard and soft) when the hard limit is lower;
    /// raising it needs CAP_SYS_RESOURCE. The soft limit is raised to the hard one
    /// in any case.
    pub limit_nofile: Option<u64>,
    /// Messages per second a client may send (burst: one second's worth).
    pub max_msgs_per_sec: u32,
    /// The longest a client's swap-out may wait for its application's answer to which
    /// of its memory is dead, in ms (`--max-hint-wait-ms`): told to each client that
    /// registers with `bounds` ([`ArbiterMsg::Bounds`]), which clamps its
    /// `KIWI_HINT_WAIT_MS` to it. The next tenant waits for that answer.
    pub max_hint_wait_ms: u64,
    /// Where to serve Prometheus metrics (`None`: nowhere).
    pub metrics_addr: Option<String>,
    /// The node's host-RAM swap budget in bytes, over every GPU (`None`: unlimited).
    /// Clients are told it at registration and ask before growing their working set
    /// (see [`crate::swap`]).
    pub swap_budget_bytes: Option<u64>,
    /// Where each GPU's UUID and size come from: NVML's table, or (without NVML) the
    /// first registration of each GPU (see [`crate::gpus`]).
    pub gpus: gpus::GpuTruth,
    /// Lines about the start (where the GPUs come from) printed once every socket is
    /// bound: a start that fails says one line, its error, and nothing before it.
    pub startup_lines: Vec<String>,
    /// Each GPU's memory in use as the driver counts it (NVML), when known: a
    /// holder's `no_room` teaches the scheduler only what this confirms is taken.
    pub used_memory: Option<Arc<dyn gpus::UsedMemory>>,
    /// The socket directory, for per-container client sockets (`containers/`, see
    /// [`containers`]); `None`: only the node's socket is served.
    pub socket_dir: Option<std::path::PathBuf>,
    /// The driver's checkpoint API, when it can be used here: idle clients' whole
    /// processes may then be checkpointed to make room (see [`checkpoints`]).
    pub checkpointer: Option<Arc<dyn crate::checkpoint::Checkpointer>>,
    /// The node's swap pool (`[arbiter] swap_pool`): host memory the arbiter owns and
    /// lends to clients for their swap-outs ([`crate::pool`]); its size bounds a swap
    /// budget (the smaller of both). `None`: clients swap into their own
    /// memory.
    pub swap_pool: Option<crate::pool::PoolConfig>,
    /// The swap pool's disk tier (`--spill-dir`); needs `swap_pool`.
    pub spill: Option<crate::pool::SpillConfig>,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            scheduler: SchedulerMode::On,
            tq: kiwi_config::Quantum::default(),
            grace_ms: 5_000,
            idle_evict_ms: 30_000,
            reserve_mib: None,
            event_log_capacity: 100_000,
            max_connections: 4096,
            max_conns_per_group: 64,
            register_timeout_ms: 5_000,
            frame_timeout_ms: 5_000,
            partial_frame_budget_bytes: 64 << 20,
            event_log_max_bytes: crate::events::DEFAULT_MAX_BYTES,
            limit_nofile: None,
            max_msgs_per_sec: 20_000,
            max_hint_wait_ms: DEFAULT_MAX_HINT_WAIT_MS,
            metrics_addr: None,
            swap_budget_bytes: None,
            gpus: gpus::GpuTruth::Claims,
            startup_lines: Vec::new(),
            used_memory: None,
            socket_dir: None,
            checkpointer: None,
            swap_pool: None,
            spill: None,
        }
    }
}

/// The default of [`ServerConfig::max_hint_wait_ms`]: ten times the shim's own default
/// (10 ms), room for a provider thread that needs a core or Python's GIL on a loaded
/// host, and short beside any swap-out that moves memory (a GiB takes a few hundred
/// ms over PCIe): what one holder's hint can add to a hand-off.
pub const DEFAULT_MAX_HINT_WAIT_MS: u64 = 100;

/// Bytes a slow reader may leave unread before it is disconnected. A client's
/// messages are under 1 KiB each and it reads them as they come, so 64 KiB is far
/// more than an honest client ever leaves; at the default connection cap it bounds
/// unread replies to 256 MiB node-wide.
const MAX_PENDING_WRITE: usize = 64 << 10;
/// How often one connection's `no_room` asks NVML for its GPU's used memory; between,
/// the last answer stands.
const USED_PROBE_INTERVAL: Duration = Duration::from_millis(100);
/// Descriptors client connections never take: the control socket's connections
/// ([`MAX_CONTROL_CONNS`]), the listeners, the metrics server, the runtime's own.
pub const FD_RESERVE: usize = 64;
/// Simultaneous control connections (root's); they live in [`FD_RESERVE`].
const MAX_CONTROL_CONNS: usize = 16;
/// Frames up to this size (one read) are always buffered; larger ones need room in
/// the node's budget for partly received frames.
pub const SMALL_FRAME: usize = 16 * 1024;
/// Longest log line; longer ones are cut (a peer's text could otherwise flood it).
const MAX_LOG_LINE: usize = 2048;

/// One log line, made safe: control characters (a newline would forge a line) are
/// escaped and the line is cut to [`MAX_LOG_LINE`] bytes.
fn log_safe(line: &str) -> std::borrow::Cow<'_, str> {
    if line.len() <= MAX_LOG_LINE && !line.chars().any(kiwi_protocol::is_forbidden_char) {
        return line.into();
    }
    let mut out = String::with_capacity(line.len().min(MAX_LOG_LINE) + 32);
    for c in line.chars() {
        if out.len() >= MAX_LOG_LINE {
            out.push_str(&format!("… ({} bytes in all)", line.len()));
            break;
        }
        if kiwi_protocol::is_forbidden_char(c) {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out.into()
}

macro_rules! log_line {
    ($lvl:literal, $($arg:tt)*) => {
        eprintln!(concat!("[", $lvl, "] {}"), log_safe(&format!($($arg)*)))
    };
}

/// At most `burst` warnings per 10 s; the rest are counted and summed up in the next
/// one, so a flood of bad peers (or accept failing in a loop) cannot flood the log.
struct Throttle {
    burst: u32,
    window_start: u64,
    in_window: u32,
    suppressed: u64,
}

impl Throttle {
    const WINDOW_NS: u64 = 10_000_000_000;

    fn new(burst: u32) -> Self {
        Self {
            burst,
            window_start: 0,
            in_window: 0,
            suppressed: 0,
        }
    }

    /// `Some(note)` when a warning may be written now; the note tells how many were
    /// left out before it.
    fn allow(&mut self) -> Option<String> {
        let now = monotonic_ns();
        if now.saturating_sub(self.window_start) >= Self::WINDOW_NS {
            self.window_start = now;
            self.in_window = 0;
        }
        if self.in_window >= self.burst {
            self.suppressed += 1;
            return None;
        }
        self.in_window += 1;
        let n = std::mem::take(&mut self.suppressed);
        Some(if n == 0 {
            String::new()
        } else {
            format!(" ({n} similar warnings suppressed)")
        })
    }
}

/// Warns through a shared [`Throttle`].
macro_rules! warn_throttled {
    ($throttle:expr, $($arg:tt)*) => {
        let allowed = $throttle.lock().unwrap_or_else(|e| e.into_inner()).allow();
        if let Some(note) = allowed {
            log_line!("WARN", "{}{note}", format_args!($($arg)*));
        }
    };
}

/// How long a connection closed for its unread replies waits for the client to read
/// the error that says why (its socket is full).
const UNREAD_LINGER: Duration = Duration::from_secs(1);

/// Why a client connection ended: each one the arbiter closes is logged (throttled)
/// with what the client was told, counted in `kiwi_client_disconnects_total{reason}`,
/// and told to the client where a message can still reach it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Closed {
    /// The client closed it, or its process ended: not the arbiter's doing.
    ByClient,
    /// A frame or message that does not decode, or a control request.
    Malformed,
    /// Past the message rate.
    RateLimited,
    /// A frame that does not fit in what is left of the node's budget for partly
    /// received frames.
    FrameBudget,
    /// No registration within its time.
    NotRegistered,
    /// A frame not completed within its time.
    FrameTimeout,
    /// Replies unread past the cap ([`MAX_PENDING_WRITE`]).
    UnreadReplies,
    /// Writing to it failed.
    WriteFailed,
    /// A message refused (a registration for another GPU, a wrong version, …).
    Refused,
    /// The daemon stops, or the container socket it came on was detached.
    Shutdown,
}

impl Closed {
    /// The metric's label.
    fn label(self) -> &'static str {
        match self {
            Closed::ByClient => "client",
            Closed::Malformed => "malformed",
            Closed::RateLimited => "rate_limited",
            Closed::FrameBudget => "frame_budget",
            Closed::NotRegistered => "not_registered",
            Closed::FrameTimeout => "frame_timeout",
            Closed::UnreadReplies => "unread_replies",
            Closed::WriteFailed => "write_failed",
            Closed::Refused => "refused",
            Closed::Shutdown => "shutdown",
        }
    }
}

/// The writing half of a client connection, shared with other tasks that must
/// send to it (a release in one connection grants in another).
struct Peer {
    stream: Arc<UnixStream>,
    pending: Mutex<Outbox>,
    flush: Notify,
    closing: AtomicBool,
    /// The connection closes because its unread replies passed the cap.
    unread: AtomicBool,
    /// The last error it was sent (`code: message`), for the line that says why its
    /// connection closed.
    told: Mutex<Option<String>>,
}

/// The messages that say a state (`pressure`, `room`, `waiting`, `contended`): a
/// newer one makes an unsent older one of its kind pointless.
const STATE_KINDS: usize = 4;

fn state_kind(msg: &ArbiterMsg) -> Option<usize> {
    match msg {
        ArbiterMsg::Pressure { .. } => Some(0),
        ArbiterMsg::Room { .. } => Some(1),
        ArbiterMsg::Waiting { .. } => Some(2),
        ArbiterMsg::Contended { .. } => Some(3),
        _ => None,
    }
}

/// What a peer has not read yet: bytes in order, and, while the socket is full, the
/// latest unsent message of each state kind (a holder's `contended` follows every
/// usage report of a waiter, so it can storm too). A slow reader is sent the latest state,
/// never a backlog of states (so it is never disconnected for them); the bytes are
/// bounded by [`MAX_PENDING_WRITE`]. A message that is not a state moves the states
/// waiting before it into the bytes first, so the order a client sees is the order
/// sent (a `ping`'s `pong` follows the `room` due before it).
#[derive(Default)]
struct Outbox {
    bytes: Vec<u8>,
    latest: [Option<Vec<u8>>; STATE_KINDS],
}

impl Outbox {
    fn is_empty(&self) -> bool {
        self.bytes.is_empty() && self.latest.iter().all(Option::is_none)
    }

    /// Moves the waiting states into the byte queue, in kind order.
    fn settle_states(&mut self) {
        for slot in &mut self.latest {
            if let Some(b) = slot.take() {
                self.bytes.extend_from_slice(&b);
            }
        }
    }
}

impl Peer {
    fn new(stream: Arc<UnixStream>) -> Self {
        Self {
            stream,
            pending: Mutex::new(Outbox::default()),
            flush: Notify::new(),
            closing: AtomicBool::new(false),
            unread: AtomicBool::new(false),
            told: Mutex::new(None),
        }
    }

    /// Writes now if the socket takes it; otherwise queues for the owner task. `kind`:
    /// the message's state kind, if it is one.
    fn send_bytes(&self, bytes: &[u8], kind: Option<usize>) {
        let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        let mut rest = bytes;
        if pending.is_empty() {
            while !rest.is_empty() {
                match self.stream.try_write(rest) {
                    Ok(n) => rest = &rest[n..],
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    Err(_) => {
                        self.closing.store(true, Ordering::Relaxed);
                        self.flush.notify_one();
                        return;
                    }
                }
            }
        }
        if rest.is_empty() {
            return;
        }
        match kind {
            // Whole and a state: it replaces the older one of its kind.
            Some(k) if rest.len() == bytes.len() => pending.latest[k] = Some(rest.to_vec()),
            _ => {
                pending.settle_states();
                if pending.bytes.len() + rest.len() > MAX_PENDING_WRITE {
                    // A client that never reads must not grow our memory.
                    self.unread.store(true, Ordering::Relaxed);
                    self.closing.store(true, Ordering::Relaxed);
                } else {
                    pending.bytes.extend_from_slice(rest);
                }
            }
        }
        self.flush.notify_one();
    }

    fn send(&self, msg: &ArbiterMsg) {
        if let ArbiterMsg::Error { code, message } = msg {
            *self.told.lock().unwrap_or_else(|e| e.into_inner()) =
                Some(format!("{code:?}: {message}"));
        }
        let mut buf = Vec::with_capacity(96);
        if encode_into(msg, &mut buf).is_ok() {
            self.send_bytes(&buf, state_kind(msg));
        }
    }

    /// The last message of a connection closed for its unread replies, in place of
    /// the backlog it did not read (lost with the connection anyway): it follows what
    /// the socket already holds, once the client reads.
    fn replace_with_last(&self, msg: &ArbiterMsg) {
        if let ArbiterMsg::Error { code, message } = msg {
            *self.told.lock().unwrap_or_else(|e| e.into_inner()) =
                Some(format!("{code:?}: {message}"));
        }
        let mut p = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        *p = Outbox::default();
        let _ = encode_into(msg, &mut p.bytes);
    }

    fn has_pending(&self) -> bool {
        !self
            .pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_empty()
    }

    /// Writes as much of the queue as the socket takes now, without waiting
    /// (a client that never reads must not stall its own connection task).
    fn try_flush(&self) -> std::io::Result<()> {
        let mut p = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if p.bytes.is_empty() {
                // The bytes are out: the latest states follow.
                p.settle_states();
                if p.bytes.is_empty() {
                    break;
                }
            }
            match self.stream.try_write(&p.bytes) {
                Ok(n) => {
                    p.bytes.drain(..n);
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

// After the logging macros, which it uses.
mod checkpoints;
mod containers;
mod pool;

struct ClientConn {
    peer: Arc<Peer>,
    gpu: Option<String>,
    /// Its connection's cap group: whose share of the event log its events take
    /// ([`crate::events`]).
    tenant: Tenant,
    /// The connecting process (host pid, start time), read when it connected: the
    /// only process a checkpoint of this client may touch ([`checkpoints`]).
    process: Option<(u32, u64)>,
}

struct Gpu {
    index: u32,
    sched: GpuScheduler,
}

/// Everything the daemon knows, behind one mutex: steps are microseconds long.
struct State {
    cfg: ServerConfig,
    defaults: Settings,
    gpus: BTreeMap<String, Gpu>,
    clients: HashMap<ClientId, ClientConn>,
    events: EventLog,
    metrics: ArbiterMetrics,
    next_client: ClientId,
    /// End of the post-restart window: claims to hold a GPU are believed until then.
    resume_until: u64,
    /// Checkpoints and restores the schedulers asked for, to the task that runs them.
    checkpoint_jobs: Option<tokio::sync::mpsc::UnboundedSender<checkpoints::Job>>,
    /// Groups of clients granted their GPUs together ([`crate::gang`]), moved on
    /// after every scheduler step ([`State::dispatch_leaving`]); `settling` while it
    /// moves them (its own outputs do not move them again).
    gangs: Gangs,
    settling: bool,
}

impl gang::Scheds for BTreeMap<String, Gpu> {
    fn sched(&mut self, gpu: &str) -> Option<&mut GpuScheduler> {
        self.get_mut(gpu).map(|g| &mut g.sched)
    }
}

impl gpus::Entries for BTreeMap<String, Gpu> {
    fn entry(&self, uuid: &str) -> Option<(u32, u64)> {
        self.get(uuid).map(|g| (g.index, g.sched.total()))
    }
    fn count(&self) -> usize {
        self.len()
    }
    fn index_used(&self, index: u32) -> bool {
        self.values().any(|g| g.index == index)
    }
}

impl State {
    /// What client `id`'s tenant may see of GPU `uuid` ([`ArbiterMsg::View`]): its
    /// own clients there, none of another tenant's.
    fn view(&self, id: ClientId, uuid: String) -> ArbiterMsg {
        let Some(tenant) = self.clients.get(&id).map(|c| c.tenant.clone()) else {
            return ArbiterMsg::Error {
                code: ErrorCode::NotRegistered,
                message: "this connection is closing".into(),
            };
        };
        let host = tenant.starts_with("uid ");
        let Some(g) = self.gpus.get(&uuid) else {
            return ArbiterMsg::View {
                gpu_uuid: uuid,
                known: false,
                unswappable_bytes: 0,
                processes: Vec::new(),
                host,
            };
        };
        let (unswappable_bytes, processes) = g
            .sched
            .view(|other| self.clients.get(&other).is_some_and(|c| c.tenant == tenant));
        ArbiterMsg::View {
            gpu_uuid: uuid,
            known: true,
            unswappable_bytes,
            processes,
            host,
        }
    }

    /// Checks a registration's GPU against what the arbiter knows ([`gpus`]) and
    /// creates its entry if it is the GPU's first client.
    fn admit_gpu(&mut self, now: u64, uuid: &str, claimed: u64) -> Result<(), gpus::Refusal> {
        let reserve_for = |total: u64| {
            kiwi_config::context_reserve_bytes(
                &kiwi_config::ArbiterConfig {
                    reserve_mib: self.cfg.reserve_mib,
                    ..Default::default()
                },
                total,
            )
        };
        match self.cfg.gpus.check(&self.gpus, uuid, claimed)? {
            gpus::Admit::Join { raise_to: None } => {}
            gpus::Admit::Join {
                raise_to: Some(total),
            } => {
                let capacity = total - reserve_for(total);
                let outs = self
                    .gpus
                    .get_mut(uuid)
                    .map(|g| g.sched.raise_total(now, total, capacity))
                    .unwrap_or_default();
                self.dispatch(uuid, outs);
                log_line!(
                    "INFO",
                    "GPU {uuid}: {} MiB, as a later client reported",
                    total >> 20
                );
            }
            gpus::Admit::Create { index, total } => {
                let reserve = reserve_for(total);
                let sched =
                    GpuScheduler::new(total, total - reserve, self.defaults, self.cfg.grace_ms)
                        .with_swap_budget(self.cfg.swap_budget_bytes)
                        .with_idle_evict(self.cfg.idle_evict_ms)
                        .with_resume_window(self.resume_until)
                        .with_checkpoint(self.checkpoint_jobs.is_some());
                log_line!(
                    "INFO",
                    "new GPU {uuid} (index {index}): {} MiB, {} MiB schedulable",
                    total >> 20,
                    (total - reserve) >> 20
                );
                self.gpus.insert(uuid.to_string(), Gpu { index, sched });
            }
        }
        Ok(())
    }

    /// Drops `uuid`'s entry once its last client left, unless the GPUs come from
    /// NVML: made-up GPUs must not pile up, and a GPU's size is asked again.
    fn forget_gpu_if_unused(&mut self, uuid: &str) {
        if self.cfg.gpus.keeps_empty_entries() {
            return;
        }
        if self.gpus.get(uuid).is_some_and(|g| g.sched.is_empty()) {
            self.gpus.remove(uuid);
            self.metrics.forget_gpu(uuid);
            log_line!("INFO", "GPU {uuid} has no clients left; forgotten");
        }
    }

    /// Applies scheduler outputs: messages to peers, events to the log.
    fn dispatch(&mut self, gpu: &str, outs: Vec<Output>) {
        self.dispatch_leaving(gpu, outs, None)
    }

    /// [`State::dispatch`] for the outputs of a client's exit: `leaving` is that
    /// client, no longer in `clients`, and its tenant.
    fn dispatch_leaving(
        &mut self,
        gpu: &str,
        outs: Vec<Output>,
        leaving: Option<(ClientId, &Tenant)>,
    ) {
        let now = monotonic_ns();
        // Messages first: a waiting client's grant must not wait for bookkeeping.
        for o in &outs {
            if let Output::Send(id, msg) = o {
                if let Some(c) = self.clients.get(id) {
                    c.peer.send(msg);
                }
            }
        }
        for o in outs {
            match o {
                Output::Log(id, kind) => {
                    self.metrics.observe(now, gpu, id, &kind);
                    let tenant = id.and_then(|id| match leaving {
                        Some((l, t)) if l == id => Some(t),
                        _ => self.clients.get(&id).map(|c| &c.tenant),
                    });
                    self.events.push(now, gpu, id, tenant, kind);
                }
                Output::Checkpoint { id, pid } | Output::Restore { id, pid } => {
                    let restore = matches!(o, Output::Restore { .. });
                    if let Some(tx) = &self.checkpoint_jobs {
                        let _ = tx.send(checkpoints::Job {
                            gpu: gpu.to_string(),
                            id,
                            pid,
                            restore,
                        });
                    }
                }
                Output::Send(..) => {}
            }
        }
        // Any step may move a group's turn on (a release ends it, a request claims).
        if !self.settling {
            self.settling = true;
            let outs = self.gangs.step(&mut self.gpus, now);
            for (u, o) in outs {
                self.dispatch(&u, o);
            }
            self.settling = false;
        }
    }

    /// Puts client `id` (registered on `gpu`) in group `key` and dispatches what that
    /// changes.
    fn join_group(&mut self, now: u64, id: ClientId, key: &str, gpu: &str) {
        let (joined, outs) = self.gangs.join(&mut self.gpus, now, id, key, gpu);
        if !joined {
            log_line!(
                "WARN",
                "client {id}: the node keeps {} groups already; granted on its own",
                gang::MAX_GROUPS
            );
        }
        for (u, o) in outs {
            self.dispatch(&u, o);
        }
    }

    fn resolve_gpu(&self, sel: &str) -> Option<String> {
        if self.gpus.contains_key(sel) {
            return Some(sel.to_string());
        }
        let idx: u32 = sel.parse().ok()?;
        self.gpus
            .iter()
            .find(|(_, g)| g.index == idx)
            .map(|(u, _)| u.clone())
    }

    fn gpu_statuses(&self, now: u64) -> Vec<kiwi_protocol::GpuStatus> {
        self.gpus
            .keys()
            .filter_map(|u| self.gpu_status(now, u))
            .collect()
    }

    /// GPU `uuid`'s status: its scheduler's, with the groups of its clients and of
    /// its turn.
    fn gpu_status(&self, now: u64, uuid: &str) -> Option<kiwi_protocol::GpuStatus> {
        let g = self.gpus.get(uuid)?;
        let mut s = g.sched.status(now, g.index, uuid);
        for c in &mut s.clients {
            c.group = self.gangs.ganged_key(c.id).map(str::to_string);
        }
        s.group_turn =
            self.gangs
                .reserved_for(uuid)
                .map(|(group, running)| kiwi_protocol::GroupTurn {
                    group: group.to_string(),
                    running,
                });
        Some(s)
    }

    /// The node's swap figures for status and metrics.
    fn node_swap(&self) -> NodeSwap {
        let scheds = || self.gpus.values().map(|g| &g.sched);
        NodeSwap {
            budget_bytes: self.cfg.swap_budget_bytes,
            need_bytes: swap::node_swap_need(scheds()),
            in_use_bytes: swap::node_swapped_bytes(scheds()),
            pool: None,
        }
    }

    fn next_deadline(&self) -> Option<u64> {
        self.gpus
            .values()
            .filter_map(|g| g.sched.next_deadline())
            .min()
    }
}

struct Shared {
    state: Mutex<State>,
    /// Wakes the timer task when a deadline may have moved.
    timer: Notify,
    /// Open client connections per peer group (see [`peer_group`]).
    groups: Mutex<HashMap<String, usize>>,
    /// Bytes of partly received frames, over every client connection.
    partial: FrameBudget,
    /// Warnings about peers (bad frames, limits), over every connection.
    warn: Mutex<Throttle>,
    limits: Limits,
    /// Places under the node's connection cap; each container socket holds one.
    conn_limit: Arc<Semaphore>,
    conn_limit_total: usize,
    /// The daemon's stop signal, for listeners started later (container sockets).
    stop: watch::Receiver<bool>,
    /// The container sockets being served, by key.
    containers: Mutex<HashMap<String, containers::Served>>,
    /// The node's swap pool, when configured.
    pool: Option<Arc<crate::pool::Pool>>,
    /// What each process borrows from the pool, for the disk tier ([`pool::Book`]).
    pool_book: pool::Book,
}

/// The per-connection limits, fixed at start.
#[derive(Debug, Clone, Copy)]
struct Limits {
    max_conns_per_group: usize,
    register_timeout: Duration,
    frame_timeout: Duration,
}

/// The node-wide budget for partly received frames. A connection is charged for the
/// whole frame it is in the middle of, from its header on, so a refusal comes before
/// the payload is buffered.
struct FrameBudget {
    used: AtomicUsize,
    limit: usize,
}

impl FrameBudget {
    /// Sets a connection's charge (`charged`) to `want` bytes. `false`: `want` is a
    /// large frame the budget has no room for; the charge is unchanged.
    fn charge(&self, charged: &mut usize, want: usize) -> bool {
        if want <= *charged {
            self.used.fetch_sub(*charged - want, Ordering::Relaxed);
            *charged = want;
            return true;
        }
        let extra = want - *charged;
        let ok = self
            .used
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |used| {
                (want <= SMALL_FRAME || used + extra <= self.limit).then_some(used + extra)
            })
            .is_ok();
        if ok {
            *charged = want;
        }
        ok
    }
}

/// A client connection's place under the connection caps; given back on drop.
struct ConnSlot {
    shared: Arc<Shared>,
    group: String,
    _permit: OwnedSemaphorePermit,
}

impl ConnSlot {
    /// Takes a place in `group`; `None` when the group is at its cap.
    fn take(shared: &Arc<Shared>, group: String, permit: OwnedSemaphorePermit) -> Option<Self> {
        let mut groups = shared.groups.lock().unwrap_or_else(|e| e.into_inner());
        let n = groups.entry(group.clone()).or_insert(0);
        if *n >= shared.limits.max_conns_per_group {
            return None;
        }
        *n += 1;
        Some(Self {
            shared: shared.clone(),
            group,
            _permit: permit,
        })
    }
}

impl Drop for ConnSlot {
    fn drop(&mut self) {
        let mut groups = self.shared.groups.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = groups.get_mut(&self.group) {
            *n -= 1;
            if *n == 0 {
                groups.remove(&self.group);
            }
        }
    }
}

/// Raises RLIMIT_NOFILE: both limits to `want` if the hard limit is below it (this
/// needs CAP_SYS_RESOURCE; a refusal is logged), then the soft limit to the hard
/// one. Returns the soft limit now.
pub fn raise_fd_limit(want: Option<u64>) -> std::io::Result<u64> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the struct we own.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    if let Some(want) = want.filter(|&w| w > lim.rlim_max) {
        let raised = libc::rlimit {
            rlim_cur: want as libc::rlim_t,
            rlim_max: want as libc::rlim_t,
        };
        // SAFETY: setrlimit reads the struct we own.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            lim = raised;
        } else {
            log_line!(
                "WARN",
                "cannot raise RLIMIT_NOFILE to {want} ({}; it needs CAP_SYS_RESOURCE); staying at {}",
                std::io::Error::last_os_error(),
                lim.rlim_max
            );
        }
    }
    if lim.rlim_cur < lim.rlim_max {
        let want = libc::rlimit {
            rlim_cur: lim.rlim_max,
            rlim_max: lim.rlim_max,
        };
        // SAFETY: setrlimit reads the struct we own; raising soft up to hard needs no
        // privilege.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &want) } == 0 {
            lim.rlim_cur = lim.rlim_max;
        }
    }
    Ok(lim.rlim_cur)
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Serves until `shutdown` resolves. The caller binds the listeners (so tests can
/// inject them) and removes the socket files afterwards.
pub async fn serve(
    mut cfg: ServerConfig,
    client_listener: UnixListener,
    control_listener: UnixListener,
    metrics_listener: Option<tokio::net::TcpListener>,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    let defaults = Settings {
        scheduler_on: cfg.scheduler.is_on(),
        tq_ms: cfg.tq.as_millis(),
    };
    // Client connections stop FD_RESERVE short of the descriptor limit, so the
    // control socket always has room.
    let nofile = match raise_fd_limit(cfg.limit_nofile) {
        Ok(n) => n,
        Err(e) => {
            log_line!("WARN", "cannot read RLIMIT_NOFILE ({e}); assuming 1024");
            1024
        }
    };
    let fd_room = usize::try_from(nofile)
        .unwrap_or(usize::MAX)
        .saturating_sub(FD_RESERVE)
        .max(1);
    let max_connections = cfg.max_connections.min(fd_room).max(1);
    let limits = Limits {
        max_conns_per_group: cfg.max_conns_per_group.max(1),
        register_timeout: Duration::from_millis(cfg.register_timeout_ms.max(1)),
        frame_timeout: Duration::from_millis(cfg.frame_timeout_ms.max(1)),
    };
    log_line!(
        "INFO",
        "limits: {max_connections} client connections (RLIMIT_NOFILE {nofile}, {FD_RESERVE} descriptors kept for the control socket and the daemon; configured {}), {} per container, registration within {} ms, each frame within {} ms, {} MiB for partly received frames, event log {} MiB, a swap-out's wait for its hints at most {} ms",
        cfg.max_connections,
        limits.max_conns_per_group,
        cfg.register_timeout_ms,
        cfg.frame_timeout_ms,
        cfg.partial_frame_budget_bytes >> 20,
        cfg.event_log_max_bytes >> 20,
        cfg.max_hint_wait_ms
    );
    let pool = match cfg.swap_pool {
        Some(p) => {
            let pool = crate::pool::Pool::start(p).context("cannot start the node's swap pool")?;
            let s = pool.stats();
            cfg.swap_budget_bytes = cfg.swap_budget_bytes.map(|b| b.min(s.size));
            log_line!(
                "INFO",
                "swap pool: {} MiB of host memory lent to clients for their swap-outs ({} pages, {} MiB populated at start), swap budget {}",
                s.size >> 20,
                s.page_mode,
                s.floor >> 20,
                cfg.swap_budget_bytes
                    .map_or("none".to_string(), |b| format!("{} MiB", b >> 20))
            );
            if let Some(spill) = cfg.spill.clone() {
                let dir = spill.dir.display().to_string();
                let budget = spill
                    .budget
                    .map_or("the disk's free space".to_string(), |b| {
                        format!("{} MiB", b >> 20)
                    });
                match pool.enable_spill(spill) {
                    Ok(()) => log_line!(
                        "INFO",
                        "swap pool disk tier: {dir} (at most {budget}): the swapped-out memory of the processes idle longest moves there when the pool runs short"
                    ),
                    // The node's GPUs work without it: spills are refused, with the
                    // reason, until the directory is usable.
                    Err(e) => log_line!(
                        "WARN",
                        "swap pool disk tier {dir} is unusable now ({e}); spills are refused until it is"
                    ),
                }
            }
            Some(pool)
        }
        None => None,
    };
    let (stop_tx, stop_rx) = watch::channel(false);
    let limit = Arc::new(Semaphore::new(max_connections));
    let (checkpoint_tx, checkpoint_rx) = match &cfg.checkpointer {
        Some(_) => {
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            (Some(tx), Some(rx))
        }
        None => (None, None),
    };
    let shared = Arc::new(Shared {
        conn_limit: limit.clone(),
        conn_limit_total: max_connections,
        stop: stop_rx.clone(),
        containers: Mutex::new(HashMap::new()),
        pool: pool.clone(),
        pool_book: pool::Book::default(),
        groups: Mutex::new(HashMap::new()),
        partial: FrameBudget {
            used: AtomicUsize::new(0),
            limit: cfg.partial_frame_budget_bytes,
        },
        warn: Mutex::new(Throttle::new(20)),
        limits,
        state: Mutex::new(State {
            events: EventLog::with_max_bytes(cfg.event_log_capacity, cfg.event_log_max_bytes),
            metrics: ArbiterMetrics::new(),
            cfg: cfg.clone(),
            defaults,
            gpus: BTreeMap::new(),
            clients: HashMap::new(),
            next_client: 1,
            resume_until: monotonic_ns() + crate::sched::RESUME_CLAIM_WINDOW_NS,
            checkpoint_jobs: checkpoint_tx,
            gangs: Gangs::default(),
            settling: false,
        }),
        timer: Notify::new(),
    });
    containers::serve_recorded(&shared);

    let timer = tokio::spawn(run_timers(shared.clone(), stop_rx.clone()));
    let reconcile = cfg
        .used_memory
        .clone()
        .map(|used| tokio::spawn(run_reconcile(shared.clone(), used, stop_rx.clone())));
    let evictions = match (cfg.checkpointer.clone(), checkpoint_rx) {
        (Some(c), Some(rx)) => Some(tokio::spawn(checkpoints::run(
            shared.clone(),
            c,
            rx,
            stop_rx.clone(),
        ))),
        _ => None,
    };
    let pool_wanted = pool
        .clone()
        .map(|p| tokio::spawn(pool::run_wanted(shared.clone(), p, stop_rx.clone())));
    let clients = tokio::spawn(accept_clients(
        shared.clone(),
        client_listener,
        Origin::Node,
        None,
    ));
    let control = tokio::spawn(accept_control(
        shared.clone(),
        control_listener,
        stop_rx.clone(),
    ));
    let metrics = metrics_listener.map(|l| {
        let s = shared.clone();
        let render: kiwi_metrics::Render = Arc::new(move || {
            let pool = s.pool.as_ref().map(|p| {
                let p = p.stats();
                crate::metrics::PoolFigures {
                    size: p.size,
                    populated: p.populated,
                    ready: p.ready,
                    lent: p.lent,
                    scrubbing: p.scrubbing,
                    spilled: p.spilled,
                }
            });
            let st = s.lock();
            let mut swap = st.node_swap();
            swap.pool = pool;
            st.metrics.render(&st.gpu_statuses(monotonic_ns()), &swap)
        });
        let mut stop = stop_rx.clone();
        tokio::spawn(kiwi_metrics::serve(l, render, async move {
            let _ = stop.changed().await;
        }))
    });

    shutdown.await;
    log_line!("INFO", "shutting down");
    let _ = stop_tx.send(true);
    let _ = tokio::join!(timer, clients, control);
    if let Some(r) = reconcile {
        let _ = r.await;
    }
    if let Some(e) = evictions {
        let _ = e.await;
    }
    containers::stop_all(&shared).await;
    if let Some(m) = metrics {
        let _ = m.await;
    }
    if let Some(w) = pool_wanted {
        let _ = w.await;
    }
    if let Some(p) = pool {
        p.shutdown();
    }
    Ok(())
}

/// Sleeps until `deadline`; forever without one.
async fn sleep_until(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending::<()>().await,
    }
}

async fn run_timers(shared: Arc<Shared>, mut stop: watch::Receiver<bool>) {
    loop {
        let wait = {
            let st = shared.lock();
            st.next_deadline()
                .map(|d| Duration::from_nanos(d.saturating_sub(monotonic_ns())))
        };
        let sleep = async {
            match wait {
                Some(d) => tokio::time::sleep(d).await,
                None => std::future::pending::<()>().await,
            }
        };
        tokio::select! {
            _ = sleep => {
                let mut st = shared.lock();
                let now = monotonic_ns();
                let uuids: Vec<String> = st
                    .gpus
                    .iter()
                    .filter(|(_, g)| g.sched.next_deadline().is_some_and(|d| d <= now))
                    .map(|(u, _)| u.clone())
                    .collect();
                for u in uuids {
                    let outs = st.gpus.get_mut(&u).map(|g| g.sched.tick(now)).unwrap_or_default();
                    st.dispatch(&u, outs);
                }
            }
            _ = shared.timer.notified() => {}
            _ = stop.changed() => return,
        }
    }
}

/// Gives each GPU's scheduler the driver's per-process figures every
/// [`crate::sched::RECONCILE_INTERVAL_NS`] ([`GpuScheduler::reconcile`]): NVML is
/// asked outside the state lock, on a blocking thread, so a slow NVML holds up
/// nobody. Every GPU NVML knows is asked, and one with processes but no entry yet
/// gets one, as at its first client's registration: a process outside Kiwi is then
/// counted before the first client arrives, and that client told the truth.
async fn run_reconcile(
    shared: Arc<Shared>,
    used: Arc<dyn gpus::UsedMemory>,
    mut stop: watch::Receiver<bool>,
) {
    let every = Duration::from_nanos(crate::sched::RECONCILE_INTERVAL_NS);
    loop {
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = stop.changed() => return,
        }
        let uuids: Vec<String> = {
            let st = shared.lock();
            let known = match &st.cfg.gpus {
                gpus::GpuTruth::Nvml(known) => known.iter().map(|k| k.uuid.clone()).collect(),
                gpus::GpuTruth::Claims => Vec::new(),
            };
            let mut uuids: Vec<String> = st.gpus.keys().cloned().chain(known).collect();
            uuids.sort();
            uuids.dedup();
            uuids
        };
        if uuids.is_empty() {
            continue;
        }
        let used = used.clone();
        let Ok(figures) = tokio::task::spawn_blocking(move || {
            uuids
                .into_iter()
                .filter_map(|u| used.process_bytes(&u).map(|p| (u, p)))
                .collect::<Vec<_>>()
        })
        .await
        else {
            continue;
        };
        let mut st = shared.lock();
        let now = monotonic_ns();
        for (u, procs) in figures {
            if !st.gpus.contains_key(&u) && !procs.is_empty() {
                let total = match &st.cfg.gpus {
                    gpus::GpuTruth::Nvml(known) => {
                        known.iter().find(|k| k.uuid == u).map(|k| k.total_bytes)
                    }
                    gpus::GpuTruth::Claims => None,
                };
                if let Some(total) = total {
                    let _ = st.admit_gpu(now, &u, total);
                }
            }
            let outs = st
                .gpus
                .get_mut(&u)
                .map(|g| g.sched.reconcile(now, &procs))
                .unwrap_or_default();
            st.dispatch(&u, outs);
        }
        drop(st);
        shared.timer.notify_one();
    }
}

/// Where a client connection came from, which decides what it may do: the node's
/// socket (host processes; capped per uid), or one container's (capped per socket,
/// speaking for that container only, on the GPUs it claimed; root from the host is
/// capped as on the node's socket).
#[derive(Clone)]
enum Origin {
    Node,
    Container(Arc<containers::Served>),
}

impl Origin {
    /// The connection-cap group of a peer: its container, or its uid as the initial
    /// user namespace sees it (SO_PEERCRED translates it, so user namespaces do not
    /// multiply a host user's share) on the node's socket and for a host process on
    /// a container's: a uid's share is one, over every socket.
    fn group(&self, cred: Option<tokio::net::unix::UCred>) -> String {
        let uid = || format!("uid {}", cred.map_or(u32::MAX, |c| c.uid()));
        match self {
            Origin::Node => uid(),
            Origin::Container(c) if c.host_peer(cred).is_some() => uid(),
            Origin::Container(c) => format!("container {}", c.key),
        }
    }
}

async fn accept_clients(
    shared: Arc<Shared>,
    listener: UnixListener,
    origin: Origin,
    mut own_stop: Option<watch::Receiver<bool>>,
) {
    let mut stop = shared.stop.clone();
    let limit = shared.conn_limit.clone();
    let mut tasks = tokio::task::JoinSet::new();
    let mut backoff = Duration::from_millis(1);
    let cap = shared.conn_limit_total;
    let accept_errors = Mutex::new(Throttle::new(1));
    loop {
        tokio::select! {
            res = listener.accept() => match res {
                Ok((stream, _)) => {
                    backoff = Duration::from_millis(1);
                    let Ok(permit) = limit.clone().try_acquire_owned() else {
                        warn_throttled!(shared.warn, "{cap} client connections open, the limit; refusing a client");
                        refuse(stream, ErrorCode::RateLimited, "too many connections to the arbiter").await;
                        continue;
                    };
                    let cred = stream.peer_cred().ok();
                    if let Origin::Container(c) = &origin {
                        if let Err(why) = c.admits(cred) {
                            warn_throttled!(shared.warn, "container {}'s socket: refusing pid {}: {why}", c.key, cred.and_then(|c| c.pid()).unwrap_or(0));
                            refuse(stream, ErrorCode::WrongSocket, &why).await;
                            continue;
                        }
                    }
                    let group = origin.group(cred);
                    let Some(slot) = ConnSlot::take(&shared, group.clone(), permit) else {
                        let per = shared.limits.max_conns_per_group;
                        warn_throttled!(shared.warn, "{per} connections open from {group}, its limit; refusing pid {}", cred.and_then(|c| c.pid()).unwrap_or(0));
                        let whose = if group.starts_with("uid") { "user" } else { "container" };
                        refuse(stream, ErrorCode::RateLimited, &format!("too many connections from this {whose} (limit {per})")).await;
                        continue;
                    };
                    let shared = shared.clone();
                    let stop = stop.clone();
                    let origin = origin.clone();
                    tasks.spawn(async move {
                        client_connection(shared, stream, cred, origin, stop).await;
                        drop(slot);
                    });
                }
                Err(e) => {
                    // EMFILE and friends: back off instead of spinning, and say so
                    // once in a while rather than on every try.
                    warn_throttled!(accept_errors, "accept failed: {e}; retrying in up to 1 s");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(1));
                }
            },
            Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
            _ = stop.changed() => break,
            _ = async {
                match own_stop.as_mut() {
                    Some(r) => { let _ = r.changed().await; }
                    None => std::future::pending::<()>().await,
                }
            } => {
                // A detached container: no new connections; those open stay until
                // their processes leave.
                drop(listener);
                while let Some(r) = tokio::select! {
                    r = tasks.join_next() => r,
                    _ = stop.changed() => None,
                } {
                    let _ = r;
                }
                break;
            }
        }
    }
    tasks.shutdown().await;
}

async fn refuse(stream: UnixStream, code: ErrorCode, message: &str) {
    let mut buf = Vec::new();
    let msg = ArbiterMsg::Error {
        code,
        message: message.to_string(),
    };
    if encode_into(&msg, &mut buf).is_ok() {
        let _ = stream.try_write(&buf);
    }
}

/// A token bucket: `rate` messages per second, bursts up to `rate`.
struct RateLimit {
    rate: f64,
    tokens: f64,
    last: u64,
}

impl RateLimit {
    fn new(rate: u32) -> Self {
        Self {
            rate: rate as f64,
            tokens: rate as f64,
            last: monotonic_ns(),
        }
    }

    fn allow(&mut self) -> bool {
        let now = monotonic_ns();
        self.tokens = (self.tokens + (now - self.last) as f64 * 1e-9 * self.rate).min(self.rate);
        self.last = now;
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

thread_local! {
    /// Where connections read into before feeding their decoder: one per thread
    /// rather than one per connection (an idle connection then costs no buffer).
    static READ_BUF: std::cell::RefCell<Vec<u8>> = std::cell::RefCell::new(vec![0u8; SMALL_FRAME]);
}

/// Reads what the socket has into `decoder`. `Ok(false)`: end of stream.
fn read_into(stream: &UnixStream, decoder: &mut FrameDecoder) -> std::io::Result<bool> {
    READ_BUF.with(|b| {
        let mut buf = b.borrow_mut();
        let n = stream.try_read(&mut buf)?;
        decoder.push(&buf[..n]);
        Ok(n > 0)
    })
}

async fn client_connection(
    shared: Arc<Shared>,
    stream: UnixStream,
    cred: Option<tokio::net::unix::UCred>,
    origin: Origin,
    mut stop: watch::Receiver<bool>,
) {
    let host_pid = cred.and_then(|c| c.pid()).unwrap_or(0).max(0) as u32;
    let tenant: Tenant = Arc::from(origin.group(cred));
    let tenant_of_pool = tenant.clone();
    let stream = Arc::new(stream);
    let peer = Arc::new(Peer::new(stream.clone()));
    let id = {
        let mut st = shared.lock();
        let id = st.next_client;
        st.next_client += 1;
        st.clients.insert(
            id,
            ClientConn {
                peer: peer.clone(),
                gpu: None,
                tenant,
                process: checkpoints::identity(host_pid),
            },
        );
        id
    };
    let limits = shared.limits;
    let mut decoder = FrameDecoder::new();
    let (max_msgs, probe) = {
        let st = shared.lock();
        (st.cfg.max_msgs_per_sec, st.cfg.used_memory.clone())
    };
    let mut rate = RateLimit::new(max_msgs);
    // This connection's GPU once registered, and the driver's used memory on it as
    // last asked (for `no_room`): asked outside the state lock, at most every
    // USED_PROBE_INTERVAL per connection, so neither a slow NVML nor a flood of
    // claims holds up anyone else.
    let mut my_gpu: Option<String> = None;
    let mut probed: Option<(tokio::time::Instant, Option<u64>)> = None;
    let mut register_by = Some(tokio::time::Instant::now() + limits.register_timeout);
    // When the frame now arriving must be complete; `None` between frames.
    let mut frame_by: Option<tokio::time::Instant> = None;
    // This connection's share of the node's budget for partly received frames.
    let mut charged = 0usize;
    let mut closed = Closed::ByClient;
    // A `pool_open` as the first message makes this a pool connection.
    let mut pool_conn = false;
    // A `view` as the first message makes this a view connection.
    let mut viewer = false;
    'conn: loop {
        if peer.closing.load(Ordering::Relaxed) {
            break;
        }
        let want_write = peer.has_pending();
        let deadline = register_by.into_iter().chain(frame_by).min();
        let expired = sleep_until(deadline);
        tokio::select! {
            r = stream.readable() => {
                if r.is_err() { break; }
                match read_into(&stream, &mut decoder) {
                    Ok(false) => break,
                    Ok(true) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                    Err(_) => break,
                }
                let mut frames = 0;
                loop {
                    let msg = match decoder.next_payload() {
                        Ok(Some(p)) => decode_client(p),
                        Ok(None) => break,
                        Err(e) => Err(ClientDecodeError::Protocol(e)),
                    };
                    frames += 1;
                    let msg = match msg {
                        Ok(m) => m,
                        Err(e) => {
                            closed = Closed::Malformed;
                            let (code, text) = match &e {
                                ClientDecodeError::Control => (
                                    ErrorCode::WrongSocket,
                                    "control requests are refused on the client socket; use the control socket".to_string(),
                                ),
                                ClientDecodeError::Invalid(f) => {
                                    (ErrorCode::InvalidArgument, format!("invalid message: {f}"))
                                }
                                // serde's text can quote the peer's bytes: bound it.
                                ClientDecodeError::Protocol(p) => {
                                    (p.code(), log_safe(&p.to_string()).into_owned())
                                }
                            };
                            peer.send(&ArbiterMsg::Error { code, message: text });
                            break 'conn;
                        }
                    };
                    if !rate.allow() {
                        closed = Closed::RateLimited;
                        peer.send(&ArbiterMsg::Error {
                            code: ErrorCode::RateLimited,
                            message: "too many messages; slow down".into(),
                        });
                        break 'conn;
                    }
                    if matches!(msg, ClientMsg::PoolOpen) {
                        if my_gpu.is_none() && shared.pool.is_some() {
                            pool_conn = true;
                            break 'conn;
                        }
                        closed = Closed::Refused;
                        let message = if shared.pool.is_none() {
                            "this node has no swap pool (kiwi-arbiter --swap-pool off)"
                        } else {
                            "pool_open must be a connection's first message"
                        };
                        peer.send(&ArbiterMsg::Error { code: ErrorCode::InvalidArgument, message: message.into() });
                        break 'conn;
                    }
                    // A `view` before any registration makes this a view connection
                    // (the shim's NVML answers): no deadline, and no registering.
                    if matches!(msg, ClientMsg::View { .. }) && my_gpu.is_none() {
                        viewer = true;
                        register_by = None;
                    } else if viewer && !matches!(msg, ClientMsg::View { .. } | ClientMsg::Ping { .. }) {
                        closed = Closed::Refused;
                        peer.send(&ArbiterMsg::Error {
                            code: ErrorCode::InvalidArgument,
                            message: "a view connection carries only view and ping".into(),
                        });
                        break 'conn;
                    }
                    let registering = matches!(msg, ClientMsg::Register(_));
                    let used = match (&msg, &probe, &my_gpu) {
                        (ClientMsg::NoRoom { .. }, Some(p), Some(g)) => match probed {
                            Some((at, u)) if at.elapsed() < USED_PROBE_INTERVAL => u,
                            _ => {
                                let u = p.used_bytes(g);
                                probed = Some((tokio::time::Instant::now(), u));
                                u
                            }
                        },
                        _ => None,
                    };
                    if !handle_client_msg(&shared, id, host_pid, &origin, &peer, msg, used) {
                        closed = Closed::Refused;
                        break 'conn;
                    }
                    if registering {
                        my_gpu = shared.lock().clients.get(&id).and_then(|c| c.gpu.clone());
                        if my_gpu.is_some() {
                            register_by = None;
                        }
                    }
                }
                // The frame in progress, if any: its deadline starts with its first
                // byte, and it is charged in full from its header on.
                let partial = decoder.partial_frame();
                frame_by = match partial {
                    None => None,
                    Some(_) if frames > 0 || frame_by.is_none() => {
                        Some(tokio::time::Instant::now() + limits.frame_timeout)
                    }
                    Some(_) => frame_by,
                };
                let want = partial.unwrap_or(0);
                if !shared.partial.charge(&mut charged, want) {
                    let budget = shared.partial.limit;
                    closed = Closed::FrameBudget;
                    peer.send(&ArbiterMsg::Error {
                        code: ErrorCode::RateLimited,
                        message: format!("the arbiter is buffering too many partly sent frames ({} MiB); a frame of {want} bytes is refused", budget >> 20),
                    });
                    break 'conn;
                }
            }
            _ = expired => {
                let (code, message) = if register_by.is_some_and(|d| d <= tokio::time::Instant::now()) {
                    closed = Closed::NotRegistered;
                    (ErrorCode::NotRegistered, format!("no registration within {} ms of connecting; closing", limits.register_timeout.as_millis()))
                } else {
                    closed = Closed::FrameTimeout;
                    (ErrorCode::Timeout, format!("a frame was not completed within {} ms; closing", limits.frame_timeout.as_millis()))
                };
                peer.send(&ArbiterMsg::Error { code, message });
                break;
            }
            r = stream.writable(), if want_write => {
                if r.is_err() || peer.try_flush().is_err() {
                    closed = Closed::WriteFailed;
                    break;
                }
            }
            // Another task queued bytes for us: loop to re-check `want_write`.
            _ = peer.flush.notified() => {}
            _ = stop.changed() => {
                closed = Closed::Shutdown;
                break;
            }
        }
    }
    if pool_conn {
        shared.partial.charge(&mut charged, 0);
        shared.lock().clients.remove(&id);
        if let Some(p) = shared.pool.clone() {
            pool::serve(
                shared.clone(),
                p,
                stream,
                decoder,
                id,
                host_pid,
                tenant_of_pool,
                rate,
                stop,
            )
            .await;
        }
        return;
    }
    if closed == Closed::ByClient && peer.closing.load(Ordering::Relaxed) {
        closed = if peer.unread.load(Ordering::Relaxed) {
            peer.replace_with_last(&ArbiterMsg::Error {
                code: ErrorCode::RateLimited,
                message: format!(
                    "more than {} KiB of replies unread; closing (replies after the ones already sent are lost)",
                    MAX_PENDING_WRITE >> 10
                ),
            });
            // Its socket is full: give it a moment (bounded) to read, so it hears why.
            let _ = tokio::time::timeout(UNREAD_LINGER, async {
                while peer.has_pending() {
                    if stream.writable().await.is_err() || peer.try_flush().is_err() {
                        break;
                    }
                }
            })
            .await;
            Closed::UnreadReplies
        } else {
            Closed::WriteFailed
        };
    }
    shared.partial.charge(&mut charged, 0);
    drop(decoder);
    // Best effort: flush a final error message, then forget the client.
    let _ = peer.try_flush();
    if closed != Closed::ByClient {
        if closed != Closed::Shutdown {
            let told = peer
                .told
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take()
                .map(|t| format!("; told {t}"))
                .unwrap_or_default();
            warn_throttled!(
                shared.warn,
                "client {id} (pid {host_pid}): connection closed ({}){}",
                closed.label(),
                log_safe(&told)
            );
        }
        shared.lock().metrics.disconnect(closed.label());
    }
    let mut st = shared.lock();
    if let Some(conn) = st.clients.remove(&id) {
        if let Some(gpu) = conn.gpu {
            let now = monotonic_ns();
            let outs = st
                .gpus
                .get_mut(&gpu)
                .map(|g| g.sched.exit(now, id))
                .unwrap_or_default();
            st.dispatch_leaving(&gpu, outs, Some((id, &conn.tenant)));
            let st = &mut *st;
            for (u, o) in st.gangs.leave(&mut st.gpus, now, id) {
                st.dispatch(&u, o);
            }
            log_line!("INFO", "client {id} (pid {host_pid}) left GPU {gpu}");
            st.forget_gpu_if_unused(&gpu);
        }
    }
    drop(st);
    shared.timer.notify_one();
}

/// The group a registering client belongs to ([`crate::gang`]): the name it gives
/// (`KIWI_GROUP`), scoped to its tenant so no tenant joins another's group; else its
/// container's pod or the container (from the container's record); else its process
/// (a process using several GPUs is one job); a client whose process is unknown is a
/// group of its own.
fn group_key(
    origin: &Origin,
    tenant: Option<&str>,
    named: Option<&str>,
    host_pid: u32,
    id: ClientId,
) -> String {
    if let Some(name) = named {
        return format!("{} / {name}", tenant.unwrap_or("?"));
    }
    if let Origin::Container(c) = origin {
        if tenant.is_some_and(|t| t.starts_with("container ")) {
            return c.group_key();
        }
    }
    if host_pid != 0 {
        return format!("pid {host_pid}");
    }
    format!("client {id}")
}

enum ClientDecodeError {
    Control,
    Invalid(kiwi_protocol::FieldError),
    Protocol(ProtocolError),
}

impl From<ProtocolError> for ClientDecodeError {
    fn from(e: ProtocolError) -> Self {
        ClientDecodeError::Protocol(e)
    }
}

/// Decodes and validates one client payload (string limits: see
/// [`ClientMsg::validate`]).
fn decode_client(payload: &[u8]) -> Result<ClientMsg, ClientDecodeError> {
    match decode_payload::<ClientMsg>(payload) {
        Ok(m) => match m.validate() {
            Ok(()) => Ok(m),
            Err(f) => Err(ClientDecodeError::Invalid(f)),
        },
        Err(e) => {
            if decode_payload::<ControlRequest>(payload).is_ok() {
                Err(ClientDecodeError::Control)
            } else {
                Err(e.into())
            }
        }
    }
}

/// The line a refused growth prints: what bounds it (the swap pool, or the budget)
/// and who fills the pool most.
fn refusal_line(
    a: &swap::Admission,
    working_set: u64,
    pool: Option<&crate::pool::PoolStats>,
) -> String {
    let what = match pool {
        Some(p) if p.size <= a.budget => format!("the node's swap pool ({} MiB)", p.size >> 20),
        _ => format!("the node's swap budget ({} MiB)", a.budget >> 20),
    };
    let mut line = format!(
        "growing this GPU's working set to {} MiB would need {} MiB of GPU memory swapped out on this node, more than {what} holds",
        working_set >> 20,
        a.need_after >> 20
    );
    if let Some(p) = pool {
        let mut top = p.tenants.clone();
        top.sort_by_key(|t| std::cmp::Reverse(t.1));
        let names: Vec<String> = top
            .iter()
            .take(3)
            .map(|(t, b)| format!("{} ({} MiB)", log_safe(t), b >> 20))
            .collect();
        if !names.is_empty() {
            line.push_str(&format!("; it is lent most to {}", names.join(", ")));
        }
    }
    line
}

/// Handles one client message. `false`: close the connection.
fn handle_client_msg(
    shared: &Shared,
    id: ClientId,
    host_pid: u32,
    origin: &Origin,
    peer: &Peer,
    msg: ClientMsg,
    used: Option<u64>,
) -> bool {
    let now = monotonic_ns();
    let mut st = shared.lock();
    let deadline_before = st.next_deadline();
    let gpu = st.clients.get(&id).and_then(|c| c.gpu.clone());
    let (gpu, outs) = match (msg, gpu) {
        (ClientMsg::Ping { token }, gpu) => {
            // A `room` due to this client goes before the answer: the shim's
            // `cuMemGetInfo` counts on it (docs/protocol.md, "Memory no swap frees").
            if let Some(uuid) = gpu {
                let outs = st
                    .gpus
                    .get_mut(&uuid)
                    .map(|g| g.sched.flush_room(now, id))
                    .unwrap_or_default();
                st.dispatch(&uuid, outs);
            }
            peer.send(&ArbiterMsg::Pong { token });
            return true;
        }
        (ClientMsg::Register(r), None) => {
            if r.version != PROTOCOL_VERSION {
                peer.send(&ArbiterMsg::Error {
                    code: ErrorCode::Version,
                    message: format!(
                        "protocol version {} is not supported (the arbiter speaks {PROTOCOL_VERSION})",
                        r.version
                    ),
                });
                return false;
            }
            if r.gpu_uuid.is_empty() || r.gpu_uuid.len() > 128 || r.gpu_total_memory == 0 {
                peer.send(&ArbiterMsg::Error {
                    code: ErrorCode::InvalidArgument,
                    message: "registration needs a GPU UUID (≤128 bytes) and its total memory"
                        .into(),
                });
                return false;
            }
            let uuid = r.gpu_uuid.clone();
            if let Origin::Container(c) = origin {
                if let Err(message) = c.may_use(&uuid) {
                    warn_throttled!(
                        shared.warn,
                        "client {id} (pid {host_pid}) of container {} refused: {}",
                        c.key,
                        log_safe(&message)
                    );
                    peer.send(&ArbiterMsg::Error {
                        code: ErrorCode::UnknownGpu,
                        message,
                    });
                    return false;
                }
            }
            if let Err(refusal) = st.admit_gpu(now, &uuid, r.gpu_total_memory) {
                warn_throttled!(
                    shared.warn,
                    "client {id} (pid {host_pid}) refused: {refusal}"
                );
                let code = match refusal {
                    gpus::Refusal::WrongTotal { .. } => ErrorCode::InvalidArgument,
                    gpus::Refusal::UnknownGpu { .. } | gpus::Refusal::TooManyGpus { .. } => {
                        ErrorCode::UnknownGpu
                    }
                };
                peer.send(&ArbiterMsg::Error {
                    code,
                    message: refusal.to_string(),
                });
                return false;
            }
            if let Some(c) = st.clients.get_mut(&id) {
                c.gpu = Some(uuid.clone());
            }
            log_line!(
                "INFO",
                "client {id} registered: pid {} (host pid {host_pid}) {} on GPU {uuid}{}",
                r.pid,
                r.name.as_deref().unwrap_or("?"),
                if r.resume.is_some() { " (resumed)" } else { "" }
            );
            let mut info = ClientInfo::from_register(&r, host_pid);
            info.tenant = st.clients.get(&id).map(|c| c.tenant.to_string());
            if let Origin::Container(c) = origin {
                // Who a container's client is comes from its record, not from itself.
                c.label(&mut info);
            }
            let group = group_key(
                origin,
                info.tenant.as_deref(),
                r.group.as_deref(),
                host_pid,
                id,
            );
            let usage = Usage {
                working_set_bytes: r.working_set_bytes,
                resident_bytes: r.resident_bytes,
            };
            let mut outs = st
                .gpus
                .get_mut(&uuid)
                .map(|g| g.sched.register(now, id, info, usage, r.resume))
                .unwrap_or_default();
            // The node's bounds, right after `registered` (the scheduler's), so the
            // shim has them before any drop or reclaim; only to a client that asked.
            let registered = outs.iter().position(
                |o| matches!(o, Output::Send(to, ArbiterMsg::Registered { .. }) if *to == id),
            );
            if let (true, Some(k)) = (r.bounds, registered) {
                let bounds = ArbiterMsg::Bounds {
                    hint_wait_ms: st.cfg.max_hint_wait_ms,
                };
                outs.insert(k + 1, Output::Send(id, bounds));
            }
            if r.resume.is_some() && host_pid != 0 {
                checkpoints::restore_if_left(&st, &uuid, id, host_pid);
            }
            if r.resume.is_some_and(|x| x.holding)
                && outs
                    .iter()
                    .any(|o| matches!(o, Output::Send(to, ArbiterMsg::Revoked { .. }) if *to == id))
            {
                warn_throttled!(
                    shared.warn,
                    "client {id} (pid {host_pid}) claims to hold GPU {uuid}, which the arbiter did not grant it: refused, queued"
                );
            }
            st.dispatch(&uuid, outs);
            st.join_group(now, id, &group, &uuid);
            (uuid, Vec::new())
        }
        (
            ClientMsg::PoolOpen
            | ClientMsg::PoolTake { .. }
            | ClientMsg::PoolGive { .. }
            | ClientMsg::PoolKept { .. }
            | ClientMsg::PoolSpill { .. },
            _,
        ) => {
            peer.send(&ArbiterMsg::Error {
                code: ErrorCode::InvalidArgument,
                message: "swap pool messages belong on a pool connection (opened with pool_open)"
                    .into(),
            });
            return true;
        }
        (ClientMsg::View { gpu_uuid }, _) => {
            if let Origin::Container(c) = origin {
                if let Err(message) = c.may_use(&gpu_uuid) {
                    peer.send(&ArbiterMsg::Error {
                        code: ErrorCode::UnknownGpu,
                        message,
                    });
                    return true;
                }
            }
            peer.send(&st.view(id, gpu_uuid));
            return true;
        }
        (ClientMsg::Register(_), Some(_)) => {
            peer.send(&ArbiterMsg::Error {
                code: ErrorCode::AlreadyRegistered,
                message: "already registered on this connection".into(),
            });
            return true;
        }
        (_, None) => {
            peer.send(&ArbiterMsg::Error {
                code: ErrorCode::NotRegistered,
                message: "register first".into(),
            });
            return true;
        }
        (ClientMsg::Admit { working_set_bytes }, Some(uuid)) => {
            let Some(g) = st.gpus.get(&uuid) else {
                return false;
            };
            let a = swap::decide(
                st.cfg.swap_budget_bytes,
                st.gpus.values().map(|g| &g.sched),
                &g.sched,
                id,
                working_set_bytes,
            );
            // The answer first: the client is blocked in its allocator waiting for it.
            let message = (!a.ok && g.sched.takes_notices(id)).then(|| {
                let pool = shared.pool.as_ref().map(|p| p.stats());
                refusal_line(&a, working_set_bytes, pool.as_ref())
            });
            peer.send(&ArbiterMsg::Admitted {
                ok: a.ok,
                swap_needed_bytes: a.need_after,
                swap_budget_bytes: a.budget,
                message,
            });
            if !a.ok {
                st.metrics.admission_refused();
                log_line!(
                    "INFO",
                    "swap budget: refused client {id} (pid {host_pid}) on GPU {uuid} a working set of {} MiB ({working_set_bytes} bytes): node swap need would be {} MiB ({} bytes), budget {} MiB ({} bytes)",
                    working_set_bytes >> 20,
                    a.need_after >> 20,
                    a.need_after,
                    a.budget >> 20,
                    a.budget
                );
                return true;
            }
            let outs = st
                .gpus
                .get_mut(&uuid)
                .map(|g| g.sched.admit(now, id, working_set_bytes))
                .unwrap_or_default();
            (uuid, outs)
        }
        (msg, Some(uuid)) => {
            let Some(g) = st.gpus.get_mut(&uuid) else {
                return false;
            };
            let s = &mut g.sched;
            let outs = match msg {
                ClientMsg::Request => s.request(now, id),
                ClientMsg::Release(u) => s.release(now, id, u),
                ClientMsg::Usage(u) => s.usage(now, id, u),
                ClientMsg::Reclaimed(u) => s.reclaimed(now, id, u),
                ClientMsg::Unswappable { bytes } => s.unswappable(now, id, bytes),
                ClientMsg::Swapped {
                    direction,
                    bytes,
                    duration_ns,
                } => s.swapped(now, id, direction, bytes, duration_ns),
                ClientMsg::Drained => s.drained(now, id),
                ClientMsg::NoRoom { missing_bytes } => s.no_room(now, id, missing_bytes, || used),
                ClientMsg::Register(_)
                | ClientMsg::Ping { .. }
                | ClientMsg::Admit { .. }
                | ClientMsg::PoolOpen
                | ClientMsg::PoolTake { .. }
                | ClientMsg::PoolGive { .. }
                | ClientMsg::PoolKept { .. }
                | ClientMsg::PoolSpill { .. }
                | ClientMsg::View { .. } => Vec::new(),
            };
            (uuid, outs)
        }
    };
    st.dispatch(&gpu, outs);
    // Wake the timer task only when its deadline moved: on the hand-off path every
    // avoided wake-up is CPU the next holder's process can have.
    let moved = st.next_deadline() != deadline_before;
    drop(st);
    if moved {
        shared.timer.notify_one();
    }
    true
}

async fn accept_control(
    shared: Arc<Shared>,
    listener: UnixListener,
    mut stop: watch::Receiver<bool>,
) {
    let mut tasks = tokio::task::JoinSet::new();
    let mut backoff = Duration::from_millis(1);
    let accept_errors = Mutex::new(Throttle::new(1));
    loop {
        tokio::select! {
            res = listener.accept() => match res {
                Ok((stream, _)) => {
                    backoff = Duration::from_millis(1);
                    if tasks.len() >= MAX_CONTROL_CONNS {
                        warn_throttled!(shared.warn, "{MAX_CONTROL_CONNS} control connections open, the limit; refusing one");
                        let reply = ControlReply::Error {
                            code: ErrorCode::RateLimited,
                            message: format!("{MAX_CONTROL_CONNS} kiwictl connections are open already; try again"),
                        };
                        if let Ok(buf) = kiwi_protocol::encode(&reply) {
                            let _ = stream.try_write(&buf);
                        }
                        continue;
                    }
                    let shared = shared.clone();
                    tasks.spawn(control_connection(shared, stream));
                }
                Err(e) => {
                    warn_throttled!(accept_errors, "control accept failed: {e}; retrying in up to 1 s");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(1));
                }
            },
            Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
            _ = stop.changed() => break,
        }
    }
    tasks.shutdown().await;
}

async fn control_connection(shared: Arc<Shared>, stream: UnixStream) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let who = stream
        .peer_cred()
        .ok()
        .and_then(|c| c.pid())
        .map_or("?".to_string(), |p| p.to_string());
    let mut stream = stream;
    let mut decoder = FrameDecoder::new();
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match tokio::time::timeout(Duration::from_secs(300), stream.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) | Err(_) => return,
            Ok(Ok(n)) => n,
        };
        decoder.push(&buf[..n]);
        loop {
            let (reply, fatal) = match decoder.next_payload() {
                Ok(None) => break,
                Ok(Some(p)) => match decode_payload::<ControlRequest>(p) {
                    Ok(req) => match req.validate() {
                        Ok(()) => (handle_control(&shared, req, &who), false),
                        Err(f) => (
                            ControlReply::Error {
                                code: ErrorCode::InvalidArgument,
                                message: format!("invalid request: {f}"),
                            },
                            false,
                        ),
                    },
                    Err(e) => {
                        let wrong = decode_payload::<ClientMsg>(p).is_ok();
                        let (code, message) = if wrong {
                            (
                                ErrorCode::WrongSocket,
                                "client messages belong on the client socket".to_string(),
                            )
                        } else {
                            (e.code(), log_safe(&e.to_string()).into_owned())
                        };
                        (ControlReply::Error { code, message }, false)
                    }
                },
                Err(e) => (
                    ControlReply::Error {
                        code: e.code(),
                        message: e.to_string(),
                    },
                    true,
                ),
            };
            // A reply too large for a frame becomes an error reply, never silence.
            let out = match kiwi_protocol::encode(&reply) {
                Ok(out) => out,
                Err(e) => {
                    log_line!("WARN", "a reply to kiwictl (pid {who}) was too large: {e}");
                    let err = ControlReply::Error {
                        code: e.code(),
                        message: format!(
                            "the arbiter's reply was too large to send ({e}); narrow the request (--gpu)"
                        ),
                    };
                    match kiwi_protocol::encode(&err) {
                        Ok(out) => out,
                        Err(_) => return,
                    }
                }
            };
            if stream.write_all(&out).await.is_err() || fatal {
                return;
            }
        }
    }
}

/// The most a status reply may encode to: the frame limit, less room for the
/// counts of what was left out.
const STATUS_BUDGET: usize = kiwi_protocol::MAX_PAYLOAD - 1024;

/// Encoded length of a JSON value (`usize::MAX` if it would not encode).
macro_rules! json_len {
    ($v:expr) => {
        serde_json::to_vec($v).map_or(usize::MAX, |b| b.len())
    };
}

/// Cuts a status report to fit in one frame: clients from the last GPU backwards
/// (holders and queue still list every id), then whole GPUs; counts what it left
/// out in `omitted_clients` and `omitted_gpus`.
fn fit_status(r: &mut StatusReport, budget: usize) {
    let mut len = json_len!(&*r);
    while len > budget {
        let excess = len - budget;
        let mut cut = 0;
        for g in r.gpus.iter_mut().rev() {
            while cut < excess {
                let Some(c) = g.clients.pop() else { break };
                cut += json_len!(&c) + 1;
                r.omitted_clients += 1;
            }
        }
        if cut < excess {
            if let Some(g) = r.gpus.pop() {
                r.omitted_gpus += 1;
                r.omitted_clients += g.clients.len() as u64;
            } else {
                return;
            }
        }
        len = json_len!(&*r);
    }
}

fn handle_control(shared: &Arc<Shared>, req: ControlRequest, who: &str) -> ControlReply {
    let now = monotonic_ns();
    let mut st = shared.lock();
    let select = |st: &State, gpu: &Option<String>| -> Result<Vec<String>, ControlReply> {
        match gpu {
            None => Ok(st.gpus.keys().cloned().collect()),
            Some(sel) => st
                .resolve_gpu(sel)
                .map(|u| vec![u])
                .ok_or_else(|| ControlReply::Error {
                    code: ErrorCode::UnknownGpu,
                    message: format!(
                        "no GPU {sel:?} is known to the arbiter (known: {})",
                        if st.gpus.is_empty() {
                            "none yet".to_string()
                        } else {
                            st.gpus
                                .iter()
                                .map(|(u, g)| format!("{} = {u}", g.index))
                                .collect::<Vec<_>>()
                                .join(", ")
                        }
                    ),
                }),
        }
    };
    let reply = match req {
        ControlRequest::SetScheduler { on, gpu } => {
            let word = if on { "ON" } else { "OFF" };
            log_line!("INFO", "Received SCHED_{word} from kiwictl (pid {who})");
            match select(&st, &gpu) {
                Err(e) => e,
                Ok(uuids) => {
                    if gpu.is_none() {
                        st.defaults.scheduler_on = on;
                    }
                    for u in &uuids {
                        let outs = st
                            .gpus
                            .get_mut(u)
                            .map(|g| g.sched.set_scheduler(now, on))
                            .unwrap_or_default();
                        st.dispatch(u, outs);
                    }
                    log_line!(
                        "INFO",
                        "Scheduler status changed to {word}, broadcasting it"
                    );
                    ControlReply::Done {
                        message: format!(
                            "Successfully turned {} the Kiwi scheduler.",
                            if on { "on" } else { "off" }
                        ),
                        gpus: uuids,
                    }
                }
            }
        }
        ControlRequest::SetTq { tq_ms, gpu } => {
            log_line!(
                "INFO",
                "Received SET_TQ {tq_ms} ms from kiwictl (pid {who})"
            );
            if tq_ms == 0 || tq_ms > 86_400_000 {
                ControlReply::Error {
                    code: ErrorCode::InvalidArgument,
                    message: format!("TQ must be between 1 ms and one day, not {tq_ms} ms"),
                }
            } else {
                match select(&st, &gpu) {
                    Err(e) => e,
                    Ok(uuids) => {
                        if gpu.is_none() {
                            st.defaults.tq_ms = tq_ms;
                        }
                        for u in &uuids {
                            let outs = st
                                .gpus
                                .get_mut(u)
                                .map(|g| g.sched.set_tq(now, tq_ms))
                                .unwrap_or_default();
                            st.dispatch(u, outs);
                        }
                        ControlReply::Done {
                            message: format!(
                                "Successfully set the Kiwi scheduler's time quantum to {} s.",
                                tq_ms as f64 / 1000.0
                            ),
                            gpus: uuids,
                        }
                    }
                }
            }
        }
        ControlRequest::Status { gpu } => match select(&st, &gpu) {
            Err(e) => e,
            Ok(uuids) => {
                let swap = st.node_swap();
                let mut report = StatusReport {
                    default_settings: st.defaults,
                    gpus: uuids.iter().filter_map(|u| st.gpu_status(now, u)).collect(),
                    now_ns: now,
                    swap_budget_bytes: swap.budget_bytes,
                    swap_need_bytes: swap.need_bytes,
                    swap_in_use_bytes: swap.in_use_bytes,
                    swap_pool: shared.pool.as_ref().map(|p| Box::new(pool::status(p))),
                    omitted_clients: 0,
                    omitted_gpus: 0,
                };
                fit_status(&mut report, STATUS_BUDGET);
                ControlReply::Status(report)
            }
        },
        ControlRequest::AttachContainer { key } => {
            drop(st);
            return containers::attach(shared, &key, who);
        }
        ControlRequest::DetachContainer { key } => {
            drop(st);
            return containers::detach(shared, &key, who);
        }
        ControlRequest::Events {
            gpu,
            since_seq,
            limit,
        } => match gpu.as_ref().map(|g| select(&st, &Some(g.clone()))) {
            Some(Err(e)) => e,
            sel => {
                let uuid = sel.and_then(|r| r.ok()).and_then(|v| v.into_iter().next());
                let (events, more) = st.events.page(uuid.as_deref(), since_seq, limit as usize);
                let next_seq = events.last().map_or(since_seq.max(1), |e| e.seq + 1);
                ControlReply::Events {
                    events,
                    next_seq,
                    more,
                    now_ns: now,
                }
            }
        },
    };
    drop(st);
    shared.timer.notify_one();
    reply
}

#[cfg(test)]
mod peer_tests {
    use super::*;

    /// Everything `b` can read now, decoded.
    fn read_all(b: &mut std::os::unix::net::UnixStream) -> Vec<ArbiterMsg> {
        use std::io::Read;
        let mut dec = FrameDecoder::new();
        let mut buf = vec![0u8; 1 << 16];
        let mut out = Vec::new();
        loop {
            match b.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => dec.push(&buf[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) => panic!("{e}"),
            }
            while let Some(m) = dec.next_msg::<ArbiterMsg>().unwrap() {
                out.push(m);
            }
        }
        out
    }

    #[tokio::test]
    async fn a_slow_reader_gets_the_latest_state_in_order_and_stays_connected() {
        let (a, mut b) = std::os::unix::net::UnixStream::pair().unwrap();
        a.set_nonblocking(true).unwrap();
        b.set_nonblocking(true).unwrap();
        let peer = Peer::new(Arc::new(UnixStream::from_std(a).unwrap()));
        // 100,000 states (~6 MB) to a client that reads nothing: far past the 64 KiB
        // of unread replies that disconnect a client.
        const N: u64 = 100_000;
        for i in 0..N {
            peer.send(&ArbiterMsg::Room {
                others_unswappable_bytes: i,
                keep: None,
            });
        }
        peer.send(&ArbiterMsg::Pong { token: 7 });
        peer.send(&ArbiterMsg::Room {
            others_unswappable_bytes: N,
            keep: None,
        });
        assert!(!peer.closing.load(Ordering::Relaxed), "disconnected");
        let mut got = Vec::new();
        while peer.has_pending() {
            got.extend(read_all(&mut b));
            // As the connection's task does: tokio learns the socket drained from
            // its reactor, which runs while we wait.
            tokio::time::timeout(Duration::from_secs(5), peer.stream.writable())
                .await
                .expect("writable")
                .unwrap();
            peer.try_flush().unwrap();
        }
        got.extend(read_all(&mut b));
        let n = got.len();
        assert!(n < 20_000, "{n} messages: the backlog was sent");
        // The latest state before the pong, the pong, then the latest state.
        assert_eq!(
            got[n - 3..],
            [
                ArbiterMsg::Room {
                    others_unswappable_bytes: N - 1,
                    keep: None,
                },
                ArbiterMsg::Pong { token: 7 },
                ArbiterMsg::Room {
                    others_unswappable_bytes: N,
                    keep: None,
                },
            ]
        );
        // What was written before the socket filled came in order.
        for w in got[..n - 3].windows(2) {
            match w {
                [ArbiterMsg::Room {
                    others_unswappable_bytes: x,
                    keep: None,
                }, ArbiterMsg::Room {
                    others_unswappable_bytes: y,
                    keep: None,
                }] => assert_eq!(x + 1, *y),
                other => panic!("{other:?}"),
            }
        }
    }
}
