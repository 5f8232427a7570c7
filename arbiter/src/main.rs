//! `kiwi-arbiter`: binds the client and control sockets, serves, and removes them
//! on SIGTERM/SIGINT. Flags win over `/etc/kiwi/config.toml` (or `KIWI_CONFIG`).

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Parser;
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
}

fn main() {
    if let Err(e) = run() {
        eprintln!("kiwi-arbiter: {e:#}");
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
    let server_cfg = ServerConfig {
        scheduler,
        tq_ms: ((tq_s * 1000.0).round() as u64).max(1),
        grace_ms: args.grace_ms.unwrap_or(cfg.arbiter.grace_ms),
        reserve_mib: args.reserve_mib.or(cfg.arbiter.reserve_mib),
        event_log_capacity: args
            .event_log_capacity
            .unwrap_or(cfg.arbiter.event_log_capacity)
            .max(1),
        metrics_addr: args.metrics_addr.or(cfg.arbiter.metrics_addr),
        swap_budget_bytes: (swap_budget_bytes > 0).then_some(swap_budget_bytes),
        ..ServerConfig::default()
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
