//! Client connections, on the node's socket and on each container's: the accept
//! loop (the node's connection cap, each container's or uid's share, backing off
//! when accept fails), then one task per connection ([`client_connection`]) that
//! reads and decodes frames within their deadlines and the node's budget, handles
//! each message under the state lock ([`messages`]), writes what waits for its
//! client, and, when the connection ends, says why and takes the client off its
//! GPU. A `pool_open` first hands the connection to [`pool`]; a `view` first makes
//! it a view connection.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use kiwi_protocol::frame::{decode_payload, encode_into};
use kiwi_protocol::{
    ArbiterMsg, ClientMsg, ControlRequest, ErrorCode, FrameDecoder, ProtocolError,
};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::watch;

use super::limits::{AcceptBackoff, ConnSlot, Limits, RateLimit, SMALL_FRAME};
use super::logging::log_safe;
use super::peer::{Peer, MAX_PENDING_WRITE};
use super::state::{ClientConn, Shared};
use super::{checkpoints, containers, pool};
use crate::clock::monotonic_ns;
use crate::events::Tenant;
use crate::gpus;
use crate::sched::ClientId;

mod messages;

use messages::handle_client_msg;

/// How often one connection's `no_room` asks NVML for its GPU's used memory; between,
/// the last answer stands.
const USED_PROBE_INTERVAL: Duration = Duration::from_millis(100);

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

