//! From a claim to host device nodes: which `/dev/nvidia*` files a claimed container
//! needs, with the major/minor numbers the host really has.
//!
//! Indexes need no discovery: index `N` is `<device_root>/nvidia<N>`. A UUID's device
//! node comes from GPU discovery, which is `kiwi-nvml`'s (the one [`GpuDiscovery`] the
//! device plugin uses too): the GPU list file `device_plugin.gpu_list` when one is
//! configured (its one format and its rules, duplicates and malformed UUIDs refused,
//! are in `kiwi_nvml::list`), else NVML loaded with `dlopen`, so nothing here links
//! against the driver. This module never edits a spec or touches a container.

use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use kiwi_nvml::{GpuListSource, NvmlSource, NVML_LIBRARY};

pub use kiwi_nvml::{Gpu, GpuDiscovery};

use crate::claim::{Claim, GpuRef};

/// Control nodes every CUDA process opens, besides its GPUs. `true`: required.
pub const CONTROL_NODES: [(&str, bool); 3] = [
    ("nvidiactl", true),
    ("nvidia-uvm", true),
    ("nvidia-uvm-tools", false),
];

/// Errors turning a claim into device nodes.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    #[error("unknown GPU {gpu}: {reason}")]
    UnknownGpu { gpu: String, reason: String },
    #[error("device node {path} is missing on the host{hint}")]
    MissingNode { path: PathBuf, hint: &'static str },
    #[error("{path} is not a character device")]
    NotCharDevice { path: PathBuf },
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    /// Discovery failed: the GPU list is unreadable or malformed, NVML failed, or the
    /// UUID is not this node's.
    #[error(transparent)]
    Discovery(#[from] kiwi_nvml::GpuError),
    /// NVML is missing or does not start; the hint is part of the one line.
    #[error("{nvml}; to resolve GPU UUIDs without NVML, configure device_plugin.gpu_list or claim GPUs by index")]
    NoNvml { nvml: kiwi_nvml::GpuError },
    /// Discovery failed in another process (the hook's forked child); its one line.
    #[error("{0}")]
    DiscoveryIn(String),
    #[error(
        "the container claims all GPUs but there is no {root}/nvidia<N> device node on this host"
    )]
    NoGpus { root: PathBuf },
}

impl GpuError {
    /// Whether NVML is missing or failed (not a GPU list's error, nor a device node's).
    pub fn is_nvml(&self) -> bool {
        match self {
            GpuError::NoNvml { .. } => true,
            GpuError::Discovery(e) => e.is_nvml(),
            _ => false,
        }
    }
}

/// A character device as the container must see it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DeviceNode {
    /// Path inside the container, e.g. `/dev/nvidia0`.
    pub path: PathBuf,
    pub major: u64,
    pub minor: u64,
    /// Permission bits, taken from the host node.
    pub mode: u32,
}

/// The discovery the configuration asks for: the GPU list file if one is configured
/// (read when asked, not here), else NVML.
pub fn discovery_from_config(cfg: &kiwi_config::Config) -> Result<Box<dyn GpuDiscovery>, GpuError> {
    match &cfg.device_plugin.gpu_list {
        Some(p) => Ok(Box::new(GpuListSource::new(p))),
        None => match NvmlSource::load(NVML_LIBRARY) {
            Ok(nvml) => Ok(Box::new(nvml)),
            Err(nvml) => Err(GpuError::NoNvml { nvml }),
        },
    }
}

/// A UUID's minor number through the discovery `make` returns, made at the first UUID
/// asked (so claims by index or `all` never load NVML) and kept for the next ones.
pub fn minor_through(
    make: impl FnOnce() -> Result<Box<dyn GpuDiscovery>, GpuError>,
) -> impl FnMut(&str) -> Result<u32, GpuError> {
    let mut make = Some(make);
    let mut made: Option<Box<dyn GpuDiscovery>> = None;
    move |uuid| {
        let discovery = match made.take() {
            Some(d) => d,
            None => {
                let make = make.take().ok_or_else(|| {
                    GpuError::DiscoveryIn("GPU discovery failed for an earlier GPU".into())
                })?;
                make()?
            }
        };
        Ok(made.insert(discovery).minor_for_uuid(uuid)?)
    }
}

/// The host's device directory (`runtime.device_root`, `/dev` by default).
#[derive(Debug, Clone)]
pub struct HostDevices {
    pub root: PathBuf,
}

