//! `kiwi-arbiter`: binds the client and control sockets, serves, and removes them
//! on SIGTERM/SIGINT. Flags win over `/etc/kiwi/config.toml` (or `KIWI_CONFIG`).

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Parser;
use kiwi_arbiter::{serve, ServerConfig};
use kiwi_config::{client_dir, client_socket, control_socket, Config, SchedulerMode};
use tokio::net::UnixListener;
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
    let server_cfg = ServerConfig {
        scheduler,
        tq_ms: ((tq_s * 1000.0).round() as u64).max(1),
        grace_ms: args.grace_ms.unwrap_or(cfg.arbiter.grace_ms),
        reserve_mib: args.reserve_mib.or(cfg.arbiter.reserve_mib),
        event_log_capacity: args
            .event_log_capacity
            .unwrap_or(cfg.arbiter.event_log_capacity)
            .max(1),
        ..ServerConfig::default()
    };

    std::fs::create_dir_all(client_dir(&dir))
        .with_context(|| format!("cannot create socket directory {}", dir.display()))?;
    let client_path = client_socket(&dir);
    let control_path = control_socket(&dir);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the runtime")?;
    rt.block_on(async move {
        let client = bind(&client_path, 0o666)?;
        let control = match bind(&control_path, 0o600) {
            Ok(l) => l,
            Err(e) => {
                let _ = std::fs::remove_file(&client_path);
                return Err(e);
            }
        };
        eprintln!(
            "[INFO] kiwi-arbiter listening on {} (control {}), scheduler {}, TQ {} s",
            client_path.display(),
            control_path.display(),
            scheduler,
            server_cfg.tq_ms as f64 / 1000.0
        );
        let mut term = signal(SignalKind::terminate())?;
        let mut int = signal(SignalKind::interrupt())?;
        let shutdown = async move {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
        };
        let res = serve(server_cfg, client, control, shutdown).await;
        let _ = std::fs::remove_file(&client_path);
        let _ = std::fs::remove_file(&control_path);
        res
    })
}

/// Binds a socket with `mode`, refusing to steal one a live arbiter still serves.
fn bind(path: &Path, mode: u32) -> Result<UnixListener> {
    if path.exists() {
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            bail!("another kiwi-arbiter is already serving {}", path.display());
        }
        std::fs::remove_file(path)
            .with_context(|| format!("cannot remove stale socket {}", path.display()))?;
    }
    // Bind under a umask that leaves the socket no wider than `mode`, so the control
    // socket is never reachable by others, not even briefly.
    // SAFETY: umask only changes this process's file-creation mask; no memory involved.
    let old = unsafe { libc::umask(0o777 & !mode as libc::mode_t) };
    let res = UnixListener::bind(path);
    // SAFETY: as above, restoring the previous mask.
    unsafe { libc::umask(old) };
    let listener = res.with_context(|| format!("cannot listen on {}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .with_context(|| format!("cannot set mode of {}", path.display()))?;
    Ok(listener)
}