/// Where a client connection came from, which decides what it may do: the node's
/// socket (host processes; capped per uid), or one container's (capped per socket,
/// speaking for that container only, on the GPUs it claimed; root from the host is
/// capped as on the node's socket).
#[derive(Clone)]
pub(super) enum Origin {
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

pub(super) async fn accept_clients(
    shared: Arc<Shared>,
    listener: UnixListener,
    origin: Origin,
    mut own_stop: Option<watch::Receiver<bool>>,
) {
    let mut stop = shared.stop.clone();
    let limit = shared.conn_limit.clone();
    let mut tasks = tokio::task::JoinSet::new();
    let mut backoff = AcceptBackoff::new();
    let cap = shared.conn_limit_total;
    loop {
        tokio::select! {
            res = listener.accept() => match res {
                Ok((stream, _)) => {
                    backoff.reset();
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
                Err(e) => backoff.failed("accept", &e).await,
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

/// Sleeps until `deadline`; forever without one.
pub(super) async fn sleep_until(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending::<()>().await,
    }
}

thread_local! {
    /// Where connections read into before feeding their decoder: one per thread
    /// rather than one per connection (an idle connection then costs no buffer).
    static READ_BUF: std::cell::RefCell<Vec<u8>> = std::cell::RefCell::new(vec![0u8; SMALL_FRAME]);
}

/// Reads what the socket has into `decoder`. `Ok(false)`: end of stream.
pub(super) fn read_into(stream: &UnixStream, decoder: &mut FrameDecoder) -> std::io::Result<bool> {
    READ_BUF.with(|b| {
        let mut buf = b.borrow_mut();
        let n = stream.try_read(&mut buf)?;
        decoder.push(&buf[..n]);
        Ok(n > 0)
    })
}

/// One client connection, as its task knows it between messages.
struct Conn {
    shared: Arc<Shared>,
    stream: Arc<UnixStream>,
    peer: Arc<Peer>,
    origin: Origin,
    id: ClientId,
    host_pid: u32,
    limits: Limits,
    decoder: FrameDecoder,
    rate: RateLimit,
    /// The driver's used memory per GPU, where NVML loaded.
    probe: Option<Arc<dyn gpus::UsedMemory>>,
    /// This connection's GPU once registered, and the driver's used memory on it as
    /// last asked (for `no_room`, in `probed`): asked outside the state lock, at most
    /// every USED_PROBE_INTERVAL per connection, so neither a slow NVML nor a flood of
    /// claims holds up anyone else.
    my_gpu: Option<String>,
    probed: Option<(tokio::time::Instant, Option<u64>)>,
    register_by: Option<tokio::time::Instant>,
    /// When the frame now arriving must be complete; `None` between frames.
    frame_by: Option<tokio::time::Instant>,
    /// This connection's share of the node's budget for partly received frames.
    charged: usize,
    closed: Closed,
    /// A `pool_open` as the first message makes this a pool connection.
    pool_conn: bool,
    /// A `view` as the first message makes this a view connection.
    viewer: bool,
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
    let decoder = FrameDecoder::new();
    let (max_msgs, probe) = {
        let st = shared.lock();
        (st.cfg.max_msgs_per_sec, st.cfg.used_memory.clone())
    };
    let rate = RateLimit::new(max_msgs);
    let mut conn = Conn {
        shared,
        stream,
        peer,
        origin,
        id,
        host_pid,
        limits,
        decoder,
        rate,
        probe,
        my_gpu: None,
        probed: None,
        register_by: Some(tokio::time::Instant::now() + limits.register_timeout),
        frame_by: None,
        charged: 0,
        closed: Closed::ByClient,
        pool_conn: false,
        viewer: false,
    };
    conn.run(&mut stop).await;
    if conn.pool_conn {
        conn.into_pool(tenant_of_pool, stop).await;
        return;
    }
    conn.close().await;
}

impl Conn {
    /// Reads and handles messages, writes what waits for this client, and keeps the
    /// deadlines, until the connection ends (`closed` says why) or becomes a pool
    /// connection (`pool_conn`).
    async fn run(&mut self, stop: &mut watch::Receiver<bool>) {
        loop {
            if self.peer.closing.load(Ordering::Relaxed) {
                break;
            }
            let want_write = self.peer.has_pending();
            let deadline = self.register_by.into_iter().chain(self.frame_by).min();
            let expired = sleep_until(deadline);
            tokio::select! {
                r = self.stream.readable() => {
                    if r.is_err() || !self.on_readable() {
                        break;
                    }
                }
                _ = expired => {
                    self.expired();
                    break;
                }
                r = self.stream.writable(), if want_write => {
                    if r.is_err() || self.peer.try_flush().is_err() {
                        self.closed = Closed::WriteFailed;
                        break;
                    }
                }
                // Another task queued bytes for us: loop to re-check `want_write`.
                _ = self.peer.flush.notified() => {}
                _ = stop.changed() => {
                    self.closed = Closed::Shutdown;
                    break;
                }
            }
        }
    }

    /// Reads what the socket has and handles each whole message in it. `false`: the
    /// connection ends.
    fn on_readable(&mut self) -> bool {
        match read_into(&self.stream, &mut self.decoder) {
            Ok(false) => return false,
            Ok(true) => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return true,
            Err(_) => return false,
        }
        let mut frames = 0;
        loop {
            let msg = match self.decoder.next_payload() {
                Ok(Some(p)) => decode_client(p),
                Ok(None) => break,
                Err(e) => Err(ClientDecodeError::Protocol(e)),
            };
            frames += 1;
            let msg = match msg {
                Ok(m) => m,
                Err(e) => {
                    self.malformed(e);
                    return false;
                }
            };
            if !self.on_message(msg) {
                return false;
            }
        }
        self.charge_partial(frames)
    }

    /// Tells the client why its frame or message is refused; the connection ends.
    fn malformed(&mut self, e: ClientDecodeError) {
        self.closed = Closed::Malformed;
        let (code, text) = match &e {
            ClientDecodeError::Control => (
                ErrorCode::WrongSocket,
                "control requests are refused on the client socket; use the control socket"
                    .to_string(),
            ),
            ClientDecodeError::Invalid(f) => {
                (ErrorCode::InvalidArgument, format!("invalid message: {f}"))
            }
            // serde's text can quote the peer's bytes: bound it.
            ClientDecodeError::Protocol(p) => (p.code(), log_safe(&p.to_string()).into_owned()),
        };
        self.peer.send(&ArbiterMsg::Error {
            code,
            message: text,
        });
    }

    /// One message: within the rate, allowed on this kind of connection (its first
    /// message may make it a pool or a view connection), then handled
    /// ([`handle_client_msg`]). `false`: the connection ends.
    fn on_message(&mut self, msg: ClientMsg) -> bool {
        if !self.rate.allow() {
            self.closed = Closed::RateLimited;
            self.peer.send(&ArbiterMsg::Error {
                code: ErrorCode::RateLimited,
                message: "too many messages; slow down".into(),
            });
            return false;
        }
        if matches!(msg, ClientMsg::PoolOpen) {
            if self.my_gpu.is_none() && self.shared.pool.is_some() {
                self.pool_conn = true;
                return false;
            }
            self.closed = Closed::Refused;
            let message = if self.shared.pool.is_none() {
                "this node has no swap pool (kiwi-arbiter --swap-pool off)"
            } else {
                "pool_open must be a connection's first message"
            };
            self.peer.send(&ArbiterMsg::Error {
                code: ErrorCode::InvalidArgument,
                message: message.into(),
            });
            return false;
        }
        // A `view` before any registration makes this a view connection
        // (the shim's NVML answers): no deadline, and no registering.
        if matches!(msg, ClientMsg::View { .. }) && self.my_gpu.is_none() {
            self.viewer = true;
            self.register_by = None;
        } else if self.viewer && !matches!(msg, ClientMsg::View { .. } | ClientMsg::Ping { .. }) {
            self.closed = Closed::Refused;
            self.peer.send(&ArbiterMsg::Error {
                code: ErrorCode::InvalidArgument,
                message: "a view connection carries only view and ping".into(),
            });
            return false;
        }
        let registering = matches!(msg, ClientMsg::Register(_));
        let used = self.used_bytes(&msg);
        if !handle_client_msg(
            &self.shared,
            self.id,
            self.host_pid,
            &self.origin,
            &self.peer,
            msg,
            used,
        ) {
            self.closed = Closed::Refused;
            return false;
        }
        if registering {
            self.my_gpu = self
                .shared
                .lock()
                .clients
                .get(&self.id)
                .and_then(|c| c.gpu.clone());
            if self.my_gpu.is_some() {
                self.register_by = None;
            }
        }
        true
    }

    /// For a `no_room`: the driver's used memory on this connection's GPU, asked at
    /// most every [`USED_PROBE_INTERVAL`] (between, the last answer stands).
    fn used_bytes(&mut self, msg: &ClientMsg) -> Option<u64> {
        match (msg, &self.probe, &self.my_gpu) {
            (ClientMsg::NoRoom { .. }, Some(p), Some(g)) => match self.probed {
                Some((at, u)) if at.elapsed() < USED_PROBE_INTERVAL => u,
                _ => {
                    let u = p.used_bytes(g);
                    self.probed = Some((tokio::time::Instant::now(), u));
                    u
                }
            },
            _ => None,
        }
    }

    /// After the whole messages of a read (`frames` of them), the frame in progress,
    /// if any. `false`: the node's budget has no room for it; the connection ends.
    fn charge_partial(&mut self, frames: usize) -> bool {
        // The frame in progress, if any: its deadline starts with its first
        // byte, and it is charged in full from its header on.
        let partial = self.decoder.partial_frame();
        self.frame_by = match partial {
            None => None,
            Some(_) if frames > 0 || self.frame_by.is_none() => {
                Some(tokio::time::Instant::now() + self.limits.frame_timeout)
            }
            Some(_) => self.frame_by,
        };
        let want = partial.unwrap_or(0);
        if !self.shared.partial.charge(&mut self.charged, want) {
            let budget = self.shared.partial.limit;
            self.closed = Closed::FrameBudget;
            self.peer.send(&ArbiterMsg::Error {
                code: ErrorCode::RateLimited,
                message: format!("the arbiter is buffering too many partly sent frames ({} MiB); a frame of {want} bytes is refused", budget >> 20),
            });
            return false;
        }
        true
    }

    /// The registration's or the frame's deadline passed: tells the client which;
    /// the connection ends.
    fn expired(&mut self) {
        let limits = self.limits;
        let (code, message) = if self
            .register_by
            .is_some_and(|d| d <= tokio::time::Instant::now())
        {
            self.closed = Closed::NotRegistered;
            (
                ErrorCode::NotRegistered,
                format!(
                    "no registration within {} ms of connecting; closing",
                    limits.register_timeout.as_millis()
                ),
            )
        } else {
            self.closed = Closed::FrameTimeout;
            (
                ErrorCode::Timeout,
                format!(
                    "a frame was not completed within {} ms; closing",
                    limits.frame_timeout.as_millis()
                ),
            )
        };
        self.peer.send(&ArbiterMsg::Error { code, message });
    }

    /// Hands the connection to [`pool::serve`] (its first message was `pool_open`):
    /// it is no client of a GPU.
    async fn into_pool(mut self, tenant_of_pool: Tenant, stop: watch::Receiver<bool>) {
        let shared = self.shared;
        shared.partial.charge(&mut self.charged, 0);
        shared.lock().clients.remove(&self.id);
        if let Some(p) = shared.pool.clone() {
            pool::serve(
                shared.clone(),
                p,
                self.stream,
                self.decoder,
                self.id,
                self.host_pid,
                tenant_of_pool,
                self.rate,
                stop,
            )
            .await;
        }
    }

    /// The connection ended: says why where the client can still hear it (and, for
    /// unread replies, gives it a moment to), logs and counts why the arbiter closed
    /// it, and takes the client off its GPU ([`leave`]).
    async fn close(self) {
        let Conn {
            shared,
            stream,
            peer,
            id,
            host_pid,
            decoder,
            mut charged,
            mut closed,
            ..
        } = self;
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
        leave(&shared, id, host_pid);
    }
}

/// Forgets client `id`: its GPU's scheduler steps its exit, its group's turn moves
/// on without it, and a GPU left without clients may be forgotten.
fn leave(shared: &Shared, id: ClientId, host_pid: u32) {
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

pub(super) enum ClientDecodeError {
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
pub(super) fn decode_client(payload: &[u8]) -> Result<ClientMsg, ClientDecodeError> {
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
