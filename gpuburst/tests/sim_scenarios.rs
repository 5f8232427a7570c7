//! The simulator's behaviours, exercised by real processes through `cuprobe`
//! (which loads `libcuda.so.1` the way the CUDA runtime does).

use std::io::{BufRead, BufReader};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use kiwi_sim_core::harness::SimMachine;
use kiwi_sim_core::trace;

const PROBE: &str = env!("CARGO_BIN_EXE_cuprobe");

fn machine(tag: &str, gpus: u32, mib: u64) -> SimMachine {
    SimMachine::new(tag, gpus, mib << 20).unwrap_or_else(|e| panic!("{e}"))
}

fn probe(m: &SimMachine, args: &[&str]) -> Output {
    m.apply(&mut Command::new(PROBE))
        .args(args)
        .output()
        .expect("running cuprobe")
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

#[test]
fn vmm_map_unmap_access_and_illegal_address() {
    let m = machine("vmm", 1, 256);
    let o = probe(&m, &["vmm"]);
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    for step in [
        "ok map",
        "ok release-before-unmap",
        "ok kernel across two mappings",
        "ok remap keeps contents",
        "ok no access -> illegal address",
        "ok unmapped -> illegal address (sticky)",
        "PASS vmm",
    ] {
        assert!(t.contains(step), "missing {step:?} in:\n{t}");
    }
}

#[test]
fn get_proc_address_base_names_versions_and_per_thread_variants() {
    let m = machine("procaddr", 1, 64);
    let o = probe(&m, &["procaddr"]);
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    assert!(t.contains("ok per-thread default stream variants"), "{t}");
    assert!(t.contains("PASS procaddr"), "{t}");
}

/// Waits until `child` prints a line containing `what` (or fails after `secs`).
fn wait_for_line(child: &mut std::process::Child, what: &str, secs: u64) -> String {
    let out = child.stdout.take().expect("piped stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    let needle = what.to_string();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            let hit = line.contains(&needle);
            let _ = tx.send(line);
            if hit {
                break;
            }
        }
    });
    let deadline = Instant::now() + Duration::from_secs(secs);
    let mut seen = String::new();
    while Instant::now() < deadline {
        if let Ok(l) = rx.recv_timeout(Duration::from_millis(100)) {
            seen.push_str(&l);
            seen.push('\n');
            if l.contains(what) {
                return seen;
            }
        }
    }
    let _ = child.kill();
    panic!("no line with {what:?} within {secs}s; got:\n{seen}");
}

#[test]
fn capacity_is_shared_across_processes_and_reclaimed_after_sigkill() {
    let m = machine("capacity", 1, 1024);
    let mut holder = m
        .apply(&mut Command::new(PROBE))
        .args(["alloc", "--mib", "600", "--hold-ms", "60000"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    wait_for_line(&mut holder, "allocated 600 MiB", 30);

    // 600 + 600 MiB do not fit in 1 GiB: the second process is refused.
    let o = probe(&m, &["alloc", "--mib", "600"]);
    let t = text(&o);
    assert_eq!(o.status.code(), Some(2), "{t}");
    assert!(t.contains("CUDA_ERROR_OUT_OF_MEMORY"), "{t}");
    // While a smaller one fits next to it.
    let o = probe(&m, &["alloc", "--mib", "300"]);
    assert!(o.status.success(), "{}", text(&o));

    // SIGKILL frees the holder's memory, as a real driver does.
    holder.kill().unwrap();
    holder.wait().unwrap();
    let o = probe(&m, &["alloc", "--mib", "600"]);
    assert!(
        o.status.success(),
        "memory of the killed process was not reclaimed: {}",
        text(&o)
    );
}

#[test]
fn kernels_of_two_processes_never_overlap_on_one_gpu() {
    let m = machine("exclusion", 1, 64);
    let spawn = || {
        m.apply(&mut Command::new(PROBE))
            .args(["spin", "--ms", "10", "--count", "10"])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let t0 = Instant::now();
    let (a, b) = (spawn(), spawn());
    let (pa, pb) = (a.id(), b.id());
    let oa = a.wait_with_output().unwrap();
    let ob = b.wait_with_output().unwrap();
    let wall = t0.elapsed();
    assert!(
        oa.status.success() && ob.status.success(),
        "{}{}",
        text(&oa),
        text(&ob)
    );
    let recs = m.read_trace();
    assert_eq!(recs.iter().filter(|r| r.pid == pa).count(), 10);
    assert_eq!(recs.iter().filter(|r| r.pid == pb).count(), 10);
    for r in &recs {
        assert!(
            r.end_ns - r.start_ns >= 10_000_000,
            "kernel shorter than modelled: {r:?}"
        );
    }
    assert!(
        trace::first_overlap(&recs, pa, pb, None, 0).is_none(),
        "kernels overlapped: {:?}",
        trace::first_overlap(&recs, pa, pb, None, 0)
    );
    // 20 kernels of 10 ms, one at a time.
    assert!(wall >= Duration::from_millis(200), "{wall:?}");
}

#[test]
fn a_full_launch_queue_blocks_and_loses_nothing() {
    // 3000 launches through a 1024-deep queue: submissions block, every kernel runs.
    let m = machine("backpressure", 1, 64);
    let o = probe(&m, &["spin", "--ms", "0", "--count", "3000"]);
    assert!(o.status.success(), "{}", text(&o));
    let recs = m.read_trace();
    assert_eq!(recs.iter().filter(|r| r.name == "kiwi_spin").count(), 3000);
}

#[test]
fn launch_overhead_is_small() {
    let m = machine("launch-rate", 1, 64);
    let o = probe(&m, &["launch-rate", "--count", "1000"]);
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    let ns: f64 = t
        .split_whitespace()
        .find_map(|w| w.strip_prefix("launch_ns="))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no launch_ns in {t}"));
    println!("{}", t.lines().next().unwrap_or(""));
    // ~70 ns in release; debug builds of the probe and contention stay far below.
    assert!(ns < 50_000.0, "a queued launch costs {ns} ns");
}

#[test]
fn streams_events_and_cross_context_waits_keep_order() {
    let m = machine("streams", 1, 64);
    let o = probe(&m, &["streams"]);
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    for step in [
        "ok query while pending",
        "ok cross-context stream wait",
        "ok event elapsed time",
        "PASS streams",
    ] {
        assert!(t.contains(step), "missing {step:?} in:\n{t}");
    }
}

#[test]
fn a_process_killed_inside_a_kernel_releases_the_gpu() {
    let m = machine("killed-in-kernel", 1, 64);
    // A holds the GPU with a 20 s kernel...
    let mut a = m
        .apply(&mut Command::new(PROBE))
        .args(["spin", "--ms", "20000", "--count", "1"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(500));
    // ...and dies inside it.
    a.kill().unwrap();
    a.wait().unwrap();
    let t = Instant::now();
    let o = probe(&m, &["spin", "--ms", "10", "--count", "2"]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "the dead process's kernel lock was not released: {:?}",
        t.elapsed()
    );
}
