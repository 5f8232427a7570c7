//! libkiwi.so with a driver proxy below it, and the entry points the simulator lacks.
//!
//! `shim/tests/c/logging_proxy.c` is built here as a `libcuda.so.1` that forwards to
//! the simulator through `dlsym` on the simulator's handle (a tracing proxy, as
//! found in front of real drivers) and, for the array test, gives the driver arrays
//! (the simulator has none). Real processes, the real `kiwi-arbiter`, the shim
//! preloaded. Needs the workspace built, `gcc`, `nm` and `cuda.h`
//! (`scripts/fetch-cuda-h.sh`).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use kiwi_protocol::EventKind;
use kiwi_tests::{profile_dir, require_tool, Arbiter};

struct Env {
    shim: PathBuf,
    sim_dir: PathBuf,
    /// The proxy `libcuda.so.1` (forwarding only) and the one that also has arrays.
    proxy_dir: PathBuf,
    array_proxy_dir: PathBuf,
    probe: PathBuf,
    array_copy: PathBuf,
    _tmp: tempfile::TempDir,
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

fn gcc(args: &[&dyn AsRef<std::ffi::OsStr>]) {
    let mut c = Command::new("gcc");
    for a in args {
        c.arg(a);
    }
    let o = c.output().expect("gcc");
    assert!(
        o.status.success(),
        "gcc {:?}: {}",
        c.get_args().collect::<Vec<_>>(),
        String::from_utf8_lossy(&o.stderr)
    );
}

fn setup() -> Option<Env> {
    if !require_tool("gcc") || !require_tool("nm") {
        return None;
    }
    let profile = profile_dir();
    let shim = profile.join("libkiwi.so");
    assert!(shim.exists(), "{} is missing: build first", shim.display());
    let sim_dir = kiwi_sim_core::ensure_sim_dir(&profile).expect("simulator built");
    let out = Command::new("sh")
        .arg(root().join("scripts/fetch-cuda-h.sh"))
        .output()
        .expect("fetch-cuda-h.sh");
    assert!(out.status.success(), "fetch-cuda-h.sh failed");
    let include = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    let tmp = tempfile::tempdir().unwrap();
    // One forwarder per cu* symbol the simulator exports.
    let nm = Command::new("nm")
        .args(["-D", "--defined-only"])
        .arg(sim_dir.join("libcuda.so.1"))
        .output()
        .expect("nm");
    assert!(nm.status.success());
    let fwd: String = String::from_utf8_lossy(&nm.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().nth(2))
        .map(|s| s.split('@').next().unwrap())
        .filter(|s| s.starts_with("cu"))
        .map(|s| format!("FWD({s})\n"))
        .collect();
    assert!(fwd.contains("FWD(cuInit)") && fwd.contains("FWD(cuMemCreate)"));
    let fwd_file = tmp.path().join("forwarders.h");
    std::fs::write(&fwd_file, fwd).unwrap();
    let define = format!("-DFORWARDERS=\"{}\"", fwd_file.display());
    let src = root().join("shim/tests/c/logging_proxy.c");
    let proxy_dir = tmp.path().join("proxy");
    let array_proxy_dir = tmp.path().join("array-proxy");
    for (dir, extra) in [
        (&proxy_dir, "-DKIWI_NOTHING"),
        (&array_proxy_dir, "-DKIWI_PROXY_ARRAYS"),
    ] {
        std::fs::create_dir_all(dir).unwrap();
        let so = dir.join("libcuda.so.1");
        gcc(&[
            &"-O1",
            &"-Wall",
            &"-Werror",
            &"-shared",
            &"-fPIC",
            &"-Wl,-soname,libcuda.so.1",
            &define,
            &extra,
            &src,
            &"-o",
            &so,
            &"-ldl",
        ]);
    }
    let probe = tmp.path().join("probe");
    gcc(&[
        &"-O1",
        &"-I",
        &include,
        &root().join("shim/tests/c/probe.c"),
        &"-o",
        &probe,
        &"-L",
        &sim_dir,
        &"-lcuda",
        &"-ldl",
    ]);
    // Linked against the proxy with arrays: the simulator has no cuArrayCreate.
    let array_copy = tmp.path().join("array_copy");
    gcc(&[
        &"-O1",
        &"-Wall",
        &"-Werror",
        &"-I",
        &include,
        &root().join("shim/tests/c/array_copy.c"),
        &"-o",
        &array_copy,
        &array_proxy_dir.join("libcuda.so.1"),
    ]);
    Some(Env {
        shim,
        sim_dir,
        proxy_dir,
        array_proxy_dir,
        probe,
        array_copy,
        _tmp: tmp,
    })
}

impl Env {
    /// `exe args` on the simulator `sim_name`, preloaded with the shim, with `proxy`
    /// (if any) first on the library path as `libcuda.so.1`.
    fn command(
        &self,
        exe: &Path,
        args: &[&str],
        sim_name: &str,
        proxy: Option<&Path>,
        arb: &Arbiter,
    ) -> Command {
        let lib_path = match proxy {
            Some(p) => format!("{}:{}", p.display(), self.sim_dir.display()),
            None => self.sim_dir.display().to_string(),
        };
        let mut c = Command::new(exe);
        c.args(args)
            .env("LD_LIBRARY_PATH", lib_path)
            .env("LD_PRELOAD", &self.shim)
            .env("KIWI_TEST_REAL_LIBCUDA", self.sim_dir.join("libcuda.so.1"))
            .env(
                "KIWI_SIM_NAME",
                format!("{sim_name}-{}", std::process::id()),
            )
            .env("KIWI_SIM_MEMORY", "1GiB")
            .env(
                "KIWI_SIM_CONTEXT_MEMORY",
                format!(
                    "{}MiB",
                    kiwi_sim_core::harness::suite_context_memory(1 << 30) >> 20
                ),
            )
            .env("KIWI_SOCKET_DIR", arb.socket_dir())
            .env("KIWI_LOG", "info")
            .env_remove("KIWI_REAL_LIBCUDA")
            .env_remove("KIWI_REQUIRE_ARBITER")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        c
    }
}

/// Waits for a child, killing it (and failing) after `limit`.
fn finish(child: Child, limit: Duration) -> Output {
    let pid = child.id() as i32;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(limit) {
        Ok(o) => o.expect("wait"),
        Err(_) => {
            // SAFETY: kill(2) on our own child's pid.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            panic!("pid {pid} hung for {limit:?}");
        }
    }
}

fn text(o: &Output) -> String {
    format!(
        "status {:?}\n--- stdout\n{}--- stderr\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn client_of(arb: &Arbiter, pid: u32) -> Option<u64> {
    arb.events().iter().find_map(|e| match &e.kind {
        EventKind::Register { pid: p, .. } if *p == pid => e.client,
        _ => None,
    })
}

fn wait_for(what: &str, limit: Duration, mut f: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !f() {
        assert!(t0.elapsed() < limit, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_driver_proxy_below_the_shim_gets_the_drivers_own_functions() {
    let Some(env) = setup() else { return };
    let arb = Arbiter::start(&["--tq", "0.5"]);
    // A through the proxy, B straight on the simulator: 700 + 700 MiB on 1 GiB, so
    // they take turns and A's memory is swapped out and back.
    let args = ["link", "700", "3", "200", "100", "0"];
    let a = env
        .command(&env.probe, &args, "proxy", Some(&env.proxy_dir), &arb)
        .spawn()
        .unwrap();
    let a_pid = a.id();
    std::thread::sleep(Duration::from_millis(300));
    let b = env
        .command(&env.probe, &args, "proxy", None, &arb)
        .spawn()
        .unwrap();
    let (oa, ob) = (
        finish(a, Duration::from_secs(120)),
        finish(b, Duration::from_secs(120)),
    );
    let ea = String::from_utf8_lossy(&oa.stderr).to_string();
    assert!(
        !ea.contains("recursed"),
        "the proxy was handed the shim's wrappers: {}",
        text(&oa)
    );
    assert_eq!(oa.status.code(), Some(0), "A (proxy): {}", text(&oa));
    assert_eq!(ob.status.code(), Some(0), "B: {}", text(&ob));
    assert!(String::from_utf8_lossy(&oa.stdout).contains("\nOK\n"));
    // The application still reached the shim (its wrappers, its allocator); the
    // proxy saw the shim's VMM calls, never the application's cuMemAlloc_v2.
    assert!(
        String::from_utf8_lossy(&oa.stdout).contains("resolve cuLaunchKernel libkiwi.so"),
        "{}",
        text(&oa)
    );
    for call in [
        "proxy: cuInit",
        "proxy: cuMemCreate",
        "proxy: cuMemMap",
        "proxy: cuLaunchKernel",
    ] {
        assert!(ea.contains(call), "{call} missing: {}", text(&oa));
    }
    assert!(
        !ea.contains("proxy: cuMemAlloc_v2"),
        "the application's allocation bypassed the shim: {}",
        text(&oa)
    );
    // Managed, and its memory was swapped (the allocation is the shim's).
    let id = client_of(&arb, a_pid).expect("A registered");
    let swapped_out: u64 = arb
        .events()
        .iter()
        .filter(|e| e.client == Some(id))
        .filter_map(|e| match e.kind {
            EventKind::SwapOut { bytes, .. } => Some(bytes),
            _ => None,
        })
        .sum();
    assert!(
        swapped_out >= 500 << 20,
        "A (through the proxy) swapped out only {swapped_out} bytes"
    );
}

#[test]
fn an_array_copy_waits_for_the_turn() {
    let Some(env) = setup() else { return };
    let arb = Arbiter::start(&["--tq", "1"]);
    // A holds the GPU with 700 MiB and 5 × 300 ms of kernels.
    let a = env
        .command(
            &env.probe,
            &["link", "700", "5", "300", "0", "0"],
            "array",
            None,
            &arb,
        )
        .spawn()
        .unwrap();
    let a_id = {
        let pid = a.id();
        let mut id = None;
        wait_for("A's registration", Duration::from_secs(30), || {
            id = client_of(&arb, pid);
            id.is_some()
        });
        id.unwrap()
    };
    wait_for("A's grant", Duration::from_secs(30), || {
        arb.events()
            .iter()
            .any(|e| e.client == Some(a_id) && matches!(e.kind, EventKind::Grant { .. }))
    });
    // B: 400 MiB of its own (does not fit beside A), then a host-to-array copy.
    let b = env
        .command(
            &env.array_copy,
            &["400"],
            "array",
            Some(&env.array_proxy_dir),
            &arb,
        )
        .spawn()
        .unwrap();
    let ob = finish(b, Duration::from_secs(60));
    let oa = finish(a, Duration::from_secs(60));
    assert_eq!(oa.status.code(), Some(0), "A: {}", text(&oa));
    assert_eq!(ob.status.code(), Some(0), "B: {}", text(&ob));
    let out = String::from_utf8_lossy(&ob.stdout).to_string();
    let field = |k: &str| -> u64 {
        out.lines()
            .find_map(|l| l.strip_prefix(k)?.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {k}: {}", text(&ob)))
    };
    let (called, returned) = (field("called_ns "), field("returned_ns "));
    assert!(
        String::from_utf8_lossy(&ob.stderr).contains("proxy: cuMemcpyHtoD_v2 (for arrays)"),
        "the copy reached the driver: {}",
        text(&ob)
    );
    let released = arb
        .events()
        .iter()
        .find(|e| e.client == Some(a_id) && matches!(e.kind, EventKind::Release { .. }))
        .map(|e| e.t_ns)
        .expect("A released the GPU");
    println!(
        "array copy called {:.3} s before A's release, returned {:.3} s after it",
        released.saturating_sub(called) as f64 / 1e9,
        returned.saturating_sub(released) as f64 / 1e9
    );
    assert!(
        called < released,
        "B copied only after A released: nothing to prove"
    );
    assert!(
        returned >= released,
        "B's array copy returned {:.3} s before A released the GPU: it escaped the gate",
        (released - returned) as f64 / 1e9
    );
}
