//! Gang turns (issue #41) through the real arbiter and real sockets: two 2-GPU jobs
//! crosswise on two oversubscribed GPUs, with a notebook process on each, are granted
//! their GPUs together, one scheduling step apart at most, as the arbiter's own
//! event log shows.

use std::time::Duration;

use kiwi_protocol::{ArbiterMsg, ClientMsg, EventKind, Usage};
use kiwi_tests::{register_msg, wait_until, Arbiter, Client, FakeClient};

const GIB: u64 = 1 << 30;

fn member(arb: &Arbiter, gpu: &str, group: &str) -> Client {
    let mut r = register_msg(gpu, 4 * GIB, 3 * GIB);
    r.group = Some(group.to_string());
    Client::register(&arb.client_socket(), r)
}

fn granted(c: &mut Client) {
    c.wait_for(Duration::from_secs(20), |m| {
        matches!(
            m,
            ArbiterMsg::Grant {
                exclusive: true,
                ..
            }
        )
    })
    .unwrap_or_else(|| panic!("client {} was never granted", c.id));
    c.conn
        .send(&ClientMsg::Usage(Usage {
            working_set_bytes: 3 * GIB,
            resident_bytes: 3 * GIB,
        }))
        .unwrap();
}

fn dropped_then_release(c: &mut Client) {
    c.wait_for(Duration::from_secs(20), |m| {
        matches!(m, ArbiterMsg::Drop { .. })
    })
    .unwrap_or_else(|| panic!("client {} was never dropped", c.id));
    c.conn
        .send(&ClientMsg::Release(Usage {
            working_set_bytes: 3 * GIB,
            resident_bytes: 0,
        }))
        .unwrap();
}

#[test]
fn crosswise_two_gpu_jobs_and_notebooks_are_granted_by_group() {
    let arb = Arbiter::start(&["--tq", "0.3", "--grace-ms", "5000"]);
    let ws = (3 * GIB).to_string();
    let total = (4 * GIB).to_string();
    // A notebook on each GPU holds it first.
    let mut n1 = FakeClient::spawn(
        &arb,
        &[
            "--gpu",
            "GPU-a",
            "--total",
            &total,
            "--ws",
            &ws,
            "--request",
        ],
    );
    n1.expect("GRANTED");
    let mut n2 = FakeClient::spawn(
        &arb,
        &[
            "--gpu",
            "GPU-b",
            "--total",
            &total,
            "--ws",
            &ws,
            "--request",
        ],
    );
    n2.expect("GRANTED");
    // Job J: rank 0 on a, rank 1 on b. Job K crosswise.
    let mut j0 = member(&arb, "GPU-a", "J");
    let mut j1 = member(&arb, "GPU-b", "J");
    let mut k0 = member(&arb, "GPU-b", "K");
    let mut k1 = member(&arb, "GPU-a", "K");
    // J asks first: both GPUs are claimed for it, and the notebooks' quanta end.
    j0.conn.send(&ClientMsg::Request).unwrap();
    wait_until("J's claim on both GPUs", Duration::from_secs(10), || {
        arb.status().gpus.iter().all(|g| {
            g.group_turn
                .as_ref()
                .is_some_and(|t| t.group.ends_with("/ J"))
        })
    });
    for c in [&mut j1, &mut k0, &mut k1] {
        c.conn.send(&ClientMsg::Request).unwrap();
    }
    n1.expect("DROP");
    n2.expect("DROP");
    granted(&mut j0);
    granted(&mut j1);
    let st = arb.status();
    for g in &st.gpus {
        let t = g.group_turn.as_ref().expect("reserved");
        assert!(t.running && t.group.ends_with("/ J"), "{:?}", g.group_turn);
        assert!(
            g.clients
                .iter()
                .filter(|c| c.group.as_deref().is_some_and(|k| k.ends_with("/ J")))
                .count()
                == 1,
            "one member of J on GPU {}",
            g.uuid
        );
    }
    // J's quantum ends on both at once; K's turn follows, on both at once.
    dropped_then_release(&mut j0);
    dropped_then_release(&mut j1);
    granted(&mut k0);
    granted(&mut k1);
    // Nobody else waits: K keeps both GPUs until it lets go (early releases).
    for c in [&mut k0, &mut k1] {
        c.conn
            .send(&ClientMsg::Release(Usage {
                working_set_bytes: 3 * GIB,
                resident_bytes: 3 * GIB,
            }))
            .unwrap();
    }
    wait_until("K's turn ends", Duration::from_secs(10), || {
        arb.status().gpus.iter().all(|g| g.group_turn.is_none())
    });

    // One clock at the source: the arbiter's event log.
    let ev = arb.events();
    let grant_at = |id: u64| -> Vec<u64> {
        ev.iter()
            .filter(|e| e.client == Some(id) && matches!(e.kind, EventKind::Grant { .. }))
            .map(|e| e.t_ns)
            .collect()
    };
    for (a, b) in [(&j0, &j1), (&k0, &k1)] {
        let (ta, tb) = (grant_at(a.id), grant_at(b.id));
        assert_eq!(ta.len(), 1, "{ev:#?}");
        assert_eq!(tb.len(), 1, "{ev:#?}");
        let apart = ta[0].abs_diff(tb[0]);
        assert!(
            apart < 50_000_000,
            "ranks {} and {} granted {} ms apart",
            a.id,
            b.id,
            apart / 1_000_000
        );
    }
    let turns: Vec<(&str, &str)> = ev
        .iter()
        .filter_map(|e| match &e.kind {
            EventKind::GroupTurn { group, gpus: 2 } => Some((group.as_str(), e.gpu.as_str())),
            _ => None,
        })
        .collect();
    assert_eq!(turns.len(), 4, "a GroupTurn per GPU per turn: {turns:?}");
    // K's grant comes after J's release on both GPUs: no member held while its peer
    // waited behind another job.
    let released = |id: u64| {
        ev.iter()
            .find(|e| e.client == Some(id) && matches!(e.kind, EventKind::Release { .. }))
            .map(|e| e.t_ns)
            .expect("released")
    };
    let k_first = grant_at(k0.id)[0].min(grant_at(k1.id)[0]);
    assert!(k_first >= released(j0.id).max(released(j1.id)));
}

