//! `kiwi-arbiter`: binds the client and control sockets, serves, and removes them
//! on SIGTERM/SIGINT. Flags win over `/etc/kiwi/config.toml` (or `KIWI_CONFIG`).

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Parser;
use kiwi_arbiter::gpus::NvmlSetting;
use kiwi_arbiter::{run_daemon, ServerConfig};
use kiwi_config::{Config, SchedulerMode};
use tokio::signal::unix::{signal, SignalKind};

#[derive(Parser, Debug)]
#[command(
    name = "kiwi-arbiter",
    version,
    about = "The Kiwi Scheduler: arbitrates GPU access between applications on this node."
)]
struct Args {
    /// Socket directory (default: $KIWI_SOCKET_DIR, the config file, /run/kiwi).
    #[arg(long)]
    socket_dir: Option<PathBuf>,
    /// Config file (default: $KIWI_CONFIG, /etc/kiwi/config.toml).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Time quantum in seconds (default 30).
    #[arg(long, value_parser = kiwi_config::parse_tq_arg)]
    tq: Option<f64>,
    /// Start with the scheduler on or off.
    #[arg(long, value_parser = ["on", "off"])]
    scheduler: Option<String>,
    /// How long a holder may ignore a drop before the GPU is taken from it, in ms.
    #[arg(long)]
    grace_ms: Option<u64>,
    /// On an oversubscribed GPU, ask a client that neither holds nor waits to swap
    /// out in the background after this many idle seconds (default 30; 0: never;
    /// config: [arbiter] idle_evict_seconds).
    #[arg(long, value_name = "SECONDS", allow_hyphen_values = true)]
    idle_evict_seconds: Option<String>,
    /// GPU memory reserved for contexts, in MiB (default: 1536, at most 1/8 of the GPU).
    #[arg(long)]
    reserve_mib: Option<u64>,
    /// Events kept per GPU.
    #[arg(long)]
    event_log_capacity: Option<usize>,
    /// Serve Prometheus metrics on this address, e.g. 127.0.0.1:9400.
    #[arg(long)]
    metrics_addr: Option<String>,
    /// Host RAM this node lends as GPU swap, over all GPUs and clients, e.g. 64GiB or
    /// 512MiB (config: [arbiter] swap_budget_mib). A client whose working set would
    /// push the node's swap need (the GPU memory that does not fit, summed over GPUs)
    /// past it is refused the allocation. 0 or absent: unlimited.
    #[arg(long, value_name = "SIZE", allow_hyphen_values = true)]
    swap_budget: Option<String>,
    /// The node's swap pool (config: [arbiter] swap_pool): host memory the arbiter
    /// owns, populates ahead and lends to clients for their swap-outs, so a pod's
    /// memory limit never pays for its GPU's idle memory. auto (half the host's
    /// available memory), off (clients swap into their own memory), or a size; it
    /// bounds a swap budget set beside it.
    #[arg(long, value_name = "auto|off|SIZE")]
    swap_pool: Option<String>,
    /// Bytes of the swap pool populated at start and kept ready (config: [arbiter]
    /// swap_pool_floor_mib; default 0: populated ahead as working sets grow).
    #[arg(long, value_name = "SIZE")]
    swap_pool_floor: Option<String>,
    /// The swap pool's disk tier (config: [arbiter] spill_dir): a directory on local
    /// disk where the swapped-out memory of the processes idle longest moves when the
    /// pool runs short. Absent: no disk tier.
    #[arg(long, value_name = "DIR")]
    spill_dir: Option<std::path::PathBuf>,
    /// The most the disk tier holds (config: [arbiter] spill_budget_mib). Absent:
    /// the disk's free space, less a reserve of 5% (at most 1 GiB).
    #[arg(long, value_name = "SIZE")]
    spill_budget: Option<String>,
    /// Where to learn each GPU's UUID and memory (config: [arbiter] nvml): auto
    /// (libnvidia-ml.so.1 if it loads), off (a GPU's first registration sets its size),
    /// or the path of an NVML library, which must load. With NVML, registrations for
    /// other GPUs or other sizes are refused.
    #[arg(long, value_name = "auto|off|PATH")]
    nvml: Option<String>,
    /// Whole-process eviction (config: [arbiter] checkpoint): auto (the driver's
    /// checkpoint API, driver 570 or later, when libcuda.so.1 loads and has it; idle
    /// clients' whole processes, contexts included, are then checkpointed to host
    /// memory when paging cannot make enough room) or off.
    #[arg(long, value_name = "auto|off")]
    checkpoint: Option<String>,
    /// Most client connections (default 4096; never above RLIMIT_NOFILE − 64, which
    /// stay for the control socket). See docs/protocol.md, "Limits".
    #[arg(long, value_name = "N", help_heading = "Limits")]
    max_connections: Option<usize>,
    /// Most client connections from one container (on its own socket), or from one
    /// host uid on the node's socket, default 64.
    #[arg(long, value_name = "N", help_heading = "Limits")]
    max_conns_per_group: Option<usize>,
    /// Close a connection that has not registered within this many ms (default 5000).
    #[arg(long, value_name = "MS", help_heading = "Limits")]
    register_timeout_ms: Option<u64>,
    /// Close a connection whose frame is not complete this many ms after its first
    /// byte (default 5000).
    #[arg(long, value_name = "MS", help_heading = "Limits")]
    frame_timeout_ms: Option<u64>,
    /// Bytes of partly received frames buffered over all connections (default 64MiB).
    #[arg(long, value_name = "SIZE", help_heading = "Limits")]
    partial_frame_budget: Option<String>,
    /// Memory the event log may hold over all GPUs (default 64MiB).
    #[arg(long, value_name = "SIZE", help_heading = "Limits")]
    event_log_bytes: Option<String>,
    /// Raise RLIMIT_NOFILE (hard and soft) to this at start, for containers that
    /// cannot set it from outside (needs CAP_SYS_RESOURCE). The soft limit is always
    /// raised to the hard one.
    #[arg(
        long,
        value_name = "N",
        env = "KIWI_LIMIT_NOFILE",
        help_heading = "Limits"
    )]
    limit_nofile: Option<u64>,
    /// The longest a client's swap-out waits for its application to say which of its
    /// memory is dead (the shim's KIWI_HINT_WAIT_MS is clamped to it): the next
    /// tenant waits for that answer. Default 100; 0: never wait.
    #[arg(long, value_name = "MS", help_heading = "Limits")]
    max_hint_wait_ms: Option<u64>,
}

