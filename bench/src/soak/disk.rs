//! The soak's spill disk: the directory the arbiter's disk tier writes to, and the two
//! faults that take it from the arbiter, gone (renamed away) and full.
//!
//! Run as root, the arbiter gets a mount namespace of its own with a small tmpfs
//! ([`SIZE`]) at `<run>/spillfs`, its spill directory inside: the soak can then fill
//! that disk to the last byte without filling the machine's. Each arbiter started gets
//! a new, empty one; a spill file a client still holds keeps its old one alive. The
//! faults reach the arbiter's view through `/proc/<pid>/root` and hold a descriptor of
//! the filesystem's root, so a fault that outlives its arbiter (SIGKILLed and
//! restarted meanwhile) still undoes what it did, on the disk it did it to. Run as
//! another user, the spill directory is on the run's own disk and the soak injects no
//! full disk (and says so).

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, Context, Result};

/// The private tmpfs's size: room for what the disk tier holds in a soak (a few
/// hundred MiB at most, `spilled_peak`), small enough that filling it costs little.
const SIZE: &str = "1g";
/// Where the spill directory is inside the disk, and where it goes when "gone".
const SPILL: &str = "spill";
const GONE: &str = "spill.gone";
/// The file that fills the disk.
const FILLER: &str = "filler";

/// The spill disk of a soak run in `dir`.
#[derive(Debug, Clone)]
pub(super) struct SpillDisk {
    /// The disk's root as the soak's own process sees it (`<run>/spillfs`).
    root: PathBuf,
    /// Whether each arbiter gets a tmpfs of its own there (run as root).
    private: bool,
}

impl SpillDisk {
    pub(super) fn new(dir: &Path) -> Result<SpillDisk> {
        let root = dir.join("spillfs");
        std::fs::create_dir_all(&root).context("cannot make the spill disk's directory")?;
        // SAFETY: geteuid has no preconditions and cannot fail.
        let private = unsafe { libc::geteuid() } == 0;
        if !private {
            std::fs::create_dir_all(root.join(SPILL)).context("cannot make the spill directory")?;
        }
        Ok(SpillDisk { root, private })
    }

    /// Whether the soak can fill this disk (a tmpfs of the arbiter's own).
    pub(super) fn can_fill(&self) -> bool {
        self.private
    }

    /// The arbiter's `--spill-dir`.
    pub(super) fn spill_dir(&self) -> PathBuf {
        self.root.join(SPILL)
    }

    /// Has `cmd` (the arbiter) start in a mount namespace of its own with a fresh
    /// tmpfs at the disk's root and the spill directory in it.
    pub(super) fn prepare(&self, cmd: &mut Command) -> Result<()> {
        if !self.private {
            return Ok(());
        }
        let cstr = |p: &Path| CString::new(p.as_os_str().as_bytes()).context("a NUL in a path");
        let (root, spill) = (cstr(&self.root)?, cstr(&self.spill_dir())?);
        let opts = CString::new(format!("size={SIZE},mode=0700")).expect("no NUL");
        let pre_exec = move || -> io::Result<()> {
            let check = |r: libc::c_int| match r {
                0 => Ok(()),
                _ => Err(io::Error::last_os_error()),
            };
            // SAFETY: only system calls with NUL-terminated strings built before the
            // fork (alive in this closure) and null pointers where the calls take
            // them; nothing here allocates or takes a lock.
            unsafe {
                check(libc::unshare(libc::CLONE_NEWNS))?;
                // Nothing mounted here reaches the machine's namespace.
                check(libc::mount(
                    c"none".as_ptr(),
                    c"/".as_ptr(),
                    std::ptr::null(),
                    libc::MS_REC | libc::MS_PRIVATE,
                    std::ptr::null(),
                ))?;
                check(libc::mount(
                    c"kiwi-soak-spill".as_ptr(),
                    root.as_ptr(),
                    c"tmpfs".as_ptr(),
                    libc::MS_NOSUID | libc::MS_NODEV,
                    opts.as_ptr().cast(),
                ))?;
                check(libc::mkdir(spill.as_ptr(), 0o700))
            }
        };
        // SAFETY: the closure makes only async-signal-safe system calls (above).
        unsafe { cmd.pre_exec(pre_exec) };
        Ok(())
    }

    /// The disk's root as arbiter `pid` sees it, held open.
    pub(super) fn open(&self, pid: u32) -> Result<Disk> {
        let path = if self.private {
            PathBuf::from(format!("/proc/{pid}/root")).join(self.root.strip_prefix("/")?)
        } else {
            self.root.clone()
        };
        let c = CString::new(path.as_os_str().as_bytes())?;
        // SAFETY: `c` is a valid NUL-terminated path alive for the call.
        let fd = unsafe {
            libc::open(
                c.as_ptr(),
                libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC,
            )
        };
        if fd < 0 {
            let e = io::Error::last_os_error();
            bail!("cannot open the spill disk at {}: {e}", path.display());
        }
        // SAFETY: `fd` was just opened and is owned by nothing else.
        Ok(Disk(unsafe { OwnedFd::from_raw_fd(fd) }))
    }
}

/// One arbiter's spill disk, held open by its root.
pub(super) struct Disk(OwnedFd);

impl Disk {
    fn rename(&self, from: &std::ffi::CStr, to: &std::ffi::CStr) -> io::Result<()> {
        let fd = self.0.as_raw_fd();
        // SAFETY: `fd` is an open directory and both names valid NUL-terminated
        // strings alive for the call.
        match unsafe { libc::renameat(fd, from.as_ptr(), fd, to.as_ptr()) } {
            0 => Ok(()),
            _ => Err(io::Error::last_os_error()),
        }
    }

