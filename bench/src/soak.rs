//! `soak` (issue #38): a node under load and faults loses nothing. Several simulated
//! GPUs charging real hardware's costs (`jobs::COSTS`), a real `kiwi-arbiter` with the
//! simulator's NVML and checkpoint API, and many `gpuburst --verify` clients of the
//! patterns gpuburst has (notebooks, growing notebooks, JAX-like preallocation with and
//! without the discard hint, idle processes that get checkpointed), each replaced when
//! it ends, while faults come at seeded random moments: SIGKILL of clients (whatever
//! they are doing: a swap-out, a swap-in, a checkpoint), SIGKILL and restart of the
//! arbiter, a tenant that storms the arbiter with reports that flip its GPU in and out
//! of oversubscription, and one that never reads its replies.
//!
//! It checks that every client not killed verifies every byte and ends within its
//! bound, that the arbiter's memory and descriptors stay bounded, and that nothing is
//! left once all have exited (simulated device memory, the arbiter's clients). It
//! prints the hand-off p50/p99 under load against a quiet run of the same clients
//! (no faults), grants per second, bytes swapped, the faults injected and survived,
//! and the seed: a failure replays with `--seed`.
//!
//! The patterns: notebooks, growing notebooks, JAX-like preallocation with and without
//! the discard hint, idle processes that get checkpointed, an application that maps
//! its own virtual memory as PyTorch's `expandable_segments` does (`--alloc vmm`,
//! growing mid-run), managed memory (`--alloc managed`), and a CUDA IPC pair (an
//! exporter and an importer of one allocation, `--ipc`, both verifying it). A pair is
//! one client of two processes on one GPU: it ends when both have, fails if either
//! does, and a client SIGKILL kills both together (an importer whose exporter died
//! before it opened the memory fails to open it, and an exporter waits for its
//! importer's close: killing one side alone would fail the other for a reason that
//! is not Kiwi's).
//!
//! The arbiter runs with a swap pool smaller than the clients' swapped-out memory
//! ([`SWAP_POOL`]) and a disk tier in the run's directory, so swap-outs borrow from the
//! pool, idle clients are asked to spill, and swap-ins read back from disk; a fault
//! takes the spill directory away for a few seconds (a missing disk: spills are
//! refused, nothing may be lost). At the end the pool must have nothing lent and no
//! spill file left.
//!
//! Not covered yet: clients in containers on their own sockets.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use kiwi_protocol::blocking::Connection;
use kiwi_protocol::{ArbiterMsg, ClientMsg, Event, EventKind, Register, Usage, PROTOCOL_VERSION};

use crate::jobs::{Build, Sim};
use crate::report::Figure;

const MIB: u64 = 1 << 20;
/// Each simulated GPU's memory.
const GPU_MEMORY: u64 = 4 << 30;
/// The arbiter's time quantum.
const TQ_S: u64 = 1;
/// The arbiter's swap pool: less than the clients' swapped-out memory, so the disk
/// tier works.
const SWAP_POOL: &str = "1GiB";
/// How long the spill directory is gone in a [`Fault::DiskGone`].
const DISK_GONE: Duration = Duration::from_secs(3);
/// The most the arbiter may hold resident, and descriptors beyond its clients'.
const MAX_ARBITER_RSS: u64 = 256 << 20;
const SPARE_FDS: usize = 64;

/// What `kiwi-bench soak` is asked for.
#[derive(Debug, Clone)]
pub struct SoakOptions {
    pub gpus: u32,
    pub clients: usize,
    pub seconds: u64,
    pub seed: u64,
    /// Only these patterns (by name; empty: all), to replay a failure of one.
    pub patterns: Vec<String>,
}

/// A seeded generator (splitmix64): the same seed, the same run.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// In `lo..=hi`.
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }
}

/// The faults a soak injects, in turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    Kill,
    Storm,
    Deaf,
    Restart,
    /// The spill directory disappears for [`DISK_GONE`] (a missing disk).
    DiskGone,
}

const FAULTS: [Fault; 7] = [
    Fault::Kill,
    Fault::Storm,
    Fault::Kill,
    Fault::Deaf,
    Fault::DiskGone,
    Fault::Kill,
    Fault::Restart,
];

