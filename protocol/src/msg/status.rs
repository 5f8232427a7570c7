//! What `kiwictl status` is told ([`StatusReport`]): GPUs, clients, the swap pool.

use serde::{Deserialize, Serialize};

use super::*;

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
