//! An UNMANAGED process (no arbiter within `KIWI_ARBITER_TIMEOUT`) behaves exactly as
//! without Kiwi (issue #24): nobody will make room for it, so an allocation that
//! cannot be backed fails at once with the driver's error. It used to "succeed" with
//! a range left unbacked until a turn that never comes, and the first kernel or copy
//! on it failed with `CUDA_ERROR_INVALID_VALUE`.
//!
//! Needs the workspace built (`cargo build --workspace --all-targets`).

mod common;
use common::*;

use std::process::{Command, Output, Stdio};

use kiwi_sim_core::harness::SimMachine;
use kiwi_tests::bin;

/// gpuburst with `mem` on machine `m`, output piped.
fn gpuburst(m: &SimMachine, mem: &str) -> Command {
    let mut c = Command::new(bin("gpuburst"));
    c.args(["--mem", mem, "--bursts", "1", "--gpu-ms", "1", "--verify"]);
    m.apply(&mut c)
        .env_remove("LD_PRELOAD")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c
}

#[test]
fn an_unmanaged_allocation_that_cannot_be_backed_fails_at_once_as_without_kiwi() {
    let m = SimMachine::new("unmanaged-oom", 1, 2 << 30).unwrap();
    // A process outside Kiwi holds 1300 MiB of the 2 GiB and waits.
    let mut holder = gpuburst(&m, "1300MiB");
    holder.args(["--start-on-stdin", "--name", "H"]);
    let mut holder = Stepped::spawn(&mut holder);
    holder.wait_for("[H] ready:");

    let no_arbiter = tempfile::tempdir().unwrap();
    let under_kiwi = |c: &mut Command| -> Output {
        c.env("LD_PRELOAD", shim())
            .env("KIWI_SOCKET_DIR", no_arbiter.path())
            .env("KIWI_ARBITER_TIMEOUT", "0.2")
            .env("KIWI_STATS", no_arbiter.path().join("stats"));
        finish(c.spawn().unwrap())
    };
    let kiwi = under_kiwi(&mut gpuburst(&m, "800MiB"));
    let alone = finish(gpuburst(&m, "800MiB").spawn().unwrap());
    let _ = holder.child.kill();
    let _ = holder.child.wait();

    let stats = std::fs::read_to_string(no_arbiter.path().join("stats")).unwrap_or_default();
    assert!(stats.contains("mode unmanaged"), "not unmanaged: {stats}");
    for (what, o) in [("without Kiwi", &alone), ("unmanaged under Kiwi", &kiwi)] {
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{what}: {}", text(o));
        assert!(
            err.contains("cuMemAlloc_v2 failed: CUDA_ERROR_OUT_OF_MEMORY"),
            "{what}: the allocation itself must fail: {}",
            text(o)
        );
    }
    // And one that fits is backed at once and verifies.
    let small = under_kiwi(&mut gpuburst(&m, "256MiB"));
    assert!(small.status.success(), "{}", text(&small));
}
