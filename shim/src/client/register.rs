//! Registering a turn with the arbiter: the fallback chain through older arbiters,
//! and what the arbiter said first.

use super::*;

/// Why a turn could not be registered.
#[derive(Debug)]
pub enum StartError {
    Protocol(ProtocolError),
    Refused(String),
    /// The arbiter refused `wait_info` as malformed: it predates it.
    Predates(String),
}

impl std::fmt::Display for StartError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StartError::Protocol(e) => write!(f, "{e}"),
            StartError::Refused(m) => write!(f, "refused: {m}"),
            StartError::Predates(m) => write!(f, "refused as malformed: {m}"),
        }
    }
}

impl From<ProtocolError> for StartError {
    fn from(e: ProtocolError) -> Self {
        StartError::Protocol(e)
    }
}

impl From<std::io::Error> for StartError {
    fn from(e: std::io::Error) -> Self {
        StartError::Protocol(ProtocolError::Io(e))
    }
}

/// A registered connection for one GPU.
pub(super) struct Registration {
    pub(super) reader: Conn,
    pub(super) writer: Conn,
    pub(super) capacity: u64,
    pub(super) swap_budget: Option<u64>,
    /// The arbiter took `unswappable_bytes`: it counts them and takes `unswappable`.
    pub(super) reports_unswappable: bool,
    /// The arbiter's first [`ArbiterMsg::Room`]: the others' memory no swap frees
    /// and the working set it must leave room for.
    pub(super) others_fixed: Option<(u64, Option<Keep>)>,
    /// A message that came where `room` was expected: the turn's thread's first.
    pub(super) first: Option<ArbiterMsg>,
    /// The arbiter took `pipelined`: it takes `drained` and may send `pressure` and
    /// `grant {pipelined}`.
    pub(super) pipelined: bool,
}

/// Connects and registers one GPU, taking the operator's bounds on its own settings
/// (`bounds`), asking to be told the others' memory (`room_info`) and why it waits
/// (`wait_info`), reporting its memory no swap frees (`unswappable_bytes`) and taking
/// part in pipelined hand-offs (`pipelined`). An arbiter that predates a field
/// refuses it as malformed: the shim then registers again without the newest field
/// first: without `bounds` (an arbiter that has none to say: its own settings
/// stand), without `room_info`, without `pipelined` (hand-offs wait for its whole
/// swap-out, buffers are pinned ahead only once others wait), then without
/// `unswappable_bytes` (its working set then counts the application's own VMM
/// memory, as before), then without `wait_info` too (and explains its waits with
/// less).
pub(super) fn register(
    env: &ShimEnv,
    info: &DeviceInfo,
    slot: usize,
    figures: Figures,
    unswappable: u64,
    resume: Option<Resume>,
) -> Result<Registration, StartError> {
    let u = Some(unswappable);
    let mut r = register_once(env, info, slot, figures, resume, true, u, true, true, true);
    if let Err(StartError::Predates(m)) = &r {
        crate::kdebug!(
            "the arbiter does not know `bounds` or `group` ({m}); registering without them"
        );
        r = register_once(env, info, slot, figures, resume, true, u, true, true, false);
    }
    if let Err(StartError::Predates(m)) = &r {
        crate::kdebug!("the arbiter does not know `room_info` ({m}); registering without it");
        r = register_once(
            env, info, slot, figures, resume, true, u, true, false, false,
        );
    }
    if let Err(StartError::Predates(m)) = &r {
        crate::kdebug!("the arbiter does not know `pipelined` ({m}); registering without it");
        r = register_once(
            env, info, slot, figures, resume, true, u, false, false, false,
        );
    }
    if let Err(StartError::Predates(m)) = &r {
        crate::kdebug!(
            "the arbiter does not know `unswappable_bytes` ({m}); registering without it"
        );
        r = register_once(
            env, info, slot, figures, resume, true, None, false, false, false,
        );
    }
    if let Err(StartError::Predates(m)) = &r {
        crate::kdebug!("the arbiter does not know `wait_info` ({m}); registering without it");
        r = register_once(
            env, info, slot, figures, resume, false, None, false, false, false,
        );
    }
    r
}

