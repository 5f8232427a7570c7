//! The kernel trace: one line per kernel, `pid device start_ns end_ns name`,
//! whitespace-separated, times from `CLOCK_MONOTONIC` (comparable across processes
//! on one host). Writers open the file with `O_APPEND` and emit each line with a
//! single `write`, so lines of concurrent processes never interleave.
//!
//! The analysis half answers the question tests ask: did two processes ever run
//! kernels at the same time?

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// Nanoseconds of `CLOCK_MONOTONIC`: Kiwi's one clock, `kiwi_protocol`'s, so traces
/// compare directly with the arbiter's event log.
pub use kiwi_protocol::monotonic_ns;

/// One executed kernel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceRecord {
    pub pid: u32,
    pub device: u32,
    pub start_ns: u64,
    pub end_ns: u64,
    pub name: String,
}

/// A trace line that does not parse.
#[derive(Debug, thiserror::Error, PartialEq)]
#[error("trace line {line}: {reason}: {text:?}")]
pub struct TraceParseError {
    pub line: usize,
    pub reason: &'static str,
    pub text: String,
}

impl TraceRecord {
    /// The line as written to the trace file (with the newline).
    pub fn to_line(&self) -> String {
        format!(
            "{} {} {} {} {}\n",
            self.pid, self.device, self.start_ns, self.end_ns, self.name
        )
    }

    /// Parses one line (1-based `line` for the error message).
    pub fn parse(text: &str, line: usize) -> Result<TraceRecord, TraceParseError> {
        let err = |reason| TraceParseError {
            line,
            reason,
            text: text.to_string(),
        };
        let mut f = text.split_whitespace();
        let mut num = |what| -> Result<u64, TraceParseError> {
            f.next().ok_or(err(what))?.parse().map_err(|_| err(what))
        };
        let pid = num("bad pid")? as u32;
        let device = num("bad device")? as u32;
        let start_ns = num("bad start_ns")?;
        let end_ns = num("bad end_ns")?;
        let name = f.next().ok_or(err("missing name"))?.to_string();
        if end_ns < start_ns {
            return Err(err("end before start"));
        }
        Ok(TraceRecord {
            pid,
            device,
            start_ns,
            end_ns,
            name,
        })
    }
}

/// Parses a whole trace (blank lines ignored).
pub fn parse_trace(text: &str) -> Result<Vec<TraceRecord>, TraceParseError> {
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| TraceRecord::parse(l, i + 1))
        .collect()
}

/// Errors reading a trace file.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: {source}")]
    Parse {
        path: String,
        source: TraceParseError,
    },
}

/// Reads and parses a trace file.
pub fn read_trace(path: &Path) -> Result<Vec<TraceRecord>, TraceError> {
    let text = std::fs::read_to_string(path).map_err(|source| TraceError::Io {
        path: path.display().to_string(),
        source,
    })?;
    parse_trace(&text).map_err(|source| TraceError::Parse {
        path: path.display().to_string(),
        source,
    })
}

/// Appends trace lines; one `write(2)` per line on an `O_APPEND` descriptor.
pub struct TraceWriter {
    file: File,
}

impl TraceWriter {
    pub fn open(path: &Path) -> std::io::Result<TraceWriter> {
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o666)
            .open(path)?;
        Ok(TraceWriter { file })
    }

    pub fn append(&self, rec: &TraceRecord) -> std::io::Result<()> {
        let line = rec.to_line();
        // One write: O_APPEND makes it atomic with respect to other appenders for
        // lines this short.
        let n = (&self.file).write(line.as_bytes())?;
        if n != line.len() {
            return Err(std::io::Error::other("short write to trace file"));
        }
        Ok(())
    }
}

/// The first pair of kernels, one of `pid_a` and one of `pid_b`, whose intervals
/// overlap by more than `slack_ns`; with `device`, only kernels on that device count.
pub fn first_overlap(
    records: &[TraceRecord],
    pid_a: u32,
    pid_b: u32,
    device: Option<u32>,
    slack_ns: u64,
) -> Option<(TraceRecord, TraceRecord)> {
    let on = |r: &&TraceRecord| device.is_none_or(|d| r.device == d);
    let a: Vec<&TraceRecord> = records
        .iter()
        .filter(|r| r.pid == pid_a)
        .filter(on)
        .collect();
    let mut b: Vec<&TraceRecord> = records
        .iter()
        .filter(|r| r.pid == pid_b)
        .filter(on)
        .collect();
    b.sort_by_key(|r| r.start_ns);
    for x in a {
        // Only b's that start before x ends can overlap it.
        let upto = b.partition_point(|r| r.start_ns < x.end_ns);
        for y in &b[..upto] {
            let overlap = x
                .end_ns
                .min(y.end_ns)
                .saturating_sub(x.start_ns.max(y.start_ns));
            if overlap > slack_ns {
                return Some((x.clone(), (*y).clone()));
            }
        }
    }
    None
}

