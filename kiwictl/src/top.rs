//! `kiwictl top`: a live view of the node, in the spirit of `nvidia-smi` and `htop`,
//! refreshed every second over the control socket.
//!
//! Each refresh asks for the status report and for the event log's entries since the
//! last refresh. The report gives settings, memory, holders, queue and per-client
//! figures; the events give what the report does not: when the current hold began
//! (so the holder's time left of its TQ is `since + TQ − now`, the rule the
//! scheduler applies when someone waits) and the bytes swapped in and out between
//! two refreshes (the swap rates).
//!
//! This module owns the terminal while it runs: raw mode through termios, the
//! alternate screen, a hidden cursor, and their restoration on every way out (`q`,
//! Ctrl-C, SIGINT/SIGTERM/SIGHUP, a lost arbiter, an error, a panic's unwinding).

use std::collections::HashMap;
use std::io::Write;
use std::path::Path;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use kiwi_protocol::{
    ClientState, ClientStatus, ControlReply, ControlRequest, EventKind, GpuStatus, StatusReport,
};

use crate::control::Control;
use crate::status::{
    client_state_marked, client_where, group_lines, mib, omitted_line, pool_line, secs, swap_line,
    CKPT_LEGEND,
};

#[derive(clap::Args, Debug)]
pub struct TopArgs {
    /// Print one frame to stdout and exit (no terminal needed; for scripts).
    #[arg(long)]
    once: bool,
    /// Seconds between refreshes (0.1 to 60).
    #[arg(long, default_value = "1", value_parser = parse_interval)]
    interval: f64,
}

fn parse_interval(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if (0.1..=60.0).contains(&v) => Ok(v),
        _ => Err(format!("the interval must be 0.1 to 60 seconds, not {s:?}")),
    }
}

/// The current hold of a client, as the event log tells it.
#[derive(Debug, Clone, Copy)]
struct Hold {
    /// When the hold (or its exclusive part) began, arbiter clock.
    since_ns: u64,
    exclusive: bool,
    /// When the arbiter asked for the GPU back, if it did.
    drop_ns: Option<u64>,
}

/// Bytes per second swapped in and out over the last refresh interval.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Rate {
    in_bps: f64,
    out_bps: f64,
}

type Key = (String, u64);

/// What `top` remembers between refreshes.
#[derive(Debug, Default)]
struct Tracker {
    next_seq: u64,
    /// The arbiter's clock at the last event fetch; `None` before the first.
    last_now_ns: Option<u64>,
    holds: HashMap<Key, Hold>,
    states: HashMap<Key, ClientState>,
    /// `None` until two refreshes have been seen.
    rates: Option<HashMap<Key, Rate>>,
}

impl Tracker {
    /// One refresh: the status report, then the events logged since the last one.
    fn refresh(&mut self, ctl: &mut Control, gpu: &Option<String>) -> Result<StatusReport> {
        let report = match ctl.call(&ControlRequest::Status { gpu: gpu.clone() })? {
            ControlReply::Status(r) => r,
            other => bail!("unexpected reply from the arbiter: {other:?}"),
        };
        let (events, now_ns) = ctl.events(gpu.clone(), self.next_seq)?;
        self.fold(&report, &events, now_ns);
        Ok(report)
    }