#[allow(clippy::too_many_arguments)]
pub(super) fn register_once(
    env: &ShimEnv,
    info: &DeviceInfo,
    slot: usize,
    figures: Figures,
    resume: Option<Resume>,
    wait_info: bool,
    unswappable: Option<u64>,
    pipelined: bool,
    room_info: bool,
    bounds: bool,
) -> Result<Registration, StartError> {
    let stream = UnixStream::connect(env.client_socket())?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    let writer_stream = stream.try_clone()?;
    let mut conn = Conn::new(stream);
    let name = std::env::args()
        .next()
        .map(|a| a.rsplit('/').next().unwrap_or(&a).to_string());
    let pod_name = std::env::var("KIWI_POD_NAME")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok());
    // Reporting it apart, the application's own VMM memory leaves the working set.
    let own = if unswappable.is_some() {
        figures.external
    } else {
        0
    };
    conn.send(&ClientMsg::Register(Register {
        version: PROTOCOL_VERSION,
        pid: std::process::id(),
        gpu_uuid: info.uuid.clone(),
        gpu_total_memory: info.total_memory,
        working_set_bytes: figures.working_set - own,
        resident_bytes: figures.resident - own,
        container_id: std::env::var("KIWI_CONTAINER_ID").ok(),
        pod_name,
        pod_namespace: std::env::var("KIWI_POD_NAMESPACE").ok(),
        name,
        resume,
        wait_info,
        unswappable_bytes: unswappable,
        pipelined,
        room_info,
        bounds,
        // The newest field goes with the next newest: an arbiter that refuses it is
        // asked again without both.
        group: job_group(|k| std::env::var(k).ok()).filter(|_| bounds),
    }))?;
    let (capacity, swap_budget) = match conn.recv()? {
        ArbiterMsg::Registered {
            client_id,
            settings,
            capacity_bytes,
            swap_budget_bytes,
        } => {
            crate::kinfo!(
                "GPU {} ({}): registered with the arbiter as client {client_id} (scheduler {}, TQ {} ms, capacity {capacity_bytes} bytes)",
                info.ordinal,
                info.uuid,
                if settings.scheduler_on { "on" } else { "off" },
                settings.tq_ms
            );
            (capacity_bytes, swap_budget_bytes)
        }
        ArbiterMsg::Error {
            code: ErrorCode::Malformed,
            message,
        } if wait_info || unswappable.is_some() || pipelined || room_info || bounds => {
            return Err(StartError::Predates(message))
        }
        ArbiterMsg::Error { code, message } => {
            return Err(StartError::Refused(format!("{code:?}: {message}")))
        }
        other => return Err(StartError::Refused(format!("unexpected reply {other:?}"))),
    };
    // An arbiter that took `bounds` says them right after: applied before any swap-out
    // of this turn (its thread handles a later `bounds` too). Anything else first (a
    // peer that does not keep to that) is handled by the turn's thread.
    let mut first = None;
    if bounds {
        match next_message(&mut conn, ROOM_WAIT)? {
            Some(ArbiterMsg::Bounds { hint_wait_ms }) => apply_bounds(hint_wait_ms),
            other => {
                crate::kdebug!("no `bounds` right after `registered` (got {other:?})");
                first = other;
            }
        }
    }
    // An arbiter that took `room_info` says the others' memory right after, before
    // the application can ask what is free. Anything else first (a peer that does
    // not keep to that) is handled by the turn's thread like any message.
    let (others_fixed, first) = if first.is_some() {
        (None, first)
    } else if room_info {
        match next_message(&mut conn, ROOM_WAIT)? {
            Some(ArbiterMsg::Room {
                others_unswappable_bytes,
                keep,
            }) => (Some((others_unswappable_bytes, keep)), None),
            other => {
                crate::kdebug!("no `room` right after `registered` (got {other:?})");
                (None, other)
            }
        }
    } else {
        (None, None)
    };
    conn.stream().set_read_timeout(None)?;
    CONN_FDS[2 * slot].store(conn.stream().as_raw_fd(), Ordering::Relaxed);
    CONN_FDS[2 * slot + 1].store(writer_stream.as_raw_fd(), Ordering::Relaxed);
    Ok(Registration {
        reader: conn,
        writer: Conn::new(writer_stream),
        capacity,
        swap_budget,
        reports_unswappable: unswappable.is_some(),
        pipelined,
        others_fixed,
        first,
    })
}

