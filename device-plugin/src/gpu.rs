//! GPU discovery and health probing behind one trait, [`GpuDiscovery`].
//!
//! Three implementations: NVML loaded at run time ([`crate::nvml::NvmlSource`]), a GPU
//! list file for nodes without NVML ([`GpuListSource`]), and an in-memory fake for
//! tests ([`FakeGpus`]). This module owns the GPU description and the list file
//! format; it knows nothing about vGPUs or the kubelet.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// One physical GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gpu {
    /// NVML index (or the index written in the list file).
    pub index: u32,
    /// `GPU-…` (or `MIG-…`) UUID; the claim the container runtime acts on.
    pub uuid: String,
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
    #[error("GPU list {path}: {message}")]
    ListInvalid { path: PathBuf, message: String },
}

/// Where GPUs come from and how their health is learnt.
///
/// The health monitor calls these from one dedicated thread, so implementations may
/// block (NVML's event wait does).
pub trait GpuDiscovery: Send + 'static {
    /// Every GPU on the node, in index order.
    fn discover(&mut self) -> Result<Vec<Gpu>, GpuError>;
    /// Waits at most `timeout` for critical faults; returns those seen (maybe none).
    fn wait_faults(&mut self, timeout: Duration) -> Vec<Fault>;
    /// Checks that one GPU still answers.
    fn probe(&mut self, gpu: &Gpu) -> Probe;
    /// A short name for logs ("NVML 550.54.15", "GPU list /etc/kiwi/gpus").
    fn describe(&self) -> String;
}

/// Checks a UUID for use in vGPU IDs and in `KIWI_VISIBLE_DEVICES`.
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

/// Reads a GPU list file.
///
/// Format: one GPU per line, `#` starts a comment, blank lines are ignored.
///
/// ```text
/// <index> <uuid> [pci=<bus-id>] [numa=<node>] [memory=<size>] [<name ...>]
/// ```
///
/// e.g. `0 GPU-8f6a0c5e-7b1d-4c2e-9a3f-1d2e3f4a5b6c minor=0 pci=0000:3b:00.0 memory=80GiB NVIDIA H100`
/// (`minor=` is for kiwi-runtime, which reads the same file).
/// The output of `nvidia-smi -L` is accepted too:
/// `GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-8f6a…)`.
pub fn parse_gpu_list(text: &str, path: &Path) -> Result<Vec<Gpu>, GpuError> {
    let mut gpus: Vec<Gpu> = Vec::new();
    for (n, raw) in text.lines().enumerate() {
        let line = raw.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let err = |message: String| GpuError::ListParse {
            path: path.to_path_buf(),
            line: n + 1,
            message,
        };
        let gpu = if line.starts_with("GPU ") && line.contains("(UUID:") {
            parse_smi_line(line).map_err(err)?
        } else {
            parse_plain_line(line).map_err(err)?
        };
        if gpus.iter().any(|g| g.uuid == gpu.uuid) {
            return Err(err(format!("GPU {} listed twice", gpu.uuid)));
        }
        if gpus.iter().any(|g| g.index == gpu.index) {
            return Err(err(format!("index {} listed twice", gpu.index)));
        }
        gpus.push(gpu);
    }
    gpus.sort_by_key(|g| g.index);
    Ok(gpus)
}

fn parse_plain_line(line: &str) -> Result<Gpu, String> {
    let mut words = line.split_whitespace();
    let index_word = words.next().unwrap_or_default();
    let index: u32 = index_word
        .parse()
        .map_err(|_| format!("expected \"<index> <uuid> ...\", got index {index_word:?}"))?;
    let uuid = words
        .next()
        .ok_or_else(|| format!("GPU {index} has no UUID"))?;
    validate_uuid(uuid)?;
    let mut gpu = Gpu::new(index, uuid);
    let mut name: Vec<&str> = Vec::new();
    for word in words {
        if !name.is_empty() {
            name.push(word);
            continue;
        }
        if let Some(v) = word.strip_prefix("pci=") {
            gpu.pci_bus_id =
                Some(normalize_bus_id(v).ok_or_else(|| format!("bad PCI bus id {v:?}"))?);
        } else if let Some(v) = word.strip_prefix("numa=") {
            let node: i64 = v.parse().map_err(|_| format!("bad NUMA node {v:?}"))?;
            gpu.numa_node = (node >= 0).then_some(node);
        } else if let Some(v) = word.strip_prefix("memory=") {
            gpu.memory_bytes = Some(kiwi_config::parse_size(v)?);
        } else if let Some(v) = word.strip_prefix("minor=") {
            // The device node's minor number, for kiwi-runtime; the plugin needs none.
            v.parse::<u32>()
                .map_err(|_| format!("bad minor number {v:?}"))?;
        } else {
            name.push(word);
        }
    }
    if !name.is_empty() {
        gpu.name = Some(name.join(" "));
    }
    Ok(gpu)
}