    fn fold(&mut self, report: &StatusReport, events: &[kiwi_protocol::Event], now_ns: u64) {
        if let Some(last) = events.last() {
            self.next_seq = last.seq + 1;
        }
        let mut swapped: HashMap<Key, (u64, u64)> = HashMap::new();
        for e in events {
            let Some(id) = e.client else { continue };
            let key = (e.gpu.clone(), id);
            match &e.kind {
                EventKind::Grant { exclusive, .. } => {
                    self.holds.insert(
                        key,
                        Hold {
                            since_ns: e.t_ns,
                            exclusive: *exclusive,
                            drop_ns: None,
                        },
                    );
                }
                EventKind::Drop { .. } => {
                    if let Some(h) = self.holds.get_mut(&key) {
                        h.drop_ns.get_or_insert(e.t_ns);
                    }
                }
                EventKind::Release { .. } | EventKind::Revoke | EventKind::Exit => {
                    self.holds.remove(&key);
                }
                EventKind::SwapIn { bytes, .. } => swapped.entry(key).or_default().0 += bytes,
                EventKind::SwapOut { bytes, .. } => swapped.entry(key).or_default().1 += bytes,
                _ => {}
            }
        }
        if let Some(prev) = self.last_now_ns {
            let dt = now_ns.saturating_sub(prev).max(1) as f64 / 1e9;
            self.rates = Some(
                swapped
                    .into_iter()
                    .map(|(k, (i, o))| {
                        (
                            k,
                            Rate {
                                in_bps: i as f64 / dt,
                                out_bps: o as f64 / dt,
                            },
                        )
                    })
                    .collect(),
            );
        }
        self.last_now_ns = Some(now_ns);

        // A shared holder that becomes the exclusive one (the working sets stopped
        // fitting) starts its TQ then; the log has no event for it, so the first
        // frame that shows it holding stands in for the moment.
        let mut states = HashMap::new();
        for g in &report.gpus {
            for c in &g.clients {
                let key = (g.uuid.clone(), c.id);
                if c.state == ClientState::Holding {
                    let seen_running = self.states.get(&key) == Some(&ClientState::Running);
                    if let Some(h) = self.holds.get_mut(&key) {
                        if !h.exclusive {
                            h.exclusive = true;
                            if seen_running {
                                h.since_ns = h.since_ns.max(report.now_ns);
                            }
                        }
                    }
                }
                states.insert(key, c.state);
            }
        }
        self.states = states;
        self.holds.retain(|k, _| self.states.contains_key(k));
    }

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

    /// The frame for `report`, one entry per line.
    fn frame(&self, report: &StatusReport, live: bool) -> Vec<Line> {
        let mut out = Vec::new();
        let n_clients: usize = report.gpus.iter().map(|g| g.clients.len()).sum();
        out.push(Line::inverse(format!(
            "kiwictl top  {} GPU(s)  {} client(s){}",
            report.gpus.len(),
            n_clients,
            if live { "   q: quit" } else { "" }
        )));
        out.push(Line::plain(swap_line(report)));
        if let Some(l) = pool_line(report) {
            out.push(Line::plain(l));
        }
        if report.gpus.is_empty() {
            out.push(Line::plain(format!(
                "No GPU has clients yet. Defaults: scheduler {}, TQ {} s.",
                on_off(report.default_settings.scheduler_on),
                report.default_settings.tq_ms as f64 / 1000.0
            )));
        }
        for g in &report.gpus {
            out.push(Line::plain(String::new()));
            self.gpu_lines(g, report.now_ns, &mut out);
        }
        if let Some(l) = omitted_line(report) {
            out.push(Line::plain(l));
        }
        out
    }

