//! `kiwi-hook`: the OCI prestart / createRuntime hook, and the poststop hook. Reads the
//! container state on stdin. At prestart, for a container that claims a vGPU: has the
//! arbiter serve the container's own client socket and binds its directory into the
//! container, binds the shim, lists it in `/etc/ld.so.preload`, creates missing device
//! nodes and adds the bound driver libraries to the container's ld cache. At poststop:
//! has the arbiter drop the container's socket and removes its files. An unclaimed
//! container is left alone (exit 0).

use std::path::PathBuf;

use clap::Parser;
use kiwi_config::Config;
use kiwi_oci::attach;
use kiwi_oci::hook::{self, HookError};
use kiwi_oci::log::Logger;

#[derive(Debug, Parser)]
#[command(
    name = "kiwi-hook",
    version,
    about = "Kiwi's OCI hook: injects the shim into claimed containers"
)]
struct Args {
    /// Config file (default: $KIWI_CONFIG, then /etc/kiwi/config.toml).
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Arbiter socket directory (default: $KIWI_SOCKET_DIR, the config file, /run/kiwi).
    #[arg(long, value_name = "DIR")]
    socket_dir: Option<PathBuf>,
    /// A directory of driver libraries kiwi-runtime bound into the container, to add to
    /// its ld cache (repeatable).
    #[arg(long = "ld-dir", value_name = "DIR")]
    ld_dir: Vec<PathBuf>,
    /// The hook stage this runs at: prestart or createRuntime, or poststop. Without
    /// it, the state's status says (`stopped`: poststop), so one hooks.d entry can
    /// name both stages.
    stage: Option<String>,
}

fn is_poststop(args: &Args, state: &hook::State) -> bool {
    match args.stage.as_deref() {
        Some(stage) => stage == "poststop",
        None => state.status.as_deref() == Some("stopped"),
    }
}

/// `poststop`: the container was deleted; its client socket goes.
fn poststop(args: &Args, state: &hook::State, log: &mut Logger) -> Result<(), HookError> {
    // Left alone when its spec (still in the bundle at runc delete) claims nothing.
    if let Ok(None) = hook::claimed_spec(state) {
        return Ok(());
    }
    let cfg = Config::load(args.config.as_deref())?;
    *log = Logger::new("kiwi-hook", cfg.runtime.log_path.clone());
    let socket_dir = cfg.socket_dir(args.socket_dir.as_deref());
    if let Some(line) = attach::detach(&socket_dir, &state.id) {
        log.info(&line);
    }
    Ok(())
}

fn run(
    args: &Args,
    state: &hook::State,
    log: &mut Logger,
    t0: std::time::Instant,
) -> Result<(), HookError> {
    let Some((spec, claim)) = hook::claimed_spec(state)? else {
        return Ok(());
    };
    let cfg = Config::load(args.config.as_deref())?;
    *log = Logger::new("kiwi-hook", cfg.runtime.log_path.clone());
    let socket_dir = cfg.socket_dir(args.socket_dir.as_deref());
    let inj = hook::plan(state, &spec, &claim, &cfg, &socket_dir, &args.ld_dir)?;
    if let Some(note) = &inj.note {
        log.info(&format!("container {}: {note}", state.id));
    }
    if let Err(e) = hook::inject(&inj) {
        // The container will not start: its socket must not outlive it.
        attach::detach(&socket_dir, &state.id);
        return Err(e);
    }
    log.info(&format!(
        "container {}: injected shim, {} device node(s), socket dir {} in {:.2} ms",
        state.id,
        inj.nodes.len(),
        inj.client_dir.display(),
        t0.elapsed().as_secs_f64() * 1e3
    ));
    Ok(())
}

fn main() {
    let t0 = std::time::Instant::now();
    let args = match Args::try_parse() {
        Ok(a) => a,
        Err(e) if !e.use_stderr() => e.exit(), // --help, --version
        Err(e) => {
            // One line, as for every other bad input; the usage text would be noise in
            // a runtime's error message.
            let first = e.to_string();
            let first = first.lines().next().unwrap_or("bad arguments");
            eprintln!("kiwi-hook: {}", first.trim_start_matches("error: "));
            std::process::exit(2);
        }
    };
    let mut log = Logger::new("kiwi-hook", None);
    let res = hook::read_state(std::io::stdin().lock()).and_then(|state| {
        if is_poststop(&args, &state) {
            poststop(&args, &state, &mut log)
        } else {
            run(&args, &state, &mut log, t0)
        }
    });
    if let Err(e) = res {
        log.error(&e.to_string(), None);
        std::process::exit(1);
    }
}
