//! Message types. Every message is a JSON object with a `"type"` tag.
//!
//! - [`ClientMsg`]: shim → arbiter, on the client socket.
//! - [`ArbiterMsg`]: arbiter → shim.
//! - [`ControlRequest`] / [`ControlReply`]: kiwictl ↔ arbiter, on the control socket only.
//!
//! Identity is the connection: the arbiter takes a client's host pid and uid from the
//! socket (SO_PEERCRED), never from a message, so no client can act for another.

use serde::{Deserialize, Serialize};

/// Longest client-supplied string the arbiter accepts, in bytes (a DNS name's limit,
/// which bounds Kubernetes names too). Checked by [`ClientMsg::validate`].
pub const MAX_TEXT_BYTES: usize = 253;

/// A client-supplied field that breaks a limit: the error reply names the field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("field `{field}` {problem}")]
pub struct FieldError {
    pub field: &'static str,
    pub problem: String,
}

/// Characters refused in client text: every control character (a newline would forge
/// a log line, an escape sequence would drive an operator's terminal), the Unicode
/// line and paragraph separators, and the bidirectional overrides that reorder text.
pub fn is_forbidden_char(c: char) -> bool {
    c.is_control()
        || matches!(c, '\u{2028}' | '\u{2029}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

/// Checks one client-supplied string: at most [`MAX_TEXT_BYTES`], no forbidden
/// characters.
pub fn check_text(field: &'static str, s: &str) -> Result<(), FieldError> {
    if s.len() > MAX_TEXT_BYTES {
        return Err(FieldError {
            field,
            problem: format!("is {} bytes long; the limit is {MAX_TEXT_BYTES}", s.len()),
        });
    }
    if let Some(c) = s.chars().find(|&c| is_forbidden_char(c)) {
        return Err(FieldError {
            field,
            problem: format!("contains the control character U+{:04X}", c as u32),
        });
    }
    Ok(())
}

fn check_opt(field: &'static str, s: &Option<String>) -> Result<(), FieldError> {
    s.as_deref().map_or(Ok(()), |s| check_text(field, s))
}

/// Registration: the first message on a client connection. One connection per
/// (process, GPU): a process using two GPUs opens two connections.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Register {
    /// Must equal [`crate::PROTOCOL_VERSION`].
    pub version: u16,
    /// The pid as the client sees it (its own PID namespace). Informational: the
    /// arbiter records the host pid from SO_PEERCRED beside it.
    pub pid: u32,
    /// GPU UUID as the driver reports it, e.g. `GPU-8a3c…`.
    pub gpu_uuid: String,
    /// The GPU's total memory in bytes (`cuDeviceTotalMem`).
    pub gpu_total_memory: u64,
    /// Bytes this client has allocated (its working set) at registration.
    #[serde(default)]
    pub working_set_bytes: u64,
    /// Of those, bytes resident in GPU memory now.
    #[serde(default)]
    pub resident_bytes: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_namespace: Option<String>,
    /// A short name for people: the program name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Set when re-registering after the arbiter restarted: what this client held.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resume: Option<Resume>,
    /// The client wants [`ArbiterMsg::Waiting`] (who holds the GPU, its place in the
    /// queue) while it waits. Opt-in, so that arbiters never send it to shims that
    /// predate it (they refuse unknown message types). Left out when false, so a
    /// registration without it is byte for byte what older shims send.
    #[serde(default, skip_serializing_if = "is_false")]
    pub wait_info: bool,
    /// GPU memory of this client that no swap frees (its contexts, the modules it
    /// loaded, the application's own VMM memory), as it measured it. Present (even
    /// `0`) when the client will report changes with [`ClientMsg::Unswappable`]: an
    /// arbiter that accepts a registration carrying it counts it and takes those
    /// reports. Left out by clients that predate it, so their registrations are
    /// unchanged; an arbiter that predates it refuses the field as malformed and the
    /// client registers again without it (and never reports).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unswappable_bytes: Option<u64>,
    /// The client takes part in pipelined hand-offs (issue #15): after a
    /// [`ArbiterMsg::Drop`] it sends [`ClientMsg::Drained`] as soon as its queued work
    /// is done, it understands `Grant { pipelined: true }` and [`ArbiterMsg::Pressure`].
    /// Opt-in and left out when false, like `wait_info`: an arbiter that predates it
    /// refuses the field and the client registers again without it.
    #[serde(default, skip_serializing_if = "is_false")]
    pub pipelined: bool,
    /// The client wants [`ArbiterMsg::Room`] (issue #24): the others' memory no swap
    /// frees, so it can tell the application the truth about free memory and let it
    /// allocate what it could beside them. Opt-in and left out when false, like
    /// `wait_info`.
    #[serde(default, skip_serializing_if = "is_false")]
    pub room_info: bool,
    /// The client keeps to the operator's bounds on its own settings that make other
    /// tenants wait, and wants them ([`ArbiterMsg::Bounds`], right after
    /// `registered`). Opt-in and left out when false, like `wait_info`: an arbiter
    /// that predates it refuses the field and the client registers again without it.
    #[serde(default, skip_serializing_if = "is_false")]
    pub bounds: bool,
    /// The job it belongs to (`KIWI_GROUP`): clients of one group on several GPUs
    /// are granted those GPUs together (issue #41). Scoped by the arbiter to the
    /// client's tenant (its container, or its uid on the node's socket), so no
    /// tenant joins another's group. Left out: its pod or container, else its
    /// process.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
}

fn is_zero_u64(n: &u64) -> bool {
    *n == 0
}

fn is_false(b: &bool) -> bool {
    !*b
}

impl Register {
    /// Checks every string the client chose (see [`check_text`]).
    pub fn validate(&self) -> Result<(), FieldError> {
        if self.gpu_uuid.is_empty() {
            return Err(FieldError {
                field: "gpu_uuid",
                problem: "is empty".into(),
            });
        }
        check_text("gpu_uuid", &self.gpu_uuid)?;
        check_opt("container_id", &self.container_id)?;
        check_opt("pod_name", &self.pod_name)?;
        check_opt("pod_namespace", &self.pod_namespace)?;
        check_opt("name", &self.name)?;
        check_opt("group", &self.group)
    }
}

/// A re-registering client's state, so a new arbiter can rebuild its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Resume {
    /// The client held the GPU (exclusively or shared) when the old arbiter went away.
    pub holding: bool,
    /// It was waiting for the GPU.
    pub waiting: bool,
}

