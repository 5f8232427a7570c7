//! [`FakeGpus`]: an in-memory [`GpuDiscovery`] for tests and the device plugin's
//! benchmark, whose GPUs can be lost, faulted and cleared from another thread.

use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use crate::gpu::{Fault, Gpu, GpuDiscovery, GpuError, Probe};

#[derive(Default)]
struct FakeState {
    gpus: Vec<Gpu>,
    lost: Vec<String>,
    pending: Vec<Fault>,
    discover_error: Option<String>,
}

/// An in-memory GPU source for tests: GPUs can be lost, faulted and cleared from
/// another thread; a fault wakes the monitor at once.
#[derive(Clone, Default)]
pub struct FakeGpus {
    inner: Arc<(Mutex<FakeState>, Condvar)>,
}

impl FakeGpus {
    /// `count` GPUs with UUIDs `GPU-00000000-0000-0000-0000-0000000000NN`, device node
    /// minor number = index, NUMA node `index % 2`.
    pub fn new(count: u32) -> FakeGpus {
        let gpus = (0..count)
            .map(|i| {
                let mut g = Gpu::new(i, fake_uuid(i));
                g.minor = Some(i);
                g.name = Some("Fake GPU".into());
                g.memory_bytes = Some(16 << 30);
                g.numa_node = Some(i64::from(i % 2));
                g
            })
            .collect();
        FakeGpus::with_gpus(gpus)
    }

    pub fn with_gpus(gpus: Vec<Gpu>) -> FakeGpus {
        let fake = FakeGpus::default();
        fake.state().gpus = gpus;
        fake
    }

    fn state(&self) -> std::sync::MutexGuard<'_, FakeState> {
        // A test that panicked while holding the lock has failed already; keep going.
        self.inner.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The GPUs, as discovered.
    pub fn gpus(&self) -> Vec<Gpu> {
        self.state().gpus.clone()
    }

    /// Makes discovery fail.
    pub fn fail_discovery(&self, message: &str) {
        self.state().discover_error = Some(message.into());
    }

    /// The GPU stops answering probes (like `NVML_ERROR_GPU_IS_LOST`).
    pub fn lose(&self, uuid: &str) {
        self.state().lost.push(uuid.into());
        self.inner.1.notify_all();
    }

    /// A critical fault event (like an XID 79).
    pub fn fault(&self, uuid: &str, reason: &str) {
        self.state().pending.push(Fault {
            uuid: Some(uuid.into()),
            reason: reason.into(),
        });
        self.inner.1.notify_all();
    }

    /// The GPU answers again.
    pub fn clear(&self, uuid: &str) {
        self.state().lost.retain(|u| u != uuid);
        self.inner.1.notify_all();
    }
}

/// The UUID [`FakeGpus`] gives GPU `i`.
pub fn fake_uuid(i: u32) -> String {
    format!("GPU-00000000-0000-0000-0000-{i:012}")
}

impl GpuDiscovery for FakeGpus {
    fn discover(&mut self) -> Result<Vec<Gpu>, GpuError> {
        let st = self.state();
        if let Some(message) = &st.discover_error {
            return Err(GpuError::Nvml {
                call: "nvmlInit_v2",
                message: message.clone(),
            });
        }
        Ok(st.gpus.clone())
    }

    fn wait_faults(&mut self, timeout: Duration) -> Vec<Fault> {
        let (lock, cv) = &*self.inner;
        let guard = lock.lock().unwrap_or_else(|p| p.into_inner());
        let (mut guard, _) = cv
            .wait_timeout_while(guard, timeout, |st| st.pending.is_empty())
            .unwrap_or_else(|p| p.into_inner());
        std::mem::take(&mut guard.pending)
    }

    fn probe(&mut self, gpu: &Gpu) -> Probe {
        if self.state().lost.contains(&gpu.uuid) {
            Probe::Failed(format!("{} is lost", gpu.uuid))
        } else {
            Probe::Ok
        }
    }

    fn describe(&self) -> String {
        "fake GPUs".into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fake_fault_wakes_waiter() {
        let fake = FakeGpus::new(2);
        let mut waiter = fake.clone();
        let t = std::thread::spawn(move || waiter.wait_faults(Duration::from_secs(10)));
        std::thread::sleep(Duration::from_millis(20));
        fake.fault(&fake_uuid(1), "xid 79");
        let faults = t.join().unwrap();
        assert_eq!(faults.len(), 1);
        assert_eq!(faults[0].uuid.as_deref(), Some(fake_uuid(1).as_str()));
    }

    #[test]
    fn fake_discovers_resolves_probes_and_fails_on_demand() {
        let mut fake = FakeGpus::new(2);
        assert_eq!(fake.discover().unwrap(), fake.gpus());
        assert_eq!(fake.minor_for_uuid(&fake_uuid(1)).unwrap(), 1);
        let gpu = fake.gpus()[0].clone();
        fake.lose(&gpu.uuid);
        assert!(matches!(fake.probe(&gpu), Probe::Failed(m) if m.contains("lost")));
        fake.clear(&gpu.uuid);
        assert_eq!(fake.probe(&gpu), Probe::Ok);
        fake.fail_discovery("no driver");
        let e = fake.discover().unwrap_err().to_string();
        assert!(e.contains("no driver"), "{e}");
    }
}
