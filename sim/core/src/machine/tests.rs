use super::*;

fn cfg(tag: &str, gpus: u32, memory: u64) -> SimConfig {
    SimConfig {
        gpus,
        memory,
        name: format!("unit-{tag}-{}", std::process::id()),
        ..SimConfig::default()
    }
}

#[test]
fn capacity_is_enforced_and_released() {
    let c = cfg("cap", 2, 100 << 20);
    let m = Machine::open(&c).unwrap();
    m.reserve(0, 60 << 20).unwrap();
    let e = m.reserve(0, 50 << 20).unwrap_err();
    assert!(matches!(e, MachineError::OutOfMemory { free, .. } if free == 40 << 20));
    m.reserve(1, 100 << 20).unwrap();
    m.release(0, 60 << 20);
    m.reserve(0, 100 << 20).unwrap();
    let u = m.usage(0).unwrap();
    assert_eq!(u.used, 100 << 20);
    assert_eq!(u.peak, 100 << 20, "the refused 50 MiB never counted");
    m.release(0, 100 << 20);
    m.reserve(0, 10 << 20).unwrap();
    assert_eq!(m.usage(0).unwrap().peak, 100 << 20, "the peak stays");
    m.release(0, 10 << 20);
    m.reserve(0, 100 << 20).unwrap();
    let u = m.usage(0).unwrap();
    assert_eq!(
        u.processes,
        vec![ProcessUsage {
            pid: std::process::id(),
            bytes: 100 << 20
        }]
    );
    assert!(matches!(
        m.reserve(2, 1),
        Err(MachineError::NoSuchGpu { .. })
    ));
    reset(&c.name).unwrap();
}

#[test]
fn later_opens_see_the_first_knobs() {
    let c = cfg("knobs", 1, 64 << 20);
    let a = Machine::open(&c).unwrap();
    let mut other = c.clone();
    other.gpus = 3;
    other.memory = 1 << 30;
    other.context_memory = 1 << 20;
    let b = Machine::open(&other).unwrap();
    assert_eq!(b.gpu_count(), 1);
    assert_eq!(b.settings().context_memory, 300 << 20);
    assert_eq!(b.capacity(0).unwrap(), 64 << 20);
    a.reserve(0, 10 << 20).unwrap();
    // Same process, same entry: both handles see it.
    assert_eq!(b.usage(0).unwrap().used, 10 << 20);
    reset(&c.name).unwrap();
}

#[test]
fn dead_processes_are_reclaimed() {
    let c = cfg("gc", 1, 64 << 20);
    let m = Machine::open(&c).unwrap();
    // Forge an entry for a process that exited: spawn and reap `true`.
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let pid = child.id();
    let start = process_start_time(pid);
    child.wait().unwrap();
    let slot = &m.seg().gpu[0].procs[0];
    slot.pid.store(u64::from(pid), Ordering::Relaxed);
    slot.start_time.store(start.unwrap_or(1), Ordering::Relaxed);
    slot.bytes.store(60 << 20, Ordering::Relaxed);
    m.reserve(0, 30 << 20)
        .expect("dead process's 60MiB must be reclaimed");
    assert_eq!(m.usage(0).unwrap().used, 30 << 20);
    reset(&c.name).unwrap();
}

#[test]
fn extents_are_handed_out_freed_and_reclaimed() {
    use std::os::unix::fs::MetadataExt;
    let c = cfg("extent", 2, 64 << 20);
    let m = Machine::open(&c).unwrap();
    assert_eq!(file_granules(64 << 20), 80);
    let (file, len) = m.mem_file(1).unwrap();
    assert_eq!(len, 80 * crate::GRANULARITY);
    assert_eq!(file.metadata().unwrap().len(), len);
    assert_eq!(file.metadata().unwrap().blocks(), 0, "sparse until touched");
    let a = m.extent_alloc(0, 10).unwrap();
    assert_eq!(a, vec![(0, 10)]);
    assert_eq!(m.extent_alloc(0, 5).unwrap(), vec![(10, 5)]);
    m.extent_free(0, &a);
    // The lowest run long enough, then the lowest granules in several runs.
    assert_eq!(m.extent_alloc(0, 12).unwrap(), vec![(15, 12)]);
    assert!(matches!(
        m.extent_alloc(0, 64),
        Err(MachineError::FileFull { gpu: 0, .. })
    ));
    assert_eq!(m.extent_alloc(0, 60).unwrap(), vec![(0, 10), (27, 50)]);
    assert_eq!(m.extents_in_use(0).unwrap(), (77, 80));
    assert_eq!(m.extents_in_use(1).unwrap(), (0, 80));
    // A dead process's granules come back: forge them for a process that
    // exited, then free ours.
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let pid = child.id();
    let start = process_start_time(pid);
    child.wait().unwrap();
    let slot = &m.seg().gpu[0];
    let table = m.granule_table(slot);
    slot.owners[5].pid.store(u64::from(pid), Ordering::Relaxed);
    slot.owners[5]
        .start_time
        .store(start.unwrap_or(1), Ordering::Relaxed);
    slot.owners[5].bytes.store(3, Ordering::Relaxed);
    for g in &table[77..80] {
        g.store(6, Ordering::Relaxed);
    }
    // All 80 granules are taken: an allocation reclaims the dead one's first.
    assert_eq!(m.extent_alloc(0, 3).unwrap(), vec![(77, 3)]);
    assert_eq!(m.extents_in_use(0).unwrap(), (80, 80));
    assert_eq!(slot.owners[5].pid.load(Ordering::Relaxed), 0);
    m.extent_free(0, &[(0, 80)]);
    assert_eq!(m.extents_in_use(0).unwrap(), (0, 80));
    // Populating fills the capacity's pages (the file stays sparse past it).
    assert_eq!(m.populate(1).unwrap(), 64 << 20);
    let blocks = m.mem_file(1).unwrap().0.metadata().unwrap().blocks();
    assert!(
        blocks * 512 >= 64 << 20 && blocks * 512 < 80 << 20,
        "{blocks}"
    );
    reset(&c.name).unwrap();
    assert!(!mem_file_path(&c.name, 0).exists());
    assert!(!mem_file_path(&c.name, 1).exists());
}

