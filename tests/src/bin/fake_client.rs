//! `kiwi-fake-client`: a real process that speaks the client protocol the way the
//! shim does, for fault tests (SIGKILL, stubborn holders, arbiter restarts).
//! Prints one line per event it sees: `REGISTERED id`, `GRANTED t_ns exclusive`,
//! `DROP t_ns need`, `RELEASED t_ns`, `REVOKED t_ns`, `RESUMED id`.

use std::io::Write;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use clap::Parser;
use kiwi_protocol::blocking::Connection;
use kiwi_protocol::{ArbiterMsg, ClientMsg, Resume, Usage};
use kiwi_tests::{monotonic_ns, register_msg};

#[derive(Parser)]
struct Args {
    #[arg(long)]
    socket: PathBuf,
    #[arg(long, default_value = "GPU-fake-0")]
    gpu: String,
    #[arg(long, default_value_t = 1 << 30)]
    total: u64,
    #[arg(long)]
    ws: u64,
    /// Ask for the GPU right after registering.
    #[arg(long)]
    request: bool,
    /// Ignore drops (a misbehaving holder).
    #[arg(long)]
    stubborn: bool,
    /// Release on its own this long after each grant (0: hold until dropped).
    #[arg(long, default_value_t = 0)]
    hold_ms: u64,
    /// Reconnect and re-register when the arbiter goes away.
    #[arg(long)]
    reconnect: bool,
}

fn say(s: String) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{s}");
    let _ = out.flush();
}

fn main() {
    let a = Args::parse();
    let mut holding = false;
    let mut waiting = false;
    let mut resume: Option<Resume> = None;
    loop {
        let mut conn: Connection<ClientMsg, ArbiterMsg> = match Connection::connect(&a.socket) {
            Ok(c) => c,
            Err(_) if a.reconnect => {
                std::thread::sleep(Duration::from_millis(20));
                continue;
            }
            Err(e) => {
                say(format!("ERROR connect {e}"));
                std::process::exit(1);
            }
        };
        let mut reg = register_msg(&a.gpu, a.total, a.ws);
        reg.resident_bytes = if holding { a.ws } else { 0 };
        reg.resume = resume;
        // A refusal at accept may close the connection before the registration is
        // sent: without `--reconnect`, its answer is still there to read.
        if conn.send(&ClientMsg::Register(reg)).is_err() && a.reconnect {
            continue;
        }
        let mut release_at: Option<Instant> = None;
        let mut first = true;
        loop {
            let timeout = release_at
                .map(|t| t.saturating_duration_since(Instant::now()))
                .unwrap_or(Duration::from_secs(3600));
            let msg = match conn.recv_timeout(timeout) {
                Ok(Some(m)) => m,
                Ok(None) => {
                    // Our own hold time is over: release early.
                    release_at = None;
                    holding = false;
                    let _ = conn.send(&ClientMsg::Release(Usage {
                        working_set_bytes: a.ws,
                        resident_bytes: a.ws,
                    }));
                    say(format!("RELEASED {}", monotonic_ns()));
                    continue;
                }
                Err(_) => break,
            };
            match msg {
                ArbiterMsg::Registered { client_id, .. } => {
                    say(format!(
                        "{} {client_id}",
                        if resume.is_some() {
                            "RESUMED"
                        } else {
                            "REGISTERED"
                        }
                    ));
                    if first && a.request && resume.is_none() {
                        waiting = true;
                        let _ = conn.send(&ClientMsg::Request);
                    }
                    first = false;
                }
                ArbiterMsg::Grant { exclusive, .. } => {
                    let t = monotonic_ns();
                    holding = true;
                    waiting = false;
                    say(format!("GRANTED {t} {exclusive}"));
                    let _ = conn.send(&ClientMsg::Usage(Usage {
                        working_set_bytes: a.ws,
                        resident_bytes: a.ws,
                    }));
                    if a.hold_ms > 0 {
                        release_at = Some(Instant::now() + Duration::from_millis(a.hold_ms));
                    }
                }
                ArbiterMsg::Drop { need_bytes, .. } => {
                    say(format!("DROP {} {need_bytes}", monotonic_ns()));
                    if !a.stubborn {
                        holding = false;
                        release_at = None;
                        let _ = conn.send(&ClientMsg::Release(Usage {
                            working_set_bytes: a.ws,
                            resident_bytes: a.ws.saturating_sub(need_bytes),
                        }));
                        say(format!("RELEASED {}", monotonic_ns()));
                    }
                }
                ArbiterMsg::Reclaim { need_bytes } => {
                    let _ = conn.send(&ClientMsg::Reclaimed(Usage {
                        working_set_bytes: a.ws,
                        resident_bytes: a.ws.saturating_sub(need_bytes),
                    }));
                }
                ArbiterMsg::Revoked { .. } => {
                    holding = false;
                    say(format!("REVOKED {}", monotonic_ns()));
                }
                ArbiterMsg::Error { message, .. } => say(format!("ERROR {message}")),
                _ => {}
            }
        }
        if !a.reconnect {
            say("CLOSED".into());
            return;
        }
        say("LOST".into());
        resume = Some(Resume { holding, waiting });
    }
}
