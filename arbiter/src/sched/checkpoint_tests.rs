//! Whole-process eviction in the scheduler ([`super::checkpoint`]), with simulated
//! time.

use super::checkpoint::{
    Ckpt, CHECKPOINT_IDLE_NS, RESTORE_RETRY_NS, RETRY_NS, TENANT_EVICTIONS, VICTIM_EVICTIONS,
};
use super::*;

const MIB: u64 = 1 << 20;
const SEC: u64 = 1_000_000_000;
const MS: u64 = 1_000_000;

fn usage(ws: u64, resident: u64) -> Usage {
    Usage {
        working_set_bytes: ws,
        resident_bytes: resident,
    }
}

/// A 4000 MiB GPU with two clients of 3600 MiB working sets and 300 MiB contexts
/// (host pids 101, 102): the TensorFlow-style pair of issue #24, which can never both
/// be resident beside each other's context. Client 1 holds the GPU, 200 MiB short.
fn pair(checkpoint: bool) -> (GpuScheduler, Vec<Output>) {
    let mut s = sched_4000(checkpoint);
    for (id, pid) in [(1, 101), (2, 102)] {
        let info = ClientInfo {
            host_pid: pid,
            unswappable: Some(300 * MIB),
            room_info: true,
            ..ClientInfo::default()
        };
        s.register(0, id, info, usage(3600 * MIB, 0), None);
    }
    s.request(MS, 1);
    s.usage(2 * MS, 1, usage(3600 * MIB, 3400 * MIB));
    let outs = s.no_room(600 * MS, 1, 200 * MIB, || None);
    (s, outs)
}

/// A 4000 MiB GPU, TQ 1 s, grace 500 ms; whole processes evicted when `checkpoint`.
fn sched_4000(checkpoint: bool) -> GpuScheduler {
    GpuScheduler::new(
        4000 * MIB,
        4000 * MIB,
        Settings {
            scheduler_on: true,
            tq_ms: 1_000,
        },
        500,
    )
    .with_checkpoint(checkpoint)
}

fn checkpoints(outs: &[Output]) -> Vec<(ClientId, u32)> {
    outs.iter()
        .filter_map(|o| match o {
            Output::Checkpoint { id, pid } => Some((*id, *pid)),
            _ => None,
        })
        .collect()
}

fn restores(outs: &[Output]) -> Vec<(ClientId, u32)> {
    outs.iter()
        .filter_map(|o| match o {
            Output::Restore { id, pid } => Some((*id, *pid)),
            _ => None,
        })
        .collect()
}

fn granted(outs: &[Output], to: ClientId) -> bool {
    outs.iter()
        .any(|o| matches!(o, Output::Send(id, ArbiterMsg::Grant { .. }) if *id == to))
}

fn logged(outs: &[Output], f: impl Fn(&EventKind) -> bool) -> bool {
    outs.iter().any(|o| matches!(o, Output::Log(_, k) if f(k)))
}

#[test]
fn what_paging_cannot_free_is_checkpointed_and_restored_before_the_next_turn() {
    let (mut s, outs) = pair(true);
    // Client 2 has nothing resident to reclaim: its context is what is in the way.
    assert_eq!(checkpoints(&outs), vec![(2, 102)], "{outs:?}");
    assert_eq!(s.fixed(), 600 * MIB);
    // Asked once: a second `no_room` while it runs asks nothing more.
    let again = s.no_room(850 * MS, 1, 200 * MIB, || None);
    assert!(checkpoints(&again).is_empty(), "{again:?}");
    let outs = s.checkpoint_done(900 * MS, 2, Ok(300 * MS));
    assert!(logged(&outs, |k| matches!(
        k,
        EventKind::Checkpoint { bytes, duration_ns } if *bytes == 300 * MIB && *duration_ns == 300 * MS
    )));
    assert_eq!(s.fixed(), 300 * MIB, "its context is off the GPU");
    let st = s.status(900 * MS, 0, "GPU-x");
    assert!(st.clients.iter().any(|c| c.id == 2 && c.checkpointed));
    // Its turn: restored first, granted once restored.
    s.request(950 * MS, 2);
    assert_eq!(
        s.fixed(),
        600 * MIB,
        "waiting: its context must come back first"
    );
    let outs = s.tick(SEC + MS);
    let outs = [outs, s.release(SEC + 2 * MS, 1, usage(3600 * MIB, 0))].concat();
    assert_eq!(restores(&outs), vec![(2, 102)], "{outs:?}");
    assert!(!granted(&outs, 2), "not before its restore: {outs:?}");
    assert_eq!(s.fixed(), 600 * MIB, "coming back: counted again");
    let outs = s.restore_done(SEC + 300 * MS, 2, Ok(250 * MS));
    assert!(granted(&outs, 2), "{outs:?}");
    assert!(logged(&outs, |k| matches!(k, EventKind::Restore { .. })));
}

