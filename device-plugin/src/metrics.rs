//! Prometheus metrics for the plugin (`--metrics-addr`): the data model and text
//! encoding of the maintained `prometheus-client` crate, served on `GET /metrics`
//! by the endpoint Kiwi's daemons share (`kiwi-metrics`).

use std::net::SocketAddr;
use std::sync::Arc;

use kiwi_metrics::Registrar;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::health::HealthFlags;

/// Everything the plugin counts.
#[derive(Debug)]
pub struct Metrics {
    pub vgpus_advertised: Gauge,
    pub gpus: Gauge,
    pub allocate_calls: Counter,
    pub allocate_errors: Counter,
    pub registrations: Counter,
    pub list_and_watch_streams: Gauge,
    healthy_gpus: Gauge,
    registry: Registry,
}

impl Default for Metrics {
    fn default() -> Self {
        // Added in the order of the exposition.
        let mut r = Registrar::with_prefix("kiwi_device_plugin");
        Metrics {
            vgpus_advertised: r.add("vgpus_advertised", "vGPUs advertised to the kubelet"),
            gpus: r.add("gpus", "Physical GPUs found"),
            healthy_gpus: r.add("healthy_gpus", "Physical GPUs currently healthy"),
            allocate_calls: r.add("allocate_calls", "Allocate calls received"),
            allocate_errors: r.add("allocate_errors", "Allocate calls refused"),
            registrations: r.add("registrations", "Successful registrations with the kubelet"),
            list_and_watch_streams: r.add("list_and_watch_streams", "Open ListAndWatch streams"),
            registry: r.finish(),
        }
    }
}

impl Metrics {
    /// The exposition text; `health` gives the healthy GPU count.
    pub fn render(&self, health: &[bool]) -> String {
        self.healthy_gpus
            .set(health.iter().filter(|h| **h).count() as i64);
        kiwi_metrics::render(&self.registry)
    }
}

/// Binds `addr` and serves `/metrics` until the task is dropped.
pub async fn serve(
    addr: SocketAddr,
    metrics: Arc<Metrics>,
    health: watch::Receiver<HealthFlags>,
) -> std::io::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let listener = TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    let render: kiwi_metrics::Render = Arc::new(move || {
        let flags = health.borrow().clone();
        metrics.render(&flags)
    });
    let task = tokio::spawn(kiwi_metrics::serve(
        listener,
        render,
        std::future::pending::<()>(),
    ));
    Ok((local, task))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    async fn get(addr: SocketAddr, path: &str) -> String {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes())
            .await
            .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        out
    }

    #[tokio::test]
    async fn serves_counters_and_health() {
        let m = Arc::new(Metrics::default());
        m.vgpus_advertised.set(20);
        m.allocate_calls.inc();
        m.allocate_calls.inc();
        let (_tx, rx) = watch::channel(Arc::new(vec![true, false]));
        let (addr, task) = serve("127.0.0.1:0".parse().unwrap(), m, rx).await.unwrap();
        let body = get(addr, "/metrics").await;
        assert!(body.starts_with("HTTP/1.1 200"), "{body}");
        assert!(
            body.contains("\nkiwi_device_plugin_vgpus_advertised 20\n"),
            "{body}"
        );
        assert!(
            body.contains("\nkiwi_device_plugin_allocate_calls_total 2\n"),
            "{body}"
        );
        assert!(
            body.contains("\nkiwi_device_plugin_healthy_gpus 1\n"),
            "{body}"
        );
        assert!(get(addr, "/other").await.starts_with("HTTP/1.1 404"));
        task.abort();
    }
}
