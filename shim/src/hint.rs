//! Asking the application which of its memory is dead before a swap-out (issue #26).
//!
//! A framework knows bytes the shim cannot see are dead: PyTorch's cached free
//! blocks, CuPy's pool. A *provider* (the Python package's thread, or any thread of
//! the application) waits in `kiwi_hint_wait`; before a swap-out, with the gate
//! closed and the process's work drained, the swapping thread opens a *request* and
//! waits at most `KIWI_HINT_WAIT_MS` (10 ms) for the provider's answer: its `kiwiMemDiscard` calls, then
//! `kiwi_hint_done`. Then it swaps, leaving the dead bytes behind; a late answer
//! changes nothing (its discards are ignored), so a slow provider costs at most the
//! wait, and a process without a provider waits not at all.
//!
//! The next tenant waits for that swap-out, so the wait is the operator's to bound:
//! the arbiter says its bound at registration (`bounds`, `--max-hint-wait-ms`) and
//! `KIWI_HINT_WAIT_MS` is clamped to it ([`set_bound`]). Without an arbiter, or with
//! one that predates it, the tenant's own value stands.
//!
//! Discards made for a request carry the submission token of the moment the request
//! opened, not of their own call: the provider's view (a snapshot of the framework's
//! allocator) is taken after that moment, and any submission the application tried
//! since (even one still waiting at the closed gate) changes the token and voids them
//! all ([`crate::live`]). So a block the application took from its cache and wrote
//! after the snapshot is never lost.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How long a swap-out waits for an answer, in µs: the least of [`ASKED_US`] and
/// [`BOUND_US`]. The one figure the swap path reads (no lock).
static WAIT_US: AtomicU64 = AtomicU64::new(10_000);
/// What the application asked for, in µs (`KIWI_HINT_WAIT_MS`, set when the client
/// starts).
static ASKED_US: AtomicU64 = AtomicU64::new(10_000);
/// The arbiter's bound, in µs (`u64::MAX`: none said).
static BOUND_US: AtomicU64 = AtomicU64::new(u64::MAX);
/// The clamp was said on stderr (once per process).
static CLAMP_SAID: AtomicBool = AtomicBool::new(false);

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// Sets how long the application asks a swap-out to wait for a provider's answer
/// (`KIWI_HINT_WAIT_MS`); the arbiter's bound, if one was said, still applies.
pub fn set_wait(limit: Duration) {
    ASKED_US.store(micros(limit), Ordering::Relaxed);
    settle();
}

/// Sets the arbiter's bound on the wait (told at each registration, `bounds`): the
/// wait is the application's, clamped to it. Says once, at info level, when it
/// clamps the application's value. Returns the wait now in force.
pub fn set_bound(bound: Duration) -> Duration {
    BOUND_US.store(micros(bound), Ordering::Relaxed);
    let (asked, now) = settle();
    if asked > now && !CLAMP_SAID.swap(true, Ordering::Relaxed) {
        crate::kinfo!(
            "KIWI_HINT_WAIT_MS={} is more than the arbiter allows: a swap-out waits at most {} ms for the application's hints (kiwi-arbiter --max-hint-wait-ms)",
            asked / 1000,
            now / 1000
        );
    }
    Duration::from_micros(now)
}

/// Recomputes [`WAIT_US`]; returns (asked, in force), in µs.
fn settle() -> (u64, u64) {
    let asked = ASKED_US.load(Ordering::Relaxed);
    let now = asked.min(BOUND_US.load(Ordering::Relaxed));
    WAIT_US.store(now, Ordering::Relaxed);
    (asked, now)
}

/// How long a swap-out waits for a provider's answer.
pub fn wait() -> Duration {
    Duration::from_micros(WAIT_US.load(Ordering::Relaxed))
}

