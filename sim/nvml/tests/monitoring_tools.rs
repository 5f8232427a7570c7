//! The monitoring tools people run first, from PyPI, against the simulator's NVML
//! (issue #39): pynvml (`nvidia-ml-py`), `nvitop -1` and `gpustat --json`, each run
//! as a real process on a machine of its own with two 2 GiB GPUs, where a process
//! (`tests/tools/hold_memory.py`, through the simulator's `libcuda.so.1`) holds a
//! context and 256 MiB on GPU 1. Each tool must show both GPUs by name, each GPU's
//! memory as the machine segment counts it (the figure `cuMemGetInfo` gives the
//! holder), and the holder's pid and memory on GPU 1 and no process on GPU 0; it must
//! not fail on any symbol it looks up (a missing one is `FunctionNotFound` to pynvml,
//! which gpustat does not survive and nvitop logs as an error).
//!
//! The tools are pinned in `.ci/pip-packages` and run as `python3 -m <tool>`, the
//! interpreter `.ci/run` installs them for. A missing one fails the test under
//! `CI=true` and is skipped loudly otherwise.
//!
//! Cargo builds no cdylib for its own crate's integration tests, so the first test
//! builds both simulator libraries (`cargo build -p kiwi-sim-nvml -p kiwi-sim-cuda`,
//! this test's profile and target directory): the tools never read a stale NVML.

use std::io::{BufRead, BufReader, Read};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Output, Stdio};
use std::sync::OnceLock;

use kiwi_sim_core::harness::{in_ci, SimMachine};
use kiwi_sim_core::{ident, profile_dir_of_current_exe, GpuUsage, Machine};
use serde_json::Value;

const MIB: u64 = 1 << 20;
const GPU_MEMORY: u64 = 2 << 30;
/// The GPU the holder allocates on, and how much.
const HELD_GPU: u32 = 1;
const HELD_BYTES: u64 = 256 * MIB;
/// How long one tool may run before the test gives up on it.
const TOOL_TIMEOUT_S: &str = "120";

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn tools_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/tools")
}

/// Whether `python3` can import each module; if not, fails under `CI=true` and
/// otherwise prints a loud skip line and returns false.
fn python_modules_or_skip(test: &str, modules: &[&str]) -> bool {
    for module in modules {
        let found = Command::new("python3")
            .args(["-c", &format!("import {module}")])
            .output();
        let why = match found {
            Ok(o) if o.status.success() => continue,
            Ok(o) => format!(
                "python3 cannot import {module} (pip install -r .ci/pip-packages): {}",
                String::from_utf8_lossy(&o.stderr).trim()
            ),
            Err(e) => format!("python3 is not installed: {e}"),
        };
        if in_ci() {
            panic!("{test}: {why}");
        }
        eprintln!("\n!!!!! SKIPPING {test}: {why} (this fails under CI=true) !!!!!\n");
        return false;
    }
    true
}

