//! `soak` (issue #38): a node under load and faults loses nothing. Several simulated
//! GPUs charging real hardware's costs (`jobs::COSTS`), a real `kiwi-arbiter` with the
//! simulator's NVML and checkpoint API, and many `gpuburst --verify` clients of the
//! patterns gpuburst has (notebooks, growing notebooks, JAX-like preallocation with and
//! without the discard hint, idle processes that get checkpointed), each replaced when
//! it ends, while faults come at seeded random moments: SIGKILL of clients (whatever
//! they are doing: a swap-out, a swap-in, a checkpoint), SIGKILL and restart of the
//! arbiter, a tenant that storms the arbiter with reports that flip its GPU in and out
//! of oversubscription, one that never reads its replies, and containers attached and
//! detached around the clients that run in them.
//!
//! It checks that every client not killed verifies every byte and ends within its
//! bound, that the arbiter's memory and descriptors stay bounded, and that nothing is
//! left once all have exited (simulated device memory, the arbiter's clients, the
//! containers' records, sockets and listeners). It prints the hand-off p50/p99 under
//! load against a quiet run of the same clients (no faults), grants per second, bytes
//! swapped, the faults injected and survived, and the seed: a failure replays with
//! `--seed`.
//!
//! The patterns (`clients`): notebooks, growing notebooks, JAX-like preallocation with
//! and without the discard hint, idle processes that get checkpointed, an application
//! that maps its own virtual memory as PyTorch's `expandable_segments` does (`--alloc
//! vmm`, growing mid-run), managed memory (`--alloc managed`), a CUDA IPC pair (an
//! exporter and an importer of one allocation, `--ipc`, both verifying it), and
//! notebooks in containers. A pair is one client of two processes on one GPU: it ends
//! when both have, fails if either does, and a client SIGKILL kills both together (an
//! importer whose exporter died before it opened the memory fails to open it, and an
//! exporter waits for its importer's close: killing one side alone would fail the
//! other for a reason that is not Kiwi's).
//!
//! A client in a container (`containers`) runs on the container's own socket, which
//! the arbiter serves after `attach_container` (as `kiwi-hook` asks at prestart, with
//! the record the hook writes, claiming the client's GPU), and claims to be someone
//! else: the arbiter must label it from the record. A container stops once its few
//! clients are done; container churn attaches a new one and stops an idle one early.
//! A container stops by its poststop hook (`detach_container`) or, every other time
//! under faults, without one (a runtime that crashed: the arbiter's next attach or
//! start sweeps it); either way nothing of it may be left, its listener included. A
//! harsher fault detaches a container while its client runs, which must still verify
//! every byte and exit 0 on the connections it has (one an arbiter restart would cut
//! off is killed before the restart and counted apart). Every other storming or deaf
//! tenant is in a container.
//!
//! The arbiter runs with a swap pool smaller than the clients' swapped-out memory
//! ([`SWAP_POOL`]) and a disk tier in the run's directory, so swap-outs borrow from the
//! pool, idle clients are asked to spill, and swap-ins read back from disk; a fault
//! takes the spill directory away for a few seconds (a missing disk: spills are
//! refused, nothing may be lost). At the end the pool must have nothing lent and no
//! spill file left.
//!
//! Run as root, each arbiter gets a tmpfs of its own for its spill directory
//! (`disk`), and a fault fills it to the last byte for a few seconds (a full disk:
//! spills are refused, nothing may be lost).
//!
//! Not covered yet: clients in real containers (their own mount and pid namespaces,
//! as `kiwi-tests`' `FakeContainer` makes them; the soak's share the host's).

mod arbiter;
mod clients;
mod containers;
mod disk;
mod tenants;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use kiwi_protocol::{Event, EventKind};

use crate::jobs::{Build, Sim};
use crate::report::Figure;
use arbiter::{arbiter_footprint, Arbiter};
use clients::{processes, ClientProc, Pattern, Proc, PATTERNS};
use containers::Containers;
use disk::SpillDisk;

