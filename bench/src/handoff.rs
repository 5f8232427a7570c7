//! `handoff`: N real client processes contend for one GPU whose working sets do not
//! fit together. Measures the hand-off latency (holder's release sent → next
//! holder's grant received, both on CLOCK_MONOTONIC) against the raw round trip of
//! a bare Unix-socket ping-pong between two processes, measured in the same run.
//! Also `idle`: what 256 connected idle clients cost the arbiter.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use kiwi_protocol::blocking::Connection;
use kiwi_protocol::{ArbiterMsg, ClientMsg, Usage};

use crate::procs::{self, cpu_seconds, monotonic_ns, registration, rss_bytes, ArbiterProc};
use crate::report::{percentile, Figure};

const GPU_TOTAL: u64 = 16 << 30;

fn register(socket: &Path, ws: u64) -> Result<Connection<ClientMsg, ArbiterMsg>> {
    let reg = registration("GPU-bench-0000".into(), GPU_TOTAL, ws, "kiwi-bench");
    let (c, _) = procs::register(socket, Duration::from_secs(30), reg, "registration refused")?;
    Ok(c)
}

/// Client role: `rounds` times request, on grant note the time, release at once,
/// idle a moment.
/// Prints `G <t_ns>` and `R <t_ns>` lines.
pub fn client_role(socket: &Path, rounds: u32, start_fd_wait: bool) -> Result<()> {
    let ws = GPU_TOTAL * 6 / 10;
    let mut c = register(socket, ws)?;
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    if start_fd_wait {
        // Wait for the go signal so every client starts contending together.
        let mut line = String::new();
        std::io::stdin().read_line(&mut line)?;
    }
    let usage = Usage {
        working_set_bytes: ws,
        resident_bytes: 0,
    };
    let mut times = Vec::with_capacity(rounds as usize * 3);
    for _ in 0..rounds {
        let requested = monotonic_ns();
        c.send(&ClientMsg::Request)?;
        loop {
            match c.recv()? {
                ArbiterMsg::Grant { .. } => break,
                ArbiterMsg::Drop { .. } | ArbiterMsg::Reclaim { .. } => {}
                _ => {}
            }
        }
        let granted = monotonic_ns();
        let released = monotonic_ns();
        c.send(&ClientMsg::Release(usage))?;
        times.push((requested, granted, released));
        // An application that gives the GPU back early is idle: it sleeps a little
        // before it wants the GPU again (and leaves the CPU to the next holder).
        std::thread::sleep(Duration::from_micros(300));
    }
    for (q, g, r) in times {
        writeln!(out, "Q {q}")?;
        writeln!(out, "G {g}")?;
        writeln!(out, "R {r}")?;
    }
    out.flush()?;
    Ok(())
}

/// Echo role for the baseline: answers every 8-byte message on `socket`.
pub fn echo_role(socket: &Path) -> Result<()> {
    let l = UnixListener::bind(socket)?;
    println!("ready");
    std::io::stdout().flush()?;
    let (mut s, _) = l.accept()?;
    let mut buf = [0u8; 8];
    while s.read_exact(&mut buf).is_ok() {
        s.write_all(&buf)?;
    }
    Ok(())
}

/// Raw Unix-socket round trips between this process and a child, in µs.
fn raw_round_trips(n: usize) -> Result<Vec<f64>> {
    let dir = tempfile::tempdir()?;
    let sock = dir.path().join("echo.sock");
    let mut child = Command::new(std::env::current_exe()?)
        .arg("__echo")
        .arg("--socket")
        .arg(&sock)
        .stdout(Stdio::piped())
        .spawn()?;
    let mut ready = String::new();
    BufReader::new(child.stdout.take().context("stdout")?).read_line(&mut ready)?;
    let mut s = UnixStream::connect(&sock)?;
    let mut buf = [0u8; 8];
    let mut rtts = Vec::with_capacity(n);
    for i in 0..n + n / 10 {
        let t0 = monotonic_ns();
        s.write_all(&(i as u64).to_le_bytes())?;
        s.read_exact(&mut buf)?;
        if i >= n / 10 {
            rtts.push((monotonic_ns() - t0) as f64 / 1e3);
        }
    }
    drop(s);
    let _ = child.kill();
    let _ = child.wait();
    Ok(rtts)
}

