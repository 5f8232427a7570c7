//! A real engine: Debian's docker (`docker.io`) with Kiwi installed the way a user does
//! it, `kiwictl install docker`, then the reload it advises (SIGHUP, which is what
//! `systemctl reload docker` sends), then `docker run --runtime kiwi`:
//!
//! - a claimed container gets the shim, the preload, the arbiter's socket and the
//!   device nodes; an unclaimed one through the same runtime gets none of them;
//! - two claimed containers of 700 MiB on a simulated 1 GiB GPU (`--ipc=host
//!   --pid=host`: the simulator's shared machine lives in `/dev/shm` and tracks host
//!   pids) take turns under a private arbiter and both verify every byte.
//!
//! dockerd runs privately: its own data root, exec root, pid file, socket and
//! containerd, `vfs` storage, no iptables, no bridge. The image is imported from a tar
//! (busybox-static, gpuburst and the libraries it needs); nothing is pulled. Installs
//! nothing itself: under `CI=true` a missing tool fails, elsewhere the test is skipped.
//! Everything is torn down on drop, failures included.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use kiwi_tests::engines::{is_ci, output_within, text, unmount_under, which};
use kiwi_tests::{bin, profile_dir, require_tool, Arbiter};

const IMAGE: &str = "kiwi-test/busybox:e2e";
/// No AppArmor profile: on a kernel with AppArmor, loading docker's default profile
/// needs apparmor_parser and a writable securityfs, which a CI container may lack; Kiwi
/// does not depend on it either way.
const UNCONFINED: &str = "--security-opt=apparmor=unconfined";

/// Whether `pid` is still running (a zombie is not: it has exited, unreaped).
fn running(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rsplit_once(") ").map(|(_, rest)| !rest.starts_with('Z')))
        .unwrap_or(false)
}

