//! The plugin's life cycle: discover GPUs, start the health monitor, then in a loop
//! serve the `DevicePlugin` service on `<kubelet-dir>/<endpoint>`, register with the
//! kubelet, and watch for anything that calls for starting over.
//!
//! Starting over (a new "generation": fresh socket, fresh server, new registration)
//! happens when the plugin's socket is deleted or replaced (the kubelet deletes every
//! socket when it restarts) or when the gRPC server task ends. A `kubelet.sock` that
//! appears or is recreated only calls for registering again. Files are polled every
//! [`POLL`], well inside the 2 s in which a restarted kubelet must see the plugin back.
//! On shutdown the plugin's socket is removed, if it is still the plugin's own.

use std::future::Future;
use std::net::SocketAddr;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;

use crate::api::device_plugin_server::DevicePluginServer;
use crate::devices::{DeviceListStrategy, Inventory, InventoryError};
use crate::health::HealthMonitor;
use crate::kubelet::{self, KUBELET_SOCKET};
use crate::metrics::Metrics;
use crate::plugin::{PluginService, PluginState};
use kiwi_nvml::{GpuDiscovery, GpuError};

/// How often the socket files are checked.
pub const POLL: Duration = Duration::from_millis(100);
/// Pause between failed registrations with the same kubelet.
pub const REGISTER_RETRY: Duration = Duration::from_secs(1);
/// How long a stopping server may take to drain.
const DRAIN: Duration = Duration::from_secs(2);
/// Consecutive accept errors after which a listener counts as broken, and the pause
/// after each (so a transient EMFILE is waited out instead of spun on).
const MAX_ACCEPT_ERRORS: u32 = 20;
const ACCEPT_BACKOFF: Duration = Duration::from_millis(25);

/// Everything the plugin is told (flags over the config file).
#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    pub resource_name: String,
    pub vgpus_per_gpu: u32,
    pub kubelet_dir: PathBuf,
    pub strategy: DeviceListStrategy,
    pub gpu_list: Option<PathBuf>,
    pub metrics_addr: Option<SocketAddr>,
    pub health_interval: Duration,
}

impl Default for Settings {
    fn default() -> Self {
        let c = kiwi_config::DevicePluginConfig::default();
        Settings {
            resource_name: c.resource_name,
            vgpus_per_gpu: c.vgpus_per_gpu,
            kubelet_dir: c.kubelet_dir,
            strategy: DeviceListStrategy::Envvar,
            gpu_list: None,
            metrics_addr: None,
            health_interval: Duration::from_secs(5),
        }
    }
}

impl Settings {
    /// The plugin's socket file name: the resource name made file-safe, so two plugins
    /// for different resources can share the directory.
    pub fn endpoint(&self) -> String {
        let safe: String = self
            .resource_name
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '.' || c == '_' {
                    c
                } else {
                    '-'
                }
            })
            .collect();
        format!("{safe}.sock")
    }

    pub fn socket_path(&self) -> PathBuf {
        self.kubelet_dir.join(self.endpoint())
    }
}

/// Checks an extended resource name: `<domain>/<name>`, outside `kubernetes.io`.
pub fn validate_resource_name(name: &str) -> Result<(), String> {
    let bad = |why: &str| Err(format!("resource name {name:?} {why} (e.g. kiwi.dev/gpu)"));
    let Some((domain, item)) = name.split_once('/') else {
        return bad("must look like <domain>/<name>");
    };
    let dns = |s: &str, extra: &[char]| {
        !s.is_empty()
            && s.len() <= 63
            && s.chars().all(|c| {
                c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || extra.contains(&c)
            })
            && s.starts_with(|c: char| c.is_ascii_alphanumeric())
            && s.ends_with(|c: char| c.is_ascii_alphanumeric())
    };
    if domain.len() > 253 || !domain.split('.').all(|l| dns(l, &[])) {
        return bad("has an invalid domain");
    }
    if domain == "kubernetes.io" || domain.ends_with(".kubernetes.io") {
        return bad("may not use the kubernetes.io domain");
    }
    if !dns(&item.to_ascii_lowercase(), &['.', '_']) {
        return bad("has an invalid name part");
    }
    Ok(())
}

