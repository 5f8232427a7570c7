//! NVML itself, loaded with `dlopen` at run time: the raw C signatures ([`sys`]) and
//! [`Nvml`], whose methods return `Result`s (cudarc's `sys` and `result` layers). Only
//! the NVML functions listed in `docs/device-plugin.md` are called (the GPU
//! simulator's `libnvidia-ml.so.1` implements exactly those). What a GPU is to Kiwi,
//! and discovery, are [`crate::gpu`]'s and [`crate::source`]'s, above this layer.

use std::ffi::{c_char, c_uint, c_ulonglong, CStr, CString};
use std::sync::Arc;
use std::time::Duration;

/// The library loaded by default (found through the dynamic linker's search path).
pub const NVML_LIBRARY: &str = "libnvidia-ml.so.1";

pub use crate::sys;

/// A failed NVML call.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{call}: {message} (NVML error {code})")]
pub struct NvmlError {
    pub call: &'static str,
    pub code: sys::NvmlReturn,
    pub message: String,
}

fn error_with(
    error_string: sys::ErrorString,
    call: &'static str,
    code: sys::NvmlReturn,
) -> NvmlError {
    // SAFETY: nvmlErrorString accepts any code and returns a static C string (or null
    // from a broken library, handled below).
    let ptr = unsafe { error_string(code) };
    let message = if ptr.is_null() {
        "unknown error".to_string()
    } else {
        // SAFETY: non-null, NUL-terminated, static per nvml.h.
        unsafe { CStr::from_ptr(ptr) }
            .to_string_lossy()
            .into_owned()
    };
    NvmlError {
        call,
        code,
        message,
    }
}

/// Why NVML could not be loaded and initialized.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LoadError {
    /// The library is missing or lacks a required symbol.
    #[error("cannot load NVML ({library}): {message}")]
    Library { library: String, message: String },
    /// `nvmlInit_v2` failed (e.g. no driver loaded).
    #[error(transparent)]
    Init(#[from] NvmlError),
}

struct Fns {
    init: sys::Init,
    shutdown: sys::Shutdown,
    error_string: sys::ErrorString,
    driver_version: Option<sys::SystemGetDriverVersion>,
    count: sys::DeviceGetCount,
    by_index: sys::DeviceGetHandleByIndex,
    by_uuid: Option<sys::DeviceGetHandleByUuid>,
    uuid: sys::DeviceGetString,
    name: Option<sys::DeviceGetString>,
    memory: Option<sys::DeviceGetMemoryInfo>,
    minor: Option<sys::DeviceGetUint>,
    pci: Option<sys::DeviceGetPciInfo>,
    index: Option<sys::DeviceGetUint>,
    processes: Option<sys::DeviceGetProcesses>,
    set_create: Option<sys::EventSetCreate>,
    register: Option<sys::DeviceRegisterEvents>,
    supported: Option<sys::DeviceGetSupportedEventTypes>,
    wait: Option<sys::EventSetWait>,
    set_free: Option<sys::EventSetFree>,
}

/// An NVML device handle. Handles are process-wide pointers into NVML, valid until
/// `nvmlShutdown`, and NVML is thread-safe, so they may cross threads.
#[derive(Debug, Clone, Copy)]
pub struct DeviceHandle(sys::Device);

impl DeviceHandle {
    /// The raw handle, to compare handles (never dereferenced).
    pub fn raw(&self) -> sys::Device {
        self.0
    }
}

// SAFETY: see the type's docs: an NVML handle is an opaque process-wide token, not
// memory this program dereferences, and NVML calls on it are thread-safe.
unsafe impl Send for DeviceHandle {}

/// A loaded and initialized NVML; shut down on drop.
pub struct Nvml {
    fns: Fns,
    _lib: libloading::Library,
}

// SAFETY: NVML is documented thread-safe; `Fns` holds plain function pointers and the
// library handle is only kept alive, never used mutably.
unsafe impl Send for Nvml {}
// SAFETY: as above.
unsafe impl Sync for Nvml {}

