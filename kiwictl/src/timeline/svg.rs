//! The timeline as a standalone SVG, laid out like the seed's figure: a title, one
//! lane per application with coloured blocks (named inside when wide enough), dashed
//! vertical lines for T0…T4 with their labels, a time axis in seconds, a legend, and
//! what each mark means. Plain SVG 1.1 text, no scripts or external references.

use std::fmt::Write as _;

use super::term::{lane_cells, tick_label, tick_step};
use super::{fmt_secs, Interval, Lane, LaneState, Timeline, ALWAYS_VISIBLE_NS};

const WIDTH: f64 = 1000.0;
const LANE_H: f64 = 38.0;
const LANE_GAP: f64 = 16.0;
const FONT: &str = "DejaVu Sans, Verdana, Arial, sans-serif";

/// Fill colour and the colour of text written on it.
fn colors(state: LaneState) -> (&'static str, &'static str) {
    match state {
        LaneState::Gpu => ("#2e8b57", "#ffffff"),
        LaneState::Held => ("#4caf50", "#ffffff"),
        LaneState::Waiting => ("#e4572e", "#ffffff"),
        LaneState::SwapOut => ("#d49a00", "#ffffff"),
        LaneState::SwapIn => ("#8e44ad", "#ffffff"),
        LaneState::Cpu => ("#3f7fbf", "#ffffff"),
        LaneState::Idle => ("#e6e6e6", "#555555"),
        LaneState::OffGpu => ("#d6d6d6", "#555555"),
    }
}

/// More intervals than this in a lane are drawn at half-pixel resolution instead.
const MAX_EXACT_INTERVALS: usize = 2_000;

/// The blocks to draw for a lane: its intervals as they are, or, for a lane with
/// very many (a long log with a short quantum), runs of half-pixel columns each in
/// its dominant state, so the file stays small and every short wait stays visible.
fn drawn_intervals(t: &Timeline, lane: &Lane, plot_w: f64) -> Vec<Interval> {
    if lane.intervals.len() <= MAX_EXACT_INTERVALS {
        return lane.intervals.clone();
    }
    let cols = (plot_w * 2.0) as usize;
    let bound = |c: usize| t.t0_ns + (c as f64 * t.span_ns() as f64 / cols as f64) as u64;
    let mut out: Vec<Interval> = Vec::new();
    for (c, cell) in lane_cells(t, lane, cols).into_iter().enumerate() {
        let Some(state) = cell else { continue };
        match out.last_mut() {
            Some(last) if last.state == state && last.end_ns == bound(c) => {
                last.end_ns = bound(c + 1)
            }
            _ => out.push(Interval {
                start_ns: bound(c),
                end_ns: bound(c + 1),
                state,
            }),
        }
    }
    out
}

/// Escapes text for XML content and attribute values.
pub fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            // Control characters are not allowed in XML 1.0.
            c if (c as u32) < 0x20 && !matches!(c, '\t' | '\n' | '\r') => out.push(' '),
            c => out.push(c),
        }
    }
    out
}

/// Roughly how wide `s` is at `size` px (for fitting text in blocks and margins).
fn text_w(s: &str, size: f64) -> f64 {
    s.chars().count() as f64 * size * 0.6
}

