//! Races and stale state (#13 item 5), with real processes on the GPU simulator under
//! a real `kiwi-arbiter`.
//!
//! Needs the workspace built (`cargo build --workspace --all-targets`), `gcc`, and
//! `cuda.h` (fetched once by `scripts/fetch-cuda-h.sh`).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use kiwi_protocol::EventKind;
use kiwi_sim_core::harness::SimMachine;
use kiwi_tests::{bin, profile_dir, require_tool, Arbiter};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The shim under test: `KIWI_TEST_SHIM` (to run a test against another build of
/// it, e.g. the last commit's), else the workspace's.
fn shim() -> PathBuf {
    std::env::var_os("KIWI_TEST_SHIM")
        .map(PathBuf::from)
        .unwrap_or_else(|| profile_dir().join("libkiwi.so"))
}

/// Compiles a driver-API program of `tests/c` against NVIDIA's cuda.h and the
/// simulator's libcuda; `None` (skip) when gcc is missing outside CI.
fn compile(name: &str, dir: &Path) -> Option<PathBuf> {
    if !require_tool("gcc") {
        return None;
    }
    let out = Command::new("sh")
        .arg(root().join("scripts/fetch-cuda-h.sh"))
        .output()
        .expect("run fetch-cuda-h.sh");
    assert!(out.status.success(), "fetch-cuda-h.sh failed");
    let include = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let sim_dir = kiwi_sim_core::ensure_sim_dir(&profile_dir()).expect("simulator built");
    let exe = dir.join(name);
    let st = Command::new("gcc")
        .args(["-O1", "-Wall", "-Werror", "-I", &include])
        .arg(root().join(format!("shim/tests/c/{name}.c")))
        .arg("-o")
        .arg(&exe)
        .arg("-L")
        .arg(&sim_dir)
        .arg("-lcuda")
        .status()
        .expect("gcc");
    assert!(st.success(), "compiling {name}.c");
    Some(exe)
}

fn finish(child: Child) -> Output {
    let pid = child.id() as i32;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(Duration::from_secs(120)) {
        Ok(o) => o.expect("wait for child"),
        Err(_) => {
            // SAFETY: kill(2) on our own child's pid.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            panic!("pid {pid} hung for 120 s");
        }
    }
}

fn text(o: &Output) -> String {
    format!(
        "status {:?}\n--- stdout\n{}--- stderr\n{}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn under_kiwi<'a>(c: &'a mut Command, m: &SimMachine, arb: &Arbiter) -> &'a mut Command {
    m.apply(c)
        .env("LD_PRELOAD", shim())
        .env("KIWI_SOCKET_DIR", arb.socket_dir())
        .env("KIWI_REQUIRE_ARBITER", "1")
        .env("KIWI_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
}

/// A program that destroyed a context before working is dropped for a program over
/// capacity with it: the shim swaps and drains in the live context, so both take
/// turns and keep every byte. With the first context remembered for ever, the
/// swap-out ran in no context (CUDA error 201): nothing was swapped and the other
/// program never fit.
fn context_churn_then_forced_drops(mode: &str) {
    let dir = tempfile::tempdir().unwrap();
    let Some(exe) = compile("ctx_churn", dir.path()) else {
        return;
    };
    let m = SimMachine::new(&format!("churn-{mode}"), 1, 1 << 30).unwrap();
    let arb = Arbiter::start(&["--tq", "0.3"]);
    let mut a = Command::new(&exe);
    let a = under_kiwi(a.args([mode, "500", "20"]), &m, &arb)
        .spawn()
        .expect("spawn ctx_churn");
    std::thread::sleep(Duration::from_millis(300));
    let mut b = Command::new(bin("gpuburst"));
    let b = under_kiwi(
        b.args([
            "--mem", "500MiB", "--bursts", "4", "--gpu-ms", "100", "--cpu-ms", "20", "--verify",
        ]),
        &m,
        &arb,
    )
    .spawn()
    .expect("spawn gpuburst");
    let pa = a.id();
    let (oa, ob) = (finish(a), finish(b));
    assert_eq!(oa.status.code(), Some(0), "{}", text(&oa));
    assert!(String::from_utf8_lossy(&oa.stdout).contains("OK"));
    assert_eq!(ob.status.code(), Some(0), "{}", text(&ob));
    let events = arb.events();
    let ca = events
        .iter()
        .find_map(|e| match e.kind {
            EventKind::Register { pid, .. } if pid == pa => e.client,
            _ => None,
        })
        .expect("the program registered");
    let out: u64 = events
        .iter()
        .filter(|e| e.client == Some(ca))
        .filter_map(|e| match e.kind {
            EventKind::SwapOut { bytes, .. } => Some(bytes),
            _ => None,
        })
        .sum();
    assert!(
        out >= 100 << 20,
        "the program swapped out {out} bytes\n{}\n{}",
        text(&oa),
        text(&ob)
    );
}

#[test]
fn a_destroyed_context_then_forced_drops_swaps_in_the_live_context() {
    context_churn_then_forced_drops("destroy");
}
