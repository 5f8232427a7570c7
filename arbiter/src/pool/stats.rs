//! The pool's figures ([`PoolStats`]), for `kiwictl status` and the metrics.

use super::*;

/// The pool's figures at one moment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolStats {
    pub size: u64,
    pub floor: u64,
    pub slice: u64,
    pub wanted: u64,
    /// Ready plus lent.
    pub populated: u64,
    pub ready: u64,
    pub lent: u64,
    /// Being populated now (by the background thread and takes in flight).
    pub populating: u64,
    /// Returned and not yet scrubbed.
    pub scrubbing: u64,
    /// Memfds the pool holds open (ready, lent and waiting to be scrubbed).
    pub memfds: usize,
    /// Bytes lent per tenant, largest first; a tenant holding nothing is absent.
    pub tenants: Vec<(String, u64)>,
    /// `"4KiB"`, `"thp"` or `"hugetlb"`.
    pub page_mode: &'static str,
    /// Scrubs that failed (the slice was closed anyway; never re-lent).
    pub scrub_failures: u64,
    /// The last error populating in the background, if any.
    pub last_error: Option<String>,
    /// Bytes in spill files now (the disk tier; not part of `lent` or `populated`, not
    /// counted against `size`).
    pub spilled: u64,
    /// Spill files the pool holds open.
    pub spill_files: usize,
    /// The disk tier's budget (None: the disk's free space less its reserve, or no
    /// disk tier).
    pub spill_budget: Option<u64>,
    /// The disk tier's directory; None: no disk tier.
    pub spill_dir: Option<String>,
    /// Bytes in spill files per tenant, largest first; a tenant with none is absent.
    pub spilled_tenants: Vec<(String, u64)>,
    /// Spills that failed or were refused (each [`Pool::spill`] that stopped short).
    pub spill_failures: u64,
    /// The last spill failure's line, if any.
    pub last_spill_error: Option<String>,
}

impl Pool {
    /// The pool's figures now.
    pub fn stats(&self) -> PoolStats {
        let cfg = self.inner.cfg;
        let st = self.inner.lock();
        let (spill_failures, last_spill_error) = st.disk.failures();
        PoolStats {
            size: cfg.size,
            floor: cfg.floor,
            slice: cfg.slice,
            wanted: st.wanted,
            populated: st.ready_bytes + st.lent_bytes,
            ready: st.ready_bytes,
            lent: st.lent_bytes + st.kept_bytes + st.orphan_bytes,
            populating: st.populating + st.take_populating,
            scrubbing: st.scrubbing,
            memfds: st.ready.len()
                + st.lent.len()
                + st.scrub.len()
                + st.orphans.values().map(Vec::len).sum::<usize>(),
            tenants: st.holders(),
            page_mode: self.inner.mode.name(),
            scrub_failures: st.scrub_failures,
            last_error: st.last_error.clone(),
            spilled: st.disk.spilled_bytes(),
            spill_files: st.disk.files(),
            spill_budget: st.disk.config().and_then(|c| c.budget),
            spill_dir: st
                .disk
                .config()
                .map(|c| c.dir.to_string_lossy().into_owned()),
            spilled_tenants: largest_first(st.disk.tenants()),
            spill_failures,
            last_spill_error,
        }
    }
}

/// `(name, bytes)` of a per-tenant map, largest first (then by name).
pub(super) fn largest_first(map: &HashMap<String, u64>) -> Vec<(String, u64)> {
    let mut v: Vec<(String, u64)> = map.iter().map(|(t, b)| (t.clone(), *b)).collect();
    v.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    v
}