/// A gpuburst under Kiwi on `m`: `args`, in group `group` (none: its process alone).
fn gpuburst(
    m: &kiwi_sim_core::harness::SimMachine,
    arb: &Arbiter,
    group: Option<&str>,
    args: &[&str],
) -> std::process::Child {
    let env: Vec<(&str, &str)> = group.map(|g| ("KIWI_GROUP", g)).into_iter().collect();
    gpuburst_env(m, arb, &env, args)
}

/// [`gpuburst`] with `env` set (and none of the variables that name a job otherwise).
fn gpuburst_env(
    m: &kiwi_sim_core::harness::SimMachine,
    arb: &Arbiter,
    env: &[(&str, &str)],
    args: &[&str],
) -> std::process::Child {
    let mut c = std::process::Command::new(kiwi_tests::bin("gpuburst"));
    m.apply(&mut c)
        .args(args)
        .args(["--verify", "--json"])
        .env("LD_PRELOAD", kiwi_tests::bin("libkiwi.so"))
        .env("KIWI_SOCKET_DIR", arb.socket_dir())
        .env("KIWI_REQUIRE_ARBITER", "1")
        .env_remove("KIWI_GROUP")
        .env_remove("MASTER_ADDR")
        .env_remove("MASTER_PORT")
        .envs(env.iter().copied())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    c.spawn().expect("spawn gpuburst")
}

/// Waits for every gpuburst of `kids` (each at most `limit`): each must exit 0 having
/// verified every byte; the failures' output otherwise.
fn all_verified(kids: Vec<(&str, std::process::Child)>, limit: Duration) {
    let mut failed = Vec::new();
    for (name, c) in kids {
        let (out, hung) = kiwi_tests::finish_within(c, limit);
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let verified = text.contains("\"event\":\"verify\"") && text.contains("\"ok\":true");
        if hung || !out.status.success() || !verified {
            failed.push(format!("{name} (hung {hung}, {:?}):\n{text}", out.status));
        }
    }
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}

