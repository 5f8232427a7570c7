//! `kiwictl timeline` against a real arbiter: two protocol-level clients act out the
//! seed's example (A gets the GPU, B waits, A's quantum ends, B releases early), then
//! the real binary draws it; the SVG is parsed as XML and checked against the log.

use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

use kiwi_protocol::{ArbiterMsg, ClientMsg, Event, EventKind, Usage};
use kiwi_tests::{bin, register_msg, require_tool, Arbiter, Client};

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;
const GPU: &str = "GPU-timeline-0";

fn kiwictl(arb: &Arbiter, args: &[&str]) -> Output {
    Command::new(bin("kiwictl"))
        .env_remove("KIWI_CONFIG")
        .env("KIWI_SOCKET_DIR", arb.socket_dir())
        .env("NO_COLOR", "1")
        .args(args)
        .output()
        .expect("run kiwictl")
}

fn client(arb: &Arbiter, name: &str) -> Client {
    // 700 MiB each on a 1 GiB GPU: they do not fit together, so grants are exclusive.
    let mut reg = register_msg(GPU, GIB, 700 * MIB);
    reg.name = Some(name.into());
    Client::register(&arb.client_socket(), reg)
}

fn usage() -> Usage {
    Usage {
        working_set_bytes: 700 * MIB,
        resident_bytes: 700 * MIB,
    }
}

fn granted(c: &mut Client) {
    c.wait_for(Duration::from_secs(5), |m| {
        matches!(m, ArbiterMsg::Grant { .. })
    })
    .expect("grant");
}

fn sleep_ms(ms: u64) {
    std::thread::sleep(Duration::from_millis(ms));
}

/// Acts out T1…T4 and returns the arbiter's log.
fn seed_story(arb: &Arbiter) -> (Client, Client, Vec<Event>) {
    let mut a = client(arb, "A");
    let mut b = client(arb, "B");
    sleep_ms(100); // T0–T1: A computes on the CPU, B is idle.
    a.conn.send(&ClientMsg::Request).unwrap();
    granted(&mut a); // T1
    sleep_ms(100);
    b.conn.send(&ClientMsg::Request).unwrap(); // T2: B waits.
    a.wait_for(Duration::from_secs(5), |m| {
        matches!(m, ArbiterMsg::Drop { .. })
    })
    .expect("A's quantum ends with a drop");
    a.conn.send(&ClientMsg::Release(usage())).unwrap();
    a.conn.send(&ClientMsg::Request).unwrap(); // A still has GPU work.
    granted(&mut b); // T3
    sleep_ms(120);
    b.conn.send(&ClientMsg::Release(usage())).unwrap(); // T4: B is done early.
    granted(&mut a);
    sleep_ms(100);
    a.conn.send(&ClientMsg::Release(usage())).unwrap();
    sleep_ms(50);
    let events = arb.events();
    (a, b, events)
}

/// `t_ns` of the first event of `client` matching `pred`.
fn t_of(events: &[Event], client: u64, pred: impl Fn(&EventKind) -> bool) -> u64 {
    events
        .iter()
        .find(|e| e.client == Some(client) && pred(&e.kind))
        .unwrap_or_else(|| panic!("no such event for client {client} in {events:#?}"))
        .t_ns
}

fn f(node: roxmltree::Node, attr: &str) -> f64 {
    node.attribute(attr)
        .unwrap_or_else(|| panic!("{attr} missing"))
        .parse()
        .unwrap()
}

