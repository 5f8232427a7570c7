//! Loaded modules' device memory counts as memory no swap frees (#13 item 2), with
//! real processes on the strict GPU simulator (each `cuModuleLoad*` costs its context
//! `KIWI_SIM_MODULE_MEMORY`: at its first `cuModuleGetFunction` with lazy loading,
//! the default, at the load with `CUDA_MODULE_LOADING=EAGER`) under a real
//! `kiwi-arbiter`.
//!
//! Needs the workspace built (`cargo build --workspace --all-targets`).

mod common;
use common::*;

use std::time::Duration;

use kiwi_sim_core::harness::SimMachine;
use kiwi_tests::Arbiter;

/// Two programs on a 1 GiB GPU: A's module takes 256 MiB, A works on 300 MiB and B
/// on 400 MiB. Counting contexts only (2 × 48 MiB, under the arbiter's 128 MiB
/// reserve), the arbiter sees 700 MiB of working sets in 896 MiB of room and lets
/// both run at once, while only 1024 − 96 − 256 = 672 MiB are there: B's memory
/// cannot all be backed, and B waits for room nobody is asked to make (it never
/// finished within the limit). With the module measured and reported, the GPU is
/// oversubscribed: they take turns, swap, and keep every byte.
///
/// Run with each loading mode: with lazy loading, the module's memory is taken when
/// its kernels are first looked up, and only counting it there shows it (the
/// arbiter's `unswappable` figure for A includes it).
#[test]
fn a_modules_memory_is_counted_so_programs_take_turns_and_verify() {
    take_turns("LAZY");
    take_turns("EAGER");
}

fn take_turns(loading: &str) {
    let m = SimMachine::new("modules", 1, 1 << 30)
        .unwrap()
        .with_env("CUDA_MODULE_LOADING", loading);
    let arb = Arbiter::start(&["--tq", "0.3"]);
    // A runs long enough to overlap all of B.
    let mut a = gpuburst("300MiB", 16, 100);
    let a = under_kiwi_on(a.env("KIWI_SIM_MODULE_MEMORY", "256MiB"), &m, &arb)
        .spawn()
        .expect("spawn gpuburst A");
    std::thread::sleep(Duration::from_millis(500));
    let mut b = gpuburst("400MiB", 4, 100);
    let b = under_kiwi_on(&mut b, &m, &arb)
        .spawn()
        .expect("spawn gpuburst B");
    let pa = a.id();
    // A program that waits for room nobody makes fails this test rather than hangs.
    let within = |c| wait_within(c, 60).unwrap_or_else(|o| o);
    let (oa, ob) = (within(a), within(b));
    assert_eq!(
        oa.status.code(),
        Some(0),
        "A\n{}\nB\n{}",
        text(&oa),
        text(&ob)
    );
    assert_eq!(
        ob.status.code(),
        Some(0),
        "B\n{}\nA\n{}",
        text(&ob),
        text(&oa)
    );
    // A's module counted with its context, as the arbiter heard it.
    let unswappable = unswappable_figures(&arb, pa).into_iter().max().unwrap_or(0);
    assert!(
        unswappable >= 256 << 20,
        "{loading}: A reported {unswappable} bytes no swap frees, not its 256 MiB module\n{}",
        text(&oa)
    );
    // They took turns: A's memory went out for B.
    let out = swapped_out(&arb, pa);
    assert!(out > 0, "A never swapped out\n{}\n{}", text(&oa), text(&ob));
    // Nobody waited for room the arbiter did not know was taken.
    for o in [&oa, &ob] {
        assert!(
            !String::from_utf8_lossy(&o.stderr).contains("no room to swap in"),
            "{}",
            text(o)
        );
    }
}
