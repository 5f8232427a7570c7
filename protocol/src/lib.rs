//! The Kiwi wire protocol, shared by `libkiwi.so`, `kiwi-arbiter` and `kiwictl`.
//!
//! Every message travels in one frame: an 8-byte header (`b"KW"`, protocol version
//! as u16 big-endian, payload length as u32 big-endian) and a UTF-8 JSON payload of
//! at most [`MAX_PAYLOAD`] bytes. `docs/protocol.md` is the reference.
//!
//! This crate owns framing ([`frame`]), the message types ([`msg`]) and a blocking
//! connection for clients ([`blocking`]). It does no scheduling and knows nothing of
//! CUDA. Decoding never panics on any input: malformed bytes are a [`ProtocolError`].

pub mod blocking;
pub mod clock;
pub mod fds;
pub mod frame;
pub mod msg;

pub use clock::monotonic_ns;
pub use frame::{encode, FrameDecoder, HEADER_LEN, MAGIC, MAX_PAYLOAD};
pub use msg::*;

/// Version spoken by this build. Frames and registrations carrying another are refused.
pub const PROTOCOL_VERSION: u16 = 1;

/// Everything that can go wrong reading or writing frames.
#[derive(Debug, thiserror::Error)]
pub enum ProtocolError {
    #[error("bad frame magic {0:02x?}: not a Kiwi peer")]
    BadMagic([u8; 2]),
    #[error("protocol version {got} is not supported (this side speaks {PROTOCOL_VERSION})")]
    Version { got: u16 },
    #[error("frame of {len} bytes exceeds the limit of {MAX_PAYLOAD} bytes")]
    Oversize { len: usize },
    #[error("malformed message: {0}")]
    Malformed(String),
    #[error("connection closed")]
    Closed,
    /// A blocking receive hit the stream's read timeout (`None`: no timeout was set,
    /// yet the socket said it would block).
    #[error("no answer within {}", after.map(|d| format!("{:.1} s", d.as_secs_f64())).unwrap_or_else(|| "the read timeout".into()))]
    TimedOut { after: Option<std::time::Duration> },
    /// The cause is the whole message: printing it once keeps errors on one line.
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

impl ProtocolError {
    /// The error code sent back to a peer in [`ArbiterMsg::Error`].
    pub fn code(&self) -> ErrorCode {
        match self {
            ProtocolError::BadMagic(_) | ProtocolError::Malformed(_) => ErrorCode::Malformed,
            ProtocolError::Version { .. } => ErrorCode::Version,
            ProtocolError::Oversize { .. } => ErrorCode::Oversize,
            ProtocolError::Closed | ProtocolError::TimedOut { .. } | ProtocolError::Io(_) => {
                ErrorCode::Internal
            }
        }
    }

    /// Whether the stream can no longer be trusted to be at a frame boundary.
    pub fn is_fatal(&self) -> bool {
        !matches!(self, ProtocolError::Malformed(_))
    }
}
