//! The disk tier (`[arbiter] spill_dir`, `spill_budget`): the pool's side of a
//! spill, all or none, within the budget, and the slices it moved taken back once
//! the answer is sent. The files themselves are `spill.rs`'s.

use super::*;

/// The disk tier's books: its configuration, and the spill files the pool holds
/// with their bytes, in all and by tenant (always the sum of the files'), and the
/// bytes being written; spilled and written bytes together stay within the budget.
/// Spilled bytes are host memory no longer: no part of the pool's size.
#[derive(Debug, Default)]
pub(super) struct DiskTier {
    /// The disk tier; None: not enabled.
    spill: Option<SpillConfig>,
    /// Spill files by id (ids from `next_id`, shared with slices).
    spills: HashMap<u64, SpillFile>,
    spilled_bytes: u64,
    /// Bytes of spills being written now (counted against the budget).
    spilling: u64,
    spill_tenants: HashMap<String, u64>,
    spill_failures: u64,
    last_spill_error: Option<String>,
}

/// A slice's contents on disk: the pool's read-write descriptor of its spill file.
#[derive(Debug)]
pub(super) struct SpillFile {
    owner: Owner,
    tenant: String,
    bytes: u64,
    fd: OwnedFd,
}

impl DiskTier {
    /// Forgets `owner`'s spill file `id`; its descriptor (to be closed outside the
    /// lock), None when `id` is no spill file of `owner`'s.
    pub(super) fn drop_spill(&mut self, owner: Owner, id: u64) -> Option<OwnedFd> {
        match self.spills.get(&id) {
            Some(f) if f.owner == owner => {}
            _ => return None,
        }
        let f = self.spills.remove(&id)?;
        self.spilled_bytes -= f.bytes;
        if let Some(t) = self.spill_tenants.get_mut(&f.tenant) {
            *t = t.saturating_sub(f.bytes);
            if *t == 0 {
                self.spill_tenants.remove(&f.tenant);
            }
        }
        Some(f.fd)
    }

    /// Forgets all of `owner`'s spill files; their descriptors (to be closed outside
    /// the lock).
    pub(super) fn drop_owner(&mut self, owner: Owner) -> Vec<OwnedFd> {
        let spill_ids: Vec<u64> = self
            .spills
            .iter()
            .filter(|(_, f)| f.owner == owner)
            .map(|(&id, _)| id)
            .collect();
        spill_ids
            .iter()
            .filter_map(|&id| self.drop_spill(owner, id))
            .collect()
    }

    /// Forgets every spill file (the pool shuts down); them, to be closed outside the
    /// lock.
    pub(super) fn take_all(&mut self) -> HashMap<u64, SpillFile> {
        let spills = std::mem::take(&mut self.spills);
        self.spill_tenants.clear();
        self.spilled_bytes = 0;
        spills
    }

    /// Bytes in spill files now.
    pub(super) fn spilled_bytes(&self) -> u64 {
        self.spilled_bytes
    }

    /// Spill files held open.
    pub(super) fn files(&self) -> usize {
        self.spills.len()
    }

    /// The configuration; None: no disk tier.
    pub(super) fn config(&self) -> Option<&SpillConfig> {
        self.spill.as_ref()
    }

    /// Bytes in spill files per tenant.
    pub(super) fn tenants(&self) -> &HashMap<String, u64> {
        &self.spill_tenants
    }

    /// Spills that failed or were refused, and the last one's line.
    pub(super) fn failures(&self) -> (u64, Option<String>) {
        (self.spill_failures, self.last_spill_error.clone())
    }
}

/// Where and how much the pool may spill (`[arbiter] spill_dir`, `spill_budget`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpillConfig {
    /// The directory spill files are made in (nameless `O_TMPFILE`s: nothing of them
    /// is ever visible there).
    pub dir: PathBuf,
    /// The most bytes in spill files at once. None: bounded only by the disk's free
    /// space (less its reserve).
    pub budget: Option<u64>,
}