/// Did processes `pid_a` and `pid_b` ever run kernels at the same time (on any
/// device)? On one simulated GPU this must never happen.
pub fn ran_concurrently(records: &[TraceRecord], pid_a: u32, pid_b: u32) -> bool {
    first_overlap(records, pid_a, pid_b, None, 0).is_some()
}

/// Did the wall-time spans of the two processes' kernels (first start to last end)
/// intersect? True when they shared the GPU side by side, interleaving kernels.
pub fn spans_overlap(records: &[TraceRecord], pid_a: u32, pid_b: u32) -> bool {
    match (span(records, pid_a), span(records, pid_b)) {
        (Some((a0, a1)), Some((b0, b1))) => a0 < b1 && b0 < a1,
        _ => false,
    }
}

/// Distinct pids in a trace, in order of first appearance.
pub fn pids(records: &[TraceRecord]) -> Vec<u32> {
    let mut out = Vec::new();
    for r in records {
        if !out.contains(&r.pid) {
            out.push(r.pid);
        }
    }
    out
}

/// Wall-time span `(first start, last end)` of `pid`'s kernels.
pub fn span(records: &[TraceRecord], pid: u32) -> Option<(u64, u64)> {
    let mine = records.iter().filter(|r| r.pid == pid);
    let start = mine.clone().map(|r| r.start_ns).min()?;
    let end = mine.map(|r| r.end_ns).max()?;
    Some((start, end))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(pid: u32, device: u32, s: u64, e: u64) -> TraceRecord {
        TraceRecord {
            pid,
            device,
            start_ns: s,
            end_ns: e,
            name: "k".into(),
        }
    }

    #[test]
    fn line_round_trip() {
        let x = r(12, 1, 100, 250);
        let back = parse_trace(&x.to_line()).unwrap();
        assert_eq!(back, vec![x]);
    }

    #[test]
    fn malformed_lines_are_reported_with_their_number() {
        let e = parse_trace("1 0 5 9 k\n1 0 x 9 k\n").unwrap_err();
        assert_eq!(e.line, 2);
        assert!(parse_trace("1 0 9 5 k").is_err(), "end before start");
        assert!(parse_trace("1 0 5 9").is_err(), "missing name");
    }

    #[test]
    fn overlap_detection() {
        let serial = vec![r(1, 0, 0, 10), r(2, 0, 10, 20), r(1, 0, 20, 30)];
        assert!(!ran_concurrently(&serial, 1, 2));
        let overlapping = vec![r(1, 0, 0, 10), r(2, 0, 5, 20)];
        assert!(ran_concurrently(&overlapping, 1, 2));
        assert!(ran_concurrently(&overlapping, 2, 1));
        // Different devices: concurrent, but not on one device.
        let two_gpus = vec![r(1, 0, 0, 10), r(2, 1, 5, 20)];
        assert!(ran_concurrently(&two_gpus, 1, 2));
        assert!(first_overlap(&two_gpus, 1, 2, Some(0), 0).is_none());
        // Slack tolerates touching intervals.
        assert!(first_overlap(&overlapping, 1, 2, None, 5).is_none());
        assert!(spans_overlap(&serial, 1, 2));
        assert!(!spans_overlap(&[r(1, 0, 0, 10), r(2, 0, 10, 20)], 1, 2));
        assert_eq!(span(&serial, 1), Some((0, 30)));
        assert_eq!(pids(&serial), vec![1, 2]);
    }

    #[test]
    fn writer_appends_whole_lines() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("t");
        let w = TraceWriter::open(&p).unwrap();
        w.append(&r(1, 0, 1, 2)).unwrap();
        TraceWriter::open(&p)
            .unwrap()
            .append(&r(2, 0, 3, 4))
            .unwrap();
        assert_eq!(read_trace(&p).unwrap(), vec![r(1, 0, 1, 2), r(2, 0, 3, 4)]);
    }
}
