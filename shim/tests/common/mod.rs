//! Helpers the shim's end-to-end tests share: the shim under test, driver-API C
//! programs of `tests/c` built against NVIDIA's cuda.h, running them under Kiwi, and
//! waiting for them with a limit.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use kiwi_tests::{profile_dir, require_tool, Arbiter};

pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The shim under test: `KIWI_TEST_SHIM` (to run a test against another build of
/// it, e.g. the last commit's), else the workspace's.
pub fn shim() -> PathBuf {
    std::env::var_os("KIWI_TEST_SHIM")
        .map(PathBuf::from)
        .unwrap_or_else(|| profile_dir().join("libkiwi.so"))
}

/// Compiles a driver-API program of `tests/c` against NVIDIA's cuda.h and the
/// simulator's libcuda; `None` (skip) when gcc is missing outside CI.
pub fn compile(name: &str, dir: &Path) -> Option<PathBuf> {
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

pub fn finish(child: Child) -> Output {
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

pub fn text(o: &Output) -> String {
    format!(
        "status {:?}\n--- stdout\n{}--- stderr\n{}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// `c` under Kiwi: the shim under test preloaded, `arb`'s socket, the arbiter required,
/// output piped.
pub fn under_kiwi<'a>(c: &'a mut Command, arb: &Arbiter) -> &'a mut Command {
    c.env("LD_PRELOAD", shim())
        .env("KIWI_SOCKET_DIR", arb.socket_dir())
        .env("KIWI_REQUIRE_ARBITER", "1")
        .env("KIWI_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
}

/// [`under_kiwi`] on the simulated machine `m`.
pub fn under_kiwi_on<'a>(
    c: &'a mut Command,
    m: &kiwi_sim_core::harness::SimMachine,
    arb: &Arbiter,
) -> &'a mut Command {
    under_kiwi(m.apply(c), arb)
}
