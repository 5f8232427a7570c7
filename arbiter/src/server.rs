//! The daemon: accepts clients on the client socket and operators on the control
//! socket, feeds the per-GPU schedulers, runs their timers, and writes their answers.
//!
//! Latency matters on one path: a holder's release to the next holder's grant. That
//! path stays in the releasing connection's task: decode, scheduler step, and a
//! direct non-blocking write to the next holder's socket. Only a write that would
//! block is deferred to the receiving connection's own task.
//!
//! Identity comes from the socket: a client's host pid and uid are read with
//! SO_PEERCRED and a connection can only act for itself.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kiwi_config::SchedulerMode;
use kiwi_protocol::frame::{decode_payload, encode_into};
use kiwi_protocol::{
    ArbiterMsg, ClientMsg, ControlReply, ControlRequest, ErrorCode, FrameDecoder, ProtocolError,
    Settings, StatusReport, Usage, PROTOCOL_VERSION,
};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{watch, Notify, Semaphore};

use crate::clock::monotonic_ns;
use crate::events::EventLog;
use crate::metrics::{ArbiterMetrics, NodeSwap};
use crate::sched::{ClientId, ClientInfo, GpuScheduler, Output};
use crate::swap;

/// Runtime settings of the daemon.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub scheduler: SchedulerMode,
    pub tq_ms: u64,
    pub grace_ms: u64,
    /// Context reserve policy: explicit MiB, or the default (see `kiwi_config`).
    pub reserve_mib: Option<u64>,
    pub event_log_capacity: usize,
    /// Most simultaneous connections; more are refused.
    pub max_connections: usize,
    /// Messages per second a client may send (burst: one second's worth).
    pub max_msgs_per_sec: u32,
    /// Where to serve Prometheus metrics (`None`: nowhere).
    pub metrics_addr: Option<String>,
    /// The node's host-RAM swap budget in bytes, over every GPU (`None`: unlimited).
    /// Clients are told it at registration and ask before growing their working set
    /// (see [`crate::swap`]).
    pub swap_budget_bytes: Option<u64>,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            scheduler: SchedulerMode::On,
            tq_ms: 30_000,
            grace_ms: 5_000,
            reserve_mib: None,
            event_log_capacity: 100_000,
            max_connections: 4096,
            max_msgs_per_sec: 20_000,
            metrics_addr: None,
            swap_budget_bytes: None,
        }
    }
}

/// Bytes a slow reader may leave unread before it is disconnected.
const MAX_PENDING_WRITE: usize = 1 << 20;

macro_rules! log_line {
    ($lvl:literal, $($arg:tt)*) => {
        eprintln!(concat!("[", $lvl, "] {}"), format_args!($($arg)*))
    };
}

/// The writing half of a client connection, shared with other tasks that must
/// send to it (a release in one connection grants in another).
struct Peer {
    stream: Arc<UnixStream>,
    pending: Mutex<Vec<u8>>,
    flush: Notify,
    closing: AtomicBool,
}

impl Peer {
    fn new(stream: Arc<UnixStream>) -> Self {
        Self {
            stream,
            pending: Mutex::new(Vec::new()),
            flush: Notify::new(),
            closing: AtomicBool::new(false),
        }
    }

    /// Writes now if the socket takes it; otherwise queues for the owner task.
    fn send_bytes(&self, bytes: &[u8]) {
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
        if !rest.is_empty() {
            if pending.len() + rest.len() > MAX_PENDING_WRITE {
                // A client that never reads must not grow our memory.
                self.closing.store(true, Ordering::Relaxed);
            } else {
                pending.extend_from_slice(rest);
            }
            self.flush.notify_one();
        }
    }

