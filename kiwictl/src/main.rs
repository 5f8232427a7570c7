//! `kiwictl`: everything an operator types. Finds the arbiter through `--socket-dir`,
//! `KIWI_SOCKET_DIR`, the config file, or `/run/kiwi`, in that order.

mod control;
mod demo;
mod run;
mod status;
mod timeline;
mod top;

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Result};
use clap::{Parser, Subcommand};
use kiwi_config::Config;
use kiwi_protocol::{ControlReply, ControlRequest};

use crate::control::Control;

#[derive(Parser, Debug)]
#[command(
    name = "kiwictl",
    version,
    about = "Control Kiwi: GPU sharing with swapping and a per-GPU scheduler.",
    arg_required_else_help = true
)]
struct Cli {
    /// Turn the Kiwi scheduler on or off (this arbiter instance only; not persisted).
    #[arg(short = 'S', long = "scheduler", value_name = "on|off", value_parser = parse_on_off)]
    scheduler: Option<bool>,
    /// Set the time quantum in seconds (> 0; fractions allowed).
    #[arg(
        short = 'T',
        long = "tq",
        value_name = "SECONDS",
        allow_hyphen_values = true
    )]
    tq: Option<kiwi_config::Quantum>,
    /// GPU to act on (UUID or index); default: every GPU.
    #[arg(long)]
    gpu: Option<String>,
    /// Socket directory of the arbiter.
    #[arg(long, global = true)]
    socket_dir: Option<PathBuf>,
    /// Kiwi's config file (default: $KIWI_CONFIG, /etc/kiwi/config.toml). Given
    /// before the command; `install`'s own `--config` names containerd's or docker's.
    #[arg(long)]
    config: Option<PathBuf>,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Show each GPU's scheduler, holder and queue, and each client.
    Status {
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
        /// Only this GPU (UUID or index).
        #[arg(long)]
        gpu: Option<String>,
    },
    /// A live view of every GPU and client, refreshed every second (q quits).
    Top {
        /// Only this GPU (UUID or index).
        #[arg(long)]
        gpu: Option<String>,
        #[command(flatten)]
        args: top::TopArgs,
    },
    /// Print the arbiter's event log (one JSON object per line).
    Events {
        /// Only events with a sequence number at least this.
        #[arg(long, default_value_t = 0)]
        since_seq: u64,
        /// Only this GPU (UUID or index).
        #[arg(long)]
        gpu: Option<String>,
    },
    /// Draw who had the GPU, who waited and when, from the arbiter's event log.
    Timeline {
        /// Only this GPU (UUID or index).
        #[arg(long)]
        gpu: Option<String>,
        #[command(flatten)]
        args: timeline::TimelineArgs,
    },
    /// Replay the seed's two-notebook story for real and draw its timeline.
    Demo(demo::DemoArgs),
    /// Run a program under Kiwi on this machine (preloads the shim; sets
    /// XLA_PYTHON_CLIENT_PREALLOCATE=false and TF_FORCE_GPU_ALLOW_GROWTH=true where
    /// unset, unless [hook] framework_defaults = false).
    Run {
        /// The GPU (index or UUID) the program may use (sets CUDA_VISIBLE_DEVICES).
        #[arg(long)]
        gpu: Option<String>,
        #[command(flatten)]
        args: run::RunArgs,
    },
    /// Register runtime "kiwi" with containerd or docker.
    Install(kiwi_containerd_config::InstallArgs),
    /// Remove exactly what `install` added.
    Uninstall(kiwi_containerd_config::UninstallArgs),
    /// Container Device Interface (CDI) specs.
    Cdi {
        #[command(subcommand)]
        command: CdiCommand,
    },
}

#[derive(Subcommand, Debug)]
enum CdiCommand {
    /// Write a CDI spec (kind kiwi.dev/gpu) for this node's GPUs.
    Generate(kiwi_oci::cdi::CdiGenerateArgs),
}

fn parse_on_off(s: &str) -> Result<bool, String> {
    match s {
        "on" => Ok(true),
        "off" => Ok(false),
        other => Err(format!("expected \"on\" or \"off\", not {other:?}")),
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("[ERROR] {}", kiwi_config::one_line(e.as_ref()));
            ExitCode::from(1)
        }
    }
}

fn run(cli: Cli) -> Result<ExitCode> {
    // Commands that edit other programs' configuration need none of Kiwi's.
    match &cli.command {
        Some(Command::Install(a)) => {
            kiwi_containerd_config::run_install(a)?;
            return Ok(ExitCode::SUCCESS);
        }
        Some(Command::Uninstall(a)) => {
            kiwi_containerd_config::run_uninstall(a)?;
            return Ok(ExitCode::SUCCESS);
        }
        Some(Command::Cdi {
            command: CdiCommand::Generate(a),
        }) => {
            let mut a = a.clone();
            if a.config.is_none() {
                a.config = cli.config.clone();
            }
            kiwi_oci::cdi::run_cdi_generate(&a)?;
            return Ok(ExitCode::SUCCESS);
        }
        _ => {}
    }
    let cfg = Config::load(cli.config.as_deref())?;
    let socket_dir = cfg.socket_dir(cli.socket_dir.as_deref());
    if cli.scheduler.is_some() || cli.tq.is_some() {
        if cli.command.is_some() {
            bail!("-S/-T cannot be combined with a command");
        }
        let mut ctl = Control::connect(&socket_dir)?;
        if let Some(on) = cli.scheduler {
            done(ctl.call(&ControlRequest::SetScheduler {
                on,
                gpu: cli.gpu.clone(),
            })?);
        }
        if let Some(tq) = cli.tq {
            done(ctl.call(&ControlRequest::SetTq {
                tq_ms: tq.as_millis(),
                gpu: cli.gpu.clone(),
            })?);
        }
        return Ok(ExitCode::SUCCESS);
    }
    match cli.command {
        None => bail!("nothing to do: give -S, -T or a command (see --help)"),
        Some(Command::Status { json, gpu }) => {
            let mut ctl = Control::connect(&socket_dir)?;
            match ctl.call(&ControlRequest::Status {
                gpu: gpu.or(cli.gpu),
            })? {
                ControlReply::Status(report) => {
                    if json {
                        println!("{}", serde_json::to_string_pretty(&report)?);
                    } else {
                        print!("{}", status::render(&report));
                    }
                }
                other => bail!("unexpected reply from the arbiter: {other:?}"),
            }
            Ok(ExitCode::SUCCESS)
        }
        Some(Command::Top { gpu, args }) => top::run(&socket_dir, gpu.or(cli.gpu), &args),
        Some(Command::Events { since_seq, gpu }) => {
            let mut ctl = Control::connect(&socket_dir)?;
            let (events, _) = ctl.events(gpu.or(cli.gpu), since_seq)?;
            for e in events {
                println!("{}", serde_json::to_string(&e)?);
            }
            Ok(ExitCode::SUCCESS)
        }
        Some(Command::Timeline { gpu, args }) => timeline::run(&socket_dir, gpu.or(cli.gpu), &args),
        Some(Command::Run { gpu, args }) => {
            run::run(&cfg, &socket_dir, gpu.or(cli.gpu).as_deref(), args)
        }
        Some(Command::Demo(args)) => demo::run(&args),
        Some(Command::Install(_) | Command::Uninstall(_) | Command::Cdi { .. }) => {
            unreachable!("handled above")
        }
    }
}

fn done(reply: ControlReply) {
    if let ControlReply::Done { message, .. } = reply {
        println!("[INFO] {message}");
    }
}
