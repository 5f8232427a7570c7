//! A C program compiled against NVIDIA's real `cuda.h` (fetched from the CUDA
//! runtime wheel on PyPI by `scripts/fetch-cuda-h.sh`) and linked with `-lcuda`
//! against the simulator runs correctly on it: the simulator's ABI (types, enum
//! values, struct layouts, symbol names) is the real driver's.

use std::path::PathBuf;
use std::process::Command;

use kiwi_sim_core::harness::{in_ci, SimMachine};
use kiwi_sim_core::knobs;

fn skip_or_fail(why: &str) {
    if in_ci() {
        panic!("{why}");
    }
    eprintln!("\n!!!!! SKIPPING c_program test: {why} (this fails under CI=true) !!!!!\n");
}

/// The include directory holding the real `cuda.h`, or `None` after a skip.
fn cuda_include() -> Option<String> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    if Command::new("gcc").arg("--version").output().is_err() {
        skip_or_fail("gcc is not installed (apt-get install gcc)");
        return None;
    }
    let fetch = Command::new("sh")
        .arg(root.join("scripts/fetch-cuda-h.sh"))
        .output()
        .expect("running scripts/fetch-cuda-h.sh");
    if !fetch.status.success() {
        skip_or_fail(&format!(
            "could not fetch cuda.h: {}",
            String::from_utf8_lossy(&fetch.stderr)
        ));
        return None;
    }
    Some(
        String::from_utf8_lossy(&fetch.stdout)
            .lines()
            .last()
            .expect("fetch-cuda-h prints the include dir")
            .trim()
            .to_string(),
    )
}

/// Compiles `tests/c/<name>` against `cuda.h`, linked with `-lcuda` against the
/// simulator, runs it on `m` and checks that it printed `OK`.
fn build_and_run(include: &str, m: &SimMachine, name: &str) {
    let exe = build(include, m, name);
    let run = m.apply(&mut Command::new(&exe)).output().unwrap();
    expect_ok(&run);
}

fn expect_ok(run: &std::process::Output) {
    let out = format!(
        "{}{}",
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr)
    );
    assert!(run.status.success(), "{out}");
    assert_eq!(String::from_utf8_lossy(&run.stdout).trim(), "OK", "{out}");
}

/// Compiles `tests/c/<name>` against `cuda.h`, linked with `-lcuda` against the
/// simulator; returns the executable (in `m`'s temporary directory).
fn build(include: &str, m: &SimMachine, name: &str) -> PathBuf {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let exe = m.trace.with_file_name(name.trim_end_matches(".c"));
    let cc = Command::new("gcc")
        .args(["-Wall", "-Werror", "-o"])
        .arg(&exe)
        .arg(root.join("sim/core/tests/c").join(name))
        .arg(format!("-I{include}"))
        .arg(format!("-L{}", m.sim_dir.display()))
        .args(["-lcuda", "-lpthread"])
        .output()
        .expect("running gcc");
    assert!(
        cc.status.success(),
        "gcc failed:\n{}",
        String::from_utf8_lossy(&cc.stderr)
    );
    exe
}

/// Managed memory takes device memory where it is (`tests/c/managed_memory.c`):
/// touched or prefetched blocks, not the allocation (issue #24, item 3).
#[test]
fn managed_memory_takes_device_memory_where_it_is() {
    let Some(include) = cuda_include() else {
        return;
    };
    let m = SimMachine::new("managed", 1, 1 << 30).unwrap_or_else(|e| panic!("{e}"));
    build_and_run(&include, &m, "managed_memory.c");
}

#[test]
fn c_program_built_against_real_cuda_h_runs_on_the_simulator() {
    let Some(include) = cuda_include() else {
        return;
    };
    let m = SimMachine::new("cprog", 2, 256 << 20).unwrap_or_else(|e| panic!("{e}"));
    build_and_run(&include, &m, "sim_smoke.c");
    // Its kernels went through the simulator's trace.
    let names: Vec<String> = m.read_trace().into_iter().map(|r| r.name).collect();
    for k in ["kiwi_fill", "kiwi_add", "kiwi_checksum", "kiwi_spin"] {
        assert!(names.iter().any(|n| n == k), "{k} not traced: {names:?}");
    }
}

