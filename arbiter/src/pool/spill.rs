//! The disk tier's files: one spill file per slice moved to disk.
//!
//! A spill file is an `O_TMPFILE` in the configured directory, opened `O_EXCL` as
//! well: it never has a name on disk (nothing to clean up after a crash, no tenant can
//! reach it by path) and can never be given one (`linkat` through `/proc` is refused).
//! Its blocks are freed when the last descriptor of it closes: the pool's read-write
//! one ([`super::Pool::give`], [`super::Pool::release_owner`], shutdown) and the
//! client's read-only one.
//!
//! [`write()`] makes one from a slice: it checks the filesystem's free space first (a
//! spill never takes the last of a disk others use: a reserve of
//! `min(5% of the filesystem, 1 GiB)` stays free), allocates the whole file
//! (`fallocate`, so a full disk is found before any copying), copies the slice in
//! through a read-only shared mapping of the pool's own descriptor with `pwrite`,
//! syncs it (`fdatasync`) and drops its pages from the page cache
//! (`POSIX_FADV_DONTNEED`: the point of spilling is to free host memory). The client's
//! descriptor is a new read-only open of the same file (`/proc/self/fd/<n>`), so the
//! client cannot write to it or grow it through what it was sent.
//!
//! Every failure is a one-line [`PoolError::Spill`] naming the directory; the file is
//! closed (freed) before it is returned. Nothing here takes the pool's lock.

use super::{retry_eintr, PoolError, MIB};
use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

const GIB: u64 = 1 << 30;
/// Mode of a spill file (it has no name, so only reopening through `/proc` sees it).
const FILE_MODE: libc::c_uint = 0o600;

fn spill_err(reason: String) -> PoolError {
    PoolError::Spill { reason }
}

/// `bytes` as MiB for a message: whole when it is whole, else to one decimal.
pub(super) fn mib(bytes: u64) -> String {
    if bytes.is_multiple_of(MIB) {
        format!("{} MiB", bytes / MIB)
    } else {
        format!("{:.1} MiB", bytes as f64 / MIB as f64)
    }
}

fn c_path(dir: &Path) -> Result<CString, PoolError> {
    CString::new(dir.as_os_str().as_bytes())
        .map_err(|_| spill_err(format!("spill_dir {dir:?} contains a NUL byte")))
}

/// Checks that `dir` is a directory where a spill file can be created (one is created
/// and closed).
pub(super) fn check_dir(dir: &Path) -> Result<(), PoolError> {
    let meta = std::fs::metadata(dir).map_err(|e| spill_err(format!("spill_dir {dir:?}: {e}")))?;
    if !meta.is_dir() {
        return Err(spill_err(format!("spill_dir {dir:?} is not a directory")));
    }
    drop(create(dir)?);
    Ok(())
}

/// Bytes free in `dir`'s filesystem (to an unprivileged user) and the reserve kept
/// free there: `min(5% of the filesystem, 1 GiB)`.
// `fsblkcnt_t` and `c_ulong` are 32 bits on some targets: the `u64::from`s are not
// useless there.
#[allow(clippy::useless_conversion)]
pub(super) fn free_space(dir: &Path) -> Result<(u64, u64), PoolError> {
    let path = c_path(dir)?;
    // SAFETY: an all-zero `statvfs` is a valid value to be overwritten.
    let mut vfs: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `path` is a valid NUL-terminated string and `vfs` a valid out-pointer,
    // both alive for the call.
    let r = retry_eintr(|| unsafe { libc::statvfs(path.as_ptr(), &mut vfs) });
    if r != 0 {
        let e = io::Error::last_os_error();
        return Err(spill_err(format!(
            "cannot read the free space of {dir:?}: {e}"
        )));
    }
    let block = match u64::from(vfs.f_frsize) {
        0 => u64::from(vfs.f_bsize),
        b => b,
    };
    let free = u64::from(vfs.f_bavail).saturating_mul(block);
    let total = u64::from(vfs.f_blocks).saturating_mul(block);
    Ok((free, reserve(total)))
}

/// The free space a spill never takes on a filesystem of `total` bytes:
/// `min(5% of it, 1 GiB)`.
pub(super) fn reserve(total: u64) -> u64 {
    (total / 20).min(GIB)
}

/// The disk-full refusal for a file of `bytes` in `dir`.
fn too_full(dir: &Path, bytes: u64, free: u64, reserve: u64) -> PoolError {
    spill_err(format!(
        "not enough free space in {dir:?} for a {} spill file: {} free, {} kept free in reserve",
        mib(bytes),
        mib(free),
        mib(reserve)
    ))
}

/// What an I/O failure on a spill file becomes: the disk-full refusal for ENOSPC and
/// EDQUOT (with the free space now, when it can be read), else `what` and the error.
fn io_fail(dir: &Path, what: &str, bytes: u64, e: &io::Error) -> PoolError {
    if matches!(e.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT)) {
        return match free_space(dir) {
            Ok((free, reserve)) => spill_err(format!(
                "no room in {dir:?} for a {} spill file ({what}: {e}; {} free, {} kept free in reserve)",
                mib(bytes),
                mib(free),
                mib(reserve)
            )),
            Err(_) => spill_err(format!(
                "no room in {dir:?} for a {} spill file ({what}: {e})",
                mib(bytes)
            )),
        };
    }
    spill_err(format!("{what} in {dir:?}: {e}"))
}

