//! Whole-process eviction through the driver's checkpoint API (issue #25), end to
//! end: programs on NVIDIA's CUDA runtime (`cudart_notebook.c`) preloaded with
//! `libkiwi.so`, on a 4 GiB simulated GPU with the simulator's real 300 MiB contexts,
//! under a private `kiwi-arbiter` that loads the simulator's `libcuda.so.1` for its
//! checkpoint API.
//!
//! A notebook holds 3008 MiB (2.9 GiB) and runs rounds; three newcomers start beside
//! it. Their contexts (900 MiB) leave the holder no room for its working set even
//! with every other byte swapped out (3008 + 4 × 300 > 4096 MiB): paging alone can
//! never make room. The arbiter checkpoints idle newcomers (their contexts leave the
//! GPU), restores each before its turn, and all four verify every byte.
//!
//! Needs the workspace built (`cargo build --workspace --all-targets`), `gcc` and
//! `pip` (a failure under `CI=true`, a loud skip otherwise).

use std::io::Write;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use kiwi_protocol::EventKind;
use kiwi_sim_core::harness::{CudaRuntime, SimMachine};
use kiwi_tests::{
    finish_within as finish, output_text as text, profile_dir, read_stdout_until, Arbiter,
};

const MIB: u64 = 1 << 20;

fn notebook(
    rt: &CudaRuntime,
    m: &SimMachine,
    exe: &Path,
    socket_dir: &Path,
    tag: &str,
    args: &[&str],
) -> Command {
    let mut c = Command::new(exe);
    m.apply_with_runtime(&mut c, rt)
        .args(args)
        .env("KIWI_LOG", "info")
        .env("KIWI_POD_NAME", tag)
        .env("LD_PRELOAD", profile_dir().join("libkiwi.so"))
        .env("KIWI_SOCKET_DIR", socket_dir)
        .env_remove("KIWI_REQUIRE_ARBITER")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c
}

/// The scenario; returns every program's (tag, output, hung) and the arbiter's log.
fn run(checkpoint: &str) -> (Vec<(String, Output, bool)>, Vec<kiwi_protocol::Event>) {
    let rt = CudaRuntime::fetch_or_skip("checkpoint under Kiwi").expect("CUDA runtime");
    let m = SimMachine::new(&format!("ckpt-e2e-{checkpoint}"), 1, 4096 * MIB)
        .unwrap_or_else(|e| panic!("{e}"))
        .with_env("KIWI_SIM_CONTEXT_MEMORY", "300MiB");
    let dir = tempfile::tempdir().unwrap();
    let exe = dir.path().join("cudart_notebook");
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../sim/core/tests/c/cudart_notebook.c");
    rt.compile(&src, &exe).unwrap_or_else(|e| panic!("{e}"));
    // The arbiter reaches the simulator's libcuda.so.1 (and the same machine).
    let env: Vec<(String, String)> = m.env();
    let arb = Arbiter::start_with_env(&["--tq", "1", "--checkpoint", checkpoint], env);
    let mut holder = notebook(
        &rt,
        &m,
        &exe,
        arb.socket_dir(),
        "holder",
        &["3008", "8", "400"],
    );
    holder.env("KIWI_TEST_GATE", "1").stdin(Stdio::piped());
    let mut holder = holder.spawn().expect("spawn the holder");
    read_stdout_until(&mut holder, "READY");
    let _ = holder.stdin.take().expect("stdin").write_all(b"go\n");
    let started = Instant::now();
    let mut kids = vec![("holder".to_string(), holder)];
    for i in 0..3 {
        let tag = format!("newcomer{i}");
        let c = notebook(&rt, &m, &exe, arb.socket_dir(), &tag, &["64", "6", "400"])
            .spawn()
            .expect("spawn a newcomer");
        kids.push((tag, c));
    }
    // Alone, each runs in a few seconds; together about 20 s with the checkpoint API
    // and 45 s without it on this machine; 180 s is a hang.
    let limit = Duration::from_secs(180);
    let outs = kids
        .into_iter()
        .map(|(t, c)| {
            let (o, hung) = finish(c, limit.saturating_sub(started.elapsed()));
            (t, o, hung)
        })
        .collect();
    (outs, arb.events())
}

