//! Running the checkpoints and restores the schedulers ask for ([`Output::Checkpoint`],
//! [`Output::Restore`]): one task takes them in order and makes each driver call on
//! tokio's blocking pool (a checkpoint copies a process's device memory out; the
//! daemon's thread must go on answering), then feeds the outcome back to the GPU's
//! scheduler under the state lock.
//!
//! Only a registered client's process is ever touched: the pid is the one the kernel
//! gave for the connection (`SO_PEERCRED`), and its start time, read when it
//! connected, must still match, so a pid that exited and was reused by someone else's
//! process is never checkpointed.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, watch};

use super::state::{Shared, State};
use crate::checkpoint::{CheckpointError, Checkpointer, Held};
use crate::clock::monotonic_ns;
use crate::sched::{CheckpointFailure, ClientId};

/// How long a lock may wait for the process's submitted work: a client chosen is
/// idle (it does not hold the GPU and answered its reclaim), so its queues are empty
/// or nearly.
const LOCK_TIMEOUT: Duration = Duration::from_secs(2);

/// What a [`Job`] does to a client's process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Task {
    Checkpoint,
    Restore,
    /// Asks the driver where it holds a client that came back after a restart
    /// ([`learn_if_left`]).
    Learn,
}

/// One checkpoint or restore asked by GPU `gpu`'s scheduler, or a look at a client
/// that came back.
#[derive(Debug)]
pub(super) struct Job {
    pub gpu: String,
    pub id: ClientId,
    pub pid: u32,
    pub task: Task,
}

/// Who connected: the pid and its start time (clock ticks since boot), read as it
/// connects. A pid and its start time name one process for good (a pid reused later
/// has another start time), without holding a descriptor per connection, which the
/// connection caps count on.
pub(super) fn identity(pid: u32) -> Option<(u32, u64)> {
    if pid == 0 {
        return None;
    }
    kiwi_config::containers::process_start(pid as i32).map(|t| (pid, t))
}

/// Why `job` may not run: its client is gone or its process is not the one that
/// connected.
fn refuse(st: &State, job: &Job) -> Option<&'static str> {
    let conn = st.clients.get(&job.id)?;
    match conn.process {
        None => Some("its process was not known when it connected"),
        Some((pid, _)) if pid != job.pid => Some("its pid is not the one that connected"),
        Some((pid, start)) => match kiwi_config::containers::process_start(pid as i32) {
            Some(now) if now == start => None,
            _ => Some("its process exited"),
        },
    }
}

fn failure(e: CheckpointError) -> CheckpointFailure {
    CheckpointFailure {
        permanent: e.permanent(),
        reason: e.to_string(),
    }
}

pub(super) async fn run(
    shared: Arc<Shared>,
    checkpointer: Arc<dyn Checkpointer>,
    mut jobs: mpsc::UnboundedReceiver<Job>,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        let job = tokio::select! {
            j = jobs.recv() => match j {
                Some(j) => j,
                None => return,
            },
            _ = stop.changed() => {
                restore_all(&shared, &checkpointer).await;
                return;
            }
        };
        let (skip, keeps) = {
            let st = shared.lock();
            if !st.clients.contains_key(&job.id) {
                continue;
            }
            let keeps: u64 = st
                .gpus
                .values()
                .map(|g| g.sched.process_device_bytes(job.pid))
                .fold(0, u64::saturating_add);
            (refuse(&st, &job), keeps)
        };
        if job.task == Task::Learn {
            if skip.is_none() {
                learn(&shared, &checkpointer, &job).await;
            }
            continue;
        }
        let restore = job.task == Task::Restore;
        // The driver keeps a checkpointed process's GPU memory in that process's
        // host memory, which its memory limit pays for: where that has no room, the
        // checkpoint would have the kernel kill it. Skipped, and tried again later.
        let short = (!restore && skip.is_none())
            .then(|| kiwi_config::cgroup::memory_room(job.pid))
            .flatten()
            .filter(|&room| room < keeps);
        // A spill under way would wait in the driver, holding the shim's allocator,
        // until the restore (`super::pool::SPILL_QUIET`).
        let spilling = (!restore && skip.is_none())
            .then(|| shared.pool_book.spilled_lately(job.pid))
            .flatten();
        let outcome = match (skip, short) {
            (None, None) if spilling.is_some() => Err(CheckpointFailure {
                reason: format!(
                    "checkpoint skipped: its process was asked to move swapped-out memory to the disk tier {} ms ago, and may be doing so",
                    spilling.unwrap_or_default().as_millis()
                ),
                permanent: false,
            }),
            (Some(why), _) => Err(CheckpointFailure {
                reason: format!(
                    "{} skipped: {why}",
                    if restore { "restore" } else { "checkpoint" }
                ),
                permanent: true,
            }),
            (None, Some(room)) => Err(CheckpointFailure {
                reason: format!(
                    "checkpoint skipped: the driver would keep its {} MiB of GPU memory in the process, and its memory limit has {} MiB free",
                    keeps >> 20,
                    room >> 20
                ),
                permanent: false,
            }),
            (None, None) => {
                let c = checkpointer.clone();
                let pid = job.pid;
                let ran = tokio::task::spawn_blocking(move || {
                    let t0 = Instant::now();
                    let r = if restore {
                        c.restore(pid)
                    } else {
                        c.checkpoint(pid, LOCK_TIMEOUT)
                    };
                    r.map(|()| t0.elapsed().as_nanos() as u64)
                })
                .await;
                match ran {
                    Ok(r) => r.map_err(failure),
                    Err(e) => Err(CheckpointFailure {
                        reason: format!("the driver's checkpoint call panicked: {e}"),
                        permanent: true,
                    }),
                }
            }
        };
        let mut st = shared.lock();
        let now = monotonic_ns();
        let outs = match st.gpus.get_mut(&job.gpu) {
            Some(g) if restore => g.sched.restore_done(now, job.id, outcome),
            Some(g) => g.sched.checkpoint_done(now, job.id, outcome),
            None => continue,
        };
        st.dispatch(&job.gpu, outs);
        drop(st);
        shared.timer.notify_one();
    }
}