const MIB: u64 = 1 << 20;
/// The arbiter's time quantum.
const TQ_S: u64 = 1;
/// The arbiter's swap pool: less than the clients' swapped-out memory, so the disk
/// tier works.
const SWAP_POOL: &str = "1GiB";
/// How long the spill directory is gone in a [`Fault::DiskGone`], or its disk full in
/// a [`Fault::DiskFull`].
const DISK_GONE: Duration = Duration::from_secs(3);
/// The most the arbiter may hold resident, and descriptors beyond its clients'.
const MAX_ARBITER_RSS: u64 = 256 << 20;
const SPARE_FDS: usize = 64;
/// Descriptors the arbiter may hold at the end, once nothing is left, beyond those
/// it held at its first start and its swap pool's.
const END_SPARE_FDS: usize = 16;

/// What `kiwi-bench soak` is asked for.
#[derive(Debug, Clone)]
pub struct SoakOptions {
    pub gpus: u32,
    pub clients: usize,
    pub seconds: u64,
    /// Each simulated GPU's memory, bytes.
    pub gpu_memory: u64,
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

    /// One of `v`, if any.
    fn pick<T: Copy>(&mut self, v: &[T]) -> Option<T> {
        (!v.is_empty()).then(|| v[self.range(0, v.len() as u64 - 1) as usize])
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
    /// The spill directory's disk is full for [`DISK_GONE`] (when the soak can fill
    /// it: [`disk`]).
    DiskFull,
    /// A new container is attached and an idle one stops, with its poststop hook or
    /// (every other time) without.
    Churn,
    /// A container is detached while a client of it runs.
    DetachLive,
}

const FAULTS: [Fault; 10] = [
    Fault::Kill,
    Fault::Storm,
    Fault::Churn,
    Fault::Kill,
    Fault::Deaf,
    Fault::DiskGone,
    Fault::Kill,
    Fault::DiskFull,
    Fault::Restart,
    // Right after a restart: its client has the longest to run on before the next.
    Fault::DetachLive,
];

/// What one run saw.
#[derive(Default)]
struct Outcome {
    /// Hand-offs, ms (from the arbiter's log; see [`tally`]).
    handoffs_ms: Vec<f64>,
    grants: usize,
    /// Grants to a waiter of room others gave up with no one asked back.
    room_grants: usize,
    swapped_bytes: u64,
    seconds: f64,
    clients_run: usize,
    faults: BTreeMap<&'static str, usize>,
    peak_rss: u64,
    peak_fds: usize,
    /// The most the swap pool's disk tier held at once (sampled every second).
    peak_spilled: u64,
    /// Spills the disk tier refused (summed over the arbiter's lives; sampled every
    /// second), and of those, whether one said the disk had no room.
    spill_refusals: (u64, bool),
    /// The arbiter's descriptors at the end, once nothing was left, and at its first
    /// start.
    end_fds: (usize, usize),
    /// Clients in containers that exited 0.
    container_clients_ok: usize,
    /// Swaps of clients whose container was detached under them, after the detach,
    /// and their bytes.
    orphan_swaps: usize,
    orphan_swapped_bytes: u64,
    containers: containers::Tally,
    failures: Vec<String>,
}

/// Reads the arbiter's whole event log.
fn events(dir: &Path) -> Result<Vec<Event>> {
    crate::shimbench::events_at(dir)
}

/// Hand-offs, grants and bytes swapped in a log.
///
/// A hand-off is the arbiter taking a GPU back for a waiter: from the moment it asks
/// a holder back (its drop; a revocation if it had to), or the waiter's request if
/// that came later, to the waiter's grant. That is the holders' swap-out and the
/// grant's own latency, what the faults could lengthen. A waiter granted room that
/// others gave up on their own (a release when idle or done, an exit, a kill) with no
/// one asked back is no hand-off: the arbiter grants it in the same step, so it would
/// count 0 ms, and faults, which end clients, would make more of them and pull the
/// median down (the 15-minute run of 2026-11-29 printed a p50 of 0). Those grants are
/// counted apart (`room_grants`).
fn tally(events: &[Event], out: &mut Outcome) {
    #[derive(Default)]
    struct Gpu {
        /// When a holder was first asked back since the last grants.
        asked: Option<u64>,
        /// When the grants that answered `asked` were made (one step, one time).
        answered: Option<u64>,
    }
    let mut gpus: BTreeMap<&str, Gpu> = BTreeMap::new();
    for e in events {
        let g = gpus.entry(e.gpu.as_str()).or_default();
        match e.kind {
            EventKind::Drop { .. } | EventKind::Revoke => {
                if g.answered.is_some_and(|t| t != e.t_ns) {
                    *g = Gpu::default();
                }
                g.asked.get_or_insert(e.t_ns);
            }
            EventKind::Grant { waited_ns, .. } => {
                out.grants += 1;
                if waited_ns == 0 {
                    continue;
                }
                if g.answered.is_some_and(|t| t != e.t_ns) {
                    *g = Gpu::default();
                }
                match g.asked {
                    Some(asked) => {
                        let from = asked.max(e.t_ns.saturating_sub(waited_ns));
                        out.handoffs_ms
                            .push(e.t_ns.saturating_sub(from) as f64 / 1e6);
                        g.answered = Some(e.t_ns);
                    }
                    None => out.room_grants += 1,
                }
            }
            EventKind::SwapOut { bytes, .. } | EventKind::SwapIn { bytes, .. } => {
                out.swapped_bytes += bytes;
            }
            _ => {}
        }
    }
}

/// One run of `o.clients` clients for `o.seconds`, with faults when `faults`.
fn run(b: &Build, o: &SoakOptions, faults: bool) -> Result<Outcome> {
    let sim = Sim::new(if faults { "soak" } else { "soak-quiet" }, o.gpu_memory);
    let work = tempfile::Builder::new().prefix("kiwi-soak").tempdir()?;
    let dir = work.path().join("run");
    std::fs::create_dir(&dir)?;
    let disk = SpillDisk::new(&dir)?;
    let mut arb = Arbiter::start(b, &sim, o.gpus, &dir, disk.clone())?;
    // What it holds with nothing to serve: the end's bound is counted from it.
    let base_fds = arbiter_footprint(arb.pid()).map_or(0, |f| f.1);
    let mut containers = Containers::new(&dir, work.path(), faults);
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
    let mut detach_tries = 0;
    // Spills the arbiter running now has refused.
    let mut refused_now = 0;
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
    let uuid = |gpu: u32| kiwi_sim_core::ident::gpu_uuid_string(&sim.name, gpu);
    // Its work, then at each of its turns the quanta and swaps of the others on its
    // GPU (a grace period and a swap of a few hundred MiB each), and the arbiter's
    // restarts (a reconnection each).
    let bound_ms = |work_ms: u64| {
        let turns = 4 + work_ms / (TQ_S * 1000);
        work_ms + turns * per_gpu * (TQ_S * 1000 + 5_500) + 30_000
    };
    // Client `n` of `pattern` on `gpu`, in container `container` (its number and its
    // processes' socket directory) if any.
    let spawn = |rng: &mut Rng,
                 n: usize,
                 pattern: Pattern,
                 gpu: u32,
                 container: Option<(usize, PathBuf)>|
     -> Result<ClientProc> {
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
            if let Some((_, socket_dir)) = &container {
                // Its container's socket, and an identity of its own making that
                // the arbiter must not believe.
                cmd.env("KIWI_SOCKET_DIR", socket_dir)
                    .env("KIWI_POD_NAME", containers::IMPOSTOR)
                    .env("KIWI_POD_NAMESPACE", containers::IMPOSTOR)
                    .env("KIWI_CONTAINER_ID", containers::IMPOSTOR);
            }
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
            container: container.map(|c| c.0),
            orphaned: None,
            started: now,
            bound: now + Duration::from_millis(bound_ms(work_ms)),
        })
    };
    while Instant::now() < end || !live.is_empty() {
        let now = Instant::now();
        // Keep `clients` alive until the end. A new client goes to the GPU with the
        // fewest processes: clients of a busy GPU last longer, and GPUs picked in
        // turn piled twice their share onto one.
        while now < end && processes(&live) < o.clients {
            let n = spawned;
            spawned += 1;
            let pattern = patterns[n % patterns.len()];
            let gpu = (0..o.gpus)
                .min_by_key(|g| {
                    live.iter()
                        .filter(|c| c.gpu == *g)
                        .map(|c| c.procs.len())
                        .sum::<usize>()
                })
                .unwrap_or(0);
            let container = if pattern == Pattern::Container {
                match containers.for_client(gpu, &uuid(gpu), &live) {
                    Some(c) => Some(c),
                    // Its failure is recorded; the next pattern's turn, at the
                    // next tick.
                    None => break,
                }
            } else {
                None
            };
            let c = spawn(&mut rng, n, pattern, gpu, container)?;
            live.push(c);
        }
        // Reap the ended ones; kill and fail the ones past their bound.
        let mut i = 0;
        while i < live.len() {
            let c = &mut live[i];
            if c.reap()? {
                let c = live.swap_remove(i);
                out.clients_run += c.procs.len();
                let mut ok = true;
                for p in &c.procs {
                    match p.ended {
                        Some(status) if !status.success() => {
                            ok = false;
                            out.failures.push(c.failure(p, &format!("exited {status}")));
                        }
                        _ => {}
                    }
                }
                if ok && c.container.is_some() {
                    out.container_clients_ok += 1;
                    if let Some(t) = c.orphaned {
                        let tally = &mut containers.tally;
                        tally.ran_on += 1;
                        tally.ran_on_longest_s =
                            tally.ran_on_longest_s.max(t.elapsed().as_secs_f64());
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
        // Containers whose clients are done stop, as their jobs' do.
        containers.stop_done(&live);
        if faults && now >= next_fault && now < end {
            next_fault = now + Duration::from_millis(rng.range(1000, 3000));
            let gpu = rng.range(0, o.gpus as u64 - 1) as u32;
            let socket = kiwi_config::client_socket(&dir);
            // Every kind in turn, at random moments and on random victims: a short
            // run still sees each.
            let kind = FAULTS[fault_no % FAULTS.len()];
            fault_no += 1;
            // A disk the soak cannot fill without filling the machine's: gone instead.
            let kind = match kind {
                Fault::DiskFull if !disk.can_fill() => Fault::DiskGone,
                k => k,
            };
            // At most one arbiter restart per 10 s: a client is killed instead.
            let kind = if kind == Fault::Restart && now < last_restart + Duration::from_secs(10) {
                Fault::Kill
            } else {
                kind
            };
            // A container can be detached under its client only while one runs,
            // connected: churn instead, and try again at the next fault's moment
            // (up to 3 times, so a short run sees it).
            let busy = match kind {
                Fault::DetachLive => containers.busy(&live, &registered(&dir)),
                _ => Vec::new(),
            };
            let kind = if kind == Fault::DetachLive && busy.is_empty() {
                let again = patterns.contains(&Pattern::Container) && detach_tries < 3;
                detach_tries = if again { detach_tries + 1 } else { 0 };
                if again {
                    fault_no -= 1;
                }
                Fault::Churn
            } else {
                if kind == Fault::DetachLive {
                    detach_tries = 0;
                }
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
                Fault::Storm | Fault::Deaf => {
                    // Every other one in a container, on its socket and its GPU.
                    let inside = rng.next().is_multiple_of(2);
                    let (socket, gpu) = match inside.then(|| containers.any(&mut rng)) {
                        Some(Some(place)) => place,
                        _ => (socket, gpu),
                    };
                    let in_container = socket != kiwi_config::client_socket(&dir);
                    let uuid = uuid(gpu);
                    let name = match (kind, in_container) {
                        (Fault::Storm, false) => "report storm",
                        (Fault::Storm, true) => "report storm in a container",
                        (_, false) => "client that never reads",
                        (_, true) => "client that never reads in a container",
                    };
                    let memory = o.gpu_memory;
                    tenants.push(std::thread::spawn(move || {
                        if kind == Fault::Storm {
                            tenants::storm(socket, uuid, memory, Duration::from_secs(2))
                        } else {
                            tenants::deaf(socket, uuid, memory, Duration::from_secs(3))
                        }
                    }));
                    *out.faults.entry(name).or_default() += 1;
                }
                Fault::DiskGone | Fault::DiskFull => {
                    // Held open: undone on the disk it was done to, even once its
                    // arbiter is restarted meanwhile.
                    let d = disk.open(arb.pid())?;
                    let name = if kind == Fault::DiskGone {
                        tenants.push(std::thread::spawn(move || d.gone(DISK_GONE)));
                        "spill directory gone"
                    } else {
                        tenants.push(std::thread::spawn(move || {
                            let full = d.fill()?;
                            std::thread::sleep(DISK_GONE);
                            full.empty()
                        }));
                        "spill disk full"
                    };
                    *out.faults.entry(name).or_default() += 1;
                }
                Fault::Churn => {
                    // An idle one stops early (every other time with no poststop
                    // hook: a runtime that crashed), then a new one comes, which
                    // sweeps it.
                    if let Some(no) = rng.pick(&containers.idle(&live)) {
                        containers.stop_idle(no);
                    }
                    if containers.served() < 2 * o.gpus as usize {
                        containers.attach(gpu, &uuid(gpu));
                    }
                    *out.faults.entry("container churn").or_default() += 1;
                }
                Fault::DetachLive => {
                    if let Some(no) = rng.pick(&busy) {
                        containers.detach_live(no);
                        for c in live.iter_mut().filter(|c| c.container == Some(no)) {
                            c.orphaned = Some(now);
                            let t = kiwi_protocol::monotonic_ns();
                            let pids = c.procs.iter().map(|p| (p.child.id(), t));
                            containers.tally.orphans.extend(pids);
                        }
                        *out.faults
                            .entry("container detached under its client")
                            .or_default() += 1;
                    }
                }
                Fault::Restart => {
                    // A client of a detached container has no socket to reconnect
                    // to: it would wait for the arbiter for ever.
                    let mut k = 0;
                    while k < live.len() {
                        if live[k].orphaned.is_some() {
                            live.swap_remove(k).kill();
                            containers.tally.cut_off += 1;
                        } else {
                            k += 1;
                        }
                    }
                    // What this arbiter logged, before its log goes with it.
                    log_so_far.extend(events(&dir).unwrap_or_default());
                    arb.kill();
                    out.spill_refusals.0 += std::mem::take(&mut refused_now);
                    arb.spawn(b, &sim, o.gpus)?;
                    containers.after_restart();
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
                refused_now = spill.failures;
                let full = ["free space", "no room"];
                out.spill_refusals.1 |= spill
                    .last_error
                    .is_some_and(|e| full.iter().any(|f| e.contains(f)));
            }
            containers.look(arb.pid());
        }
        out.failures.append(&mut containers.failures);
        if let Some((rss, fds)) = arbiter_footprint(arb.pid()) {
            out.peak_rss = out.peak_rss.max(rss);
            out.peak_fds = out.peak_fds.max(fds);
            // Each container's socket is a listener of the arbiter's.
            let mut bound = o.clients + tenants.len() + containers.served() + SPARE_FDS;
            if fds > bound + 64 {
                // The swap pool's memfds and spill files are the arbiter's to hold,
                // bounded by the pool and the disk tier.
                bound += pool_fds(&dir);
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
    out.spill_refusals.0 += refused_now;
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
    // Every container stops with its poststop hook; nothing of them may be left.
    containers.finish(arb.pid());
    out.failures.append(&mut containers.failures);
    log_so_far.extend(events(&dir)?);
    tally(&log_so_far, &mut out);
    (out.orphan_swaps, out.orphan_swapped_bytes) =
        containers::swaps_after_detach(&log_so_far, &containers.tally.orphans);
    out.failures.extend(containers::check_labels(
        &log_so_far,
        containers.numbered(),
        out.container_clients_ok,
    ));
    // Nothing left: no client in the arbiter, no simulated device memory in use.
    let leftover = wait_for_nothing_left(&dir, &sim.name, o.gpus);
    if let Err(why) = leftover {
        out.failures.push(why);
    }
    // Its descriptors back to what it held at its first start, beside the pool's.
    if let Some((_, fds)) = arbiter_footprint(arb.pid()) {
        let bound = base_fds + pool_fds(&dir) + END_SPARE_FDS;
        out.end_fds = (fds, base_fds);
        if fds > bound {
            out.failures.push(format!(
                "the arbiter holds {fds} descriptors once nothing is left (it held {base_fds} at its first start; bound {bound} with its pool's)"
            ));
        }
    }
    out.containers = std::mem::take(&mut containers.tally);
    drop(arb);
    let _ = kiwi_sim_core::machine::reset(&sim.name);
    if !out.failures.is_empty() {
        // The clients' and the arbiter's logs, for the failure's story.
        eprintln!(
            "kiwi-bench soak: the run's logs are kept in {}",
            work.keep().display()
        );
    }
    Ok(out)
}

/// The arbiter's clients now: host pid → the container it labelled each with.
fn registered(dir: &Path) -> BTreeMap<u32, Option<String>> {
    status(dir)
        .map(|s| {
            s.gpus
                .into_iter()
                .flat_map(|g| g.clients)
                .map(|c| (c.host_pid, c.container_id))
                .collect()
        })
        .unwrap_or_default()
}

/// The swap pool's memfds and spill files: descriptors the arbiter holds for it.
fn pool_fds(dir: &Path) -> usize {
    status(dir)
        .and_then(|s| s.swap_pool)
        .map_or(0, |p| p.memfds + p.spill.map_or(0, |s| s.files)) as usize
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
    crate::shimbench::status_at(dir)
}

/// The `p`th (0 to 1) of `v`; 0 when empty.
fn percentile(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    crate::report::percentile(&mut v.to_vec(), p * 100.0)
}

/// The soak, then the same clients quiet; fails if anything was lost.
pub fn soak(o: &SoakOptions) -> Result<Vec<Figure>> {
    if o.gpus == 0 || o.clients == 0 || o.seconds == 0 {
        bail!("--gpus, --clients and --seconds must be at least 1");
    }
    let b = Build::find()?;
    let only = if o.patterns.is_empty() {
        String::new()
    } else {
        format!(" --patterns {}", o.patterns.join(","))
    };
    let mib = o.gpu_memory / MIB;
    eprintln!(
        "kiwi-bench soak: {} clients on {} GPUs of {mib} MiB for {} s, seed {} (replay: kiwi-bench soak --gpus {} --clients {} --seconds {} --gpu-mib {mib} --seed {}{only})",
        o.clients, o.gpus, o.seconds, o.seed, o.gpus, o.clients, o.seconds, o.seed
    );
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!(
            "kiwi-bench soak: not root: the spill directory is on the run's own disk, and a full disk is not injected (a missing one is)"
        );
    }
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
        "kiwi-bench soak: seed {}: {} clients run, {injected} faults injected ({faults}), {} failures; {} hand-offs (quiet run: {}), {} grants of room given up with no one asked back ({}); arbiter peak {} MiB, {} descriptors; the disk tier refused {} spills (one for want of room: {})",
        o.seed,
        loaded.clients_run,
        failures.len(),
        loaded.handoffs_ms.len(),
        quiet.handoffs_ms.len(),
        loaded.room_grants,
        quiet.room_grants,
        loaded.peak_rss >> 20,
        loaded.peak_fds,
        loaded.spill_refusals.0,
        if loaded.spill_refusals.1 { "yes" } else { "no" }
    );
    let c = &loaded.containers;
    eprintln!(
        "kiwi-bench soak: containers: {} attached, {} detached by their poststop hook, {} swept after stopping without one; {} detached under a client: {} of their clients ran on (up to {:.1} s, {} swaps of {} MiB after the detach) and verified every byte, {} cut off by an arbiter restart; {} clients in containers verified every byte (quiet run: {}); arbiter descriptors at the end {} (at its first start {})",
        c.attached,
        c.poststop,
        c.swept,
        c.detached_live,
        c.ran_on,
        c.ran_on_longest_s,
        loaded.orphan_swaps,
        loaded.orphan_swapped_bytes / MIB,
        c.cut_off,
        loaded.container_clients_ok,
        quiet.container_clients_ok,
        loaded.end_fds.0,
        loaded.end_fds.1
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
    // A figure of the run with faults against the same clients' quiet run: `of`
    // reads it from either.
    let vs_quiet = |metric: &str, unit: &str, of: fn(&Outcome) -> f64, baseline: &str| {
        Figure::new(s, metric, of(&loaded), unit).against(of(&quiet), baseline)
    };
    const QUIET: &str = "the same clients without faults, same run";
    Ok(vec![
        vs_quiet(
            "handoff_p50",
            "ms",
            |r| percentile(&r.handoffs_ms, 0.5),
            QUIET,
        )
        .goal("bounded: the faults cost the others little"),
        vs_quiet(
            "handoff_p99",
            "ms",
            |r| percentile(&r.handoffs_ms, 0.99),
            QUIET,
        )
        .goal("bounded"),
        vs_quiet(
            "grants_per_second",
            "/s",
            |r| r.grants as f64 / r.seconds,
            QUIET,
        ),
        vs_quiet(
            "swapped",
            "MiB",
            |r| r.swapped_bytes as f64 / MIB as f64,
            "the same clients without faults (half as long), same run",
        ),
        vs_quiet(
            "spilled_peak",
            "MiB",
            |r| r.peak_spilled as f64 / MIB as f64,
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

#[cfg(test)]
mod tests {
    use super::*;
    use kiwi_protocol::DropReason;

    fn at(t_ms: u64, gpu: &str, client: u64, kind: EventKind) -> Event {
        Event {
            seq: t_ms,
            t_ns: t_ms * 1_000_000,
            gpu: gpu.into(),
            client: Some(client),
            kind,
        }
    }

    fn grant(waited_ms: u64) -> EventKind {
        EventKind::Grant {
            exclusive: true,
            waited_ns: waited_ms * 1_000_000,
        }
    }

    fn release() -> EventKind {
        EventKind::Release {
            early: false,
            resident_bytes: 0,
        }
    }

    fn drop_() -> EventKind {
        EventKind::Drop {
            need_bytes: 0,
            reason: DropReason::TqExpired,
        }
    }

    #[test]
    fn a_hand_off_runs_from_the_ask_or_the_request_and_room_given_up_is_no_hand_off() {
        let events = [
            // GPU a: 1 holds; 2 asks at 100; 1 is asked back at 150, released at 400;
            // 2 is granted at 420: 270 ms.
            at(10, "a", 1, grant(0)),
            at(150, "a", 1, drop_()),
            at(400, "a", 1, release()),
            at(420, "a", 2, grant(320)),
            // A newcomer asks after the drop it caused: from its request (430).
            at(425, "a", 2, drop_()),
            at(900, "a", 2, release()),
            at(900, "a", 3, grant(470)),
            // Two waiters granted in the one step that answers the same ask.
            at(950, "a", 3, drop_()),
            at(1200, "a", 3, release()),
            at(1210, "a", 4, grant(500)),
            at(1210, "a", 5, grant(400)),
            // GPU b: its holder exits (killed); the waiter gets the room at once,
            // with no one asked back: no hand-off of 0 ms.
            at(20, "b", 7, grant(0)),
            at(600, "b", 7, EventKind::Exit),
            at(600, "b", 8, grant(300)),
            // The old ask on a was answered: a later grant of room is not measured from it.
            at(1500, "a", 4, release()),
            at(1500, "a", 6, grant(100)),
        ];
        let mut out = Outcome::default();
        tally(&events, &mut out);
        assert_eq!(out.handoffs_ms, vec![270.0, 470.0, 260.0, 260.0]);
        assert_eq!(out.room_grants, 2);
        assert_eq!(out.grants, 8);
    }
}
