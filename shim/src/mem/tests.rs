use super::fake::*;
use super::*;

fn pattern(seed: u64, n: usize) -> Vec<u8> {
    (0..n)
        .map(|i| ((i as u64).wrapping_mul(31).wrapping_add(seed) % 251) as u8)
        .collect()
}

/// Both kinds of driver: copies at once, and copies queued until waited for.
fn drivers(physical_limit: u64) -> [FakeDriver; 2] {
    [
        FakeDriver::new(physical_limit),
        FakeDriver::asynchronous(physical_limit),
    ]
}

#[test]
fn swap_keeps_addresses_and_bytes() {
    for d in drivers(1 << 30) {
        let mut m = Memory::new(d).unwrap();
        let big = m.alloc(150 << 20).unwrap();
        let small = m.alloc(4096).unwrap();
        let data = pattern(7, 150 << 20);
        m.driver().poke(big, &data).unwrap();
        m.driver().poke(small, &pattern(9, 4096)).unwrap();
        assert!(m.all_resident());
        assert_eq!(m.figures().working_set, (150 << 20) + GRAN);

        let out = m.evict(u64::MAX).unwrap();
        assert_eq!(out.bytes, (150 << 20) + GRAN);
        assert_eq!(m.figures().resident, 0);
        assert_eq!(m.driver().st.borrow().physical_used, 0);
        // Touching swapped-out memory is an illegal address, as on the GPU.
        assert_eq!(m.driver().peek(big, 1), Err(700));

        let back = m.swap_in_all().unwrap();
        assert_eq!(back.bytes, (150 << 20) + GRAN);
        assert!(m.all_resident());
        assert_eq!(m.driver().peek(big, data.len()).unwrap(), data);
        assert_eq!(m.driver().peek(small, 4096).unwrap(), pattern(9, 4096));
    }
}

/// A discard at the current token: the swap-out copies only the live bytes, a
/// wholly dead segment needs no copy and no host buffer, the live bytes come back
/// intact; at another token (a submission since) every byte is copied.
#[test]
fn discarded_bytes_are_not_copied_while_the_token_holds() {
    for d in drivers(1 << 30) {
        let mut m = Memory::new(d).unwrap();
        // 150 MiB: segments of 64, 64 and 22 MiB.
        let big = m.alloc(150 << 20).unwrap();
        let data = pattern(3, 150 << 20);
        m.driver().poke(big, &data).unwrap();
        // Live: the first 10 MiB; dead: the rest (one whole segment and a half).
        assert_eq!(
            m.discard(big + (10 << 20), 140 << 20, Some(5)),
            Ok(140 << 20)
        );
        let out = m.evict_live(u64::MAX, Some(5)).unwrap();
        assert_eq!(out.bytes, 10 << 20, "only the live bytes were copied");
        assert_eq!(
            m.host_buffer_bytes(),
            64 << 20,
            "one buffer: the live segment's"
        );
        assert_eq!(m.driver().st.borrow().physical_used, 0);
        let back = m.swap_in_all().unwrap();
        assert_eq!(back.bytes, 10 << 20);
        assert_eq!(
            m.driver().peek(big, 10 << 20).unwrap(),
            data[..10 << 20].to_vec()
        );

        // Another token: the marks are stale, everything is copied and kept.
        m.driver().poke(big, &data).unwrap();
        assert_eq!(m.discard(big, 150 << 20, Some(6)), Ok(150 << 20));
        let out = m.evict_live(u64::MAX, Some(7)).unwrap();
        assert_eq!(out.bytes, 150 << 20);
        m.swap_in_all().unwrap();
        assert_eq!(m.driver().peek(big, data.len()).unwrap(), data);
        // Without a token (a caller that cannot tell) too.
        assert_eq!(m.discard(big, 150 << 20, Some(8)), Ok(150 << 20));
        assert_eq!(m.evict(u64::MAX).unwrap().bytes, 150 << 20);
        m.swap_in_all().unwrap();
        assert_eq!(m.driver().peek(big, data.len()).unwrap(), data);
    }
}

/// A partial eviction takes the wholly dead segments first: they free GPU memory
/// without a copy.
#[test]
fn partial_eviction_takes_dead_segments_first() {
    for d in drivers(1 << 30) {
        let mut m = Memory::new(d).unwrap();
        let old = m.alloc(64 << 20).unwrap();
        m.epoch += 5;
        let newer = m.alloc(64 << 20).unwrap();
        m.driver().poke(old, &[9; 64]).unwrap();
        m.discard(newer, 64 << 20, Some(1)).unwrap();
        let out = m.evict_live(10 << 20, Some(1)).unwrap();
        assert_eq!(out.bytes, 0, "the dead segment went, uncopied");
        assert_eq!(m.driver().peek(newer, 1), Err(700));
        assert_eq!(m.driver().peek(old, 64).unwrap(), vec![9; 64]);
        assert_eq!(m.figures().resident, 64 << 20);
    }
}