#[test]
fn a_client_heard_from_just_now_is_not_checkpointed() {
    let (mut s, _) = pair(true);
    s.checkpoint_done(
        700 * MS,
        2,
        Err(CheckpointFailure {
            reason: "lock: CUDA_ERROR_NOT_READY".into(),
            permanent: false,
        }),
    );
    // Client 2 just reported its memory: it is at work, maybe inside a driver call.
    let t = 700 * MS + RETRY_NS;
    s.usage(t, 2, usage(3500 * MIB, 0));
    let outs = s.no_room(t + 100 * MS, 1, 200 * MIB, || None);
    assert!(checkpoints(&outs).is_empty(), "{outs:?}");
    let outs = s.no_room(t + CHECKPOINT_IDLE_NS, 1, 200 * MIB, || None);
    assert_eq!(checkpoints(&outs), vec![(2, 102)], "{outs:?}");
}

#[test]
fn without_the_checkpoint_api_nothing_is_checkpointed() {
    let (_, outs) = pair(false);
    assert!(checkpoints(&outs).is_empty(), "{outs:?}");
}

#[test]
fn a_refused_process_is_never_asked_again_and_stays_in_the_holders_way() {
    let (mut s, outs) = pair(true);
    assert_eq!(checkpoints(&outs), vec![(2, 102)]);
    let outs = s.checkpoint_done(
        700 * MS,
        2,
        Err(CheckpointFailure {
            reason: "checkpoint: CUDA_ERROR_NOT_SUPPORTED".into(),
            permanent: true,
        }),
    );
    assert!(logged(
        &outs,
        |k| matches!(k, EventKind::CheckpointSkipped { reason } if reason.contains("NOT_SUPPORTED"))
    ));
    assert_eq!(s.fixed(), 600 * MIB);
    // Client 1's room: client 2's context can no longer be moved.
    assert_eq!(s.room_for(1), Some((300 * MIB, None)));
    let outs = s.no_room(5 * SEC, 1, 200 * MIB, || None);
    assert!(checkpoints(&outs).is_empty(), "{outs:?}");
}

#[test]
fn a_lock_that_timed_out_is_tried_again_after_a_pause() {
    let (mut s, _) = pair(true);
    s.checkpoint_done(
        700 * MS,
        2,
        Err(CheckpointFailure {
            reason: "lock: CUDA_ERROR_NOT_READY".into(),
            permanent: false,
        }),
    );
    assert!(checkpoints(&s.no_room(1000 * MS, 1, 200 * MIB, || None)).is_empty());
    let outs = s.no_room(700 * MS + RETRY_NS, 1, 200 * MIB, || None);
    assert_eq!(checkpoints(&outs), vec![(2, 102)], "{outs:?}");
}

#[test]
fn an_idle_gpu_restores_its_checkpointed_processes() {
    let (mut s, _) = pair(true);
    s.checkpoint_done(700 * MS, 2, Ok(MS));
    // Client 1 gives the GPU back and nobody waits: a second later, 2 comes back.
    let t = 800 * MS;
    let outs = s.release(t, 1, usage(3600 * MIB, 3400 * MIB));
    assert!(restores(&outs).is_empty(), "not at once: {outs:?}");
    assert_eq!(s.next_deadline(), Some(t + RESTORE_WHEN_IDLE_NS));
    assert!(restores(&s.tick(t + RESTORE_WHEN_IDLE_NS - 1)).is_empty());
    // 3400 + 300 + 300 fits in 4000.
    let outs = s.tick(t + RESTORE_WHEN_IDLE_NS);
    assert_eq!(restores(&outs), vec![(2, 102)], "{outs:?}");
    // A restore that finds no room yet asks the others for it (client 1 has 3400 MiB
    // resident) and is tried again later, not in a loop.
    let outs = s.restore_done(
        t + RESTORE_WHEN_IDLE_NS + MS,
        2,
        Err(CheckpointFailure {
            reason: "restore: CUDA_ERROR_OUT_OF_MEMORY".into(),
            permanent: false,
        }),
    );
    assert!(restores(&outs).is_empty());
    assert!(
        outs.iter().any(|o| matches!(o, Output::Send(1, ArbiterMsg::Reclaim { need_bytes }) if *need_bytes == 300 * MIB)),
        "{outs:?}"
    );
    let due = s.next_deadline().expect("a retry");
    assert_eq!(due, t + RESTORE_WHEN_IDLE_NS + MS + RESTORE_RETRY_NS);
    assert_eq!(restores(&s.tick(due)), vec![(2, 102)]);
}

