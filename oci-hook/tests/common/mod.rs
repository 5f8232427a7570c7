//! Fixtures for the tests that run the real thing: fake NVIDIA device nodes made with
//! mknod, a fake shim, a config file, a busybox bundle, an arbiter-socket stand-in.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub const RUNTIME: &str = env!("CARGO_BIN_EXE_kiwi-runtime");
pub const HOOK: &str = env!("CARGO_BIN_EXE_kiwi-hook");
pub const SHIM_CONTENT: &str = "kiwi-fake-shim-for-tests";
pub const DRIVER_CONTENT: &str = "fake-libcuda-for-tests";
pub const UUID0: &str = "GPU-11111111-2222-3333-4444-555555555555";
pub const UUID1: &str = "GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee";
/// NVIDIA's real major for nvidia<N> and nvidiactl; no driver here, so opening gives ENXIO.
pub const NV_MAJOR: u64 = 195;

pub fn is_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true")
}

pub fn which(tool: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin"].map(PathBuf::from))
        .map(|d| d.join(tool))
        .find(|p| p.is_file())
}

/// True when every tool is there and we are root. Otherwise fails under CI=true and
/// prints a loud skip message elsewhere.
pub fn require(tools: &[&str]) -> bool {
    let mut missing: Vec<String> = tools
        .iter()
        .filter(|t| which(t).is_none())
        .map(|t| t.to_string())
        .collect();
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        missing.push("root privileges".into());
    }
    if missing.is_empty() {
        return true;
    }
    let msg = format!("this test needs {}", missing.join(", "));
    if is_ci() {
        panic!("{msg} (CI=true: installing it is part of .ci/apt-packages)");
    }
    eprintln!("\n!!!!!!!! SKIPPED: {msg} !!!!!!!!\n");
    false
}

static COUNTER: AtomicUsize = AtomicUsize::new(0);

pub fn unique_id(prefix: &str) -> String {
    format!(
        "{prefix}-{}-{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::SeqCst)
    )
}

fn mknod(path: &Path, major: u64, minor: u64) {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: valid C string; creating a character device node.
    let rc = unsafe {
        libc::mknod(
            c.as_ptr(),
            libc::S_IFCHR | 0o666,
            libc::makedev(major as u32, minor as u32),
        )
    };
    assert_eq!(
        rc,
        0,
        "mknod {}: {}",
        path.display(),
        std::io::Error::last_os_error()
    );
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666)).unwrap();
}

/// Everything a claimed container needs on a "host" built inside a temp dir.
pub struct Fixture {
    pub dir: tempfile::TempDir,
    pub dev: PathBuf,
    pub shim: PathBuf,
    pub socket_dir: PathBuf,
    pub config: PathBuf,
    pub log: PathBuf,
    pub driver_file: PathBuf,
    pub gpu_list: PathBuf,
    pub runc_root: PathBuf,
}