    fn gpu_lines(&self, g: &GpuStatus, now_ns: u64, out: &mut Vec<Line>) {
        let resident: u64 = g.clients.iter().map(|c| c.resident_bytes).sum();
        let ws: u64 = g.clients.iter().map(|c| c.working_set_bytes).sum();
        out.push(Line::bold(format!(
            "GPU {}  {}  scheduler {}  TQ {} s  capacity {} of {}  {}",
            g.index,
            g.uuid,
            on_off(g.settings.scheduler_on),
            g.settings.tq_ms as f64 / 1000.0,
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
        out.push(Line::plain(format!(
            "  memory {}  resident {} ({}%)  working sets {} ({}% of capacity)",
            bar(resident, g.capacity_bytes, 20),
            mib(resident),
            pct(resident),
            mib(ws),
            pct(ws)
        )));
        let by_id = |id: u64| g.clients.iter().find(|c| c.id == id);
        let label = |id: u64| match by_id(id) {
            Some(c) => format!(
                "#{id} {} ({})",
                c.name.as_deref().unwrap_or("-"),
                client_where(c)
            ),
            None => format!("#{id}"),
        };
        if g.holders.is_empty() {
            out.push(Line::plain("  holder -  (the GPU is free)".into()));
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
                out.push(Line::plain(format!("  holder {}  {phrase}", label(id))));
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
        out.push(Line::plain(format!("  queue  {queue}")));
        out.push(Line::inverse(format!(
            "  {:>5} {:>7} {:<16} {:<24} {:<8} {:>9} {:>9} {:>8} {:>8} {:>9} {:>9}",
            "ID",
            "PID",
            "NAME",
            "POD / CONTAINER",
            "STATE",
            "RESIDENT",
            "SWAPPED",
            "WAITED",
            "HELD",
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
            out.push(Line::plain(format!(
                "  {:>5} {:>7} {:<16} {:<24} {:<8} {:>9} {:>9} {:>8} {:>8} {:>9} {:>9}",
                c.id,
                c.host_pid,
                cut(c.name.as_deref().unwrap_or("-"), 16),
                cut(&client_where(c), 24),
                client_state_marked(c),
                mib(c.resident_bytes),
                mib(c.swapped_bytes),
                secs(c.waited_ns),
                secs(c.held_ns),
                fmt_rate(|r| r.in_bps),
                fmt_rate(|r| r.out_bps),
            )));
        }
        if g.clients.iter().any(|c| c.checkpointed) {
            out.push(Line::plain(CKPT_LEGEND.to_string()));
        }
        for line in group_lines(g) {
            out.push(Line::plain(line));
        }
    }
}

fn on_off(on: bool) -> &'static str {
    if on {
        "on"
    } else {
        "off"
    }
}

fn cut(s: &str, n: usize) -> String {
    s.chars().take(n).collect()
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

#[derive(Debug, Clone, Copy, PartialEq)]
enum Style {
    Plain,
    Bold,
    Inverse,
}

#[derive(Debug, Clone)]
struct Line {
    text: String,
    style: Style,
}

impl Line {
    fn plain(text: String) -> Self {
        Self {
            text,
            style: Style::Plain,
        }
    }
    fn bold(text: String) -> Self {
        Self {
            text,
            style: Style::Bold,
        }
    }
    fn inverse(text: String) -> Self {
        Self {
            text,
            style: Style::Inverse,
        }
    }
}

/// The screen for `lines` on a `width` × `height` terminal: every line cut to the
/// width (so nothing wraps), no more lines than rows (so nothing scrolls).
fn draw(lines: &[Line], width: usize, height: usize) -> String {
    let mut s = String::from("\x1b[H");
    for (i, l) in lines.iter().take(height).enumerate() {
        // Names come from tenants: never send them a control character.
        let text: String = l
            .text
            .chars()
            .map(|c| if c.is_control() { '?' } else { c })
            .take(width)
            .collect();
        match l.style {
            Style::Plain => s.push_str(&text),
            Style::Bold => {
                s.push_str("\x1b[1m");
                s.push_str(&text);
                s.push_str("\x1b[0m");
            }
            Style::Inverse => {
                let pad = width.saturating_sub(text.chars().count());
                s.push_str("\x1b[7m");
                s.push_str(&text);
                s.push_str(&" ".repeat(pad));
                s.push_str("\x1b[0m");
            }
        }
        s.push_str("\x1b[K");
        if i + 1 < height {
            s.push_str("\r\n");
        }
    }
    s.push_str("\x1b[J");
    s
}

/// `kiwictl top`.
pub fn run(socket_dir: &Path, gpu: Option<String>, args: &TopArgs) -> Result<ExitCode> {
    let mut ctl = Control::connect(socket_dir)?;
    let mut tracker = Tracker::default();
    if args.once {
        let report = tracker.refresh(&mut ctl, &gpu)?;
        let mut out = String::new();
        for l in tracker.frame(&report, false) {
            out.push_str(l.text.trim_end());
            out.push('\n');
        }
        print!("{out}");
        return Ok(ExitCode::SUCCESS);
    }
    // SAFETY: isatty only inspects the descriptors.
    if unsafe { libc::isatty(0) != 1 || libc::isatty(1) != 1 } {
        bail!("kiwictl top needs a terminal on stdin and stdout (--once prints one frame)");
    }
    let term = Terminal::enter()?;
    let interval = Duration::from_secs_f64(args.interval);
    loop {
        let report = match tracker.refresh(&mut ctl, &gpu) {
            Ok(r) => r,
            Err(e) => {
                drop(term);
                return Err(e.context("lost the arbiter"));
            }
        };
        let lines = tracker.frame(&report, true);
        let (w, h) = term_size();
        {
            let mut out = std::io::stdout().lock();
            if out
                .write_all(draw(&lines, w, h).as_bytes())
                .and_then(|_| out.flush())
                .is_err()
            {
                // The terminal went away.
                return Ok(ExitCode::SUCCESS);
            }
        }
        match wait_for_key(Instant::now() + interval, &lines) {
            Wait::Quit => return Ok(ExitCode::SUCCESS),
            Wait::Refresh => {}
        }
    }
}

enum Wait {
    Quit,
    Refresh,
}

/// Waits until `deadline` for a key or a signal; redraws `lines` on a resize.
fn wait_for_key(deadline: Instant, lines: &[Line]) -> Wait {
    loop {
        if QUIT.load(Ordering::Relaxed) {
            return Wait::Quit;
        }
        if RESIZED.swap(false, Ordering::Relaxed) {
            let (w, h) = term_size();
            let mut out = std::io::stdout().lock();
            let _ = out.write_all(draw(lines, w, h).as_bytes());
            let _ = out.flush();
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Wait::Refresh;
        }
        let mut pfd = libc::pollfd {
            fd: 0,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd for the duration of the call.
        let n = unsafe { libc::poll(&mut pfd, 1, left.as_millis().clamp(1, 60_000) as i32) };
        if n <= 0 {
            continue; // timeout, or EINTR from a signal: look at the flags again
        }
        if pfd.revents & (libc::POLLHUP | libc::POLLERR | libc::POLLNVAL) != 0
            && pfd.revents & libc::POLLIN == 0
        {
            return Wait::Quit;
        }
        let mut buf = [0u8; 64];
        // SAFETY: reads at most buf.len() bytes into buf.
        let r = unsafe { libc::read(0, buf.as_mut_ptr().cast(), buf.len()) };
        if r == 0 {
            return Wait::Quit; // end of input: the terminal is gone
        }
        if r < 0 {
            continue;
        }
        // q, Q, Ctrl-C (ISIG is off, so it arrives as a byte), Ctrl-D.
        if buf[..r as usize]
            .iter()
            .any(|b| matches!(b, b'q' | b'Q' | 3 | 4))
        {
            return Wait::Quit;
        }
    }
}

static QUIT: AtomicBool = AtomicBool::new(false);
static RESIZED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(sig: libc::c_int) {
    // Only atomics here: async-signal-safe.
    if sig == libc::SIGWINCH {
        RESIZED.store(true, Ordering::Relaxed);
    } else {
        QUIT.store(true, Ordering::Relaxed);
    }
}

/// The terminal's size; 80 × 24 when it does not say.
fn term_size() -> (usize, usize) {
    // SAFETY: winsize is plain data; TIOCGWINSZ fills it in or fails.
    let mut ws: libc::winsize = unsafe { std::mem::zeroed() };
    // SAFETY: TIOCGWINSZ writes one winsize through the valid pointer.
    let ok = unsafe { libc::ioctl(1, libc::TIOCGWINSZ, &mut ws) } == 0;
    if ok && ws.ws_col > 0 && ws.ws_row > 0 {
        (ws.ws_col as usize, ws.ws_row as usize)
    } else {
        (80, 24)
    }
}

/// The terminal in raw mode on the alternate screen; restored on drop.
struct Terminal {
    saved: libc::termios,
}

impl Terminal {
    fn enter() -> Result<Self> {
        // SAFETY: termios is plain data; tcgetattr fills it in or fails.
        let mut saved: libc::termios = unsafe { std::mem::zeroed() };
        // SAFETY: fd 0 is a terminal (checked) and `saved` is a valid termios.
        if unsafe { libc::tcgetattr(0, &mut saved) } != 0 {
            return Err(std::io::Error::last_os_error()).context("reading the terminal's mode");
        }
        let mut raw = saved;
        // Keys arrive one at a time, unechoed; Ctrl-C is a byte, not a signal.
        raw.c_lflag &= !(libc::ICANON | libc::ECHO | libc::ISIG | libc::IEXTEN);
        raw.c_iflag &= !(libc::IXON | libc::ICRNL);
        raw.c_cc[libc::VMIN] = 1;
        raw.c_cc[libc::VTIME] = 0;
        // SAFETY: a valid termios for fd 0.
        if unsafe { libc::tcsetattr(0, libc::TCSAFLUSH, &raw) } != 0 {
            return Err(std::io::Error::last_os_error()).context("setting the terminal's mode");
        }
        let term = Terminal { saved };
        for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP, libc::SIGWINCH] {
            // SAFETY: a zeroed sigaction with an empty mask and no flags (no
            // SA_RESTART, so poll returns EINTR) and a handler that only stores atomics.
            unsafe {
                let mut sa: libc::sigaction = std::mem::zeroed();
                sa.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as usize;
                libc::sigemptyset(&mut sa.sa_mask);
                libc::sigaction(sig, &sa, std::ptr::null_mut());
            }
        }
        let mut out = std::io::stdout().lock();
        // Alternate screen, cursor hidden, screen cleared.
        out.write_all(b"\x1b[?1049h\x1b[?25l\x1b[H\x1b[2J")
            .and_then(|_| out.flush())
            .context("writing to the terminal")?;
        Ok(term)
    }
}

impl Drop for Terminal {
    fn drop(&mut self) {
        let mut out = std::io::stdout().lock();
        let _ = out.write_all(b"\x1b[0m\x1b[?25h\x1b[?1049l");
        let _ = out.flush();
        // SAFETY: restores the termios read from fd 0 in `enter`.
        unsafe { libc::tcsetattr(0, libc::TCSAFLUSH, &self.saved) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiwi_protocol::Event;

    /// A report through serde, so fields added to the protocol later (with
    /// defaults) do not break these tests.
    fn report(now_ns: u64, queue: &[u64], fits: bool) -> StatusReport {
        let client = |id: u64, state: &str, res: u64, ws: u64| {
            serde_json::json!({
                "id": id, "pid": 100 + id, "host_pid": 200 + id,
                "name": format!("nb-{id}"), "container_id": null,
                "pod_name": "pod", "pod_namespace": "team", "state": state,
                "working_set_bytes": ws, "resident_bytes": res,
                "swapped_bytes": ws - res, "waited_ns": 0, "held_ns": 3_000_000_000u64
            })
        };
        serde_json::from_value(serde_json::json!({
            "default_settings": {"scheduler_on": true, "tq_ms": 10_000},
            "now_ns": now_ns,
            "gpus": [{
                "index": 0, "uuid": "GPU-x",
                "settings": {"scheduler_on": true, "tq_ms": 10_000},
                "total_memory_bytes": 1u64 << 30, "capacity_bytes": 1000u64 << 20,
                "fits": fits, "holders": [1], "queue": queue,
                "clients": [client(1, "holding", 700 << 20, 700 << 20),
                            client(2, if queue.is_empty() { "idle" } else { "waiting" }, 0, 700 << 20)]
            }]
        }))
        .unwrap()
    }

    fn ev(seq: u64, t_ns: u64, client: u64, kind: EventKind) -> Event {
        Event {
            seq,
            t_ns,
            gpu: "GPU-x".into(),
            client: Some(client),
            kind,
        }
    }

    fn text(t: &Tracker, r: &StatusReport) -> String {
        t.frame(r, false)
            .iter()
            .map(|l| l.text.clone() + "\n")
            .collect()
    }

    #[test]
    fn time_left_counts_from_the_grant_when_someone_waits() {
        let mut t = Tracker::default();
        let grant = ev(
            1,
            1_000_000_000,
            1,
            EventKind::Grant {
                exclusive: true,
                waited_ns: 0,
            },
        );
        let r = report(5_000_000_000, &[2], false);
        t.fold(&r, &[grant], 5_000_000_000);
        let s = text(&t, &r);
        assert!(s.contains("holder #1 nb-1 (team/pod)"), "{s}");
        assert!(s.contains("~6.0s left of its TQ, 1 waiting"), "{s}");
        assert!(s.contains("queue  1. #2 nb-2 (team/pod)"), "{s}");
        assert!(
            s.contains("working sets 1400 MiB (140% of capacity)"),
            "{s}"
        );

        // Nobody waits: no TQ runs.
        let r = report(6_000_000_000, &[], false);
        t.fold(&r, &[], 6_000_000_000);
        assert!(text(&t, &r).contains("no one waits"));

        // Asked to give it back.
        let r = report(12_000_000_000, &[2], false);
        let drop = ev(
            2,
            11_000_000_000,
            1,
            EventKind::Drop {
                need_bytes: 1,
                reason: kiwi_protocol::DropReason::TqExpired,
            },
        );
        t.fold(&r, &[drop], 12_000_000_000);
        assert!(text(&t, &r).contains("TQ over: giving the GPU back"));
    }

    #[test]
    fn swap_rates_come_from_the_events_between_two_refreshes() {
        let mut t = Tracker::default();
        let r = report(1, &[], false);
        t.fold(&r, &[], 1_000_000_000);
        // One refresh: no interval yet, so no rate.
        let s = text(&t, &r);
        let row = s
            .lines()
            .find(|l| l.trim_start().starts_with("1 "))
            .unwrap();
        let tail: Vec<&str> = row.split_whitespace().rev().take(2).collect();
        assert_eq!(tail, ["-", "-"], "{s}");
        let swaps = [
            ev(
                5,
                1_500_000_000,
                1,
                EventKind::SwapOut {
                    bytes: 100 << 20,
                    duration_ns: 1,
                },
            ),
            ev(
                6,
                1_600_000_000,
                2,
                EventKind::SwapIn {
                    bytes: 50 << 20,
                    duration_ns: 1,
                },
            ),
        ];
        t.fold(&r, &swaps, 3_000_000_000);
        assert_eq!(t.next_seq, 7);
        let s = text(&t, &r);
        let row = |id: &str| {
            s.lines()
                .find(|l| l.split_whitespace().next() == Some(id))
                .unwrap()
                .to_string()
        };
        assert!(row("1").trim_end().ends_with("0.0      50.0"), "{s}");
        assert!(row("2").trim_end().ends_with("25.0       0.0"), "{s}");
    }

    #[test]
    fn group_members_are_marked_and_the_gpus_turn_says_whose_it_is() {
        let t = Tracker::default();
        let mut r = report(1, &[2], false);
        assert!(!text(&t, &r).contains("group"));
        r.gpus[0].clients[0].group = Some("uid 0 / train".into());
        r.gpus[0].group_turn = Some(kiwi_protocol::GroupTurn {
            group: "uid 0 / train".into(),
            running: true,
        });
        for s in [text(&t, &r), crate::status::render(&r)] {
            let row = s
                .lines()
                .find(|l| l.split_whitespace().next() == Some("1"))
                .unwrap();
            assert!(row.contains("holding*"), "{s}");
            assert!(
                s.contains("turn reserved for group uid 0 / train: its turn runs on all its GPUs"),
                "{s}"
            );
            assert!(
                s.contains("* group uid 0 / train (clients 1 here): granted together"),
                "{s}"
            );
        }
    }

    #[test]
    fn a_checkpointed_client_says_so_and_the_legend_says_what_it_means() {
        let t = Tracker::default();
        let mut r = report(1, &[2], false);
        assert!(!text(&t, &r).contains("ckpt"));
        r.gpus[0].clients[1].checkpointed = true;
        let s = text(&t, &r);
        let row = s
            .lines()
            .find(|l| l.split_whitespace().next() == Some("2"))
            .unwrap();
        assert!(row.contains("wait+ck"), "{s}");
        assert!(s.contains("ckpt: the whole process is checkpointed"), "{s}");
        assert!(crate::status::render(&r).contains("wait+ck"));
    }

    #[test]
    fn a_tiny_terminal_gets_a_cut_frame() {
        let t = Tracker::default();
        let lines = t.frame(&report(1, &[2], false), true);
        for (w, h) in [(1, 1), (5, 2), (0, 0), (200, 100)] {
            let s = draw(&lines, w, h);
            let rows: Vec<&str> = s.split("\r\n").collect();
            assert!(rows.len() <= h.max(1), "{w}x{h}: {s:?}");
            for r in rows {
                let visible: String = strip_ansi(r);
                assert!(visible.chars().count() <= w, "{w}x{h}: {r:?}");
            }
        }
    }

    fn strip_ansi(s: &str) -> String {
        let mut out = String::new();
        let mut it = s.chars();
        while let Some(c) = it.next() {
            if c == '\x1b' {
                for d in it.by_ref() {
                    if d.is_ascii_alphabetic() {
                        break;
                    }
                }
            } else {
                out.push(c);
            }
        }
        out
    }
}
