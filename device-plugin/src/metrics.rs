//! Prometheus metrics for the plugin (`--metrics-addr`), in the text exposition
//! format, served by a deliberately tiny HTTP/1.0 responder: the plugin answers
//! `GET /metrics` and nothing else, so a web framework would be dead weight.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::health::HealthFlags;

/// A counter or gauge.
#[derive(Debug, Default)]
pub struct Value(AtomicI64);

impl Value {
    pub fn inc(&self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }
    pub fn dec(&self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
    pub fn set(&self, v: i64) {
        self.0.store(v, Ordering::Relaxed);
    }
    pub fn get(&self) -> i64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// Everything the plugin counts.
#[derive(Debug, Default)]
pub struct Metrics {
    pub vgpus_advertised: Value,
    pub gpus: Value,
    pub allocate_calls: Value,
    pub allocate_errors: Value,
    pub registrations: Value,
    pub list_and_watch_streams: Value,
}

impl Metrics {
    /// The exposition text; `health` gives the healthy GPU count.
    pub fn render(&self, health: &[bool]) -> String {
        let healthy = health.iter().filter(|h| **h).count();
        let rows: [(&str, &str, &str, i64); 7] = [
            (
                "kiwi_device_plugin_vgpus_advertised",
                "gauge",
                "vGPUs advertised to the kubelet",
                self.vgpus_advertised.get(),
            ),
            (
                "kiwi_device_plugin_gpus",
                "gauge",
                "Physical GPUs found",
                self.gpus.get(),
            ),
            (
                "kiwi_device_plugin_healthy_gpus",
                "gauge",
                "Physical GPUs currently healthy",
                healthy as i64,
            ),
            (
                "kiwi_device_plugin_allocate_calls_total",
                "counter",
                "Allocate calls received",
                self.allocate_calls.get(),
            ),
            (
                "kiwi_device_plugin_allocate_errors_total",
                "counter",
                "Allocate calls refused",
                self.allocate_errors.get(),
            ),
            (
                "kiwi_device_plugin_registrations_total",
                "counter",
                "Successful registrations with the kubelet",
                self.registrations.get(),
            ),
            (
                "kiwi_device_plugin_list_and_watch_streams",
                "gauge",
                "Open ListAndWatch streams",
                self.list_and_watch_streams.get(),
            ),
        ];
        let mut out = String::new();
        for (name, kind, help, v) in rows {
            out.push_str(&format!(
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}\n"
            ));
        }
        out
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
    let task = tokio::spawn(async move {
        loop {
            let Ok((mut conn, _)) = listener.accept().await else {
                // Out of file descriptors or similar: back off instead of spinning.
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                continue;
            };
            let metrics = metrics.clone();
            let health = health.clone();
            tokio::spawn(async move {
                let mut buf = [0u8; 2048];
                let read =
                    tokio::time::timeout(std::time::Duration::from_secs(5), conn.read(&mut buf))
                        .await;
                let Ok(Ok(n)) = read else { return };
                let head = String::from_utf8_lossy(&buf[..n]);
                let path = head.split_whitespace().nth(1).unwrap_or("");
                let (status, body) =
                    if head.starts_with("GET ") && (path == "/metrics" || path == "/") {
                        let flags = health.borrow().clone();
                        ("200 OK", metrics.render(&flags))
                    } else {
                        ("404 Not Found", "only GET /metrics is served\n".to_string())
                    };
                let reply = format!(
                    "HTTP/1.0 {status}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = conn.write_all(reply.as_bytes()).await;
                let _ = conn.shutdown().await;
            });
        }
    });
    Ok((local, task))
}

#[cfg(test)]
mod tests {
    use super::*;
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
        assert!(body.starts_with("HTTP/1.0 200"), "{body}");
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
        assert!(get(addr, "/other").await.starts_with("HTTP/1.0 404"));
        task.abort();
    }
}
