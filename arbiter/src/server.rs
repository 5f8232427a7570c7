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
//!
//! Divided by what each part owns:
//! - `limits`: the caps and budgets above, and the log's throttle;
//! - `peer`: a connection's writing half, the non-blocking writes other tasks
//!   make to it, and what waits when its socket is full;
//! - `state`: everything the daemon knows, behind one mutex, and the dispatch of
//!   each scheduler step's outputs;
//! - `client`: the client sockets' accept loop and each connection's task
//!   (`client/messages.rs`: what each message does);
//! - `control`: the control socket and its requests;
//! - `timer`: the schedulers' deadlines and the reconcile with NVML;
//! - `containers`, `pool`, `checkpoints`: each container's own socket, the
//!   swap pool's connections, whole-process checkpoints;
//! - `socket`: binding a socket file (a leaf, which `daemon.rs` uses too).
//!
//! This file keeps [`serve`], which starts and stops the rest, and its settings.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use kiwi_config::SchedulerMode;
use kiwi_protocol::Settings;
use tokio::net::UnixListener;
use tokio::sync::watch;

use crate::clock::monotonic_ns;
use crate::gpus;

// The logging macros first: every module after it uses them.
#[macro_use]
mod logging;
mod checkpoints;
mod client;
mod containers;
mod control;
mod limits;
mod peer;
mod pool;
pub(crate) mod socket;
mod state;
mod timer;

use client::Origin;
use limits::Limits;
pub use limits::{raise_fd_limit, FD_RESERVE, SMALL_FRAME};
use state::Shared;

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
    let (max_connections, limits) = connection_limits(&cfg);
    let pool = start_pool(&mut cfg)?;
    let (stop_tx, stop_rx) = watch::channel(false);
    let (checkpoint_tx, checkpoint_rx) = match &cfg.checkpointer {
        Some(_) => {
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            (Some(tx), Some(rx))
        }
        None => (None, None),
    };
    let shared = Arc::new(Shared::new(
        &cfg,
        defaults,
        max_connections,
        limits,
        pool.clone(),
        stop_rx.clone(),
        checkpoint_tx,
    ));
    containers::serve_recorded(&shared);

    let timer = tokio::spawn(timer::run_timers(shared.clone(), stop_rx.clone()));
    let reconcile = cfg
        .used_memory
        .clone()
        .map(|used| tokio::spawn(timer::run_reconcile(shared.clone(), used, stop_rx.clone())));
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
    let clients = tokio::spawn(client::accept_clients(
        shared.clone(),
        client_listener,
        Origin::Node,
        None,
    ));
    let control = tokio::spawn(control::accept_control(
        shared.clone(),
        control_listener,
        stop_rx.clone(),
    ));
    let metrics = metrics_listener.map(|l| serve_metrics(&shared, l, stop_rx.clone()));

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

/// The node's connection cap (client connections stop [`FD_RESERVE`] short of the
/// descriptor limit, raised first) and the per-connection limits, logged.
fn connection_limits(cfg: &ServerConfig) -> (usize, Limits) {
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
    (max_connections, limits)
}

/// Starts the node's swap pool (and its disk tier) when configured. The pool and its
/// disk tier are the swap budget (issue #37: admission is the pool): without one
/// set, the budget is what they can hold at start; one the operator sets is bounded
/// by it.
fn start_pool(cfg: &mut ServerConfig) -> anyhow::Result<Option<Arc<crate::pool::Pool>>> {
    let Some(p) = cfg.swap_pool else {
        return Ok(None);
    };
    let pool = crate::pool::Pool::start(p).context("cannot start the node's swap pool")?;
    let s = pool.stats();
    log_line!(
        "INFO",
        "swap pool: {} MiB of host memory lent to clients for their swap-outs ({} pages, {} MiB populated at start)",
        s.size >> 20,
        s.page_mode,
        s.floor >> 20,
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
    let holds = s.size.saturating_add(pool.spill_room());
    cfg.swap_budget_bytes = Some(cfg.swap_budget_bytes.map_or(holds, |b| b.min(holds)));
    log_line!(
        "INFO",
        "swap budget: {} MiB (the pool and its disk tier hold {} MiB): a growth whose swap need passes it fails with out-of-memory",
        cfg.swap_budget_bytes.unwrap_or(0) >> 20,
        holds >> 20
    );
    Ok(Some(pool))
}

/// Serves `/metrics` on `listener` until the daemon stops: the metrics and, at each
/// scrape, the GPUs' status and the node's swap figures.
fn serve_metrics(
    shared: &Arc<Shared>,
    listener: tokio::net::TcpListener,
    mut stop: watch::Receiver<bool>,
) -> tokio::task::JoinHandle<()> {
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
    tokio::spawn(kiwi_metrics::serve(listener, render, async move {
        let _ = stop.changed().await;
    }))
}