/// Small allocations share a chunk: discarding one leaves its neighbours' bytes
/// copied. Bad ranges are refused and mark nothing.
#[test]
fn discards_inside_a_chunk_and_bad_ranges() {
    for d in drivers(1 << 30) {
        let mut m = Memory::new(d).unwrap();
        let a = m.alloc(4096).unwrap();
        let b = m.alloc(4096).unwrap();
        m.driver().poke(a, &pattern(1, 4096)).unwrap();
        m.driver().poke(b, &pattern(2, 4096)).unwrap();
        let inval = Err(CUDA_ERROR_INVALID_VALUE);
        assert_eq!(m.discard(a, 4097, Some(1)), inval, "past the allocation");
        assert_eq!(m.discard(a, 0, Some(1)), inval);
        assert_eq!(m.discard(u64::MAX - 1, 10, Some(1)), inval, "overflow");
        assert_eq!(m.discard(12345, 10, Some(1)), inval, "not the shim's");
        assert_eq!(m.discard(a, 4096, None), Ok(0), "checked, not marked");
        assert_eq!(m.discard(a, 4096, Some(1)), Ok(4096));
        let out = m.evict_live(u64::MAX, Some(1)).unwrap();
        assert_eq!(out.bytes, GRAN - 4096);
        m.swap_in_all().unwrap();
        assert_eq!(m.driver().peek(b, 4096).unwrap(), pattern(2, 4096));
    }
}

#[test]
fn host_buffers_are_allocated_once_and_reused() {
    for d in drivers(1 << 30) {
        let mut m = Memory::new(d).unwrap();
        let p = m.alloc(100 << 20).unwrap();
        for round in 0..50u64 {
            m.driver()
                .poke(p + round * 4096, &[round as u8; 16])
                .unwrap();
            m.evict(u64::MAX).unwrap();
            m.swap_in_all().unwrap();
            assert_eq!(
                m.driver().peek(p + round * 4096, 16).unwrap(),
                vec![round as u8; 16]
            );
        }
        // 100 MiB = two segments (64 + 36 MiB): two pinned buffers, ever.
        assert_eq!(m.driver().st.borrow().host_allocs, 2);
        assert_eq!(m.host_buffer_bytes(), 100 << 20);
    }
}

#[test]
fn partial_eviction_is_lru_first() {
    for d in drivers(1 << 30) {
        let mut m = Memory::new(d).unwrap();
        let old = m.alloc(64 << 20).unwrap();
        m.evict(u64::MAX).unwrap();
        m.swap_in_all().unwrap(); // `old` touched at epoch 2
        let _ = old;
        m.epoch += 5;
        let newer = m.alloc(64 << 20).unwrap(); // touched later
        let out = m.evict(10 << 20).unwrap();
        assert_eq!(out.bytes, 64 << 20, "one segment is enough");
        assert_eq!(m.driver().peek(old, 1), Err(700), "the older one went");
        assert!(m.driver().peek(newer, 1).is_ok());
    }
}

/// Partial evictions that take turns over the segments (LRU) reuse the buffers the
/// others left: pinned memory is the most ever out at once, and no byte is lost.
#[test]
fn spare_host_buffers_serve_other_segments() {
    for d in drivers(1 << 30) {
        let mut m = Memory::new(d).unwrap();
        // Four segments: 3 × 64 MiB and a 14 MiB tail, then a small chunk.
        let big = m.alloc(206 << 20).unwrap();
        let small = m.alloc(4096).unwrap();
        let mut data = pattern(3, 206 << 20);
        m.driver().poke(big, &data).unwrap();
        m.driver().poke(small, &pattern(4, 4096)).unwrap();
        let mut most_out = 0;
        for round in 0..12u64 {
            // Half of it, least recently used first: a different half each time.
            let out = m.evict(100 << 20).unwrap();
            assert!(out.bytes >= 100 << 20);
            most_out = most_out.max(out.bytes);
            m.swap_in_all().unwrap();
            assert!(m.all_resident());
            let at = ((round * 17) << 20) as usize % data.len();
            data[at] = data[at].wrapping_add(1);
            m.driver().poke(big + at as u64, &data[at..at + 1]).unwrap();
            assert!(m.host_buffer_bytes() <= m.figures().working_set);
        }
        assert_eq!(m.driver().peek(big, data.len()).unwrap(), data);
        assert_eq!(m.driver().peek(small, 4096).unwrap(), pattern(4, 4096));
        // Segments that were never out before took the spares: what is pinned is
        // the most that was out at once, not every segment.
        let st = m.driver().st.borrow();
        assert_eq!(st.host_used, most_out);
        assert!(st.host_used < m.figures().working_set);
        // 64 + 64 + 14 + 2 MiB: one buffer per segment of the largest eviction.
        assert_eq!(st.host_allocs, 4);
        assert_eq!(st.host_used, m.host_buffer_bytes());
    }
}