/// A slice written to its spill file, not committed yet ([`Pool::spill`]).
struct Written {
    from: u64,
    bytes: u64,
    /// The pool's read-write descriptor and the client's read-only one.
    file: OwnedFd,
    client: OwnedFd,
}

/// One slice moved to disk.
#[derive(Debug)]
pub struct Spilled {
    /// The slice id it replaces.
    pub from: u64,
    /// Its new id (give it back with [`Pool::give`] when read back).
    pub id: u64,
    pub bytes: u64,
    /// Read-only descriptor of the spill file (for the client).
    pub fd: OwnedFd,
}

impl Pool {
    /// Enables the disk tier: checks that `cfg.dir` is a directory where an
    /// `O_TMPFILE` can be created (one is created and closed), else
    /// [`PoolError::Spill`] with a one-line reason naming the path. The tier is
    /// configured either way: while the directory is unusable (a disk not mounted
    /// yet, removed), each spill is refused with that reason, and spills work once it
    /// is back. A later call replaces the configuration (spill files already made
    /// stay, and count against the new budget).
    pub fn enable_spill(&self, cfg: SpillConfig) -> Result<(), PoolError> {
        let checked = spill::check_dir(&cfg.dir);
        self.inner.lock().disk.spill = Some(cfg);
        checked
    }

    /// The most the disk tier can hold now: its budget, or where it has none, what
    /// it holds plus the disk's free space less its reserve; 0 without a usable tier.
    pub fn spill_room(&self) -> u64 {
        let (cfg, held) = {
            let st = self.inner.lock();
            (st.disk.spill.clone(), st.disk.spilled_bytes())
        };
        match cfg {
            None => 0,
            Some(SpillConfig {
                budget: Some(b), ..
            }) => b,
            Some(SpillConfig { dir, budget: None }) => spill::free_space(&dir)
                .map_or(0, |(free, reserve)| held + free.saturating_sub(reserve)),
        }
    }

    /// Moves the slices `ids` lent to `owner` to disk, all or none (see the module
    /// doc): each is copied to a spill file of its own; once every copy is written,
    /// each slice is taken back as by [`Pool::give`] and its file recorded under a
    /// new id, labelled `tenant`. Returns one [`Spilled`] per slice, in the order of
    /// `ids`; ids not lent to `owner` are skipped silently. On any failure nothing
    /// moved: the files written are dropped, every slice stays lent, untouched, and
    /// the error is returned (counted in [`PoolStats::spill_failures`] and kept in
    /// [`PoolStats::last_spill_error`]). All or none, because the client has given up
    /// its mapping's registration for the spill and must know which contents are
    /// where. Blocking (it writes to disk, without the pool's lock): call it from a
    /// blocking thread. Refused when no disk tier is enabled, and once the pool is
    /// shut down.
    pub fn spill(
        &self,
        owner: Owner,
        tenant: &str,
        ids: &[u64],
    ) -> Result<Vec<Spilled>, PoolError> {
        let mut written: Vec<Written> = Vec::new();
        let mut result = {
            let st = self.inner.lock();
            if st.stopping {
                return Err(PoolError::ShutDown);
            }
            if st.disk.spill.is_none() {
                Err(no_spill_dir())
            } else {
                Ok(())
            }
        };
        if result.is_ok() {
            for &from in ids {
                match self.write_one(owner, from) {
                    Ok(Some(w)) => written.push(w),
                    Ok(None) => {}
                    Err(e) => {
                        result = Err(e);
                        break;
                    }
                }
            }
        }
        let mut st = self.inner.lock();
        st.disk.spilling -= written.iter().map(|w| w.bytes).sum::<u64>();
        if result.is_ok() && st.stopping {
            result = Err(PoolError::ShutDown);
        }
        if result.is_ok()
            && !written
                .iter()
                .all(|w| st.lent.get(&w.from).is_some_and(|h| h.owner == owner))
        {
            // Never while the owner's connection is served one message at a time.
            result = Err(PoolError::Spill {
                reason: "a slice stopped being lent while it was written".into(),
            });
        }
        if let Err(e) = result {
            if !matches!(e, PoolError::ShutDown) {
                st.disk.spill_failures += 1;
                st.disk.last_spill_error = Some(e.to_string());
            }
            drop(st);
            self.inner.changed.notify_all();
            drop(written);
            return Err(e);
        }
        let mut moved = Vec::with_capacity(written.len());
        for w in written {
            // Taken back once the answer is sent ([`Pool::spill_sent`]).
            st.unsent.entry(owner).or_default().push(w.from);
            let id = st.next_id;
            st.next_id += 1;
            st.disk.spilled_bytes += w.bytes;
            *st.disk.spill_tenants.entry(tenant.to_owned()).or_insert(0) += w.bytes;
            st.disk.spills.insert(
                id,
                SpillFile {
                    owner,
                    tenant: tenant.to_owned(),
                    bytes: w.bytes,
                    fd: w.file,
                },
            );
            moved.push(Spilled {
                from: w.from,
                id,
                bytes: w.bytes,
                fd: w.client,
            });
        }
        drop(st);
        self.inner.changed.notify_all();
        Ok(moved)
    }

