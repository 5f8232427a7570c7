//! The event log: per GPU, a bounded set of [`Event`]s with arbiter-wide sequence
//! numbers, bounded in count per GPU and in bytes over all GPUs. Read page by page
//! over the control socket; a page is bounded in count and in encoded bytes so that
//! it always fits in one frame.
//!
//! What goes when a bound is reached is chosen by share, not by age alone (issue
//! #42, item 7: one client's flood of `no_room` erased every other client's
//! history): on the GPU over its count (or, over the byte bound, the GPU holding the
//! most bytes), the oldest event of the client with the most events within the
//! tenant with the most events. A tenant is a container, or a uid on the node's
//! socket, as the connection caps group them ([`Tenant`]); the GPU's own events
//! (no client) are the arbiter's, a tenant of their own. So a flood, or a churn of
//! short-lived clients, pushes out its own tenant's history, then its own client's,
//! and the others keep theirs. Each client's events are a queue of their own, oldest
//! first; a page merges the queues by `seq`. Every step is O(log n).

use std::cmp::Reverse;
use std::collections::hash_map::Entry;
use std::collections::{BTreeSet, BinaryHeap, HashMap, VecDeque};
use std::sync::Arc;

use kiwi_protocol::{Event, EventKind};

/// Most events one control reply carries.
pub const MAX_PAGE: usize = 2_000;
/// Most encoded bytes of events one control reply carries: well under the frame
/// limit, whatever the events hold.
pub const MAX_PAGE_BYTES: usize = 512 * 1024;
/// Default bound on the memory the whole log holds (see [`EventLog::bytes`]).
pub const DEFAULT_MAX_BYTES: usize = 64 << 20;
/// The bookkeeping of one queue (a client's on a GPU) or of one tenant's entry on a
/// GPU, counted in the log's bytes: its deque, map and rank entries, near enough.
const QUEUE_BYTES: usize = 128;

/// Whose events share one quota: a connection's cap group (`container <key>`, or
/// `uid <n>` on the node's socket).
pub type Tenant = Arc<str>;

/// One tenant's events on one GPU: a queue per client, ranked by length, then by
/// age (of equal queues, the one whose oldest event is oldest gives way first).
#[derive(Debug, Default)]
struct TenantLog {
    len: usize,
    clients: HashMap<Option<u64>, VecDeque<Event>>,
    /// (length, `Reverse(seq)` of its oldest event, client) of every queue.
    by_len: BTreeSet<(usize, Reverse<u64>, Option<u64>)>,
}

impl TenantLog {
    /// Appends `e` to its client's queue; returns the bookkeeping bytes it added.
    fn push(&mut self, e: Event) -> usize {
        let client = e.client;
        let (q, added) = match self.clients.entry(client) {
            Entry::Occupied(o) => (o.into_mut(), 0),
            Entry::Vacant(v) => (v.insert(VecDeque::new()), QUEUE_BYTES),
        };
        let n = q.len();
        let oldest = Reverse(q.front().map_or(e.seq, |f| f.seq));
        q.push_back(e);
        self.by_len.remove(&(n, oldest, client));
        self.by_len.insert((n + 1, oldest, client));
        self.len += 1;
        added
    }

    /// Takes the oldest event of the client with the most, and the bookkeeping
    /// bytes that freed.
    fn pop_largest(&mut self) -> Option<(Event, usize)> {
        let (n, _, client) = self.by_len.pop_last()?;
        let q = self.clients.get_mut(&client)?;
        let e = q.pop_front()?;
        self.len -= 1;
        let Some(front) = q.front().map(|f| f.seq) else {
            self.clients.remove(&client);
            return Some((e, QUEUE_BYTES));
        };
        // A flood's queue, trimmed by the others' events, must not keep its peak's
        // memory: give back what is mostly spare (amortized O(1), as growing is).
        if q.capacity() > 32 && q.len() * 2 < q.capacity() {
            q.shrink_to(q.len() + q.len() / 2);
        }
        self.by_len.insert((n - 1, Reverse(front), client));
        Some((e, 0))
    }
}

/// One GPU's events: a [`TenantLog`] per tenant, ranked by length.
#[derive(Debug)]
struct GpuLog {
    name: Arc<str>,
    len: usize,
    /// The events' bytes ([`event_bytes`]) and the bookkeeping's ([`QUEUE_BYTES`]).
    bytes: usize,
    tenants: HashMap<Tenant, TenantLog>,
    by_len: BTreeSet<(usize, Tenant)>,
}