fn load_error(library: &str, message: impl ToString) -> LoadError {
    LoadError::Library {
        library: library.to_string(),
        message: message.to_string(),
    }
}

impl Nvml {
    /// Loads `library` (e.g. [`NVML_LIBRARY`]) and calls `nvmlInit_v2`.
    pub fn load(library: &str) -> Result<Nvml, LoadError> {
        // SAFETY: loading NVML runs its initializers, which have no preconditions.
        let lib =
            unsafe { libloading::Library::new(library) }.map_err(|e| load_error(library, e))?;
        macro_rules! required {
            ($name:literal) => {
                // SAFETY: the type on the left is nvml.h's signature for this symbol.
                *unsafe { lib.get(concat!($name, "\0").as_bytes()) }
                    .map_err(|e| load_error(library, e))?
            };
        }
        macro_rules! optional {
            ($name:literal) => {
                // SAFETY: the type on the left is nvml.h's signature for this symbol.
                unsafe { lib.get(concat!($name, "\0").as_bytes()) }
                    .ok()
                    .map(|s| *s)
            };
        }
        let fns = Fns {
            init: required!("nvmlInit_v2"),
            shutdown: required!("nvmlShutdown"),
            error_string: required!("nvmlErrorString"),
            driver_version: optional!("nvmlSystemGetDriverVersion"),
            count: required!("nvmlDeviceGetCount_v2"),
            by_index: required!("nvmlDeviceGetHandleByIndex_v2"),
            by_uuid: optional!("nvmlDeviceGetHandleByUUID"),
            uuid: required!("nvmlDeviceGetUUID"),
            name: optional!("nvmlDeviceGetName"),
            memory: optional!("nvmlDeviceGetMemoryInfo"),
            minor: optional!("nvmlDeviceGetMinorNumber"),
            pci: optional!("nvmlDeviceGetPciInfo_v3"),
            index: optional!("nvmlDeviceGetIndex"),
            processes: optional!("nvmlDeviceGetComputeRunningProcesses_v3"),
            set_create: optional!("nvmlEventSetCreate"),
            register: optional!("nvmlDeviceRegisterEvents"),
            supported: optional!("nvmlDeviceGetSupportedEventTypes"),
            wait: optional!("nvmlEventSetWait_v2"),
            set_free: optional!("nvmlEventSetFree"),
        };
        // SAFETY: nvmlInit_v2 takes no arguments and may be called from any thread.
        let ret = unsafe { (fns.init)() };
        if ret != sys::NVML_SUCCESS {
            // Not wrapped in `Nvml` yet, so no nvmlShutdown runs for a failed init.
            return Err(error_with(fns.error_string, "nvmlInit_v2", ret).into());
        }
        Ok(Nvml { fns, _lib: lib })
    }

    fn error(&self, call: &'static str, code: sys::NvmlReturn) -> NvmlError {
        error_with(self.fns.error_string, call, code)
    }

    fn check(&self, call: &'static str, code: sys::NvmlReturn) -> Result<(), NvmlError> {
        if code == sys::NVML_SUCCESS {
            Ok(())
        } else {
            Err(self.error(call, code))
        }
    }

    fn missing(call: &'static str) -> NvmlError {
        NvmlError {
            call,
            code: sys::NVML_ERROR_NOT_SUPPORTED,
            message: "not exported by this NVML".into(),
        }
    }

    fn string(
        &self,
        call: &'static str,
        f: impl FnOnce(*mut c_char, c_uint) -> sys::NvmlReturn,
        size: usize,
    ) -> Result<String, NvmlError> {
        let mut buf = vec![0 as c_char; size];
        self.check(call, f(buf.as_mut_ptr(), size as c_uint))?;
        // Guarantee termination even if the library filled the whole buffer.
        buf[size - 1] = 0;
        // SAFETY: `buf` is NUL-terminated (set above) and outlives the borrow.
        Ok(unsafe { CStr::from_ptr(buf.as_ptr()) }
            .to_string_lossy()
            .into_owned())
    }

