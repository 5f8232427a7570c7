//! Lending: takes and returns, the size bound, sealing, orphans and kept slices.

use super::*;

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
fn release_owner_returns_everything_it_holds() {
    let p = pool(32 * M, 0, 4 * M);
    let a1 = p.take(1, "a", 6 * M).unwrap();
    let a2 = p.take(1, "a", 2 * M).unwrap();
    let b = p.take(2, "b", 4 * M).unwrap();
    assert_eq!(p.release_owner(1, None), 8 * M);
    assert_eq!(p.release_owner(1, None), 0);
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
                p.release_owner(owner, None);
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
fn slices_an_earlier_arbiter_lent_count_until_their_owner_lets_go() {
    let p = pool(64 * M, 32 * M, 8 * M);
    assert_eq!(settled(&p).ready, 32 * M);
    // A client kept 48 MiB of a dead arbiter's slices: counted, ready given up for it.
    assert_eq!(p.keep(7, None, "team/nb", 48 * M), 48 * M);
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
    assert_eq!(p.keep(7, None, "team/nb", 100 * M), 48 * M);
    // It lets go (a smaller figure, then its connection ends): the room comes back.
    assert_eq!(p.keep(7, None, "team/nb", 8 * M), 8 * M);
    assert_eq!(p.stats().lent, 16 * M + 8 * M);
    p.release_owner(7, None);
    p.give(1, &ids(&lent));
    let s = settled(&p);
    assert_eq!(s.lent, 0);
    assert!(s.tenants.is_empty(), "{s:?}");
}
