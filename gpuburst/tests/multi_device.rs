//! `gpuburst --device 0,1`: one program using several simulated GPUs. Its memory
//! (`--mem` per device) and its bursts are on every listed device, in the listed
//! order, and verification covers every device.

mod common;

use common::{finish, gpuburst};
use kiwi_sim_core::harness::SimMachine;
use kiwi_sim_core::trace::{self, TraceRecord};

fn machine(tag: &str, gpus: u32, mib: u64) -> SimMachine {
    SimMachine::new(tag, gpus, mib << 20).unwrap_or_else(|e| panic!("{e}"))
}

/// The JSON line of `event` (the first one).
fn event<'a>(out: &'a str, event: &str) -> &'a str {
    let tag = format!("\"event\":\"{event}\"");
    out.lines()
        .find(|l| l.contains(&tag))
        .unwrap_or_else(|| panic!("no {event} line in:\n{out}"))
}

fn bursts(out: &str) -> usize {
    out.lines()
        .filter(|l| l.contains("\"event\":\"burst\""))
        .count()
}

/// The first `kiwi_spin` of `pid` on `device`: the probe of its first burst there.
fn first_spin(recs: &[TraceRecord], pid: u32, device: u32) -> &TraceRecord {
    recs.iter()
        .filter(|r| r.pid == pid && r.device == device && r.name == "kiwi_spin")
        .min_by_key(|r| r.start_ns)
        .unwrap_or_else(|| panic!("no kiwi_spin of {pid} on device {device}: {recs:?}"))
}

fn kernels_on(recs: &[TraceRecord], pid: u32, device: u32, name: &str) -> usize {
    recs.iter()
        .filter(|r| r.pid == pid && r.device == device && r.name == name)
        .count()
}

#[test]
fn one_program_on_two_gpus_runs_kernels_on_both_and_verifies() {
    let m = machine("multi-dev", 2, 256);
    let c = gpuburst(
        &m,
        &[
            "--device", "0,1", "--mem", "16MiB", "--bursts", "2", "--gpu-ms", "30", "--cpu-ms",
            "10", "--verify", "--json", "--name", "md",
        ],
    );
    let pid = c.id();
    let (ok, code, t) = finish(c);
    assert!(ok, "exit {code:?}: {t}");
    assert_eq!(bursts(&t), 2, "{t}");
    // 16 MiB per device: three 64 KiB allocations and one of the rest, on each.
    let ready = event(&t, "ready");
    assert!(
        ready.contains(&format!("\"mem_bytes\":{}", 16 << 20)),
        "{ready}"
    );
    assert!(ready.contains("\"allocations\":8"), "{ready}");
    assert!(ready.contains("\"devices\":2"), "{ready}");
    let verify = event(&t, "verify");
    assert!(verify.contains("\"ok\":true"), "{verify}");
    assert!(verify.contains("\"allocations\":8"), "{verify}");

    let recs = m.read_trace();
    for dev in [0, 1] {
        // Fill: 4 allocations; each burst: 4 adds; each --verify and the final one:
        // 4 checksums; each burst: a probe and spins.
        assert_eq!(kernels_on(&recs, pid, dev, "kiwi_fill"), 4, "device {dev}");
        assert_eq!(kernels_on(&recs, pid, dev, "kiwi_add"), 8, "device {dev}");
        assert_eq!(
            kernels_on(&recs, pid, dev, "kiwi_checksum"),
            12,
            "device {dev}"
        );
        assert!(
            kernels_on(&recs, pid, dev, "kiwi_spin") >= 2 * 2,
            "device {dev}: {recs:?}"
        );
    }
    // Device 0 first: its burst-0 probe is waited for before device 1's is queued.
    let (p0, p1) = (first_spin(&recs, pid, 0), first_spin(&recs, pid, 1));
    assert!(p0.end_ns <= p1.start_ns, "{p0:?} {p1:?}");
}

