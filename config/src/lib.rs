//! The Kiwi configuration file, shared by every component.
//!
//! One file, `/etc/kiwi/config.toml` (or the file named by `KIWI_CONFIG`), with a
//! section per component. A missing default file means defaults; a file named
//! explicitly must exist; a malformed file is an error naming the file and line.
//! Unknown keys are refused so that a typo never silently falls back to a default.
//!
//! This crate owns parsing and the well-known paths derived from `socket_dir`; it
//! does not act on any value. Values are typed where they are read ([`Quantum`],
//! [`Nvml`], [`Checkpoint`], [`SwapPool`]), so no reader checks them again; the
//! `[arbiter]` section declares each key and its flag once ([`arbiter`]).

use std::fmt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

pub mod arbiter;
pub mod cgroup;
pub mod containers;
pub mod quantum;
pub mod report;
pub mod value;
pub use arbiter::{
    parse_idle_evict_arg, parse_idle_evict_value, ArbiterConfig, Checkpoint, Nvml, SwapPool,
};
pub use quantum::Quantum;
pub use report::one_line;
pub use value::{flag_error, ValueError};

/// Where the file is looked for when neither a flag nor `KIWI_CONFIG` names one.
pub const DEFAULT_CONFIG_PATH: &str = "/etc/kiwi/config.toml";
/// Environment variable naming the config file.
pub const CONFIG_ENV: &str = "KIWI_CONFIG";
/// Environment variable naming the socket directory.
pub const SOCKET_DIR_ENV: &str = "KIWI_SOCKET_DIR";
/// Host default socket directory.
pub const DEFAULT_SOCKET_DIR: &str = "/run/kiwi";
/// Where containers see the client socket directory.
pub const CONTAINER_CLIENT_DIR: &str = "/run/kiwi/client";
/// Where containers see the shim.
pub const CONTAINER_SHIM_PATH: &str = "/usr/lib/kiwi/libkiwi.so";

/// The environment Kiwi gives a claimed container's process (kiwi-runtime, the CDI
/// spec) and a program under `kiwictl run`, unless that variable is already set there:
/// the image's, the pod's or the user's value always wins. Kiwi tells every process the
/// whole GPU is free, and without these JAX preallocates 75% of it and TensorFlow all
/// of it, so every notebook would hold, and swap at each hand-off, the whole GPU.
/// `[hook] framework_defaults = false` turns them off. The one list every path uses.
pub const FRAMEWORK_ENV_DEFAULTS: &[(&str, &str)] = &[
    ("XLA_PYTHON_CLIENT_PREALLOCATE", "false"),
    ("TF_FORCE_GPU_ALLOW_GROWTH", "true"),
];

/// Errors reading the configuration.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}; name a readable file with --config or KIWI_CONFIG, or leave both unset for /etc/kiwi/config.toml")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("config file {path}, line {line}: {message}")]
    Parse {
        path: PathBuf,
        line: usize,
        message: String,
    },
    #[error("config file {path}: {message}")]
    Invalid { path: PathBuf, message: String },
}

/// The whole configuration file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    pub socket_dir: PathBuf,
    pub arbiter: ArbiterConfig,
    pub runtime: RuntimeConfig,
    pub hook: HookConfig,
    pub device_plugin: DevicePluginConfig,
    /// Where this configuration was read from; `None` for built-in defaults.
    #[serde(skip)]
    pub source: Option<PathBuf>,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            socket_dir: PathBuf::from(DEFAULT_SOCKET_DIR),
            arbiter: ArbiterConfig::default(),
            runtime: RuntimeConfig::default(),
            hook: HookConfig::default(),
            device_plugin: DevicePluginConfig::default(),
            source: None,
        }
    }
}

/// `on` / `off`, as the operator writes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum SchedulerMode {
    #[default]
    On,
    Off,
}

impl SchedulerMode {
    pub fn is_on(self) -> bool {
        self == SchedulerMode::On
    }
}

impl fmt::Display for SchedulerMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            SchedulerMode::On => "on",
            SchedulerMode::Off => "off",
        })
    }
}

impl std::str::FromStr for SchedulerMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "on" => Ok(SchedulerMode::On),
            "off" => Ok(SchedulerMode::Off),
            other => Err(format!(
                "scheduler must be \"on\" or \"off\", not {other:?}"
            )),
        }
    }
}

/// `[runtime]`: kiwi-runtime and kiwi-hook.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RuntimeConfig {
    /// Low-level runtimes, in order of preference; the first found on PATH is exec'd.
    pub runtimes: Vec<String>,
    pub hook_path: PathBuf,
    pub shim_path: PathBuf,
    /// Where the host's nvidia* device nodes are.
    pub device_root: PathBuf,
    /// Driver user-space files to inject when NVIDIA's toolkit is not in use.
    /// Empty: found through the host's ld cache.
    pub driver_files: Vec<PathBuf>,
    /// Log file for kiwi-runtime and kiwi-hook (they have no terminal). `None`: stderr only.
    pub log_path: Option<PathBuf>,
}

