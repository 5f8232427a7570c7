//! The timeline picture: who had the GPU, who waited, who worked on the CPU, over
//! time — the seed's "Example Timeline of Kiwi Applications" (T0…T4), drawn from an
//! arbiter's event log (`kiwictl timeline`) or from a run that also knows when each
//! application computed (`kiwictl demo`, which refines lanes with [`refine_lane`]).
//!
//! This module owns the model ([`Timeline`], [`Lane`], [`Interval`], [`Mark`]), how
//! it is built from events ([`from_events`], [`seed_marks`], [`summarize`]), and the
//! `timeline` subcommand ([`run`]). The T-marks are found in `marks.rs`, the per-lane
//! sums and their wording in `summary.rs`; drawing lives in [`term`] (ANSI terminal)
//! and [`svg`]. It talks to the arbiter only through [`Control`]; it never writes to it.

// `kiwictl demo` (the lead's) is the caller of the refinement and summary API that
// `timeline` itself does not need; until it lands, the binary does not use all of it.

mod marks;
mod summary;
pub mod svg;
pub mod term;

#[cfg(test)]
pub use marks::seed_marks;
pub use marks::seed_marks_from;
pub use summary::{fmt_bytes, fmt_secs, render_summary, summarize};

use std::collections::{BTreeMap, HashMap};
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use kiwi_protocol::{DropReason, Event, EventKind};

use crate::control::Control;

const NS_PER_S: u64 = 1_000_000_000;

/// A wait or GPU burst at least this long is always drawn, however short next to the
/// picture; shorter ones (an instant grant logs a request and a grant microseconds
/// apart) only at their true size.
pub const ALWAYS_VISIBLE_NS: u64 = 1_000_000;

/// What an application is doing during an [`Interval`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum LaneState {
    /// Running GPU work (known from the application itself, e.g. kernel intervals).
    Gpu,
    /// Holding the GPU grant (all an arbiter log can tell: it does not see kernels).
    Held,
    /// Asked for the GPU and not granted yet.
    Waiting,
    /// Copying its GPU memory out to host RAM (the arbiter's `swap_out` events).
    SwapOut,
    /// Copying its memory back onto the GPU (`swap_in` events).
    SwapIn,
    /// Working on the CPU (known from the application itself).
    Cpu,
    /// Doing nothing (known from the application itself).
    Idle,
    /// Not holding and not waiting: CPU work or idleness, the arbiter cannot tell.
    OffGpu,
}

impl LaneState {
    /// Every state, in legend order.
    pub const ALL: [LaneState; 8] = [
        LaneState::Gpu,
        LaneState::Held,
        LaneState::Waiting,
        LaneState::SwapOut,
        LaneState::SwapIn,
        LaneState::Cpu,
        LaneState::Idle,
        LaneState::OffGpu,
    ];

    /// The legend's words.
    pub fn label(self) -> &'static str {
        match self {
            LaneState::Gpu => "GPU",
            LaneState::Held => "holds the GPU",
            LaneState::Waiting => "waiting for the GPU",
            LaneState::SwapOut => "swapping out to host RAM",
            LaneState::SwapIn => "swapping in",
            LaneState::Cpu => "CPU",
            LaneState::Idle => "idle",
            LaneState::OffGpu => "off GPU (CPU or idle)",
        }
    }

    /// The word written inside a block when it is wide enough.
    pub fn short(self) -> &'static str {
        match self {
            LaneState::Gpu => "GPU",
            LaneState::Held => "GPU",
            LaneState::Waiting => "waiting",
            LaneState::SwapOut => "swap out",
            LaneState::SwapIn => "swap in",
            LaneState::Cpu => "CPU",
            LaneState::Idle => "idle",
            LaneState::OffGpu => "off GPU",
        }
    }

    /// Using the GPU: running on it, holding it, or moving memory to or from it (a
    /// swap happens within a hold, or while the GPU is reclaimed for another).
    fn on_gpu(self) -> bool {
        matches!(
            self,
            LaneState::Gpu | LaneState::Held | LaneState::SwapOut | LaneState::SwapIn
        )
    }
}

/// `[start_ns, end_ns)` in one state (CLOCK_MONOTONIC ns).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Interval {
    pub start_ns: u64,
    pub end_ns: u64,
    pub state: LaneState,
}