#[test]
fn freeing_allocations_trims_spare_host_buffers() {
    for d in drivers(1 << 30) {
        let mut m = Memory::new(d).unwrap();
        let a = m.alloc(128 << 20).unwrap();
        let b = m.alloc(64 << 20).unwrap();
        m.evict(u64::MAX).unwrap();
        assert_eq!(m.host_buffer_bytes(), 192 << 20);
        m.swap_in_all().unwrap();
        m.free(a).unwrap();
        // 64 MiB of working set left: no more than that stays pinned.
        assert_eq!(m.host_buffer_bytes(), 64 << 20);
        // Freeing a swapped-out allocation returns its buffer too.
        m.evict(u64::MAX).unwrap();
        m.free(b).unwrap();
        assert_eq!(m.host_buffer_bytes(), 0);
        assert_eq!(m.driver().st.borrow().host_used, 0);
        assert!(m.driver().st.borrow().host.is_empty());
    }
}

/// With a copy engine, the next buffer is allocated (swap-out) and the next
/// segment mapped (swap-in) while a copy is in flight.
#[test]
fn swaps_overlap_allocation_with_copies() {
    let mut m = Memory::new(FakeDriver::asynchronous(1 << 30)).unwrap();
    let p = m.alloc(256 << 20).unwrap(); // four segments
    let data = pattern(5, 256 << 20);
    m.driver().poke(p, &data).unwrap();
    m.evict(u64::MAX).unwrap();
    // Buffers 2..4 were allocated during the copies of 1..3.
    assert_eq!(m.driver().st.borrow().overlapped, 3);
    m.swap_in_all().unwrap();
    // Segments 2..4 were created during the copies of 1..3.
    assert_eq!(m.driver().st.borrow().overlapped, 6);
    assert_eq!(m.driver().peek(p, data.len()).unwrap(), data);
}

/// Failures in the middle of a pipelined swap leave every segment either resident
/// or out with its contents; the next call goes on and no byte is lost.
#[test]
fn swap_failures_midway_lose_nothing() {
    for d in drivers(1 << 30) {
        let mut m = Memory::new(d).unwrap();
        let p = m.alloc(256 << 20).unwrap();
        let data = pattern(11, 256 << 20);
        m.driver().poke(p, &data).unwrap();

        // No pinned memory for the third buffer.
        m.driver().st.borrow_mut().host_limit = 128 << 20;
        assert_eq!(m.evict(u64::MAX), Err(CUDA_ERROR_OUT_OF_MEMORY));
        assert_eq!(m.figures().resident, 128 << 20);
        m.driver().st.borrow_mut().host_limit = u64::MAX;
        assert_eq!(m.evict(u64::MAX).unwrap().bytes, 128 << 20);
        assert_eq!(m.figures().resident, 0);

        // The second copy-in fails.
        let copies = m.driver().st.borrow().copies;
        m.driver().st.borrow_mut().fail_copy = Some(copies + 2);
        assert!(m.swap_in_all().is_err());
        assert_eq!(m.figures().resident, 64 << 20);
        m.driver().st.borrow_mut().fail_copy = None;
        // No room for the last segment.
        m.driver().st.borrow_mut().physical_limit = 192 << 20;
        assert_eq!(m.swap_in_all(), Err(CUDA_ERROR_OUT_OF_MEMORY));
        assert_eq!(m.figures().resident, 192 << 20);
        m.driver().st.borrow_mut().physical_limit = 1 << 30;
        assert_eq!(m.swap_in_all().unwrap().bytes, 64 << 20);
        assert!(m.all_resident());
        assert_eq!(m.driver().peek(p, data.len()).unwrap(), data);

        // A copy-out that fails leaves its segment resident.
        let copies = m.driver().st.borrow().copies;
        m.driver().st.borrow_mut().fail_copy = Some(copies + 3);
        assert!(m.evict(u64::MAX).is_err());
        assert_eq!(m.figures().resident, 128 << 20);
        m.driver().st.borrow_mut().fail_copy = None;
        m.evict(u64::MAX).unwrap();
        m.swap_in_all().unwrap();
        assert_eq!(m.driver().peek(p, data.len()).unwrap(), data);
        assert!(m.host_buffer_bytes() <= 256 << 20);
    }
}

