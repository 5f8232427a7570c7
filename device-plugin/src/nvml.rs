//! GPU discovery and health through NVML, loaded with `dlopen` at run time so the
//! plugin builds and runs on machines without the NVIDIA driver.
//!
//! Three layers, as in cudarc: the raw C signatures ([`sys`]) and [`Nvml`], whose
//! methods return `Result`s, live in the `kiwi-nvml` crate (shared with the arbiter)
//! and are re-exported here; [`NvmlSource`] is the [`GpuDiscovery`] the plugin uses.

use std::ffi::CStr;
use std::path::PathBuf;
use std::time::Duration;

use crate::gpu::{normalize_bus_id, Fault, Gpu, GpuDiscovery, GpuError, Probe};

pub use kiwi_nvml::{sys, DeviceHandle, Event, EventSet, LoadError, Nvml, NvmlError, NVML_LIBRARY};

/// XIDs caused by applications, not by the GPU; NVIDIA's plugin ignores them too.
pub const APPLICATION_XIDS: [u64; 6] = [13, 31, 43, 45, 68, 109];

impl From<NvmlError> for GpuError {
    fn from(e: NvmlError) -> GpuError {
        GpuError::Nvml {
            call: e.call,
            message: format!("{} (NVML error {})", e.message, e.code),
        }
    }
}

impl From<LoadError> for GpuError {
    fn from(e: LoadError) -> GpuError {
        match e {
            LoadError::Library { library, message } => GpuError::NvmlLoad { library, message },
            LoadError::Init(e) => e.into(),
        }
    }
}

/// The PCI bus id of `d` in sysfs form.
fn pci_bus_id(nvml: &Nvml, d: DeviceHandle) -> Result<String, NvmlError> {
    let info = nvml.pci_info(d)?;
    // SAFETY: `pci_info` NUL-terminates `bus_id`; the array lives across the borrow.
    let text = unsafe { CStr::from_ptr(info.bus_id.as_ptr()) }.to_string_lossy();
    Ok(normalize_bus_id(&text).unwrap_or_else(|| {
        format!(
            "{:04x}:{:02x}:{:02x}.0",
            info.domain & 0xffff,
            info.bus,
            info.device
        )
    }))
}

/// Whether an XID event makes the GPU unhealthy.
pub fn is_critical_xid(xid: u64) -> bool {
    !APPLICATION_XIDS.contains(&xid)
}

/// The [`GpuDiscovery`] backed by NVML.
pub struct NvmlSource {
    // Field order matters: the event set borrows `nvml` and must drop first.
    events: Option<EventSet<'static>>,
    /// Device handles and UUIDs of the discovered GPUs, to name event devices.
    known: Vec<(DeviceHandle, String)>,
    nvml: &'static Nvml,
    sysfs: PathBuf,
    driver: String,
    /// The last event-wait error logged, so a lasting one is logged once.
    last_wait_error: Option<String>,
}

// SAFETY: the event set and handles are NVML tokens usable from any thread (NVML is
// thread-safe); the monitor uses the source from one thread at a time.
unsafe impl Send for NvmlSource {}

impl NvmlSource {
    /// Loads NVML from `library` and initializes it.
    pub fn load(library: &str) -> Result<NvmlSource, GpuError> {
        // The source lives as long as the plugin; leaking one `Nvml` lets the event
        // set borrow it for 'static, and nvmlShutdown at exit is not needed.
        let nvml: &'static Nvml = Box::leak(Box::new(Nvml::load(library)?));
        let driver = nvml.driver_version().unwrap_or_else(|e| {
            tracing::debug!("{e}");
            "unknown".into()
        });
        Ok(NvmlSource {
            events: None,
            known: Vec::new(),
            nvml,
            sysfs: PathBuf::from(crate::topology::SYSFS_ROOT),
            driver,
            last_wait_error: None,
        })
    }

    /// Uses another sysfs root for NUMA look-ups (tests).
    pub fn with_sysfs(mut self, root: impl Into<PathBuf>) -> NvmlSource {
        self.sysfs = root.into();
        self
    }

