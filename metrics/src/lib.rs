//! Metrics plumbing shared by `kiwi-arbiter` and `kiwi-device-plugin`: the
//! maintained `prometheus-client` crate for the data model and encoding, and a
//! minimal HTTP/1.1 endpoint answering `GET /metrics` (and `/healthz`).
//!
//! The endpoint renders on every scrape through a callback, so daemons can refresh
//! gauges from their live state first.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

pub use prometheus_client;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Produces the exposition text for one scrape.
pub type Render = Arc<dyn Fn() -> String + Send + Sync>;

/// Content type of OpenMetrics text, as produced by `prometheus_client::encoding::text`.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

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
    use prometheus_client::registry::Registry;

    async fn get(addr: std::net::SocketAddr, req: &str) -> String {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(req.as_bytes()).await.unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        out
    }

    #[tokio::test]
    async fn serves_metrics_from_the_registry() {
        let c: Counter = Counter::default();
        let mut reg = Registry::default();
        reg.register("kiwi_test_events", "test counter", c.clone());
        c.inc();
        let reg = Arc::new(reg);
        let render: Render = Arc::new(move || {
            let mut s = String::new();
            prometheus_client::encoding::text::encode(&mut s, &reg).unwrap();
            s
        });
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
}
