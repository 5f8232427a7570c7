//! The Grafana dashboard and the Prometheus alerts in `deploy/helm/kiwi/files/`
//! against the real daemons: the JSON parses, and every metric that any query
//! names (panels, template variables, alert rules) is one that a real
//! `kiwi-arbiter` or `kiwi-device-plugin` exports, as read from their `/metrics`.
//! The alerts' behaviour is unit-tested with `promtool test rules`.

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kiwi_protocol::{ArbiterMsg, ClientMsg, SwapDirection, Usage};
use kiwi_tests::{bin, register_msg, require_tool, Arbiter, Client};

const MIB: u64 = 1 << 20;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root")
        .to_path_buf()
}

fn files() -> PathBuf {
    repo().join("deploy/helm/kiwi/files")
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// GET /metrics, or `None` while nothing listens.
fn scrape(port: u16) -> Option<String> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: kiwi\r\n\r\n")
        .ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    out.starts_with("HTTP/1.1 200").then_some(out)
}

/// The sample names an exposition can contain: from each `# TYPE` line (so a
/// family with no series yet still counts) and from the samples themselves.
fn exported_names(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut it = rest.split_whitespace();
            let (Some(name), Some(kind)) = (it.next(), it.next()) else {
                continue;
            };
            match kind {
                "counter" => {
                    names.insert(format!("{name}_total"));
                }
                "histogram" => {
                    for s in ["_bucket", "_sum", "_count"] {
                        names.insert(format!("{name}{s}"));
                    }
                }
                _ => {
                    names.insert(name.to_string());
                }
            }
        } else if line.starts_with("kiwi_") {
            let end = line.find(['{', ' ']).unwrap_or(line.len());
            names.insert(line[..end].to_string());
        }
    }
    names
}

/// Every metric name a PromQL expression selects. Label matchers, ranges,
/// strings, Grafana variables, function names, keywords and the label lists of
/// `by`/`without`/`on`/`ignoring`/`group_*` are not metric names.
fn metric_names(expr: &str) -> Vec<String> {
    const KEYWORDS: &[&str] = &[
        "and",
        "or",
        "unless",
        "bool",
        "offset",
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
        "inf",
        "nan",
        // Aggregations: `sum by (l) (x)` has no parenthesis right after the name.
        "sum",
        "min",
        "max",
        "avg",
        "group",
        "stddev",
        "stdvar",
        "count",
        "count_values",
        "bottomk",
        "topk",
        "quantile",
    ];
    let c: Vec<char> = expr.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    let skip_to = |i: usize, close: char| -> usize {
        let mut j = i + 1;
        while j < c.len() && c[j] != close {
            if c[j] == '"' {
                j += 1;
                while j < c.len() && c[j] != '"' {
                    j += if c[j] == '\\' { 2 } else { 1 };
                }
            }
            j += 1;
        }
        j + 1
    };
    while i < c.len() {
        let ch = c[i];
        if ch == '{' {
            i = skip_to(i, '}');
        } else if ch == '[' {
            i = skip_to(i, ']');
        } else if ch == '"' || ch == '\'' || ch == '`' {
            i = skip_to(i, ch);
        } else if ch == '$' {
            i += 1;
            while i < c.len() && (c[i].is_alphanumeric() || c[i] == '_') {
                i += 1;
            }
        } else if ch.is_ascii_digit()
            || (ch == '.' && c.get(i + 1).is_some_and(char::is_ascii_digit))
        {
            while i < c.len() && (c[i].is_alphanumeric() || c[i] == '.') {
                i += 1;
            }
        } else if ch.is_alphabetic() || ch == '_' || ch == ':' {
            let start = i;
            while i < c.len() && (c[i].is_alphanumeric() || c[i] == '_' || c[i] == ':') {
                i += 1;
            }
            let word: String = c[start..i].iter().collect();
            let mut j = i;
            while j < c.len() && c[j].is_whitespace() {
                j += 1;
            }
            let paren = c.get(j) == Some(&'(');
            let lower = word.to_ascii_lowercase();
            if [
                "by",
                "without",
                "on",
                "ignoring",
                "group_left",
                "group_right",
            ]
            .contains(&lower.as_str())
                && paren
            {
                i = skip_to(j, ')');
            } else if paren || KEYWORDS.contains(&lower.as_str()) {
                // A function or an aggregation, or a keyword.
            } else {
                out.push(word);
            }
        } else {
            i += 1;
        }
    }
    out
}

