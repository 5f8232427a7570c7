//! The swap engine of [`Memory`]: swap-ins (pipelined with creating the next
//! segment's memory, waiting for room when asked), evictions (least recently used
//! first, dead bytes left behind, pipelined with allocating the next pinned buffer)
//! and the pinned buffers prepared ahead of them.

use super::*;

impl<D: Driver> Memory<D> {
    /// Brings every segment back into GPU memory at its own address. While one
    /// segment's contents are copied in, the next one's physical memory is created and
    /// mapped. On error the segments done so far stay resident and the rest stay out,
    /// consistent (a later call goes on with the rest).
    pub fn swap_in_all(&mut self) -> Result<Swap, CUresult> {
        self.swap_in_until(None)
    }

    /// [`Memory::swap_in_all`] for a swap-in that runs while another process frees
    /// the memory it needs, segment by segment (a pipelined hand-off): a segment whose
    /// physical memory cannot be created yet (out of memory) is tried again after a
    /// short pause (0.5 ms, doubling to 2 ms) until `deadline`, or until no room came
    /// for [`ROOM_STALL`]; then the error is returned as by `swap_in_all`. `None`: one
    /// try.
    pub fn swap_in_until(&mut self, deadline: Option<Instant>) -> Result<Swap, CUresult> {
        let start = Instant::now();
        let resident_before = self.resident;
        self.epoch += 1;
        let todo: Vec<usize> = (0..self.segs.len())
            .filter(|&i| self.segs[i].as_ref().is_some_and(|s| s.handle.is_none()))
            .collect();
        let mut bytes = 0;
        for (k, &i) in todo.iter().enumerate() {
            // Each segment that found room restarts the stall window.
            let deadline = deadline.map(|d| d.min(Instant::now() + ROOM_STALL));
            // Mapped during the previous copy, unless there was no room yet.
            self.map_fresh_until(i, deadline)?;
            let next = todo.get(k + 1).copied();
            let (va, host, spilled, pieces) = {
                let s = self.seg(i);
                let pieces = s.pieces.clone().unwrap_or_else(|| vec![(0, s.size)]);
                (s.va, s.host.as_ref().map(|b| b.ptr), s.spilled, pieces)
            };
            if let (None, Some(h)) = (host, spilled) {
                // From the disk tier: read back now (bound by the disk, not the copy).
                if let Err(e) = self.drv.spilled_to_device(h, va, &pieces) {
                    self.unmap_fresh(i);
                    return Err(e);
                }
                let s = self.seg(i);
                s.spilled = None;
                s.pieces = None;
                self.drv.spill_free(h);
                bytes += pieces.iter().map(|p| p.1).sum::<u64>();
            }
            if let Some(host) = host {
                for &(off, len) in &pieces {
                    // SAFETY: the segment's host buffer holds at least its size (the
                    // pieces lie inside it); it stays in the segment, untouched,
                    // until the copy is waited for below.
                    let r = unsafe {
                        self.drv
                            .to_device_async(va + off, host.add(off as usize), len)
                    };
                    if let Err(e) = r {
                        let _ = self.drv.wait_copies();
                        self.unmap_fresh(i);
                        return Err(e);
                    }
                }
            }
            // While the copy runs: the next segment's memory. Waiting for room, it is
            // tried again while the copy runs (the memory may come free meanwhile),
            // else after it.
            let mapped_next = next.map(|n| self.map_during_copy(n, deadline));
            if host.is_some() {
                if let Err(e) = self.drv.wait_copies() {
                    self.unmap_fresh(i);
                    if let (Some(n), Some(Ok(()))) = (next, &mapped_next) {
                        self.unmap_fresh(n);
                    }
                    return Err(e);
                }
                let s = self.seg(i);
                let b = s.host.take().expect("checked above");
                s.pieces = None;
                self.recycle(b);
                bytes += pieces.iter().map(|p| p.1).sum::<u64>();
            }
            match mapped_next {
                Some(Err(CUDA_ERROR_OUT_OF_MEMORY)) | Some(Ok(())) | None => {}
                Some(Err(e)) => return Err(e),
            }
        }
        Ok(Swap {
            bytes,
            duration: start.elapsed(),
            moved: self.resident - resident_before,
        })
    }