/// Two 2-GPU jobs crosswise (ranks that wait for each other every step through
/// stream memory operations, as NCCL ranks do) and a notebook on each GPU, real
/// processes under the shim on two simulated GPUs that none of the pairs fits: all
/// six finish and verify every byte, and every group turn starts on both GPUs in
/// one step.
///
/// It hung in 1 run of 4 before a drop's drain was bounded in a group's turn: a
/// group drop that lands between the two ranks' submissions of a step leaves the
/// first rank's drain waiting for its peer, which the closed gate holds back until
/// the group's next turn (`docs/shim.md`, limits). Now that rank releases with its
/// memory resident after the bound, and its work finishes in the group's next turn.
#[test]
fn crosswise_exchanging_jobs_and_notebooks_finish_and_verify_under_kiwi() {
    use kiwi_sim_core::harness::SimMachine;
    const MIB: u64 = 1 << 20;
    let m = SimMachine::new("gang-jobs", 2, 1024 * MIB).unwrap_or_else(|e| panic!("{e}"));
    let arb = Arbiter::start(&["--tq", "0.3", "--grace-ms", "10000"]);
    let dir = tempfile::tempdir().unwrap();
    let file = |n: &str, rank: u32| format!("{}:{rank}", dir.path().join(n).display());
    let steps = [
        "--mem", "400MiB", "--bursts", "3", "--gpu-ms", "60", "--cpu-ms", "30",
    ];
    let mut kids = Vec::new();
    for (name, dev) in [("notebook-0", "0"), ("notebook-1", "1")] {
        let mut a = steps.to_vec();
        a.extend(["--device", dev, "--name", name]);
        kids.push((name, gpuburst(&m, &arb, None, &a)));
    }
    // Job J: rank 0 on GPU 0, rank 1 on GPU 1, named by KIWI_GROUP; job K
    // crosswise, named only by its torch.distributed rendezvous, as torchrun's ranks
    // on the host are.
    let (j0, j1, k0, k1) = (file("J", 0), file("J", 1), file("K", 0), file("K", 1));
    let j = [("KIWI_GROUP", "J")];
    let k = [("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29577")];
    for (name, env, dev, ex) in [
        ("J0", &j[..], "0", &j0),
        ("J1", &j[..], "1", &j1),
        ("K0", &k[..], "1", &k0),
        ("K1", &k[..], "0", &k1),
    ] {
        let mut a = steps.to_vec();
        a.extend(["--device", dev, "--name", name, "--exchange", ex]);
        a.extend(["--exchange-timeout-ms", "90000"]);
        kids.push((name, gpuburst_env(&m, &arb, env, &a)));
    }
    all_verified(kids, Duration::from_secs(150));

    // Every group turn started on both GPUs in one scheduling step: its two
    // `group_turn` events are logged under one hold of the arbiter's state, with
    // only that step's own events (the grants, room-making) between them. (Their
    // times may lie milliseconds apart on a loaded host: each is taken as it is
    // logged.)
    let ev = arb.events();
    let turns: Vec<(u64, &str, &str)> = ev
        .iter()
        .filter_map(|e| match &e.kind {
            EventKind::GroupTurn { group, .. } => Some((e.seq, group.as_str(), e.gpu.as_str())),
            _ => None,
        })
        .collect();
    assert!(turns.len() >= 4, "both jobs had turns: {turns:?}");
    for job in ["/ J", "/ torch.distributed 127.0.0.1:29577"] {
        assert!(
            turns.iter().any(|t| t.1.ends_with(job)),
            "job {job} had group turns: {turns:?}"
        );
    }
    for pair in turns.chunks(2) {
        assert!(
            pair.len() == 2 && pair[0].1 == pair[1].1 && pair[0].2 != pair[1].2,
            "group turns come in pairs, one per GPU: {turns:?}"
        );
        let between: Vec<&kiwi_protocol::Event> = ev
            .iter()
            .filter(|e| e.seq > pair[0].0 && e.seq < pair[1].0)
            .collect();
        assert!(
            between.len() <= 8
                && between.iter().all(|e| !matches!(
                    e.kind,
                    EventKind::Request | EventKind::Release { .. } | EventKind::Exit
                )),
            "a group's turn did not start in one step: {between:#?}"
        );
    }
}

