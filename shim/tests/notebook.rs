//! The `kiwi` Python package (`python/`) with real Python: a notebook-like script run
//! under `kiwictl run` on the GPU simulator, behind a real `gpuburst` holding the GPU
//! under a real `kiwi-arbiter`. It reads `kiwi.status()` while it waits and once it
//! holds, and its `%load_ext kiwi` hooks show the live line and the summary. Without
//! the shim the package says so and does nothing; `pip install ./python` works
//! offline.
//!
//! The simulated contexts cost no GPU memory here (`KIWI_SIM_CONTEXT_MEMORY=0`): the
//! subject is the wait, and 1 GiB holds one 700 MiB program at a time either way.
//!
//! Needs the workspace built first (`cargo build --workspace --all-targets`) and
//! `python3` (with pip for the install test).

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use kiwi_tests::{profile_dir, require_tool, Arbiter};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

fn python_dir() -> PathBuf {
    root().join("python")
}

fn sim_dir() -> PathBuf {
    kiwi_sim_core::ensure_sim_dir(&profile_dir()).expect("simulator built")
}

fn text(o: &Output) -> String {
    format!(
        "status {:?}\nstdout: {}\nstderr: {}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// The notebook-like script under `kiwictl run`, with `python/` on PYTHONPATH (or
/// `pythonpath` when given), on simulated machine `sim`.
fn notebook(arb: &Arbiter, sim: &str, env: &[(&str, &str)]) -> Command {
    let mut c = Command::new(kiwi_tests::bin("kiwictl"));
    c.arg("--socket-dir")
        .arg(arb.socket_dir())
        .args(["run", "--", "python3"])
        .arg(root().join("shim/tests/py/notebook_cell.py"))
        .env("PYTHONPATH", python_dir())
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env("LD_LIBRARY_PATH", sim_dir())
        .env("KIWI_SIM_NAME", sim)
        .env("KIWI_SIM_MEMORY", "1GiB")
        .env("KIWI_SIM_CONTEXT_MEMORY", "0")
        .env_remove("KIWI_LOG")
        .env_remove("LD_PRELOAD")
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c
}

/// A 700 MiB `gpuburst` that holds the GPU for a 2.5 s burst (pod `nb-a`).
fn holder(arb: &Arbiter, sim: &str) -> std::process::Child {
    Command::new(kiwi_tests::bin("gpuburst"))
        .args([
            "--mem", "700MiB", "--bursts", "1", "--gpu-ms", "2500", "--cpu-ms", "0",
        ])
        .env("LD_LIBRARY_PATH", sim_dir())
        .env("KIWI_SIM_NAME", sim)
        .env("KIWI_SIM_MEMORY", "1GiB")
        .env("KIWI_SIM_CONTEXT_MEMORY", "0")
        .env("LD_PRELOAD", profile_dir().join("libkiwi.so"))
        .env("KIWI_SOCKET_DIR", arb.socket_dir())
        .env("KIWI_POD_NAME", "nb-a")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Runs the notebook behind a holder; returns the script's JSON and stderr. The
/// notebook starts first and waits at its start gate with everything but the cell
/// done (Python's and IPython's imports took over 2 s on a loaded machine: started
/// after the holder, the notebook found the holder's quantum spent and waited only
/// for its swap-out, too short for the live line); the holder then takes the GPU,
/// and once its quantum runs the cell asks for the GPU and waits it out.
fn run_behind_holder(tag: &str, env: &[(&str, &str)]) -> (serde_json::Value, String) {
    let arb = Arbiter::start(&["--tq", "2"]);
    let sim = format!("notebook-{tag}-{}", std::process::id());
    let mut nb = notebook(&arb, &sim, env)
        .env("KIWI_TEST_GATE", "1")
        .stdin(Stdio::piped())
        .spawn()
        .unwrap();
    kiwi_tests::read_stdout_until(&mut nb, "READY");
    let a = holder(&arb, &sim);
    // The holder's memory resident, so its quantum runs (before that, its quantum's
    // end is only bounded by the arbiter's 5 s grace: a loaded machine backing 700
    // MiB slowly made the notebook read ~5 s left).
    kiwi_tests::wait_until("the holder resident", Duration::from_secs(30), || {
        arb.status().gpus.first().is_some_and(|g| {
            g.clients
                .iter()
                .any(|c| c.working_set_bytes > 0 && c.resident_bytes == c.working_set_bytes)
        })
    });
    {
        use std::io::Write;
        let mut gate = nb.stdin.take().expect("stdin piped");
        gate.write_all(b"go\n").unwrap();
    }
    let o = nb.wait_with_output().unwrap();
    let oa = a.wait_with_output().unwrap();
    let _ = kiwi_sim_core::machine::reset(&sim);
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        oa.status.success(),
        "holder: {}",
        String::from_utf8_lossy(&oa.stderr)
    );
    let stdout = String::from_utf8_lossy(&o.stdout);
    let json = stdout
        .lines()
        .last()
        .and_then(|l| serde_json::from_str(l).ok())
        .unwrap_or_else(|| panic!("no JSON from the script: {}", text(&o)));
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    eprintln!("{tag}: {json}\nstderr:\n{err}");
    (json, err)
}

fn check_status(v: &serde_json::Value, all: &str) {
    assert_eq!(v["available"], true, "{all}");
    assert_eq!(v["before_cuda"], serde_json::json!([]), "{all}");
    // While the cell waited: the GPU, who holds it, the place, the time left.
    let w = &v["waiting"];
    assert_eq!(w["index"], 0, "{all}");
    assert!(
        w["uuid"].as_str().unwrap_or("").starts_with("GPU-"),
        "{all}"
    );
    assert_eq!(w["waiting"], true, "{all}");
    assert_eq!(w["holding"], false, "{all}");
    assert_eq!(w["holder"], "nb-a", "{all}");
    assert_eq!(w["ahead"], 0, "{all}");
    let left = w["quantum_left_s"].as_f64().unwrap_or(-1.0);
    assert!((0.0..=2.0).contains(&left), "{all}");
    // The time left, or, sampled as the quantum ends (a loaded machine), the
    // hand-off under way.
    let reason = w["reason"].as_str().unwrap_or("");
    assert!(
        reason.starts_with("nb-a holds it, ~")
            || (left == 0.0 && reason.starts_with("nb-a holds it, giving it back now")),
        "{all}"
    );
    // Once it holds: resident, nothing swapped, the wait and the hold counted.
    let h = &v["after"][0];
    assert_eq!(h["holding"], true, "{all}");
    assert_eq!(h["waiting"], false, "{all}");
    assert_eq!(h["holder"], serde_json::Value::Null, "{all}");
    assert!(
        h["resident_bytes"].as_u64().unwrap_or(0) >= 700 << 20,
        "{all}"
    );
    assert_eq!(h["swapped_bytes"], 0, "{all}");
    // It waited out the holder's quantum from when it started waiting (a loaded
    // machine starts the notebook later into that quantum: 0.8 s were left once).
    assert!(
        h["waited_s"].as_f64().unwrap_or(0.0) >= left - 0.25,
        "{all}"
    );
    assert!(h["held_s"].as_f64().unwrap_or(0.0) > 0.0, "{all}");
    assert!(h["grants"].as_u64().unwrap_or(0) >= 1, "{all}");
}

fn check_lines(err: &str, all: &str) {
    // The live line, updated in place with carriage returns, then cleared.
    assert!(
        err.contains("\rwaiting for GPU 0: nb-a holds it, ~"),
        "{all}"
    );
    assert!(err.contains(" left, you are next"), "{all}");
    // The shim's own wait lines are silenced while the extension shows its own.
    assert!(!err.contains("[kiwi] info"), "{all}");
    // One summary line after the cell.
    let summary: Vec<&str> = err
        .lines()
        .filter(|l| l.contains("kiwi: this cell waited "))
        .collect();
    assert_eq!(summary.len(), 1, "{all}");
    assert!(summary[0].contains(" s for GPU 0 (nb-a held it)"), "{all}");
}

#[test]
fn a_notebook_cell_that_waits_shows_who_holds_the_gpu_and_a_summary() {
    if !require_tool("python3") {
        return;
    }
    let (v, err) = run_behind_holder("fake-ip", &[]);
    let all = format!("{v:#}\nstderr:\n{err}");
    assert_eq!(v["loaded"], true, "{all}");
    assert_eq!(
        v["hooks"],
        serde_json::json!(["post_run_cell", "pre_run_cell"]),
        "{all}"
    );
    assert_eq!(v["hooks_after_unload"], 0, "{all}");
    check_status(&v, &all);
    check_lines(&err, &all);
}

/// The same with a real IPython shell (`%load_ext kiwi`, `run_cell`), when IPython
/// is installed (CI installs it: .ci/pip-packages).
#[test]
fn real_ipython_load_ext_kiwi_shows_the_wait() {
    if !require_tool("python3") {
        return;
    }
    let has_ipython = Command::new("python3")
        .args(["-c", "import IPython"])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !has_ipython {
        if std::env::var("CI").is_ok_and(|v| v == "true") {
            panic!("IPython is required by this test (CI installs it from .ci/pip-packages)");
        }
        eprintln!("SKIPPED: IPython is not installed (CI=true would fail this test)");
        return;
    }
    let (v, err) = run_behind_holder("ipython", &[("KIWI_TEST_IPYTHON", "1")]);
    let all = format!("{v:#}\nstderr:\n{err}");
    assert_eq!(v["ipython_ok"], true, "{all}");
    check_status(&v, &all);
    check_lines(&err, &all);
}

#[test]
fn without_the_shim_the_package_says_so_and_does_nothing() {
    if !require_tool("python3") {
        return;
    }
    let script = r#"
import io, kiwi
assert kiwi.available() is False
try:
    kiwi.status()
    raise SystemExit("status() did not raise")
except kiwi.KiwiNotLoaded as e:
    print("status:", e)
class Events:
    n = 0
    def register(self, name, fn):
        Events.n += 1
class IP:
    events = Events()
out = io.StringIO()
assert kiwi.load_ipython_extension(IP(), stream=out) is False
assert Events.n == 0, "registered hooks"
print("ext:", out.getvalue().strip())
"#;
    let o = Command::new("python3")
        .args(["-c", script])
        .env("PYTHONPATH", python_dir())
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env_remove("LD_PRELOAD")
        .output()
        .unwrap();
    let all = text(&o);
    assert!(o.status.success(), "{all}");
    let s = String::from_utf8_lossy(&o.stdout);
    assert!(
        s.contains("status: libkiwi.so is not loaded in this process"),
        "{all}"
    );
    assert!(
        s.contains("ext: kiwi: libkiwi.so is not loaded in this process")
            && s.contains("the extension does nothing"),
        "{all}"
    );
}

/// `pip install ./python` builds the wheel with the package's own stdlib backend:
/// no network, no setuptools.
#[test]
fn pip_installs_the_package_offline() {
    if !require_tool("python3") {
        return;
    }
    let has_pip = Command::new("python3")
        .args(["-m", "pip", "--version"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !has_pip {
        if std::env::var("CI").is_ok_and(|v| v == "true") {
            panic!("pip is required by this test (CI installs python3-pip)");
        }
        eprintln!("SKIPPED: pip is not installed");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // A copy: pip may write build files next to the sources.
    let src = dir.path().join("src");
    std::fs::create_dir_all(src.join("kiwi")).unwrap();
    for f in ["pyproject.toml", "_kiwi_build.py", "kiwi/__init__.py"] {
        std::fs::copy(python_dir().join(f), src.join(f)).unwrap();
    }
    let target = dir.path().join("site");
    let o = Command::new("python3")
        .args([
            "-m",
            "pip",
            "install",
            "--no-index",
            "--disable-pip-version-check",
            "--quiet",
            "--target",
        ])
        .arg(&target)
        .arg(&src)
        .env("PIP_NO_INPUT", "1")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let o = Command::new("python3")
        .args([
            "-c",
            "import kiwi, importlib.metadata as m; print(kiwi.__file__, kiwi.available(), m.version('kiwi-gpu'))",
        ])
        .env("PYTHONPATH", &target)
        .env_remove("LD_PRELOAD")
        .current_dir(dir.path())
        .output()
        .unwrap();
    let s = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        s.starts_with(&target.join("kiwi").display().to_string())
            && s.trim_end().ends_with("False 0.1.0"),
        "{}",
        text(&o)
    );
}