#[test]
fn a_stopping_daemon_knows_whom_to_restore() {
    let (mut s, _) = pair(true);
    assert_eq!(s.checkpointed_pids(), vec![102], "on its way");
    s.checkpoint_done(700 * MS, 2, Ok(MS));
    assert_eq!(s.checkpointed_pids(), vec![102]);
}

/// Issue #24, "no silent livelock": on a GPU whose processes cannot be evicted whole,
/// each client hears the largest other working set, which the memory no swap frees
/// it adds must leave room for; with the API, none (the processes take turns).
#[test]
fn room_names_the_working_set_that_memory_no_swap_frees_must_leave_room_for() {
    let (mut s, _) = pair(false);
    s.usage(SEC, 2, usage(3000 * MIB, 0));
    let keep = |name: &str, bytes: u64| {
        Some(Keep {
            bytes,
            name: name.into(),
        })
    };
    assert_eq!(
        s.room_for(1),
        Some((300 * MIB, keep("client 2", 3000 * MIB)))
    );
    assert_eq!(
        s.room_for(2),
        Some((300 * MIB, keep("client 1", 3600 * MIB)))
    );
    // What was told is what changed: client 2 grows, client 1 hears it.
    let outs = s.usage(2 * SEC, 2, usage(3100 * MIB, 0));
    assert!(
        outs.iter().any(|o| matches!(
            o,
            Output::Send(1, ArbiterMsg::Room { keep: Some(k), .. }) if k.bytes == 3100 * MIB
        )),
        "{outs:?}"
    );
    let (s, _) = pair(true);
    assert_eq!(s.room_for(1), Some((0, None)));
}

/// Issue #42, item 1: a newcomer is told, as taken, what neither a swap nor a
/// checkpoint takes off the GPU: the memory of processes outside Kiwi (NVML) and of
/// processes the daemon cannot name, beside what the driver refused.
#[test]
fn what_no_eviction_moves_is_told_as_taken() {
    let (mut s, _) = pair(true);
    // A process outside Kiwi holds 1 GiB, for three looks.
    for t in 1..=3 {
        s.reconcile(
            t * SEC,
            &[(101, 3700 * MIB), (102, 300 * MIB), (777, 1024 * MIB)],
        );
    }
    assert_eq!(s.room_for(1), Some((1024 * MIB, None)));
    // A client whose host pid is unknown can never be checkpointed.
    let info = ClientInfo {
        host_pid: 0,
        unswappable: Some(200 * MIB),
        room_info: true,
        ..ClientInfo::default()
    };
    s.register(4 * SEC, 3, info, usage(100 * MIB, 0), None);
    assert_eq!(s.room_for(1), Some((1224 * MIB, None)));
    // Nobody is checkpointed for a shortfall that only the outsider's exit ends.
    let mut s = pair(true).0;
    s.checkpoint_done(
        700 * MS,
        2,
        Err(CheckpointFailure {
            reason: "lock: CUDA_ERROR_NOT_READY".into(),
            permanent: false,
        }),
    );
    let t = 700 * MS + RETRY_NS;
    s.usage(t, 1, usage(3600 * MIB, 3000 * MIB));
    let outs = s.no_room(t + CHECKPOINT_IDLE_NS, 1, 600 * MIB, || None);
    assert!(
        checkpoints(&outs).is_empty(),
        "600 MiB short beside a 300 MiB context: {outs:?}"
    );
}

/// A 4000 MiB GPU: holder 1 (pid 101, tenant "uid 1000") and `victims` idle clients
/// with 300 MiB contexts each (pids 201..), nothing of theirs resident.
fn holder_beside(victims: u64) -> GpuScheduler {
    let mut s = sched_4000(true);
    let info = ClientInfo {
        host_pid: 101,
        unswappable: Some(300 * MIB),
        tenant: Some("uid 1000".into()),
        ..ClientInfo::default()
    };
    s.register(0, 1, info, usage(3600 * MIB, 0), None);
    for v in 0..victims {
        let info = ClientInfo {
            host_pid: 201 + v as u32,
            unswappable: Some(300 * MIB),
            tenant: Some(format!("container v{v}")),
            ..ClientInfo::default()
        };
        s.register(0, 2 + v, info, usage(0, 0), None);
    }
    s.request(MS, 1);
    s.usage(2 * MS, 1, usage(3600 * MIB, 3000 * MIB));
    s
}

