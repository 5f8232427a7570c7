//! The answer to the CUDA runtime's integrity check (`cuGetExportTable` table
//! `INTEGRITY_CHECK`, `d4082055-bde6-704b-8d34-ba123c66e1f2`, slot 1).
//!
//! NVIDIA's runtime (`libcudart`, 12.x) calls the driver's check with its own version
//! and the current time, and compares the 16 bytes it gets with what it computes
//! itself; a wrong answer makes the runtime fail with
//! `cudaErrorSoftwareValidityNotEstablished` (103). The check is an HMAC over MD2
//! (RFC 1319; 16-byte blocks, so the HMAC pads are 16 bytes) with a fixed key, of:
//! the driver version, the runtime's version, the pid, the calling thread
//! (`pthread_self`, truncated), the addresses of the runtime-interface table, of the
//! integrity table and of the check function itself, the seconds the runtime passed,
//! then every device's UUID and PCI domain, bus and device ids, in `repr(C)` layout.
//! Learned from ZLUDA's `dark_api` (vosen/ZLUDA), which recovered it from the real
//! driver; written here from that description.

/// The key both sides use (what ZLUDA calls the first pass, which has no input).
const KEY: [u8; 16] = [
    0x14, 0x6A, 0xDD, 0xAE, 0x53, 0xA9, 0xA7, 0x52, 0xAA, 0x08, 0x41, 0x36, 0x0B, 0xF5, 0x5A, 0x9F,
];

/// MD2's substitution table (RFC 1319, digits of pi).
const S: [u8; 256] = [
    0x29, 0x2E, 0x43, 0xC9, 0xA2, 0xD8, 0x7C, 0x01, 0x3D, 0x36, 0x54, 0xA1, 0xEC, 0xF0, 0x06, 0x13,
    0x62, 0xA7, 0x05, 0xF3, 0xC0, 0xC7, 0x73, 0x8C, 0x98, 0x93, 0x2B, 0xD9, 0xBC, 0x4C, 0x82, 0xCA,
    0x1E, 0x9B, 0x57, 0x3C, 0xFD, 0xD4, 0xE0, 0x16, 0x67, 0x42, 0x6F, 0x18, 0x8A, 0x17, 0xE5, 0x12,
    0xBE, 0x4E, 0xC4, 0xD6, 0xDA, 0x9E, 0xDE, 0x49, 0xA0, 0xFB, 0xF5, 0x8E, 0xBB, 0x2F, 0xEE, 0x7A,
    0xA9, 0x68, 0x79, 0x91, 0x15, 0xB2, 0x07, 0x3F, 0x94, 0xC2, 0x10, 0x89, 0x0B, 0x22, 0x5F, 0x21,
    0x80, 0x7F, 0x5D, 0x9A, 0x5A, 0x90, 0x32, 0x27, 0x35, 0x3E, 0xCC, 0xE7, 0xBF, 0xF7, 0x97, 0x03,
    0xFF, 0x19, 0x30, 0xB3, 0x48, 0xA5, 0xB5, 0xD1, 0xD7, 0x5E, 0x92, 0x2A, 0xAC, 0x56, 0xAA, 0xC6,
    0x4F, 0xB8, 0x38, 0xD2, 0x96, 0xA4, 0x7D, 0xB6, 0x76, 0xFC, 0x6B, 0xE2, 0x9C, 0x74, 0x04, 0xF1,
    0x45, 0x9D, 0x70, 0x59, 0x64, 0x71, 0x87, 0x20, 0x86, 0x5B, 0xCF, 0x65, 0xE6, 0x2D, 0xA8, 0x02,
    0x1B, 0x60, 0x25, 0xAD, 0xAE, 0xB0, 0xB9, 0xF6, 0x1C, 0x46, 0x61, 0x69, 0x34, 0x40, 0x7E, 0x0F,
    0x55, 0x47, 0xA3, 0x23, 0xDD, 0x51, 0xAF, 0x3A, 0xC3, 0x5C, 0xF9, 0xCE, 0xBA, 0xC5, 0xEA, 0x26,
    0x2C, 0x53, 0x0D, 0x6E, 0x85, 0x28, 0x84, 0x09, 0xD3, 0xDF, 0xCD, 0xF4, 0x41, 0x81, 0x4D, 0x52,
    0x6A, 0xDC, 0x37, 0xC8, 0x6C, 0xC1, 0xAB, 0xFA, 0x24, 0xE1, 0x7B, 0x08, 0x0C, 0xBD, 0xB1, 0x4A,
    0x78, 0x88, 0x95, 0x8B, 0xE3, 0x63, 0xE8, 0x6D, 0xE9, 0xCB, 0xD5, 0xFE, 0x3B, 0x00, 0x1D, 0x39,
    0xF2, 0xEF, 0xB7, 0x0E, 0x66, 0x58, 0xD0, 0xE4, 0xA6, 0x77, 0x72, 0xF8, 0xEB, 0x75, 0x4B, 0x0A,
    0x31, 0x44, 0x50, 0xB4, 0x8F, 0xED, 0x1F, 0x1A, 0xDB, 0x99, 0x8D, 0x33, 0x9F, 0x11, 0x83, 0x14,
];