impl GpuLog {
    fn new(name: Arc<str>) -> Self {
        Self {
            name,
            len: 0,
            bytes: 0,
            tenants: HashMap::new(),
            by_len: BTreeSet::new(),
        }
    }

    fn push(&mut self, tenant: &Tenant, e: Event) {
        let size = event_bytes(&e);
        let t = match self.tenants.get_mut(tenant) {
            Some(t) => t,
            None => {
                self.bytes += QUEUE_BYTES;
                self.tenants.entry(tenant.clone()).or_default()
            }
        };
        let n = t.len;
        self.bytes += size + t.push(e);
        if n > 0 {
            self.by_len.remove(&(n, tenant.clone()));
        }
        self.by_len.insert((n + 1, tenant.clone()));
        self.len += 1;
    }

    /// Drops the oldest event of the largest client of the largest tenant; returns
    /// the bytes freed.
    fn evict(&mut self) -> Option<usize> {
        let (n, tenant) = self.by_len.pop_last()?;
        let t = self.tenants.get_mut(&tenant)?;
        let (e, mut freed) = t.pop_largest()?;
        freed += event_bytes(&e);
        if t.len == 0 {
            self.tenants.remove(&tenant);
            freed += QUEUE_BYTES;
        } else {
            self.by_len.insert((n - 1, tenant));
        }
        self.len -= 1;
        self.bytes -= freed;
        Some(freed)
    }

    fn queues(&self) -> impl Iterator<Item = &VecDeque<Event>> {
        self.tenants.values().flat_map(|t| t.clients.values())
    }
}