    pub fn driver_version(&self) -> Result<String, NvmlError> {
        let f = self
            .fns
            .driver_version
            .ok_or_else(|| Self::missing("nvmlSystemGetDriverVersion"))?;
        self.string(
            "nvmlSystemGetDriverVersion",
            // SAFETY: the buffer and its length come from `string`.
            |p, n| unsafe { f(p, n) },
            sys::DRIVER_VERSION_BUFFER_SIZE,
        )
    }

    pub fn device_count(&self) -> Result<u32, NvmlError> {
        let mut n: c_uint = 0;
        // SAFETY: `n` is a valid out pointer.
        self.check("nvmlDeviceGetCount_v2", unsafe { (self.fns.count)(&mut n) })?;
        Ok(n)
    }

    pub fn handle_by_index(&self, index: u32) -> Result<DeviceHandle, NvmlError> {
        let mut d: sys::Device = std::ptr::null_mut();
        // SAFETY: `d` is a valid out pointer; NVML checks the index.
        self.check("nvmlDeviceGetHandleByIndex_v2", unsafe {
            (self.fns.by_index)(index, &mut d)
        })?;
        Ok(DeviceHandle(d))
    }

    pub fn handle_by_uuid(&self, uuid: &str) -> Result<DeviceHandle, NvmlError> {
        let f = self
            .fns
            .by_uuid
            .ok_or_else(|| Self::missing("nvmlDeviceGetHandleByUUID"))?;
        let c = CString::new(uuid).map_err(|_| NvmlError {
            call: "nvmlDeviceGetHandleByUUID",
            code: 2,
            message: "UUID contains a NUL byte".into(),
        })?;
        let mut d: sys::Device = std::ptr::null_mut();
        // SAFETY: `c` is NUL-terminated and lives across the call; `d` is a valid out pointer.
        self.check("nvmlDeviceGetHandleByUUID", unsafe {
            f(c.as_ptr(), &mut d)
        })?;
        Ok(DeviceHandle(d))
    }

    pub fn uuid(&self, d: DeviceHandle) -> Result<String, NvmlError> {
        let f = self.fns.uuid;
        // SAFETY: `d` came from NVML; the buffer and length come from `string`.
        self.string(
            "nvmlDeviceGetUUID",
            |p, n| unsafe { f(d.0, p, n) },
            sys::UUID_BUFFER_SIZE,
        )
    }

    pub fn name(&self, d: DeviceHandle) -> Result<String, NvmlError> {
        let f = self
            .fns
            .name
            .ok_or_else(|| Self::missing("nvmlDeviceGetName"))?;
        // SAFETY: `d` came from NVML; the buffer and length come from `string`.
        self.string(
            "nvmlDeviceGetName",
            |p, n| unsafe { f(d.0, p, n) },
            sys::NAME_BUFFER_SIZE,
        )
    }

    pub fn memory(&self, d: DeviceHandle) -> Result<sys::Memory, NvmlError> {
        let f = self
            .fns
            .memory
            .ok_or_else(|| Self::missing("nvmlDeviceGetMemoryInfo"))?;
        let mut m = sys::Memory::default();
        // SAFETY: `d` came from NVML; `m` is a valid out pointer of the right layout.
        self.check("nvmlDeviceGetMemoryInfo", unsafe { f(d.0, &mut m) })?;
        Ok(m)
    }

