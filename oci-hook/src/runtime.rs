//! What `kiwi-runtime` does before it `exec`s the real runtime: pick that runtime, and
//! for `create`/`run` of a claimed container, edit `config.json` (device nodes, allow
//! rules, driver files or `NVIDIA_VISIBLE_DEVICES`, the frameworks' memory defaults
//! where the process does not set them, the `kiwi-hook` prestart hook with the driver
//! libraries' directories for the container's ld cache).
//!
//! An unclaimed container's spec is never written. A claimed one that Kiwi cannot serve
//! is refused before anything is written, so a failed create leaves the bundle as it
//! was. This module never execs; the binary does, once this returns.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};

use kiwi_config::Config;

use crate::claim::{Claim, GpuRef};
use crate::driver::{self, DriverError};
use crate::gpu::{self, GpuDiscovery, GpuError, HostDevices};
use crate::log::Logger;
use crate::runc_args::RuncCommand;
use crate::spec::{Hook, Spec, SpecError};

/// The stage the hook is added to. runc runs `prestart` hooks at the same point as
/// `createRuntime` (namespaces made, before `pivot_root`), and every runtime that runs
/// NVIDIA's legacy hook runs it.
pub const HOOK_STAGE: &str = "prestart";

/// The stage of the hook that drops the container's own client socket: runc runs
/// poststop hooks when the container is deleted.
pub const POSTSTOP_STAGE: &str = "poststop";

/// The hook flag naming a directory of bound driver libraries (repeated per directory).
pub const LD_DIR_FLAG: &str = "--ld-dir";