impl Fixture {
    pub fn new() -> Fixture {
        let dir = tempfile::Builder::new()
            .prefix("kiwi-oci-test")
            .tempdir()
            .unwrap();
        let root = dir.path().to_path_buf();
        let dev = root.join("dev");
        std::fs::create_dir_all(&dev).unwrap();
        mknod(&dev.join("nvidia0"), NV_MAJOR, 0);
        mknod(&dev.join("nvidia1"), NV_MAJOR, 1);
        mknod(&dev.join("nvidiactl"), NV_MAJOR, 255);
        mknod(&dev.join("nvidia-uvm"), NV_MAJOR, 250);
        mknod(&dev.join("nvidia-uvm-tools"), NV_MAJOR, 251);
        let shim = root.join("lib/libkiwi.so");
        std::fs::create_dir_all(shim.parent().unwrap()).unwrap();
        std::fs::write(&shim, SHIM_CONTENT).unwrap();
        let driver_file = root.join("driver/libcuda.so.1");
        std::fs::create_dir_all(driver_file.parent().unwrap()).unwrap();
        std::fs::write(&driver_file, DRIVER_CONTENT).unwrap();
        let gpu_list = root.join("gpus.txt");
        std::fs::write(&gpu_list, format!("# index uuid\n0 {UUID0}\n1 {UUID1}\n")).unwrap();
        let socket_dir = root.join("run-kiwi");
        std::fs::create_dir_all(socket_dir.join("client")).unwrap();
        let fx = Fixture {
            config: root.join("kiwi.toml"),
            log: root.join("kiwi.log"),
            runc_root: root.join("runc-root"),
            dev,
            shim,
            socket_dir,
            driver_file,
            gpu_list,
            dir,
        };
        fx.write_config("");
        fx
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Writes the config file; `runtime_extra` lines go into `[runtime]`.
    pub fn write_config_with(&self, runtimes: &str, shim: &Path, runtime_extra: &str) {
        let text = format!(
            "socket_dir = {sock:?}\n\n[runtime]\nruntimes = {runtimes}\nhook_path = {hook:?}\nshim_path = {shim:?}\ndevice_root = {dev:?}\ndriver_files = [{drv:?}]\nlog_path = {log:?}\n{runtime_extra}\n\n[device_plugin]\ngpu_list = {list:?}\n",
            sock = self.socket_dir,
            hook = HOOK,
            dev = self.dev,
            drv = self.driver_file,
            log = self.log,
            list = self.gpu_list,
        );
        std::fs::write(&self.config, text).unwrap();
    }

    pub fn write_config(&self, runtime_extra: &str) {
        self.write_config_with("[\"runc\"]", &self.shim, runtime_extra);
    }

    /// A busybox bundle (from `runc spec`: read-only root, deny-all device cgroup)
    /// running `script` with `env` added to the process environment.
    pub fn bundle(&self, name: &str, script: &str, env: &[&str]) -> PathBuf {
        let bundle = self.path().join(name);
        let rootfs = bundle.join("rootfs");
        busybox_rootfs(&rootfs);
        let out = Command::new(which("runc").unwrap())
            .args(["spec", "--bundle"])
            .arg(&bundle)
            .output()
            .unwrap();
        assert!(out.status.success(), "runc spec: {out:?}");
        let p = bundle.join("config.json");
        let mut spec: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
        spec["process"]["terminal"] = false.into();
        spec["process"]["args"] = serde_json::json!(["/bin/sh", "-c", script]);
        let e = spec["process"]["env"].as_array_mut().unwrap();
        for kv in env {
            e.push(kv.to_string().into());
        }
        std::fs::write(&p, serde_json::to_vec_pretty(&spec).unwrap()).unwrap();
        bundle
    }

    /// A command running `kiwi-runtime` with this fixture's config.
    pub fn kiwi_runtime(&self) -> Command {
        let mut c = Command::new(RUNTIME);
        c.env("KIWI_CONFIG", &self.config);
        c.env_remove("KIWI_SOCKET_DIR");
        c
    }

    /// `kiwi-runtime --root <runc-root> run --bundle B <id>`, output captured.
    pub fn run_container(&self, bundle: &Path) -> Output {
        let id = unique_id("kiwi-oci");
        let _guard = RuncDelete {
            root: self.runc_root.clone(),
            id: id.clone(),
        };
        self.kiwi_runtime()
            .arg("--root")
            .arg(&self.runc_root)
            .args(["run", "--bundle"])
            .arg(bundle)
            .arg(&id)
            .stdin(Stdio::null())
            .output()
            .unwrap()
    }

    /// IDs of containers runc still knows under this fixture's root.
    pub fn runc_list(&self) -> String {
        let out = Command::new(which("runc").unwrap())
            .arg("--root")
            .arg(&self.runc_root)
            .args(["list", "-q"])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }
}

/// Deletes a runc container on drop, so a failing test leaves none behind.
pub struct RuncDelete {
    pub root: PathBuf,
    pub id: String,
}

impl Drop for RuncDelete {
    fn drop(&mut self) {
        if let Some(runc) = which("runc") {
            let _ = Command::new(runc)
                .arg("--root")
                .arg(&self.root)
                .args(["delete", "-f", &self.id])
                .stderr(Stdio::null())
                .status();
        }
    }
}

/// A static binary that connects to a Unix socket, built from tests/helpers/uconnect.c.
pub fn uconnect_binary(out_dir: &Path) -> PathBuf {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/helpers/uconnect.c");
    let out = out_dir.join("uconnect");
    let st = Command::new("gcc")
        .args(["-static", "-O2", "-o"])
        .arg(&out)
        .arg(&src)
        .status()
        .expect("gcc");
    assert!(st.success(), "building uconnect");
    out
}

/// A busybox rootfs: the static busybox, its applets as symlinks, the uconnect helper,
/// and an image-owned /etc/ld.so.preload entry that must survive injection.
pub fn busybox_rootfs(rootfs: &Path) {
    for d in ["bin", "etc", "tmp", "proc", "sys", "dev"] {
        std::fs::create_dir_all(rootfs.join(d)).unwrap();
    }
    let bb = which("busybox").expect("busybox");
    std::fs::copy(&bb, rootfs.join("bin/busybox")).unwrap();
    let list = Command::new(&bb).arg("--list").output().unwrap();
    for applet in String::from_utf8_lossy(&list.stdout).lines() {
        let link = rootfs.join("bin").join(applet);
        if applet != "busybox" && !link.exists() {
            std::os::unix::fs::symlink("busybox", &link).unwrap();
        }
    }
    uconnect_binary(&rootfs.join("bin"));
    std::fs::write(rootfs.join("etc/ld.so.preload"), "/lib/libimage-own.so\n").unwrap();
    std::fs::write(rootfs.join("etc/passwd"), "root:x:0:0:root:/:/bin/sh\n").unwrap();
}

/// Stands in for the arbiter's client socket: accepts connections, reads one line,
/// answers `ok`, and records what each client said.
pub struct FakeArbiter {
    pub heard: Arc<Mutex<Vec<String>>>,
    stop: Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl FakeArbiter {
    /// Serves the node's client socket and the control socket; an `attach_container`
    /// on the latter makes it serve that container's socket too (as the arbiter does),
    /// and is heard as `attach <key>` (`detach <key>` likewise).
    pub fn start(socket_dir: &Path) -> FakeArbiter {
        let bind = |path: &Path, mode: u32| {
            let _ = std::fs::remove_file(path);
            let l = UnixListener::bind(path).unwrap();
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
            l.set_nonblocking(true).unwrap();
            l
        };
        let mut clients = vec![bind(&socket_dir.join("client/arbiter.sock"), 0o666)];
        let control = bind(&kiwi_config::control_socket(socket_dir), 0o600);
        let dir = socket_dir.to_path_buf();
        let heard = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (h, s) = (heard.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            while !s.load(Ordering::SeqCst) {
                let mut idle = true;
                if let Ok((stream, _)) = control.accept() {
                    idle = false;
                    stream.set_nonblocking(false).unwrap();
                    stream
                        .set_read_timeout(Some(Duration::from_secs(5)))
                        .unwrap();
                    let mut c: kiwi_protocol::blocking::Connection<
                        kiwi_protocol::ControlReply,
                        kiwi_protocol::ControlRequest,
                    > = kiwi_protocol::blocking::Connection::new(stream);
                    if let Ok(req) = c.recv() {
                        let line = match &req {
                            kiwi_protocol::ControlRequest::AttachContainer { key } => {
                                let path = kiwi_config::containers::container_socket(&dir, key);
                                clients.push(bind(&path, 0o666));
                                format!("attach {key}")
                            }
                            kiwi_protocol::ControlRequest::DetachContainer { key } => {
                                format!("detach {key}")
                            }
                            other => format!("{other:?}"),
                        };
                        h.lock().unwrap().push(line);
                        let _ = c.send(&kiwi_protocol::ControlReply::Done {
                            message: "ok".into(),
                            gpus: Vec::new(),
                        });
                    }
                }
                for listener in &clients {
                    if let Ok((stream, _)) = listener.accept() {
                        idle = false;
                        stream.set_nonblocking(false).unwrap();
                        stream
                            .set_read_timeout(Some(Duration::from_secs(5)))
                            .unwrap();
                        let mut line = String::new();
                        let mut r = BufReader::new(&stream);
                        let _ = r.read_line(&mut line);
                        let _ = (&stream).write_all(b"ok\n");
                        h.lock().unwrap().push(line.trim().to_string());
                    }
                }
                if idle {
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
        });
        FakeArbiter {
            heard,
            stop,
            thread: Some(thread),
        }
    }

    pub fn wait_heard(&self, n: usize, timeout: Duration) -> Vec<String> {
        let t0 = Instant::now();
        loop {
            let h = self.heard.lock().unwrap().clone();
            if h.len() >= n || t0.elapsed() > timeout {
                return h;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// The claimed container spoke on its own socket: the hook attached it (before the
/// container's `hello`), and, when `deleted`, detached it once the container was
/// deleted, leaving no record, socket or directory behind.
pub fn assert_own_socket(arbiter: &FakeArbiter, hello: &str, socket_dir: &Path, deleted: bool) {
    let want = if deleted { 3 } else { 2 };
    let heard = arbiter.wait_heard(want, Duration::from_secs(5));
    assert_eq!(heard.len(), want, "{heard:?}");
    let key = heard[0]
        .strip_prefix("attach ")
        .unwrap_or_else(|| panic!("the hook attached first: {heard:?}"))
        .to_string();
    assert_eq!(heard[1], hello, "{heard:?}");
    let record = kiwi_config::containers::record_path(socket_dir, &key);
    let dir = kiwi_config::containers::container_dir(socket_dir, &key);
    if deleted {
        assert_eq!(heard[2], format!("detach {key}"), "{heard:?}");
        assert!(!record.exists() && !dir.exists(), "{} left", key);
    } else {
        let rec = kiwi_config::containers::ContainerRecord::read(&record).unwrap();
        assert!(rec.id.starts_with(&key), "{rec:?}");
    }
}

impl Drop for FakeArbiter {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

pub fn text(out: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// C sources the tests compile (`tests/helpers`).
pub const HELPERS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/helpers");

/// Compiles with gcc (`args` then `-o out`); panics if gcc fails.
pub fn gcc(args: &[&str], out: &Path) {
    let st = Command::new("gcc")
        .args(args)
        .arg("-o")
        .arg(out)
        .status()
        .unwrap();
    assert!(st.success(), "gcc {args:?}");
}