/// MD2 (RFC 1319).
struct Md2 {
    x: [u8; 48],
    checksum: [u8; 16],
    block: [u8; 16],
    len: usize,
    last: u8,
}

impl Md2 {
    fn new() -> Md2 {
        Md2 {
            x: [0; 48],
            checksum: [0; 16],
            block: [0; 16],
            len: 0,
            last: 0,
        }
    }

    fn update(&mut self, data: &[u8]) {
        for &b in data {
            self.block[self.len] = b;
            self.len += 1;
            if self.len == 16 {
                self.compress();
                self.len = 0;
            }
        }
    }

    fn compress(&mut self) {
        for j in 0..16 {
            let b = self.block[j];
            self.x[16 + j] = b;
            self.x[32 + j] = b ^ self.x[j];
            self.checksum[j] ^= S[usize::from(b ^ self.last)];
            self.last = self.checksum[j];
        }
        let mut t = 0u8;
        for j in 0..18u8 {
            for k in 0..48 {
                self.x[k] ^= S[usize::from(t)];
                t = self.x[k];
            }
            t = t.wrapping_add(j);
        }
    }

    fn finish(mut self) -> [u8; 16] {
        let pad = (16 - self.len) as u8;
        self.update(&vec![pad; usize::from(pad)]);
        let c = self.checksum;
        self.update(&c);
        let mut out = [0u8; 16];
        out.copy_from_slice(&self.x[..16]);
        out
    }
}

fn hmac_md2(message: &[u8]) -> [u8; 16] {
    let pad = |m: u8| KEY.map(|k| k ^ m);
    let mut inner = Md2::new();
    inner.update(&pad(0x36));
    inner.update(message);
    let inner = inner.finish();
    let mut outer = Md2::new();
    outer.update(&pad(0x5c));
    outer.update(&inner);
    outer.finish()
}

/// One device as the check sees it.
#[derive(Clone, Copy, Debug)]
pub struct DeviceHashInfo {
    /// `cuDeviceGetUuid` bytes.
    pub uuid: [u8; 16],
    /// `CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID`, `_PCI_BUS_ID`, `_PCI_DEVICE_ID`.
    pub pci_domain: i32,
    pub pci_bus: i32,
    pub pci_device: i32,
}

/// What the check mixes in besides the devices.
#[derive(Clone, Copy, Debug)]
pub struct CheckInput {
    /// The runtime's version (`12090`, `12091`, `12092` for CUDA 12.9).
    pub version: u32,
    /// Seconds the runtime passed (its clock).
    pub unix_seconds: u64,
    /// What `cuDriverGetVersion` reports.
    pub driver_version: u32,
    pub pid: u32,
    /// `pthread_self()` of the calling thread, truncated to 32 bits.
    pub thread: u32,
    /// Address of the `CUDART_INTERFACE` table.
    pub cudart_table: u64,
    /// Address of the `INTEGRITY_CHECK` table.
    pub integrity_table: u64,
    /// Address of the check function (the table's slot 1).
    pub check_fn: u64,
}

