//! The background thread: scrubbing, the floor and the wanted bytes, shutdown.

use super::*;

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
