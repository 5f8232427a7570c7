//! Unit tests of the timeline model and its renderers, on hand-written event logs
//! shaped like the seed's example (T0…T4).

use kiwi_protocol::{DropReason, Event, EventKind};

use super::*;

const S: u64 = NS_PER_S;
const MS: u64 = 1_000_000;
const GPU: &str = "GPU-test-0";

fn ev(seq: u64, t_ns: u64, client: Option<u64>, kind: EventKind) -> Event {
    Event {
        seq,
        t_ns,
        gpu: GPU.into(),
        client,
        kind,
    }
}

fn reg(name: &str, pid: u32) -> EventKind {
    EventKind::Register {
        pid,
        host_pid: pid,
        name: Some(name.into()),
        pod_name: None,
        pod_namespace: None,
        working_set_bytes: 700 << 20,
        resumed: false,
    }
}

fn grant() -> EventKind {
    EventKind::Grant {
        exclusive: true,
        waited_ns: 0,
    }
}

fn release(early: bool) -> EventKind {
    EventKind::Release {
        early,
        resident_bytes: 0,
    }
}

/// The seed's story, with base time 100 s: A (client 1) and B (client 2) register;
/// A gets the GPU at 101 s (T1); B asks at 102 s (T2); A's quantum ends, A releases
/// and asks again, B is granted at 104.05 s (T3); B releases early at 105 s and A
/// gets it back (T4); A releases early at 106 s. "Now" is 107 s.
fn seed_log() -> (Vec<Event>, u64) {
    let b = 100 * S;
    let a = Some(1);
    let bb = Some(2);
    let evs = vec![
        ev(1, b, a, reg("A", 11)),
        ev(2, b + S / 10, bb, reg("B", 22)),
        ev(3, b + S, a, EventKind::Request),
        ev(4, b + S, a, grant()),
        ev(5, b + 2 * S, bb, EventKind::Request),
        ev(
            6,
            b + 4 * S,
            a,
            EventKind::Drop {
                need_bytes: 1,
                reason: DropReason::TqExpired,
            },
        ),
        ev(
            7,
            b + 4 * S + 40 * MS,
            a,
            EventKind::SwapOut {
                bytes: 512 << 20,
                duration_ns: 10 * MS,
            },
        ),
        ev(8, b + 4 * S + 50 * MS, a, release(false)),
        ev(9, b + 4 * S + 50 * MS, bb, grant()),
        ev(10, b + 4 * S + 60 * MS, a, EventKind::Request),
        ev(
            11,
            b + 4 * S + 70 * MS,
            bb,
            EventKind::SwapIn {
                bytes: 300 << 20,
                duration_ns: 5 * MS,
            },
        ),
        ev(12, b + 5 * S, bb, release(true)),
        ev(13, b + 5 * S, a, grant()),
        ev(14, b + 6 * S, a, release(true)),
    ];
    (evs, b + 7 * S)
}

fn iv(start_ns: u64, end_ns: u64, state: LaneState) -> Interval {
    Interval {
        start_ns,
        end_ns,
        state,
    }
}

