//! Kubernetes' way in: containerd's CRI plugin, driven as the kubelet drives it
//! (`tests/cri/cri.py`, grpcio stubs of CRI `runtime.v1`), with a `kiwi` runtime handler
//! whose runtime is kiwi-runtime (FIELD-NOTES, "Kubernetes through CRI"):
//!
//! - a notebook pod's claimed container registers with the arbiter through its own
//!   socket, and the arbiter (and `kiwictl status`) name it by its pod: `team-a/nb-0`;
//! - another pod's container that claimed GPU 1 but uses GPU 0 is refused, with a
//!   message naming only its own GPU, never the other pod, and runs unmanaged;
//! - an unclaimed container and the pod sandboxes get nothing: no socket directory, no
//!   record; the claimed containers' records go when their pods are removed;
//! - NVML inside a third pod's container on the notebook's GPU (`cuprobe nvml`: dlopen
//!   and dlsym, as the monitoring tools reach it) tells the free memory its CUDA
//!   tells, and lists its own process only, never the notebook's.
//!
//! containerd runs privately (its own root, state, socket, runc root and CNI
//! directories in a temp dir; overlayfs if this kernel mounts it there, else `native`),
//! pods use the node's network, PID and IPC namespaces (no CNI; the simulator's shared
//! machine and host pids are shared), and the images (a sandbox image that sleeps,
//! and busybox with gpuburst) are docker archives built here and imported with
//! `ctr -n k8s.io images import`: nothing is pulled. Installs nothing itself: under
//! `CI=true` a missing tool (or grpcio) fails, elsewhere the test is skipped.
//! Everything is torn down on drop, failures included.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kiwi_tests::engines::{is_ci, output_within, text, unmount_under, which};
use kiwi_tests::{bin, profile_dir, require_tool, wait_until, Arbiter};

const SANDBOX_IMAGE: &str = "docker.io/kiwi-test/sandbox:cri";
const GPU_IMAGE: &str = "docker.io/kiwi-test/gpuburst:cri";
/// The namespace the CRI plugin keeps its containers and images in.
const K8S_NS: &str = "k8s.io";

/// The last `n` lines of a file, for failure messages.
fn tail(path: &Path, n: usize) -> String {
    let s = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Whether `pid` is still running (a zombie is not: it has exited, unreaped).
fn running(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rsplit_once(") ").map(|(_, rest)| !rest.starts_with('Z')))
        .unwrap_or(false)
}

