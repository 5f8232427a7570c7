//! The terminal while `top` runs, through crossterm: raw mode (keys arrive one at a
//! time, unechoed; Ctrl-C is a key, not a signal), the alternate screen, a hidden
//! cursor, and a ratatui terminal drawing on it. Every way out gives the terminal back
//! as it was: dropping the [`Session`] (`q`, Ctrl-C, a lost arbiter, an error, a
//! panic's unwinding), the panic hook (before the message prints, so it lands on the
//! normal screen), and SIGINT/SIGTERM/SIGHUP. Knows nothing of what is drawn.

use std::io::{self, IsTerminal, Stdout};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Once;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use crossterm::event::{self, Event, KeyCode, KeyEvent, KeyEventKind, KeyModifiers};
use crossterm::style::{Attribute, SetAttribute};
use crossterm::terminal::{self, ClearType};
use crossterm::{cursor, execute};
use ratatui::backend::CrosstermBackend;
use ratatui::text::Line;
use ratatui::Terminal;
use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
use signal_hook::iterator::{Handle, Signals};

use super::view::Screen;

/// The longest `wait` blocks in crossterm before it looks at [`QUIT`] again: crossterm
/// resumes its poll after a signal interrupts it, so the flag is read between slices.
const SLICE: Duration = Duration::from_millis(100);

/// How long after a signal the main loop has to give the terminal back itself before
/// the signal thread does it and ends the process (the loop may be stuck reading a
/// terminal that hung up).
const GRACE: Duration = Duration::from_secs(1);

/// Raw mode and the alternate screen are on. Every way out swaps it to false, so the
/// terminal is restored exactly once whichever gets there first.
static ACTIVE: AtomicBool = AtomicBool::new(false);
/// A signal asked `top` to end.
static QUIT: AtomicBool = AtomicBool::new(false);

/// Whether stdin and stdout are both terminals, as the live view needs.
pub(super) fn is_interactive() -> bool {
    io::stdin().is_terminal() && io::stdout().is_terminal()
}

/// What ended a [`Session::wait`].
pub(super) enum Wait {
    /// A quit key, a signal, or the terminal gone.
    Quit,
    /// The refresh deadline passed.
    Refresh,
    /// The window changed size: draw the same frame again.
    Resized,
}

/// The terminal in raw mode on the alternate screen; restored on drop.
pub(super) struct Session {
    terminal: Terminal<CrosstermBackend<Stdout>>,
    signals: Handle,
    // Last: dropped after the ratatui terminal has shown the cursor.
    _restore: Restore,
}

impl Session {
    pub(super) fn enter() -> Result<Self> {
        install_panic_hook();
        let signals = watch_signals()?;
        terminal::enable_raw_mode().context("setting the terminal's mode")?;
        ACTIVE.store(true, Ordering::SeqCst);
        let restore = Restore;
        execute!(
            io::stdout(),
            terminal::EnterAlternateScreen,
            cursor::Hide,
            terminal::Clear(ClearType::All)
        )
        .context("writing to the terminal")?;
        let terminal =
            Terminal::new(CrosstermBackend::new(io::stdout())).context("reading the terminal")?;
        Ok(Session {
            terminal,
            signals,
            _restore: restore,
        })
    }

    /// Draws `lines` on the whole window. An error means the terminal went away.
    pub(super) fn draw(&mut self, lines: &[Line<'_>]) -> io::Result<()> {
        self.terminal
            .draw(|f| f.render_widget(Screen(lines), f.area()))
            .map(drop)
    }

    /// Waits until `deadline` for a quit key, a signal or a resize.
    pub(super) fn wait(&self, deadline: Instant) -> Wait {
        loop {
            if QUIT.load(Ordering::SeqCst) {
                return Wait::Quit;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Wait::Refresh;
            }
            match event::poll(left.min(SLICE)) {
                Ok(false) => {}
                Ok(true) => match event::read() {
                    Ok(Event::Key(k)) if is_quit(&k) => return Wait::Quit,
                    Ok(Event::Resize(..)) => return Wait::Resized,
                    Ok(_) => {}
                    Err(_) => return Wait::Quit,
                },
                // The terminal is gone.
                Err(_) => return Wait::Quit,
            }
        }
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        self.signals.close();
    }
}

/// q, Q, Ctrl-C, Ctrl-D.
fn is_quit(k: &KeyEvent) -> bool {
    k.kind != KeyEventKind::Release
        && match k.code {
            KeyCode::Char('q' | 'Q') => true,
            KeyCode::Char('c' | 'd') => k.modifiers.contains(KeyModifiers::CONTROL),
            _ => false,
        }
}

/// Gives the terminal back on drop.
struct Restore;

impl Drop for Restore {
    fn drop(&mut self) {
        restore();
    }
}

/// Attributes reset, cursor shown, the normal screen back, the terminal's own mode
/// back; once, however many ways out get here.
fn restore() {
    if ACTIVE.swap(false, Ordering::SeqCst) {
        let _ = execute!(
            io::stdout(),
            SetAttribute(Attribute::Reset),
            cursor::Show,
            terminal::LeaveAlternateScreen
        );
        let _ = terminal::disable_raw_mode();
    }
}

/// Restores the terminal before the panic message prints, then prints it as before.
fn install_panic_hook() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            restore();
            previous(info);
        }));
    });
}

/// SIGINT, SIGTERM and SIGHUP set [`QUIT`]; the main loop sees it within a [`SLICE`]
/// and leaves through [`Session`]'s drop. If it has not within [`GRACE`] (crossterm
/// can spin reading a terminal that hung up), this thread restores the terminal and
/// ends the process, with status 0 as for `q`.
fn watch_signals() -> Result<Handle> {
    let mut signals = Signals::new([SIGINT, SIGTERM, SIGHUP]).context("catching signals")?;
    let handle = signals.handle();
    std::thread::Builder::new()
        .name("top-signals".into())
        .spawn(move || {
            if signals.forever().next().is_some() {
                QUIT.store(true, Ordering::SeqCst);
                std::thread::sleep(GRACE);
                restore();
                std::process::exit(0);
            }
        })
        .context("starting the signal thread")?;
    Ok(handle)
}
