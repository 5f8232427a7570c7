//! Slices' pages and the pool's configuration.

use super::*;

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

/// Huge pages reserved for one test (`vm.nr_hugepages` raised), the count put back
/// when dropped, a panic included.
struct Reserved(String);

impl Reserved {
    const PATH: &'static str = "/proc/sys/vm/nr_hugepages";

    fn pages(more: u64) -> Reserved {
        let before = std::fs::read_to_string(Self::PATH).expect("nr_hugepages");
        let n: u64 = before.trim().parse().expect("a count");
        std::fs::write(Self::PATH, (n + more).to_string()).expect("raising nr_hugepages");
        Reserved(before)
    }
}

impl Drop for Reserved {
    fn drop(&mut self) {
        let _ = std::fs::write(Self::PATH, self.0.trim());
    }
}

/// On a host with hugetlb pages reserved (the pool's first choice), slices are made of
/// them, mapped side by side as the shim maps a swap-out's buffer (each at a multiple
/// of the huge page, which `MAP_FIXED` requires of a hugetlb file), written and read
/// through, and scrubbed once given back.
#[test]
fn hugetlb_slices_map_side_by_side_and_are_scrubbed() {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        assert_ne!(
            std::env::var("CI").as_deref(),
            Ok("true"),
            "reserving huge pages needs root, which CI has"
        );
        eprintln!("skipped: reserving huge pages needs root");
        return;
    }
    let _reserved = Reserved::pages(8);
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap();
    assert_eq!(
        PageMode::detect_from(&meminfo, None, 4 * M),
        PageMode::HugeTlb { page: 2 * M },
        "the kernel gave no huge pages: {meminfo}"
    );
    let p = Pool::start_with(
        PoolConfig {
            size: 16 * M,
            floor: 0,
            slice: 4 * M,
        },
        PageMode::HugeTlb { page: 2 * M },
    )
    .unwrap();
    assert_eq!(p.stats().page_mode, "hugetlb");
    let lent = p.take(3, "hugepages", 8 * M).unwrap();
    let parts: Vec<kiwi_cuda::filemap::FilePart> = lent
        .iter()
        .map(|l| kiwi_cuda::filemap::FilePart::whole(l.fd.as_raw_fd(), l.bytes as usize))
        .collect();
    let (ptr, len) = kiwi_cuda::filemap::map_side_by_side(
        &parts,
        libc::PROT_READ | libc::PROT_WRITE,
        libc::MAP_SHARED,
    )
    .expect("hugetlb slices map side by side");
    assert_eq!(len as u64, 8 * M);
    // SAFETY: the mapping just made, `len` bytes readable and writable, unmapped below.
    let bytes = unsafe { std::slice::from_raw_parts_mut(ptr, len) };
    for (i, b) in bytes.iter_mut().enumerate() {
        *b = (i / 4096) as u8;
    }
    assert!(bytes
        .iter()
        .enumerate()
        .all(|(i, &b)| b == (i / 4096) as u8));
    // SAFETY: the mapping made above, not used after.
    unsafe { libc::munmap(ptr.cast(), len) };

    let kept = lent[0].fd.try_clone().unwrap();
    assert_eq!(p.give(3, &ids(&lent)), 8 * M);
    drop(lent);
    wait_for("the scrub", || p.stats().scrubbing == 0);
    let mut map = Map::new(kept.as_fd(), 4 * M);
    assert!(
        map.bytes().iter().all(|&b| b == 0),
        "a returned hugetlb slice reads zeros"
    );
}