#[test]
fn two_programs_with_opposite_device_orders_fit_and_verify() {
    // 400 MiB per device each: 800 MiB of each 1 GiB GPU.
    let m = machine("multi-dev-pair", 2, 1024);
    let args = [
        "--mem", "400MiB", "--bursts", "3", "--gpu-ms", "60", "--cpu-ms", "40", "--json",
    ];
    let a = gpuburst(
        &m,
        &[
            &args[..],
            &["--device", "0,1", "--name", "a", "--seed", "1"],
        ]
        .concat(),
    );
    let b = gpuburst(
        &m,
        &[
            &args[..],
            &["--device", "1,0", "--name", "b", "--seed", "2"],
        ]
        .concat(),
    );
    let (pa, pb) = (a.id(), b.id());
    let (ok_a, code_a, ta) = finish(a);
    let (ok_b, code_b, tb) = finish(b);
    assert!(ok_a, "a: exit {code_a:?}: {ta}");
    assert!(ok_b, "b: exit {code_b:?}: {tb}");
    for t in [&ta, &tb] {
        assert_eq!(bursts(t), 3, "{t}");
        let ready = event(t, "ready");
        assert!(
            ready.contains(&format!("\"mem_bytes\":{}", 400u64 << 20)),
            "{ready}"
        );
        // 400 MiB: three of 64 KiB and two chunks, per device.
        assert!(ready.contains("\"allocations\":10"), "{ready}");
        let verify = event(t, "verify");
        assert!(
            verify.contains("\"ok\":true") && verify.contains("\"allocations\":10"),
            "{verify}"
        );
    }
    let recs = m.read_trace();
    for (pid, first, second) in [(pa, 0, 1), (pb, 1, 0)] {
        for dev in [0, 1] {
            assert_eq!(
                kernels_on(&recs, pid, dev, "kiwi_add"),
                3 * 5,
                "{pid} {dev}"
            );
        }
        // The listed order: the first device's probe completes before the second's.
        let (x, y) = (
            first_spin(&recs, pid, first),
            first_spin(&recs, pid, second),
        );
        assert!(x.end_ns <= y.start_ns, "{pid}: {x:?} {y:?}");
    }
    // Each GPU is still shared one kernel at a time.
    for dev in [0, 1] {
        assert!(
            trace::first_overlap(&recs, pa, pb, Some(dev), 0).is_none(),
            "kernels overlapped on device {dev}: {:?}",
            trace::first_overlap(&recs, pa, pb, Some(dev), 0)
        );
    }
}

#[test]
fn bad_device_lists_are_refused_with_exit_1() {
    let m = machine("multi-dev-usage", 2, 64);
    for bad in ["0,0", "0,", "x", ",1", "1,1", "0,,1", "-1"] {
        let (ok, code, t) = finish(gpuburst(&m, &["--device", bad, "--mem", "1MiB"]));
        assert!(!ok && code == Some(1), "--device {bad}: exit {code:?}: {t}");
        assert!(t.contains("--device"), "--device {bad}: {t}");
        assert_eq!(t.trim_end().lines().count(), 1, "--device {bad}: {t}");
    }
    // A device the machine does not have is the driver's error (exit 2).
    let (ok, code, t) = finish(gpuburst(
        &m,
        &[
            "--device", "0,2", "--mem", "1MiB", "--bursts", "1", "--gpu-ms", "1",
        ],
    ));
    assert!(!ok && code == Some(2), "exit {code:?}: {t}");
    assert!(t.contains("CUDA_ERROR_INVALID_DEVICE"), "{t}");
}

#[test]
fn verification_on_several_devices_names_the_corrupted_one() {
    // --inject-fault changes memory on the first listed device.
    let m = machine("multi-dev-corrupt", 2, 64);
    let (ok, code, t) = finish(gpuburst(
        &m,
        &[
            "--device",
            "1,0",
            "--mem",
            "8MiB",
            "--bursts",
            "1",
            "--gpu-ms",
            "5",
            "--inject-fault",
        ],
    ));
    assert!(!ok && code == Some(3), "exit {code:?}: {t}");
    assert!(t.contains("verification failed: device 1,"), "{t}");
}