#[test]
fn prepared_buffers_make_the_swap_out_allocate_nothing() {
    for d in drivers(1 << 30) {
        let mut m = Memory::new(d).unwrap();
        let p = m.alloc(206 << 20).unwrap(); // 64 + 64 + 64 + 14 MiB
        let data = pattern(13, 206 << 20);
        m.driver().poke(p, &data).unwrap();
        // A little at a time: one 64 MiB buffer fits a 100 MiB budget, then the
        // second, then nothing is left (two segments cover 100 MiB).
        assert_eq!(m.prepare_swap_out(100 << 20, 100 << 20).unwrap(), 64 << 20);
        assert_eq!(m.prepare_swap_out(100 << 20, 100 << 20).unwrap(), 64 << 20);
        assert_eq!(m.prepare_swap_out(100 << 20, 100 << 20).unwrap(), 0);
        // A budget below one buffer still makes progress: one buffer per call.
        assert_eq!(m.prepare_swap_out(150 << 20, 10 << 20).unwrap(), 64 << 20);
        assert_eq!(m.prepare_swap_out(150 << 20, 64 << 20).unwrap(), 0);
        let allocs = m.driver().st.borrow().host_allocs;
        assert_eq!(m.evict(150 << 20).unwrap().bytes, 192 << 20);
        assert_eq!(m.driver().st.borrow().host_allocs, allocs, "all prepared");
        // Everything: only the 14 MiB tail is missing.
        m.swap_in_all().unwrap();
        assert_eq!(m.prepare_swap_out(u64::MAX, u64::MAX).unwrap(), 14 << 20);
        m.evict(u64::MAX).unwrap();
        assert_eq!(m.driver().st.borrow().host_allocs, allocs + 1);
        m.swap_in_all().unwrap();
        assert_eq!(m.driver().peek(p, data.len()).unwrap(), data);
        assert_eq!(m.host_buffer_bytes(), 206 << 20);
    }
}

/// Buffers pinned outside the allocator's lock and handed over as spares serve
/// the next swap-out; the spares go back when no swap is due.
#[test]
fn buffers_pinned_elsewhere_serve_the_swap_out_and_spares_are_released() {
    for d in drivers(1 << 30) {
        let mut m = Memory::new(d).unwrap();
        let p = m.alloc(150 << 20).unwrap(); // 64 + 64 + 22 MiB
        let data = pattern(17, 150 << 20);
        m.driver().poke(p, &data).unwrap();
        let missing = m.swap_out_shortfall(u64::MAX);
        assert_eq!(missing, vec![64 << 20, 64 << 20, 22 << 20]);
        for size in missing {
            let ptr = m.driver().host_alloc(size).unwrap();
            // SAFETY: a fresh buffer of `size` bytes from this allocator's driver.
            unsafe { m.add_spare(ptr, size) };
        }
        assert!(m.swap_out_shortfall(u64::MAX).is_empty());
        let allocs = m.driver().st.borrow().host_allocs;
        assert_eq!(m.evict(u64::MAX).unwrap().bytes, 150 << 20);
        assert_eq!(
            m.driver().st.borrow().host_allocs,
            allocs,
            "all handed over"
        );
        m.swap_in_all().unwrap();
        assert_eq!(m.driver().peek(p, data.len()).unwrap(), data);
        assert_eq!(m.release_spares(), 150 << 20);
        assert_eq!(m.host_buffer_bytes(), 0);
        assert!(m.driver().st.borrow().host.is_empty());
        // A spare past the working set is trimmed at once.
        let ptr = m.driver().host_alloc(512 << 20).unwrap();
        // SAFETY: as above.
        unsafe { m.add_spare(ptr, 512 << 20) };
        assert_eq!(m.host_buffer_bytes(), 0);
    }
}

/// A swap-in waiting for room goes on as soon as there is some, and one that is
/// not waiting stops at the first segment without room, as before.
#[test]
fn swap_in_until_waits_for_room_only_when_asked() {
    let mut m = Memory::new(FakeDriver::new(1 << 30)).unwrap();
    let p = m.alloc(128 << 20).unwrap();
    let data = pattern(19, 128 << 20);
    m.driver().poke(p, &data).unwrap();
    m.evict(u64::MAX).unwrap();
    m.driver().st.borrow_mut().physical_limit = 64 << 20;
    let t = Instant::now();
    let deadline = Some(t + Duration::from_millis(30));
    assert_eq!(m.swap_in_until(deadline), Err(CUDA_ERROR_OUT_OF_MEMORY));
    assert!(t.elapsed() >= Duration::from_millis(30), "it waited");
    assert_eq!(m.figures().resident, 64 << 20);
    m.driver().st.borrow_mut().physical_limit = 1 << 30;
    assert_eq!(m.swap_in_until(None).unwrap().bytes, 64 << 20);
    assert_eq!(m.driver().peek(p, data.len()).unwrap(), data);
}