/// Memory figures a client reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Usage {
    /// All bytes the application has allocated (resident + swapped out).
    pub working_set_bytes: u64,
    /// Bytes currently in GPU memory.
    pub resident_bytes: u64,
}

/// Direction of a swap.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SwapDirection {
    Out,
    In,
}

/// Shim → arbiter.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum ClientMsg {
    Register(Register),
    /// The client wants the GPU. Answered by [`ArbiterMsg::Grant`], at once or later.
    Request,
    /// The client gives the GPU back: after a [`ArbiterMsg::Drop`], or early because it
    /// went idle. Carries its memory after any swap-out.
    Release(Usage),
    /// The working set or residency changed (allocation, free, swap).
    Usage(Usage),
    /// A swap finished; recorded in the event log.
    Swapped {
        direction: SwapDirection,
        bytes: u64,
        duration_ns: u64,
    },
    /// Answer to [`ArbiterMsg::Reclaim`]: memory after evicting.
    Reclaimed(Usage),
    /// Liveness / latency probe; answered by [`ArbiterMsg::Pong`].
    Ping {
        token: u64,
    },
    /// Swap admission: "my working set is about to grow to `working_set_bytes`" (the
    /// allocations the shim's allocator is about to make). Sent only when
    /// [`ArbiterMsg::Registered`] carried a `swap_budget_bytes`, before the allocation,
    /// and answered, in order on this connection, by [`ArbiterMsg::Admitted`].
    Admit {
        working_set_bytes: u64,
    },
    /// This client's GPU memory that no swap frees changed (a context, a module
    /// load, the application's own `cuMemCreate`): `bytes` is the new total. Sent
    /// only after a registration that carried `unswappable_bytes` was accepted.
    Unswappable {
        bytes: u64,
    },
    /// After a [`ArbiterMsg::Drop`], before its [`ClientMsg::Release`]: the holder's
    /// queued work is done and it submits nothing more; its swap-out starts now. The
    /// arbiter may grant the next client at once (`Grant { pipelined: true }`): its
    /// swap-in then runs while this swap-out frees memory, on the other PCIe
    /// direction. Sent only by clients that registered with `pipelined`.
    Drained,
    /// The holder's swap-in (or an allocation it must back) found no room on the GPU:
    /// `missing_bytes` of its working set are still not resident, though the arbiter
    /// counted on room for it. Memory the arbiter cannot see takes the rest (a
    /// process outside Kiwi, a context measured short): the arbiter counts it from
    /// then on, and reclaims up to `missing_bytes` (never more than the client's last
    /// `usage` says is not resident), beyond what is already on its way out, from
    /// clients that do not hold the GPU.
    /// Sent when the shortage starts and again, at most every 250 ms, while it lasts;
    /// ignored from a client that does not hold the GPU, or was dropped. Sent
    /// only by clients that registered with `pipelined`.
    NoRoom {
        missing_bytes: u64,
    },
    /// The first message of a **pool connection** (instead of [`ClientMsg::Register`]):
    /// this connection borrows host memory from the node's swap pool for the swap-outs
    /// of the same process's registered clients. Answered by
    /// [`ArbiterMsg::PoolOpened`], or an error from an arbiter without a pool. A pool
    /// connection carries only `pool_take` and `pool_give` after it.
    PoolOpen,
    /// Lend me at least `bytes` (rounded up to the pool's 2 MiB unit) of populated
    /// host memory: answered, in order, by [`ArbiterMsg::PoolLent`] (its descriptors
    /// attached) or [`ArbiterMsg::PoolRefused`]. `ahead`: for buffers prepared before
    /// any swap-out needs them (refused first when the pool runs low). At most
    /// [`MAX_POOL_TAKE_BYTES`] per request; what one process holds is bounded by the
    /// working sets it registered.
    PoolTake {
        bytes: u64,
        #[serde(default, skip_serializing_if = "is_false")]
        ahead: bool,
    },
    /// These slices come back (the client unmapped them): the arbiter scrubs them
    /// and never lends them again. Ids this connection was not lent are ignored.
    PoolGive {
        ids: Vec<u64>,
    },
    /// On a pool connection: this process still maps `bytes` of slices that an
    /// earlier arbiter (before a restart) lent it. The arbiter counts them against
    /// the pool (within what the process may hold) until the next `pool_kept` or the
    /// connection's end. Sent after `pool_opened` and whenever the figure changes.
    PoolKept {
        bytes: u64,
    },
    /// On a pool connection: move the contents of these slices (lent to this
    /// connection, unregistered from the driver and no longer touched by the client)
    /// to the pool's disk tier. Answered by [`ArbiterMsg::PoolSpilled`] (every slice
    /// moved: each is taken back and scrubbed, as by `pool_give`) or
    /// [`ArbiterMsg::PoolRefused`] (none moved; the slices stay lent, untouched). At
    /// most [`MAX_POOL_SPILL_IDS`] ids.
    PoolSpill {
        ids: Vec<u64>,
    },
    /// What this client's tenant may see of GPU `gpu_uuid` (issue #39: NVML inside a
    /// process under Kiwi answers for that process's view). Answered by
    /// [`ArbiterMsg::View`]. Allowed on any client connection, registered or not;
    /// on one that has not registered it lifts the registration deadline (the shim
    /// keeps one such connection for its NVML answers) and the connection may carry
    /// only `view` and `ping` after it.
    View {
        gpu_uuid: String,
    },
}

/// Most processes one [`ArbiterMsg::View`] lists.
pub const MAX_VIEW_PROCESSES: usize = 256;

/// Most bytes one [`ClientMsg::PoolTake`] asks for.
pub const MAX_POOL_TAKE_BYTES: u64 = 4 << 30;
/// Most ids one [`ClientMsg::PoolGive`] returns.
pub const MAX_POOL_GIVE_IDS: usize = 256;
/// Most ids one [`ClientMsg::PoolSpill`] moves (the slices of one take).
pub const MAX_POOL_SPILL_IDS: usize = 64;