#[test]
fn timeline_draws_the_seed_story_from_a_live_arbiter() {
    let arb = Arbiter::start(&["--tq", "0.3"]);
    let (a, b, events) = seed_story(&arb);
    let is_grant = |k: &EventKind| matches!(k, EventKind::Grant { .. });
    let t1 = t_of(&events, a.id, is_grant);
    let t2 = t_of(&events, b.id, |k| matches!(k, EventKind::Request));
    let t3 = t_of(&events, b.id, is_grant);
    let t4 = t_of(&events, b.id, |k| {
        matches!(k, EventKind::Release { early: true, .. })
    });
    assert!(t1 < t2 && t2 < t3 && t3 < t4);
    // The seed's T3 = T1 + TQ: B gets the GPU when A's 0.3 s quantum is over.
    let quantum_ms = (t3 - t1) as f64 / 1e6;
    assert!(
        (300.0..1_000.0).contains(&quantum_ms),
        "T3 - T1 = {quantum_ms:.0} ms"
    );

    let dir = tempfile::tempdir().unwrap();
    let svg_path = dir.path().join("tl.svg");
    let o = kiwictl(
        &arb,
        &[
            "timeline",
            "--svg",
            svg_path.to_str().unwrap(),
            "--width",
            "100",
        ],
    );
    let stdout = String::from_utf8_lossy(&o.stdout);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(
        o.status.success(),
        "exit {:?}\n{stdout}\n{stderr}",
        o.status
    );
    println!("{stdout}");

    // The terminal picture: both lanes, B's wait drawn, all marks explained, a summary.
    let lane_row = |name: &str| -> String {
        stdout
            .lines()
            .find(|l| l.starts_with(&format!("{name} (pid ")))
            .unwrap_or_else(|| panic!("no lane {name}:\n{stdout}"))
            .to_string()
    };
    let (row_a, row_b) = (lane_row("A"), lane_row("B"));
    assert!(row_b.contains('~'), "B waits:\n{stdout}");
    assert!(row_a.contains('~'), "A waits after its quantum:\n{stdout}");
    assert!(row_a.contains('=') && row_b.contains('='), "{stdout}");
    assert!(!stdout.contains('\x1b'), "NO_COLOR and a pipe: no ANSI");
    for (label, note) in [
        ("T1", "A gets the GPU"),
        ("T2", "B asks for the GPU and waits"),
        ("T3", "A's time quantum is over: B gets the GPU, A waits"),
        ("T4", "B releases early: A gets the GPU again"),
    ] {
        assert!(
            stdout
                .lines()
                .any(|l| l.starts_with(label) && l.ends_with(note)),
            "{label}: {note}\n{stdout}"
        );
    }
    assert!(stdout.contains("GPU busy "), "{stdout}");
    assert!(stdout.contains(&format!("wrote {}", svg_path.display())));

    // The SVG: well-formed XML, both lanes, B's waiting block, marks at the log's times.
    let text = std::fs::read_to_string(&svg_path).expect("svg written");
    let doc = roxmltree::Document::parse(&text).expect("well-formed SVG");
    let root = doc.root_element();
    assert_eq!(root.tag_name().name(), "svg");
    assert_eq!(
        root.tag_name().namespace(),
        Some("http://www.w3.org/2000/svg")
    );
    let lanes: Vec<roxmltree::Node> = root
        .descendants()
        .filter(|n| n.attribute("class") == Some("lane"))
        .collect();
    assert_eq!(lanes.len(), 2, "two lanes");
    let lane = |prefix: &str| {
        *lanes
            .iter()
            .find(|n| n.attribute("data-name").unwrap().starts_with(prefix))
            .unwrap_or_else(|| panic!("lane {prefix}"))
    };
    let waiting_blocks = |l: roxmltree::Node| -> Vec<(f64, f64)> {
        l.children()
            .filter(|n| n.attribute("class") == Some("block waiting"))
            .map(|n| (f(n, "x"), f(n, "x") + f(n, "width")))
            .collect()
    };
    let b_waits = waiting_blocks(lane("B "));
    assert_eq!(b_waits.len(), 1, "B waits once: {b_waits:?}");
    assert_eq!(waiting_blocks(lane("A ")).len(), 1, "A waits once");

    let mark_x = |label: &str| -> (u64, f64) {
        let g = root
            .descendants()
            .find(|n| n.attribute("data-label") == Some(label))
            .unwrap_or_else(|| panic!("mark {label} missing"));
        let line = g
            .children()
            .find(|n| n.tag_name().name() == "line")
            .unwrap();
        let dashed = line.attribute("stroke-dasharray").is_some();
        assert!(dashed, "{label} is a dashed line");
        (
            g.attribute("data-t-ns").unwrap().parse().unwrap(),
            f(line, "x1"),
        )
    };
    let (mt1, _) = mark_x("T1");
    let (mt2, x2) = mark_x("T2");
    let (mt3, x3) = mark_x("T3");
    let (mt4, _) = mark_x("T4");
    assert_eq!((mt1, mt2, mt3, mt4), (t1, t2, t3, t4));
    // B's waiting block runs from the T2 line to the T3 line.
    let (wx0, wx1) = b_waits[0];
    assert!(
        (wx0 - x2).abs() < 0.5,
        "B's wait starts at T2: {wx0} vs {x2}"
    );
    assert!((wx1 - x3).abs() < 1.5, "B's wait ends at T3: {wx1} vs {x3}");
    let title = root
        .children()
        .find(|n| n.tag_name().name() == "title")
        .and_then(|n| n.text());
    assert_eq!(title, Some(format!("Kiwi timeline: {GPU}").as_str()));

    // It renders: rsvg-convert draws it as a PNG.
    if require_tool("rsvg-convert") {
        let png = dir.path().join("tl.png");
        render_png(&svg_path, &png);
        let bytes = std::fs::read(&png).unwrap();
        assert!(bytes.starts_with(b"\x89PNG\r\n\x1a\n"), "a PNG");
        assert!(bytes.len() > 5_000, "a picture, not an empty canvas");
        if let Some(keep) = std::env::var_os("KIWI_TIMELINE_KEEP") {
            std::fs::copy(&svg_path, Path::new(&keep).with_extension("svg")).unwrap();
            std::fs::copy(&png, Path::new(&keep).with_extension("png")).unwrap();
        }
    }

    // --since narrower than the story: the window starts later; the marks before it go.
    let o = kiwictl(&arb, &["timeline", "--since", "1s", "--width", "100"]);
    assert!(o.status.success());
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("A (pid ") && out.contains("B (pid "), "{out}");
}