/// One application (one client of the arbiter): intervals sorted, non-overlapping.
/// Time outside every interval is time the application did not exist (or the log
/// does not cover).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lane {
    pub name: String,
    /// The arbiter's client id, when the lane comes from an event log.
    pub client: Option<u64>,
    pub intervals: Vec<Interval>,
}

impl Lane {
    /// Nanoseconds this lane spends in `state` within `[t0, t1)`.
    pub fn time_in(&self, state: LaneState, t0: u64, t1: u64) -> u64 {
        self.intervals
            .iter()
            .filter(|i| i.state == state)
            .map(|i| i.end_ns.min(t1).saturating_sub(i.start_ns.max(t0)))
            .sum()
    }
}

/// A labelled instant, drawn as a dashed vertical line (the seed's T1…T4).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mark {
    pub label: String,
    pub t_ns: u64,
    pub note: String,
}

/// Everything one picture shows, over `[t0_ns, t1_ns)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Timeline {
    pub title: String,
    pub t0_ns: u64,
    pub t1_ns: u64,
    pub lanes: Vec<Lane>,
    pub marks: Vec<Mark>,
    /// Lines printed under the picture.
    pub notes: Vec<String>,
}

impl Timeline {
    /// Length of the picture in ns (at least 1).
    pub fn span_ns(&self) -> u64 {
        self.t1_ns.saturating_sub(self.t0_ns).max(1)
    }

    /// The states that occur in the window, in legend order.
    pub fn states_present(&self) -> Vec<LaneState> {
        LaneState::ALL
            .into_iter()
            .filter(|s| {
                self.lanes
                    .iter()
                    .any(|l| l.time_in(*s, self.t0_ns, self.t1_ns) > 0)
            })
            .collect()
    }
}

// ---- building a timeline from the event log ----------------------------------------

/// What the log says about a client, for its lane's name.
struct ClientInfo {
    host_pid: u32,
    pod: Option<String>,
}

/// Short names for clients, unique within the log: the program name (or `client N`),
/// with `#id` appended where two share a name.
fn short_names(events: &[Event]) -> HashMap<u64, String> {
    let mut base: BTreeMap<u64, String> = BTreeMap::new();
    for e in events {
        let Some(id) = e.client else { continue };
        match &e.kind {
            EventKind::Register { name, pid, .. } => {
                let n = name
                    .clone()
                    .filter(|n| !n.trim().is_empty())
                    .unwrap_or_else(|| format!("pid {pid}"));
                base.insert(id, n);
            }
            _ => {
                base.entry(id).or_insert_with(|| format!("client {id}"));
            }
        }
    }
    let mut count: HashMap<&str, usize> = HashMap::new();
    for n in base.values() {
        *count.entry(n.as_str()).or_default() += 1;
    }
    base.iter()
        .map(|(id, n)| {
            let s = if count[n.as_str()] > 1 {
                format!("{n} #{id}")
            } else {
                n.clone()
            };
            (*id, s)
        })
        .collect()
}

/// Only the events of `gpu` when the log names it (a UUID); an index was already
/// applied by the arbiter, so events that never name it are taken as they are.
fn filter_gpu<'a>(events: &'a [Event], gpu: Option<&str>) -> Vec<&'a Event> {
    match gpu {
        Some(g) if events.iter().any(|e| e.gpu == g) => {
            events.iter().filter(|e| e.gpu == g).collect()
        }
        _ => events.iter().collect(),
    }
}

/// Appends `[start, end)` in `state`, merging with the previous interval when it
/// continues it; empty intervals are dropped.
fn push_interval(v: &mut Vec<Interval>, start_ns: u64, end_ns: u64, state: LaneState) {
    if end_ns <= start_ns {
        return;
    }
    if let Some(last) = v.last_mut() {
        if last.state == state && last.end_ns >= start_ns {
            last.end_ns = last.end_ns.max(end_ns);
            return;
        }
    }
    v.push(Interval {
        start_ns,
        end_ns,
        state,
    });
}

