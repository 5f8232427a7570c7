//! From a claim to host device nodes: which `/dev/nvidia*` files a claimed container
//! needs, with the major/minor numbers the host really has.
//!
//! GPU discovery (UUID → minor number, the GPU list) sits behind [`GpuDiscovery`]: a
//! GPU list file (`device_plugin.gpu_list`) or NVML loaded with `dlopen`, so nothing
//! here links against the driver. Indexes need no discovery: index `N` is
//! `<device_root>/nvidia<N>`. This module never edits a spec or touches a container.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

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
    #[error("GPU list {path}, line {line}: {reason}")]
    BadGpuList {
        path: PathBuf,
        line: usize,
        reason: String,
    },
    #[error("NVML: {0}")]
    Nvml(String),
    #[error(
        "the container claims all GPUs but there is no {root}/nvidia<N> device node on this host"
    )]
    NoGpus { root: PathBuf },
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

/// One physical GPU as discovery reports it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct GpuInfo {
    pub index: u32,
    pub uuid: Option<String>,
    /// Minor number of `/dev/nvidia<minor>`.
    pub minor: u32,
}

/// GPU discovery: real (NVML) or from a list file; tests use either a list or a fake.
pub trait GpuDiscovery {
    /// Every GPU on the node.
    fn gpus(&self) -> Result<Vec<GpuInfo>, GpuError>;
    /// The minor number of the GPU with this UUID.
    fn minor_for_uuid(&self, uuid: &str) -> Result<u32, GpuError> {
        self.gpus()?
            .into_iter()
            .find(|g| g.uuid.as_deref() == Some(uuid))
            .map(|g| g.minor)
            .ok_or_else(|| GpuError::UnknownGpu {
                gpu: uuid.to_string(),
                reason: "no GPU with this UUID on this node".into(),
            })
    }
}

/// A fixed list of GPUs (a GPU list file, or a test's fake).
#[derive(Debug, Clone, Default)]
pub struct StaticGpus(pub Vec<GpuInfo>);

impl GpuDiscovery for StaticGpus {
    fn gpus(&self) -> Result<Vec<GpuInfo>, GpuError> {
        Ok(self.0.clone())
    }
}

