//! Per-container client sockets (`kiwi_config::containers`): serving one for each
//! claimed container the hook attaches (and, at start, for every recorded container
//! that still runs), and what a connection on one may do.
//!
//! A container socket is the container's identity: the arbiter labels its clients
//! with the record's pod, namespace and container id, counts their connections
//! against that socket alone, and refuses registrations for GPUs the container did
//! not claim. Each socket holds one place under the node's connection cap, so
//! listeners cannot exhaust the daemon's descriptors either.
//!
//! Only the container and root on the host reach a socket (`<socket-dir>/containers`
//! is 0700, `kiwi_config::containers`). A peer from the host (a process outside the
//! container's pid namespace, [`Served::host_peer`]) that is not root, which found the
//! socket another way (`/proc/<pid>/root` of a container process of its own uid), is
//! refused; root's connections from the host count against root's node-wide share,
//! as on the node's socket, not the container's.

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::fs::MetadataExt;
use std::sync::Arc;

use kiwi_config::containers::{self, ContainerRecord};
use kiwi_protocol::{ControlReply, ErrorCode};
use tokio::net::unix::UCred;
use tokio::sync::{watch, OwnedSemaphorePermit};

use super::client::{accept_clients, Origin};
use super::socket;
use super::state::Shared;
use crate::sched::ClientInfo;

/// Container sockets served at once, at most (each also takes a connection place).
pub(super) const MAX_CONTAINERS: usize = 1024;
/// Pid namespaces nest at most 32 deep (the kernel's limit).
const MAX_PID_NS_DEPTH: usize = 33;

/// One container's socket as the daemon serves it.
pub(super) struct Served {
    pub(super) key: String,
    pub(super) record: ContainerRecord,
    /// Tells the socket's accept loop to stop (detach).
    stop: Option<watch::Sender<bool>>,
    task: Option<tokio::task::JoinHandle<()>>,
    _permit: Option<OwnedSemaphorePermit>,
}

impl Served {
    /// Whether this container may register on `uuid`; the refusal names only its own
    /// GPUs.
    pub(super) fn may_use(&self, uuid: &str) -> Result<(), String> {
        if self.record.any_gpu || self.record.gpus.iter().any(|g| g == uuid) {
            return Ok(());
        }
        Err(format!(
            "GPU {uuid} was not given to this container; it may use {}",
            self.record.gpus.join(", ")
        ))
    }

    /// The uid of a peer that connected from outside the container: its pid
    /// namespace (`SO_PEERCRED`'s pid, as the arbiter sees it: the arbiter runs in
    /// the host's) is neither the container init's nor nested in it. `None` for a
    /// peer inside, and whenever that cannot be told (its process gone, a kernel
    /// without `NS_GET_PARENT`, a container in the host's pid namespace): only root
    /// reaches the socket from the host, so a doubt is counted as the container's.
    pub(super) fn host_peer(&self, cred: Option<UCred>) -> Option<u32> {
        let cred = cred?;
        let pid = cred.pid().filter(|p| *p > 0)?;
        outside_pid_ns(pid, self.record.pid).then_some(cred.uid())
    }

    /// Whether a peer may use this socket: from inside the container, any; from the
    /// host, root (or this arbiter's own user) only.
    pub(super) fn admits(&self, cred: Option<UCred>) -> Result<(), String> {
        match self.host_peer(cred) {
            // SAFETY: geteuid has no preconditions.
            Some(uid) if uid != 0 && uid != unsafe { libc::geteuid() } => Err(format!(
                "this socket is a container's: on the host only root may use it (uid {uid}); \
                 host processes use the node's socket"
            )),
            _ => Ok(()),
        }
    }

    /// The group a client of this container belongs to unless it names one: its pod
    /// (a pod's containers run one job), else the container.
    pub(super) fn group_key(&self) -> String {
        match (&self.record.pod_namespace, &self.record.pod_name) {
            (Some(ns), Some(name)) => format!("pod {ns}/{name}"),
            _ => format!("container {}", self.record.id),
        }
    }

    /// Puts the record's identity on a registering client.
    pub(super) fn label(&self, info: &mut ClientInfo) {
        info.container_id = Some(self.record.id.clone());
        info.pod_name = self
            .record
            .pod_name
            .clone()
            .or_else(|| self.record.container_name.clone());
        info.pod_namespace = self.record.pod_namespace.clone();
    }
}