#[test]
fn lanes_follow_requests_grants_and_releases() {
    let (evs, now) = seed_log();
    let t = from_events(&evs, None, None, now);
    let b = 100 * S;
    assert_eq!((t.t0_ns, t.t1_ns), (b, now));
    assert_eq!(t.title, "Kiwi timeline: GPU-test-0");
    assert_eq!(t.lanes.len(), 2);
    assert_eq!(t.lanes[0].name, "A (pid 11)");
    assert_eq!(t.lanes[0].client, Some(1));
    assert_eq!(
        t.lanes[0].intervals,
        vec![
            iv(b, b + S, LaneState::OffGpu),
            iv(b + S, b + 4030 * MS, LaneState::Held),
            // The swap-out logged at 104.04 s, 10 ms long.
            iv(b + 4030 * MS, b + 4040 * MS, LaneState::SwapOut),
            iv(b + 4040 * MS, b + 4050 * MS, LaneState::Held),
            iv(b + 4050 * MS, b + 4060 * MS, LaneState::OffGpu),
            iv(b + 4060 * MS, b + 5 * S, LaneState::Waiting),
            iv(b + 5 * S, b + 6 * S, LaneState::Held),
            iv(b + 6 * S, now, LaneState::OffGpu),
        ]
    );
    assert_eq!(t.lanes[1].name, "B (pid 22)");
    assert_eq!(
        t.lanes[1].intervals,
        vec![
            iv(b + S / 10, b + 2 * S, LaneState::OffGpu),
            iv(b + 2 * S, b + 4050 * MS, LaneState::Waiting),
            iv(b + 4050 * MS, b + 4065 * MS, LaneState::Held),
            iv(b + 4065 * MS, b + 4070 * MS, LaneState::SwapIn),
            iv(b + 4070 * MS, b + 5 * S, LaneState::Held),
            iv(b + 5 * S, now, LaneState::OffGpu),
        ]
    );
}

/// Swaps are their own band (issue #28): drawn over the grant in both pictures, kept
/// by the demo's refinement (the application's own report says nothing of them), and
/// never drawn outside the lane's life.
#[test]
fn swaps_are_their_own_band_in_every_picture() {
    let (mut evs, now) = seed_log();
    let b = 100 * S;
    // Stretch the two swaps so they own whole columns of a 100-column picture.
    for e in &mut evs {
        match &mut e.kind {
            EventKind::SwapOut { duration_ns, .. } => *duration_ns = 900 * MS,
            EventKind::SwapIn { duration_ns, .. } => *duration_ns = 15 * MS,
            _ => {}
        }
    }
    let mut t = from_events(&evs, None, None, now);
    assert_eq!(
        t.lanes[0].time_in(LaneState::SwapOut, b, now),
        900 * MS,
        "{:?}",
        t.lanes[0]
    );
    assert_eq!(t.lanes[1].time_in(LaneState::SwapIn, b, now), 15 * MS);
    let states = t.states_present();
    assert!(states.contains(&LaneState::SwapOut) && states.contains(&LaneState::SwapIn));

    let ascii = term::render_terminal(&t, 100, false);
    let a_row = ascii
        .lines()
        .find(|l| l.starts_with("A "))
        .unwrap_or_default();
    assert!(a_row.contains('v'), "{ascii}");
    assert!(
        ascii.contains("swapping out to host RAM"),
        "legend: {ascii}"
    );
    let svg = svg::render_svg(&t);
    assert!(svg.contains("class=\"block swap-out\"") && svg.contains("class=\"block swap-in\""));

    // The demo refines A with its own GPU and CPU spans: the swap stays.
    let a = t.lanes[0].client.unwrap();
    assert!(refine(&mut t, a, &[(b + S, b + 3 * S)], &[]));
    assert_eq!(t.lanes[0].time_in(LaneState::SwapOut, b, now), 900 * MS);

    // A swap that the log says ended before the lane began is cut to the lane.
    let mut early = evs.clone();
    early.push(ev(
        99,
        b + S / 10 + MS,
        Some(2),
        EventKind::SwapOut {
            bytes: 1,
            duration_ns: S,
        },
    ));
    let t = from_events(&early, None, None, now);
    assert_eq!(t.lanes[1].intervals[0].start_ns, b + S / 10);
    assert_eq!(t.lanes[1].time_in(LaneState::SwapOut, b, now), MS);
}