fn parse_smi_line(line: &str) -> Result<Gpu, String> {
    // GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-…)
    let rest = &line["GPU ".len()..];
    let (index, rest) = rest
        .split_once(':')
        .ok_or_else(|| format!("not an nvidia-smi -L line: {line:?}"))?;
    let index: u32 = index
        .trim()
        .parse()
        .map_err(|_| format!("bad GPU index in {line:?}"))?;
    let (name, rest) = rest
        .split_once("(UUID:")
        .ok_or_else(|| format!("not an nvidia-smi -L line: {line:?}"))?;
    let uuid = rest.split(')').next().map(str::trim).unwrap_or_default();
    validate_uuid(uuid)?;
    let mut gpu = Gpu::new(index, uuid);
    let name = name.trim();
    gpu.name = (!name.is_empty()).then(|| name.to_string());
    Ok(gpu)
}

/// Turns NVML's `00000000:3B:00.0` (or sysfs' `0000:3b:00.0`) into sysfs form.
pub fn normalize_bus_id(id: &str) -> Option<String> {
    let id = id.trim().to_ascii_lowercase();
    let (domain, rest) = id.split_once(':')?;
    let (bus, rest) = rest.split_once(':')?;
    let (dev, func) = rest.split_once('.')?;
    let hex = |s: &str, max: u32| u32::from_str_radix(s, 16).ok().filter(|v| *v <= max);
    let domain = hex(domain, 0xffff_ffff)?;
    let bus = hex(bus, 0xff)?;
    let dev = hex(dev, 0x1f)?;
    let func = hex(func, 0x7)?;
    if domain > 0xffff {
        return None;
    }
    Some(format!("{domain:04x}:{bus:02x}:{dev:02x}.{func:x}"))
}

/// `--gpu-list FILE`: GPUs from a file, for nodes without NVML.
///
/// Health: the file is read again on every probe; a GPU that is no longer listed is
/// unhealthy until it is listed again. There are no asynchronous faults.
pub struct GpuListSource {
    path: PathBuf,
    sysfs: PathBuf,
    /// The file as read at the last probe round, so a round reads it once.
    cache: Option<(Instant, Vec<Gpu>)>,
}

impl GpuListSource {
    pub fn new(path: impl Into<PathBuf>) -> GpuListSource {
        GpuListSource {
            path: path.into(),
            sysfs: PathBuf::from(crate::topology::SYSFS_ROOT),
            cache: None,
        }
    }

    /// Uses another sysfs root for NUMA look-ups (tests).
    pub fn with_sysfs(mut self, root: impl Into<PathBuf>) -> GpuListSource {
        self.sysfs = root.into();
        self
    }

    fn read(&self) -> Result<Vec<Gpu>, GpuError> {
        let text = std::fs::read_to_string(&self.path).map_err(|source| GpuError::ListRead {
            path: self.path.clone(),
            source,
        })?;
        parse_gpu_list(&text, &self.path)
    }
}

impl GpuDiscovery for GpuListSource {
    fn discover(&mut self) -> Result<Vec<Gpu>, GpuError> {
        let mut gpus = self.read()?;
        for gpu in &mut gpus {
            if gpu.numa_node.is_none() {
                if let Some(bus) = &gpu.pci_bus_id {
                    gpu.numa_node = crate::topology::numa_node(&self.sysfs, bus);
                }
            }
        }
        Ok(gpus)
    }

    fn wait_faults(&mut self, timeout: Duration) -> Vec<Fault> {
        std::thread::sleep(timeout);
        Vec::new()
    }

    fn probe(&mut self, gpu: &Gpu) -> Probe {
        let fresh = match &self.cache {
            Some((at, _)) => at.elapsed() > Duration::from_millis(10),
            None => true,
        };
        if fresh {
            match self.read() {
                Ok(list) => self.cache = Some((Instant::now(), list)),
                Err(e) => return Probe::Failed(e.to_string()),
            }
        }
        let listed = self
            .cache
            .as_ref()
            .is_some_and(|(_, list)| list.iter().any(|g| g.uuid == gpu.uuid));
        if listed {
            Probe::Ok
        } else {
            Probe::Failed(format!(
                "{} is no longer listed in {}",
                gpu.uuid,
                self.path.display()
            ))
        }
    }

    fn describe(&self) -> String {
        format!("GPU list {}", self.path.display())
    }
}

