//! The event log: per GPU, a bounded ring of [`Event`]s with arbiter-wide sequence
//! numbers, bounded in count per GPU and in bytes over all GPUs (the oldest events
//! go first). Read page by page over the control socket; a page is bounded in count
//! and in encoded bytes so that it always fits in one frame.

use std::collections::{BTreeMap, VecDeque};

use kiwi_protocol::{Event, EventKind};

/// Most events one control reply carries.
pub const MAX_PAGE: usize = 2_000;
/// Most encoded bytes of events one control reply carries: well under the frame
/// limit, whatever the events hold.
pub const MAX_PAGE_BYTES: usize = 512 * 1024;
/// Default bound on the memory the whole log holds (see [`event_bytes`]).
pub const DEFAULT_MAX_BYTES: usize = 64 << 20;

#[derive(Debug)]
pub struct EventLog {
    per_gpu: BTreeMap<String, VecDeque<Event>>,
    capacity: usize,
    max_bytes: usize,
    bytes: usize,
    next_seq: u64,
}

/// The memory an event holds, near enough: its inline size and its strings.
pub fn event_bytes(e: &Event) -> usize {
    let text = |s: &Option<String>| s.as_ref().map_or(0, |s| s.len());
    let kind = match &e.kind {
        EventKind::Register {
            name,
            pod_name,
            pod_namespace,
            ..
        } => text(name) + text(pod_name) + text(pod_namespace),
        _ => 0,
    };
    std::mem::size_of::<Event>() + e.gpu.len() + kind
}

/// The bytes `e` adds to a page of JSON (the event and a separating comma).
fn encoded_len(e: &Event) -> usize {
    struct Count(usize);
    impl std::io::Write for Count {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0 += b.len();
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut c = Count(1);
    // An event always serializes (plain data); count it as too big if it ever did not.
    match serde_json::to_writer(&mut c, e) {
        Ok(()) => c.0,
        Err(_) => MAX_PAGE_BYTES,
    }
}

impl EventLog {
    pub fn new(capacity_per_gpu: usize) -> Self {
        Self::with_max_bytes(capacity_per_gpu, DEFAULT_MAX_BYTES)
    }

    /// A log of at most `capacity_per_gpu` events per GPU and `max_bytes` in all.
    pub fn with_max_bytes(capacity_per_gpu: usize, max_bytes: usize) -> Self {
        Self {
            per_gpu: BTreeMap::new(),
            capacity: capacity_per_gpu.max(1),
            max_bytes,
            bytes: 0,
            next_seq: 1,
        }
    }

    /// Memory the events hold now (see [`event_bytes`]).
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    pub fn push(&mut self, t_ns: u64, gpu: &str, client: Option<u64>, kind: EventKind) {
        let e = Event {
            seq: self.next_seq,
            t_ns,
            gpu: gpu.to_string(),
            client,
            kind,
        };
        self.next_seq += 1;
        let size = event_bytes(&e);
        let ring = self.per_gpu.entry(gpu.to_string()).or_default();
        if ring.len() >= self.capacity {
            if let Some(old) = ring.pop_front() {
                self.bytes -= event_bytes(&old);
            }
        }
        ring.push_back(e);
        self.bytes += size;
        while self.bytes > self.max_bytes && self.evict_oldest() {}
    }

    /// Drops the oldest event of the whole log (never the last one); `false` if
    /// nothing could go.
    fn evict_oldest(&mut self) -> bool {
        if self.per_gpu.values().map(VecDeque::len).sum::<usize>() <= 1 {
            return false;
        }
        let Some(gpu) = self
            .per_gpu
            .iter()
            .filter_map(|(g, r)| r.front().map(|e| (e.seq, g)))
            .min()
            .map(|(_, g)| g.clone())
        else {
            return false;
        };
        let ring = self.per_gpu.get_mut(&gpu).expect("ring just found");
        if let Some(old) = ring.pop_front() {
            self.bytes -= event_bytes(&old);
        }
        if ring.is_empty() {
            self.per_gpu.remove(&gpu);
        }
        true
    }

    /// Events with `seq >= since` (of `gpu`, or all GPUs), oldest first, at most
    /// `limit` and [`MAX_PAGE_BYTES`] encoded (at least one). Returns them and
    /// whether more remain.
    pub fn page(&self, gpu: Option<&str>, since: u64, limit: usize) -> (Vec<Event>, bool) {
        let limit = limit.clamp(1, MAX_PAGE);
        let mut refs: Vec<&Event> = Vec::new();
        for (g, ring) in &self.per_gpu {
            if gpu.is_some_and(|want| want != g) {
                continue;
            }
            let start = ring.partition_point(|e| e.seq < since);
            refs.extend(ring.iter().skip(start).take(limit + 1));
        }
        refs.sort_by_key(|e| e.seq);
        let mut out = Vec::new();
        let mut bytes = 0;
        for e in &refs {
            if out.len() == limit {
                break;
            }
            bytes += encoded_len(e);
            if bytes > MAX_PAGE_BYTES && !out.is_empty() {
                break;
            }
            out.push((*e).clone());
        }
        let more = refs.len() > out.len();
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

    fn big_register() -> EventKind {
        EventKind::Register {
            pid: 1,
            host_pid: 1,
            name: Some("n".repeat(253)),
            pod_name: Some("p".repeat(253)),
            pod_namespace: Some("s".repeat(253)),
            working_set_bytes: 0,
            resumed: false,
        }
    }

    #[test]
    fn bounded_in_bytes_oldest_first_across_gpus() {
        let mut log = EventLog::with_max_bytes(100_000, 100_000);
        for i in 0..1_000 {
            let gpu = if i % 2 == 0 { "A" } else { "B" };
            log.push(i, gpu, Some(i), big_register());
            assert!(log.bytes() <= 100_000, "{} bytes", log.bytes());
        }
        let (events, _) = log.page(None, 0, MAX_PAGE);
        // The newest survive, contiguous, from both GPUs.
        assert_eq!(events.last().unwrap().seq, 1_000);
        assert!(events.windows(2).all(|w| w[1].seq == w[0].seq + 1));
        assert!(events.len() > 50 && events.len() < 200, "{}", events.len());
        assert_eq!(
            log.bytes(),
            events.iter().map(event_bytes).sum::<usize>(),
            "accounting matches what is held"
        );
    }

    #[test]
    fn a_page_fits_in_a_frame() {
        let mut log = EventLog::new(100_000);
        for i in 0..MAX_PAGE as u64 {
            log.push(i, "GPU-1", Some(i), big_register());
        }
        let (page, more) = log.page(None, 0, MAX_PAGE);
        assert!(more, "a full page of large events is split");
        let reply = kiwi_protocol::ControlReply::Events {
            events: page,
            next_seq: 0,
            more,
            now_ns: 0,
        };
        let bytes = kiwi_protocol::encode(&reply).expect("page fits in a frame");
        assert!(bytes.len() <= MAX_PAGE_BYTES + 1024);
    }
}
