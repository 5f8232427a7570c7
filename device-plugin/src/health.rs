//! The health monitor: one thread that owns the [`GpuDiscovery`], waits for its fault
//! events and probes every GPU at a fixed interval, and publishes one health flag per
//! GPU on a `tokio::sync::watch` channel that every `ListAndWatch` stream follows.
//!
//! Rules: a GPU whose probe fails is unhealthy until a probe succeeds. A critical
//! fault event (an XID) makes it unhealthy at once, and it stays so until a probe
//! that comes at least one interval after the last such event succeeds — a fault
//! that keeps recurring keeps the GPU out.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::watch;

use kiwi_nvml::{Fault, Gpu, GpuDiscovery, Probe};

/// Health flags by position in the inventory's GPU list; `true` is healthy.
pub type HealthFlags = Arc<Vec<bool>>;

/// The longest one wait for faults lasts, so that stopping is noticed quickly.
const MAX_WAIT: Duration = Duration::from_millis(250);

#[derive(Debug, Default, Clone)]
struct GpuHealth {
    probe_failure: Option<String>,
    fault_until: Option<Instant>,
}

impl GpuHealth {
    fn healthy(&self) -> bool {
        self.probe_failure.is_none() && self.fault_until.is_none()
    }
}

/// A running monitor; dropping it stops the thread (within 250 ms plus one
/// probe round).
pub struct HealthMonitor {
    rx: watch::Receiver<HealthFlags>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl HealthMonitor {
    /// Starts watching `gpus` (as discovered from `source`), all healthy at first.
    pub fn start(
        mut source: Box<dyn GpuDiscovery>,
        gpus: Vec<Gpu>,
        interval: Duration,
    ) -> std::io::Result<HealthMonitor> {
        let (tx, rx) = watch::channel(Arc::new(vec![true; gpus.len()]));
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = stop.clone();
        let thread = std::thread::Builder::new()
            .name("kiwi-health".into())
            .spawn(move || monitor_loop(source.as_mut(), &gpus, interval, &tx, &stop2))?;
        Ok(HealthMonitor {
            rx,
            stop,
            thread: Some(thread),
        })
    }

    /// A receiver of every change.
    pub fn subscribe(&self) -> watch::Receiver<HealthFlags> {
        self.rx.clone()
    }
}

impl Drop for HealthMonitor {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            // Joining could wait on a blocking NVML call; the thread ends by itself.
            drop(t);
        }
    }
}

fn monitor_loop(
    source: &mut dyn GpuDiscovery,
    gpus: &[Gpu],
    interval: Duration,
    tx: &watch::Sender<HealthFlags>,
    stop: &AtomicBool,
) {
    let mut state = vec![GpuHealth::default(); gpus.len()];
    let mut next_probe = Instant::now() + interval;
    while !stop.load(Ordering::Relaxed) && !tx.is_closed() {
        let wait = next_probe
            .saturating_duration_since(Instant::now())
            .min(MAX_WAIT);
        let faults = source.wait_faults(wait);
        let now = Instant::now();
        for fault in &faults {
            apply_fault(gpus, &mut state, fault, now + interval);
        }
        if now >= next_probe {
            for (gpu, st) in gpus.iter().zip(state.iter_mut()) {
                match source.probe(gpu) {
                    Probe::Ok => {
                        if let Some(why) = st.probe_failure.take() {
                            tracing::info!(gpu = %gpu.uuid, "probe succeeds again (was: {why})");
                        }
                        if st.fault_until.is_some_and(|t| now >= t) {
                            tracing::info!(gpu = %gpu.uuid, "no fault for one interval; fault cleared");
                            st.fault_until = None;
                        }
                    }
                    Probe::Failed(why) => {
                        if st.probe_failure.is_none() {
                            tracing::warn!(gpu = %gpu.uuid, "probe failed: {why}");
                        }
                        st.probe_failure = Some(why);
                    }
                }
            }
            next_probe = now + interval;
        }
        let flags: Vec<bool> = state.iter().map(GpuHealth::healthy).collect();
        tx.send_if_modified(|cur| {
            if **cur == flags {
                return false;
            }
            for (gpu, (old, new)) in gpus.iter().zip(cur.iter().zip(&flags)) {
                if old != new {
                    let to = if *new { "Healthy" } else { "Unhealthy" };
                    tracing::warn!(gpu = %gpu.uuid, "GPU is now {to}");
                }
            }
            *cur = Arc::new(flags);
            true
        });
    }
}

fn apply_fault(gpus: &[Gpu], state: &mut [GpuHealth], fault: &Fault, until: Instant) {
    for (gpu, st) in gpus.iter().zip(state.iter_mut()) {
        if fault.uuid.as_deref().is_none_or(|u| u == gpu.uuid) {
            tracing::warn!(gpu = %gpu.uuid, "critical fault: {}", fault.reason);
            st.fault_until = Some(until);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiwi_nvml::{fake_uuid, FakeGpus};

    async fn wait_for(rx: &mut watch::Receiver<HealthFlags>, want: &[bool]) {
        let reached = tokio::time::timeout(Duration::from_secs(10), rx.wait_for(|f| **f == want))
            .await
            .map(|r| r.is_ok());
        assert_eq!(
            reached.ok(),
            Some(true),
            "health never became {want:?}: {:?}",
            *rx.borrow()
        );
    }

    #[tokio::test]
    async fn lost_gpu_goes_unhealthy_and_recovers() {
        let fake = FakeGpus::new(3);
        let mon = HealthMonitor::start(
            Box::new(fake.clone()),
            fake.gpus(),
            Duration::from_millis(30),
        )
        .unwrap();
        let mut rx = mon.subscribe();
        assert_eq!(**rx.borrow(), vec![true, true, true]);
        fake.lose(&fake_uuid(1));
        wait_for(&mut rx, &[true, false, true]).await;
        fake.clear(&fake_uuid(1));
        wait_for(&mut rx, &[true, true, true]).await;
    }

    #[tokio::test]
    async fn fault_is_immediate_and_held_one_interval() {
        let fake = FakeGpus::new(2);
        let interval = Duration::from_millis(300);
        let mon = HealthMonitor::start(Box::new(fake.clone()), fake.gpus(), interval).unwrap();
        let mut rx = mon.subscribe();
        let t0 = Instant::now();
        fake.fault(&fake_uuid(0), "xid 79");
        wait_for(&mut rx, &[false, true]).await;
        assert!(t0.elapsed() < interval, "fault took {:?}", t0.elapsed());
        wait_for(&mut rx, &[true, true]).await;
        assert!(t0.elapsed() >= interval, "cleared after {:?}", t0.elapsed());
    }

    #[test]
    fn fault_without_gpu_hits_every_gpu() {
        let gpus = FakeGpus::new(3).gpus();
        let mut state = vec![GpuHealth::default(); 3];
        let only = Fault {
            uuid: Some(fake_uuid(2)),
            reason: "xid 48".into(),
        };
        apply_fault(&gpus, &mut state, &only, Instant::now());
        assert_eq!(
            state.iter().map(GpuHealth::healthy).collect::<Vec<_>>(),
            [true, true, false]
        );
        let every = Fault {
            uuid: None,
            reason: "xid 79".into(),
        };
        apply_fault(&gpus, &mut state, &every, Instant::now());
        assert!(state.iter().all(|s| !s.healthy()));
    }
}
