//! What a person sees of the turns: the two log lines that explain a wait (who holds
//! the GPU, the place in the queue, the holder's time left; then how long the wait was
//! and what came back in), and each GPU's entry of the JSON that `kiwi_status_json`
//! (a C export of [`crate::exports`]) gives the Python package (`python/kiwi`).
//!
//! This module owns each turn's [`View`] (kept up to date by [`crate::client`] at each
//! change of phase and each `waiting` message) and the wording; it takes plain data
//! (a view, a device's ordinal and UUID) and uses no other module but the log. Nothing here runs on
//! the submission fast path: the wait line is written from the waiting thread's slow
//! path, and the status is read by whoever asks, without the turn's state lock or an
//! allocator's lock (it never waits behind a swap).

use std::time::{Duration, Instant};

/// Version of the JSON `kiwi_status_json` writes (its `kiwi` field).
pub const STATUS_VERSION: u32 = 1;

/// What the arbiter last said about a wait ([`kiwi_protocol::ArbiterMsg::Waiting`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Why {
    pub holder: Option<String>,
    pub other_holders: u32,
    pub ahead: u32,
    /// When the holder's quantum ends (it is asked to give the GPU back then).
    pub quantum_end: Option<Instant>,
}

/// One turn as people see it.
#[derive(Debug, Clone, Default)]
pub struct View {
    pub waiting_since: Option<Instant>,
    pub holding_since: Option<Instant>,
    pub exclusive: bool,
    /// Finished waits and holds, summed.
    pub waited: Duration,
    pub held: Duration,
    /// Grants so far.
    pub grants: u64,
    pub why: Option<Why>,
    /// The last wait that ended in a grant, and the swap-in after it (bytes, time).
    pub last_wait: Option<Duration>,
    pub last_swap_in: Option<(u64, Duration)>,
}

impl View {
    pub fn start_waiting(&mut self, now: Instant) {
        // `why` was cleared when the last wait or hold ended; a `waiting` message that
        // overtook this call (the request went out first) is kept.
        if self.waiting_since.is_none() {
            self.waiting_since = Some(now);
        }
    }

    pub fn granted(&mut self, now: Instant, exclusive: bool) {
        if let Some(w) = self.waiting_since.take() {
            let d = now.saturating_duration_since(w);
            self.waited += d;
            self.last_wait = Some(d);
        }
        if self.holding_since.is_none() {
            self.holding_since = Some(now);
        }
        self.exclusive = exclusive;
        self.grants += 1;
        self.why = None;
        self.last_swap_in = None;
    }

    /// Neither holding nor waiting any more.
    pub fn stop(&mut self, now: Instant) {
        if let Some(w) = self.waiting_since.take() {
            self.waited += now.saturating_duration_since(w);
        }
        if let Some(h) = self.holding_since.take() {
            self.held += now.saturating_duration_since(h);
        }
        self.why = None;
    }
}

/// `GPU-1234abcd` from a full `GPU-1234abcd-…` UUID.
pub fn short_uuid(uuid: &str) -> &str {
    let end = uuid
        .char_indices()
        .nth("GPU-".len() + 8)
        .map_or(uuid.len(), |(i, _)| i);
    &uuid[..end]
}

/// `~12 s`, `~2.5 s`.
pub fn approx(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s >= 9.5 {
        format!("~{s:.0} s")
    } else {
        format!("~{s:.1} s")
    }
}

/// `700 MiB`, `1.5 GiB`, `12 KiB`.
pub fn bytes(n: u64) -> String {
    const MIB: f64 = (1u64 << 20) as f64;
    let f = n as f64;
    if n >= 1 << 30 {
        format!("{:.1} GiB", f / (MIB * 1024.0))
    } else if n >= 1 << 20 {
        format!("{:.0} MiB", f / MIB)
    } else {
        format!("{:.0} KiB", f / 1024.0)
    }
}

/// Why a turn waits, in words: "nb-a holds it, ~12 s left, 1 ahead of you".
pub fn reason(why: Option<&Why>, now: Instant) -> String {
    let Some(w) = why else {
        return "the arbiter has not said who holds it".into();
    };
    let mut s = match (&w.holder, w.other_holders) {
        (None, _) => "it is being handed over".to_string(),
        (Some(h), 0) => format!("{h} holds it"),
        (Some(h), 1) => format!("{h} and 1 other hold it"),
        (Some(h), n) => format!("{h} and {n} others hold it"),
    };
    if w.holder.is_some() {
        match w.quantum_end.map(|e| e.saturating_duration_since(now)) {
            Some(left) if left.is_zero() => s.push_str(", giving it back now"),
            Some(left) => s.push_str(&format!(", {} left", approx(left))),
            None => {}
        }
    }
    match w.ahead {
        0 => s.push_str(", you are next"),
        n => s.push_str(&format!(", {n} ahead of you")),
    }
    s
}