#[derive(Debug)]
pub struct EventLog {
    gpus: HashMap<Arc<str>, GpuLog>,
    /// GPUs by the bytes they hold: the largest gives way to the byte bound.
    by_bytes: BTreeSet<(usize, Arc<str>)>,
    /// The tenant of events without one: the GPU's own, and clients no longer known.
    own: Tenant,
    capacity: usize,
    max_bytes: usize,
    bytes: usize,
    len: usize,
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
            gpus: HashMap::new(),
            by_bytes: BTreeSet::new(),
            own: Arc::from(""),
            capacity: capacity_per_gpu.max(1),
            max_bytes,
            bytes: 0,
            len: 0,
            next_seq: 1,
        }
    }

    /// Memory the log holds now: its events' (see [`event_bytes`]) and its queues'
    /// bookkeeping.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Events held now, over every GPU.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Logs `kind` for `client` (`None`: the GPU's own) of `tenant` (`None`: the
    /// arbiter's own events, or a client no longer known). O(log n).
    pub fn push(
        &mut self,
        t_ns: u64,
        gpu: &str,
        client: Option<u64>,
        tenant: Option<&Tenant>,
        kind: EventKind,
    ) {
        let e = Event {
            seq: self.next_seq,
            t_ns,
            gpu: gpu.to_string(),
            client,
            kind,
        };
        self.next_seq += 1;
        let tenant = tenant.unwrap_or(&self.own);
        let g = match self.gpus.get_mut(gpu) {
            Some(g) => g,
            None => {
                let name: Arc<str> = Arc::from(gpu);
                self.gpus
                    .entry(name.clone())
                    .or_insert_with(|| GpuLog::new(name))
            }
        };
        let before = g.bytes;
        self.by_bytes.remove(&(before, g.name.clone()));
        g.push(tenant, e);
        self.len += 1;
        if g.len > self.capacity && g.evict().is_some() {
            self.len -= 1;
        }
        self.bytes = self.bytes + g.bytes - before;
        self.by_bytes.insert((g.bytes, g.name.clone()));
        while self.bytes > self.max_bytes && self.len > 1 && self.evict_from_largest_gpu() {}
    }

    /// Drops one event of the GPU that holds the most bytes (see [`GpuLog::evict`]);
    /// `false` if nothing could go.
    fn evict_from_largest_gpu(&mut self) -> bool {
        let Some((_, name)) = self.by_bytes.pop_last() else {
            return false;
        };
        let Some(g) = self.gpus.get_mut(&name) else {
            return false;
        };
        let before = g.bytes;
        if g.evict().is_some() {
            self.len -= 1;
        }
        self.bytes = self.bytes + g.bytes - before;
        if g.len == 0 {
            self.gpus.remove(&name);
        } else {
            self.by_bytes.insert((g.bytes, name));
        }
        true
    }

    /// Events with `seq >= since` (of `gpu`, or all GPUs), oldest first, at most
    /// `limit` and [`MAX_PAGE_BYTES`] encoded (at least one). Returns them and
    /// whether more remain. The queues are merged by `seq`.
    pub fn page(&self, gpu: Option<&str>, since: u64, limit: usize) -> (Vec<Event>, bool) {
        let limit = limit.clamp(1, MAX_PAGE);
        let gpus: Vec<&GpuLog> = match gpu {
            Some(g) => self.gpus.get(g).into_iter().collect(),
            None => self.gpus.values().collect(),
        };
        // Each queue's next event from `since` on; the heap gives the lowest `seq`.
        let mut cursors: Vec<(&VecDeque<Event>, usize)> = Vec::new();
        let mut next = BinaryHeap::new();
        for q in gpus.iter().flat_map(|g| g.queues()) {
            let i = q.partition_point(|e| e.seq < since);
            if let Some(e) = q.get(i) {
                next.push(Reverse((e.seq, cursors.len())));
                cursors.push((q, i));
            }
        }
        let mut out = Vec::new();
        let mut bytes = 0;
        while let Some(&Reverse((_, c))) = next.peek() {
            let (q, i) = cursors[c];
            let e = &q[i];
            if out.len() == limit {
                break;
            }
            bytes += encoded_len(e);
            if bytes > MAX_PAGE_BYTES && !out.is_empty() {
                break;
            }
            out.push(e.clone());
            next.pop();
            if let Some(n) = q.get(i + 1) {
                cursors[c].1 = i + 1;
                next.push(Reverse((n.seq, c)));
            }
        }
        let more = !next.is_empty();
        (out, more)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    impl EventLog {
        /// The bytes and counts recomputed from what is held, checked against the
        /// running totals and ranks; returns the bytes.
        fn recount(&self) -> usize {
            let mut total = 0;
            let mut len = 0;
            for g in self.gpus.values() {
                let mut bytes = 0;
                let mut glen = 0;
                for (name, t) in &g.tenants {
                    let mut tlen = 0;
                    for (c, q) in &t.clients {
                        assert!(!q.is_empty());
                        assert!(q.iter().all(|e| e.client == *c && *e.gpu == *g.name));
                        assert!(t.by_len.contains(&(q.len(), Reverse(q[0].seq), *c)));
                        bytes += q.iter().map(event_bytes).sum::<usize>() + QUEUE_BYTES;
                        tlen += q.len();
                    }
                    assert_eq!(t.len, tlen);
                    assert_eq!(t.by_len.len(), t.clients.len());
                    assert!(g.by_len.contains(&(tlen, name.clone())));
                    bytes += QUEUE_BYTES;
                    glen += tlen;
                }
                assert_eq!(g.by_len.len(), g.tenants.len());
                assert_eq!((g.bytes, g.len), (bytes, glen));
                assert!(glen > 0 && glen <= self.capacity);
                assert!(self.by_bytes.contains(&(bytes, g.name.clone())));
                total += bytes;
                len += glen;
            }
            assert_eq!(self.by_bytes.len(), self.gpus.len());
            assert_eq!((self.bytes, self.len), (total, len));
            total
        }

        /// Everything held, through pages of `size`, checked to ascend.
        fn read_all(&self, gpu: Option<&str>, size: usize) -> Vec<Event> {
            let mut out: Vec<Event> = Vec::new();
            let mut since = 0;
            loop {
                let (page, more) = self.page(gpu, since, size);
                out.extend(page);
                since = out.last().map_or(since, |e| e.seq + 1);
                if !more {
                    break;
                }
            }
            assert!(out.windows(2).all(|w| w[0].seq < w[1].seq));
            out
        }
    }

    fn tenant(name: &str) -> Tenant {
        Arc::from(name)
    }

    /// What an honest client's history on a GPU looks like.
    fn history() -> Vec<EventKind> {
        vec![
            big_register(),
            EventKind::Request,
            EventKind::Grant {
                exclusive: true,
                waited_ns: 1,
            },
            EventKind::Release {
                early: false,
                resident_bytes: 1,
            },
            EventKind::Checkpoint {
                bytes: 1,
                duration_ns: 1,
            },
        ]
    }

    fn no_room() -> EventKind {
        EventKind::NoRoom {
            missing_bytes: 1 << 30,
            unseen_bytes: 0,
        }
    }

    /// Issue #42, item 7: one client's `no_room`s at 19k/s for 8 s filled the GPU's
    /// 100,000 events, and every other client's registrations, grants and
    /// checkpoints were gone. The flood now pushes out only its own oldest events.
    #[test]
    fn a_flood_from_one_client_leaves_the_others_history_in_order() {
        let cap = 1_000;
        let mut log = EventLog::new(cap);
        let (uid, container) = (tenant("uid 1000"), tenant("container abc"));
        // Two clients of one host user (the flooder's uid too), one of a container,
        // and the GPU's own events.
        log.push(0, "G", None, None, EventKind::Scheduler { on: true });
        for kind in history() {
            log.push(1, "G", Some(1), Some(&uid), kind.clone());
            log.push(2, "G", Some(2), Some(&container), kind.clone());
            log.push(3, "G", Some(3), Some(&uid), kind);
        }
        let before = log.read_all(None, MAX_PAGE);
        for i in 0..100_000 {
            log.push(10 + i, "G", Some(9), Some(&uid), no_room());
        }
        let after = log.read_all(None, 7);
        assert_eq!(after.len(), cap, "the GPU's count bound holds");
        assert_eq!(
            &after[..before.len()],
            &before[..],
            "the others' history is whole"
        );
        let flood = &after[before.len()..];
        assert!(flood.iter().all(|e| e.client == Some(9)));
        // The flood keeps its newest events, contiguous.
        assert_eq!(flood.last().unwrap().seq, log.next_seq - 1);
        assert!(flood.windows(2).all(|w| w[1].seq == w[0].seq + 1));
        // Bounded memory: the accounting is right, and the flooder's queue gave back
        // its room when the others' events trimmed it.
        let held = log.recount();
        assert!(held < cap * 2 * QUEUE_BYTES, "{held} bytes");
        let g = &log.gpus["G"];
        let q = &g.tenants[&uid].clients[&Some(9)];
        assert!(q.capacity() <= 2 * cap, "{}", q.capacity());
        // A flood of the other tenant, afterwards, trims the flooder, not the first
        // tenant's history.
        for i in 0..100_000 {
            log.push(10 + i, "G", Some(4), Some(&container), no_room());
        }
        let last = log.read_all(Some("G"), MAX_PAGE);
        assert_eq!(&last[..before.len()], &before[..]);
        let count = |c| last.iter().filter(|e| e.client == Some(c)).count();
        assert!(count(9) > 0 && count(4) > 0);
        assert!(
            count(4).abs_diff(count(9) + 5) <= 1,
            "{} {}",
            count(9),
            count(4)
        );
        let q = &log.gpus["G"].tenants[&uid].clients[&Some(9)];
        assert!(q.capacity() <= cap, "{}", q.capacity());
        log.recount();
    }

    /// A tenant that churns short-lived clients (a registration and an exit each)
    /// pushes out its own history, not another tenant's.
    #[test]
    fn a_churn_of_clients_leaves_other_tenants_history() {
        let mut log = EventLog::new(500);
        let (honest, churner) = (tenant("container honest"), tenant("container churn"));
        for round in 0..20 {
            for kind in history() {
                log.push(round, "G", Some(1), Some(&honest), kind);
            }
        }
        let before = log.read_all(None, MAX_PAGE);
        assert_eq!(before.len(), 100);
        for c in 10..20_000 {
            log.push(c, "G", Some(c), Some(&churner), big_register());
            log.push(c, "G", Some(c), Some(&churner), EventKind::Exit);
        }
        let after = log.read_all(None, MAX_PAGE);
        assert_eq!(after.len(), 500);
        assert_eq!(&after[..100], &before[..]);
        log.recount();
    }

    /// The byte bound takes from the GPU that holds the most, its largest tenant
    /// and client: a flood over several GPUs leaves another GPU's history whole, and
    /// its own GPU's other clients too.
    #[test]
    fn the_byte_bound_takes_from_the_largest_share() {
        let max = 400_000;
        let mut log = EventLog::with_max_bytes(100_000, max);
        let (honest, flooder) = (tenant("uid 1"), tenant("uid 2"));
        for kind in history() {
            log.push(0, "C", Some(1), Some(&honest), kind.clone());
            log.push(0, "A", Some(2), Some(&honest), kind);
        }
        let before = log.read_all(None, MAX_PAGE);
        for i in 0..50_000 {
            let gpu = ["A", "B"][i as usize % 2];
            log.push(i, gpu, Some(3 + i % 2), Some(&flooder), no_room());
            assert!(log.bytes() <= max, "{}", log.bytes());
        }
        let after = log.read_all(None, MAX_PAGE);
        let kept: Vec<&Event> = after.iter().filter(|e| e.client <= Some(2)).collect();
        assert_eq!(kept, before.iter().collect::<Vec<_>>());
        assert!(after.len() > 1_000, "{}", after.len());
        assert_eq!(log.recount(), log.bytes());
    }

    #[test]
    fn pages_merge_the_queues_in_seq_order() {
        let mut log = EventLog::new(300);
        let ts = [tenant("a"), tenant("b"), tenant("c")];
        let mut x: u64 = 7;
        for i in 0..5_000u64 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let gpu = ["G0", "G1"][(x >> 60) as usize % 2];
            let client = (x >> 40) % 9;
            let t = &ts[(client % 3) as usize];
            let client = (client != 0).then_some(client);
            let t = client.map(|_| t);
            log.push(i, gpu, client, t, EventKind::Request);
            if i % 997 == 0 {
                log.recount();
            }
        }
        let whole = log.read_all(None, MAX_PAGE);
        assert_eq!(whole.len(), 600);
        for size in [1, 7, 100] {
            assert_eq!(log.read_all(None, size), whole);
        }
        for g in ["G0", "G1"] {
            let one = log.read_all(Some(g), 13);
            assert_eq!(one.len(), 300);
            let want: Vec<Event> = whole.iter().filter(|e| e.gpu == g).cloned().collect();
            assert_eq!(one, want);
        }
        // From the middle on.
        let mid = whole[250].seq;
        let (page, more) = log.page(None, mid, 100);
        assert!(more);
        assert_eq!(&page[..], &whole[250..350]);
        log.recount();
    }

    #[test]
    fn bounded_paged_and_filtered() {
        let mut log = EventLog::new(3);
        for i in 0..5 {
            log.push(i, "A", Some(1), None, EventKind::Request);
            log.push(i, "B", Some(2), None, EventKind::Exit);
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
    fn bounded_in_bytes_the_largest_gpu_gives_way() {
        let mut log = EventLog::with_max_bytes(100_000, 100_000);
        for i in 0..1_000 {
            let gpu = if i % 2 == 0 { "A" } else { "B" };
            log.push(i, gpu, Some(i), None, big_register());
            assert!(log.bytes() <= 100_000, "{} bytes", log.bytes());
        }
        let (events, _) = log.page(None, 0, MAX_PAGE);
        assert_eq!(events.last().unwrap().seq, 1_000);
        assert!(events.len() > 50 && events.len() < 200, "{}", events.len());
        // Each GPU keeps its newest, contiguous, and the two keep equal shares.
        let per_gpu = |g: &str| -> Vec<u64> {
            let seqs: Vec<u64> = events
                .iter()
                .filter(|e| e.gpu == g)
                .map(|e| e.seq)
                .collect();
            assert!(seqs.windows(2).all(|w| w[1] == w[0] + 2), "{seqs:?}");
            seqs
        };
        let (a, b) = (per_gpu("A"), per_gpu("B"));
        assert_eq!((*a.last().unwrap(), *b.last().unwrap()), (999, 1_000));
        assert!(a.len().abs_diff(b.len()) <= 1, "{} {}", a.len(), b.len());
        assert_eq!(
            log.bytes(),
            log.recount(),
            "accounting matches what is held"
        );
        assert_eq!(log.len(), events.len());
    }

    #[test]
    fn a_page_fits_in_a_frame() {
        let mut log = EventLog::new(100_000);
        for i in 0..MAX_PAGE as u64 {
            log.push(i, "GPU-1", Some(i), None, big_register());
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
