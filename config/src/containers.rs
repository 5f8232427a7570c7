//! Per-container client sockets: where they live and the record that says whose each
//! one is.
//!
//! `kiwi-hook` (prestart) writes `<socket-dir>/containers/<key>.json` for a claimed
//! container and asks the arbiter, over the control socket, to serve
//! `<socket-dir>/containers/<key>/arbiter.sock`; that directory, not the node's
//! `client/`, is what the container gets at `/run/kiwi/client`. Everything said on
//! the socket is that container's: the arbiter takes the identity and the GPUs from
//! the record, never from the client. The record outlives an arbiter restart (the
//! arbiter serves every record whose container still runs when it starts) and goes,
//! with the directory, at `kiwi-hook poststop`.
//!
//! Only root writes here, and only root reads: `<socket-dir>/containers` is mode
//! 0700 (made so, and tightened where an older version left it 0755), so host users
//! can neither reach a container's socket nor read its record (0600), while inside
//! the container, where the `<key>` directory (0755, its socket 0666) is bound at
//! `/run/kiwi/client`, the path never passes through `containers/` and any uid
//! connects. The arbiter refuses a record that is not its own user's or root's, or
//! that others may write.

use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// Name of the socket inside each container's directory (the node's has the same
/// name, so the shim finds either at `/run/kiwi/client/arbiter.sock`).
pub const SOCKET_NAME: &str = "arbiter.sock";
/// The longest key: a container id's first characters.
pub const MAX_KEY_LEN: usize = 32;
/// The longest text field in a record (ids, names, UUIDs).
pub const MAX_FIELD_LEN: usize = 253;
/// The most GPUs a record may name.
pub const MAX_GPUS: usize = 64;
/// A Unix socket path must fit `sun_path` (108 bytes with its NUL).
pub const MAX_SOCKET_PATH: usize = 107;
/// `<socket-dir>/containers`: root's (or the arbiter's own user's) alone.
pub const CONTAINERS_DIR_MODE: u32 = 0o700;
/// `<socket-dir>/containers/<key>`: what the container sees at `/run/kiwi/client`,
/// traversable by every uid inside it.
pub const CONTAINER_DIR_MODE: u32 = 0o755;
/// `<socket-dir>/containers/<key>.json`.
pub const RECORD_MODE: u32 = 0o600;

/// `<socket-dir>/containers`.
pub fn containers_dir(socket_dir: &Path) -> PathBuf {
    socket_dir.join("containers")
}

/// `<socket-dir>/containers/<key>`: the directory a container gets mounted.
pub fn container_dir(socket_dir: &Path, key: &str) -> PathBuf {
    containers_dir(socket_dir).join(key)
}

/// `<socket-dir>/containers/<key>/arbiter.sock`.
pub fn container_socket(socket_dir: &Path, key: &str) -> PathBuf {
    container_dir(socket_dir, key).join(SOCKET_NAME)
}

/// `<socket-dir>/containers/<key>.json`: outside the mounted directory, so the
/// container never sees it.
pub fn record_path(socket_dir: &Path, key: &str) -> PathBuf {
    containers_dir(socket_dir).join(format!("{key}.json"))
}

/// The key of a container id: its first [`MAX_KEY_LEN`] characters, which must be
/// letters, digits, `_`, `-`, `.` or `+` (what runc accepts in an id).
pub fn key_for(id: &str) -> Result<String, ContainerError> {
    let bad = |why: &str| ContainerError::BadId {
        id: id.chars().take(80).collect(),
        why: why.to_string(),
    };
    if id.is_empty() {
        return Err(bad("empty"));
    }
    if !id
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.' | b'+'))
        || id.starts_with('.')
    {
        return Err(bad("only letters, digits, _ - . + are allowed"));
    }
    Ok(id.chars().take(MAX_KEY_LEN).collect())
}

