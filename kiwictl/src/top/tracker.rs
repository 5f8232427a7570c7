//! What `top` remembers between refreshes: when each hold began and whether the
//! arbiter asked for it back (from the event log), the clients' last states, and the
//! swap rates over the last interval. Owns no terminal and draws nothing.

use std::collections::HashMap;

use anyhow::{bail, Result};
use kiwi_protocol::{ClientState, ControlReply, ControlRequest, Event, EventKind, StatusReport};

use crate::control::Control;

/// The current hold of a client, as the event log tells it.
#[derive(Debug, Clone, Copy)]
pub(super) struct Hold {
    /// When the hold (or its exclusive part) began, arbiter clock.
    pub(super) since_ns: u64,
    pub(super) exclusive: bool,
    /// When the arbiter asked for the GPU back, if it did.
    pub(super) drop_ns: Option<u64>,
}

/// Bytes per second swapped in and out over the last refresh interval.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(super) struct Rate {
    pub(super) in_bps: f64,
    pub(super) out_bps: f64,
}

/// A client on a GPU: (GPU UUID, client id).
pub(super) type Key = (String, u64);

#[derive(Debug, Default)]
pub(super) struct Tracker {
    pub(super) next_seq: u64,
    /// The arbiter's clock at the last event fetch; `None` before the first.
    last_now_ns: Option<u64>,
    pub(super) holds: HashMap<Key, Hold>,
    states: HashMap<Key, ClientState>,
    /// `None` until two refreshes have been seen.
    pub(super) rates: Option<HashMap<Key, Rate>>,
}

impl Tracker {
    /// One refresh: the status report, then the events logged since the last one.
    pub(super) fn refresh(
        &mut self,
        ctl: &mut Control,
        gpu: &Option<String>,
    ) -> Result<StatusReport> {
        let report = match ctl.call(&ControlRequest::Status { gpu: gpu.clone() })? {
            ControlReply::Status(r) => r,
            other => bail!("unexpected reply from the arbiter: {other:?}"),
        };
        let (events, now_ns) = ctl.events(gpu.clone(), self.next_seq)?;
        self.fold(&report, &events, now_ns);
        Ok(report)
    }

    pub(super) fn fold(&mut self, report: &StatusReport, events: &[Event], now_ns: u64) {
        if let Some(last) = events.last() {
            self.next_seq = last.seq + 1;
        }
        let mut swapped: HashMap<Key, (u64, u64)> = HashMap::new();
        for e in events {
            let Some(id) = e.client else { continue };
            let key = (e.gpu.clone(), id);
            match &e.kind {
                EventKind::Grant { exclusive, .. } => {
                    self.holds.insert(
                        key,
                        Hold {
                            since_ns: e.t_ns,
                            exclusive: *exclusive,
                            drop_ns: None,
                        },
                    );
                }
                EventKind::Drop { .. } => {
                    if let Some(h) = self.holds.get_mut(&key) {
                        h.drop_ns.get_or_insert(e.t_ns);
                    }
                }
                EventKind::Release { .. } | EventKind::Revoke | EventKind::Exit => {
                    self.holds.remove(&key);
                }
                EventKind::SwapIn { bytes, .. } => swapped.entry(key).or_default().0 += bytes,
                EventKind::SwapOut { bytes, .. } => swapped.entry(key).or_default().1 += bytes,
                _ => {}
            }
        }
        if let Some(prev) = self.last_now_ns {
            let dt = now_ns.saturating_sub(prev).max(1) as f64 / 1e9;
            self.rates = Some(
                swapped
                    .into_iter()
                    .map(|(k, (i, o))| {
                        (
                            k,
                            Rate {
                                in_bps: i as f64 / dt,
                                out_bps: o as f64 / dt,
                            },
                        )
                    })
                    .collect(),
            );
        }
        self.last_now_ns = Some(now_ns);

        // A shared holder that becomes the exclusive one (the working sets stopped
        // fitting) starts its TQ then; the log has no event for it, so the first
        // frame that shows it holding stands in for the moment.
        let mut states = HashMap::new();
        for g in &report.gpus {
            for c in &g.clients {
                let key = (g.uuid.clone(), c.id);
                if c.state == ClientState::Holding {
                    let seen_running = self.states.get(&key) == Some(&ClientState::Running);
                    if let Some(h) = self.holds.get_mut(&key) {
                        if !h.exclusive {
                            h.exclusive = true;
                            if seen_running {
                                h.since_ns = h.since_ns.max(report.now_ns);
                            }
                        }
                    }
                }
                states.insert(key, c.state);
            }
        }
        self.states = states;
        self.holds.retain(|k, _| self.states.contains_key(k));
    }
}
