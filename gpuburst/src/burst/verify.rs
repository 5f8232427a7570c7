//! Verification: every allocation checksummed on the GPU against the host model,
//! and where a checksum is wrong, the first wrong word found.

use crate::cu;
use crate::driver::Cuda;
use crate::kernels::{BLOCK, GRID};
use crate::memory::{self, Source};

use super::device::{launch, make_current, Device};
use super::Failure;

/// Checksums every allocation of one device on the GPU and compares with the host
/// model. The device's context must be current.
pub(super) fn verify(cuda: &Cuda, d: &Device) -> Result<(), Failure> {
    for (i, a) in d.allocs.iter().enumerate() {
        let out = d.sums + 8 * i as u64;
        // kiwi_checksum adds into *out: start from zero.
        cu!(
            cuda,
            memset_d32_async,
            "cuMemsetD32Async",
            out,
            0,
            2,
            std::ptr::null_mut()
        )?;
        let (mut ptr, mut words, mut o) = (a.ptr, a.words, out);
        launch(
            cuda,
            d.k.checksum,
            GRID,
            BLOCK,
            &mut [
                (&mut ptr as *mut u64).cast(),
                (&mut words as *mut u64).cast(),
                (&mut o as *mut u64).cast(),
            ],
        )?;
    }
    let mut got = vec![0u64; d.allocs.len()];
    cu!(
        cuda,
        memcpy_dtoh,
        "cuMemcpyDtoH",
        got.as_mut_ptr().cast(),
        d.sums,
        8 * d.allocs.len()
    )?;
    for (i, (a, g)) in d.allocs.iter().zip(&got).enumerate() {
        let want = a.words * u64::from(a.value);
        let what = || {
            format!(
                "device {}, allocation {i} ({} bytes at {:#x}, {})",
                d.ordinal,
                a.words * 4,
                a.ptr,
                a.source.name()
            )
        };
        if *g != want {
            // Where: the first wrong word, read back.
            let at = match memory::locate(cuda, a.ptr, a.words, a.value)? {
                Some((w, got)) => format!(
                    "first wrong word {w} (byte offset {:#x}) holds {got:#x}, expected {:#x}",
                    4 * w,
                    a.value
                ),
                None => "every word reads back as expected (a checksum kernel's fault?)".into(),
            };
            return Err(Failure::Mismatch(format!(
                "{}: checksum {g}, expected {want}; {at}",
                what()
            )));
        }
        if a.source == Source::Managed {
            // SAFETY: a live managed allocation of this process; the synchronous
            // cuMemcpyDtoH above ran after every kernel of the (only, legacy) stream,
            // so nothing writes it now.
            if let Some((w, got)) = unsafe { memory::host_mismatch(a.ptr, a.words, a.value) } {
                return Err(Failure::Mismatch(format!(
                    "{}, read on the host: word {w} (byte offset {:#x}) holds {got:#x}, expected {:#x}",
                    what(),
                    4 * w,
                    a.value
                )));
            }
        }
    }
    Ok(())
}

/// Verifies every device, in the listed order (the first mismatch is the error).
pub(super) fn verify_all(cuda: &Cuda, devs: &[Device]) -> Result<(), Failure> {
    for d in devs {
        make_current(cuda, devs, d)?;
        verify(cuda, d)?;
    }
    Ok(())
}
