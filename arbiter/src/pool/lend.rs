//! Lending: takes (ready slices first, the rest populated on the taker's thread),
//! returns, what a closed connection leaves to its live process (orphans, reaped
//! when it exits), and what a client says it still maps after an arbiter restart.

use super::slices::{create_slice, seal, truncate};
use super::*;

/// One slice lent: its id (for [`Pool::give`]), its size, and a duplicate of the
/// pool's descriptor for sending to the client (the pool keeps its own to scrub it).
#[derive(Debug)]
pub struct Lent {
    pub id: u64,
    pub bytes: u64,
    pub fd: OwnedFd,
}

impl Pool {
    /// Lends `bytes` (rounded up to 2 MiB, or to the hugetlb page) to `owner`, labelled
    /// `tenant`, as at most 64 slices: ready ones first (one larger than needed is cut
    /// down), then fresh ones populated here, on the caller's (blocking) thread. Every
    /// slice is fully populated and sealed before it is lent. Refused when the lent
    /// bytes would pass the pool's size. `bytes == 0` lends nothing.
    pub fn take(&self, owner: Owner, tenant: &str, bytes: u64) -> Result<Vec<Lent>, PoolError> {
        if bytes == 0 {
            return Ok(Vec::new());
        }
        let cfg = self.inner.cfg;
        let unit = self.inner.mode.unit();
        let max = cfg.slice.saturating_mul(MAX_SLICES_PER_TAKE as u64);
        if bytes > max {
            return Err(PoolError::TooLarge { bytes, max });
        }
        let bytes = round_up(bytes, unit);

        let mut st = self.inner.lock();
        if st.stopping {
            return Err(PoolError::ShutDown);
        }
        if st.committed().saturating_add(bytes) > cfg.size {
            let mut holders = st.holders();
            holders.truncate(HOLDERS_NAMED);
            return Err(PoolError::Full {
                size: cfg.size,
                lent: st.committed(),
                bytes,
                holders,
            });
        }
        st.reserved += bytes;
        st.idle = false;

        let mut chosen: Vec<Slice> = Vec::new();
        let mut have = 0u64;
        let mut to_free: Vec<Slice> = Vec::new();
        loop {
            // Ready slices first, largest first.
            while have < bytes {
                let need = bytes - have;
                let Some(i) = largest(&st.ready) else { break };
                let use_bytes = st.ready[i].bytes.min(need);
                let after = chosen.len() + 1 + ceil_div(need - use_bytes, cfg.slice);
                if after > MAX_SLICES_PER_TAKE {
                    break;
                }
                let s = st.ready.swap_remove(i);
                st.ready_bytes -= s.bytes;
                if s.bytes > use_bytes {
                    // Cut down before it is lent; the tail's pages are freed here.
                    if truncate(&s.fd, use_bytes).is_err() {
                        to_free.push(s);
                        continue;
                    }
                }
                have += use_bytes;
                chosen.push(Slice {
                    fd: s.fd,
                    bytes: use_bytes,
                });
            }
            if have == bytes {
                break;
            }
            // Room for the rest: what is ready and unused goes first, then wait for the
            // thread to finish what it populates or scrubs.
            while st.held() > cfg.size {
                let Some(s) = st.ready.pop() else { break };
                st.ready_bytes -= s.bytes;
                to_free.push(s);
            }
            if st.held() <= cfg.size || (st.populating == 0 && st.scrubbing == 0) {
                break;
            }
            if st.stopping {
                st.reserved -= bytes;
                drop(st);
                self.inner.changed.notify_all();
                return Err(PoolError::ShutDown);
            }
            st = self.inner.wait(st);
        }
        let rest = bytes - have;
        st.take_populating += rest;
        drop(st);
        drop(to_free);

        let made = self.populate_for_take(rest, &mut chosen);
        let sealed = made.and_then(|()| {
            chosen
                .iter()
                .map(|s| {
                    seal(&s.fd)?;
                    s.fd.try_clone().map_err(|source| PoolError::Io {
                        op: "duplicating a slice's descriptor",
                        source,
                    })
                })
                .collect::<Result<Vec<OwnedFd>, PoolError>>()
        });

        let mut st = self.inner.lock();
        st.reserved -= bytes;
        st.take_populating -= rest;
        let dups = match sealed {
            Ok(dups) => dups,
            Err(e) => {
                drop(st);
                self.inner.changed.notify_all();
                // Never lent: closing them frees their pages.
                drop(chosen);
                return Err(e);
            }
        };
        let mut lent = Vec::with_capacity(chosen.len());
        for (slice, fd) in chosen.into_iter().zip(dups) {
            let id = st.next_id;
            st.next_id += 1;
            st.lent_bytes += slice.bytes;
            *st.tenants.entry(tenant.to_owned()).or_insert(0) += slice.bytes;
            lent.push(Lent {
                id,
                bytes: slice.bytes,
                fd,
            });
            st.lent.insert(
                id,
                Held {
                    owner,
                    tenant: tenant.to_owned(),
                    slice,
                },
            );
        }
        st.idle = false;
        drop(st);
        self.inner.changed.notify_all();
        Ok(lent)
    }

    /// Creates and populates fresh slices for `rest` bytes into `chosen`.
    fn populate_for_take(&self, mut rest: u64, chosen: &mut Vec<Slice>) -> Result<(), PoolError> {
        while rest > 0 {
            let n = rest.min(self.inner.cfg.slice);
            chosen.push(create_slice(self.inner.mode, n)?);
            rest -= n;
        }
        Ok(())
    }

