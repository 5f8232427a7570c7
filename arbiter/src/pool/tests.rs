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

#[test]
fn take_give_round_trip_and_accounting() {
    let p = pool(32 * M, 0, 8 * M);
    let a = p.take(1, "alice", 10 * M - 1).unwrap();
    assert_eq!(total(&a), 10 * M, "rounded up to 2 MiB");
    assert_eq!(a.len(), 2, "an 8 MiB slice and a 2 MiB one");
    let b = p.take(2, "bob", 4 * M).unwrap();
    let s = p.stats();
    assert_eq!((s.lent, s.size, s.page_mode), (14 * M, 32 * M, "4KiB"));
    assert_eq!(
        s.tenants,
        vec![("alice".to_string(), 10 * M), ("bob".to_string(), 4 * M)]
    );
    assert_eq!(s.memfds, 3);

    // Another owner's ids, unknown ids, and repeats are ignored.
    assert_eq!(p.give(2, &ids(&a)), 0);
    assert_eq!(p.give(1, &[9999, 0, u64::MAX]), 0);
    assert_eq!(p.stats().lent, 14 * M);

    let mut twice = ids(&a);
    twice.extend(ids(&a));
    assert_eq!(p.give(1, &twice), 10 * M);
    let s = settled(&p);
    assert_eq!((s.lent, s.scrubbing, s.ready), (4 * M, 0, 0));
    assert_eq!(s.tenants, vec![("bob".to_string(), 4 * M)]);
    assert_eq!(p.give(2, &ids(&b)), 4 * M);
    let s = settled(&p);
    assert_eq!((s.lent, s.populated, s.memfds), (0, 0, 0));
    assert!(s.tenants.is_empty(), "a tenant holding nothing is absent");
    assert_eq!(p.take(1, "alice", 0).unwrap().len(), 0);
}

#[test]
fn refuses_past_size_naming_the_largest_holders() {
    let p = pool(16 * M, 0, 4 * M);
    let _a = p.take(1, "alice", 8 * M).unwrap();
    let _b = p.take(2, "bob", 4 * M).unwrap();
    match p.take(3, "carol", 6 * M) {
        Err(PoolError::Full {
            size,
            lent,
            bytes,
            holders,
        }) => {
            assert_eq!((size, lent, bytes), (16 * M, 12 * M, 6 * M));
            assert_eq!(
                holders,
                vec![("alice".to_string(), 8 * M), ("bob".to_string(), 4 * M)]
            );
        }
        other => panic!("expected Full, got {other:?}"),
    }
    let msg = p.take(3, "carol", 6 * M).unwrap_err().to_string();
    assert!(msg.contains("alice 8388608"), "{msg}");
    // What fits is still lent.
    assert_eq!(total(&p.take(3, "carol", 4 * M).unwrap()), 4 * M);
    assert!(matches!(p.take(3, "carol", 1), Err(PoolError::Full { .. })));
    assert_eq!(p.stats().lent, 16 * M);
}

#[test]
fn more_than_64_slices_in_one_take_is_refused() {
    let p = pool(1 << 40, 0, 2 * M);
    assert!(matches!(
        p.take(1, "a", 64 * 2 * M + 1),
        Err(PoolError::TooLarge { .. })
    ));
    assert!(matches!(
        p.take(1, "a", u64::MAX),
        Err(PoolError::TooLarge { .. })
    ));
    assert_eq!(p.stats().lent, 0);
}

#[test]
fn a_lent_slice_is_populated_before_it_is_lent() {
    let p = pool(32 * M, 0, 8 * M);
    let lent = p.take(1, "a", 12 * M).unwrap();
    for l in &lent {
        assert_eq!(blocks_bytes(l.fd.as_fd()), l.bytes, "all blocks allocated");
        assert_eq!(fstat(l.fd.as_fd()).st_size as u64, l.bytes);
    }
}

#[test]
fn thp_advise_populates_through_a_mapping() {
    let p = Pool::start_with(
        PoolConfig {
            size: 16 * M,
            floor: 4 * M,
            slice: 4 * M,
        },
        PageMode::ThpAdvise,
    )
    .unwrap();
    assert_eq!(p.stats().page_mode, "thp");
    let lent = p.take(1, "a", 8 * M).unwrap();
    for l in &lent {
        assert_eq!(blocks_bytes(l.fd.as_fd()), l.bytes);
    }
}

