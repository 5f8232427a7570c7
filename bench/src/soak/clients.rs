//! The soak's clients: the patterns they run (as `gpuburst` arguments) and the
//! processes of each, reaped and killed together. Nothing here talks to the arbiter.

use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::Instant;

use super::Rng;

/// A client's pattern: what it runs, as gpuburst arguments.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Pattern {
    Notebook,
    Grower,
    Prealloc,
    Discard,
    Idle,
    /// The application's own VMM memory, as PyTorch's `expandable_segments`.
    AppVmm,
    Managed,
    /// Two processes: an exporter and an importer of one allocation.
    IpcPair,
    /// A notebook in a container: on the container's own socket
    /// (`super::containers`), labelled by its record.
    Container,
}

pub(super) const PATTERNS: [Pattern; 9] = [
    Pattern::Notebook,
    Pattern::Grower,
    Pattern::Prealloc,
    Pattern::Discard,
    Pattern::Idle,
    Pattern::AppVmm,
    Pattern::Managed,
    Pattern::IpcPair,
    Pattern::Container,
];

/// What an IPC pair's exporter shares.
const IPC_MEM: &str = "32MiB";

impl Pattern {
    pub(super) fn name(self) -> &'static str {
        match self {
            Pattern::Notebook => "notebook",
            Pattern::Grower => "grower",
            Pattern::Prealloc => "prealloc",
            Pattern::Discard => "discard",
            Pattern::Idle => "idle",
            Pattern::AppVmm => "vmm",
            Pattern::Managed => "managed",
            Pattern::IpcPair => "ipc-pair",
            Pattern::Container => "container",
        }
    }

    /// Its processes' roles and arguments (`file`: a fresh path for a pair's
    /// handle, `bound_ms`: how long a side may wait for the other), and the time its
    /// own work takes, ms.
    pub(super) fn procs(
        self,
        rng: &mut Rng,
        file: &Path,
        bound_ms: impl Fn(u64) -> u64,
    ) -> (Vec<(&'static str, Vec<String>)>, u64) {
        if self == Pattern::IpcPair {
            let (exporter, work_ms) = Pattern::Notebook.args(rng);
            let (importer, _) = Pattern::Notebook.args(rng);
            let wait = bound_ms(work_ms).to_string();
            let side = |mut a: Vec<String>, role: &str| {
                a.extend([
                    "--ipc".into(),
                    format!("{role}:{}", file.display()),
                    "--ipc-timeout-ms".into(),
                    wait.clone(),
                ]);
                if role == "export" {
                    a.extend(["--ipc-mem".into(), IPC_MEM.into()]);
                }
                a
            };
            return (
                vec![
                    ("exporter", side(exporter, "export")),
                    ("importer", side(importer, "import")),
                ],
                work_ms,
            );
        }
        let (a, work_ms) = self.args(rng);
        (vec![(self.name(), a)], work_ms)
    }

    /// A one-process pattern's arguments and the time its own work takes, ms.
    fn args(self, rng: &mut Rng) -> (Vec<String>, u64) {
        // Small enough that 32 of them fit this machine's RAM: the simulator's device
        // memory is its processes' own host memory, and each swaps out to host
        // buffers of its own (issue #37); larger ones had the kernel's OOM killer
        // end them.
        let mem = rng.range(64, 192);
        match self {
            Pattern::Notebook | Pattern::Managed | Pattern::IpcPair | Pattern::Container => {
                let rounds = rng.range(2, 4);
                let phases = vec!["gpu:200,cpu:300"; rounds as usize].join(",");
                let mut a = vec![
                    "--mem".into(),
                    format!("{mem}MiB"),
                    "--script".into(),
                    phases,
                ];
                if self == Pattern::Managed {
                    a.extend(["--alloc".into(), "managed".into()]);
                }
                (a, rounds * 500)
            }
            Pattern::AppVmm => (
                vec![
                    "--alloc".into(),
                    "vmm".into(),
                    "--mem".into(),
                    format!("{mem}MiB"),
                    "--script".into(),
                    "gpu:100,cpu:200,grow:64,gpu:200,cpu:200,gpu:100".into(),
                ],
                800,
            ),
            Pattern::Grower => (
                vec![
                    "--mem".into(),
                    format!("{mem}MiB"),
                    "--script".into(),
                    "gpu:100,cpu:200,grow:96,gpu:200,cpu:200,gpu:100".into(),
                ],
                800,
            ),
            Pattern::Prealloc | Pattern::Discard => {
                let mut a = vec![
                    "--prealloc".into(),
                    "0.1".into(),
                    "--mem".into(),
                    "64MiB".into(),
                    "--bursts".into(),
                    "3".into(),
                    "--gpu-ms".into(),
                    "150".into(),
                    "--cpu-ms".into(),
                    "250".into(),
                ];
                if self == Pattern::Discard {
                    a.push("--discard".into());
                }
                (a, 1200)
            }
            Pattern::Idle => {
                let idle = rng.range(2000, 5000);
                (
                    vec![
                        "--mem".into(),
                        format!("{mem}MiB"),
                        "--script".into(),
                        format!("gpu:100,idle:{idle},gpu:100"),
                    ],
                    idle + 200,
                )
            }
        }
    }
}

