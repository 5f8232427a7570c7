//! A claimed container's own client socket (`kiwi_config::containers`): at prestart
//! the hook records whose the container is (its id, its pod from the CRI
//! annotations, the GPU UUIDs it claimed) and asks the arbiter to serve a socket for
//! it; at poststop it asks the arbiter to drop it and removes what is left.
//!
//! The arbiter being down is not an error: the record stays, and the arbiter serves
//! it when it starts (the container's shim waits for the socket as for any arbiter
//! restart).

use std::path::{Path, PathBuf};
use std::time::Duration;

use kiwi_config::containers::{self, ContainerRecord};
use kiwi_protocol::blocking::Connection;
use kiwi_protocol::{ControlReply, ControlRequest};

use crate::claim::{Claim, GpuRef};
use crate::gpu::Gpu;
use crate::spec::Spec;

/// containerd's CRI annotations (FIELD-NOTES, "Kubernetes through CRI").
pub const SANDBOX_NAME: &str = "io.kubernetes.cri.sandbox-name";
pub const SANDBOX_NAMESPACE: &str = "io.kubernetes.cri.sandbox-namespace";
pub const CONTAINER_NAME: &str = "io.kubernetes.cri.container-name";
/// How long the hook waits for the arbiter's answer: it runs while the container is
/// being created, and an arbiter that is down must not hold that up.
const ARBITER_TIMEOUT: Duration = Duration::from_secs(3);

