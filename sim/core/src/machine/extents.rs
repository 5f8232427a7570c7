//! The allocator of each GPU's memory file: a table of 2 MiB granules in the segment,
//! each free or owned by a process, handed out as extents and reclaimed when their
//! owner is dead; and populating a GPU's file ahead.
//!
//! The file has twice the GPU's granules ([`super::file_granules`]), but only the
//! first capacity's worth stays populated: extents are taken there first (in several
//! runs rather than one run beyond it), and granules beyond it are punched out of the
//! file when they are given back or reclaimed. Otherwise a long run touches the whole
//! file over time, and the simulated GPUs hold twice their memory of the host's RAM
//! (the soak's 30-minute run was ended by the kernel's OOM killer so).

use super::*;

impl Machine {
    /// The granule table of `gpu`'s memory file.
    pub(super) fn granule_table(&self, slot: &GpuSlot) -> &[std::sync::atomic::AtomicU16] {
        let n = slot.granules.load(Ordering::Relaxed) as usize;
        let off = slot.granule_table.load(Ordering::Relaxed) as usize;
        assert!(
            off + 2 * n <= self.seg_len,
            "granule table inside the segment"
        );
        // SAFETY: the table lies inside the mapping (checked above), 2-aligned (the
        // header's size is a multiple of 8, tables are 2 bytes per granule), and is
        // only ever accessed through atomics.
        unsafe {
            std::slice::from_raw_parts(
                (self.seg as *const u8)
                    .add(off)
                    .cast::<std::sync::atomic::AtomicU16>(),
                n,
            )
        }
    }

    /// Drops the granules of owners that no longer exist; returns granules in use
    /// after.
    pub(super) fn collect_dead_owners(&self, gpu: u32, slot: &GpuSlot) -> u64 {
        let table = self.granule_table(slot);
        let cap = Self::capacity_granules(slot);
        let mut used = 0;
        for (i, o) in slot.owners.iter().enumerate() {
            let pid = o.pid.load(Ordering::Relaxed);
            if pid == 0 {
                continue;
            }
            let alive = u32::try_from(pid)
                .ok()
                .and_then(process_start_time)
                .is_some_and(|t| t == o.start_time.load(Ordering::Relaxed));
            if alive {
                used += o.bytes.load(Ordering::Relaxed);
                continue;
            }
            let tag = i as u16 + 1;
            let mut beyond = Vec::new();
            for (k, g) in table.iter().enumerate() {
                if g.load(Ordering::Relaxed) == tag {
                    g.store(0, Ordering::Relaxed);
                    if k as u64 >= cap {
                        beyond.push((k as u64, 1));
                    }
                }
            }
            self.punch_beyond_capacity(gpu, cap, &beyond);
            o.bytes.store(0, Ordering::Relaxed);
            o.start_time.store(0, Ordering::Relaxed);
            o.pid.store(0, Ordering::Relaxed);
        }
        used
    }

