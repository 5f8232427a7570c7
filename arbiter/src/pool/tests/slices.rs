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