#[test]
fn seed_marks_are_where_the_log_puts_them() {
    let (evs, now) = seed_log();
    let b = 100 * S;
    let marks = seed_marks(&evs);
    let got: Vec<(&str, u64)> = marks.iter().map(|m| (m.label.as_str(), m.t_ns)).collect();
    assert_eq!(
        got,
        vec![
            ("T1", b + S),
            ("T2", b + 2 * S),
            ("T3", b + 4050 * MS),
            ("T4", b + 5 * S)
        ]
    );
    assert_eq!(marks[0].note, "A gets the GPU");
    assert_eq!(marks[1].note, "B asks for the GPU and waits");
    assert_eq!(
        marks[2].note,
        "A's time quantum is over: B gets the GPU, A waits"
    );
    assert_eq!(marks[3].note, "B releases early: A gets the GPU again");
    // The timeline adds T0 at its start.
    let t = from_events(&evs, None, None, now);
    let labels: Vec<&str> = t.marks.iter().map(|m| m.label.as_str()).collect();
    assert_eq!(labels, ["T0", "T1", "T2", "T3", "T4"]);
    assert_eq!(t.marks[0].t_ns, b);
}

#[test]
fn no_marks_without_someone_waiting_behind_a_holder() {
    let (evs, now) = seed_log();
    // Only A's events: nobody ever waits behind anyone.
    let only_a: Vec<Event> = evs
        .iter()
        .filter(|e| e.client == Some(1))
        .cloned()
        .collect();
    assert!(seed_marks(&only_a).is_empty());
    assert!(from_events(&only_a, None, None, now).marks.is_empty());
    // Stopping right after B's request: T1 and T2 only.
    let partial: Vec<Event> = evs.iter().take(5).cloned().collect();
    let labels: Vec<String> = seed_marks(&partial).into_iter().map(|m| m.label).collect();
    assert_eq!(labels, ["T1", "T2"]);
}

#[test]
fn t4_needs_an_early_release() {
    let (mut evs, _) = seed_log();
    // B is dropped instead of releasing early: no T4.
    for e in &mut evs {
        if e.seq == 12 {
            e.kind = release(false);
        }
    }
    let labels: Vec<String> = seed_marks(&evs).into_iter().map(|m| m.label).collect();
    assert_eq!(labels, ["T1", "T2", "T3"]);
}

#[test]
fn since_clips_the_window_but_keeps_the_state_at_its_start() {
    let (evs, now) = seed_log();
    let b = 100 * S;
    let t = from_events(&evs, None, Some(b + 4500 * MS), now);
    assert_eq!(t.t0_ns, b + 4500 * MS);
    assert_eq!(
        t.lanes[0].intervals[0],
        iv(b + 4500 * MS, b + 5 * S, LaneState::Waiting)
    );
    assert_eq!(
        t.lanes[1].intervals[0],
        iv(b + 4500 * MS, b + 5 * S, LaneState::Held)
    );
    // B's request (T2) is before the window: no occurrence of the pattern starts in
    // it, so no marks.
    assert!(t.marks.is_empty(), "{:?}", t.marks);
    // A window starting between T1 and T2 shows T2…T4 (T1 is before it, and
    // without T1 there is no T0).
    let t = from_events(&evs, None, Some(b + 1500 * MS), now);
    let labels: Vec<&str> = t.marks.iter().map(|m| m.label.as_str()).collect();
    assert_eq!(labels, ["T2", "T3", "T4"]);
    // A window older than the log starts at the first event.
    let t = from_events(&evs, None, Some(1), now);
    assert_eq!(t.t0_ns, b);
}