#[test]
fn a_returned_slice_is_scrubbed_and_never_lent_again() {
    let p = pool(16 * M, 8 * M, 4 * M);
    let lent = p.take(7, "mallory", 4 * M).unwrap();
    assert_eq!(lent.len(), 1);
    let kept = lent[0].fd.try_clone().unwrap();
    let kept_ino = fstat(kept.as_fd()).st_ino;
    let mut map = Map::new(kept.as_fd(), 4 * M);
    map.bytes().fill(0xa5);

    assert_eq!(p.give(7, &ids(&lent)), 4 * M);
    drop(lent);
    wait_for("the scrub", || p.stats().scrubbing == 0);
    assert_eq!(blocks_bytes(kept.as_fd()), 0, "every page freed");
    let mut buf = vec![0xffu8; (4 * M) as usize];
    // SAFETY: `buf` is a valid buffer of its length; `kept` is open.
    let n = unsafe { libc::pread(kept.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
    assert_eq!(n as u64, 4 * M);
    assert!(buf.iter().all(|&b| b == 0), "read back zeros");
    assert!(
        map.bytes().iter().all(|&b| b == 0),
        "the old mapping sees zeros"
    );

    // Fresh slices only: no take ever returns the returned inode (kept alive by our
    // duplicate, so its number cannot be reused).
    for _ in 0..8 {
        let again = p.take(8, "bob", 8 * M).unwrap();
        for l in &again {
            assert_ne!(fstat(l.fd.as_fd()).st_ino, kept_ino);
        }
        p.give(8, &ids(&again));
        settled(&p);
    }
}

#[test]
fn release_owner_returns_everything_it_holds() {
    let p = pool(32 * M, 0, 4 * M);
    let a1 = p.take(1, "a", 6 * M).unwrap();
    let a2 = p.take(1, "a", 2 * M).unwrap();
    let b = p.take(2, "b", 4 * M).unwrap();
    assert_eq!(p.release_owner(1), 8 * M);
    assert_eq!(p.release_owner(1), 0);
    assert_eq!(p.give(1, &ids(&a1)), 0);
    assert_eq!(p.give(1, &ids(&a2)), 0);
    let s = settled(&p);
    assert_eq!(s.lent, 4 * M);
    assert_eq!(s.tenants, vec![("b".to_string(), 4 * M)]);
    for l in a1.iter().chain(&a2) {
        assert_eq!(blocks_bytes(l.fd.as_fd()), 0, "scrubbed");
    }
    assert_eq!(
        blocks_bytes(b[0].fd.as_fd()),
        4 * M,
        "the other owner's untouched"
    );
}

#[test]
fn floor_zero_populates_nothing_and_wanted_populates_up_to_size() {
    let p = pool(32 * M, 0, 8 * M);
    let s = settled(&p);
    assert_eq!((s.ready, s.populated, s.memfds), (0, 0, 0));

    p.set_wanted(20 * M);
    let s = settled(&p);
    assert_eq!(s.ready, 20 * M);
    assert!(s.memfds <= 3);

    p.set_wanted(1 << 40);
    let s = settled(&p);
    assert_eq!(s.ready, 32 * M, "bounded by the size");

    // Lending counts against what is wanted ready; the rest stays within the size.
    let lent = p.take(1, "a", 12 * M).unwrap();
    let s = settled(&p);
    assert_eq!(s.lent + s.ready, 32 * M);
    assert!(s.populated <= s.size);
    p.give(1, &ids(&lent));

    p.set_wanted(0);
    let s = settled(&p);
    assert_eq!(
        (s.ready, s.lent, s.scrubbing),
        (0, 0, 0),
        "freed past the target"
    );
}

#[test]
fn floor_is_populated_at_start_and_kept() {
    let p = pool(32 * M, 16 * M, 8 * M);
    let s = settled(&p);
    assert_eq!(s.ready, 16 * M);
    // A ready slice larger than needed is cut down before it is lent.
    let lent = p.take(1, "a", 6 * M).unwrap();
    assert_eq!(lent.len(), 1);
    assert_eq!(lent[0].bytes, 6 * M);
    assert_eq!(fstat(lent[0].fd.as_fd()).st_size as u64, 6 * M);
    assert_eq!(blocks_bytes(lent[0].fd.as_fd()), 6 * M);
    let s = settled(&p);
    assert_eq!((s.ready, s.lent), (16 * M, 6 * M), "the floor is refilled");
    // The floor is kept only within the size.
    let more = p.take(2, "b", 24 * M).unwrap();
    assert_eq!(total(&more), 24 * M);
    let s = settled(&p);
    assert_eq!((s.lent, s.ready), (30 * M, 2 * M));
}

#[test]
fn a_lent_slice_is_sealed() {
    let p = pool(16 * M, 0, 4 * M);
    let lent = p.take(1, "a", 4 * M).unwrap();
    let fd = lent[0].fd.as_raw_fd();
    // SAFETY: plain syscalls on an open descriptor.
    unsafe {
        assert_eq!(
            errno_of(libc::ftruncate(fd, 2 * M as i64)),
            Some(libc::EPERM)
        );
        assert_eq!(
            errno_of(libc::ftruncate(fd, 8 * M as i64)),
            Some(libc::EPERM)
        );
        assert_eq!(
            errno_of(libc::fallocate(fd, 0, 0, 8 * M as i64)),
            Some(libc::EPERM)
        );
        assert_eq!(
            errno_of(libc::fcntl(fd, libc::F_ADD_SEALS, libc::F_SEAL_WRITE)),
            Some(libc::EPERM),
            "no write seal that would stop the scrub"
        );
    }
    assert_eq!(fstat(lent[0].fd.as_fd()).st_size as u64, 4 * M);
}

#[test]
fn shutdown_frees_ready_and_still_scrubs_returns() {
    let p = pool(32 * M, 16 * M, 8 * M);
    wait_for("the floor", || p.stats().ready == 16 * M);
    let lent = p.take(1, "a", 4 * M).unwrap();
    p.shutdown();
    let s = p.stats();
    assert_eq!((s.ready, s.lent), (0, 4 * M));
    assert!(matches!(p.take(1, "a", 2 * M), Err(PoolError::ShutDown)));
    assert_eq!(p.give(1, &ids(&lent)), 4 * M);
    assert_eq!(p.stats().scrubbing, 0, "scrubbed on the returner's thread");
    assert_eq!(blocks_bytes(lent[0].fd.as_fd()), 0);
    p.shutdown();
}

#[test]
fn concurrent_takes_stay_within_the_size() {
    let p = pool(32 * M, 8 * M, 4 * M);
    p.set_wanted(16 * M);
    let threads: Vec<_> = (0..4u64)
        .map(|owner| {
            let p = Arc::clone(&p);
            std::thread::spawn(move || {
                let mut lent_total = 0;
                for i in 0..20u64 {
                    let want = ((owner + i) % 4 + 1) * 2 * M;
                    match p.take(owner, &format!("t{owner}"), want) {
                        Ok(l) => {
                            lent_total += total(&l);
                            let s = p.stats();
                            assert!(s.populated + s.scrubbing + s.populating <= s.size, "{s:?}");
                            for x in &l {
                                assert_eq!(blocks_bytes(x.fd.as_fd()), x.bytes);
                            }
                            if i % 4 != 0 {
                                p.give(owner, &ids(&l));
                            }
                        }
                        Err(PoolError::Full { .. }) => {}
                        Err(e) => panic!("{e}"),
                    }
                }
                p.release_owner(owner);
                lent_total
            })
        })
        .collect();
    let lent: u64 = threads.into_iter().map(|t| t.join().unwrap()).sum();
    assert!(lent > 0);
    let s = settled(&p);
    assert_eq!((s.lent, s.scrubbing), (0, 0));
    assert!(s.tenants.is_empty());
    assert_eq!(s.ready, 16 * M);
    assert!(s.memfds <= (32 / 2) as usize);
}

#[test]
fn bad_configurations_are_refused() {
    for (size, floor, slice) in [
        (0, 0, 8 * M),
        (16 * M, 0, 3 * M),
        (16 * M, 0, 0),
        (16 * M, 32 * M, 4 * M),
    ] {
        assert!(matches!(
            Pool::start(PoolConfig { size, floor, slice }),
            Err(PoolError::Config(_))
        ));
    }
    assert!(matches!(
        Pool::start_with(
            PoolConfig::new(1 << 30),
            PageMode::HugeTlb { page: 1 << 30 }
        ),
        Err(PoolError::Config(_))
    ));
}

#[test]
fn detects_the_page_mode() {
    let meminfo = |free: u64, size_kb: u64| {
        format!(
            "MemTotal: 1000 kB\nHugePages_Total: {free}\nHugePages_Free: {free}\nHugepagesize: {size_kb} kB\n"
        )
    };
    let never = Some("always within_size advise [never] deny force\n");
    let advise = Some("always within_size [advise] never deny force\n");
    let always = Some("[always] within_size advise never deny force\n");
    let within = Some("always [within_size] advise never deny force\n");
    let d = PageMode::detect_from;
    assert_eq!(d(&meminfo(0, 2048), never, 64 * M), PageMode::Small);
    assert_eq!(d(&meminfo(0, 2048), None, 64 * M), PageMode::Small);
    assert_eq!(d(&meminfo(0, 2048), advise, 64 * M), PageMode::ThpAdvise);
    assert_eq!(d(&meminfo(0, 2048), always, 64 * M), PageMode::ThpFallocate);
    assert_eq!(d(&meminfo(0, 2048), within, 64 * M), PageMode::ThpFallocate);
    assert_eq!(d(&meminfo(31, 2048), never, 64 * M), PageMode::Small);
    assert_eq!(
        d(&meminfo(32, 2048), never, 64 * M),
        PageMode::HugeTlb { page: 2 * M }
    );
    // A 1 GiB huge page does not divide a 64 MiB slice.
    assert_eq!(d(&meminfo(8, 1 << 20), advise, 64 * M), PageMode::ThpAdvise);
    assert_eq!(PageMode::HugeTlb { page: 2 * M }.name(), "hugetlb");
    assert_eq!(PageMode::ThpAdvise.name(), "thp");
}

#[test]
fn default_size_is_half_of_available_at_least_256_mib() {
    assert_eq!(
        default_size_from("MemTotal: 67108864 kB\nMemAvailable:   33554432 kB\n"),
        16 << 30
    );
    assert_eq!(
        default_size_from("MemAvailable: 1000 kB\n"),
        MIN_DEFAULT_SIZE
    );
    assert_eq!(default_size_from(""), MIN_DEFAULT_SIZE);
    assert_eq!(default_size_from("MemAvailable: 1048577 kB\n") % UNIT, 0);
    assert!(default_size() >= MIN_DEFAULT_SIZE);
}

#[test]
fn slices_an_earlier_arbiter_lent_count_until_their_owner_lets_go() {
    let p = pool(64 * M, 32 * M, 8 * M);
    assert_eq!(settled(&p).ready, 32 * M);
    // A client kept 48 MiB of a dead arbiter's slices: counted, ready given up for it.
    assert_eq!(p.keep(7, "team/nb", 48 * M), 48 * M);
    let s = p.stats();
    assert_eq!(s.lent, 48 * M);
    assert!(s.ready + s.lent <= 64 * M, "{s:?}");
    assert_eq!(s.tenants, vec![("team/nb".to_string(), 48 * M)]);
    // The room left is the size less what is kept.
    assert!(matches!(
        p.take(1, "other", 24 * M),
        Err(PoolError::Full { .. })
    ));
    let lent = p.take(1, "other", 16 * M).expect("16 MiB fit beside it");
    // More than there is room for: counted up to the size.
    assert_eq!(p.keep(7, "team/nb", 100 * M), 48 * M);
    // It lets go (a smaller figure, then its connection ends): the room comes back.
    assert_eq!(p.keep(7, "team/nb", 8 * M), 8 * M);
    assert_eq!(p.stats().lent, 16 * M + 8 * M);
    p.release_owner(7);
    p.give(1, &ids(&lent));
    let s = settled(&p);
    assert_eq!(s.lent, 0);
    assert!(s.tenants.is_empty(), "{s:?}");
}
