//! The CDI spec (`kiwictl cdi generate`) for runtimes that speak the Container Device
//! Interface (podman, CRI-O, containerd with CDI on): kind `kiwi.dev/gpu`, one device
//! per GPU by index and by UUID, plus `all`.
//!
//! Each device sets the claim (`KIWI_VISIBLE_DEVICES`) and adds its GPU's node; the
//! spec-wide edits add the control nodes, the frameworks' memory defaults
//! ([`kiwi_config::FRAMEWORK_ENV_DEFAULTS`], unless `[hook] framework_defaults = false`)
//! and `kiwi-hook` as a `createRuntime` hook, which then does in the container what it
//! does for kiwi-runtime. This module builds and prints the spec; it does not install it.
//!
//! Unlike kiwi-runtime, a CDI spec cannot leave a variable the container already sets
//! alone: engines (through CDI's library) write the spec's `env` over the image's and
//! the user's (podman 4.3 does, `tests/podman_cdi.rs` checks it). docs/containers.md
//! says so.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::Context;
use kiwi_config::Config;
use serde::{Deserialize, Serialize};

use crate::gpu::{self, DeviceNode, GpuError, HostDevices};

pub const CDI_KIND: &str = "kiwi.dev/gpu";

/// The lowest `cdiVersion` a spec's content needs, by the rules of CDI's own
/// `MinimumRequiredVersion` for the features this module can write: 0.3.0 (the earliest
/// engines accept), 0.5.0 once a device name starts with something other than a letter
/// (`0`, `1`: GPU indexes), 0.6.0 once the kind's class has a dot. Declaring more than
/// needed only shuts out older engines: podman 4.3 (Debian 12) refuses a 0.6.0 spec.
pub fn minimum_cdi_version(spec: &CdiSpec) -> &'static str {
    let class = spec.kind.split_once('/').map_or("", |(_, c)| c);
    if class.contains('.') {
        return "0.6.0";
    }
    let digit_first = spec.devices.iter().any(|d| {
        d.name
            .chars()
            .next()
            .is_some_and(|c| !c.is_ascii_alphabetic())
    });
    if digit_first {
        return "0.5.0";
    }
    "0.3.0"
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CdiSpec {
    pub cdi_version: String,
    pub kind: String,
    pub devices: Vec<CdiDevice>,
    #[serde(default)]
    pub container_edits: ContainerEdits,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CdiDevice {
    pub name: String,
    pub container_edits: ContainerEdits,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ContainerEdits {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub device_nodes: Vec<CdiDeviceNode>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hooks: Vec<CdiHook>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CdiDeviceNode {
    pub path: PathBuf,
    #[serde(rename = "type")]
    pub kind: String,
    pub major: u64,
    pub minor: u64,
    pub file_mode: u32,
    pub permissions: String,
}

impl From<&DeviceNode> for CdiDeviceNode {
    fn from(n: &DeviceNode) -> Self {
        CdiDeviceNode {
            path: n.path.clone(),
            kind: "c".into(),
            major: n.major,
            minor: n.minor,
            file_mode: n.mode,
            permissions: "rwm".into(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CdiHook {
    pub hook_name: String,
    pub path: PathBuf,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub args: Vec<String>,
}

fn claim_env(v: &str) -> String {
    format!("{}={v}", crate::CLAIM_ENV)
}

/// A GPU as the spec names it: by index, and by UUID where discovery knows it (a GPU
/// found only as a device node under the device root has none).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CdiGpu {
    pub index: u32,
    pub uuid: Option<String>,
    /// Minor number of `<device_root>/nvidia<minor>`.
    pub minor: u32,
}

/// The GPUs of this node for the spec: the configured GPU list, else NVML (both through
/// `kiwi-nvml`), else, where NVML is missing or fails, the `nvidia<N>` device nodes
/// under the device root (indexes only, no UUIDs). A malformed list is an error.
pub fn discover_gpus(cfg: &Config) -> Result<Vec<CdiGpu>, GpuError> {
    let discovered =
        gpu::discovery_from_config(cfg).and_then(|mut d| d.discover().map_err(GpuError::from));
    match discovered {
        Ok(gpus) => gpus
            .iter()
            .map(|g| {
                Ok(CdiGpu {
                    index: g.index,
                    uuid: Some(g.uuid.clone()),
                    minor: kiwi_nvml::minor_for_uuid(&gpus, &g.uuid)?,
                })
            })
            .collect(),
        Err(e) if e.is_nvml() => {
            let devices = HostDevices::new(&cfg.runtime.device_root);
            Ok(devices
                .gpu_minors()?
                .into_iter()
                .map(|m| CdiGpu {
                    index: m,
                    uuid: None,
                    minor: m,
                })
                .collect())
        }
        Err(e) => Err(e),
    }
}

/// Builds the spec for `gpus`, with the device numbers of the host's nodes under
/// `runtime.device_root` and the hook of `runtime.hook_path`.
pub fn generate_cdi_spec(gpus: &[CdiGpu], cfg: &Config) -> Result<CdiSpec, GpuError> {
    let devices = HostDevices::new(&cfg.runtime.device_root);
    let mut out = Vec::new();
    let mut all_nodes = Vec::new();
    for g in gpus {
        let node = devices
            .node(&format!("nvidia{}", g.minor))
            .map_err(|e| match e {
                GpuError::MissingNode { path, .. } => GpuError::UnknownGpu {
                    gpu: g.index.to_string(),
                    reason: format!("{} does not exist", path.display()),
                },
                other => other,
            })?;
        let cdi_node = CdiDeviceNode::from(&node);
        out.push(CdiDevice {
            name: g.index.to_string(),
            container_edits: ContainerEdits {
                env: vec![claim_env(
                    &g.uuid.clone().unwrap_or_else(|| g.index.to_string()),
                )],
                device_nodes: vec![cdi_node.clone()],
                hooks: vec![],
            },
        });
        if let Some(u) = &g.uuid {
            out.push(CdiDevice {
                name: u.clone(),
                container_edits: ContainerEdits {
                    env: vec![claim_env(u)],
                    device_nodes: vec![cdi_node.clone()],
                    hooks: vec![],
                },
            });
        }
        all_nodes.push(cdi_node);
    }
    out.push(CdiDevice {
        name: "all".into(),
        container_edits: ContainerEdits {
            env: vec![claim_env("all")],
            device_nodes: all_nodes,
            hooks: vec![],
        },
    });
    let control = devices.control_nodes()?;
    let hook = crate::runtime::hook_entry(cfg, &cfg.socket_dir(None));
    let mut args = hook.args;
    if let Some(last) = args.last_mut() {
        *last = "createRuntime".into();
    }
    let mut stop_args = args.clone();
    if let Some(last) = stop_args.last_mut() {
        *last = crate::runtime::POSTSTOP_STAGE.into();
    }
    let mut spec = CdiSpec {
        cdi_version: String::new(),
        kind: CDI_KIND.into(),
        devices: out,
        container_edits: ContainerEdits {
            // `env` is in CDI's first versions: it never raises `cdiVersion`.
            env: cfg
                .hook
                .framework_env()
                .iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect(),
            device_nodes: control.iter().map(CdiDeviceNode::from).collect(),
            // poststop drops the container's own client socket.
            hooks: vec![
                CdiHook {
                    hook_name: "createRuntime".into(),
                    path: hook.path.clone(),
                    args,
                },
                CdiHook {
                    hook_name: crate::runtime::POSTSTOP_STAGE.into(),
                    path: hook.path,
                    args: stop_args,
                },
            ],
        },
    };
    spec.cdi_version = minimum_cdi_version(&spec).into();
    Ok(spec)
}

/// `kiwictl cdi generate` arguments.
#[derive(Debug, Clone, clap::Args)]
pub struct CdiGenerateArgs {
    /// Write the spec to this file (e.g. /etc/cdi/kiwi.json) instead of stdout.
    #[arg(short, long, value_name = "FILE")]
    pub output: Option<PathBuf>,
    /// Config file (default: $KIWI_CONFIG, then /etc/kiwi/config.toml).
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
}

/// Discovers the GPUs, builds the spec and prints it as JSON.
pub fn run_cdi_generate(args: &CdiGenerateArgs) -> anyhow::Result<()> {
    let cfg = Config::load(args.config.as_deref())?;
    let gpus = discover_gpus(&cfg).context("cannot list the GPUs of this node")?;
    let spec = generate_cdi_spec(&gpus, &cfg)?;
    let mut text = serde_json::to_string_pretty(&spec).context("serializing the CDI spec")?;
    text.push('\n');
    match &args.output {
        Some(path) => write_atomically(path, text.as_bytes())
            .with_context(|| format!("cannot write {}", path.display()))?,
        None => std::io::stdout()
            .write_all(text.as_bytes())
            .context("cannot write to stdout")?,
    }
    Ok(())
}

fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let tmp = dir.join(format!(
        ".{}.tmp{}",
        path.file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
        std::process::id()
    ));
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(kind: &str, names: &[&str]) -> CdiSpec {
        CdiSpec {
            cdi_version: String::new(),
            kind: kind.into(),
            devices: names
                .iter()
                .map(|n| CdiDevice {
                    name: n.to_string(),
                    container_edits: ContainerEdits::default(),
                })
                .collect(),
            container_edits: ContainerEdits::default(),
        }
    }

    /// A device root with `nvidia0`, `nvidiactl` and `nvidia-uvm` (links to /dev/null:
    /// character devices without mknod).
    fn config_with_gpu0() -> (tempfile::TempDir, Config) {
        let dir = tempfile::tempdir().unwrap();
        for n in ["nvidia0", "nvidiactl", "nvidia-uvm"] {
            std::os::unix::fs::symlink("/dev/null", dir.path().join(n)).unwrap();
        }
        let mut cfg = Config::default();
        cfg.runtime.device_root = dir.path().to_path_buf();
        (dir, cfg)
    }

    const GPU0: CdiGpu = CdiGpu {
        index: 0,
        uuid: None,
        minor: 0,
    };

    #[test]
    fn spec_wide_edits_carry_the_framework_defaults_unless_turned_off() {
        let (_dev, mut cfg) = config_with_gpu0();
        let spec = generate_cdi_spec(&[GPU0], &cfg).unwrap();
        assert_eq!(
            spec.container_edits.env,
            [
                "XLA_PYTHON_CLIENT_PREALLOCATE=false",
                "TF_FORCE_GPU_ALLOW_GROWTH=true"
            ]
        );
        // In the JSON engines read, next to the claim of each device.
        let json = serde_json::to_value(&spec).unwrap();
        assert_eq!(
            json["containerEdits"]["env"][0],
            "XLA_PYTHON_CLIENT_PREALLOCATE=false"
        );
        assert_eq!(
            json["devices"][0]["containerEdits"]["env"][0],
            "KIWI_VISIBLE_DEVICES=0"
        );
        // env needs no newer CDI: still the version the device names ask for.
        assert_eq!(spec.cdi_version, "0.5.0");
        assert_eq!(generate_cdi_spec(&[], &cfg).unwrap().cdi_version, "0.3.0");

        cfg.hook.framework_defaults = false;
        let off = generate_cdi_spec(&[GPU0], &cfg).unwrap();
        assert!(off.container_edits.env.is_empty());
        let json = serde_json::to_value(&off).unwrap();
        assert!(json["containerEdits"].get("env").is_none(), "{json}");
        assert!(!json.to_string().contains("XLA_PYTHON"), "{json}");
        assert_eq!(
            off.container_edits.device_nodes,
            spec.container_edits.device_nodes
        );
        assert_eq!(off.devices, spec.devices);
    }

    #[test]
    fn declared_version_is_the_lowest_the_content_needs() {
        // Today's content: GPU indexes as device names need 0.5.0, and nothing more.
        assert_eq!(
            minimum_cdi_version(&spec(CDI_KIND, &["0", "GPU-1234", "all"])),
            "0.5.0"
        );
        // Names that start with a letter (no GPU found: only `all`) need nothing new.
        assert_eq!(minimum_cdi_version(&spec(CDI_KIND, &["all"])), "0.3.0");
        assert_eq!(
            minimum_cdi_version(&spec(CDI_KIND, &["GPU-1", "all"])),
            "0.3.0"
        );
        // A dot in the class (0.6.0) outranks a digit-first name.
        assert_eq!(
            minimum_cdi_version(&spec("kiwi.dev/v.gpu", &["0"])),
            "0.6.0"
        );
        // Dots in the vendor are allowed since the beginning.
        assert_eq!(minimum_cdi_version(&spec("a.b.c/gpu", &["x"])), "0.3.0");
    }
}