impl ClientMsg {
    /// Checks the limits serde cannot express (string lengths and characters). The
    /// arbiter calls it on every decoded message before acting on it.
    pub fn validate(&self) -> Result<(), FieldError> {
        match self {
            ClientMsg::Register(r) => r.validate(),
            ClientMsg::PoolTake { bytes, .. } if *bytes == 0 || *bytes > MAX_POOL_TAKE_BYTES => {
                Err(FieldError {
                    field: "bytes",
                    problem: format!("must be 1 to {MAX_POOL_TAKE_BYTES}"),
                })
            }
            ClientMsg::PoolGive { ids } if ids.len() > MAX_POOL_GIVE_IDS => Err(FieldError {
                field: "ids",
                problem: format!(
                    "has {} entries; the limit is {MAX_POOL_GIVE_IDS}",
                    ids.len()
                ),
            }),
            ClientMsg::View { gpu_uuid } if gpu_uuid.is_empty() || gpu_uuid.len() > 128 => {
                Err(FieldError {
                    field: "gpu_uuid",
                    problem: "must be 1 to 128 bytes".into(),
                })
            }
            ClientMsg::View { gpu_uuid } => check_text("gpu_uuid", gpu_uuid),
            ClientMsg::PoolSpill { ids } if ids.is_empty() || ids.len() > MAX_POOL_SPILL_IDS => {
                Err(FieldError {
                    field: "ids",
                    problem: format!(
                        "has {} entries; it must have 1 to {MAX_POOL_SPILL_IDS}",
                        ids.len()
                    ),
                })
            }
            _ => Ok(()),
        }
    }
}

/// One process of a tenant's view of a GPU ([`ArbiterMsg::View`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ViewProcess {
    /// Its pid as it sees itself (its registration's): the caller's tenant shares
    /// its PID namespace.
    pub pid: u32,
    /// What Kiwi counts for it on the GPU: its working set (resident and swapped)
    /// and its memory no swap frees (contexts, modules).
    pub used_bytes: u64,
}

/// One slice of the node's swap pool lent to a client ([`ArbiterMsg::PoolLent`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolSlice {
    /// What the client names it by when it gives it back.
    pub id: u64,
    /// Its length: the client maps all of it.
    pub bytes: u64,
}

/// Why the arbiter asks a holder to give the GPU back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DropReason {
    /// The holder used its time quantum and someone is waiting.
    TqExpired,
    /// Working sets stopped fitting (or the scheduler was turned on) while several
    /// clients ran side by side: all but one must yield.
    NoLongerFits,
}

/// Another client's working set that memory no swap frees must leave room for
/// ([`ArbiterMsg::Room`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Keep {
    pub bytes: u64,
    /// How the client is shown: its pod's name, else its program's.
    pub name: String,
}