/// Issue #42, item 2: a tenant that answers every turn with `no_room` gets a process
/// checkpointed for it at most [`VICTIM_EVICTIONS`] times per window, whoever asks,
/// and asks for at most [`TENANT_EVICTIONS`] per window; the log says why not.
#[test]
fn evictions_are_bounded_per_victim_and_per_tenant() {
    let mut s = holder_beside(1);
    let mut t = SEC;
    let mut count = 0;
    let mut said = false;
    // Ten seconds of no_room, each checkpoint answered and restored at once.
    while t < 10 * SEC {
        let outs = s.no_room(t, 1, 300 * MIB, || None);
        said |= logged(
            &outs,
            |k| matches!(k, EventKind::CheckpointSkipped { reason } if reason.contains("checkpointed 2 times each")),
        );
        for (id, _) in checkpoints(&outs) {
            count += 1;
            s.checkpoint_done(t + MS, id, Ok(MS));
            // Restored at once (as a grant of its own would).
            s.clients.get_mut(&id).unwrap().ckpt = Ckpt::None;
        }
        t += 250 * MS;
    }
    assert_eq!(
        count, VICTIM_EVICTIONS,
        "checkpoints of one idle process in 10 s"
    );
    assert!(said, "the limit is in the log");
    // One tenant, many victims: at most TENANT_EVICTIONS per window.
    let mut s = holder_beside(8);
    s.usage(3 * MS, 1, usage(3600 * MIB, 1500 * MIB));
    let outs = s.no_room(SEC, 1, 2100 * MIB, || None);
    assert_eq!(
        checkpoints(&outs).len(),
        TENANT_EVICTIONS,
        "7 contexts short, for one tenant: {outs:?}"
    );
}

/// A holder whose process the driver shows holding no GPU memory at all (a
/// protocol client with no context) gets nobody checkpointed, whatever it claims.
#[test]
fn a_claim_no_process_backs_gets_nobody_checkpointed() {
    let mut s = holder_beside(1);
    s.reconcile(500 * MS, &[(201, 300 * MIB)]);
    let outs = s.no_room(SEC, 1, 300 * MIB, || None);
    assert!(checkpoints(&outs).is_empty(), "{outs:?}");
    assert!(s.clients.values().all(|c| c.ckpt == Ckpt::None));
    assert!(logged(&outs, |k| matches!(
        k,
        EventKind::CheckpointSkipped { reason } if reason.contains("no GPU memory")
    )));
    // Listed with its context: it is believed.
    s.reconcile(1100 * MS, &[(101, 3300 * MIB), (201, 300 * MIB)]);
    let outs = s.no_room(2 * SEC, 1, 300 * MIB, || None);
    assert_eq!(checkpoints(&outs), vec![(2, 201)], "{outs:?}");

    // A process looked at while it was checkpointed holds nothing then: once
    // restored it is not taken for one with no GPU memory (found by the soak).
    let mut s = holder_beside(1);
    s.clients.get_mut(&1).unwrap().ckpt = Ckpt::Checkpointed;
    s.reconcile(500 * MS, &[(201, 300 * MIB)]);
    assert_eq!(s.clients[&1].driver_bytes, Some(0));
    s.clients.get_mut(&1).unwrap().ckpt = Ckpt::None;
    let outs = s.no_room(SEC, 1, 300 * MIB, || None);
    assert_eq!(checkpoints(&outs), vec![(2, 201)], "{outs:?}");
}

