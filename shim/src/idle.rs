//! How long a holder must be idle before it releases early: learned from the
//! process's own pauses between pieces of work.
//!
//! A fixed `KIWI_IDLE_MS` is a guess: too short and a training loop that pauses
//! between steps gives its turn away mid-burst; too long and every hand-off of a
//! notebook that finished its cell waits that long for nothing. Yet the process shows
//! what its pauses look like: each time its queued work was seen done and it then
//! submitted again, the time in between was a pause that was not the end of its work.
//! [`IdleLearner`] keeps the longest recent pause (halving every [`HALF_LIFE`], so one
//! long pause is remembered for minutes, not forever), and the threshold is
//! [`MARGIN`] times that, between `KIWI_IDLE_MIN_MS` and `KIWI_IDLE_MS`. Until
//! [`MIN_PAUSES`] pauses are seen it is `KIWI_IDLE_MS`: one quick resubmission says
//! little about the next pause. A pause that ended after the process had already
//! released early counts too, so a wrong guess raises the threshold.

use std::time::{Duration, Instant};

/// How many times the longest recent pause the holder waits before releasing.
pub const MARGIN: u32 = 4;

/// Pauses seen before the threshold may drop below `KIWI_IDLE_MS`.
pub const MIN_PAUSES: u32 = 8;

/// The remembered longest pause halves every this long.
pub const HALF_LIFE: Duration = Duration::from_secs(60);

/// The longest recent pause between pieces of a process's work.
#[derive(Debug, Clone, Default)]
pub struct IdleLearner {
    /// The longest pause, and when it was last raised or decayed.
    longest: Option<(Duration, Instant)>,
    /// Pauses seen (up to [`MIN_PAUSES`]).
    seen: u32,
}

impl IdleLearner {
    /// A pause of `gap` ended at `now` (the process submitted again).
    pub fn pause(&mut self, gap: Duration, now: Instant) {
        let kept = self.longest_at(now).unwrap_or_default();
        self.longest = Some((kept.max(gap), now));
        self.seen = (self.seen + 1).min(MIN_PAUSES);
    }

    /// The longest recent pause at `now`, decayed; `None` before any was seen.
    pub fn longest_at(&self, now: Instant) -> Option<Duration> {
        let (d, at) = self.longest?;
        let halvings = now.saturating_duration_since(at).as_secs_f64() / HALF_LIFE.as_secs_f64();
        Some(d.mul_f64(half_to_the(halvings)))
    }

    /// How long to be idle before releasing early: [`MARGIN`] × the longest recent
    /// pause, within `[min, max]`; `max` until [`MIN_PAUSES`] pauses were seen.
    pub fn threshold(&self, now: Instant, min: Duration, max: Duration) -> Duration {
        match self.longest_at(now) {
            Some(d) if self.seen >= MIN_PAUSES => (d * MARGIN).clamp(min.min(max), max),
            _ => max,
        }
    }
}

/// 0.5 to the power `x` (≥ 0), exact at whole numbers and linear between them:
/// `f64::powf` would make the shim need libm, which the smallest container images
/// lack (the shim is injected into any container).
fn half_to_the(x: f64) -> f64 {
    if x.is_nan() || x >= 64.0 {
        return 0.0;
    }
    let whole = x as u32;
    let frac = x - f64::from(whole);
    (1.0 - frac / 2.0) / (1u64 << whole) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: Duration = Duration::from_millis(10);
    const MAX: Duration = Duration::from_millis(100);

    #[test]
    fn unlearned_waits_the_whole_idle_period() {
        let mut l = IdleLearner::default();
        let t = Instant::now();
        assert_eq!(l.threshold(t, MIN, MAX), MAX);
        for _ in 1..MIN_PAUSES {
            l.pause(Duration::from_micros(50), t);
            assert_eq!(l.threshold(t, MIN, MAX), MAX, "too few pauses to go by");
        }
        l.pause(Duration::from_micros(50), t);
        assert_eq!(l.threshold(t, MIN, MAX), MIN);
    }

    fn learned(gap: Duration, t: Instant) -> IdleLearner {
        let mut l = IdleLearner::default();
        for _ in 0..MIN_PAUSES {
            l.pause(gap, t);
        }
        l
    }

    #[test]
    fn short_pauses_bring_it_down_to_the_floor_and_a_long_one_raises_it() {
        let t = Instant::now();
        let mut l = learned(Duration::from_micros(1), t);
        for i in 0..20 {
            l.pause(
                Duration::from_micros(800),
                t + Duration::from_millis(i * 100),
            );
        }
        let now = t + Duration::from_secs(2);
        assert_eq!(l.threshold(now, MIN, MAX), MIN);
        l.pause(Duration::from_millis(15), now);
        assert_eq!(l.threshold(now, MIN, MAX), Duration::from_millis(60));
        // Shorter pauses after it do not lower it at once.
        l.pause(Duration::from_millis(1), now + Duration::from_millis(10));
        assert!(
            l.threshold(now + Duration::from_millis(10), MIN, MAX) >= Duration::from_millis(59)
        );
        // A pause longer than the idle period is capped.
        l.pause(Duration::from_millis(70), now);
        assert_eq!(l.threshold(now, MIN, MAX), MAX);
    }

    #[test]
    fn a_long_pause_is_forgotten_slowly() {
        let t = Instant::now();
        let l = learned(Duration::from_millis(20), t);
        assert_eq!(l.threshold(t, MIN, MAX), Duration::from_millis(80));
        let later = t + HALF_LIFE;
        let th = l.threshold(later, MIN, MAX);
        assert!(
            th > Duration::from_millis(39) && th < Duration::from_millis(41),
            "{th:?}"
        );
        assert_eq!(l.threshold(t + HALF_LIFE * 10, MIN, MAX), MIN);
    }

    #[test]
    fn halving_is_exact_at_whole_numbers_and_never_rises() {
        assert_eq!(half_to_the(0.0), 1.0);
        assert_eq!(half_to_the(1.0), 0.5);
        assert_eq!(half_to_the(3.0), 0.125);
        assert_eq!(half_to_the(0.5), 0.75);
        assert_eq!(half_to_the(100.0), 0.0);
        assert_eq!(half_to_the(f64::NAN), 0.0);
        let mut last = 2.0;
        for i in 0..700 {
            let v = half_to_the(f64::from(i) / 10.0);
            assert!(v <= last, "{i}");
            last = v;
        }
    }

    #[test]
    fn a_floor_above_the_ceiling_means_the_ceiling() {
        let t = Instant::now();
        let l = learned(Duration::from_micros(1), t);
        assert_eq!(
            l.threshold(t, Duration::from_millis(500), MAX),
            MAX,
            "KIWI_IDLE_MIN_MS above KIWI_IDLE_MS: the fixed KIWI_IDLE_MS"
        );
    }
}
