//! Frees wait for the work that may still use the memory (#13 item 5), as `cuMemFree`
//! does, with real processes on the strict GPU simulator under a real `kiwi-arbiter`.
//!
//! Needs the workspace built (`cargo build --workspace --all-targets`), `gcc`, and
//! `cuda.h` (fetched once by `scripts/fetch-cuda-h.sh`).

mod common;
use common::*;

use std::process::{Command, Stdio};

use kiwi_sim_core::harness::SimMachine;
use kiwi_tests::Arbiter;

/// A small allocation freed while a kernel queued before the free still writes it:
/// the shim hands its range out again at once (small allocations share 2 MiB chunks),
/// so without the free waiting for the context the late kernel overwrote the next
/// allocation there (word 0 of Y was 0xdeadbeef).
#[test]
fn a_small_free_waits_for_the_kernel_still_writing_it() {
    let dir = tempfile::tempdir().unwrap();
    let Some(exe) = compile("free_reuse", dir.path()) else {
        return;
    };
    let m = SimMachine::new("free-reuse", 1, 1 << 30).unwrap();

    // On the bare simulator (cuMemFree waits, as the real driver): the program is right.
    let bare = finish(piped(m.apply(Command::new(&exe).arg("64"))));
    assert_eq!(bare.status.code(), Some(0), "{}", text(&bare));

    let arb = Arbiter::start(&[]);
    let mut c = Command::new(&exe);
    let o = finish(
        under_kiwi_on(c.arg("64"), &m, &arb)
            .spawn()
            .expect("spawn free_reuse"),
    );
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains("SAME"),
        "Y should reuse X's range (the chunk's first fit)\n{}",
        text(&o)
    );
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(out.contains("OK"), "{}", text(&o));
}

/// Spawns `c` with stdout and stderr piped, stdin closed.
fn piped(c: &mut Command) -> std::process::Child {
    c.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn")
}
