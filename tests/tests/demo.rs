//! `kiwictl demo` end to end: the arbiter, the shim and two gpuburst notebooks on the
//! simulator, replaying the seed's story; the SVG is parsed and checked.

use std::path::PathBuf;
use std::process::Command;

use kiwi_tests::bin;
use serde_json::Value;

/// The demos of this file run one at a time: the busy-machine one is about its own
/// load (a spinning thread per core), and two other demos beside it (an arbiter, two
/// notebooks and the simulator's threads each) made the ±100 ms marks miss by up to
/// 430 ms on 2 cores.
static ONE_DEMO_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one_demo_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    ONE_DEMO_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

/// What `--keep` left behind: the arbiter's events and each notebook's JSON lines.
struct Kept {
    dir: PathBuf,
    events: Vec<Value>,
}

impl Kept {
    fn read(stdout: &str) -> Kept {
        let dir = stdout
            .lines()
            .find_map(|l| l.strip_prefix("Run files kept in "))
            .map(|d| PathBuf::from(d.trim()))
            .unwrap_or_else(|| panic!("no kept directory in:\n{stdout}"));
        let events = std::fs::read_to_string(dir.join("events.jsonl"))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        Kept { dir, events }
    }

    fn lines(&self, label: &str) -> Vec<Value> {
        std::fs::read_to_string(self.dir.join(format!("{label}.out")))
            .unwrap()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }

    /// The arbiter's client id of notebook `label` (matched by pid).
    fn client(&self, label: &str) -> u64 {
        let pid = self
            .lines(label)
            .iter()
            .find(|v| v["event"] == "ready")
            .and_then(|v| v["pid"].as_u64())
            .unwrap_or_else(|| panic!("{label} never got ready"));
        self.events
            .iter()
            .find(|e| e["kind"]["event"] == "register" && e["kind"]["pid"].as_u64() == Some(pid))
            .and_then(|e| e["client"].as_u64())
            .unwrap_or_else(|| panic!("{label} (pid {pid}) never registered"))
    }

    /// The first event of `kind` by `client` at or after `after`.
    fn first(&self, client: u64, kind: &str, after: u64) -> Option<&Value> {
        self.events.iter().find(|e| {
            e["client"].as_u64() == Some(client)
                && e["kind"]["event"] == kind
                && e["t_ns"].as_u64().unwrap() >= after
        })
    }

    fn t(&self, client: u64, kind: &str, after: u64) -> u64 {
        self.first(client, kind, after)
            .unwrap_or_else(|| panic!("no {kind} of client {client} after {after}"))["t_ns"]
            .as_u64()
            .unwrap()
    }

    /// How long `client`'s swap-outs that ended in `[from, to]` took, together.
    fn swapped_out_ns(&self, client: u64, from: u64, to: u64) -> u64 {
        self.events
            .iter()
            .filter(|e| {
                let t = e["t_ns"].as_u64().unwrap();
                e["client"].as_u64() == Some(client)
                    && e["kind"]["event"] == "swap_out"
                    && (from..=to).contains(&t)
            })
            .map(|e| e["kind"]["duration_ns"].as_u64().unwrap())
            .sum()
    }

    /// When `client`'s first swap-in that ended in `[from, to]` ended (its event is
    /// logged at its end), if any.
    fn swapped_in_at(&self, client: u64, from: u64, to: u64) -> Option<u64> {
        self.events
            .iter()
            .filter(|e| e["client"].as_u64() == Some(client) && e["kind"]["event"] == "swap_in")
            .map(|e| e["t_ns"].as_u64().unwrap())
            .find(|t| (from..=to).contains(t))
    }

    /// When `client`'s last release in `[from, to]` reached the arbiter, if any.
    fn released_at(&self, client: u64, from: u64, to: u64) -> Option<u64> {
        self.events
            .iter()
            .filter(|e| e["client"].as_u64() == Some(client) && e["kind"]["event"] == "release")
            .map(|e| e["t_ns"].as_u64().unwrap())
            .filter(|t| (from..=to).contains(t))
            .max()
    }

