//! The GPU list file, for nodes without NVML (`device_plugin.gpu_list` in the config,
//! `--gpu-list` of the device plugin): its one format, its one parser
//! ([`parse_gpu_list`]), and [`GpuListSource`], the [`GpuDiscovery`] over such a file.
//! kiwi-runtime, kiwi-hook, `kiwictl cdi generate` and kiwi-device-plugin all read the
//! file through here, so they agree on what it says and on what is refused.
//!
//! The format, one GPU per line, `#` starts a comment, blank lines are ignored:
//!
//! ```text
//! <index> <uuid> [minor=<N>] [pci=<bus-id>] [numa=<node>] [memory=<size>] [<name ...>]
//! ```
//!
//! e.g. `0 GPU-8f6a0c5e-7b1d-4c2e-9a3f-1d2e3f4a5b6c pci=0000:3b:00.0 memory=80GiB NVIDIA H100`.
//! Words are separated by any whitespace. The `key=value` options may come in any order,
//! before or after the name; the other words are the name. A bare number right after
//! the UUID is the minor number too (`<index> <uuid> <minor>`, an older form). The minor
//! number (of `/dev/nvidia<N>`) defaults to the index. The output of `nvidia-smi -L` is
//! accepted as it is: `GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-8f6a…)`.
//!
//! Refused, naming the file and the line: a line without an index and a UUID, a UUID
//! [`validate_uuid`] refuses (empty, `::`, characters other than letters, digits, `-`,
//! `_`, `.`, `:`, or `all`/`none`/`void`), a malformed option, and an index or a UUID
//! listed twice. A list with no GPU at all is not an error here; its users decide.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::gpu::{validate_uuid, Fault, Gpu, GpuDiscovery, GpuError, Probe};
use crate::topology::normalize_bus_id;

/// Reads and parses the GPU list file `path`.
pub fn read_gpu_list(path: &Path) -> Result<Vec<Gpu>, GpuError> {
    let text = std::fs::read_to_string(path).map_err(|source| GpuError::ListRead {
        path: path.to_path_buf(),
        source,
    })?;
    parse_gpu_list(&text, path)
}

/// Parses the text of a GPU list file (see the module's docs for the format); `path`
/// names the file in errors. The GPUs come back in index order.
pub fn parse_gpu_list(text: &str, path: &Path) -> Result<Vec<Gpu>, GpuError> {
    // Each GPU with the line it came from, to name both lines of a duplicate.
    let mut gpus: Vec<(Gpu, usize)> = Vec::new();
    for (n, raw) in text.lines().enumerate() {
        let line = raw.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let number = n + 1;
        let err = |message: String| GpuError::ListParse {
            path: path.to_path_buf(),
            line: number,
            message,
        };
        let gpu = if line.starts_with("GPU ") && line.contains("(UUID:") {
            parse_smi_line(line).map_err(err)?
        } else {
            parse_plain_line(line).map_err(err)?
        };
        if let Some((_, first)) = gpus.iter().find(|(g, _)| g.uuid == gpu.uuid) {
            return Err(err(format!(
                "GPU {} listed twice (first on line {first})",
                gpu.uuid
            )));
        }
        if let Some((_, first)) = gpus.iter().find(|(g, _)| g.index == gpu.index) {
            return Err(err(format!(
                "index {} listed twice (first on line {first})",
                gpu.index
            )));
        }
        gpus.push((gpu, number));
    }
    let mut gpus: Vec<Gpu> = gpus.into_iter().map(|(g, _)| g).collect();
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
    let parse_minor = |v: &str| {
        v.parse::<u32>()
            .map_err(|_| format!("bad minor number {v:?}"))
    };
    let mut minor = None;
    let mut name: Vec<&str> = Vec::new();
    for (i, word) in words.enumerate() {
        if let Some(v) = word.strip_prefix("minor=") {
            minor = Some(parse_minor(v)?);
        } else if let Some(v) = word.strip_prefix("pci=") {
            gpu.pci_bus_id =
                Some(normalize_bus_id(v).ok_or_else(|| format!("bad PCI bus id {v:?}"))?);
        } else if let Some(v) = word.strip_prefix("numa=") {
            let node: i64 = v.parse().map_err(|_| format!("bad NUMA node {v:?}"))?;
            gpu.numa_node = (node >= 0).then_some(node);
        } else if let Some(v) = word.strip_prefix("memory=") {
            gpu.memory_bytes = Some(kiwi_units::parse_size(v)?);
        } else if i == 0 && word.bytes().all(|b| b.is_ascii_digit()) {
            minor = Some(parse_minor(word)?);
        } else {
            name.push(word);
        }
    }
    gpu.minor = Some(minor.unwrap_or(index));
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
    gpu.minor = Some(index);
    let name = name.trim();
    gpu.name = (!name.is_empty()).then(|| name.to_string());
    Ok(gpu)
}