    /// The processes with a compute context on `d` and the device memory each uses
    /// (`nvmlDeviceGetComputeRunningProcesses_v3`), by host pid; a process whose use
    /// NVML cannot tell is left out.
    pub fn compute_processes(&self, d: DeviceHandle) -> Result<Vec<(u32, u64)>, NvmlError> {
        const CALL: &str = "nvmlDeviceGetComputeRunningProcesses_v3";
        let f = self.fns.processes.ok_or_else(|| Self::missing(CALL))?;
        let mut cap: c_uint = 64;
        // Processes start between the calls: a few tries with the size NVML asks for.
        for _ in 0..4 {
            let mut infos = vec![sys::ProcessInfo::default(); cap as usize];
            let mut n = cap;
            // SAFETY: `d` came from NVML; `infos` holds `n` entries of nvml.h's layout.
            let r = unsafe { f(d.0, &mut n, infos.as_mut_ptr()) };
            if r == sys::NVML_ERROR_INSUFFICIENT_SIZE {
                cap = n.max(cap.saturating_mul(2)).min(4096);
                continue;
            }
            self.check(CALL, r)?;
            infos.truncate((n as usize).min(infos.len()));
            return Ok(infos
                .into_iter()
                .filter(|p| p.used_gpu_memory != sys::VALUE_NOT_AVAILABLE)
                .map(|p| (p.pid, p.used_gpu_memory))
                .collect());
        }
        Err(self.error(CALL, sys::NVML_ERROR_INSUFFICIENT_SIZE))
    }

    fn uint(
        &self,
        call: &'static str,
        f: Option<sys::DeviceGetUint>,
        d: DeviceHandle,
    ) -> Result<u32, NvmlError> {
        let f = f.ok_or_else(|| Self::missing(call))?;
        let mut v: c_uint = 0;
        // SAFETY: `d` came from NVML; `v` is a valid out pointer.
        self.check(call, unsafe { f(d.0, &mut v) })?;
        Ok(v)
    }

    pub fn minor_number(&self, d: DeviceHandle) -> Result<u32, NvmlError> {
        self.uint("nvmlDeviceGetMinorNumber", self.fns.minor, d)
    }

    pub fn index(&self, d: DeviceHandle) -> Result<u32, NvmlError> {
        self.uint("nvmlDeviceGetIndex", self.fns.index, d)
    }

    /// The PCI information (`nvmlDeviceGetPciInfo_v3`), `bus_id` NUL-terminated.
    pub fn pci_info(&self, d: DeviceHandle) -> Result<sys::PciInfo, NvmlError> {
        let f = self
            .fns
            .pci
            .ok_or_else(|| Self::missing("nvmlDeviceGetPciInfo_v3"))?;
        // SAFETY: PciInfo is plain old data; all-zero is a valid value.
        let mut info: sys::PciInfo = unsafe { std::mem::zeroed() };
        // SAFETY: `d` came from NVML; `info` is a valid out pointer of the right layout.
        self.check("nvmlDeviceGetPciInfo_v3", unsafe { f(d.0, &mut info) })?;
        info.bus_id[31] = 0;
        Ok(info)
    }

    /// Creates an event set registered for critical XIDs on every device that supports
    /// them; `None` when this NVML has no event support at all. The set keeps NVML
    /// loaded (it holds `self`) until it is freed.
    pub fn xid_event_set(
        self: &Arc<Self>,
        devices: &[DeviceHandle],
    ) -> Result<Option<EventSet>, NvmlError> {
        let (Some(create), Some(register), Some(_wait), Some(_free)) = (
            self.fns.set_create,
            self.fns.register,
            self.fns.wait,
            self.fns.set_free,
        ) else {
            return Ok(None);
        };
        let mut raw: sys::EventSet = std::ptr::null_mut();
        // SAFETY: `raw` is a valid out pointer.
        self.check("nvmlEventSetCreate", unsafe { create(&mut raw) })?;
        let set = EventSet {
            nvml: Arc::clone(self),
            raw,
        };
        for &d in devices {
            let mut supported: c_ulonglong = sys::EVENT_TYPE_XID_CRITICAL_ERROR;
            if let Some(f) = self.fns.supported {
                // SAFETY: `d` came from NVML; `supported` is a valid out pointer.
                let ret = unsafe { f(d.0, &mut supported) };
                if ret != sys::NVML_SUCCESS {
                    tracing::warn!("{}", self.error("nvmlDeviceGetSupportedEventTypes", ret));
                    continue;
                }
            }
            let mask = supported & sys::EVENT_TYPE_XID_CRITICAL_ERROR;
            if mask == 0 {
                continue;
            }
            // SAFETY: `d` came from NVML and `set.raw` from nvmlEventSetCreate.
            let ret = unsafe { register(d.0, mask, set.raw) };
            if ret != sys::NVML_SUCCESS {
                tracing::warn!("{}", self.error("nvmlDeviceRegisterEvents", ret));
            }
        }
        Ok(Some(set))
    }
}