/// Whose a container socket is, as the hook saw it in the container's spec.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ContainerRecord {
    /// The runtime's container id.
    pub id: String,
    /// Kubernetes: `io.kubernetes.cri.sandbox-name`; docker: the container's name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_name: Option<String>,
    /// Kubernetes: `io.kubernetes.cri.sandbox-namespace`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_namespace: Option<String>,
    /// Kubernetes: `io.kubernetes.cri.container-name`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container_name: Option<String>,
    /// The GPU UUIDs the container claimed; registrations for others are refused.
    pub gpus: Vec<String>,
    /// Set when a claimed GPU could not be named by UUID (an index claim on a node
    /// without NVML or a GPU list): the container may register on any GPU.
    #[serde(default)]
    pub any_gpu: bool,
    /// The container's init process on the host, and its start time (clock ticks
    /// since boot, `/proc/<pid>/stat` field 22): a record whose process is gone is
    /// stale.
    pub pid: i32,
    pub pid_start: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum ContainerError {
    #[error("container id {id:?} cannot name a socket: {why}")]
    BadId { id: String, why: String },
    #[error("the container record {path}: {why}")]
    Invalid { path: PathBuf, why: String },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> ContainerError + '_ {
    move |source| ContainerError::Io {
        path: path.to_path_buf(),
        source,
    }
}

impl ContainerRecord {
    /// Checks every field's size and characters (the values reach logs and status).
    pub fn validate(&self) -> Result<(), String> {
        let text = |name: &str, v: &str| -> Result<(), String> {
            if v.is_empty() || v.len() > MAX_FIELD_LEN || v.chars().any(char::is_control) {
                return Err(format!(
                    "{name} must be 1 to {MAX_FIELD_LEN} bytes without control characters"
                ));
            }
            Ok(())
        };
        key_for(&self.id).map_err(|e| e.to_string())?;
        text("id", &self.id)?;
        for (name, v) in [
            ("pod_name", &self.pod_name),
            ("pod_namespace", &self.pod_namespace),
            ("container_name", &self.container_name),
        ] {
            if let Some(v) = v {
                text(name, v)?;
            }
        }
        if self.gpus.len() > MAX_GPUS {
            return Err(format!("more than {MAX_GPUS} GPUs"));
        }
        for g in &self.gpus {
            text("gpus", g)?;
        }
        if self.gpus.is_empty() && !self.any_gpu {
            return Err("no GPU claimed".into());
        }
        if self.pid <= 0 {
            return Err("pid must be positive".into());
        }
        Ok(())
    }

    /// Whether the container's init process still runs (same pid, same start time).
    pub fn is_running(&self) -> bool {
        process_start(self.pid) == Some(self.pid_start)
    }

    /// Writes the record atomically (a temporary file renamed over it), mode 0600,
    /// creating `<socket-dir>/containers` (0700, or tightening it to that) and the
    /// container's directory (0755). Refuses to replace another container's record
    /// with the same key.
    pub fn write(&self, socket_dir: &Path) -> Result<PathBuf, ContainerError> {
        self.validate().map_err(|why| ContainerError::Invalid {
            path: socket_dir.to_path_buf(),
            why,
        })?;
        let key = key_for(&self.id)?;
        let sock = container_socket(socket_dir, &key);
        if sock.as_os_str().len() > MAX_SOCKET_PATH {
            return Err(ContainerError::Invalid {
                path: sock,
                why: format!("longer than a socket path may be ({MAX_SOCKET_PATH} bytes); use a shorter socket directory"),
            });
        }
        let top = containers_dir(socket_dir);
        make_dir(&top, CONTAINERS_DIR_MODE)?;
        let path = record_path(socket_dir, &key);
        if let Ok(old) = Self::read(&path) {
            if old.id != self.id {
                return Err(ContainerError::Invalid {
                    path,
                    why: format!(
                        "container {} and {} share the key {key}; ids must differ in their first {MAX_KEY_LEN} characters",
                        old.id, self.id
                    ),
                });
            }
        }
        make_dir(&container_dir(socket_dir, &key), CONTAINER_DIR_MODE)?;
        let tmp = top.join(format!(".{key}.json.tmp"));
        let body = serde_json::to_vec_pretty(self).map_err(|e| ContainerError::Invalid {
            path: path.clone(),
            why: e.to_string(),
        })?;
        let _ = std::fs::remove_file(&tmp);
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(RECORD_MODE)
            .open(&tmp)
            .map_err(io(&tmp))?;
        f.write_all(&body).map_err(io(&tmp))?;
        f.sync_all().map_err(io(&tmp))?;
        std::fs::rename(&tmp, &path).map_err(io(&path))?;
        Ok(path)
    }

