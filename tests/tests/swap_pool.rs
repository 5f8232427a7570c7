//! Issue #37: swapped-out memory lives in the node's swap pool, host memory the
//! arbiter owns, never charged to a tenant's memory cgroup. On the simulator, whose
//! device memory (since #37) lives outside every process as a GPU's does, with real
//! memory cgroups (v1 or v2, whichever the machine has), real processes and sockets.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use kiwi_protocol::EventKind;
use kiwi_sim_core::harness::SimMachine;
use kiwi_tests::{bin, finish_within, output_text, wait_until, Arbiter, MemCgroup};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

fn gpuburst(m: &SimMachine, arb: &Arbiter, mut cmd: Command, pool: bool) -> Child {
    m.apply(&mut cmd)
        .env("LD_PRELOAD", bin("libkiwi.so"))
        .env("KIWI_SOCKET_DIR", arb.socket_dir())
        .env("KIWI_REQUIRE_ARBITER", "1")
        .env("KIWI_SWAP_POOL", if pool { "1" } else { "0" })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd.spawn().expect("spawn gpuburst")
}

/// Bytes swapped out so far, from the arbiter's event log.
fn swapped_out(arb: &Arbiter) -> u64 {
    arb.events()
        .iter()
        .filter_map(|e| match &e.kind {
            EventKind::SwapOut { bytes, .. } => Some(*bytes),
            _ => None,
        })
        .sum()
}

/// A notebook with 1.5 GiB on a 2 GiB GPU, in a memory cgroup limited to 768 MiB, is
/// swapped out and back by a competitor, verifies every byte and is never
/// OOM-killed: its swapped-out memory is the pool's. The same notebook swapping into
/// its own memory (`KIWI_SWAP_POOL=0`, what every version before #37 did) is killed
/// at its first swap-out, so the test shows the pool is what saves it.
#[test]
fn a_notebook_in_a_memory_limited_cgroup_is_swapped_out_and_back_without_being_killed() {
    let m = SimMachine::new("pool-cg", 1, 2 * GIB).unwrap_or_else(|e| panic!("{e}"));
    // A GPU's memory exists before anyone allocates it: populated from here, outside
    // the notebook's cgroup.
    m.populate().unwrap_or_else(|e| panic!("{e}"));
    let arb = Arbiter::start(&["--tq", "0.5", "--swap-pool", "3GiB"]);
    let mut outcomes = Vec::new();
    for pool in [true, false] {
        let Some(cg) = MemCgroup::new(if pool { "pool" } else { "own" }, 768 * MIB) else {
            return;
        };
        let notebook = gpuburst(
            &m,
            &arb,
            cg.command(
                &bin("gpuburst"),
                &[
                    "--mem",
                    "1536MiB",
                    "--script",
                    "gpu:200,idle:2500,gpu:200",
                    "--verify",
                    "--name",
                    "notebook",
                ],
            ),
            pool,
        );
        wait_until("the notebook is resident", Duration::from_secs(30), || {
            arb.status()
                .gpus
                .iter()
                .any(|g| g.clients.iter().any(|c| c.resident_bytes >= 1536 * MIB))
        });
        let mut cmd = Command::new(bin("gpuburst"));
        cmd.args([
            "--mem",
            "1200MiB",
            "--script",
            "gpu:300",
            "--verify",
            "--name",
            "competitor",
        ]);
        let competitor = gpuburst(&m, &arb, cmd, true);
        let (c, _) = finish_within(competitor, Duration::from_secs(60));
        assert!(c.status.success(), "competitor: {}", output_text(&c));
        let (n, _) = finish_within(notebook, Duration::from_secs(60));
        outcomes.push((swapped_out(&arb), n, cg.oom_kills(), cg.peak()));
    }
    let swapped = outcomes[0].0;
    assert!(
        swapped > 768 * MIB,
        "the competitor made the notebook swap out more than its cgroup's limit (swapped out {} MiB)",
        swapped >> 20
    );
    let (_, with_pool, kills, peak) = &outcomes[0];
    assert!(
        with_pool.status.success() && *kills == 0,
        "with the pool the notebook verifies and is not killed (OOM kills {kills}, peak {} MiB): {}",
        peak >> 20,
        output_text(with_pool)
    );
    assert!(
        *peak < 768 * MIB,
        "its cgroup stayed under its limit (peak {} MiB)",
        peak >> 20
    );
    let (_, own, kills, _) = &outcomes[1];
    assert!(
        !own.status.success() && *kills > 0,
        "swapping into its own memory, the same notebook is OOM-killed (kills {kills}): {}",
        output_text(own)
    );
}

