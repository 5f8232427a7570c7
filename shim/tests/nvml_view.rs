//! Every tool sees the same GPU (issue #39): NVML in a process under Kiwi answers for
//! that process's view, as `cuMemGetInfo` does, and lists only its own tenant's
//! processes; without the shim (or with `KIWI_NVML_VIEW=0`) it tells the physical GPU.
//!
//! The scene: a 4 GiB simulated GPU under a real arbiter (with the simulator's NVML),
//! and another tenant, a container on its own socket (`FakeContainer`: its own pid
//! and mount namespaces), holding 2.5 GiB through the shim. Then, as real processes:
//! - on the host, `py/nvml_view.py` under the shim: pynvml (memory v1 and v2, every
//!   compute-list version, graphics, MPS), nvitop's and gpustat's own Python code,
//!   before and after the process makes a context and allocates, against
//!   `cuMemGetInfo` in the same process; the same tools' command lines, under the
//!   shim and without it;
//! - a C program linked with `-lnvidia-ml` (no `dlsym`: the linker binds the names);
//! - in a second container, the same script: only its own process, by the pid it
//!   sees itself, never the other container's or the host's.
//!
//! Needs the workspace built (`cargo build --workspace`), python3 with pynvml,
//! nvitop and gpustat (`.ci/pip-packages`), gcc, and `unshare`/`nsenter`/`setpriv`.

mod common;
use common::*;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};

use kiwi_sim_core::harness::SimMachine;
use kiwi_tests::{require_tool, Arbiter, FakeContainer};
use serde_json::Value;

const MIB: u64 = 1 << 20;
const GPU_MEMORY: u64 = 4 << 30;
/// What the other tenant holds, and what the process under test allocates.
const OTHER_HOLDS: u64 = 2560 * MIB;
const MINE_MIB: u64 = 300;
/// One allocation granule: the most two figures of the same moment may differ by.
const GRANULE: i64 = 2 * MIB as i64;

fn py(name: &str) -> PathBuf {
    root().join("shim/tests/py").join(name)
}

/// Whether python3 has the tools; fails under `CI=true`, else skips loudly.
fn tools_or_skip(test: &str) -> bool {
    if !require_tool("python3") {
        return false;
    }
    let ok = Command::new("python3")
        .args(["-c", "import pynvml, nvitop, gpustat"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        assert!(
            !kiwi_sim_core::harness::in_ci(),
            "{test}: python3 cannot import pynvml, nvitop and gpustat (pip install -r .ci/pip-packages)"
        );
        eprintln!("\n!!!!! SKIPPING {test}: pynvml, nvitop or gpustat missing (fails under CI=true) !!!!!\n");
    }
    ok
}

/// A process that printed one JSON line and holds its memory until its stdin closes.
struct Holding {
    child: Child,
    _stdin: ChildStdin,
    report: Value,
}

impl Holding {
    fn spawn(cmd: &mut Command, what: &str) -> Holding {
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {what}: {e}"));
        let stdin = child.stdin.take().unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let report = match serde_json::from_str(&line) {
            Ok(v) => v,
            Err(e) => {
                let _ = child.kill();
                let out = child.wait_with_output().unwrap();
                panic!(
                    "{what} printed no report ({e}): {line:?}\n{}",
                    String::from_utf8_lossy(&out.stderr)
                );
            }
        };
        Holding {
            child,
            _stdin: stdin,
            report,
        }
    }
}

impl Drop for Holding {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The scene: the machine, the arbiter, and the other tenant's container holding
/// [`OTHER_HOLDS`] through the shim.
struct Scene {
    m: SimMachine,
    arb: Arbiter,
    other: FakeContainer,
    holder: Option<Holding>,
}

impl Scene {
    fn new(tag: &str) -> Scene {
        let m = SimMachine::new(tag, 1, GPU_MEMORY).unwrap();
        let arb = Arbiter::start_with_env(&["--tq", "1"], m.env());
        let uuid = kiwi_sim_core::ident::gpu_uuid_string(&m.name, 0);
        let other = FakeContainer::start(arb.socket_dir(), &format!("{tag}-other"), &[&uuid], None);
        let mut s = Scene {
            m,
            arb,
            other,
            holder: None,
        };
        let script = root().join("sim/nvml/tests/tools/hold_memory.py");
        let mut cmd = s.in_container(&s.other, "python3");
        cmd.arg(script).arg("0").arg(OTHER_HOLDS.to_string());
        s.holder = Some(Holding::spawn(&mut cmd, "the other tenant's holder"));
        s
    }

    /// `program` in container `c` under the shim, on its own socket.
    fn in_container(&self, c: &FakeContainer, program: &str) -> Command {
        let mut cmd = c.command(program);
        self.m.apply(&mut cmd);
        cmd.env("LD_PRELOAD", shim())
            .env("KIWI_SOCKET_DIR", c.client_dir.parent().unwrap())
            .env("KIWI_REQUIRE_ARBITER", "1");
        cmd
    }

    /// The other tenant's pids: as the host sees its process, and as it sees itself.
    fn other_pids(&self) -> Vec<u64> {
        let h = self.holder.as_ref().unwrap();
        vec![h.child.id() as u64, h.report["pid"].as_u64().unwrap()]
    }

    /// `cmd` on this machine under the shim (on the node's socket).
    fn under_kiwi<'a>(&self, cmd: &'a mut Command) -> &'a mut Command {
        under_kiwi_on(cmd, &self.m, &self.arb)
    }
}