    /// The spill directory renamed away for `hold`, then back (a missing disk).
    pub(super) fn gone(&self, hold: Duration) -> Result<()> {
        let (here, away) = (
            CString::new(SPILL).expect("no NUL"),
            CString::new(GONE).expect("no NUL"),
        );
        self.rename(&here, &away)
            .context("cannot take the spill directory away")?;
        std::thread::sleep(hold);
        self.rename(&away, &here)
            .context("cannot put the spill directory back")
    }

    /// The disk filled to its last byte (a full disk) until [`Filled::empty`]: how
    /// many bytes it took.
    pub(super) fn fill(&self) -> Result<Filled<'_>> {
        let name = CString::new(FILLER).expect("no NUL");
        // SAFETY: `self.0` is an open directory and `name` a valid NUL-terminated
        // string alive for the call.
        let fd = unsafe {
            libc::openat(
                self.0.as_raw_fd(),
                name.as_ptr(),
                libc::O_CREAT | libc::O_WRONLY | libc::O_TRUNC | libc::O_CLOEXEC,
                0o600,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error()).context("cannot create the filler");
        }
        // SAFETY: `fd` was just opened and is owned by nothing else.
        let file = unsafe { OwnedFd::from_raw_fd(fd) };
        // In shrinking steps until not one block more fits (what the disk tier frees
        // meanwhile is taken too).
        let mut filled = Filled {
            disk: self,
            name,
            bytes: 0,
        };
        let mut step = 1u64 << 20;
        while step >= 4096 {
            // SAFETY: `file` is open for writing; the range is in bounds of `off_t`.
            let r = unsafe {
                libc::fallocate(
                    file.as_raw_fd(),
                    0,
                    filled.bytes as libc::off_t,
                    step as libc::off_t,
                )
            };
            if r == 0 {
                filled.bytes += step;
                continue;
            }
            let e = io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::ENOSPC) {
                return Err(e).context("cannot fill the spill disk");
            }
            step /= 16;
        }
        Ok(filled)
    }
}

/// A disk filled by [`Disk::fill`], emptied when dropped.
pub(super) struct Filled<'a> {
    disk: &'a Disk,
    name: CString,
    /// What it took to fill.
    pub(super) bytes: u64,
}

impl Filled<'_> {
    /// The filler removed.
    pub(super) fn empty(self) -> Result<()> {
        let r = self.unlink();
        std::mem::forget(self);
        r.context("cannot empty the spill disk")
    }

    fn unlink(&self) -> io::Result<()> {
        // SAFETY: the disk's descriptor is an open directory and `name` a valid
        // NUL-terminated string alive for the call.
        match unsafe { libc::unlinkat(self.disk.0.as_raw_fd(), self.name.as_ptr(), 0) } {
            0 => Ok(()),
            _ => Err(io::Error::last_os_error()),
        }
    }
}

impl Drop for Filled<'_> {
    fn drop(&mut self) {
        let _ = self.unlink();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Free bytes of the filesystem at `path`.
    fn free(path: &Path) -> u64 {
        let c = CString::new(path.as_os_str().as_bytes()).unwrap();
        // SAFETY: an all-zero `statvfs` is a valid value to be overwritten.
        let mut vfs: libc::statvfs = unsafe { std::mem::zeroed() };
        // SAFETY: `c` is a valid path and `vfs` a valid out-pointer for the call.
        assert_eq!(unsafe { libc::statvfs(c.as_ptr(), &mut vfs) }, 0);
        vfs.f_bavail * vfs.f_frsize
    }

    #[test]
    fn an_arbiters_own_disk_fills_goes_and_comes_back_without_touching_the_machines() {
        let dir = tempfile::tempdir().unwrap();
        let disk = SpillDisk::new(dir.path()).unwrap();
        if !disk.can_fill() {
            // The soak's full disk needs root; CI runs as root and must test it.
            assert_ne!(
                std::env::var("CI").as_deref(),
                Ok("true"),
                "CI runs as root"
            );
            eprintln!("not root: no private spill disk to test");
            return;
        }
        let mut cmd = Command::new("sleep");
        cmd.arg("60");
        disk.prepare(&mut cmd).unwrap();
        let mut child = cmd.spawn().unwrap();
        let inside = PathBuf::from(format!("/proc/{}/root", child.id()))
            .join(disk.spill_dir().strip_prefix("/").unwrap());
        // The spill directory is on the arbiter's tmpfs, not the machine's disk.
        assert!(inside.is_dir(), "{}", inside.display());
        assert!(!disk.spill_dir().exists());
        let whole = free(&inside);
        assert!(whole > 900 << 20 && whole <= 1 << 30, "{whole}");
        let d = disk.open(child.id()).unwrap();
        let filled = d.fill().unwrap();
        assert_eq!(free(&inside), 0);
        assert!(
            filled.bytes + (4 << 20) >= whole,
            "{} of {whole}",
            filled.bytes
        );
        filled.empty().unwrap();
        assert_eq!(free(&inside), whole);
        // Gone for a moment, then back, even once its arbiter has died.
        let gone = std::thread::spawn(move || d.gone(Duration::from_millis(500)));
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while inside.exists() && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(!inside.exists(), "the spill directory never went");
        child.kill().unwrap();
        child.wait().unwrap();
        gone.join().unwrap().unwrap();
        // The machine's directory was never touched.
        assert_eq!(
            std::fs::read_dir(dir.path().join("spillfs"))
                .unwrap()
                .count(),
            0
        );
    }
}