/// Arbiter → shim.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum ArbiterMsg {
    /// Answer to [`ClientMsg::Register`].
    Registered {
        client_id: u64,
        settings: Settings,
        /// GPU memory the arbiter schedules against (total − context reserve).
        capacity_bytes: u64,
        /// The node's host-RAM swap budget, over every client of every GPU. Present
        /// only when the operator set one (`kiwi-arbiter --swap-budget`): the client
        /// must then send [`ClientMsg::Admit`] before growing its working set.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        swap_budget_bytes: Option<u64>,
    },
    /// To a client that registered with `bounds`, right after [`ArbiterMsg::Registered`]
    /// (before anything else): the operator's bounds (`kiwi-arbiter
    /// --max-hint-wait-ms`) on the client's own settings that make other tenants
    /// wait. `hint_wait_ms`: the longest one of its swap-outs waits for the
    /// application's answer to which of its memory is dead (`KIWI_HINT_WAIT_MS` is
    /// clamped to it). Sent by the daemon, not a GPU's scheduler: the bounds are the
    /// node's. Only to clients that asked: older shims refuse unknown message types.
    Bounds {
        hint_wait_ms: u64,
    },
    /// To a client that registered with `bounds` (this version's shims): the driver
    /// checkpointed its process to make room for others (`restored: false`): its
    /// CUDA calls wait inside the driver until it is restored, at its next turn or as
    /// soon as the GPU has room for it; then `restored: true`. The shim says so when
    /// the checkpoint lasts past a second.
    Checkpointed {
        restored: bool,
    },
    /// The GPU is this client's. `exclusive: false` means every working set fits (or
    /// the scheduler is off): run alongside the others, no swapping needed.
    /// `waiting`: clients queued behind this one at the time of the grant.
    Grant {
        exclusive: bool,
        tq_ms: u64,
        waiting: u32,
        /// The previous holder is still swapping out (it sent [`ClientMsg::Drained`]):
        /// the memory this client's swap-in needs is being freed. Its swap-in waits for
        /// that memory (never failing the application's call) and runs alongside the
        /// previous holder's swap-out. Only ever true for clients that registered with
        /// `pipelined`; left out when false.
        #[serde(default, skip_serializing_if = "is_false")]
        pipelined: bool,
        /// The client's group spans GPUs and this is its group's turn (issue #41):
        /// its queued work may wait for a peer's on another GPU, so at a drop it
        /// drains within a bound and never holds the GPU waiting for a peer that the
        /// drop stopped too. Left out when false.
        #[serde(default, skip_serializing_if = "is_false")]
        group: bool,
    },
    /// Sent to the holder(s) when the queue goes from empty to non-empty
    /// (`waiting > 0`) or back to empty (`waiting == 0`). A holder that goes idle
    /// while others wait releases early, evicting `need_bytes` first so the next
    /// holder fits.
    Contended {
        waiting: u32,
        need_bytes: u64,
    },
    /// Give the GPU back: stop submitting, drain, evict at least `need_bytes`
    /// (least recently used first), then send [`ClientMsg::Release`].
    Drop {
        need_bytes: u64,
        reason: DropReason,
    },
    /// A client not holding the GPU is asked to evict `need_bytes` so the next holder
    /// fits, or (idle eviction, `arbiter.idle_evict_seconds`) because it has been idle
    /// on an oversubscribed GPU: then `need_bytes` is all it has resident, and it
    /// swaps out in the background; answer [`ClientMsg::Reclaimed`].
    Reclaim {
        need_bytes: u64,
    },
    /// The GPU was taken away: the client ignored a drop past the grace period. It
    /// must not submit work until granted again.
    Revoked {
        reason: String,
    },
    /// To every client of the GPU that registered with `pipelined`, when the GPU's
    /// working sets (with the memory no swap frees) start (`oversubscribed: true`) or
    /// stop exceeding its capacity, and once at registration when they already do. An
    /// oversubscribed GPU swaps: each client may prepare its swap-out in the background
    /// (page-lock its host buffers) so no swap pays for that while someone waits.
    Pressure {
        oversubscribed: bool,
        /// `arbiter.idle_evict_seconds` in ms (0: off). A client holding the GPU alone
        /// on an oversubscribed GPU, idle this long, gives it back and swaps out
        /// everything on its own (the arbiter cannot tell a busy holder from an idle
        /// one: a holder's work sends it nothing), so the next notebook that asks
        /// pays only its own swap-in.
        #[serde(default, skip_serializing_if = "is_zero_u64")]
        idle_evict_ms: u64,
        /// Another client is registered on this GPU: whoever holds it may be asked
        /// for it at any moment, so each client prepares the buffers of its
        /// swap-out as its working set grows, within the node's swap budget, before
        /// anyone asks (issue #28). Told as it changes, like `oversubscribed`.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        shared: bool,
    },
    /// To a client that registered with `room_info`: the GPU memory no swap frees
    /// that the other clients report (their contexts, modules and VMM memory; the
    /// context reserve instead while a client does not report), after its
    /// registration and whenever that changes. What the client can have resident in
    /// its turn is the GPU's total less this and its own memory no swap frees.
    Room {
        others_unswappable_bytes: u64,
        /// The largest working set of one other client that no whole-process
        /// eviction can take off the GPU (its swappable memory, which must be
        /// resident in its turn beside every client's memory no swap frees), and
        /// whose it is. Memory no swap frees that this client would add past
        /// `total − others_unswappable_bytes − keep.bytes` makes that working set
        /// impossible: the creation fails with out of memory instead (issue #24,
        /// "no silent livelock"). Absent when there is none, or when the arbiter
        /// evicts whole idle processes (then both take turns).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        keep: Option<Keep>,
    },
    /// Scheduler settings changed (`kiwictl -S/-T`), sent to every client of the GPU.
    Settings(Settings),
    Pong {
        token: u64,
    },
    /// Answer to [`ClientMsg::Admit`]. `ok`: the working set may grow to the requested
    /// size; the arbiter already counts it (resident unchanged). `!ok`: the growth would
    /// push the node's swap need past the budget; nothing changed, the allocation
    /// should fail as out of memory. `swap_needed_bytes`: the node-wide swap need with
    /// the requested working set (Σ over GPUs of the working sets that do not fit in
    /// its capacity). `swap_budget_bytes`: `u64::MAX` when no budget is configured.
    Admitted {
        ok: bool,
        swap_needed_bytes: u64,
        swap_budget_bytes: u64,
        /// When refused, to a client that registered with `bounds` (this version's
        /// shims): one line for the application's stderr naming what bounds the
        /// growth (the node's swap pool, or its budget) and who fills it.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        message: Option<String>,
    },
    /// Answer to [`ClientMsg::View`]: what the caller's tenant (its container; on
    /// the host, its uid) may see of the GPU. `known: false`: the arbiter schedules
    /// no client on that GPU (nothing of Kiwi's is on it: the driver's own figures
    /// are the truth). Otherwise `unswappable_bytes` is the memory no swap frees on
    /// it, every client's and every process's outside Kiwi (what a client
    /// registering now would be told others hold, [`ArbiterMsg::Room`]), and
    /// `processes` the tenant's own clients on it, at most [`MAX_VIEW_PROCESSES`].
    /// `host`: the caller is a host process (its pid namespace is the node's), so
    /// the driver's own process list, filtered to its uid, means something to it.
    View {
        gpu_uuid: String,
        known: bool,
        #[serde(default)]
        unswappable_bytes: u64,
        #[serde(default)]
        processes: Vec<ViewProcess>,
        #[serde(default)]
        host: bool,
    },
    /// Answer to [`ClientMsg::PoolOpen`]: the pool's size and its slices' usual size.
    PoolOpened {
        size_bytes: u64,
        slice_bytes: u64,
    },
    /// Answer to [`ClientMsg::PoolTake`]: one descriptor per slice rides with this
    /// message (`SCM_RIGHTS`), in the same order. Each is a memfd whose pages the
    /// arbiter populated (they are charged to Kiwi, not to the client's memory
    /// cgroup); map it `MAP_SHARED`, whole.
    PoolLent {
        slices: Vec<PoolSlice>,
    },
    /// Answer to [`ClientMsg::PoolTake`]: nothing lent; `message` is one line for the
    /// application's stderr, naming the pool and who fills it.
    PoolRefused {
        message: String,
    },
    /// Answer to [`ClientMsg::PoolSpill`]: one read-only descriptor per slice rides
    /// with this message (`SCM_RIGHTS`), in the order of the ids asked. Each is the
    /// slice's spill file (no name on disk), `bytes` long: the client reads its
    /// contents back from it itself, then gives `id` back with `pool_give` (the file's
    /// blocks are freed once both sides closed it).
    PoolSpilled {
        files: Vec<PoolSlice>,
    },
    /// To a client whose process borrows from the node's swap pool (it opened a pool
    /// connection), when the pool runs short and has a disk tier: give back the pool
    /// memory it holds for nothing (spare buffers) and move up to `bytes` of its
    /// swapped-out contents to the disk tier (`pool_spill`). Sent to the processes
    /// idle longest first; nothing is answered on this connection.
    PoolReclaim {
        bytes: u64,
    },
    /// A refused request. Fatal errors are followed by closing the connection.
    Error {
        code: ErrorCode,
        message: String,
    },
    /// To a waiting client that registered with `wait_info`: why it waits. Sent when
    /// it starts waiting and again only when what it says changes (another holder,
    /// another place in the queue, another quantum end), never twice for the same.
    Waiting {
        /// Who holds the GPU, as it registered: its pod name, else its program name,
        /// else `client <id>`. `None`: nobody holds it this instant (being handed
        /// over).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        holder: Option<String>,
        /// Clients holding the GPU besides `holder` (being dropped so it fits).
        #[serde(default, skip_serializing_if = "is_zero_u32")]
        other_holders: u32,
        /// Clients in the queue before this one (0: next).
        ahead: u32,
        /// Milliseconds from now until the holder's quantum ends and it is asked to
        /// give the GPU back; 0: it has been asked already. `None`: no deadline.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        quantum_left_ms: Option<u64>,
    },
}

fn is_zero_u32(n: &u32) -> bool {
    *n == 0
}

/// Per-GPU scheduler settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    pub scheduler_on: bool,
    pub tq_ms: u64,
}

/// Machine-readable error kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    Malformed,
    Version,
    Oversize,
    /// A message that needs registration came first, or registration came twice.
    NotRegistered,
    AlreadyRegistered,
    /// A control request on the client socket, a client request on the control socket,
    /// or a host process other than root on a container's socket.
    WrongSocket,
    /// Too many messages too fast, too many connections, or the node's buffer for
    /// partly received frames is full.
    RateLimited,
    /// A frame was not completed in time.
    Timeout,
    UnknownGpu,
    InvalidArgument,
    Internal,
}

