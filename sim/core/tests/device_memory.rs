//! Simulated device memory lives in each GPU's memory file, next to the machine
//! segment, not in the memory of the process that allocates it (issue #37, item 6):
//! it does not grow the process's anonymous memory, a killed process's extents come
//! back, exported memory's bytes cross processes, and a machine populated ahead
//! (`kiwi-sim populate`) charges none of it to a tenant's memory cgroup.
//! `tests/c/device_memory.c` is the program, built against the real `cuda.h`.

use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use kiwi_sim_core::harness::{in_ci, SimMachine};

fn skip_or_fail(test: &str, why: &str) {
    if in_ci() {
        panic!("{test}: {why}");
    }
    eprintln!("\n!!!!! SKIPPING {test}: {why} (this fails under CI=true) !!!!!\n");
}

/// The include directory holding the real `cuda.h`, or `None` after a skip.
fn cuda_include(test: &str) -> Option<String> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    if Command::new("gcc").arg("--version").output().is_err() {
        skip_or_fail(test, "gcc is not installed (apt-get install gcc)");
        return None;
    }
    let fetch = Command::new("sh")
        .arg(root.join("scripts/fetch-cuda-h.sh"))
        .output()
        .expect("running scripts/fetch-cuda-h.sh");
    if !fetch.status.success() {
        let why = format!(
            "could not fetch cuda.h: {}",
            String::from_utf8_lossy(&fetch.stderr)
        );
        skip_or_fail(test, &why);
        return None;
    }
    let out = String::from_utf8_lossy(&fetch.stdout);
    Some(
        out.lines()
            .last()
            .expect("the include dir")
            .trim()
            .to_string(),
    )
}

/// `tests/c/device_memory.c` built for `m` (in its temporary directory).
fn build(test: &str, m: &SimMachine) -> Option<PathBuf> {
    let include = cuda_include(test)?;
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let exe = m.trace.with_file_name("device_memory");
    let cc = Command::new("gcc")
        .args(["-Wall", "-Werror", "-o"])
        .arg(&exe)
        .arg(root.join("sim/core/tests/c/device_memory.c"))
        .arg(format!("-I{include}"))
        .arg(format!("-L{}", m.sim_dir.display()))
        .arg("-lcuda")
        .output()
        .expect("running gcc");
    assert!(
        cc.status.success(),
        "gcc failed:\n{}",
        String::from_utf8_lossy(&cc.stderr)
    );
    Some(exe)
}