#[test]
fn gpu_filter_exit_and_truncated_logs() {
    let (mut evs, now) = seed_log();
    let b = 100 * S;
    // Another GPU's client, which the filter must leave out.
    evs.push(Event {
        seq: 20,
        t_ns: b + S,
        gpu: "GPU-other".into(),
        client: Some(9),
        kind: reg("other", 99),
    });
    let t = from_events(&evs, Some(GPU), None, now);
    assert_eq!(t.lanes.len(), 2);
    let all = from_events(&evs, None, None, now);
    assert_eq!(all.lanes.len(), 3);
    assert_eq!(all.title, "Kiwi timeline: 2 GPUs");

    // A client whose Register fell out of the log, seen giving the GPU back, then
    // exiting: held from the log's start, gone after its exit.
    let evs = vec![
        ev(50, b, Some(3), reg("C", 33)),
        ev(51, b + S, Some(4), release(true)),
        ev(52, b + 2 * S, Some(4), EventKind::Exit),
    ];
    let t = from_events(&evs, None, None, b + 3 * S);
    let lane = t.lanes.iter().find(|l| l.client == Some(4)).unwrap();
    assert_eq!(lane.name, "client 4");
    assert_eq!(
        lane.intervals,
        vec![
            iv(b, b + S, LaneState::Held),
            iv(b + S, b + 2 * S, LaneState::OffGpu)
        ]
    );
}

#[test]
fn same_names_are_told_apart_and_pods_shown() {
    let b = 100 * S;
    let mut pod = reg("python", 7);
    if let EventKind::Register {
        pod_name,
        pod_namespace,
        ..
    } = &mut pod
    {
        *pod_name = Some("nb-1".into());
        *pod_namespace = Some("ml".into());
    }
    let evs = vec![ev(1, b, Some(1), reg("python", 5)), ev(2, b, Some(2), pod)];
    let t = from_events(&evs, None, None, b + S);
    let names: Vec<&str> = t.lanes.iter().map(|l| l.name.as_str()).collect();
    assert_eq!(names, ["python #1 (pid 5)", "python #2 (ml/nb-1)"]);
}

#[test]
fn a_tenants_name_reaches_no_terminal_as_control_characters() {
    let b = 100 * S;
    let mut pod = reg("py\x1b[2Jthon", 7);
    if let EventKind::Register { pod_name, .. } = &mut pod {
        *pod_name = Some("nb\n\x1b]0;owned\x07".into());
    }
    let t = from_events(&[ev(1, b, Some(1), pod)], None, None, b + S);
    assert_eq!(t.lanes[0].name, "py?[2Jthon (nb??]0;owned?)");
}

#[test]
fn merge_joins_close_intervals() {
    assert_eq!(
        merge_intervals(&[(10, 20), (0, 5), (22, 30), (50, 60), (7, 7)], 3),
        vec![(0, 5), (10, 30), (50, 60)]
    );
    assert_eq!(merge_intervals(&[(0, 5), (6, 8)], 0), vec![(0, 5), (6, 8)]);
    assert_eq!(merge_intervals(&[(0, 5), (5, 8)], 0), vec![(0, 8)]);
}

#[test]
fn refine_turns_held_and_off_gpu_into_gpu_cpu_idle_and_keeps_waiting() {
    let (evs, now) = seed_log();
    let b = 100 * S;
    let mut t = from_events(&evs, None, None, now);
    let a = &mut t.lanes[0];
    // A computes on the CPU 100.2–101, on the GPU 101–104 and 105–105.8, then
    // reports a kernel while it waits (which must not show).
    refine_lane(
        a,
        &[
            (b + S, b + 4 * S),
            (b + 4500 * MS, b + 4600 * MS),
            (b + 5 * S, b + 5800 * MS),
        ],
        &[(b + S / 5, b + S)],
    );
    assert_eq!(
        a.intervals,
        vec![
            iv(b, b + S / 5, LaneState::Idle),
            iv(b + S / 5, b + S, LaneState::Cpu),
            iv(b + S, b + 4 * S, LaneState::Gpu),
            iv(b + 4 * S, b + 4030 * MS, LaneState::Idle),
            // The swap-out stays: the application's report does not cover it.
            iv(b + 4030 * MS, b + 4040 * MS, LaneState::SwapOut),
            iv(b + 4040 * MS, b + 4060 * MS, LaneState::Idle),
            iv(b + 4060 * MS, b + 5 * S, LaneState::Waiting),
            iv(b + 5 * S, b + 5800 * MS, LaneState::Gpu),
            iv(b + 5800 * MS, now, LaneState::Idle),
        ]
    );
    // Reported work past the lane's end extends it.
    let mut lane = Lane {
        name: "x".into(),
        client: None,
        intervals: vec![iv(10, 20, LaneState::OffGpu)],
    };
    refine_lane(&mut lane, &[(15, 30)], &[]);
    assert_eq!(
        lane.intervals,
        vec![iv(10, 15, LaneState::Idle), iv(15, 30, LaneState::Gpu)]
    );
}