/// Paints `[start, end)` in `state` over a lane's sorted, disjoint intervals: what
/// it covers is cut away (only within the lane's extent: a swap is not drawn where
/// the lane did not exist).
fn overlay(v: &mut Vec<Interval>, start_ns: u64, end_ns: u64, state: LaneState) {
    let (Some(lo), Some(hi)) = (v.first().map(|i| i.start_ns), v.last().map(|i| i.end_ns)) else {
        return;
    };
    let (s, e) = (start_ns.max(lo), end_ns.min(hi));
    if e <= s {
        return;
    }
    let mut out = Vec::with_capacity(v.len() + 2);
    let mut placed = false;
    for i in v.iter() {
        if i.end_ns <= s || i.start_ns >= e {
            if !placed && i.start_ns >= e {
                out.push(Interval {
                    start_ns: s,
                    end_ns: e,
                    state,
                });
                placed = true;
            }
            out.push(*i);
            continue;
        }
        if i.start_ns < s {
            out.push(Interval { end_ns: s, ..*i });
        }
        if !placed {
            out.push(Interval {
                start_ns: s,
                end_ns: e,
                state,
            });
            placed = true;
        }
        if i.end_ns > e {
            out.push(Interval { start_ns: e, ..*i });
        }
    }
    if !placed {
        out.push(Interval {
            start_ns: s,
            end_ns: e,
            state,
        });
    }
    *v = out;
}