#[derive(Default)]
struct FakeState {
    gpus: Vec<Gpu>,
    lost: Vec<String>,
    pending: Vec<Fault>,
    discover_error: Option<String>,
}

/// An in-memory GPU source for tests: GPUs can be lost, faulted and cleared from
/// another thread; a fault wakes the monitor at once.
#[derive(Clone, Default)]
pub struct FakeGpus {
    inner: Arc<(Mutex<FakeState>, Condvar)>,
}

impl FakeGpus {
    /// `count` GPUs with UUIDs `GPU-00000000-0000-0000-0000-0000000000NN`, NUMA node
    /// `index % 2`.
    pub fn new(count: u32) -> FakeGpus {
        let gpus = (0..count)
            .map(|i| {
                let mut g = Gpu::new(i, fake_uuid(i));
                g.name = Some("Fake GPU".into());
                g.memory_bytes = Some(16 << 30);
                g.numa_node = Some(i64::from(i % 2));
                g
            })
            .collect();
        FakeGpus::with_gpus(gpus)
    }

    pub fn with_gpus(gpus: Vec<Gpu>) -> FakeGpus {
        let fake = FakeGpus::default();
        fake.state().gpus = gpus;
        fake
    }

    fn state(&self) -> std::sync::MutexGuard<'_, FakeState> {
        // A test that panicked while holding the lock has failed already; keep going.
        self.inner.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The GPUs, as discovered.
    pub fn gpus(&self) -> Vec<Gpu> {
        self.state().gpus.clone()
    }

    /// Makes discovery fail.
    pub fn fail_discovery(&self, message: &str) {
        self.state().discover_error = Some(message.into());
    }

    /// The GPU stops answering probes (like `NVML_ERROR_GPU_IS_LOST`).
    pub fn lose(&self, uuid: &str) {
        self.state().lost.push(uuid.into());
        self.inner.1.notify_all();
    }

    /// A critical fault event (like an XID 79).
    pub fn fault(&self, uuid: &str, reason: &str) {
        self.state().pending.push(Fault {
            uuid: Some(uuid.into()),
            reason: reason.into(),
        });
        self.inner.1.notify_all();
    }

    /// The GPU answers again.
    pub fn clear(&self, uuid: &str) {
        self.state().lost.retain(|u| u != uuid);
        self.inner.1.notify_all();
    }
}

/// The UUID [`FakeGpus`] gives GPU `i`.
pub fn fake_uuid(i: u32) -> String {
    format!("GPU-00000000-0000-0000-0000-{i:012}")
}

impl GpuDiscovery for FakeGpus {
    fn discover(&mut self) -> Result<Vec<Gpu>, GpuError> {
        let st = self.state();
        if let Some(message) = &st.discover_error {
            return Err(GpuError::Nvml {
                call: "nvmlInit_v2",
                message: message.clone(),
            });
        }
        Ok(st.gpus.clone())
    }

    fn wait_faults(&mut self, timeout: Duration) -> Vec<Fault> {
        let (lock, cv) = &*self.inner;
        let guard = lock.lock().unwrap_or_else(|p| p.into_inner());
        let (mut guard, _) = cv
            .wait_timeout_while(guard, timeout, |st| st.pending.is_empty())
            .unwrap_or_else(|p| p.into_inner());
        std::mem::take(&mut guard.pending)
    }

    fn probe(&mut self, gpu: &Gpu) -> Probe {
        if self.state().lost.contains(&gpu.uuid) {
            Probe::Failed(format!("{} is lost", gpu.uuid))
        } else {
            Probe::Ok
        }
    }