/// Every PromQL expression of the dashboard: panel targets and template queries.
fn dashboard_queries(dash: &serde_json::Value) -> Vec<String> {
    fn walk(v: &serde_json::Value, out: &mut Vec<String>) {
        match v {
            serde_json::Value::Object(m) => {
                if let Some(e) = m.get("expr").and_then(|e| e.as_str()) {
                    out.push(e.to_string());
                }
                for v in m.values() {
                    walk(v, out);
                }
            }
            serde_json::Value::Array(a) => a.iter().for_each(|v| walk(v, out)),
            _ => {}
        }
    }
    let mut out = Vec::new();
    walk(&dash["panels"], &mut out);
    for var in dash["templating"]["list"].as_array().expect("templating") {
        if var["type"] == "query" {
            let q = var["query"]["query"]
                .as_str()
                .or(var["query"].as_str())
                .expect("query text");
            // label_values(<selector>, <label>): only the selector is PromQL.
            let inner = q
                .strip_prefix("label_values(")
                .and_then(|r| r.rsplit_once(','))
                .map(|(sel, _)| sel.to_string())
                .unwrap_or_else(|| q.to_string());
            out.push(inner);
        }
    }
    out
}

/// The `expr` of every rule in a Prometheus rule file (block or inline scalars).
fn rule_exprs(yaml: &str) -> Vec<String> {
    let lines: Vec<&str> = yaml.lines().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let l = lines[i];
        let t = l.trim_start();
        if let Some(rest) = t.strip_prefix("expr:") {
            let indent = l.len() - t.len();
            let rest = rest.trim();
            if rest.starts_with('|') || rest.starts_with('>') {
                let mut e = String::new();
                i += 1;
                while i < lines.len() {
                    let n = lines[i];
                    let nt = n.trim_start();
                    if !nt.is_empty() && n.len() - nt.len() <= indent {
                        break;
                    }
                    e.push_str(n);
                    e.push('\n');
                    i += 1;
                }
                out.push(e);
                continue;
            }
            out.push(rest.to_string());
        }
        i += 1;
    }
    out
}

struct Plugin(Child);