fn main() {
    if let Err(e) = run() {
        eprintln!("kiwi-arbiter: {}", kiwi_config::one_line(e.as_ref()));
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    let args = Args::parse();
    let cfg = Config::load(args.config.as_deref())?;
    let dir = cfg.socket_dir(args.socket_dir.as_deref());
    let scheduler = match args.scheduler.as_deref() {
        Some(s) => s.parse::<SchedulerMode>().map_err(anyhow::Error::msg)?,
        None => cfg.arbiter.scheduler,
    };
    let tq_s = args.tq.unwrap_or(cfg.arbiter.tq_seconds);
    // Parsed here rather than by clap, so a bad value is one line, like other errors.
    let swap_budget_bytes = match args.swap_budget.as_deref() {
        Some(s) => kiwi_config::parse_size(s).map_err(|e| anyhow::anyhow!("--swap-budget: {e}"))?,
        None => match cfg.arbiter.swap_budget_mib {
            None => 0,
            Some(mib) => mib.checked_mul(1 << 20).with_context(|| {
                format!("[arbiter] swap_budget_mib = {mib} is too large (bytes overflow 64 bits)")
            })?,
        },
    };
    let swap_pool = swap_pool(&args, &cfg)?;
    let spill = spill(&args, &cfg, swap_pool.is_some())?;
    // Parsed here rather than by clap, so a bad value is one line, like other errors.
    let idle_evict_s = match args.idle_evict_seconds.as_deref() {
        Some(s) => kiwi_config::parse_idle_evict_arg(s)
            .map_err(|e| anyhow::anyhow!("--idle-evict-seconds: {e}"))?,
        None => cfg.arbiter.idle_evict_seconds,
    };
    let nvml_setting = args.nvml.as_deref().unwrap_or(&cfg.arbiter.nvml);
    let nvml: NvmlSetting = nvml_setting
        .parse()
        .map_err(|e| anyhow::anyhow!("--nvml {nvml_setting:?}: {e}"))?;
    let loaded = kiwi_arbiter::gpus::load(&nvml).with_context(|| {
        format!("--nvml {nvml_setting}: NVML is unusable; use --nvml off to run without it")
    })?;
    let checkpoint_setting = args
        .checkpoint
        .as_deref()
        .unwrap_or(&cfg.arbiter.checkpoint);
    let (checkpointer, checkpoint_line) = match checkpoint_setting {
        "off" => (None, "checkpoint: off".to_string()),
        "auto" => match kiwi_arbiter::checkpoint::DriverCheckpointer::load() {
            Ok(d) => (
                Some(std::sync::Arc::new(d) as std::sync::Arc<dyn kiwi_arbiter::checkpoint::Checkpointer>),
                "checkpoint: the driver's checkpoint API (idle processes are checkpointed when paging cannot make room)".to_string(),
            ),
            Err(why) => (None, format!("checkpoint: unavailable, {why}")),
        },
        other => anyhow::bail!(
            "--checkpoint (or [arbiter] checkpoint) {other:?}: must be \"auto\" or \"off\""
        ),
    };
    let server_cfg = ServerConfig {
        scheduler,
        tq_ms: ((tq_s * 1000.0).round() as u64).max(1),
        grace_ms: args.grace_ms.unwrap_or(cfg.arbiter.grace_ms),
        idle_evict_ms: (idle_evict_s * 1000.0).round() as u64,
        reserve_mib: args.reserve_mib.or(cfg.arbiter.reserve_mib),
        event_log_capacity: args
            .event_log_capacity
            .unwrap_or(cfg.arbiter.event_log_capacity)
            .max(1),
        metrics_addr: args.metrics_addr.or(cfg.arbiter.metrics_addr.clone()),
        // A budget the operator sets is bounded by the pool (the smaller of both),
        // said in the start line. Without one, growth is not asked for: an
        // allocation waits for nobody, and a swap-out the full pool refuses goes to
        // the process's own memory with a line.
        swap_budget_bytes: match (swap_budget_bytes, &swap_pool) {
            (0, _) => None,
            (b, p) => Some(p.as_ref().map_or(b, |p| b.min(p.size))),
        },
        gpus: loaded.truth,
        used_memory: loaded.used,
        startup_lines: vec![loaded.line, checkpoint_line],
        checkpointer,
        swap_pool,
        spill,
        ..ServerConfig::default()
    };
    // Each limit: the flag, then the config key, then the arbiter's default; 0 is
    // refused (it would lock every client out or disable a bound).
    let a = &cfg.arbiter;
    let mib = |key: &str, v: Option<u64>| -> Result<Option<usize>> {
        v.map(|m| {
            m.checked_mul(1 << 20)
                .and_then(|b| usize::try_from(b).ok())
                .with_context(|| format!("[arbiter] {key} = {m} is too large"))
        })
        .transpose()
    };
    let size = |flag: &str, v: &Option<String>| -> Result<Option<usize>> {
        v.as_deref()
            .map(|s| {
                kiwi_config::parse_size(s)
                    .map(|b| usize::try_from(b).unwrap_or(usize::MAX))
                    .map_err(|e| anyhow::anyhow!("{flag}: {e}"))
            })
            .transpose()
    };
    let server_cfg = ServerConfig {
        max_connections: positive(
            "--max-connections",
            args.max_connections.or(a.max_connections),
        )?
        .unwrap_or(server_cfg.max_connections),
        max_conns_per_group: positive(
            "--max-conns-per-group",
            args.max_conns_per_group.or(a.max_conns_per_group),
        )?
        .unwrap_or(server_cfg.max_conns_per_group),
        register_timeout_ms: positive(
            "--register-timeout-ms",
            args.register_timeout_ms.or(a.register_timeout_ms),
        )?
        .unwrap_or(server_cfg.register_timeout_ms),
        frame_timeout_ms: positive(
            "--frame-timeout-ms",
            args.frame_timeout_ms.or(a.frame_timeout_ms),
        )?
        .unwrap_or(server_cfg.frame_timeout_ms),
        partial_frame_budget_bytes: positive(
            "--partial-frame-budget",
            size("--partial-frame-budget", &args.partial_frame_budget)?
                .or(mib("partial_frame_budget_mib", a.partial_frame_budget_mib)?),
        )?
        .unwrap_or(server_cfg.partial_frame_budget_bytes),
        event_log_max_bytes: positive(
            "--event-log-bytes",
            size("--event-log-bytes", &args.event_log_bytes)?
                .or(mib("event_log_mib", a.event_log_mib)?),
        )?
        .unwrap_or(server_cfg.event_log_max_bytes),
        limit_nofile: positive("--limit-nofile", args.limit_nofile.or(a.limit_nofile))?,
        // A bound on tenants, not on what the arbiter holds: 0 (never wait) is valid.
        max_hint_wait_ms: args
            .max_hint_wait_ms
            .or(a.max_hint_wait_ms)
            .unwrap_or(server_cfg.max_hint_wait_ms),
        ..server_cfg
    };

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the runtime")?;
    rt.block_on(async move {
        let mut term = signal(SignalKind::terminate())?;
        let mut int = signal(SignalKind::interrupt())?;
        let shutdown = async move {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
        };
        run_daemon(&dir, server_cfg, shutdown).await
    })
}

/// A limit that must be at least 1 when given.
fn positive<T: PartialEq + From<u8>>(flag: &str, v: Option<T>) -> Result<Option<T>> {
    if v == Some(T::from(0)) {
        anyhow::bail!("{flag} must be at least 1");
    }
    Ok(v)
}

/// The swap pool's settings: the flag, else the config key; `None` when off.
fn swap_pool(args: &Args, cfg: &Config) -> Result<Option<kiwi_arbiter::pool::PoolConfig>> {
    let setting = args.swap_pool.as_deref().unwrap_or(&cfg.arbiter.swap_pool);
    let size = match setting {
        "off" => return Ok(None),
        "auto" => kiwi_arbiter::pool::default_size(),
        s => kiwi_config::parse_size(s).map_err(|e| {
            anyhow::anyhow!(
                "--swap-pool (or [arbiter] swap_pool) {s:?}: {e}; use auto, off or a size"
            )
        })?,
    };
    if size == 0 {
        anyhow::bail!("--swap-pool (or [arbiter] swap_pool) is 0; use off to turn the pool off");
    }
    let floor = match args.swap_pool_floor.as_deref() {
        Some(s) => {
            kiwi_config::parse_size(s).map_err(|e| anyhow::anyhow!("--swap-pool-floor: {e}"))?
        }
        None => cfg
            .arbiter
            .swap_pool_floor_mib
            .unwrap_or(0)
            .checked_mul(1 << 20)
            .context("[arbiter] swap_pool_floor_mib is too large (bytes overflow 64 bits)")?,
    };
    Ok(Some(kiwi_arbiter::pool::PoolConfig {
        size,
        floor: floor.min(size),
        ..kiwi_arbiter::pool::PoolConfig::new(size)
    }))
}

/// The disk tier's settings: the flags, else the config keys; `None` when no
/// directory is set. It needs the pool.
fn spill(args: &Args, cfg: &Config, pool: bool) -> Result<Option<kiwi_arbiter::pool::SpillConfig>> {
    let dir = match (&args.spill_dir, &cfg.arbiter.spill_dir) {
        (Some(d), _) => d.clone(),
        (None, Some(d)) => std::path::PathBuf::from(d),
        (None, None) => {
            if args.spill_budget.is_some() || cfg.arbiter.spill_budget_mib.is_some() {
                anyhow::bail!(
                    "a spill budget needs a spill directory (--spill-dir or [arbiter] spill_dir)"
                );
            }
            return Ok(None);
        }
    };
    if !pool {
        anyhow::bail!(
            "the disk tier ({}) needs the swap pool, which is off (--swap-pool off)",
            dir.display()
        );
    }
    let budget = match args.spill_budget.as_deref() {
        Some(s) => {
            Some(kiwi_config::parse_size(s).map_err(|e| anyhow::anyhow!("--spill-budget: {e}"))?)
        }
        None => cfg
            .arbiter
            .spill_budget_mib
            .map(|m| {
                m.checked_mul(1 << 20)
                    .context("[arbiter] spill_budget_mib is too large (bytes overflow 64 bits)")
            })
            .transpose()?,
    };
    if budget == Some(0) {
        anyhow::bail!("the spill budget is 0; leave out the spill directory to have no disk tier");
    }
    Ok(Some(kiwi_arbiter::pool::SpillConfig { dir, budget }))
}