    /// Takes back the slices `ids` lent to `owner`, and drops its spill files among
    /// `ids` ([`Pool::spill`]'s [`Spilled::id`]: the pool closes its descriptor; the
    /// file's blocks are freed once the client's is closed too); ids that are neither
    /// are ignored. Slices are scrubbed on the background thread, never lent again.
    /// Returns the bytes of *slices* taken back (host memory): spill files given back
    /// add nothing, as they were no longer lent (their bytes left the lent figure at
    /// the spill).
    pub fn give(&self, owner: Owner, ids: &[u64]) -> u64 {
        let mut st = self.inner.lock();
        let mut closing = Vec::new();
        let mut bytes = 0;
        for &id in ids {
            bytes += st.give_back(owner, id);
            closing.extend(st.disk.drop_spill(owner, id));
        }
        self.after_return(st);
        // Closing a spill file the client has closed already frees its blocks: not
        // under the lock.
        drop(closing);
        bytes
    }

    /// `owner`'s connection closed: drops all its spill files (the client reads its
    /// own descriptors of them), and takes back everything lent to it, scrubbed,
    /// unless `alive` names its process, still running: then what it was lent is
    /// its process's until that exits ([`Pool::reap`]), unscrubbed and counted
    /// against the size, because a connection can close under a live client (a
    /// timeout, a refusal, an answer lost) whose swapped-out memory is in those
    /// slices. Returns the bytes of slices taken back now, as [`Pool::give`].
    pub fn release_owner(&self, owner: Owner, alive: Option<Process>) -> u64 {
        let mut st = self.inner.lock();
        st.unkeep(owner);
        st.unsent.remove(&owner);
        let ids: Vec<u64> = st
            .lent
            .iter()
            .filter(|(_, h)| h.owner == owner)
            .map(|(&id, _)| id)
            .collect();
        let bytes = match alive {
            Some(process) => {
                for id in ids {
                    if let Some(h) = st.lent.remove(&id) {
                        st.lent_bytes -= h.slice.bytes;
                        st.orphan_bytes += h.slice.bytes;
                        st.orphans.entry(process).or_default().push(h);
                    }
                }
                0
            }
            None => ids.iter().map(|&id| st.give_back(owner, id)).sum(),
        };
        let closing: Vec<OwnedFd> = st.disk.drop_owner(owner);
        self.after_return(st);
        drop(closing);
        bytes
    }

    /// Scrubs what the processes that have exited were lent on connections that
    /// closed before them (`alive` says whether a process still runs). Returns the
    /// bytes taken back.
    pub fn reap(&self, alive: impl Fn(Process) -> bool) -> u64 {
        let mut st = self.inner.lock();
        let gone: Vec<Process> = st.orphans.keys().copied().filter(|&p| !alive(p)).collect();
        let mut bytes = 0;
        for p in gone {
            for h in st.orphans.remove(&p).unwrap_or_default() {
                let n = h.slice.bytes;
                st.orphan_bytes -= n;
                st.sub_tenant(&h.tenant, n);
                st.scrubbing += n;
                st.scrub.push_back(h.slice);
                bytes += n;
            }
        }
        if bytes > 0 {
            st.idle = false;
        }
        self.after_return(st);
        bytes
    }

    /// Bytes lent on earlier connections of `process` that closed while it lived.
    pub fn orphaned(&self, process: Process) -> u64 {
        self.inner
            .lock()
            .orphans
            .get(&process)
            .map_or(0, |v| v.iter().map(|h| h.slice.bytes).sum())
    }

    /// `owner` (a client after an arbiter restart) still maps `bytes` of slices an
    /// earlier arbiter lent it: they count against the size (as much as there is room
    /// for, ready slices given up first) until the owner says otherwise or goes.
    /// Replaces what it said before; returns the bytes counted.
    pub fn keep(&self, owner: Owner, process: Option<Process>, tenant: &str, bytes: u64) -> u64 {
        let cfg = self.inner.cfg;
        let mut st = self.inner.lock();
        st.unkeep(owner);
        // What this pool still counts for the process (lent on a connection that
        // closed under it) is not counted twice.
        let orphaned: u64 = process
            .and_then(|p| st.orphans.get(&p))
            .map_or(0, |v| v.iter().map(|h| h.slice.bytes).sum());
        let bytes = bytes.saturating_sub(orphaned);
        let busy = st.held() - st.ready_bytes;
        let counted = bytes.min(cfg.size.saturating_sub(busy));
        if counted > 0 {
            st.kept.insert(owner, (tenant.to_string(), counted));
            st.kept_bytes += counted;
            st.add_tenant(tenant, counted);
            // Ready slices past the size go back to the kernel.
            while st.held() > cfg.size {
                let Some(s) = st.ready.pop() else { break };
                st.ready_bytes -= s.bytes;
            }
        }
        st.idle = false;
        drop(st);
        self.inner.changed.notify_all();
        counted
    }
}

fn largest(slices: &[Slice]) -> Option<usize> {
    slices
        .iter()
        .enumerate()
        .max_by_key(|(_, s)| s.bytes)
        .map(|(i, _)| i)
}

fn ceil_div(n: u64, d: u64) -> usize {
    usize::try_from(n.div_ceil(d)).unwrap_or(usize::MAX)
}