    /// Takes `count` granules of `gpu`'s memory file for this process, as runs
    /// `(first granule, granules)`: the lowest run long enough when there is one,
    /// else the lowest free granules in several runs. Granules of dead processes
    /// are reclaimed before a refusal (`FileFull`).
    pub fn extent_alloc(&self, gpu: u32, count: u64) -> Result<Vec<(u64, u64)>, MachineError> {
        let slot = self.gpu(gpu)?;
        let _lock = FileLock::exclusive(&self.file);
        let table = self.granule_table(slot);
        let free_runs = || {
            let mut runs = Vec::new();
            let mut at = 0;
            while at < table.len() {
                if table[at].load(Ordering::Relaxed) != 0 {
                    at += 1;
                    continue;
                }
                let start = at;
                while at < table.len() && table[at].load(Ordering::Relaxed) == 0 {
                    at += 1;
                }
                runs.push((start as u64, (at - start) as u64));
            }
            runs
        };
        let cap = Self::capacity_granules(slot);
        let mut runs = free_runs();
        // Dead processes' granules come back before a refusal, and before granules
        // beyond the populated part are taken.
        let within: u64 = runs
            .iter()
            .map(|&(first, n)| n.min(cap.saturating_sub(first)))
            .sum();
        if within < count {
            self.collect_dead_owners(gpu, slot);
            runs = free_runs();
        }
        // One run within the populated part, else the lowest free granules.
        let taken =
            if let Some(&(first, _)) = runs.iter().find(|r| r.1 >= count && r.0 + count <= cap) {
                vec![(first, count)]
            } else {
                let mut need = count;
                let mut taken = Vec::new();
                for &(first, n) in &runs {
                    if need == 0 {
                        break;
                    }
                    let k = n.min(need);
                    taken.push((first, k));
                    need -= k;
                }
                if need > 0 {
                    return Err(MachineError::FileFull {
                        gpu,
                        granules: count,
                    });
                }
                taken
            };
        let idx = slot
            .owners
            .iter()
            .position(|o| {
                o.pid.load(Ordering::Relaxed) == self.me.0
                    && o.start_time.load(Ordering::Relaxed) == self.me.1
            })
            .or_else(|| {
                let i = slot
                    .owners
                    .iter()
                    .position(|o| o.pid.load(Ordering::Relaxed) == 0)?;
                let o = &slot.owners[i];
                o.start_time.store(self.me.1, Ordering::Relaxed);
                o.bytes.store(0, Ordering::Relaxed);
                o.pid.store(self.me.0, Ordering::Relaxed);
                Some(i)
            })
            .ok_or(MachineError::TooManyProcesses(gpu))?;
        let tag = idx as u16 + 1;
        for &(first, n) in &taken {
            for g in &table[first as usize..(first + n) as usize] {
                g.store(tag, Ordering::Relaxed);
            }
        }
        slot.owners[idx].bytes.fetch_add(count, Ordering::Relaxed);
        self.touch();
        Ok(taken)
    }

    /// Gives back granules [`Machine::extent_alloc`] gave this process (their pages
    /// stay populated for the next allocation, but those beyond the capacity).
    pub fn extent_free(&self, gpu: u32, runs: &[(u64, u64)]) {
        let Ok(slot) = self.gpu(gpu) else { return };
        let _lock = FileLock::exclusive(&self.file);
        let table = self.granule_table(slot);
        let Some(idx) = slot.owners.iter().position(|o| {
            o.pid.load(Ordering::Relaxed) == self.me.0
                && o.start_time.load(Ordering::Relaxed) == self.me.1
        }) else {
            return;
        };
        let tag = idx as u16 + 1;
        let cap = Self::capacity_granules(slot);
        let mut freed = 0;
        let mut beyond = Vec::new();
        for &(first, n) in runs {
            let end = (first + n).min(table.len() as u64);
            for (k, g) in table
                .iter()
                .enumerate()
                .take(end as usize)
                .skip(first.min(end) as usize)
            {
                if g.load(Ordering::Relaxed) == tag {
                    g.store(0, Ordering::Relaxed);
                    freed += 1;
                    if k as u64 >= cap {
                        beyond.push((k as u64, 1));
                    }
                }
            }
        }
        self.punch_beyond_capacity(gpu, cap, &beyond);
        self.touch();
        let o = &slot.owners[idx];
        let left = o.bytes.load(Ordering::Relaxed).saturating_sub(freed);
        o.bytes.store(left, Ordering::Relaxed);
        if left == 0 {
            o.start_time.store(0, Ordering::Relaxed);
            o.pid.store(0, Ordering::Relaxed);
        }
    }

    /// Granules of `gpu`'s memory file: (owned by live processes, all), after
    /// reclaiming dead owners' granules.
    pub fn extents_in_use(&self, gpu: u32) -> Result<(u64, u64), MachineError> {
        let slot = self.gpu(gpu)?;
        let _lock = FileLock::exclusive(&self.file);
        let used = self.collect_dead_owners(gpu, slot);
        Ok((used, slot.granules.load(Ordering::Relaxed)))
    }

    /// The granules of `slot`'s capacity: the part of its file that stays populated.
    fn capacity_granules(slot: &GpuSlot) -> u64 {
        slot.capacity
            .load(Ordering::Relaxed)
            .div_ceil(crate::GRANULARITY)
    }