impl Default for RuntimeConfig {
    fn default() -> Self {
        Self {
            runtimes: vec!["runc".into(), "crun".into()],
            hook_path: PathBuf::from("/usr/local/bin/kiwi-hook"),
            shim_path: PathBuf::from("/usr/local/lib/kiwi/libkiwi.so"),
            device_root: PathBuf::from("/dev"),
            driver_files: Vec::new(),
            log_path: None,
        }
    }
}

/// `[hook]`: what a claimed container's process (and `kiwictl run`'s program) is given.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HookConfig {
    /// Set [`FRAMEWORK_ENV_DEFAULTS`] where the process does not set them itself.
    pub framework_defaults: bool,
}

impl Default for HookConfig {
    fn default() -> Self {
        Self {
            framework_defaults: true,
        }
    }
}

impl HookConfig {
    /// The framework variables to set where unset: [`FRAMEWORK_ENV_DEFAULTS`], or none
    /// when `framework_defaults` is off.
    pub fn framework_env(&self) -> &'static [(&'static str, &'static str)] {
        if self.framework_defaults {
            FRAMEWORK_ENV_DEFAULTS
        } else {
            &[]
        }
    }
}

/// `[device_plugin]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DevicePluginConfig {
    pub resource_name: String,
    pub vgpus_per_gpu: u32,
    pub kubelet_dir: PathBuf,
    /// `envvar`, `cdi-cri` or `cdi-annotations`.
    pub device_list_strategy: String,
    /// GPU list file for nodes without NVML.
    pub gpu_list: Option<PathBuf>,
    pub metrics_addr: Option<String>,
    /// How often every GPU is probed for health, in milliseconds.
    pub health_interval_ms: u64,
}

impl Default for DevicePluginConfig {
    fn default() -> Self {
        Self {
            resource_name: "kiwi.dev/gpu".into(),
            vgpus_per_gpu: 10,
            kubelet_dir: PathBuf::from("/var/lib/kubelet/device-plugins"),
            device_list_strategy: "envvar".into(),
            gpu_list: None,
            metrics_addr: None,
            health_interval_ms: 5_000,
        }
    }
}

impl Config {
    /// Loads the configuration: `explicit` (a `--config` flag) wins, then `KIWI_CONFIG`,
    /// then `/etc/kiwi/config.toml`. Only the last may be missing.
    pub fn load(explicit: Option<&Path>) -> Result<Config, ConfigError> {
        if let Some(p) = explicit {
            return Self::from_file(p);
        }
        if let Some(p) = std::env::var_os(CONFIG_ENV).filter(|p| !p.is_empty()) {
            return Self::from_file(Path::new(&p));
        }
        match std::fs::metadata(DEFAULT_CONFIG_PATH) {
            Ok(_) => Self::from_file(Path::new(DEFAULT_CONFIG_PATH)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Config::default()),
            Err(source) => Err(ConfigError::Read {
                path: DEFAULT_CONFIG_PATH.into(),
                source,
            }),
        }
    }

    /// Reads one file; it must exist.
    pub fn from_file(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let mut cfg = Self::from_str_at(&text, path)?;
        cfg.source = Some(path.to_path_buf());
        Ok(cfg)
    }

    /// Parses `text` as if read from `path` (used in error messages).
    pub fn from_str_at(text: &str, path: &Path) -> Result<Config, ConfigError> {
        let cfg: Config = toml::from_str(text).map_err(|e| {
            let line = e
                .span()
                .map(|s| text[..s.start.min(text.len())].matches('\n').count() + 1)
                .unwrap_or(1);
            ConfigError::Parse {
                path: path.to_path_buf(),
                line,
                message: e.message().to_string(),
            }
        })?;
        cfg.validate(path)?;
        Ok(cfg)
    }

    fn validate(&self, path: &Path) -> Result<(), ConfigError> {
        let invalid = |message: String| ConfigError::Invalid {
            path: path.to_path_buf(),
            message,
        };
        if self.socket_dir.as_os_str().is_empty() {
            return Err(invalid("socket_dir must not be empty".into()));
        }
        if self.device_plugin.vgpus_per_gpu == 0 {
            return Err(invalid(
                "device_plugin.vgpus_per_gpu must be at least 1".into(),
            ));
        }
        if self.device_plugin.health_interval_ms == 0 {
            return Err(invalid(
                "device_plugin.health_interval_ms must be at least 1".into(),
            ));
        }
        if self.runtime.runtimes.is_empty() {
            return Err(invalid(
                "runtime.runtimes must name at least one runtime".into(),
            ));
        }
        self.arbiter.validate().map_err(invalid)
    }

