//! Test helper for any crate whose tests run programs on the simulator: a uniquely
//! named simulated machine (its own GPUs, capacity and trace file) that is removed
//! when the helper drops, and the environment a child process needs to use it.
//!
//! ```no_run
//! let m = kiwi_sim_core::harness::SimMachine::new("my-test", 1, 1 << 30).unwrap();
//! let mut cmd = std::process::Command::new("my-cuda-program");
//! m.apply(&mut cmd); // LD_LIBRARY_PATH, KIWI_SIM_NAME, KIWI_SIM_MEMORY, ...
//! ```

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

use crate::install::{ensure_sim_dir, profile_dir_of_current_exe};
use crate::trace::{read_trace, TraceRecord};

/// A simulated machine private to one test.
pub struct SimMachine {
    pub name: String,
    pub gpus: u32,
    pub memory: u64,
    /// Directory holding `libcuda.so.1` and `libnvidia-ml.so.1`.
    pub sim_dir: PathBuf,
    /// Kernel trace file of this machine's processes.
    pub trace: PathBuf,
    /// Extra knobs (e.g. `KIWI_SIM_PCIE_GBPS`).
    pub extra_env: Vec<(String, String)>,
    _tmp: tempfile_dir::TempDir,
}

/// A minimal self-deleting temp dir (keeps this crate free of dev-only deps).
mod tempfile_dir {
    use std::path::{Path, PathBuf};

    pub struct TempDir(PathBuf);

    impl TempDir {
        pub fn new(tag: &str) -> std::io::Result<TempDir> {
            let p = std::env::temp_dir().join(format!(
                "kiwi-sim-{tag}-{}-{}",
                std::process::id(),
                crate::trace::monotonic_ns()
            ));
            std::fs::create_dir_all(&p)?;
            Ok(TempDir(p))
        }

        pub fn path(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

/// The simulator directory for a test binary of this workspace, installing the
/// cdylibs into `<profile>/sim/` if needed. Fails (with the command to run) when
/// the simulator has not been built.
pub fn sim_dir() -> Result<PathBuf, String> {
    let profile = profile_dir_of_current_exe().map_err(|e| e.to_string())?;
    ensure_sim_dir(&profile)
        .map_err(|e| format!("{e} (the simulator cdylibs are built by `cargo build --workspace`)"))
}

impl SimMachine {
    /// A fresh machine named `kt-<tag>-<pid>-<n>` with `gpus` GPUs of `memory` bytes.
    pub fn new(tag: &str, gpus: u32, memory: u64) -> Result<SimMachine, String> {
        static SEQ: AtomicU32 = AtomicU32::new(0);
        let name = format!(
            "kt-{tag}-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        );
        crate::knobs::validate_name(&name)?;
        let _ = crate::machine::reset(&name);
        let tmp = tempfile_dir::TempDir::new(tag).map_err(|e| e.to_string())?;
        Ok(SimMachine {
            trace: tmp.path().join("trace"),
            name,
            gpus,
            memory,
            sim_dir: sim_dir()?,
            extra_env: Vec::new(),
            _tmp: tmp,
        })
    }

    /// Adds a knob for every process started with [`SimMachine::apply`].
    pub fn with_env(mut self, k: &str, v: &str) -> Self {
        self.extra_env.push((k.into(), v.into()));
        self
    }

    /// The environment a process needs to run on this machine.
    pub fn env(&self) -> Vec<(String, String)> {
        let mut ld = self.sim_dir.display().to_string();
        if let Ok(old) = std::env::var("LD_LIBRARY_PATH") {
            if !old.is_empty() {
                ld = format!("{ld}:{old}");
            }
        }
        let mut v = vec![
            ("LD_LIBRARY_PATH".to_string(), ld),
            ("KIWI_SIM_NAME".into(), self.name.clone()),
            ("KIWI_SIM_GPUS".into(), self.gpus.to_string()),
            ("KIWI_SIM_MEMORY".into(), self.memory.to_string()),
            ("KIWI_SIM_TRACE".into(), self.trace.display().to_string()),
        ];
        v.extend(self.extra_env.iter().cloned());
        v
    }

    /// Sets [`SimMachine::env`] on `cmd`.
    pub fn apply<'a>(&self, cmd: &'a mut Command) -> &'a mut Command {
        cmd.envs(self.env())
    }

    /// The kernel trace so far (empty if no kernel ran).
    pub fn read_trace(&self) -> Vec<TraceRecord> {
        if !Path::new(&self.trace).exists() {
            return Vec::new();
        }
        read_trace(&self.trace).unwrap_or_else(|e| panic!("{e}"))
    }
}

impl Drop for SimMachine {
    fn drop(&mut self) {
        let _ = crate::machine::reset(&self.name);
    }
}

/// Whether tests run in CI (`CI=true`), where a missing tool is a failure.
pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
}
