//! The application's own VMM memory swaps (issue #24, item 2): two programs that grow
//! their memory as PyTorch's `expandable_segments` does (20 MiB handles of their own,
//! mapped into one reserved range), 60% of the GPU each, take turns, and every byte
//! of every handle verifies after each turn, after a shrink and a regrow, and through
//! NCCL's way of freeing (released while mapped). That memory used to be counted
//! and never swapped: the second program's `cuMemCreate` waited for room that never
//! came and failed. A handle the application exports stays resident.
//!
//! Real processes on the strict GPU simulator (2 GiB, 300 MiB contexts) under a real
//! `kiwi-arbiter`. Needs the workspace built (`cargo build --workspace --all-targets`),
//! `gcc`, and `cuda.h` (fetched once by `scripts/fetch-cuda-h.sh`).

mod common;
use common::*;

use std::process::Command;

use kiwi_sim_core::harness::SimMachine;
use kiwi_tests::Arbiter;

const MIB: u64 = 1 << 20;

fn machine(tag: &str) -> SimMachine {
    SimMachine::new(tag, 1, 2048 * MIB)
        .unwrap()
        .with_env("KIWI_SIM_CONTEXT_MEMORY", &(300 * MIB).to_string())
}

/// Two programs of 1240 MiB (62 handles of 20 MiB, 60% of the GPU) on `m`, the first with `env`
/// set; both run to their end. Their outputs and pids.
fn pair(
    m: &SimMachine,
    arb: &Arbiter,
    exe: &std::path::Path,
    env: &[(&str, &str)],
) -> [(std::process::Output, u32); 2] {
    let spawn = |env: &[(&str, &str)]| {
        let mut c = Command::new(exe);
        c.args(["1240", "20", "3"]).envs(env.iter().copied());
        under_kiwi_on(&mut c, m, arb)
            .spawn()
            .expect("spawn the program")
    };
    let (a, b) = (spawn(env), spawn(&[]));
    let (pa, pb) = (a.id(), b.id());
    let oa = wait_within(a, 120).unwrap_or_else(|o| panic!("A hung: {}", text(&o)));
    let ob = wait_within(b, 120).unwrap_or_else(|o| panic!("B hung: {}", text(&o)));
    for (o, who) in [(&oa, "A"), (&ob, "B")] {
        assert_eq!(o.status.code(), Some(0), "{who}: {}", text(o));
        assert!(
            String::from_utf8_lossy(&o.stdout).contains("OK"),
            "{who}: {}",
            text(o)
        );
    }
    [(oa, pa), (ob, pb)]
}

#[test]
fn two_expandable_segment_programs_at_60_percent_take_turns() {
    let dir = tempfile::tempdir().unwrap();
    let Some(exe) = compile("expandable", dir.path()) else {
        return;
    };
    let m = machine("app-vmm-pair");
    let arb = Arbiter::start(&["--tq", "1"]);
    let [(oa, pa), (ob, pb)] = pair(&m, &arb, &exe, &[]);
    // Neither gave its turn back while it waited for room for its memory (not
    // idle: the arbiter was making room for it).
    for (o, who) in [(&oa, "A"), (&ob, "B")] {
        let mut waiting = false;
        for l in String::from_utf8_lossy(&o.stderr).lines() {
            waiting = (waiting
                || l.contains("waiting for this GPU's turn while the arbiter makes room"))
                && !l.contains("room made");
            assert!(
                !(waiting && l.contains("releasing early")),
                "{who} released while it waited for room: {}",
                text(o)
            );
        }
    }
    // Each one's own memory left the GPU for the other, whole handles of it.
    for (o, pid, who) in [(&oa, pa, "A"), (&ob, pb, "B")] {
        let out = swapped_out(&arb, pid);
        assert!(
            out >= 500 * MIB,
            "{who} swapped out {} MiB: {}",
            out >> 20,
            text(o)
        );
    }
}

/// The exporter's first handle (20 MiB) stays resident once exported: counted as
/// memory no swap frees, beside its context.
#[test]
fn an_exported_handle_stays_resident_and_is_counted() {
    let dir = tempfile::tempdir().unwrap();
    let Some(exe) = compile("expandable", dir.path()) else {
        return;
    };
    let m = machine("app-vmm-export");
    let arb = Arbiter::start(&["--tq", "1"]);
    let [(oa, pa), _] = pair(&m, &arb, &exe, &[("EXPORT", "1")]);
    assert!(
        String::from_utf8_lossy(&oa.stdout).contains("EXPORTED 1"),
        "{}",
        text(&oa)
    );
    let most = unswappable_figures(&arb, pa).into_iter().max().unwrap_or(0);
    assert!(
        most >= 300 * MIB + 20 * MIB,
        "the exporter's memory no swap frees peaked at {} MiB: {}",
        most >> 20,
        text(&oa)
    );
    // Its other handles still swapped.
    assert!(swapped_out(&arb, pa) >= 500 * MIB, "{}", text(&oa));
}
