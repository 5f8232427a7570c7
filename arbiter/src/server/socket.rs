//! Binding a socket file: the node's client and control sockets (`daemon.rs`) and
//! each container's own (`containers.rs`). A leaf: it knows nothing of the daemon.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use anyhow::{bail, Context, Result};
use tokio::net::UnixListener;

/// Binds a socket with `mode`, refusing to steal one a live arbiter still serves.
pub(crate) fn bind(path: &Path, mode: u32) -> Result<UnixListener> {
    if path.exists() {
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            bail!("another kiwi-arbiter is already serving {}", path.display());
        }
        std::fs::remove_file(path)
            .with_context(|| format!("cannot remove stale socket {}", path.display()))?;
    }
    // Bind under a umask that leaves the socket no wider than `mode`, so the control
    // socket is never reachable by others, not even briefly.
    // SAFETY: umask only changes this process's file-creation mask; no memory involved.
    let old = unsafe { libc::umask(0o777 & !mode as libc::mode_t) };
    let res = UnixListener::bind(path);
    // SAFETY: as above, restoring the previous mask.
    unsafe { libc::umask(old) };
    let listener = res.with_context(|| format!("cannot listen on {}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .with_context(|| format!("cannot set mode of {}", path.display()))?;
    Ok(listener)
}
