//! `[kiwi]`-prefixed log lines on stderr, filtered by `KIWI_LOG`
//! (`error`, `warn` (default), `info`, `debug`). Writing never panics and never
//! allocates more than the formatted line.

use std::io::Write;
use std::sync::atomic::{AtomicU8, Ordering};

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
pub enum Level {
    Error = 1,
    Warn = 2,
    Info = 3,
    Debug = 4,
}

/// 0 = not read yet.
static LEVEL: AtomicU8 = AtomicU8::new(0);

pub fn parse_level(s: &str) -> Option<Level> {
    match s.trim().to_ascii_lowercase().as_str() {
        "error" => Some(Level::Error),
        "warn" | "warning" => Some(Level::Warn),
        "info" => Some(Level::Info),
        "debug" | "trace" => Some(Level::Debug),
        _ => None,
    }
}

pub fn enabled(level: Level) -> bool {
    let mut cur = LEVEL.load(Ordering::Relaxed);
    if cur == 0 {
        cur = std::env::var("KIWI_LOG")
            .ok()
            .and_then(|v| parse_level(&v))
            .unwrap_or(Level::Warn) as u8;
        LEVEL.store(cur, Ordering::Relaxed);
    }
    level as u8 <= cur
}

pub fn write(level: Level, args: std::fmt::Arguments<'_>) {
    if !enabled(level) {
        return;
    }
    let tag = match level {
        Level::Error => "error",
        Level::Warn => "warn",
        Level::Info => "info",
        Level::Debug => "debug",
    };
    let pid = std::process::id();
    let line = if level == Level::Debug {
        // Debug lines carry CLOCK_MONOTONIC (ms), the clock of the arbiter's event log.
        let t = kiwi_protocol::monotonic_ns();
        format!(
            "[kiwi] {tag}: pid {pid}: {}.{:03} ms: {args}\n",
            t / 1_000_000,
            t / 1_000 % 1_000
        )
    } else {
        format!("[kiwi] {tag}: pid {pid}: {args}\n")
    };
    // One write call per line so lines from several threads do not interleave.
    let _ = std::io::stderr().write_all(line.as_bytes());
}

/// 0 = not read yet, 1 = shown, 2 = silenced.
static EXPLAIN: AtomicU8 = AtomicU8::new(0);

/// Whether the two lines that explain a wait are shown: they are `info` lines, but a
/// person waiting should see them without asking, so they show unless `KIWI_LOG`
/// asks for less than `info` (`warn`, `error`).
pub fn explain_enabled() -> bool {
    let mut cur = EXPLAIN.load(Ordering::Relaxed);
    if cur == 0 {
        let quiet = std::env::var("KIWI_LOG")
            .ok()
            .and_then(|v| parse_level(&v))
            .is_some_and(|l| l < Level::Info);
        cur = if quiet { 2 } else { 1 };
        EXPLAIN.store(cur, Ordering::Relaxed);
    }
    cur == 1
}

/// Shows (`true`) or silences the lines that explain a wait, whatever `KIWI_LOG`
/// said; returns whether they were shown. The notebook extension silences them while
/// it shows its own live line.
pub fn set_explain(on: bool) -> bool {
    let was = explain_enabled();
    EXPLAIN.store(if on { 1 } else { 2 }, Ordering::Relaxed);
    was
}

/// Writes a line explaining a wait, as an `info` line (see [`explain_enabled`]).
pub fn explain(args: std::fmt::Arguments<'_>) {
    if !explain_enabled() {
        return;
    }
    let line = format!("[kiwi] info: pid {}: {args}\n", std::process::id());
    let _ = std::io::stderr().write_all(line.as_bytes());
}

#[macro_export]
macro_rules! kwarn { ($($a:tt)*) => { $crate::log::write($crate::log::Level::Warn, format_args!($($a)*)) } }
#[macro_export]
macro_rules! kerror { ($($a:tt)*) => { $crate::log::write($crate::log::Level::Error, format_args!($($a)*)) } }
#[macro_export]
macro_rules! kinfo { ($($a:tt)*) => { $crate::log::write($crate::log::Level::Info, format_args!($($a)*)) } }
#[macro_export]
macro_rules! kdebug { ($($a:tt)*) => { $crate::log::write($crate::log::Level::Debug, format_args!($($a)*)) } }

/// At most `burst` lines per 10 s for one kind of warning; the rest are counted and
/// the count is told in the next line allowed, so a flood of bad peers cannot fill the
/// application's stderr. Used from one thread (no lock).
pub struct Throttle {
    burst: u32,
    window_start: Option<std::time::Instant>,
    in_window: u32,
    suppressed: u64,
}

impl Throttle {
    const WINDOW: std::time::Duration = std::time::Duration::from_secs(10);

    pub const fn new(burst: u32) -> Self {
        Self {
            burst,
            window_start: None,
            in_window: 0,
            suppressed: 0,
        }
    }

    /// `Some(note)` when a line may be written now: the note says how many were left
    /// out before it (empty when none).
    pub fn allow(&mut self) -> Option<String> {
        let now = std::time::Instant::now();
        if self
            .window_start
            .is_none_or(|w| now.duration_since(w) >= Self::WINDOW)
        {
            self.window_start = Some(now);
            self.in_window = 0;
        }
        if self.in_window >= self.burst {
            self.suppressed += 1;
            return None;
        }
        self.in_window += 1;
        Some(match std::mem::take(&mut self.suppressed) {
            0 => String::new(),
            n => format!(" ({n} more like it left out)"),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_parse() {
        assert_eq!(parse_level("WARN"), Some(Level::Warn));
        assert_eq!(parse_level(" debug "), Some(Level::Debug));
        assert_eq!(parse_level("loud"), None);
        assert!(Level::Error < Level::Debug);
    }
}
