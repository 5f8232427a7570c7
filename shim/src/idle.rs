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
//! [`MARGIN`] times that, between `KIWI_IDLE_MIN_MS` and `KIWI_IDLE_MS`. Trust in it
//! grows with the pauses seen: before any it is `KIWI_IDLE_MS`; after `n` of them it
//! lies `n / MIN_PAUSES` of the way from `KIWI_IDLE_MS` down to the learned value,
//! which it reaches after [`MIN_PAUSES`]: one quick resubmission says little about
//! the next pause, yet a notebook whose work shows one or two pauses a turn should
//! not wait the whole `KIWI_IDLE_MS` for four turns (it did: in a run of `kiwi-bench
//! oversub`'s two jobs by hand, one released at 100 ms in each of its four turns, the
//! other at 10 to 15 ms from its second, its start-up having shown enough pauses). A
//! pause that ended after the process had already released early counts too, so a
//! wrong guess raises the threshold.

use std::time::{Duration, Instant};

/// How many times the longest recent pause the holder waits before releasing.
pub const MARGIN: u32 = 4;

/// Pauses seen before the threshold is the learned one (it falls towards it with each).
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
    /// pause, within `[min, max]`, once [`MIN_PAUSES`] pauses were seen; `max` before
    /// any, and in between the share of the way down that the pauses seen give.
    pub fn threshold(&self, now: Instant, min: Duration, max: Duration) -> Duration {
        let Some(d) = self.longest_at(now) else {
            return max;
        };
        let learned = (d * MARGIN).clamp(min.min(max), max);
        // `seen` stops at MIN_PAUSES (`pause`).
        let unseen = MIN_PAUSES - self.seen;
        learned + (max - learned) * unseen / MIN_PAUSES
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
    fn trust_grows_with_each_pause_seen() {
        let mut l = IdleLearner::default();
        let t = Instant::now();
        assert_eq!(
            l.threshold(t, MIN, MAX),
            MAX,
            "no pause seen: the idle period"
        );
        let mut last = MAX;
        for n in 1..=MIN_PAUSES {
            l.pause(Duration::from_micros(50), t);
            let th = l.threshold(t, MIN, MAX);
            // 100 ms down to 10 ms in eighths: 88.75, 77.5, ... 21.25, 10.
            let want = MIN + (MAX - MIN) * (MIN_PAUSES - n) / MIN_PAUSES;
            assert_eq!(th, want, "after {n} pauses");
            assert!(th < last, "after {n} pauses: {th:?}, not below {last:?}");
            last = th;
        }
        assert_eq!(last, MIN);
        l.pause(Duration::from_micros(50), t);
        assert_eq!(
            l.threshold(t, MIN, MAX),
            MIN,
            "past MIN_PAUSES it stays learned"
        );
    }

    #[test]
    fn a_long_pause_among_few_is_never_undercut() {
        // One pause of 20 ms: the learned value (80 ms) is the floor of the way down.
        let mut l = IdleLearner::default();
        let t = Instant::now();
        l.pause(Duration::from_millis(20), t);
        let th = l.threshold(t, MIN, MAX);
        assert!(th >= Duration::from_millis(80) && th < MAX, "{th:?}");
        assert_eq!(
            th,
            Duration::from_millis(80) + Duration::from_millis(20) * 7 / 8
        );
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
