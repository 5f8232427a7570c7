//! [`NvmlSource`]: the [`GpuDiscovery`] backed by NVML (the real driver's, or the GPU
//! simulator's `libnvidia-ml.so.1`): discovery, the device node of a UUID, critical XID
//! events and probes. This module decides which XIDs are faults; the device plugin's
//! health monitor decides what a fault does.

use std::ffi::CStr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crate::gpu::{validate_uuid, Fault, Gpu, GpuDiscovery, GpuError, Probe};
use crate::nvml::{sys, DeviceHandle, EventSet, Nvml, NvmlError};
use crate::topology::normalize_bus_id;

/// XIDs caused by applications, not by the GPU; NVIDIA's plugin ignores them too.
pub const APPLICATION_XIDS: [u64; 6] = [13, 31, 43, 45, 68, 109];

/// Whether an XID event makes the GPU unhealthy.
pub fn is_critical_xid(xid: u64) -> bool {
    !APPLICATION_XIDS.contains(&xid)
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

/// The [`GpuDiscovery`] backed by NVML. NVML stays initialized while the source (or
/// its event set) lives, and shuts down when both are gone.
pub struct NvmlSource {
    nvml: Arc<Nvml>,
    /// The critical-XID event set over the discovered GPUs, made at the first wait
    /// after a discovery (so discovery alone, all kiwi-runtime and kiwi-hook ask,
    /// registers no events).
    events: Events,
    /// Device handles and UUIDs of the discovered GPUs, to name event devices.
    known: Vec<(DeviceHandle, String)>,
    sysfs: PathBuf,
    driver: String,
    /// The last event-wait error logged, so a lasting one is logged once.
    last_wait_error: Option<String>,
}

enum Events {
    /// Not asked for since the last discovery.
    NotMade,
    /// Made; `None` when this NVML has no events or registering failed (probes only).
    Made(Option<EventSet>),
}

impl NvmlSource {
    /// Loads NVML from `library` (e.g. [`crate::NVML_LIBRARY`]) and initializes it.
    pub fn load(library: &str) -> Result<NvmlSource, GpuError> {
        let nvml = Arc::new(Nvml::load(library)?);
        let driver = nvml.driver_version().unwrap_or_else(|e| {
            tracing::debug!("{e}");
            "unknown".into()
        });
        Ok(NvmlSource {
            nvml,
            events: Events::NotMade,
            known: Vec::new(),
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

    fn events(&mut self) -> Option<&EventSet> {
        if matches!(self.events, Events::NotMade) {
            let devices: Vec<DeviceHandle> = self.known.iter().map(|(d, _)| *d).collect();
            let set = self.nvml.xid_event_set(&devices).unwrap_or_else(|e| {
                tracing::warn!("no NVML events, probing only: {e}");
                None
            });
            self.events = Events::Made(set);
        }
        match &self.events {
            Events::Made(set) => set.as_ref(),
            Events::NotMade => None,
        }
    }
}

impl GpuDiscovery for NvmlSource {
    fn discover(&mut self) -> Result<Vec<Gpu>, GpuError> {
        let nvml = Arc::clone(&self.nvml);
        let count = nvml.device_count()?;
        let mut gpus = Vec::with_capacity(count as usize);
        let mut handles = Vec::with_capacity(count as usize);
        for i in 0..count {
            let d = nvml.handle_by_index(i)?;
            let mut gpu = Gpu::new(nvml.index(d).unwrap_or(i), nvml.uuid(d)?);
            validate_uuid(&gpu.uuid).map_err(|message| GpuError::Nvml {
                call: "nvmlDeviceGetUUID",
                message,
            })?;
            gpu.minor = nvml
                .minor_number(d)
                .inspect_err(|e| tracing::debug!(gpu = %gpu.uuid, "no device node minor: {e}"))
                .ok();
            gpu.name = nvml.name(d).ok();
            gpu.memory_bytes = nvml.memory(d).ok().map(|m| m.total);
            gpu.pci_bus_id = pci_bus_id(&nvml, d).ok();
            gpu.numa_node = gpu
                .pci_bus_id
                .as_deref()
                .and_then(|bus| crate::topology::numa_node(&self.sysfs, bus));
            handles.push((d, gpu.uuid.clone()));
            gpus.push(gpu);
        }
        gpus.sort_by_key(|g| g.index);
        self.known = handles;
        self.events = Events::NotMade;
        Ok(gpus)
    }

    /// One NVML look-up by UUID (`nvmlDeviceGetHandleByUUID`), without discovering
    /// every GPU.
    fn minor_for_uuid(&mut self, uuid: &str) -> Result<u32, GpuError> {
        let d = self
            .nvml
            .handle_by_uuid(uuid)
            .map_err(|e| GpuError::UnknownGpu {
                uuid: uuid.to_string(),
                reason: format!("NVML does not know it ({}, code {})", e.message, e.code),
            })?;
        Ok(self.nvml.minor_number(d)?)
    }

    fn wait_faults(&mut self, timeout: Duration) -> Vec<Fault> {
        let Some(events) = self.events() else {
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
            Err(e) if e.code == sys::NVML_ERROR_GPU_IS_LOST => {
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

    #[test]
    fn missing_library_is_an_nvml_error() {
        let e = NvmlSource::load("/nonexistent/libnvidia-ml.so.1")
            .err()
            .unwrap();
        assert!(e.is_nvml(), "{e}");
        assert!(
            e.to_string().starts_with("cannot load NVML (/nonexistent/"),
            "{e}"
        );
    }
}
