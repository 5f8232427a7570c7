//! `kiwictl demo`: the seed's two-notebook story, run for real.
//!
//! Starts a private `kiwi-arbiter` and a simulated GPU (or uses the real one with
//! `--gpu`), runs two `gpuburst` "notebooks" under the shim with scripted CPU, idle
//! and GPU phases, and draws what happened: lanes from the arbiter's event log,
//! refined with the simulator's kernel trace and the programs' own phase reports.
//!
//! Everything it needs comes from the workspace build next to this executable:
//! `kiwi-arbiter`, `gpuburst`, `libkiwi.so` and the simulator's libraries.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use kiwi_protocol::{ClientState, ControlReply, ControlRequest, Event, EventKind};

use crate::control::Control;
use crate::timeline::{self, svg, term};

/// Which story to tell.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scenario {
    /// The seed's: the working sets do not fit, so the apps take turns.
    Oversub,
    /// The working sets fit: both run side by side and never wait.
    Fit,
}

#[derive(clap::Args, Debug, Clone)]
pub struct DemoArgs {
    /// `oversub` (the seed's timeline) or `fit` (nobody waits).
    #[arg(long, value_enum, default_value = "oversub")]
    scenario: Scenario,
    /// Time quantum in seconds.
    #[arg(long, default_value = "3")]
    tq: kiwi_config::Quantum,
    /// GPU memory of each notebook (default: 700MiB when oversubscribed, 400MiB when
    /// they fit, scaled to the GPU).
    #[arg(long)]
    mem: Option<String>,
    /// Memory of the simulated GPU.
    #[arg(long, default_value = "1GiB")]
    gpu_mem: String,
    /// Where to write the picture.
    #[arg(long, default_value = "kiwi-timeline.svg")]
    svg: PathBuf,
    /// Run on this machine's real NVIDIA GPU instead of the simulator.
    #[arg(long)]
    gpu: bool,
    /// Width of the terminal picture (default: the terminal's).
    #[arg(long)]
    width: Option<usize>,
    /// Keep the run's files (arbiter log, event log, kernel trace) and say where.
    #[arg(long)]
    keep: bool,
}

/// The built workspace: where the demo's programs are.
struct Build {
    arbiter: PathBuf,
    gpuburst: PathBuf,
    shim: PathBuf,
    sim_dir: Option<PathBuf>,
}

fn find_build(real_gpu: bool) -> Result<Build> {
    let exe = std::env::current_exe().context("cannot find kiwictl's own path")?;
    let dir = exe
        .parent()
        .context("kiwictl has no directory")?
        .to_path_buf();
    let need = |name: &str| -> Result<PathBuf> {
        let p = dir.join(name);
        if p.exists() {
            Ok(p)
        } else {
            bail!(
                "{} is missing: build the workspace first (`cargo build --release`), then run {}",
                p.display(),
                exe.display()
            )
        }
    };
    let arbiter = need("kiwi-arbiter")?;
    let gpuburst = need("gpuburst")?;
    let shim = need("libkiwi.so")?;
    let sim_dir = if real_gpu {
        None
    } else {
        need("libkiwi_sim_cuda.so")?;
        Some(
            kiwi_sim_core::ensure_sim_dir(&dir)
                .context("cannot set up the simulator's libraries")?,
        )
    };
    Ok(Build {
        arbiter,
        gpuburst,
        shim,
        sim_dir,
    })
}

/// One notebook's script: the seed's story with a TQ of `tq` seconds.
struct Notebook {
    label: &'static str,
    script: String,
}

fn scripts(tq_ms: u64) -> [Notebook; 2] {
    // A: CPU work (T0–T1), a GPU burst longer than TQ, CPU, a short burst.
    // B: idle, a GPU burst shorter than TQ that starts while A holds (T2), a long CPU
    // phase, a short burst while A is on the CPU, so after T4 nobody waits.
    let t = |x: f64| ((x * tq_ms as f64) as u64).max(1);
    let a = format!(
        "cpu:{},gpu:{},cpu:{},gpu:{}",
        t(0.5),
        t(5.0 / 3.0),
        t(2.0 / 3.0),
        t(0.2)
    );
    let b = format!(
        "idle:{},gpu:{},cpu:{},gpu:{},idle:{}",
        t(5.0 / 6.0),
        t(0.5),
        t(1.0),
        t(0.2),
        t(0.1)
    );
    [
        Notebook {
            label: "A",
            script: a,
        },
        Notebook {
            label: "B",
            script: b,
        },
    ]
}