/// Whether an overlay mount works in `dir` (not on every CI container's filesystem):
/// containerd's default snapshotter, much faster than `native`'s full copies.
fn overlay_works(dir: &Path) -> bool {
    let probe = dir.join("overlay-probe");
    for d in ["lower", "upper", "work", "merged"] {
        std::fs::create_dir_all(probe.join(d)).unwrap();
    }
    let c = |s: String| std::ffi::CString::new(s).unwrap();
    let merged = c(probe.join("merged").display().to_string());
    let opts = c(format!(
        "lowerdir={},upperdir={},workdir={}",
        probe.join("lower").display(),
        probe.join("upper").display(),
        probe.join("work").display()
    ));
    let fstype = c("overlay".into());
    // SAFETY: valid C strings; a fresh mount on a directory this test owns.
    let ok = unsafe {
        libc::mount(
            fstype.as_ptr(),
            merged.as_ptr(),
            fstype.as_ptr(),
            0,
            opts.as_ptr().cast(),
        )
    } == 0;
    if ok {
        // SAFETY: as above; unmounts what was just mounted.
        unsafe { libc::umount2(merged.as_ptr(), libc::MNT_DETACH) };
    }
    let _ = std::fs::remove_dir_all(&probe);
    ok
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

fn sha256_hex(path: &Path) -> String {
    let out = Command::new("sha256sum").arg(path).output().unwrap();
    assert!(out.status.success(), "sha256sum {}", path.display());
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .unwrap()
        .to_string()
}

fn tar_dir(dir: &Path, archive: &Path) {
    let st = Command::new("tar")
        .arg("-C")
        .arg(dir)
        .args(["--numeric-owner", "-cf"])
        .arg(archive)
        .arg(".")
        .status()
        .unwrap();
    assert!(st.success(), "tar of {}", dir.display());
}

/// A rootfs with static busybox and the named applets.
fn busybox_rootfs(root: &Path, applets: &[&str]) {
    for d in ["bin", "sbin", "etc", "tmp", "proc", "sys", "dev", "run"] {
        std::fs::create_dir_all(root.join(d)).unwrap();
    }
    std::fs::copy(which("busybox").unwrap(), root.join("bin/busybox")).unwrap();
    for a in applets {
        std::os::unix::fs::symlink("busybox", root.join("bin").join(a)).unwrap();
    }
}

/// The GPU image's rootfs, as tests/docker.rs builds it: busybox, gpuburst with the
/// libraries `ldd` names, an ld.so.conf and the host's ldconfig (a glibc image, whose
/// ld cache kiwi-hook updates for the bound simulator libraries).
fn gpu_rootfs(root: &Path) {
    busybox_rootfs(root, &["sh", "cat", "echo", "ls", "sleep"]);
    let gpuburst = bin("gpuburst");
    std::fs::copy(&gpuburst, root.join("bin/gpuburst")).unwrap();
    // The same libraries as gpuburst's (libc's): what NVML says inside a container.
    std::fs::copy(bin("cuprobe"), root.join("bin/cuprobe")).unwrap();
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
}

/// A docker archive (`docker save`'s format: manifest.json, each image's config and
/// its one layer tar) holding `images`: (name, rootfs, the config's `config`).
fn docker_archive(work: &Path, images: &[(&str, PathBuf, serde_json::Value)]) -> PathBuf {
    let dir = work.join("archive");
    std::fs::create_dir_all(&dir).unwrap();
    let arch = if cfg!(target_arch = "aarch64") {
        "arm64"
    } else {
        "amd64"
    };
    let mut manifest = Vec::new();
    for (i, (name, rootfs, config)) in images.iter().enumerate() {
        let layer = dir.join(format!("layer{i}.tar"));
        tar_dir(rootfs, &layer);
        let layer_hex = sha256_hex(&layer);
        std::fs::create_dir_all(dir.join(&layer_hex)).unwrap();
        std::fs::rename(&layer, dir.join(&layer_hex).join("layer.tar")).unwrap();
        let cfg = serde_json::json!({
            "architecture": arch,
            "os": "linux",
            "config": config,
            "rootfs": {"type": "layers", "diff_ids": [format!("sha256:{layer_hex}")]},
        });
        let cfg_file = dir.join(format!("config{i}.json"));
        std::fs::write(&cfg_file, serde_json::to_vec(&cfg).unwrap()).unwrap();
        let cfg_hex = sha256_hex(&cfg_file);
        std::fs::rename(&cfg_file, dir.join(format!("{cfg_hex}.json"))).unwrap();
        manifest.push(serde_json::json!({
            "Config": format!("{cfg_hex}.json"),
            "RepoTags": [name],
            "Layers": [format!("{layer_hex}/layer.tar")],
        }));
    }
    std::fs::write(
        dir.join("manifest.json"),
        serde_json::to_vec(&manifest).unwrap(),
    )
    .unwrap();
    let archive = work.join("images.tar");
    tar_dir(&dir, &archive);
    archive
}

/// A private containerd with the CRI plugin; on drop its pods are stopped and removed,
/// leftover shims killed, it is stopped, and what it mounted is unmounted.
struct Containerd {
    child: Child,
    dir: PathBuf,
    address: PathBuf,
    /// cri.py's stub cache and pod configs.
    cri_state: PathBuf,
    kiwi_log: PathBuf,
    snapshotter: &'static str,
    /// The pods' cgroup parent (cgroupfs), this test's own: removed on drop.
    cgroup_parent: String,
    /// The runtimes' runc state root (their `Root` option), this test's own.
    runc_root: PathBuf,
    pods: std::cell::RefCell<Vec<String>>,
}

impl Containerd {
    fn start(dir: &Path, kiwi_config: &Path, kiwi_log: &Path) -> Containerd {
        let snapshotter = if overlay_works(dir) {
            "overlayfs"
        } else {
            "native"
        };
        let address = dir.join("ctrd.sock");
        let config = dir.join("containerd.toml");
        let cri = "plugins.\"io.containerd.grpc.v1.cri\"";
        // restrict_oom_score_adj: the sandbox asks for -998, which a test (or CI)
        // container's root may not set (runc: "failed to update
        // /proc/self/oom_score_adj: Permission denied"); no lower than containerd's own.
        // disable_apparmor: loading CRI's profile needs apparmor_parser; Kiwi does not
        // depend on it either way.
        let runc_root = dir.join("runc");
        std::fs::write(
            &config,
            format!(
                "version = 2\n\
                 disabled_plugins = [\"io.containerd.snapshotter.v1.btrfs\", \"io.containerd.snapshotter.v1.zfs\", \
                 \"io.containerd.snapshotter.v1.devmapper\", \"io.containerd.snapshotter.v1.aufs\"]\n\
                 [plugins.\"io.containerd.internal.v1.opt\"]\n  path = {opt:?}\n\
                 [{cri}]\n  sandbox_image = {SANDBOX_IMAGE:?}\n  disable_apparmor = true\n  \
                 restrict_oom_score_adj = true\n\
                 [{cri}.containerd]\n  snapshotter = {snapshotter:?}\n  default_runtime_name = \"runc\"\n\
                 [{cri}.containerd.runtimes.runc]\n  runtime_type = \"io.containerd.runc.v2\"\n\
                 [{cri}.containerd.runtimes.runc.options]\n  Root = {runc_root:?}\n\
                 [{cri}.containerd.runtimes.kiwi]\n  runtime_type = \"io.containerd.runc.v2\"\n\
                 [{cri}.containerd.runtimes.kiwi.options]\n  BinaryName = {runtime:?}\n  Root = {runc_root:?}\n\
                 [{cri}.cni]\n  bin_dir = {cni_bin:?}\n  conf_dir = {cni_conf:?}\n",
                opt = dir.join("opt"),
                runtime = bin("kiwi-runtime"),
                cni_bin = dir.join("cni/bin"),
                cni_conf = dir.join("cni/conf"),
            ),
        )
        .unwrap();
        let log = std::fs::File::create(dir.join("containerd.log")).unwrap();
        let child = Command::new(which("containerd").unwrap())
            .arg("--config")
            .arg(&config)
            .arg("--root")
            .arg(dir.join("root"))
            .arg("--state")
            .arg(dir.join("state"))
            .arg("--address")
            .arg(&address)
            // kiwi-runtime finds its config through the shim, which inherits this env.
            .env("KIWI_CONFIG", kiwi_config)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start containerd");
        let c = Containerd {
            child,
            dir: dir.to_path_buf(),
            address,
            cri_state: dir.join("cri-state"),
            kiwi_log: kiwi_log.to_path_buf(),
            snapshotter,
            cgroup_parent: format!("/kiwi-cri-test-{}", std::process::id()),
            runc_root,
            pods: Default::default(),
        };
        let t0 = Instant::now();
        loop {
            let out = output_within(c.ctr(&["version"]), Duration::from_secs(10));
            if out.status.success() {
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "containerd did not come up: {}\n{}",
                text(&out),
                c.logs()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        c
    }

    /// The tails of containerd's and Kiwi's logs.
    fn logs(&self) -> String {
        format!(
            "--- containerd.log:\n{}\n--- kiwi log:\n{}",
            tail(&self.dir.join("containerd.log"), 40),
            tail(&self.kiwi_log, 40)
        )
    }

    fn ctr(&self, args: &[&str]) -> Command {
        let mut c = Command::new(which("ctr").unwrap());
        c.arg("--address")
            .arg(&self.address)
            .args(["--namespace", K8S_NS])
            .args(args);
        c
    }

    fn import(&self, archive: &Path) {
        let out = output_within(
            self.ctr(&[
                "images",
                "import",
                "--snapshotter",
                self.snapshotter,
                archive.to_str().unwrap(),
            ]),
            Duration::from_secs(60),
        );
        assert!(
            out.status.success(),
            "import: {}\n{}",
            text(&out),
            self.logs()
        );
    }

    fn cri(&self, args: &[&str]) -> Command {
        let mut c = Command::new("python3");
        c.arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("cri/cri.py"))
            .arg("--address")
            .arg(&self.address)
            .arg("--state")
            .arg(&self.cri_state)
            .args(args);
        c
    }

    /// Runs cri.py; its output's first line (an id) on success.
    fn cri_ok(&self, args: &[&str]) -> String {
        let out = output_within(self.cri(args), Duration::from_secs(90));
        assert!(
            out.status.success(),
            "cri.py {args:?}: {}\n{}",
            text(&out),
            self.logs()
        );
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .next()
            .unwrap_or("")
            .trim()
            .to_string()
    }

    fn run_pod(&self, name: &str, namespace: &str) -> String {
        let uid = format!("uid-{name}-{}", std::process::id());
        let log_dir = self.dir.join("logs").join(name);
        let id = self.cri_ok(&[
            "run-pod",
            "--name",
            name,
            "--namespace",
            namespace,
            "--uid",
            &uid,
            "--handler",
            "kiwi",
            "--log-dir",
            log_dir.to_str().unwrap(),
            "--cgroup-parent",
            &self.cgroup_parent,
        ]);
        assert!(!id.is_empty(), "run-pod printed no id");
        self.pods.borrow_mut().push(id.clone());
        id
    }

    /// Creates and starts a container; returns its id and its log file.
    fn start_container(
        &self,
        pod: &str,
        pod_name: &str,
        name: &str,
        env: &[String],
        argv: &[&str],
    ) -> (String, PathBuf) {
        let log = format!("{name}.log");
        let mut args = vec![
            "create-start",
            "--pod",
            pod,
            "--name",
            name,
            "--image",
            GPU_IMAGE,
            "--log",
            &log,
        ];
        for e in env {
            args.extend(["--env", e]);
        }
        args.push("--");
        args.extend(argv);
        let id = self.cri_ok(&args);
        assert!(!id.is_empty(), "create-start printed no id");
        (id, self.dir.join("logs").join(pod_name).join(log))
    }

    fn stop_remove_pod(&self, pod: &str) {
        self.cri_ok(&["stop-remove-pod", pod]);
        self.pods.borrow_mut().retain(|p| p != pod);
    }

    /// The bundle's `config.json` containerd wrote for a container.
    fn spec(&self, id: &str) -> serde_json::Value {
        let p = self
            .dir
            .join("state/io.containerd.runtime.v2.task")
            .join(K8S_NS)
            .join(id)
            .join("config.json");
        let bytes = std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        serde_json::from_slice(&bytes).unwrap()
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        for pod in self.pods.take() {
            let cmd = self.cri(&["stop-remove-pod", &pod]);
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                output_within(cmd, Duration::from_secs(30))
            }));
        }
        // Whatever is left of the containers (the pods could not be removed): runc's
        // own state root is ours, so everything in it is this test's.
        let root = self.runc_root.join(K8S_NS);
        if let Ok(out) = Command::new(which("runc").unwrap())
            .arg("--root")
            .arg(&root)
            .args(["list", "-q"])
            .output()
        {
            for id in String::from_utf8_lossy(&out.stdout).split_whitespace() {
                let _ = Command::new(which("runc").unwrap())
                    .arg("--root")
                    .arg(&root)
                    .args(["delete", "--force", id])
                    .output();
            }
        }
        // Shims outlive containerd; ours are the ones started with our unique address.
        let addr = self.address.to_string_lossy().into_owned();
        if let Ok(rd) = std::fs::read_dir("/proc") {
            for e in rd.flatten() {
                let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
                    continue;
                };
                let cmd = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
                let cmd = String::from_utf8_lossy(&cmd);
                if cmd.contains("containerd-shim") && cmd.contains(&addr) {
                    // SAFETY: kill with a pid read from /proc and a valid signal.
                    unsafe { libc::kill(pid, libc::SIGKILL) };
                }
            }
        }
        let pid = self.child.id() as i32;
        // SAFETY: signalling the containerd this test started.
        unsafe { libc::kill(pid, libc::SIGTERM) };
        let t0 = Instant::now();
        while running(pid) && t0.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        unmount_under(&self.dir);
        // The pods' cgroup parent, in each v1 hierarchy or the v2 one (empty by now:
        // runc removed the pods' own cgroups).
        let name = self.cgroup_parent.trim_start_matches('/');
        let _ = std::fs::remove_dir(Path::new("/sys/fs/cgroup").join(name));
        for e in std::fs::read_dir("/sys/fs/cgroup")
            .into_iter()
            .flatten()
            .flatten()
        {
            let _ = std::fs::remove_dir(e.path().join(name));
        }
    }
}

