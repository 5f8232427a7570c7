//! Host memory made of files: parts of files mapped side by side at one address, the
//! one way Kiwi builds such a range (issue #40). The shim's swap-out buffers are the
//! pool's memfd slices mapped so, and a spilled buffer's files are read back so
//! ([`read_files`], which the spill benchmark measures as the swap-in does it); the
//! simulator maps an extent in several runs of a GPU's memory file so. The address
//! space underneath is a [`reserve`]ation, as is the arbiter's window for populating a
//! slice.
//!
//! Here because every one of those users links this crate and it needs nothing but
//! libc. No policy: which files, their protection and flags are the caller's, and so
//! is unmapping what this maps (`munmap` of the address and length returned).

use std::io;
use std::os::fd::RawFd;

/// A part of a file to map: `len` bytes from `offset` (both page multiples) of the
/// open descriptor `fd`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FilePart {
    pub fd: RawFd,
    pub offset: u64,
    pub len: usize,
}

impl FilePart {
    /// The first `len` bytes of `fd`.
    pub fn whole(fd: RawFd, len: usize) -> FilePart {
        FilePart { fd, offset: 0, len }
    }
}

/// Reserves `len` bytes of address space for mappings to be placed in with
/// `MAP_FIXED`: private, anonymous, `PROT_NONE` and without swap reserved, so nothing
/// is charged for it. The caller unmaps it.
pub fn reserve(len: usize) -> io::Result<*mut u8> {
    // SAFETY: a fresh reservation at an address of the kernel's choosing; no existing
    // memory is affected.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if base == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    Ok(base.cast())
}

/// Maps `parts`, in order, side by side at one address of the kernel's choosing, each
/// with `prot` and `flags` (`MAP_FIXED` added): the address and the length of the
/// whole. On an error (nothing to map included) nothing stays mapped. Each descriptor
/// must stay open while this runs; the mappings keep their files after.
pub fn map_side_by_side(parts: &[FilePart], prot: i32, flags: i32) -> io::Result<(*mut u8, usize)> {
    let invalid = |what: &str| io::Error::new(io::ErrorKind::InvalidInput, what.to_string());
    let len = parts
        .iter()
        .try_fold(0usize, |sum, p| sum.checked_add(p.len))
        .ok_or_else(|| invalid("the parts are longer than the address space"))?;
    if len == 0 {
        return Err(invalid("nothing to map"));
    }
    let base = reserve(len)?;
    let mut at = 0usize;
    for part in parts {
        let mapped = libc::off_t::try_from(part.offset)
            .map_err(|_| invalid("a part's offset is past what mmap takes"))
            .and_then(|offset| {
                // SAFETY: replaces `part.len` bytes of the reservation made above
                // (`at + part.len <= len`) with a mapping of the part; the caller keeps
                // its descriptor open meanwhile.
                let p = unsafe {
                    libc::mmap(
                        base.add(at).cast(),
                        part.len,
                        prot,
                        flags | libc::MAP_FIXED,
                        part.fd,
                        offset,
                    )
                };
                if p == libc::MAP_FAILED {
                    Err(io::Error::last_os_error())
                } else {
                    Ok(())
                }
            });
        if let Err(e) = mapped {
            // SAFETY: the reservation made above and the parts mapped into it, which
            // nothing else knows of.
            unsafe { libc::munmap(base.cast(), len) };
            return Err(e);
        }
        at += part.len;
    }
    Ok((base, len))
}

/// Runs `f(address, length)` over `files` mapped read-only side by side, read in at
/// once (`MAP_POPULATE`), then unmaps them and drops the parts' pages from the page
/// cache (`POSIX_FADV_DONTNEED`): memory read back from disk once (a spilled swap-out)
/// leaves no cache behind. Each descriptor must stay open while this runs.
pub fn read_files<T>(files: &[FilePart], f: impl FnOnce(*const u8, usize) -> T) -> io::Result<T> {
    let (base, len) = map_side_by_side(
        files,
        libc::PROT_READ,
        libc::MAP_SHARED | libc::MAP_POPULATE,
    )?;
    let out = f(base.cast_const(), len);
    // SAFETY: the mapping made above; `f` is done with it and nothing else knows of it.
    unsafe { libc::munmap(base.cast(), len) };
    for part in files {
        let offset = libc::off_t::try_from(part.offset).unwrap_or(libc::off_t::MAX);
        let len = libc::off_t::try_from(part.len).unwrap_or(libc::off_t::MAX);
        // SAFETY: advice on an open descriptor (its clean cached pages may go); no
        // memory is passed, and a failure changes nothing but the timing.
        unsafe { libc::posix_fadvise(part.fd, offset, len, libc::POSIX_FADV_DONTNEED) };
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::FileExt;

    const PAGE: usize = 4096;

    /// An unnamed file (`O_TMPFILE` in the temp dir) holding `bytes`.
    fn file_of(bytes: &[u8]) -> std::fs::File {
        use std::os::unix::fs::OpenOptionsExt;
        let mut f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_TMPFILE)
            .open(std::env::temp_dir())
            .unwrap();
        f.write_all(bytes).unwrap();
        f
    }

    #[test]
    fn parts_are_mapped_side_by_side_in_order_and_read_back() {
        let a = file_of(&[1u8; PAGE]);
        let b = file_of(&[[2u8; PAGE], [3u8; PAGE]].concat());
        // The second page of `b`, then `a`, then `b` whole.
        let parts = [
            FilePart {
                fd: b.as_raw_fd(),
                offset: PAGE as u64,
                len: PAGE,
            },
            FilePart::whole(a.as_raw_fd(), PAGE),
            FilePart::whole(b.as_raw_fd(), 2 * PAGE),
        ];
        let got = read_files(&parts, |p, n| {
            // SAFETY: the whole mapping `read_files` made, readable while `f` runs.
            unsafe { std::slice::from_raw_parts(p, n) }.to_vec()
        })
        .unwrap();
        let want = [[3u8; PAGE], [1u8; PAGE], [2u8; PAGE], [3u8; PAGE]].concat();
        assert_eq!(got, want);

        let (p, n) = map_side_by_side(
            &parts[1..2],
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
        )
        .unwrap();
        assert_eq!(n, PAGE);
        // SAFETY: the writable shared mapping of `a`'s page just made, unmapped after.
        unsafe {
            *p = 9;
            libc::munmap(p.cast(), n);
        }
        let mut first = [0u8; 1];
        a.read_exact_at(&mut first, 0).unwrap();
        assert_eq!(first, [9], "a shared mapping writes through to its file");
    }

    #[test]
    fn nothing_to_map_or_a_bad_descriptor_is_an_error() {
        assert!(map_side_by_side(&[], libc::PROT_READ, libc::MAP_SHARED).is_err());
        let a = file_of(&[1u8; PAGE]);
        let parts = [
            FilePart::whole(a.as_raw_fd(), PAGE),
            FilePart::whole(-1, PAGE),
        ];
        let e = map_side_by_side(&parts, libc::PROT_READ, libc::MAP_SHARED).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EBADF));
    }
}