#[test]
fn extents_stay_in_the_populated_part_and_what_lies_beyond_it_is_punched() {
    use std::os::unix::fs::MetadataExt;
    const G: u64 = crate::GRANULARITY;
    // 32 granules of capacity, 80 in the file.
    let c = cfg("beyond", 1, 64 << 20);
    let m = Machine::open(&c).unwrap();
    m.populate(0).unwrap();
    let blocks = || m.mem_file(0).unwrap().0.metadata().unwrap().blocks() * 512;
    let populated = blocks();
    assert!(populated >= 64 << 20, "{populated}");
    let a = m.extent_alloc(0, 10).unwrap();
    assert_eq!(m.extent_alloc(0, 10).unwrap(), vec![(10, 10)]);
    m.extent_free(0, &a);
    // No run of 16 within the capacity ((0, 10) and (20, 12) are free there): two
    // runs there, not one beyond it, whose pages would have to be faulted in.
    assert_eq!(m.extent_alloc(0, 16).unwrap(), vec![(0, 10), (20, 6)]);
    assert_eq!(m.extent_alloc(0, 6).unwrap(), vec![(26, 6)]);
    // The capacity full, rounding may take granules beyond it: given back, their
    // pages leave the host's memory.
    let beyond = m.extent_alloc(0, 4).unwrap();
    assert_eq!(beyond, vec![(32, 4)]);
    let p = m.map_mem_file(0, 36 * G).unwrap();
    // SAFETY: the mapping just made is 36 granules long; granules 32..36 are this
    // process's.
    unsafe {
        std::ptr::write_bytes(p.add((32 * G) as usize), 0xa5, (4 * G) as usize);
        libc::munmap(p.cast(), (36 * G) as usize);
    }
    assert_eq!(blocks(), populated + 4 * G);
    m.extent_free(0, &beyond);
    assert_eq!(
        blocks(),
        populated,
        "the granules beyond the capacity punched"
    );
    // A process that exited never gave its granules back: they are reclaimed before
    // any beyond the capacity are taken (forged for a process that exited).
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let pid = child.id();
    let start = process_start_time(pid);
    child.wait().unwrap();
    let slot = &m.seg().gpu[0];
    slot.owners[7].pid.store(u64::from(pid), Ordering::Relaxed);
    slot.owners[7]
        .start_time
        .store(start.unwrap_or(1), Ordering::Relaxed);
    slot.owners[7].bytes.store(6, Ordering::Relaxed);
    m.extent_free(0, &[(26, 6)]);
    for g in &m.granule_table(slot)[26..32] {
        g.store(8, Ordering::Relaxed);
    }
    assert_eq!(m.extent_alloc(0, 4).unwrap(), vec![(26, 4)]);
    assert_eq!(slot.owners[7].pid.load(Ordering::Relaxed), 0);
    reset(&c.name).unwrap();
}

#[test]
fn idle_machines_nobody_holds_memory_on_give_their_pages_back() {
    use std::os::unix::fs::MetadataExt;
    let c = cfg("sweep", 1, 16 << 20);
    let m = Machine::open(&c).unwrap();
    m.populate(0).unwrap();
    let blocks = || m.mem_file(0).unwrap().0.metadata().unwrap().blocks();
    assert!(blocks() * 512 >= 16 << 20);
    let runs = m.extent_alloc(0, 2).unwrap();
    let age = |m: &Machine| {
        m.seg().last_active.store(
            crate::trace::monotonic_ns() - IDLE_SWEEP_NS - 1,
            Ordering::Relaxed,
        )
    };
    // Recently active: kept.
    sweep_idle_machines("none");
    assert!(blocks() * 512 >= 16 << 20);
    // Idle, but a living process (this one) owns granules: kept.
    age(&m);
    sweep_idle_machines("none");
    assert!(blocks() * 512 >= 16 << 20);
    // Idle, nobody holds anything: the pages go, the machine stays usable.
    m.extent_free(0, &runs);
    age(&m);
    sweep_idle_machines(&format!("not-{}", c.name));
    assert_eq!(blocks(), 0);
    assert_eq!(m.extent_alloc(0, 1).unwrap(), vec![(0, 1)]);
    reset(&c.name).unwrap();
}

