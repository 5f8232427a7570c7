//! `kiwictl status`: the human table, and the formatting helpers `kiwictl top`
//! shares with it. Text that comes from tenants (process names, pods, namespaces,
//! container ids, groups) is printed only through [`printable`] or [`column`].

use std::borrow::Cow;
use std::fmt::Write;

use kiwi_protocol::{ClientState, ClientStatus, GpuStatus, StatusReport};

pub(crate) fn mib(b: u64) -> String {
    if b >= 10 << 30 {
        format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64)
    } else {
        format!("{} MiB", b >> 20)
    }
}

pub(crate) fn secs(ns: u64) -> String {
    format!("{:.1}s", ns as f64 / 1e9)
}

/// `text` with each control character as `?`. Names come from tenants: an escape
/// sequence or a line break among them must reach neither the operator's terminal
/// nor a pipe as one.
pub(crate) fn printable(text: &str) -> Cow<'_, str> {
    if text.chars().any(char::is_control) {
        Cow::Owned(
            text.chars()
                .map(|c| if c.is_control() { '?' } else { c })
                .collect(),
        )
    } else {
        Cow::Borrowed(text)
    }
}

/// A table's column of tenant text: at most `width` characters, [`printable`].
pub(crate) fn column(text: &str, width: usize) -> String {
    let cut: String = text.chars().take(width).collect();
    printable(&cut).into_owned()
}

pub(crate) fn on_off(on: bool) -> &'static str {
    if on {
        "on"
    } else {
        "off"
    }
}

/// A client's process name, or `-`.
pub(crate) fn client_name(c: &ClientStatus) -> &str {
    c.name.as_deref().unwrap_or("-")
}

/// Where a client runs: `namespace/pod`, the pod, a short container id, or `-`.
pub(crate) fn client_where(c: &ClientStatus) -> String {
    match (&c.pod_namespace, &c.pod_name, &c.container_id) {
        (Some(ns), Some(p), _) => format!("{ns}/{p}"),
        (None, Some(p), _) => p.clone(),
        (_, None, Some(cid)) => cid.chars().take(12).collect(),
        _ => "-".to_string(),
    }
}

pub(crate) fn state_name(s: ClientState) -> &'static str {
    match s {
        ClientState::Running => "running",
        ClientState::Holding => "holding",
        ClientState::Waiting => "waiting",
        ClientState::Idle => "idle",
    }
}

/// A client's state as the tables show it: its scheduling state, or `ckpt` (`wait+ck`
/// while it waits for its turn) when the driver checkpointed its whole process.
pub(crate) fn client_state(c: &ClientStatus) -> &'static str {
    match (c.checkpointed, c.state) {
        (true, ClientState::Waiting) => "wait+ck",
        (true, _) => "ckpt",
        (false, s) => state_name(s),
    }
}

/// A client's state with `*` when it is granted with its group (one job on several
/// GPUs, issue #41), as the tables show it.
pub(crate) fn client_state_marked(c: &ClientStatus) -> String {
    let s = client_state(c);
    if c.group.is_some() {
        format!("{s}*")
    } else {
        s.to_string()
    }
}

/// The columns both tables show of a client, from its name to the time it held the
/// GPU, defined once so that a table's heading lines up with its rows: `place` is
/// the width of the pod / container column, `memory` of the resident and swapped
/// ones.
pub(crate) struct ClientColumns {
    pub place: usize,
    pub memory: usize,
}

impl ClientColumns {
    pub(crate) fn heading(&self) -> String {
        self.row([
            "NAME",
            "POD / CONTAINER",
            "STATE",
            "RESIDENT",
            "SWAPPED",
            "WAITED",
            "HELD",
        ])
    }

    /// `c`'s cells; its name and place [`column`]s.
    pub(crate) fn cells(&self, c: &ClientStatus) -> String {
        let cells = [
            column(client_name(c), 16),
            column(&client_where(c), self.place),
            client_state_marked(c),
            mib(c.resident_bytes),
            mib(c.swapped_bytes),
            secs(c.waited_ns),
            secs(c.held_ns),
        ];
        self.row(cells.each_ref().map(String::as_str))
    }

    fn row(&self, [name, place, state, resident, swapped, waited, held]: [&str; 7]) -> String {
        let (p, m) = (self.place, self.memory);
        format!(
            "{name:<16} {place:<p$} {state:<8} {resident:>m$} {swapped:>m$} {waited:>8} {held:>8}"
        )
    }
}