/// kiwictl → arbiter, on the control socket.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum ControlRequest {
    /// `kiwictl -S on|off`. `gpu`: UUID or index; `None` means every GPU, and the
    /// default for GPUs seen later.
    SetScheduler {
        on: bool,
        gpu: Option<String>,
    },
    /// `kiwictl -T <seconds>`.
    SetTq {
        tq_ms: u64,
        gpu: Option<String>,
    },
    Status {
        gpu: Option<String>,
    },
    /// Events with `seq >= since_seq`, at most `limit` (capped by the arbiter).
    Events {
        gpu: Option<String>,
        since_seq: u64,
        limit: u32,
    },
    /// From `kiwi-hook` at a claimed container's creation: serve a client socket for
    /// the container whose record is `<socket-dir>/containers/<key>.json`
    /// (`kiwi_config::containers`). Answered `done` once the socket is listening.
    AttachContainer {
        key: String,
    },
    /// From `kiwi-hook poststop`: stop serving the container's socket and remove it,
    /// its directory and its record.
    DetachContainer {
        key: String,
    },
}

impl ControlRequest {
    /// Checks the GPU selector like client text (the control socket is root's, but a
    /// selector is echoed into logs and replies).
    pub fn validate(&self) -> Result<(), FieldError> {
        match self {
            ControlRequest::SetScheduler { gpu, .. }
            | ControlRequest::SetTq { gpu, .. }
            | ControlRequest::Status { gpu }
            | ControlRequest::Events { gpu, .. } => check_opt("gpu", gpu),
            ControlRequest::AttachContainer { key } | ControlRequest::DetachContainer { key } => {
                check_text("key", key)
            }
        }
    }
}

/// Arbiter → kiwictl.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum ControlReply {
    /// A setting was changed on `gpus` (UUIDs).
    Done {
        message: String,
        gpus: Vec<String>,
    },
    Status(StatusReport),
    Events {
        events: Vec<Event>,
        /// Pass as `since_seq` to continue.
        next_seq: u64,
        /// Whether more events are waiting past this page.
        more: bool,
        /// The arbiter's CLOCK_MONOTONIC now, in ns, to place events in time.
        now_ns: u64,
    },
    Error {
        code: ErrorCode,
        message: String,
    },
}

/// `kiwictl status`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StatusReport {
    /// Defaults applied to GPUs first seen from now on.
    pub default_settings: Settings,
    pub gpus: Vec<GpuStatus>,
    pub now_ns: u64,
    /// The node's host-RAM swap budget in bytes; `None`: unlimited. Node-wide, whatever
    /// GPU the request selected.
    #[serde(default)]
    pub swap_budget_bytes: Option<u64>,
    /// The node's swap need: Σ over GPUs of max(0, Σ working sets − capacity), the
    /// least host RAM the node must hold for GPU memory that does not fit. This is what
    /// the budget bounds.
    #[serde(default)]
    pub swap_need_bytes: u64,
    /// Host RAM holding swapped-out GPU memory now: Σ over clients of working set −
    /// resident.
    #[serde(default)]
    pub swap_in_use_bytes: u64,
    /// The node's swap pool (`kiwi-arbiter --swap-pool`); absent when it is off.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub swap_pool: Option<Box<PoolStatus>>,
    /// Clients left out of `gpus[].clients` so that the reply fits in one frame
    /// (their ids still appear in `holders` and `queue`). Absent when 0.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub omitted_clients: u64,
    /// GPUs left out of `gpus` for the same reason (select one with `gpu`). Absent
    /// when 0.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub omitted_gpus: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// The node's swap pool in a [`StatusReport`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolStatus {
    /// Most bytes it holds (populated and lent together).
    pub size_bytes: u64,
    /// Bytes with pages now: ready to lend, lent, or being scrubbed.
    pub populated_bytes: u64,
    /// Populated and not lent.
    pub ready_bytes: u64,
    /// Lent to clients (their swapped-out memory and buffers prepared ahead).
    pub lent_bytes: u64,
    /// Returned, not scrubbed yet.
    pub scrubbing_bytes: u64,
    /// `4KiB`, `thp` or `hugetlb`.
    pub page_mode: String,
    /// Descriptors the pool holds open (its memfds: ready, lent, being scrubbed, left
    /// to processes whose connection closed); spill files are `spill.files`.
    #[serde(default)]
    pub memfds: u64,
    /// Who borrows most: (tenant, bytes), largest first, at most 16.
    #[serde(default)]
    pub tenants: Vec<(String, u64)>,
    /// The disk tier (`kiwi-arbiter --spill-dir`); absent when there is none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spill: Option<SpillStatus>,
}

/// The swap pool's disk tier in a [`PoolStatus`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SpillStatus {
    pub dir: String,
    /// Bytes in spill files now.
    pub spilled_bytes: u64,
    /// `--spill-budget`; absent: bounded by the disk's free space.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget_bytes: Option<u64>,
    pub files: u64,
    /// Spills refused or failed since start.
    #[serde(default)]
    pub failures: u64,
    /// Who has most on disk: (tenant, bytes), largest first, at most 16.
    #[serde(default)]
    pub tenants: Vec<(String, u64)>,
    /// The last failure's line.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GpuStatus {
    pub index: u32,
    pub uuid: String,
    pub settings: Settings,
    pub total_memory_bytes: u64,
    /// Total minus the context reserve: what working sets are measured against.
    pub capacity_bytes: u64,
    /// Whether every registered working set fits at once (no arbitration needed).
    pub fits: bool,
    /// Client ids holding the GPU (one when exclusive).
    pub holders: Vec<u64>,
    /// Waiting client ids, first in line first.
    pub queue: Vec<u64>,
    pub clients: Vec<ClientStatus>,
    /// The group this GPU's turns are reserved for (issue #41), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group_turn: Option<GroupTurn>,
}

/// A GPU reserved for a group's turn.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GroupTurn {
    pub group: String,
    /// Its turn runs (`false`: claimed, waiting for its other GPUs to come free).
    pub running: bool,
}