fn render_png(svg: &Path, png: &Path) {
    let st = Command::new("rsvg-convert")
        .arg("-o")
        .arg(png)
        .arg(svg)
        .status()
        .expect("run rsvg-convert");
    assert!(st.success(), "rsvg-convert failed on {}", svg.display());
}

#[test]
fn timeline_with_no_events_says_so_and_bad_since_is_refused() {
    let arb = Arbiter::start(&[]);
    let o = kiwictl(&arb, &["timeline"]);
    assert!(o.status.success());
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("No client events"), "{out}");

    // A GPU nobody used: nothing to draw either, and no SVG written.
    let _c = client(&arb, "C");
    let dir = tempfile::tempdir().unwrap();
    let svg = dir.path().join("x.svg");
    let o = kiwictl(
        &arb,
        &[
            "--gpu",
            "GPU-none",
            "timeline",
            "--svg",
            svg.to_str().unwrap(),
        ],
    );
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    // The arbiter refuses an unknown GPU, or has no events for it: either way, one
    // clear line and no picture.
    assert_eq!(all.trim().lines().count(), 1, "{all}");
    assert!(!svg.exists());

    for bad in ["10x", "0s", "-5m", "soon"] {
        let o = kiwictl(&arb, &["timeline", &format!("--since={bad}")]);
        assert_eq!(o.status.code(), Some(1), "--since {bad} accepted");
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(err.trim().lines().count(), 1, "{err}");
        assert!(
            err.contains("--since") && err.contains("90s, 10m or 2h")
                || err.contains("more than 0"),
            "{err}"
        );
    }
}

#[test]
fn timeline_draws_one_picture_per_gpu_and_gpu_picks_one() {
    let arb = Arbiter::start(&[]);
    let mut regs = Vec::new();
    for (gpu, name) in [("GPU-tl-x", "onx"), ("GPU-tl-y", "ony")] {
        let mut reg = register_msg(gpu, GIB, 100 * MIB);
        reg.name = Some(name.into());
        let mut c = Client::register(&arb.client_socket(), reg);
        c.conn.send(&ClientMsg::Request).unwrap();
        granted(&mut c);
        regs.push(c);
    }
    let dir = tempfile::tempdir().unwrap();
    let svg = dir.path().join("t.svg");
    let o = kiwictl(&arb, &["timeline", "--svg", svg.to_str().unwrap()]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{out}");
    assert!(out.contains("Kiwi timeline: GPU-tl-x") && out.contains("Kiwi timeline: GPU-tl-y"));
    let x = std::fs::read_to_string(&svg).unwrap();
    let y = std::fs::read_to_string(dir.path().join("t-1.svg")).unwrap();
    for (text, mine, other) in [(&x, "onx", "ony"), (&y, "ony", "onx")] {
        let doc = roxmltree::Document::parse(text).expect("well-formed");
        let names: Vec<&str> = doc
            .descendants()
            .filter_map(|n| n.attribute("data-name"))
            .collect();
        assert_eq!(names.len(), 1, "{names:?}");
        assert!(names[0].starts_with(mine) && !names[0].contains(other));
    }

    let o = kiwictl(&arb, &["--gpu", "GPU-tl-y", "timeline"]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{out}");
    assert!(out.contains("ony (pid ") && !out.contains("onx"), "{out}");
}