#[derive(Default)]
struct State {
    /// Provider threads waiting in [`provider_wait`] now.
    providers: u32,
    /// The last request's id (ids start at 1).
    last: u64,
    /// The open request: its id and the submission token it opened at.
    open: Option<(u64, u64)>,
    /// The highest request id answered.
    answered: u64,
    /// When a provider last left [`provider_wait`]: one between two waits (its
    /// loop's turn, or its thread preempted on a loaded machine) is still a provider.
    left_at: Option<Instant>,
}

/// How long after a provider left its wait a request still counts on it: a request
/// that found nobody waiting in that gap used to go unanswered, and the swap-out
/// copied what the provider would have discarded (1 GiB, on a loaded 2-core host).
const PROVIDER_GAP: Duration = Duration::from_secs(1);

/// The longest any wait here is taken to be (a figure past it means "for good").
const LONGEST_WAIT: Duration = Duration::from_secs(86_400);

static STATE: Mutex<State> = Mutex::new(State {
    providers: 0,
    last: 0,
    open: None,
    answered: 0,
    left_at: None,
});
/// Wakes providers (a request opened) and the requester (an answer came).
static CHANGED: Condvar = Condvar::new();

thread_local! {
    /// The request this provider thread is answering (0: none).
    static ANSWERING: Cell<u64> = const { Cell::new(0) };
    /// The last request this provider thread was given (not given twice).
    static GIVEN: Cell<u64> = const { Cell::new(0) };
}

fn state() -> MutexGuard<'static, State> {
    STATE.lock().unwrap_or_else(|p| p.into_inner())
}

/// Opens a request at submission token `token` and waits, at most `limit`, for a
/// provider to answer it. Returns at once (false) when no provider is waiting or
/// left its wait within [`PROVIDER_GAP`].
/// Called by the swapping thread with the gate closed and the work drained; one
/// request at a time (a second caller waits for the open one's answer).
pub fn request(token: u64, limit: Duration) -> bool {
    let mut st = state();
    let recent = st.left_at.is_some_and(|t| t.elapsed() < PROVIDER_GAP);
    if st.providers == 0 && st.open.is_none() && !recent {
        return false;
    }
    let id = match st.open {
        Some((id, _)) => id,
        None => {
            st.last += 1;
            st.open = Some((st.last, token));
            CHANGED.notify_all();
            st.last
        }
    };
    // Whatever the figure, never an `Instant` past its range (that add panics).
    let deadline = Instant::now() + limit.min(LONGEST_WAIT);
    while st.answered < id {
        let now = Instant::now();
        if now >= deadline {
            break;
        }
        st = CHANGED
            .wait_timeout(st, deadline - now)
            .unwrap_or_else(|p| p.into_inner())
            .0;
    }
    let answered = st.answered >= id;
    if st.open.is_some_and(|(o, _)| o == id) {
        st.open = None;
    }
    answered
}

/// A provider waits, at most `limit`, for a request; returns its id (0: none came).
/// The calling thread answers it from then on: its discards carry the request's token
/// until [`done`].
pub fn provider_wait(limit: Duration) -> u64 {
    let mut st = state();
    st.providers += 1;
    let seen = GIVEN.with(|a| a.get());
    let deadline = Instant::now() + limit;
    let id = loop {
        match st.open {
            Some((id, _)) if id > seen.max(st.answered) => break id,
            _ => {}
        }
        let now = Instant::now();
        if now >= deadline {
            break 0;
        }
        st = CHANGED
            .wait_timeout(st, deadline - now)
            .unwrap_or_else(|p| p.into_inner())
            .0;
    };
    st.providers -= 1;
    st.left_at = Some(Instant::now());
    if id != 0 {
        ANSWERING.with(|a| a.set(id));
        GIVEN.with(|a| a.set(id));
    }
    id
}

/// The provider answered request `id` (its discards are all made); the calling
/// thread's later discards are its own again.
pub fn done(id: u64) {
    ANSWERING.with(|a| a.set(0));
    let mut st = state();
    if id > st.answered && id <= st.last {
        st.answered = id;
        CHANGED.notify_all();
    }
}