/// A stopping daemon restores every process it checkpointed: a process left locked
/// would block in its next CUDA call for good.
async fn restore_all(shared: &Shared, checkpointer: &Arc<dyn Checkpointer>) {
    let pids: Vec<u32> = {
        let st = shared.lock();
        st.gpus
            .values()
            .flat_map(|g| g.sched.checkpointed_pids())
            .collect()
    };
    for pid in pids {
        let c = checkpointer.clone();
        let r = tokio::task::spawn_blocking(move || c.restore(pid)).await;
        match r {
            Ok(Ok(())) => log_line!("INFO", "restored process {pid} before stopping"),
            Ok(Err(e)) => log_line!("WARN", "could not restore process {pid}: {e}"),
            Err(e) => log_line!("WARN", "could not restore process {pid}: {e}"),
        }
    }
}

/// After a restart, a client that comes back may have been left checkpointed or
/// locked by the arbiter before (killed without its shutdown): [`learn`] asks the
/// driver.
pub(super) fn learn_if_left(st: &State, gpu: &str, id: ClientId, pid: u32) {
    if let Some(tx) = &st.checkpoint_jobs {
        let _ = tx.send(Job {
            gpu: gpu.to_string(),
            id,
            pid,
            task: Task::Learn,
        });
    }
}

/// Where the driver holds `job`'s process. Locked (its memory still on the GPU): it
/// is unlocked at once. Checkpointed: its GPU's scheduler learns so and restores it
/// as any other, before its next grant or once its memory fits (a restore now could
/// find no room, and a client thought running would be granted the GPU while its
/// calls wait in the driver for good). Running: left alone.
async fn learn(shared: &Shared, checkpointer: &Arc<dyn Checkpointer>, job: &Job) {
    let (c, pid) = (checkpointer.clone(), job.pid);
    let held = match tokio::task::spawn_blocking(move || c.held(pid)).await {
        Ok(Ok(h)) => h,
        // No CUDA state (a client that reports without CUDA): nothing to undo.
        Ok(Err(_)) | Err(_) => return,
    };
    match held {
        Held::Running => {
            let mut st = shared.lock();
            let now = monotonic_ns();
            st.step(&job.gpu, |s| s.found_running(now, job.id));
        }
        Held::Locked => {
            let c = checkpointer.clone();
            match tokio::task::spawn_blocking(move || c.restore(pid)).await {
                Ok(Ok(())) => log_line!(
                    "INFO",
                    "process {pid} was left locked by the arbiter before: unlocked"
                ),
                Ok(Err(e)) => log_line!("WARN", "could not unlock process {pid}: {e}"),
                Err(e) => log_line!("WARN", "could not unlock process {pid}: {e}"),
            }
        }
        Held::Checkpointed => {
            log_line!(
                "INFO",
                "process {pid} was left checkpointed by the arbiter before: restored before its next turn"
            );
            let mut st = shared.lock();
            let now = monotonic_ns();
            st.step(&job.gpu, |s| s.found_checkpointed(now, job.id));
            drop(st);
            shared.timer.notify_one();
        }
    }
}