/// Builds both simulator cdylibs once per test binary, with the profile and target
/// directory the test was built with (`target/<profile>/deps/<test>`).
fn build_simulator() {
    static BUILT: OnceLock<Result<(), String>> = OnceLock::new();
    let built = BUILT.get_or_init(|| {
        let profile_dir = profile_dir_of_current_exe().map_err(|e| e.to_string())?;
        let target_dir = profile_dir.parent().ok_or("no target directory")?;
        let profile = match profile_dir.file_name().and_then(|n| n.to_str()) {
            Some("debug") => "dev",
            Some(p) => p,
            None => return Err("no profile directory".into()),
        };
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let out = Command::new(cargo)
            .args(["build", "-p", "kiwi-sim-nvml", "-p", "kiwi-sim-cuda"])
            .args(["--profile", profile, "--target-dir"])
            .arg(target_dir)
            .current_dir(root())
            .output()
            .map_err(|e| format!("running cargo: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "cargo build -p kiwi-sim-nvml -p kiwi-sim-cuda failed:\n{}",
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        Ok(())
    });
    if let Err(e) = built {
        panic!("{e}");
    }
}

/// What the holder printed once its memory was held.
struct Holder {
    pid: u32,
    /// `/proc/<pid>/cmdline`'s first word, as the holder reads it itself.
    argv0: String,
    /// `cuMemGetInfo` in the holder, with its memory held.
    cuda_free: u64,
    cuda_total: u64,
    /// `cuDeviceGetAttribute`'s compute capability of the GPU.
    compute_capability: Value,
}

/// A machine with two GPUs, and the holder's memory on GPU 1 until the scene drops.
struct Scene {
    machine: SimMachine,
    holder: Holder,
    child: Child,
    stdin: Option<ChildStdin>,
}

impl Scene {
    fn new(tag: &str) -> Scene {
        build_simulator();
        let machine = SimMachine::new(tag, 2, GPU_MEMORY).unwrap_or_else(|e| panic!("{e}"));
        let mut cmd = Command::new("python3");
        cmd.arg(tools_dir().join("hold_memory.py"))
            .args([HELD_GPU.to_string(), HELD_BYTES.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = machine.apply(&mut cmd).spawn().expect("starting python3");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("holder's stdout"))
            .read_line(&mut line)
            .expect("reading the holder's line");
        if line.trim().is_empty() {
            let mut err = String::new();
            let _ = child.stderr.take().map(|mut e| e.read_to_string(&mut err));
            let _ = child.wait();
            panic!("hold_memory.py failed: {err}");
        }
        let v: Value = serde_json::from_str(&line).expect("the holder's JSON line");
        let holder = Holder {
            pid: v["pid"].as_u64().expect("pid") as u32,
            argv0: v["argv0"].as_str().expect("argv0").to_string(),
            cuda_free: v["free"].as_u64().expect("free"),
            cuda_total: v["total"].as_u64().expect("total"),
            compute_capability: v["compute_capability"].clone(),
        };
        let stdin = child.stdin.take();
        Scene {
            machine,
            holder,
            child,
            stdin,
        }
    }

    /// GPU `gpu` as the machine segment counts it now.
    fn usage(&self, gpu: u32) -> GpuUsage {
        Machine::open_existing(&self.machine.name)
            .expect("opening the machine")
            .expect("the machine exists")
            .usage(gpu)
            .expect("usage")
    }

    /// The simulator's own account, checked first so the tools' checks below rest
    /// on it: GPU 1 holds the holder's context and allocation and nothing else,
    /// GPU 0 nothing, and `cuMemGetInfo` in the holder saw the same free memory.
    /// Returns each GPU's usage.
    fn ground_truth(&self) -> [GpuUsage; 2] {
        let gpus = [self.usage(0), self.usage(1)];
        for u in &gpus {
            assert_eq!(u.capacity, GPU_MEMORY);
        }
        assert_eq!(gpus[0].used, 0, "GPU 0: {:?}", gpus[0].processes);
        let held = &gpus[HELD_GPU as usize];
        let owners: Vec<(u32, u64)> = held
            .processes
            .iter()
            .filter(|p| p.bytes > 0)
            .map(|p| (p.pid, p.bytes))
            .collect();
        assert_eq!(owners, vec![(self.holder.pid, held.used)]);
        assert!(held.used >= HELD_BYTES, "{} < {HELD_BYTES}", held.used);
        assert_eq!(
            (self.holder.cuda_total, self.holder.cuda_free),
            (held.capacity, held.free()),
            "cuMemGetInfo in the holder agrees with the machine"
        );
        gpus
    }

    /// Runs `python3 args..` on this machine (killed after [`TOOL_TIMEOUT_S`]).
    fn python(&self, args: &[&str]) -> Output {
        let mut cmd = Command::new("timeout");
        cmd.args([TOOL_TIMEOUT_S, "python3"]).args(args);
        let out = self
            .machine
            .apply(&mut cmd)
            .output()
            .expect("running python3");
        assert_ne!(
            out.status.code(),
            Some(124),
            "python3 {args:?} ran past {TOOL_TIMEOUT_S} s"
        );
        out
    }
}

impl Drop for Scene {
    fn drop(&mut self) {
        // EOF on its stdin ends the holder.
        drop(self.stdin.take());
        let _ = self.child.wait();
    }
}

fn text(out: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A size as nvitop prints it (`0B`, `304.0MiB`, `2048MiB`, `1.50GiB`): bytes, and
/// half its last digit's worth (how far from the true figure rounding may put it).
fn parse_size(s: &str) -> (f64, f64) {
    let s = s.trim();
    let (number, unit) = [
        ("KiB", 1u64 << 10),
        ("MiB", MIB),
        ("GiB", 1 << 30),
        ("B", 1),
    ]
    .into_iter()
    .find_map(|(suffix, unit)| s.strip_suffix(suffix).map(|n| (n, unit as f64)))
    .unwrap_or_else(|| panic!("not a size: {s:?}"));
    let value: f64 = number
        .parse()
        .unwrap_or_else(|_| panic!("not a size: {s:?}"));
    let decimals = number.split_once('.').map_or(0, |(_, d)| d.len()) as i32;
    (value * unit, 0.5 * unit * 10f64.powi(-decimals))
}

fn assert_size(shown: &str, bytes: u64, what: &str) {
    let (value, slack) = parse_size(shown);
    assert!(
        (value - bytes as f64).abs() <= slack,
        "{what}: shown {shown:?}, the machine says {bytes} bytes"
    );
}

#[test]
fn pynvml_reads_each_gpu_its_memory_and_the_holding_process_as_the_simulator_counts_them() {
    let test = "pynvml_reads_each_gpu";
    if !python_modules_or_skip(test, &["pynvml"]) {
        return;
    }
    let scene = Scene::new("nvml-pynvml");
    let gpus = scene.ground_truth();
    let out = scene.python(&[
        tools_dir().join("pynvml_report.py").to_str().unwrap(),
        &scene.holder.pid.to_string(),
    ]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "pynvml_report.py: {stdout}{stderr}");
    let report: Value = serde_json::from_str(&stdout).expect("the report's JSON");

    assert_eq!(report["cuda_driver_version"], 12040);
    assert_eq!(
        report["holder_name"], scene.holder.argv0,
        "nvmlSystemGetProcessName names the holder as /proc does"
    );
    let reported = report["gpus"].as_array().expect("gpus");
    assert_eq!(reported.len(), 2);
    for (i, (g, u)) in reported.iter().zip(&gpus).enumerate() {
        let i = i as u32;
        assert_eq!(g["index"], i);
        assert_eq!(g["name"], ident::DEVICE_NAME);
        assert_eq!(g["uuid"], ident::gpu_uuid_string(&scene.machine.name, i));
        assert_eq!(g["bus_id"], ident::pci_bus_id(i));

        // Memory, v1 and v2, is the machine's: used equals what the simulator says.
        let memory = serde_json::json!({"total": u.capacity, "free": u.free(), "used": u.used});
        assert_eq!(g["memory_v1"], memory, "GPU {i}");
        let v2 = serde_json::json!({
            "version": 0x0200_0028, "total": u.capacity, "reserved": 0,
            "free": u.free(), "used": u.used,
        });
        assert_eq!(g["memory_v2"], v2, "GPU {i}");
        assert_eq!(
            g["memory_v2_wrong_version"], 25,
            "GPU {i}: NVML_ERROR_ARGUMENT_VERSION_MISMATCH"
        );

        // The process lists, in every version and through the sized-array protocol.
        let procs: Vec<Value> = u
            .processes
            .iter()
            .filter(|p| p.bytes > 0)
            .map(|p| serde_json::json!({"pid": p.pid, "used": p.bytes}))
            .collect();
        let procs = Value::Array(procs);
        assert_eq!(g["compute_v3"], procs, "GPU {i}");
        assert_eq!(g["compute_v2"], procs, "GPU {i}");
        assert_eq!(g["graphics_v3"], serde_json::json!([]), "GPU {i}");
        assert_eq!(g["mps_v3"], serde_json::json!([]), "GPU {i}");
        let n = u.processes.iter().filter(|p| p.bytes > 0).count();
        for by_hand in ["compute_v1_by_hand", "compute_v3_by_hand"] {
            let first = if n == 0 { 0 } else { 7 }; // NVML_ERROR_INSUFFICIENT_SIZE
            let want = serde_json::json!({
                "first_return": first, "needed": n, "second_return": 0, "entries": procs,
            });
            assert_eq!(g[by_hand], want, "GPU {i}: {by_hand}");
        }

        // Sensors and modes answer (plausible, consistent), or NOT_SUPPORTED where
        // an SXM board on Linux does.
        let temperature = g["temperature"].as_u64().expect("temperature");
        assert!((1..100).contains(&temperature), "{temperature} °C");
        let power = g["power_usage_mw"].as_u64().expect("power draw");
        let limit = g["power_limit_mw"].as_u64().expect("power limit");
        assert!(0 < power && power <= limit, "{power} mW of {limit}");
        for util in g["utilization"].as_array().expect("utilization") {
            assert!(util.as_u64().expect("percent") <= 100);
        }
        for (domain, clocks) in g["clocks_mhz"].as_object().expect("clocks") {
            let (now, max) = (clocks[0].as_u64().unwrap(), clocks[1].as_u64().unwrap());
            assert!(0 < now && now <= max, "{domain}: {now} MHz of {max}");
        }
        assert_eq!(
            g["compute_capability"], scene.holder.compute_capability,
            "NVML's compute capability is CUDA's"
        );
        assert_eq!(g["mig_mode"], serde_json::json!([0, 0]));
        assert_eq!(g["ecc_uncorrected_volatile"], 0);
        assert_eq!(g["fan_speed"], "NVMLError_NotSupported");
        assert_eq!(g["driver_model"], "NVMLError_NotSupported");
    }
}

#[test]
fn nvitop_once_shows_each_gpu_its_memory_and_the_holding_process() {
    let test = "nvitop_once";
    if !python_modules_or_skip(test, &["nvitop"]) {
        return;
    }
    let scene = Scene::new("nvml-nvitop");
    let gpus = scene.ground_truth();
    let out = scene.python(&["-m", "nvitop", "--once"]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "nvitop -1:\n{stdout}{stderr}");
    assert_eq!(
        stderr.trim(),
        "",
        "nvitop -1 logged errors (a FunctionNotFound?):\n{stdout}"
    );
    let rows: Vec<Vec<&str>> = stdout
        .lines()
        .map(|l| l.split('│').map(str::trim).collect())
        .collect();

    // Devices: `│ i  name  Persistence │ bus-id  Disp.A │ ...`, then
    // `│ Fan Temp Perf Pwr │ used / total │ ...`.
    for (i, u) in gpus.iter().enumerate() {
        let at = rows
            .iter()
            .position(|r| {
                r.len() > 2
                    && r[1].starts_with(&format!("{i} "))
                    && r[1].contains(ident::DEVICE_NAME)
            })
            .unwrap_or_else(|| panic!("no row for GPU {i}:\n{stdout}"));
        assert!(
            rows[at][2].starts_with(&ident::pci_bus_id(i as u32)),
            "GPU {i}'s bus id: {:?}",
            rows[at]
        );
        let memory = rows[at + 1][2];
        let (used, total) = memory
            .split_once(" / ")
            .unwrap_or_else(|| panic!("GPU {i}'s memory cell: {memory:?}"));
        assert_size(used, u.used, &format!("GPU {i} used"));
        assert_size(total, u.capacity, &format!("GPU {i} total"));
    }

    // Processes: `│ GPU PID type USER GPU-MEM ... │`, one row, the holder's.
    let processes: Vec<Vec<&str>> = rows
        .iter()
        .filter(|r| r.len() == 3)
        .map(|r| r[1].split_whitespace().collect::<Vec<_>>())
        .filter(|t| t.len() > 4 && t[0].parse::<u32>().is_ok() && t[1].parse::<u32>().is_ok())
        .collect();
    assert_eq!(processes.len(), 1, "one process listed:\n{stdout}");
    let p = &processes[0];
    assert_eq!(p[0], HELD_GPU.to_string(), "{p:?}");
    assert_eq!(p[1], scene.holder.pid.to_string(), "{p:?}");
    assert_eq!(p[2], "C", "a compute process: {p:?}");
    assert_size(p[4], gpus[HELD_GPU as usize].used, "the holder's memory");
}

#[test]
fn gpustat_shows_each_gpu_its_memory_and_the_holding_process() {
    let test = "gpustat";
    if !python_modules_or_skip(test, &["gpustat"]) {
        return;
    }
    let scene = Scene::new("nvml-gpustat");
    let gpus = scene.ground_truth();
    let out = scene.python(&["-m", "gpustat", "--json"]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "gpustat --json:\n{stdout}{stderr}");
    let report: Value = serde_json::from_str(&stdout).expect("gpustat's JSON");
    let reported = report["gpus"].as_array().expect("gpus");
    assert_eq!(reported.len(), 2, "{stdout}");
    for (i, (g, u)) in reported.iter().zip(&gpus).enumerate() {
        assert_eq!(g["index"], i);
        assert_eq!(g["name"], ident::DEVICE_NAME);
        assert_eq!(
            g["uuid"],
            ident::gpu_uuid_string(&scene.machine.name, i as u32)
        );
        // gpustat's "MB" are MiB, rounded down.
        assert_eq!(g["memory.total"], u.capacity / MIB, "GPU {i}");
        assert_eq!(g["memory.used"], u.used / MIB, "GPU {i}");
        let procs: Vec<(u64, u64)> = g["processes"]
            .as_array()
            .expect("processes")
            .iter()
            .map(|p| {
                (
                    p["pid"].as_u64().unwrap(),
                    p["gpu_memory_usage"].as_u64().unwrap(),
                )
            })
            .collect();
        let want: Vec<(u64, u64)> = u
            .processes
            .iter()
            .filter(|p| p.bytes > 0)
            .map(|p| (u64::from(p.pid), p.bytes / MIB))
            .collect();
        assert_eq!(procs, want, "GPU {i}");
        // No fan on an SXM board: NOT_SUPPORTED, which gpustat shows as null; the
        // sensors that exist answer.
        assert_eq!(g["fan.speed"], Value::Null, "GPU {i}");
        assert!(g["temperature.gpu"].is_u64(), "GPU {i}: {g}");
        assert!(g["power.draw"].is_u64(), "GPU {i}: {g}");
    }

    // The table a user reads: `[1] name | temp, util, power | used / total MB | cmd/pid(MiB)`.
    let out = scene.python(&["-m", "gpustat", "--no-color", "--show-cmd", "--show-pid"]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "gpustat:\n{stdout}{stderr}");
    for (i, u) in gpus.iter().enumerate() {
        let line = stdout
            .lines()
            .find(|l| l.starts_with(&format!("[{i}]")))
            .unwrap_or_else(|| panic!("no line for GPU {i}:\n{stdout}"));
        assert!(line.contains(ident::DEVICE_NAME), "{line}");
        let words: Vec<&str> = line.split_whitespace().collect();
        let memory = [
            (u.used / MIB).to_string(),
            "/".into(),
            (u.capacity / MIB).to_string(),
            "MB".into(),
        ];
        assert!(
            words.windows(4).any(|w| w == memory),
            "GPU {i}: {memory:?} in {line:?}"
        );
        let holder = format!("/{}({}M)", scene.holder.pid, u.used / MIB);
        assert_eq!(
            line.contains(&holder),
            i as u32 == HELD_GPU,
            "GPU {i}: {holder} in {line:?}"
        );
    }
}
