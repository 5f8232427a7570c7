//! The clock of the scheduler and the event log: CLOCK_MONOTONIC nanoseconds, as
//! the protocol defines it.

pub use kiwi_protocol::monotonic_ns;