/// Room that never comes stops the wait after ROOM_STALL, not at the deadline.
#[test]
fn a_swap_in_waiting_for_room_that_never_comes_stops_after_the_stall() {
    let mut m = Memory::new(FakeDriver::new(1 << 30)).unwrap();
    m.alloc(128 << 20).unwrap();
    m.evict(u64::MAX).unwrap();
    m.driver().st.borrow_mut().physical_limit = 64 << 20;
    let t = Instant::now();
    let deadline = Some(t + Duration::from_secs(5));
    assert_eq!(m.swap_in_until(deadline), Err(CUDA_ERROR_OUT_OF_MEMORY));
    let took = t.elapsed();
    assert!(
        took >= ROOM_STALL && took < ROOM_STALL * 5,
        "waited {took:?} with no room coming (stall {ROOM_STALL:?}, deadline 5 s)"
    );
    assert_eq!(m.figures().resident, 64 << 20, "what fitted came in");
}

#[test]
fn growth_is_what_the_working_set_gains() {
    let mut m = Memory::new(FakeDriver::new(1 << 30)).unwrap();
    assert_eq!(m.growth(4096), GRAN, "no chunk yet");
    m.alloc(4096).unwrap();
    assert_eq!(m.growth(4096), 0, "room in the chunk");
    assert_eq!(m.growth(GRAN + 1), 2 * GRAN);
    let before = m.figures().working_set;
    m.alloc(GRAN + 1).unwrap();
    assert_eq!(m.figures().working_set - before, 2 * GRAN);
    assert_eq!(m.growth(0), 0);
}

#[test]
fn small_allocations_share_chunks() {
    let mut m = Memory::new(FakeDriver::new(1 << 30)).unwrap();
    let ptrs: Vec<u64> = (0..10_000).map(|_| m.alloc(4096).unwrap()).collect();
    // 10,000 × 4 KiB = 40,000 KiB = 19.5 chunks of 2 MiB.
    assert_eq!(m.handles(), 20);
    let mut sorted = ptrs.clone();
    sorted.sort_unstable();
    sorted.dedup();
    assert_eq!(sorted.len(), ptrs.len(), "no address handed out twice");
    assert!(ptrs.iter().all(|p| p % SMALL_ALIGN == 0));
    assert_eq!(m.range_of(ptrs[5] + 100), Some((ptrs[5], 4096)));
    for p in &ptrs {
        m.free(*p).unwrap();
    }
    assert_eq!(m.handles(), 0);
    assert_eq!(m.figures(), Figures::default());
    assert!(m.driver().st.borrow().reserved.is_empty(), "VA returned");
}

#[test]
fn unbacked_allocation_gets_memory_at_next_swap_in() {
    let mut m = Memory::new(FakeDriver::new(1 << 30)).unwrap();
    m.set_backing_allowed(false);
    let p = m.alloc(8 << 20).unwrap();
    assert!(!m.all_resident());
    assert_eq!(m.driver().peek(p, 1), Err(700));
    m.set_backing_allowed(true);
    m.swap_in_all().unwrap();
    assert!(m.all_resident());
    m.driver().poke(p, b"hello").unwrap();
    assert_eq!(m.range_of(p), Some((p, 8 << 20)));
}

#[test]
fn limit_and_physical_oom() {
    let mut m = Memory::new(FakeDriver::new(64 << 20)).unwrap();
    m.set_limit(100 << 20);
    assert_eq!(m.alloc(128 << 20), Err(CUDA_ERROR_OUT_OF_MEMORY));
    // Within the limit but more than physically free: the error is out-of-memory and
    // nothing leaks.
    assert_eq!(m.alloc(80 << 20), Err(CUDA_ERROR_OUT_OF_MEMORY));
    assert_eq!(m.figures(), Figures::default());
    assert!(m.driver().st.borrow().reserved.is_empty());
    assert_eq!(m.alloc(0), Err(CUDA_ERROR_INVALID_VALUE));
    assert_eq!(m.free(12345), Err(CUDA_ERROR_INVALID_VALUE));
}