/// A timeline from an arbiter event log (CLOCK_MONOTONIC ns): one lane per client
/// (named after its Register event: program name, pod or pid). Request→Grant is
/// Waiting; Grant→Release/Revoke/Exit is Held; the rest is OffGpu (the arbiter
/// cannot tell CPU work from idleness); swaps (`swap_out`, `swap_in`, each logged at
/// its end with its duration) are drawn over the rest. The window is `[since, now)`, or from the
/// first event when `since_ns` is `None` or older; states at the window's start come
/// from the whole log. `gpu` keeps only that GPU's events (when the log names it).
pub fn from_events(
    events: &[Event],
    gpu: Option<&str>,
    since_ns: Option<u64>,
    now_ns: u64,
) -> Timeline {
    let mut evs = filter_gpu(events, gpu);
    evs.sort_by_key(|e| (e.t_ns, e.seq));
    let first_t = evs.first().map_or(now_ns, |e| e.t_ns);
    let t0 = since_ns.map_or(first_t, |s| s.max(first_t)).min(now_ns);
    let t1 = now_ns.max(t0 + 1);

    let owned: Vec<Event> = evs.iter().map(|e| (*e).clone()).collect();
    let names = short_names(&owned);

    struct Open {
        state: LaneState,
        since: u64,
        intervals: Vec<Interval>,
        info: ClientInfo,
        order: usize,
    }
    let mut open: BTreeMap<u64, Open> = BTreeMap::new();
    // Each client's swaps: `[t - duration, t)` (a swap is logged when it ends).
    let mut swaps: HashMap<u64, Vec<(u64, u64, LaneState)>> = HashMap::new();
    let mut closed: Vec<(usize, u64, Vec<Interval>, ClientInfo)> = Vec::new();
    let mut next_order = 0;
    let mut gpus: Vec<&str> = Vec::new();
    let mut tq_ms: Option<u64> = None;

    for e in &evs {
        if !gpus.contains(&e.gpu.as_str()) {
            gpus.push(&e.gpu);
        }
        if let EventKind::Tq { tq_ms: tq } = e.kind {
            tq_ms = Some(tq);
        }
        let Some(id) = e.client else { continue };
        let t = e.t_ns;
        if let EventKind::SwapOut { duration_ns, .. } | EventKind::SwapIn { duration_ns, .. } =
            e.kind
        {
            let state = match e.kind {
                EventKind::SwapOut { .. } => LaneState::SwapOut,
                _ => LaneState::SwapIn,
            };
            swaps
                .entry(id)
                .or_default()
                .push((t.saturating_sub(duration_ns), t, state));
        }
        let o = open.entry(id).or_insert_with(|| {
            // A client first seen without its Register (the log was truncated): it
            // was holding before when the first event shows it giving the GPU back.
            let (since, state) = match e.kind {
                EventKind::Register { .. } => (t, LaneState::OffGpu),
                EventKind::Release { .. } | EventKind::Drop { .. } | EventKind::Revoke => {
                    (first_t, LaneState::Held)
                }
                _ => (first_t, LaneState::OffGpu),
            };
            next_order += 1;
            Open {
                state,
                since,
                intervals: Vec::new(),
                info: ClientInfo {
                    host_pid: 0,
                    pod: None,
                },
                order: next_order,
            }
        });
        let new_state = match &e.kind {
            EventKind::Register {
                host_pid,
                pod_name,
                pod_namespace,
                ..
            } => {
                o.info = ClientInfo {
                    host_pid: *host_pid,
                    pod: pod_name.as_ref().map(|p| match pod_namespace {
                        Some(ns) => format!("{ns}/{p}"),
                        None => p.clone(),
                    }),
                };
                None
            }
            EventKind::Request if o.state != LaneState::Held => Some(LaneState::Waiting),
            EventKind::Grant { .. } => Some(LaneState::Held),
            EventKind::Release { .. } | EventKind::Revoke if o.state == LaneState::Held => {
                Some(LaneState::OffGpu)
            }
            EventKind::Exit => {
                let mut o = open.remove(&id).expect("present");
                push_interval(&mut o.intervals, o.since, t, o.state);
                closed.push((o.order, id, o.intervals, o.info));
                continue;
            }
            _ => None,
        };
        if let Some(s) = new_state {
            if s != o.state {
                push_interval(&mut o.intervals, o.since, t, o.state);
                o.state = s;
                o.since = t;
            }
        }
    }
    for (id, mut o) in open {
        push_interval(&mut o.intervals, o.since, t1, o.state);
        closed.push((o.order, id, o.intervals, o.info));
    }
    closed.sort_by_key(|c| c.0);

    let lanes: Vec<Lane> = closed
        .into_iter()
        .filter_map(|(_, id, mut intervals, info)| {
            for &(s, e, state) in swaps.get(&id).map_or(&[][..], |v| v.as_slice()) {
                overlay(&mut intervals, s, e, state);
            }
            let clipped: Vec<Interval> = intervals
                .into_iter()
                .filter(|i| i.end_ns > t0 && i.start_ns < t1)
                .map(|i| Interval {
                    start_ns: i.start_ns.max(t0),
                    end_ns: i.end_ns.min(t1),
                    state: i.state,
                })
                .collect();
            if clipped.is_empty() {
                return None;
            }
            let short = names
                .get(&id)
                .cloned()
                .unwrap_or_else(|| format!("client {id}"));
            let name = match (&info.pod, info.host_pid) {
                (Some(pod), _) => format!("{short} ({pod})"),
                (None, 0) => short,
                (None, pid) => format!("{short} (pid {pid})"),
            };
            Some(Lane {
                // Tenants name themselves: no escape sequence reaches a terminal.
                name: crate::status::printable(&name).into_owned(),
                client: Some(id),
                intervals: clipped,
            })
        })
        .collect();

    let mut marks: Vec<Mark> = seed_marks_from(&owned, t0)
        .into_iter()
        .filter(|m| m.t_ns >= t0 && m.t_ns <= t1)
        .collect();
    if marks
        .first()
        .is_some_and(|m| m.label == "T1" && m.t_ns > t0)
    {
        marks.insert(
            0,
            Mark {
                label: "T0".into(),
                t_ns: t0,
                note: "start of the picture".into(),
            },
        );
    }

    let title = match gpus.as_slice() {
        [one] => format!("Kiwi timeline: {one}"),
        [] => "Kiwi timeline".to_string(),
        many => format!("Kiwi timeline: {} GPUs", many.len()),
    };
    let mut notes = vec![LIVE_LOG_NOTE.to_string()];
    if let Some(tq) = tq_ms {
        notes.push(format!(
            "Time quantum set to {} s.",
            fmt_secs(tq * 1_000_000)
        ));
    }
    Timeline {
        title,
        t0_ns: t0,
        t1_ns: t1,
        lanes,
        marks,
        notes,
    }
}

/// The note under a picture drawn from the event log alone; [`refine`] removes it
/// once every lane is refined.
pub const LIVE_LOG_NOTE: &str = "From the arbiter's event log: it sees grants and requests, \
     not kernels, so time off the GPU may be CPU work or idleness.";

