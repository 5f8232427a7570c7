//! What a GPU is to Kiwi and the one trait every GPU source implements,
//! [`GpuDiscovery`]: discovery, the device node of a UUID, health (fault events and
//! probes). The sources are [`crate::source::NvmlSource`], [`crate::list::GpuListSource`]
//! and [`crate::fake::FakeGpus`]. This module knows nothing of vGPUs, the kubelet or
//! containers, and does no I/O.

use std::path::PathBuf;
use std::time::Duration;

/// One physical GPU.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Gpu {
    /// NVML index (or the index written in the list file).
    pub index: u32,
    /// `GPU-…` (or `MIG-…`) UUID, checked by [`validate_uuid`]; the claim the container
    /// runtime acts on.
    pub uuid: String,
    /// Minor number of its device node, `/dev/nvidia<minor>`, if known (a list file's
    /// defaults to the index).
    pub minor: Option<u32>,
    /// Product name, if known.
    pub name: Option<String>,
    /// Total memory in bytes, if known.
    pub memory_bytes: Option<u64>,
    /// PCI bus id in sysfs form (`0000:3b:00.0`), if known.
    pub pci_bus_id: Option<String>,
    /// NUMA node, if known (sysfs reports -1 for "none"; that is stored as `None`).
    pub numa_node: Option<i64>,
}

impl Gpu {
    /// A GPU known only by index and UUID.
    pub fn new(index: u32, uuid: impl Into<String>) -> Gpu {
        Gpu {
            index,
            uuid: uuid.into(),
            minor: None,
            name: None,
            memory_bytes: None,
            pci_bus_id: None,
            numa_node: None,
        }
    }
}

/// A critical fault reported asynchronously (an NVML event).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fault {
    /// The GPU it concerns; `None` means every GPU (NVML reports some events that way).
    pub uuid: Option<String>,
    /// Why, for the log.
    pub reason: String,
}

/// The outcome of probing one GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Probe {
    /// The GPU answers.
    Ok,
    /// The GPU is gone or broken; why, for the log.
    Failed(String),
}

/// Errors from GPU discovery.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    #[error("cannot load NVML ({library}): {message}")]
    NvmlLoad { library: String, message: String },
    #[error("NVML {call} failed: {message}")]
    Nvml { call: &'static str, message: String },
    #[error("cannot read GPU list {path}: {source}")]
    ListRead {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("GPU list {path}, line {line}: {message}")]
    ListParse {
        path: PathBuf,
        line: usize,
        message: String,
    },
    #[error("unknown GPU {uuid}: {reason}")]
    UnknownGpu { uuid: String, reason: String },
}

impl GpuError {
    /// Whether the error is NVML's (missing, failed to start, or a failed call), as
    /// opposed to a GPU list's or an unknown GPU.
    pub fn is_nvml(&self) -> bool {
        matches!(self, GpuError::NvmlLoad { .. } | GpuError::Nvml { .. })
    }
}

impl From<crate::NvmlError> for GpuError {
    fn from(e: crate::NvmlError) -> GpuError {
        GpuError::Nvml {
            call: e.call,
            message: format!("{} (NVML error {})", e.message, e.code),
        }
    }
}

impl From<crate::LoadError> for GpuError {
    fn from(e: crate::LoadError) -> GpuError {
        match e {
            crate::LoadError::Library { library, message } => {
                GpuError::NvmlLoad { library, message }
            }
            crate::LoadError::Init(e) => e.into(),
        }
    }
}

/// Where GPUs come from and how their health is learnt.
///
/// The device plugin's health monitor calls these from one dedicated thread, so
/// implementations may block (NVML's event wait does).
pub trait GpuDiscovery: Send + 'static {
    /// Every GPU on the node, in index order.
    fn discover(&mut self) -> Result<Vec<Gpu>, GpuError>;
    /// The minor number of the device node of the GPU with this UUID
    /// (`/dev/nvidia<minor>`). By default, looked up in [`GpuDiscovery::discover`]'s
    /// answer.
    fn minor_for_uuid(&mut self, uuid: &str) -> Result<u32, GpuError> {
        minor_for_uuid(&self.discover()?, uuid)
    }
    /// Waits at most `timeout` for critical faults; returns those seen (maybe none).
    fn wait_faults(&mut self, timeout: Duration) -> Vec<Fault>;
    /// Checks that one GPU still answers.
    fn probe(&mut self, gpu: &Gpu) -> Probe;
    /// A short name for logs ("NVML, driver 550.54.15", "GPU list /etc/kiwi/gpus").
    fn describe(&self) -> String;
}

