//! `kiwictl demo` end to end: the arbiter, the shim and two gpuburst notebooks on the
//! simulator, replaying the seed's story; the SVG is parsed and checked.

use std::process::Command;

use kiwi_tests::bin;

fn f(node: roxmltree::Node, attr: &str) -> f64 {
    node.attribute(attr)
        .unwrap_or_else(|| panic!("{attr} missing"))
        .parse()
        .unwrap()
}

#[test]
fn demo_replays_the_seed_story() {
    let dir = tempfile::tempdir().unwrap();
    let svg = dir.path().join("demo.svg");
    // A smaller simulated GPU keeps swaps quick in a debug build.
    let out = Command::new(bin("kiwictl"))
        .env_remove("KIWI_CONFIG")
        .env("NO_COLOR", "1")
        .args([
            "demo",
            "--tq",
            "1.5",
            "--gpu-mem",
            "256MiB",
            "--width",
            "100",
            "--svg",
        ])
        .arg(&svg)
        .output()
        .expect("run kiwictl demo");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "demo failed:\n{stdout}\n{stderr}");
    assert!(
        stdout.contains("Both notebooks verified every byte"),
        "{stdout}"
    );
    assert!(stdout.contains("GPU busy"), "the summary: {stdout}");
    for m in ["T1", "T2", "T3", "T4"] {
        assert!(stdout.contains(m), "{m} missing:\n{stdout}");
    }

    let text = std::fs::read_to_string(&svg).expect("SVG written");
    let doc = roxmltree::Document::parse(&text).expect("well-formed SVG");
    let root = doc.root_element();
    let lanes: Vec<roxmltree::Node> = root
        .descendants()
        .filter(|n| n.attribute("class") == Some("lane"))
        .collect();
    assert_eq!(lanes.len(), 2, "two notebooks");
    let lane = |p: &str| {
        *lanes
            .iter()
            .find(|n| n.attribute("data-name").unwrap().starts_with(p))
            .unwrap_or_else(|| panic!("lane {p}"))
    };
    let blocks = |l: roxmltree::Node, class: &str| -> Vec<(f64, f64)> {
        l.children()
            .filter(|n| n.attribute("class") == Some(class))
            .map(|n| (f(n, "x"), f(n, "x") + f(n, "width")))
            .collect()
    };
    let mark = |label: &str| -> (u64, f64) {
        let g = root
            .descendants()
            .find(|n| n.attribute("data-label") == Some(label))
            .unwrap_or_else(|| panic!("mark {label} missing"));
        let line = g
            .children()
            .find(|n| n.tag_name().name() == "line")
            .unwrap();
        (
            g.attribute("data-t-ns").unwrap().parse().unwrap(),
            f(line, "x1"),
        )
    };
    let (t1, _) = mark("T1");
    let (t2, x2) = mark("T2");
    let (t3, x3) = mark("T3");
    let (t4, _) = mark("T4");
    assert!(t1 < t2 && t2 < t3 && t3 < t4, "marks in order");
    // T3 is A's quantum after T1 (plus the drop's drain and swap, well under 2 s).
    let q = (t3 - t1) as f64 / 1e9;
    assert!((1.5..3.5).contains(&q), "T3 - T1 = {q} s");
    // B's early release comes before a whole quantum of its own.
    let b_turn = (t4 - t3) as f64 / 1e9;
    assert!(
        b_turn < 1.5,
        "B held the GPU {b_turn} s: an early release, not a TQ"
    );
    // B waits from T2 to T3, and A runs GPU work and CPU work.
    let b_waits = blocks(lane("B"), "block waiting");
    assert!(
        b_waits
            .iter()
            .any(|(x0, x1)| (x0 - x2).abs() < 3.0 && (x1 - x3).abs() < 3.0),
        "B's wait spans T2..T3 ({x2}..{x3}): {b_waits:?}"
    );
    assert!(!blocks(lane("A"), "block gpu").is_empty());
    assert!(!blocks(lane("A"), "block cpu").is_empty());
    assert!(!blocks(lane("B"), "block gpu").is_empty());
}

#[test]
fn demo_where_the_notebooks_fit_never_waits() {
    let dir = tempfile::tempdir().unwrap();
    let svg = dir.path().join("fit.svg");
    let out = Command::new(bin("kiwictl"))
        .env_remove("KIWI_CONFIG")
        .env("NO_COLOR", "1")
        .args([
            "demo",
            "--scenario",
            "fit",
            "--tq",
            "1.5",
            "--gpu-mem",
            "256MiB",
            "--svg",
        ])
        .arg(&svg)
        .output()
        .expect("run kiwictl demo");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = std::fs::read_to_string(&svg).unwrap();
    let doc = roxmltree::Document::parse(&text).unwrap();
    let waits = doc
        .descendants()
        .filter(|n| n.attribute("class") == Some("block waiting"))
        .count();
    assert_eq!(
        waits, 0,
        "nobody waits when the working sets fit:\n{stdout}"
    );
}

#[test]
fn demo_refuses_bad_options() {
    for args in [
        &["demo", "--tq", "0"][..],
        &["demo", "--mem", "2GiB"],
        &["demo", "--scenario", "party"],
    ] {
        let out = Command::new(bin("kiwictl")).args(args).output().unwrap();
        assert!(!out.status.success(), "{args:?} accepted");
    }
}
