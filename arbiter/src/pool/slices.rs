//! A slice's memfd from birth to scrub: how its pages are made ([`PageMode`],
//! detected from the host), creating and populating it on the calling thread (so its
//! pages are charged to the arbiter's cgroup), cutting it down, sealing it before it
//! is lent, and scrubbing it once returned.

use super::*;

/// How the pool's pages are made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PageMode {
    /// 4 KiB pages.
    Small,
    /// Transparent huge pages (`shmem_enabled` is `always`, `within_size` or
    /// `force`).
    ThpFallocate,
    /// Transparent huge pages through a temporary mapping with `MADV_HUGEPAGE` and
    /// `MADV_POPULATE_WRITE` (`shmem_enabled` is `advise`).
    ThpAdvise,
    /// Reserved hugetlb pages (`MFD_HUGETLB`) of `page` bytes, populated with
    /// `fallocate`.
    HugeTlb { page: u64 },
}

impl PageMode {
    /// The mode this host allows for slices of `slice` bytes (see the module doc).
    pub fn detect(slice: u64) -> PageMode {
        let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        let shmem =
            std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/shmem_enabled").ok();
        Self::detect_from(&meminfo, shmem.as_deref(), slice)
    }

    /// [`PageMode::detect`] from the text of `/proc/meminfo` and of
    /// `/sys/kernel/mm/transparent_hugepage/shmem_enabled` (`None`: no THP).
    pub fn detect_from(meminfo: &str, shmem_enabled: Option<&str>, slice: u64) -> PageMode {
        let page = meminfo_bytes(meminfo, "Hugepagesize").unwrap_or(0);
        let free = meminfo_bytes(meminfo, "HugePages_Free").unwrap_or(0);
        if page > 0 && slice.is_multiple_of(page) && free.saturating_mul(page) >= slice {
            return PageMode::HugeTlb { page };
        }
        // The selected setting is the bracketed word: "always within_size [advise] never".
        let selected = shmem_enabled.and_then(|s| {
            let start = s.find('[')?;
            let end = s[start..].find(']')?;
            Some(&s[start + 1..start + end])
        });
        match selected {
            Some("always" | "within_size" | "force") => PageMode::ThpFallocate,
            Some("advise") => PageMode::ThpAdvise,
            _ => PageMode::Small,
        }
    }

    /// The name stats report: `"4KiB"`, `"thp"` or `"hugetlb"`.
    pub fn name(self) -> &'static str {
        match self {
            PageMode::Small => "4KiB",
            PageMode::ThpFallocate | PageMode::ThpAdvise => "thp",
            PageMode::HugeTlb { .. } => "hugetlb",
        }
    }

    /// What every take and slice is a multiple of.
    pub(super) fn unit(self) -> u64 {
        match self {
            PageMode::HugeTlb { page } => page.max(UNIT),
            _ => UNIT,
        }
    }
}

/// A fresh memfd of `bytes`, every page populated by this thread (so charged to this
/// process's cgroup).
pub(super) fn create_slice(mode: PageMode, bytes: u64) -> Result<Slice, PoolError> {
    let mut flags = libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING;
    if let PageMode::HugeTlb { .. } = mode {
        flags |= libc::MFD_HUGETLB;
    }
    // SAFETY: MEMFD_NAME is a valid NUL-terminated string; memfd_create takes no other
    // pointers.
    let raw = unsafe { libc::memfd_create(MEMFD_NAME.as_ptr(), flags) };
    if raw < 0 {
        return Err(io_err("memfd_create"));
    }
    // SAFETY: `raw` is a descriptor just returned to us and owned by nothing else.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    let len =
        libc::off_t::try_from(bytes).map_err(|_| PoolError::Config("slice too large".into()))?;
    // SAFETY: plain syscall on a descriptor we own.
    if retry_eintr(|| unsafe { libc::ftruncate(fd.as_raw_fd(), len) }) != 0 {
        return Err(io_err("ftruncate of a new slice"));
    }
    // `fallocate` on tmpfs allocates pages without clearing them: the first fault
    // clears each page, which would be the client's, as it maps or page-locks the
    // slice (`mincore` does not even count such pages as present). Faulting them in
    // here for write clears them on this thread. Hugetlbfs clears at `fallocate`.
    match mode {
        PageMode::ThpAdvise => populate_mapped(&fd, bytes, true)?,
        PageMode::Small | PageMode::ThpFallocate => populate_mapped(&fd, bytes, false)?,
        PageMode::HugeTlb { .. } => {
            // SAFETY: plain syscall on a descriptor we own.
            if retry_eintr(|| unsafe { libc::fallocate(fd.as_raw_fd(), 0, 0, len) }) != 0 {
                return Err(io_err("fallocate (populating a slice)"));
            }
        }
    }
    Ok(Slice { fd, bytes })
}

