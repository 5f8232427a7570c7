//! Metrics plumbing shared by `kiwi-arbiter` and `kiwi-device-plugin`: the
//! maintained `prometheus-client` crate for the data model and encoding, and a
//! minimal HTTP/1.1 endpoint answering `GET /metrics` (and `/healthz`).
//!
//! The endpoint renders on every scrape through a callback, so daemons can refresh
//! gauges from their live state first.
//!
//! [`Registrar`] fills a registry (each metric made and registered in one step) and
//! [`render`] encodes it: the two steps every daemon's metrics take.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

pub use prometheus_client;
use prometheus_client::encoding::text::encode;
use prometheus_client::registry::{Metric, Registry};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Produces the exposition text for one scrape.
pub type Render = Arc<dyn Fn() -> String + Send + Sync>;

/// Content type of OpenMetrics text, as produced by `prometheus_client::encoding::text`.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// A registry being filled: each metric is made and registered in one step, so a
/// daemon's metrics are listed once, each with its name and help text. The
/// exposition lists them in the order they were added.
#[derive(Debug)]
pub struct Registrar {
    registry: Registry,
}

impl Registrar {
    /// Metrics named `<prefix>_<name>`.
    pub fn with_prefix(prefix: &str) -> Self {
        Self {
            registry: Registry::with_prefix(prefix),
        }
    }

    /// A new metric (counter, gauge or family), registered as `name` with `help`.
    /// The returned handle and the registered metric share their values.
    pub fn add<M: Metric + Clone + Default>(&mut self, name: &str, help: &str) -> M {
        self.add_metric(name, help, M::default())
    }

    /// [`Registrar::add`] for a metric made otherwise (a family whose metrics are
    /// built by a constructor of its own, such as histograms with their buckets).
    pub fn add_metric<M: Metric + Clone>(&mut self, name: &str, help: &str, metric: M) -> M {
        self.registry.register(name, help, metric.clone());
        metric
    }

    /// The filled registry.
    pub fn finish(self) -> Registry {
        self.registry
    }
}

/// The exposition text of `registry` (OpenMetrics); empty where it cannot be encoded.
pub fn render(registry: &Registry) -> String {
    let mut out = String::new();
    if encode(&mut out, registry).is_err() {
        out.clear();
    }
    out
}

/// Serves `/metrics` on `listener` until `shutdown` resolves.
pub async fn serve(listener: TcpListener, render: Render, shutdown: impl Future<Output = ()>) {
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            res = listener.accept() => {
                if let Ok((stream, _)) = res {
                    let render = render.clone();
                    tokio::spawn(async move {
                        let _ = tokio::time::timeout(Duration::from_secs(10), answer(stream, render)).await;
                    });
                } else {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
            _ = &mut shutdown => return,
        }
    }
}

async fn answer(mut stream: TcpStream, render: Render) -> std::io::Result<()> {
    // Read the request head (bounded); only the request line matters.
    let mut head = Vec::with_capacity(512);
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 16 * 1024 {
        let n = stream.read(&mut buf).await?;
        if n == 0 {
            break;
        }
        head.extend_from_slice(&buf[..n]);
    }
    let line = head.split(|&b| b == b'\n').next().unwrap_or_default();
    let line = String::from_utf8_lossy(line);
    let mut parts = line.split_whitespace();
    let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let path = path.split('?').next().unwrap_or("");
    let (status, ctype, body) = match (method, path) {
        ("GET", "/metrics") => ("200 OK", CONTENT_TYPE, render()),
        ("GET", "/healthz") => ("200 OK", "text/plain", "ok\n".to_string()),
        ("GET", _) => ("404 Not Found", "text/plain", "try /metrics\n".to_string()),
        _ => (
            "405 Method Not Allowed",
            "text/plain",
            "GET only\n".to_string(),
        ),
    };
    let resp = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(resp.as_bytes()).await?;
    stream.shutdown().await
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::metrics::counter::Counter;
    use prometheus_client::metrics::gauge::Gauge;

    async fn get(addr: std::net::SocketAddr, req: &str) -> String {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(req.as_bytes()).await.unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        out
    }

    #[tokio::test]
    async fn serves_metrics_from_the_registry() {
        let mut registrar = Registrar::with_prefix("kiwi_test");
        let c: Counter = registrar.add("events", "test counter");
        c.inc();
        let reg = Arc::new(registrar.finish());
        let render: Render = Arc::new(move || super::render(&reg));
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(serve(l, render, async {
            let _ = rx.await;
        }));
        let r = get(addr, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").await;
        assert!(r.starts_with("HTTP/1.1 200 OK"), "{r}");
        assert!(r.contains("kiwi_test_events_total 1"), "{r}");
        let r = get(addr, "GET /nope HTTP/1.1\r\n\r\n").await;
        assert!(r.starts_with("HTTP/1.1 404"), "{r}");
        let r = get(addr, "garbage\r\n\r\n").await;
        assert!(r.starts_with("HTTP/1.1 405"), "{r}");
        let _ = tx.send(());
        task.await.unwrap();
    }

    /// Metrics come out in the order they were added, each under the prefix, and a
    /// handle moves the registered metric.
    #[test]
    fn registrar_registers_in_order_under_the_prefix() {
        let mut r = Registrar::with_prefix("kiwi_x");
        let b: Gauge = r.add("b", "the second letter");
        let a: Counter = r.add_metric("a", "the first letter", Counter::default());
        b.set(7);
        a.inc();
        let out = render(&r.finish());
        let b_at = out.find("# HELP kiwi_x_b the second letter").expect(&out);
        let a_at = out.find("# HELP kiwi_x_a the first letter").expect(&out);
        assert!(b_at < a_at, "{out}");
        assert!(out.contains("\nkiwi_x_b 7\n"), "{out}");
        assert!(out.contains("\nkiwi_x_a_total 1\n"), "{out}");
    }
}
