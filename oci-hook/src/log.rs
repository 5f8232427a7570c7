//! The log of `kiwi-runtime` and `kiwi-hook`. They have no terminal of their own, so
//! lines go to stderr (which containerd, docker and runc show on failure), to
//! `runtime.log_path` when configured, and errors also to runc's `--log` file in its
//! JSON format, where containerd's shim looks for the reason a `create` failed.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

/// Appends log lines; never fails (a log that cannot be written must not stop a
/// container that would otherwise start).
#[derive(Debug, Clone)]
pub struct Logger {
    component: &'static str,
    file: Option<PathBuf>,
}

/// RFC 3339 UTC time with milliseconds, e.g. `2026-11-22T04:05:06.789Z`.
pub fn rfc3339_now() -> String {
    let d = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    let secs = d.as_secs() as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Civil-from-days (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        d.subsec_millis()
    )
}

/// Messages are one line: multi-line causes (TOML parser messages) are joined with "; ".
pub fn one_line(msg: &str) -> String {
    msg.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join("; ")
}

impl Logger {
    pub fn new(component: &'static str, file: Option<PathBuf>) -> Self {
        Self { component, file }
    }

    fn append(&self, level: &str, msg: &str) {
        if let Some(path) = &self.file {
            let line = format!(
                "{} {}[{}] {level}: {msg}\n",
                rfc3339_now(),
                self.component,
                std::process::id()
            );
            if let Ok(mut f) = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
            {
                let _ = f.write_all(line.as_bytes());
            }
        }
    }

    /// Goes to the log file only.
    pub fn info(&self, msg: &str) {
        self.append("info", msg);
    }

    /// Goes to the log file and stderr.
    pub fn warn(&self, msg: &str) {
        let msg = &one_line(msg);
        self.append("warning", msg);
        eprintln!("{}: warning: {msg}", self.component);
    }

    /// Goes to the log file, stderr, and runc's `--log` file when one is given.
    pub fn error(&self, msg: &str, runc_log: Option<(&Path, Option<&str>)>) {
        let msg = &one_line(msg);
        self.append("error", msg);
        eprintln!("{}: {msg}", self.component);
        if let Some((path, format)) = runc_log {
            let line = if format == Some("json") {
                let mut s = serde_json::json!({
                    "level": "error",
                    "msg": format!("{}: {msg}", self.component),
                    "time": rfc3339_now(),
                })
                .to_string();
                s.push('\n');
                s
            } else {
                format!(
                    "time=\"{}\" level=error msg=\"{}: {}\"\n",
                    rfc3339_now(),
                    self.component,
                    msg.replace('"', "'")
                )
            };
            if let Ok(mut f) = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
            {
                let _ = f.write_all(line.as_bytes());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn time_format_is_rfc3339() {
        let t = rfc3339_now();
        assert_eq!(t.len(), 24, "{t}");
        assert!(
            t.starts_with("20") && t.ends_with('Z') && t.as_bytes()[10] == b'T',
            "{t}"
        );
    }

    #[test]
    fn errors_reach_file_and_runc_json_log() {
        let dir = tempfile::tempdir().unwrap();
        let own = dir.path().join("kiwi.log");
        let runc = dir.path().join("log.json");
        let l = Logger::new("kiwi-runtime", Some(own.clone()));
        l.info("hello");
        l.error("shim missing", Some((&runc, Some("json"))));
        let text = std::fs::read_to_string(&own).unwrap();
        assert!(
            text.contains("info: hello") && text.contains("error: shim missing"),
            "{text}"
        );
        let j: serde_json::Value =
            serde_json::from_str(std::fs::read_to_string(&runc).unwrap().trim()).unwrap();
        assert_eq!(j["level"], "error");
        assert_eq!(j["msg"], "kiwi-runtime: shim missing");
    }
}
