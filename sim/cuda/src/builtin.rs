//! The built-in kernels every module holds (found by entry name): their table, whose
//! entries are the `CUfunction` handles, their parameters, and what running one
//! does: the device held exclusively across processes for its modelled duration,
//! its memory touched, its trace line appended.

use kiwi_sim_core::{monotonic_ns, TraceRecord};

use crate::abi::*;
use crate::hw::{pace, Hw};
use crate::memory::Fault;
use crate::phys::Piece;

/// The built-in kernels, found by entry name in any module.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Builtin {
    /// `kiwi_fill(u32* ptr, u32 value, u64 words)`
    Fill,
    /// `kiwi_add(u32* ptr, u32 delta, u64 words)`
    Add,
    /// `kiwi_checksum(const u32* ptr, u64 words, u64* out)`: u64 sum of the words.
    Checksum,
    /// `kiwi_spin(u64 nanoseconds)`
    Spin,
}

/// The four built-in kernels; a `CUfunction` is a pointer into this table.
pub static BUILTINS: [Builtin; 4] = [
    Builtin::Fill,
    Builtin::Add,
    Builtin::Checksum,
    Builtin::Spin,
];

impl Builtin {
    /// Its `CUfunction`: its entry of [`BUILTINS`].
    pub fn handle(self) -> CUfunction {
        let b = BUILTINS
            .iter()
            .find(|b| **b == self)
            .unwrap_or(&BUILTINS[0]);
        b as *const Builtin as CUfunction
    }

    /// Its name as a C string (`cuKernelGetName`).
    pub fn c_name(self) -> *const std::ffi::c_char {
        match self {
            Builtin::Fill => c"kiwi_fill".as_ptr(),
            Builtin::Add => c"kiwi_add".as_ptr(),
            Builtin::Checksum => c"kiwi_checksum".as_ptr(),
            Builtin::Spin => c"kiwi_spin".as_ptr(),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Builtin::Fill => "kiwi_fill",
            Builtin::Add => "kiwi_add",
            Builtin::Checksum => "kiwi_checksum",
            Builtin::Spin => "kiwi_spin",
        }
    }

    /// Parameter sizes in order (for `kernelParams` and the packed `extra` buffer).
    pub fn param_sizes(self) -> &'static [usize] {
        match self {
            Builtin::Fill | Builtin::Add => &[8, 4, 8],
            Builtin::Checksum => &[8, 8, 8],
            Builtin::Spin => &[8],
        }
    }

    /// Runs the kernel on `device`, holding it exclusively (across processes) for
    /// at least its modelled duration, then appends its trace line.
    pub fn run(self, d: &Hw, device: u32, args: [u64; 3]) -> Result<(), Fault> {
        let guard = d.machine.kernel_lock(device).ok();
        let start = monotonic_ns();
        let modelled_s = match self {
            Builtin::Spin => args[0] as f64 / 1e9,
            Builtin::Fill => {
                let (ptr, value, words) = (args[0], args[1] as u32, args[2]);
                for p in d.mem.resolve(ptr, bytes_of(words)?, true, device)? {
                    for_words(&p, |w| *w = value);
                }
                words as f64 * 4.0 / d.hbm_bps
            }
            Builtin::Add => {
                let (ptr, delta, words) = (args[0], args[1] as u32, args[2]);
                for p in d.mem.resolve(ptr, bytes_of(words)?, true, device)? {
                    for_words(&p, |w| *w = w.wrapping_add(delta));
                }
                words as f64 * 8.0 / d.hbm_bps
            }
            Builtin::Checksum => {
                let (ptr, words, out) = (args[0], args[1], args[2]);
                let mut sum = 0u64;
                for p in d.mem.resolve(ptr, bytes_of(words)?, false, device)? {
                    for_words(&p, |w| sum = sum.wrapping_add(u64::from(*w)));
                }
                let dst = d.mem.resolve(out, 8, true, device)?;
                copy_from_host(&dst, &sum.to_le_bytes());
                words as f64 * 4.0 / d.hbm_bps
            }
        };
        pace(start, modelled_s);
        let end = monotonic_ns();
        drop(guard);
        if let Some(t) = &d.trace {
            let _ = t.append(&TraceRecord {
                pid: std::process::id(),
                device,
                start_ns: start,
                end_ns: end,
                name: self.name().to_string(),
            });
        }
        Ok(())
    }
}

/// Bytes of `words` u32 words; a count no device could hold is an illegal address.
fn bytes_of(words: u64) -> Result<u64, Fault> {
    words.checked_mul(4).ok_or(Fault::Unmapped)
}

/// Applies `f` to each whole u32 of a piece (pieces of kernels are 4-byte multiples
/// whenever the kernel's pointer is 4-byte aligned; a misaligned tail is ignored).
fn for_words(p: &Piece, mut f: impl FnMut(&mut u32)) {
    let base = p.phys.host_ptr(p.offset);
    let words = (p.len / 4) as usize;
    if (base as usize).is_multiple_of(4) {
        // SAFETY: resolved piece of `p.len` bytes, aligned, kept alive by p.phys.
        let s = unsafe { std::slice::from_raw_parts_mut(base.cast::<u32>(), words) };
        s.iter_mut().for_each(f);
    } else {
        for i in 0..words {
            // SAFETY: as above, using unaligned accesses.
            unsafe {
                let w = base.add(i * 4).cast::<u32>();
                let mut v = w.read_unaligned();
                f(&mut v);
                w.write_unaligned(v);
            }
        }
    }
}

fn copy_from_host(dst: &[Piece], src: &[u8]) {
    let mut at = 0;
    for p in dst {
        // SAFETY: resolved writable piece; src has at least p.len bytes left.
        unsafe {
            std::ptr::copy_nonoverlapping(
                src.as_ptr().add(at),
                p.phys.host_ptr(p.offset),
                p.len as usize,
            )
        };
        at += p.len as usize;
    }
}