    fn send(&self, msg: &ArbiterMsg) {
        let mut buf = Vec::with_capacity(96);
        if encode_into(msg, &mut buf).is_ok() {
            self.send_bytes(&buf);
        }
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
        while !p.is_empty() {
            match self.stream.try_write(&p) {
                Ok(n) => {
                    p.drain(..n);
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

struct ClientConn {
    peer: Arc<Peer>,
    gpu: Option<String>,
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
}

impl State {
    /// Applies scheduler outputs: messages to peers, events to the log.
    fn dispatch(&mut self, gpu: &str, outs: Vec<Output>) {
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
            if let Output::Log(id, kind) = o {
                self.metrics.observe(now, gpu, &kind);
                self.events.push(now, gpu, id, kind);
            }
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
            .iter()
            .map(|(u, g)| g.sched.status(now, g.index, u))
            .collect()
    }

    /// The node's swap figures for status and metrics.
    fn node_swap(&self) -> NodeSwap {
        let scheds = || self.gpus.values().map(|g| &g.sched);
        NodeSwap {
            budget_bytes: self.cfg.swap_budget_bytes,
            need_bytes: swap::node_swap_need(scheds()),
            in_use_bytes: swap::node_swapped_bytes(scheds()),
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
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Serves until `shutdown` resolves. The caller binds the listeners (so tests can
/// inject them) and removes the socket files afterwards.
pub async fn serve(
    cfg: ServerConfig,
    client_listener: UnixListener,
    control_listener: UnixListener,
    metrics_listener: Option<tokio::net::TcpListener>,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    let defaults = Settings {
        scheduler_on: cfg.scheduler.is_on(),
        tq_ms: cfg.tq_ms.max(1),
    };
    let shared = Arc::new(Shared {
        state: Mutex::new(State {
            events: EventLog::new(cfg.event_log_capacity),
            metrics: ArbiterMetrics::new(),
            cfg: cfg.clone(),
            defaults,
            gpus: BTreeMap::new(),
            clients: HashMap::new(),
            next_client: 1,
        }),
        timer: Notify::new(),
    });
    let (stop_tx, stop_rx) = watch::channel(false);
    let limit = Arc::new(Semaphore::new(cfg.max_connections));

    let timer = tokio::spawn(run_timers(shared.clone(), stop_rx.clone()));
    let clients = tokio::spawn(accept_clients(
        shared.clone(),
        client_listener,
        limit.clone(),
        stop_rx.clone(),
    ));
    let control = tokio::spawn(accept_control(
        shared.clone(),
        control_listener,
        stop_rx.clone(),
    ));
    let metrics = metrics_listener.map(|l| {
        let s = shared.clone();
        let render: kiwi_metrics::Render = Arc::new(move || {
            let st = s.lock();
            st.metrics
                .render(&st.gpu_statuses(monotonic_ns()), &st.node_swap())
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
    if let Some(m) = metrics {
        let _ = m.await;
    }
    Ok(())
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

async fn accept_clients(
    shared: Arc<Shared>,
    listener: UnixListener,
    limit: Arc<Semaphore>,
    mut stop: watch::Receiver<bool>,
) {
    let mut tasks = tokio::task::JoinSet::new();
    let mut backoff = Duration::from_millis(1);
    loop {
        tokio::select! {
            res = listener.accept() => match res {
                Ok((stream, _)) => {
                    backoff = Duration::from_millis(1);
                    let Ok(permit) = limit.clone().try_acquire_owned() else {
                        log_line!("WARN", "connection limit reached; refusing a client");
                        refuse(stream, ErrorCode::RateLimited, "too many connections").await;
                        continue;
                    };
                    let shared = shared.clone();
                    let stop = stop.clone();
                    tasks.spawn(async move {
                        client_connection(shared, stream, stop).await;
                        drop(permit);
                    });
                }
                Err(e) => {
                    // EMFILE and friends: back off instead of spinning.
                    log_line!("WARN", "accept failed: {e}");
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

async fn client_connection(
    shared: Arc<Shared>,
    stream: UnixStream,
    mut stop: watch::Receiver<bool>,
) {
    let cred = stream.peer_cred().ok();
    let host_pid = cred.and_then(|c| c.pid()).unwrap_or(0).max(0) as u32;
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
            },
        );
        id
    };
    let mut decoder = FrameDecoder::new();
    let mut rate = RateLimit::new(shared.lock().cfg.max_msgs_per_sec);
    let mut buf = vec![0u8; 16 * 1024];
    'conn: loop {
        if peer.closing.load(Ordering::Relaxed) {
            break;
        }
        let want_write = peer.has_pending();
        tokio::select! {
            r = stream.readable() => {
                if r.is_err() { break; }
                match stream.try_read(&mut buf) {
                    Ok(0) => break,
                    Ok(n) => decoder.push(&buf[..n]),
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                    Err(_) => break,
                }
                loop {
                    let msg = match decoder.next_payload() {
                        Ok(Some(p)) => decode_client(p),
                        Ok(None) => break,
                        Err(e) => Err(ClientDecodeError::Protocol(e)),
                    };
                    let msg = match msg {
                        Ok(m) => m,
                        Err(e) => {
                            let (code, text) = match &e {
                                ClientDecodeError::Control => (
                                    ErrorCode::WrongSocket,
                                    "control requests are refused on the client socket; use the control socket".to_string(),
                                ),
                                ClientDecodeError::Protocol(p) => (p.code(), p.to_string()),
                            };
                            log_line!("WARN", "client {id} (pid {host_pid}): {text}; disconnecting");
                            peer.send(&ArbiterMsg::Error { code, message: text });
                            break 'conn;
                        }
                    };
                    if !rate.allow() {
                        log_line!("WARN", "client {id} (pid {host_pid}) floods requests; disconnecting");
                        peer.send(&ArbiterMsg::Error {
                            code: ErrorCode::RateLimited,
                            message: "too many messages; slow down".into(),
                        });
                        break 'conn;
                    }
                    if !handle_client_msg(&shared, id, host_pid, &peer, msg) {
                        break 'conn;
                    }
                }
            }
            r = stream.writable(), if want_write => {
                if r.is_err() || peer.try_flush().is_err() { break; }
            }
            // Another task queued bytes for us: loop to re-check `want_write`.
            _ = peer.flush.notified() => {}
            _ = stop.changed() => break,
        }
    }
    // Best effort: flush a final error message, then forget the client.
    let _ = peer.try_flush();
    let mut st = shared.lock();
    if let Some(conn) = st.clients.remove(&id) {
        if let Some(gpu) = conn.gpu {
            let now = monotonic_ns();
            let outs = st
                .gpus
                .get_mut(&gpu)
                .map(|g| g.sched.exit(now, id))
                .unwrap_or_default();
            st.dispatch(&gpu, outs);
            log_line!("INFO", "client {id} (pid {host_pid}) left GPU {gpu}");
        }
    }
    drop(st);
    shared.timer.notify_one();
}

enum ClientDecodeError {
    Control,
    Protocol(ProtocolError),
}

impl From<ProtocolError> for ClientDecodeError {
    fn from(e: ProtocolError) -> Self {
        ClientDecodeError::Protocol(e)
    }
}

fn decode_client(payload: &[u8]) -> Result<ClientMsg, ClientDecodeError> {
    match decode_payload::<ClientMsg>(payload) {
        Ok(m) => Ok(m),
        Err(e) => {
            if decode_payload::<ControlRequest>(payload).is_ok() {
                Err(ClientDecodeError::Control)
            } else {
                Err(e.into())
            }
        }
    }
}

/// Handles one client message. `false`: close the connection.
fn handle_client_msg(
    shared: &Shared,
    id: ClientId,
    host_pid: u32,
    peer: &Peer,
    msg: ClientMsg,
) -> bool {
    let now = monotonic_ns();
    let mut st = shared.lock();
    let deadline_before = st.next_deadline();
    let gpu = st.clients.get(&id).and_then(|c| c.gpu.clone());
    let (gpu, outs) = match (msg, gpu) {
        (ClientMsg::Ping { token }, _) => {
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
            if !st.gpus.contains_key(&uuid) {
                let index = st.gpus.len() as u32;
                let reserve = kiwi_config::context_reserve_bytes(
                    &kiwi_config::ArbiterConfig {
                        reserve_mib: st.cfg.reserve_mib,
                        ..Default::default()
                    },
                    r.gpu_total_memory,
                );
                let sched = GpuScheduler::new(
                    r.gpu_total_memory,
                    r.gpu_total_memory - reserve,
                    st.defaults,
                    st.cfg.grace_ms,
                )
                .with_swap_budget(st.cfg.swap_budget_bytes);
                log_line!(
                    "INFO",
                    "new GPU {uuid} (index {index}): {} MiB, {} MiB schedulable",
                    r.gpu_total_memory >> 20,
                    (r.gpu_total_memory - reserve) >> 20
                );
                st.gpus.insert(uuid.clone(), Gpu { index, sched });
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
            let info = ClientInfo::from_register(&r, host_pid);
            let usage = Usage {
                working_set_bytes: r.working_set_bytes,
                resident_bytes: r.resident_bytes,
            };
            let outs = st
                .gpus
                .get_mut(&uuid)
                .map(|g| g.sched.register(now, id, info, usage, r.resume))
                .unwrap_or_default();
            (uuid, outs)
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
            peer.send(&ArbiterMsg::Admitted {
                ok: a.ok,
                swap_needed_bytes: a.need_after,
                swap_budget_bytes: a.budget,
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
                ClientMsg::Swapped {
                    direction,
                    bytes,
                    duration_ns,
                } => s.swapped(now, id, direction, bytes, duration_ns),
                ClientMsg::Register(_) | ClientMsg::Ping { .. } | ClientMsg::Admit { .. } => {
                    Vec::new()
                }
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
    loop {
        tokio::select! {
            res = listener.accept() => match res {
                Ok((stream, _)) => {
                    let shared = shared.clone();
                    tasks.spawn(control_connection(shared, stream));
                }
                Err(e) => {
                    log_line!("WARN", "control accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(10)).await;
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
                    Ok(req) => (handle_control(&shared, req, &who), false),
                    Err(e) => {
                        let wrong = decode_payload::<ClientMsg>(p).is_ok();
                        let (code, message) = if wrong {
                            (
                                ErrorCode::WrongSocket,
                                "client messages belong on the client socket".to_string(),
                            )
                        } else {
                            (e.code(), e.to_string())
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
            let mut out = Vec::new();
            if encode_into(&reply, &mut out).is_err() {
                return;
            }
            if stream.write_all(&out).await.is_err() || fatal {
                return;
            }
        }
    }
}

fn handle_control(shared: &Shared, req: ControlRequest, who: &str) -> ControlReply {
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
                ControlReply::Status(StatusReport {
                    default_settings: st.defaults,
                    gpus: uuids
                        .iter()
                        .filter_map(|u| st.gpus.get(u).map(|g| g.sched.status(now, g.index, u)))
                        .collect(),
                    now_ns: now,
                    swap_budget_bytes: swap.budget_bytes,
                    swap_need_bytes: swap.need_bytes,
                    swap_in_use_bytes: swap.in_use_bytes,
                })
            }
        },
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