/// The wait line: "waiting for GPU 0 (GPU-1234abcd): nb-a holds it, ~12 s left, 1
/// ahead of you", for GPU `ordinal` (`uuid`) whose turn shows `v`. The caller checks
/// [`crate::log::explain_enabled`] first (reading a view costs a lock).
pub fn explain_wait(ordinal: usize, uuid: &str, v: &View) {
    crate::log::explain(format_args!(
        "waiting for GPU {} ({}): {}",
        ordinal,
        short_uuid(uuid),
        reason(v.why.as_ref(), Instant::now())
    ));
}

/// The grant line: how long the wait was and what came back in, in how long.
/// The caller checks [`crate::log::explain_enabled`] first.
pub fn explain_grant(ordinal: usize, uuid: &str, v: &View, waited: Duration) {
    let swapped = match v.last_swap_in {
        Some((n, d)) if n > 0 => format!("swapped in {} in {:.2} s", bytes(n), d.as_secs_f64()),
        _ => "nothing to swap in".into(),
    };
    crate::log::explain(format_args!(
        "GPU {} ({}) is ours after waiting {:.1} s; {swapped}",
        ordinal,
        short_uuid(uuid),
        waited.as_secs_f64()
    ));
}

fn secs(d: Duration) -> f64 {
    (d.as_secs_f64() * 1000.0).round() / 1000.0
}

/// One GPU's entry of the status JSON: GPU `ordinal` (`uuid`) whose turn shows `v`,
/// with its working set and resident bytes.
pub fn gpu_json(
    ordinal: usize,
    uuid: &str,
    v: &View,
    working_set: u64,
    resident: u64,
    now: Instant,
) -> serde_json::Value {
    let wait = v
        .waiting_since
        .map_or(Duration::ZERO, |w| now.saturating_duration_since(w));
    let hold = v
        .holding_since
        .map_or(Duration::ZERO, |h| now.saturating_duration_since(h));
    let why = v.why.as_ref().filter(|_| v.waiting_since.is_some());
    serde_json::json!({
        "index": ordinal,
        "uuid": uuid,
        "holding": v.holding_since.is_some(),
        "exclusive": v.holding_since.is_some() && v.exclusive,
        "waiting": v.waiting_since.is_some(),
        "holder": why.and_then(|w| w.holder.clone()),
        "other_holders": why.map(|w| w.other_holders),
        "ahead": why.map(|w| w.ahead),
        "quantum_left_s": why
            .and_then(|w| w.quantum_end)
            .map(|e| secs(e.saturating_duration_since(now))),
        "reason": v.waiting_since.map(|_| reason(why, now)),
        "working_set_bytes": working_set,
        "resident_bytes": resident,
        "swapped_bytes": working_set.saturating_sub(resident),
        "wait_s": secs(wait),
        "waited_s": secs(v.waited + wait),
        "held_s": secs(v.held + hold),
        "grants": v.grants,
        "last_wait_s": v.last_wait.map(secs),
        "last_swap_in_bytes": v.last_swap_in.map(|(n, _)| n),
        "last_swap_in_s": v.last_swap_in.map(|(_, d)| secs(d)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasons_read_as_sentences() {
        let now = Instant::now();
        let mut w = Why {
            holder: Some("nb-a".into()),
            other_holders: 0,
            ahead: 1,
            quantum_end: Some(now + Duration::from_millis(12_200)),
        };
        assert_eq!(
            reason(Some(&w), now),
            "nb-a holds it, ~12 s left, 1 ahead of you"
        );
        w.ahead = 0;
        w.quantum_end = Some(now + Duration::from_millis(2_540));
        assert_eq!(
            reason(Some(&w), now),
            "nb-a holds it, ~2.5 s left, you are next"
        );
        w.quantum_end = Some(now);
        w.other_holders = 2;
        assert_eq!(
            reason(Some(&w), now),
            "nb-a and 2 others hold it, giving it back now, you are next"
        );
        w.holder = None;
        assert_eq!(
            reason(Some(&w), now),
            "it is being handed over, you are next"
        );
        assert_eq!(reason(None, now), "the arbiter has not said who holds it");
        assert_eq!(short_uuid("GPU-1234abcd-5678-9abc"), "GPU-1234abcd");
        assert_eq!(short_uuid("GPU-12"), "GPU-12");
        assert_eq!(bytes(700 << 20), "700 MiB");
        assert_eq!(bytes(3 << 29), "1.5 GiB");
    }

    #[test]
    fn view_sums_waits_and_holds() {
        let t0 = Instant::now();
        let mut v = View::default();
        v.start_waiting(t0);
        v.start_waiting(t0 + Duration::from_secs(1));
        v.granted(t0 + Duration::from_secs(3), true);
        assert_eq!(v.last_wait, Some(Duration::from_secs(3)));
        v.stop(t0 + Duration::from_secs(5));
        assert_eq!(
            (v.waited, v.held),
            (Duration::from_secs(3), Duration::from_secs(2))
        );
        assert!(v.waiting_since.is_none() && v.holding_since.is_none());
    }
}
