//! `--ipc export:FILE` and `--ipc import:FILE`: two gpuburst processes that share
//! memory through CUDA IPC, and both verify it.
//!
//! The **exporter** allocates, beside its `--mem`, one `cuMemAlloc` of `--ipc-mem`
//! bytes, fills it with one value (derived from its seed), gets its handle
//! (`cuIpcGetMemHandle`) and publishes it in FILE: one line (see [`Published`]),
//! written to a temporary file then renamed, so an importer never reads half of it.
//! Nobody changes the shared memory afterwards: it is not part of the bursts'
//! additions, and each side's verification checks it holds the value.
//!
//! The **importer** waits (up to `--ipc-timeout-ms`) for FILE, opens the handle
//! (`cuIpcOpenMemHandle`) and adds the memory to its own, read only: its kernels
//! checksum it at every verification against the exporter's value. At its end it
//! closes the handle and creates `FILE.closed`.
//!
//! The exporter keeps the memory (and stays alive, as a CUDA IPC exporter must)
//! until `FILE.closed` appears, up to `--ipc-timeout-ms` (then exit code 4), then
//! verifies everything once more and frees it. A FILE or `FILE.closed` that already
//! exists is refused by the exporter: one fresh FILE per pair.
//!
//! This module owns the option's syntax and the two files; `burst` makes the driver
//! calls.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::driver::IpcMemHandle;

/// `--ipc-mem` when not given.
pub const DEFAULT_IPC_MEM: u64 = 32 << 20;
/// `--ipc-timeout-ms` when not given.
pub const DEFAULT_TIMEOUT_MS: u64 = 60_000;
/// The first word of FILE's line.
const MAGIC: &str = "gpuburst-ipc1";

/// Which side of the pair this process is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Export,
    Import,
}

impl Role {
    pub fn name(self) -> &'static str {
        match self {
            Role::Export => "export",
            Role::Import => "import",
        }
    }
}

/// A parsed `--ipc ROLE:FILE`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IpcSpec {
    pub role: Role,
    pub path: PathBuf,
}

/// Parses `export:FILE` or `import:FILE` (FILE may hold colons).
pub fn parse_ipc(s: &str) -> Result<IpcSpec, String> {
    let (role, file) = s
        .split_once(':')
        .ok_or_else(|| format!("--ipc: {s:?} is not export:FILE or import:FILE"))?;
    let role = match role {
        "export" => Role::Export,
        "import" => Role::Import,
        other => {
            return Err(format!(
                "--ipc: {other:?} is not a role (export:FILE or import:FILE)"
            ))
        }
    };
    if file.is_empty() {
        return Err("--ipc: no FILE after the role".into());
    }
    Ok(IpcSpec {
        role,
        path: PathBuf::from(file),
    })
}

/// What the exporter publishes in FILE: `gpuburst-ipc1 PID BYTES VALUE HANDLE`, the
/// handle as 128 hex digits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Published {
    pub pid: u32,
    pub bytes: u64,
    pub value: u32,
    pub handle: IpcMemHandle,
}

impl Published {
    pub fn line(&self) -> String {
        let hex: String = self
            .handle
            .reserved
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        format!("{MAGIC} {} {} {} {hex}\n", self.pid, self.bytes, self.value)
    }

    pub fn parse(text: &str) -> Result<Published, String> {
        let f: Vec<&str> = text.split_whitespace().collect();
        let bad = || format!("not an exporter's line ({MAGIC} PID BYTES VALUE HANDLE): {text:?}");
        if f.len() != 5 || f[0] != MAGIC || f[4].len() != 128 {
            return Err(bad());
        }
        let mut handle = IpcMemHandle { reserved: [0; 64] };
        for (i, b) in handle.reserved.iter_mut().enumerate() {
            *b = u8::from_str_radix(&f[4][2 * i..2 * i + 2], 16).map_err(|_| bad())?;
        }
        let bytes: u64 = f[2].parse().map_err(|_| bad())?;
        if bytes < 4 || !bytes.is_multiple_of(4) {
            return Err(bad());
        }
        Ok(Published {
            pid: f[1].parse().map_err(|_| bad())?,
            bytes,
            value: f[3].parse().map_err(|_| bad())?,
            handle,
        })
    }
}

/// The file the importer creates once it closed the memory.
pub fn closed_marker(path: &Path) -> PathBuf {
    let mut p = path.as_os_str().to_owned();
    p.push(".closed");
    PathBuf::from(p)
}

/// The exporter's check before any GPU work: FILE and its marker must not exist.
pub fn check_fresh(path: &Path) -> Result<(), String> {
    for p in [path.to_path_buf(), closed_marker(path)] {
        if p.exists() {
            return Err(format!(
                "--ipc export: {} already exists (use a fresh FILE per pair)",
                p.display()
            ));
        }
    }
    Ok(())
}