/// Issue #42, item 4: a client that never answers its reclaim (a silent hint
/// provider, a hostile shim) frees nothing: once the reclaim is overdue (the grace
/// and the slowest swap-out of what it was asked), its process is checkpointed,
/// instead of the holder waiting for it for good.
#[test]
fn a_client_that_never_answers_its_reclaim_is_checkpointed_once_overdue() {
    let mut s = sched_4000(true);
    for (id, pid, ws) in [(2, 201, 1000 * MIB), (1, 101, 3600 * MIB)] {
        let info = ClientInfo {
            host_pid: pid,
            unswappable: Some(300 * MIB),
            ..ClientInfo::default()
        };
        let resident = if id == 2 { ws } else { 0 };
        s.register(0, id, info, usage(ws, resident), None);
    }
    s.request(MS, 1);
    assert!(s.clients[&2].reclaim_pending > 0, "asked to make room");
    s.usage(2 * MS, 1, usage(3600 * MIB, 2400 * MIB));
    // Not overdue yet: its swap-out may still be on the way.
    let outs = s.no_room(SEC, 1, 1200 * MIB, || None);
    assert!(checkpoints(&outs).is_empty(), "{outs:?}");
    let due = s.reclaim_overdue_at(&s.clients[&2]).expect("a reclaim");
    assert!(due <= MS + 500 * MS + 1000 * MIB, "overdue at {due}");
    let outs = s.no_room(due, 1, 1200 * MIB, || None);
    assert_eq!(checkpoints(&outs), vec![(2, 201)], "{outs:?}");
    // Checkpointed: none of its memory counts on the GPU any more.
    s.checkpoint_done(due + MS, 2, Ok(MS));
    assert_eq!(s.need_for(1), 0, "the holder's 1200 MiB fit");
}

/// Issue #42, item 3: a checkpointed process is restored as soon as the GPU can
/// hold it beside the holders' whole working sets, not only once nobody holds.
#[test]
fn a_checkpointed_process_comes_back_as_soon_as_it_fits_beside_the_holder() {
    let (mut s, _) = pair(true);
    s.checkpoint_done(700 * MS, 2, Ok(MS));
    // Client 1 still holds 3600 MiB beside 300 + 300: no room for 2's context.
    assert!(restores(&s.tick(2 * SEC)).is_empty());
    // It frees 400 MiB of its working set and keeps the GPU: 2 fits now.
    let outs = s.usage(3 * SEC, 1, usage(3200 * MIB, 3200 * MIB));
    assert_eq!(restores(&outs), vec![(2, 102)], "{outs:?}");
}

/// Issue #38 (found by the soak): a client that comes back to a restarted arbiter
/// while the driver holds its process checkpointed is known as checkpointed (its
/// memory no swap frees off the GPU), told so, not asked to spill to the pool's disk
/// tier (its calls would wait in the driver), and restored before it is granted;
/// one granted meanwhile is restored at once.
#[test]
fn a_process_found_checkpointed_after_a_restart_is_restored_before_its_turn() {
    let mut s = sched_4000(true);
    let info = |pid| ClientInfo {
        host_pid: pid,
        unswappable: Some(300 * MIB),
        notices: true,
        ..ClientInfo::default()
    };
    let resume = Some(kiwi_protocol::Resume {
        holding: false,
        waiting: false,
    });
    s.register(0, 1, info(101), usage(1000 * MIB, 0), resume);
    assert!(s.activity(1).is_some(), "idle: the disk tier may ask it");
    let outs = s.found_checkpointed(MS, 1);
    assert!(outs.iter().any(|o| matches!(
        o,
        Output::Send(1, ArbiterMsg::Checkpointed { restored: false })
    )));
    assert_eq!(s.clients[&1].ckpt, Ckpt::Checkpointed);
    assert_eq!(
        s.activity(1),
        None,
        "never asked to spill while checkpointed"
    );
    // Its turn (past the post-restart window) comes only after a restore.
    let outs = s.request(30 * SEC, 1);
    assert_eq!(restores(&outs), vec![(1, 101)], "{outs:?}");
    assert!(!granted(&outs, 1), "{outs:?}");
    let outs = s.restore_done(30 * SEC + MS, 1, Ok(MS));
    assert!(granted(&outs, 1), "{outs:?}");
    assert!(s.activity(1).is_none(), "it holds");

    // Granted before the driver's answer came: restored at once.
    let mut s = sched_4000(true);
    s.register(0, 2, info(102), usage(1000 * MIB, 0), resume);
    let outs = s.request(30 * SEC, 2);
    assert!(granted(&outs, 2), "{outs:?}");
    let outs = s.found_checkpointed(30 * SEC + MS, 2);
    assert_eq!(restores(&outs), vec![(2, 102)], "{outs:?}");
    assert_eq!(s.clients[&2].ckpt, Ckpt::Restoring);
    // Running: told so (the arbiter before may have died between a restore and its
    // notice).
    let mut s = sched_4000(true);
    s.register(0, 3, info(103), usage(0, 0), resume);
    let outs = s.found_running(MS, 3);
    assert!(outs.iter().any(|o| matches!(
        o,
        Output::Send(3, ArbiterMsg::Checkpointed { restored: true })
    )));
    assert_eq!(s.clients[&3].ckpt, Ckpt::None);
}