    /// Reads a record, refusing one that others than its owner may write or whose
    /// owner is neither root nor us (a host user must not be able to plant one).
    pub fn read(path: &Path) -> Result<ContainerRecord, ContainerError> {
        let invalid = |why: String| ContainerError::Invalid {
            path: path.to_path_buf(),
            why,
        };
        let meta = std::fs::symlink_metadata(path).map_err(io(path))?;
        check_owner(&meta).map_err(invalid)?;
        if !meta.is_file() {
            return Err(invalid("not a regular file".into()));
        }
        if meta.len() > 64 * 1024 {
            return Err(invalid("larger than 64 KiB".into()));
        }
        let text = std::fs::read(path).map_err(io(path))?;
        let rec: ContainerRecord =
            serde_json::from_slice(&text).map_err(|e| invalid(e.to_string()))?;
        rec.validate().map_err(invalid)?;
        let key = key_for(&rec.id).map_err(|e| invalid(e.to_string()))?;
        if path.file_name() != Some(format!("{key}.json").as_ref()) {
            return Err(invalid(format!("names container {} (key {key})", rec.id)));
        }
        Ok(rec)
    }
}

/// Makes `<socket-dir>/containers` private (mode 0700; created if missing) and its
/// records 0600, also where an older version left them 0755 and 0644: what the
/// arbiter does at start. Refuses a directory that others than root or us
/// own or may write, as [`ContainerRecord::write`] does.
pub fn make_private(socket_dir: &Path) -> Result<PathBuf, ContainerError> {
    let top = containers_dir(socket_dir);
    make_dir(&top, CONTAINERS_DIR_MODE)?;
    for e in std::fs::read_dir(&top).map_err(io(&top))?.flatten() {
        let path = e.path();
        let is_record = e.file_name().to_str().is_some_and(|n| n.ends_with(".json"));
        // Not following a link: only a regular file is tightened.
        let loose = std::fs::symlink_metadata(&path)
            .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o077 != 0);
        if is_record && loose {
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(RECORD_MODE))
                .map_err(io(&path))?;
        }
    }
    Ok(top)
}

/// Removes a container's record, socket and directory (whatever of them exists).
pub fn remove(socket_dir: &Path, key: &str) {
    let _ = std::fs::remove_file(record_path(socket_dir, key));
    let _ = std::fs::remove_file(container_socket(socket_dir, key));
    let _ = std::fs::remove_dir(container_dir(socket_dir, key));
}

/// The keys of every record in `<socket-dir>/containers`.
pub fn list_keys(socket_dir: &Path) -> Vec<String> {
    let Ok(rd) = std::fs::read_dir(containers_dir(socket_dir)) else {
        return Vec::new();
    };
    let mut keys: Vec<String> = rd
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let key = name
                .strip_prefix('.')
                .map_or(Some(name.as_str()), |_| None)?;
            key.strip_suffix(".json").map(str::to_string)
        })
        .filter(|k| key_for(k).is_ok_and(|x| &x == k))
        .collect();
    keys.sort();
    keys
}

/// A process's start time in clock ticks since boot, or `None` when it is gone.
pub fn process_start(pid: i32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may hold spaces and parentheses: fields follow the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    // rest starts at field 3 (state); starttime is field 22.
    rest.split_whitespace().nth(19)?.parse().ok()
}

fn check_owner(meta: &std::fs::Metadata) -> Result<(), String> {
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    if meta.uid() != 0 && meta.uid() != me {
        return Err(format!("owned by uid {}, not root", meta.uid()));
    }
    if meta.permissions().mode() & 0o022 != 0 {
        return Err("writable by others than its owner".into());
    }
    Ok(())
}