/// One process with both ranks of a 2-GPU job (`--exchange F:both`: on GPU 0 a write
/// and a wait for GPU 1's write, then GPU 1's, from one thread, as NCCL from one
/// thread launches a collective's kernels device by device), under Kiwi. The shim's
/// queue bound must not wait for GPU 0's queue before the thread has submitted GPU
/// 1's part: that wait would never end (it did: killed after 120 s). Alone on its
/// GPUs, so no drop comes: a drop between the two parts is another matter
/// (`docs/shim.md`, limits).
#[test]
fn one_process_with_both_ranks_is_not_held_up_by_its_own_queue_bound() {
    use kiwi_sim_core::harness::SimMachine;
    const MIB: u64 = 1 << 20;
    let m = SimMachine::new("gang-both", 2, 1024 * MIB).unwrap_or_else(|e| panic!("{e}"));
    let arb = Arbiter::start(&["--tq", "0.3", "--grace-ms", "10000"]);
    let dir = tempfile::tempdir().unwrap();
    let ex = format!("{}:both", dir.path().join("X").display());
    // Many short steps of short kernels: the bound comes round often.
    let args = [
        "--mem",
        "300MiB",
        "--gpu-ms",
        "20",
        "--cpu-ms",
        "5",
        "--bursts",
        "40",
        "--device",
        "0,1",
        "--name",
        "both",
        "--exchange",
        &ex,
        "--exchange-timeout-ms",
        "60000",
        "--kernel-us",
        "500",
    ];
    let kids = vec![("both", gpuburst(&m, &arb, None, &args))];
    all_verified(kids, Duration::from_secs(120));
}

/// One process with both ranks of a 2-GPU job (`--exchange F:both`) beside a
/// notebook on each GPU, TQ 0.1 s. The job never pauses (so never releases early),
/// and its group turn is dropped many times, often between GPU 0's part of a step (a
/// write, then a wait for GPU 1's write) and GPU 1's (60 ms of kernels, then its
/// write). The drop's drain must let the thread submit GPU 1's part (the gate opens
/// again while both turns are held) instead of waiting for it behind the closed gate:
/// it did wait, for good (the process hung; `docs/shim.md`, limits). All three finish
/// and verify every byte.
#[test]
fn a_process_on_two_gpus_dropped_between_its_parts_of_a_step_finishes() {
    use kiwi_sim_core::harness::SimMachine;
    const MIB: u64 = 1 << 20;
    let m = SimMachine::new("gang-both-drops", 2, 1024 * MIB).unwrap_or_else(|e| panic!("{e}"));
    let arb = Arbiter::start(&["--tq", "0.1", "--grace-ms", "10000"]);
    let dir = tempfile::tempdir().unwrap();
    let ex = format!("{}:both", dir.path().join("X").display());
    let mut kids = Vec::new();
    for (name, dev) in [("notebook-0", "0"), ("notebook-1", "1")] {
        let notebook = format!(
            "--mem 600MiB --bursts 4 --gpu-ms 100 --cpu-ms 40 --device {dev} --name {name}"
        );
        let a: Vec<&str> = notebook.split(' ').collect();
        kids.push((name, gpuburst(&m, &arb, None, &a)));
    }
    let job = format!(
        "--mem 600MiB --gpu-ms 60 --cpu-ms 0 --bursts 30 --kernel-us 500 --device 0,1 \
         --name both --exchange {ex} --exchange-timeout-ms 60000"
    );
    let a: Vec<&str> = job.split_whitespace().collect();
    kids.push(("both", gpuburst(&m, &arb, None, &a)));
    all_verified(kids, Duration::from_secs(120));
    // The job's turns were taken back at their quantum's end, mid-step.
    let ev = arb.events();
    let tq_drops = ev
        .iter()
        .filter(|e| {
            matches!(
                e.kind,
                EventKind::Drop {
                    reason: kiwi_protocol::DropReason::TqExpired,
                    ..
                }
            )
        })
        .count();
    assert!(tq_drops >= 4, "turns changed hands: {tq_drops} drops");
}