/// The minor number of the GPU with this UUID among `gpus`.
pub fn minor_for_uuid(gpus: &[Gpu], uuid: &str) -> Result<u32, GpuError> {
    let unknown = |reason: &str| GpuError::UnknownGpu {
        uuid: uuid.to_string(),
        reason: reason.into(),
    };
    let gpu = gpus
        .iter()
        .find(|g| g.uuid == uuid)
        .ok_or_else(|| unknown("no GPU with this UUID on this node"))?;
    gpu.minor
        .ok_or_else(|| unknown("the minor number of its device node is not known"))
}

/// Checks a GPU UUID: it is used in vGPU IDs (`<uuid>::<n>`) and in
/// `KIWI_VISIBLE_DEVICES` (comma-separated, `all`/`none`/`void` reserved). The error
/// is one line naming the UUID.
pub fn validate_uuid(uuid: &str) -> Result<(), String> {
    if uuid.is_empty() {
        return Err("empty GPU UUID".into());
    }
    if uuid.contains("::") {
        return Err(format!("GPU UUID {uuid:?} contains \"::\""));
    }
    if let Some(c) = uuid
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | ':')))
    {
        return Err(format!("GPU UUID {uuid:?} contains {c:?}"));
    }
    if uuid.eq_ignore_ascii_case("all")
        || uuid.eq_ignore_ascii_case("none")
        || uuid.eq_ignore_ascii_case("void")
    {
        return Err(format!("{uuid:?} is reserved in KIWI_VISIBLE_DEVICES"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuids_nvml_gives_pass() {
        for ok in [
            "GPU-8f6a0c5e-7b1d-4c2e-9a3f-1d2e3f4a5b6c",
            "MIG-8f6a0c5e-7b1d-4c2e-9a3f-1d2e3f4a5b6c",
            "GPU-a:b",
            "gpu_1.x",
            "allx",
        ] {
            assert_eq!(validate_uuid(ok), Ok(()), "{ok}");
        }
    }

    #[test]
    fn malformed_and_reserved_uuids_are_refused_in_one_line() {
        for (bad, why) in [
            ("", "empty"),
            ("GPU-a::b", "\"::\""),
            ("GPU-a,b", "','"),
            ("GPU-a b", "' '"),
            ("GPU-ä", "'ä'"),
            ("GPU-a\tb", "'\\t'"),
            // Old-style MIG names (`MIG-GPU-<uuid>/<gi>/<ci>`): no `/` allowed.
            ("MIG-GPU-8f6a0c5e/1/0", "'/'"),
            ("all", "reserved"),
            ("ALL", "reserved"),
            ("None", "reserved"),
            ("void", "reserved"),
        ] {
            let e = validate_uuid(bad).unwrap_err();
            assert!(e.contains(why), "{bad:?}: {e}");
            assert!(!e.contains('\n'), "{bad:?}: {e}");
        }
    }

    #[test]
    fn minor_lookup_names_the_uuid() {
        let mut a = Gpu::new(0, "GPU-a");
        a.minor = Some(4);
        let gpus = [a, Gpu::new(1, "GPU-b")];
        assert_eq!(minor_for_uuid(&gpus, "GPU-a").unwrap(), 4);
        let e = minor_for_uuid(&gpus, "GPU-c").unwrap_err().to_string();
        assert_eq!(e, "unknown GPU GPU-c: no GPU with this UUID on this node");
        let e = minor_for_uuid(&gpus, "GPU-b").unwrap_err().to_string();
        assert!(e.starts_with("unknown GPU GPU-b: the minor number"), "{e}");
    }

    #[test]
    fn nvml_errors_are_told_apart() {
        let load: GpuError = crate::LoadError::Library {
            library: "x".into(),
            message: "gone".into(),
        }
        .into();
        assert!(load.is_nvml());
        assert_eq!(load.to_string(), "cannot load NVML (x): gone");
        let call: GpuError = crate::NvmlError {
            call: "nvmlInit_v2",
            code: 9,
            message: "driver not loaded".into(),
        }
        .into();
        assert!(call.is_nvml());
        assert_eq!(
            call.to_string(),
            "NVML nvmlInit_v2 failed: driver not loaded (NVML error 9)"
        );
        let unknown = GpuError::UnknownGpu {
            uuid: "GPU-x".into(),
            reason: "r".into(),
        };
        assert!(!unknown.is_nvml());
    }
}
