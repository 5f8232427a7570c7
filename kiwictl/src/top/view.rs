//! What `top` shows: the frame for a status report as ratatui lines (the header and
//! table headings inverse, each GPU's line bold), and the widget that lays them on
//! the screen one per row, cut to the width and height. The same lines, without
//! their styles, are `--once`'s output. Reads the tracker; owns no terminal.

use std::borrow::Cow;

use kiwi_protocol::{ClientState, ClientStatus, GpuStatus, StatusReport};
use ratatui::buffer::Buffer;
use ratatui::layout::Rect;
use ratatui::style::Style;
use ratatui::text::{Line, Span};
use ratatui::widgets::Widget;

use super::tracker::{Rate, Tracker};
use crate::status::{
    client_name, client_where, gpu_heading, group_lines, mib, no_gpus_line, omitted_line,
    pool_line, printable, secs, swap_line, ClientColumns, CKPT_LEGEND,
};

/// The frame's lines, laid one per row from the top of the area: a line longer than
/// the width is cut (never wrapped), lines past the height are left out (never
/// scrolled). A styled line's style covers its whole row, so the inverse headings
/// run the full width.
pub(super) struct Screen<'a>(pub(super) &'a [Line<'a>]);

impl Widget for Screen<'_> {
    fn render(self, area: Rect, buf: &mut Buffer) {
        for (line, row) in self.0.iter().zip(area.rows()) {
            line.render(row, buf);
        }
    }
}

/// One line of `text` in `style`, [`printable`]: names come from tenants, and a
/// control character among them reaches neither the terminal nor, in `--once`, a
/// pipe.
fn styled(text: String, style: Style) -> Line<'static> {
    let text = match printable(&text) {
        Cow::Borrowed(_) => text,
        Cow::Owned(clean) => clean,
    };
    Line::from(Span::raw(text)).style(style)
}

fn plain(text: String) -> Line<'static> {
    styled(text, Style::new())
}

fn bold(text: String) -> Line<'static> {
    styled(text, Style::new().bold())
}

fn inverse(text: String) -> Line<'static> {
    styled(text, Style::new().reversed())
}

impl Tracker {
    /// The holder's standing, as one phrase.
    fn holder_phrase(&self, g: &GpuStatus, c: &ClientStatus, now_ns: u64) -> String {
        if !g.settings.scheduler_on || g.fits {
            return "shared: working sets fit".into();
        }
        if g.queue.is_empty() {
            return "no one waits: keeps it until idle".into();
        }
        let Some(h) = self.holds.get(&(g.uuid.clone(), c.id)) else {
            return "time left unknown (its grant left the event log)".into();
        };
        if h.drop_ns.is_some() {
            return "TQ over: giving the GPU back".into();
        }
        let end = h
            .since_ns
            .saturating_add(g.settings.tq_ms.saturating_mul(1_000_000));
        match end.checked_sub(now_ns) {
            Some(left) if left > 0 => {
                format!("~{} left of its TQ, {} waiting", secs(left), g.queue.len())
            }
            _ => "TQ over: being asked to give the GPU back".into(),
        }
    }