/// [`refine_lane`] on the lane of arbiter client `client`; returns whether there was
/// one. Once no lane shows log-only states (held, off GPU), the log-only note goes.
pub fn refine(t: &mut Timeline, client: u64, gpu_busy: &[(u64, u64)], cpu: &[(u64, u64)]) -> bool {
    let Some(lane) = t.lanes.iter_mut().find(|l| l.client == Some(client)) else {
        return false;
    };
    refine_lane(lane, gpu_busy, cpu);
    let log_only = t.lanes.iter().any(|l| {
        l.intervals
            .iter()
            .any(|i| matches!(i.state, LaneState::Held | LaneState::OffGpu))
    });
    if !log_only {
        t.notes.retain(|n| n != LIVE_LOG_NOTE);
    }
    true
}

/// Sorts and merges `[start, end)` pairs, joining those closer than `gap_ns`: e.g.
/// kernel intervals from the simulator's trace become GPU bursts.
pub fn merge_intervals(spans: &[(u64, u64)], gap_ns: u64) -> Vec<(u64, u64)> {
    let mut v: Vec<(u64, u64)> = spans.iter().copied().filter(|(s, e)| e > s).collect();
    v.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(v.len());
    for (s, e) in v {
        match out.last_mut() {
            Some(last) if s <= last.1.saturating_add(gap_ns) => last.1 = last.1.max(e),
            _ => out.push((s, e)),
        }
    }
    out
}

/// Refines a lane with what the application itself reports: `gpu_busy` intervals
/// become Gpu and `cpu` intervals Cpu; swaps and Waiting stay (a waiting or swapping
/// application runs nothing, whatever it reports); everything else becomes Idle. The lane keeps
/// its extent (extended to cover the reported intervals).
pub fn refine_lane(lane: &mut Lane, gpu_busy: &[(u64, u64)], cpu: &[(u64, u64)]) {
    let gpu = merge_intervals(gpu_busy, 0);
    let cpu = merge_intervals(cpu, 0);
    let of = |state: LaneState| -> Vec<(u64, u64)> {
        lane.intervals
            .iter()
            .filter(|i| i.state == state)
            .map(|i| (i.start_ns, i.end_ns))
            .collect()
    };
    let (waiting, swap_out, swap_in) = (
        of(LaneState::Waiting),
        of(LaneState::SwapOut),
        of(LaneState::SwapIn),
    );
    let starts = lane
        .intervals
        .first()
        .map(|i| i.start_ns)
        .into_iter()
        .chain(gpu.first().map(|g| g.0))
        .chain(cpu.first().map(|c| c.0));
    let ends = lane
        .intervals
        .last()
        .map(|i| i.end_ns)
        .into_iter()
        .chain(gpu.last().map(|g| g.1))
        .chain(cpu.last().map(|c| c.1));
    let (Some(lo), Some(hi)) = (starts.min(), ends.max()) else {
        return;
    };
    // Cut the extent at every boundary; each piece has one state.
    let mut cuts: Vec<u64> = vec![lo, hi];
    for (s, e) in gpu
        .iter()
        .chain(&cpu)
        .chain(&waiting)
        .chain(&swap_out)
        .chain(&swap_in)
    {
        cuts.push(*s);
        cuts.push(*e);
    }
    cuts.retain(|t| (lo..=hi).contains(t));
    cuts.sort_unstable();
    cuts.dedup();
    let inside = |v: &[(u64, u64)], a: u64, b: u64| v.iter().any(|(s, e)| *s <= a && b <= *e);
    let mut out = Vec::new();
    for w in cuts.windows(2) {
        let (a, b) = (w[0], w[1]);
        let state = if inside(&swap_out, a, b) {
            LaneState::SwapOut
        } else if inside(&swap_in, a, b) {
            LaneState::SwapIn
        } else if inside(&waiting, a, b) {
            LaneState::Waiting
        } else if inside(&gpu, a, b) {
            LaneState::Gpu
        } else if inside(&cpu, a, b) {
            LaneState::Cpu
        } else {
            LaneState::Idle
        };
        push_interval(&mut out, a, b, state);
    }
    lane.intervals = out;
}