/// Writes `what` into FILE whole (a temporary file renamed over it).
pub fn publish(path: &Path, what: &Published) -> Result<(), String> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(format!(".tmp{}", std::process::id()));
    let tmp = PathBuf::from(tmp);
    std::fs::write(&tmp, what.line())
        .and_then(|()| std::fs::rename(&tmp, path))
        .map_err(|e| format!("--ipc export: cannot write {}: {e}", path.display()))
}

/// How a wait for the other side ended badly.
#[derive(Debug)]
pub enum WaitError {
    /// Nothing within the timeout.
    Timeout(String),
    /// FILE is there and is not an exporter's.
    Bad(String),
}

/// The importer's wait for FILE, polled every 10 ms.
pub fn wait_published(path: &Path, timeout: Duration) -> Result<Published, WaitError> {
    let deadline = Instant::now() + timeout;
    loop {
        match std::fs::read_to_string(path) {
            Ok(text) => {
                return Published::parse(&text)
                    .map_err(|e| WaitError::Bad(format!("--ipc import: {}: {e}", path.display())))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                return Err(WaitError::Bad(format!(
                    "--ipc import: cannot read {}: {e}",
                    path.display()
                )))
            }
        }
        if Instant::now() >= deadline {
            return Err(WaitError::Timeout(format!(
                "--ipc import: no exporter published {} within {} ms",
                path.display(),
                timeout.as_millis()
            )));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The importer's last word: it closed the memory.
pub fn mark_closed(path: &Path) -> Result<(), String> {
    let m = closed_marker(path);
    std::fs::write(&m, format!("{}\n", std::process::id()))
        .map_err(|e| format!("--ipc import: cannot create {}: {e}", m.display()))
}

/// The exporter's wait for the importer to close the memory, polled every 10 ms:
/// whether it did within `timeout`.
pub fn wait_closed(path: &Path, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    let m = closed_marker(path);
    while !m.exists() {
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse() {
        assert_eq!(
            parse_ipc("export:/dev/shm/a:b").unwrap(),
            IpcSpec {
                role: Role::Export,
                path: PathBuf::from("/dev/shm/a:b")
            }
        );
        assert_eq!(parse_ipc("import:f").unwrap().role, Role::Import);
        for bad in ["", "export", "export:", "both:f", ":f", "f"] {
            let e = parse_ipc(bad).unwrap_err();
            assert!(e.starts_with("--ipc"), "{bad}: {e}");
        }
    }

    #[test]
    fn a_published_line_reads_back() {
        let mut handle = IpcMemHandle { reserved: [0; 64] };
        for (i, b) in handle.reserved.iter_mut().enumerate() {
            *b = (i * 37) as u8;
        }
        let p = Published {
            pid: 42,
            bytes: 32 << 20,
            value: 0xdead_beef,
            handle,
        };
        assert_eq!(Published::parse(&p.line()), Ok(p.clone()));
        let line = p.line();
        for bad in [
            String::new(),
            line.replace(MAGIC, "gpuburst-ipc0"),
            line.replace(" 33554432 ", " 33554431 "),
            line[..line.len() - 3].to_string(),
            line.replace("42 ", "x "),
        ] {
            assert!(Published::parse(&bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn files_are_fresh_published_and_closed() {
        let dir = tempfile_dir();
        let f = dir.join("pair");
        assert!(check_fresh(&f).is_ok());
        let p = Published {
            pid: 1,
            bytes: 4096,
            value: 3,
            handle: IpcMemHandle { reserved: [9; 64] },
        };
        publish(&f, &p).unwrap();
        assert!(check_fresh(&f).is_err());
        assert_eq!(wait_published(&f, Duration::ZERO).unwrap(), p);
        assert!(!wait_closed(&f, Duration::from_millis(20)));
        mark_closed(&f).unwrap();
        assert!(wait_closed(&f, Duration::ZERO));
        std::fs::remove_file(&f).unwrap();
        let e = check_fresh(&f).unwrap_err();
        assert!(e.contains(".closed"), "{e}");
        assert!(matches!(
            wait_published(&dir.join("none"), Duration::from_millis(20)),
            Err(WaitError::Timeout(_))
        ));
        std::fs::write(dir.join("junk"), "hello").unwrap();
        assert!(matches!(
            wait_published(&dir.join("junk"), Duration::ZERO),
            Err(WaitError::Bad(_))
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    fn tempfile_dir() -> PathBuf {
        let d = std::env::temp_dir().join(format!(
            "gpuburst-ipc-test-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }
}