impl StaticGpus {
    /// Reads a GPU list file: one GPU a line, `<index> <uuid> [minor]`, `#` comments.
    /// The minor number defaults to the index.
    pub fn from_file(path: &Path) -> Result<StaticGpus, GpuError> {
        let text = std::fs::read_to_string(path).map_err(|source| GpuError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::parse(&text, path)
    }

    pub fn parse(text: &str, path: &Path) -> Result<StaticGpus, GpuError> {
        let mut gpus = Vec::new();
        for (n, raw) in text.lines().enumerate() {
            let line = raw.split('#').next().unwrap_or("").trim();
            if line.is_empty() {
                continue;
            }
            let bad = |reason: String| GpuError::BadGpuList {
                path: path.to_path_buf(),
                line: n + 1,
                reason,
            };
            // The one GPU list format Kiwi reads (shared with kiwi-device-plugin):
            // `<index> <uuid> [minor=N] [pci=..] [numa=..] [memory=..] [name...]`,
            // a bare third number as the minor, or `nvidia-smi -L` lines.
            let (index, uuid, rest): (u32, String, Vec<&str>) =
                if line.starts_with("GPU ") && line.contains("(UUID:") {
                    let idx = line["GPU ".len()..].split(':').next().unwrap_or("").trim();
                    let uuid = line
                        .split("(UUID:")
                        .nth(1)
                        .and_then(|r| r.split(')').next())
                        .map(str::trim)
                        .unwrap_or("");
                    let index: u32 = idx
                        .parse()
                        .map_err(|_| bad(format!("{idx:?} is not a GPU index")))?;
                    if uuid.is_empty() {
                        return Err(bad("no UUID in the nvidia-smi line".into()));
                    }
                    (index, uuid.to_string(), Vec::new())
                } else {
                    let fields: Vec<&str> = line.split_whitespace().collect();
                    if fields.len() < 2 {
                        return Err(bad("expected `<index> <uuid> [minor=N] ...`".into()));
                    }
                    let index: u32 = fields[0]
                        .parse()
                        .map_err(|_| bad(format!("{:?} is not a GPU index", fields[0])))?;
                    (index, fields[1].to_string(), fields[2..].to_vec())
                };
            let mut minor = index;
            for (i, word) in rest.iter().enumerate() {
                if let Some(m) = word.strip_prefix("minor=") {
                    minor = m
                        .parse()
                        .map_err(|_| bad(format!("{m:?} is not a minor number")))?;
                } else if i == 0 && word.bytes().all(|b| b.is_ascii_digit()) {
                    minor = word
                        .parse()
                        .map_err(|_| bad(format!("{word:?} is not a minor number")))?;
                }
            }
            gpus.push(GpuInfo {
                index,
                uuid: Some(uuid),
                minor,
            });
        }
        Ok(StaticGpus(gpus))
    }
}

/// The discovery the configuration asks for: the GPU list file if one is configured,
/// else NVML.
pub fn discovery_from_config(cfg: &kiwi_config::Config) -> Result<Box<dyn GpuDiscovery>, GpuError> {
    match &cfg.device_plugin.gpu_list {
        Some(p) => Ok(Box::new(StaticGpus::from_file(p)?)),
        None => Ok(Box::new(Nvml::load()?)),
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

/// The GPUs' device nodes for `claim`, then the control nodes. `discovery` is only
/// called when a UUID has to be resolved, so the index and `all` paths never load NVML.
pub fn resolve_claim(
    claim: &Claim,
    devices: &HostDevices,
    discovery: impl FnOnce() -> Result<Box<dyn GpuDiscovery>, GpuError>,
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
            let mut disc: Option<Box<dyn GpuDiscovery>> = None;
            let mut discovery = Some(discovery);
            let mut out = Vec::new();
            for r in refs {
                let minor = match r {
                    GpuRef::Index(i) => *i,
                    GpuRef::Uuid(u) => {
                        if disc.is_none() {
                            let make = discovery.take().expect("discovery made once");
                            disc = Some(make()?);
                        }
                        disc.as_ref().expect("set above").minor_for_uuid(u)?
                    }
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

type NvmlDevice = *mut c_void;

/// NVML, loaded with `dlopen("libnvidia-ml.so.1")` (the driver's, or the simulator's
/// stand-in through `LD_LIBRARY_PATH`). Shut down on drop; never unloaded.
pub struct Nvml {
    get_handle_by_uuid: unsafe extern "C" fn(*const c_char, *mut NvmlDevice) -> c_int,
    get_handle_by_index: unsafe extern "C" fn(c_uint, *mut NvmlDevice) -> c_int,
    get_count: unsafe extern "C" fn(*mut c_uint) -> c_int,
    get_minor: unsafe extern "C" fn(NvmlDevice, *mut c_uint) -> c_int,
    get_uuid: unsafe extern "C" fn(NvmlDevice, *mut c_char, c_uint) -> c_int,
    shutdown: unsafe extern "C" fn() -> c_int,
    error_string: Option<unsafe extern "C" fn(c_int) -> *const c_char>,
}

impl std::fmt::Debug for Nvml {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Nvml")
    }
}

/// Looks `name` up in `handle`.
///
/// # Safety
/// `handle` must come from `dlopen`, and `T` must be the C function pointer type of the
/// symbol named `name`.
unsafe fn sym<T: Copy>(handle: *mut c_void, name: &CStr) -> Result<T, GpuError> {
    // SAFETY: handle is a live dlopen handle and name a NUL-terminated string.
    let p = unsafe { libc::dlsym(handle, name.as_ptr()) };
    if p.is_null() {
        return Err(GpuError::Nvml(format!(
            "libnvidia-ml.so.1 has no symbol {}",
            name.to_string_lossy()
        )));
    }
    assert_eq!(std::mem::size_of::<T>(), std::mem::size_of::<*mut c_void>());
    // SAFETY: the caller guarantees T is the function pointer type of this symbol, and
    // the sizes match (checked above).
    Ok(unsafe { std::mem::transmute_copy::<*mut c_void, T>(&p) })
}

impl Nvml {
    /// Loads and initialises NVML.
    pub fn load() -> Result<Nvml, GpuError> {
        let lib = c"libnvidia-ml.so.1";
        // SAFETY: dlopen with a valid C string; the handle is never closed, so symbols
        // taken from it stay valid for the life of the process.
        let handle = unsafe { libc::dlopen(lib.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if handle.is_null() {
            // SAFETY: dlerror returns a thread-local string or NULL.
            let err = unsafe { libc::dlerror() };
            let msg = if err.is_null() {
                "unknown error".to_string()
            } else {
                // SAFETY: non-null dlerror results are NUL-terminated strings.
                unsafe { CStr::from_ptr(err) }
                    .to_string_lossy()
                    .into_owned()
            };
            return Err(GpuError::Nvml(format!(
                "cannot load libnvidia-ml.so.1 to resolve GPU UUIDs ({msg}); configure device_plugin.gpu_list or use GPU indexes"
            )));
        }
        // SAFETY: each type below is the documented NVML prototype of the symbol named.
        let (init, nvml) = unsafe {
            let init: unsafe extern "C" fn() -> c_int = sym(handle, c"nvmlInit_v2")?;
            let nvml = Nvml {
                get_handle_by_uuid: sym(handle, c"nvmlDeviceGetHandleByUUID")?,
                get_handle_by_index: sym(handle, c"nvmlDeviceGetHandleByIndex_v2")?,
                get_count: sym(handle, c"nvmlDeviceGetCount_v2")?,
                get_minor: sym(handle, c"nvmlDeviceGetMinorNumber")?,
                get_uuid: sym(handle, c"nvmlDeviceGetUUID")?,
                shutdown: sym(handle, c"nvmlShutdown")?,
                error_string: sym(handle, c"nvmlErrorString").ok(),
            };
            (init, nvml)
        };
        // SAFETY: nvmlInit_v2 takes no arguments.
        let rc = unsafe { init() };
        if rc != 0 {
            // Not initialised: do not call nvmlShutdown on drop.
            let msg = nvml.describe(rc);
            std::mem::forget(nvml);
            return Err(GpuError::Nvml(format!("nvmlInit failed: {msg}")));
        }
        Ok(nvml)
    }

    fn describe(&self, rc: c_int) -> String {
        if let Some(f) = self.error_string {
            // SAFETY: nvmlErrorString returns a static string for any code.
            let p = unsafe { f(rc) };
            if !p.is_null() {
                // SAFETY: non-null, NUL-terminated, static.
                let text = unsafe { CStr::from_ptr(p) };
                return format!("{} (code {rc})", text.to_string_lossy());
            }
        }
        format!("error code {rc}")
    }

    fn check(&self, what: &str, rc: c_int) -> Result<(), GpuError> {
        if rc == 0 {
            Ok(())
        } else {
            Err(GpuError::Nvml(format!("{what}: {}", self.describe(rc))))
        }
    }

    fn minor_of(&self, dev: NvmlDevice) -> Result<u32, GpuError> {
        let mut minor: c_uint = 0;
        // SAFETY: dev is a handle NVML gave us; minor is a valid out pointer.
        let rc = unsafe { (self.get_minor)(dev, &mut minor) };
        self.check("nvmlDeviceGetMinorNumber", rc)?;
        Ok(minor)
    }
}

impl GpuDiscovery for Nvml {
    fn gpus(&self) -> Result<Vec<GpuInfo>, GpuError> {
        let mut count: c_uint = 0;
        // SAFETY: valid out pointer.
        let rc = unsafe { (self.get_count)(&mut count) };
        self.check("nvmlDeviceGetCount", rc)?;
        let mut out = Vec::new();
        for index in 0..count {
            let mut dev: NvmlDevice = std::ptr::null_mut();
            // SAFETY: index < count; valid out pointer.
            let rc = unsafe { (self.get_handle_by_index)(index, &mut dev) };
            self.check("nvmlDeviceGetHandleByIndex", rc)?;
            let mut buf = [0 as c_char; 96];
            // SAFETY: buf is writable for its whole length, which we pass.
            let rc = unsafe { (self.get_uuid)(dev, buf.as_mut_ptr(), buf.len() as c_uint) };
            self.check("nvmlDeviceGetUUID", rc)?;
            // SAFETY: NVML NUL-terminates the UUID within the buffer; the last byte of
            // buf is never written past.
            let uuid = unsafe { CStr::from_ptr(buf.as_ptr()) }
                .to_string_lossy()
                .into_owned();
            out.push(GpuInfo {
                index,
                uuid: Some(uuid),
                minor: self.minor_of(dev)?,
            });
        }
        Ok(out)
    }

    fn minor_for_uuid(&self, uuid: &str) -> Result<u32, GpuError> {
        let c = CString::new(uuid).map_err(|_| GpuError::UnknownGpu {
            gpu: uuid.to_string(),
            reason: "contains a NUL byte".into(),
        })?;
        let mut dev: NvmlDevice = std::ptr::null_mut();
        // SAFETY: c is a valid C string; dev a valid out pointer.
        let rc = unsafe { (self.get_handle_by_uuid)(c.as_ptr(), &mut dev) };
        if rc != 0 {
            return Err(GpuError::UnknownGpu {
                gpu: uuid.to_string(),
                reason: format!("NVML does not know it ({})", self.describe(rc)),
            });
        }
        self.minor_of(dev)
    }
}

impl Drop for Nvml {
    fn drop(&mut self) {
        // SAFETY: NVML was initialised in load(); shutdown balances that init.
        unsafe {
            (self.shutdown)();
        }
    }
}

/// Discovery for `kiwictl cdi generate`: the configured list, else NVML, else the
/// device nodes under the device root (indexes only, no UUIDs).
pub fn discover_for_cdi(cfg: &kiwi_config::Config) -> Result<Vec<GpuInfo>, GpuError> {
    match discovery_from_config(cfg) {
        Ok(d) => d.gpus(),
        Err(GpuError::Nvml(_)) => {
            let devices = HostDevices::new(&cfg.runtime.device_root);
            Ok(devices
                .gpu_minors()?
                .into_iter()
                .map(|m| GpuInfo {
                    index: m,
                    uuid: None,
                    minor: m,
                })
                .collect())
        }
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_list_parses_and_refuses_garbage() {
        let g = StaticGpus::parse(
            "# idx uuid\n0 GPU-aaa\n1 GPU-bbb 7 # comment\n",
            Path::new("l"),
        )
        .unwrap();
        assert_eq!(g.0.len(), 2);
        assert_eq!(g.0[1].minor, 7);
        assert_eq!(g.minor_for_uuid("GPU-aaa").unwrap(), 0);
        assert!(matches!(
            g.minor_for_uuid("GPU-ccc"),
            Err(GpuError::UnknownGpu { .. })
        ));
        let e = StaticGpus::parse("0 GPU-a\nx GPU-b\n", Path::new("/l")).unwrap_err();
        assert!(e.to_string().contains("/l, line 2"), "{e}");
    }

    #[test]
    fn gpu_list_reads_the_device_plugins_format_too() {
        let g = StaticGpus::parse(
            "0 GPU-aaa minor=4 pci=0000:3b:00.0 memory=80GiB NVIDIA H100\n\
             GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-bbb)\n",
            Path::new("l"),
        )
        .unwrap();
        assert_eq!(g.minor_for_uuid("GPU-aaa").unwrap(), 4);
        assert_eq!(g.minor_for_uuid("GPU-bbb").unwrap(), 1);
        assert!(StaticGpus::parse("0 GPU-a minor=x\n", Path::new("l")).is_err());
    }

    #[test]
    fn missing_gpu_node_is_an_unknown_gpu() {
        let dir = tempfile::tempdir().unwrap();
        let devs = HostDevices::new(dir.path());
        let claim = Claim::Gpus(vec![GpuRef::Index(3)]);
        let e = resolve_claim(&claim, &devs, || panic!("no discovery for indexes")).unwrap_err();
        assert!(e.to_string().starts_with("unknown GPU 3"), "{e}");
        let e = resolve_claim(&Claim::All, &devs, || panic!("none")).unwrap_err();
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