/// Whether `pid` runs in a pid namespace that is neither `init`'s nor one nested in
/// it (walking up from `pid`'s with `NS_GET_PARENT`, which ends at the arbiter's own
/// namespace with `EPERM`). False when that cannot be told.
fn outside_pid_ns(pid: i32, init: i32) -> bool {
    let Ok(target) = std::fs::metadata(format!("/proc/{init}/ns/pid")) else {
        return false;
    };
    let Ok(mut ns) = File::open(format!("/proc/{pid}/ns/pid")) else {
        return false;
    };
    for _ in 0..MAX_PID_NS_DEPTH {
        let Ok(m) = ns.metadata() else {
            return false;
        };
        if (m.dev(), m.ino()) == (target.dev(), target.ino()) {
            return false;
        }
        // SAFETY: an ioctl on a namespace descriptor this function owns; it returns a
        // new descriptor or -1, and touches no memory of ours.
        let parent = unsafe { libc::ioctl(ns.as_raw_fd(), libc::NS_GET_PARENT) };
        if parent < 0 {
            return std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM);
        }
        // SAFETY: the descriptor the ioctl just opened, owned by nothing else.
        ns = unsafe { File::from_raw_fd(parent) };
    }
    false
}

fn error(code: ErrorCode, message: String) -> ControlReply {
    ControlReply::Error { code, message }
}

/// `attach_container`: reads the record and serves its socket (once: attaching a
/// served container again is answered as done).
/// The socket directory, when `key` is a container key (never a path) and this
/// arbiter serves container sockets.
fn checked(shared: &Shared, key: &str) -> Result<std::path::PathBuf, ControlReply> {
    let Some(dir) = shared.lock().cfg.socket_dir.clone() else {
        return Err(error(
            ErrorCode::InvalidArgument,
            "this arbiter serves no container sockets (no socket directory)".into(),
        ));
    };
    if containers::key_for(key).ok().as_deref() != Some(key) {
        return Err(error(
            ErrorCode::InvalidArgument,
            format!("{key:?} is not a container key"),
        ));
    }
    Ok(dir)
}

pub(super) fn attach(shared: &Arc<Shared>, key: &str, who: &str) -> ControlReply {
    let dir = match checked(shared, key) {
        Ok(d) => d,
        Err(reply) => return reply,
    };
    let record = match ContainerRecord::read(&containers::record_path(&dir, key)) {
        Ok(r) => r,
        Err(e) => return error(ErrorCode::InvalidArgument, e.to_string()),
    };
    match start(shared, &dir, key, record) {
        Ok(message) => {
            log_line!("INFO", "{message} (kiwi-hook pid {who})");
            ControlReply::Done {
                message,
                gpus: Vec::new(),
            }
        }
        Err(reply) => reply,
    }
}

