//! The time quantum (TQ): how long a holder keeps a GPU while others wait.
//!
//! Built once, from seconds as a person writes them (`--tq`, `[arbiter] tq_seconds`,
//! `kiwictl -T`), with the one range check; held in whole milliseconds, what the wire
//! carries (`tq_ms`); shown in seconds. Whatever holds a [`Quantum`] holds a valid one
//! and checks nothing again.

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::value::ValueError;

/// A time quantum: at least 1 ms, at most a day.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "f64", into = "f64")]
pub struct Quantum {
    ms: u64,
}

impl Quantum {
    /// The shortest quantum, in seconds.
    pub const MIN_SECS: f64 = 0.001;
    /// The longest quantum, in seconds: a day.
    pub const MAX_SECS: f64 = 86_400.0;

    /// The quantum of `secs` seconds (fractions allowed), to the nearest millisecond;
    /// refuses anything not finite, not positive, under 1 ms or over a day.
    pub fn from_secs(secs: f64) -> Result<Quantum, ValueError> {
        if !secs.is_finite() || secs <= 0.0 {
            return Err(ValueError(format!(
                "TQ must be a positive number of seconds, not {secs}"
            )));
        }
        if secs > Self::MAX_SECS {
            return Err(ValueError(format!(
                "TQ must be at most 86400 seconds (a day), not {secs}"
            )));
        }
        if secs < Self::MIN_SECS {
            return Err(ValueError(format!(
                "TQ must be at least 0.001 seconds, not {secs}"
            )));
        }
        // In range, so 1 ..= 86_400_000 ms.
        Ok(Quantum {
            ms: (secs * 1000.0).round() as u64,
        })
    }

    /// The quantum of `ms` milliseconds, as the wire carries it (`kiwictl -T`'s
    /// `set_tq`); the same range as [`Quantum::from_secs`].
    pub fn from_millis(ms: u64) -> Result<Quantum, ValueError> {
        if ms == 0 || ms > 86_400_000 {
            return Err(ValueError(format!(
                "TQ must be between 1 ms and one day, not {ms} ms"
            )));
        }
        Ok(Quantum { ms })
    }

    /// Whole milliseconds, as the wire and the schedulers count it.
    pub fn as_millis(self) -> u64 {
        self.ms
    }

    pub fn as_duration(self) -> Duration {
        Duration::from_millis(self.ms)
    }

    pub fn as_secs_f64(self) -> f64 {
        self.ms as f64 / 1000.0
    }
}

/// 30 seconds.
impl Default for Quantum {
    fn default() -> Self {
        Quantum { ms: 30_000 }
    }
}

/// In seconds, as the operator wrote it: `30`, `2.5`.
impl fmt::Display for Quantum {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.as_secs_f64(), f)
    }
}

/// Seconds as a person types them (`30`, `2.5`); refuses `0`, negatives and words.
impl std::str::FromStr for Quantum {
    type Err = ValueError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let secs: f64 = s.trim().parse().map_err(|_| {
            ValueError(format!(
                "TQ must be a positive number of seconds, not {s:?}"
            ))
        })?;
        Quantum::from_secs(secs)
    }
}

impl TryFrom<f64> for Quantum {
    type Error = ValueError;
    fn try_from(secs: f64) -> Result<Self, Self::Error> {
        Quantum::from_secs(secs)
    }
}

impl From<Quantum> for f64 {
    fn from(q: Quantum) -> f64 {
        q.as_secs_f64()
    }
}

/// Compares with a number of seconds.
impl PartialEq<f64> for Quantum {
    fn eq(&self, secs: &f64) -> bool {
        self.as_secs_f64() == *secs
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn from_seconds_to_millis_and_back() {
        assert_eq!(Quantum::default().as_millis(), 30_000);
        let q: Quantum = "2.5".parse().unwrap();
        assert_eq!(q.as_millis(), 2_500);
        assert_eq!(q.as_duration(), Duration::from_millis(2_500));
        assert_eq!(q.to_string(), "2.5");
        assert_eq!(Quantum::default().to_string(), "30");
        assert_eq!(q, 2.5);
        assert_eq!(Quantum::from_secs(0.001).unwrap().as_millis(), 1);
        assert_eq!(
            Quantum::from_secs(86_400.0).unwrap().as_millis(),
            86_400_000
        );
        assert_eq!(" 30 ".parse::<Quantum>().unwrap(), Quantum::default());
    }

    #[test]
    fn the_one_range_check() {
        for bad in ["0", "-3", "abc", "", "nan", "inf", "1e9", "0.0009"] {
            let e = bad.parse::<Quantum>().unwrap_err().to_string();
            assert!(e.starts_with("TQ must be"), "{bad}: {e}");
        }
        assert_eq!(
            Quantum::from_secs(0.0).unwrap_err().to_string(),
            "TQ must be a positive number of seconds, not 0"
        );
        assert_eq!(
            Quantum::from_secs(1e9).unwrap_err().to_string(),
            "TQ must be at most 86400 seconds (a day), not 1000000000"
        );
        assert_eq!(
            Quantum::from_secs(0.0001).unwrap_err().to_string(),
            "TQ must be at least 0.001 seconds, not 0.0001"
        );
        assert_eq!(
            "abc".parse::<Quantum>().unwrap_err().to_string(),
            "TQ must be a positive number of seconds, not \"abc\""
        );
    }

    #[test]
    fn the_wires_milliseconds_pass_the_same_range() {
        assert_eq!(Quantum::from_millis(1).unwrap().as_millis(), 1);
        assert_eq!(
            Quantum::from_millis(86_400_000).unwrap(),
            Quantum::from_secs(86_400.0).unwrap()
        );
        for bad in [0, 86_400_001, u64::MAX] {
            let e = Quantum::from_millis(bad).unwrap_err().to_string();
            assert_eq!(
                e,
                format!("TQ must be between 1 ms and one day, not {bad} ms")
            );
        }
    }
}
