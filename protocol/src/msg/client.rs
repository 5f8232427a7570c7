//! Shim → arbiter ([`ClientMsg`]): registration, reports, requests, the swap pool's
//! and the NVML view's questions; the limits on what a client may send, checked by
//! [`ClientMsg::validate`].

use serde::{Deserialize, Serialize};

use super::*;

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

pub(crate) fn check_opt(field: &'static str, s: &Option<String>) -> Result<(), FieldError> {
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

impl Register {
    /// This process's registration for `gpu_uuid` (`gpu_total_memory` bytes) with a
    /// working set of `working_set_bytes`, none of it resident, at this protocol
    /// version: no claims, no name, none of the opt-ins (set them with `..`).
    pub fn new(gpu_uuid: impl Into<String>, gpu_total_memory: u64, working_set_bytes: u64) -> Self {
        Self {
            version: crate::PROTOCOL_VERSION,
            pid: std::process::id(),
            gpu_uuid: gpu_uuid.into(),
            gpu_total_memory,
            working_set_bytes,
            resident_bytes: 0,
            container_id: None,
            pod_name: None,
            pod_namespace: None,
            name: None,
            resume: None,
            wait_info: false,
            unswappable_bytes: None,
            pipelined: false,
            room_info: false,
            bounds: false,
            group: None,
        }
    }

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
