//! The event log: per GPU, a bounded ring of [`Event`]s with arbiter-wide sequence
//! numbers. Read page by page over the control socket.

use std::collections::{BTreeMap, VecDeque};

use kiwi_protocol::{Event, EventKind};

/// Most events one control reply carries (keeps the frame under the size limit).
pub const MAX_PAGE: usize = 2_000;

#[derive(Debug)]
pub struct EventLog {
    per_gpu: BTreeMap<String, VecDeque<Event>>,
    capacity: usize,
    next_seq: u64,
}

impl EventLog {
    pub fn new(capacity_per_gpu: usize) -> Self {
        Self {
            per_gpu: BTreeMap::new(),
            capacity: capacity_per_gpu.max(1),
            next_seq: 1,
        }
    }

    pub fn push(&mut self, t_ns: u64, gpu: &str, client: Option<u64>, kind: EventKind) {
        let ring = self.per_gpu.entry(gpu.to_string()).or_default();
        if ring.len() >= self.capacity {
            ring.pop_front();
        }
        ring.push_back(Event {
            seq: self.next_seq,
            t_ns,
            gpu: gpu.to_string(),
            client,
            kind,
        });
        self.next_seq += 1;
    }

    /// Events with `seq >= since` (of `gpu`, or all GPUs), oldest first, at most
    /// `limit`. Returns them and whether more remain.
    pub fn page(&self, gpu: Option<&str>, since: u64, limit: usize) -> (Vec<Event>, bool) {
        let limit = limit.clamp(1, MAX_PAGE);
        let mut out: Vec<Event> = Vec::new();
        for (g, ring) in &self.per_gpu {
            if gpu.is_some_and(|want| want != g) {
                continue;
            }
            let start = ring.partition_point(|e| e.seq < since);
            out.extend(ring.iter().skip(start).take(limit + 1).cloned());
        }
        out.sort_by_key(|e| e.seq);
        let more = out.len() > limit;
        out.truncate(limit);
        (out, more)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounded_paged_and_filtered() {
        let mut log = EventLog::new(3);
        for i in 0..5 {
            log.push(i, "A", Some(1), EventKind::Request);
            log.push(i, "B", Some(2), EventKind::Exit);
        }
        let (all, more) = log.page(None, 0, 100);
        assert!(!more);
        assert_eq!(all.len(), 6);
        assert!(all.windows(2).all(|w| w[0].seq < w[1].seq));
        let (a, _) = log.page(Some("A"), 0, 100);
        assert!(a.iter().all(|e| e.gpu == "A"));
        let (p1, more) = log.page(None, 0, 4);
        assert!(more);
        let (p2, more) = log.page(None, p1.last().unwrap().seq + 1, 4);
        assert!(!more);
        assert_eq!(p1.len() + p2.len(), 6);
    }
}
