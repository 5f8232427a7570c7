//! `kiwictl run [--gpu G] -- CMD...`: runs a program under Kiwi on this machine.
//!
//! Sets up the environment the shim needs (and the frameworks' memory defaults,
//! `kiwi_config::FRAMEWORK_ENV_DEFAULTS`, where the caller's environment does not set
//! them and `[hook] framework_defaults` is on) and execs the program; starts nothing
//! else (the node's arbiter must be running). The shim is found at `--shim`, then
//! `$KIWI_SHIM`, then the config's `runtime.shim_path`, then `libkiwi.so` next to
//! this executable (an in-tree build).

use std::ffi::OsString;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use kiwi_config::Config;

#[derive(clap::Args, Debug)]
pub struct RunArgs {
    /// The shim library to preload.
    #[arg(long)]
    shim: Option<PathBuf>,
    /// The program and its arguments.
    #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
    command: Vec<OsString>,
}

/// Finds the shim library.
pub fn find_shim(cfg: &Config, flag: Option<&Path>) -> Result<PathBuf> {
    let mut tried = Vec::new();
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Some(f) = flag {
        candidates.push(f.to_path_buf());
    } else {
        if let Some(e) = std::env::var_os("KIWI_SHIM").filter(|e| !e.is_empty()) {
            candidates.push(PathBuf::from(e));
        }
        candidates.push(cfg.runtime.shim_path.clone());
        if let Ok(exe) = std::env::current_exe() {
            if let Some(dir) = exe.parent() {
                candidates.push(dir.join("libkiwi.so"));
            }
        }
    }
    for c in candidates {
        if c.is_file() {
            return Ok(c.canonicalize().unwrap_or(c));
        }
        tried.push(c.display().to_string());
    }
    bail!(
        "the Kiwi shim libkiwi.so was not found (tried {})",
        tried.join(", ")
    )
}

pub fn run(cfg: &Config, socket_dir: &Path, gpu: Option<&str>, args: RunArgs) -> Result<ExitCode> {
    let shim = find_shim(cfg, args.shim.as_deref())?;
    let socket = kiwi_config::client_socket(socket_dir);
    if !socket.exists() {
        eprintln!(
            "[WARN] no arbiter socket at {}: the program will wait for one (KIWI_ARBITER_TIMEOUT)",
            socket.display()
        );
    }
    let mut preload = OsString::from(shim.as_os_str());
    if let Some(existing) = std::env::var_os("LD_PRELOAD").filter(|p| !p.is_empty()) {
        preload.push(" ");
        preload.push(existing);
    }
    let (program, rest) = args.command.split_first().context("no program given")?;
    let mut cmd = std::process::Command::new(program);
    cmd.args(rest)
        .env("LD_PRELOAD", preload)
        .env("KIWI_SOCKET_DIR", socket_dir);
    if let Some(g) = gpu {
        cmd.env("CUDA_VISIBLE_DEVICES", g);
    }
    // The processes of one run are one job (torchrun's ranks, say): granted their
    // GPUs together (issue #41). A group the caller names is kept, and an empty one
    // names none. The program keeps this process's pid (exec), so the name is unique
    // on the node while it runs.
    if std::env::var_os("KIWI_GROUP").is_none() {
        cmd.env("KIWI_GROUP", format!("kiwictl run {}", std::process::id()));
    }
    // Frameworks are told not to hoard the whole GPU Kiwi reports free; a variable the
    // caller's environment sets (even empty) is passed on as it is.
    for (key, value) in cfg.hook.framework_env() {
        if std::env::var_os(key).is_none() {
            cmd.env(key, value);
        }
    }
    let err = cmd.exec();
    bail!("cannot run {}: {err}", Path::new(program).display())
}
