//! Talking to the arbiter's control socket.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use kiwi_protocol::blocking::{read_event_log, Connection};
use kiwi_protocol::{ControlReply, ControlRequest, Event};

/// A connection to `<socket-dir>/control.sock`.
pub struct Control {
    conn: Connection<ControlRequest, ControlReply>,
}

impl Control {
    pub fn connect(socket_dir: &Path) -> Result<Self> {
        let path: PathBuf = kiwi_config::control_socket(socket_dir);
        let conn = Connection::connect(&path).map_err(|e| {
            let hint = match &e {
                kiwi_protocol::ProtocolError::Io(io)
                    if io.kind() == std::io::ErrorKind::PermissionDenied =>
                {
                    " (the control socket is root-only)"
                }
                _ => " (is kiwi-arbiter running? see --socket-dir / KIWI_SOCKET_DIR)",
            };
            anyhow::anyhow!("cannot reach the arbiter at {}: {e}{hint}", path.display())
        })?;
        conn.stream()
            .set_read_timeout(Some(Duration::from_secs(10)))
            .context("socket setup")?;
        Ok(Self { conn })
    }

    /// Sends a request; an error reply becomes an error.
    pub fn call(&mut self, req: &ControlRequest) -> Result<ControlReply> {
        let reply = self.conn.call(req).map_err(|e| match e {
            kiwi_protocol::ProtocolError::TimedOut { .. } => {
                anyhow::anyhow!("the arbiter accepted the connection but gave {e}; it may be overloaded (see its log)")
            }
            e => anyhow::Error::new(e).context("the arbiter did not answer"),
        })?;
        if let ControlReply::Error { message, .. } = &reply {
            bail!("{message}");
        }
        Ok(reply)
    }

    /// Every event with `seq >= since` (all pages), and the arbiter's clock now.
    pub fn events(&mut self, gpu: Option<String>, since: u64) -> Result<(Vec<Event>, u64)> {
        read_event_log(
            gpu,
            since,
            |req| self.call(req),
            |other| anyhow::anyhow!("unexpected reply from the arbiter: {other:?}"),
        )
    }
}
