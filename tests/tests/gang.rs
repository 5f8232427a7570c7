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