    /// Frees the pages of `granules` (runs of single granules, in order) of `gpu`'s
    /// file that lie at or beyond `cap`: nobody owns them now, and reads give zeros.
    fn punch_beyond_capacity(&self, gpu: u32, cap: u64, granules: &[(u64, u64)]) {
        let Some(file) = self.mem_files.get(gpu as usize) else {
            return;
        };
        // Adjacent granules in one call.
        let mut runs: Vec<(u64, u64)> = Vec::new();
        for &(g, n) in granules.iter().filter(|(g, _)| *g >= cap) {
            match runs.last_mut() {
                Some((first, len)) if *first + *len == g => *len += n,
                _ => runs.push((g, n)),
            }
        }
        for (first, n) in runs {
            // SAFETY: fallocate on a file this machine holds open; punching a hole
            // frees its pages (reads give zeros), and no process owns these granules.
            unsafe {
                libc::fallocate(
                    file.as_raw_fd(),
                    libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                    (first * crate::GRANULARITY) as libc::off_t,
                    (n * crate::GRANULARITY) as libc::off_t,
                )
            };
        }
    }

    /// The file holding `gpu`'s device memory (`kiwi-sim-<name>.gpu<N>.mem`), and
    /// its length (granule `i` is bytes `[i × 2 MiB, (i + 1) × 2 MiB)`).
    pub fn mem_file(&self, gpu: u32) -> Result<(&File, u64), MachineError> {
        let slot = self.gpu(gpu)?;
        let f = self
            .mem_files
            .get(gpu as usize)
            .ok_or(MachineError::NoSuchGpu {
                gpu,
                count: self.gpu_count(),
            })?;
        Ok((
            f,
            slot.granules.load(Ordering::Relaxed) * crate::GRANULARITY,
        ))
    }

    /// A new writable shared mapping (`MAP_NORESERVE`) of the first `len` bytes of
    /// `gpu`'s memory file, at an address of the kernel's choosing. The caller unmaps
    /// it.
    pub fn map_mem_file(&self, gpu: u32, len: u64) -> Result<*mut u8, MachineError> {
        let (file, _) = self.mem_file(gpu)?;
        // SAFETY: a new shared mapping of a file this machine holds open; no existing
        // memory is affected.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_NORESERVE,
                file.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(MachineError::Io {
                path: mem_file_path(&self.name, gpu),
                source: std::io::Error::last_os_error(),
            });
        }
        Ok(p.cast())
    }

    /// Populates `gpu`'s memory file up to its capacity (rounded up to a granule)
    /// from this process, so its pages exist before any tenant allocates them and
    /// are charged to this process's memory cgroup, not to the processes that later
    /// map them (a memory cgroup charges a shared page to whoever faults it in
    /// first). Contents are left as they are. Returns the bytes populated.
    pub fn populate(&self, gpu: u32) -> Result<u64, MachineError> {
        let (file, _) = self.mem_file(gpu)?;
        let len = self.capacity(gpu)?.next_multiple_of(crate::GRANULARITY);
        let p = self.map_mem_file(gpu, len)?;
        const PART: usize = 64 << 20;
        self.touch();
        let mut result = Ok(len);
        for at in (0..len as usize).step_by(PART) {
            let n = PART.min(len as usize - at);
            // SAFETY: advice on a part of the mapping just made; populating a shared
            // mapping writable faults its pages in without changing their bytes.
            let r = unsafe { libc::madvise(p.add(at).cast(), n, MADV_POPULATE_WRITE) };
            if r != 0 {
                // Kernels before 5.14: allocate the pages (their contents stay).
                // SAFETY: fallocate on a file we hold open; mode 0 only allocates.
                let r = unsafe {
                    libc::fallocate(file.as_raw_fd(), 0, at as libc::off_t, n as libc::off_t)
                };
                if r != 0 {
                    result = Err(MachineError::Io {
                        path: mem_file_path(&self.name, gpu),
                        source: std::io::Error::last_os_error(),
                    });
                    break;
                }
            }
        }
        // SAFETY: unmapping the mapping made above, which nothing else refers to.
        unsafe { libc::munmap(p.cast(), len as usize) };
        result
    }
}