/// Populates `fd` through a temporary 2 MiB-aligned shared mapping with
/// `MADV_POPULATE_WRITE`, after `MADV_HUGEPAGE` when `advise` (falling back to
/// `fallocate` on a kernel without `MADV_POPULATE_WRITE`).
fn populate_mapped(fd: &OwnedFd, bytes: u64, advise: bool) -> Result<(), PoolError> {
    let len = usize::try_from(bytes).map_err(|_| PoolError::Config("slice too large".into()))?;
    let span = len + UNIT as usize;
    let base = kiwi_cuda::filemap::reserve(span)
        .map_err(|source| PoolError::Io {
            op: "mmap (reserving a populating window)",
            source,
        })?
        .cast::<libc::c_void>();
    struct Unmap(*mut libc::c_void, usize);
    impl Drop for Unmap {
        fn drop(&mut self) {
            // SAFETY: the range is the reservation made above (and the mapping placed
            // inside it), used by no one else and never referenced after this.
            unsafe { libc::munmap(self.0, self.1) };
        }
    }
    let _unmap = Unmap(base, span);
    let aligned = round_up(base as u64, UNIT) as usize as *mut libc::c_void;
    // SAFETY: MAP_FIXED at an address inside our own reservation (`aligned + len` is
    // within `base + span`), replacing only that reservation.
    let at = unsafe {
        libc::mmap(
            aligned,
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_FIXED,
            fd.as_raw_fd(),
            0,
        )
    };
    if at == libc::MAP_FAILED {
        return Err(io_err("mmap (a slice to populate)"));
    }
    // SAFETY: advice on our own mapping of `len` bytes at `aligned`.
    if advise && unsafe { libc::madvise(aligned, len, libc::MADV_HUGEPAGE) } != 0 {
        return Err(io_err("madvise(MADV_HUGEPAGE)"));
    }
    // SAFETY: as above; POPULATE_WRITE only faults pages in, it writes no data.
    let r = retry_eintr(|| unsafe { libc::madvise(aligned, len, libc::MADV_POPULATE_WRITE) });
    if r != 0 {
        if io::Error::last_os_error().raw_os_error() != Some(libc::EINVAL) {
            return Err(io_err("madvise(MADV_POPULATE_WRITE)"));
        }
        let off = libc::off_t::try_from(bytes).unwrap_or(libc::off_t::MAX);
        // SAFETY: plain syscall on a descriptor we own.
        if retry_eintr(|| unsafe { libc::fallocate(fd.as_raw_fd(), 0, 0, off) }) != 0 {
            return Err(io_err("fallocate (populating a slice)"));
        }
    }
    Ok(())
}

pub(super) fn truncate(fd: &OwnedFd, bytes: u64) -> Result<(), PoolError> {
    let len =
        libc::off_t::try_from(bytes).map_err(|_| PoolError::Config("slice too large".into()))?;
    // SAFETY: plain syscall on a descriptor we own.
    if retry_eintr(|| unsafe { libc::ftruncate(fd.as_raw_fd(), len) }) != 0 {
        return Err(io_err("ftruncate (cutting a ready slice down)"));
    }
    Ok(())
}

/// Seals a slice before it is lent: no growing, no shrinking, no further seals (a
/// write seal would stop the scrub).
pub(super) fn seal(fd: &OwnedFd) -> Result<(), PoolError> {
    let seals = libc::F_SEAL_GROW | libc::F_SEAL_SHRINK | libc::F_SEAL_SEAL;
    // SAFETY: plain fcntl on a descriptor we own.
    if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
        return Err(io_err("sealing a slice"));
    }
    Ok(())
}

/// Frees every page of a returned slice (mappings and duplicates elsewhere see holes).
pub(super) fn scrub(s: &Slice) -> Result<(), PoolError> {
    let len = libc::off_t::try_from(s.bytes).unwrap_or(libc::off_t::MAX);
    let mode = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
    // SAFETY: plain syscall on a descriptor we own.
    if retry_eintr(|| unsafe { libc::fallocate(s.fd.as_raw_fd(), mode, 0, len) }) != 0 {
        return Err(io_err("fallocate(PUNCH_HOLE) (scrubbing a slice)"));
    }
    Ok(())
}