/// `wait_until`, with `diag()` in the failure message.
fn wait_or(what: &str, timeout: Duration, f: impl FnMut() -> bool, diag: impl FnOnce() -> String) {
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        wait_until(what, timeout, f)
    }));
    if r.is_err() {
        panic!("timed out waiting for {what}\n{}", diag());
    }
}

/// The records in `<socket-dir>/containers` (their container ids) and the other
/// entries there (the per-container directories).
fn records(socket_dir: &Path) -> (Vec<kiwi_config::containers::ContainerRecord>, Vec<String>) {
    let dir = kiwi_config::containers::containers_dir(socket_dir);
    let mut recs = Vec::new();
    let mut others = Vec::new();
    for e in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.ends_with(".json") {
            let bytes = std::fs::read(e.path()).unwrap_or_default();
            match serde_json::from_slice(&bytes) {
                Ok(r) => recs.push(r),
                // Being written or removed right now.
                Err(_) => others.push(name),
            }
        } else {
            others.push(name);
        }
    }
    (recs, others)
}

#[test]
fn cri_pods_get_their_own_sockets_named_by_pod() {
    for tool in [
        "containerd",
        "containerd-shim-runc-v2",
        "ctr",
        "runc",
        "busybox",
        "tar",
        "ldd",
        "ldconfig",
        "sha256sum",
        "python3",
    ] {
        if !require_tool(tool) {
            return;
        }
    }
    let grpc = Command::new("python3")
        .args(["-c", "import grpc, grpc_tools"])
        .output()
        .unwrap();
    if !grpc.status.success() {
        assert!(
            !is_ci(),
            "python3 cannot import grpc and grpc_tools (CI=true; .ci/pip-packages installs them): {}",
            text(&grpc)
        );
        eprintln!(
            "SKIPPED: python3 cannot import grpc and grpc_tools (pip install grpcio grpcio-tools)"
        );
        return;
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        assert!(!is_ci(), "this test needs root (CI=true)");
        eprintln!("SKIPPED: this test needs root");
        return;
    }
    let t0 = Instant::now();
    let work = tempfile::Builder::new().prefix("kcri").tempdir().unwrap();
    let w = work.path();
    let sim_name = format!("kiwi-cri-{}", std::process::id());
    let _sim = SimReset(sim_name.clone());
    let sim_dir = kiwi_sim_core::ensure_sim_dir(&profile_dir()).expect("simulator built");
    let arbiter = Arbiter::start(&[]);
    let sock_dir = arbiter.socket_dir().to_path_buf();
    let uuid = |i| kiwi_sim_core::ident::gpu_uuid_string(&sim_name, i);
    let (gpu0, gpu1) = (uuid(0), uuid(1));

    // The node: two fake NVIDIA GPUs, the simulator as the driver, a GPU list naming
    // the simulator's UUIDs (the hook resolves index claims with it; no NVML).
    let dev = w.join("dev");
    std::fs::create_dir_all(&dev).unwrap();
    for (name, minor) in [
        ("nvidia0", 0),
        ("nvidia1", 1),
        ("nvidiactl", 255),
        ("nvidia-uvm", 250),
        ("nvidia-uvm-tools", 251),
    ] {
        mknod(&dev.join(name), minor);
    }
    let gpu_list = w.join("gpus.list");
    std::fs::write(&gpu_list, format!("0 {gpu0}\n1 {gpu1}\n")).unwrap();
    let kiwi_log = w.join("kiwi.log");
    let kiwi_config = w.join("kiwi.toml");
    std::fs::write(
        &kiwi_config,
        format!(
            "socket_dir = {sock:?}\n[runtime]\nruntimes = [{runc:?}]\nhook_path = {hook:?}\n\
             shim_path = {shim:?}\ndevice_root = {dev:?}\n\
             driver_files = [{cuda:?}, {nvml:?}]\nlog_path = {log:?}\n\
             [device_plugin]\ngpu_list = {gpu_list:?}\n",
            sock = sock_dir,
            runc = which("runc").unwrap(),
            hook = bin("kiwi-hook"),
            shim = bin("libkiwi.so"),
            cuda = sim_dir.join("libcuda.so.1"),
            nvml = sim_dir.join("libnvidia-ml.so.1"),
            log = kiwi_log,
        ),
    )
    .unwrap();

    let ctrd = Containerd::start(w, &kiwi_config, &kiwi_log);
    let sandbox_root = w.join("sandbox-rootfs");
    busybox_rootfs(&sandbox_root, &["sleep"]);
    let gpu_root = w.join("gpu-rootfs");
    gpu_rootfs(&gpu_root);
    let archive = docker_archive(
        w,
        &[
            (
                SANDBOX_IMAGE,
                sandbox_root,
                serde_json::json!({"Entrypoint": ["/bin/sleep", "2147483647"]}),
            ),
            (
                GPU_IMAGE,
                gpu_root,
                serde_json::json!({"Env": ["PATH=/bin:/sbin"], "Cmd": ["/bin/sh"]}),
            ),
        ],
    );
    ctrd.import(&archive);
    // The CRI plugin learns of imported images from containerd's events.
    ctrd.cri_ok(&["wait-images", SANDBOX_IMAGE, GPU_IMAGE]);
    eprintln!(
        "containerd ({} snapshotter) up and images in at {:?}",
        ctrd.snapshotter,
        t0.elapsed()
    );

    let sim_env = |claim: Option<&str>, require: bool| {
        let mut env = vec![
            format!("KIWI_SIM_NAME={sim_name}"),
            "KIWI_SIM_GPUS=2".to_string(),
            "KIWI_SIM_MEMORY=1GiB".to_string(),
            "KIWI_SIM_CONTEXT_MEMORY=48MiB".to_string(),
        ];
        if let Some(c) = claim {
            env.push(format!("KIWI_VISIBLE_DEVICES={c}"));
        }
        if require {
            env.push("KIWI_REQUIRE_ARBITER=1".to_string());
        }
        env
    };

    // Pod A: a notebook on GPU 0, registered until its pod is stopped.
    let pod_a = ctrd.run_pod("nb-0", "team-a");
    let (nb, nb_log) = ctrd.start_container(
        &pod_a,
        "nb-0",
        "notebook",
        &sim_env(Some("0"), true),
        &[
            "/bin/gpuburst",
            "--mem",
            "100MiB",
            "--script",
            "gpu:100,idle:600000",
            "--device",
            "0",
            "--name",
            "a",
        ],
    );
    let diag = |log: &Path| {
        format!(
            "--- container log {}:\n{}\n{}",
            log.display(),
            tail(log, 30),
            ctrd.logs()
        )
    };
    let on_gpu0 = || {
        arbiter
            .status()
            .gpus
            .into_iter()
            .filter(|g| g.uuid == gpu0)
            .flat_map(|g| g.clients)
            .collect::<Vec<_>>()
    };
    wait_or(
        "the notebook to register on GPU 0",
        Duration::from_secs(30),
        || !on_gpu0().is_empty(),
        || diag(&nb_log),
    );
    let clients = on_gpu0();
    assert_eq!(clients.len(), 1, "{clients:?}");
    let c = &clients[0];
    assert_eq!(c.pod_name.as_deref(), Some("nb-0"), "{c:?}");
    assert_eq!(c.pod_namespace.as_deref(), Some("team-a"), "{c:?}");
    assert_eq!(c.container_id.as_deref(), Some(nb.as_str()), "{c:?}");
    eprintln!("notebook registered at {:?}", t0.elapsed());

    let out = output_within(
        {
            let mut k = Command::new(bin("kiwictl"));
            k.arg("--socket-dir")
                .arg(&sock_dir)
                .arg("status")
                .env_remove("KIWI_CONFIG")
                .env("KIWI_SOCKET_DIR", &sock_dir);
            k
        },
        Duration::from_secs(20),
    );
    let said = text(&out);
    assert!(out.status.success(), "kiwictl status: {said}");
    assert!(said.contains("team-a/nb-0"), "kiwictl status:\n{said}");

    // What containerd told the runtime about the notebook (the hook's identity).
    let spec = ctrd.spec(&nb);
    let ann = &spec["annotations"];
    eprintln!(
        "the notebook's config.json annotations: {}",
        serde_json::to_string_pretty(ann).unwrap()
    );
    for (k, v) in [
        ("io.kubernetes.cri.sandbox-name", "nb-0"),
        ("io.kubernetes.cri.sandbox-namespace", "team-a"),
        ("io.kubernetes.cri.container-name", "notebook"),
        ("io.kubernetes.cri.container-type", "container"),
    ] {
        assert_eq!(ann[k].as_str(), Some(v), "{k} in {ann}");
    }

    // Pod C, on the notebook's GPU too: NVML inside it (dlopen + dlsym, as the tools
    // do) says what its CUDA says is free and lists its own process only, never the
    // notebook of pod A (issue #39).
    let pod_c = ctrd.run_pod("nb-2", "team-c");
    let (probe, probe_log) = ctrd.start_container(
        &pod_c,
        "nb-2",
        "probe",
        &sim_env(Some("0"), true),
        &["/bin/cuprobe", "nvml", "--mib", "64", "--hold-ms", "600000"],
    );
    let mut said = String::new();
    wait_or(
        "pod C's NVML line",
        Duration::from_secs(30),
        || {
            said = std::fs::read_to_string(&probe_log).unwrap_or_default();
            said.contains("nvml free ")
        },
        || diag(&probe_log),
    );
    let line = said
        .lines()
        .find(|l| l.contains("nvml free "))
        .unwrap()
        .to_string();
    let words: Vec<&str> = line[line.find("nvml free ").unwrap()..]
        .split_whitespace()
        .collect();
    let (nvml_free, cuda_free): (i64, i64) = (words[2].parse().unwrap(), words[5].parse().unwrap());
    assert!(
        (nvml_free - cuda_free).abs() <= 2 << 20,
        "NVML's free is CUDA's in pod C: {line}"
    );
    let own_pid = words[7];
    let listed: Vec<&str> = words
        .get(9)
        .map(|l| l.split(',').filter_map(|e| e.split(':').next()).collect())
        .unwrap_or_default();
    assert_eq!(
        listed,
        vec![own_pid],
        "pod C sees its own process only: {line}"
    );
    for c in &clients {
        assert!(
            !listed.contains(&c.host_pid.to_string().as_str()),
            "the notebook's pid {} leaked to pod C: {line}",
            c.host_pid
        );
    }
    ctrd.stop_remove_pod(&pod_c);
    eprintln!("pod C's NVML view checked at {:?}", t0.elapsed());

    // Pod B: claims GPU 1 but uses GPU 0, the notebook's: refused, runs unmanaged.
    let pod_b = ctrd.run_pod("nb-1", "team-b");
    let (thief, thief_log) = ctrd.start_container(
        &pod_b,
        "nb-1",
        "thief",
        &sim_env(Some("1"), false),
        &[
            "/bin/gpuburst",
            "--mem",
            "100MiB",
            "--script",
            "gpu:100",
            "--device",
            "0",
            "--name",
            "b",
        ],
    );
    let may_use = format!("it may use {gpu1}");
    wait_or(
        "the refusal in the thief's log",
        Duration::from_secs(30),
        || {
            let log = std::fs::read_to_string(&thief_log).unwrap_or_default();
            log.contains("was not given to this container") && log.contains(&may_use)
        },
        || diag(&thief_log),
    );
    let log = std::fs::read_to_string(&thief_log).unwrap();
    assert!(log.contains("UnknownGpu"), "{log}");
    assert!(log.contains("UNMANAGED"), "{log}");
    assert!(
        log.contains(&gpu0),
        "the refusal names the GPU asked for:\n{log}"
    );
    for other in ["nb-0", "team-a", nb.as_str(), &nb[..12]] {
        assert!(!log.contains(other), "{other:?} leaked to pod B:\n{log}");
    }
    let st = arbiter.status();
    for g in &st.gpus {
        for c in &g.clients {
            assert_ne!(c.pod_name.as_deref(), Some("nb-1"), "{c:?} on {}", g.uuid);
        }
    }
    eprintln!("pod B refused at {:?}", t0.elapsed());

    // An unclaimed container in pod B: nothing injected.
    let (plain, plain_log) = ctrd.start_container(
        &pod_b,
        "nb-1",
        "plain",
        &[],
        &["/bin/sh", "-c", "ls /run/kiwi/client 2>&1; echo DONE"],
    );
    wait_or(
        "the unclaimed container's DONE",
        Duration::from_secs(30),
        || {
            std::fs::read_to_string(&plain_log)
                .unwrap_or_default()
                .contains("DONE")
        },
        || diag(&plain_log),
    );
    let log = std::fs::read_to_string(&plain_log).unwrap();
    assert!(
        log.contains("/run/kiwi/client: No such file or directory"),
        "{log}"
    );
    assert!(!log.contains("arbiter.sock"), "{log}");

    // Records: only the claimed containers' (the notebook's while it runs; the
    // thief's until its exited container is deleted), never a sandbox's.
    let (recs, others) = records(&sock_dir);
    let claimed = [nb.as_str(), thief.as_str(), probe.as_str()];
    let key = |id: &str| kiwi_config::containers::key_for(id).unwrap();
    for r in &recs {
        assert!(
            claimed.contains(&r.id.as_str()),
            "a record for {} (pods {pod_a} {pod_b}, unclaimed {plain}): {r:?}",
            r.id
        );
    }
    for o in &others {
        assert!(
            claimed.iter().any(|id| key(id) == *o),
            "{o} in {}",
            kiwi_config::containers::containers_dir(&sock_dir).display()
        );
    }
    let rec = recs
        .iter()
        .find(|r| r.id == nb)
        .unwrap_or_else(|| panic!("no record for the running notebook: {recs:?}"));
    assert_eq!(rec.pod_name.as_deref(), Some("nb-0"), "{rec:?}");
    assert_eq!(rec.pod_namespace.as_deref(), Some("team-a"), "{rec:?}");
    assert_eq!(rec.container_name.as_deref(), Some("notebook"), "{rec:?}");
    assert_eq!(rec.gpus, vec![gpu0.clone()], "{rec:?}");
    assert!(!rec.any_gpu, "{rec:?}");

    // Removing the pods removes every record and directory (kiwi-hook poststop).
    ctrd.stop_remove_pod(&pod_a);
    ctrd.stop_remove_pod(&pod_b);
    wait_or(
        "no records or directories left",
        Duration::from_secs(10),
        || {
            let (r, o) = records(&sock_dir);
            r.is_empty() && o.is_empty()
        },
        || format!("{:?}\n{}", records(&sock_dir), ctrd.logs()),
    );
    wait_or(
        "the arbiter to forget the notebook",
        Duration::from_secs(10),
        || on_gpu0().is_empty(),
        || format!("{:?}", arbiter.status()),
    );
    eprintln!("CRI end to end took {:?}", t0.elapsed());
    drop(ctrd);
    drop(arbiter);
}