/// The application's `cuMemSetAccess` and peer access survive swaps: every new
/// mapping gets them again (a mapping starts with the owning device's only).
#[test]
fn other_devices_access_is_reapplied_after_every_swap_in() {
    for d in drivers(1 << 30) {
        let mut m = Memory::new(d).unwrap();
        let big = m.alloc(150 << 20).unwrap(); // segments of 64, 64, 22 MiB
        let small = m.alloc(4096).unwrap();
        // A range in the first segment only; the small one's whole chunk.
        assert_eq!(
            m.set_access(big + (10 << 20), 1 << 20, &[(1, 3)]),
            Some(Ok(()))
        );
        assert_eq!(m.set_access(small, 4096, &[(2, 1)]), Some(Ok(())));
        assert_eq!(
            m.set_access(small, 8192, &[(2, 1)]),
            Some(Err(1)),
            "past the end"
        );
        assert_eq!(m.set_access(0x1000, 16, &[(1, 3)]), None, "not ours");
        m.set_peer(3, 3).unwrap();
        let expect = |m: &Memory<FakeDriver>| {
            let st = m.driver().st.borrow();
            assert_eq!(st.access[&big], vec![(1, 3), (3, 3)]);
            assert_eq!(st.access[&(big + (64 << 20))], vec![(3, 3)]);
            assert_eq!(st.access[&(big + (128 << 20))], vec![(3, 3)]);
            assert_eq!(st.access[&small], vec![(2, 1), (3, 3)]);
        };
        expect(&m);
        for _ in 0..3 {
            m.evict(u64::MAX).unwrap();
            assert!(m.driver().st.borrow().access.is_empty());
            m.swap_in_all().unwrap();
            // Grants in the order the allocator keeps them: peers first.
            let st = m.driver().st.borrow();
            assert_eq!(st.access[&big], vec![(3, 3), (1, 3)]);
            assert_eq!(st.access[&small], vec![(3, 3), (2, 1)]);
            assert_eq!(st.access[&(big + (64 << 20))], vec![(3, 3)]);
        }
        // Peer access disabled: gone from every mapping, now and after a swap.
        m.set_peer(3, 0).unwrap();
        assert_eq!(
            m.driver().st.borrow().access[&(big + (64 << 20))],
            vec![(3, 0)]
        );
        m.evict(u64::MAX).unwrap();
        m.swap_in_all().unwrap();
        let st = m.driver().st.borrow();
        assert!(!st.access.contains_key(&(big + (64 << 20))));
        assert_eq!(st.access[&big], vec![(1, 3)]);
    }
}

/// A small free waits for the context's work like any other (`cuMemFree` does):
/// its range is handed out again at once, under a kernel that may still write it.
/// Swapped out, nothing can be running on it. A failed wait frees nothing.
#[test]
fn small_frees_wait_for_the_work_that_may_use_them() {
    let mut m = Memory::new(FakeDriver::new(1 << 30)).unwrap();
    let keep = m.alloc(4096).unwrap();
    let x = m.alloc(4096).unwrap();
    let syncs = m.driver().st.borrow().syncs;
    m.free(x).unwrap();
    assert_eq!(m.driver().st.borrow().syncs, syncs + 1, "the free waited");
    assert_eq!(m.alloc(4096).unwrap(), x, "the range is reused at once");
    m.evict(u64::MAX).unwrap();
    let syncs = m.driver().st.borrow().syncs;
    m.free(x).unwrap();
    assert_eq!(
        m.driver().st.borrow().syncs,
        syncs,
        "nothing resident to wait for"
    );
    m.free(keep).unwrap();
    assert_eq!(m.figures(), Figures::default());
}

#[test]
fn external_vmm_is_counted_not_swapped() {
    let mut m = Memory::new(FakeDriver::new(1 << 30)).unwrap();
    m.external_created(42, 4 << 20);
    m.external_created(42, 4 << 20);
    assert_eq!(m.figures().working_set, 4 << 20);
    assert_eq!(m.evict(u64::MAX).unwrap().bytes, 0);
    m.external_released(42);
    assert_eq!(m.figures().working_set, 0);
}