/// Stream capture is as strict as the real driver: each rule of
/// `tests/c/capture_rules.c` (calls refused with
/// `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`, the capture invalidated, captured work
/// not run before launch) fails on a simulator that lets the call through.
#[test]
fn stream_capture_refuses_what_the_driver_refuses() {
    let Some(include) = cuda_include() else {
        return;
    };
    let m = SimMachine::new("capture", 1, 256 << 20).unwrap_or_else(|e| panic!("{e}"));
    build_and_run(&include, &m, "capture_rules.c");
}

/// The rows of the first table in `docs/gpu-validation.md` that follows `after`:
/// every line from its header (`| call |`) to its last row.
fn doc_table(doc: &str, after: &str) -> Vec<String> {
    let from = doc
        .find(after)
        .unwrap_or_else(|| panic!("docs/gpu-validation.md has no {after:?}"));
    doc[from..]
        .lines()
        .skip_while(|l| !l.starts_with("| call |"))
        .take_while(|l| l.starts_with('|'))
        .map(str::to_string)
        .collect()
}

/// The simulator refuses and invalidates during a stream capture exactly what the
/// real driver does: `tests/c/capture_table.c`, `scripts/gpu-capture-rules.py` in C
/// (the same 23 calls in the same four places: the capturing thread in a `GLOBAL`
/// and in a `THREAD_LOCAL` capture, another thread in `GLOBAL` and in `RELAXED`
/// mode), prints the table measured on an H100 (driver 580.159.04) and kept in
/// `docs/gpu-validation.md`, cell for cell: the call's result, the capture's status
/// after it, `cuStreamEndCapture`'s result.
#[test]
fn stream_capture_rules_match_the_table_measured_on_an_h100() {
    let Some(include) = cuda_include() else {
        return;
    };
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let doc = std::fs::read_to_string(root.join("docs/gpu-validation.md")).unwrap();
    let want = doc_table(&doc, "Calls made during a stream capture");
    assert_eq!(want.len(), 2 + 23, "the measured table: {want:#?}");
    let m = SimMachine::new("capture-table", 1, 256 << 20).unwrap_or_else(|e| panic!("{e}"));
    let exe = build(&include, &m, "capture_table.c");
    let run = m.apply(&mut Command::new(&exe)).output().unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout).to_string();
    let all = format!("{stdout}{}", String::from_utf8_lossy(&run.stderr));
    assert!(run.status.success(), "{all}");
    let got: Vec<String> = stdout
        .lines()
        .filter(|l| l.starts_with('|'))
        .map(str::to_string)
        .collect();
    let differ: Vec<String> = want
        .iter()
        .zip(&got)
        .filter(|(w, g)| w != g)
        .map(|(w, g)| format!("  driver:    {w}\n  simulator: {g}"))
        .collect();
    assert!(
        differ.is_empty() && got.len() == want.len(),
        "the simulator differs from the driver in {} rows:\n{}\n--- its output\n{all}",
        differ.len(),
        differ.join("\n")
    );
}

/// VMM mappings are reachable only from devices granted by `cuMemSetAccess`; IPC
/// refuses VMM memory; a non-blocking stream is not ordered with the legacy
/// stream (`tests/c/strict_rules.c`, each check failing on a lenient simulator).
#[test]
fn vmm_access_ipc_and_stream_ordering_are_strict() {
    let Some(include) = cuda_include() else {
        return;
    };
    let m = SimMachine::new("strict", 2, 256 << 20).unwrap_or_else(|e| panic!("{e}"));
    build_and_run(&include, &m, "strict_rules.c");
}

/// Shareable VMM memory crosses processes as with the real driver: created with the
/// POSIX fd handle type, exported, sent over a Unix socket, imported and mapped by
/// a second process whose writes the first sees; exports of handles created without
/// that type, other handle types, flags and foreign descriptors are refused
/// (`tests/c/shareable.c`).
#[test]
fn shareable_memory_crosses_processes_and_refuses_what_the_driver_refuses() {
    let Some(include) = cuda_include() else {
        return;
    };
    let m = SimMachine::new("shareable", 1, 256 << 20).unwrap_or_else(|e| panic!("{e}"));
    build_and_run(&include, &m, "shareable.c");
}

