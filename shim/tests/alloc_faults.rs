//! Allocation under fault injection and a reset context (#13 item 5), with real
//! processes on the strict GPU simulator under a real `kiwi-arbiter`: the simulator's
//! `KIWI_SIM_FAIL_MEMCREATE=N` fails every Nth `cuMemCreate` of a process with out
//! of memory, as when others' memory fills the GPU.
//!
//! Needs the workspace built (`cargo build --workspace --all-targets`), `gcc`, and
//! `cuda.h` (fetched once by `scripts/fetch-cuda-h.sh`).

mod common;
use common::*;

use std::process::{Command, Output};
use std::time::Duration;

use kiwi_sim_core::harness::SimMachine;
use kiwi_tests::Arbiter;

fn no_illegal_address(o: &Output) {
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(
        !all.contains("ILLEGAL_ADDRESS") && !all.contains("error 700"),
        "{}",
        text(o)
    );
}

/// A program that allocates between kernels while it holds the GPU, and a program
/// over a 512 MiB GPU's capacity with it, take turns (forced drops every 0.3 s);
/// every fourth `cuMemCreate` of the first fails. Such an allocation falls back to
/// unbacked memory, backed before any work runs (the gate closes over it, under the
/// allocator's lock, until the swap-in is retried), and its swap-ins stop short of
/// room midway and are retried. It never runs work over unbacked memory (a sticky
/// illegal address, or a memset refused) and keeps every byte; the other is
/// unaffected.
#[test]
fn memcreate_out_of_memory_under_turns_never_exposes_unbacked_memory() {
    let dir = tempfile::tempdir().unwrap();
    let Some(exe) = compile("alloc_churn", dir.path()) else {
        return;
    };
    let m = SimMachine::new("memcreate-oom", 1, 512 << 20).unwrap();
    let arb = Arbiter::start(&["--tq", "0.3"]);
    let mut a = Command::new(&exe);
    let a = under_kiwi_on(a.args(["150", "200"]), &m, &arb)
        .env("KIWI_SIM_FAIL_MEMCREATE", "4")
        .env("KIWI_LOG", "debug")
        .spawn()
        .expect("spawn alloc_churn");
    std::thread::sleep(Duration::from_millis(300));
    let mut b = gpuburst("300MiB", 8, 40);
    let b = under_kiwi_on(&mut b, &m, &arb)
        .spawn()
        .expect("spawn gpuburst");
    let pa = a.id();
    let (oa, ob) = (finish(a), finish(b));
    no_illegal_address(&oa);
    no_illegal_address(&ob);
    assert_eq!(
        oa.status.code(),
        Some(0),
        "A\n{}\nB\n{}",
        text(&oa),
        text(&ob)
    );
    assert!(String::from_utf8_lossy(&oa.stdout).contains("OK"));
    assert_eq!(
        ob.status.code(),
        Some(0),
        "B\n{}\nA\n{}",
        text(&ob),
        text(&oa)
    );
    assert!(
        swapped_out(&arb, pa) > 0,
        "A never swapped: no turns were taken\n{}",
        text(&oa)
    );
    // The faults were met: an allocation was left unbacked, or a swap-in stopped
    // short of room, at least once (which one depends on where the fourth
    // `cuMemCreate` falls; a swap-in may also absorb one by retrying).
    let err = String::from_utf8_lossy(&oa.stderr);
    assert!(
        err.contains("left unbacked until the next turn") || err.contains("no room to swap in yet"),
        "{}",
        text(&oa)
    );
}

/// A program that reset its primary context (`cuDevicePrimaryCtxReset`, as
/// `cudaDeviceReset` does) and then works in a context of its own is dropped for a
/// program over capacity with it: the shim swaps and drains in the application's live
/// context, not the reset one, so both take turns and keep every byte.
#[test]
fn a_reset_primary_context_then_forced_drops_swaps_in_the_live_context() {
    let dir = tempfile::tempdir().unwrap();
    let Some(exe) = compile("reset_then_work", dir.path()) else {
        return;
    };
    let m = SimMachine::new("reset", 1, 512 << 20).unwrap();
    let arb = Arbiter::start(&["--tq", "0.3"]);
    let mut a = Command::new(&exe);
    let a = under_kiwi_on(a.args(["200", "12"]), &m, &arb)
        .spawn()
        .expect("spawn reset_then_work");
    std::thread::sleep(Duration::from_millis(300));
    let mut b = gpuburst("300MiB", 6, 40);
    let b = under_kiwi_on(&mut b, &m, &arb)
        .spawn()
        .expect("spawn gpuburst");
    let pa = a.id();
    let (oa, ob) = (finish(a), finish(b));
    assert_eq!(oa.status.code(), Some(0), "{}", text(&oa));
    assert!(String::from_utf8_lossy(&oa.stdout).contains("OK"));
    assert_eq!(ob.status.code(), Some(0), "{}", text(&ob));
    let out = swapped_out(&arb, pa);
    assert!(
        out >= 32 << 20,
        "the program swapped out {out} bytes\n{}\n{}",
        text(&oa),
        text(&ob)
    );
}
