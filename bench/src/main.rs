//! `kiwi-bench <scenario>`: Kiwi's benchmarks. Every figure is printed next to a
//! baseline measured in the same run, as a ratio (`--json`: one object per line).

mod checkpoint;
mod gang;
mod handoff;
mod jobs;
mod livebytes;
mod markdown;
mod newcomer;
mod pipeline;
mod procs;
mod report;
mod shimbench;
mod soak;
mod spill;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "kiwi-bench", version, about = "Kiwi benchmarks")]
struct Cli {
    /// One JSON object per figure and line.
    #[arg(long, global = true)]
    json: bool,
    /// A short run (under 30 s), same output.
    #[arg(long, global = true)]
    quick: bool,
    #[command(subcommand)]
    scenario: Scenario,
}

#[derive(Subcommand)]
enum Scenario {
    /// GPU hand-off latency between N client processes vs. a raw socket round trip.
    Handoff {
        #[arg(long, default_value_t = 8)]
        clients: usize,
        /// Grants per client.
        #[arg(long)]
        rounds: Option<u32>,
    },
    /// What idle connected clients cost the arbiter (RSS, CPU).
    Idle {
        #[arg(long, default_value_t = 256)]
        clients: usize,
    },
    /// cuLaunchKernel through the shim vs. the driver directly.
    LaunchOverhead,
    /// Swap throughput vs. the pinned copy bandwidth.
    Swap,
    /// Time from a drop to the release for apps queueing 10,000 short kernels.
    DropLatency,
    /// The swap pool's disk tier (spill out, read back) vs. plain writes and reads of
    /// the same bytes on the same disk.
    Spill {
        /// Where the spill directory is made (a fresh subdirectory, removed at the
        /// end); default: the temp dir.
        #[arg(long)]
        dir: Option<PathBuf>,
    },
    /// Every scenario, one after the other.
    All {
        /// Also write the figures as Markdown.
        #[arg(long)]
        markdown: bool,
        /// Where the Markdown goes.
        #[arg(long, default_value = "docs/benchmarks.md")]
        output: PathBuf,
    },
    /// Two jobs of 70% of GPU memory each: Kiwi vs. serial vs. no Kiwi, and a TQ sweep.
    Oversub,
    /// Two jobs that fit: Kiwi vs. the scheduler off.
    Fit,
    /// 2-GPU jobs (two ranks that wait for each other every step) beside a notebook
    /// on each GPU, and two such jobs crosswise: group turns against the ideal
    /// interleave and against per-GPU turns (issue #41).
    Gang,
    /// The cold (first ever) and a steady hand-off, and the hand-off against
    /// max(swap-out alone, swap-in alone).
    HandoffSwap,
    /// Request-to-first-work of a notebook whose only partner idles (idle eviction)
    /// against its own swap-in.
    IdlePartner,
    /// A holder that goes idle while another waits: its last work's completion to
    /// the waiter's grant, minus KIWI_IDLE_MS.
    EarlyRelease,
    /// Two JAX-like programs (75% of free preallocated, 5% used) with and without
    /// the discard hint, against the same programs allocating only what they use.
    LiveBytes,
    /// A newcomer's first CUDA call to its context beside an idle holder of 90% of
    /// the GPU, against that holder's swap-out alone.
    Newcomer,
    /// Whole-process eviction (issue #25): a 2.9 GiB notebook and three newcomers whose
    /// contexts leave it no room, with the driver's checkpoint API: the checkpoint of
    /// an idle process's residual against the simulator's modelled cost, and the
    /// makespan against the four run one after another.
    Checkpoint,
    /// A node under load and faults (issue #38): many verifying clients on several
    /// simulated GPUs while clients and the arbiter are killed, and tenants storm or
    /// never read; fails if any client loses a byte or waits past its bound, or if
    /// anything is left behind. Prints hand-offs under load against a quiet run.
    Soak {
        #[arg(long, default_value_t = 4)]
        gpus: u32,
        #[arg(long, default_value_t = 32)]
        clients: usize,
        #[arg(long, default_value_t = 120)]
        seconds: u64,
        /// Each simulated GPU's memory, MiB: smaller GPUs oversubscribe with fewer
        /// clients (a client alone needs about 700).
        #[arg(long, default_value_t = 4096, value_parser = clap::value_parser!(u64).range(768..=81920))]
        gpu_mib: u64,
        /// Replays a run (printed by every run); default: from the clock.
        #[arg(long)]
        seed: Option<u64>,
        /// Only these client patterns (comma-separated: notebook, grower, prealloc,
        /// discard, idle, vmm, managed, ipc-pair, container), to replay a failure of one.
        #[arg(long, value_delimiter = ',')]
        patterns: Vec<String>,
    },
    #[command(name = "__arbiter", hide = true)]
    Arbiter {
        #[arg(long)]
        socket_dir: PathBuf,
        #[arg(long)]
        tq: f64,
        #[arg(long, default_value = "on")]
        scheduler: String,
        /// `[arbiter] idle_evict_seconds`, in ms (0: off); default: the arbiter's.
        #[arg(long)]
        idle_evict_ms: Option<u64>,
        /// Load the driver's checkpoint API (the simulator's, from this process's
        /// environment).
        #[arg(long)]
        checkpoint: bool,
        /// `[arbiter] swap_pool`: the daemon's default, so that swaps go where they
        /// go on a node (into the pool's slices).
        #[arg(long, default_value = "auto")]
        swap_pool: kiwi_config::SwapPool,
        /// `[arbiter] swap_pool_floor_mib`: populated at start and kept ready.
        #[arg(long, default_value_t = 0)]
        swap_pool_floor_mib: u64,
    },
    #[command(name = "__launch-overhead", hide = true)]
    LaunchOverheadRole { shim: PathBuf },
    #[command(name = "__copy-bandwidth", hide = true)]
    CopyBandwidthRole {
        bytes: usize,
        /// One way only: `d2h` or `h2d`, from `--start-ns` to `--end-ns`.
        #[arg(long)]
        dir: Option<String>,
        #[arg(long, default_value_t = 0)]
        start_ns: u64,
        #[arg(long, default_value_t = 0)]
        end_ns: u64,
    },
    #[command(name = "__newcomer", hide = true)]
    NewcomerRole,
    #[command(name = "__create-rate", hide = true)]
    CreateRateRole { bytes: usize, segment: usize },
    #[command(name = "__handoff-client", hide = true)]
    HandoffClient {
        #[arg(long)]
        socket: PathBuf,
        #[arg(long)]
        rounds: u32,
    },
    #[command(name = "__echo", hide = true)]
    Echo {
        #[arg(long)]
        socket: PathBuf,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kiwi-bench: {e:#}");
            ExitCode::from(1)
        }
    }
}