#[test]
fn summary_counts_states_swaps_and_gpu_busy_time() {
    let (evs, now) = seed_log();
    let t = from_events(&evs, None, None, now);
    let s = summarize(&t, &evs);
    assert_eq!(s.span_ns, 7 * S);
    // Held 101–104.05 (A), 104.05–105 (B), 105–106 (A): 5 s of 7.
    assert_eq!(s.gpu_busy_ns, 5 * S);
    assert!((s.gpu_busy_pct() - 100.0 * 5.0 / 7.0).abs() < 1e-9);
    let a = &s.lanes[0];
    assert_eq!(a.gpu_ns, 4050 * MS);
    assert_eq!(a.waited_ns, 940 * MS);
    assert_eq!(a.idle_ns, 7 * S - 4050 * MS - 940 * MS);
    assert_eq!((a.swapped_out_bytes, a.swapped_in_bytes), (512 << 20, 0));
    let b = &s.lanes[1];
    assert_eq!(b.waited_ns, 2050 * MS);
    assert_eq!((b.swapped_out_bytes, b.swapped_in_bytes), (0, 300 << 20));
    let text = render_summary(&s);
    assert!(text.starts_with("GPU busy 71.4% of 7.000 s\n"), "{text}");
    assert!(!s.cpu_known);
    assert!(
        text.contains("off GPU") && text.contains("        -  "),
        "{text}"
    );
    assert!(
        text.contains("512 MiB") && text.contains("300 MiB"),
        "{text}"
    );
    assert!(
        text.contains("A (pid 11)") && text.contains("2.050 s"),
        "{text}"
    );
}

#[test]
fn terminal_picture_places_states_and_marks_by_column() {
    let (evs, now) = seed_log();
    let t = from_events(&evs, None, None, now);
    let out = term::render_terminal(&t, 80, false);
    println!("{out}");
    assert!(!out.contains('\x1b'), "no colour asked for:\n{out}");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[0], "Kiwi timeline: GPU-test-0");
    for l in &lines[..lines.len() - 1] {
        assert!(
            l.chars().count() <= 80,
            "{} columns: {l:?}",
            l.chars().count()
        );
    }
    let row = |prefix: &str| -> Vec<char> {
        let l = lines
            .iter()
            .find(|l| l.starts_with(prefix))
            .unwrap_or_else(|| panic!("no row for {prefix}:\n{out}"));
        let bar = &l[l.find('|').unwrap() + 1..l.rfind('|').unwrap()];
        bar.chars().collect()
    };
    let (a, b) = (row("A (pid 11)"), row("B (pid 22)"));
    assert_eq!(a.len(), b.len());
    let cols = a.len();
    // 7 s over `cols` columns: the middle of each phase shows its state.
    let at = |secs: f64| ((secs / 7.0) * cols as f64) as usize;
    assert_eq!(a[at(0.5)], '-', "A off the GPU before T1:\n{out}");
    assert_eq!(a[at(2.5)], '=', "A holds the GPU T1–T3:\n{out}");
    assert_eq!(b[at(3.0)], '~', "B waits T2–T3:\n{out}");
    assert_eq!(a[at(4.5)], '~', "A waits T3–T4:\n{out}");
    assert_eq!(b[at(4.5)], '=', "B holds T3–T4:\n{out}");
    assert_eq!(a[at(5.5)], '=', "A again after T4:\n{out}");
    // Marks row: T2 starts in the column of 2 s.
    let marks_row = lines[1];
    let bar_start = lines
        .iter()
        .find(|l| l.starts_with("A (pid"))
        .unwrap()
        .find('|')
        .unwrap()
        + 1;
    assert_eq!(marks_row.find("T2"), Some(bar_start + at(2.0)), "{out}");
    assert!(out.contains("Legend:  == holds the GPU  ~~ waiting for the GPU  vv swapping out"));
    assert!(
        out.contains("\n         ^^ swapping in  -- off GPU"),
        "{out}"
    );
    // The swaps, each in the column where it happened (shorter than a column, it
    // still gets one): A's swap-out at T3, B's swap-in just after.
    assert_eq!(a[at(4.035)], 'v', "A swaps out as it is dropped:\n{out}");
    assert_eq!(b[at(4.0675)], '^', "B swaps in after its grant:\n{out}");
    assert!(
        out.contains("T3     4.050 s  A's time quantum is over"),
        "{out}"
    );
    assert!(out.contains("  time (s)  0 "), "{out}");
}