fn free_of(v: &Value) -> i64 {
    v["free"].as_i64().unwrap()
}

fn pids(list: &Value) -> Vec<u64> {
    list.as_array()
        .unwrap()
        .iter()
        .map(|e| e[0].as_u64().unwrap())
        .collect()
}

fn near(a: i64, b: i64, what: &str, r: &Value) {
    assert!((a - b).abs() <= GRANULE, "{what}: {a} vs {b}\n{r:#}");
}

#[test]
fn nvml_under_kiwi_tells_the_process_its_own_view_and_no_other_tenant() {
    let test = "nvml_view_host";
    if !tools_or_skip(test) {
        return;
    }
    let s = Scene::new("nvml-view");
    let others = s.other_pids();
    let mut cmd = Command::new("python3");
    cmd.arg(py("nvml_view.py")).arg(MINE_MIB.to_string());
    s.under_kiwi(&mut cmd);
    let me = Holding::spawn(&mut cmd, "nvml_view.py under Kiwi");
    let r = &me.report;
    let pid = r["pid"].as_u64().unwrap();
    let cuda = free_of(&r["cuda"]);
    let after = &r["after_cuda"];
    let total = after["v1"]["total"].as_i64().unwrap();
    assert_eq!(total as u64, GPU_MEMORY, "{r:#}");

    // The same free memory through every path, as CUDA's at the same moment.
    near(
        free_of(&after["v1"]),
        cuda,
        "pynvml v1 free vs cuMemGetInfo",
        r,
    );
    near(
        free_of(&after["v2"]),
        cuda,
        "pynvml v2 free vs cuMemGetInfo",
        r,
    );
    near(
        r["nvitop"]["free"].as_i64().unwrap(),
        cuda,
        "nvitop free vs cuMemGetInfo",
        r,
    );
    let gpustat_free = (r["gpustat"]["total_mib"].as_i64().unwrap()
        - r["gpustat"]["used_mib"].as_i64().unwrap())
        * MIB as i64;
    near(
        gpustat_free,
        cuda,
        "gpustat total - used vs cuMemGetInfo",
        r,
    );
    near(
        free_of(&r["cuda_after_tools"]),
        cuda,
        "cuMemGetInfo again",
        r,
    );
    for v in ["v1", "v2"] {
        let m = &after[v];
        let sum = m["free"].as_i64().unwrap()
            + m["used"].as_i64().unwrap()
            + m["reserved"].as_i64().unwrap_or(0);
        assert_eq!(
            sum, total,
            "{v}: free + used (+ reserved) is the total\n{r:#}"
        );
    }
    // Far more than the physical GPU has free: the other tenant's 2.5 GiB can be
    // swapped out for this process's turn.
    assert!(
        cuda as u64 > GPU_MEMORY - OTHER_HOLDS,
        "CUDA's free is the process's view: {r:#}"
    );

    // Only its own process, with what Kiwi counts for it (at least its allocation).
    for list in ["compute_v3", "compute_v2"] {
        let l = &after[list];
        assert_eq!(pids(l), vec![pid], "{list}: only itself\n{r:#}");
        assert!(
            l[0][1].as_u64().unwrap() >= MINE_MIB * MIB,
            "{list}: its memory\n{r:#}"
        );
    }
    let v1 = &after["compute_v1"];
    assert_eq!(
        v1["first"], 7,
        "a size query with no room: INSUFFICIENT_SIZE\n{r:#}"
    );
    assert_eq!(v1["second"], 0, "{r:#}");
    assert_eq!(pids(&v1["list"]), vec![pid], "{r:#}");
    assert_eq!(r["nvitop"]["pids"], serde_json::json!([pid]), "{r:#}");
    assert_eq!(r["gpustat"]["pids"], serde_json::json!([pid]), "{r:#}");
    for list in ["graphics", "mps"] {
        assert_eq!(after[list], serde_json::json!([]), "{list}\n{r:#}");
    }

    // Before CUDA: no context, so not listed; free is what a newcomer could have
    // (the total less the memory no swap frees: the other tenant's context).
    let before = &r["before_cuda"];
    assert_eq!(before["compute_v3"], serde_json::json!([]), "{r:#}");
    let newcomer = free_of(&before["v1"]) as u64;
    assert!(
        newcomer > GPU_MEMORY - OTHER_HOLDS && newcomer < GPU_MEMORY,
        "NVML before CUDA: {r:#}"
    );
    for p in &others {
        assert!(
            !r.to_string().contains(&format!("[{p},")),
            "pid {p} leaked: {r:#}"
        );
    }

    // The command-line tools, in processes of their own under the shim: no other
    // tenant's process, the newcomer's free memory.
    let mut gpustat = Command::new("python3");
    gpustat.args(["-m", "gpustat", "--json"]);
    let out = finish(s.under_kiwi(&mut gpustat).spawn().unwrap());
    assert!(out.status.success(), "{}", text(&out));
    let g: Value = serde_json::from_slice(&out.stdout).unwrap();
    let gpu = &g["gpus"][0];
    let listed: Vec<u64> = gpu["processes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["pid"].as_u64().unwrap())
        .collect();
    assert_eq!(
        listed,
        vec![pid],
        "gpustat under Kiwi: the same user's only\n{g:#}"
    );
    let mut nvitop = Command::new("python3");
    nvitop.args(["-m", "nvitop", "--once"]);
    let out = finish(s.under_kiwi(&mut nvitop).spawn().unwrap());
    assert!(out.status.success(), "{}", text(&out));
    let shown = String::from_utf8_lossy(&out.stdout);
    // Its process rows: `│ GPU PID type USER GPU-MEM ... │`.
    let rows: Vec<String> = shown
        .lines()
        .map(|l| l.split('│').map(str::trim).collect::<Vec<_>>())
        .filter(|r| r.len() == 3)
        .map(|r| r[1].split_whitespace().collect::<Vec<_>>())
        .filter(|t| t.len() > 4 && t[0].parse::<u32>().is_ok() && t[1].parse::<u32>().is_ok())
        .map(|t| t[1].to_string())
        .collect();
    assert_eq!(
        rows,
        vec![pid.to_string()],
        "nvitop -1 under Kiwi: its user's only\n{shown}"
    );

    // The physical truth, without the shim and with the view off: the other
    // tenant's memory is in use and its process listed.
    let physical = |view_off: bool| -> Value {
        let mut c = Command::new("python3");
        c.arg("-c").arg(
            "import json, pynvml as N; N.nvmlInit(); h = N.nvmlDeviceGetHandleByIndex(0); \
             m = N.nvmlDeviceGetMemoryInfo(h); \
             print(json.dumps({'free': m.free, 'pids': [p.pid for p in N.nvmlDeviceGetComputeRunningProcesses(h)]}))",
        );
        if view_off {
            s.under_kiwi(&mut c).env("KIWI_NVML_VIEW", "0");
        } else {
            s.m.apply(&mut c)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
        }
        let out = finish(c.spawn().unwrap());
        assert!(out.status.success(), "{}", text(&out));
        serde_json::from_slice(&out.stdout).unwrap()
    };
    for view_off in [false, true] {
        let p = physical(view_off);
        assert!(
            (p["free"].as_u64().unwrap()) < GPU_MEMORY - OTHER_HOLDS,
            "physical (view off: {view_off}): {p}"
        );
        let listed = p["pids"].as_array().unwrap().len();
        assert_eq!(
            listed, 2,
            "physical (view off: {view_off}): both processes: {p}"
        );
    }
}

const LINKED_C: &str = r#"
#include <stdio.h>
typedef void *nvmlDevice_t;
typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
typedef struct { unsigned int pid; unsigned long long usedGpuMemory;
                 unsigned int gpuInstanceId, computeInstanceId; } nvmlProcessInfo_t;
int nvmlInit_v2(void);
int nvmlDeviceGetHandleByIndex_v2(unsigned int, nvmlDevice_t *);
int nvmlDeviceGetMemoryInfo(nvmlDevice_t, nvmlMemory_t *);
int nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t, unsigned int *, nvmlProcessInfo_t *);
int main(void) {
    nvmlDevice_t d; nvmlMemory_t m; nvmlProcessInfo_t p[16]; unsigned int n = 16;
    if (nvmlInit_v2() || nvmlDeviceGetHandleByIndex_v2(0, &d) || nvmlDeviceGetMemoryInfo(d, &m)
        || nvmlDeviceGetComputeRunningProcesses_v3(d, &n, p)) return 1;
    printf("free %llu used %llu total %llu processes %u\n", m.free, m.used, m.total, n);
    return 0;
}
"#;