impl Drop for Nvml {
    fn drop(&mut self) {
        // SAFETY: init succeeded (a failed init never builds an `Nvml` that drops);
        // every event set holds an `Arc` of `self`, so all are freed by now.
        let _ = unsafe { (self.fns.shutdown)() };
    }
}

/// An NVML event set; freed on drop, before the NVML it holds can shut down.
pub struct EventSet {
    nvml: Arc<Nvml>,
    raw: sys::EventSet,
}

// SAFETY: the set is an opaque NVML token, never dereferenced here, and NVML calls on
// it are thread-safe; it is waited on and freed through `&self`/`Drop` only.
unsafe impl Send for EventSet {}

/// One event from [`EventSet::wait`].
#[derive(Debug, Clone, Copy)]
pub struct Event {
    pub device: Option<DeviceHandle>,
    pub event_type: u64,
    pub data: u64,
}

impl EventSet {
    /// Waits up to `timeout`; `Ok(None)` on timeout.
    pub fn wait(&self, timeout: Duration) -> Result<Option<Event>, NvmlError> {
        let f = self
            .nvml
            .fns
            .wait
            .ok_or_else(|| Nvml::missing("nvmlEventSetWait_v2"))?;
        // SAFETY: EventData is plain old data; all-zero is a valid value.
        let mut data: sys::EventData = unsafe { std::mem::zeroed() };
        let ms = timeout.as_millis().min(u128::from(u32::MAX)) as c_uint;
        // SAFETY: `raw` came from nvmlEventSetCreate; `data` is a valid out pointer.
        let ret = unsafe { f(self.raw, &mut data, ms) };
        match ret {
            sys::NVML_SUCCESS => Ok(Some(Event {
                device: (!data.device.is_null()).then_some(DeviceHandle(data.device)),
                event_type: data.event_type,
                data: data.event_data,
            })),
            sys::NVML_ERROR_TIMEOUT => Ok(None),
            code => Err(self.nvml.error("nvmlEventSetWait_v2", code)),
        }
    }
}

impl Drop for EventSet {
    fn drop(&mut self) {
        if let Some(free) = self.nvml.fns.set_free {
            // SAFETY: `raw` came from nvmlEventSetCreate and is freed once.
            let _ = unsafe { free(self.raw) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_library_is_a_clear_error() {
        let e = Nvml::load("/nonexistent/libnvidia-ml.so.1")
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("/nonexistent/libnvidia-ml.so.1"), "{e}");
        assert!(e.starts_with("cannot load NVML"), "{e}");
    }

    #[test]
    fn library_without_nvml_symbols_is_refused() {
        // libc is always there and exports none of NVML.
        let e = Nvml::load("libc.so.6").err().unwrap().to_string();
        assert!(e.contains("nvmlInit_v2"), "{e}");
    }

    #[test]
    fn struct_layouts_match_nvml_h() {
        assert_eq!(std::mem::size_of::<sys::PciInfo>(), 16 + 5 * 4 + 32);
        assert_eq!(std::mem::size_of::<sys::Memory>(), 24);
        assert_eq!(std::mem::size_of::<sys::EventData>(), 8 + 8 + 8 + 4 + 4);
    }
}