/// Each context costs device memory the application can never free or swap
/// (`KIWI_SIM_CONTEXT_MEMORY`, 300 MiB by default): `tests/c/context_memory.c`
/// sees it in `cuMemGetInfo`, cannot allocate past it, cannot create a context
/// that does not fit, and gets it back when a context is destroyed or reset.
#[test]
fn every_context_costs_device_memory() {
    let Some(include) = cuda_include() else {
        return;
    };
    // The library's default: 300 MiB (the harness sets a smaller value for the
    // other tests; see SimMachine::env).
    let m = SimMachine::new("ctxmem", 1, 1 << 30).unwrap_or_else(|e| panic!("{e}"));
    let exe = build(&include, &m, "context_memory.c");
    let run = m
        .apply(&mut Command::new(&exe))
        .env_remove("KIWI_SIM_CONTEXT_MEMORY")
        .args(["check", "300"])
        .output()
        .unwrap();
    expect_ok(&run);
    // Another size, set by the knob.
    let m = SimMachine::new("ctxmem", 1, 1 << 30)
        .unwrap_or_else(|e| panic!("{e}"))
        .with_env("KIWI_SIM_CONTEXT_MEMORY", "100MiB");
    let run = m
        .apply(&mut Command::new(&exe))
        .args(["check", "100"])
        .output()
        .unwrap();
    expect_ok(&run);
}