struct Running {
    label: &'static str,
    child: Child,
    out: std::sync::mpsc::Receiver<String>,
    lines: Vec<String>,
}

/// Kills what is left on the way out, whatever happened.
struct Cleanup {
    children: Vec<Child>,
    sim_name: Option<String>,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        for c in &mut self.children {
            // SAFETY: kill(2) on a child we spawned; SIGTERM lets the arbiter clean up.
            unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
        }
        for c in &mut self.children {
            let deadline = Instant::now() + Duration::from_secs(2);
            while Instant::now() < deadline {
                if matches!(c.try_wait(), Ok(Some(_))) {
                    break;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
        if let Some(name) = &self.sim_name {
            let _ = kiwi_sim_core::machine::reset(name);
        }
    }
}

pub fn run(args: &DemoArgs) -> Result<ExitCode> {
    let build = find_build(args.gpu)?;
    let tq_ms = args.tq.as_millis();
    let gpu_mem = kiwi_config::parse_size(&args.gpu_mem).map_err(anyhow::Error::msg)?;
    let mem = match &args.mem {
        Some(m) => kiwi_config::parse_size(m).map_err(anyhow::Error::msg)?,
        None => match args.scenario {
            Scenario::Oversub => gpu_mem / 1024 * 700,
            Scenario::Fit => gpu_mem / 1024 * 400,
        },
    };
    if mem == 0 || mem > gpu_mem {
        bail!(
            "--mem must be between 1 byte and the GPU's memory ({})",
            timeline::fmt_bytes(gpu_mem)
        );
    }
    let tmp = tempfile::Builder::new()
        .prefix("kiwi-demo")
        .tempdir()
        .context("cannot create a temporary directory")?;
    let socket_dir = tmp.path().join("sock");
    let trace = tmp.path().join("kernels.trace");
    let sim_name = format!("kiwi-demo-{}", std::process::id());
    let mut cleanup = Cleanup {
        children: Vec::new(),
        sim_name: build.sim_dir.as_ref().map(|_| sim_name.clone()),
    };

    // The arbiter, on a private socket directory.
    let arb_log = std::fs::File::create(tmp.path().join("arbiter.log"))?;
    let arbiter = Command::new(&build.arbiter)
        .arg("--socket-dir")
        .arg(&socket_dir)
        .arg("--tq")
        .arg(args.tq.to_string())
        .arg("--grace-ms")
        .arg("2000")
        // The simulated GPU is unknown to a real node's NVML; on a real GPU the
        // arbiter checks registrations against it as in production.
        .arg("--nvml")
        .arg(if build.sim_dir.is_some() {
            "off"
        } else {
            "auto"
        })
        .env_remove("KIWI_CONFIG")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(arb_log)
        .spawn()
        .context("cannot start kiwi-arbiter")?;
    cleanup.children.push(arbiter);
    let client_sock = kiwi_config::client_socket(&socket_dir);
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::os::unix::net::UnixStream::connect(&client_sock).is_err() {
        if Instant::now() > deadline {
            bail!(
                "kiwi-arbiter did not come up (log: {})",
                tmp.path().join("arbiter.log").display()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }

    let fits = matches!(args.scenario, Scenario::Fit);
    println!(
        "Kiwi demo: two notebooks of {} each on {} ({}), TQ {} s — {}.",
        timeline::fmt_bytes(mem),
        if args.gpu {
            "this machine's GPU".to_string()
        } else {
            format!("a simulated {} GPU", timeline::fmt_bytes(gpu_mem))
        },
        if fits {
            "they fit together"
        } else {
            "together they do not fit"
        },
        args.tq,
        if fits {
            "they run side by side"
        } else {
            "the Kiwi Scheduler makes them take turns"
        }
    );

    // Both notebooks allocate and fill their memory first (swapping as needed); the
    // story starts for both at the same instant once both are ready, whatever the
    // machine's load made that take: each waits for its start time on stdin.
    let mut apps = Vec::new();
    for nb in scripts(tq_ms) {
        let mut cmd = Command::new(&build.gpuburst);
        cmd.arg("--mem")
            .arg(mem.to_string())
            .arg("--name")
            .arg(nb.label)
            .arg("--script")
            .arg(&nb.script)
            .arg("--start-on-stdin")
            .arg("--json")
            .env("LD_PRELOAD", &build.shim)
            .env("KIWI_SOCKET_DIR", &socket_dir)
            .env("KIWI_REQUIRE_ARBITER", "1")
            .env_remove("CUDA_VISIBLE_DEVICES")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if let Some(sim) = &build.sim_dir {
            cmd.env("LD_LIBRARY_PATH", sim)
                .env("KIWI_SIM_NAME", &sim_name)
                .env("KIWI_SIM_MEMORY", gpu_mem.to_string())
                // Not the simulator's 300 MiB per context: the story's notebooks
                // (700 MiB each on 1 GiB) are sized for the arbiter's context
                // reserve (1/8 of the GPU), which does not yet count each client's
                // non-swappable memory (issue #13); two of these contexts fit in it.
                .env(
                    "KIWI_SIM_CONTEXT_MEMORY",
                    kiwi_sim_core::harness::suite_context_memory(gpu_mem).to_string(),
                )
                .env("KIWI_SIM_TRACE", &trace);
        }
        let mut child = cmd.spawn().context("cannot start gpuburst")?;
        let stdout = child.stdout.take().context("no stdout")?;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut app = Running {
            label: nb.label,
            child,
            out: rx,
            lines: Vec::new(),
        };
        // One notebook after the other: A fills its memory first, then B, so at T0 B
        // holds the (idle) GPU and A's burst at T1 starts a fresh turn, as in the seed.
        let ready_by = Instant::now() + Duration::from_secs(30);
        while !app.lines.iter().any(|l| l.contains("\"event\":\"ready\"")) {
            match app.out.recv_timeout(Duration::from_millis(50)) {
                Ok(l) => app.lines.push(l),
                Err(_) if app.child.try_wait()?.is_some() => break,
                Err(_) if Instant::now() > ready_by => break,
                Err(_) => {}
            }
        }
        apps.push(app);
    }
    // T0: both are ready and wait for it. A little ahead of now, so both have read it
    // before it comes.
    let start_ns = kiwi_sim_core::monotonic_ns() + 100_000_000;
    for a in &mut apps {
        if let Some(mut stdin) = a.child.stdin.take() {
            // A notebook that already failed has closed its end: its status says why.
            let _ = writeln!(stdin, "{start_ns}");
        }
    }

    // Progress while the story runs.
    let tty = std::io::stdout().is_terminal();
    let started = Instant::now();
    let mut last_print = Instant::now() - Duration::from_secs(10);
    let mut statuses: Vec<Option<std::process::ExitStatus>> = vec![None; apps.len()];
    let limit = Duration::from_secs(120);
    loop {
        for (i, a) in apps.iter_mut().enumerate() {
            while let Ok(l) = a.out.try_recv() {
                a.lines.push(l);
            }
            if statuses[i].is_none() {
                statuses[i] = a.child.try_wait()?;
            }
        }
        if statuses.iter().all(Option::is_some) {
            break;
        }
        if started.elapsed() > limit {
            bail!("the demo did not finish within {} s", limit.as_secs());
        }
        let every = if tty {
            Duration::from_millis(200)
        } else {
            Duration::from_secs(2)
        };
        if last_print.elapsed() >= every {
            last_print = Instant::now();
            let line = progress_line(&socket_dir, &apps, start_ns);
            if tty {
                print!("\r\x1b[2K{line}");
            } else {
                println!("{line}");
            }
            std::io::stdout().flush()?;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    if tty {
        print!("\r\x1b[2K");
    }
    for a in &mut apps {
        // The reader thread may still hold the last lines.
        while let Ok(l) = a.out.recv_timeout(Duration::from_millis(200)) {
            a.lines.push(l);
        }
    }

    // What happened, from the arbiter's log.
    let (events, now_ns) = Control::connect(&socket_dir)?.events(None, 0)?;
    let mut failures = Vec::new();
    for (a, st) in apps.iter_mut().zip(&statuses) {
        let st = st.expect("all finished");
        let verified = a
            .lines
            .iter()
            .any(|l| l.contains("\"event\":\"verify\"") && l.contains("\"ok\":true"));
        if !st.success() || !verified {
            let mut err = String::new();
            if let Some(mut e) = a.child.stderr.take() {
                let _ = std::io::Read::read_to_string(&mut e, &mut err);
            }
            failures.push(format!(
                "notebook {} {} ({}): {}",
                a.label,
                if verified {
                    "failed"
                } else {
                    "did not verify its memory"
                },
                st,
                err.lines().last().unwrap_or("no message")
            ));
        }
    }
    let mut tl = build_timeline(
        &events,
        &apps,
        &trace,
        start_ns,
        now_ns,
        build.sim_dir.is_some(),
    )?;
    tl.title = format!(
        "Kiwi demo: two notebooks of {} on a {} GPU, TQ {} s",
        timeline::fmt_bytes(mem),
        timeline::fmt_bytes(gpu_mem),
        args.tq
    );
    let width = args.width.unwrap_or_else(term::terminal_width).max(40);
    let color = tty && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    print!("{}", term::render_terminal(&tl, width, color));
    println!();
    print!(
        "{}",
        timeline::render_summary(&timeline::summarize(&tl, &events))
    );
    if args.keep {
        let events_path = tmp.path().join("events.jsonl");
        let text: String = events
            .iter()
            .filter_map(|e| serde_json::to_string(e).ok())
            .map(|l| l + "\n")
            .collect();
        std::fs::write(&events_path, text)?;
        for a in &apps {
            std::fs::write(
                tmp.path().join(format!("{}.out", a.label)),
                a.lines.join("\n"),
            )?;
        }
        let kept = tmp.keep();
        println!("Run files kept in {}", kept.display());
    }
    std::fs::write(&args.svg, svg::render_svg(&tl))
        .with_context(|| format!("cannot write {}", args.svg.display()))?;
    println!("Timeline written to {}", args.svg.display());
    drop(cleanup);
    if failures.is_empty() {
        println!("Both notebooks verified every byte of their GPU memory.");
        Ok(ExitCode::SUCCESS)
    } else {
        for f in failures {
            eprintln!("[ERROR] {f}");
        }
        Ok(ExitCode::from(1))
    }
}

/// `[ 4.2 s] A: holding GPU | B: waiting` from the arbiter's status.
fn progress_line(socket_dir: &Path, apps: &[Running], start_ns: u64) -> String {
    let now = kiwi_sim_core::monotonic_ns();
    let t = if now >= start_ns {
        format!("{:>5.1} s", (now - start_ns) as f64 / 1e9)
    } else {
        "warm-up".to_string()
    };
    let pids: HashMap<u32, &str> = apps.iter().map(|a| (a.child.id(), a.label)).collect();
    let mut parts: Vec<String> = Vec::new();
    if let Ok(mut ctl) = Control::connect(socket_dir) {
        if let Ok(ControlReply::Status(r)) = ctl.call(&ControlRequest::Status { gpu: None }) {
            for g in &r.gpus {
                for c in &g.clients {
                    if let Some(label) = pids.get(&c.host_pid) {
                        let st = match c.state {
                            ClientState::Holding => "holds the GPU",
                            ClientState::Running => "on the GPU",
                            ClientState::Waiting => "waiting",
                            ClientState::Idle => "off the GPU",
                        };
                        parts.push(format!("{label}: {st}"));
                    }
                }
            }
        }
    }
    parts.sort();
    if parts.is_empty() {
        parts.push("the notebooks start and fill their memory".into());
    }
    format!("[{t}] {}", parts.join(" | "))
}

/// A phase a notebook reported: (kind, start, end).
fn phases(lines: &[String]) -> Vec<(String, u64, u64)> {
    lines
        .iter()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["event"] == "phase")
        .filter_map(|v| {
            Some((
                v["kind"].as_str()?.to_string(),
                v["start_ns"].as_u64()?,
                v["end_ns"].as_u64()?,
            ))
        })
        .collect()
}

fn build_timeline(
    events: &[Event],
    apps: &[Running],
    trace: &Path,
    start_ns: u64,
    now_ns: u64,
    simulated: bool,
) -> Result<timeline::Timeline> {
    // The story's window: from the common start to the last phase's end.
    let end_ns = apps
        .iter()
        .flat_map(|a| phases(&a.lines))
        .map(|(_, _, e)| e)
        .max()
        .unwrap_or(now_ns)
        .min(now_ns);
    let mut tl = timeline::from_events(events, None, Some(start_ns), end_ns.max(start_ns + 1));
    tl.t0_ns = start_ns;
    tl.t1_ns = end_ns.max(start_ns + 1);
    let kernels: Vec<kiwi_sim_core::TraceRecord> = if simulated && trace.exists() {
        kiwi_sim_core::trace::read_trace(trace).context("cannot read the simulator's trace")?
    } else {
        Vec::new()
    };
    // Client ids by host pid, from the registrations.
    let mut client_of: HashMap<u32, u64> = HashMap::new();
    for e in events {
        if let (EventKind::Register { host_pid, .. }, Some(id)) = (&e.kind, e.client) {
            client_of.insert(*host_pid, id);
        }
    }
    for a in apps {
        let pid = a.child.id();
        let Some(&client) = client_of.get(&pid) else {
            continue;
        };
        let ph = phases(&a.lines);
        let cpu: Vec<(u64, u64)> = ph
            .iter()
            .filter(|(k, _, _)| k == "cpu")
            .map(|(_, s, e)| (*s, *e))
            .collect();
        let gpu: Vec<(u64, u64)> = if simulated {
            let spans: Vec<(u64, u64)> = kernels
                .iter()
                .filter(|k| k.pid == pid)
                .map(|k| (k.start_ns, k.end_ns))
                .collect();
            timeline::merge_intervals(&spans, 20_000_000)
        } else {
            ph.iter()
                .filter(|(k, _, _)| k == "gpu")
                .map(|(_, s, e)| (*s, *e))
                .collect()
        };
        timeline::refine(&mut tl, client, &gpu, &cpu);
        if let Some(lane) = tl.lanes.iter_mut().find(|l| l.client == Some(client)) {
            lane.name = format!("{} (pid {pid})", a.label);
        }
    }
    tl.lanes.sort_by(|a, b| a.name.cmp(&b.name));
    tl.marks = story_marks(events, apps, &client_of, start_ns, tl.t1_ns);
    Ok(tl)
}

/// The seed's T0…T4, found in what really happened: T1 A starts GPU work and has the
/// GPU, T2 B asks for it and waits, T3 B gets it (A's quantum is over), T4 B is done
/// early and gives it back. Only the marks the run shows are returned.
fn story_marks(
    events: &[Event],
    apps: &[Running],
    client_of: &HashMap<u32, u64>,
    start_ns: u64,
    end_ns: u64,
) -> Vec<timeline::Mark> {
    let mark = |label: &str, t_ns: u64, note: &str| timeline::Mark {
        label: label.into(),
        t_ns,
        note: note.into(),
    };
    let mut marks = vec![mark("T0", start_ns, "both notebooks are ready")];
    let id = |label: &str| {
        apps.iter()
            .find(|a| a.label == label)
            .and_then(|a| client_of.get(&a.child.id()).copied())
    };
    let (Some(a), Some(b)) = (id("A"), id("B")) else {
        return marks;
    };
    let first = |client: u64, after: u64, pred: &dyn Fn(&EventKind) -> bool| {
        events
            .iter()
            .filter(|e| e.client == Some(client) && e.t_ns >= after && pred(&e.kind))
            .map(|e| e.t_ns)
            .min()
    };
    let a_gpu_phase = apps
        .iter()
        .find(|x| x.label == "A")
        .and_then(|x| phases(&x.lines).into_iter().find(|(k, _, _)| k == "gpu"))
        .map(|(_, s, _)| s);
    // A may already hold the GPU when its burst starts (a lone holder keeps it).
    let t1 = first(a, start_ns, &|k| matches!(k, EventKind::Grant { .. }))
        .into_iter()
        .chain(a_gpu_phase)
        .min();
    let Some(t1) = t1 else { return marks };
    marks.push(mark("T1", t1, "A starts a GPU burst and has the GPU"));
    let Some(t2) = first(b, t1, &|k| matches!(k, EventKind::Request)) else {
        return marks;
    };
    marks.push(mark("T2", t2, "B asks for the GPU and waits"));
    let Some(t3) = first(b, t2, &|k| matches!(k, EventKind::Grant { .. })) else {
        return marks;
    };
    marks.push(mark("T3", t3, "A's time quantum is over: B gets the GPU"));
    if let Some(t4) = first(b, t3, &|k| {
        matches!(k, EventKind::Release { early: true, .. })
    }) {
        marks.push(mark(
            "T4",
            t4,
            "B is done early and gives the GPU back: A resumes",
        ));
    }
    marks.retain(|m| m.t_ns <= end_ns);
    marks
}