/// A client's pattern: what it runs, as gpuburst arguments.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pattern {
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
}

const PATTERNS: [Pattern; 8] = [
    Pattern::Notebook,
    Pattern::Grower,
    Pattern::Prealloc,
    Pattern::Discard,
    Pattern::Idle,
    Pattern::AppVmm,
    Pattern::Managed,
    Pattern::IpcPair,
];

/// What an IPC pair's exporter shares.
const IPC_MEM: &str = "32MiB";

impl Pattern {
    fn name(self) -> &'static str {
        match self {
            Pattern::Notebook => "notebook",
            Pattern::Grower => "grower",
            Pattern::Prealloc => "prealloc",
            Pattern::Discard => "discard",
            Pattern::Idle => "idle",
            Pattern::AppVmm => "vmm",
            Pattern::Managed => "managed",
            Pattern::IpcPair => "ipc-pair",
        }
    }

    /// Its processes' roles and arguments (`file`: a fresh path for a pair's
    /// handle, `bound_ms`: how long a side may wait for the other), and the time its
    /// own work takes, ms.
    fn procs(
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
            Pattern::Notebook | Pattern::Managed | Pattern::IpcPair => {
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
struct Proc {
    child: Child,
    /// Its part: the pattern's name, or `exporter` / `importer` in a pair.
    role: &'static str,
    log: PathBuf,
    /// How it ended, once it has.
    ended: Option<std::process::ExitStatus>,
}

/// A client of the soak: one process, or the two of an IPC pair.
struct ClientProc {
    procs: Vec<Proc>,
    pattern: Pattern,
    gpu: u32,
    started: Instant,
    /// When it must have ended: its own work, the quanta of the others on its GPU
    /// ahead of it at each of its turns, and their swaps.
    bound: Instant,
}

impl ClientProc {
    /// One line: which client (and which of its processes), after how long, `what`,
    /// and the last line it wrote.
    fn failure(&self, p: &Proc, what: &str) -> String {
        let text = std::fs::read_to_string(&p.log).unwrap_or_default();
        let role = if p.role == self.pattern.name() {
            String::new()
        } else {
            format!(" ({})", p.role)
        };
        format!(
            "{}{role} on GPU {} (after {:.1} s) {what}: {}",
            self.pattern.name(),
            self.gpu,
            self.started.elapsed().as_secs_f64(),
            tail(&text)
        )
    }

    /// Reaps what ended; whether all of its processes have.
    fn reap(&mut self) -> Result<bool> {
        for p in self.procs.iter_mut().filter(|p| p.ended.is_none()) {
            p.ended = p.child.try_wait()?;
        }
        Ok(self.procs.iter().all(|p| p.ended.is_some()))
    }

    /// SIGKILLs every process still running (a pair dies together).
    fn kill(&mut self) {
        for p in self.procs.iter_mut().filter(|p| p.ended.is_none()) {
            let _ = p.child.kill();
            p.ended = p.child.wait().ok();
        }
    }
}

/// Processes of `live` (a pair is two).
fn processes(live: &[ClientProc]) -> usize {
    live.iter().map(|c| c.procs.len()).sum()
}

/// The arbiter: the workspace's `kiwi-arbiter`, which the soak kills and restarts on
/// the same socket directory.
struct Arbiter {
    exe: PathBuf,
    dir: PathBuf,
    child: Option<Child>,
}

impl Arbiter {
    fn start(b: &Build, sim: &Sim, gpus: u32, dir: &Path) -> Result<Arbiter> {
        let exe = b
            .gpuburst
            .parent()
            .context("no build directory")?
            .join("kiwi-arbiter");
        if !exe.exists() {
            bail!("{} is missing: build the workspace first", exe.display());
        }
        std::fs::create_dir_all(spill_dir(dir)).context("cannot make the spill directory")?;
        let mut a = Arbiter {
            exe,
            dir: dir.to_path_buf(),
            child: None,
        };
        a.spawn(b, sim, gpus)?;
        Ok(a)
    }

    fn spawn(&mut self, b: &Build, sim: &Sim, gpus: u32) -> Result<()> {
        let mut cmd = Command::new(&self.exe);
        sim.apply(b, &mut cmd)
            .env("KIWI_SIM_GPUS", gpus.to_string())
            .env_remove("KIWI_CONFIG")
            .arg("--socket-dir")
            .arg(&self.dir)
            .args([
                "--tq",
                &TQ_S.to_string(),
                "--nvml",
                "auto",
                "--checkpoint",
                "auto",
                "--swap-pool",
                SWAP_POOL,
            ])
            .arg("--spill-dir")
            .arg(spill_dir(&self.dir))
            // Every soak client is a child of this process, of one uid.
            .args(["--max-conns-per-group", "100000"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        self.child = Some(cmd.spawn().context("cannot start kiwi-arbiter")?);
        let socket = kiwi_config::client_socket(&self.dir);
        let control = kiwi_config::control_socket(&self.dir);
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::os::unix::net::UnixStream::connect(&socket).is_err()
            || std::os::unix::net::UnixStream::connect(&control).is_err()
        {
            if Instant::now() > deadline {
                bail!("the arbiter did not come up");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(())
    }

    fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Arbiter {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The arbiter's own resident memory (anonymous) and open descriptors.
fn arbiter_footprint(pid: u32) -> Option<(u64, usize)> {
    // Its own memory: the swap pool's slices it maps while it populates or spills
    // them are the pool's, bounded by its size.
    let rss = crate::procs::anon_rss_bytes(pid).ok()?;
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.count();
    Some((rss, fds))
}

/// What one run saw.
#[derive(Default)]
struct Outcome {
    /// Release → next grant on the same GPU, ms (from the arbiter's log).
    handoffs_ms: Vec<f64>,
    grants: usize,
    swapped_bytes: u64,
    seconds: f64,
    clients_run: usize,
    faults: BTreeMap<&'static str, usize>,
    peak_rss: u64,
    peak_fds: usize,
    /// The most the swap pool's disk tier held at once (sampled every second).
    peak_spilled: u64,
    failures: Vec<String>,
}

/// Reads the arbiter's whole event log.
fn events(dir: &Path) -> Result<Vec<Event>> {
    crate::shimbench::events_at(dir)
}

/// Hand-offs, grants and bytes swapped in a log. A hand-off runs from the moment the
/// GPU is asked back from its holder (its drop; for a holder that gives it back on
/// its own, its release, revocation or exit) to the grant of a client that was
/// waiting for it: the holder's swap-out and the grant's own latency.
fn tally(events: &[Event], out: &mut Outcome) {
    let mut holders: BTreeMap<&str, Vec<Option<u64>>> = BTreeMap::new();
    let mut asked_back: BTreeMap<&str, u64> = BTreeMap::new();
    for e in events {
        let gpu = e.gpu.as_str();
        match e.kind {
            EventKind::Drop { .. } => {
                asked_back.entry(gpu).or_insert(e.t_ns);
            }
            EventKind::Release { .. } | EventKind::Revoke | EventKind::Exit => {
                let h = holders.entry(gpu).or_default();
                if let Some(i) = h.iter().position(|&c| c == e.client) {
                    h.swap_remove(i);
                    asked_back.entry(gpu).or_insert(e.t_ns);
                }
            }
            EventKind::Grant { waited_ns, .. } => {
                out.grants += 1;
                holders.entry(gpu).or_default().push(e.client);
                let asked = e.t_ns.saturating_sub(waited_ns);
                match asked_back.remove(gpu) {
                    Some(t) if waited_ns > 0 && asked <= t => {
                        out.handoffs_ms.push(e.t_ns.saturating_sub(t) as f64 / 1e6);
                    }
                    _ => {}
                }
            }
            EventKind::SwapOut { bytes, .. } | EventKind::SwapIn { bytes, .. } => {
                out.swapped_bytes += bytes;
            }
            _ => {}
        }
    }
}

/// A tenant that flips its working set between 0 and 3 GiB as fast as the rate limit
/// lets it, for `for_`, then leaves.
fn storm(socket: PathBuf, uuid: String, total: u64, for_: Duration) -> Result<()> {
    let mut c: Connection<ClientMsg, ArbiterMsg> = Connection::connect(&socket)?;
    c.send(&ClientMsg::Register(register(&uuid, total)))?;
    let end = Instant::now() + for_;
    let mut token = 0;
    while Instant::now() < end {
        for k in 0..4_000u64 {
            let ws = if k % 2 == 0 { 3 << 30 } else { 0 };
            c.send(&ClientMsg::Usage(Usage {
                working_set_bytes: ws,
                resident_bytes: 0,
            }))?;
        }
        token += 1;
        c.send(&ClientMsg::Ping { token })?;
        // Its replies are read: it is not the deaf one.
        while let Ok(Some(m)) = c.recv_timeout(Duration::from_secs(10)) {
            if matches!(m, ArbiterMsg::Pong { token: t } if t == token) {
                break;
            }
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    Ok(())
}

/// A tenant that registers, asks and never reads a reply, for `for_`.
fn deaf(socket: PathBuf, uuid: String, total: u64, for_: Duration) -> Result<()> {
    let mut c: Connection<ClientMsg, ArbiterMsg> = Connection::connect(&socket)?;
    c.send(&ClientMsg::Register(register(&uuid, total)))?;
    let end = Instant::now() + for_;
    let mut token = 0;
    while Instant::now() < end {
        token += 1;
        if c.send(&ClientMsg::Ping { token }).is_err() {
            break;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    Ok(())
}

fn register(uuid: &str, total: u64) -> Register {
    Register {
        version: PROTOCOL_VERSION,
        pid: std::process::id(),
        gpu_uuid: uuid.to_string(),
        gpu_total_memory: total,
        working_set_bytes: 0,
        resident_bytes: 0,
        container_id: None,
        pod_name: None,
        pod_namespace: None,
        name: Some("soak-tenant".into()),
        resume: None,
        wait_info: false,
        unswappable_bytes: Some(0),
        pipelined: false,
        room_info: false,
        bounds: false,
        group: None,
    }
}

/// One run of `o.clients` clients for `o.seconds`, with faults when `faults`.
fn run(b: &Build, o: &SoakOptions, faults: bool) -> Result<Outcome> {
    let sim = Sim::new(if faults { "soak" } else { "soak-quiet" }, GPU_MEMORY);
    let work = tempfile::Builder::new().prefix("kiwi-soak").tempdir()?;
    let dir = work.path().join("run");
    std::fs::create_dir(&dir)?;
    let mut arb = Arbiter::start(b, &sim, o.gpus, &dir)?;
    let mut rng = Rng(o.seed ^ if faults { 0 } else { 0x5eed });
    let per_gpu = o.clients.div_ceil(o.gpus as usize) as u64;
    let mut out = Outcome::default();
    let mut live: Vec<ClientProc> = Vec::new();
    let mut tenants: Vec<std::thread::JoinHandle<Result<()>>> = Vec::new();
    let mut last_look = Instant::now();
    let mut log_so_far: Vec<Event> = Vec::new();
    let start = Instant::now();
    let end = start + Duration::from_secs(o.seconds);
    let mut next_fault = start + Duration::from_millis(rng.range(1000, 3000));
    let mut last_restart = start;
    let mut spawned = 0usize;
    let mut fault_no = 0usize;
    let patterns: Vec<Pattern> = PATTERNS
        .into_iter()
        .filter(|p| o.patterns.is_empty() || o.patterns.iter().any(|n| n == p.name()))
        .collect();
    if patterns.is_empty() {
        bail!(
            "--patterns: none of {:?} is a pattern ({})",
            o.patterns,
            PATTERNS.map(Pattern::name).join(", ")
        );
    }
    // A new client goes to the GPU with the fewest processes: clients of a busy GPU
    // last longer, and GPUs picked in turn piled twice their share onto one.
    // Its work, then at each of its turns the quanta and swaps of the others on its
    // GPU (a grace period and a swap of a few hundred MiB each), and the arbiter's
    // restarts (a reconnection each).
    let bound_ms = |work_ms: u64| {
        let turns = 4 + work_ms / (TQ_S * 1000);
        work_ms + turns * per_gpu * (TQ_S * 1000 + 5_500) + 30_000
    };
    let spawn = |rng: &mut Rng, n: usize, live: &[ClientProc]| -> Result<ClientProc> {
        let pattern = patterns[n % patterns.len()];
        let gpu = (0..o.gpus)
            .min_by_key(|g| {
                live.iter()
                    .filter(|c| c.gpu == *g)
                    .map(|c| c.procs.len())
                    .sum::<usize>()
            })
            .unwrap_or(0);
        let pair_file = work.path().join(format!("ipc-{n}"));
        let (roles, work_ms) = pattern.procs(rng, &pair_file, bound_ms);
        let mut procs: Vec<Proc> = Vec::with_capacity(roles.len());
        for (role, args) in roles {
            let log = work.path().join(format!("client-{n}-{role}.log"));
            let file = std::fs::File::create(&log)?;
            let mut cmd = Command::new(&b.gpuburst);
            sim.apply(b, &mut cmd)
                .env("KIWI_SIM_GPUS", o.gpus.to_string())
                .env("LD_PRELOAD", &b.shim)
                .env("KIWI_SOCKET_DIR", &dir)
                .env("KIWI_REQUIRE_ARBITER", "1")
                .env("KIWI_LOG", "warn")
                .args(&args)
                .args(["--device", &gpu.to_string(), "--verify"])
                .args(["--name", &format!("{role}-{n}")])
                .args(["--seed", &n.to_string()])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(file);
            let child = match cmd.spawn() {
                Ok(c) => c,
                Err(e) => {
                    // The pair's first side dies with it.
                    for p in &mut procs {
                        let _ = p.child.kill();
                        let _ = p.child.wait();
                    }
                    return Err(e).context("cannot start gpuburst");
                }
            };
            procs.push(Proc {
                child,
                role,
                log,
                ended: None,
            });
        }
        let now = Instant::now();
        Ok(ClientProc {
            procs,
            pattern,
            gpu,
            started: now,
            bound: now + Duration::from_millis(bound_ms(work_ms)),
        })
    };
    while Instant::now() < end || !live.is_empty() {
        let now = Instant::now();
        // Keep `clients` alive until the end.
        while now < end && processes(&live) < o.clients {
            let c = spawn(&mut rng, spawned, &live)?;
            live.push(c);
            spawned += 1;
        }
        // Reap the ended ones; kill and fail the ones past their bound.
        let mut i = 0;
        while i < live.len() {
            let c = &mut live[i];
            if c.reap()? {
                let c = live.swap_remove(i);
                out.clients_run += c.procs.len();
                for p in &c.procs {
                    match p.ended {
                        Some(status) if !status.success() => {
                            out.failures.push(c.failure(p, &format!("exited {status}")));
                        }
                        _ => {}
                    }
                }
            } else if now > c.bound {
                // Those still running waited too long; a pair's other side may have
                // ended well.
                let late: Vec<usize> = (0..c.procs.len())
                    .filter(|&k| c.procs[k].ended.is_none())
                    .collect();
                c.kill();
                let c = live.swap_remove(i);
                for k in late {
                    out.failures
                        .push(c.failure(&c.procs[k], "waited past its bound"));
                }
            } else {
                i += 1;
            }
        }
        if faults && now >= next_fault && now < end {
            next_fault = now + Duration::from_millis(rng.range(1000, 3000));
            let gpu = rng.range(0, o.gpus as u64 - 1) as u32;
            let uuid = kiwi_sim_core::ident::gpu_uuid_string(&sim.name, gpu);
            let socket = kiwi_config::client_socket(&dir);
            // Every kind in turn, at random moments and on random victims: a short
            // run still sees each.
            let kind = FAULTS[fault_no % FAULTS.len()];
            fault_no += 1;
            // At most one arbiter restart per 10 s: a client is killed instead.
            let kind = if kind == Fault::Restart && now < last_restart + Duration::from_secs(10) {
                Fault::Kill
            } else {
                kind
            };
            match kind {
                Fault::Kill if !live.is_empty() => {
                    // A pair's two processes together.
                    let k = rng.range(0, live.len() as u64 - 1) as usize;
                    let mut c = live.swap_remove(k);
                    c.kill();
                    *out.faults.entry("client SIGKILL").or_default() += 1;
                }
                Fault::Storm => {
                    tenants.push(std::thread::spawn(move || {
                        storm(socket, uuid, GPU_MEMORY, Duration::from_secs(2))
                    }));
                    *out.faults.entry("report storm").or_default() += 1;
                }
                Fault::Deaf => {
                    tenants.push(std::thread::spawn(move || {
                        deaf(socket, uuid, GPU_MEMORY, Duration::from_secs(3))
                    }));
                    *out.faults.entry("client that never reads").or_default() += 1;
                }
                Fault::DiskGone => {
                    let (here, away) = (spill_dir(&dir), dir.join("spill.gone"));
                    tenants.push(std::thread::spawn(move || {
                        std::fs::rename(&here, &away)?;
                        std::thread::sleep(DISK_GONE);
                        std::fs::rename(&away, &here)?;
                        Ok(())
                    }));
                    *out.faults.entry("spill directory gone").or_default() += 1;
                }
                Fault::Restart => {
                    // What this arbiter logged, before its log goes with it.
                    log_so_far.extend(events(&dir).unwrap_or_default());
                    arb.kill();
                    arb.spawn(b, &sim, o.gpus)?;
                    last_restart = Instant::now();
                    *out.faults.entry("arbiter SIGKILL and restart").or_default() += 1;
                }
                _ => {}
            }
        }
        if last_look.elapsed() >= Duration::from_secs(1) {
            last_look = Instant::now();
            if let Some(spill) = status(&dir).and_then(|s| s.swap_pool).and_then(|p| p.spill) {
                out.peak_spilled = out.peak_spilled.max(spill.spilled_bytes);
            }
        }
        if let Some((rss, fds)) = arbiter_footprint(arb.pid()) {
            out.peak_rss = out.peak_rss.max(rss);
            out.peak_fds = out.peak_fds.max(fds);
            let mut bound = o.clients + tenants.len() + SPARE_FDS;
            if fds > bound + 64 {
                // The swap pool's memfds and spill files are the arbiter's to hold,
                // bounded by the pool and the disk tier.
                bound += status(&dir)
                    .and_then(|s| s.swap_pool)
                    .map_or(0, |p| p.memfds + p.spill.map_or(0, |s| s.files))
                    as usize;
            }
            if rss > MAX_ARBITER_RSS || fds > bound + 64 {
                out.failures.push(format!(
                    "the arbiter holds {} MiB and {fds} descriptors (bounds: {} MiB, {})",
                    rss >> 20,
                    MAX_ARBITER_RSS >> 20,
                    bound + 64
                ));
                break;
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    for t in tenants {
        match t.join() {
            Ok(Ok(())) => {}
            // A tenant the arbiter disconnected (the deaf one) ends in an error:
            // what is checked is that the others did not pay for it.
            Ok(Err(_)) => {}
            Err(_) => out.failures.push("a tenant thread panicked".into()),
        }
    }
    for mut c in live {
        c.kill();
    }
    out.seconds = start.elapsed().as_secs_f64();
    log_so_far.extend(events(&dir)?);
    tally(&log_so_far, &mut out);
    // Nothing left: no client in the arbiter, no simulated device memory in use.
    let leftover = wait_for_nothing_left(&dir, &sim.name, o.gpus);
    if let Err(why) = leftover {
        out.failures.push(why);
    }
    drop(arb);
    let _ = kiwi_sim_core::machine::reset(&sim.name);
    Ok(out)
}

/// The disk tier's directory in the run's directory.
fn spill_dir(dir: &Path) -> PathBuf {
    dir.join("spill")
}

/// Waits (up to 10 s) until the arbiter has no client, the simulated GPUs no memory in
/// use, and the swap pool nothing lent and no spill file; why not otherwise.
fn wait_for_nothing_left(dir: &Path, sim: &str, gpus: u32) -> std::result::Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (clients, pool) = match status(dir) {
            Some(s) => (
                Some(s.gpus.iter().map(|g| g.clients.len()).sum::<usize>()),
                s.swap_pool
                    .map(|p| (p.lent_bytes, p.spill.map_or(0, |s| s.files))),
            ),
            None => (None, None),
        };
        let used: Vec<u64> = match kiwi_sim_core::Machine::open_existing(sim) {
            Ok(Some(m)) => (0..gpus)
                .map(|g| m.usage(g).map(|u| u.used).unwrap_or(0))
                .collect(),
            _ => vec![0],
        };
        if clients == Some(0) && used.iter().all(|&u| u == 0) && pool == Some((0, 0)) {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!(
                "left behind once every client exited: {clients:?} clients in the arbiter, device memory in use {:?} MiB, swap pool (lent bytes, spill files) {pool:?}",
                used.iter().map(|u| u >> 20).collect::<Vec<_>>()
            ));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn status(dir: &Path) -> Option<kiwi_protocol::StatusReport> {
    let mut c: Connection<kiwi_protocol::ControlRequest, kiwi_protocol::ControlReply> =
        Connection::connect(&kiwi_config::control_socket(dir)).ok()?;
    match c
        .call(&kiwi_protocol::ControlRequest::Status { gpu: None })
        .ok()?
    {
        kiwi_protocol::ControlReply::Status(s) => Some(s),
        _ => None,
    }
}

/// The last line of a client's log.
fn tail(text: &str) -> String {
    text.lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("(no output)")
        .to_string()
}

fn percentile(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s[((s.len() - 1) as f64 * p).round() as usize]
}

/// The soak, then the same clients quiet; fails if anything was lost.
pub fn soak(o: &SoakOptions) -> Result<Vec<Figure>> {
    if o.gpus == 0 || o.clients == 0 || o.seconds == 0 {
        bail!("--gpus, --clients and --seconds must be at least 1");
    }
    let b = Build::find()?;
    eprintln!(
        "kiwi-bench soak: {} clients on {} GPUs for {} s, seed {} (replay: kiwi-bench soak --gpus {} --clients {} --seconds {} --seed {})",
        o.clients, o.gpus, o.seconds, o.seed, o.gpus, o.clients, o.seconds, o.seed
    );
    let loaded = run(&b, o, true)?;
    let quiet_opts = SoakOptions {
        seconds: (o.seconds / 2).max(10),
        ..o.clone()
    };
    let quiet = run(&b, &quiet_opts, false)?;
    let mut failures = loaded.failures.clone();
    failures.extend(quiet.failures.iter().map(|f| format!("(quiet run) {f}")));
    let injected: usize = loaded.faults.values().sum();
    let faults = loaded
        .faults
        .iter()
        .map(|(k, v)| format!("{k} {v}"))
        .collect::<Vec<_>>()
        .join(", ");
    eprintln!(
        "kiwi-bench soak: seed {}: {} clients run, {injected} faults injected ({faults}), {} failures; arbiter peak {} MiB, {} descriptors",
        o.seed,
        loaded.clients_run,
        failures.len(),
        loaded.peak_rss >> 20,
        loaded.peak_fds
    );
    if !failures.is_empty() {
        bail!(
            "seed {}: {} failure(s):\n{}",
            o.seed,
            failures.len(),
            failures.join("\n")
        );
    }
    let s = "soak";
    let p50 = percentile(&loaded.handoffs_ms, 0.5);
    let p99 = percentile(&loaded.handoffs_ms, 0.99);
    Ok(vec![
        Figure::new(s, "handoff_p50", p50, "ms")
            .against(
                percentile(&quiet.handoffs_ms, 0.5),
                "the same clients without faults, same run",
            )
            .goal("bounded: the faults cost the others little"),
        Figure::new(s, "handoff_p99", p99, "ms")
            .against(
                percentile(&quiet.handoffs_ms, 0.99),
                "the same clients without faults, same run",
            )
            .goal("bounded"),
        Figure::new(
            s,
            "grants_per_second",
            loaded.grants as f64 / loaded.seconds,
            "/s",
        )
        .against(
            quiet.grants as f64 / quiet.seconds,
            "the same clients without faults, same run",
        ),
        Figure::new(
            s,
            "swapped",
            loaded.swapped_bytes as f64 / MIB as f64,
            "MiB",
        )
        .against(
            quiet.swapped_bytes as f64 / MIB as f64,
            "the same clients without faults (half as long), same run",
        ),
        Figure::new(
            s,
            "spilled_peak",
            loaded.peak_spilled as f64 / MIB as f64,
            "MiB",
        )
        .against(
            quiet.peak_spilled as f64 / MIB as f64,
            "the same clients without faults, same run; the pool is 1 GiB",
        ),
        Figure::new(s, "faults_survived", injected as f64, "faults")
            .against(
                injected as f64,
                &format!("faults injected ({faults}), seed {}", o.seed),
            )
            .goal("all survived: every client not killed verified every byte"),
    ])
}
