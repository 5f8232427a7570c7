//! Puts the simulator's two cdylibs together in `<profile>/sim/` as `libcuda.so.1`,
//! `libcuda.so` and `libnvidia-ml.so.1`, so `LD_LIBRARY_PATH=<profile>/sim` is all a
//! program needs. Copies (not symlinks) so the directory can be bind-mounted or
//! copied elsewhere on its own.

use std::io;
use std::path::{Path, PathBuf};

/// Cargo's output names of the two cdylibs.
pub const CUDA_CDYLIB: &str = "libkiwi_sim_cuda.so";
pub const NVML_CDYLIB: &str = "libkiwi_sim_nvml.so";

/// (source in the profile dir, names in the sim dir)
const INSTALLS: [(&str, &[&str]); 2] = [
    (CUDA_CDYLIB, &["libcuda.so.1", "libcuda.so"]),
    (NVML_CDYLIB, &["libnvidia-ml.so.1"]),
];

fn missing(profile_dir: &Path, lib: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::NotFound,
        format!(
            "{} not found: build the simulator first (`cargo build --workspace`)",
            profile_dir.join(lib).display()
        ),
    )
}

/// Copies the cdylibs into `<profile_dir>/sim/` unconditionally.
pub fn install_sim_dir(profile_dir: &Path) -> io::Result<PathBuf> {
    install(profile_dir, true)
}

/// Like [`install_sim_dir`], but copies only what is missing or older than the build
/// output. Safe to call from concurrent tests (copies go through a temp file + rename).
pub fn ensure_sim_dir(profile_dir: &Path) -> io::Result<PathBuf> {
    install(profile_dir, false)
}

fn install(profile_dir: &Path, force: bool) -> io::Result<PathBuf> {
    let dir = profile_dir.join("sim");
    std::fs::create_dir_all(&dir)?;
    for (src_name, dests) in INSTALLS {
        let src = profile_dir.join(src_name);
        let src_meta = std::fs::metadata(&src).map_err(|_| missing(profile_dir, src_name))?;
        for dest_name in dests {
            let dest = dir.join(dest_name);
            let stale = force
                || match std::fs::metadata(&dest) {
                    Ok(m) => m.len() != src_meta.len() || m.modified()? < src_meta.modified()?,
                    Err(_) => true,
                };
            if stale {
                // Unique per call: tests in one process may install concurrently.
                static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
                let n = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let tmp = dir.join(format!(".{dest_name}.{}.{n}.tmp", std::process::id()));
                std::fs::copy(&src, &tmp)?;
                std::fs::rename(&tmp, &dest)?;
            }
        }
    }
    Ok(dir)
}

/// The cargo profile directory (`target/debug`, `target/release`) of the running
/// executable: the exe's directory, or its parent when the exe lives in `deps/`
/// (test binaries) or `examples/`.
pub fn profile_dir_of_current_exe() -> io::Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let dir = exe
        .parent()
        .ok_or_else(|| io::Error::other("executable has no parent directory"))?;
    if matches!(
        dir.file_name().and_then(|n| n.to_str()),
        Some("deps" | "examples")
    ) {
        Ok(dir.parent().unwrap_or(dir).to_path_buf())
    } else {
        Ok(dir.to_path_buf())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn installs_and_refreshes_copies() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path();
        assert_eq!(
            ensure_sim_dir(p).unwrap_err().kind(),
            io::ErrorKind::NotFound
        );
        std::fs::write(p.join(CUDA_CDYLIB), b"cuda-v1").unwrap();
        std::fs::write(p.join(NVML_CDYLIB), b"nvml-v1").unwrap();
        let sim = ensure_sim_dir(p).unwrap();
        assert_eq!(std::fs::read(sim.join("libcuda.so.1")).unwrap(), b"cuda-v1");
        assert_eq!(std::fs::read(sim.join("libcuda.so")).unwrap(), b"cuda-v1");
        assert_eq!(
            std::fs::read(sim.join("libnvidia-ml.so.1")).unwrap(),
            b"nvml-v1"
        );
        assert!(!std::fs::symlink_metadata(sim.join("libcuda.so.1"))
            .unwrap()
            .file_type()
            .is_symlink());
        std::fs::write(p.join(CUDA_CDYLIB), b"cuda-version-2").unwrap();
        ensure_sim_dir(p).unwrap();
        assert_eq!(
            std::fs::read(sim.join("libcuda.so.1")).unwrap(),
            b"cuda-version-2"
        );
    }

    #[test]
    fn profile_dir_of_a_test_binary_is_the_profile() {
        let p = profile_dir_of_current_exe().unwrap();
        assert!(p.join("deps").is_dir(), "{}", p.display());
    }
}