    /// The event log, one line per event, for failure messages.
    fn summary(&self) -> String {
        let t0 = self
            .events
            .first()
            .and_then(|e| e["t_ns"].as_u64())
            .unwrap_or(0);
        self.events
            .iter()
            .map(|e| {
                let t = e["t_ns"].as_u64().unwrap_or(0).saturating_sub(t0);
                format!(
                    "{:9.1} ms client {} {}",
                    t as f64 / 1e6,
                    e["client"],
                    e["kind"]
                )
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// (start, end) of `label`'s `n`th phase of `kind`.
    fn phase(&self, label: &str, kind: &str, n: usize) -> (u64, u64) {
        let p = self
            .lines(label)
            .into_iter()
            .filter(|v| v["event"] == "phase" && v["kind"] == kind)
            .nth(n)
            .unwrap_or_else(|| panic!("{label} has no phase {kind} #{n}"));
        (
            p["start_ns"].as_u64().unwrap(),
            p["end_ns"].as_u64().unwrap(),
        )
    }
}

impl Drop for Kept {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn f(node: roxmltree::Node, attr: &str) -> f64 {
    node.attribute(attr)
        .unwrap_or_else(|| panic!("{attr} missing"))
        .parse()
        .unwrap()
}

/// The seed's story, on a machine whose every core is kept busy by other processes:
/// the marks come when the script says, not when the load lets them.
#[test]
fn demo_replays_the_seed_story_on_a_busy_machine() {
    let _one = one_demo_at_a_time();
    const TQ_NS: u64 = 1_500_000_000;
    const IDLE_NS: u64 = 100_000_000; // the shim's default KIWI_IDLE_MS
    const MS: u64 = 1_000_000;
    let dir = tempfile::tempdir().unwrap();
    let svg = dir.path().join("demo.svg");
    let load = kiwi_tests::BusyLoad::every_core();
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
            "--keep",
            "--svg",
        ])
        .arg(&svg)
        .output()
        .expect("run kiwictl demo");
    drop(load);
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
    let kept = Kept::read(&stdout);
    let log = kept.summary();
    assert!(t1 < t2 && t2 < t3 && t3 < t4, "marks in order\n{log}");
    // T3 is A's quantum after T1 (plus the drop's drain and swap, well under 2 s).
    let q = (t3 - t1) as f64 / 1e9;
    assert!((1.5..3.5).contains(&q), "T3 - T1 = {q} s");
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

    // The timings, from the arbiter's event log and the notebooks' own phase lines.
    let (t0, _) = mark("T0");
    let (a, b) = (kept.client("A"), kept.client("B"));
    let ms = |ns: u64| ns as f64 / 1e6;
    // B's early release comes before a whole quantum of its own: counted from the
    // end of its swap-in (on a loaded machine it waited 820 ms once for A's swap-out
    // to make room) to the release, less the swap-out that ends it (T4 is the
    // release: 1.34 s of swap-out once on a loaded machine).
    let b_release_out = kept.swapped_out_ns(b, t3, t4);
    let b_in = kept.swapped_in_at(b, t3, t4).unwrap_or(t3);
    assert!(
        (t4 - b_in).saturating_sub(b_release_out) < TQ_NS,
        "B held the GPU {:.0} ms ({:.0} ms of it waiting for room and swapping in, {:.0} ms its swap-out): an early release, not a TQ\n{log}",
        ms(t4 - t3),
        ms(b_in - t3),
        ms(b_release_out)
    );
    // B asks at T2 = T0 + 5/6 TQ, as its script says (±100 ms); unless it was still
    // giving the GPU back then (idle, it released early when A asked, and on a loaded
    // machine that swap-out ran 870 ms once, past its script's time): it asks as
    // its release ends.
    let script_ask = t0 + TQ_NS * 5 / 6;
    let due = match kept.released_at(b, t0, t2) {
        Some(r) if r + 100 * MS >= script_ask => r.max(script_ask),
        _ => script_ask,
    };
    assert!(
        t2.abs_diff(due) <= 100 * MS,
        "B asked {:.0} ms after T0; the script says {:.0} ms, its release allowed {:.0} ms\n{log}",
        ms(t2 - t0),
        ms(TQ_NS * 5 / 6),
        ms(due - t0)
    );
    // A asks at T0 + TQ/2 and is granted at once: B, idle since it got ready, gives
    // the GPU back without waiting to be asked twice; A waits for B's swap-out at most.
    let a_asks = kept.t(a, "request", t0);
    assert!(
        (a_asks - t0).abs_diff(TQ_NS / 2) <= 100 * MS,
        "A asked {:.0} ms after T0\n{log}",
        ms(a_asks - t0)
    );
    let a_granted = kept.t(a, "grant", a_asks);
    let b_out = kept.swapped_out_ns(b, a_asks, a_granted);
    assert!(
        a_granted - a_asks <= IDLE_NS + b_out + 50 * MS,
        "A waited {:.0} ms for an idle GPU (B's swap-out took {:.0} ms)",
        ms(a_granted - a_asks),
        ms(b_out)
    );
    // T3 = A's grant + TQ + the drain (and A's swap-out, unless the hand-off is
    // pipelined). The drain on this busy machine took up to 208 ms beyond the
    // swap-out (a fresh-clone CI run): 300 ms still tells a prompt drop from one
    // that waited for anything else (the quantum is 1.5 s).
    let a_out = kept.swapped_out_ns(a, a_granted + TQ_NS, t3 + TQ_NS);
    assert!(
        t3 >= a_granted + TQ_NS && t3 - a_granted - TQ_NS <= a_out + 300 * MS,
        "T3 came {:.0} ms after A's grant + TQ (A's swap-out took {:.0} ms)",
        ms(t3.saturating_sub(a_granted + TQ_NS)),
        ms(a_out)
    );
    // T4: B releases early, KIWI_IDLE_MS after its burst's work is done (+20 ms, and
    // the swap-out that makes room for A).
    let (_, b_gpu_end) = kept.phase("B", "gpu", 0);
    let b_out = kept.swapped_out_ns(b, b_gpu_end, t4);
    assert!(
        t4 >= b_gpu_end && t4 - b_gpu_end <= IDLE_NS + 20 * MS + b_out,
        "B released {:.0} ms after its work was done (KIWI_IDLE_MS 100, its swap-out {:.0} ms)",
        ms(t4.saturating_sub(b_gpu_end)),
        ms(b_out)
    );
}

#[test]
fn demo_where_the_notebooks_fit_never_waits() {
    let _one = one_demo_at_a_time();
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