/// A new nameless, never-linkable read-write file in `dir`.
fn create(dir: &Path) -> Result<OwnedFd, PoolError> {
    let path = c_path(dir)?;
    let flags = libc::O_TMPFILE | libc::O_EXCL | libc::O_RDWR | libc::O_CLOEXEC;
    // SAFETY: `path` is a valid NUL-terminated string alive for the call; the mode is
    // passed as the variadic argument O_TMPFILE requires.
    let raw = retry_eintr(|| unsafe { libc::open(path.as_ptr(), flags, FILE_MODE) });
    if raw < 0 {
        let e = io::Error::last_os_error();
        let hint = if e.raw_os_error() == Some(libc::EOPNOTSUPP) {
            " (its filesystem has no O_TMPFILE)"
        } else {
            ""
        };
        return Err(spill_err(format!(
            "cannot create a spill file in {dir:?}: {e}{hint}"
        )));
    }
    // SAFETY: `raw` is a descriptor just returned to us and owned by nothing else.
    Ok(unsafe { OwnedFd::from_raw_fd(raw) })
}

/// A read-only shared mapping, unmapped on drop.
struct ReadMap {
    ptr: *mut libc::c_void,
    len: usize,
}

impl ReadMap {
    fn new(fd: &OwnedFd, len: usize) -> io::Result<ReadMap> {
        // SAFETY: a new shared read-only mapping of an open descriptor at an address of
        // the kernel's choosing; nothing else is touched.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                // Page-table entries at once: the slice's pages exist, and faulting
                // them in one by one during the write cost a third of its speed.
                libc::MAP_SHARED | libc::MAP_POPULATE,
                fd.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(ReadMap { ptr, len })
    }
}

impl Drop for ReadMap {
    fn drop(&mut self) {
        // SAFETY: our own mapping of `len` bytes, never referenced after this.
        unsafe { libc::munmap(self.ptr, self.len) };
    }
}

/// Writes all of `map` to `fd` from offset 0 (short writes continued, EINTR retried).
fn write_all(fd: &OwnedFd, map: &ReadMap) -> io::Result<()> {
    let mut done = 0usize;
    while done < map.len {
        let off =
            libc::off_t::try_from(done).map_err(|_| io::Error::from_raw_os_error(libc::EFBIG))?;
        // SAFETY: `map.ptr + done .. map.ptr + map.len` lies inside our live read-only
        // mapping; `fd` is open; pwrite only reads from the buffer.
        let n = unsafe {
            libc::pwrite(
                fd.as_raw_fd(),
                map.ptr.cast::<u8>().add(done).cast(),
                map.len - done,
                off,
            )
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::WriteZero,
                "pwrite wrote nothing",
            ));
        }
        done += n as usize;
    }
    Ok(())
}

/// Copies the slice `src` (`bytes` long) to a new spill file in `dir`. Returns the
/// pool's read-write descriptor of the file and the client's read-only one.
pub(super) fn write(
    dir: &Path,
    src: &OwnedFd,
    bytes: u64,
) -> Result<(OwnedFd, OwnedFd), PoolError> {
    let (free, reserve) = free_space(dir)?;
    if free < bytes.saturating_add(reserve) {
        return Err(too_full(dir, bytes, free, reserve));
    }
    let len = usize::try_from(bytes)
        .ok()
        .zip(libc::off_t::try_from(bytes).ok())
        .ok_or_else(|| spill_err(format!("a slice of {bytes} bytes is too large to spill")))?;
    let file = create(dir)?;
    // SAFETY: plain syscall on a descriptor we own.
    if retry_eintr(|| unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, len.1) }) != 0 {
        let e = io::Error::last_os_error();
        // A filesystem without fallocate still takes the writes (a full disk then
        // shows there).
        if e.raw_os_error() != Some(libc::EOPNOTSUPP) {
            return Err(io_fail(dir, "allocating a spill file", bytes, &e));
        }
    }
    if len.0 > 0 {
        let map = ReadMap::new(src, len.0)
            .map_err(|e| spill_err(format!("cannot map a slice to spill it to {dir:?}: {e}")))?;
        write_all(&file, &map).map_err(|e| io_fail(dir, "writing a spill file", bytes, &e))?;
        // SAFETY: plain syscall on a descriptor we own.
        if retry_eintr(|| unsafe { libc::fdatasync(file.as_raw_fd()) }) != 0 {
            let e = io::Error::last_os_error();
            return Err(io_fail(dir, "syncing a spill file", bytes, &e));
        }
        // Advice only: the written (now clean) pages leave the page cache. Its failure
        // changes nothing the client sees.
        // SAFETY: plain syscall on a descriptor we own.
        let _ =
            unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, len.1, libc::POSIX_FADV_DONTNEED) };
        drop(map);
    }
    let client = reopen_read_only(&file).map_err(|e| {
        spill_err(format!(
            "cannot reopen a spill file in {dir:?} read-only: {e}"
        ))
    })?;
    Ok((file, client))
}

/// A new read-only open file description of `fd`'s file (through `/proc/self/fd`).
fn reopen_read_only(fd: &OwnedFd) -> io::Result<OwnedFd> {
    let path = CString::new(format!("/proc/self/fd/{}", fd.as_raw_fd()))
        .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: `path` is a valid NUL-terminated string alive for the call.
    let raw =
        retry_eintr(|| unsafe { libc::open(path.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) });
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `raw` is a descriptor just returned to us and owned by nothing else.
    Ok(unsafe { OwnedFd::from_raw_fd(raw) })
}