/// Errors that stop the plugin.
#[derive(Debug, thiserror::Error)]
pub enum PluginError {
    #[error(transparent)]
    Gpu(#[from] GpuError),
    #[error("no GPUs found through {0}")]
    NoGpus(String),
    #[error(transparent)]
    Inventory(#[from] InventoryError),
    #[error("{0}")]
    Settings(String),
    #[error("cannot serve on {path}: {source}; --kubelet-dir (device_plugin.kubelet_dir) must name the kubelet's device plugin directory, usually /var/lib/kubelet/device-plugins")]
    Bind {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot serve metrics on {addr}: {source}")]
    Metrics {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("cannot start the health monitor: {0}")]
    Thread(std::io::Error),
}

/// A file's identity, to notice it being deleted and created again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FileId {
    dev: u64,
    ino: u64,
    ctime: i64,
    ctime_nsec: i64,
}

fn file_id(path: &Path) -> Option<FileId> {
    let m = std::fs::symlink_metadata(path).ok()?;
    Some(FileId {
        dev: m.dev(),
        ino: m.ino(),
        ctime: m.ctime(),
        ctime_nsec: m.ctime_nsec(),
    })
}

/// Runs the plugin until `shutdown` completes.
pub async fn run(
    settings: Settings,
    source: Box<dyn GpuDiscovery>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), PluginError> {
    validate_resource_name(&settings.resource_name).map_err(PluginError::Settings)?;
    let describe = source.describe();
    let (source, gpus) = tokio::task::spawn_blocking(move || {
        let mut source = source;
        let gpus = source.discover();
        (source, gpus)
    })
    .await
    .map_err(|e| PluginError::Settings(format!("GPU discovery panicked: {e}")))?;
    let gpus = gpus?;
    if gpus.is_empty() {
        return Err(PluginError::NoGpus(describe));
    }
    let inventory = Inventory::new(gpus.clone(), settings.vgpus_per_gpu)?;
    for g in &gpus {
        tracing::info!(
            gpu = %g.uuid,
            index = g.index,
            name = g.name.as_deref().unwrap_or("?"),
            numa = ?g.numa_node,
            "found GPU"
        );
    }
    tracing::info!(
        "{} GPUs through {describe}, {} vGPUs each, resource {}",
        gpus.len(),
        settings.vgpus_per_gpu,
        settings.resource_name
    );
    let monitor = HealthMonitor::start(source, gpus.clone(), settings.health_interval)
        .map_err(PluginError::Thread)?;
    let metrics = Arc::new(Metrics::default());
    metrics.gpus.set(gpus.len() as i64);
    metrics.vgpus_advertised.set(inventory.vgpu_count() as i64);
    let _metrics_task = match settings.metrics_addr {
        Some(addr) => {
            let (local, task) = crate::metrics::serve(addr, metrics.clone(), monitor.subscribe())
                .await
                .map_err(|source| PluginError::Metrics { addr, source })?;
            tracing::info!("metrics on http://{local}/metrics");
            Some(AbortOnDrop(task))
        }
        None => None,
    };
    let state = Arc::new(PluginState {
        inventory,
        strategy: settings.strategy,
        cdi_kind: crate::devices::CDI_KIND.to_string(),
        health: monitor.subscribe(),
        metrics: metrics.clone(),
    });

    tokio::pin!(shutdown);
    let socket = settings.socket_path();
    let kubelet_socket = settings.kubelet_dir.join(KUBELET_SOCKET);
    let endpoint = settings.endpoint();
    let mut first = true;
    loop {
        // One generation.
        let _ = std::fs::remove_file(&socket);
        let listener = match UnixListener::bind(&socket) {
            Ok(l) => l,
            Err(source) if first => {
                return Err(PluginError::Bind {
                    path: socket,
                    source,
                })
            }
            Err(e) => {
                tracing::warn!("cannot serve on {}: {e}; retrying", socket.display());
                tokio::select! {
                    _ = &mut shutdown => return Ok(()),
                    _ = tokio::time::sleep(REGISTER_RETRY) => continue,
                }
            }
        };
        first = false;
        let own_id = file_id(&socket);
        let (stop_tx, stop_rx) = watch::channel(false);
        let stop_tx = Arc::new(stop_tx);
        let service = PluginService::new(state.clone(), stop_rx.clone());
        let mut stop_server = stop_rx.clone();
        let (conn_tx, conn_rx) = mpsc::channel(16);
        let acceptor = AbortOnDrop(tokio::spawn(accept_loop(
            listener,
            conn_tx,
            stop_tx.clone(),
        )));
        let mut server = tokio::spawn(async move {
            tonic::transport::Server::builder()
                .add_service(DevicePluginServer::new(service))
                .serve_with_incoming_shutdown(ReceiverStream::new(conn_rx), async move {
                    let _ = stop_server.wait_for(|s| *s).await;
                })
                .await
        });
        tracing::info!("serving on {}", socket.display());

        let mut kubelet_seen: Option<FileId> = None;
        let mut registered = false;
        let mut next_attempt = Instant::now();
        let mut waiting_logged = false;
        let stopping = loop {
            tokio::select! {
                _ = &mut shutdown => break true,
                result = &mut server => {
                    match result {
                        Ok(Ok(())) => tracing::warn!("gRPC server stopped; starting it again"),
                        Ok(Err(e)) => tracing::warn!("gRPC server failed: {e}; starting it again"),
                        Err(e) => tracing::warn!("gRPC server task ended: {e}; starting it again"),
                    }
                    break false;
                }
                _ = tokio::time::sleep(POLL) => {}
            }
            if file_id(&socket) != own_id {
                tracing::warn!(
                    "{} was removed or replaced; serving again",
                    socket.display()
                );
                break false;
            }
            let kubelet_now = file_id(&kubelet_socket);
            if kubelet_now != kubelet_seen {
                if kubelet_now.is_some() && kubelet_seen.is_some() {
                    tracing::info!("kubelet.sock was recreated: the kubelet restarted");
                }
                kubelet_seen = kubelet_now;
                registered = false;
                next_attempt = Instant::now();
            }
            if registered || Instant::now() < next_attempt {
                continue;
            }
            if kubelet_now.is_none() {
                if !waiting_logged {
                    tracing::info!("waiting for {}", kubelet_socket.display());
                    waiting_logged = true;
                }
                continue;
            }
            let attempt = kubelet::register(
                &kubelet_socket,
                &endpoint,
                &settings.resource_name,
                PluginState::options(),
            );
            tokio::select! {
                _ = &mut shutdown => break true,
                result = attempt => match result {
                    Ok(()) => {
                        registered = true;
                        waiting_logged = false;
                        metrics.registrations.inc();
                        tracing::info!("registered {} with the kubelet as {}", settings.resource_name, endpoint);
                    }
                    Err(e) => {
                        tracing::warn!("{e}; retrying in {REGISTER_RETRY:?}");
                        next_attempt = Instant::now() + REGISTER_RETRY;
                    }
                }
            }
        };

        let _ = stop_tx.send(true);
        drop(acceptor);
        if !server.is_finished() && tokio::time::timeout(DRAIN, &mut server).await.is_err() {
            server.abort();
        }
        if stopping {
            if file_id(&socket) == own_id {
                let _ = std::fs::remove_file(&socket);
            }
            tracing::info!("stopped; removed {}", socket.display());
            drop(monitor);
            return Ok(());
        }
    }
}

/// Where connections come from: the generation's listener, or a fake in tests.
trait Accept: Send + 'static {
    fn accept(&mut self) -> impl Future<Output = std::io::Result<UnixStream>> + Send;
}

impl Accept for UnixListener {
    async fn accept(&mut self) -> std::io::Result<UnixStream> {
        UnixListener::accept(self).await.map(|(conn, _)| conn)
    }
}

/// Accepts connections for one generation's server. A listener that keeps failing
/// (closed or shut down under it) ends the generation: the server is told to stop, so
/// its streams end, and the supervisor serves again on a fresh socket.
async fn accept_loop(
    mut listener: impl Accept,
    conns: mpsc::Sender<std::io::Result<UnixStream>>,
    stop: Arc<watch::Sender<bool>>,
) {
    let mut errors = 0u32;
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(conn) => {
                    errors = 0;
                    if conns.send(Ok(conn)).await.is_err() {
                        return;
                    }
                }
                Err(e) => {
                    errors += 1;
                    tracing::warn!("accept failed ({errors} in a row): {e}");
                    if errors >= MAX_ACCEPT_ERRORS {
                        tracing::error!("the plugin socket is broken; stopping this server");
                        let _ = stop.send(true);
                        return;
                    }
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                }
            },
            _ = conns.closed() => return,
        }
    }
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Fails `errors` times, then hands out one end of a socket pair, then waits.
    struct FlakyAcceptor {
        errors: u32,
        spare: Option<UnixStream>,
    }

    impl Accept for FlakyAcceptor {
        async fn accept(&mut self) -> std::io::Result<UnixStream> {
            if self.errors > 0 {
                self.errors -= 1;
                return Err(std::io::Error::from_raw_os_error(libc::EMFILE));
            }
            match self.spare.take() {
                Some(s) => Ok(s),
                None => std::future::pending().await,
            }
        }
    }

    #[tokio::test]
    async fn accept_errors_are_waited_out_then_end_the_generation() {
        let (a, _b) = UnixStream::pair().unwrap();
        let (tx, mut rx) = mpsc::channel(4);
        let (stop_tx, stop_rx) = watch::channel(false);
        let flaky = FlakyAcceptor {
            errors: MAX_ACCEPT_ERRORS - 1,
            spare: Some(a),
        };
        let task = tokio::spawn(accept_loop(flaky, tx, Arc::new(stop_tx)));
        assert!(
            rx.recv().await.unwrap().is_ok(),
            "a connection after transient errors"
        );
        assert!(!*stop_rx.borrow());
        task.abort();

        let (tx, mut rx) = mpsc::channel(4);
        let (stop_tx, stop_rx) = watch::channel(false);
        let broken = FlakyAcceptor {
            errors: u32::MAX,
            spare: None,
        };
        accept_loop(broken, tx, Arc::new(stop_tx)).await;
        assert!(rx.recv().await.is_none(), "connection stream ends");
        assert!(*stop_rx.borrow(), "the generation is told to stop");
    }

    #[test]
    fn endpoint_is_file_safe() {
        let s = Settings::default();
        assert_eq!(s.endpoint(), "kiwi.dev-gpu.sock");
        assert_eq!(
            s.socket_path(),
            PathBuf::from("/var/lib/kubelet/device-plugins/kiwi.dev-gpu.sock")
        );
    }

    #[test]
    fn resource_names() {
        for good in ["kiwi.dev/gpu", "example.com/shared-gpu", "a.b/GPU_1"] {
            assert!(validate_resource_name(good).is_ok(), "{good}");
        }
        for bad in [
            "gpu",
            "kiwi.dev/",
            "/gpu",
            "Kiwi.dev/gpu",
            "kubernetes.io/gpu",
            "kiwi.dev/g/pu",
            "kiwi.dev/-gpu",
        ] {
            assert!(validate_resource_name(bad).is_err(), "{bad}");
        }
    }
}