    /// Writes one slice to a spill file of its own, its bytes reserved against the
    /// budget (`spilling`) until [`Pool::spill`] commits or drops it; `None` when
    /// `from` is not lent to `owner`.
    fn write_one(&self, owner: Owner, from: u64) -> Result<Option<Written>, PoolError> {
        let (dir, src, bytes) = {
            let mut st = self.inner.lock();
            if st.stopping {
                return Err(PoolError::ShutDown);
            }
            let Some(cfg) = st.disk.spill.clone() else {
                return Err(no_spill_dir());
            };
            let Some(held) = st.lent.get(&from).filter(|h| h.owner == owner) else {
                return Ok(None);
            };
            let bytes = held.slice.bytes;
            if let Some(budget) = cfg.budget {
                let used = st.disk.spilled_bytes + st.disk.spilling;
                if used.saturating_add(bytes) > budget {
                    return Err(PoolError::Spill {
                        reason: format!(
                            "spill budget of {} is full ({} spilled)",
                            spill::mib(budget),
                            spill::mib(used)
                        ),
                    });
                }
            }
            let src = held.slice.fd.try_clone().map_err(|source| PoolError::Io {
                op: "duplicating a slice's descriptor to spill it",
                source,
            })?;
            st.disk.spilling += bytes;
            (cfg.dir, src, bytes)
        };
        // The copy, without the lock: the owner's connection is served sequentially,
        // so the slice stays lent meanwhile (checked again at the commit all the same).
        let result = spill::write(&dir, &src, bytes);
        drop(src);
        match result {
            Ok((file, client)) => Ok(Some(Written {
                from,
                bytes,
                file,
                client,
            })),
            Err(e) => {
                self.inner.lock().disk.spilling -= bytes;
                self.inner.changed.notify_all();
                Err(e)
            }
        }
    }

    /// The answer to `owner`'s last [`Pool::spill`] is sent: the slices it moved are
    /// taken back and scrubbed now. Until then they stay lent, intact: a client that
    /// never got the answer (the arbiter died, the connection broke) still holds its
    /// memory in them. Returns the bytes taken back.
    pub fn spill_sent(&self, owner: Owner) -> u64 {
        let mut st = self.inner.lock();
        let ids = st.unsent.remove(&owner).unwrap_or_default();
        let bytes = ids.iter().map(|&id| st.give_back(owner, id)).sum();
        self.after_return(st);
        bytes
    }
}

/// The refusal when no disk tier is enabled.
fn no_spill_dir() -> PoolError {
    PoolError::Spill {
        reason: "no spill_dir is configured".into(),
    }
}