#[derive(Debug, thiserror::Error)]
pub enum AttachError {
    #[error("cannot record the container's client socket: {0}")]
    Record(#[from] containers::ContainerError),
    #[error("the arbiter refused the container's client socket: {0}")]
    Refused(String),
    #[error("container process {0} is gone")]
    Gone(i32),
}

/// The claimed GPUs' UUIDs, and whether some claimed GPU could not be named (then
/// the container may register on any GPU). `gpus` is discovery's answer, asked only
/// for index and `all` claims.
pub fn claimed_uuids(
    claim: &Claim,
    gpus: impl FnOnce() -> Option<Vec<Gpu>>,
) -> (Vec<String>, bool) {
    let mut out = Vec::new();
    let mut any = false;
    let mut known: Option<Option<Vec<Gpu>>> = None;
    let mut gpus = Some(gpus);
    let mut table = |known: &mut Option<Option<Vec<Gpu>>>| -> Option<Vec<Gpu>> {
        known
            .get_or_insert_with(|| gpus.take().and_then(|f| f()))
            .clone()
    };
    let push = |u: String, out: &mut Vec<String>| {
        if !out.contains(&u) {
            out.push(u);
        }
    };
    match claim {
        Claim::None => {}
        Claim::All => match table(&mut known) {
            Some(list) if !list.is_empty() => {
                for g in list {
                    push(g.uuid, &mut out);
                }
            }
            _ => any = true,
        },
        Claim::Gpus(refs) => {
            for r in refs {
                match r {
                    GpuRef::Uuid(u) => push(u.clone(), &mut out),
                    GpuRef::Index(i) => {
                        let found = table(&mut known)
                            .and_then(|list| list.into_iter().find(|g| g.index == *i))
                            .map(|g| g.uuid);
                        match found {
                            Some(u) => push(u, &mut out),
                            None => any = true,
                        }
                    }
                }
            }
        }
    }
    (out, any)
}

/// The record for a claimed container.
pub fn record(
    id: &str,
    pid: i32,
    spec: &Spec,
    gpus: Vec<String>,
    any_gpu: bool,
) -> Result<ContainerRecord, AttachError> {
    let text = |key: &str| {
        spec.annotation(key)
            .filter(|v| !v.is_empty())
            .map(|v| v.chars().take(containers::MAX_FIELD_LEN).collect())
    };
    let pid_start = containers::process_start(pid).ok_or(AttachError::Gone(pid))?;
    Ok(ContainerRecord {
        id: id.to_string(),
        pod_name: text(SANDBOX_NAME),
        pod_namespace: text(SANDBOX_NAMESPACE),
        container_name: text(CONTAINER_NAME),
        gpus,
        any_gpu,
        pid,
        pid_start,
    })
}

/// Writes the record and asks the arbiter to serve the socket. Returns the directory
/// to mount at `/run/kiwi/client`, and a line for the log when the arbiter could not
/// be asked (it serves the record when it starts).
pub fn attach(
    socket_dir: &Path,
    rec: &ContainerRecord,
) -> Result<(PathBuf, Option<String>), AttachError> {
    if let Err(e) = rec.write(socket_dir) {
        // A hook that is not root (rootless podman's hooks.d) cannot write records
        // under the node's socket directory: the container gets the node's socket,
        // as host processes do (capped with its user's other processes).
        // SAFETY: geteuid has no preconditions.
        let root = unsafe { libc::geteuid() } == 0;
        let denied = matches!(&e, containers::ContainerError::Io { source, .. }
            if matches!(source.kind(), std::io::ErrorKind::PermissionDenied | std::io::ErrorKind::ReadOnlyFilesystem));
        if root || !denied {
            return Err(e.into());
        }
        return Ok((
            kiwi_config::client_dir(socket_dir),
            Some(format!(
                "no socket of its own ({e}); the node's socket is mounted, as for host processes"
            )),
        ));
    }
    let key = containers::key_for(&rec.id)?;
    let dir = containers::container_dir(socket_dir, &key);
    let note = match ask(socket_dir, ControlRequest::AttachContainer { key }) {
        Ok(()) => None,
        Err(Ask::Unreachable(why)) => Some(format!(
            "the arbiter could not be asked to serve the container's socket ({why}); it will when it starts"
        )),
        Err(Ask::Refused(why)) => return Err(AttachError::Refused(why)),
    };
    Ok((dir, note))
}

/// Asks the arbiter to drop the container's socket, then removes the record, the
/// socket and the directory (the arbiter may be down). A container that never had
/// one is left alone.
pub fn detach(socket_dir: &Path, id: &str) -> Option<String> {
    let key = containers::key_for(id).ok()?;
    if !containers::record_path(socket_dir, &key).exists()
        && !containers::container_dir(socket_dir, &key).exists()
    {
        return None;
    }
    let note = match ask(
        socket_dir,
        ControlRequest::DetachContainer { key: key.clone() },
    ) {
        Ok(()) => None,
        Err(Ask::Unreachable(why) | Ask::Refused(why)) => Some(why),
    };
    containers::remove(socket_dir, &key);
    Some(note.map_or_else(
        || format!("container {id}: its client socket is gone"),
        |why| format!("container {id}: removed its client socket's files (the arbiter: {why})"),
    ))
}

enum Ask {
    Unreachable(String),
    Refused(String),
}

fn ask(socket_dir: &Path, req: ControlRequest) -> Result<(), Ask> {
    let path = kiwi_config::control_socket(socket_dir);
    let unreachable =
        |e: &dyn std::fmt::Display| Ask::Unreachable(format!("{}: {e}", path.display()));
    let mut c: Connection<ControlRequest, ControlReply> =
        Connection::connect(&path).map_err(|e| unreachable(&e))?;
    let _ = c.stream().set_read_timeout(Some(ARBITER_TIMEOUT));
    let _ = c.stream().set_write_timeout(Some(ARBITER_TIMEOUT));
    match c.call(&req).map_err(|e| unreachable(&e))? {
        ControlReply::Done { .. } => Ok(()),
        ControlReply::Error { message, .. } => Err(Ask::Refused(message)),
        other => Err(Ask::Refused(format!("unexpected reply {other:?}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claims_become_uuids_or_any() {
        let table = || Some(vec![Gpu::new(0, "GPU-a"), Gpu::new(1, "GPU-b")]);
        let uuids = Claim::Gpus(vec![GpuRef::Uuid("GPU-x".into())]);
        // A UUID claim never asks discovery.
        assert_eq!(
            claimed_uuids(&uuids, || panic!("asked")),
            (vec!["GPU-x".to_string()], false)
        );
        let idx = Claim::Gpus(vec![GpuRef::Index(1), GpuRef::Uuid("GPU-b".into())]);
        assert_eq!(
            claimed_uuids(&idx, table),
            (vec!["GPU-b".to_string()], false)
        );
        assert_eq!(
            claimed_uuids(&Claim::All, table),
            (vec!["GPU-a".to_string(), "GPU-b".to_string()], false)
        );
        // Nothing to name them by: any GPU.
        assert_eq!(claimed_uuids(&Claim::All, || None), (vec![], true));
        assert_eq!(
            claimed_uuids(&Claim::Gpus(vec![GpuRef::Index(7)]), table),
            (vec![], true)
        );
    }
}
