//! The simulated copy engine: how host↔device copies move their bytes.
//!
//! A GPU's copy engine moves a host↔device copy by DMA at the link's rate whatever the
//! copy's size, and its writes do not go through the CPU's caches. The simulator
//! copies with the CPU, and `memcpy` changes strategy with the size: glibc switches
//! to non-temporal stores only above `x86_non_temporal_threshold`, three quarters of
//! the L3 size it detects (240 MiB on VMs whose hypervisor reports a 320 MiB L3). Below
//! it, every destination line is read before it is written; on such a machine a
//! 256 MiB copy ran at ~9.7 GB/s and the same bytes in 64 MiB copies at ~7.2 GB/s,
//! a size effect no GPU has (and one that made a swapper copying 64 MiB segments look
//! slower than a 256 MiB "pinned copy" baseline). So copies from [`STREAM_MIN`] bytes
//! up use non-temporal stores at every size, as DMA does; smaller ones use `memcpy`.

/// Smallest copy written with non-temporal stores.
pub const STREAM_MIN: usize = 256 << 10;

/// Copies `n` bytes from `src` to `dst` as the copy engine does.
///
/// `#[inline]` (here and below) makes the code generated in the calling crate, with
/// its optimization level: `libcuda.so.1` is built at `opt-level = 2` even in debug
/// builds, this crate is not, and an unoptimized copy loop moves well under 1 GB/s.
///
/// # Safety
/// `src` is readable and `dst` writable for `n` bytes, and the two ranges do not
/// overlap.
#[inline]
pub unsafe fn copy(dst: *mut u8, src: *const u8, n: usize) {
    if n >= STREAM_MIN {
        // SAFETY: the caller's contract.
        unsafe { stream_copy(dst, src, n) }
    } else {
        // SAFETY: the caller's contract.
        unsafe { std::ptr::copy_nonoverlapping(src, dst, n) }
    }
}

/// Non-temporal copy: 64 bytes per step, 16-byte aligned streaming stores (SSE2, part
/// of every x86-64), then a store fence so the bytes are visible before whatever the
/// caller publishes next (the operation's completion).
///
/// # Safety
/// As [`copy`].
#[cfg(target_arch = "x86_64")]
#[inline]
unsafe fn stream_copy(dst: *mut u8, src: *const u8, n: usize) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
    let head = dst.align_offset(16).min(n);
    let blocks = (n - head) / 64;
    let tail = n - head - blocks * 64;
    // SAFETY: every access stays inside [dst, dst+n) and [src, src+n) (head + 64 ×
    // blocks + tail = n); stores go to 16-byte aligned addresses (dst + head is
    // aligned and steps by 16); loads are unaligned loads. SSE2 is baseline on x86-64.
    unsafe {
        std::ptr::copy_nonoverlapping(src, dst, head);
        let (mut s, mut d) = (src.add(head), dst.add(head));
        for _ in 0..blocks {
            let a = _mm_loadu_si128(s.cast::<__m128i>());
            let b = _mm_loadu_si128(s.add(16).cast::<__m128i>());
            let c = _mm_loadu_si128(s.add(32).cast::<__m128i>());
            let e = _mm_loadu_si128(s.add(48).cast::<__m128i>());
            _mm_stream_si128(d.cast::<__m128i>(), a);
            _mm_stream_si128(d.add(16).cast::<__m128i>(), b);
            _mm_stream_si128(d.add(32).cast::<__m128i>(), c);
            _mm_stream_si128(d.add(48).cast::<__m128i>(), e);
            s = s.add(64);
            d = d.add(64);
        }
        _mm_sfence();
        std::ptr::copy_nonoverlapping(s, d, tail);
    }
}

/// Elsewhere: `memcpy`.
///
/// # Safety
/// As [`copy`].
#[cfg(not(target_arch = "x86_64"))]
#[inline]
unsafe fn stream_copy(dst: *mut u8, src: *const u8, n: usize) {
    // SAFETY: the caller's contract.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, n) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_every_byte_at_any_alignment_and_size() {
        let src: Vec<u8> = (0..STREAM_MIN * 3 + 200)
            .map(|i| (i * 7 % 251) as u8)
            .collect();
        for &n in &[
            0,
            1,
            63,
            64,
            65,
            STREAM_MIN - 1,
            STREAM_MIN,
            STREAM_MIN * 2 + 77,
        ] {
            for s_off in [0usize, 1, 8, 15] {
                for d_off in [0usize, 3, 16, 31] {
                    let mut dst = vec![0xaau8; n + d_off + 64];
                    // SAFETY: both vectors hold the ranges; they are distinct.
                    unsafe { copy(dst.as_mut_ptr().add(d_off), src.as_ptr().add(s_off), n) };
                    assert_eq!(&dst[d_off..d_off + n], &src[s_off..s_off + n], "n {n}");
                    assert!(dst[..d_off].iter().all(|&b| b == 0xaa), "before, n {n}");
                    assert!(dst[d_off + n..].iter().all(|&b| b == 0xaa), "after, n {n}");
                }
            }
        }
    }
}
