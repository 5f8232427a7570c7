//! The event log's entries ([`Event`], [`EventKind`]).

use serde::{Deserialize, Serialize};

use super::*;

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