/// What a client is doing, as `kiwictl status` shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ClientState {
    /// Granted shared access (working sets fit, or the scheduler is off).
    Running,
    /// Exclusive holder.
    Holding,
    Waiting,
    Idle,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClientStatus {
    pub id: u64,
    pub pid: u32,
    pub host_pid: u32,
    pub name: Option<String>,
    pub container_id: Option<String>,
    pub pod_name: Option<String>,
    pub pod_namespace: Option<String>,
    pub state: ClientState,
    pub working_set_bytes: u64,
    pub resident_bytes: u64,
    pub swapped_bytes: u64,
    pub waited_ns: u64,
    pub held_ns: u64,
    /// For a client neither holding nor waiting: since when it is idle, the
    /// CLOCK_MONOTONIC ns (as [`StatusReport::now_ns`]) it last asked for the GPU, gave
    /// it back or changed its memory (what idle eviction measures,
    /// `arbiter.idle_evict_seconds`). Absent for holders and waiters, and from arbiters
    /// that predate it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle_since_ns: Option<u64>,
    /// The driver checkpointed the whole process to host memory (its contexts and
    /// modules too) to make room; it is restored before its next turn. Left out when
    /// false.
    #[serde(default, skip_serializing_if = "is_false")]
    pub checkpointed: bool,
    /// The group it is granted with (one job on several GPUs, issue #41): its key.
    /// Left out for a client whose group is on one GPU only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
}

