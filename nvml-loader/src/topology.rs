//! Where a GPU sits: its PCI bus id in sysfs form, and its NUMA node, read from sysfs.
//!
//! `/sys/bus/pci/devices/<bus-id>/numa_node` holds the node, or `-1` when the platform
//! does not say; then the kubelet gets no topology for the device.

use std::path::Path;

/// The real sysfs root.
pub const SYSFS_ROOT: &str = "/sys";

/// The NUMA node of PCI device `bus_id` (sysfs form, `0000:3b:00.0`) under `sysfs_root`.
pub fn numa_node(sysfs_root: &Path, bus_id: &str) -> Option<i64> {
    let path = sysfs_root
        .join("bus/pci/devices")
        .join(bus_id)
        .join("numa_node");
    let text = std::fs::read_to_string(path).ok()?;
    let node: i64 = text.trim().parse().ok()?;
    (node >= 0).then_some(node)
}

/// Turns NVML's `00000000:3B:00.0` (or sysfs' `0000:3b:00.0`) into sysfs form.
pub fn normalize_bus_id(id: &str) -> Option<String> {
    let id = id.trim().to_ascii_lowercase();
    let (domain, rest) = id.split_once(':')?;
    let (bus, rest) = rest.split_once(':')?;
    let (dev, func) = rest.split_once('.')?;
    let hex = |s: &str, max: u32| u32::from_str_radix(s, 16).ok().filter(|v| *v <= max);
    let domain = hex(domain, 0xffff_ffff)?;
    let bus = hex(bus, 0xff)?;
    let dev = hex(dev, 0x1f)?;
    let func = hex(func, 0x7)?;
    if domain > 0xffff {
        return None;
    }
    Some(format!("{domain:04x}:{bus:02x}:{dev:02x}.{func:x}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_node(root: &Path, bus: &str, value: &str) {
        let dir = root.join("bus/pci/devices").join(bus);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("numa_node"), value).unwrap();
    }

    #[test]
    fn reads_node_and_treats_minus_one_as_unknown() {
        let root = tempfile::tempdir().unwrap();
        write_node(root.path(), "0000:3b:00.0", "1\n");
        write_node(root.path(), "0000:af:00.0", "-1\n");
        write_node(root.path(), "0000:b0:00.0", "garbage");
        assert_eq!(numa_node(root.path(), "0000:3b:00.0"), Some(1));
        assert_eq!(numa_node(root.path(), "0000:af:00.0"), None);
        assert_eq!(numa_node(root.path(), "0000:b0:00.0"), None);
        assert_eq!(numa_node(root.path(), "0000:00:00.0"), None);
    }

    #[test]
    fn bus_ids() {
        assert_eq!(
            normalize_bus_id("00000000:3B:00.0").as_deref(),
            Some("0000:3b:00.0")
        );
        assert_eq!(
            normalize_bus_id("0000:af:1f.7").as_deref(),
            Some("0000:af:1f.7")
        );
        assert_eq!(normalize_bus_id("3b:00.0"), None);
        assert_eq!(normalize_bus_id("0000:3b:20.0"), None);
    }
}