fn run(cli: Cli) -> Result<()> {
    let figures = match cli.scenario {
        Scenario::Handoff { clients, rounds } => {
            let rounds = rounds.unwrap_or(if cli.quick { 100 } else { 1000 });
            handoff::run(clients, rounds)?
        }
        Scenario::Idle { clients } => {
            let watch = Duration::from_secs(if cli.quick { 1 } else { 3 });
            handoff::idle(clients, watch)?
        }
        Scenario::All { markdown, output } => {
            return run_all(cli.quick, cli.json, markdown.then_some(output))
        }
        Scenario::Oversub => jobs::oversub(cli.quick)?,
        Scenario::LaunchOverhead => shimbench::launch_overhead(cli.quick)?,
        Scenario::Swap => shimbench::swap(cli.quick)?,
        Scenario::DropLatency => shimbench::drop_latency(cli.quick)?,
        Scenario::Spill { dir } => spill::spill(cli.quick, dir.as_deref())?,
        Scenario::LaunchOverheadRole { shim } => return shimbench::launch_overhead_role(&shim),
        Scenario::CopyBandwidthRole {
            bytes,
            dir,
            start_ns,
            end_ns,
        } => {
            let one_way = match dir.as_deref() {
                None => None,
                Some("d2h") => Some((true, start_ns, end_ns)),
                Some("h2d") => Some((false, start_ns, end_ns)),
                Some(d) => anyhow::bail!("--dir: d2h or h2d, not {d:?}"),
            };
            return shimbench::copy_bandwidth_role(bytes, one_way);
        }
        Scenario::CreateRateRole { bytes, segment } => {
            return shimbench::create_rate_role(bytes, segment)
        }
        Scenario::Fit => jobs::fit(cli.quick)?,
        Scenario::Gang => gang::gang(cli.quick)?,
        Scenario::HandoffSwap => pipeline::handoff_swap(cli.quick)?,
        Scenario::IdlePartner => pipeline::idle_partner(cli.quick)?,
        Scenario::EarlyRelease => pipeline::early_release(cli.quick)?,
        Scenario::LiveBytes => livebytes::live_bytes(cli.quick)?,
        Scenario::Newcomer => newcomer::newcomer(cli.quick)?,
        Scenario::Checkpoint => checkpoint::checkpoint(cli.quick)?,
        Scenario::Soak {
            gpus,
            clients,
            seconds,
            gpu_mib,
            seed,
            patterns,
        } => soak::soak(&soak::SoakOptions {
            gpus,
            clients,
            seconds,
            gpu_memory: gpu_mib << 20,
            seed: seed.unwrap_or_else(|| procs::monotonic_ns() % 1_000_000),
            patterns,
        })?,
        Scenario::NewcomerRole => return newcomer::newcomer_role(),
        Scenario::Arbiter {
            socket_dir,
            tq,
            scheduler,
            idle_evict_ms,
            checkpoint,
            swap_pool,
            swap_pool_floor_mib,
        } => {
            return arbiter_role(
                socket_dir,
                tq,
                &scheduler,
                idle_evict_ms,
                checkpoint,
                swap_pool,
                swap_pool_floor_mib << 20,
            )
        }
        Scenario::HandoffClient { socket, rounds } => {
            return handoff::client_role(&socket, rounds, true)
        }
        Scenario::Echo { socket } => return handoff::echo_role(&socket),
    };
    for f in &figures {
        f.print(cli.json);
    }
    Ok(())
}