/// One entry of a GPU's event log.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Event {
    /// Increasing over the whole arbiter, never reused.
    pub seq: u64,
    /// CLOCK_MONOTONIC nanoseconds (same clock as the simulator's trace).
    pub t_ns: u64,
    pub gpu: String,
    pub client: Option<u64>,
    pub kind: EventKind,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum EventKind {
    Register {
        pid: u32,
        host_pid: u32,
        name: Option<String>,
        pod_name: Option<String>,
        pod_namespace: Option<String>,
        working_set_bytes: u64,
        resumed: bool,
    },
    Request,
    Grant {
        exclusive: bool,
        waited_ns: u64,
    },
    Drop {
        need_bytes: u64,
        reason: DropReason,
    },
    Release {
        /// Released before the arbiter asked (the holder went idle).
        early: bool,
        resident_bytes: u64,
    },
    Reclaim {
        need_bytes: u64,
        /// Why: `true` for idle eviction (the client had been idle past
        /// `arbiter.idle_evict_seconds` on an oversubscribed GPU); `false` (left out):
        /// room for the next holder.
        #[serde(default, skip_serializing_if = "is_false")]
        idle: bool,
    },
    Revoke,
    SwapOut {
        bytes: u64,
        duration_ns: u64,
    },
    SwapIn {
        bytes: u64,
        duration_ns: u64,
    },
    Usage {
        working_set_bytes: u64,
        resident_bytes: u64,
    },
    /// The client's GPU memory no swap frees (contexts, modules, its own VMM
    /// memory), as it reported at registration (logged when not 0) or changed since:
    /// it decides with the working sets whether the GPU is shared or taken in turns.
    Unswappable {
        bytes: u64,
    },
    /// The driver counts `bytes` of GPU memory for the client's process beyond what
    /// it reported (its resident memory and its memory no swap frees), stable over
    /// several looks: counted from now on as memory no swap frees (NVIDIA's runtime
    /// 13 loads kernel code inside launches, where the shim cannot see it); 0: no
    /// longer.
    Unreported {
        bytes: u64,
    },
    /// `bytes` of the memory no swap frees that the client reports are held by no
    /// process as the driver counts it (its process holds less than its reports
    /// claim, over several looks): not counted from now on; 0: its reports are
    /// backed again.
    Unbacked {
        bytes: u64,
    },
    /// The GPU memory of processes that are no client of this GPU (run without
    /// Kiwi, refused, a tool with a context), as NVML counts them, stable over
    /// several looks: counted from now on as memory no swap frees (client `None`).
    OutsideKiwi {
        bytes: u64,
    },
    /// A holder found no room for `missing_bytes` of its working set
    /// ([`ClientMsg::NoRoom`]); `unseen_bytes`: the GPU memory no client accounts
    /// for that the arbiter counts from now on. The reclaims it caused follow.
    NoRoom {
        missing_bytes: u64,
        unseen_bytes: u64,
    },
    Exit,
    /// The arbiter had the driver checkpoint the whole (idle) process to make room:
    /// `bytes` of GPU memory no swap frees (its contexts, modules) left the GPU, in
    /// `duration_ns` (lock and checkpoint).
    Checkpoint {
        bytes: u64,
        duration_ns: u64,
    },
    /// The process was restored and unlocked (before its turn, or once the GPU was
    /// idle): `bytes` back on the GPU in `duration_ns`.
    Restore {
        bytes: u64,
        duration_ns: u64,
    },
    /// A checkpoint or restore the arbiter tried and the driver refused, or one it
    /// skipped, and why (one line).
    CheckpointSkipped {
        reason: String,
    },
    Scheduler {
        on: bool,
    },
    Tq {
        tq_ms: u64,
    },
    /// A group's turn started (issue #41): the clients of one job on several GPUs
    /// (`group`: its key) are granted together on its `gpus` GPUs; logged (client
    /// `None`) on each of them in the same step, before the grants.
    GroupTurn {
        group: String,
        gpus: u32,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_shape_is_documented_shape() {
        let j = serde_json::to_string(&ClientMsg::Request).unwrap();
        assert_eq!(j, r#"{"type":"request"}"#);
        let j = serde_json::to_string(&ClientMsg::Release(Usage {
            working_set_bytes: 10,
            resident_bytes: 4,
        }))
        .unwrap();
        assert_eq!(
            j,
            r#"{"type":"release","working_set_bytes":10,"resident_bytes":4}"#
        );
        let j = serde_json::to_string(&ArbiterMsg::Grant {
            exclusive: true,
            tq_ms: 30000,
            waiting: 1,
            pipelined: false,
            group: false,
        })
        .unwrap();
        assert_eq!(
            j,
            r#"{"type":"grant","exclusive":true,"tq_ms":30000,"waiting":1}"#
        );
        let j = serde_json::to_string(&ArbiterMsg::Grant {
            exclusive: true,
            tq_ms: 300,
            waiting: 0,
            pipelined: false,
            group: true,
        })
        .unwrap();
        assert_eq!(
            j,
            r#"{"type":"grant","exclusive":true,"tq_ms":300,"waiting":0,"group":true}"#
        );
    }

    #[test]
    fn register_minimal_and_unknown_fields() {
        let m: ClientMsg = serde_json::from_str(
            r#"{"type":"register","version":1,"pid":7,"gpu_uuid":"GPU-1","gpu_total_memory":1024}"#,
        )
        .unwrap();
        match m {
            ClientMsg::Register(r) => {
                assert_eq!(r.pid, 7);
                assert_eq!(r.working_set_bytes, 0);
                assert!(r.resume.is_none());
            }
            other => panic!("{other:?}"),
        }
        assert!(serde_json::from_str::<ClientMsg>(
            r#"{"type":"set_scheduler","on":false,"gpu":null}"#
        )
        .is_err());
        assert!(serde_json::from_str::<ControlRequest>(
            r#"{"type":"set_scheduler","on":false,"gpu":null}"#
        )
        .is_ok());
    }

    /// A registration without `unswappable_bytes` is what older shims send; one with
    /// it (even 0) opts in to `unswappable` reports, which older arbiters refuse.
    #[test]
    fn unswappable_is_opt_in_and_additive() {
        let base =
            r#"{"type":"register","version":1,"pid":7,"gpu_uuid":"GPU-1","gpu_total_memory":1024"#;
        let old: ClientMsg = serde_json::from_str(&format!("{base}}}")).unwrap();
        let ClientMsg::Register(mut r) = old else {
            panic!("not a registration")
        };
        assert_eq!(r.unswappable_bytes, None);
        assert!(!serde_json::to_string(&ClientMsg::Register(r.clone()))
            .unwrap()
            .contains("unswappable"));
        r.unswappable_bytes = Some(0);
        let j = serde_json::to_string(&ClientMsg::Register(r.clone())).unwrap();
        assert!(j.contains(r#""unswappable_bytes":0"#), "{j}");
        assert_eq!(
            round_trip(&ClientMsg::Register(r.clone())),
            ClientMsg::Register(r)
        );
        let m = ClientMsg::Unswappable { bytes: 300 << 20 };
        assert_eq!(
            serde_json::to_string(&m).unwrap(),
            r#"{"type":"unswappable","bytes":314572800}"#
        );
        assert_eq!(round_trip(&m), m);
        assert!(serde_json::from_str::<ClientMsg>(r#"{"type":"unswappable"}"#).is_err());
        assert!(
            serde_json::from_str::<ClientMsg>(r#"{"type":"unswappable","bytes":1,"x":2}"#).is_err()
        );
    }

    fn round_trip<T>(msg: &T) -> T
    where
        T: Serialize + serde::de::DeserializeOwned,
    {
        let bytes = crate::encode(msg).unwrap();
        let mut d = crate::FrameDecoder::new();
        d.push(&bytes);
        d.next_msg::<T>().unwrap().unwrap()
    }

    #[test]
    fn swap_admission_messages_round_trip() {
        let admit = ClientMsg::Admit {
            working_set_bytes: 800 << 20,
        };
        assert_eq!(
            serde_json::to_string(&admit).unwrap(),
            r#"{"type":"admit","working_set_bytes":838860800}"#
        );
        assert_eq!(round_trip(&admit), admit);

        let admitted = ArbiterMsg::Admitted {
            ok: false,
            swap_needed_bytes: 123,
            swap_budget_bytes: u64::MAX,
            message: None,
        };
        assert_eq!(
            serde_json::to_string(&admitted).unwrap(),
            r#"{"type":"admitted","ok":false,"swap_needed_bytes":123,"swap_budget_bytes":18446744073709551615}"#
        );
        assert_eq!(round_trip(&admitted), admitted);
        // Every field is required; unknown ones are refused.
        assert!(serde_json::from_str::<ArbiterMsg>(r#"{"type":"admitted","ok":true}"#).is_err());
        assert!(serde_json::from_str::<ClientMsg>(r#"{"type":"admit"}"#).is_err());
        assert!(serde_json::from_str::<ClientMsg>(
            r#"{"type":"admit","working_set_bytes":1,"resident_bytes":0}"#
        )
        .is_err());
    }

    #[test]
    fn registered_carries_the_budget_only_when_set() {
        let settings = Settings {
            scheduler_on: true,
            tq_ms: 30_000,
        };
        let none = ArbiterMsg::Registered {
            client_id: 3,
            settings,
            capacity_bytes: 896 << 20,
            swap_budget_bytes: None,
        };
        let j = serde_json::to_string(&none).unwrap();
        assert!(!j.contains("swap_budget_bytes"), "{j}");
        assert_eq!(round_trip(&none), none);

        let some = ArbiterMsg::Registered {
            client_id: 3,
            settings,
            capacity_bytes: 896 << 20,
            swap_budget_bytes: Some(100 << 20),
        };
        let j = serde_json::to_string(&some).unwrap();
        assert!(j.contains(r#""swap_budget_bytes":104857600"#), "{j}");
        assert_eq!(round_trip(&some), some);

        // What an arbiter without the field sends still decodes.
        let old: ArbiterMsg = serde_json::from_str(
            r#"{"type":"registered","client_id":3,"settings":{"scheduler_on":true,"tq_ms":30000},"capacity_bytes":939524096}"#,
        )
        .unwrap();
        assert_eq!(old, none);
    }

    /// `bounds` is opt-in: a registration without it is what older shims send, and
    /// `bounds` (a message older shims cannot decode) goes only to those that asked.
    #[test]
    fn bounds_are_opt_in_and_round_trip() {
        let old =
            r#"{"type":"register","version":1,"pid":7,"gpu_uuid":"GPU-1","gpu_total_memory":1024}"#;
        let ClientMsg::Register(mut r) = serde_json::from_str::<ClientMsg>(old).unwrap() else {
            panic!("not a register");
        };
        assert!(!r.bounds);
        assert!(!serde_json::to_string(&ClientMsg::Register(r.clone()))
            .unwrap()
            .contains("bounds"));
        r.bounds = true;
        let j = serde_json::to_string(&ClientMsg::Register(r.clone())).unwrap();
        assert!(j.ends_with(r#","bounds":true}"#), "{j}");
        assert_eq!(
            round_trip(&ClientMsg::Register(r.clone())),
            ClientMsg::Register(r)
        );

        let b = ArbiterMsg::Bounds { hint_wait_ms: 200 };
        assert_eq!(
            serde_json::to_string(&b).unwrap(),
            r#"{"type":"bounds","hint_wait_ms":200}"#
        );
        assert_eq!(round_trip(&b), b);
        let max = ArbiterMsg::Bounds {
            hint_wait_ms: u64::MAX,
        };
        assert_eq!(round_trip(&max), max);
        // The bound is required; unknown fields are refused.
        assert!(serde_json::from_str::<ArbiterMsg>(r#"{"type":"bounds"}"#).is_err());
        assert!(serde_json::from_str::<ArbiterMsg>(
            r#"{"type":"bounds","hint_wait_ms":1,"idle_ms":2}"#
        )
        .is_err());
    }

    #[test]
    fn wait_info_is_opt_in_and_waiting_round_trips() {
        // A registration without the opt-in is what older shims send, and decodes.
        let old =
            r#"{"type":"register","version":1,"pid":7,"gpu_uuid":"GPU-1","gpu_total_memory":1024}"#;
        let ClientMsg::Register(mut r) = serde_json::from_str::<ClientMsg>(old).unwrap() else {
            panic!("not a register");
        };
        assert!(!r.wait_info);
        assert!(!serde_json::to_string(&ClientMsg::Register(r.clone()))
            .unwrap()
            .contains("wait_info"));
        r.wait_info = true;
        let j = serde_json::to_string(&ClientMsg::Register(r.clone())).unwrap();
        assert!(j.ends_with(r#","wait_info":true}"#), "{j}");
        assert_eq!(
            round_trip(&ClientMsg::Register(r.clone())),
            ClientMsg::Register(r)
        );

        let w = ArbiterMsg::Waiting {
            holder: Some("nb-a".into()),
            other_holders: 0,
            ahead: 1,
            quantum_left_ms: Some(12_000),
        };
        assert_eq!(
            serde_json::to_string(&w).unwrap(),
            r#"{"type":"waiting","holder":"nb-a","ahead":1,"quantum_left_ms":12000}"#
        );
        assert_eq!(round_trip(&w), w);
        let bare: ArbiterMsg = serde_json::from_str(r#"{"type":"waiting","ahead":0}"#).unwrap();
        assert_eq!(
            bare,
            ArbiterMsg::Waiting {
                holder: None,
                other_holders: 0,
                ahead: 0,
                quantum_left_ms: None
            }
        );
        // Why it must be opt-in: a shim that predates the type cannot decode it.
        #[derive(Deserialize)]
        #[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
        #[allow(dead_code)]
        enum OldArbiterMsg {
            Pong { token: u64 },
        }
        assert!(serde_json::from_str::<OldArbiterMsg>(r#"{"type":"waiting","ahead":0}"#).is_err());
    }

    #[test]
    fn status_report_swap_fields_default() {
        let old: StatusReport = serde_json::from_str(
            r#"{"default_settings":{"scheduler_on":true,"tq_ms":30000},"gpus":[],"now_ns":5}"#,
        )
        .unwrap();
        assert_eq!(old.swap_budget_bytes, None);
        assert_eq!(old.swap_need_bytes, 0);
        assert_eq!(old.swap_in_use_bytes, 0);
        assert_eq!(old.omitted_clients, 0);
        assert!(!serde_json::to_string(&old).unwrap().contains("omitted"));
        let r = StatusReport {
            omitted_clients: 3,
            swap_budget_bytes: Some(1 << 30),
            swap_need_bytes: 7,
            swap_in_use_bytes: 9,
            ..old
        };
        let back: StatusReport = serde_json::from_str(&serde_json::to_string(&r).unwrap()).unwrap();
        assert_eq!(back, r);
    }

    /// #15's additions to the control side are optional both ways: what older
    /// arbiters send decodes, and defaults are left out.
    #[test]
    fn idle_eviction_fields_are_additive() {
        let old: EventKind = serde_json::from_str(r#"{"event":"reclaim","need_bytes":5}"#).unwrap();
        assert_eq!(
            old,
            EventKind::Reclaim {
                need_bytes: 5,
                idle: false
            }
        );
        assert_eq!(
            serde_json::to_string(&old).unwrap(),
            r#"{"event":"reclaim","need_bytes":5}"#
        );
        let idle = EventKind::Reclaim {
            need_bytes: 5,
            idle: true,
        };
        assert_eq!(
            serde_json::to_string(&idle).unwrap(),
            r#"{"event":"reclaim","need_bytes":5,"idle":true}"#
        );
        let c: ClientStatus = serde_json::from_str(
            r#"{"id":1,"pid":2,"host_pid":3,"name":null,"container_id":null,"pod_name":null,"pod_namespace":null,"state":"idle","working_set_bytes":0,"resident_bytes":0,"swapped_bytes":0,"waited_ns":0,"held_ns":0}"#,
        )
        .unwrap();
        assert_eq!(c.idle_since_ns, None);
        assert!(!serde_json::to_string(&c).unwrap().contains("idle_since"));
    }

    #[test]
    fn client_text_is_bounded_and_printable() {
        let mut r = Register {
            version: 1,
            pid: 1,
            gpu_uuid: "GPU-1".into(),
            gpu_total_memory: 1 << 30,
            working_set_bytes: 0,
            resident_bytes: 0,
            container_id: None,
            pod_name: Some("p".repeat(MAX_TEXT_BYTES)),
            pod_namespace: None,
            name: Some("jupyter-ü".into()),
            resume: None,
            wait_info: false,
            unswappable_bytes: None,
            pipelined: false,
            room_info: false,
            bounds: false,
            group: None,
        };
        assert_eq!(r.validate(), Ok(()));
        r.name = Some("x".repeat(1 << 20));
        let e = r.validate().unwrap_err();
        assert_eq!(e.field, "name");
        assert_eq!(
            e.to_string(),
            "field `name` is 1048576 bytes long; the limit is 253"
        );
        r.name = Some("ok\n[INFO] forged".into());
        let e = ClientMsg::Register(r.clone()).validate().unwrap_err();
        assert_eq!(
            e.to_string(),
            "field `name` contains the control character U+000A"
        );
        r.name = None;
        for bad in ["a\rb", "\u{1b}[2J", "a\u{2028}b", "\u{202e}gpj", "\u{85}"] {
            r.container_id = Some(bad.into());
            assert_eq!(r.validate().unwrap_err().field, "container_id", "{bad:?}");
        }
        r.container_id = None;
        r.gpu_uuid = String::new();
        assert_eq!(r.validate().unwrap_err().field, "gpu_uuid");
        let sel = ControlRequest::Status {
            gpu: Some("0\n".into()),
        };
        assert_eq!(sel.validate().unwrap_err().field, "gpu");
    }
}
