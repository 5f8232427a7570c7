//! Message types. Every message is a JSON object with a `"type"` tag.
//!
//! - [`ClientMsg`]: shim → arbiter, on the client socket.
//! - [`ArbiterMsg`]: arbiter → shim.
//! - [`ControlRequest`] / [`ControlReply`]: kiwictl ↔ arbiter, on the control socket only.
//!
//! Identity is the connection: the arbiter takes a client's host pid and uid from the
//! socket (SO_PEERCRED), never from a message, so no client can act for another.
//!
//! One file per direction: [`client`], [`arbiter`], [`control`]; what the control
//! socket reports, [`status`] and [`events`].

mod arbiter;
mod client;
mod control;
mod events;
mod status;

pub use arbiter::*;
pub use client::*;
pub use control::*;
pub use events::*;
pub use status::*;

// `skip_serializing_if` predicates the message types share.
pub(crate) fn is_zero_u64(n: &u64) -> bool {
    *n == 0
}

pub(crate) fn is_false(b: &bool) -> bool {
    !*b
}

pub(crate) fn is_zero_u32(n: &u32) -> bool {
    *n == 0
}

pub(crate) fn is_zero(n: &u64) -> bool {
    *n == 0
}

#[cfg(test)]
mod tests;
