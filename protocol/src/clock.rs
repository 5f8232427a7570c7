//! CLOCK_MONOTONIC in nanoseconds: the clock of every timestamp Kiwi exchanges (the
//! event log's `t_ns`, the simulator's trace, gpuburst's start times), so they can be
//! compared directly. Kiwi's one copy: the arbiter, the simulator (`kiwi-sim-core`)
//! and gpuburst re-export it.

/// Now, in CLOCK_MONOTONIC nanoseconds.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; CLOCK_MONOTONIC is always supported.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}
