//! The pool's background thread: it scrubs returned slices (or, once it has
//! exited, the returner's thread does), keeps `ready` at its target
//! ([`Pool::set_wanted`]) and frees ready slices past it.

use super::slices::{create_slice, scrub};
use super::*;

impl Pool {
    /// Wakes the thread; once it has exited, scrubs here.
    pub(super) fn after_return(&self, mut st: MutexGuard<'_, State>) {
        if st.stopped {
            let queue: Vec<Slice> = st.scrub.drain(..).collect();
            drop(st);
            let (mut done, mut failed) = (0, 0);
            for s in queue {
                done += s.bytes;
                failed += u64::from(scrub(&s).is_err());
            }
            let mut st = self.inner.lock();
            st.scrubbing -= done;
            st.scrub_failures += failed;
        } else {
            drop(st);
        }
        self.inner.changed.notify_all();
    }

    /// How much the arbiter expects to lend soon; the thread keeps
    /// `min(max(floor, wanted - lent), size - lent)` ready.
    pub fn set_wanted(&self, bytes: u64) {
        let mut st = self.inner.lock();
        st.wanted = bytes;
        st.idle = false;
        drop(st);
        self.inner.changed.notify_all();
    }

    /// Waits up to `timeout` until the background thread has nothing left to do
    /// (nothing to scrub, as much ready as it keeps). True when it got there.
    pub fn settle(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut st = self.inner.lock();
        loop {
            if st.stopped || st.idle {
                return true;
            }
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            st = self.inner.wait_timeout(st, deadline - now);
        }
    }
}

/// The background thread's nice value.
const BACKGROUND_NICE: libc::c_int = 10;

/// What the thread does next.
enum Work {
    Scrub(Slice),
    Populate(u64),
    Free(Slice),
    Exit,
}

/// The background thread: scrubs returned slices, keeps the ready target, frees ready
/// slices past it.
pub(super) fn background(inner: &Inner) {
    // Populating ahead and scrubbing are nobody's critical path: they yield the CPU
    // to the tenants (and to a take populating on its caller's thread). A notebook
    // that just grew page-locks its slices while this refills the floor it took
    // them from; at equal priority, on two cores, the refill slowed that down.
    // SAFETY: setpriority on this thread's own id (a thread is a process to it).
    unsafe {
        libc::setpriority(
            libc::PRIO_PROCESS,
            libc::gettid() as libc::id_t,
            BACKGROUND_NICE,
        )
    };
    let cfg = inner.cfg;
    let unit = inner.mode.unit();
    loop {
        let mut st = inner.lock();
        let work = loop {
            if let Some(s) = st.scrub.pop_front() {
                break Work::Scrub(s);
            }
            if st.stopping {
                st.stopped = true;
                break Work::Exit;
            }
            let now = Instant::now();
            let retry_wait = st.retry_at.filter(|&t| t > now).map(|t| t - now);
            let target = st.ready_target(&cfg);
            if retry_wait.is_none() && st.ready_bytes + st.populating < target {
                let short = round_up(target - st.ready_bytes - st.populating, unit);
                let room = round_down(cfg.size.saturating_sub(st.held()), unit);
                let n = short.min(cfg.slice).min(room);
                if n > 0 {
                    st.populating += n;
                    break Work::Populate(n);
                }
            }
            if st.ready_bytes > target {
                let excess = st.ready_bytes - target;
                if let Some(i) = st.ready.iter().position(|s| s.bytes <= excess) {
                    let s = st.ready.swap_remove(i);
                    st.ready_bytes -= s.bytes;
                    break Work::Free(s);
                }
            }
            st.idle = true;
            inner.changed.notify_all();
            st = match retry_wait {
                Some(d) => inner.wait_timeout(st, d),
                None => inner.wait(st),
            };
        };
        st.idle = false;
        drop(st);
        match work {
            Work::Exit => {
                inner.changed.notify_all();
                return;
            }
            Work::Scrub(s) => {
                let bytes = s.bytes;
                let failed = scrub(&s).is_err();
                drop(s);
                let mut st = inner.lock();
                st.scrubbing -= bytes;
                st.scrub_failures += u64::from(failed);
            }
            Work::Free(s) => drop(s),
            Work::Populate(n) => {
                let made = create_slice(inner.mode, n);
                let mut st = inner.lock();
                st.populating -= n;
                match made {
                    Ok(s) if !st.stopping => {
                        st.ready_bytes += s.bytes;
                        st.ready.push(s);
                        st.retry_at = None;
                    }
                    Ok(s) => {
                        drop(st);
                        drop(s);
                    }
                    Err(e) => {
                        st.last_error = Some(e.to_string());
                        st.retry_at = Some(Instant::now() + RETRY_AFTER_ERROR);
                    }
                }
            }
        }
        inner.changed.notify_all();
    }
}