/// Every program ended on its own, having verified every byte ("OK").
fn all_verified(outs: &[(String, Output, bool)], log: &str) {
    let all: String = outs
        .iter()
        .map(|(tag, o, hung)| format!("=== {tag} (hung: {hung}) {}\n", text(o)))
        .collect();
    for (tag, o, hung) in outs {
        assert!(!hung, "{tag} hung\n{all}\n--- arbiter's log\n{log}");
        assert_eq!(
            (
                o.status.code(),
                String::from_utf8_lossy(&o.stdout).lines().last()
            ),
            (Some(0), Some("OK")),
            "{tag} did not verify every byte\n{all}\n--- arbiter's log\n{log}"
        );
    }
}

fn log_of(events: &[kiwi_protocol::Event]) -> String {
    events
        .iter()
        .map(|e| format!("{} {:?} {:?}\n", e.t_ns, e.client, e.kind))
        .collect()
}

#[test]
fn a_holder_beside_three_newcomers_contexts_runs_when_idle_processes_are_checkpointed() {
    if CudaRuntime::fetch_or_skip("checkpoint under Kiwi").is_none() {
        return;
    }
    let (outs, events) = run("auto");
    let log = log_of(&events);
    all_verified(&outs, &log);
    let checkpoints: Vec<u64> = events
        .iter()
        .filter_map(|e| match e.kind {
            EventKind::Checkpoint { bytes, .. } => Some(bytes),
            _ => None,
        })
        .collect();
    let restores = events
        .iter()
        .filter(|e| matches!(e.kind, EventKind::Restore { .. }))
        .count();
    assert!(
        !checkpoints.is_empty() && checkpoints.iter().all(|&b| b >= 300 * MIB),
        "no checkpoint of a context: {checkpoints:?}\n{log}"
    );
    assert!(restores > 0, "nobody restored\n{log}");
    says_why_while_checkpointed(&outs, &events, &log);
}

/// Issue #42, item 3: a program checkpointed for more than a second says why its CUDA
/// calls wait (the line comes a second in, from the arbiter's `checkpointed`); one
/// never checkpointed never says so. Timed from the arbiter's own log: checkpoints
/// that lasted 2 s or more must have the line.
fn says_why_while_checkpointed(
    outs: &[(String, Output, bool)],
    events: &[kiwi_protocol::Event],
    log: &str,
) {
    const LINE: &str = "is checkpointed to host memory";
    let tag_of = |client: Option<u64>| {
        events.iter().find_map(|e| match &e.kind {
            EventKind::Register { pod_name, .. } if e.client == client => pod_name.clone(),
            _ => None,
        })
    };
    let mut longest = std::collections::BTreeMap::<String, u64>::new();
    for (i, e) in events.iter().enumerate() {
        if !matches!(e.kind, EventKind::Checkpoint { .. }) {
            continue;
        }
        let end = events[i..]
            .iter()
            .find(|r| r.client == e.client && matches!(r.kind, EventKind::Restore { .. }))
            .map_or(u64::MAX, |r| r.t_ns);
        let tag = tag_of(e.client).unwrap_or_else(|| panic!("no registration\n{log}"));
        let l = longest.entry(tag).or_default();
        *l = (*l).max(end.saturating_sub(e.t_ns));
    }
    for (tag, o, _) in outs {
        let said = String::from_utf8_lossy(&o.stderr).contains(LINE);
        let held = longest.get(tag).copied();
        eprintln!("{tag}: longest checkpoint {held:?} ns, said so: {said}");
        if held.is_some_and(|ns| ns >= 2_000_000_000) {
            assert!(
                said,
                "{tag} was checkpointed for {held:?} ns and said nothing: {}",
                text(o)
            );
        }
        if held.is_none() {
            assert!(!said, "{tag} was never checkpointed: {}", text(o));
        }
    }
}

