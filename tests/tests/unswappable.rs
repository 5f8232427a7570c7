//! Memory no swap frees (#13 item 2): each process's context costs GPU memory that
//! stays on the GPU whoever holds it. Four programs on NVIDIA's CUDA runtime
//! (`cudart_notebook.c`), each with the simulator's real default context cost
//! (300 MiB), on a 4 GiB simulated GPU under a private `kiwi-arbiter` and
//! `libkiwi.so`: their working sets (4 × 896 MiB) fit in the GPU less the arbiter's
//! reserve (3584 MiB), but not next to their four contexts (3584 + 1200 > 4096 MiB).
//! The shims measure and report their contexts, so the arbiter makes them take
//! turns, and every byte is verified, in about 8 s. With the previous shim and
//! arbiter all four were granted the GPU shared, their allocations found no room,
//! and each sat in the shim's 15 s swap-in retry loop holding its state lock: all
//! four hung past the 60 s limit.
//!
//! Needs the workspace built (`cargo build --workspace --all-targets`), `gcc` and
//! `pip` (a failure under `CI=true`, a loud skip otherwise).

use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use kiwi_protocol::EventKind;
use kiwi_sim_core::harness::{CudaRuntime, SimMachine};
use kiwi_tests::{finish_within as finish, output_text as text, profile_dir, Arbiter};

const MIB: u64 = 1 << 20;

fn spawn(rt: &CudaRuntime, m: &SimMachine, exe: &Path, socket_dir: &Path, tag: &str) -> Child {
    let shim = profile_dir().join("libkiwi.so");
    assert!(
        shim.exists(),
        "{} is missing: run `cargo build --workspace --all-targets` first",
        shim.display()
    );
    let mut c = Command::new(exe);
    m.apply_with_runtime(&mut c, rt)
        .args(["896", "3", "100"])
        .env("KIWI_LOG", "info")
        .env("KIWI_POD_NAME", tag)
        .env("LD_PRELOAD", shim)
        .env("KIWI_SOCKET_DIR", socket_dir)
        .env_remove("KIWI_REQUIRE_ARBITER")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c.spawn().expect("spawn the runtime program")
}

#[test]
fn four_runtime_programs_with_real_context_costs_take_turns_and_keep_every_byte() {
    let Some(rt) = CudaRuntime::fetch_or_skip("contexts under Kiwi") else {
        return;
    };
    // The simulator's own default context cost, not the suite's small one.
    let m = SimMachine::new("unswappable", 1, 4096 * MIB)
        .unwrap_or_else(|e| panic!("{e}"))
        .with_env("KIWI_SIM_CONTEXT_MEMORY", "300MiB");
    let dir = tempfile::tempdir().unwrap();
    let exe = dir.path().join("cudart_notebook");
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../sim/core/tests/c/cudart_notebook.c");
    rt.compile(&src, &exe).unwrap_or_else(|e| panic!("{e}"));
    let arb = Arbiter::start(&["--tq", "0.5"]);
    let started = Instant::now();
    let kids: Vec<(String, Child)> = (0..4)
        .map(|i| {
            let tag = format!("nb{i}");
            let c = spawn(&rt, &m, &exe, arb.socket_dir(), &tag);
            (tag, c)
        })
        .collect();
    // Each program alone runs in about a second; 60 s is a hang.
    let limit = Duration::from_secs(60);
    let outs: Vec<(String, Output, bool)> = kids
        .into_iter()
        .map(|(t, c)| {
            let (o, hung) = finish(c, limit.saturating_sub(started.elapsed()));
            (t, o, hung)
        })
        .collect();
    let events = arb.events();
    let log: String = events
        .iter()
        .map(|e| format!("{} {:?} {:?}\n", e.t_ns, e.client, e.kind))
        .collect();
    let all: String = outs
        .iter()
        .map(|(tag, o, hung)| format!("=== {tag} (hung: {hung}) {}\n", text(o)))
        .collect();
    for (tag, o, hung) in &outs {
        assert!(!hung, "{tag} hung\n{all}\n--- arbiter's log\n{log}");
        assert_eq!(
            (
                o.status.code(),
                String::from_utf8_lossy(&o.stdout).lines().last()
            ),
            (Some(0), Some("OK")),
            "{tag} (every byte verified): {}\n--- arbiter's log\n{log}",
            text(o)
        );
    }
    println!("four programs finished in {:?}", started.elapsed());
    for (tag, o, _) in &outs {
        for l in String::from_utf8_lossy(&o.stderr).lines() {
            if l.contains("room")
                || l.contains("memory")
                || l.contains("error")
                || l.contains("context")
            {
                println!("{tag}: {l}");
            }
        }
    }
    // They took turns: (working sets grow after shared grants, and those that no
    // longer fit are dropped) an exclusive grant, and memory swapped out for room.
    let exclusive = events
        .iter()
        .filter(|e| {
            matches!(
                e.kind,
                EventKind::Grant {
                    exclusive: true,
                    ..
                }
            )
        })
        .count();
    let swapped_out: u64 = events
        .iter()
        .map(|e| match e.kind {
            EventKind::SwapOut { bytes, .. } => bytes,
            _ => 0,
        })
        .sum();
    assert!(
        exclusive >= 1 && swapped_out > 0,
        "they must take turns ({exclusive} exclusive grants, {swapped_out} bytes swapped out):\n{log}"
    );
    // No program's call failed for lack of room, and none waited holding a lock: no
    // shim said it released for lack of room or failed a swap-in.
    for (tag, o, _) in &outs {
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            !err.contains("swap-in failed") && !err.contains("cudaErrorMemoryAllocation"),
            "{tag}: {}",
            text(o)
        );
    }
}
