//! The daemon's clocks: one timer task sleeps until the earliest scheduler deadline
//! (TQ expiry, grace expiry, the post-restart resume window) and ticks the
//! schedulers then ([`run_timers`]); where NVML loaded, a reconcile task gives them
//! the driver's per-process figures every second ([`run_reconcile`]).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use super::state::Shared;
use crate::clock::monotonic_ns;
use crate::gpus;

pub(super) async fn run_timers(shared: Arc<Shared>, mut stop: watch::Receiver<bool>) {
    loop {
        let wait = {
            let st = shared.lock();
            st.next_deadline()
                .map(|d| Duration::from_nanos(d.saturating_sub(monotonic_ns())))
        };
        let sleep = async {
            match wait {
                Some(d) => tokio::time::sleep(d).await,
                None => std::future::pending::<()>().await,
            }
        };
        tokio::select! {
            _ = sleep => {
                let mut st = shared.lock();
                let now = monotonic_ns();
                let uuids: Vec<String> = st
                    .gpus
                    .iter()
                    .filter(|(_, g)| g.sched.next_deadline().is_some_and(|d| d <= now))
                    .map(|(u, _)| u.clone())
                    .collect();
                for u in uuids {
                    st.step(&u, |s| s.tick(now));
                }
            }
            _ = shared.timer.notified() => {}
            _ = stop.changed() => return,
        }
    }
}

/// Gives each GPU's scheduler the driver's per-process figures every
/// [`crate::sched::RECONCILE_INTERVAL_NS`]
/// ([`GpuScheduler::reconcile`](crate::sched::GpuScheduler::reconcile)): NVML is
/// asked outside the state lock, on a blocking thread, so a slow NVML holds up
/// nobody. Every GPU NVML knows is asked, and one with processes but no entry yet
/// gets one, as at its first client's registration: a process outside Kiwi is then
/// counted before the first client arrives, and that client told the truth.
pub(super) async fn run_reconcile(
    shared: Arc<Shared>,
    used: Arc<dyn gpus::UsedMemory>,
    mut stop: watch::Receiver<bool>,
) {
    let every = Duration::from_nanos(crate::sched::RECONCILE_INTERVAL_NS);
    loop {
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = stop.changed() => return,
        }
        let uuids: Vec<String> = {
            let st = shared.lock();
            let known = match &st.cfg.gpus {
                gpus::GpuTruth::Nvml(known) => known.iter().map(|k| k.uuid.clone()).collect(),
                gpus::GpuTruth::Claims => Vec::new(),
            };
            let mut uuids: Vec<String> = st.gpus.keys().cloned().chain(known).collect();
            uuids.sort();
            uuids.dedup();
            uuids
        };
        if uuids.is_empty() {
            continue;
        }
        let used = used.clone();
        let Ok(figures) = tokio::task::spawn_blocking(move || {
            uuids
                .into_iter()
                .filter_map(|u| used.process_bytes(&u).map(|p| (u, p)))
                .collect::<Vec<_>>()
        })
        .await
        else {
            continue;
        };
        let mut st = shared.lock();
        let now = monotonic_ns();
        for (u, procs) in figures {
            if !st.gpus.contains_key(&u) && !procs.is_empty() {
                let total = match &st.cfg.gpus {
                    gpus::GpuTruth::Nvml(known) => {
                        known.iter().find(|k| k.uuid == u).map(|k| k.total_bytes)
                    }
                    gpus::GpuTruth::Claims => None,
                };
                if let Some(total) = total {
                    let _ = st.admit_gpu(now, &u, total);
                }
            }
            st.step(&u, |s| s.reconcile(now, &procs));
        }
        drop(st);
        shared.timer.notify_one();
    }
}
