//! The `DevicePlugin` gRPC service: answers the kubelet from the [`Inventory`] and the
//! health flags. Holds no state of its own besides counters; one instance per server
//! generation, so stopping a generation ends its `ListAndWatch` streams.

use std::sync::Arc;

use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use crate::api;
use crate::api::device_plugin_server::DevicePlugin;
use crate::devices::{DeviceListStrategy, Inventory, RequestError};
use crate::health::HealthFlags;
use crate::metrics::Metrics;

/// What every generation of the service shares.
pub struct PluginState {
    pub inventory: Inventory,
    pub strategy: DeviceListStrategy,
    /// CDI kind for device names, `vendor/class`.
    pub cdi_kind: String,
    pub health: watch::Receiver<HealthFlags>,
    pub metrics: Arc<Metrics>,
}

impl PluginState {
    /// Options the plugin registers with and answers `GetDevicePluginOptions` with.
    pub fn options() -> api::DevicePluginOptions {
        api::DevicePluginOptions {
            pre_start_required: false,
            get_preferred_allocation_available: true,
        }
    }
}

/// One generation of the service.
#[derive(Clone)]
pub struct PluginService {
    state: Arc<PluginState>,
    /// Becomes `true` when this generation stops.
    stop: watch::Receiver<bool>,
}

impl PluginService {
    pub fn new(state: Arc<PluginState>, stop: watch::Receiver<bool>) -> PluginService {
        PluginService { state, stop }
    }
}

impl From<RequestError> for Status {
    fn from(e: RequestError) -> Status {
        Status::invalid_argument(e.to_string())
    }
}

#[tonic::async_trait]
impl DevicePlugin for PluginService {
    async fn get_device_plugin_options(
        &self,
        _: Request<api::Empty>,
    ) -> Result<Response<api::DevicePluginOptions>, Status> {
        Ok(Response::new(PluginState::options()))
    }

    type ListAndWatchStream = ReceiverStream<Result<api::ListAndWatchResponse, Status>>;

    async fn list_and_watch(
        &self,
        _: Request<api::Empty>,
    ) -> Result<Response<Self::ListAndWatchStream>, Status> {
        let (tx, rx) = mpsc::channel(4);
        let state = self.state.clone();
        let mut health = state.health.clone();
        let mut stop = self.stop.clone();
        tokio::spawn(async move {
            state.metrics.list_and_watch_streams.inc();
            loop {
                let flags = health.borrow_and_update().clone();
                let list = state.inventory.device_list(&flags);
                if tx.send(Ok(list)).await.is_err() {
                    break;
                }
                tokio::select! {
                    changed = health.changed() => if changed.is_err() { break },
                    _ = stop.wait_for(|s| *s) => break,
                    _ = tx.closed() => break,
                }
            }
            state.metrics.list_and_watch_streams.dec();
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn get_preferred_allocation(
        &self,
        request: Request<api::PreferredAllocationRequest>,
    ) -> Result<Response<api::PreferredAllocationResponse>, Status> {
        let req = request.into_inner();
        let flags = self.state.health.borrow().clone();
        let mut container_responses = Vec::with_capacity(req.container_requests.len());
        for c in &req.container_requests {
            let ids = self
                .state
                .inventory
                .preferred(
                    &c.available_device_i_ds,
                    &c.must_include_device_i_ds,
                    c.allocation_size,
                    &flags,
                )
                .inspect_err(|e| tracing::warn!("GetPreferredAllocation refused: {e}"))?;
            container_responses
                .push(api::ContainerPreferredAllocationResponse { device_i_ds: ids });
        }
        Ok(Response::new(api::PreferredAllocationResponse {
            container_responses,
        }))
    }

    async fn allocate(
        &self,
        request: Request<api::AllocateRequest>,
    ) -> Result<Response<api::AllocateResponse>, Status> {
        self.state.metrics.allocate_calls.inc();
        let result = allocate(&self.state, request.into_inner());
        if let Err(e) = &result {
            self.state.metrics.allocate_errors.inc();
            tracing::warn!("Allocate refused: {e}");
        }
        Ok(Response::new(result?))
    }

    async fn pre_start_container(
        &self,
        request: Request<api::PreStartContainerRequest>,
    ) -> Result<Response<api::PreStartContainerResponse>, Status> {
        // Not requested in the options; still check the IDs if a kubelet calls it.
        for id in &request.get_ref().devices_ids {
            self.state.inventory.gpu_of(id)?;
        }
        Ok(Response::new(api::PreStartContainerResponse {}))
    }
}

fn allocate(
    state: &PluginState,
    req: api::AllocateRequest,
) -> Result<api::AllocateResponse, RequestError> {
    if req.container_requests.is_empty() {
        return Err(RequestError::NoContainers);
    }
    let mut container_responses = Vec::with_capacity(req.container_requests.len());
    for (i, c) in req.container_requests.iter().enumerate() {
        if c.devices_ids.is_empty() {
            return Err(RequestError::EmptyRequest(i));
        }
        container_responses.push(state.inventory.allocate(
            &c.devices_ids,
            state.strategy,
            &state.cdi_kind,
        )?);
    }
    Ok(api::AllocateResponse {
        container_responses,
    })
}
