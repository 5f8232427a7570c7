//! The timeline as text for a terminal: one row per lane, the T-marks above, a time
//! axis in seconds below, a legend. ANSI colour only when asked for (the caller
//! decides: stdout a tty and `NO_COLOR` unset); without it every state still has its
//! own character, so the picture survives pipes and logs.

use std::fmt::Write as _;

use super::{fmt_secs, LaneState, Timeline, ALWAYS_VISIBLE_NS, NS_PER_S};

/// Columns of the terminal on stdout; `$COLUMNS`; else 100.
pub fn terminal_width() -> usize {
    let mut ws = libc::winsize {
        ws_row: 0,
        ws_col: 0,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: TIOCGWINSZ writes one `winsize` into the valid, live struct we pass;
    // on a non-tty it fails and leaves it untouched.
    let rc = unsafe { libc::ioctl(libc::STDOUT_FILENO, libc::TIOCGWINSZ, &mut ws) };
    if rc == 0 && ws.ws_col >= 40 {
        return ws.ws_col as usize;
    }
    std::env::var("COLUMNS")
        .ok()
        .and_then(|c| c.trim().parse::<usize>().ok())
        .filter(|c| *c >= 40)
        .unwrap_or(100)
}

/// The character for a state: plain, and with colour.
fn glyph(state: LaneState, color: bool) -> (char, &'static str) {
    match (state, color) {
        (LaneState::Gpu, false) => ('#', ""),
        (LaneState::Held, false) => ('=', ""),
        (LaneState::Waiting, false) => ('~', ""),
        (LaneState::SwapOut, false) => ('v', ""),
        (LaneState::SwapIn, false) => ('^', ""),
        (LaneState::Cpu, false) => ('+', ""),
        (LaneState::Idle, false) => ('.', ""),
        (LaneState::OffGpu, false) => ('-', ""),
        (LaneState::Gpu, true) => ('█', "\x1b[32m"),
        (LaneState::Held, true) => ('▓', "\x1b[32m"),
        (LaneState::Waiting, true) => ('█', "\x1b[31m"),
        (LaneState::SwapOut, true) => ('▼', "\x1b[33m"),
        (LaneState::SwapIn, true) => ('▲', "\x1b[35m"),
        (LaneState::Cpu, true) => ('█', "\x1b[34m"),
        (LaneState::Idle, true) => ('·', "\x1b[90m"),
        (LaneState::OffGpu, true) => ('─', "\x1b[90m"),
    }
}

const RESET: &str = "\x1b[0m";

/// Which state each of `cols` columns shows for a lane: the state covering most of
/// the column; a Waiting, GPU or swap interval too short to win a column still gets the
/// column of its middle (when at least [`ALWAYS_VISIBLE_NS`] long), so a brief wait
/// is never invisible.
pub(crate) fn lane_cells(t: &Timeline, lane: &super::Lane, cols: usize) -> Vec<Option<LaneState>> {
    let span = t.span_ns() as f64;
    let col_of = |ns: u64| -> usize {
        let x = (ns.saturating_sub(t.t0_ns)) as f64 / span * cols as f64;
        (x as usize).min(cols - 1)
    };
    let mut cover: Vec<[u64; LaneState::ALL.len()]> = vec![[0; LaneState::ALL.len()]; cols];
    let idx = |s: LaneState| LaneState::ALL.iter().position(|x| *x == s).unwrap_or(0);
    for i in &lane.intervals {
        let (s, e) = (i.start_ns.max(t.t0_ns), i.end_ns.min(t.t1_ns));
        if e <= s {
            continue;
        }
        for (c, cell) in cover
            .iter_mut()
            .enumerate()
            .take(col_of(e - 1) + 1)
            .skip(col_of(s))
        {
            let c0 = t.t0_ns + (c as f64 * span / cols as f64) as u64;
            let c1 = t.t0_ns + ((c + 1) as f64 * span / cols as f64) as u64;
            cell[idx(i.state)] += e.min(c1).saturating_sub(s.max(c0));
        }
    }
    let mut cells: Vec<Option<LaneState>> = cover
        .iter()
        .map(|c| {
            let (best, ns) = c
                .iter()
                .enumerate()
                .max_by_key(|(i, ns)| (**ns, std::cmp::Reverse(*i)))
                .expect("every state");
            (*ns > 0).then_some(LaneState::ALL[best])
        })
        .collect();
    // Later states win a contested column: a swap is drawn over the grant it falls in.
    let forced = [
        LaneState::Held,
        LaneState::Gpu,
        LaneState::Waiting,
        LaneState::SwapIn,
        LaneState::SwapOut,
    ];
    for i in forced
        .iter()
        .flat_map(|f| lane.intervals.iter().filter(move |i| i.state == *f))
    {
        let (s, e) = (i.start_ns.max(t.t0_ns), i.end_ns.min(t.t1_ns));
        if e < s + ALWAYS_VISIBLE_NS {
            continue;
        }
        let (a, b) = (col_of(s), col_of(e - 1));
        if !cells[a..=b].contains(&Some(i.state)) {
            cells[col_of(s + (e - s) / 2)] = Some(i.state);
        }
    }
    cells
}

/// A tick step (ns) of 1, 2 or 5 × 10^k giving at most `max_ticks` ticks.
pub(crate) fn tick_step(span_ns: u64, max_ticks: usize) -> u64 {
    let mut base = 1_000_000u64; // 1 ms
    loop {
        for m in [1, 2, 5] {
            let step = base * m;
            if span_ns / step < max_ticks.max(1) as u64 {
                return step;
            }
        }
        base *= 10;
    }
}

/// Seconds for an axis label at this step: `0`, `0.5`, `12`.
pub(crate) fn tick_label(ns: u64, step: u64) -> String {
    let s = ns as f64 / NS_PER_S as f64;
    let decimals = if step >= NS_PER_S {
        0
    } else if step >= NS_PER_S / 10 {
        1
    } else if step >= NS_PER_S / 100 {
        2
    } else {
        3
    };
    format!("{s:.decimals$}")
}

fn truncate(s: &str, w: usize) -> String {
    if s.chars().count() <= w {
        format!("{s:<w$}")
    } else {
        let mut out: String = s.chars().take(w.saturating_sub(1)).collect();
        out.push('…');
        out
    }
}

/// Writes `text` into `row` at column `col` unless that would overwrite something
/// (then a little to the right), never past the end. Returns whether it fit.
fn place(row: &mut [char], col: usize, text: &str) -> bool {
    let n = text.chars().count();
    let mut c = col;
    while c + n <= row.len() {
        let free = row[c.saturating_sub(1)..(c + n + 1).min(row.len())]
            .iter()
            .all(|ch| *ch == ' ');
        if free {
            for (i, ch) in text.chars().enumerate() {
                row[c + i] = ch;
            }
            return true;
        }
        c += 1;
    }
    false
}

/// The timeline as text, `width` columns wide (at least 40).
pub fn render_terminal(t: &Timeline, width: usize, color: bool) -> String {
    let width = width.max(40);
    let longest = t
        .lanes
        .iter()
        .map(|l| l.name.chars().count())
        .max()
        .unwrap_or(4);
    let label_w = longest.clamp(4, (width / 3).min(32));
    let cols = width - label_w - 3;
    let pad = " ".repeat(label_w + 1);
    let col_of = |ns: u64| -> usize {
        let x = ns.saturating_sub(t.t0_ns) as f64 / t.span_ns() as f64 * cols as f64;
        (x as usize).min(cols - 1)
    };
    let mut out = String::new();
    let bold = |s: &str| {
        if color {
            format!("\x1b[1m{s}{RESET}")
        } else {
            s.to_string()
        }
    };
    let _ = writeln!(out, "{}", bold(&t.title));

    // Marks: the labels, then a tick under each.
    if !t.marks.is_empty() {
        let mut row = vec![' '; cols];
        let mut ticks = vec![' '; cols];
        for m in &t.marks {
            let c = col_of(m.t_ns);
            place(&mut row, c, &m.label);
            ticks[c] = 'v';
        }
        let _ = writeln!(out, "{pad} {}", row.iter().collect::<String>().trim_end());
        let _ = writeln!(out, "{pad} {}", ticks.iter().collect::<String>().trim_end());
    }

    for lane in &t.lanes {
        let cells = lane_cells(t, lane, cols);
        let mut bar = String::new();
        let mut current = "";
        for cell in cells {
            match cell {
                None => {
                    if color && !current.is_empty() {
                        bar.push_str(RESET);
                        current = "";
                    }
                    bar.push(' ');
                }
                Some(s) => {
                    let (ch, code) = glyph(s, color);
                    if color && code != current {
                        bar.push_str(code);
                        current = code;
                    }
                    bar.push(ch);
                }
            }
        }
        if color && !current.is_empty() {
            bar.push_str(RESET);
        }
        let _ = writeln!(out, "{} |{bar}|", truncate(&lane.name, label_w));
    }

    // Axis: a tick every step, labelled where the labels fit.
    let step = tick_step(t.span_ns(), (cols / 8).max(2));
    let mut axis = vec!['-'; cols];
    let mut labels = vec![' '; cols];
    let mut k = 0u64;
    while k * step <= t.span_ns() {
        let c = col_of(t.t0_ns + k * step);
        axis[c] = '+';
        place(&mut labels, c, &tick_label(k * step, step));
        k += 1;
    }
    let _ = writeln!(out, "{pad} {}", axis.iter().collect::<String>());
    let unit = if label_w >= 8 { "time (s)" } else { "s" };
    let _ = writeln!(
        out,
        "{unit:>label_w$}  {}",
        labels.iter().collect::<String>().trim_end()
    );

    // Legend: only the states drawn, wrapped at the picture's width.
    let mut legend = String::from("Legend:");
    let mut used = legend.len();
    for s in t.states_present() {
        let (ch, code) = glyph(s, color);
        let item = 2 + 2 + 1 + s.label().chars().count();
        if used + item > width && used > "Legend:".len() {
            let _ = writeln!(out, "{legend}");
            legend = " ".repeat("Legend:".len());
            used = legend.len();
        }
        if color {
            let _ = write!(legend, "  {code}{ch}{ch}{RESET} {}", s.label());
        } else {
            let _ = write!(legend, "  {ch}{ch} {}", s.label());
        }
        used += item;
    }
    let _ = writeln!(out, "{legend}");
    for m in &t.marks {
        let _ = writeln!(
            out,
            "{:<3} {:>8} s  {}",
            m.label,
            fmt_secs(m.t_ns.saturating_sub(t.t0_ns)),
            m.note
        );
    }
    for n in &t.notes {
        let _ = writeln!(out, "{n}");
    }
    out
}