fn text(o: &Output) -> String {
    format!(
        "{:?}\n{}{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn expect_ok(o: &Output) {
    assert!(o.status.success(), "{}", text(o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert_eq!(out.lines().last().map(str::trim), Some("OK"), "{}", text(o));
}

/// A `key=value` number of the program's output.
fn field(o: &Output, key: &str) -> i64 {
    let out = String::from_utf8_lossy(&o.stdout);
    out.split_whitespace()
        .find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {key}= in {}", text(o)))
}

/// (a) 256 MiB of device memory allocated and written do not grow the process's
/// anonymous memory: the bytes are the GPU file's pages (RssShmem), not the
/// process's own (the old simulator kept them in a private anonymous mapping).
#[test]
fn device_memory_is_not_the_processs_anonymous_memory() {
    let test = "device_memory_is_not_the_processs_anonymous_memory";
    let m = SimMachine::new("rssanon", 1, 1 << 30).unwrap_or_else(|e| panic!("{e}"));
    let Some(exe) = build(test, &m) else { return };
    let o = m
        .apply(&mut Command::new(&exe))
        .args(["fill", "256"])
        .output()
        .unwrap();
    expect_ok(&o);
    let (anon, shmem) = (field(&o, "anon_kb"), field(&o, "shmem_kb"));
    eprintln!("after 256 MiB of device memory: RssAnon +{anon} KiB, RssShmem +{shmem} KiB");
    assert!(
        anon < 32 << 10,
        "RssAnon grew by {anon} KiB for 256 MiB of device memory"
    );
    assert!(
        shmem >= 250 << 10,
        "RssShmem grew by only {shmem} KiB: where are the bytes?"
    );
}

/// Kills the child even when an assertion fails.
struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// (b) A process SIGKILLed while holding extents gives them back: three holders of
/// 400 MiB of a 512 MiB GPU (more granules, together, than its memory file has)
/// are killed one after the other, each after the one before it, and then one
/// process allocates and fills all of the GPU's memory its context leaves.
#[test]
fn a_killed_processs_extents_come_back() {
    let test = "a_killed_processs_extents_come_back";
    let m = SimMachine::new("extkill", 1, 512 << 20).unwrap_or_else(|e| panic!("{e}"));
    let Some(exe) = build(test, &m) else { return };
    for round in 0..3 {
        let mut holder = Child(
            m.apply(&mut Command::new(&exe))
                .args(["hold", "400"])
                .stdout(std::process::Stdio::piped())
                .spawn()
                .unwrap(),
        );
        let mut line = String::new();
        std::io::BufReader::new(holder.0.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert_eq!(line.trim(), "READY", "holder {round}");
        let machine = kiwi_sim_core::Machine::open_existing(&m.name)
            .unwrap()
            .expect("the holder created the machine");
        let (used, all) = machine.extents_in_use(0).unwrap();
        assert!(used >= 200, "round {round}: {used} of {all} granules held");
        holder.0.kill().unwrap();
        holder.0.wait().unwrap();
        assert_eq!(
            machine.extents_in_use(0).unwrap().0,
            0,
            "round {round}: a dead process's granules were not reclaimed"
        );
        assert_eq!(machine.usage(0).unwrap().used, 0, "round {round}");
    }
    let context = kiwi_sim_core::harness::suite_context_memory(512 << 20) >> 20;
    let o = m
        .apply(&mut Command::new(&exe))
        .args(["fill", &(512 - context).to_string()])
        .output()
        .unwrap();
    expect_ok(&o);
}

/// (c) Bytes written by one process into exported memory (written while they were
/// in the GPU's file, then exported) are read by another, and its writes by the
/// first.
#[test]
fn exported_memory_crosses_processes_both_ways() {
    let test = "exported_memory_crosses_processes_both_ways";
    let m = SimMachine::new("xshare", 1, 512 << 20).unwrap_or_else(|e| panic!("{e}"));
    let Some(exe) = build(test, &m) else { return };
    let o = m
        .apply(&mut Command::new(&exe))
        .args(["share", "64"])
        .output()
        .unwrap();
    expect_ok(&o);
}

/// A memory cgroup of its own (cgroup v1), removed when dropped.
struct Cgroup(PathBuf);

impl Cgroup {
    /// `None` after a skip (a failure under `CI=true`) where no memory cgroup
    /// hierarchy (v1) can be written.
    fn new(test: &str, tag: &str, limit: u64) -> Option<Cgroup> {
        let root = Path::new("/sys/fs/cgroup/memory");
        if !root.join("memory.limit_in_bytes").exists() {
            skip_or_fail(
                test,
                "no cgroup v1 memory hierarchy at /sys/fs/cgroup/memory",
            );
            return None;
        }
        let dir = root.join(format!(
            "kiwi-sim-{tag}-{}-{}",
            std::process::id(),
            kiwi_sim_core::monotonic_ns()
        ));
        if let Err(e) = std::fs::create_dir(&dir) {
            skip_or_fail(test, &format!("cannot create {}: {e}", dir.display()));
            return None;
        }
        let cg = Cgroup(dir);
        std::fs::write(cg.0.join("memory.limit_in_bytes"), limit.to_string())
            .unwrap_or_else(|e| panic!("{}: {e}", cg.0.display()));
        Some(cg)
    }

    fn read(&self, file: &str) -> u64 {
        std::fs::read_to_string(self.0.join(file))
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(0)
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        // Its processes have exited; their exit may take a moment to reach it.
        for _ in 0..50 {
            if std::fs::remove_dir(&self.0).is_ok() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        eprintln!("could not remove {}", self.0.display());
    }
}

/// (d) On a machine populated ahead with `kiwi-sim populate` (by this process), a
/// process in a memory cgroup limited to 128 MiB allocates and fills 512 MiB of
/// device memory and exits 0: the pages it maps were charged to whoever touched
/// them first. On a machine nobody populated, the same process touches them first
/// and is OOM-killed: the limit is real.
#[test]
fn a_populated_machine_charges_no_device_memory_to_a_limited_tenant() {
    let test = "a_populated_machine_charges_no_device_memory_to_a_limited_tenant";
    let limit = 128u64 << 20;
    let run = |m: &SimMachine, exe: &Path| -> Option<(Output, u64)> {
        let cg = Cgroup::new(test, "populate", limit)?;
        let o = m
            .apply(&mut Command::new(exe))
            .env("KIWI_TEST_CGROUP", &cg.0)
            .args(["fill", "512"])
            .output()
            .unwrap();
        Some((o, cg.read("memory.max_usage_in_bytes")))
    };

    let m = SimMachine::new("populated", 1, 1 << 30).unwrap_or_else(|e| panic!("{e}"));
    let Some(exe) = build(test, &m) else { return };
    let pop = m
        .apply(&mut Command::new(env!("CARGO_BIN_EXE_kiwi-sim")))
        .args(["populate", "--name", &m.name])
        .output()
        .unwrap();
    assert!(pop.status.success(), "{}", text(&pop));
    assert!(
        String::from_utf8_lossy(&pop.stdout).contains("populated 1024.0 MiB of simulated GPU 0"),
        "{}",
        text(&pop)
    );
    let Some((o, peak)) = run(&m, &exe) else {
        return;
    };
    eprintln!(
        "populated: the tenant's cgroup peaked at {} MiB",
        peak >> 20
    );
    expect_ok(&o);
    assert!(peak < limit, "peak {peak}");

    // The control: nobody populated this machine.
    let cold = SimMachine::new("unpopulated", 1, 1 << 30).unwrap_or_else(|e| panic!("{e}"));
    let (o, _) = run(&cold, &exe).expect("the cgroup was made above");
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(
        o.status.signal(),
        Some(libc::SIGKILL),
        "a tenant touching 512 MiB first under a 128 MiB limit was not OOM-killed: {}",
        text(&o)
    );
}