type ScenarioFn = Box<dyn Fn(bool) -> Result<Vec<report::Figure>>>;

/// Every scenario; a failing one is reported and the others still run.
fn run_all(quick: bool, json: bool, markdown: Option<PathBuf>) -> Result<()> {
    let scenarios: Vec<(&str, ScenarioFn)> = vec![
        (
            "handoff",
            Box::new(|q| handoff::run(8, if q { 100 } else { 1000 })),
        ),
        (
            "idle",
            Box::new(|q| handoff::idle(256, Duration::from_secs(if q { 1 } else { 3 }))),
        ),
        ("launch-overhead", Box::new(shimbench::launch_overhead)),
        ("swap", Box::new(shimbench::swap)),
        ("drop-latency", Box::new(shimbench::drop_latency)),
        ("spill", Box::new(|q| spill::spill(q, None))),
        ("handoff-swap", Box::new(pipeline::handoff_swap)),
        ("idle-partner", Box::new(pipeline::idle_partner)),
        ("early-release", Box::new(pipeline::early_release)),
        ("live-bytes", Box::new(livebytes::live_bytes)),
        ("newcomer", Box::new(newcomer::newcomer)),
        ("checkpoint", Box::new(checkpoint::checkpoint)),
        ("oversub", Box::new(jobs::oversub)),
        ("fit", Box::new(jobs::fit)),
        ("gang", Box::new(gang::gang)),
    ];
    let mut figures = Vec::new();
    let mut errors = Vec::new();
    for (name, f) in scenarios {
        eprintln!(
            "kiwi-bench: running {name}{}",
            if quick { " (quick)" } else { "" }
        );
        match f(quick) {
            Ok(figs) => {
                for fig in &figs {
                    fig.print(json);
                }
                figures.extend(figs);
            }
            Err(e) => {
                eprintln!("kiwi-bench: {name} failed: {e:#}");
                errors.push((name.to_string(), format!("{e:#}")));
            }
        }
    }
    if let Some(path) = markdown {
        let cmd = format!(
            "kiwi-bench all --markdown{}",
            if quick { " --quick" } else { "" }
        );
        std::fs::write(&path, markdown::render(&figures, &errors, &cmd))
            .with_context(|| format!("cannot write {}", path.display()))?;
        eprintln!("kiwi-bench: wrote {}", path.display());
    }
    if errors.is_empty() {
        Ok(())
    } else {
        anyhow::bail!("{} scenario(s) failed", errors.len())
    }
}

/// The arbiter, in this process (the same library code as `kiwi-arbiter`).
fn arbiter_role(
    socket_dir: PathBuf,
    tq: f64,
    scheduler: &str,
    idle_evict_ms: Option<u64>,
    checkpoint: bool,
    swap_pool: kiwi_config::SwapPool,
    swap_pool_floor: u64,
) -> Result<()> {
    let mut cfg = kiwi_arbiter::ServerConfig {
        tq: kiwi_config::Quantum::from_secs(tq)?,
        scheduler: scheduler.parse().map_err(anyhow::Error::msg)?,
        // Every benchmark client is a child of this process, in one cgroup; on a node
        // they are separate containers, each under its own per-container cap.
        max_conns_per_group: usize::MAX,
        // Nor a stranger to protect from another's hint wait: the clients' own
        // `KIWI_HINT_WAIT_MS` stands (`bench/tests/quick.rs` raises it for loaded
        // hosts).
        max_hint_wait_ms: u64::MAX,
        swap_pool: kiwi_arbiter::pool::PoolConfig::from_setting(swap_pool, swap_pool_floor),
        ..Default::default()
    };
    if let Some(ms) = idle_evict_ms {
        cfg.idle_evict_ms = ms;
    }
    if checkpoint {
        let d = kiwi_arbiter::checkpoint::DriverCheckpointer::load().map_err(anyhow::Error::msg)?;
        cfg.checkpointer = Some(std::sync::Arc::new(d));
    }
    // A benchmark killed mid-run (Ctrl-C, a timeout) leaves no arbiter behind.
    // SAFETY: prctl(PR_SET_PDEATHSIG) takes a signal number and touches no memory.
    unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        kiwi_arbiter::run_daemon(&socket_dir, cfg, async move {
            term.recv().await;
        })
        .await
    })
}