    /// The frame for `report`, one entry per line; `live` adds the key help.
    pub(super) fn frame(&self, report: &StatusReport, live: bool) -> Vec<Line<'static>> {
        let mut out = Vec::new();
        let n_clients: usize = report.gpus.iter().map(|g| g.clients.len()).sum();
        out.push(inverse(format!(
            "kiwictl top  {} GPU(s)  {} client(s){}",
            report.gpus.len(),
            n_clients,
            if live { "   q: quit" } else { "" }
        )));
        out.push(plain(swap_line(report)));
        if let Some(l) = pool_line(report) {
            out.push(plain(l));
        }
        if report.gpus.is_empty() {
            out.push(plain(no_gpus_line(report)));
        }
        for g in &report.gpus {
            out.push(plain(String::new()));
            self.gpu_lines(g, report.now_ns, &mut out);
        }
        if let Some(l) = omitted_line(report) {
            out.push(plain(l));
        }
        out
    }

    fn gpu_lines(&self, g: &GpuStatus, now_ns: u64, out: &mut Vec<Line<'static>>) {
        let resident: u64 = g.clients.iter().map(|c| c.resident_bytes).sum();
        let ws: u64 = g.clients.iter().map(|c| c.working_set_bytes).sum();
        out.push(bold(format!(
            "{}  capacity {} of {}  {}",
            gpu_heading(g),
            mib(g.capacity_bytes),
            mib(g.total_memory_bytes),
            if g.fits {
                "working sets fit"
            } else {
                "oversubscribed"
            }
        )));
        let pct = |b: u64| {
            if g.capacity_bytes == 0 {
                0
            } else {
                (b as u128 * 100 / g.capacity_bytes as u128) as u64
            }
        };
        out.push(plain(format!(
            "  memory {}  resident {} ({}%)  working sets {} ({}% of capacity)",
            bar(resident, g.capacity_bytes, 20),
            mib(resident),
            pct(resident),
            mib(ws),
            pct(ws)
        )));
        let by_id = |id: u64| g.clients.iter().find(|c| c.id == id);
        let label = |id: u64| match by_id(id) {
            Some(c) => format!("#{id} {} ({})", client_name(c), client_where(c)),
            None => format!("#{id}"),
        };
        if g.holders.is_empty() {
            out.push(plain("  holder -  (the GPU is free)".into()));
        } else {
            for &id in &g.holders {
                let phrase = match by_id(id) {
                    Some(c) => format!("held {}  {}", secs(c.held_ns), {
                        if c.state == ClientState::Holding {
                            self.holder_phrase(g, c, now_ns)
                        } else {
                            "shared: working sets fit".into()
                        }
                    }),
                    None => String::new(),
                };
                out.push(plain(format!("  holder {}  {phrase}", label(id))));
            }
        }
        let queue = if g.queue.is_empty() {
            "-".to_string()
        } else {
            g.queue
                .iter()
                .enumerate()
                .map(|(i, &id)| format!("{}. {}", i + 1, label(id)))
                .collect::<Vec<_>>()
                .join("  ")
        };
        out.push(plain(format!("  queue  {queue}")));
        let columns = ClientColumns {
            place: 24,
            memory: 9,
        };
        out.push(inverse(format!(
            "  {:>5} {:>7} {} {:>9} {:>9}",
            "ID",
            "PID",
            columns.heading(),
            "IN MiB/s",
            "OUT MiB/s"
        )));
        // Holders first, then the queue in order, then the others.
        let rank = |c: &ClientStatus| {
            if g.holders.contains(&c.id) {
                (0, 0, c.id)
            } else if let Some(p) = g.queue.iter().position(|&q| q == c.id) {
                (1, p, c.id)
            } else {
                (2, 0, c.id)
            }
        };
        let mut clients: Vec<&ClientStatus> = g.clients.iter().collect();
        clients.sort_by_key(|c| rank(c));
        for c in clients {
            let rate = self
                .rates
                .as_ref()
                .map(|r| r.get(&(g.uuid.clone(), c.id)).copied().unwrap_or_default());
            let fmt_rate = |f: fn(&Rate) -> f64| match &rate {
                Some(r) => format!("{:.1}", f(r) / (1u64 << 20) as f64),
                None => "-".into(),
            };
            out.push(plain(format!(
                "  {:>5} {:>7} {} {:>9} {:>9}",
                c.id,
                c.host_pid,
                columns.cells(c),
                fmt_rate(|r| r.in_bps),
                fmt_rate(|r| r.out_bps),
            )));
        }
        if g.clients.iter().any(|c| c.checkpointed) {
            out.push(plain(CKPT_LEGEND.to_string()));
        }
        for line in group_lines(g) {
            out.push(plain(line));
        }
    }
}

/// `[#####.....]`: `part` of `whole` in `width` cells.
fn bar(part: u64, whole: u64, width: usize) -> String {
    let filled = if whole == 0 {
        0
    } else {
        ((part as u128 * width as u128 / whole as u128) as usize).min(width)
    };
    format!("[{}{}]", "#".repeat(filled), ".".repeat(width - filled))
}
