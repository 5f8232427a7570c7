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

/// The huge page parts are aligned to: a hugetlb file can be mapped only at a
/// multiple of its page (`MAP_FIXED` elsewhere fails with `EINVAL`), and shared memory
/// gets huge page-table entries (transparent huge pages) only where its offset and
/// the address agree modulo it. 1 GiB hugetlb pages are not used for what is mapped
/// here (the swap pool's slices are 64 MiB).
pub const HUGE_PAGE: usize = 2 << 20;

/// [`reserve`], at a multiple of `align` (a power of two) where `len` is at least
/// `align`: `len + align` bytes are reserved, and what lies outside the aligned `len`
/// given back.
pub fn reserve_aligned(len: usize, align: usize) -> io::Result<*mut u8> {
    if len < align {
        return reserve(len);
    }
    let span = len
        .checked_add(align)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "too long to align"))?;
    let base = reserve(span)?;
    let head = (align - (base as usize) % align) % align;
    let tail = span - head - len;
    // SAFETY: both ranges lie inside the reservation just made, which nothing else
    // knows of; what stays is `[base + head, base + head + len)`.
    unsafe {
        if head > 0 {
            libc::munmap(base.cast(), head);
        }
        if tail > 0 {
            libc::munmap(base.add(head + len).cast(), tail);
        }
        Ok(base.add(head))
    }
}

/// Maps `parts`, in order, side by side at one address of the kernel's choosing, each
/// with `prot` and `flags` (`MAP_FIXED` added): the address and the length of the
/// whole. On an error (nothing to map included) nothing stays mapped. Each descriptor
/// must stay open while this runs; the mappings keep their files after. A range of a
/// huge page or more starts at a multiple of [`HUGE_PAGE`].
pub fn map_side_by_side(parts: &[FilePart], prot: i32, flags: i32) -> io::Result<(*mut u8, usize)> {
    let invalid = |what: &str| io::Error::new(io::ErrorKind::InvalidInput, what.to_string());
    let len = parts
        .iter()
        .try_fold(0usize, |sum, p| sum.checked_add(p.len))
        .ok_or_else(|| invalid("the parts are longer than the address space"))?;
    if len == 0 {
        return Err(invalid("nothing to map"));
    }
    let base = reserve_aligned(len, HUGE_PAGE)?;
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
    fn a_range_of_a_huge_page_or_more_starts_at_a_huge_page() {
        // Lengths that are no multiple of it too: newer kernels align anonymous
        // mappings of whole huge pages by themselves, older ones none.
        for len in [3 * HUGE_PAGE, 3 * HUGE_PAGE + PAGE, HUGE_PAGE + 5 * PAGE] {
            for _ in 0..4 {
                let p = reserve_aligned(len, HUGE_PAGE).unwrap();
                assert_eq!(p as usize % HUGE_PAGE, 0, "{p:?}, {len} bytes");
                // SAFETY: the reservation just made, of that length, unmapped once.
                assert_eq!(unsafe { libc::munmap(p.cast(), len) }, 0);
            }
        }
        let a = file_of(&vec![5u8; HUGE_PAGE]);
        let b = file_of(&[6u8; PAGE]);
        let (p, n) = map_side_by_side(
            &[
                FilePart::whole(a.as_raw_fd(), HUGE_PAGE),
                FilePart::whole(b.as_raw_fd(), PAGE),
            ],
            libc::PROT_READ,
            libc::MAP_SHARED,
        )
        .unwrap();
        assert_eq!((p as usize % HUGE_PAGE, n), (0, HUGE_PAGE + PAGE));
        // SAFETY: the mapping just made, readable, unmapped after.
        unsafe {
            assert_eq!((*p.add(HUGE_PAGE - 1), *p.add(HUGE_PAGE)), (5, 6));
            libc::munmap(p.cast(), n);
        }
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