impl Drop for Plugin {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// What a real arbiter exports once clients have been granted, swapped and released.
fn arbiter_metrics() -> String {
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let arb = Arbiter::start(&["--tq", "0.2", "--metrics-addr", &addr]);
    let mut a = Client::register(
        &arb.client_socket(),
        register_msg("GPU-d", 1 << 30, 700 * MIB),
    );
    let mut b = Client::register(
        &arb.client_socket(),
        register_msg("GPU-d", 1 << 30, 700 * MIB),
    );
    a.conn.send(&ClientMsg::Request).unwrap();
    a.wait_for(Duration::from_secs(5), |m| {
        matches!(m, ArbiterMsg::Grant { .. })
    })
    .expect("grant");
    b.conn.send(&ClientMsg::Request).unwrap();
    a.wait_for(Duration::from_secs(5), |m| {
        matches!(m, ArbiterMsg::Drop { .. })
    })
    .expect("drop at TQ end");
    a.conn
        .send(&ClientMsg::Swapped {
            direction: SwapDirection::Out,
            bytes: 100 * MIB,
            duration_ns: 1_000_000,
        })
        .unwrap();
    a.conn
        .send(&ClientMsg::Release(Usage {
            working_set_bytes: 700 * MIB,
            resident_bytes: 600 * MIB,
        }))
        .unwrap();
    b.wait_for(Duration::from_secs(5), |m| {
        matches!(m, ArbiterMsg::Grant { .. })
    })
    .expect("handed over");
    scrape(port).expect("arbiter metrics")
}

/// What a real device plugin exports (GPUs from a `--gpu-list` file, no kubelet).
fn device_plugin_metrics() -> String {
    let dir = tempfile::tempdir().unwrap();
    let list = dir.path().join("gpus");
    std::fs::write(
        &list,
        "0 GPU-5a1c0e2b-1111-4c2e-9a3f-000000000000 Test GPU\n",
    )
    .unwrap();
    let config = dir.path().join("empty.toml");
    std::fs::write(&config, "").unwrap();
    let port = free_port();
    let _plugin = Plugin(
        Command::new(bin("kiwi-device-plugin"))
            .arg("--kubelet-dir")
            .arg(dir.path())
            .arg("--gpu-list")
            .arg(&list)
            .arg("--metrics-addr")
            .arg(format!("127.0.0.1:{port}"))
            .env("KIWI_CONFIG", &config)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn kiwi-device-plugin"),
    );
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        if let Some(m) = scrape(port) {
            return m;
        }
        assert!(
            Instant::now() < deadline,
            "the device plugin never served /metrics"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn every_query_names_a_metric_the_daemons_export() {
    let arbiter = arbiter_metrics();
    let plugin = device_plugin_metrics();
    let mut exported = exported_names(&arbiter);
    exported.extend(exported_names(&plugin));
    // The derivation from `# TYPE` lines agrees with samples actually seen.
    for must in [
        "kiwi_grants_total",
        "kiwi_wait_seconds_bucket",
        "kiwi_swap_bytes_total",
        "kiwi_client_resident_bytes",
        "kiwi_device_plugin_healthy_gpus",
    ] {
        assert!(exported.contains(must), "{must} not in {exported:?}");
    }
    assert!(arbiter.contains("kiwi_swap_bytes_total{gpu=\"GPU-d\",direction=\"out\"}"));

    let check = |what: &str, exprs: &[String]| -> Vec<String> {
        let mut bad = Vec::new();
        for e in exprs {
            let names = metric_names(e);
            if names.is_empty() {
                bad.push(format!("{what}: selects no metric: {e}"));
            }
            for n in names {
                if !exported.contains(&n) {
                    bad.push(format!("{what}: {n} is not exported (in {e:?})"));
                }
            }
        }
        bad
    };

    // The checker itself: made-up names, a counter without `_total`, a
    // histogram's family name and a metric of another exporter are caught; labels,
    // variables, functions and keywords are not taken for metrics.
    for wrong in [
        "rate(kiwi_nope_total[5m])",
        "sum by (gpu) (kiwi_grants)",
        "kiwi_wait_seconds > 1",
        "up == 0",
    ] {
        assert!(!check("self-test", &[wrong.into()]).is_empty(), "{wrong}");
    }
    let fine = r#"histogram_quantile(0.9, sum by (gpu, le) (rate(kiwi_wait_seconds_bucket{gpu=~"$gpu"}[$__rate_interval]))) > on (gpu) group_left () 5 * kiwi_tq_seconds and on(gpu) kiwi_queue_length offset 5m"#;
    assert_eq!(
        metric_names(fine),
        [
            "kiwi_wait_seconds_bucket",
            "kiwi_tq_seconds",
            "kiwi_queue_length"
        ]
    );

    let text = std::fs::read_to_string(files().join("kiwi-dashboard.json")).unwrap();
    let dash: serde_json::Value = serde_json::from_str(&text).expect("the dashboard is JSON");
    assert_eq!(dash["uid"], "kiwi-gpu-sharing");
    let queries = dashboard_queries(&dash);
    assert!(queries.len() >= 20, "{queries:?}");
    let mut bad = check("dashboard", &queries);

    let rules = std::fs::read_to_string(files().join("kiwi-alerts.yaml")).unwrap();
    let exprs = rule_exprs(&rules);
    assert_eq!(
        exprs.len(),
        rules.matches("- alert:").count(),
        "one expr per alert: {exprs:?}"
    );
    bad.extend(check("alerts", &exprs));
    assert!(bad.is_empty(), "{}", bad.join("\n"));

    // What the issue asks the dashboard and the alerts to cover.
    let all = queries.join("\n");
    for m in [
        "kiwi_client_holding",
        "kiwi_wait_seconds_bucket",
        "kiwi_swap_bytes_total",
        "kiwi_early_releases_total",
        "kiwi_revocations_total",
        "kiwi_client_resident_bytes",
        "kiwi_client_swapped_bytes",
    ] {
        assert!(all.contains(m), "the dashboard does not show {m}");
    }
    let all = exprs.join("\n");
    for m in [
        "kiwi_client_waited_seconds",
        "kiwi_tq_seconds",
        "kiwi_swap_budget_bytes",
        "kiwi_device_plugin_healthy_gpus",
    ] {
        assert!(all.contains(m), "no alert on {m}");
    }
}

#[test]
fn the_alerts_pass_promtool() {
    if !require_tool("promtool") {
        return;
    }
    let tests = repo().join("deploy/tools/kiwi-alerts.test.yaml");
    for args in [vec!["check", "rules"], vec!["test", "rules"]] {
        let target = if args[0] == "check" {
            files().join("kiwi-alerts.yaml")
        } else {
            tests.clone()
        };
        let o = Command::new("promtool")
            .args(&args)
            .arg(&target)
            .current_dir(repo())
            .output()
            .expect("run promtool");
        assert!(
            o.status.success(),
            "promtool {args:?}:\n{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
    }
}
