//! Copies take bytes ÷ PCIe bandwidth of wall time (its own test binary, so no other
//! test competes for the two CPUs while it measures).

use std::process::Command;

use kiwi_sim_core::harness::SimMachine;

#[test]
fn copy_time_matches_the_configured_bandwidth_within_10_percent() {
    // 1 GB/s and 128 MiB: 134 ms per copy, far above sleep granularity and above
    // what the memcpy itself costs.
    let m = SimMachine::new("copy", 1, 512 << 20)
        .unwrap_or_else(|e| panic!("{e}"))
        .with_env("KIWI_SIM_PCIE_GBPS", "1");
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
    let expected = (128u64 << 20) as f64 / 1e9;
    for k in ["htod_s=", "dtoh_s="] {
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