#[test]
fn terminal_colour_only_when_asked_and_brief_waits_stay_visible() {
    let b = 100 * S;
    let evs = vec![
        ev(1, b, Some(1), reg("A", 1)),
        ev(2, b, Some(2), reg("B", 2)),
        ev(3, b, Some(1), grant()),
        ev(4, b + 50 * S, Some(2), EventKind::Request),
        ev(5, b + 50 * S + 5 * MS, Some(1), release(true)),
        ev(6, b + 50 * S + 5 * MS, Some(2), grant()),
    ];
    let mut t = from_events(&evs, None, None, b + 100 * S);
    // An instant grant (request and grant 2 µs apart) is not drawn as a wait.
    t.lanes[0]
        .intervals
        .insert(0, iv(b - 2_000, b, LaneState::Waiting));
    t.t0_ns = b - 2_000;
    let plain = term::render_terminal(&t, 60, false);
    let a_row = plain.lines().find(|l| l.starts_with("A ")).unwrap();
    assert!(!a_row.contains('~'), "{plain}");
    // A 5 ms wait in a 100 s picture is far less than a column, and still drawn.
    let b_row = plain.lines().find(|l| l.starts_with("B ")).unwrap();
    assert_eq!(b_row.matches('~').count(), 1, "{plain}");
    let colored = term::render_terminal(&t, 60, true);
    assert!(colored.contains("\x1b[31m█"), "waiting in red:\n{colored}");
    assert!(colored.contains("\x1b[0m"));
}

