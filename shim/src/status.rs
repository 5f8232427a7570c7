//! What a person sees of the turns: the two log lines that explain a wait (who holds
//! the GPU, the place in the queue, the holder's time left; then how long the wait was
//! and what came back in), and `kiwi_status_json`, the C function the Python package
//! (`python/kiwi`) reads this process's GPUs through.
//!
//! This module owns each turn's [`View`] (kept up to date by [`crate::client`] at each
//! change of phase and each `waiting` message) and the wording. Nothing here runs on
//! the submission fast path: the wait line is written from the waiting thread's slow
//! path, and the status is read by whoever asks, without the turn's state lock or an
//! allocator's lock (it never waits behind a swap).

use std::ffi::c_char;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::{Duration, Instant};

use crate::client::Turn;

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
/// ahead of you".
pub fn explain_wait(turn: &Turn) {
    if !crate::log::explain_enabled() {
        return;
    }
    let (v, _, _) = turn.view();
    let info = turn.info();
    crate::log::explain(format_args!(
        "waiting for GPU {} ({}): {}",
        info.ordinal,
        short_uuid(&info.uuid),
        reason(v.why.as_ref(), Instant::now())
    ));
}

/// The grant line: how long the wait was and what came back in, in how long.
pub fn explain_grant(turn: &Turn, waited: Duration) {
    if !crate::log::explain_enabled() {
        return;
    }
    let (v, _, _) = turn.view();
    let info = turn.info();
    let swapped = match v.last_swap_in {
        Some((n, d)) if n > 0 => format!("swapped in {} in {:.2} s", bytes(n), d.as_secs_f64()),
        _ => "nothing to swap in".into(),
    };
    crate::log::explain(format_args!(
        "GPU {} ({}) is ours after waiting {:.1} s; {swapped}",
        info.ordinal,
        short_uuid(&info.uuid),
        waited.as_secs_f64()
    ));
}

fn secs(d: Duration) -> f64 {
    (d.as_secs_f64() * 1000.0).round() / 1000.0
}

/// One GPU's entry of the status JSON.
pub fn gpu_json(turn: &Turn, now: Instant) -> serde_json::Value {
    let (v, working_set, resident) = turn.view();
    let info = turn.info();
    let wait = v
        .waiting_since
        .map_or(Duration::ZERO, |w| now.saturating_duration_since(w));
    let hold = v
        .holding_since
        .map_or(Duration::ZERO, |h| now.saturating_duration_since(h));
    let why = v.why.as_ref().filter(|_| v.waiting_since.is_some());
    serde_json::json!({
        "index": info.ordinal,
        "uuid": info.uuid,
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

/// This process's GPUs as JSON (see `docs/shim.md`).
pub fn status_json() -> String {
    let now = Instant::now();
    let gpus: Vec<serde_json::Value> = crate::client::global()
        .map(|c| c.turns().map(|t| gpu_json(t, now)).collect())
        .unwrap_or_default();
    serde_json::json!({
        "kiwi": STATUS_VERSION,
        "pid": std::process::id(),
        "mode": crate::client::mode_name(),
        "gpus": gpus,
    })
    .to_string()
}

/// Copies `json` into `buf` (`len` bytes) with a NUL when it fits whole; else writes
/// an empty string (when `len > 0`). Returns `json`'s length, without the NUL.
///
/// # Safety
/// `buf` is null or valid for writes of `len` bytes.
unsafe fn copy_out(json: &str, buf: *mut c_char, len: usize) -> isize {
    let n = json.len();
    if buf.is_null() || len == 0 {
        return n as isize;
    }
    if n < len {
        // SAFETY: the caller's buffer holds `len` > n bytes: the JSON and its NUL fit.
        unsafe {
            std::ptr::copy_nonoverlapping(json.as_ptr(), buf.cast::<u8>(), n);
            *buf.add(n) = 0;
        }
    } else {
        // SAFETY: `len` ≥ 1: the first byte is the caller's.
        unsafe { *buf = 0 };
    }
    n as isize
}

/// `ssize_t kiwi_status_json(char *buf, size_t len)`: writes this process's GPUs as
/// JSON, NUL-terminated, into `buf` when it fits (`return value < len`); returns the
/// JSON's length in bytes without the NUL (call again with a larger buffer when it is
/// `>= len`; `buf` may be NULL to ask the length), or -1 on an internal error. Never
/// blocks behind a swap; thread-safe.
///
/// # Safety
/// `buf` is NULL or valid for writes of `len` bytes.
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn kiwi_status_json(buf: *mut c_char, len: usize) -> isize {
    match catch_unwind(AssertUnwindSafe(status_json)) {
        // SAFETY: the caller's promise about `buf`, passed on.
        Ok(json) => unsafe { copy_out(&json, buf, len) },
        Err(_) => -1,
    }
}

/// `int kiwi_explain(int on)`: shows (`on` ≠ 0) or silences the shim's two lines
/// that explain a wait on stderr, whatever `KIWI_LOG` said (`on` < 0: leaves it as
/// it is). Returns 1 when they were shown, 0 when not. `%load_ext kiwi` silences
/// them while its own live line is on.
#[cfg_attr(not(test), no_mangle)]
pub extern "C" fn kiwi_explain(on: std::ffi::c_int) -> std::ffi::c_int {
    let was = catch_unwind(|| {
        if on < 0 {
            crate::log::explain_enabled()
        } else {
            crate::log::set_explain(on != 0)
        }
    });
    std::ffi::c_int::from(was.unwrap_or(false))
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
    fn status_copies_whole_or_not_at_all() {
        let json = r#"{"kiwi":1}"#;
        let mut buf = [0x55 as c_char; 16];
        // SAFETY: buf is 16 bytes long.
        assert_eq!(unsafe { copy_out(json, buf.as_mut_ptr(), 16) }, 10);
        assert_eq!(buf[10], 0);
        // SAFETY: as above; a short length leaves an empty string.
        assert_eq!(unsafe { copy_out(json, buf.as_mut_ptr(), 10) }, 10);
        assert_eq!(buf[0], 0);
        // SAFETY: NULL asks the length.
        assert_eq!(unsafe { copy_out(json, std::ptr::null_mut(), 0) }, 10);
        let v: serde_json::Value = serde_json::from_str(&status_json()).unwrap();
        assert_eq!(v["kiwi"], 1);
        assert_eq!(v["gpus"], serde_json::json!([]));
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
