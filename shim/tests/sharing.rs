//! What an application asks about its memory and grants on it survives swaps, and a
//! failed drain never evicts (#13 items 5 and 6): real processes on the GPU simulator
//! under a real `kiwi-arbiter`, driver-API programs of `tests/c` built against
//! NVIDIA's `cuda.h`.
//!
//! Needs the workspace built (`cargo build --workspace --all-targets`), `gcc`, and
//! `cuda.h` (fetched once by `scripts/fetch-cuda-h.sh`).

mod common;
use common::*;

use std::process::Command;
use std::time::{Duration, Instant};

use kiwi_protocol::EventKind;
use kiwi_sim_core::harness::SimMachine;
use kiwi_tests::Arbiter;

/// Waits (up to 30 s) until `pid` swapped out at least `bytes`.
fn wait_swapped_out(arb: &Arbiter, pid: u32, bytes: u64) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while swapped_out(arb, pid) < bytes {
        assert!(
            Instant::now() < deadline,
            "pid {pid} swapped out only {} bytes in 30 s",
            swapped_out(arb, pid)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `cuPointerGetAttribute(s)` and `cuMemGetAddressRange` answer for a shim allocation
/// with its own range, device and type, for a pointer inside it, resident and swapped
/// out. The driver alone answered with a 64 MiB (or 2 MiB) mapping's range while
/// resident, and "invalid value" while swapped out.
#[test]
fn pointer_attributes_are_the_allocations_own_even_swapped_out() {
    let dir = tempfile::tempdir().unwrap();
    let Some(exe) = compile("ptr_attrs", dir.path()) else {
        return;
    };
    let m = SimMachine::new("ptrattr", 1, 1 << 30).unwrap();
    let arb = Arbiter::start(&["--tq", "0.2"]);
    let mut a = Command::new(&exe);
    let mut a = Stepped::spawn(under_kiwi_on(a.arg("400"), &m, &arb));
    a.wait_for("READY");
    let b = notebook(&m, &arb, 600);
    // The 2 MiB chunk and the first 64 MiB segment go first (least recently mapped).
    wait_swapped_out(&arb, a.child.id(), 66 << 20);
    a.go();
    let (oa, ob) = (a.finish(), finish(b));
    assert_eq!(oa.status.code(), Some(0), "{}", text(&oa));
    assert!(String::from_utf8_lossy(&oa.stdout).contains("OK"));
    assert_eq!(ob.status.code(), Some(0), "{}", text(&ob));
}

/// Another GPU's access to a shim allocation (`cuMemSetAccess`, as NCCL and peer
/// copies grant it) is re-applied after a swap: a copy from GPU 1's context out of
/// GPU 0's memory works before and after the program was swapped out on GPU 0. The
/// shim's new mappings granted GPU 0 only: the copy after the swap-in failed with
/// `CUDA_ERROR_INVALID_VALUE`.
#[test]
fn another_gpus_access_survives_a_swap() {
    let dir = tempfile::tempdir().unwrap();
    let Some(exe) = compile("peer_access", dir.path()) else {
        return;
    };
    let m = SimMachine::new("peeracc", 2, 1 << 30).unwrap();
    let arb = Arbiter::start(&["--tq", "0.2"]);
    let mut a = Command::new(&exe);
    let mut a = Stepped::spawn(under_kiwi_on(a.arg("400"), &m, &arb));
    a.wait_for("READY");
    // gpuburst works on GPU 0 by default: 400 + 600 MiB and two 48 MiB contexts do
    // not fit in 1 GiB.
    let b = notebook(&m, &arb, 600);
    // Its first 64 MiB segment goes first (least recently mapped).
    wait_swapped_out(&arb, a.child.id(), 64 << 20);
    a.go();
    let (oa, ob) = (a.finish(), finish(b));
    assert_eq!(oa.status.code(), Some(0), "{}", text(&oa));
    assert!(String::from_utf8_lossy(&oa.stdout).contains("OK"));
    assert_eq!(ob.status.code(), Some(0), "{}", text(&ob));
}

/// A drop that comes while work is still queued, and whose drain fails (the
/// simulator's `KIWI_SIM_FAIL_SYNC` fails the shim's `cuCtxSynchronize` at once, the
/// work going on): nothing is swapped out then (the release reports the memory still
/// resident); the arbiter's reclaim drains again and evicts once the work is done,
/// and both programs keep every byte. Evicting after the failed drain copied the
/// memory out while the queued memsets still wrote it and unmapped it under them: a
/// sticky illegal address (or stale bytes) for the program.
#[test]
fn a_failed_drain_does_not_evict() {
    let dir = tempfile::tempdir().unwrap();
    let Some(exe) = compile("drain_fail", dir.path()) else {
        return;
    };
    // Memsets of 400 MiB take 0.4 s each: four are queued when the drop comes.
    let m = SimMachine::new("drainfail", 1, 1 << 30)
        .unwrap()
        .with_env("KIWI_SIM_HBM_GBPS", "1");
    let arb = Arbiter::start(&["--tq", "0.2"]);
    let fail = dir.path().join("fail-next-sync");
    let mut a = Command::new(&exe);
    let a = under_kiwi_on(a.arg("400"), &m, &arb)
        .env("KIWI_SIM_FAIL_SYNC", &fail)
        // No early release, and a fixed threshold (nothing to learn): its idle probe
        // would meet the armed failure first.
        .env("KIWI_IDLE_MS", "600000")
        .env("KIWI_IDLE_MIN_MS", "600000");
    let mut a = Stepped::spawn(a);
    a.wait_for("QUEUED");
    std::fs::write(&fail, b"").unwrap();
    // 400 + 600 MiB and two 48 MiB contexts do not fit in 1 GiB.
    let b = notebook(&m, &arb, 600);
    let ob = finish(b);
    let pid = a.child.id();
    a.go();
    let oa = a.finish();
    assert!(!fail.exists(), "the drain never met the injected failure");
    assert_eq!(oa.status.code(), Some(0), "{}", text(&oa));
    assert!(String::from_utf8_lossy(&oa.stdout).contains("OK"));
    assert_eq!(ob.status.code(), Some(0), "{}", text(&ob));
    let err = String::from_utf8_lossy(&oa.stderr);
    assert!(
        err.contains("draining before release failed"),
        "{}",
        text(&oa)
    );
    // It released with its memory resident, and swapped out later (the reclaim).
    let clients = clients_of(&arb, pid);
    let events = arb.events();
    let mine = |e: &&kiwi_protocol::Event| e.client.is_some_and(|c| clients.contains(&c));
    let first_release = events
        .iter()
        .filter(mine)
        .find_map(|e| match e.kind {
            EventKind::Release { resident_bytes, .. } => Some(resident_bytes),
            _ => None,
        })
        .expect("a release");
    assert!(
        first_release >= 400 << 20,
        "released with {first_release} bytes resident"
    );
}