/// A shared (IPC) allocation is never evicted while pinned, counts as memory no
/// swap frees, and is swappable again once its last pin goes; a free ends the
/// share, and an old share's unpin then touches nothing.
#[test]
fn shared_allocations_stay_resident_while_pinned() {
    let mut m = Memory::new(FakeDriver::new(1 << 30)).unwrap();
    let shared = m.alloc(100 << 20).unwrap();
    let private = m.alloc(64 << 20).unwrap();
    m.driver().poke(shared, &pattern(1, 4096)).unwrap();
    assert_eq!(
        m.pin_shared(shared, 7, false),
        Err(PinError::Stale),
        "not shared yet"
    );
    m.pin_shared(shared, 7, true).unwrap();
    m.pin_shared(shared, 7, false).unwrap();
    assert_eq!(
        m.pin_shared(shared, 8, true),
        Err(PinError::Stale),
        "another share"
    );
    let layout = m.shared_layout(shared, 7).unwrap();
    assert_eq!(
        (layout.base, layout.size, layout.offset),
        (shared, 100 << 20, 0)
    );
    assert_eq!(layout.segments.len(), 2, "64 + 36 MiB segments");
    assert_eq!(m.figures().external, 100 << 20);
    // Everything that may go goes; the shared memory stays, at the same handles.
    assert_eq!(m.evict(u64::MAX).unwrap().bytes, 64 << 20);
    assert_eq!(m.shared_layout(shared, 7), Some(layout.clone()));
    assert_eq!(m.driver().peek(shared, 4096).unwrap(), pattern(1, 4096));
    m.swap_in_all().unwrap();
    m.unpin_shared(shared, 7);
    assert_eq!(
        m.evict(u64::MAX).unwrap().bytes,
        64 << 20,
        "one pin left: the private memory only"
    );
    m.unpin_shared(shared, 7);
    assert_eq!(m.figures().external, 0);
    assert_eq!(m.shared_layout(shared, 7), None);
    assert_eq!(m.evict(u64::MAX).unwrap().bytes, 100 << 20);
    // Swapped out, it cannot be pinned until it is back.
    assert_eq!(m.pin_shared(shared, 7, false), Err(PinError::NotResident));
    m.swap_in_all().unwrap();
    assert_eq!(m.driver().peek(shared, 4096).unwrap(), pattern(1, 4096));
    m.pin_shared(shared, 7, false).unwrap();
    m.free(shared).unwrap();
    assert_eq!(m.figures().external, 0, "the free ended the share");
    let again = m.alloc(100 << 20).unwrap();
    m.unpin_shared(again, 7);
    assert_eq!(m.pin_shared(again, 7, false), Err(PinError::Stale));
    m.free(again).unwrap();
    m.free(private).unwrap();
}

/// Issue #28, item 1: a swap-out that finds no pinned buffer ready copies into
/// pageable memory instead of page-locking on the critical path; the pinning thread
/// registers those buffers in place afterwards (here by hand), so the swap-in copies
/// from pinned memory and the buffers become spares; every byte comes back.
#[test]
fn a_swap_out_without_buffers_ready_goes_into_pageable_memory_registered_later() {
    for asynchronous in [false, true] {
        let mut m = Memory::new(FakeDriver::with_pageable(1 << 30, asynchronous)).unwrap();
        let big = m.alloc(150 << 20).unwrap();
        let data = pattern(11, 150 << 20);
        m.driver().poke(big, &data).unwrap();
        let out = m.evict(u64::MAX).unwrap();
        assert_eq!(out.bytes, 150 << 20);
        {
            let st = m.driver().st.borrow();
            assert_eq!(st.host_allocs, 0, "nothing page-locked while someone waits");
            assert_eq!(st.pageable_allocs, 3, "one pageable buffer per segment");
        }
        assert_eq!(m.pageable_bytes(), 150 << 20);
        // The pinning thread's work: one buffer at a time, outside the lock.
        let mut n = 0;
        while let Some((p, cap)) = m.register_next() {
            m.driver().host_register(p, cap).unwrap();
            m.finish_register(p, true);
            n += 1;
        }
        assert_eq!(n, 3);
        assert_eq!(m.pageable_bytes(), 0);
        let back = m.swap_in_all().unwrap();
        assert_eq!(back.bytes, 150 << 20);
        assert_eq!(m.driver().peek(big, data.len()).unwrap(), data);
        // The registered buffers are spares now: the next swap-out uses them.
        m.evict(u64::MAX).unwrap();
        let st = m.driver().st.borrow();
        assert_eq!(
            (st.host_allocs, st.pageable_allocs),
            (0, 3),
            "spares reused"
        );
    }
}

/// A segment swapped in while the pinning thread registers its buffer lets the buffer
/// go only when the registration ends: a pinned one becomes a spare, one that failed
/// to register is freed as pageable memory. Swapped in before any registration, a
/// pageable buffer is freed at once (spares are pinned).
#[test]
fn a_buffer_being_registered_outlives_its_segments_swap_in() {
    for ok in [true, false] {
        let mut m = Memory::new(FakeDriver::with_pageable(1 << 30, true)).unwrap();
        let a = m.alloc(64 << 20).unwrap();
        let data = pattern(5, 64 << 20);
        m.driver().poke(a, &data).unwrap();
        m.evict(u64::MAX).unwrap();
        let (p, cap) = m.register_next().unwrap();
        // Swapped in meanwhile: its contents come from the (pageable) buffer.
        m.swap_in_all().unwrap();
        assert_eq!(m.driver().peek(a, data.len()).unwrap(), data);
        assert_eq!(
            m.host_buffer_bytes(),
            64 << 20,
            "not freed under registration"
        );
        if ok {
            m.driver().host_register(p, cap).unwrap();
        }
        m.finish_register(p, ok);
        let st = m.driver().st.borrow();
        if ok {
            assert_eq!(st.host.len(), 1, "kept as a spare");
        } else {
            assert!(st.host.is_empty(), "freed");
        }
    }
    // No registration at all: freed at the swap-in.
    let mut m = Memory::new(FakeDriver::with_pageable(1 << 30, false)).unwrap();
    let a = m.alloc(64 << 20).unwrap();
    m.driver().poke(a, &pattern(1, 64 << 20)).unwrap();
    m.evict(u64::MAX).unwrap();
    m.swap_in_all().unwrap();
    assert!(m.driver().st.borrow().host.is_empty());
    assert_eq!(m.host_buffer_bytes(), 0);
}

