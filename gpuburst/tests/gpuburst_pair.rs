//! Two gpuburst processes on one simulated 1 GiB GPU: 400 MiB each fit and share
//! the GPU side by side (their kernels interleave but never overlap); 700 MiB each
//! do not fit, and without Kiwi the second fails with out-of-memory.

use std::io::{BufRead, BufReader};
use std::time::{Duration, Instant};

mod common;

use common::{finish, gpuburst};
use kiwi_sim_core::harness::SimMachine;
use kiwi_sim_core::trace;

fn bursts(out: &str) -> usize {
    out.lines()
        .filter(|l| l.contains("\"event\":\"burst\""))
        .count()
}

#[test]
fn two_400mib_programs_fit_on_a_1gib_gpu_and_share_it() {
    let m = SimMachine::new("pair-fit", 1, 1 << 30).unwrap_or_else(|e| panic!("{e}"));
    // Both start their bursts at the same moment, however unevenly the two processes
    // start up and fill their memory (a cold first run in CI skews them by a second).
    let start = (kiwi_sim_core::trace::monotonic_ns() + 3_000_000_000).to_string();
    let args = [
        "--mem",
        "400MiB",
        "--bursts",
        "3",
        "--gpu-ms",
        "60",
        "--cpu-ms",
        "40",
        "--json",
        "--start-at-ns",
        &start,
    ];
    let a = gpuburst(&m, &[&args[..], &["--name", "a", "--seed", "1"]].concat());
    let b = gpuburst(&m, &[&args[..], &["--name", "b", "--seed", "2"]].concat());
    let (pa, pb) = (a.id(), b.id());
    let (ok_a, _, ta) = finish(a);
    let (ok_b, _, tb) = finish(b);
    assert!(ok_a, "{ta}");
    assert!(ok_b, "{tb}");
    for t in [&ta, &tb] {
        assert_eq!(bursts(t), 3, "{t}");
        assert!(
            t.contains("\"event\":\"verify\"") && t.contains("\"ok\":true"),
            "{t}"
        );
    }
    let recs = m.read_trace();
    // The trace helper on the "shared, never concurrent" outcome.
    assert!(
        !trace::ran_concurrently(&recs, pa, pb),
        "kernels overlapped on one GPU"
    );
    assert!(
        trace::spans_overlap(&recs, pa, pb),
        "the two programs did not run side by side"
    );
}

#[test]
fn two_700mib_programs_do_not_fit_and_the_second_gets_out_of_memory() {
    let m = SimMachine::new("pair-oom", 1, 1 << 30).unwrap_or_else(|e| panic!("{e}"));
    let mut a = gpuburst(
        &m,
        &[
            // A long CPU phase keeps it (and its memory) alive while the second starts,
            // however slowly processes start on a loaded machine.
            "--mem", "700MiB", "--bursts", "2", "--gpu-ms", "50", "--cpu-ms", "4000", "--json",
            "--name", "a",
        ],
    );
    // Wait until the first holds its memory.
    let stdout = a.stdout.take().unwrap();
    let mut lines = BufReader::new(stdout).lines();
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut seen = String::new();
    loop {
        assert!(
            Instant::now() < deadline,
            "first program never got ready: {seen}"
        );
        let l = lines.next().expect("first program exited early").unwrap();
        seen.push_str(&l);
        if l.contains("\"event\":\"ready\"") {
            break;
        }
    }
    let b = gpuburst(
        &m,
        &["--mem", "700MiB", "--bursts", "2", "--json", "--name", "b"],
    );
    let (ok_b, code_b, tb) = finish(b);
    assert!(!ok_b, "second program must not fit: {tb}");
    assert_eq!(code_b, Some(2), "{tb}");
    assert!(tb.contains("CUDA_ERROR_OUT_OF_MEMORY"), "{tb}");
    let rest: Vec<String> = lines.map_while(Result::ok).collect();
    let (ok_a, _, ta) = finish(a);
    assert!(ok_a, "{ta}");
    assert!(rest.iter().any(|l| l.contains("\"ok\":true")), "{rest:?}");
}

#[test]
fn programs_on_two_gpus_run_kernels_at_the_same_time() {
    let m = SimMachine::new("two-gpus", 2, 256 << 20).unwrap_or_else(|e| panic!("{e}"));
    // A start gate, not luck: on a loaded CI host one process started its bursts after
    // the other had finished them.
    let start = (kiwi_sim_core::trace::monotonic_ns() + 3_000_000_000).to_string();
    let args = [
        "--mem",
        "16MiB",
        "--bursts",
        "2",
        "--gpu-ms",
        "300",
        "--cpu-ms",
        "10",
        "--json",
        "--start-at-ns",
        &start,
    ];
    let a = gpuburst(&m, &[&args[..], &["--device", "0"]].concat());
    let b = gpuburst(&m, &[&args[..], &["--device", "1"]].concat());
    let (pa, pb) = (a.id(), b.id());
    let (ok_a, _, ta) = finish(a);
    let (ok_b, _, tb) = finish(b);
    assert!(ok_a && ok_b, "{ta}\n{tb}");
    let recs = m.read_trace();
    assert!(
        recs.iter().any(|r| r.pid == pb && r.device == 1),
        "{recs:?}"
    );
    // The trace helper on the "concurrent" outcome: different GPUs do overlap.
    assert!(
        trace::ran_concurrently(&recs, pa, pb),
        "no overlap across two GPUs"
    );
    assert!(trace::first_overlap(&recs, pa, pb, Some(0), 0).is_none());
}

#[test]
fn bad_arguments_are_refused_with_exit_1() {
    let m = SimMachine::new("usage", 1, 64 << 20).unwrap_or_else(|e| panic!("{e}"));
    let (ok, code, t) = finish(gpuburst(&m, &["--mem", "lots"]));
    assert!(!ok && code == Some(1), "{t}");
    assert!(t.contains("--mem"), "{t}");
}

#[test]
fn verification_catches_memory_changed_behind_the_programs_back() {
    let m = SimMachine::new("corrupt", 1, 64 << 20).unwrap_or_else(|e| panic!("{e}"));
    let (ok, code, t) = finish(gpuburst(
        &m,
        &[
            "--mem",
            "8MiB",
            "--bursts",
            "1",
            "--gpu-ms",
            "5",
            "--inject-fault",
        ],
    ));
    assert!(!ok && code == Some(3), "{t}");
    assert!(t.contains("verification failed"), "{t}");
}