/// Compiles [`LINKED_C`] against the simulator's `libnvidia-ml.so.1`.
fn linked_program(dir: &Path, sim_dir: &Path) -> Option<PathBuf> {
    if !require_tool("gcc") {
        return None;
    }
    let src = dir.join("nvml_linked.c");
    std::fs::write(&src, LINKED_C).unwrap();
    let exe = dir.join("nvml_linked");
    let st = Command::new("gcc")
        .args(["-O1", "-Wall", "-Werror"])
        .arg(&src)
        .arg("-o")
        .arg(&exe)
        .arg("-L")
        .arg(sim_dir)
        .arg("-l:libnvidia-ml.so.1")
        .status()
        .expect("gcc");
    assert!(st.success(), "compiling nvml_linked.c");
    Some(exe)
}

fn linked_figures(out: &std::process::Output) -> (u64, u64) {
    assert!(out.status.success(), "{}", text(out));
    let line = String::from_utf8_lossy(&out.stdout);
    let w: Vec<&str> = line.split_whitespace().collect();
    (w[1].parse().unwrap(), w[7].parse().unwrap())
}

#[test]
fn a_program_linked_with_nvml_gets_the_view_too() {
    let s = Scene::new("nvml-linked");
    let dir = tempfile::tempdir().unwrap();
    let Some(exe) = linked_program(dir.path(), &s.m.sim_dir) else {
        return;
    };
    let out = finish(s.under_kiwi(&mut Command::new(&exe)).spawn().unwrap());
    let (free, listed) = linked_figures(&out);
    assert!(
        free > GPU_MEMORY - OTHER_HOLDS,
        "under Kiwi: {}",
        text(&out)
    );
    assert_eq!(
        listed,
        0,
        "under Kiwi, no other tenant's process: {}",
        text(&out)
    );
    let mut plain = Command::new(&exe);
    s.m.apply(&mut plain)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let out = finish(plain.spawn().unwrap());
    let (free, listed) = linked_figures(&out);
    assert!(
        free < GPU_MEMORY - OTHER_HOLDS,
        "without Kiwi: {}",
        text(&out)
    );
    assert_eq!(listed, 1, "without Kiwi, the physical list: {}", text(&out));
}

