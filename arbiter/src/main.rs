//! `kiwi-arbiter`: binds the client and control sockets, serves, and removes them
//! on SIGTERM/SIGINT. Flags win over `/etc/kiwi/config.toml` (or `KIWI_CONFIG`).
//!
//! Every `[arbiter]` key is declared once, in [`ArbiterConfig`], as the key and its
//! flag, each value typed and checked where it is read; this file only turns the
//! merged settings into what the daemon needs (loading NVML, the checkpoint API, the
//! swap pool's size).

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result};
use clap::{ArgMatches, CommandFactory, FromArgMatches, Parser};
use kiwi_arbiter::checkpoint::{Checkpointer, DriverCheckpointer};
use kiwi_arbiter::pool::{PoolConfig, SpillConfig};
use kiwi_arbiter::{run_daemon, ServerConfig};
use kiwi_config::{ArbiterConfig, Checkpoint, Config};
use tokio::signal::unix::{signal, SignalKind};

/// The flags that are no `[arbiter]` key; [`cli`] adds [`ArbiterConfig`]'s.
#[derive(Parser, Debug)]
#[command(
    name = "kiwi-arbiter",
    version,
    about = "The Kiwi Scheduler: arbitrates GPU access between applications on this node."
)]
struct Cli {
    /// Socket directory (default: $KIWI_SOCKET_DIR, the config file, /run/kiwi).
    #[arg(long)]
    socket_dir: Option<PathBuf>,
    /// Config file (default: $KIWI_CONFIG, /etc/kiwi/config.toml).
    #[arg(long)]
    config: Option<PathBuf>,
}

/// The whole command line.
fn cli() -> clap::Command {
    ArbiterConfig::flags(Cli::command())
}

fn main() {
    let matches = cli().try_get_matches().unwrap_or_else(|e| {
        // A value a setting refuses is one line, like every other error here.
        match kiwi_config::flag_error(&e) {
            Some(line) => {
                eprintln!("kiwi-arbiter: {line}");
                std::process::exit(1);
            }
            None => e.exit(),
        }
    });
    if let Err(e) = run(&matches) {
        eprintln!("kiwi-arbiter: {}", kiwi_config::one_line(e.as_ref()));
        std::process::exit(1);
    }
}

/// The socket directory and the `[arbiter]` settings: the defaults, the config file
/// over them, the command line over both.
fn settings(matches: &ArgMatches) -> Result<(PathBuf, ArbiterConfig)> {
    let cli = Cli::from_arg_matches(matches)?;
    let cfg = Config::load(cli.config.as_deref())?;
    let dir = cfg.socket_dir(cli.socket_dir.as_deref());
    Ok((dir, cfg.arbiter.merge(matches)?))
}

