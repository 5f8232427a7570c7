//! Running the daemon on a socket directory: create it, make the container sockets'
//! directory private, bind both sockets with the right modes (refusing to steal a
//! live arbiter's: `server/socket.rs`), serve, and remove the sockets on the way
//! out. Used by the `kiwi-arbiter` binary and by benchmarks and demos that run an
//! arbiter of their own.

use std::future::Future;
use std::path::Path;

use anyhow::{bail, Context, Result};
use kiwi_config::{client_dir, client_socket, containers, control_socket};

use crate::server::socket::bind;
use crate::server::{serve, ServerConfig};

/// Serves on `dir` until `shutdown` resolves, then removes the sockets.
pub async fn run_daemon(
    dir: &Path,
    mut cfg: ServerConfig,
    shutdown: impl Future<Output = ()>,
) -> Result<()> {
    std::fs::create_dir_all(client_dir(dir))
        .with_context(|| format!("cannot create socket directory {}", dir.display()))?;
    // Root's alone (0700, records 0600), even where an older version left it open:
    // host users must reach neither the containers' sockets nor their records.
    containers::make_private(dir)
        .context("cannot make the container sockets' directory private")?;
    cfg.socket_dir = Some(dir.to_path_buf());
    let client_path = client_socket(dir);
    let control_path = control_socket(dir);
    let client = bind(&client_path, 0o666)?;
    let control = match bind(&control_path, 0o600) {
        Ok(l) => l,
        Err(e) => {
            let _ = std::fs::remove_file(&client_path);
            return Err(e);
        }
    };
    let metrics = match &cfg.metrics_addr {
        None => None,
        Some(addr) => match tokio::net::TcpListener::bind(addr.as_str()).await {
            Ok(l) => Some(l),
            Err(e) => {
                let _ = std::fs::remove_file(&client_path);
                let _ = std::fs::remove_file(&control_path);
                bail!("cannot serve metrics on {addr}: {e}");
            }
        },
    };
    // Only now that everything is bound: a start that fails says its error alone.
    for line in &cfg.startup_lines {
        eprintln!("[INFO] {line}");
    }
    eprintln!(
        "[INFO] kiwi-arbiter listening on {} (control {}), scheduler {}, TQ {} s, swap budget {}",
        client_path.display(),
        control_path.display(),
        cfg.scheduler,
        cfg.tq,
        match cfg.swap_budget_bytes {
            None => "unlimited".to_string(),
            Some(b) => format!("{} MiB", b >> 20),
        }
    );
    if let Some(addr) = &cfg.metrics_addr {
        eprintln!("[INFO] metrics on http://{addr}/metrics");
    }
    let res = serve(cfg, client, control, metrics, shutdown).await;
    let _ = std::fs::remove_file(&client_path);
    let _ = std::fs::remove_file(&control_path);
    res
}
