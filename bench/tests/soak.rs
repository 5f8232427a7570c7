//! The short seeded soak CI runs (issue #38): 12 verifying clients on 4 simulated
//! GPUs of 1280 MiB (three processes' contexts leave less than their working sets
//! need together: the GPUs are oversubscribed, and clients swap through the pool and
//! its disk tier) for 60 s while clients and the arbiter are killed, tenants storm or
//! never read, the spill disk goes missing or fills up, and containers are attached
//! and detached (one under its running client), then the same clients quiet. `kiwi-bench soak` fails if a client not killed loses
//! a byte or waits past its bound, if the arbiter's memory or descriptors grow past
//! their bounds, if a container's client is not labelled by its record, or if
//! anything is left behind (a detached container's record, socket or listener
//! included); it prints the seed, so a failure replays. Alone in its test binary: its
//! clients' bounds assume the machine is not also running the other benchmarks.

use std::process::Command;

#[test]
fn a_short_seeded_soak_loses_nothing() {
    let out = Command::new(env!("CARGO_BIN_EXE_kiwi-bench"))
        .args(["soak", "--gpus", "4", "--clients", "12", "--seconds", "60"])
        .args(["--gpu-mib", "1280"])
        .args(["--seed", "38", "--json"])
        .output()
        .expect("run kiwi-bench soak");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "kiwi-bench soak: {err}");
    let figs: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l}: {e}")))
        .collect();
    let survived = figs
        .iter()
        .find(|f| f["metric"] == "faults_survived")
        .unwrap_or_else(|| panic!("no faults_survived in {figs:?}"));
    // Every kind of fault came at least once (they come in turn).
    for kind in [
        "client SIGKILL",
        "report storm",
        "client that never reads",
        "arbiter SIGKILL and restart",
        "spill directory gone",
        // CI runs as root: the arbiter's spill disk is a tmpfs of its own to fill.
        "spill disk full",
        "container churn",
        "container detached under its client",
    ] {
        assert!(err.contains(kind), "no {kind} in: {err}");
    }
    assert!(survived["value"].as_f64().unwrap() >= 8.0, "{survived}");
    // Oversubscribed: clients swapped, under faults and quiet.
    let swapped = figs
        .iter()
        .find(|f| f["metric"] == "swapped")
        .unwrap_or_else(|| panic!("no swapped in {figs:?}"));
    assert!(swapped["value"].as_f64().unwrap() > 0.0, "{swapped}");
    assert!(swapped["baseline"].as_f64().unwrap() > 0.0, "{swapped}");
    // Clients ran in containers, on their containers' sockets.
    let in_containers: usize = err
        .split("; ")
        .find_map(|p| p.split_once(" clients in containers verified every byte"))
        .and_then(|(n, _)| n.parse().ok())
        .unwrap_or_else(|| panic!("no count of clients in containers in: {err}"));
    assert!(in_containers > 0, "{err}");
}
