//! The daemon's log lines. Peers' text reaches them (a GPU UUID, a serde error
//! quoting their bytes), so every line is made safe ([`log_safe`]: escaped, cut),
//! and warnings about peers go through a shared `Throttle` (`warn_throttled!`).
//! Declared first in `server.rs`, so every module after it has the macros.

/// Longest log line; longer ones are cut (a peer's text could otherwise flood it).
const MAX_LOG_LINE: usize = 2048;

/// One log line, made safe: control characters (a newline would forge a line) are
/// escaped and the line is cut to [`MAX_LOG_LINE`] bytes.
pub(super) fn log_safe(line: &str) -> std::borrow::Cow<'_, str> {
    if line.len() <= MAX_LOG_LINE && !line.chars().any(kiwi_protocol::is_forbidden_char) {
        return line.into();
    }
    let mut out = String::with_capacity(line.len().min(MAX_LOG_LINE) + 32);
    for c in line.chars() {
        if out.len() >= MAX_LOG_LINE {
            out.push_str(&format!("… ({} bytes in all)", line.len()));
            break;
        }
        if kiwi_protocol::is_forbidden_char(c) {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out.into()
}

macro_rules! log_line {
    ($lvl:literal, $($arg:tt)*) => {
        eprintln!(
            concat!("[", $lvl, "] {}"),
            $crate::server::logging::log_safe(&format!($($arg)*))
        )
    };
}

/// Warns through a shared [`Throttle`](super::limits::Throttle).
macro_rules! warn_throttled {
    ($throttle:expr, $($arg:tt)*) => {
        let allowed = $throttle.lock().unwrap_or_else(|e| e.into_inner()).allow();
        if let Some(note) = allowed {
            log_line!("WARN", "{}{note}", format_args!($($arg)*));
        }
    };
}
