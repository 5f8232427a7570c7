//! kiwictl ↔ arbiter on the control socket ([`ControlRequest`], [`ControlReply`]).

use serde::{Deserialize, Serialize};

use super::*;

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