/// A process's context memory is accounted to it on the shared machine (another
/// process sees it used) and reclaimed when the process is killed, like its
/// allocations.
#[test]
fn a_killed_process_gives_its_context_memory_back() {
    use std::io::BufRead;
    let Some(include) = cuda_include() else {
        return;
    };
    let m = SimMachine::new("ctxkill", 1, 1 << 30)
        .unwrap_or_else(|e| panic!("{e}"))
        .with_env("KIWI_SIM_CONTEXT_MEMORY", "200MiB");
    let exe = build(&include, &m, "context_memory.c");
    /// Kills the holder even when an assertion fails (it never exits by itself).
    struct Holder(std::process::Child);
    impl Drop for Holder {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let mut holder = Holder(
        m.apply(&mut Command::new(&exe))
            .arg("hold")
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let mut line = String::new();
    std::io::BufReader::new(holder.0.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line.trim(), "READY");
    let machine = kiwi_sim_core::Machine::open_existing(&m.name)
        .unwrap()
        .expect("the holder created the machine");
    let u = machine.usage(0).unwrap();
    assert_eq!(u.used, 200 << 20, "{u:?}");
    assert_eq!(
        u.processes,
        vec![kiwi_sim_core::ProcessUsage {
            pid: holder.0.id(),
            bytes: 200 << 20
        }]
    );
    holder.0.kill().unwrap();
    holder.0.wait().unwrap();
    assert_eq!(machine.usage(0).unwrap().used, 0, "not reclaimed");
}

/// `cuMemCreate` and page-locking host memory (`cuMemHostAlloc`, `cuMemAllocHost`,
/// `cuMemHostRegister`) take wall time as the knobs say, and far less with the
/// knobs at 0 (so the checks fail on a simulator that does not pay the cost).
/// The knobs are set large here so that the modelled time dominates the host's own
/// work (populating the pages); their defaults are checked by the knobs' unit test.
#[test]
fn mem_create_and_pinning_take_the_modelled_time() {
    let Some(include) = cuda_include() else {
        return;
    };
    let m = SimMachine::new("timecost", 1, 256 << 20).unwrap_or_else(|e| panic!("{e}"));
    let exe = build(&include, &m, "time_costs.c");
    let times_with = |knobs: &[(&str, &str)], args: &[&str]| -> Vec<f64> {
        let mut cmd = Command::new(&exe);
        m.apply(&mut cmd);
        for (k, v) in knobs {
            cmd.env(k, v);
        }
        let run = cmd.args(args).output().unwrap();
        let out = String::from_utf8_lossy(&run.stdout).to_string();
        assert!(
            run.status.success(),
            "{out}{}",
            String::from_utf8_lossy(&run.stderr)
        );
        out.split_whitespace()
            .map(|t| t.parse().unwrap_or_else(|_| panic!("not a time: {out}")))
            .collect()
    };
    let times = |knob: &str, value: &str, args: &[&str]| times_with(&[(knob, value)], args);
    // 8 MiB = 4 pages of 2 MiB at 5 ms each.
    let on = times(
        "KIWI_SIM_MEMCREATE_US_PER_2MIB",
        "5000",
        &["memcreate", "8"],
    );
    let off = times_with(
        &[
            ("KIWI_SIM_MEMCREATE_US_PER_2MIB", "0"),
            ("KIWI_SIM_MEMCREATE_US", "0"),
        ],
        &["memcreate", "8"],
    );
    eprintln!("cuMemCreate of 8 MiB: {on:?} ms modelled, {off:?} ms without the cost");
    assert!(on[0] >= 20.0, "cuMemCreate took {} ms, not 20", on[0]);
    assert!(
        off[0] < 20.0,
        "without its cost cuMemCreate took {} ms",
        off[0]
    );
    // And the call's own cost, whatever the size: 8 ms for the one call.
    let call = times_with(
        &[
            ("KIWI_SIM_MEMCREATE_US_PER_2MIB", "0"),
            ("KIWI_SIM_MEMCREATE_US", "8000"),
        ],
        &["memcreate", "8"],
    );
    assert!(call[0] >= 8.0, "cuMemCreate took {} ms, not 8", call[0]);
    // The other VMM calls, 100 of each on 2 MiB handles, at their measured costs per
    // call (knobs::VMM_*), and free with cuMemCreate's cost off.
    let on = times_with(&[], &["vmm", "100"]);
    let off = times_with(&[("KIWI_SIM_MEMCREATE_US", "0")], &["vmm", "100"]);
    eprintln!("100 x (map, set-access, unmap, release): {on:?} ms modelled, {off:?} ms without");
    let want = [
        knobs::VMM_MAP_US,
        knobs::VMM_SET_ACCESS_US,
        knobs::VMM_UNMAP_US,
        knobs::VMM_RELEASE_US + knobs::VMM_RELEASE_US_PER_2MIB,
    ]
    .map(|us| 100.0 * us / 1e3);
    for (i, call) in ["cuMemMap", "cuMemSetAccess", "cuMemUnmap", "cuMemRelease"]
        .iter()
        .enumerate()
    {
        assert!(
            on[i] >= want[i],
            "100 {call} took {} ms, not {}",
            on[i],
            want[i]
        );
    }
    assert!(
        off[1] < want[1],
        "without the costs 100 cuMemSetAccess took {} ms",
        off[1]
    );
    // 16 MiB of fresh memory at 0.5 GB/s: 33.6 ms for each way of pinning it; of
    // memory touched before, registered at the populated-page rate (0.25 GB/s here,
    // so that it shows apart from the fresh rate): 67.1 ms.
    let want = 16.0 * 1048576.0 / 0.5e9 * 1e3;
    let want_touched = 16.0 * 1048576.0 / 0.25e9 * 1e3;
    let on = times_with(
        &[
            ("KIWI_SIM_PIN_GBPS", "0.5"),
            ("KIWI_SIM_PIN_POPULATED_GBPS", "0.25"),
        ],
        &["pin", "16"],
    );
    let off = times_with(
        &[
            ("KIWI_SIM_PIN_GBPS", "0"),
            ("KIWI_SIM_PIN_POPULATED_GBPS", "0"),
        ],
        &["pin", "16"],
    );
    eprintln!("pinning 16 MiB (HostAlloc, AllocHost, HostRegister touched, -, HostRegister fresh): {on:?} ms modelled, {off:?} ms without the cost");
    for (i, call, want) in [
        (0, "cuMemHostAlloc", want),
        (1, "cuMemAllocHost", want),
        (2, "cuMemHostRegister of touched memory", want_touched),
        (4, "cuMemHostRegister of fresh memory", want),
    ] {
        assert!(on[i] >= want, "{call} took {} ms, not {want}", on[i]);
        assert!(off[i] < want, "without its cost {call} took {} ms", off[i]);
    }
    // Registering never-touched memory page-locks it: all of it resident.
    assert_eq!(on[3], 1.0, "share of registered memory resident: {}", on[3]);
}

/// Each simulated GPU has one PCIe link, full duplex, shared by every process
/// (`tests/c/link_copies.c`): two processes copying host to device at once take
/// about twice as long as one alone (each direction is one queue), while one
/// copying host to device and one device to host at once take about as long as one
/// (the directions are independent). A simulator that paces each copy on its own
/// gives every copier the whole link and fails the first check.
#[test]
fn concurrent_copies_share_each_direction_of_the_pcie_link() {
    use std::io::{BufRead, BufReader, Write};
    let Some(include) = cuda_include() else {
        return;
    };
    // 128 MiB at 0.25 GB/s: 537 ms on the link, far above the host's own memcpy.
    const MIB: u64 = 128;
    let alone_ms = (MIB << 20) as f64 / 0.25e9 * 1e3;
    let m = SimMachine::new("link", 1, 1 << 30)
        .unwrap_or_else(|e| panic!("{e}"))
        .with_env("KIWI_SIM_PCIE_GBPS", "0.25")
        .with_env("KIWI_SIM_PIN_GBPS", "0");
    let exe = build(&include, &m, "link_copies.c");
    // Starts one process per direction, lets them all copy at once; returns the
    // time from the first copy's start to the last one's end, in ms.
    let together = |dirs: &[&str]| -> f64 {
        let mut kids: Vec<_> = dirs
            .iter()
            .map(|dir| {
                let mut c = m
                    .apply(&mut Command::new(&exe))
                    .args([dir.to_string(), MIB.to_string()])
                    .stdin(std::process::Stdio::piped())
                    .stdout(std::process::Stdio::piped())
                    .spawn()
                    .unwrap();
                let mut out = BufReader::new(c.stdout.take().unwrap());
                let mut line = String::new();
                out.read_line(&mut line).unwrap();
                assert_eq!(line.trim(), "READY", "{dir}: {line:?}");
                (c, out)
            })
            .collect();
        for (c, _) in &mut kids {
            writeln!(c.stdin.as_mut().unwrap(), "go").unwrap();
        }
        let (mut first, mut last) = (f64::MAX, 0f64);
        for (mut c, mut out) in kids {
            let mut line = String::new();
            out.read_line(&mut line).unwrap();
            assert!(c.wait().unwrap().success(), "a copier failed: {line:?}");
            let t: Vec<f64> = line
                .split_whitespace()
                .map(|t| t.parse().unwrap_or_else(|_| panic!("not times: {line:?}")))
                .collect();
            first = first.min(t[0]);
            last = last.max(t[1]);
        }
        last - first
    };
    let one = together(&["h2d"]);
    let same = together(&["h2d", "h2d"]);
    let both = together(&["h2d", "d2h"]);
    eprintln!(
        "{MIB} MiB at 0.25 GB/s ({alone_ms:.0} ms modelled): one H2D {one:.0} ms, \
         two H2D at once {same:.0} ms, H2D + D2H at once {both:.0} ms"
    );
    assert!(one >= alone_ms, "one copy took {one} ms, not {alone_ms}");
    assert!(
        same >= 1.8 * alone_ms,
        "two H2D copies at once took {same:.0} ms: each got the whole link"
    );
    assert!(
        both < 1.5 * alone_ms,
        "H2D + D2H at once took {both:.0} ms: the directions waited for each other"
    );
}

/// The driver's checkpoint API (`tests/c/checkpoint.c`): a parent locks, checkpoints,
/// restores and unlocks a child by pid; a lock waits for submitted work (and fails
/// within its timeout, leaving the child RUNNING); a call made while locked returns
/// after the unlock with every byte right; a checkpoint gives the GPU the child's
/// context, module and memory and costs the modelled time, a restore takes them back
/// (refused while they do not fit); every transition the driver refuses is refused
/// (wrong state, no CUDA state, managed memory, CUDA IPC, reserved fields); and a
/// driver without the API (`KIWI_SIM_CHECKPOINT=0`) refuses every call.
#[test]
fn checkpoint_api_moves_a_whole_process_off_the_gpu_and_back() {
    let Some(include) = cuda_include() else {
        return;
    };
    let m = SimMachine::new("ckpt", 1, 1 << 30)
        .unwrap_or_else(|e| panic!("{e}"))
        .with_env("KIWI_SIM_CHECKPOINT_MS", "40")
        .with_env("KIWI_SIM_CHECKPOINT_GBPS", "1")
        .with_env("KIWI_SIM_RESTORE_MS", "30")
        .with_env("KIWI_SIM_RESTORE_GBPS", "2");
    let exe = build(&include, &m, "checkpoint.c");
    expect_ok(&m.apply(&mut Command::new(&exe)).output().unwrap());
    let run = m
        .apply(&mut Command::new(&exe))
        .env("KIWI_SIM_CHECKPOINT", "0")
        .arg("off")
        .output()
        .unwrap();
    expect_ok(&run);
}
