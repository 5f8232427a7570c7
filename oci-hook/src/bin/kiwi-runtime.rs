//! `kiwi-runtime`: a runc-compatible wrapper. On `create`/`run` of a container whose
//! environment claims a vGPU it edits `config.json`; then, for every command, it
//! `exec`s the real runtime with the same argv, so stdio, signals and the exit status
//! are the real runtime's own.

use std::ffi::OsString;
use std::os::unix::process::CommandExt;
use std::path::Path;

use kiwi_config::Config;
use kiwi_oci::log::Logger;
use kiwi_oci::{runc_args, runtime};

fn main() {
    let args: Vec<OsString> = std::env::args_os().skip(1).collect();
    let cmd = runc_args::parse(&args);
    let runc_log = cmd.log.clone();
    let runc_log_format = cmd.log_format.clone();
    let fail = |log: &Logger, msg: &str| -> ! {
        log.error(
            msg,
            runc_log.as_deref().map(|p| (p, runc_log_format.as_deref())),
        );
        std::process::exit(1)
    };

    let cfg = match Config::load(None) {
        Ok(c) => c,
        Err(e) if cmd.creates() => fail(&Logger::new("kiwi-runtime", None), &e.to_string()),
        // `delete`, `kill`, `state` … must keep working on a node whose config broke,
        // or containers could not be cleaned up; they only need a runtime to exec.
        Err(e) => {
            let log = Logger::new("kiwi-runtime", None);
            log.warn(&format!("{e}; using the default runtimes"));
            Config::default()
        }
    };
    let log = Logger::new("kiwi-runtime", cfg.runtime.log_path.clone());

    let self_exe = std::fs::read_link("/proc/self/exe").ok();
    let real = match runtime::find_runtime(
        &cfg.runtime.runtimes,
        std::env::var_os("PATH").as_deref(),
        self_exe.as_deref(),
    ) {
        Ok(r) => r,
        Err(e) => fail(&log, &e.to_string()),
    };

    if cmd.creates() {
        if let Err(e) = runtime::prepare_create(&cmd, &cfg, &real, &log) {
            fail(&log, &e.to_string());
        }
    }

    let err = std::process::Command::new(&real)
        .arg0(Path::new(&real).as_os_str())
        .args(&args)
        .exec();
    fail(&log, &format!("cannot execute {}: {err}", real.display()));
}