/// One process of a client.
pub(super) struct Proc {
    pub(super) child: Child,
    /// Its part: the pattern's name, or `exporter` / `importer` in a pair.
    pub(super) role: &'static str,
    pub(super) log: PathBuf,
    /// How it ended, once it has.
    pub(super) ended: Option<std::process::ExitStatus>,
}

/// A client of the soak: one process, or the two of an IPC pair.
pub(super) struct ClientProc {
    pub(super) procs: Vec<Proc>,
    pub(super) pattern: Pattern,
    pub(super) gpu: u32,
    /// The container it runs in (`super::containers::Container::no`), if any.
    pub(super) container: Option<usize>,
    /// When its container was detached while it ran: it keeps the connections it
    /// has and can open no new one.
    pub(super) orphaned: Option<Instant>,
    pub(super) started: Instant,
    /// When it must have ended: its own work, the quanta of the others on its GPU
    /// ahead of it at each of its turns, and their swaps.
    pub(super) bound: Instant,
}

impl ClientProc {
    /// One line: which client (and which of its processes, and its container), after
    /// how long, `what`, and the last line it wrote.
    pub(super) fn failure(&self, p: &Proc, what: &str) -> String {
        let text = std::fs::read_to_string(&p.log).unwrap_or_default();
        let role = if p.role == self.pattern.name() {
            String::new()
        } else {
            format!(" ({})", p.role)
        };
        let container = match (self.container, self.orphaned) {
            (Some(no), None) => format!(" in container {}", super::containers::name(no)),
            (Some(no), Some(t)) => format!(
                " in container {} (detached {:.1} s before, while it ran)",
                super::containers::name(no),
                t.elapsed().as_secs_f64()
            ),
            (None, _) => String::new(),
        };
        format!(
            "{}{role}{container} on GPU {} (after {:.1} s) {what}: {}",
            self.pattern.name(),
            self.gpu,
            self.started.elapsed().as_secs_f64(),
            tail(&text)
        )
    }

    /// Reaps what ended; whether all of its processes have.
    pub(super) fn reap(&mut self) -> std::io::Result<bool> {
        for p in self.procs.iter_mut().filter(|p| p.ended.is_none()) {
            p.ended = p.child.try_wait()?;
        }
        Ok(self.procs.iter().all(|p| p.ended.is_some()))
    }

    /// SIGKILLs every process still running (a pair dies together).
    pub(super) fn kill(&mut self) {
        for p in self.procs.iter_mut().filter(|p| p.ended.is_none()) {
            let _ = p.child.kill();
            p.ended = p.child.wait().ok();
        }
    }
}

/// Processes of `live` (a pair is two).
pub(super) fn processes(live: &[ClientProc]) -> usize {
    live.iter().map(|c| c.procs.len()).sum()
}

/// The last line of a client's log.
fn tail(text: &str) -> String {
    text.lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("(no output)")
        .to_string()
}
