//! What a timeline adds up to per lane (held, waited, swapped), and the figures'
//! wording.

use super::*;

/// One lane's figures in [`Summary`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaneSummary {
    pub name: String,
    pub client: Option<u64>,
    /// Running on (or holding) the GPU, swaps included.
    pub gpu_ns: u64,
    pub waited_ns: u64,
    pub cpu_ns: u64,
    /// Idle, or off the GPU when CPU work and idleness cannot be told apart.
    pub idle_ns: u64,
    pub swapped_out_bytes: u64,
    pub swapped_in_bytes: u64,
}

/// The short summary printed under a timeline.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Summary {
    pub span_ns: u64,
    /// Whether CPU work is told apart from idleness (refined lanes); from the event
    /// log alone it is not, and `idle_ns` is all the time off the GPU.
    pub cpu_known: bool,
    /// Time at least one lane was on (or held) the GPU.
    pub gpu_busy_ns: u64,
    pub lanes: Vec<LaneSummary>,
}

impl Summary {
    /// GPU busy time as a percentage of the span.
    pub fn gpu_busy_pct(&self) -> f64 {
        100.0 * self.gpu_busy_ns as f64 / self.span_ns.max(1) as f64
    }
}

/// Per-lane time in each state within the picture, bytes swapped (from the log's
/// swap events in the window, by client), and how busy the GPU was: the union of
/// every lane's GPU (or held) intervals over the span.
pub fn summarize(t: &Timeline, events: &[Event]) -> Summary {
    let (t0, t1) = (t.t0_ns, t.t1_ns);
    let mut lanes = Vec::new();
    let mut busy: Vec<(u64, u64)> = Vec::new();
    for l in &t.lanes {
        let mut s = LaneSummary {
            name: l.name.clone(),
            client: l.client,
            gpu_ns: [
                LaneState::Gpu,
                LaneState::Held,
                LaneState::SwapOut,
                LaneState::SwapIn,
            ]
            .iter()
            .map(|&st| l.time_in(st, t0, t1))
            .sum(),
            waited_ns: l.time_in(LaneState::Waiting, t0, t1),
            cpu_ns: l.time_in(LaneState::Cpu, t0, t1),
            idle_ns: l.time_in(LaneState::Idle, t0, t1) + l.time_in(LaneState::OffGpu, t0, t1),
            swapped_out_bytes: 0,
            swapped_in_bytes: 0,
        };
        if let Some(id) = l.client {
            for e in events
                .iter()
                .filter(|e| e.client == Some(id) && e.t_ns >= t0 && e.t_ns <= t1)
            {
                match e.kind {
                    EventKind::SwapOut { bytes, .. } => s.swapped_out_bytes += bytes,
                    EventKind::SwapIn { bytes, .. } => s.swapped_in_bytes += bytes,
                    _ => {}
                }
            }
        }
        busy.extend(
            l.intervals
                .iter()
                .filter(|i| i.state.on_gpu())
                .map(|i| (i.start_ns.max(t0), i.end_ns.min(t1))),
        );
        lanes.push(s);
    }
    let gpu_busy_ns = merge_intervals(&busy, 0).iter().map(|(s, e)| e - s).sum();
    let cpu_known = t.lanes.iter().any(|l| {
        l.intervals
            .iter()
            .any(|i| matches!(i.state, LaneState::Cpu | LaneState::Idle))
    });
    Summary {
        span_ns: t.span_ns(),
        cpu_known,
        gpu_busy_ns,
        lanes,
    }
}

/// The summary as text: GPU busy %, then a row per lane.
pub fn render_summary(s: &Summary) -> String {
    let w = s
        .lanes
        .iter()
        .map(|l| l.name.chars().count())
        .max()
        .unwrap_or(4)
        .max(4);
    let mut out = format!(
        "GPU busy {:.1}% of {} s\n",
        s.gpu_busy_pct(),
        fmt_secs(s.span_ns)
    );
    out.push_str(&format!(
        "{:<w$}  {:>9}  {:>9}  {:>9}  {:>9}  {:>11}  {:>11}\n",
        "app",
        "on GPU",
        "waited",
        "CPU",
        if s.cpu_known { "idle" } else { "off GPU" },
        "swapped out",
        "swapped in"
    ));
    for l in &s.lanes {
        out.push_str(&format!(
            "{:<w$}  {:>9}  {:>9}  {:>9}  {:>9}  {:>11}  {:>11}\n",
            l.name,
            format!("{} s", fmt_secs(l.gpu_ns)),
            format!("{} s", fmt_secs(l.waited_ns)),
            if s.cpu_known {
                format!("{} s", fmt_secs(l.cpu_ns))
            } else {
                "-".to_string()
            },
            format!("{} s", fmt_secs(l.idle_ns)),
            fmt_bytes(l.swapped_out_bytes),
            fmt_bytes(l.swapped_in_bytes),
        ));
    }
    out
}

/// Seconds with a precision that suits the size: `0.305`, `12.3`, `4000`.
pub fn fmt_secs(ns: u64) -> String {
    let s = ns as f64 / NS_PER_S as f64;
    if s == 0.0 {
        "0".into()
    } else if s < 10.0 {
        format!("{s:.3}")
    } else if s < 1000.0 {
        format!("{s:.1}")
    } else {
        format!("{s:.0}")
    }
}

/// Bytes for people: `0 B`, `700 MiB`, `1.5 GiB`.
pub fn fmt_bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 || v.fract() == 0.0 {
        format!("{v:.0} {}", UNITS[u])
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}
