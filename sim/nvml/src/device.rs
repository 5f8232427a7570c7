//! Device identity: the count, handles (by index, UUID or PCI bus id), UUID, name,
//! index, minor number, PCI info, architecture and compute capability. The UUIDs and
//! PCI addresses are `kiwi_sim_core::ident`'s, the same the CUDA stand-in reports.

use std::ffi::{c_char, c_int, c_uint};

use kiwi_sim_core::ident;

use crate::abi::*;
use crate::ffi::{c_str, fill_chars, out, out_pair, write_str};
use crate::model;
use crate::state::{state, Gpu};

pub(crate) fn count(n: *mut c_uint) -> Result<(), NvmlReturn> {
    out(n, Gpu::count(state()?))
}

pub(crate) fn handle_by_index(index: c_uint, handle: *mut Device) -> Result<(), NvmlReturn> {
    Gpu::at(state()?, index, NVML_ERROR_INVALID_ARGUMENT)?.write_handle(handle)
}

pub(crate) fn handle_by_uuid(uuid: *const c_char, handle: *mut Device) -> Result<(), NvmlReturn> {
    let s = state()?;
    let want = c_str(uuid)?;
    let index = (0..Gpu::count(s))
        .find(|&i| ident::gpu_uuid_string(&s.name, i) == want)
        .ok_or(NVML_ERROR_NOT_FOUND)?;
    Gpu::at(s, index, NVML_ERROR_NOT_FOUND)?.write_handle(handle)
}

/// By `[domain:]bus:device[.function]` in hex, any case (`00000000:10:00.0`,
/// `0000:10:00.0`, `10:00.0`).
pub(crate) fn handle_by_pci_bus_id(
    bus_id: *const c_char,
    handle: *mut Device,
) -> Result<(), NvmlReturn> {
    let s = state()?;
    let want = parse_pci_bus_id(c_str(bus_id)?).ok_or(NVML_ERROR_INVALID_ARGUMENT)?;
    let index = (0..Gpu::count(s))
        .find(|&i| want == (0, ident::pci_bus(i), 0, 0))
        .ok_or(NVML_ERROR_NOT_FOUND)?;
    Gpu::at(s, index, NVML_ERROR_NOT_FOUND)?.write_handle(handle)
}

/// (domain, bus, device, function) of a PCI bus id.
fn parse_pci_bus_id(id: &str) -> Option<(u32, u32, u32, u32)> {
    let hex = |s: &str| u32::from_str_radix(s, 16).ok();
    let parts: Vec<&str> = id.trim().split(':').collect();
    let (domain, bus, dev_fn) = match parts[..] {
        [domain, bus, dev_fn] => (hex(domain)?, hex(bus)?, dev_fn),
        [bus, dev_fn] => (0, hex(bus)?, dev_fn),
        _ => return None,
    };
    let (device, function) = match dev_fn.split_once('.') {
        Some((d, f)) => (hex(d)?, hex(f)?),
        None => (hex(dev_fn)?, 0),
    };
    Some((domain, bus, device, function))
}

pub(crate) fn index(handle: Device, index: *mut c_uint) -> Result<(), NvmlReturn> {
    out(index, Gpu::of(handle)?.index)
}

/// The minor number is the index: device node `/dev/nvidia<index>`.
pub(crate) fn minor_number(handle: Device, minor: *mut c_uint) -> Result<(), NvmlReturn> {
    out(minor, Gpu::of(handle)?.index)
}

pub(crate) fn uuid(handle: Device, buf: *mut c_char, len: c_uint) -> Result<(), NvmlReturn> {
    let gpu = Gpu::of(handle)?;
    write_str(
        buf,
        len,
        &ident::gpu_uuid_string(&gpu.state.name, gpu.index),
    )
}

pub(crate) fn name(handle: Device, buf: *mut c_char, len: c_uint) -> Result<(), NvmlReturn> {
    Gpu::of(handle)?;
    write_str(buf, len, ident::DEVICE_NAME)
}

pub(crate) fn pci_info(handle: Device, pci: *mut PciInfo) -> Result<(), NvmlReturn> {
    let gpu = Gpu::of(handle)?;
    let id = ident::pci_bus_id(gpu.index);
    out(
        pci,
        PciInfo {
            bus_id_legacy: fill_chars(&id[4..]),
            domain: 0,
            bus: ident::pci_bus(gpu.index),
            device: 0,
            // NVIDIA's vendor id 0x10de in the low half, as NVML reports it.
            pci_device_id: 0x20b0_10de,
            pci_sub_system_id: 0x1450_10de,
            bus_id: fill_chars(&id),
        },
    )
}

pub(crate) fn cuda_compute_capability(
    handle: Device,
    major: *mut c_int,
    minor: *mut c_int,
) -> Result<(), NvmlReturn> {
    Gpu::of(handle)?;
    let (maj, min) = model::COMPUTE_CAPABILITY;
    out_pair(major, maj, minor, min)
}

pub(crate) fn architecture(handle: Device, arch: *mut c_uint) -> Result<(), NvmlReturn> {
    Gpu::of(handle)?;
    out(arch, NVML_DEVICE_ARCH_AMPERE)
}

#[cfg(test)]
mod tests {
    use super::parse_pci_bus_id;

    #[test]
    fn pci_bus_ids_parse_in_every_form_nvml_accepts() {
        for id in ["00000000:10:00.0", "0000:10:00.0", "10:00.0", "0000:10:00"] {
            assert_eq!(parse_pci_bus_id(id), Some((0, 0x10, 0, 0)), "{id}");
        }
        assert_eq!(parse_pci_bus_id("0001:1A:00.1"), Some((1, 0x1a, 0, 1)));
        assert_eq!(parse_pci_bus_id("GPU-1234"), None);
        assert_eq!(parse_pci_bus_id(""), None);
    }
}