#[test]
fn in_a_container_nvml_lists_its_own_processes_only() {
    let test = "nvml_view_container";
    if !tools_or_skip(test) {
        return;
    }
    let s = Scene::new("nvml-ctr");
    let others = s.other_pids();
    // A host process of this user under Kiwi too: another tenant for the container.
    let mut host = Command::new("python3");
    host.arg(root().join("sim/nvml/tests/tools/hold_memory.py"))
        .arg("0")
        .arg((64 * MIB).to_string());
    s.under_kiwi(&mut host);
    let host = Holding::spawn(&mut host, "a host holder");
    let uuid = kiwi_sim_core::ident::gpu_uuid_string(&s.m.name, 0);
    let mine = FakeContainer::start(s.arb.socket_dir(), "nvml-ctr-mine", &[&uuid], None);
    let mut cmd = s.in_container(&mine, "python3");
    cmd.arg(py("nvml_view.py")).arg(MINE_MIB.to_string());
    let me = Holding::spawn(&mut cmd, "nvml_view.py in a container");
    let r = &me.report;
    // The pid it sees itself (its own pid namespace), and no one else's.
    let pid = r["pid"].as_u64().unwrap();
    let after = &r["after_cuda"];
    assert_eq!(pids(&after["compute_v3"]), vec![pid], "{r:#}");
    assert_eq!(pids(&after["compute_v1"]["list"]), vec![pid], "{r:#}");
    assert_eq!(r["nvitop"]["pids"], serde_json::json!([pid]), "{r:#}");
    assert_eq!(r["gpustat"]["pids"], serde_json::json!([pid]), "{r:#}");
    near(
        free_of(&after["v2"]),
        free_of(&r["cuda"]),
        "v2 free vs cuMemGetInfo",
        r,
    );
    let host_pids = [host.child.id() as u64, host.report["pid"].as_u64().unwrap()];
    for p in others.iter().chain(&host_pids).filter(|&&p| p != pid) {
        assert!(
            !r.to_string().contains(&format!("[{p},")),
            "pid {p} leaked: {r:#}"
        );
    }
    assert_eq!(after["graphics"], serde_json::json!([]), "{r:#}");
}