    /// [`Memory::map_fresh`] while a copy runs; waiting for room (`deadline`), tried
    /// again on out-of-memory every 0.5 ms until the copy is done (when the driver can
    /// tell), so that creating the memory overlaps the copy.
    fn map_during_copy(&mut self, i: usize, deadline: Option<Instant>) -> Result<(), CUresult> {
        loop {
            let r = self.map_fresh(i);
            let waiting = deadline.is_some_and(|d| Instant::now() < d);
            if r != Err(CUDA_ERROR_OUT_OF_MEMORY)
                || !waiting
                || self.drv.copies_done() != Some(false)
            {
                return r;
            }
            std::thread::sleep(Duration::from_micros(500));
        }
    }

    /// [`Memory::map_fresh`], tried again on out-of-memory until `deadline`.
    fn map_fresh_until(&mut self, i: usize, deadline: Option<Instant>) -> Result<(), CUresult> {
        let mut pause = Duration::from_micros(500);
        loop {
            match self.map_fresh(i) {
                Err(CUDA_ERROR_OUT_OF_MEMORY) if deadline.is_some_and(|d| Instant::now() < d) => {
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(Duration::from_millis(2));
                }
                r => return r,
            }
        }
    }

    /// Evicts at least `need` bytes (all of them for `u64::MAX`), least recently used
    /// first. The caller has drained the GPU work of this process. While one segment
    /// is copied out, the next one's pinned buffer is allocated (when no spare fits).
    /// On error the segments done so far stay out and the rest stay resident.
    pub fn evict(&mut self, need: u64) -> Result<Swap, CUresult> {
        self.evict_live(need, None)
    }

    /// [`Memory::evict`] at submission token `token`: the bytes declared dead at that
    /// token ([`Memory::discard`]) are not copied, and segments with no live byte go
    /// first (they cost no copy and no host buffer). `None`: every byte is copied.
    /// [`Swap::bytes`] counts the bytes copied.
    pub fn evict_live(&mut self, need: u64, token: Option<u64>) -> Result<Swap, CUresult> {
        let start = Instant::now();
        let resident_before = self.resident;
        let victims = self.victims(need, token);
        let pieces: Vec<Vec<(u64, u64)>> = victims
            .iter()
            .map(|&i| self.live_pieces(i, token))
            .collect();
        // Spare buffers first, largest segments first (so a large spare is not taken by
        // a small segment while a large one goes without); new ones while copying. A
        // segment with nothing live needs none.
        let mut bufs: Vec<Option<HostBuf>> = victims.iter().map(|_| None).collect();
        for k in self.largest_first(&victims) {
            if !pieces[k].is_empty() {
                bufs[k] = self.take_spare(self.size_of(victims[k]));
            }
        }
        let spared = bufs.iter().flatten().map(|b| b.cap).sum::<u64>();
        (self.pinned_now, self.pinning_time, self.pageable_now) = (0, Duration::ZERO, 0);
        let r = self.evict_planned(&victims, &pieces, &mut bufs);
        // Buffers prepared for segments that were not reached.
        for b in bufs.into_iter().flatten() {
            self.recycle(b);
        }
        self.trim_spare();
        crate::kdebug!(
            "swap-out of {} MiB in {:?}: {} MiB into buffers pinned ahead, {} MiB into pageable buffers (registered later), {} MiB pinned now in {:?}",
            r.as_ref().map_or(0, |b| b >> 20),
            start.elapsed(),
            spared >> 20,
            self.pageable_now >> 20,
            self.pinned_now >> 20,
            self.pinning_time
        );
        Ok(Swap {
            bytes: r?,
            duration: start.elapsed(),
            moved: resident_before - self.resident,
        })
    }

