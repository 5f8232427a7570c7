//! Identities of simulated GPUs, shared by the CUDA and NVML stand-ins so both
//! report the same GPU: a UUID derived from (machine name, index) and a PCI address.

/// 16 raw UUID bytes for GPU `index` of machine `name` (what `cuDeviceGetUuid` gives).
pub fn gpu_uuid(name: &str, index: u32) -> [u8; 16] {
    // Two FNV-1a passes with different offsets: deterministic and stable across
    // builds (std's hashers are not guaranteed to be).
    let fnv = |seed: u64| {
        let mut h = seed;
        for b in name.bytes().chain([0u8]).chain(index.to_le_bytes()) {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x100_0000_01b3);
        }
        h
    };
    let a = fnv(0xcbf2_9ce4_8422_2325);
    let b = fnv(0x6c62_272e_07bb_0142);
    let mut out = [0u8; 16];
    out[..8].copy_from_slice(&a.to_be_bytes());
    out[8..].copy_from_slice(&b.to_be_bytes());
    // Mark as an RFC 4122 version-4-style UUID so tools that parse it are happy.
    out[6] = (out[6] & 0x0f) | 0x40;
    out[8] = (out[8] & 0x3f) | 0x80;
    out
}

/// The NVML form of a UUID: `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`.
pub fn format_gpu_uuid(bytes: &[u8; 16]) -> String {
    let h: Vec<String> = bytes.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "GPU-{}-{}-{}-{}-{}",
        h[0..4].concat(),
        h[4..6].concat(),
        h[6..8].concat(),
        h[8..10].concat(),
        h[10..16].concat()
    )
}

/// The NVML UUID string of GPU `index` of machine `name`.
pub fn gpu_uuid_string(name: &str, index: u32) -> String {
    format_gpu_uuid(&gpu_uuid(name, index))
}

/// PCI bus number of a simulated GPU (domain 0, device 0, function 0).
pub fn pci_bus(index: u32) -> u32 {
    0x10 + index
}

/// `0000:BB:00.0`, the PCI bus id NVML and `cuDeviceGetPCIBusId` report.
pub fn pci_bus_id(index: u32) -> String {
    format!("00000000:{:02X}:00.0", pci_bus(index))
}

/// The marketing name of simulated GPUs.
pub const DEVICE_NAME: &str = "Kiwi Simulated GPU";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuids_are_deterministic_and_distinct() {
        assert_eq!(gpu_uuid("a", 0), gpu_uuid("a", 0));
        assert_ne!(gpu_uuid("a", 0), gpu_uuid("a", 1));
        assert_ne!(gpu_uuid("a", 0), gpu_uuid("b", 0));
        let s = gpu_uuid_string("a", 0);
        assert_eq!(s.len(), 40, "{s}");
        assert!(s.starts_with("GPU-"));
        let parts: Vec<usize> = s[4..].split('-').map(str::len).collect();
        assert_eq!(parts, vec![8, 4, 4, 4, 12]);
    }
}
