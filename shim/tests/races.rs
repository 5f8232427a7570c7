//! Races and stale state (#13 item 5), with real processes on the GPU simulator under
//! a real `kiwi-arbiter`.
//!
//! Needs the workspace built (`cargo build --workspace --all-targets`), `gcc`, and
//! `cuda.h` (fetched once by `scripts/fetch-cuda-h.sh`).

mod common;
use common::*;

use std::process::Command;
use std::time::Duration;

use kiwi_sim_core::harness::SimMachine;
use kiwi_tests::Arbiter;

/// A program that destroyed a context before working is dropped for a program over
/// capacity with it: the shim swaps and drains in the live context, so both take
/// turns and keep every byte. With the first context remembered for ever, the
/// swap-out ran in no context (CUDA error 201): nothing was swapped and the other
/// program never fit.
fn context_churn_then_forced_drops(mode: &str) {
    beside_forced_drops("ctx_churn", &[mode, "500", "20"], &format!("churn-{mode}"));
}

/// Runs the driver-API test program `name` with `args` on a 1 GiB GPU (simulated
/// machine `tag`) beside gpuburst over capacity (500 MiB each, TQ 0.3 s), so drops
/// come while it works: both must finish and verify, and the program must have
/// swapped out.
fn beside_forced_drops(name: &str, args: &[&str], tag: &str) {
    let dir = tempfile::tempdir().unwrap();
    let Some(exe) = compile(name, dir.path()) else {
        return;
    };
    let m = SimMachine::new(tag, 1, 1 << 30).unwrap();
    let arb = Arbiter::start(&["--tq", "0.3"]);
    let mut a = Command::new(&exe);
    let a = under_kiwi_on(a.args(args), &m, &arb)
        .spawn()
        .unwrap_or_else(|e| panic!("spawn {name}: {e}"));
    std::thread::sleep(Duration::from_millis(300));
    let mut b = gpuburst("500MiB", 4, 100);
    let b = under_kiwi_on(&mut b, &m, &arb)
        .spawn()
        .expect("spawn gpuburst");
    let pa = a.id();
    let (oa, ob) = (finish(a), finish(b));
    assert_eq!(oa.status.code(), Some(0), "{}\n{}", text(&oa), text(&ob));
    assert!(String::from_utf8_lossy(&oa.stdout).contains("OK"));
    assert_eq!(ob.status.code(), Some(0), "{}", text(&ob));
    let out = swapped_out(&arb, pa);
    assert!(
        out >= 100 << 20,
        "the program swapped out {out} bytes\n{}\n{}",
        text(&oa),
        text(&ob)
    );
}

#[test]
fn a_destroyed_context_then_forced_drops_swaps_in_the_live_context() {
    context_churn_then_forced_drops("destroy");
}

/// Work in flight in an older context while a newer one lives: a drop's drain waits
/// for every live context of the process on the GPU, not only the newest, so the
/// swap-out never takes memory from under a queued kernel. The program queues a
/// 150 ms spin and a fill in its older context each burst while gpuburst over
/// capacity forces drops; both verify every word. Draining the newest context only,
/// the fill ran on memory swapped out from under it (`CUDA_ERROR_ILLEGAL_ADDRESS`).
#[test]
fn work_in_an_older_context_is_drained_before_a_swap_out() {
    older_context_then_forced_drops(&[]);
}

/// The same where the newer context was destroyed first: the older one, still live,
/// is the one the shim then drains and swaps in (it drained the primary context,
/// which has none of the program's work: `CUDA_ERROR_ILLEGAL_ADDRESS`).
#[test]
fn after_the_newest_context_is_destroyed_the_older_one_is_drained() {
    older_context_then_forced_drops(&["destroy-newer"]);
}

fn older_context_then_forced_drops(extra: &[&str]) {
    let mut args = vec!["500", "12"];
    args.extend_from_slice(extra);
    beside_forced_drops(
        "older_context",
        &args,
        &format!("older-context{}", extra.len()),
    );
}

/// A destroyed context's modules and limits leave the GPU with it: what they were
/// counted as memory no swap frees is given back (the arbiter's `unswappable`
/// figure for the program falls back), or the program would be scheduled for good
/// as if 256 MiB more of the GPU were taken. The module is loaded lazily (its code
/// at its first function) and the heap limit takes 64 MiB.
#[test]
fn a_destroyed_contexts_modules_and_limits_are_no_longer_counted() {
    gone_contexts_modules_and_limits_are_no_longer_counted("modules");
}

/// The same where the context is the primary one and `cuDevicePrimaryCtxReset`
/// (`cudaDeviceReset`) destroys it: without the reset hook the module and the heap
/// stayed counted.
#[test]
fn a_reset_primary_contexts_modules_and_limits_are_no_longer_counted() {
    gone_contexts_modules_and_limits_are_no_longer_counted("reset-modules");
}

/// The same where the application only releases the primary context's last
/// reference: the driver resets it then (the simulator used to keep it, and the
/// shim to count its module and heap).
#[test]
fn a_released_primary_contexts_modules_and_limits_are_no_longer_counted() {
    gone_contexts_modules_and_limits_are_no_longer_counted("release-modules");
}

fn gone_contexts_modules_and_limits_are_no_longer_counted(mode: &str) {
    let dir = tempfile::tempdir().unwrap();
    let Some(exe) = compile("ctx_churn", dir.path()) else {
        return;
    };
    let m = SimMachine::new(&format!("churn-{mode}"), 1, 1 << 30)
        .unwrap()
        .with_env("KIWI_SIM_MODULE_MEMORY", &(256u64 << 20).to_string());
    let arb = Arbiter::start(&["--tq", "0.3"]);
    let mut a = Command::new(&exe);
    let a = under_kiwi_on(a.args([mode, "64", "20"]), &m, &arb)
        .spawn()
        .expect("spawn ctx_churn");
    let pa = a.id();
    let oa = finish(a);
    assert_eq!(oa.status.code(), Some(0), "{}", text(&oa));
    let figures = unswappable_figures(&arb, pa);
    let (most, last) = (
        figures.iter().copied().max().unwrap_or(0),
        figures.last().copied().unwrap_or(0),
    );
    assert!(
        most >= 256 << 20,
        "the module was never counted: {figures:?}\n{}",
        text(&oa)
    );
    assert!(
        last + (256 << 20) <= most,
        "the destroyed context's module is still counted: {figures:?}\n{}",
        text(&oa)
    );
    // One context lives at the end, counted once: as at the start.
    let first = figures.first().copied().unwrap_or(0);
    assert_eq!(last, first, "{figures:?}\n{}", text(&oa));
    if mode == "modules" {
        // Once the second context was made, it counted as much as the first (before
        // the module and the heap); it used to count nothing.
        assert!(
            figures.contains(&(2 * first)),
            "the second context was not counted: {figures:?}\n{}",
            text(&oa)
        );
    }
}