impl HostDevices {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into() }
    }

    /// The node `<root>/<name>`, seen in the container as `/dev/<name>`.
    pub fn node(&self, name: &str) -> Result<DeviceNode, GpuError> {
        let host = self.root.join(name);
        let md = std::fs::metadata(&host).map_err(|source| {
            if source.kind() == std::io::ErrorKind::NotFound {
                GpuError::MissingNode {
                    path: host.clone(),
                    hint: "",
                }
            } else {
                GpuError::Io {
                    path: host.clone(),
                    source,
                }
            }
        })?;
        if !md.file_type().is_char_device() {
            return Err(GpuError::NotCharDevice { path: host });
        }
        let rdev = md.rdev();
        Ok(DeviceNode {
            path: Path::new("/dev").join(name),
            major: libc::major(rdev) as u64,
            minor: libc::minor(rdev) as u64,
            mode: md.mode() & 0o777,
        })
    }

    /// Minor numbers of every `nvidia<N>` node under the root, ascending.
    pub fn gpu_minors(&self) -> Result<Vec<u32>, GpuError> {
        let rd = std::fs::read_dir(&self.root).map_err(|source| GpuError::Io {
            path: self.root.clone(),
            source,
        })?;
        let mut minors: Vec<u32> = rd
            .filter_map(|e| e.ok())
            .filter_map(|e| {
                let name = e.file_name();
                let n = name.to_str()?.strip_prefix("nvidia")?;
                if n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
                    return None;
                }
                n.parse().ok()
            })
            .collect();
        minors.sort_unstable();
        Ok(minors)
    }

    /// Device nodes for the control devices every CUDA process needs. A missing
    /// optional node is skipped; a missing required one is an error.
    pub fn control_nodes(&self) -> Result<Vec<DeviceNode>, GpuError> {
        let mut out = Vec::new();
        for (name, required) in CONTROL_NODES {
            match self.node(name) {
                Ok(n) => out.push(n),
                Err(GpuError::MissingNode { path, .. }) if required => {
                    return Err(GpuError::MissingNode {
                        path,
                        hint: " (is the NVIDIA driver loaded? nvidia-uvm needs `nvidia-modprobe -u -c=0`)",
                    })
                }
                Err(GpuError::MissingNode { .. }) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(out)
    }
}

/// The GPUs' device nodes for `claim`, then the control nodes. `minor_for_uuid` is
/// only called for a GPU named by UUID (see [`minor_through`]), so the index and `all`
/// paths need no discovery.
pub fn resolve_claim(
    claim: &Claim,
    devices: &HostDevices,
    mut minor_for_uuid: impl FnMut(&str) -> Result<u32, GpuError>,
) -> Result<Vec<DeviceNode>, GpuError> {
    let minors: Vec<(String, u32)> = match claim {
        Claim::None => return Ok(Vec::new()),
        Claim::All => {
            let m = devices.gpu_minors()?;
            if m.is_empty() {
                return Err(GpuError::NoGpus {
                    root: devices.root.clone(),
                });
            }
            m.into_iter().map(|m| (m.to_string(), m)).collect()
        }
        Claim::Gpus(refs) => {
            let mut out = Vec::new();
            for r in refs {
                let minor = match r {
                    GpuRef::Index(i) => *i,
                    GpuRef::Uuid(u) => minor_for_uuid(u)?,
                };
                out.push((r.to_string(), minor));
            }
            out
        }
    };
    let mut nodes: Vec<DeviceNode> = Vec::new();
    for (name, minor) in minors {
        let node = devices
            .node(&format!("nvidia{minor}"))
            .map_err(|e| match e {
                GpuError::MissingNode { path, .. } => GpuError::UnknownGpu {
                    gpu: name,
                    reason: format!("{} does not exist", path.display()),
                },
                other => other,
            })?;
        if !nodes.contains(&node) {
            nodes.push(node);
        }
    }
    nodes.extend(devices.control_nodes()?);
    Ok(nodes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiwi_nvml::FakeGpus;

    /// A device root with `nvidia0`, `nvidia5`, `nvidiactl` and `nvidia-uvm` (links
    /// to /dev/null: character devices without mknod).
    fn device_root() -> (tempfile::TempDir, HostDevices) {
        let dir = tempfile::tempdir().unwrap();
        for n in ["nvidia0", "nvidia5", "nvidiactl", "nvidia-uvm"] {
            std::os::unix::fs::symlink("/dev/null", dir.path().join(n)).unwrap();
        }
        let devs = HostDevices::new(dir.path());
        (dir, devs)
    }

    fn gpu_nodes(nodes: &[DeviceNode]) -> Vec<String> {
        nodes
            .iter()
            .map(|n| n.path.display().to_string())
            .filter(|p| p.trim_start_matches("/dev/nvidia").parse::<u32>().is_ok())
            .collect()
    }

    #[test]
    fn uuids_resolve_through_one_discovery_made_at_the_first_uuid() {
        let (_dir, devs) = device_root();
        let mut gpus = FakeGpus::new(2).gpus();
        gpus[1].minor = Some(5);
        let (u0, u1) = (gpus[0].uuid.clone(), gpus[1].uuid.clone());
        let made = std::cell::Cell::new(0);
        let claim = Claim::Gpus(vec![
            GpuRef::Uuid(u1.clone()),
            GpuRef::Index(0),
            GpuRef::Uuid(u0),
        ]);
        let nodes = resolve_claim(
            &claim,
            &devs,
            minor_through(|| {
                made.set(made.get() + 1);
                Ok(Box::new(FakeGpus::with_gpus(gpus.clone())))
            }),
        )
        .unwrap();
        assert_eq!(made.get(), 1);
        assert_eq!(gpu_nodes(&nodes), ["/dev/nvidia5", "/dev/nvidia0"]);
        // An unknown UUID names itself; a failed discovery is the error.
        let claim = Claim::Gpus(vec![GpuRef::Uuid("GPU-nope".into())]);
        let e = resolve_claim(
            &claim,
            &devs,
            minor_through(|| Ok(Box::new(FakeGpus::new(1)))),
        )
        .unwrap_err();
        assert!(e.to_string().starts_with("unknown GPU GPU-nope: "), "{e}");
        let e = resolve_claim(
            &claim,
            &devs,
            minor_through(|| Err(GpuError::DiscoveryIn("no list".into()))),
        )
        .unwrap_err();
        assert_eq!(e.to_string(), "no list");
    }

    #[test]
    fn a_configured_list_is_read_with_the_strict_rules() {
        let dir = tempfile::tempdir().unwrap();
        let list = dir.path().join("gpus");
        let mut cfg = kiwi_config::Config::default();
        cfg.device_plugin.gpu_list = Some(list.clone());
        // The format the device plugin reads, a bare third number as the minor too.
        std::fs::write(
            &list,
            "0 GPU-aaa 7 # comment\n1 GPU-bbb minor=4 NVIDIA H100\n",
        )
        .unwrap();
        let mut d = discovery_from_config(&cfg).unwrap();
        assert_eq!(d.minor_for_uuid("GPU-aaa").unwrap(), 7);
        assert_eq!(d.minor_for_uuid("GPU-bbb").unwrap(), 4);
        // Refused now, as by the device plugin: a UUID twice, a malformed UUID.
        for (text, what) in [
            ("0 GPU-aaa\n1 GPU-aaa\n", "line 2: GPU GPU-aaa listed twice"),
            ("0 GPU-a,b\n", "line 1: GPU UUID \"GPU-a,b\" contains ','"),
        ] {
            std::fs::write(&list, text).unwrap();
            let e = discovery_from_config(&cfg)
                .unwrap()
                .minor_for_uuid("GPU-aaa")
                .map_err(GpuError::from)
                .unwrap_err();
            assert!(e.to_string().contains(what), "{e}");
            assert!(!e.is_nvml(), "{e}");
        }
    }

    #[test]
    fn missing_gpu_node_is_an_unknown_gpu() {
        let dir = tempfile::tempdir().unwrap();
        let devs = HostDevices::new(dir.path());
        let claim = Claim::Gpus(vec![GpuRef::Index(3)]);
        let e = resolve_claim(&claim, &devs, |_| panic!("no discovery for indexes")).unwrap_err();
        assert!(e.to_string().starts_with("unknown GPU 3"), "{e}");
        let e = resolve_claim(&Claim::All, &devs, |_| panic!("none")).unwrap_err();
        assert!(matches!(e, GpuError::NoGpus { .. }), "{e}");
    }

    #[test]
    fn regular_file_is_not_a_device() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("nvidia0"), b"").unwrap();
        let devs = HostDevices::new(dir.path());
        assert!(matches!(
            devs.node("nvidia0"),
            Err(GpuError::NotCharDevice { .. })
        ));
        assert_eq!(devs.gpu_minors().unwrap(), vec![0]);
    }
}