    fn describe(&self) -> String {
        "fake GPUs".into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const U0: &str = "GPU-8f6a0c5e-7b1d-4c2e-9a3f-1d2e3f4a5b6c";
    const U1: &str = "GPU-11111111-2222-3333-4444-555555555555";

    #[test]
    fn plain_lines_with_options_and_comments() {
        let text = format!(
            "# node gpus\n\n1 {U1}\n0 {U0} pci=00000000:3B:00.0 numa=1 memory=80GiB NVIDIA H100 80GB HBM3 # first\n"
        );
        let gpus = parse_gpu_list(&text, Path::new("g")).unwrap();
        assert_eq!(gpus.len(), 2);
        assert_eq!(gpus[0].index, 0);
        assert_eq!(gpus[0].uuid, U0);
        assert_eq!(gpus[0].pci_bus_id.as_deref(), Some("0000:3b:00.0"));
        assert_eq!(gpus[0].numa_node, Some(1));
        assert_eq!(gpus[0].memory_bytes, Some(80 << 30));
        assert_eq!(gpus[0].name.as_deref(), Some("NVIDIA H100 80GB HBM3"));
        assert_eq!(gpus[1], Gpu::new(1, U1));
    }

    #[test]
    fn nvidia_smi_output_is_accepted() {
        let text =
            format!("GPU 0: NVIDIA A100-SXM4-40GB (UUID: {U0})\nGPU 1: Tesla T4 (UUID: {U1})\n");
        let gpus = parse_gpu_list(&text, Path::new("g")).unwrap();
        assert_eq!(gpus[0].name.as_deref(), Some("NVIDIA A100-SXM4-40GB"));
        assert_eq!(gpus[1].uuid, U1);
        assert_eq!(gpus[1].index, 1);
    }

    #[test]
    fn bad_lines_name_file_and_line() {
        for (text, what) in [
            (format!("0 {U0}\nx {U1}\n"), "index"),
            ("0\n".to_string(), "no UUID"),
            (format!("0 {U0}\n1 {U0}\n"), "twice"),
            (format!("0 {U0}\n0 {U1}\n"), "twice"),
            ("0 GPU-a::b\n".to_string(), "::"),
            ("0 GPU-a,b\n".to_string(), "','"),
            ("0 all\n".to_string(), "reserved"),
            (format!("0 {U0} pci=zz\n"), "PCI"),
            (format!("0 {U0} memory=lots\n"), "size"),
        ] {
            let e = parse_gpu_list(&text, Path::new("/etc/kiwi/gpus"))
                .unwrap_err()
                .to_string();
            assert!(e.contains("/etc/kiwi/gpus"), "{e}");
            assert!(e.contains("line "), "{e}");
            assert!(e.contains(what), "{text:?}: {e}");
        }
    }

    #[test]
    fn bus_ids() {
        assert_eq!(
            normalize_bus_id("00000000:3B:00.0").as_deref(),
            Some("0000:3b:00.0")
        );
        assert_eq!(
            normalize_bus_id("0000:af:1f.7").as_deref(),
            Some("0000:af:1f.7")
        );
        assert_eq!(normalize_bus_id("3b:00.0"), None);
        assert_eq!(normalize_bus_id("0000:3b:20.0"), None);
    }

    #[test]
    fn list_source_probe_follows_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("gpus");
        std::fs::write(&path, format!("0 {U0}\n1 {U1}\n")).unwrap();
        let mut src = GpuListSource::new(&path);
        let gpus = src.discover().unwrap();
        assert_eq!(src.probe(&gpus[1]), Probe::Ok);
        std::fs::write(&path, format!("0 {U0}\n")).unwrap();
        std::thread::sleep(Duration::from_millis(20));
        assert!(matches!(src.probe(&gpus[1]), Probe::Failed(m) if m.contains("no longer listed")));
        assert_eq!(src.probe(&gpus[0]), Probe::Ok);
    }

    #[test]
    fn list_source_reads_numa_from_sysfs_unless_given() {
        let dir = tempfile::tempdir().unwrap();
        let sysfs = dir.path().join("sys");
        let dev = sysfs.join("bus/pci/devices/0000:3b:00.0");
        std::fs::create_dir_all(&dev).unwrap();
        std::fs::write(dev.join("numa_node"), "1\n").unwrap();
        let path = dir.path().join("gpus");
        std::fs::write(
            &path,
            format!("0 {U0} pci=00000000:3B:00.0\n1 {U1} pci=0000:3b:00.0 numa=0\n"),
        )
        .unwrap();
        let gpus = GpuListSource::new(&path)
            .with_sysfs(&sysfs)
            .discover()
            .unwrap();
        assert_eq!(gpus[0].numa_node, Some(1), "from sysfs");
        assert_eq!(gpus[1].numa_node, Some(0), "as written");
    }

    #[test]
    fn missing_list_file_is_a_clear_error() {
        let e = GpuListSource::new("/nonexistent/gpus")
            .discover()
            .unwrap_err()
            .to_string();
        assert!(e.contains("/nonexistent/gpus"), "{e}");
    }

    #[test]
    fn fake_fault_wakes_waiter() {
        let fake = FakeGpus::new(2);
        let mut waiter = fake.clone();
        let t = std::thread::spawn(move || waiter.wait_faults(Duration::from_secs(10)));
        std::thread::sleep(Duration::from_millis(20));
        fake.fault(&fake_uuid(1), "xid 79");
        let faults = t.join().unwrap();
        assert_eq!(faults.len(), 1);
        assert_eq!(faults[0].uuid.as_deref(), Some(fake_uuid(1).as_str()));
    }
}