#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error("none of the configured runtimes {names:?} (runtime.runtimes) was found on PATH")]
    NoRuntime { names: Vec<String> },
    #[error(transparent)]
    Config(#[from] kiwi_config::ConfigError),
    #[error(transparent)]
    Spec(#[from] SpecError),
    #[error("cannot give the container its vGPU: {0}")]
    Gpu(#[from] GpuError),
    #[error("cannot give the container its vGPU: the Kiwi shim {path} is missing on this host (runtime.shim_path; {origin})")]
    ShimMissing { path: PathBuf, origin: String },
    #[error("cannot give the container its vGPU: kiwi-hook {path} is missing or not executable (runtime.hook_path; {origin})")]
    HookMissing { path: PathBuf, origin: String },
    #[error("cannot give the container its vGPU: {0}")]
    Driver(#[from] DriverError),
    #[error("cannot find the bundle: {path}: {source}")]
    Bundle {
        path: PathBuf,
        source: std::io::Error,
    },
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// The first of `names` that exists: absolute or relative paths as given, bare names on
/// `path_env`. A candidate that is `self_exe` is skipped, so installing kiwi-runtime
/// under a runtime's name cannot make it exec itself forever.
pub fn find_runtime(
    names: &[String],
    path_env: Option<&OsStr>,
    self_exe: Option<&Path>,
) -> Result<PathBuf, RuntimeError> {
    let me = self_exe.and_then(|p| std::fs::canonicalize(p).ok());
    let not_me = |p: &Path| me.is_none() || std::fs::canonicalize(p).ok() != me;
    for name in names {
        if name.contains('/') {
            let p = PathBuf::from(name);
            if is_executable(&p) && not_me(&p) {
                return Ok(p);
            }
            continue;
        }
        let path = path_env.unwrap_or(OsStr::new(
            "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        ));
        for dir in std::env::split_paths(path) {
            let p = dir.join(name);
            if is_executable(&p) && not_me(&p) {
                return Ok(p);
            }
        }
    }
    Err(RuntimeError::NoRuntime {
        names: names.to_vec(),
    })
}

/// Whether the runtime is NVIDIA's (which then adds the driver libraries itself).
pub fn is_nvidia_runtime(runtime: &Path) -> bool {
    runtime
        .file_name()
        .and_then(OsStr::to_str)
        .is_some_and(|n| n.starts_with("nvidia-container-runtime"))
}

/// The hook entry kiwi-runtime inserts: it carries the config file (when one is in use)
/// and the socket directory, so the hook sees what the runtime saw.
pub fn hook_entry(cfg: &Config, socket_dir: &Path) -> Hook {
    let mut args = vec!["kiwi-hook".to_string()];
    if let Some(src) = &cfg.source {
        let abs = std::fs::canonicalize(src).unwrap_or_else(|_| src.clone());
        args.push("--config".into());
        args.push(abs.to_string_lossy().into_owned());
    }
    args.push("--socket-dir".into());
    args.push(socket_dir.to_string_lossy().into_owned());
    args.push(HOOK_STAGE.into());
    Hook {
        path: cfg.runtime.hook_path.clone(),
        args,
        env: Vec::new(),
        timeout: None,
    }
}

/// The claim as NVIDIA's toolkit reads `NVIDIA_VISIBLE_DEVICES`.
pub fn nvidia_visible_devices(claim: &Claim) -> String {
    match claim {
        Claim::None => "void".into(),
        Claim::All => "all".into(),
        Claim::Gpus(g) => g
            .iter()
            .map(GpuRef::to_string)
            .collect::<Vec<_>>()
            .join(","),
    }
}

/// Where a setting came from, for errors about it: the config file that was read, or
/// that none was. Under docker the runtime's environment is containerd's (or conmon's
/// under podman), not dockerd's, so a `KIWI_CONFIG` set on dockerd is not seen; saying
/// which file was read makes that visible instead of blaming the shim alone.
pub fn config_origin(cfg: &Config) -> String {
    match &cfg.source {
        Some(p) => format!("config file {}", p.display()),
        None => format!(
            "no config file was read, defaults used: {} is unset in this process's \
             environment and {} does not exist",
            kiwi_config::CONFIG_ENV,
            kiwi_config::DEFAULT_CONFIG_PATH
        ),
    }
}

/// Checks everything a claimed container needs from the host. Nothing is written.
pub fn check_host(cfg: &Config) -> Result<(), RuntimeError> {
    if !cfg.runtime.shim_path.is_file() {
        return Err(RuntimeError::ShimMissing {
            path: cfg.runtime.shim_path.clone(),
            origin: config_origin(cfg),
        });
    }
    if !is_executable(&cfg.runtime.hook_path) {
        return Err(RuntimeError::HookMissing {
            path: cfg.runtime.hook_path.clone(),
            origin: config_origin(cfg),
        });
    }
    Ok(())
}

/// Applies Kiwi's edits to a claimed spec in memory. `discovery` is called only when a
/// GPU UUID needs resolving.
pub fn edit_spec(
    spec: &mut Spec,
    claim: &Claim,
    cfg: &Config,
    socket_dir: &Path,
    nvidia_runtime: bool,
    discovery: impl FnOnce() -> Result<Box<dyn GpuDiscovery>, GpuError>,
    log: &Logger,
) -> Result<(), RuntimeError> {
    check_host(cfg)?;
    let devices = HostDevices::new(&cfg.runtime.device_root);
    let nodes = gpu::resolve_claim(claim, &devices, gpu::minor_through(discovery))?;
    let files = if nvidia_runtime {
        Vec::new()
    } else if !cfg.runtime.driver_files.is_empty() {
        driver::from_list(&cfg.runtime.driver_files)?
    } else {
        let (found, missing) = driver::discover();
        if !missing.is_empty() {
            log.info(&format!(
                "driver files not found on this host, not injected: {}",
                missing.join(", ")
            ));
        }
        found
    };
    for node in &nodes {
        spec.add_device(node);
    }
    if nvidia_runtime {
        spec.set_env(
            crate::NVIDIA_VISIBLE_DEVICES_ENV,
            &nvidia_visible_devices(claim),
        );
    }
    // Frameworks are told not to hoard the whole GPU Kiwi reports free; a value the
    // image or the user set stays.
    let mut framework_env = Vec::new();
    for (key, value) in cfg.hook.framework_env() {
        if spec.set_env_default(key, value) {
            framework_env.push(format!("{key}={value}"));
        }
    }
    for f in &files {
        spec.add_ro_bind(&f.source, &f.destination);
    }
    // The libraries' directories go to the hook, which adds them to the container's ld
    // cache once the binds exist.
    let mut hook = hook_entry(cfg, socket_dir);
    let stage = hook.args.pop();
    for dir in driver::library_dirs(&files) {
        hook.args.push(LD_DIR_FLAG.into());
        hook.args.push(dir.to_string_lossy().into_owned());
    }
    hook.args.extend(stage);
    spec.add_hook(HOOK_STAGE, &hook);
    let mut stop = hook_entry(cfg, socket_dir);
    if let Some(last) = stop.args.last_mut() {
        *last = POSTSTOP_STAGE.into();
    }
    spec.add_hook(POSTSTOP_STAGE, &stop);
    log.info(&format!(
        "{}: claim {} -> {} device node(s), {} driver file(s), hook {}, env [{}]",
        spec.path().display(),
        nvidia_visible_devices(claim),
        nodes.len(),
        files.len(),
        cfg.runtime.hook_path.display(),
        framework_env.join(" ")
    ));
    Ok(())
}

/// For `create`/`run`: loads the bundle's spec and, if it claims a vGPU, edits it and
/// writes it back. Returns whether the spec was written.
pub fn prepare_create(
    cmd: &RuncCommand,
    cfg: &Config,
    runtime: &Path,
    log: &Logger,
) -> Result<bool, RuntimeError> {
    let bundle = match &cmd.bundle {
        Some(b) => b.clone(),
        None => std::env::current_dir().map_err(|source| RuntimeError::Bundle {
            path: PathBuf::from("."),
            source,
        })?,
    };
    let mut spec = Spec::load(&bundle)?;
    let claim = spec.claim()?;
    if !claim.is_claimed() {
        return Ok(false);
    }
    let socket_dir = cfg.socket_dir(None);
    edit_spec(
        &mut spec,
        &claim,
        cfg,
        &socket_dir,
        is_nvidia_runtime(runtime),
        || gpu::discovery_from_config(cfg),
        log,
    )?;
    spec.write_back()?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn runtime_search_skips_missing_and_self() {
        let dir = tempfile::tempdir().unwrap();
        let a = dir.path().join("fake-runc");
        std::fs::write(&a, "#!/bin/sh\n").unwrap();
        std::fs::set_permissions(&a, std::fs::Permissions::from_mode(0o755)).unwrap();
        let path = dir.path().as_os_str();
        let names = vec!["nope".to_string(), "fake-runc".to_string()];
        assert_eq!(find_runtime(&names, Some(path), None).unwrap(), a);
        let e = find_runtime(&names, Some(path), Some(&a)).unwrap_err();
        assert!(e.to_string().contains("[\"nope\", \"fake-runc\"]"), "{e}");
        assert!(is_nvidia_runtime(Path::new(
            "/usr/bin/nvidia-container-runtime"
        )));
        assert!(!is_nvidia_runtime(&a));
    }

    #[test]
    fn hook_carries_config_and_socket_dir() {
        let mut cfg = Config::default();
        let h = hook_entry(&cfg, Path::new("/run/kiwi"));
        assert_eq!(
            h.args,
            ["kiwi-hook", "--socket-dir", "/run/kiwi", "prestart"]
        );
        cfg.source = Some(PathBuf::from("/etc/other.toml"));
        let h = hook_entry(&cfg, Path::new("/s"));
        assert_eq!(h.args[1..3], ["--config", "/etc/other.toml"]);
    }

    /// A host with everything a claim on GPU 0 needs: the shim, an executable hook,
    /// `nvidia0`, `nvidiactl` and `nvidia-uvm` (links to /dev/null, a character device,
    /// so no mknod and no root), and one listed driver file.
    fn host() -> (tempfile::TempDir, Config) {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path();
        std::fs::create_dir(p.join("dev")).unwrap();
        for n in ["nvidia0", "nvidiactl", "nvidia-uvm"] {
            std::os::unix::fs::symlink("/dev/null", p.join("dev").join(n)).unwrap();
        }
        std::fs::write(p.join("libkiwi.so"), "shim").unwrap();
        std::fs::write(p.join("kiwi-hook"), "#!/bin/sh\n").unwrap();
        std::fs::set_permissions(p.join("kiwi-hook"), std::fs::Permissions::from_mode(0o755))
            .unwrap();
        std::fs::write(p.join("libcuda.so.1"), "driver").unwrap();
        let mut cfg = Config::default();
        cfg.runtime.shim_path = p.join("libkiwi.so");
        cfg.runtime.hook_path = p.join("kiwi-hook");
        cfg.runtime.device_root = p.join("dev");
        cfg.runtime.driver_files = vec![p.join("libcuda.so.1")];
        (dir, cfg)
    }

    /// Runs `prepare_create` on a bundle whose process env is `env`; returns whether it
    /// wrote, the bytes before, and the resulting spec.
    fn create_with_env(cfg: &Config, env: &[&str]) -> (bool, Vec<u8>, Vec<u8>) {
        let bundle = tempfile::tempdir().unwrap();
        let text = serde_json::json!({
            "ociVersion": "1.0.2",
            "process": {"args": ["sh"], "env": env},
            "root": {"path": "rootfs"},
        });
        let before = serde_json::to_vec_pretty(&text).unwrap();
        std::fs::write(bundle.path().join("config.json"), &before).unwrap();
        let cmd = RuncCommand {
            subcommand: Some("create".into()),
            bundle: Some(bundle.path().to_path_buf()),
            log: None,
            log_format: None,
        };
        let log = Logger::new("test", None);
        let wrote = prepare_create(&cmd, cfg, Path::new("/usr/sbin/runc"), &log).unwrap();
        let after = std::fs::read(bundle.path().join("config.json")).unwrap();
        (wrote, before, after)
    }

    fn env_of(spec: &[u8]) -> Vec<String> {
        let v: serde_json::Value = serde_json::from_slice(spec).unwrap();
        v["process"]["env"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e.as_str().unwrap().to_string())
            .collect()
    }

    #[test]
    fn claimed_spec_gets_the_framework_defaults_once() {
        let (_host, cfg) = host();
        let (wrote, _, after) = create_with_env(&cfg, &["PATH=/bin", "KIWI_VISIBLE_DEVICES=0"]);
        assert!(wrote);
        let env = env_of(&after);
        assert_eq!(
            env,
            [
                "PATH=/bin",
                "KIWI_VISIBLE_DEVICES=0",
                "XLA_PYTHON_CLIENT_PREALLOCATE=false",
                "TF_FORCE_GPU_ALLOW_GROWTH=true"
            ]
        );
        // Every default of the one list, in order.
        let added: Vec<String> = kiwi_config::FRAMEWORK_ENV_DEFAULTS
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        assert_eq!(env[2..], added[..]);
        // The spec as written is edited again (a retried create): still once each.
        let mut spec = Spec::parse(&after, Path::new("c.json")).unwrap();
        let log = Logger::new("test", None);
        let claim = spec.claim().unwrap();
        edit_spec(
            &mut spec,
            &claim,
            &cfg,
            Path::new("/s"),
            false,
            || panic!(),
            &log,
        )
        .unwrap();
        assert_eq!(spec.env().collect::<Vec<_>>(), env);
    }

    #[test]
    fn the_containers_own_value_wins_and_is_not_duplicated() {
        let (_host, cfg) = host();
        let (wrote, _, after) = create_with_env(
            &cfg,
            &[
                "XLA_PYTHON_CLIENT_PREALLOCATE=true",
                "KIWI_VISIBLE_DEVICES=0",
                "TF_FORCE_GPU_ALLOW_GROWTH=",
            ],
        );
        assert!(wrote);
        assert_eq!(
            env_of(&after),
            [
                "XLA_PYTHON_CLIENT_PREALLOCATE=true",
                "KIWI_VISIBLE_DEVICES=0",
                "TF_FORCE_GPU_ALLOW_GROWTH="
            ],
            "both set by the container: nothing added, nothing changed"
        );
    }

    #[test]
    fn framework_defaults_off_adds_nothing() {
        let (_host, mut cfg) = host();
        cfg.hook.framework_defaults = false;
        let (wrote, _, after) = create_with_env(&cfg, &["KIWI_VISIBLE_DEVICES=0"]);
        assert!(wrote, "the rest of the claim is still served");
        assert_eq!(env_of(&after), ["KIWI_VISIBLE_DEVICES=0"]);
        let v: serde_json::Value = serde_json::from_slice(&after).unwrap();
        assert_eq!(v["linux"]["devices"].as_array().unwrap().len(), 3);
    }

    #[test]
    fn unclaimed_spec_is_not_written_and_gets_no_defaults() {
        let (_host, cfg) = host();
        for env in [&["PATH=/bin"][..], &["KIWI_VISIBLE_DEVICES=none"], &[]] {
            let (wrote, before, after) = create_with_env(&cfg, env);
            assert!(!wrote, "{env:?}");
            assert_eq!(after, before, "{env:?}: byte for byte");
        }
    }

    #[test]
    fn missing_shim_refuses_before_editing() {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = Config::default();
        cfg.runtime.shim_path = dir.path().join("libkiwi.so");
        let text = r#"{"process":{"env":["KIWI_VISIBLE_DEVICES=0"]}}"#;
        let mut spec = Spec::parse(text.as_bytes(), Path::new("c.json")).unwrap();
        let before = spec.value().clone();
        let log = Logger::new("test", None);
        let e = edit_spec(
            &mut spec,
            &Claim::All,
            &cfg,
            Path::new("/s"),
            false,
            || panic!(),
            &log,
        )
        .unwrap_err();
        assert!(e.to_string().contains("shim"), "{e}");
        assert_eq!(spec.value(), &before);
    }
}
