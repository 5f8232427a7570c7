//! Talking to the kubelet: dialing a Unix socket with tonic, and `Register`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint, Uri};

use crate::api;
use crate::api::registration_client::RegistrationClient;

/// The API version the plugin speaks.
pub const API_VERSION: &str = "v1beta1";
/// The kubelet's registration socket, inside the device plugin directory.
pub const KUBELET_SOCKET: &str = "kubelet.sock";
/// How long one registration attempt may take.
pub const REGISTER_TIMEOUT: Duration = Duration::from_secs(3);

/// Errors talking to the kubelet.
#[derive(Debug, thiserror::Error)]
pub enum KubeletError {
    #[error("cannot connect to {path}: {source}")]
    Connect {
        path: PathBuf,
        source: tonic::transport::Error,
    },
    #[error("the kubelet refused registration: {0}")]
    Refused(String),
    #[error("registration with {0} timed out")]
    Timeout(PathBuf),
}

/// A gRPC channel over the Unix socket `path`. The URI is a placeholder that tonic
/// requires; the connector ignores it.
pub async fn dial(path: &Path) -> Result<Channel, tonic::transport::Error> {
    let path = path.to_path_buf();
    Endpoint::from_static("http://[::1]:50051")
        .connect_timeout(Duration::from_secs(2))
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move { Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(path).await?)) }
        }))
        .await
}

/// Registers `endpoint` (a file name in the kubelet's directory) for `resource_name`.
pub async fn register(
    kubelet_socket: &Path,
    endpoint: &str,
    resource_name: &str,
    options: api::DevicePluginOptions,
) -> Result<(), KubeletError> {
    let attempt = async {
        let channel = dial(kubelet_socket)
            .await
            .map_err(|source| KubeletError::Connect {
                path: kubelet_socket.to_path_buf(),
                source,
            })?;
        RegistrationClient::new(channel)
            .register(api::RegisterRequest {
                version: API_VERSION.into(),
                endpoint: endpoint.into(),
                resource_name: resource_name.into(),
                options: Some(options),
            })
            .await
            .map_err(|s| KubeletError::Refused(s.message().to_string()))?;
        Ok(())
    };
    tokio::time::timeout(REGISTER_TIMEOUT, attempt)
        .await
        .map_err(|_| KubeletError::Timeout(kubelet_socket.to_path_buf()))?
}
