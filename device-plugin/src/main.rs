//! The `kiwi-device-plugin` daemon (and its `bench` subcommand).

mod bench;

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};

use kiwi_device_plugin::devices::DeviceListStrategy;
use kiwi_device_plugin::settings::{merge, Overrides};
use kiwi_nvml::{GpuDiscovery, GpuListSource, NvmlSource, NVML_LIBRARY};

/// Advertises each GPU to the kubelet as N Kiwi vGPUs.
///
/// Every flag also has a key in the [device_plugin] section of /etc/kiwi/config.toml
/// (or the file named by KIWI_CONFIG or --config); flags win.
#[derive(Debug, Parser)]
#[command(
    name = "kiwi-device-plugin",
    version,
    args_conflicts_with_subcommands = true
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    /// Config file (default: $KIWI_CONFIG, then /etc/kiwi/config.toml).
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Extended resource name [default: kiwi.dev/gpu].
    #[arg(long, value_name = "NAME")]
    resource_name: Option<String>,
    /// vGPUs advertised per physical GPU [default: 10].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    vgpus_per_gpu: Option<u32>,
    /// The kubelet's device plugin directory [default: /var/lib/kubelet/device-plugins].
    #[arg(long, value_name = "DIR")]
    kubelet_dir: Option<PathBuf>,
    /// How Allocate names devices besides KIWI_VISIBLE_DEVICES: envvar, cdi-cri or
    /// cdi-annotations [default: envvar].
    #[arg(long, value_name = "STRATEGY")]
    device_list_strategy: Option<DeviceListStrategy>,
    /// Read GPUs from this file instead of NVML (see docs/device-plugin.md).
    #[arg(long, value_name = "FILE")]
    gpu_list: Option<PathBuf>,
    /// Serve Prometheus metrics at http://ADDR/metrics.
    #[arg(long, value_name = "ADDR")]
    metrics_addr: Option<SocketAddr>,
    /// How often every GPU is probed for health [default: 5000].
    #[arg(long, value_name = "MS", value_parser = clap::value_parser!(u64).range(1..))]
    health_interval_ms: Option<u64>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Measure Allocate latency and the plugin's memory against a fake kubelet.
    Bench(bench::BenchArgs),
}

fn main() {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("KIWI_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let result = tokio::runtime::Runtime::new()
        .context("cannot start the async runtime")
        .and_then(|rt| {
            rt.block_on(async {
                match cli.command {
                    Some(Command::Bench(args)) => bench::run(args).await,
                    None => serve(cli).await,
                }
            })
        });
    if let Err(e) = result {
        eprintln!("kiwi-device-plugin: {}", kiwi_config::one_line(e.as_ref()));
        std::process::exit(1);
    }
}

async fn serve(cli: Cli) -> anyhow::Result<()> {
    let config = kiwi_config::Config::load(cli.config.as_deref())?;
    let settings = merge(
        &config.device_plugin,
        Overrides {
            resource_name: cli.resource_name,
            vgpus_per_gpu: cli.vgpus_per_gpu,
            kubelet_dir: cli.kubelet_dir,
            device_list_strategy: cli.device_list_strategy,
            gpu_list: cli.gpu_list,
            metrics_addr: cli.metrics_addr,
            health_interval_ms: cli.health_interval_ms,
        },
    )
    .map_err(anyhow::Error::msg)?;
    let source: Box<dyn GpuDiscovery> = match &settings.gpu_list {
        Some(path) => Box::new(GpuListSource::new(path)),
        None => Box::new(
            NvmlSource::load(NVML_LIBRARY)
                .context("no NVML on this node (use --gpu-list FILE without it)")?,
        ),
    };
    // Signals first (before anything is created that SIGTERM must clean up).
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("cannot watch SIGTERM")?;
    let mut int = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())
        .context("cannot watch SIGINT")?;
    let shutdown = async move {
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
            _ = int.recv() => tracing::info!("SIGINT: shutting down"),
        }
    };
    kiwi_device_plugin::run(settings, source, shutdown).await?;
    Ok(())
}