/// Creates `dir` with `mode` if missing; refuses one that is not a directory or
/// that others than root or us own or may write; takes from one that exists the
/// permissions `mode` does not give (an older version's 0755 `containers/`).
fn make_dir(dir: &Path, mode: u32) -> Result<(), ContainerError> {
    // Created with no more than `mode` (the umask may take more; set below).
    match std::fs::DirBuilder::new().mode(mode).create(dir) {
        Ok(()) => {
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode))
                .map_err(io(dir))?;
        }
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(io(dir)(e)),
    }
    let meta = std::fs::symlink_metadata(dir).map_err(io(dir))?;
    if !meta.is_dir() {
        return Err(ContainerError::Invalid {
            path: dir.to_path_buf(),
            why: "not a directory".into(),
        });
    }
    check_owner(&meta).map_err(|why| ContainerError::Invalid {
        path: dir.to_path_buf(),
        why,
    })?;
    if meta.permissions().mode() & 0o777 & !mode != 0 {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode)).map_err(io(dir))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(id: &str) -> ContainerRecord {
        ContainerRecord {
            id: id.into(),
            pod_name: Some("nb-0".into()),
            pod_namespace: Some("team-a".into()),
            container_name: Some("notebook".into()),
            gpus: vec!["GPU-1".into()],
            any_gpu: false,
            pid: std::process::id() as i32,
            pid_start: process_start(std::process::id() as i32).unwrap(),
        }
    }

    #[test]
    fn records_round_trip_and_know_whether_their_container_runs() {
        let dir = tempfile::tempdir().unwrap();
        let id = "0123456789abcdef0123456789abcdef0123456789abcdef";
        let r = rec(id);
        let path = r.write(dir.path()).unwrap();
        assert_eq!(path, record_path(dir.path(), &id[..32]));
        assert!(container_dir(dir.path(), &id[..32]).is_dir());
        let back = ContainerRecord::read(&path).unwrap();
        assert_eq!(back, r);
        assert!(back.is_running());
        let mut stale = back.clone();
        stale.pid_start += 1;
        assert!(!stale.is_running());
        assert_eq!(list_keys(dir.path()), vec![id[..32].to_string()]);
        remove(dir.path(), &id[..32]);
        assert!(list_keys(dir.path()).is_empty());
        assert!(!container_dir(dir.path(), &id[..32]).exists());
    }

    #[test]
    fn only_root_reaches_the_records_and_the_sockets() {
        let dir = tempfile::tempdir().unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        let path = rec("c1").write(dir.path()).unwrap();
        let top = containers_dir(dir.path());
        assert_eq!(mode(&top), 0o700);
        assert_eq!(mode(&path), 0o600);
        // Inside the container every uid must pass its directory.
        assert_eq!(mode(&container_dir(dir.path(), "c1")), 0o755);
        // What an older version left (0755, 0644) is tightened: by the next record...
        std::fs::set_permissions(&top, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        rec("c2").write(dir.path()).unwrap();
        assert_eq!(mode(&top), 0o700);
        // ...and by the arbiter's start, records included.
        std::fs::set_permissions(&top, std::fs::Permissions::from_mode(0o755)).unwrap();
        assert_eq!(make_private(dir.path()).unwrap(), top);
        assert_eq!(mode(&top), 0o700);
        assert_eq!(mode(&path), 0o600);
        assert_eq!(mode(&record_path(dir.path(), "c2")), 0o600);
        // One that others may write is refused, not tightened.
        std::fs::set_permissions(&top, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = make_private(dir.path()).unwrap_err();
        assert!(e.to_string().contains("writable"), "{e}");
        assert!(rec("c3").write(dir.path()).is_err());
        // A fresh socket directory gets it private at once.
        let fresh = tempfile::tempdir().unwrap();
        make_private(fresh.path()).unwrap();
        assert_eq!(mode(&containers_dir(fresh.path())), 0o700);
    }

    #[test]
    fn bad_ids_and_records_are_refused() {
        for bad in ["", "../x", ".hidden", "a/b", "a b", "a\nb"] {
            assert!(key_for(bad).is_err(), "{bad:?}");
        }
        let dir = tempfile::tempdir().unwrap();
        let mut r = rec("c1");
        r.gpus.clear();
        assert!(r.write(dir.path()).is_err());
        r.gpus = vec!["GPU\n1".into()];
        assert!(r.write(dir.path()).is_err());
        // Two ids with one key: the second is refused, the first kept.
        let long = "x".repeat(40);
        rec(&format!("{long}1")).write(dir.path()).unwrap();
        let e = rec(&format!("{long}2")).write(dir.path()).unwrap_err();
        assert!(e.to_string().contains("share the key"), "{e}");
        // A record others may write is not believed.
        let path = record_path(dir.path(), "c2");
        rec("c2").write(dir.path()).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666)).unwrap();
        let e = ContainerRecord::read(&path).unwrap_err();
        assert!(e.to_string().contains("writable"), "{e}");
        // A record under another container's name is not believed.
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        std::fs::copy(&path, record_path(dir.path(), "c3")).unwrap();
        assert!(ContainerRecord::read(&record_path(dir.path(), "c3")).is_err());
    }
}