    /// The socket directory: `flag`, then `KIWI_SOCKET_DIR`, then this file, then `/run/kiwi`.
    pub fn socket_dir(&self, flag: Option<&Path>) -> PathBuf {
        if let Some(f) = flag {
            return f.to_path_buf();
        }
        if let Some(e) = std::env::var_os(SOCKET_DIR_ENV).filter(|e| !e.is_empty()) {
            return PathBuf::from(e);
        }
        self.socket_dir.clone()
    }
}

/// `<socket-dir>/client`: the directory containers get bind-mounted.
pub fn client_dir(socket_dir: &Path) -> PathBuf {
    socket_dir.join("client")
}

/// `<socket-dir>/client/arbiter.sock`, mode 0666.
pub fn client_socket(socket_dir: &Path) -> PathBuf {
    client_dir(socket_dir).join("arbiter.sock")
}

/// `<socket-dir>/control.sock`, mode 0600, host only.
pub fn control_socket(socket_dir: &Path) -> PathBuf {
    socket_dir.join("control.sock")
}

/// GPU memory set aside for contexts: the configured value, or 1536 MiB capped at 1/8
/// of the GPU so small (simulated) GPUs keep most of their memory.
pub fn context_reserve_bytes(cfg: &ArbiterConfig, gpu_total: u64) -> u64 {
    match cfg.reserve_mib {
        Some(mib) => (mib << 20).min(gpu_total),
        None => (1536u64 << 20).min(gpu_total / 8),
    }
}