/// A 1 GiB simulated GPU (its memory populated) and an arbiter with a 512 MiB swap
/// pool and a disk tier in a fresh directory (`extra` arguments added).
fn disk_tier(name: &str, extra: &[&str]) -> (SimMachine, tempfile::TempDir, Arbiter) {
    let m = SimMachine::new(name, 1, GIB).unwrap_or_else(|e| panic!("{e}"));
    m.populate().unwrap_or_else(|e| panic!("{e}"));
    let spill = tempfile::tempdir().expect("spill dir");
    let dir = spill.path().to_str().unwrap().to_string();
    let mut args = vec!["--tq", "0.5", "--swap-pool", "512MiB", "--spill-dir", &dir];
    args.extend_from_slice(extra);
    let arb = Arbiter::start(&args);
    (m, spill, arb)
}

/// The largest figure of the pool's disk tier seen while `children` run, and
/// their outputs in order.
fn run_watching_spill(arb: &Arbiter, children: Vec<Child>) -> (u64, Vec<std::process::Output>) {
    let mut most = 0u64;
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    let mut children = children;
    loop {
        if let Some(s) = arb.status().swap_pool.and_then(|p| p.spill) {
            most = most.max(s.spilled_bytes);
        }
        let all_done = children
            .iter_mut()
            .all(|c| c.try_wait().ok().flatten().is_some());
        if all_done {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the notebooks did not finish within 120 s"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let outs = children
        .into_iter()
        .map(|c| c.wait_with_output().expect("wait"))
        .collect();
    (most, outs)
}

/// `spilled_bytes` of a shim's `KIWI_STATS` file.
fn spilled_of(stats: &std::path::Path) -> u64 {
    std::fs::read_to_string(stats)
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("spilled_bytes "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// The disk tier: three notebooks of 512 MiB take turns on a 1 GiB GPU, each in a
/// memory cgroup of 384 MiB (less than its working set: swapping into its own memory
/// would kill it), beside a swap pool of 512 MiB. Two of them are swapped out at
/// once (1 GiB, twice the pool): the pool asks the one idle longest to move its
/// swapped-out memory to the spill directory, it comes back from there at its next
/// turn, and every notebook verifies every byte, none OOM-killed.
#[test]
fn notebooks_whose_swapped_out_total_is_twice_the_pool_all_verify_through_the_disk_tier() {
    let (m, spill, arb) = disk_tier("pool-disk", &[]);
    let stats = tempfile::tempdir().expect("stats dir");
    let mut cgroups = Vec::new();
    let mut children = Vec::new();
    for i in 0..3 {
        let Some(cg) = MemCgroup::new(&format!("disk{i}"), 384 * MIB) else {
            return;
        };
        let name = format!("nb{i}");
        let mut cmd = cg.command(
            &bin("gpuburst"),
            &[
                "--mem",
                "512MiB",
                "--script",
                "gpu:300,idle:1200,gpu:300,idle:1200,gpu:300,idle:1200,gpu:300",
                "--verify",
                "--seed",
                &i.to_string(),
                "--name",
                &name,
            ],
        );
        cmd.env("KIWI_STATS", stats.path().join(&name));
        children.push(gpuburst(&m, &arb, cmd, true));
        cgroups.push(cg);
    }
    let (most, outs) = run_watching_spill(&arb, children);
    for ((out, cg), i) in outs.iter().zip(&cgroups).zip(0..) {
        assert!(
            out.status.success() && cg.oom_kills() == 0,
            "notebook {i} verifies, not killed (OOM kills {}): {}",
            cg.oom_kills(),
            output_text(out)
        );
    }
    let spilled: u64 = (0..3)
        .map(|i| spilled_of(&stats.path().join(format!("nb{i}"))))
        .sum();
    assert!(
        most > 0 && spilled > 0,
        "the disk tier held swapped-out memory (at most {} MiB at once; the notebooks gave back {} MiB)",
        most >> 20,
        spilled >> 20
    );
    assert!(
        swapped_out(&arb) >= 2 * 512 * MIB,
        "the notebooks swapped out more than twice the pool ({} MiB)",
        swapped_out(&arb) >> 20
    );
    // Everything comes back: no spill file is left, none was ever named.
    wait_until(
        "the spill files are dropped",
        Duration::from_secs(10),
        || {
            arb.status()
                .swap_pool
                .and_then(|p| p.spill)
                .is_some_and(|s| s.files == 0 && s.spilled_bytes == 0)
        },
    );
    assert_eq!(std::fs::read_dir(spill.path()).unwrap().count(), 0);
}

/// A full spill disk (its budget spent) makes no spill: a swap-out that finds the
/// pool full waits no longer than the refusal and goes to the process's own memory
/// (with a line naming the pool, when it was on the critical path; buffers pinned
/// ahead go there silently), every notebook still verifies, the disk tier never holds
/// more than its budget, and the refusal is in the pool's status. The notebooks'
/// swap need (3 × 448 MiB on 896 MiB of capacity: 448 MiB) is within what the pool
/// and the tier hold (544 MiB), so admission lets them all in; in exclusive turns two
/// of them are swapped out at once (896 MiB), more than both.
#[test]
fn a_full_spill_disk_refuses_and_nothing_is_lost() {
    let (m, _spill, arb) = disk_tier("pool-full", &["--spill-budget", "32MiB"]);
    let children = (0..3)
        .map(|i| {
            let mut cmd = Command::new(bin("gpuburst"));
            cmd.args([
                "--mem",
                "448MiB",
                "--script",
                "gpu:300,idle:1200,gpu:300,idle:1200,gpu:300",
                "--verify",
                "--seed",
                &i.to_string(),
                "--name",
                &format!("nb{i}"),
            ]);
            gpuburst(&m, &arb, cmd, true)
        })
        .collect();
    let (most, outs) = run_watching_spill(&arb, children);
    for (out, i) in outs.iter().zip(0..) {
        assert!(out.status.success(), "notebook {i}: {}", output_text(out));
    }
    let s = arb
        .status()
        .swap_pool
        .and_then(|p| p.spill)
        .expect("the disk tier in status");
    assert!(s.failures > 0, "{s:?}");
    assert!(
        s.last_error
            .as_deref()
            .is_some_and(|e| e.contains("spill budget of 32 MiB")),
        "{s:?}"
    );
    assert!(
        most <= 32 * MIB,
        "the disk tier never held more than its budget ({} MiB)",
        most >> 20
    );
}

/// Arbiter SIGKILL and restart while notebooks swap through the pool and its disk
/// tier: their slices stay mapped and their spill files readable (each holds its own
/// descriptors), the new arbiter learns the slices back (`pool_kept`), and every
/// notebook verifies every byte.
#[test]
fn an_arbiter_killed_while_memory_is_in_the_pool_and_on_disk_loses_nothing() {
    let (m, spill, mut arb) = disk_tier("pool-restart", &[]);
    let mut children: Vec<Child> = (0..3)
        .map(|i| {
            let mut cmd = Command::new(bin("gpuburst"));
            cmd.args([
                "--mem",
                "512MiB",
                "--script",
                "gpu:300,idle:800,gpu:300,idle:800,gpu:300,idle:800,gpu:300,idle:800,gpu:300,idle:800,gpu:300,idle:800,gpu:300,idle:800,gpu:300",
                "--verify",
                "--seed",
                &(10 + i).to_string(),
                "--name",
                &format!("nb{i}"),
            ]);
            gpuburst(&m, &arb, cmd, true)
        })
        .collect();
    // First kill: once some memory is on disk.
    wait_until("memory on the disk tier", Duration::from_secs(60), || {
        arb.status()
            .swap_pool
            .and_then(|p| p.spill)
            .is_some_and(|s| s.spilled_bytes > 0)
    });
    arb.restart_hard();
    // Second kill: once the notebooks came back to the new arbiter (mid-run: each
    // has bursts left, and memory in the pool or on disk).
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while arb
        .status()
        .gpus
        .iter()
        .map(|g| g.clients.len())
        .sum::<usize>()
        < 2
    {
        if std::time::Instant::now() > deadline {
            let outs: String = children
                .drain(..)
                .map(|mut c| {
                    let _ = c.kill();
                    output_text(&c.wait_with_output().unwrap())
                })
                .collect();
            panic!("the notebooks did not come back to the restarted arbiter within 60 s: {outs}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    arb.restart_hard();
    let mut outs = Vec::new();
    for c in children.drain(..) {
        let (o, _) = finish_within(c, Duration::from_secs(120));
        outs.push(o);
    }
    for (out, i) in outs.iter().zip(0..) {
        assert!(out.status.success(), "notebook {i}: {}", output_text(out));
    }
    assert_eq!(std::fs::read_dir(spill.path()).unwrap().count(), 0);
}

mod protocol_level {
    use std::os::fd::{AsRawFd, OwnedFd};
    use std::time::Duration;

    use kiwi_protocol::blocking::Connection;
    use kiwi_protocol::{ArbiterMsg, ClientMsg, ErrorCode};
    use kiwi_tests::{register_msg, wait_until, Arbiter, Client};

    use super::MIB;

    type Conn = Connection<ClientMsg, ArbiterMsg>;

    fn pool_conn(arb: &Arbiter) -> Conn {
        let mut c = Conn::connect(&arb.client_socket()).expect("connect");
        c.stream()
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        match c.call(&ClientMsg::PoolOpen).expect("pool_open") {
            ArbiterMsg::PoolOpened { size_bytes, .. } => assert_eq!(size_bytes, 256 * MIB),
            other => panic!("unexpected {other:?}"),
        }
        c
    }

    /// (allocated bytes, size) of a descriptor's file.
    fn blocks(fd: &OwnedFd) -> (u64, u64) {
        // SAFETY: fstat into a zeroed struct, on a descriptor we own.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        assert_eq!(unsafe { libc::fstat(fd.as_raw_fd(), &mut st) }, 0);
        (st.st_blocks as u64 * 512, st.st_size as u64)
    }

    /// The pool lends populated slices (their pages exist before the client maps
    /// them: charged to the arbiter) only against working sets the same process
    /// registered; a returned slice is scrubbed at once, and one a client still
    /// holds a descriptor of is never lent again; bad requests get one-line errors and
    /// never take the daemon down.
    #[test]
    fn slices_are_populated_bounded_by_the_working_set_and_scrubbed_when_returned() {
        let arb = Arbiter::start(&["--swap-pool", "256MiB"]);
        let mut pool = pool_conn(&arb);
        match pool
            .call(&ClientMsg::PoolTake {
                bytes: 8 * MIB,
                ahead: false,
            })
            .unwrap()
        {
            ArbiterMsg::PoolRefused { message } => {
                assert!(message.contains("registered"), "{message}")
            }
            other => panic!("a process with no registration borrows nothing: {other:?}"),
        }
        let _client = Client::register(
            &arb.client_socket(),
            register_msg("GPU-pool", 1 << 30, 100 * MIB),
        );
        let (id, fd) = match pool
            .call(&ClientMsg::PoolTake {
                bytes: 60 * MIB,
                ahead: false,
            })
            .unwrap()
        {
            ArbiterMsg::PoolLent { slices } => {
                assert_eq!(slices.len(), 1, "{slices:?}");
                assert_eq!(slices[0].bytes, 60 * MIB);
                (slices[0].id, pool.take_fd().expect("its descriptor"))
            }
            other => panic!("unexpected {other:?}"),
        };
        assert_eq!(
            blocks(&fd),
            (60 * MIB, 60 * MIB),
            "populated before it is lent"
        );
        // Over the working set (100 MiB + a unit of slack): refused, saying why.
        match pool
            .call(&ClientMsg::PoolTake {
                bytes: 200 * MIB,
                ahead: false,
            })
            .unwrap()
        {
            ArbiterMsg::PoolRefused { message } => {
                assert!(message.contains("working set"), "{message}")
            }
            other => panic!("unexpected {other:?}"),
        }
        // Another connection's id, or one never lent: ignored.
        pool.send(&ClientMsg::PoolGive {
            ids: vec![id + 1000],
        })
        .unwrap();
        pool.send(&ClientMsg::PoolGive { ids: vec![id] }).unwrap();
        wait_until(
            "the returned slice is scrubbed",
            Duration::from_secs(10),
            || blocks(&fd).0 == 0,
        );
        // Writing through the kept descriptor after it came back: the pages are the
        // writer's own, and the next loan is another file.
        // SAFETY: fstat into a zeroed struct.
        let mut old: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        unsafe { libc::fstat(fd.as_raw_fd(), &mut old) };
        match pool
            .call(&ClientMsg::PoolTake {
                bytes: 60 * MIB,
                ahead: false,
            })
            .unwrap()
        {
            ArbiterMsg::PoolLent { .. } => {
                let fresh = pool.take_fd().expect("its descriptor");
                // SAFETY: as above.
                let mut st: libc::stat = unsafe { std::mem::zeroed() };
                // SAFETY: as above.
                unsafe { libc::fstat(fresh.as_raw_fd(), &mut st) };
                assert_ne!(
                    st.st_ino, old.st_ino,
                    "a returned slice is never lent again"
                );
            }
            other => panic!("unexpected {other:?}"),
        }
        // A pool message on a registered connection: an error, the connection lives.
        let mut c = Client::register(&arb.client_socket(), register_msg("GPU-pool", 1 << 30, 0));
        c.conn
            .send(&ClientMsg::PoolTake {
                bytes: MIB,
                ahead: false,
            })
            .unwrap();
        let e = c
            .wait_for(Duration::from_secs(5), |m| {
                matches!(m, ArbiterMsg::Error { .. })
            })
            .expect("an error");
        assert!(
            matches!(
                e,
                ArbiterMsg::Error {
                    code: ErrorCode::InvalidArgument,
                    ..
                }
            ),
            "{e:?}"
        );
        c.conn.send(&ClientMsg::Ping { token: 7 }).unwrap();
        assert!(c
            .wait_for(Duration::from_secs(5), |m| matches!(
                m,
                ArbiterMsg::Pong { token: 7 }
            ))
            .is_some());
        // A zero-byte take is malformed: one error, the connection closes.
        pool.send(&ClientMsg::PoolTake {
            bytes: 0,
            ahead: false,
        })
        .unwrap();
        match pool.recv() {
            Ok(ArbiterMsg::Error { message, .. }) => assert!(!message.contains('\n'), "{message}"),
            other => panic!("unexpected {other:?}"),
        }
        assert!(pool.recv().is_err(), "closed after the error");
        // The daemon still serves.
        let _again = pool_conn(&arb);
    }
}

/// Admission is the pool, with no budget set: a growth whose swap need the pool cannot
/// hold fails at allocation with out-of-memory and one line naming the pool, while a
/// notebook resident beside it and a smaller newcomer, whose swap-out the pool holds,
/// verify.
#[test]
fn a_growth_the_pool_cannot_hold_fails_with_a_line_and_the_others_verify() {
    let m = SimMachine::new("pool-full", 1, 2 * GIB).unwrap_or_else(|e| panic!("{e}"));
    let arb = Arbiter::start(&["--tq", "0.5", "--swap-pool", "256MiB"]);
    let burst = |args: &[&str]| {
        let mut cmd = Command::new(bin("gpuburst"));
        cmd.args(args);
        gpuburst(&m, &arb, cmd, true)
    };
    let notebook = burst(&[
        "--mem",
        "1536MiB",
        "--script",
        "gpu:200,idle:3000,gpu:200",
        "--verify",
        "--name",
        "notebook",
    ]);
    wait_until("the notebook is resident", Duration::from_secs(30), || {
        arb.status()
            .gpus
            .iter()
            .any(|g| g.clients.iter().any(|c| c.resident_bytes >= 1536 * MIB))
    });
    let (big, hung) = finish_within(
        burst(&[
            "--mem", "1536MiB", "--script", "gpu:100", "--verify", "--name", "big",
        ]),
        Duration::from_secs(60),
    );
    assert!(
        !hung && !big.status.success(),
        "the growth past the pool fails: {}",
        output_text(&big)
    );
    let err = String::from_utf8_lossy(&big.stderr);
    let line = err
        .lines()
        .find(|l| l.contains("swap pool (256 MiB)"))
        .unwrap_or_else(|| panic!("one line names the pool: {}", output_text(&big)));
    assert!(line.contains("out of memory"), "{line}");
    let (small, _) = finish_within(
        burst(&[
            "--mem", "600MiB", "--script", "gpu:200", "--verify", "--name", "small",
        ]),
        Duration::from_secs(60),
    );
    assert!(
        small.status.success(),
        "a growth the pool holds runs: {}",
        output_text(&small)
    );
    let (nb, _) = finish_within(notebook, Duration::from_secs(60));
    assert!(
        nb.status.success(),
        "the notebook verifies: {}",
        output_text(&nb)
    );
    assert!(
        swapped_out(&arb) > 0,
        "the small one made the notebook swap out into the pool"
    );
}