#[test]
fn spilled_segments_come_back_from_the_disk_tier_byte_for_byte() {
    for d in drivers(1 << 30) {
        d.st.borrow_mut().spill = true;
        let mut m = Memory::new(d).unwrap();
        let big = m.alloc(150 << 20).unwrap();
        let small = m.alloc(4096).unwrap();
        let data = pattern(3, 150 << 20);
        m.driver().poke(big, &data).unwrap();
        m.driver().poke(small, &pattern(5, 4096)).unwrap();
        // Dead bytes are not copied; what is left is spilled and comes back.
        m.discard(big + (100 << 20), 10 << 20, None).unwrap();
        // Resident: nothing to spill (no spares yet, nothing swapped out).
        assert_eq!(m.spill_one(), 0);
        m.evict(u64::MAX).unwrap();
        let host = m.host_buffer_bytes();
        assert!(host > 0);
        let mut spilled = 0;
        loop {
            let n = m.spill_one();
            if n == 0 {
                break;
            }
            spilled += n;
        }
        assert_eq!(spilled, host, "every swapped-out buffer moves to disk");
        assert_eq!(m.host_buffer_bytes(), 0);
        assert_eq!(m.driver().st.borrow().host_used, 0);
        assert_eq!(m.spilled_segments(), 4, "three large segments and a chunk");
        m.swap_in_all().unwrap();
        assert!(m.all_resident());
        assert_eq!(m.spilled_segments(), 0);
        assert!(
            m.driver().st.borrow().disk.is_empty(),
            "read back and forgotten"
        );
        let back = m.driver().peek(big, data.len()).unwrap();
        assert_eq!(&back[..100 << 20], &data[..100 << 20]);
        assert_eq!(&back[110 << 20..], &data[110 << 20..]);
        assert_eq!(m.driver().peek(small, 4096).unwrap(), pattern(5, 4096));
        // After a swap-in the buffers are spares: a reclaim gives them back first.
        m.evict(u64::MAX).unwrap();
        m.swap_in_all().unwrap();
        let spares = m.host_buffer_bytes();
        assert!(spares > 0);
        assert_eq!(m.spill_one(), spares);
        // A segment freed while on disk forgets its spill.
        m.evict(u64::MAX).unwrap();
        while m.spill_one() > 0 {}
        assert!(!m.driver().st.borrow().disk.is_empty());
        m.free(big).unwrap();
        m.free(small).unwrap();
        assert!(m.driver().st.borrow().disk.is_empty());
    }
}

#[test]
fn without_a_disk_tier_nothing_is_spilled() {
    let mut m = Memory::new(FakeDriver::new(1 << 30)).unwrap();
    let p = m.alloc(64 << 20).unwrap();
    m.driver().poke(p, &pattern(1, 64 << 20)).unwrap();
    m.evict(u64::MAX).unwrap();
    assert_eq!(m.spill_one(), 0);
    m.swap_in_all().unwrap();
    assert_eq!(m.driver().peek(p, 64 << 20).unwrap(), pattern(1, 64 << 20));
}

#[test]
fn the_process_s_own_buffers_are_never_spilled_and_do_not_stop_the_others() {
    let d = FakeDriver::new(1 << 30);
    d.st.borrow_mut().spill = true;
    let mut m = Memory::new(d).unwrap();
    let p = m.alloc(192 << 20).unwrap();
    m.driver().poke(p, &pattern(4, 192 << 20)).unwrap();
    m.evict(u64::MAX).unwrap();
    // Every buffer but the last allocated one is the pool's; the oldest segment's
    // (least recently used, tried first) is the process's own memory.
    let own = *m.driver().st.borrow().host.keys().next().unwrap();
    m.driver().st.borrow_mut().own.insert(own);
    let own_len = m.driver().st.borrow().host[&own] as u64;
    let mut spilled = 0;
    loop {
        let n = m.spill_one();
        if n == 0 {
            break;
        }
        spilled += n;
    }
    assert_eq!(spilled, (192 << 20) - own_len);
    assert_eq!(m.host_buffer_bytes(), own_len, "the own buffer stays");
    m.swap_in_all().unwrap();
    assert_eq!(
        m.driver().peek(p, 192 << 20).unwrap(),
        pattern(4, 192 << 20)
    );
}