/// The arbiter's bounds on this process's own settings (`bounds`): its hint wait
/// (`KIWI_HINT_WAIT_MS`) is clamped to `hint_wait_ms`.
pub(super) fn apply_bounds(hint_wait_ms: u64) {
    crate::hint::set_bound(Duration::from_millis(hint_wait_ms));
}

/// Waits up to `timeout` for the arbiter's next message on `conn`. The wait is a
/// `ppoll` (timer precision): a socket's receive timeout counts in scheduler ticks
/// (4 to 10 ms), which made the idle detector's 1 ms looks and its deadlines late.
pub(super) fn next_message(
    conn: &mut Conn,
    timeout: Duration,
) -> Result<Option<ArbiterMsg>, ProtocolError> {
    if let Some(m) = conn.try_decode()? {
        return Ok(Some(m));
    }
    let mut pfd = libc::pollfd {
        fd: conn.stream().as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: one valid pollfd and a valid timespec for the call's duration; no
    // signal mask is changed (null).
    let ready = unsafe { libc::ppoll(&mut pfd, 1, &ts, std::ptr::null()) };
    if ready <= 0 {
        // Timed out, or interrupted by a signal: the caller ticks and waits again.
        return Ok(None);
    }
    // Readable (or closed): reads what is there without waiting more than a moment.
    conn.recv_timeout(Duration::from_millis(1))
}

/// The job this process belongs to, as it registers (`group`): `KIWI_GROUP` when set
/// (set and empty: none); else what the launcher of a multi-process job gives every
/// rank of one job and no other job at the same time ([`LAUNCHERS`]: the
/// `torch.distributed` rendezvous of `torchrun`, DeepSpeed and Ray Train; the PMIx
/// namespace of Open MPI 5, PRRTE and Slurm's PMIx; Open MPI 4's daemon URI; a Slurm
/// job step; JAX's coordinator; Horovod's Gloo rendezvous): ranks started on the
/// host without `kiwictl run` or `KIWI_GROUP` are then still granted their GPUs
/// together (a rank that held its GPU while its peer waited for another would spin in
/// its collectives). The arbiter scopes the key to the process's tenant. `None` for a
/// key the protocol would refuse (too long, control characters): the process is then
/// its own job.
fn job_group(env: impl Fn(&str) -> Option<String>) -> Option<String> {
    let key = match env("KIWI_GROUP") {
        Some(g) => g,
        None => LAUNCHERS.iter().find_map(|(name, vars)| {
            let values: Option<Vec<String>> = vars
                .iter()
                .map(|v| env(v).filter(|x| !x.is_empty()))
                .collect();
            values.map(|v| format!("{name} {}", v.join(":")))
        })?,
    };
    (!key.is_empty() && kiwi_protocol::check_text("group", &key).is_ok()).then_some(key)
}

/// Launchers of multi-process jobs, first match wins: the name the key starts with
/// and the variables (all set and non-empty) whose values name one job.
const LAUNCHERS: &[(&str, &[&str])] = &[
    // torchrun, torch.distributed.launch, DeepSpeed, Ray Train, Lightning: `env://`.
    ("torch.distributed", &["MASTER_ADDR", "MASTER_PORT"]),
    // Open MPI 5 (PRRTE), Slurm's srun --mpi=pmix, any PMIx launcher.
    ("pmix", &["PMIX_NAMESPACE"]),
    // Open MPI 4's mpirun: the URI of the job's daemon.
    ("openmpi", &["OMPI_MCA_orte_hnp_uri"]),
    // A Slurm job step (srun; sbatch's batch step is step `batch`).
    ("slurm", &["SLURM_JOB_ID", "SLURM_STEP_ID"]),
    // jax.distributed.initialize() from the environment.
    ("jax", &["JAX_COORDINATOR_ADDRESS"]),
    // horovodrun with Gloo.
    (
        "horovod",
        &[
            "HOROVOD_GLOO_RENDEZVOUS_ADDR",
            "HOROVOD_GLOO_RENDEZVOUS_PORT",
        ],
    ),
];

#[cfg(test)]
mod tests {
    use super::job_group;

    fn env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| {
            vars.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn the_job_is_named_by_kiwi_group_else_by_the_torch_rendezvous() {
        assert_eq!(
            job_group(env(&[("KIWI_GROUP", "train")])),
            Some("train".into())
        );
        let torch = [("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")];
        assert_eq!(
            job_group(env(&torch)),
            Some("torch.distributed 127.0.0.1:29500".into())
        );
        // KIWI_GROUP wins, and set empty names no group at all.
        let both = [("KIWI_GROUP", "mine"), torch[0], torch[1]];
        assert_eq!(job_group(env(&both)), Some("mine".into()));
        let off = [("KIWI_GROUP", ""), torch[0], torch[1]];
        assert_eq!(job_group(env(&off)), None);
        // Half a rendezvous, none, or one the protocol would refuse: no group.
        assert_eq!(job_group(env(&[torch[0]])), None);
        assert_eq!(job_group(env(&[])), None);
        let long = "x".repeat(10_000);
        assert_eq!(job_group(env(&[("MASTER_ADDR", &long), torch[1]])), None);
        assert_eq!(job_group(env(&[("KIWI_GROUP", "a\nb")])), None);
    }

    #[test]
    fn other_launchers_name_their_jobs_and_the_first_found_wins() {
        for (vars, want) in [
            (
                &[("PMIX_NAMESPACE", "prterun-node1-4242@1")][..],
                "pmix prterun-node1-4242@1",
            ),
            (
                &[("OMPI_MCA_orte_hnp_uri", "123.0;tcp://10.0.0.1:4000")][..],
                "openmpi 123.0;tcp://10.0.0.1:4000",
            ),
            (
                &[("SLURM_JOB_ID", "77"), ("SLURM_STEP_ID", "0")][..],
                "slurm 77:0",
            ),
            (
                &[("JAX_COORDINATOR_ADDRESS", "10.0.0.1:1234")][..],
                "jax 10.0.0.1:1234",
            ),
            (
                &[
                    ("HOROVOD_GLOO_RENDEZVOUS_ADDR", "h"),
                    ("HOROVOD_GLOO_RENDEZVOUS_PORT", "9"),
                ][..],
                "horovod h:9",
            ),
            (
                &[
                    ("SLURM_JOB_ID", "77"),
                    ("SLURM_STEP_ID", "0"),
                    ("MASTER_ADDR", "a"),
                    ("MASTER_PORT", "1"),
                ][..],
                "torch.distributed a:1",
            ),
        ] {
            assert_eq!(job_group(env(vars)), Some(want.to_string()), "{vars:?}");
        }
        // A Slurm job without a step, or an empty namespace: no group.
        assert_eq!(job_group(env(&[("SLURM_JOB_ID", "77")])), None);
        assert_eq!(job_group(env(&[("PMIX_NAMESPACE", "")])), None);
    }
}