/// GPUs from a list file, for nodes without NVML.
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
    /// A source over the file `path`, which is read at each discovery (not here).
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
}

impl GpuDiscovery for GpuListSource {
    fn discover(&mut self) -> Result<Vec<Gpu>, GpuError> {
        let mut gpus = read_gpu_list(&self.path)?;
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
            match read_gpu_list(&self.path) {
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

#[cfg(test)]
mod tests {
    use super::*;

    const U0: &str = "GPU-8f6a0c5e-7b1d-4c2e-9a3f-1d2e3f4a5b6c";
    const U1: &str = "GPU-11111111-2222-3333-4444-555555555555";

    fn parse(text: &str) -> Result<Vec<Gpu>, GpuError> {
        parse_gpu_list(text, Path::new("/etc/kiwi/gpus"))
    }

    fn with_minor(index: u32, uuid: &str, minor: u32) -> Gpu {
        Gpu {
            minor: Some(minor),
            ..Gpu::new(index, uuid)
        }
    }

    /// The one-line error for `text`, checked to name the file and `line`.
    fn refused(text: &str, line: usize) -> String {
        let e = parse(text).unwrap_err().to_string();
        assert!(
            e.starts_with(&format!("GPU list /etc/kiwi/gpus, line {line}: ")),
            "{text:?}: {e}"
        );
        assert!(!e.contains('\n'), "{text:?}: {e}");
        e
    }

    #[test]
    fn plain_lines_with_options_and_comments() {
        let text = format!(
            "# node gpus\n\n1 {U1}\n0 {U0} pci=00000000:3B:00.0 numa=1 memory=80GiB NVIDIA H100 80GB HBM3 # first\n"
        );
        let gpus = parse(&text).unwrap();
        assert_eq!(gpus.len(), 2);
        assert_eq!(gpus[0].index, 0);
        assert_eq!(gpus[0].uuid, U0);
        assert_eq!(gpus[0].minor, Some(0), "defaults to the index");
        assert_eq!(gpus[0].pci_bus_id.as_deref(), Some("0000:3b:00.0"));
        assert_eq!(gpus[0].numa_node, Some(1));
        assert_eq!(gpus[0].memory_bytes, Some(80 << 30));
        assert_eq!(gpus[0].name.as_deref(), Some("NVIDIA H100 80GB HBM3"));
        assert_eq!(gpus[1], with_minor(1, U1, 1));
    }

    #[test]
    fn minor_numbers_by_option_or_bare_third_word() {
        let text = format!(
            "# idx uuid\n0 {U0} 7 # comment\n1 {U1} minor=4 pci=0000:3b:00.0 memory=80GiB NVIDIA H100\n"
        );
        let gpus = parse(&text).unwrap();
        assert_eq!(gpus[0], with_minor(0, U0, 7));
        assert_eq!(gpus[1].minor, Some(4));
        assert_eq!(gpus[1].name.as_deref(), Some("NVIDIA H100"));
        // Options may follow the name; a bare number later on is part of the name.
        let gpus = parse(&format!("0 {U0} Tesla T4 minor=3 numa=0 2\n")).unwrap();
        assert_eq!(gpus[0].minor, Some(3));
        assert_eq!(gpus[0].numa_node, Some(0));
        assert_eq!(gpus[0].name.as_deref(), Some("Tesla T4 2"));
        for bad in [format!("0 {U0} minor=x\n"), format!("0 {U0} 99999999999\n")] {
            assert!(refused(&bad, 1).contains("bad minor number"), "{bad:?}");
        }
    }

    #[test]
    fn nvidia_smi_output_is_accepted() {
        let text =
            format!("GPU 0: NVIDIA A100-SXM4-40GB (UUID: {U0})\nGPU 1: Tesla T4 (UUID: {U1})\n");
        let gpus = parse(&text).unwrap();
        assert_eq!(gpus[0].name.as_deref(), Some("NVIDIA A100-SXM4-40GB"));
        assert_eq!(gpus[1].uuid, U1);
        assert_eq!(gpus[1].index, 1);
        assert_eq!(gpus[1].minor, Some(1));
    }

    #[test]
    fn whitespace_of_any_kind_separates_and_surrounds() {
        let text = format!(
            "  \t\r\n\t0\t{U0}\tminor=2   NVIDIA  H100 \r\n   1  {U1}  # trailing\r\n  GPU 2 :  Tesla T4  (UUID:  GPU-2 )  \n"
        );
        let gpus = parse(&text).unwrap();
        assert_eq!(gpus.len(), 3);
        assert_eq!(gpus[0].uuid, U0);
        assert_eq!(gpus[0].minor, Some(2));
        assert_eq!(gpus[0].name.as_deref(), Some("NVIDIA H100"), "one space");
        assert_eq!(gpus[1], with_minor(1, U1, 1));
        assert_eq!(gpus[2].uuid, "GPU-2");
        assert_eq!(gpus[2].name.as_deref(), Some("Tesla T4"));
    }

    #[test]
    fn an_empty_list_is_no_gpus() {
        for text in ["", "\n\n", "   \t\n", "# no GPUs on this node\n  # none\n"] {
            assert_eq!(parse(text).unwrap(), [], "{text:?}");
        }
    }

    #[test]
    fn duplicates_are_refused_naming_both_lines() {
        let e = refused(&format!("0 {U0}\n# gap\n1 {U0}\n"), 3);
        assert!(
            e.ends_with(&format!("GPU {U0} listed twice (first on line 1)")),
            "{e}"
        );
        let e = refused(&format!("0 {U0}\n0 {U1}\n"), 2);
        assert!(e.ends_with("index 0 listed twice (first on line 1)"), "{e}");
        // The two forms of line describe the same GPUs.
        let e = refused(&format!("GPU 0: T4 (UUID: {U0})\n1 {U0}\n"), 2);
        assert!(e.contains("listed twice"), "{e}");
        let e = refused(&format!("0 {U0}\nGPU 0: T4 (UUID: {U1})\n"), 2);
        assert!(e.contains("index 0 listed twice"), "{e}");
    }

    #[test]
    fn malformed_uuids_are_refused() {
        for (text, what) in [
            ("0 GPU-a::b\n", "\"::\""),
            ("0 GPU-a,b\n", "','"),
            ("0 GPU-a;b\n", "';'"),
            ("0 GPU-é\n", "'é'"),
            ("GPU 0: T4 (UUID: )\n", "empty GPU UUID"),
            ("GPU 0: T4 (UUID: GPU-a/b)\n", "'/'"),
        ] {
            let e = refused(text, 1);
            assert!(e.contains(what), "{text:?}: {e}");
        }
    }

    #[test]
    fn all_none_and_void_are_no_uuids() {
        for word in ["all", "none", "void", "ALL", "None"] {
            let e = refused(&format!("0 {U0}\n1 {word}\n"), 2);
            assert!(e.contains("reserved in KIWI_VISIBLE_DEVICES"), "{e}");
            let e = refused(&format!("GPU 0: T4 (UUID: {word})\n"), 1);
            assert!(e.contains("reserved"), "{e}");
        }
    }

    #[test]
    fn bad_lines_name_file_and_line() {
        for (text, line, what) in [
            (format!("0 {U0}\nx {U1}\n"), 2, "index"),
            ("0\n".to_string(), 1, "no UUID"),
            ("MIG 0: (UUID: MIG-1)\n".to_string(), 1, "index"),
            ("GPU x: T4 (UUID: GPU-1)\n".to_string(), 1, "bad GPU index"),
            (format!("0 {U0} pci=zz\n"), 1, "PCI"),
            (format!("0 {U0} numa=far\n"), 1, "NUMA"),
            (format!("0 {U0} memory=lots\n"), 1, "size"),
        ] {
            let e = refused(&text, line);
            assert!(e.contains(what), "{text:?}: {e}");
        }
    }

    #[test]
    fn memory_sizes_are_the_config_files() {
        for (v, want) in [
            ("80GiB", 80u64 << 30),
            ("80GB", 80_000_000_000),
            ("1.5TiB", 3 << 39),
            ("700M", 700 << 20),
            ("4096", 4096),
        ] {
            let gpus = parse(&format!("0 {U0} memory={v}\n")).unwrap();
            assert_eq!(gpus[0].memory_bytes, Some(want), "{v}");
        }
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
        // A list that turns malformed fails every probe, saying why.
        std::fs::write(&path, format!("0 {U0}\n1 {U0}\n")).unwrap();
        std::thread::sleep(Duration::from_millis(20));
        assert!(matches!(src.probe(&gpus[0]), Probe::Failed(m) if m.contains("twice")));
    }

    #[test]
    fn list_source_resolves_uuids_to_minors() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("gpus");
        std::fs::write(&path, format!("0 {U0} 5\n1 {U1}\n")).unwrap();
        let mut src = GpuListSource::new(&path);
        assert_eq!(src.minor_for_uuid(U0).unwrap(), 5);
        assert_eq!(src.minor_for_uuid(U1).unwrap(), 1);
        let e = src.minor_for_uuid("GPU-ccc").unwrap_err();
        assert!(matches!(e, GpuError::UnknownGpu { .. }), "{e}");
        assert_eq!(src.describe(), format!("GPU list {}", path.display()));
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
        assert!(e.starts_with("cannot read GPU list"), "{e}");
    }
}
