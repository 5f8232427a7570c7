//! The NVIDIA driver's user-space files a CUDA container needs when NVIDIA's toolkit is
//! not there to add them: found through the host's ld cache (`ldconfig -p`) and `PATH`,
//! or taken from the configured list (`runtime.driver_files`).
//!
//! Each file is bind-mounted read-only at the same path inside the container, as
//! NVIDIA's toolkit does, and the directories of the libraries among them go to the hook,
//! which adds them to the container's ld cache (a RHEL host's `/usr/lib64` means nothing
//! to an Ubuntu image's loader otherwise). This module only finds files;
//! [`crate::runtime`] adds mounts.

use std::path::{Path, PathBuf};

/// Libraries looked up in the ld cache. The first three are what every CUDA program
/// needs; the rest are used when present (JIT of new PTX, the debugger).
pub const DRIVER_LIBRARIES: [&str; 5] = [
    "libcuda.so.1",
    "libnvidia-ml.so.1",
    "libnvidia-ptxjitcompiler.so.1",
    "libnvidia-nvvm.so.4",
    "libcudadebugger.so.1",
];
/// Programs looked up on `PATH`.
pub const DRIVER_PROGRAMS: [&str; 1] = ["nvidia-smi"];

/// A host file and where the container sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DriverFile {
    /// The real file on the host (symlinks resolved, so the bind has a file to bind).
    pub source: PathBuf,
    /// Path inside the container: the path it was found under on the host.
    pub destination: PathBuf,
}

#[derive(Debug, thiserror::Error)]
pub enum DriverError {
    #[error("runtime.driver_files names {path}, which does not exist on this host")]
    MissingConfigured { path: PathBuf },
    #[error("runtime.driver_files entries must be absolute paths, not {path}")]
    Relative { path: PathBuf },
}

/// The configured list: every entry must exist.
pub fn from_list(list: &[PathBuf]) -> Result<Vec<DriverFile>, DriverError> {
    list.iter()
        .map(|p| {
            if !p.is_absolute() {
                return Err(DriverError::Relative { path: p.clone() });
            }
            let source = std::fs::canonicalize(p)
                .map_err(|_| DriverError::MissingConfigured { path: p.clone() })?;
            Ok(DriverFile {
                source,
                destination: p.clone(),
            })
        })
        .collect()
}

/// The ld cache's architecture tag for this build (`ldconfig -p` prints e.g.
/// `libcuda.so.1 (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/libcuda.so.1`).
fn arch_tag() -> &'static str {
    if cfg!(target_arch = "x86_64") {
        "x86-64"
    } else if cfg!(target_arch = "aarch64") {
        "AArch64"
    } else {
        ""
    }
}

/// The directories, inside the container, of the shared libraries among `files`
/// (names with `.so`), in order, each once: what the container's ld cache must cover.
pub fn library_dirs(files: &[DriverFile]) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = Vec::new();
    for f in files {
        let is_lib = f
            .destination
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.ends_with(".so") || n.contains(".so."));
        if let Some(dir) = f.destination.parent().filter(|_| is_lib) {
            if !dirs.iter().any(|d| d == dir) {
                dirs.push(dir.to_path_buf());
            }
        }
    }
    dirs
}

/// Finds `names` in `ldconfig -p` output, keeping the first entry of this architecture.
pub fn find_in_ld_cache(ldconfig_p: &str, names: &[&str]) -> Vec<(String, PathBuf)> {
    let mut out: Vec<(String, PathBuf)> = Vec::new();
    for line in ldconfig_p.lines() {
        let line = line.trim();
        let Some((lhs, path)) = line.split_once(" => ") else {
            continue;
        };
        let Some((name, flags)) = lhs.split_once(' ') else {
            continue;
        };
        if !names.contains(&name) || out.iter().any(|(n, _)| n == name) {
            continue;
        }
        if !arch_tag().is_empty() && !flags.contains(arch_tag()) {
            continue;
        }
        out.push((name.to_string(), PathBuf::from(path.trim())));
    }
    out
}

