//! A context is not a claim (#13 item 3): a process needs the turns only of the GPUs
//! where it has memory or submits work. Real processes on a 2-GPU simulated machine
//! under a real `kiwi-arbiter`: a runtime program (NVIDIA's libcudart) that takes a
//! context on both GPUs and works on GPU 0, while two gpuburst programs take turns
//! over capacity on GPU 1.
//!
//! Needs the workspace built (`cargo build --workspace --all-targets`), `gcc` and the
//! CUDA runtime wheel (`scripts/fetch-cuda-runtime.sh`).

mod common;
use common::*;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output};
use std::time::Duration;

use kiwi_protocol::{Event, EventKind};
use kiwi_sim_core::harness::{CudaRuntime, SimMachine};
use kiwi_tests::{bin, wait_until, Arbiter};

/// The number after `key ` on a line of `o`'s stdout.
fn figure(o: &Output, key: &str) -> f64 {
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .find_map(|l| l.strip_prefix(key)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {key} in\n{}", text(o)))
}

/// gpuburst on GPU 1 only, over capacity with its twin.
fn holder(m: &SimMachine, arb: &Arbiter) -> Child {
    let mut c = Command::new(bin("gpuburst"));
    m.apply(&mut c).args([
        "--device", "1", "--mem", "700MiB", "--bursts", "8", "--gpu-ms", "150", "--cpu-ms", "10",
        "--verify",
    ]);
    under_kiwi(&mut c, arb).spawn().expect("spawn gpuburst")
}

/// The arbiter's client id for `pid` on GPU `uuid`.
fn client_of(events: &[Event], pid: u32, uuid: &str) -> Option<u64> {
    events.iter().find_map(|e| match &e.kind {
        EventKind::Register { pid: p, .. } if *p == pid && e.gpu == uuid => e.client,
        _ => None,
    })
}

fn compile(rt: &CudaRuntime, dir: &Path) -> PathBuf {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/c/one_gpu_of_two.c");
    let exe = dir.join("one_gpu_of_two");
    rt.compile(&src, &exe).unwrap_or_else(|e| panic!("{e}"));
    exe
}

#[test]
fn a_context_on_a_busy_gpu_is_not_a_claim_but_work_there_waits_for_its_turn() {
    let Some(rt) = CudaRuntime::fetch_or_skip("claims") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let exe = compile(&rt, dir.path());
    let m = SimMachine::new("claims", 2, 1 << 30).unwrap();
    let arb = Arbiter::start(&["--tq", "0.5"]);
    let (b, c) = (holder(&m, &arb), holder(&m, &arb));
    let (pb, pc) = (b.id(), c.id());
    // GPU 1 changes hands between the two holders.
    wait_until("a holder on GPU 1", Duration::from_secs(20), || {
        arb.events()
            .iter()
            .any(|e| matches!(e.kind, EventKind::Grant { .. }))
    });
    let mut a = Command::new(&exe);
    m.apply_with_runtime(&mut a, &rt).args(["40", "gpu1"]);
    let a = under_kiwi(&mut a, &arb).spawn().expect("spawn the program");
    let pa = a.id();
    let oa = finish(a);
    let (ob, oc) = (finish(b), finish(c));
    for o in [&oa, &ob, &oc] {
        assert_eq!(o.status.code(), Some(0), "{}", text(o));
    }
    let events = arb.events();
    let uuid1 = events
        .iter()
        .find(|e| matches!(e.kind, EventKind::Register { pid, .. } if pid == pb || pid == pc))
        .map(|e| e.gpu.clone())
        .expect("the holders registered GPU 1");
    let a1 = client_of(&events, pa, &uuid1)
        .unwrap_or_else(|| panic!("the program's context on GPU 1 registered: {events:#?}"));
    let of_a1 = |want: fn(&EventKind) -> bool| -> Vec<u64> {
        events
            .iter()
            .filter(|e| e.client == Some(a1) && e.gpu == uuid1 && want(&e.kind))
            .map(|e| e.t_ns)
            .collect()
    };
    let requests = of_a1(|k| matches!(k, EventKind::Request));
    let grants = of_a1(|k| matches!(k, EventKind::Grant { .. }));
    let gpu0_done = figure(&oa, "gpu0_done_ns") as u64;
    let gpu1_work = figure(&oa, "gpu1_work_ns") as u64;
    let worst = figure(&oa, "max_burst_ms");
    eprintln!("slowest GPU 0 burst: {worst} ms; GPU 1 requests {requests:?} grants {grants:?}");
    // Working on GPU 0 never asked for GPU 1, so it never waited for the holders.
    assert!(
        requests.iter().all(|&t| t > gpu0_done),
        "asked for GPU 1 while working on GPU 0 only (done at {gpu0_done}): {requests:?}\n{}",
        text(&oa)
    );
    assert!(
        worst < 250.0,
        "a GPU 0 burst took {worst} ms: it waited\n{}",
        text(&oa)
    );
    // Work on GPU 1 claimed it and ran only once its turn was granted.
    let granted = grants
        .iter()
        .copied()
        .filter(|&t| t > gpu0_done)
        .min()
        .unwrap_or_else(|| panic!("GPU 1 was never granted for its work\n{}", text(&oa)));
    assert!(
        granted <= gpu1_work,
        "the host function on GPU 1 ran at {gpu1_work}, before the grant at {granted}"
    );
}