/// The lines under a GPU's table about groups: whose turn the GPU is reserved for,
/// and what `*` means for each group with clients here.
pub(crate) fn group_lines(g: &GpuStatus) -> Vec<String> {
    let mut lines = Vec::new();
    if let Some(t) = &g.group_turn {
        lines.push(format!(
            "  turn reserved for group {}: {}",
            printable(&t.group),
            if t.running {
                "its turn runs on all its GPUs"
            } else {
                "waiting for its other GPUs to come free"
            }
        ));
    }
    let mut groups: Vec<(&str, Vec<u64>)> = Vec::new();
    for c in &g.clients {
        if let Some(k) = c.group.as_deref() {
            match groups.iter_mut().find(|(g, _)| *g == k) {
                Some((_, ids)) => ids.push(c.id),
                None => groups.push((k, vec![c.id])),
            }
        }
    }
    for (k, ids) in groups {
        let ids: Vec<String> = ids.iter().map(u64::to_string).collect();
        lines.push(format!(
            "  * group {} (clients {} here): granted together with its other GPUs",
            printable(k),
            ids.join(", ")
        ));
    }
    lines
}

/// What `ckpt` means, for the line under a table that shows one.
pub(crate) const CKPT_LEGEND: &str = "  ckpt: the whole process is checkpointed to host memory (its contexts too) to make room; it is restored before its next turn";

/// The node-wide swap line: budget, need, in use.
pub(crate) fn swap_line(r: &StatusReport) -> String {
    let budget = match r.swap_budget_bytes {
        None => "unlimited".to_string(),
        Some(b) => mib(b),
    };
    let over = match r.swap_budget_bytes {
        Some(b) if r.swap_need_bytes > b => "  (over budget: growth is refused)",
        _ => "",
    };
    format!(
        "Node swap: budget {budget}  need {}  in use {}{over}",
        mib(r.swap_need_bytes),
        mib(r.swap_in_use_bytes)
    )
}

/// The node's swap pool, when it has one: its size, what it has populated and lent,
/// and who borrows most.
pub(crate) fn pool_line(r: &StatusReport) -> Option<String> {
    let p = r.swap_pool.as_ref()?;
    let top: Vec<String> = p
        .tenants
        .iter()
        .take(3)
        .map(|(t, b)| format!("{} {}", printable(t), mib(*b)))
        .collect();
    Some(
        format!(
            "Swap pool: {} of {} lent, {} populated ({} ready, {} scrubbing), {} pages{}",
            mib(p.lent_bytes),
            mib(p.size_bytes),
            mib(p.populated_bytes),
            mib(p.ready_bytes),
            mib(p.scrubbing_bytes),
            p.page_mode,
            if top.is_empty() {
                String::new()
            } else {
                format!("; most lent to {}", top.join(", "))
            }
        ) + &p.spill.as_ref().map_or(String::new(), |s| {
            let most: Vec<String> = s
                .tenants
                .iter()
                .take(3)
                .map(|(t, b)| format!("{} {}", printable(t), mib(*b)))
                .collect();
            format!(
                "; on disk {} in {} files{}{}{}",
                mib(s.spilled_bytes),
                s.files,
                s.budget_bytes
                    .map_or(String::new(), |b| format!(" (budget {})", mib(b))),
                if most.is_empty() {
                    String::new()
                } else {
                    format!(", most from {}", most.join(", "))
                },
                if s.failures > 0 {
                    format!(
                        "; {} spills refused, last: {}",
                        s.failures,
                        printable(s.last_error.as_deref().unwrap_or("?"))
                    )
                } else {
                    String::new()
                }
            )
        }),
    )
}

/// The line saying what the arbiter left out to fit its reply in one frame.
pub(crate) fn omitted_line(r: &StatusReport) -> Option<String> {
    if r.omitted_clients == 0 && r.omitted_gpus == 0 {
        return None;
    }
    Some(format!(
        "Not shown: {} client(s) and {} GPU(s); the arbiter cut its reply to the 1 MiB frame limit (--gpu shows one GPU).",
        r.omitted_clients, r.omitted_gpus
    ))
}

/// The line for a node with no GPU in use: the settings a GPU's first client gets.
pub(crate) fn no_gpus_line(r: &StatusReport) -> String {
    format!(
        "No GPU has clients yet. Defaults: scheduler {}, TQ {} s.",
        on_off(r.default_settings.scheduler_on),
        r.default_settings.tq_ms as f64 / 1000.0
    )
}

