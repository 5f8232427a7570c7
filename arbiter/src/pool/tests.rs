//! The pool on real memfds, small sizes, 4 KiB pages unless a test says otherwise.

use super::*;
use std::os::fd::{AsFd, BorrowedFd};

const M: u64 = MIB;
const WAIT: Duration = Duration::from_secs(10);

fn pool(size: u64, floor: u64, slice: u64) -> Arc<Pool> {
    Pool::start_with(PoolConfig { size, floor, slice }, PageMode::Small).expect("pool starts")
}

/// Polls `cond` until it holds, for at most 10 s.
fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn settled(p: &Pool) -> PoolStats {
    assert!(p.settle(WAIT), "the pool's thread did not settle");
    p.stats()
}

fn fstat(fd: BorrowedFd<'_>) -> libc::stat {
    // SAFETY: an all-zero `stat` is a valid value to be overwritten.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `fd` is open for the borrow; `st` is a valid out-pointer.
    let r = unsafe { libc::fstat(fd.as_raw_fd(), &mut st) };
    assert_eq!(r, 0, "fstat: {}", io::Error::last_os_error());
    st
}

fn blocks_bytes(fd: BorrowedFd<'_>) -> u64 {
    fstat(fd).st_blocks as u64 * 512
}

fn errno_of(r: libc::c_int) -> Option<i32> {
    (r != 0).then(|| io::Error::last_os_error().raw_os_error().unwrap_or(0))
}

/// A shared read-write mapping of a whole memfd, unmapped on drop.
struct Map {
    ptr: *mut u8,
    len: usize,
}

impl Map {
    fn new(fd: BorrowedFd<'_>, len: u64) -> Map {
        let len = len as usize;
        // SAFETY: a new shared mapping of an open descriptor at the kernel's choice of
        // address.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        assert_ne!(
            ptr,
            libc::MAP_FAILED,
            "mmap: {}",
            io::Error::last_os_error()
        );
        Map {
            ptr: ptr.cast(),
            len,
        }
    }

    fn bytes(&mut self) -> &mut [u8] {
        // SAFETY: the mapping is `len` bytes, readable and writable, alive while `self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for Map {
    fn drop(&mut self) {
        // SAFETY: our own mapping, not referenced after this.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

fn ids(lent: &[Lent]) -> Vec<u64> {
    lent.iter().map(|l| l.id).collect()
}

fn total(lent: &[Lent]) -> u64 {
    lent.iter().map(|l| l.bytes).sum()
}

mod background;
mod disk_tier;
mod lend;
mod slices;
