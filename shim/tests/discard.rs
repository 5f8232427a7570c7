//! The discard hint (issue #26): `kiwiMemDiscard` and the hint questions, end to end.
//! Real processes (`tests/c/discard.c`, a JAX-like program: one large allocation, a
//! small part used) under `kiwictl run` on the GPU simulator and a real
//! `kiwi-arbiter`; the bytes each
//! swap-out moved come from the arbiter's event log (`swap_out`, what the shim
//! reported it copied).
//!
//! Needs the workspace built, `gcc`, and `cuda.h` (`scripts/fetch-cuda-h.sh`).

mod common;
use common::*;

use std::path::Path;
use std::time::Duration;

use kiwi_protocol::EventKind;
use kiwi_sim_core::harness::SimMachine;
use kiwi_tests::Arbiter;

const MIB: u64 = 1 << 20;

/// Runs two `discard` programs (`a` and `b`: mode, MiB, used MiB) that take turns on
/// `gpu` bytes: A's first burst, then B's request (it waits for A: the start gate),
/// then both run `rounds` bursts with idle pauses between, handing the GPU over at
/// each. Returns each one's swap-outs (bytes), after both printed OK.
fn pair(
    tag: &str,
    gpu: u64,
    a: (&str, &str, &str),
    b: (&str, &str, &str),
    rounds: &str,
) -> Option<[Vec<u64>; 2]> {
    let dir = tempfile::tempdir().unwrap();
    let exe = compile("discard", dir.path())?;
    let m = SimMachine::new(tag, 1, gpu).unwrap();
    let arb = Arbiter::start(&["--tq", "5"]);
    let spawn = |exe: &Path, (mode, mib, used): (&str, &str, &str)| {
        let mut c = kiwictl_run(exe, &m, &arb);
        c.args([mode, mib, used, rounds])
            .env("KIWI_IDLE_MS", "50")
            // The answer must come within the swap-out's wait: 10 ms (the default)
            // is plenty for the thread alone, but on a loaded 2-core machine a woken
            // thread can wait longer for a core. The subject here is the mechanism.
            .env("KIWI_HINT_WAIT_MS", "1000");
        Stepped::spawn(&mut c)
    };
    let mut pa = spawn(&exe, a);
    pa.wait_for("RUNNING");
    let mut pb = spawn(&exe, b);
    let (ida, idb) = (pa.child.id(), pb.child.id());
    // B asked for the GPU A holds: they overlap from here on. A, idle at its gate,
    // gives it back first: its first swap-out is the idle one (a burst of A's during
    // that swap-out's question would void its answer: on a loaded machine the answer
    // came 0.2-0.6 s late and overlapped A's go, and the swap-out rightly copied
    // everything).
    let asked = wait_request(&arb, idb, 0);
    wait_event(&arb, "A's release", Duration::from_secs(30), |ev| {
        let a = client_of(ev, ida)?;
        ev.iter()
            .find(|e| {
                e.client == Some(a)
                    && e.seq > asked.seq
                    && matches!(e.kind, EventKind::Release { .. })
            })
            .cloned()
    });
    pa.go();
    pb.wait_for("RUNNING");
    pb.go();
    let (oa, ob) = (pa.finish(), pb.finish());
    for o in [&oa, &ob] {
        assert!(
            o.status.success() && String::from_utf8_lossy(&o.stdout).contains("OK"),
            "{}",
            text(o)
        );
    }
    let ev = arb.events();
    let swaps = |pid: u32| -> Vec<u64> {
        let c = client_of(&ev, pid).expect("registered");
        ev.iter()
            .filter(|e| e.client == Some(c))
            .filter_map(|e| match e.kind {
                EventKind::SwapOut { bytes, .. } => Some(bytes),
                _ => None,
            })
            .collect()
    };
    Some([swaps(ida), swaps(idb)])
}

/// Two JAX-like programs, each allocating 75% of the free memory it is told about and
/// using 64 MiB of it, take turns on a 2 GiB GPU: A answers the shim's questions
/// from a thread (`kiwi_hint_wait`), B discards its unused tail after each burst.
/// Every swap-out moves at most the used bytes and one segment (64 MiB) beside them
/// (the small allocation's chunk, 2 MiB), never the preallocation; the used bytes
/// survive every hand-off. Without the hint each copied what the other lacked, at
/// least ~0.9 GiB.
#[test]
fn a_preallocating_pair_moves_only_its_used_bytes() {
    let Some([a, b]) = pair(
        "discard-pair",
        2 << 30,
        ("hint", "0", "64"),
        ("eager", "0", "64"),
        "6",
    ) else {
        return;
    };
    assert!(
        a.len() >= 2 && b.len() >= 2,
        "they took turns: swap-outs {a:?} {b:?}"
    );
    for bytes in a.iter().chain(&b) {
        assert!(
            *bytes <= 64 * MIB + 2 * MIB,
            "a swap-out moved {} MiB (A {a:?}, B {b:?})",
            bytes / MIB
        );
    }
}

/// Discards that a submission voided lose nothing: A discards its whole 600 MiB
/// allocation, then writes 64 MiB of it, each round; B discards its tail, then
/// launches a kernel over all of it. Both check every byte after several hand-offs
/// (the untouched part of A's must still hold its first fill), and every swap-out
/// copied bytes: the voided discards were not honoured (honoured, the dead segments
/// go first and cost no copy).
#[test]
fn voided_discards_lose_nothing() {
    let Some([a, b]) = pair(
        "discard-void",
        1 << 30,
        ("all-then-part", "600", "64"),
        ("discard-launch", "600", "64"),
        "4",
    ) else {
        return;
    };
    assert!(a.len() >= 2 && b.len() >= 2, "swap-outs {a:?} {b:?}");
    // Honoured, the dead segments would have gone first, uncopied: each partial
    // swap-out (what the other lacked, ~300 MiB) would have copied nothing.
    assert!(
        a.iter().chain(&b).all(|&bytes| bytes > 0),
        "a voided discard was honoured: swap-outs {a:?} {b:?}"
    );
}

/// Bad ranges get `CUDA_ERROR_INVALID_VALUE`: null, empty, past the allocation's
/// end, after it, overflowing, host memory; a good one succeeds.
#[test]
fn bad_ranges_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let Some(exe) = compile("discard", dir.path()) else {
        return;
    };
    let m = SimMachine::new("discard-bad", 1, 1 << 30).unwrap();
    let arb = Arbiter::start(&[]);
    let mut c = kiwictl_run(&exe, &m, &arb);
    c.args(["bad", "100", "0", "0"]);
    let o = finish(c.spawn().unwrap());
    assert!(
        o.status.success() && String::from_utf8_lossy(&o.stdout).contains("OK"),
        "{}",
        text(&o)
    );
}