/// The same without the API (`--checkpoint off`): nothing hangs, nothing is
/// checkpointed, and the holder verifies every byte. Each newcomer either verifies
/// (its context was made while the holder was partly swapped out: the holder then
/// waits, saying so, while the newcomers' turns come and go) or its context, which
/// would leave the holder's working set no room beside four contexts, fails at
/// once with the driver's out of memory and one line naming the holder (issue #24,
/// "no silent livelock"), whether the driver refused it or made it at once (then
/// it is taken back). Newcomers that register at the same moment do not see each
/// other's contexts, so it may also run.
#[test]
fn without_the_checkpoint_api_the_same_programs_wait_their_turns_or_are_refused() {
    if CudaRuntime::fetch_or_skip("checkpoint under Kiwi").is_none() {
        return;
    }
    let (outs, events) = run("off");
    let log = log_of(&events);
    let (refused, ran): (Vec<_>, Vec<_>) = outs.into_iter().partition(|(tag, o, hung)| {
        tag != "holder"
            && !hung
            && o.status.code() == Some(2)
            && String::from_utf8_lossy(&o.stderr)
                .lines()
                .filter(|l| l.contains("out of memory for a context"))
                .count()
                == 1
            && String::from_utf8_lossy(&o.stderr).contains("holder's working set of 3008 MiB")
    });
    // Two newcomers' contexts beside the holder's leave its working set room: only
    // the last of four contexts can be refused.
    assert!(refused.len() <= 1, "{} refused\n{log}", refused.len());
    all_verified(&ran, &log);
    assert!(
        !events.iter().any(|e| matches!(
            e.kind,
            EventKind::Checkpoint { .. } | EventKind::Restore { .. }
        )),
        "{log}"
    );
}

/// A bad `--checkpoint` is one line and a non-zero exit; without a driver that has
/// the API (this machine has none) `auto` says so at start and serves without it.
#[test]
fn the_arbiter_says_whether_it_can_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(kiwi_tests::bin("kiwi-arbiter"))
        .arg("--socket-dir")
        .arg(dir.path())
        .args(["--checkpoint", "maybe", "--nvml", "off"])
        .env_remove("KIWI_CONFIG")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    let last = err.lines().last().unwrap_or_default();
    assert!(
        last.starts_with("kiwi-arbiter: ") && last.contains("\"maybe\"") && last.contains("auto"),
        "{err}"
    );
    // The simulator's libcuda with the API switched off: unavailable, said at start.
    let m = SimMachine::new("ckpt-line", 1, 1 << 30).unwrap_or_else(|e| panic!("{e}"));
    let mut child = Command::new(kiwi_tests::bin("kiwi-arbiter"))
        .arg("--socket-dir")
        .arg(dir.path())
        .args(["--checkpoint", "auto", "--nvml", "off"])
        .env_remove("KIWI_CONFIG")
        .envs(m.env())
        .env("KIWI_SIM_CHECKPOINT", "0")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let err = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(err).lines().map_while(Result::ok) {
            if line.contains("checkpoint:") {
                let _ = tx.send(line);
                return;
            }
        }
    });
    let line = rx.recv_timeout(Duration::from_secs(30));
    let _ = child.kill();
    let _ = child.wait();
    let line = line.expect("a start-up line about checkpoints");
    assert!(
        line.contains("checkpoint: unavailable") && line.contains("does not support"),
        "{line}"
    );
}