/// The picture as an SVG document.
pub fn render_svg(t: &Timeline) -> String {
    let longest = t
        .lanes
        .iter()
        .map(|l| text_w(&l.name, 13.0))
        .fold(0.0, f64::max);
    let label_w = (longest + 20.0).clamp(90.0, 300.0);
    let x0 = label_w + 10.0;
    let x1 = WIDTH - 30.0;
    let plot_w = x1 - x0;
    let span = t.span_ns() as f64;
    let x_of = |ns: u64| x0 + (ns.saturating_sub(t.t0_ns)) as f64 / span * plot_w;

    let title_y = 30.0;
    let marks_y = if t.marks.is_empty() { 44.0 } else { 66.0 };
    let lanes_y = marks_y + 12.0;
    let lanes_end = lanes_y + t.lanes.len() as f64 * (LANE_H + LANE_GAP) - LANE_GAP;
    let axis_y = lanes_end + 10.0;
    let legend_y = axis_y + 58.0;
    let marks_list_y = legend_y + 30.0;
    let notes_y = marks_list_y + t.marks.len() as f64 * 18.0 + 8.0;
    let height = notes_y + t.notes.len() as f64 * 16.0 + 12.0;

    let mut s = String::new();
    let _ = writeln!(
        s,
        r##"<?xml version="1.0" encoding="UTF-8"?>
<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height:.0}" viewBox="0 0 {WIDTH} {height:.0}" font-family="{FONT}">
<title>{}</title>
<rect x="0" y="0" width="{WIDTH}" height="{height:.0}" fill="#ffffff"/>
<text x="{:.1}" y="{title_y}" font-size="18" font-weight="bold" text-anchor="middle" fill="#222222">{}</text>"##,
        escape(&t.title),
        WIDTH / 2.0,
        escape(&t.title)
    );

    // Lanes: a frame, the blocks, the name on the left.
    let mut words = String::new();
    let _ = writeln!(s, r#"<g id="lanes">"#);
    for (i, lane) in t.lanes.iter().enumerate() {
        let y = lanes_y + i as f64 * (LANE_H + LANE_GAP);
        let _ = writeln!(
            s,
            r##"<g class="lane" data-name="{name}">
<text x="{:.1}" y="{:.1}" font-size="13" text-anchor="end" fill="#222222">{name}</text>
<rect x="{x0:.1}" y="{y:.1}" width="{plot_w:.1}" height="{LANE_H}" fill="#fafafa" stroke="#bbbbbb"/>"##,
            label_w,
            y + LANE_H / 2.0 + 4.5,
            name = escape(&lane.name)
        );
        for iv in &drawn_intervals(t, lane, plot_w) {
            let (a, b) = (iv.start_ns.max(t.t0_ns), iv.end_ns.min(t.t1_ns));
            if b <= a {
                continue;
            }
            let (bx0, bx1) = (x_of(a), x_of(b));
            // At least a hairline, so a brief wait stays visible.
            let w = if b - a >= ALWAYS_VISIBLE_NS {
                (bx1 - bx0).max(1.0)
            } else {
                bx1 - bx0
            };
            let (fill, ink) = colors(iv.state);
            let _ = writeln!(
                s,
                r#"<rect class="block {cls}" x="{bx0:.2}" y="{:.1}" width="{w:.2}" height="{:.1}" fill="{fill}"><title>{} {} s to {} s</title></rect>"#,
                y + 3.0,
                LANE_H - 6.0,
                iv.state.label(),
                fmt_secs(a - t.t0_ns),
                fmt_secs(b - t.t0_ns),
                cls = class(iv.state),
            );
            let word = iv.state.short();
            if w >= text_w(word, 12.0) + 8.0 {
                // Written after the marks, haloed in the block's colour, so a dashed
                // line crossing the block does not cross out its word.
                let _ = writeln!(
                    words,
                    r#"<text x="{:.2}" y="{:.1}" font-size="12" text-anchor="middle" fill="{ink}" stroke="{fill}" stroke-width="4" paint-order="stroke">{word}</text>"#,
                    bx0 + w / 2.0,
                    y + LANE_H / 2.0 + 4.0
                );
            }
        }
        let _ = writeln!(s, "</g>");
    }
    let _ = writeln!(s, "</g>");

    // Marks: dashed lines across every lane, labelled on top.
    let _ = writeln!(s, r#"<g id="marks">"#);
    let mut last_label_end = f64::MIN;
    for m in &t.marks {
        let x = x_of(m.t_ns);
        // Marks closer than their labels are wide share a line of text: nudge right.
        let lx = x.max(last_label_end + 4.0 + text_w(&m.label, 14.0) / 2.0);
        last_label_end = lx + text_w(&m.label, 14.0) / 2.0;
        let _ = writeln!(
            s,
            r##"<g class="mark" data-label="{label}" data-t-ns="{}">
<line x1="{x:.2}" y1="{:.1}" x2="{x:.2}" y2="{:.1}" stroke="#333333" stroke-width="1.2" stroke-dasharray="5,4"/>
<text x="{lx:.2}" y="{:.1}" font-size="14" font-weight="bold" text-anchor="middle" fill="#333333">{label}</text>
</g>"##,
            m.t_ns,
            marks_y - 6.0,
            axis_y,
            marks_y - 10.0,
            label = escape(&m.label)
        );
    }
    let _ = writeln!(s, "</g>");
    let _ = writeln!(s, "<g id=\"block-words\">\n{words}</g>");

    // Time axis in seconds from t0.
    let step = tick_step(t.span_ns(), 10);
    let _ = writeln!(
        s,
        r##"<g id="axis" font-size="12" fill="#333333">
<line x1="{x0:.1}" y1="{axis_y:.1}" x2="{x1:.1}" y2="{axis_y:.1}" stroke="#333333"/>"##
    );
    let mut k = 0u64;
    while k * step <= t.span_ns() {
        let x = x_of(t.t0_ns + k * step);
        let _ = writeln!(
            s,
            r##"<line x1="{x:.2}" y1="{axis_y:.1}" x2="{x:.2}" y2="{:.1}" stroke="#333333"/>
<text x="{x:.2}" y="{:.1}" text-anchor="middle">{}</text>"##,
            axis_y + 5.0,
            axis_y + 19.0,
            tick_label(k * step, step)
        );
        k += 1;
    }
    let _ = writeln!(
        s,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">time (s)</text>
</g>"#,
        x0 + plot_w / 2.0,
        axis_y + 37.0
    );

    // Legend: the states drawn.
    let _ = writeln!(s, r##"<g id="legend" font-size="13" fill="#222222">"##);
    let mut lx = x0;
    for st in t.states_present() {
        let (fill, _) = colors(st);
        let _ = writeln!(
            s,
            r##"<rect x="{lx:.1}" y="{:.1}" width="16" height="16" fill="{fill}" stroke="#888888"/>
<text x="{:.1}" y="{:.1}">{}</text>"##,
            legend_y - 12.0,
            lx + 22.0,
            legend_y,
            escape(st.label())
        );
        lx += 22.0 + text_w(st.label(), 13.0) + 24.0;
    }
    let _ = writeln!(s, "</g>");

    // What each mark means, then the notes.
    let _ = writeln!(s, r##"<g id="notes" font-size="13" fill="#222222">"##);
    for (i, m) in t.marks.iter().enumerate() {
        let _ = writeln!(
            s,
            r#"<text x="{x0:.1}" y="{:.1}"><tspan font-weight="bold">{}</tspan> ({} s): {}</text>"#,
            marks_list_y + i as f64 * 18.0,
            escape(&m.label),
            fmt_secs(m.t_ns.saturating_sub(t.t0_ns)),
            escape(&m.note)
        );
    }
    for (i, n) in t.notes.iter().enumerate() {
        let _ = writeln!(
            s,
            r##"<text x="{x0:.1}" y="{:.1}" font-size="12" fill="#555555">{}</text>"##,
            notes_y + i as f64 * 16.0,
            escape(n)
        );
    }
    let _ = writeln!(s, "</g>\n</svg>");
    s
}

/// The CSS-style class of a block, for tools that read the SVG.
fn class(state: LaneState) -> &'static str {
    match state {
        LaneState::Gpu => "gpu",
        LaneState::Held => "held",
        LaneState::Waiting => "waiting",
        LaneState::SwapOut => "swap-out",
        LaneState::SwapIn => "swap-in",
        LaneState::Cpu => "cpu",
        LaneState::Idle => "idle",
        LaneState::OffGpu => "off-gpu",
    }
}