/// The two words the driver writes for `input` on a machine with `devices`.
pub fn integrity_answer(input: &CheckInput, devices: &[DeviceHashInfo]) -> [u64; 2] {
    // Versions ending in 0 and 1 get fixed answers (the runtime's first two probes).
    match input.version % 10 {
        0 => return [0x3341_181C_03CB_675C, 0x8ED3_83AA_1F4C_D1E8],
        1 => return [0x1841_181C_03CB_675C, 0x8ED3_83AA_1F4C_D1E8],
        _ => {}
    }
    // `repr(C)` layout of the driver's input struct: four u32, three pointers, u64.
    let mut m = Vec::with_capacity(48 + 28 * devices.len());
    for w in [input.driver_version, input.version, input.pid, input.thread] {
        m.extend_from_slice(&w.to_le_bytes());
    }
    for w in [
        input.cudart_table,
        input.integrity_table,
        input.check_fn,
        input.unix_seconds,
    ] {
        m.extend_from_slice(&w.to_le_bytes());
    }
    for d in devices {
        m.extend_from_slice(&d.uuid);
        for w in [d.pci_domain, d.pci_bus, d.pci_device] {
            m.extend_from_slice(&w.to_le_bytes());
        }
    }
    let h = hmac_md2(&m);
    [
        u64::from_le_bytes(h[..8].try_into().expect("8 bytes")),
        u64::from_le_bytes(h[8..].try_into().expect("8 bytes")),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn md2_hex(s: &str) -> String {
        let mut m = Md2::new();
        m.update(s.as_bytes());
        m.finish().iter().map(|b| format!("{b:02x}")).collect()
    }

    #[test]
    fn md2_matches_rfc_1319_test_suite() {
        assert_eq!(md2_hex(""), "8350e5a3e24c153df2275c9f80692773");
        assert_eq!(md2_hex("a"), "32ec01ec4a6dac72c0ab96fb34c0b5d1");
        assert_eq!(md2_hex("abc"), "da853b0d3f88d99b30283a69e6ded6bb");
        assert_eq!(
            md2_hex("abcdefghijklmnopqrstuvwxyz"),
            "4e8ddff3650292ab5a4108c3aa47940b"
        );
        assert_eq!(
            md2_hex(
                "12345678901234567890123456789012345678901234567890123456789012345678901234567890"
            ),
            "d5976f79d83d3a0dc9806c3c66f3efd8"
        );
    }

    /// The state after the inner pad, as dumped from the real driver (ZLUDA's
    /// `integrity_check_pass2` vector): the state and the checksum.
    #[test]
    fn inner_pad_state_matches_the_driver() {
        let mut m = Md2::new();
        m.update(&KEY.map(|k| k ^ 0x36));
        assert_eq!(
            m.x[..16],
            [
                0x8b, 0x21, 0x9a, 0x49, 0xe8, 0x6d, 0x1a, 0xee, 0xf2, 0x37, 0xf9, 0xb5, 0x4a, 0x8c,
                0x3c, 0x75
            ]
        );
        assert_eq!(
            m.checksum,
            [
                0x57, 0xa1, 0x10, 0x86, 0x0e, 0x60, 0x44, 0x1e, 0x70, 0x5f, 0x67, 0xd1, 0xeb, 0x67,
                0xa1, 0x3d
            ]
        );
    }

    #[test]
    fn answer_depends_on_every_input() {
        let base = CheckInput {
            version: 12092,
            unix_seconds: 1_700_000_000,
            driver_version: 12040,
            pid: 42,
            thread: 7,
            cudart_table: 0x1000,
            integrity_table: 0x2000,
            check_fn: 0x3000,
        };
        let dev = DeviceHashInfo {
            uuid: [1; 16],
            pci_domain: 0,
            pci_bus: 0x10,
            pci_device: 0,
        };
        let a = integrity_answer(&base, &[dev]);
        assert_eq!(a, integrity_answer(&base, &[dev]));
        assert_ne!(a, integrity_answer(&CheckInput { pid: 43, ..base }, &[dev]));
        assert_ne!(
            a,
            integrity_answer(
                &base,
                &[DeviceHashInfo {
                    pci_bus: 0x11,
                    ..dev
                }]
            )
        );
        assert_ne!(a, integrity_answer(&base, &[dev, dev]));
        assert_eq!(
            integrity_answer(
                &CheckInput {
                    version: 12090,
                    ..base
                },
                &[]
            ),
            [0x3341_181C_03CB_675C, 0x8ED3_83AA_1F4C_D1E8]
        );
    }
}