#[test]
fn faults_set_and_clear() {
    let c = cfg("fault", 1, 64 << 20);
    let m = Machine::open(&c).unwrap();
    assert_eq!(m.fault(0).unwrap(), FaultState::default());
    m.set_fault(0, 79, true).unwrap();
    let f = m.fault(0).unwrap();
    assert_eq!((f.xid, f.lost, f.generation), (79, true, 1));
    m.set_fault(0, 0, false).unwrap();
    assert_eq!(m.fault(0).unwrap().generation, 2);
    reset(&c.name).unwrap();
}

#[test]
fn the_kernel_lock_is_fair_between_processes() {
    // Two handles are two open files, so their flocks exclude each other as two
    // processes' would. A runs 5 ms kernels back to back; B, arriving later, must
    // get its 10 kernels in between A's, not after all of them. Counted in A's
    // kernels, not in time: on a loaded machine a 5 ms sleep overruns, and a wait
    // measured in milliseconds failed with both cores busy (16.7 ms against 12).
    let c = cfg("fair", 1, 64 << 20);
    let (a, b) = (Machine::open(&c).unwrap(), Machine::open(&c).unwrap());
    let a_done = std::sync::atomic::AtomicBool::new(false);
    let a_kernels = std::sync::atomic::AtomicU32::new(0);
    let b_before_a = std::thread::scope(|s| {
        s.spawn(|| {
            for _ in 0..100 {
                let _g = a.kernel_lock(0).unwrap();
                a_kernels.fetch_add(1, Ordering::SeqCst);
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            a_done.store(true, Ordering::SeqCst);
        });
        std::thread::sleep(std::time::Duration::from_millis(20));
        let mut most = 0;
        let mut longest = std::time::Duration::ZERO;
        for _ in 0..10 {
            let t = std::time::Instant::now();
            let before = a_kernels.load(Ordering::SeqCst);
            let _g = b.kernel_lock(0).unwrap();
            most = most.max(a_kernels.load(Ordering::SeqCst) - before);
            longest = longest.max(t.elapsed());
        }
        (!a_done.load(Ordering::SeqCst), most, longest)
    });
    let (b_before_a, most, longest) = b_before_a;
    eprintln!("B's longest wait for the kernel lock: {longest:?}, {most} of A's kernels");
    assert!(b_before_a, "B waited for every one of A's kernels");
    // Fair: B waits for at most the kernel that starts as it asks (and one more
    // if it missed its window on a loaded machine). flock alone lets A re-lock
    // before B wakes, kernel after kernel.
    assert!(most <= 2, "B waited for {most} of A's kernels at once");
    assert_eq!(a.seg().gpu[0].kernel_waiters.load(Ordering::SeqCst), 0);
    reset(&c.name).unwrap();
}

#[test]
fn each_link_direction_queues_its_copies_and_the_two_are_independent() {
    let c = cfg("link", 2, 64 << 20);
    let (a, b) = (Machine::open(&c).unwrap(), Machine::open(&c).unwrap());
    let t = crate::trace::monotonic_ns() + 1_000_000_000;
    let h2d = LinkDir::HostToDevice;
    // A's copy takes the link for 100 ns; B's, ready at the same time through
    // another mapping (another process), queues behind it.
    assert_eq!(a.link_reserve(0, h2d, t, 100).unwrap(), t + 100);
    assert_eq!(b.link_reserve(0, h2d, t, 100).unwrap(), t + 200);
    // The other direction and the other GPU's link are free.
    let d2h = LinkDir::DeviceToHost;
    assert_eq!(b.link_reserve(0, d2h, t, 100).unwrap(), t + 100);
    assert_eq!(b.link_reserve(1, h2d, t, 100).unwrap(), t + 100);
    // A copy ready after the link went idle starts when it is ready.
    assert_eq!(a.link_reserve(0, h2d, t + 500, 10).unwrap(), t + 510);
    assert!(matches!(
        a.link_reserve(2, h2d, t, 1),
        Err(MachineError::NoSuchGpu { .. })
    ));
    reset(&c.name).unwrap();
}

#[test]
fn bad_names_are_refused() {
    assert!(matches!(
        Machine::open_existing("../x"),
        Err(MachineError::BadName { .. })
    ));
}