fn run(matches: &ArgMatches) -> Result<()> {
    let (dir, a) = settings(matches)?;
    let swap_pool = PoolConfig::from_setting(a.swap_pool, a.swap_pool_floor_bytes());
    let spill = spill(&a, swap_pool.is_some())?;
    let loaded = kiwi_arbiter::gpus::load(&a.nvml).with_context(|| {
        format!(
            "--nvml {}: NVML is unusable; use --nvml off to run without it",
            a.nvml
        )
    })?;
    let (checkpointer, checkpoint_line) = checkpointer(a.checkpoint);
    let defaults = ServerConfig::default();
    let bytes = |b: u64| usize::try_from(b).unwrap_or(usize::MAX);
    let server_cfg = ServerConfig {
        scheduler: a.scheduler,
        tq: a.tq_seconds,
        grace_ms: a.grace_ms,
        idle_evict_ms: (a.idle_evict_seconds * 1000.0).round() as u64,
        reserve_mib: a.reserve_mib,
        event_log_capacity: a.event_log_capacity.max(1),
        metrics_addr: a.metrics_addr.clone(),
        // With the pool on, the budget is what the pool and its disk tier hold, or
        // one the operator sets below that (`start_pool`, said in a start line).
        // Without the pool, only a budget the operator sets is asked for.
        swap_budget_bytes: a.swap_budget_bytes(),
        // Each limit: the flag, then the config key, then the arbiter's default (0 is
        // refused where it is read: it would lock every client out or disable a bound).
        max_connections: a.max_connections.unwrap_or(defaults.max_connections),
        max_conns_per_group: a
            .max_conns_per_group
            .unwrap_or(defaults.max_conns_per_group),
        register_timeout_ms: a
            .register_timeout_ms
            .unwrap_or(defaults.register_timeout_ms),
        frame_timeout_ms: a.frame_timeout_ms.unwrap_or(defaults.frame_timeout_ms),
        partial_frame_budget_bytes: a
            .partial_frame_budget_bytes()
            .map_or(defaults.partial_frame_budget_bytes, bytes),
        event_log_max_bytes: a
            .event_log_bytes()
            .map_or(defaults.event_log_max_bytes, bytes),
        limit_nofile: a.limit_nofile,
        // A bound on tenants, not on what the arbiter holds: 0 (never wait) is valid.
        max_hint_wait_ms: a.max_hint_wait_ms.unwrap_or(defaults.max_hint_wait_ms),
        gpus: loaded.truth,
        used_memory: loaded.used,
        startup_lines: vec![loaded.line, checkpoint_line],
        checkpointer,
        swap_pool,
        spill,
        ..defaults
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

/// The driver's checkpoint API when asked for and usable, and the start line that
/// says so.
fn checkpointer(setting: Checkpoint) -> (Option<Arc<dyn Checkpointer>>, String) {
    match setting {
        Checkpoint::Off => (None, "checkpoint: off".to_string()),
        Checkpoint::Auto => match DriverCheckpointer::load() {
            Ok(d) => (
                Some(Arc::new(d) as Arc<dyn Checkpointer>),
                "checkpoint: the driver's checkpoint API (idle processes are checkpointed when paging cannot make room)".to_string(),
            ),
            Err(why) => (None, format!("checkpoint: unavailable, {why}")),
        },
    }
}

/// The disk tier's settings; `None` when no directory is set. It needs the pool.
fn spill(a: &ArbiterConfig, pool: bool) -> Result<Option<SpillConfig>> {
    let budget = a.spill_budget_bytes();
    let Some(dir) = a.spill_dir.clone() else {
        if budget.is_some() {
            anyhow::bail!(
                "a spill budget needs a spill directory (--spill-dir or [arbiter] spill_dir)"
            );
        }
        return Ok(None);
    };
    if !pool {
        anyhow::bail!(
            "the disk tier ({}) needs the swap pool, which is off (--swap-pool off)",
            dir.display()
        );
    }
    if budget == Some(0) {
        anyhow::bail!("the spill budget is 0; leave out the spill directory to have no disk tier");
    }
    Ok(Some(SpillConfig { dir, budget }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiwi_config::{Nvml, SwapPool};

    /// The arbiter's settings from a config file's text and a command line.
    fn arbiter(file: &str, args: &[&str]) -> Result<ArbiterConfig> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("config.toml");
        std::fs::write(&path, file)?;
        let m = cli().try_get_matches_from(
            ["kiwi-arbiter", "--config", path.to_str().unwrap()]
                .into_iter()
                .chain(args.iter().copied()),
        )?;
        Ok(settings(&m)?.1)
    }

    const FILE: &str = "[arbiter]\ntq_seconds = 2\ngrace_ms = 700\ncheckpoint = \"off\"\n\
                        nvml = \"off\"\nmax_conns_per_group = 8\nswap_budget_mib = 64\n";

    #[test]
    fn a_flag_beats_the_file_which_beats_the_default() {
        let d = arbiter("", &[]).unwrap();
        assert_eq!(d.tq_seconds.as_millis(), 30_000);
        assert_eq!(d.grace_ms, 5_000);
        assert_eq!(d.checkpoint, Checkpoint::Auto);
        assert_eq!(d.nvml, Nvml::Auto);
        assert_eq!(d.max_conns_per_group, None);
        assert_eq!(d.swap_budget_bytes(), None);

        let f = arbiter(FILE, &[]).unwrap();
        assert_eq!(f.tq_seconds.as_millis(), 2_000);
        assert_eq!(f.grace_ms, 700);
        assert_eq!(f.checkpoint, Checkpoint::Off);
        assert_eq!(f.nvml, Nvml::Off);
        assert_eq!(f.max_conns_per_group, Some(8));
        assert_eq!(f.swap_budget_bytes(), Some(64 << 20));

        let c = arbiter(
            FILE,
            &[
                "--tq",
                "0.25",
                "--grace-ms",
                "1",
                "--checkpoint",
                "auto",
                "--nvml",
                "auto",
                "--max-conns-per-group",
                "3",
                "--swap-budget",
                "1GiB",
            ],
        )
        .unwrap();
        assert_eq!(c.tq_seconds.as_millis(), 250);
        assert_eq!(c.grace_ms, 1);
        assert_eq!(c.checkpoint, Checkpoint::Auto);
        assert_eq!(c.nvml, Nvml::Auto);
        assert_eq!(c.max_conns_per_group, Some(3));
        assert_eq!(c.swap_budget_bytes(), Some(1 << 30));
    }

    /// A quantum out of range is refused where it is read, with its one message: on
    /// the command line as one line naming the flag, in the file with the file's name
    /// and line. Past that edge it is a [`kiwi_config::Quantum`], checked nowhere else.
    #[test]
    fn a_bad_quantum_is_refused_once_with_its_message() {
        let e = cli()
            .try_get_matches_from(["kiwi-arbiter", "--tq", "0"])
            .unwrap_err();
        assert_eq!(
            kiwi_config::flag_error(&e).as_deref(),
            Some("--tq: TQ must be a positive number of seconds, not 0")
        );
        let e = arbiter("[arbiter]\ntq_seconds = 100000\n", &[]).unwrap_err();
        let line = kiwi_config::one_line(e.as_ref());
        assert!(line.contains("config.toml, line 2: "), "{line}");
        assert!(
            line.ends_with("TQ must be at most 86400 seconds (a day), not 100000"),
            "{line}"
        );
        // A good flag over a bad file is still a bad file: the file is read whole.
        assert!(arbiter("[arbiter]\ntq_seconds = 0\n", &["--tq", "1"]).is_err());
    }

    #[test]
    fn the_disk_tier_needs_a_directory_and_the_pool() {
        let a = arbiter("", &["--spill-budget", "1GiB"]).unwrap();
        let e = spill(&a, true).unwrap_err().to_string();
        assert!(e.contains("needs a spill directory"), "{e}");
        let a = arbiter("", &["--spill-dir", "/x"]).unwrap();
        let e = spill(&a, false).unwrap_err().to_string();
        assert!(e.contains("needs the swap pool"), "{e}");
        let s = spill(&a, true).unwrap().unwrap();
        assert_eq!((s.dir, s.budget), (PathBuf::from("/x"), None));
        let pool = PoolConfig::from_setting(SwapPool::Size(1 << 30), 2 << 30).unwrap();
        assert_eq!((pool.size, pool.floor), (1 << 30, 1 << 30));
        assert!(PoolConfig::from_setting(SwapPool::Off, 0).is_none());
    }

    #[test]
    fn the_command_line_is_well_formed() {
        cli().debug_assert();
        let about = cli().get_about().map(|a| a.to_string());
        assert_eq!(
            about.as_deref(),
            Some("The Kiwi Scheduler: arbitrates GPU access between applications on this node.")
        );
    }
}