/// The start of a GPU's heading: its index, UUID, scheduler and TQ (each view adds
/// its memory figures).
pub(crate) fn gpu_heading(g: &GpuStatus) -> String {
    format!(
        "GPU {}  {}  scheduler {}  TQ {} s",
        g.index,
        g.uuid,
        on_off(g.settings.scheduler_on),
        g.settings.tq_ms as f64 / 1000.0
    )
}

/// Renders the status report as a table per GPU, after the node's swap line.
pub fn render(r: &StatusReport) -> String {
    let mut s = render_gpus(r);
    if let Some(line) = omitted_line(r) {
        let _ = writeln!(s, "{line}");
    }
    s
}

fn render_gpus(r: &StatusReport) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "{}", swap_line(r));
    if let Some(l) = pool_line(r) {
        let _ = writeln!(s, "{l}");
    }
    if r.gpus.is_empty() {
        let _ = writeln!(s, "{}", no_gpus_line(r));
        return s;
    }
    for g in &r.gpus {
        let _ = writeln!(
            s,
            "{}  memory {} ({} schedulable)  {}",
            gpu_heading(g),
            mib(g.total_memory_bytes),
            mib(g.capacity_bytes),
            if g.fits {
                "working sets fit: all run"
            } else {
                "oversubscribed: one holder at a time"
            }
        );
        let list = |v: &[u64]| {
            if v.is_empty() {
                "-".to_string()
            } else {
                v.iter()
                    .map(|i| i.to_string())
                    .collect::<Vec<_>>()
                    .join(",")
            }
        };
        let _ = writeln!(
            s,
            "  holder: {}  queue: {}",
            list(&g.holders),
            list(&g.queue)
        );
        let columns = ClientColumns {
            place: 28,
            memory: 10,
        };
        let _ = writeln!(
            s,
            "  {:>4} {:>7} {:>8} {} {:>8}",
            "ID",
            "PID",
            "HOST PID",
            columns.heading(),
            "IDLE"
        );
        for c in &g.clients {
            let _ = writeln!(
                s,
                "  {:>4} {:>7} {:>8} {} {:>8}",
                c.id,
                c.pid,
                c.host_pid,
                columns.cells(c),
                c.idle_since_ns
                    .map_or_else(|| "-".to_string(), |t| secs(r.now_ns.saturating_sub(t)))
            );
        }
        if g.clients.iter().any(|c| c.checkpointed) {
            let _ = writeln!(s, "{CKPT_LEGEND}");
        }
        for line in group_lines(g) {
            let _ = writeln!(s, "{line}");
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiwi_protocol::Settings;

    fn report(budget: Option<u64>, need: u64, in_use: u64) -> StatusReport {
        StatusReport {
            default_settings: Settings {
                scheduler_on: true,
                tq_ms: 30_000,
            },
            gpus: Vec::new(),
            now_ns: 0,
            swap_budget_bytes: budget,
            swap_need_bytes: need,
            swap_in_use_bytes: in_use,
            swap_pool: None,
            omitted_clients: 0,
            omitted_gpus: 0,
        }
    }

    #[test]
    fn the_pool_line_shows_size_use_and_who_borrows_most() {
        let mut r = report(Some(1 << 30), 0, 0);
        assert!(pool_line(&r).is_none(), "no pool, no line");
        r.swap_pool = Some(Box::new(kiwi_protocol::PoolStatus {
            size_bytes: 8 << 30,
            populated_bytes: 3 << 30,
            ready_bytes: 1 << 30,
            lent_bytes: 2 << 30,
            scrubbing_bytes: 0,
            page_mode: "4KiB".into(),
            memfds: 12,
            tenants: vec![("team-a/nb".into(), 3 << 29), ("uid 1000".into(), 1 << 29)],
            spill: None,
        }));
        let t = render(&r);
        let line = t.lines().find(|l| l.starts_with("Swap pool:")).expect(&t);
        assert!(line.contains("2048 MiB of 8192 MiB lent"), "{line}");
        assert!(
            line.contains("most lent to team-a/nb 1536 MiB, uid 1000 512 MiB"),
            "{line}"
        );
        assert!(!line.contains("on disk"), "{line}");
        r.swap_pool.as_mut().unwrap().spill = Some(kiwi_protocol::SpillStatus {
            dir: "/var/lib/kiwi/spill".into(),
            spilled_bytes: 3 << 30,
            budget_bytes: Some(100 << 30),
            files: 48,
            failures: 2,
            tenants: vec![("team-b/nb".into(), 3 << 30)],
            last_error: Some("swap pool spill: spill budget of 100 MiB is full".into()),
        });
        let t = render(&r);
        let line = t.lines().find(|l| l.starts_with("Swap pool:")).expect(&t);
        assert!(
            line.contains(
                "on disk 3072 MiB in 48 files (budget 100.0 GiB), most from team-b/nb 3072 MiB"
            ),
            "{line}"
        );
        assert!(
            line.contains("2 spills refused, last: swap pool spill"),
            "{line}"
        );
    }

    #[test]
    fn printable_text_keeps_its_width_and_loses_its_control_characters() {
        assert!(matches!(printable("team-a/nb"), Cow::Borrowed("team-a/nb")));
        assert_eq!(printable("a\u{1b}[2J\nb\u{7}"), "a?[2J?b?");
        assert_eq!(column("ab\u{1b}cdef", 4), "ab?c");
        assert_eq!(column("é\tx", 16), "é?x");
    }

    #[test]
    fn tenant_names_reach_the_table_without_their_control_characters() {
        let evil = "ev\u{1b}[2J\nFAKE";
        let mut r = report(None, 0, 0);
        r.gpus.push(
            serde_json::from_value(serde_json::json!({
                "index": 0, "uuid": "GPU-x",
                "settings": {"scheduler_on": true, "tq_ms": 10_000},
                "total_memory_bytes": 1u64 << 30, "capacity_bytes": 1000u64 << 20,
                "fits": false, "holders": [1], "queue": [],
                "group_turn": {"group": evil, "running": false},
                "clients": [{
                    "id": 1, "pid": 10, "host_pid": 20, "name": evil,
                    "container_id": null, "pod_name": evil, "pod_namespace": evil,
                    "state": "holding", "working_set_bytes": 0, "resident_bytes": 0,
                    "swapped_bytes": 0, "waited_ns": 0, "held_ns": 0, "group": evil
                }]
            }))
            .unwrap(),
        );
        r.swap_pool = Some(Box::new(kiwi_protocol::PoolStatus {
            size_bytes: 1 << 30,
            populated_bytes: 0,
            ready_bytes: 0,
            lent_bytes: 1 << 20,
            scrubbing_bytes: 0,
            page_mode: "4KiB".into(),
            memfds: 1,
            tenants: vec![(evil.into(), 1 << 20)],
            spill: None,
        }));
        let t = render(&r);
        assert!(!t.chars().any(|c| c.is_control() && c != '\n'), "{t:?}");
        assert!(!t.lines().any(|l| l.starts_with("FAKE")), "{t}");
        let row = t.lines().find(|l| l.contains("holding")).expect(&t);
        assert!(
            row.contains("ev?[2J?FAKE ") && row.contains("ev?[2J?FAKE/ev?[2J?FAKE"),
            "{row}"
        );
        assert!(t.contains("turn reserved for group ev?[2J?FAKE:"), "{t}");
        assert!(t.contains("* group ev?[2J?FAKE (clients 1 here)"), "{t}");
        assert!(t.contains("most lent to ev?[2J?FAKE 1 MiB"), "{t}");
    }

    #[test]
    fn a_cut_reply_says_so() {
        let mut r = report(None, 0, 0);
        assert!(!render(&r).contains("Not shown"));
        r.omitted_clients = 12;
        let t = render(&r);
        assert!(
            t.trim_end().ends_with("Not shown: 12 client(s) and 0 GPU(s); the arbiter cut its reply to the 1 MiB frame limit (--gpu shows one GPU)."),
            "{t}"
        );
    }

    #[test]
    fn swap_line_shows_budget_need_and_use() {
        let t = render(&report(None, 0, 0));
        assert!(
            t.starts_with("Node swap: budget unlimited  need 0 MiB  in use 0 MiB\n"),
            "{t}"
        );
        let t = render(&report(Some(100 << 20), 24 << 20, 300 << 20));
        assert!(
            t.starts_with("Node swap: budget 100 MiB  need 24 MiB  in use 300 MiB\n"),
            "{t}"
        );
        let t = render(&report(Some(100 << 20), 200 << 20, 0));
        assert!(t.lines().next().unwrap().contains("over budget"), "{t}");
    }
}
