//! The benchmarks run in their short mode and print well-formed figures.

use std::process::Command;

fn run(args: &[&str]) -> Vec<serde_json::Value> {
    let out = Command::new(env!("CARGO_BIN_EXE_kiwi-bench"))
        .args(args)
        // The jobs inherit it: the discard hint's answer may come late on a loaded
        // CI machine (these tests run side by side), and live-bytes checks what the
        // hint does, not how fast a woken thread gets a core.
        .env("KIWI_HINT_WAIT_MS", "1000")
        .output()
        .expect("run kiwi-bench");
    assert!(
        out.status.success(),
        "kiwi-bench {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l}: {e}")))
        .collect()
}

fn figure<'a>(figs: &'a [serde_json::Value], metric: &str) -> &'a serde_json::Value {
    figs.iter()
        .find(|f| f["metric"] == metric)
        .unwrap_or_else(|| panic!("{metric} missing from {figs:?}"))
}

#[test]
fn handoff_quick_json() {
    let figs = run(&[
        "handoff",
        "--clients",
        "4",
        "--rounds",
        "50",
        "--quick",
        "--json",
    ]);
    for f in &figs {
        for key in ["scenario", "metric", "value", "unit", "baseline", "ratio"] {
            assert!(f.get(key).is_some(), "{key} missing in {f}");
        }
    }
    let p99 = figure(&figs, "handoff_p99");
    assert_eq!(p99["unit"], "us");
    let (v, b) = (
        p99["value"].as_f64().unwrap(),
        p99["baseline"].as_f64().unwrap(),
    );
    assert!(v > 0.0 && b > 0.0);
    assert!((p99["ratio"].as_f64().unwrap() - v / b).abs() < 1e-6);
    // 4 clients × 50 grants: hand-offs are the grants to a client already waiting
    // when the previous holder released; most are.
    let n = figure(&figs, "handoffs_measured")["value"]
        .as_f64()
        .unwrap();
    assert!((50.0..=199.0).contains(&n), "{n} hand-offs");
    assert!(figure(&figs, "arbiter_ping_p50")["value"].as_f64().unwrap() > 0.0);
}

#[test]
fn idle_clients_cost_little() {
    let figs = run(&["idle", "--clients", "64", "--quick", "--json"]);
    let rss = figure(&figs, "arbiter_rss")["value"].as_f64().unwrap();
    assert!(rss > 0.0 && rss < 100.0, "arbiter RSS {rss} MiB");
}

#[test]
fn bad_arguments_are_refused() {
    let out = Command::new(env!("CARGO_BIN_EXE_kiwi-bench"))
        .args(["handoff", "--clients", "1"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("at least 2"));
}

#[test]
fn launch_overhead_quick_json() {
    let figs = run(&["launch-overhead", "--quick", "--json"]);
    let f = figure(&figs, "launch_through_shim");
    assert_eq!(f["unit"], "ns");
    assert!(f["baseline"].as_f64().unwrap() > 0.0);
    assert!(figure(&figs, "added_per_launch")["value"]
        .as_f64()
        .is_some());
}

/// The swap figures, and the swap-in against the slower of the copy and `cuMemCreate`
/// (both measured by child processes on the simulator, in the same run).
#[test]
fn swap_quick_json() {
    let figs = run(&["swap", "--quick", "--json"]);
    let copy = figure(&figs, "swap_in")["baseline"].as_f64().unwrap();
    let f = figure(&figs, "swap_in_vs_creation");
    let bound = f["baseline"].as_f64().unwrap();
    assert!(
        bound > 0.0 && bound <= copy,
        "the creation bound {bound} GB/s against the copy {copy} GB/s"
    );
    assert_eq!(f["value"], figure(&figs, "swap_in")["value"]);
}

#[test]
fn a_copy_direction_must_be_one_of_two() {
    let out = Command::new(env!("CARGO_BIN_EXE_kiwi-bench"))
        .args(["__copy-bandwidth", "1048576", "--dir", "sideways"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--dir: d2h or h2d"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The discard hint's figures (issue #26): the preallocating pair with the hint
/// copies at most its used 205 MiB and one segment per swap-out, without it nearly
/// its whole 1.9 GiB of untouched preallocation.
#[test]
fn live_bytes_quick_json() {
    let figs = run(&["live-bytes", "--quick", "--json"]);
    let hint = figure(&figs, "mib_per_swap_out_hint")["value"]
        .as_f64()
        .unwrap();
    let plain = figure(&figs, "mib_per_swap_out_no_hint")["value"]
        .as_f64()
        .unwrap();
    assert!(hint <= 205.0 + 64.0, "with the hint: {hint} MiB a swap-out");
    assert!(plain > 1000.0, "without the hint: {plain} MiB a swap-out");
    for m in ["makespan_hint", "makespan_no_hint", "handoff_hint"] {
        assert!(figure(&figs, m)["ratio"].as_f64().unwrap() > 0.0, "{m}");
    }
}

/// `newcomer`: the newcomer's context is ready beside an idle 90% holder (it used to
/// fail with out of memory), with a positive time against the holder's swap-out in
/// the same run.
#[test]
fn newcomer_quick_json() {
    let figs = run(&["newcomer", "--quick", "--json"]);
    let f = figure(&figs, "context_ready");
    assert!(f["value"].as_f64().unwrap() > 0.0, "{f}");
    assert!(f["ratio"].as_f64().unwrap() > 0.0, "{f}");
}

/// The disk tier against the plain disk: every figure has its baseline from the same
/// run, the read-back was checked byte for byte (the run fails otherwise), and the
/// pool had nothing left at the end.
#[test]
fn spill_quick_json() {
    let figs = run(&["spill", "--quick", "--json"]);
    for metric in ["spill_out", "spill_in"] {
        let f = figure(&figs, metric);
        assert_eq!(f["unit"], "GB/s", "{f}");
        let (v, b) = (
            f["value"].as_f64().unwrap(),
            f["baseline"].as_f64().unwrap(),
        );
        assert!(v > 0.0 && b > 0.0, "{f}");
        assert!((f["ratio"].as_f64().unwrap() - v / b).abs() < 1e-6, "{f}");
    }
}
