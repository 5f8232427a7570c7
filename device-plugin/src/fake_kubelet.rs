//! An in-process stand-in for the kubelet's device manager, for tests and the
//! benchmark: a `Registration` server on `<dir>/kubelet.sock` that reports every
//! `RegisterRequest` on a channel, refuses a wrong API version (or anything, on
//! request), and then does what the kubelet does with a new plugin: dials its
//! endpoint, asks for its options and follows its `ListAndWatch` stream, reporting
//! every device list on a second channel. It restarts the way the real kubelet does
//! (deleting every socket in the directory first).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::net::UnixListener;
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::UnixListenerStream;
use tonic::{Request, Response, Status};

use crate::api;
use crate::api::device_plugin_client::DevicePluginClient;
use crate::api::registration_server::{Registration, RegistrationServer};
use crate::kubelet::{dial, KUBELET_SOCKET};

struct Registrar {
    dir: PathBuf,
    tx: mpsc::UnboundedSender<api::RegisterRequest>,
    devices: mpsc::UnboundedSender<Vec<api::Device>>,
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
        let req = request.into_inner();
        if req.version != crate::kubelet::API_VERSION {
            return Err(Status::invalid_argument(format!(
                "unsupported version {:?}",
                req.version
            )));
        }
        let endpoint = self.dir.join(&req.endpoint);
        let devices = self.devices.clone();
        let _ = self.tx.send(req);
        // Like the kubelet, after answering: options, then follow the device stream.
        tokio::spawn(async move {
            let follow = async {
                let mut client = DevicePluginClient::new(dial(&endpoint).await?);
                client.get_device_plugin_options(api::Empty {}).await?;
                let mut stream = client.list_and_watch(api::Empty {}).await?.into_inner();
                while let Some(list) = stream.message().await? {
                    if devices.send(list.devices).is_err() {
                        break;
                    }
                }
                Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
            };
            if let Err(e) = follow.await {
                eprintln!(
                    "fake kubelet: stream from {} ended: {e}",
                    endpoint.display()
                );
            }
        });
        Ok(Response::new(api::Empty {}))
    }
}

/// The fake kubelet.
pub struct FakeKubelet {
    dir: PathBuf,
    tx: mpsc::UnboundedSender<api::RegisterRequest>,
    rx: mpsc::UnboundedReceiver<api::RegisterRequest>,
    devices_tx: mpsc::UnboundedSender<Vec<api::Device>>,
    devices_rx: mpsc::UnboundedReceiver<Vec<api::Device>>,
    refuse: Arc<Mutex<Option<String>>>,
    server: Option<(oneshot::Sender<()>, tokio::task::JoinHandle<()>)>,
}

impl FakeKubelet {
    /// Serves `<dir>/kubelet.sock`.
    pub async fn start(dir: &Path) -> std::io::Result<FakeKubelet> {
        let (tx, rx) = mpsc::unbounded_channel();
        let (devices_tx, devices_rx) = mpsc::unbounded_channel();
        let mut k = FakeKubelet {
            dir: dir.to_path_buf(),
            tx,
            rx,
            devices_tx,
            devices_rx,
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
            dir: self.dir.clone(),
            tx: self.tx.clone(),
            devices: self.devices_tx.clone(),
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

    /// The next device list the kubelet side received on a plugin's `ListAndWatch`
    /// stream, or `None` if none comes within `timeout`.
    pub async fn next_devices(&mut self, timeout: Duration) -> Option<Vec<api::Device>> {
        tokio::time::timeout(timeout, self.devices_rx.recv())
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