#[test]
fn svg_is_a_complete_document_with_lanes_blocks_and_marks() {
    let (evs, now) = seed_log();
    let mut t = from_events(&evs, None, None, now);
    t.lanes[0].name = "A <&> \"quoted\"".into();
    let svg = svg::render_svg(&t);
    assert!(svg.starts_with("<?xml"));
    assert!(svg.trim_end().ends_with("</svg>"));
    assert!(
        svg.contains("A &lt;&amp;&gt; &quot;quoted&quot;"),
        "names escaped"
    );
    assert!(!svg.contains("A <&>"));
    assert_eq!(svg.matches(r#"class="lane""#).count(), 2);
    assert_eq!(svg.matches(r#"class="block waiting""#).count(), 2);
    assert_eq!(svg.matches(r#"class="mark""#).count(), 5);
    assert!(svg.contains("stroke-dasharray"));
    assert!(svg.contains(">time (s)</text>"));
    assert!(svg.contains(">waiting for the GPU</text>"));
    // Every element opened is closed (a cheap well-formedness check; the
    // end-to-end test parses it with a real XML parser).
    for tag in ["g", "text", "rect", "title", "tspan"] {
        let open =
            svg.matches(&format!("<{tag} ")).count() + svg.matches(&format!("<{tag}>")).count();
        let closed = svg.matches(&format!("</{tag}>")).count()
            + svg
                .split(&format!("<{tag} "))
                .skip(1)
                .filter(|rest| rest.split('>').next().unwrap_or("").ends_with('/'))
                .count();
        assert_eq!(open, closed, "<{tag}> balanced");
    }
    // T2's line is at 2/7 of the plot.
    let x_t0 = attr_after(&svg, r#"data-label="T0""#, "x1");
    let x_t2 = attr_after(&svg, r#"data-label="T2""#, "x1");
    let x_t4 = attr_after(&svg, r#"data-label="T4""#, "x1");
    let frac = (x_t2 - x_t0) / (x_t4 - x_t0);
    assert!((frac - 2.0 / 5.0).abs() < 0.01, "T2 at {frac} of T0..T4");
}

fn attr_after(s: &str, anchor: &str, attr: &str) -> f64 {
    let rest = &s[s.find(anchor).expect(anchor)..];
    let pat = format!("{attr}=\"");
    let v = &rest[rest.find(&pat).unwrap() + pat.len()..];
    v[..v.find('"').unwrap()].parse().unwrap()
}

#[test]
fn since_parses_durations_and_refuses_the_rest() {
    assert_eq!(parse_since("90s"), Ok(90 * S));
    assert_eq!(parse_since("10m"), Ok(600 * S));
    assert_eq!(parse_since("2h"), Ok(7200 * S));
    assert_eq!(parse_since("1.5h"), Ok(5400 * S));
    assert_eq!(parse_since("250ms"), Ok(250 * MS));
    for bad in [
        "", "10", "m", "10x", "0s", "-5m", "1e3s", "10 m", "1.2.3s", "nans",
    ] {
        let e = parse_since(bad).unwrap_err();
        assert!(e.starts_with("--since"), "{bad:?}: {e}");
    }
}

#[test]
fn formatting_helpers() {
    assert_eq!(fmt_secs(0), "0");
    assert_eq!(fmt_secs(305 * MS), "0.305");
    assert_eq!(fmt_secs(12_340 * MS), "12.3");
    assert_eq!(fmt_bytes(0), "0 B");
    assert_eq!(fmt_bytes(700 << 20), "700 MiB");
    assert_eq!(fmt_bytes(3 << 29), "1.5 GiB");
    assert_eq!(term::tick_step(7 * S, 10), S);
    assert_eq!(term::tick_step(7 * S, 5), 2 * S);
    assert_eq!(term::tick_step(300 * MS, 10), 50 * MS);
    assert_eq!(term::tick_label(1500 * MS, 500 * MS), "1.5");
    assert_eq!(term::tick_label(2 * S, S), "2");
    assert_eq!(
        numbered(Path::new("/x/t.svg"), 2),
        PathBuf::from("/x/t-2.svg")
    );
}

#[test]
fn refined_timeline_reads_like_the_seed_figure() {
    let (evs, now) = seed_log();
    let b = 100 * S;
    let mut t = from_events(&evs, None, None, now);
    assert!(t.notes.iter().any(|n| n == LIVE_LOG_NOTE));
    // A: CPU 100–101, GPU 101–104.05 and 105–106, CPU after. B: idle, CPU
    // 101.5–102, GPU 104.05–105, CPU 105–106.
    assert!(refine(
        &mut t,
        1,
        &[(b + S, b + 4050 * MS), (b + 5 * S, b + 6 * S)],
        &[(b, b + S), (b + 6 * S, now)],
    ));
    assert!(
        t.notes.iter().any(|n| n == LIVE_LOG_NOTE),
        "B not refined yet"
    );
    assert!(refine(
        &mut t,
        2,
        &[(b + 4050 * MS, b + 5 * S)],
        &[(b + 1500 * MS, b + 2 * S), (b + 5 * S, b + 6 * S)],
    ));
    assert!(!refine(&mut t, 7, &[], &[]), "no such client");
    assert!(t.notes.is_empty(), "{:?}", t.notes);
    assert_eq!(
        t.states_present(),
        [
            LaneState::Gpu,
            LaneState::Waiting,
            LaneState::SwapOut,
            LaneState::SwapIn,
            LaneState::Cpu,
            LaneState::Idle
        ]
    );
    let text = term::render_terminal(&t, 90, false);
    let a_row = text.lines().find(|l| l.starts_with("A ")).unwrap();
    assert!(a_row.contains("+#") && a_row.contains("#v~") && a_row.contains("~#"));
    let svg = svg::render_svg(&t);
    for class in ["gpu", "waiting", "swap-out", "swap-in", "cpu", "idle"] {
        assert!(svg.contains(&format!("class=\"block {class}\"")), "{class}");
    }
    assert!(!svg.contains("off GPU"));
    if let Some(path) = std::env::var_os("KIWI_TIMELINE_KEEP") {
        std::fs::write(Path::new(&path).with_extension("refined.svg"), &svg).unwrap();
    }
}

#[test]
fn a_window_shows_its_own_occurrence_of_the_pattern() {
    let (mut evs, _) = seed_log();
    let b = 100 * S;
    // The story again at 110 s with the roles swapped: B holds, A asks.
    let later = vec![
        ev(30, b + 10 * S, Some(2), EventKind::Request),
        ev(31, b + 10 * S, Some(2), grant()),
        ev(32, b + 11 * S, Some(1), EventKind::Request),
        ev(33, b + 13 * S, Some(2), release(true)),
        ev(34, b + 13 * S, Some(1), grant()),
    ];
    evs.extend(later);
    let now = b + 14 * S;
    assert_eq!(
        seed_marks(&evs)[0].t_ns,
        b + S,
        "the whole log: the first one"
    );
    let t = from_events(&evs, None, Some(b + 9 * S), now);
    let got: Vec<(&str, u64, &str)> = t
        .marks
        .iter()
        .map(|m| (m.label.as_str(), m.t_ns, m.note.as_str()))
        .collect();
    assert_eq!(
        got,
        vec![
            ("T0", b + 9 * S, "start of the picture"),
            ("T1", b + 10 * S, "B gets the GPU"),
            ("T2", b + 11 * S, "A asks for the GPU and waits"),
            ("T3", b + 13 * S, "B releases the GPU: A gets the GPU"),
        ]
    );
}

#[test]
fn a_long_busy_log_stays_fast_and_small() {
    // 30,000 hand-overs between two clients, 10 ms each: 120,000 events.
    let b = 100 * S;
    let mut evs = vec![
        ev(0, b, Some(1), reg("A", 1)),
        ev(1, b, Some(2), reg("B", 2)),
    ];
    let mut seq = 2;
    for i in 0..30_000u64 {
        let t = b + i * 10 * MS;
        let (h, w) = if i % 2 == 0 { (1, 2) } else { (2, 1) };
        for (c, k) in [(h, grant()), (w, EventKind::Request), (h, release(true))] {
            let dt = if matches!(k, EventKind::Release { .. }) {
                10 * MS - 1
            } else {
                0
            };
            evs.push(ev(seq, t + dt, Some(c), k));
            seq += 1;
        }
    }
    let now = b + 300 * S;
    let started = std::time::Instant::now();
    let t = from_events(&evs, None, None, now);
    assert!(t.lanes[0].intervals.len() > 20_000);
    let text = term::render_terminal(&t, 120, false);
    let svg = svg::render_svg(&t);
    let secs = started.elapsed().as_secs_f64();
    assert!(secs < 5.0, "{secs} s");
    assert!(svg.len() < 2_000_000, "{} bytes", svg.len());
    assert!(svg.contains("class=\"block waiting\""));
    assert!(text.contains('~') && text.contains('='));
}