/// The token a discard from the calling thread is made at, given the current one:
/// a provider's discards carry their request's token while it is open, and are
/// ignored (`None`) once it closed (a late answer); anyone else's, the current token.
pub fn discard_token(current: u64) -> Option<u64> {
    let answering = ANSWERING.with(|a| a.get());
    if answering == 0 {
        return Some(current);
    }
    let st = state();
    match st.open {
        Some((id, token)) if id == answering && st.answered < id => Some(token),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn the_arbiters_bound_clamps_the_applications_wait() {
        let ms = Duration::from_millis;
        set_wait(ms(60_000));
        assert_eq!(
            wait(),
            ms(60_000),
            "no arbiter said a bound: the asked wait"
        );
        assert_eq!(set_bound(ms(200)), ms(200));
        assert_eq!(wait(), ms(200));
        // A later registration's bound replaces it (an arbiter restarted with another).
        assert_eq!(set_bound(ms(1000)), ms(1000));
        // Below the bound, the application's own wait stands.
        set_wait(ms(10));
        assert_eq!(wait(), ms(10));
        assert_eq!(set_bound(ms(0)), ms(0), "0: never wait");
        assert_eq!(set_bound(Duration::MAX), ms(10));
        set_wait(Duration::MAX);
        assert_eq!(wait(), Duration::from_micros(u64::MAX));
        assert_eq!(set_bound(ms(100)), ms(100));
    }

    // One test: the state is process-wide.
    #[test]
    fn requests_reach_providers_and_late_answers_are_ignored() {
        // No provider: no wait at all.
        let t = Instant::now();
        assert!(!request(5, Duration::from_secs(5)));
        assert!(t.elapsed() < Duration::from_secs(1));
        assert_eq!(
            discard_token(9),
            Some(9),
            "not a provider: the current token"
        );

        // A provider that answers: its discards carry the request's token.
        let seen = Arc::new(AtomicU64::new(u64::MAX));
        let s = seen.clone();
        let provider = std::thread::spawn(move || {
            let id = provider_wait(Duration::from_secs(10));
            s.store(discard_token(1234).unwrap_or(0), Ordering::SeqCst);
            done(id);
            id
        });
        while state().providers == 0 {
            std::thread::yield_now();
        }
        assert!(request(77, Duration::from_secs(10)));
        assert!(provider.join().unwrap() > 0);
        assert_eq!(seen.load(Ordering::SeqCst), 77);

        // A late provider: the request closed before it answered; its discards are
        // ignored.
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let late = std::thread::spawn(move || {
            let id = provider_wait(Duration::from_secs(10));
            rx.recv().unwrap();
            let token = discard_token(1);
            done(id);
            (id, token)
        });
        while state().providers == 0 {
            std::thread::yield_now();
        }
        assert!(!request(88, Duration::from_millis(20)));
        tx.send(()).unwrap();
        let (id, token) = late.join().unwrap();
        assert!(id > 0);
        assert_eq!(token, None, "a late answer's discards are ignored");

        // A provider between two waits (its loop's turn, or preempted): a request
        // made in that gap waits for its next wait and is answered.
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let (waited_tx, waited) = std::sync::mpsc::channel::<u64>();
        let looping = std::thread::spawn(move || {
            waited_tx
                .send(provider_wait(Duration::from_millis(1)))
                .unwrap();
            rx.recv().unwrap();
            let id = provider_wait(Duration::from_secs(10));
            done(id);
            id
        });
        assert_eq!(waited.recv().unwrap(), 0, "no request yet");
        let asker = std::thread::spawn(|| request(99, Duration::from_secs(10)));
        while state().open.is_none() && !asker.is_finished() {
            std::thread::yield_now();
        }
        assert!(!asker.is_finished(), "a request in the gap gave up at once");
        assert_eq!(state().providers, 0, "asked in the gap");
        tx.send(()).unwrap();
        assert!(
            asker.join().unwrap(),
            "the provider's next wait answered it"
        );
        assert!(looping.join().unwrap() > 0);
    }
}
