//! GPU memory the arbiter cannot see. A process outside Kiwi (no shim) holds 256 MiB
//! of a 2 GiB simulated GPU, with its own 300 MiB context, while two gpuburst
//! notebooks share the GPU under a private `kiwi-arbiter` and `libkiwi.so`. The
//! arbiter's room is 556 MiB larger than the truth, so a holder's swap-in finds no
//! room the arbiter believes it made.
//!
//! - 800 MiB each (they take turns): with the previous shim and arbiter every holder
//!   waited, its gate closed, until its TQ ran out (the jobs took ~27 s, not ~6).
//! - 600 MiB each (believed to fit, so they share): both sharers waited for room
//!   until the outside process exited (~28 s).
//!
//! Now the holder says `no_room`, the arbiter counts the memory it cannot see and
//! reclaims what the holder lacks, or turns the sharers into turns; every burst
//! checks its bytes (gpuburst `--verify`).
//!
//! Needs the workspace built (`cargo build --workspace --all-targets`).

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kiwi_protocol::{DropReason, EventKind};
use kiwi_sim_core::harness::SimMachine;
use kiwi_tests::{bin, Arbiter};

const MIB: u64 = 1 << 20;

/// The outside process: 256 MiB and a context, idle far longer than the test.
fn outsider(m: &SimMachine) -> Child {
    let mut c = Command::new(bin("gpuburst"));
    m.apply(&mut c)
        .args([
            "--mem",
            "256MiB",
            "--script",
            "idle:120000",
            "--name",
            "outsider",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    c.spawn().expect("spawn the outside process")
}

fn notebook(m: &SimMachine, arb: &Arbiter, mem: &str, seed: &str) -> Child {
    let mut c = Command::new(bin("gpuburst"));
    m.apply(&mut c)
        .args([
            "--mem", mem, "--bursts", "4", "--gpu-ms", "400", "--cpu-ms", "200",
        ])
        .args(["--verify", "--seed", seed])
        .env("LD_PRELOAD", bin("libkiwi.so"))
        .env("KIWI_SOCKET_DIR", arb.socket_dir())
        .env("KIWI_REQUIRE_ARBITER", "1")
        .env("KIWI_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    c.spawn().expect("spawn gpuburst")
}

/// Runs two notebooks of `mem` beside the outsider; returns the arbiter's log, the
/// notebooks' stderr, and how long they took.
fn run(tag: &str, mem: &str) -> (Vec<kiwi_protocol::Event>, String, Duration) {
    let m = SimMachine::new(tag, 1, 2048 * MIB)
        .unwrap_or_else(|e| panic!("{e}"))
        // The simulator's real context cost: three contexts take 900 MiB.
        .with_env("KIWI_SIM_CONTEXT_MEMORY", &(300 * MIB).to_string());
    let arb = Arbiter::start(&["--tq", "2"]);
    let mut out = outsider(&m);
    // Its memory is allocated before the notebooks start.
    std::thread::sleep(Duration::from_millis(1500));
    let t = Instant::now();
    // The second starts once the first has counted its context and module and
    // reported its working set: each measures what its module takes by the drop in
    // free memory, which the other's context, made at the same moment, would join
    // (a fresh-clone CI run counted 302 MiB for a 2 MiB module). Their bursts still
    // overlap: each runs 4 of 400 ms.
    let first = notebook(&m, &arb, mem, "1");
    let pid = first.id();
    kiwi_tests::wait_until(
        "the first notebook's working set",
        Duration::from_secs(30),
        || {
            let ev = arb.events();
            let id = ev.iter().find_map(|e| match e.kind {
                EventKind::Register { pid: p, .. } if p == pid => e.client,
                _ => None,
            });
            id.is_some()
                && ev.iter().any(|e| {
                    e.client == id
                        && matches!(e.kind, EventKind::Usage { working_set_bytes, .. } if working_set_bytes > 0)
                })
        },
    );
    let kids = [first, notebook(&m, &arb, mem, "2")];
    let mut stderr = String::new();
    let mut ok = true;
    for k in kids {
        let o = k.wait_with_output().expect("wait for gpuburst");
        ok &= o.status.success();
        stderr.push_str(&String::from_utf8_lossy(&o.stderr));
    }
    let took = t.elapsed();
    let _ = out.kill();
    let _ = out.wait();
    let events = arb.events();
    assert!(ok, "a notebook failed:\n{stderr}");
    (events, stderr, took)
}

fn log(ev: &[kiwi_protocol::Event], stderr: &str) -> String {
    let t0 = ev.first().map_or(0, |e| e.t_ns);
    ev.iter()
        .map(|e| {
            format!(
                "{:6} {:?} {:?}",
                (e.t_ns - t0) / 1_000_000,
                e.client,
                e.kind
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
        + "\n"
        + stderr
}

/// Where the first `no_room` is in the log (the test fails without one).
fn first_no_room(ev: &[kiwi_protocol::Event], why: &str) -> usize {
    ev.iter()
        .position(|e| matches!(e.kind, EventKind::NoRoom { .. }))
        .unwrap_or_else(|| panic!("no `no_room` was reported:\n{why}"))
}

#[test]
fn memory_outside_kiwi_neither_stalls_turns_nor_sharers() {
    // Taking turns: a holder short of room gets it from the other notebook at once.
    let (ev, stderr, took) = run("noroom-turns", "800MiB");
    let why = log(&ev, &stderr);
    let no_room = first_no_room(&ev, &why);
    let EventKind::NoRoom { unseen_bytes, .. } = ev[no_room].kind else {
        unreachable!()
    };
    // 256 MiB and a 300 MiB context, less what the arbiter's context reserve (256
    // MiB, over the two notebooks' reported 600 MiB) already covers: 556 MiB, learned
    // to within one 64 MiB segment.
    assert!(
        (556 * MIB..=(556 + 64) * MIB).contains(&unseen_bytes),
        "unseen {} MiB:\n{why}",
        unseen_bytes / MIB
    );
    assert!(
        ev[no_room..]
            .iter()
            .any(|e| e.client != ev[no_room].client && matches!(e.kind, EventKind::Reclaim { .. })),
        "no reclaim after `no_room`:\n{why}"
    );
    // Four 0.6 s bursts each, plus hand-offs: ~6 s on an idle machine, 15.6 s once on
    // a 2-core machine running the whole suite beside two busy loops (its swaps took
    // 2–4 s); a holder that waited out its TQ (2 s) at each of the ~8 hand-offs took
    // ~27 s.
    assert!(
        took < Duration::from_secs(20),
        "the notebooks took {took:?}:\n{why}"
    );
    assert!(
        !stderr.contains("no room to swap in"),
        "a holder waited for room for seconds:\n{why}"
    );

    // Believed to fit: the sharers find no room; one report turns them into turns.
    let (ev, stderr, took) = run("noroom-shared", "600MiB");
    let why = log(&ev, &stderr);
    let no_room = first_no_room(&ev, &why);
    assert!(
        ev[no_room..].iter().any(|e| matches!(
            e.kind,
            EventKind::Drop {
                reason: DropReason::NoLongerFits,
                ..
            }
        )),
        "the sharers were not turned into turns:\n{why}"
    );
    // Before: ~28 s (both waited until the outsider exited).
    assert!(
        took < Duration::from_secs(20),
        "the notebooks took {took:?}:\n{why}"
    );
}

/// A driver-API newcomer (`cuDevicePrimaryCtxRetain`, as gpuburst makes its context)
/// beside an idle holder of 86% of a 4 GiB GPU with 300 MiB contexts (issue #24):
/// its context used to fail with out of memory; now it waits for room, the idle
/// holder swaps out what it needs, and the newcomer's bursts verify every byte.
#[test]
fn a_driver_api_newcomer_gets_room_beside_an_idle_holder() {
    let m = SimMachine::new("newcomer-driver", 1, 4096 * MIB)
        .unwrap_or_else(|e| panic!("{e}"))
        .with_env("KIWI_SIM_CONTEXT_MEMORY", &(300 * MIB).to_string());
    // 3520 MiB beside two contexts is over the 4 GiB: the newcomer's context is
    // made only where whole processes can take turns.
    let arb = Arbiter::start_evicting(&["--tq", "2"], m.env());
    let under_kiwi = |c: &mut Command| {
        c.env("LD_PRELOAD", bin("libkiwi.so"))
            .env("KIWI_SOCKET_DIR", arb.socket_dir())
            .env("KIWI_REQUIRE_ARBITER", "1")
            .env("KIWI_LOG", "info")
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
    };
    let mut holder = Command::new(bin("gpuburst"));
    m.apply(&mut holder)
        .args(["--mem", "3520MiB", "--script", "gpu:100,idle:120000"]);
    under_kiwi(&mut holder);
    let mut holder = holder.spawn().expect("spawn the holder");
    // The holder's memory is on the GPU before the newcomer starts.
    let deadline = Instant::now() + Duration::from_secs(60);
    while !arb.events().iter().any(|e| {
        matches!(e.kind, EventKind::Usage { resident_bytes, .. } if resident_bytes >= 3520 * MIB)
    }) {
        assert!(Instant::now() < deadline, "the holder never became resident");
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut newcomer = Command::new(bin("gpuburst"));
    m.apply(&mut newcomer).args([
        "--mem", "640MiB", "--bursts", "2", "--gpu-ms", "100", "--cpu-ms", "50", "--verify",
    ]);
    under_kiwi(&mut newcomer);
    let out = newcomer
        .spawn()
        .expect("spawn the newcomer")
        .wait_with_output()
        .expect("wait for the newcomer");
    let _ = holder.kill();
    let _ = holder.wait();
    let ev = arb.events();
    let why = log(&ev, &String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "the newcomer failed:\n{why}");
    assert!(
        why.contains("room made for a context"),
        "the newcomer's context did not wait for room:\n{why}"
    );
}