/// SIGTERM, up to `grace` to exit, then SIGKILL.
fn terminate(pid: i32, grace: Duration) {
    // SAFETY: signalling a process this test started (dockerd) or its containerd.
    unsafe { libc::kill(pid, libc::SIGTERM) };
    let t0 = Instant::now();
    while running(pid) && t0.elapsed() < grace {
        std::thread::sleep(Duration::from_millis(20));
    }
    if running(pid) {
        // SAFETY: as above; the process outlived its grace period.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
}

/// A private dockerd; on drop its containers are removed, it and its containerd are
/// stopped, and whatever it mounted under its directories is unmounted.
struct Dockerd {
    child: Child,
    dir: PathBuf,
    docker: PathBuf,
    daemon_json: PathBuf,
}

impl Dockerd {
    fn start(dir: &Path, kiwi_config: &Path) -> Dockerd {
        let dockerd = which("dockerd").unwrap();
        // The client shipped next to dockerd (docker.io's), not another one on PATH.
        let docker = dockerd
            .parent()
            .map(|d| d.join("docker"))
            .filter(|p| p.is_file())
            .or_else(|| which("docker"))
            .unwrap();
        let daemon_json = dir.join("daemon.json");
        std::fs::write(&daemon_json, "{}\n").unwrap();
        let log = std::fs::File::create(dir.join("dockerd.log")).unwrap();
        let child = Command::new(&dockerd)
            .arg("--data-root")
            .arg(dir.join("data"))
            .arg("--exec-root")
            .arg(dir.join("exec"))
            .arg("--pidfile")
            .arg(dir.join("dockerd.pid"))
            .arg("-H")
            .arg(format!("unix://{}", dir.join("docker.sock").display()))
            .arg("--config-file")
            .arg(&daemon_json)
            .args([
                "--storage-driver",
                "vfs",
                "--iptables=false",
                "--ip6tables=false",
                "--bridge=none",
            ])
            // Its own containerd is its child, and the runtime inherits this
            // environment through it (under the stock docker.service the system
            // containerd's environment counts instead: docs/containers.md).
            .env("KIWI_CONFIG", kiwi_config)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("start dockerd");
        let d = Dockerd {
            child,
            dir: dir.to_path_buf(),
            docker,
            daemon_json,
        };
        let t0 = Instant::now();
        loop {
            let out = output_within(
                d.cmd(&["version", "--format", "{{.Server.Version}}"]),
                Duration::from_secs(10),
            );
            if out.status.success() {
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "dockerd did not come up: {}\n{}",
                text(&out),
                d.log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        d
    }

    fn log(&self) -> String {
        let log = std::fs::read_to_string(self.dir.join("dockerd.log")).unwrap_or_default();
        let tail: Vec<&str> = log.lines().rev().take(30).collect();
        tail.into_iter().rev().collect::<Vec<_>>().join("\n")
    }

    fn cmd(&self, args: &[&str]) -> Command {
        let mut c = Command::new(&self.docker);
        c.arg("-H")
            .arg(format!("unix://{}", self.dir.join("docker.sock").display()))
            .args(args)
            .env_remove("DOCKER_HOST")
            .env("DOCKER_CONFIG", self.dir.join("client"));
        c
    }

    fn run(&self, args: &[&str]) -> Output {
        output_within(self.cmd(args), Duration::from_secs(60))
    }

    fn ok(&self, args: &[&str]) -> String {
        let out = self.run(args);
        assert!(
            out.status.success(),
            "docker {args:?}: {}\n--- dockerd log:\n{}",
            text(&out),
            self.log()
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// What `systemctl reload docker` does (docker.service: ExecReload=kill -s HUP).
    fn reload(&self) {
        // SAFETY: signalling the dockerd this test started.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGHUP) };
    }
}

impl Drop for Dockerd {
    fn drop(&mut self) {
        if let Ok(out) = std::panic::catch_unwind(|| {
            output_within(self.cmd(&["ps", "-aq"]), Duration::from_secs(10))
        }) {
            let ids = String::from_utf8_lossy(&out.stdout).into_owned();
            let ids: Vec<&str> = ids.split_whitespace().collect();
            if !ids.is_empty() {
                let mut args = vec!["rm", "-f"];
                args.extend(ids);
                let _ = std::panic::catch_unwind(|| {
                    output_within(self.cmd(&args), Duration::from_secs(20))
                });
            }
        }
        let containerd_pid =
            std::fs::read_to_string(self.dir.join("exec/containerd/containerd.pid"))
                .ok()
                .and_then(|s| s.trim().parse::<i32>().ok());
        terminate(self.child.id() as i32, Duration::from_secs(15));
        let _ = self.child.wait();
        if let Some(pid) = containerd_pid {
            terminate(pid, Duration::from_secs(5));
        }
        unmount_under(&self.dir);
    }
}

/// Removes the simulated machine's shared segment, failures included.
struct SimReset(String);

impl Drop for SimReset {
    fn drop(&mut self) {
        let _ = kiwi_sim_core::machine::reset(&self.0);
    }
}

fn mknod(path: &Path, minor: u32) {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: a valid C string; creates a character device node (NVIDIA's major, 195).
    let rc = unsafe { libc::mknod(c.as_ptr(), libc::S_IFCHR | 0o666, libc::makedev(195, minor)) };
    assert_eq!(rc, 0, "mknod {}", path.display());
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666)).unwrap();
}

/// The image: static busybox with a few applets, gpuburst with the libraries `ldd`
/// names, an ld.so.conf and the host's ldconfig (so it is a glibc image whose ld cache
/// kiwi-hook updates for the bound simulator libraries).
fn image_tar(work: &Path) -> PathBuf {
    let root = work.join("rootfs");
    for d in ["bin", "sbin", "etc", "tmp", "proc", "sys", "dev"] {
        std::fs::create_dir_all(root.join(d)).unwrap();
    }
    std::fs::copy(which("busybox").unwrap(), root.join("bin/busybox")).unwrap();
    for a in [
        "sh", "cat", "echo", "test", "[", "grep", "tr", "ls", "sleep",
    ] {
        std::os::unix::fs::symlink("busybox", root.join("bin").join(a)).unwrap();
    }
    let gpuburst = bin("gpuburst");
    std::fs::copy(&gpuburst, root.join("bin/gpuburst")).unwrap();
    let ldd = Command::new("ldd").arg(&gpuburst).output().unwrap();
    assert!(ldd.status.success());
    for line in String::from_utf8_lossy(&ldd.stdout).lines() {
        if let Some(p) = line.split_whitespace().find(|w| w.starts_with('/')) {
            let dst = root.join(p.trim_start_matches('/'));
            std::fs::create_dir_all(dst.parent().unwrap()).unwrap();
            std::fs::copy(p, &dst).unwrap();
        }
    }
    std::fs::write(
        root.join("etc/ld.so.conf"),
        "include /etc/ld.so.conf.d/*.conf\n",
    )
    .unwrap();
    std::fs::copy(which("ldconfig").unwrap(), root.join("sbin/ldconfig")).unwrap();
    let tar = work.join("image.tar");
    let st = Command::new("tar")
        .arg("-C")
        .arg(&root)
        .arg("-cf")
        .arg(&tar)
        .arg(".")
        .status()
        .unwrap();
    assert!(st.success());
    tar
}

fn line<'a>(out: &'a str, key: &str) -> &'a str {
    out.lines()
        .find_map(|l| l.strip_prefix(key))
        .unwrap_or_else(|| panic!("no {key} line in:\n{out}"))
}

const PROBE: &str = "echo SHIM=$([ -f /usr/lib/kiwi/libkiwi.so ] && echo yes || echo no); \
    echo PRELOAD=$(cat /etc/ld.so.preload 2>/dev/null | tr '\\n' ' '); \
    echo SOCK=$([ -S /run/kiwi/client/arbiter.sock ] && echo yes || echo no); \
    echo DEV=$([ -c /dev/nvidia0 ] && echo yes || echo no); \
    echo LDCONF=$([ -f /etc/ld.so.conf.d/00-kiwi-driver.conf ] && echo yes || echo no); \
    echo KIWIMOUNTS=$(grep -c kiwi /proc/self/mountinfo)";

#[test]
fn docker_runs_claimed_and_unclaimed_containers_and_a_simulated_pair_takes_turns() {
    for tool in ["dockerd", "busybox", "runc", "tar", "ldd", "ldconfig"] {
        if !require_tool(tool) {
            return;
        }
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        assert!(!is_ci(), "this test needs root (CI=true)");
        eprintln!("SKIPPED: this test needs root");
        return;
    }
    let t0 = Instant::now();
    let work = tempfile::Builder::new().prefix("kd").tempdir().unwrap();
    let w = work.path();
    let sim_dir = kiwi_sim_core::ensure_sim_dir(&profile_dir()).expect("simulator built");
    let arbiter = Arbiter::start(&["--tq", "0.5"]);

    // The host: fake NVIDIA nodes, the simulator as the driver's libraries, Kiwi's config.
    let dev = w.join("dev");
    std::fs::create_dir_all(&dev).unwrap();
    for (name, minor) in [
        ("nvidia0", 0),
        ("nvidiactl", 255),
        ("nvidia-uvm", 250),
        ("nvidia-uvm-tools", 251),
    ] {
        mknod(&dev.join(name), minor);
    }
    let kiwi_config = w.join("kiwi.toml");
    std::fs::write(
        &kiwi_config,
        format!(
            "socket_dir = {sock:?}\n[runtime]\nruntimes = [{runc:?}]\nhook_path = {hook:?}\n\
             shim_path = {shim:?}\ndevice_root = {dev:?}\n\
             driver_files = [{cuda:?}, {nvml:?}]\nlog_path = {log:?}\n",
            sock = arbiter.socket_dir(),
            runc = which("runc").unwrap(),
            hook = bin("kiwi-hook"),
            shim = bin("libkiwi.so"),
            cuda = sim_dir.join("libcuda.so.1"),
            nvml = sim_dir.join("libnvidia-ml.so.1"),
            log = w.join("kiwi.log"),
        ),
    )
    .unwrap();

    let d = Dockerd::start(w, &kiwi_config);
    d.ok(&["import", image_tar(w).to_str().unwrap(), IMAGE]);

    // Install as a user does, then do what the advice says.
    let out = Command::new(bin("kiwictl"))
        .args(["install", "docker", "--config"])
        .arg(&d.daemon_json)
        .arg("--runtime-path")
        .arg(bin("kiwi-runtime"))
        .output()
        .unwrap();
    let said = text(&out);
    assert!(out.status.success(), "{said}");
    assert!(said.contains("systemctl reload docker"), "{said}");
    assert!(!said.contains("restart"), "{said}");
    d.reload();
    let reloaded = Instant::now();
    while !d
        .ok(&["info", "--format", "{{json .Runtimes}}"])
        .contains("\"kiwi\"")
    {
        assert!(
            reloaded.elapsed() < Duration::from_secs(10),
            "dockerd did not pick up runtime kiwi on SIGHUP:\n{}",
            d.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }

    let run = |env: &[&str]| {
        let mut args = vec![
            "run",
            "--rm",
            "--runtime",
            "kiwi",
            "--network",
            "none",
            UNCONFINED,
        ];
        for e in env {
            args.extend(["-e", e]);
        }
        args.extend([IMAGE, "/bin/sh", "-c", PROBE]);
        d.ok(&args)
    };
    let claimed = run(&["KIWI_VISIBLE_DEVICES=0"]);
    assert_eq!(line(&claimed, "SHIM="), "yes", "{claimed}");
    assert_eq!(
        line(&claimed, "PRELOAD="),
        "/usr/lib/kiwi/libkiwi.so",
        "{claimed}"
    );
    assert_eq!(line(&claimed, "SOCK="), "yes", "{claimed}");
    assert_eq!(line(&claimed, "DEV="), "yes", "{claimed}");
    assert_eq!(line(&claimed, "LDCONF="), "yes", "{claimed}");
    let unclaimed = run(&[]);
    for key in ["SHIM=", "SOCK=", "DEV=", "LDCONF="] {
        assert_eq!(line(&unclaimed, key), "no", "{key}\n{unclaimed}");
    }
    assert_eq!(line(&unclaimed, "PRELOAD="), "", "{unclaimed}");
    assert_eq!(line(&unclaimed, "KIWIMOUNTS="), "0", "{unclaimed}");
    eprintln!("claimed and unclaimed runs done at {:?}", t0.elapsed());

    // Two notebooks of 700 MiB on a simulated 1 GiB GPU, each in its own container.
    let out_dir = w.join("out");
    std::fs::create_dir_all(&out_dir).unwrap();
    let sim_name = format!("kiwi-docker-{}", std::process::id());
    let _sim = SimReset(sim_name.clone());
    let volume = format!("{}:/out", out_dir.display());
    // A GPU's memory is no container's: the simulated GPU's is populated from here,
    // so each container's memory limit pays only for its host work (issue #37).
    {
        let cfg = kiwi_sim_core::SimConfig::from_lookup(|k| match k {
            "KIWI_SIM_NAME" => Some(sim_name.clone()),
            "KIWI_SIM_MEMORY" => Some("1GiB".into()),
            "KIWI_SIM_CONTEXT_MEMORY" => Some("48MiB".into()),
            _ => None,
        })
        .unwrap();
        kiwi_sim_core::Machine::open(&cfg)
            .and_then(|m| m.populate(0))
            .unwrap_or_else(|e| panic!("populate the simulated GPU: {e}"));
    }
    let start = |tag: &str| {
        let (sim, stats) = (
            format!("KIWI_SIM_NAME={sim_name}"),
            format!("KIWI_STATS=/out/{tag}.stats"),
        );
        let id = d.ok(&[
            "run",
            "-d",
            "--runtime",
            "kiwi",
            "--network",
            "none",
            "--ipc=host",
            "--pid=host",
            // Below the 700 MiB each swaps out: the node's swap pool holds it, not
            // the container's memory (issue #37; with `--swap-pool off` the first
            // container is OOM-killed at its first swap-out).
            "--memory",
            "384m",
            "--memory-swap",
            "384m",
            UNCONFINED,
            "-v",
            &volume,
            "-e",
            "KIWI_VISIBLE_DEVICES=0",
            "-e",
            &sim,
            "-e",
            "KIWI_SIM_MEMORY=1GiB",
            // Not 300 MiB per context until the arbiter counts each client's
            // non-swappable memory (issue #13): see suite_context_memory.
            "-e",
            "KIWI_SIM_CONTEXT_MEMORY=48MiB",
            "-e",
            &stats,
            "-e",
            "KIWI_REQUIRE_ARBITER=1",
            IMAGE,
            "/bin/gpuburst",
            "--mem",
            "700MiB",
            "--bursts",
            "3",
            "--gpu-ms",
            "200",
            "--cpu-ms",
            "100",
            "--verify",
            "--name",
            tag,
        ]);
        id.trim().to_string()
    };
    let a = start("a");
    std::thread::sleep(Duration::from_millis(300));
    let b = start("b");
    for (tag, id) in [("a", &a), ("b", &b)] {
        let code = d.ok(&["wait", id]);
        let logs = text(&d.run(&["logs", id]));
        assert_eq!(code.trim(), "0", "{tag} failed:\n{logs}");
        assert!(logs.contains("all bytes as expected"), "{tag}:\n{logs}");
        let stats = std::fs::read_to_string(out_dir.join(format!("{tag}.stats")))
            .unwrap_or_else(|e| panic!("{tag}: no shim stats ({e}): the shim did not run\n{logs}"));
        let grants: u64 = stats
            .lines()
            .find_map(|l| l.strip_prefix("grants "))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0);
        assert!(
            grants >= 1,
            "{tag}: the arbiter never granted it the GPU:\n{stats}"
        );
    }
    let usage = kiwi_sim_core::machine::Machine::open_existing(&sim_name)
        .unwrap()
        .expect("the simulated machine")
        .usage(0)
        .unwrap();
    assert!(
        usage.peak <= usage.capacity && usage.peak >= 700 << 20,
        "peak {} of {}",
        usage.peak,
        usage.capacity
    );
    eprintln!("docker end to end took {:?}", t0.elapsed());
    drop(d);
    drop(arbiter);
}