    /// Allocates, ahead of time, the pinned buffers that `evict(need)` would have to
    /// allocate now (what no spare covers), at most `budget` bytes of them in this
    /// call; returns the bytes allocated (0: nothing left to prepare). A client that
    /// calls it while it still holds the GPU (a little at a time, once others wait)
    /// moves the pinned allocation off the critical path of its next release.
    pub fn prepare_swap_out(&mut self, need: u64, budget: u64) -> Result<u64, CUresult> {
        let mut done = 0;
        for size in self.swap_out_shortfall(need) {
            // At least one buffer per call, however small the budget.
            if done > 0 && done + size > budget {
                break;
            }
            let b = self.new_host_buf(size)?;
            self.spare.push(b);
            done += size;
        }
        Ok(done)
    }

    /// The sizes of the pinned buffers `evict(need)` would have to allocate now (what
    /// no spare covers), largest first. [`Memory::prepare_swap_out`] allocates them
    /// under the allocator's lock; a caller that must not hold it that long (pinning
    /// runs at a few GB/s) allocates them through its own driver handle and hands
    /// them over with [`Memory::add_spare`].
    pub fn swap_out_shortfall(&self, need: u64) -> Vec<u64> {
        let victims = self.victims(need, None);
        let mut caps: Vec<u64> = self.spare.iter().map(|b| b.cap).collect();
        let mut missing = Vec::new();
        for k in self.largest_first(&victims) {
            let size = self.size_of(victims[k]);
            // The spare evict would take (see take_spare), if any.
            let fit = (0..caps.len())
                .filter(|&c| caps[c] >= size)
                .min_by_key(|&c| caps[c]);
            match fit {
                Some(c) => {
                    caps.swap_remove(c);
                }
                None => missing.push(size),
            }
        }
        missing
    }

    /// Takes a pinned buffer of `cap` bytes, allocated with this allocator's driver
    /// (`host_alloc`) outside its lock, as a spare; trimmed at once if the spares then
    /// pass the working set.
    ///
    /// # Safety
    /// `ptr` came from `host_alloc(cap)` of this allocator's driver, is not freed and
    /// is owned by nobody else from now on.
    pub unsafe fn add_spare(&mut self, ptr: *mut u8, cap: u64) {
        self.host_bytes += cap;
        self.spare.push(HostBuf::pinned(ptr, cap));
        self.trim_spare();
    }

    /// Gives back host memory for the node's swap pool (the arbiter's
    /// `pool_reclaim`): every spare buffer, then the buffer of the swapped-out segment
    /// used least recently, moved to the disk tier ([`Driver::host_spill`]). One
    /// buffer per call, so that the allocator's lock is held for one spill at a time.
    /// Returns the bytes given back; 0: nothing (more) can be.
    pub fn spill_one(&mut self) -> u64 {
        let freed = self.release_spares();
        if freed > 0 {
            return freed;
        }
        let victim = self
            .segs
            .iter()
            .enumerate()
            .filter_map(|(i, s)| Some((i, s.as_ref()?)))
            .filter(|(_, s)| {
                s.handle.is_none()
                    && s.host.as_ref().is_some_and(|b| {
                        b.pinned && !b.registering && self.drv.host_spillable(b.ptr)
                    })
            })
            .min_by_key(|(_, s)| s.touch)
            .map(|(i, _)| i);
        let Some(i) = victim else {
            return 0;
        };
        let (ptr, cap) = {
            let b = self.seg(i).host.as_ref().expect("chosen above");
            (b.ptr, b.cap)
        };
        match self.drv.host_spill(ptr, cap) {
            Some(h) => {
                let s = self.seg(i);
                s.host = None;
                s.spilled = Some(h);
                self.host_bytes -= cap;
                cap
            }
            None => 0,
        }
    }

    /// Bytes of swapped-out contents on the disk tier now.
    pub fn spilled_segments(&self) -> usize {
        self.segs
            .iter()
            .flatten()
            .filter(|s| s.spilled.is_some())
            .count()
    }

    /// Frees every spare pinned buffer (those holding a swapped-out segment's contents
    /// stay); returns the bytes freed. For a GPU that stopped being oversubscribed:
    /// no swap is due, the pinned host RAM goes back to the node.
    pub fn release_spares(&mut self) -> u64 {
        let mut freed = 0;
        for b in std::mem::take(&mut self.spare) {
            self.drv.host_free(b.ptr, b.cap);
            self.host_bytes -= b.cap;
            freed += b.cap;
        }
        freed
    }

