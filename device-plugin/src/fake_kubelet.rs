//! An in-process stand-in for the kubelet's device manager, for tests and the
//! benchmark: a `Registration` server on `<dir>/kubelet.sock` that reports every
//! `RegisterRequest` on a channel, can refuse registrations, and restarts the way the
//! real kubelet does (deleting every socket in the directory first).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::net::UnixListener;
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::UnixListenerStream;
use tonic::{Request, Response, Status};

use crate::api;
use crate::api::registration_server::{Registration, RegistrationServer};
use crate::kubelet::KUBELET_SOCKET;

struct Registrar {
    tx: mpsc::UnboundedSender<api::RegisterRequest>,
    refuse: Arc<Mutex<Option<String>>>,
}

#[tonic::async_trait]
impl Registration for Registrar {
    async fn register(
        &self,
        request: Request<api::RegisterRequest>,
    ) -> Result<Response<api::Empty>, Status> {
        if let Some(why) = self
            .refuse
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
        {
            return Err(Status::invalid_argument(why));
        }
        let _ = self.tx.send(request.into_inner());
        Ok(Response::new(api::Empty {}))
    }
}

/// The fake kubelet.
pub struct FakeKubelet {
    dir: PathBuf,
    tx: mpsc::UnboundedSender<api::RegisterRequest>,
    rx: mpsc::UnboundedReceiver<api::RegisterRequest>,
    refuse: Arc<Mutex<Option<String>>>,
    server: Option<(oneshot::Sender<()>, tokio::task::JoinHandle<()>)>,
}

impl FakeKubelet {
    /// Serves `<dir>/kubelet.sock`.
    pub async fn start(dir: &Path) -> std::io::Result<FakeKubelet> {
        let (tx, rx) = mpsc::unbounded_channel();
        let mut k = FakeKubelet {
            dir: dir.to_path_buf(),
            tx,
            rx,
            refuse: Arc::new(Mutex::new(None)),
            server: None,
        };
        k.serve()?;
        Ok(k)
    }

    fn serve(&mut self) -> std::io::Result<()> {
        let path = self.socket();
        let _ = std::fs::remove_file(&path);
        let listener = UnixListener::bind(&path)?;
        let (stop_tx, stop_rx) = oneshot::channel::<()>();
        let svc = RegistrationServer::new(Registrar {
            tx: self.tx.clone(),
            refuse: self.refuse.clone(),
        });
        let task = tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .add_service(svc)
                .serve_with_incoming_shutdown(UnixListenerStream::new(listener), async {
                    let _ = stop_rx.await;
                })
                .await;
        });
        self.server = Some((stop_tx, task));
        Ok(())
    }

    /// `<dir>/kubelet.sock`.
    pub fn socket(&self) -> PathBuf {
        self.dir.join(KUBELET_SOCKET)
    }

    /// The next registration, or `None` if none comes within `timeout`.
    pub async fn next_registration(&mut self, timeout: Duration) -> Option<api::RegisterRequest> {
        tokio::time::timeout(timeout, self.rx.recv())
            .await
            .ok()
            .flatten()
    }

    /// Refuses registrations with `why` (or accepts them again with `None`).
    pub fn refuse(&self, why: Option<&str>) {
        *self.refuse.lock().unwrap_or_else(|p| p.into_inner()) = why.map(str::to_string);
    }

    /// Stops serving and removes `kubelet.sock`, as a kubelet that exits.
    pub async fn stop(&mut self) {
        if let Some((stop, task)) = self.server.take() {
            let _ = stop.send(());
            let _ = tokio::time::timeout(Duration::from_secs(2), task).await;
        }
        let _ = std::fs::remove_file(self.socket());
    }

    /// Stops, deletes every socket in the directory (the kubelet's device manager does
    /// that at start), and serves again.
    pub async fn restart(&mut self) -> std::io::Result<()> {
        self.stop().await;
        for entry in std::fs::read_dir(&self.dir)? {
            let entry = entry?;
            use std::os::unix::fs::FileTypeExt;
            if entry.file_type()?.is_socket() {
                let _ = std::fs::remove_file(entry.path());
            }
        }
        self.serve()
    }
}

impl Drop for FakeKubelet {
    fn drop(&mut self) {
        if let Some((stop, task)) = self.server.take() {
            let _ = stop.send(());
            task.abort();
        }
    }
}
