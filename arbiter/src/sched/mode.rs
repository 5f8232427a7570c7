//! Shared or in turns: whether the GPU's clients run side by side or take turns,
//! with hysteresis ([`Mode`]): exclusive at once when the GPU stops fitting, shared
//! again only once it has fit for [`STATE_INTERVAL_NS`].

use super::*;

/// Shared or exclusive, with hysteresis ([`GpuScheduler::settle_mode`]): exclusive
/// at once, relaxed back only [`STATE_INTERVAL_NS`] after the GPU was last
/// oversubscribed (or at once with the scheduler off).
#[derive(Debug, Clone)]
pub(super) struct Mode {
    /// The GPU may run shared: it has not been oversubscribed for
    /// [`STATE_INTERVAL_NS`] ([`GpuScheduler::settle_mode`]), as of
    /// `oversubscribed_at`, when it last was.
    relaxed: bool,
    oversubscribed_at: Nanos,
}

impl Mode {
    /// Relaxed: a GPU with no clients fits.
    pub(super) fn new() -> Self {
        Self {
            relaxed: true,
            oversubscribed_at: 0,
        }
    }

    /// Whether the GPU may run shared.
    pub(super) fn relaxed(&self) -> bool {
        self.relaxed
    }

    /// Steps the hysteresis at `now`: `on`, the scheduler is on; `turns`, it is on
    /// and the GPU must be taken in turns.
    fn settle(&mut self, now: Nanos, on: bool, turns: bool) {
        if turns {
            self.oversubscribed_at = now;
            self.relaxed = false;
        } else if !self.relaxed && (!on || now >= self.relax_at()) {
            self.relaxed = true;
        }
    }

    /// When the GPU may relax, if it fits from now on.
    pub(super) fn relax_at(&self) -> Nanos {
        self.oversubscribed_at.saturating_add(STATE_INTERVAL_NS)
    }
}

impl GpuScheduler {
    /// No arbitration needed: everybody runs side by side. Back from oversubscribed
    /// only once the working sets have fit for [`STATE_INTERVAL_NS`]
    /// ([`GpuScheduler::settle_mode`]).
    pub(super) fn shared_mode(&self) -> bool {
        !self.settings.scheduler_on || (!self.takes_turns() && self.mode.relaxed())
    }

    /// Whether the GPU must be taken in turns: its working sets do not fit, or a
    /// member of a group on several GPUs ([`gang`]) runs here beside others. Shared,
    /// that member's collectives would spin whenever a peer's GPU is busy with
    /// someone else: a 2-GPU job beside a notebook on each GPU whose memory fit ran
    /// 32.2 s shared against 25.8 s in turns (`kiwi-bench gang`'s shapes), and the
    /// notebooks finished sooner too.
    pub(super) fn takes_turns(&self) -> bool {
        !self.fits() || (self.clients.len() >= 2 && self.clients.values().any(|c| c.gang.is_some()))
    }

    /// Hysteresis between shared and exclusive: a GPU that stops fitting turns
    /// exclusive at once (the memory is needed now), and shared again only once it
    /// has fit for [`STATE_INTERVAL_NS`]. A tenant that flips its working set across
    /// the room (40,000 times in 3 s, issue #38) otherwise turned every flip into a
    /// `drop` for each sharer and a grant after it: 20,000 drops, and an honest
    /// notebook whose unread replies passed the cap lost its connection 5 times.
    pub(super) fn settle_mode(&mut self, now: Nanos) {
        let on = self.settings.scheduler_on;
        let turns = on && self.takes_turns();
        self.mode.settle(now, on, turns);
    }

    /// More than one client is registered: the GPU is shared, whether or not its
    /// working sets fit.
    pub(super) fn shared_now(&self) -> bool {
        self.clients.len() > 1
    }
}