    /// The resident segments `evict(need)` takes: those with nothing live at `token`
    /// first, then least recently used first, until `need` bytes.
    fn victims(&self, need: u64, token: Option<u64>) -> Vec<usize> {
        let mut order: Vec<(bool, u64, usize)> = self
            .segs
            .iter()
            .enumerate()
            .filter_map(|(i, s)| {
                s.as_ref()
                    .filter(|s| s.handle.is_some() && s.pins == 0)
                    .map(|s| (s.dead.live_bytes(token, s.size) > 0, s.touch, i))
            })
            .collect();
        order.sort_unstable();
        let mut victims = Vec::new();
        let mut planned = 0;
        for (_, _, i) in order {
            if planned >= need {
                break;
            }
            planned += self.size_of(i);
            victims.push(i);
        }
        victims
    }

    /// Indices into `victims`, largest segment first.
    fn largest_first(&self, victims: &[usize]) -> Vec<usize> {
        let mut by_size: Vec<usize> = (0..victims.len()).collect();
        by_size.sort_by_key(|&k| std::cmp::Reverse(self.size_of(victims[k])));
        by_size
    }

    /// Copies out and releases each victim, `pieces[k]` of victim `k` (none: nothing
    /// live, released without a copy or a buffer). Returns the bytes copied.
    fn evict_planned(
        &mut self,
        victims: &[usize],
        pieces: &[Vec<(u64, u64)>],
        bufs: &mut [Option<HostBuf>],
    ) -> Result<u64, CUresult> {
        let mut bytes = 0;
        let needs_buf = |k: usize| pieces.get(k).is_some_and(|p| !p.is_empty());
        if let (Some(&first), Some(slot @ None)) = (victims.first(), bufs.first_mut()) {
            if needs_buf(0) {
                *slot = Some(self.swap_out_buf(self.size_of(first))?);
            }
        }
        for (k, &i) in victims.iter().enumerate() {
            let (va, size, handle) = {
                let s = self.seg(i);
                (s.va, s.size, s.handle.expect("victims are resident"))
            };
            let buf = bufs[k].take();
            debug_assert_eq!(buf.is_some(), needs_buf(k), "prepared in the previous step");
            let give_back = |m: &mut Self, buf: Option<HostBuf>| {
                if let Some(b) = buf {
                    m.recycle(b);
                }
            };
            if let Some(b) = &buf {
                for &(off, len) in &pieces[k] {
                    // SAFETY: the buffer holds at least `size` bytes (the pieces lie
                    // inside the segment); it is kept aside, untouched, until the copy
                    // is waited for below.
                    let r = unsafe {
                        self.drv
                            .to_host_async(b.ptr.add(off as usize), va + off, len)
                    };
                    if let Err(e) = r {
                        let _ = self.drv.wait_copies();
                        give_back(self, buf);
                        return Err(e);
                    }
                }
            }
            // While the copy runs: the next segment's buffer, if no spare fit.
            let mut next_err = None;
            if let Some(slot @ None) = bufs.get_mut(k + 1) {
                if needs_buf(k + 1) {
                    match self.swap_out_buf(self.size_of(victims[k + 1])) {
                        Ok(b) => *slot = Some(b),
                        Err(e) => next_err = Some(e),
                    }
                }
            }
            if let Err(e) = self.drv.wait_copies() {
                give_back(self, buf);
                return Err(e);
            }
            // Unmapped only now: the copy has read every live byte.
            if let Err(e) = self.drv.unmap(va, size) {
                give_back(self, buf);
                return Err(e);
            }
            let _ = self.drv.release(handle);
            let copied: u64 = pieces[k].iter().map(|p| p.1).sum();
            let s = self.seg(i);
            s.handle = None;
            s.pieces = (buf.is_some() && copied < size).then(|| pieces[k].clone());
            s.host = buf;
            self.resident -= size;
            bytes += copied;
            if let Some(e) = next_err {
                return Err(e);
            }
        }
        Ok(bytes)
    }
}
