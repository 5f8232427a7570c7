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
//! [`tracker`] folds the refreshes; [`view`] turns a report into the frame's lines
//! and lays them out with ratatui; [`term`] owns the terminal (crossterm) while the
//! live view runs and gives it back on every way out. `--once` prints the same
//! lines as plain text and touches no terminal.

mod term;
mod tracker;
mod view;

#[cfg(test)]
mod tests;

use std::path::Path;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};

use crate::control::Control;
use term::{Session, Wait};
use tracker::Tracker;

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

/// `kiwictl top`.
pub fn run(socket_dir: &Path, gpu: Option<String>, args: &TopArgs) -> Result<ExitCode> {
    let mut ctl = Control::connect(socket_dir)?;
    let mut tracker = Tracker::default();
    if args.once {
        let report = tracker.refresh(&mut ctl, &gpu)?;
        let mut out = String::new();
        for l in tracker.frame(&report, false) {
            out.push_str(l.to_string().trim_end());
            out.push('\n');
        }
        print!("{out}");
        return Ok(ExitCode::SUCCESS);
    }
    if !term::is_interactive() {
        bail!("kiwictl top needs a terminal on stdin and stdout (--once prints one frame)");
    }
    let mut session = Session::enter()?;
    let interval = Duration::from_secs_f64(args.interval);
    loop {
        let report = match tracker.refresh(&mut ctl, &gpu) {
            Ok(r) => r,
            Err(e) => {
                // Give the terminal back first: the error prints on the normal screen.
                drop(session);
                return Err(e.context("lost the arbiter"));
            }
        };
        let lines = tracker.frame(&report, true);
        let deadline = Instant::now() + interval;
        loop {
            if session.draw(&lines).is_err() {
                // The terminal went away.
                return Ok(ExitCode::SUCCESS);
            }
            match session.wait(deadline) {
                Wait::Quit => return Ok(ExitCode::SUCCESS),
                Wait::Refresh => break,
                Wait::Resized => {}
            }
        }
    }
}
