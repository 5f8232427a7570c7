//! What a connection may make the daemon hold, bounded (`docs/protocol.md`,
//! "Limits"): descriptors (client connections stop short of RLIMIT_NOFILE, and each
//! container or uid has a share, [`ConnSlot`]), time (registration and each frame
//! have deadlines, [`Limits`]), memory (one node-wide budget for partly received
//! frames, [`FrameBudget`]), messages ([`RateLimit`]), log volume ([`Throttle`]) and
//! a failing accept's retries ([`AcceptBackoff`]).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::OwnedSemaphorePermit;

use super::state::Shared;
use crate::clock::monotonic_ns;

/// Descriptors client connections never take: the control socket's connections
/// ([`MAX_CONTROL_CONNS`](super::control::MAX_CONTROL_CONNS)), the listeners, the
/// metrics server, the runtime's own.
pub const FD_RESERVE: usize = 64;
/// Frames up to this size (one read) are always buffered; larger ones need room in
/// the node's budget for partly received frames.
pub const SMALL_FRAME: usize = 16 * 1024;

/// At most `burst` warnings per 10 s; the rest are counted and summed up in the next
/// one, so a flood of bad peers (or accept failing in a loop) cannot flood the log.
pub(super) struct Throttle {
    burst: u32,
    window_start: u64,
    in_window: u32,
    suppressed: u64,
}

impl Throttle {
    const WINDOW_NS: u64 = 10_000_000_000;

    pub(super) fn new(burst: u32) -> Self {
        Self {
            burst,
            window_start: 0,
            in_window: 0,
            suppressed: 0,
        }
    }

    /// `Some(note)` when a warning may be written now; the note tells how many were
    /// left out before it.
    pub(super) fn allow(&mut self) -> Option<String> {
        let now = monotonic_ns();
        if now.saturating_sub(self.window_start) >= Self::WINDOW_NS {
            self.window_start = now;
            self.in_window = 0;
        }
        if self.in_window >= self.burst {
            self.suppressed += 1;
            return None;
        }
        self.in_window += 1;
        let n = std::mem::take(&mut self.suppressed);
        Some(if n == 0 {
            String::new()
        } else {
            format!(" ({n} similar warnings suppressed)")
        })
    }
}

/// An accept loop's answer to a failed accept (EMFILE and friends): it backs off
/// instead of spinning, from 1 ms doubling to 1 s, and says so once in a while
/// rather than on every try.
pub(super) struct AcceptBackoff {
    delay: Duration,
    warn: Throttle,
}

impl AcceptBackoff {
    const FIRST: Duration = Duration::from_millis(1);
    const LONGEST: Duration = Duration::from_secs(1);

    pub(super) fn new() -> Self {
        Self {
            delay: Self::FIRST,
            warn: Throttle::new(1),
        }
    }

    /// An accept succeeded: the next failure waits the shortest again.
    pub(super) fn reset(&mut self) {
        self.delay = Self::FIRST;
    }

    /// `what` (the listener's accept) failed with `e`: warns, waits, and waits twice
    /// as long next time.
    pub(super) async fn failed(&mut self, what: &str, e: &std::io::Error) {
        if let Some(note) = self.warn.allow() {
            log_line!("WARN", "{what} failed: {e}; retrying in up to 1 s{note}");
        }
        tokio::time::sleep(self.delay).await;
        self.delay = (self.delay * 2).min(Self::LONGEST);
    }
}

/// The per-connection limits, fixed at start.
#[derive(Debug, Clone, Copy)]
pub(super) struct Limits {
    pub(super) max_conns_per_group: usize,
    pub(super) register_timeout: Duration,
    pub(super) frame_timeout: Duration,
}

/// The node-wide budget for partly received frames. A connection is charged for the
/// whole frame it is in the middle of, from its header on, so a refusal comes before
/// the payload is buffered.
pub(super) struct FrameBudget {
    pub(super) used: AtomicUsize,
    pub(super) limit: usize,
}

impl FrameBudget {
    /// Sets a connection's charge (`charged`) to `want` bytes. `false`: `want` is a
    /// large frame the budget has no room for; the charge is unchanged.
    pub(super) fn charge(&self, charged: &mut usize, want: usize) -> bool {
        if want <= *charged {
            self.used.fetch_sub(*charged - want, Ordering::Relaxed);
            *charged = want;
            return true;
        }
        let extra = want - *charged;
        let ok = self
            .used
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |used| {
                (want <= SMALL_FRAME || used + extra <= self.limit).then_some(used + extra)
            })
            .is_ok();
        if ok {
            *charged = want;
        }
        ok
    }
}

/// A client connection's place under the connection caps; given back on drop.
pub(super) struct ConnSlot {
    shared: Arc<Shared>,
    group: String,
    _permit: OwnedSemaphorePermit,
}

impl ConnSlot {
    /// Takes a place in `group`; `None` when the group is at its cap.
    pub(super) fn take(
        shared: &Arc<Shared>,
        group: String,
        permit: OwnedSemaphorePermit,
    ) -> Option<Self> {
        let mut groups = shared.groups.lock().unwrap_or_else(|e| e.into_inner());
        let n = groups.entry(group.clone()).or_insert(0);
        if *n >= shared.limits.max_conns_per_group {
            return None;
        }
        *n += 1;
        Some(Self {
            shared: shared.clone(),
            group,
            _permit: permit,
        })
    }
}

impl Drop for ConnSlot {
    fn drop(&mut self) {
        let mut groups = self.shared.groups.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = groups.get_mut(&self.group) {
            *n -= 1;
            if *n == 0 {
                groups.remove(&self.group);
            }
        }
    }
}

/// A token bucket: `rate` messages per second, bursts up to `rate`.
pub(super) struct RateLimit {
    rate: f64,
    tokens: f64,
    last: u64,
}

impl RateLimit {
    pub(super) fn new(rate: u32) -> Self {
        Self {
            rate: rate as f64,
            tokens: rate as f64,
            last: monotonic_ns(),
        }
    }

    pub(super) fn allow(&mut self) -> bool {
        let now = monotonic_ns();
        self.tokens = (self.tokens + (now - self.last) as f64 * 1e-9 * self.rate).min(self.rate);
        self.last = now;
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

/// Raises RLIMIT_NOFILE: both limits to `want` if the hard limit is below it (this
/// needs CAP_SYS_RESOURCE; a refusal is logged), then the soft limit to the hard
/// one. Returns the soft limit now.
pub fn raise_fd_limit(want: Option<u64>) -> std::io::Result<u64> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the struct we own.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    if let Some(want) = want.filter(|&w| w > lim.rlim_max) {
        let raised = libc::rlimit {
            rlim_cur: want as libc::rlim_t,
            rlim_max: want as libc::rlim_t,
        };
        // SAFETY: setrlimit reads the struct we own.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            lim = raised;
        } else {
            log_line!(
                "WARN",
                "cannot raise RLIMIT_NOFILE to {want} ({}; it needs CAP_SYS_RESOURCE); staying at {}",
                std::io::Error::last_os_error(),
                lim.rlim_max
            );
        }
    }
    if lim.rlim_cur < lim.rlim_max {
        let want = libc::rlimit {
            rlim_cur: lim.rlim_max,
            rlim_max: lim.rlim_max,
        };
        // SAFETY: setrlimit reads the struct we own; raising soft up to hard needs no
        // privilege.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &want) } == 0 {
            lim.rlim_cur = lim.rlim_max;
        }
    }
    Ok(lim.rlim_cur)
}