/// `90s`, `10m`, `2h` (also `500ms`, fractions like `1.5h`) as nanoseconds (> 0).
pub fn parse_since(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let mult = match unit {
        "ms" => 1e6,
        "s" => 1e9,
        "m" => 60e9,
        "h" => 3600e9,
        _ => {
            return Err(format!(
                "--since {s:?}: expected a duration like 90s, 10m or 2h"
            ))
        }
    };
    let v: f64 = num
        .parse()
        .map_err(|_| format!("--since {s:?}: expected a duration like 90s, 10m or 2h"))?;
    let ns = v * mult;
    if !(ns >= 1.0 && ns < u64::MAX as f64) {
        return Err(format!("--since {s:?}: the duration must be more than 0"));
    }
    Ok(ns as u64)
}

// ---- `kiwictl timeline` ----------------------------------------------------------------

/// `kiwictl timeline`'s own flags (`--gpu` and `--socket-dir` are kiwictl's).
#[derive(clap::Args, Debug, Clone)]
pub struct TimelineArgs {
    /// Only the last part of the log: 90s, 10m, 2h (default: all of it).
    #[arg(long, value_name = "DURATION")]
    pub since: Option<String>,
    /// Also write the picture as SVG to PATH.
    #[arg(long, value_name = "PATH")]
    pub svg: Option<PathBuf>,
    /// Width of the terminal picture in columns (default: the terminal's, or 100).
    #[arg(long, value_name = "COLUMNS")]
    pub width: Option<usize>,
}

/// Draws the picture from a live arbiter's event log.
pub fn run(socket_dir: &Path, gpu: Option<String>, args: &TimelineArgs) -> Result<ExitCode> {
    let since = match &args.since {
        Some(s) => Some(parse_since(s).map_err(anyhow::Error::msg)?),
        None => None,
    };
    if args.width.is_some_and(|w| w < 40) {
        bail!("--width must be at least 40 columns");
    }
    let mut ctl = Control::connect(socket_dir)?;
    let (events, now_ns) = ctl.events(gpu.clone(), 0)?;
    let since_ns = since.map(|d| now_ns.saturating_sub(d));
    let mut gpus: Vec<String> = Vec::new();
    for e in &events {
        if !gpus.contains(&e.gpu) {
            gpus.push(e.gpu.clone());
        }
    }
    let timelines: Vec<Timeline> = gpus
        .iter()
        .map(|g| from_events(&events, Some(g), since_ns, now_ns))
        .filter(|t| !t.lanes.is_empty())
        .collect();
    if timelines.is_empty() {
        let scope = gpu.map(|g| format!(" for GPU {g}")).unwrap_or_default();
        let when = args
            .since
            .as_ref()
            .map(|s| format!(" in the last {s}"))
            .unwrap_or_default();
        println!("No client events in the arbiter's log{scope}{when}: nothing to draw.");
        return Ok(ExitCode::SUCCESS);
    }
    let width = args.width.unwrap_or_else(term::terminal_width);
    let color = std::io::stdout().is_terminal()
        && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
        && std::env::var("TERM").map_or(true, |t| t != "dumb");
    for (i, t) in timelines.iter().enumerate() {
        if i > 0 {
            println!();
        }
        print!("{}", term::render_terminal(t, width, color));
        println!();
        print!("{}", render_summary(&summarize(t, &events)));
    }
    if let Some(path) = &args.svg {
        for (i, t) in timelines.iter().enumerate() {
            let p = if timelines.len() == 1 {
                path.clone()
            } else {
                numbered(path, i)
            };
            std::fs::write(&p, svg::render_svg(t))
                .with_context(|| format!("cannot write {}", p.display()))?;
            println!("[INFO] wrote {}", p.display());
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `x.svg` → `x-1.svg` for the second GPU's picture, and so on.
fn numbered(path: &Path, i: usize) -> PathBuf {
    if i == 0 {
        return path.to_path_buf();
    }
    let stem = path.file_stem().map_or_else(
        || "kiwi-timeline".into(),
        |s| s.to_string_lossy().into_owned(),
    );
    let name = match path.extension() {
        Some(ext) => format!("{stem}-{i}.{}", ext.to_string_lossy()),
        None => format!("{stem}-{i}"),
    };
    path.with_file_name(name)
}

#[cfg(test)]
pub(crate) mod tests;