    fn uuid_of(&self, d: DeviceHandle) -> Option<String> {
        self.known
            .iter()
            .find(|(h, _)| h.raw() == d.raw())
            .map(|(_, u)| u.clone())
            .or_else(|| self.nvml.uuid(d).ok())
    }
}

impl GpuDiscovery for NvmlSource {
    fn discover(&mut self) -> Result<Vec<Gpu>, GpuError> {
        let nvml = self.nvml;
        let count = nvml.device_count()?;
        let mut gpus = Vec::with_capacity(count as usize);
        let mut handles = Vec::with_capacity(count as usize);
        for i in 0..count {
            let d = nvml.handle_by_index(i)?;
            let mut gpu = Gpu::new(nvml.index(d).unwrap_or(i), nvml.uuid(d)?);
            crate::gpu::validate_uuid(&gpu.uuid).map_err(|message| GpuError::Nvml {
                call: "nvmlDeviceGetUUID",
                message,
            })?;
            gpu.name = nvml.name(d).ok();
            gpu.memory_bytes = nvml.memory(d).ok().map(|m| m.total);
            gpu.pci_bus_id = pci_bus_id(nvml, d).ok();
            gpu.numa_node = gpu
                .pci_bus_id
                .as_deref()
                .and_then(|bus| crate::topology::numa_node(&self.sysfs, bus));
            if let Ok(minor) = nvml.minor_number(d) {
                tracing::debug!(gpu = %gpu.uuid, "device node /dev/nvidia{minor}");
            }
            handles.push((d, gpu.uuid.clone()));
            gpus.push(gpu);
        }
        gpus.sort_by_key(|g| g.index);
        let raw: Vec<DeviceHandle> = handles.iter().map(|(d, _)| *d).collect();
        self.known = handles;
        self.events = None;
        match nvml.xid_event_set(&raw) {
            Ok(set) => self.events = set,
            Err(e) => tracing::warn!("no NVML events, probing only: {e}"),
        }
        Ok(gpus)
    }

    fn wait_faults(&mut self, timeout: Duration) -> Vec<Fault> {
        let Some(events) = &self.events else {
            std::thread::sleep(timeout);
            return Vec::new();
        };
        let result = events.wait(timeout);
        if result.is_ok() {
            self.last_wait_error = None;
        }
        match result {
            Ok(None) => Vec::new(),
            Ok(Some(ev)) => {
                if ev.event_type & sys::EVENT_TYPE_XID_CRITICAL_ERROR == 0 {
                    return Vec::new();
                }
                if !is_critical_xid(ev.data) {
                    tracing::info!("ignoring application XID {}", ev.data);
                    return Vec::new();
                }
                vec![Fault {
                    uuid: ev.device.and_then(|d| self.uuid_of(d)),
                    reason: format!("XID {}", ev.data),
                }]
            }
            // The wait cannot say which GPU is lost; the probes can, within one
            // interval, so only that GPU goes out (NVIDIA's plugin takes all out).
            Err(e) => {
                let text = e.to_string();
                if self.last_wait_error.as_deref() != Some(text.as_str()) {
                    tracing::warn!("{text}");
                    self.last_wait_error = Some(text);
                }
                std::thread::sleep(timeout);
                Vec::new()
            }
        }
    }

    fn probe(&mut self, gpu: &Gpu) -> Probe {
        let result = self
            .nvml
            .handle_by_uuid(&gpu.uuid)
            .and_then(|d| self.nvml.memory(d));
        match result {
            Ok(_) => Probe::Ok,
            Err(e) if e.code == sys::ERROR_GPU_IS_LOST => {
                Probe::Failed(format!("GPU is lost: {e}"))
            }
            Err(e) => Probe::Failed(e.to_string()),
        }
    }

    fn describe(&self) -> String {
        format!("NVML, driver {}", self.driver)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn application_xids_are_not_critical() {
        for x in APPLICATION_XIDS {
            assert!(!is_critical_xid(x));
        }
        assert!(is_critical_xid(79));
        assert!(is_critical_xid(48));
    }
}