fn start(
    shared: &Arc<Shared>,
    dir: &std::path::Path,
    key: &str,
    record: ContainerRecord,
) -> Result<String, ControlReply> {
    let mut served = shared.containers.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(s) = served.get(key) {
        if s.record == record {
            return Ok(format!("container {} is served already", record.id));
        }
        // The same key, a new record (a container id reused after a delete the
        // arbiter missed): serve the new one. The old listener may still be open
        // until its loop sees the stop: its path goes now, so the bind below does
        // not take it for a live arbiter's.
        stop_one(served.remove(key).expect("present"));
        let _ = std::fs::remove_file(containers::container_socket(dir, key));
    }
    // Containers deleted without their poststop hook (a runtime that crashed) must
    // not keep sockets: sweep those whose init is gone before counting.
    let gone: Vec<String> = served
        .iter()
        .filter(|(_, s)| !s.record.is_running())
        .map(|(k, _)| k.clone())
        .collect();
    for k in gone {
        if let Some(s) = served.remove(&k) {
            log_line!(
                "INFO",
                "container {} is no longer running; its socket removed",
                s.record.id
            );
            stop_one(s);
        }
        containers::remove(dir, &k);
    }
    if served.len() >= MAX_CONTAINERS {
        return Err(error(
            ErrorCode::RateLimited,
            format!("{MAX_CONTAINERS} container sockets are served already"),
        ));
    }
    let Ok(permit) = shared.conn_limit.clone().try_acquire_owned() else {
        return Err(error(
            ErrorCode::RateLimited,
            "the arbiter's connections are all in use; no socket for a new container".into(),
        ));
    };
    let path = containers::container_socket(dir, key);
    // 0666: any uid inside the container connects (through its bind mount); on the
    // host, `containers/` (0700) keeps everyone but root out.
    let listener =
        socket::bind(&path, 0o666).map_err(|e| error(ErrorCode::Internal, format!("{e:#}")))?;
    let (tx, rx) = watch::channel(false);
    let mut entry = Served {
        key: key.to_string(),
        record,
        stop: Some(tx),
        task: None,
        _permit: Some(permit),
    };
    let origin = Origin::Container(Arc::new(Served {
        key: entry.key.clone(),
        record: entry.record.clone(),
        stop: None,
        task: None,
        _permit: None,
    }));
    entry.task = Some(tokio::spawn(accept_clients(
        shared.clone(),
        listener,
        origin,
        Some(rx),
    )));
    let r = &entry.record;
    let message = format!(
        "serving container {} ({}) on {}, GPUs: {}",
        r.id,
        match (&r.pod_namespace, &r.pod_name) {
            (Some(ns), Some(p)) => format!("pod {ns}/{p}"),
            (None, Some(p)) => p.clone(),
            _ => "no pod".into(),
        },
        path.display(),
        if r.any_gpu {
            "any".to_string()
        } else {
            r.gpus.join(", ")
        }
    );
    served.insert(key.to_string(), entry);
    Ok(message)
}

fn stop_one(mut s: Served) {
    if let Some(tx) = s.stop.take() {
        let _ = tx.send(true);
    }
}

/// `detach_container`: stops serving the socket and removes it, its directory and
/// the record (also when it was never served: the arbiter may have been down).
pub(super) fn detach(shared: &Arc<Shared>, key: &str, who: &str) -> ControlReply {
    let dir = match checked(shared, key) {
        Ok(d) => d,
        Err(reply) => return reply,
    };
    let was = shared
        .containers
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .remove(key);
    let message = match was {
        Some(s) => {
            let m = format!("container {} is gone; its socket removed", s.record.id);
            stop_one(s);
            m
        }
        None => format!("no socket was served for container key {key}"),
    };
    containers::remove(&dir, key);
    log_line!("INFO", "{message} (kiwi-hook pid {who})");
    ControlReply::Done {
        message,
        gpus: Vec::new(),
    }
}

/// At start: serves every recorded container whose init process still runs, and
/// removes the records of those that are gone.
pub(super) fn serve_recorded(shared: &Arc<Shared>) {
    let Some(dir) = shared.lock().cfg.socket_dir.clone() else {
        return;
    };
    let (mut served, mut gone) = (0, 0);
    for key in containers::list_keys(&dir) {
        let record = match ContainerRecord::read(&containers::record_path(&dir, &key)) {
            Ok(r) => r,
            Err(e) => {
                log_line!("WARN", "ignoring {e}");
                continue;
            }
        };
        if !record.is_running() {
            containers::remove(&dir, &key);
            gone += 1;
            continue;
        }
        match start(shared, &dir, &key, record) {
            Ok(m) => {
                log_line!("INFO", "{m} (recorded)");
                served += 1;
            }
            Err(ControlReply::Error { message, .. }) => log_line!("WARN", "{message}"),
            Err(_) => {}
        }
    }
    if served + gone > 0 {
        log_line!(
            "INFO",
            "container sockets: {served} served again, {gone} records of stopped containers removed"
        );
    }
}

/// At shutdown (the daemon's stop already sent): waits for every container socket's
/// accept loop and removes the socket files; records and directories stay, so the
/// next arbiter serves the same paths.
pub(super) async fn stop_all(shared: &Arc<Shared>) {
    let all: Vec<Served> = shared
        .containers
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .drain()
        .map(|(_, s)| s)
        .collect();
    let dir = shared.lock().cfg.socket_dir.clone();
    for mut s in all {
        if let Some(t) = s.task.take() {
            let _ = t.await;
        }
        if let Some(d) = &dir {
            let _ = std::fs::remove_file(containers::container_socket(d, &s.key));
        }
    }
}
