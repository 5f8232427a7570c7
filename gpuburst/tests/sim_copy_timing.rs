//! Copies take bytes ÷ PCIe bandwidth of wall time (its own test binary, so no other
//! test competes for the two CPUs while it measures).

use std::process::Command;

use kiwi_sim_core::harness::SimMachine;

/// Runs `cuprobe copy` of 128 MiB (pageable host memory) on `m` and checks each
/// direction took `htod_s` and `dtoh_s` seconds, within 10%.
fn check_copy_times(m: &SimMachine, htod_s: f64, dtoh_s: f64) {
    let o = m
        .apply(&mut Command::new(env!("CARGO_BIN_EXE_cuprobe")))
        .args(["copy", "--mib", "128"])
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(
        o.status.success(),
        "{out}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let field = |k: &str| -> f64 {
        out.split_whitespace()
            .find_map(|w| w.strip_prefix(k))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no {k} in {out}"))
    };
    for (k, expected) in [("htod_s=", htod_s), ("dtoh_s=", dtoh_s)] {
        let got = field(k);
        println!(
            "{k}{got:.4} expected {expected:.4} ({:+.1}%)",
            (got / expected - 1.0) * 100.0
        );
        assert!(
            (got - expected).abs() <= 0.10 * expected,
            "{k}{got} is not within 10% of {expected}"
        );
    }
}

#[test]
fn copy_time_matches_the_configured_bandwidth_within_10_percent() {
    // 1 GB/s and 128 MiB: 134 ms per copy, far above sleep granularity and above
    // what the memcpy itself costs. Pageable memory is faster than that link.
    let m = SimMachine::new("copy", 1, 512 << 20)
        .unwrap_or_else(|e| panic!("{e}"))
        .with_env("KIWI_SIM_PCIE_GBPS", "1");
    let link = (128u64 << 20) as f64 / 1e9;
    check_copy_times(&m, link, link);
}

#[test]
fn pageable_copies_run_at_the_pageable_rates_when_the_link_is_faster() {
    // The driver stages pageable copies through its own pinned buffers: on an H100,
    // 7-8 GB/s host to device and 12-13 GB/s back against a 55 GB/s link. Here 0.5
    // and 1 GB/s against 25: 268 and 134 ms for 128 MiB.
    let m = SimMachine::new("pageable", 1, 512 << 20)
        .unwrap_or_else(|e| panic!("{e}"))
        .with_env("KIWI_SIM_PCIE_GBPS", "25")
        .with_env("KIWI_SIM_PAGEABLE_H2D_GBPS", "0.5")
        .with_env("KIWI_SIM_PAGEABLE_D2H_GBPS", "1");
    let bytes = (128u64 << 20) as f64;
    check_copy_times(&m, bytes / 0.5e9, bytes / 1e9);
}