/// Runs the handoff benchmark with `clients` processes and `rounds` grants each.
pub fn run(clients: usize, rounds: u32) -> Result<Vec<Figure>> {
    if clients < 2 {
        bail!("--clients must be at least 2 (a hand-off needs someone to hand to)");
    }
    let arb = ArbiterProc::start(30.0, &[])?;
    let mut children = Vec::new();
    for _ in 0..clients {
        let child = Command::new(std::env::current_exe()?)
            .arg("__handoff-client")
            .arg("--socket")
            .arg(arb.client_socket())
            .arg("--rounds")
            .arg(rounds.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()?;
        children.push(child);
    }
    // Let every client register, then start them together.
    std::thread::sleep(Duration::from_millis(200));
    for c in &mut children {
        c.stdin.take().context("stdin")?.write_all(b"go\n")?;
    }
    // (t, client, kind): kind 0 = request, 1 = grant, 2 = release.
    let mut events: Vec<(u64, usize, u8)> = Vec::new();
    for (i, c) in children.into_iter().enumerate() {
        let out = c.wait_with_output()?;
        if !out.status.success() {
            bail!(
                "a handoff client failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            let mut it = line.split_whitespace();
            let kind = match it.next() {
                Some("Q") => 0,
                Some("G") => 1,
                _ => 2,
            };
            let t: u64 = it.next().context("bad line")?.parse()?;
            events.push((t, i, kind));
        }
    }
    events.sort();
    // A hand-off: a grant to a client that was already waiting when the previous
    // holder released. (A grant to a client that asked after the release is no
    // hand-off: nobody was waiting.)
    let mut handoffs = Vec::new();
    let mut last_release = None;
    let mut requested_at = vec![0u64; clients];
    for (t, client, kind) in events {
        match kind {
            0 => requested_at[client] = t,
            1 => {
                if let Some(r) = last_release.take() {
                    if requested_at[client] < r {
                        handoffs.push((t - r) as f64 / 1e3);
                    }
                }
            }
            _ => last_release = Some(t),
        }
    }
    // The arbiter's own request/answer path, for reference: ping → pong.
    let mut pings = {
        let mut c = register(&arb.client_socket(), 1 << 20)?;
        let mut v = Vec::with_capacity(2000);
        for token in 0..2200u64 {
            let t0 = monotonic_ns();
            c.send(&ClientMsg::Ping { token })?;
            while !matches!(c.recv()?, ArbiterMsg::Pong { .. }) {}
            if token >= 200 {
                v.push((monotonic_ns() - t0) as f64 / 1e3);
            }
        }
        v
    };
    drop(arb);
    let mut rtt = raw_round_trips(handoffs.len().max(2000))?;
    let (h50, h99) = (
        percentile(&mut handoffs, 50.0),
        percentile(&mut handoffs, 99.0),
    );
    let (r50, r99) = (percentile(&mut rtt, 50.0), percentile(&mut rtt, 99.0));
    let base = "raw unix-socket round trip";
    let scen = format!("handoff/{clients}");
    Ok(vec![
        Figure::new(&scen, "handoff_p50", h50, "us").against(r50, base),
        Figure::new(&scen, "handoff_p99", h99, "us")
            .against(r99, base)
            .goal("<= 3x raw round trip and < 100 us (8 clients)"),
        Figure::new(
            &scen,
            "arbiter_ping_p50",
            percentile(&mut pings, 50.0),
            "us",
        )
        .against(r50, base),
        Figure::new(&scen, "handoffs_measured", handoffs.len() as f64, "n"),
    ])
}

/// 256 registered, idle clients: the arbiter's RSS and CPU while they sit there.
pub fn idle(clients: usize, watch: Duration) -> Result<Vec<Figure>> {
    let arb = ArbiterProc::start(30.0, &[])?;
    std::thread::sleep(Duration::from_millis(200));
    let rss0 = rss_bytes(arb.pid())?;
    let mut conns = Vec::with_capacity(clients);
    for _ in 0..clients {
        conns.push(register(&arb.client_socket(), 1 << 20)?);
    }
    std::thread::sleep(Duration::from_millis(300));
    let cpu0 = cpu_seconds(arb.pid())?;
    std::thread::sleep(watch);
    let cpu1 = cpu_seconds(arb.pid())?;
    let rss1 = rss_bytes(arb.pid())?;
    drop(conns);
    let mb = |b: u64| b as f64 / (1u64 << 20) as f64;
    let scen = format!("idle/{clients}");
    Ok(vec![
        Figure::new(&scen, "arbiter_rss", mb(rss1), "MiB")
            .against(mb(rss0), "arbiter with no client")
            .goal("< 30 MB"),
        Figure::new(
            &scen,
            "arbiter_cpu",
            100.0 * (cpu1 - cpu0) / watch.as_secs_f64(),
            "%",
        )
        .goal("no measurable CPU (clock tick = 10 ms)"),
    ])
}
