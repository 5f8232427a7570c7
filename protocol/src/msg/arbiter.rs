//! Arbiter → shim ([`ArbiterMsg`]): grants, drops, reclaims, room, the pool's
//! answers, and the types they carry; the error kinds every reply may carry.

use serde::{Deserialize, Serialize};

use super::*;

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
