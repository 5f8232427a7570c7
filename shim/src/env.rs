//! The shim's environment knobs, parsed once. Bad values are logged and replaced by the
//! default: a typo in an env var must never take the application down.

use std::path::PathBuf;
use std::time::Duration;

/// Everything the shim reads from its environment.
#[derive(Debug, Clone)]
pub struct ShimEnv {
    /// `KIWI_SOCKET_DIR`, else `/run/kiwi`.
    pub socket_dir: PathBuf,
    /// `KIWI_ARBITER_TIMEOUT` (default 30 s): how long to wait for the arbiter at start.
    pub arbiter_timeout: Duration,
    /// `KIWI_REQUIRE_ARBITER=1`: fail `cuInit` instead of running unmanaged.
    pub require_arbiter: bool,
    /// `KIWI_IDLE_MS` (default 100 ms): the longest a contended holder stays idle
    /// before it releases (sooner once its own pauses are known, see `crate::idle`).
    pub idle: Duration,
    /// `KIWI_IDLE_MIN_MS` (default 10 ms): the shortest; at or above `KIWI_IDLE_MS`,
    /// the threshold is `KIWI_IDLE_MS`, whatever the pauses.
    pub idle_min: Duration,
    /// `KIWI_PIPELINED` (default on; `0` turns it off): say `drained` when dropped or
    /// releasing early, so that the next holder's swap-in runs beside this one's
    /// swap-out. Off, each swap has the link to itself (the swap benchmark measures
    /// that); buffers are still pinned ahead on `pressure`.
    pub pipelined: bool,
    /// `KIWI_REAL_LIBCUDA`: path of the real driver (default `libcuda.so.1`).
    pub real_libcuda: Option<String>,
    /// `KIWI_STATS`: file the shim writes its counters to at exit.
    pub stats_file: Option<PathBuf>,
    /// `KIWI_HINT_WAIT_MS` (default 10 ms): how long a swap-out waits for the
    /// application's answer to which of its memory is dead (`crate::hint`), when a
    /// thread of it waits for such questions. The next tenant waits for that
    /// swap-out: at most the arbiter's bound (`bounds` at registration, `kiwi-arbiter
    /// --max-hint-wait-ms`, default 100 ms) is used.
    pub hint_wait: Duration,
    /// `KIWI_NVML_VIEW` (default on; `0` turns it off): NVML in this process answers
    /// for its own view of the GPU (`crate::view`), as `cuMemGetInfo` does.
    pub nvml_view: bool,
}

/// Parses a duration: plain number = `default_unit`; suffixes `ms`, `s`.
pub fn parse_duration(s: &str, default_unit_ms: f64) -> Option<Duration> {
    let s = s.trim();
    let (num, mul) = if let Some(n) = s.strip_suffix("ms") {
        (n, 1.0)
    } else if let Some(n) = s.strip_suffix('s') {
        (n, 1000.0)
    } else {
        (s, default_unit_ms)
    };
    let v: f64 = num.trim().parse().ok()?;
    if !v.is_finite() || v < 0.0 {
        return None;
    }
    // Past `Duration`'s range (`1e30`) is not a duration either: never a panic.
    Duration::try_from_secs_f64(v * mul / 1000.0).ok()
}

fn flag(v: Option<String>) -> bool {
    matches!(
        v.as_deref().map(str::trim),
        Some("1") | Some("true") | Some("yes") | Some("on")
    )
}

impl ShimEnv {
    /// Reads the process environment.
    pub fn from_env() -> Self {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// Reads from any lookup function (tests pass a map).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Self {
        let dur = |key: &str, unit_ms: f64, default: Duration| match get(key) {
            None => default,
            Some(v) => parse_duration(&v, unit_ms).unwrap_or_else(|| {
                crate::kwarn!("{key}={v:?} is not a duration; using {default:?}");
                default
            }),
        };
        Self {
            socket_dir: get("KIWI_SOCKET_DIR")
                .filter(|s| !s.is_empty())
                .map(PathBuf::from)
                .unwrap_or_else(|| PathBuf::from("/run/kiwi")),
            arbiter_timeout: dur("KIWI_ARBITER_TIMEOUT", 1000.0, Duration::from_secs(30)),
            require_arbiter: flag(get("KIWI_REQUIRE_ARBITER")),
            idle: dur("KIWI_IDLE_MS", 1.0, Duration::from_millis(100)),
            idle_min: dur("KIWI_IDLE_MIN_MS", 1.0, Duration::from_millis(10)),
            pipelined: !get("KIWI_PIPELINED")
                .is_some_and(|v| matches!(v.trim(), "0" | "false" | "no" | "off")),
            real_libcuda: get("KIWI_REAL_LIBCUDA").filter(|s| !s.is_empty()),
            stats_file: get("KIWI_STATS")
                .filter(|s| !s.is_empty())
                .map(PathBuf::from),
            hint_wait: dur("KIWI_HINT_WAIT_MS", 1.0, Duration::from_millis(10)),
            nvml_view: !get("KIWI_NVML_VIEW")
                .is_some_and(|v| matches!(v.trim(), "0" | "false" | "no" | "off")),
        }
    }

    /// `<socket dir>/client/arbiter.sock`.
    pub fn client_socket(&self) -> PathBuf {
        self.socket_dir.join("client").join("arbiter.sock")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn defaults_and_overrides() {
        let e = ShimEnv::from_lookup(|_| None);
        assert_eq!(e.socket_dir, PathBuf::from("/run/kiwi"));
        assert_eq!(e.arbiter_timeout, Duration::from_secs(30));
        assert_eq!(e.idle, Duration::from_millis(100));
        assert_eq!(e.idle_min, Duration::from_millis(10));
        assert!(e.pipelined);
        assert!(!e.require_arbiter);
        assert_eq!(e.hint_wait, Duration::from_millis(10));
        assert_eq!(
            e.client_socket(),
            PathBuf::from("/run/kiwi/client/arbiter.sock")
        );

        let m: HashMap<&str, &str> = [
            ("KIWI_SOCKET_DIR", "/tmp/k"),
            ("KIWI_ARBITER_TIMEOUT", "2.5"),
            ("KIWI_IDLE_MS", "250"),
            ("KIWI_IDLE_MIN_MS", "40"),
            ("KIWI_PIPELINED", "0"),
            ("KIWI_REQUIRE_ARBITER", "1"),
        ]
        .into();
        let e = ShimEnv::from_lookup(|k| m.get(k).map(|s| s.to_string()));
        assert_eq!(e.arbiter_timeout, Duration::from_millis(2500));
        assert_eq!(e.idle, Duration::from_millis(250));
        assert_eq!(e.idle_min, Duration::from_millis(40));
        assert!(!e.pipelined);
        assert!(e.require_arbiter);
        assert_eq!(
            e.client_socket(),
            PathBuf::from("/tmp/k/client/arbiter.sock")
        );
    }

    #[test]
    fn bad_values_fall_back() {
        let e = ShimEnv::from_lookup(|k| (k == "KIWI_IDLE_MS").then(|| "soon".to_string()));
        assert_eq!(e.idle, Duration::from_millis(100));
        assert_eq!(parse_duration("-1", 1.0), None);
        assert_eq!(parse_duration("1e30", 1.0), None);
        assert_eq!(parse_duration("3s", 1.0), Some(Duration::from_secs(3)));
        assert_eq!(
            parse_duration("40ms", 1000.0),
            Some(Duration::from_millis(40))
        );
    }
}