/// Parses sizes as people write them: `700MiB`, `1GiB`, `1.5GB`, `4096`, `512k`
/// (the one parser, [`kiwi_units::parse_size`]).
pub use kiwi_units::parse_size;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_file_is_defaults() {
        let c = Config::from_str_at("", Path::new("x.toml")).unwrap();
        assert_eq!(c, Config::default());
        assert_eq!(c.arbiter.tq_seconds, 30.0);
        assert_eq!(c.arbiter.tq_seconds, Quantum::default());
        assert_eq!(c.device_plugin.resource_name, "kiwi.dev/gpu");
    }

    #[test]
    fn design_example_parses() {
        let text = r#"
socket_dir = "/run/kiwi"
[arbiter]
scheduler = "off"
tq_seconds = 2.5
[runtime]
runtimes = ["crun"]
hook_path = "/usr/local/bin/kiwi-hook"
shim_path = "/usr/local/lib/kiwi/libkiwi.so"
device_root = "/dev"
[device_plugin]
resource_name = "kiwi.dev/gpu"
vgpus_per_gpu = 4
"#;
        let c = Config::from_str_at(text, Path::new("x.toml")).unwrap();
        assert_eq!(c.arbiter.scheduler, SchedulerMode::Off);
        assert_eq!(c.arbiter.tq_seconds.as_millis(), 2500);
        assert_eq!(c.runtime.runtimes, vec!["crun"]);
        assert_eq!(c.device_plugin.vgpus_per_gpu, 4);
        assert_eq!(c.device_plugin.health_interval_ms, 5_000);
    }

    #[test]
    fn malformed_names_file_and_line() {
        let err = Config::from_str_at(
            "socket_dir = \"/x\"\n[arbiter]\ntq_seconds = = 3\n",
            Path::new("/etc/k.toml"),
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("/etc/k.toml"), "{err}");
        assert!(err.contains("line 3"), "{err}");
    }

    #[test]
    fn unknown_keys_and_bad_values_refused() {
        let e = Config::from_str_at("[arbiter]\ntq_second = 3\n", Path::new("c")).unwrap_err();
        assert!(e.to_string().contains("line 2"), "{e}");
        assert!(Config::from_str_at("[arbiter]\ntq_seconds = 0\n", Path::new("c")).is_err());
        assert!(Config::from_str_at("[arbiter]\ntq_seconds = -3\n", Path::new("c")).is_err());
        assert!(Config::from_str_at("[arbiter]\nscheduler = \"maybe\"\n", Path::new("c")).is_err());
        assert!(
            Config::from_str_at("[device_plugin]\nvgpus_per_gpu = 0\n", Path::new("c")).is_err()
        );
        assert!(
            Config::from_str_at("[device_plugin]\nhealth_interval_ms = 0\n", Path::new("c"))
                .is_err()
        );
    }

    #[test]
    fn arbiter_limits_are_keys_and_zero_is_refused() {
        let c = Config::from_str_at(
            "[arbiter]\nmax_conns_per_group = 8\nframe_timeout_ms = 250\nevent_log_mib = 4\n",
            Path::new("c"),
        )
        .unwrap();
        assert_eq!(c.arbiter.max_conns_per_group, Some(8));
        assert_eq!(c.arbiter.frame_timeout_ms, Some(250));
        assert_eq!(c.arbiter.event_log_mib, Some(4));
        assert_eq!(c.arbiter.max_hint_wait_ms, None);
        // A bound on tenants, not on what the arbiter holds: 0 (never wait) is valid.
        for ms in [0, 200] {
            let c = Config::from_str_at(
                &format!("[arbiter]\nmax_hint_wait_ms = {ms}\n"),
                Path::new("c"),
            )
            .unwrap();
            assert_eq!(c.arbiter.max_hint_wait_ms, Some(ms));
        }
        for key in [
            "max_connections",
            "max_conns_per_group",
            "register_timeout_ms",
            "limit_nofile",
        ] {
            let e = Config::from_str_at(&format!("[arbiter]\n{key} = 0\n"), Path::new("c"))
                .unwrap_err()
                .to_string();
            assert!(
                e.contains(&format!("arbiter.{key} must be at least 1")),
                "{e}"
            );
        }
    }

    #[test]
    fn idle_evict_seconds_defaults_to_30_and_0_turns_it_off() {
        assert_eq!(ArbiterConfig::default().idle_evict_seconds, 30.0);
        let c = Config::from_str_at("[arbiter]\nidle_evict_seconds = 0\n", Path::new("c")).unwrap();
        assert_eq!(c.arbiter.idle_evict_seconds, 0.0);
        let c =
            Config::from_str_at("[arbiter]\nidle_evict_seconds = 1.5\n", Path::new("c")).unwrap();
        assert_eq!(c.arbiter.idle_evict_seconds, 1.5);
        let e = Config::from_str_at("[arbiter]\nidle_evict_seconds = -1\n", Path::new("c"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("idle_evict_seconds must be 0 (off)"), "{e}");
        assert_eq!(parse_idle_evict_arg("0").unwrap(), 0.0);
        for bad in ["-1", "abc", "", "nan", "inf", "1e9"] {
            assert!(parse_idle_evict_arg(bad).is_err(), "{bad} accepted");
        }
    }

    #[test]
    fn framework_defaults_on_by_default_off_by_key_and_bools_only() {
        let c = Config::from_str_at("", Path::new("c")).unwrap();
        assert!(c.hook.framework_defaults);
        assert_eq!(c.hook.framework_env(), FRAMEWORK_ENV_DEFAULTS);
        assert!(FRAMEWORK_ENV_DEFAULTS.contains(&("XLA_PYTHON_CLIENT_PREALLOCATE", "false")));
        assert!(FRAMEWORK_ENV_DEFAULTS.contains(&("TF_FORCE_GPU_ALLOW_GROWTH", "true")));
        let c =
            Config::from_str_at("[hook]\nframework_defaults = false\n", Path::new("c")).unwrap();
        assert!(!c.hook.framework_defaults);
        assert!(c.hook.framework_env().is_empty());
        for bad in ["\"false\"", "0", "no"] {
            let e = Config::from_str_at(
                &format!("socket_dir = \"/x\"\n[hook]\nframework_defaults = {bad}\n"),
                Path::new("/etc/kiwi/k.toml"),
            )
            .unwrap_err();
            // As every binary prints it.
            let e = one_line(&e);
            assert!(
                e.starts_with("config file /etc/kiwi/k.toml, line 3: "),
                "{e}"
            );
            assert_eq!(e.lines().count(), 1, "{e}");
        }
        let e = Config::from_str_at("[hook]\nframework_default = false\n", Path::new("c"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("line 2"), "{e}");
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("700MiB").unwrap(), 700 << 20);
        assert_eq!(parse_size("1GiB").unwrap(), 1 << 30);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("1.5GB").unwrap(), 1_500_000_000);
        assert!(parse_size("12 parsecs").is_err());
        assert!(parse_size("").is_err());
    }

    #[test]
    fn reserve_is_capped_for_small_gpus() {
        let a = ArbiterConfig::default();
        assert_eq!(context_reserve_bytes(&a, 1 << 30), 128 << 20);
        assert_eq!(context_reserve_bytes(&a, 80 << 30), 1536 << 20);
    }

    #[test]
    fn missing_explicit_file_is_an_error() {
        let e = Config::load(Some(Path::new("/nonexistent/kiwi.toml"))).unwrap_err();
        assert!(e.to_string().contains("/nonexistent/kiwi.toml"));
    }
}
