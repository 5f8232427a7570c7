//! The disk tier: spilling lent slices to files and reading them back.

use super::*;

// The disk tier.

/// A fresh directory under the system's temporary directory, removed on drop.
struct TempDir(std::path::PathBuf);

impl TempDir {
    fn new(what: &str) -> TempDir {
        static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let dir = std::env::temp_dir().join(format!(
            "kiwi-spill-test-{}-{what}-{n}-{nanos}",
            std::process::id()
        ));
        std::fs::create_dir(&dir).expect("creating a test directory");
        TempDir(dir)
    }

    fn cfg(&self, budget: Option<u64>) -> SpillConfig {
        SpillConfig {
            dir: self.0.clone(),
            budget,
        }
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A pool of 32 MiB in 4 MiB slices with a disk tier in `dir`.
fn spill_pool(dir: &TempDir, budget: Option<u64>) -> Arc<Pool> {
    let p = pool(32 * M, 0, 4 * M);
    p.enable_spill(dir.cfg(budget))
        .expect("the disk tier is enabled");
    p
}

/// The bytes a test writes into slice number `seed`.
fn pattern(seed: u8, len: u64) -> Vec<u8> {
    (0..len)
        .map(|i| (i % 251) as u8 ^ seed.wrapping_mul(37))
        .collect()
}

/// Writes [`pattern`] `seed` into a lent slice through a mapping, then unmaps it (as
/// a client does before it spills).
fn fill(l: &Lent, seed: u8) {
    let mut map = Map::new(l.fd.as_fd(), l.bytes);
    map.bytes().copy_from_slice(&pattern(seed, l.bytes));
}

/// All `len` bytes of `fd` from offset 0.
fn read_all(fd: BorrowedFd<'_>, len: u64) -> Vec<u8> {
    let mut buf = vec![0u8; len as usize];
    let mut done = 0usize;
    while done < buf.len() {
        // SAFETY: the range is inside `buf`; `fd` is open.
        let n = unsafe {
            libc::pread(
                fd.as_raw_fd(),
                buf[done..].as_mut_ptr().cast(),
                buf.len() - done,
                done as libc::off_t,
            )
        };
        assert!(n > 0, "pread: {n} {}", io::Error::last_os_error());
        done += n as usize;
    }
    buf
}

fn spill_reason(e: PoolError) -> String {
    match e {
        PoolError::Spill { reason } => {
            assert!(!reason.contains('\n'), "one line: {reason}");
            reason
        }
        other => panic!("expected a spill refusal, got {other:?}"),
    }
}

#[test]
fn a_spilled_slice_reads_back_through_a_read_only_descriptor() {
    let dir = TempDir::new("round-trip");
    let p = spill_pool(&dir, None);
    let lent = p.take(1, "alice", 8 * M).unwrap();
    assert_eq!(lent.len(), 2);
    fill(&lent[0], 1);
    fill(&lent[1], 2);

    let spilled = p.spill(1, "alice", &[lent[0].id]).unwrap();
    p.spill_sent(1);
    assert_eq!(spilled.len(), 1);
    let s0 = &spilled[0];
    assert_eq!((s0.from, s0.bytes), (lent[0].id, 4 * M));
    assert!(s0.id != lent[0].id && s0.id != lent[1].id, "a fresh id");
    assert_eq!(read_all(s0.fd.as_fd(), 4 * M), pattern(1, 4 * M));
    assert_eq!(fstat(s0.fd.as_fd()).st_size as u64, 4 * M);
    assert_eq!(fstat(s0.fd.as_fd()).st_nlink, 0, "no name on disk");
    assert_eq!(
        std::fs::read_dir(&dir.0).unwrap().count(),
        0,
        "nothing visible in the directory"
    );

    // Read-only: no write, no growing through the client's descriptor.
    let fd = s0.fd.as_raw_fd();
    // SAFETY: plain syscalls on an open descriptor; the buffer is valid.
    unsafe {
        assert_eq!(
            libc::fcntl(fd, libc::F_GETFL) & libc::O_ACCMODE,
            libc::O_RDONLY
        );
        let r = libc::pwrite(fd, [0u8; 16].as_ptr().cast(), 16, 0);
        assert_eq!(r, -1);
        assert_eq!(io::Error::last_os_error().raw_os_error(), Some(libc::EBADF));
        assert_eq!(
            errno_of(libc::fallocate(fd, 0, 0, 8 * M as i64)),
            Some(libc::EBADF)
        );
    }

    // The slice left the lent figures for the spilled ones, and is scrubbed.
    let s = settled(&p);
    assert_eq!((s.lent, s.populated, s.scrubbing), (4 * M, 4 * M, 0));
    assert_eq!((s.spilled, s.spill_files), (4 * M, 1));
    assert_eq!(s.tenants, vec![("alice".to_string(), 4 * M)]);
    assert_eq!(s.spilled_tenants, vec![("alice".to_string(), 4 * M)]);
    assert_eq!(s.spill_dir.as_deref(), Some(dir.0.to_str().unwrap()));
    assert_eq!((s.spill_budget, s.spill_failures), (None, 0));
    assert_eq!(s.last_spill_error, None);
    assert_eq!(blocks_bytes(lent[0].fd.as_fd()), 0, "the slice is scrubbed");
    assert_eq!(read_all(lent[1].fd.as_fd(), 4 * M), pattern(2, 4 * M));
    // The old id is gone; another owner cannot give the spill id back.
    assert_eq!(p.give(1, &[lent[0].id]), 0);
    assert_eq!(p.give(2, &[s0.id]), 0);
    assert_eq!(p.stats().spill_files, 1);
    // Not lent again: the slice's room is free for the next take.
    assert_eq!(total(&p.take(3, "bob", 28 * M).unwrap()), 28 * M);

    // Given back: the pool's descriptor closes (RAM taken back: none).
    assert_eq!(p.give(1, &[s0.id]), 0);
    let s = p.stats();
    assert_eq!((s.spilled, s.spill_files), (0, 0));
    assert!(s.spilled_tenants.is_empty());
    // The client's descriptor still reads what it was sent until it closes it.
    assert_eq!(read_all(s0.fd.as_fd(), 4 * M), pattern(1, 4 * M));
}

#[test]
fn give_takes_slices_and_spill_files_back_together() {
    let dir = TempDir::new("give");
    let p = spill_pool(&dir, None);
    let lent = p.take(1, "a", 12 * M).unwrap();
    let spilled = p.spill(1, "a", &[lent[0].id]).unwrap();
    p.spill_sent(1);
    assert_eq!(
        p.give(1, &[spilled[0].id, lent[1].id, lent[2].id]),
        8 * M,
        "the slices' bytes"
    );
    let s = settled(&p);
    assert_eq!((s.lent, s.spilled, s.spill_files), (0, 0, 0));
}

#[test]
fn release_owner_drops_its_spill_files() {
    let dir = TempDir::new("release");
    let p = spill_pool(&dir, None);
    let a = p.take(1, "a", 8 * M).unwrap();
    let b = p.take(2, "b", 4 * M).unwrap();
    let sa = p.spill(1, "a", &ids(&a)).unwrap();
    p.spill_sent(1);
    assert_eq!(sa.len(), 2);
    let sb = p.spill(2, "b", &ids(&b)).unwrap();
    p.spill_sent(2);
    assert_eq!(sb.len(), 1);
    let s = p.stats();
    assert_eq!((s.spilled, s.spill_files, s.lent), (12 * M, 3, 0));
    assert_eq!(
        s.spilled_tenants,
        vec![("a".to_string(), 8 * M), ("b".to_string(), 4 * M)]
    );
    assert_eq!(p.release_owner(1, None), 0, "no slices left lent to it");
    let s = p.stats();
    assert_eq!((s.spilled, s.spill_files), (4 * M, 1));
    assert_eq!(s.spilled_tenants, vec![("b".to_string(), 4 * M)]);
    // Its spill ids are gone with it.
    let sa_ids: Vec<u64> = sa.iter().map(|x| x.id).collect();
    assert_eq!(p.give(1, &sa_ids), 0);
    assert_eq!(p.stats().spill_files, 1, "the other owner's stays");
}

#[test]
fn the_budget_bounds_the_spilled_bytes() {
    let dir = TempDir::new("budget");
    let p = spill_pool(&dir, Some(4 * M));
    let lent = p.take(1, "a", 8 * M).unwrap();
    fill(&lent[0], 3);
    fill(&lent[1], 4);
    let first = p.spill(1, "a", &[lent[0].id]).unwrap();
    p.spill_sent(1);
    let reason = spill_reason(p.spill(1, "a", &[lent[1].id]).unwrap_err());
    assert!(
        reason.contains("spill budget of 4 MiB is full (4 MiB spilled)"),
        "{reason}"
    );
    let s = p.stats();
    assert_eq!((s.lent, s.spilled, s.spill_files), (4 * M, 4 * M, 1));
    assert_eq!((s.spill_budget, s.spill_failures), (Some(4 * M), 1));
    assert!(
        s.last_spill_error
            .as_deref()
            .unwrap()
            .contains("spill budget"),
        "{s:?}"
    );
    // The refused slice is still lent, untouched; the first spill is intact.
    assert_eq!(read_all(lent[1].fd.as_fd(), 4 * M), pattern(4, 4 * M));
    assert_eq!(read_all(first[0].fd.as_fd(), 4 * M), pattern(3, 4 * M));
    // Room again once the first is given back.
    p.give(1, &[first[0].id]);
    assert_eq!(p.spill(1, "a", &[lent[1].id]).unwrap().len(), 1);
}

#[test]
fn a_spill_that_fails_part_way_moves_nothing() {
    let dir = TempDir::new("partial");
    let p = spill_pool(&dir, Some(8 * M));
    let lent = p.take(1, "a", 12 * M).unwrap();
    assert_eq!(lent.len(), 3);
    for (i, l) in lent.iter().enumerate() {
        fill(l, i as u8);
    }
    // An unknown id and another owner's are skipped; the third slice is past the
    // budget: the whole request is refused, every slice stays lent, untouched.
    let other = p.take(2, "b", 4 * M).unwrap();
    let asked = [lent[0].id, 9999, other[0].id, lent[1].id, lent[2].id];
    let reason = spill_reason(p.spill(1, "a", &asked).unwrap_err());
    assert!(reason.contains("spill budget of 8 MiB"), "{reason}");
    let s = settled(&p);
    assert_eq!(
        (s.lent, s.spilled, s.spill_files, s.spill_failures),
        (16 * M, 0, 0, 1)
    );
    for (i, l) in lent.iter().enumerate() {
        assert_eq!(read_all(l.fd.as_fd(), 4 * M), pattern(i as u8, 4 * M));
    }
    assert_eq!(blocks_bytes(other[0].fd.as_fd()), 4 * M);
    // Within the budget, the same kind of request moves all its slices, in order.
    let moved = p
        .spill(1, "a", &[lent[0].id, 9999, other[0].id, lent[1].id])
        .unwrap();
    assert_eq!(
        moved.iter().map(|s| s.from).collect::<Vec<_>>(),
        vec![lent[0].id, lent[1].id]
    );
    for (s, seed) in moved.iter().zip([0u8, 1]) {
        assert_eq!(read_all(s.fd.as_fd(), 4 * M), pattern(seed, 4 * M));
    }
    // Nothing lent to the owner among the ids: nothing moves, nothing fails.
    assert!(p.spill(1, "a", &[other[0].id, 12345]).unwrap().is_empty());
    assert_eq!(p.stats().spill_failures, 1);
}

#[test]
fn a_missing_directory_refuses_and_leaves_the_slice_lent() {
    let dir = TempDir::new("vanishing");
    let p = spill_pool(&dir, None);
    let lent = p.take(1, "a", 4 * M).unwrap();
    fill(&lent[0], 9);
    std::fs::remove_dir(&dir.0).unwrap();
    let reason = spill_reason(p.spill(1, "a", &ids(&lent)).unwrap_err());
    assert!(reason.contains(dir.0.to_str().unwrap()), "{reason}");
    assert!(reason.contains("No such file"), "{reason}");
    let s = settled(&p);
    assert_eq!(
        (s.lent, s.spilled, s.spill_files, s.spill_failures),
        (4 * M, 0, 0, 1)
    );
    assert_eq!(read_all(lent[0].fd.as_fd(), 4 * M), pattern(9, 4 * M));
    assert_eq!(blocks_bytes(lent[0].fd.as_fd()), 4 * M, "not scrubbed");
    assert_eq!(p.give(1, &ids(&lent)), 4 * M, "still lent");
}

#[test]
fn enable_spill_checks_the_directory() {
    let dir = TempDir::new("enable");
    let p = pool(16 * M, 0, 4 * M);
    let lent = p.take(1, "a", 4 * M).unwrap();
    let reason = spill_reason(p.spill(1, "a", &ids(&lent)).unwrap_err());
    assert_eq!(reason, "no spill_dir is configured");
    assert_eq!(
        p.spill(1, "a", &ids(&lent)).unwrap_err().to_string(),
        "swap pool spill: no spill_dir is configured"
    );

    let missing = dir.0.join("not-there");
    let reason = spill_reason(
        p.enable_spill(SpillConfig {
            dir: missing.clone(),
            budget: None,
        })
        .unwrap_err(),
    );
    assert!(reason.contains(missing.to_str().unwrap()), "{reason}");
    let file = dir.0.join("a-file");
    std::fs::write(&file, b"x").unwrap();
    let reason = spill_reason(
        p.enable_spill(SpillConfig {
            dir: file.clone(),
            budget: None,
        })
        .unwrap_err(),
    );
    assert!(reason.contains("is not a directory"), "{reason}");
    // The tier stays configured: each spill says why it is refused, and works once
    // the directory is usable.
    assert_eq!(p.stats().spill_dir.as_deref(), file.to_str());
    let reason = spill_reason(p.spill(1, "a", &ids(&lent)).unwrap_err());
    assert!(reason.contains(file.to_str().unwrap()), "{reason}");
    let later = dir.0.join("mounted-later");
    let _ = p.enable_spill(SpillConfig {
        dir: later.clone(),
        budget: None,
    });
    std::fs::create_dir(&later).unwrap();
    let moved = p.spill(1, "a", &ids(&lent)).unwrap();
    p.spill_sent(1);
    assert_eq!(moved.len(), 1);
    p.give(1, &[moved[0].id]);
    let lent = p.take(1, "a", 4 * M).unwrap();

    // A second call replaces the first.
    p.enable_spill(dir.cfg(Some(64 * M))).unwrap();
    p.enable_spill(dir.cfg(Some(32 * M))).unwrap();
    assert_eq!(p.stats().spill_budget, Some(32 * M));
    assert_eq!(p.spill(1, "a", &ids(&lent)).unwrap().len(), 1);
}

#[test]
fn shutdown_drops_spill_files_and_refuses_spills() {
    let dir = TempDir::new("shutdown");
    let p = spill_pool(&dir, None);
    let lent = p.take(1, "a", 8 * M).unwrap();
    fill(&lent[0], 5);
    let spilled = p.spill(1, "a", &[lent[0].id]).unwrap();
    p.spill_sent(1);
    p.shutdown();
    let s = p.stats();
    assert_eq!((s.spilled, s.spill_files), (0, 0));
    assert!(s.spilled_tenants.is_empty());
    assert!(matches!(
        p.spill(1, "a", &[lent[1].id]),
        Err(PoolError::ShutDown)
    ));
    assert_eq!(
        p.stats().spill_failures,
        0,
        "a shut-down pool is no failure"
    );
    assert_eq!(read_all(spilled[0].fd.as_fd(), 4 * M), pattern(5, 4 * M));
}

#[test]
fn the_disk_reserve_is_five_percent_at_most_one_gib() {
    assert_eq!(spill::reserve(0), 0);
    assert_eq!(spill::reserve(100 * M), 5 * M);
    assert_eq!(spill::reserve(20 << 30), 1 << 30);
    assert_eq!(spill::reserve(1 << 40), 1 << 30);
}

#[test]
fn concurrent_spills_stay_within_the_budget() {
    let dir = TempDir::new("concurrent");
    let p = pool(64 * M, 0, 2 * M);
    p.enable_spill(dir.cfg(Some(16 * M))).unwrap();
    let threads: Vec<_> = (0..4u64)
        .map(|owner| {
            let p = Arc::clone(&p);
            std::thread::spawn(move || {
                let lent = p.take(owner, &format!("t{owner}"), 12 * M).unwrap();
                let moved = p
                    .spill(owner, &format!("t{owner}"), &ids(&lent))
                    .unwrap_or_default();
                p.spill_sent(owner);
                assert!(p.stats().spilled <= 16 * M);
                moved.len()
            })
        })
        .collect();
    let moved: Vec<usize> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    let s = settled(&p);
    // All or none per request: each moved its 6 slices or nothing, and together
    // no more than the budget (one 12 MiB request fits in 16 MiB, two do not).
    assert!(moved.iter().all(|&n| n == 0 || n == 6), "{moved:?}");
    let total: usize = moved.iter().sum();
    assert!(total <= 6, "{moved:?}");
    assert_eq!((s.spilled, s.spill_files), (total as u64 * 2 * M, total));
    assert_eq!(s.lent, 48 * M - total as u64 * 2 * M);
}

/// A spill whose answer never reached the client (the arbiter died, the connection
/// broke) leaves the slices intact: the client still holds its memory in them. Before
/// this, the slices were scrubbed at the spill, and a client that never got the answer
/// swapped zeros back in (seen in CI: an arbiter SIGKILLed during spills).
#[test]
fn a_spill_whose_answer_was_not_sent_leaves_the_slices_intact() {
    let dir = TempDir::new("unsent");
    let p = spill_pool(&dir, None);
    let lent = p.take(1, "a", 8 * M).unwrap();
    fill(&lent[0], 7);
    fill(&lent[1], 8);
    let spilled = p.spill(1, "a", &ids(&lent)).unwrap();
    assert_eq!(spilled.len(), 2);
    // Not sent: the connection closes while its process lives.
    let me = (std::process::id(), 1);
    assert_eq!(p.release_owner(1, Some(me)), 0, "nothing scrubbed");
    let s = settled(&p);
    assert_eq!(
        (s.lent, s.spill_files),
        (8 * M, 0),
        "still counted, files gone"
    );
    assert_eq!(read_all(lent[0].fd.as_fd(), 4 * M), pattern(7, 4 * M));
    assert_eq!(read_all(lent[1].fd.as_fd(), 4 * M), pattern(8, 4 * M));
    assert_eq!(p.orphaned(me), 8 * M);
    // A process still running keeps them; once it has exited they are scrubbed.
    assert_eq!(p.reap(|_| true), 0);
    assert_eq!(read_all(lent[0].fd.as_fd(), 4 * M), pattern(7, 4 * M));
    assert_eq!(p.reap(|_| false), 8 * M);
    let s = settled(&p);
    assert_eq!((s.lent, s.scrubbing), (0, 0));
    assert_eq!(blocks_bytes(lent[0].fd.as_fd()), 0, "scrubbed");
    assert_eq!(p.orphaned(me), 0);
}

/// Sent, the spilled slices are scrubbed at once.
#[test]
fn a_spill_answered_scrubs_its_slices() {
    let dir = TempDir::new("sent");
    let p = spill_pool(&dir, None);
    let lent = p.take(1, "a", 4 * M).unwrap();
    fill(&lent[0], 3);
    let spilled = p.spill(1, "a", &ids(&lent)).unwrap();
    assert_eq!(p.stats().lent, 4 * M, "lent until the answer is sent");
    assert_eq!(p.spill_sent(1), 4 * M);
    let s = settled(&p);
    assert_eq!((s.lent, s.spilled), (0, 4 * M));
    assert_eq!(blocks_bytes(lent[0].fd.as_fd()), 0);
    assert_eq!(read_all(spilled[0].fd.as_fd(), 4 * M), pattern(3, 4 * M));
}

/// A connection that closes under a live process (a timeout, a refusal) leaves what
/// it was lent to the process: not scrubbed, counted against the size and, through
/// `keep`, not twice.
#[test]
fn a_connection_closed_under_a_live_process_leaves_its_slices_to_it() {
    let p = pool(32 * M, 0, 4 * M);
    let lent = p.take(1, "a", 8 * M).unwrap();
    fill(&lent[0], 5);
    let me = (4242, 99);
    assert_eq!(p.release_owner(1, Some(me)), 0);
    let s = settled(&p);
    assert_eq!(s.lent, 8 * M);
    assert_eq!(read_all(lent[0].fd.as_fd(), 4 * M), pattern(5, 4 * M));
    // The process reconnects and says it still maps them: counted once.
    assert_eq!(p.keep(2, Some(me), "a", 8 * M), 0);
    assert_eq!(p.stats().lent, 8 * M);
    // The size holds: 24 MiB more fit, not 32.
    assert!(p.take(2, "a", 28 * M).is_err());
    let more = p.take(2, "a", 24 * M).unwrap();
    assert_eq!(more.iter().map(|l| l.bytes).sum::<u64>(), 24 * M);
    assert_eq!(p.reap(|q| q != me), 8 * M);
}