fn find_on_path(name: &str, path: &std::ffi::OsStr) -> Option<PathBuf> {
    std::env::split_paths(path)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// Driver files found on this host, and the names that were not found.
pub fn discover() -> (Vec<DriverFile>, Vec<&'static str>) {
    let ldconfig = ["/sbin/ldconfig", "/usr/sbin/ldconfig"]
        .into_iter()
        .map(Path::new)
        .find(|p| p.exists())
        .unwrap_or(Path::new("ldconfig"));
    let cache = std::process::Command::new(ldconfig)
        .arg("-p")
        .stderr(std::process::Stdio::null())
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    let path = std::env::var_os("PATH").unwrap_or_else(|| "/usr/local/bin:/usr/bin:/bin".into());
    discover_in(&cache, &path)
}

/// [`discover`] over given `ldconfig -p` output and `PATH`.
pub fn discover_in(
    ldconfig_p: &str,
    path: &std::ffi::OsStr,
) -> (Vec<DriverFile>, Vec<&'static str>) {
    let found = find_in_ld_cache(ldconfig_p, &DRIVER_LIBRARIES);
    let mut files = Vec::new();
    let mut missing = Vec::new();
    for name in DRIVER_LIBRARIES {
        match found.iter().find(|(n, _)| n == name) {
            Some((_, p)) => match std::fs::canonicalize(p) {
                Ok(source) => files.push(DriverFile {
                    source,
                    destination: p.clone(),
                }),
                Err(_) => missing.push(name),
            },
            None => missing.push(name),
        }
    }
    for name in DRIVER_PROGRAMS {
        match find_on_path(name, path).and_then(|p| Some((std::fs::canonicalize(&p).ok()?, p))) {
            Some((source, p)) => files.push(DriverFile {
                source,
                destination: Path::new("/usr/bin").join(p.file_name().unwrap_or_default()),
            }),
            None => missing.push(name),
        }
    }
    (files, missing)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ld_cache_lines_are_matched_by_name_and_arch() {
        let text = "3 libs found in cache `/etc/ld.so.cache'\n\
            \tlibcuda.so.1 (libc6) => /usr/lib/i386-linux-gnu/libcuda.so.1\n\
            \tlibcuda.so.1 (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/libcuda.so.1\n\
            \tlibcuda.so.1 (libc6,x86-64) => /opt/other/libcuda.so.1\n\
            \tlibnvidia-ml.so.1 (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1\n";
        let found = find_in_ld_cache(text, &DRIVER_LIBRARIES);
        if cfg!(target_arch = "x86_64") {
            assert_eq!(found.len(), 2);
            assert_eq!(
                found[0].1,
                PathBuf::from("/usr/lib/x86_64-linux-gnu/libcuda.so.1")
            );
        }
    }

    #[test]
    fn discovered_files_bind_the_real_file_at_the_cached_path() {
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().join("libcuda.so.550.54");
        std::fs::write(&real, b"elf").unwrap();
        let link = dir.path().join("libcuda.so.1");
        std::os::unix::fs::symlink("libcuda.so.550.54", &link).unwrap();
        let bin = dir.path().join("bin");
        std::fs::create_dir_all(&bin).unwrap();
        std::fs::write(bin.join("nvidia-smi"), b"#!").unwrap();
        let tag = if cfg!(target_arch = "aarch64") {
            "AArch64"
        } else {
            "x86-64"
        };
        let cache = format!("\tlibcuda.so.1 (libc6,{tag}) => {}\n", link.display());
        let (files, missing) = discover_in(&cache, bin.as_os_str());
        assert_eq!(
            files[0],
            DriverFile {
                source: std::fs::canonicalize(&real).unwrap(),
                destination: link,
            }
        );
        assert_eq!(files[1].destination, PathBuf::from("/usr/bin/nvidia-smi"));
        assert!(missing.contains(&"libnvidia-ml.so.1") && !missing.contains(&"libcuda.so.1"));
    }

    #[test]
    fn library_dirs_are_the_libraries_parents_once() {
        let f = |d: &str| DriverFile {
            source: PathBuf::from("/x"),
            destination: PathBuf::from(d),
        };
        let files = [
            f("/usr/lib64/libcuda.so.1"),
            f("/usr/lib64/libnvidia-ml.so.1"),
            f("/usr/bin/nvidia-smi"),
            f("/opt/nv/libnvidia-nvvm.so"),
        ];
        assert_eq!(
            library_dirs(&files),
            [PathBuf::from("/usr/lib64"), PathBuf::from("/opt/nv")]
        );
    }

    #[test]
    fn configured_files_must_exist_and_be_absolute() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("libcuda.so.1");
        std::fs::write(&f, b"x").unwrap();
        let got = from_list(std::slice::from_ref(&f)).unwrap();
        assert_eq!(got[0].destination, f);
        assert!(matches!(
            from_list(&[dir.path().join("nope")]),
            Err(DriverError::MissingConfigured { .. })
        ));
        assert!(matches!(
            from_list(&[PathBuf::from("lib.so")]),
            Err(DriverError::Relative { .. })
        ));
    }
}