/// `gpuburst` under the shim on `m`, as pod `tag`.
fn burst(m: &SimMachine, arb: &Arbiter, tag: &str, args: &[&str]) -> std::process::Child {
    let mut c = Command::new(kiwi_tests::bin("gpuburst"));
    m.apply(&mut c)
        .args(args)
        .args(["--verify", "--name", tag])
        .env("KIWI_LOG", "info")
        .env("KIWI_POD_NAME", tag)
        .env("LD_PRELOAD", profile_dir().join("libkiwi.so"))
        .env("KIWI_SOCKET_DIR", arb.socket_dir())
        .env("KIWI_REQUIRE_ARBITER", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c.spawn().expect("spawn gpuburst")
}

/// Issue #42, item 3: an idle notebook checkpointed to make room for a holder that
/// keeps the GPU says, a second in, why its CUDA calls wait (they wait inside the
/// driver, where nothing else says so), and that it was restored; it comes back as
/// soon as the GPU has room for it and verifies every byte.
#[test]
fn a_process_checkpointed_for_long_says_why_its_calls_wait() {
    let m = SimMachine::new("ckpt-line", 1, 4096 * MIB)
        .unwrap_or_else(|e| panic!("{e}"))
        .with_env("KIWI_SIM_CONTEXT_MEMORY", "300MiB");
    // A GPU's memory exists before it is allocated: populated here, the holder's
    // 3.6 GiB cost it no host page faults (on a loaded CI host they took it 11-15 s
    // to allocate, past the moment the checkpoint was due).
    m.populate().unwrap_or_else(|e| panic!("{e}"));
    let arb = Arbiter::start_evicting(&["--tq", "1"], m.env());
    let idle = burst(
        &m,
        &arb,
        "idle",
        &["--mem", "200MiB", "--script", "gpu:100,idle:7000,gpu:100"],
    );
    kiwi_tests::wait_until(
        "the idle notebook's memory",
        Duration::from_secs(30),
        || {
            arb.status()
                .gpus
                .iter()
                .any(|g| g.clients.iter().any(|c| c.resident_bytes >= 200 * MIB))
        },
    );
    // 3600 MiB beside two 300 MiB contexts: only a checkpoint of the idle notebook
    // makes room, and it stays out while the holder's working set is on the GPU.
    let holder = burst(
        &m,
        &arb,
        "holder",
        &["--mem", "3600MiB", "--script", "gpu:4000"],
    );
    let (ho, hhung) = finish(holder, Duration::from_secs(90));
    let (io, ihung) = finish(idle, Duration::from_secs(90));
    let events = arb.events();
    let log = log_of(&events);
    let outs = vec![
        ("holder".to_string(), ho, hhung),
        ("idle".to_string(), io, ihung),
    ];
    for (tag, o, hung) in &outs {
        assert!(!hung && o.status.success(), "{tag}: {}\n{log}", text(o));
    }
    let err = String::from_utf8_lossy(&outs[1].1.stderr);
    assert!(
        err.contains("is checkpointed to host memory") && err.contains("restored after"),
        "the idle notebook did not say why it waited: {err}\n--- holder\n{}\n{log}",
        text(&outs[0].1)
    );
    says_why_while_checkpointed(&outs, &events, &log);
}

/// Issue #37, item 4: the driver keeps a checkpointed process's GPU memory in that
/// process's host memory, which its memory limit pays for. An idle notebook in a
/// memory cgroup with less room than its GPU memory is not checkpointed (the kernel
/// would kill it): the event log says why, and it verifies every byte, whatever the
/// holder that wanted the room can then do.
#[test]
fn a_process_whose_memory_limit_cannot_hold_its_gpu_memory_is_not_checkpointed() {
    let m = SimMachine::new("ckpt-cg", 1, 4096 * MIB)
        .unwrap_or_else(|e| panic!("{e}"))
        .with_env("KIWI_SIM_CONTEXT_MEMORY", "300MiB");
    // Its device memory is the GPU's, not the notebook's (populated from here).
    m.populate().unwrap_or_else(|e| panic!("{e}"));
    let arb = Arbiter::start_evicting(&["--tq", "1"], m.env());
    let Some(cg) = kiwi_tests::MemCgroup::new("ckpt", 192 * MIB) else {
        return;
    };
    let mut cmd = cg.command(
        &kiwi_tests::bin("gpuburst"),
        &[
            "--mem",
            "300MiB",
            "--script",
            "gpu:100,idle:6000,gpu:100",
            "--verify",
            "--name",
            "idle",
        ],
    );
    m.apply(&mut cmd)
        .env("KIWI_LOG", "info")
        .env("KIWI_POD_NAME", "idle")
        .env("LD_PRELOAD", profile_dir().join("libkiwi.so"))
        .env("KIWI_SOCKET_DIR", arb.socket_dir())
        .env("KIWI_REQUIRE_ARBITER", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let idle = cmd.spawn().expect("spawn the idle notebook");
    kiwi_tests::wait_until(
        "the idle notebook's memory",
        Duration::from_secs(30),
        || {
            arb.status()
                .gpus
                .iter()
                .any(|g| g.clients.iter().any(|c| c.resident_bytes >= 300 * MIB))
        },
    );
    // 3700 MiB beside two 300 MiB contexts: only a checkpoint of the idle notebook
    // (its context goes only with its process) would make room.
    let holder = burst(
        &m,
        &arb,
        "holder",
        &["--mem", "3700MiB", "--script", "gpu:2000"],
    );
    let (_, hhung) = finish(holder, Duration::from_secs(90));
    let (io, ihung) = finish(idle, Duration::from_secs(90));
    let events = arb.events();
    let log = log_of(&events);
    assert!(!hhung, "the holder hung\n{log}");
    assert!(
        !ihung && io.status.success() && cg.oom_kills() == 0,
        "the idle notebook verifies and is not killed (OOM kills {}): {}\n{log}",
        cg.oom_kills(),
        text(&io)
    );
    assert!(
        !events
            .iter()
            .any(|e| matches!(e.kind, EventKind::Checkpoint { .. })),
        "nobody was checkpointed\n{log}"
    );
    assert!(
        events.iter().any(|e| matches!(&e.kind,
            EventKind::CheckpointSkipped { reason } if reason.contains("memory limit has"))),
        "the event log says why it was not checkpointed\n{log}"
    );
}

/// Issue #38 (found by the soak): the arbiter SIGKILLed while an idle notebook is
/// checkpointed. The driver keeps the process checkpointed, every CUDA call of it
/// waiting inside the driver, until someone restores it, and only an arbiter does.
/// The notebook reconnects to the next arbiter, which learns from the driver that it
/// is checkpointed and restores it once the GPU has room (the holder done): it
/// verifies every byte, as does the holder.
#[test]
fn a_process_checkpointed_when_the_arbiter_dies_is_restored_by_the_next() {
    checkpointed_when_the_arbiter_dies("ckpt-restart", &[]);
}

/// The same for an application that maps its own virtual memory (PyTorch's
/// `expandable_segments`, `gpuburst --alloc vmm`).
#[test]
fn a_vmm_process_checkpointed_when_the_arbiter_dies_is_restored_by_the_next() {
    checkpointed_when_the_arbiter_dies("ckpt-restart-vmm", &["--alloc", "vmm"]);
}

fn checkpointed_when_the_arbiter_dies(tag: &str, alloc: &[&str]) {
    let m = SimMachine::new(tag, 1, 4096 * MIB)
        .unwrap_or_else(|e| panic!("{e}"))
        .with_env("KIWI_SIM_CONTEXT_MEMORY", "300MiB");
    m.populate().unwrap_or_else(|e| panic!("{e}"));
    let mut arb = Arbiter::start_evicting(&["--tq", "1"], m.env());
    let idle_args = [
        alloc,
        &["--mem", "200MiB", "--script", "gpu:100,idle:6000,gpu:100"],
    ]
    .concat();
    let idle = burst(&m, &arb, "idle", &idle_args);
    kiwi_tests::wait_until(
        "the idle notebook's memory",
        Duration::from_secs(30),
        || {
            arb.status()
                .gpus
                .iter()
                .any(|g| g.clients.iter().any(|c| c.resident_bytes >= 200 * MIB))
        },
    );
    let holder = burst(
        &m,
        &arb,
        "holder",
        &["--mem", "3600MiB", "--script", "gpu:3000"],
    );
    kiwi_tests::wait_until(
        "the idle notebook checkpointed",
        Duration::from_secs(60),
        || {
            arb.status()
                .gpus
                .iter()
                .any(|g| g.clients.iter().any(|c| c.checkpointed))
        },
    );
    let before = log_of(&arb.events());
    arb.restart_hard();
    let (ho, hhung) = finish(holder, Duration::from_secs(90));
    let (io, ihung) = finish(idle, Duration::from_secs(90));
    let log = log_of(&arb.events());
    for (tag, o, hung) in [("holder", &ho, hhung), ("idle", &io, ihung)] {
        assert!(
            !hung && o.status.success(),
            "{tag}: {}\n--- the first arbiter's log\n{before}\n--- the second's\n{log}",
            text(o)
        );
    }
}
