//! After an arbiter restart ([`ResumeWindow`]): a client's claim to still hold the
//! GPU (`resume {holding}`) is believed only inside the post-restart window and
//! before this scheduler granted anyone itself; resumed waiters are not granted
//! until a resumed holder had time to re-register.

use super::*;

/// Longest wait for a resumed holder to re-register after an arbiter restart.
const RESUME_WINDOW_NS: u64 = 2_000_000_000;

/// How long after the arbiter starts a client's claim to still hold the GPU is
/// believed. Shims reconnect with a backoff of at most 1 s, so a real holder comes
/// back well within it.
pub const RESUME_CLAIM_WINDOW_NS: u64 = 5_000_000_000;

/// The post-restart window's state: a claim to hold is believed only before
/// `resume_until` and until this scheduler granted the GPU itself (`granted_own`,
/// never unset); the first believed resume starts a quiet time, which ends at
/// `quiet_until`, when a resumed holder is back, or never starts again.
#[derive(Debug, Clone)]
pub(super) struct ResumeWindow {
    /// After an arbiter restart, resumed waiters are not granted until the resumed
    /// holder (still running on the GPU) had time to re-register.
    quiet_until: Option<Nanos>,
    resume_seen: bool,
    /// Claims to hold (`resume {holding}`) are believed only before this time: the
    /// end of the post-restart window.
    resume_until: Nanos,
    /// Whether this scheduler granted the GPU itself: from then on it knows who holds,
    /// and a claim to hold is refuted.
    granted_own: bool,
}

impl ResumeWindow {
    /// The window of an arbiter started at time 0.
    pub(super) fn new() -> Self {
        Self {
            quiet_until: None,
            resume_seen: false,
            resume_until: RESUME_CLAIM_WINDOW_NS,
            granted_own: false,
        }
    }

    /// Claims to hold are refused from `until` on.
    pub(super) fn set_until(&mut self, until: Nanos) {
        self.resume_until = until;
    }

    /// Whether a claim to hold made at `now` would be believed.
    pub(super) fn believes(&self, now: Nanos) -> bool {
        now < self.resume_until && !self.granted_own
    }

    /// This scheduler granted the GPU itself.
    pub(super) fn granted(&mut self) {
        self.granted_own = true;
    }

    /// A resume was believed at `now`: the first one starts the quiet time, the
    /// grace at most [`RESUME_WINDOW_NS`].
    pub(super) fn believed(&mut self, now: Nanos, grace_ns: u64) {
        if !self.resume_seen {
            self.resume_seen = true;
            self.quiet_until = Some(now + grace_ns.min(RESUME_WINDOW_NS));
        }
    }

    /// When resumed waiters may be granted (`None`: now).
    pub(super) fn quiet_until(&self) -> Option<Nanos> {
        self.quiet_until
    }

    /// The quiet time is over: a resumed holder is back.
    pub(super) fn end_quiet(&mut self) {
        self.quiet_until = None;
    }

    /// Ends the quiet time once `now` reaches its end.
    pub(super) fn settle(&mut self, now: Nanos) {
        if self.quiet_until.is_some_and(|q| now >= q) {
            self.quiet_until = None;
        }
    }
}

impl GpuScheduler {
    /// Whether a claim to hold the GPU made now would be believed (see the module docs).
    pub fn believes_resume(&self, now: Nanos) -> bool {
        self.resume.believes(now)
    }
}
