//! The claimed container through containerd: `ctr run --runc-binary kiwi-runtime`, with
//! containerd started by the test (its own root, state and socket in a temp dir) and a
//! busybox image built here and loaded with `ctr images import` (no network).

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

const IMAGE: &str = "docker.io/library/kiwi-busybox:test";

fn sha256(path: &Path) -> String {
    let out = Command::new("sha256sum").arg(path).output().unwrap();
    assert!(out.status.success());
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .unwrap()
        .to_string()
}

/// Moves a file into the layout's blob store; returns (digest, size).
fn add_blob(layout: &Path, file: &Path) -> (String, u64) {
    let hex = sha256(file);
    let size = std::fs::metadata(file).unwrap().len();
    let dst = layout.join("blobs/sha256").join(&hex);
    std::fs::rename(file, dst).unwrap();
    (format!("sha256:{hex}"), size)
}

fn add_json_blob(layout: &Path, tmp: &Path, v: &serde_json::Value) -> (String, u64) {
    std::fs::write(tmp, serde_json::to_vec(v).unwrap()).unwrap();
    add_blob(layout, tmp)
}

/// An OCI image archive of a busybox rootfs: layer tar, config, manifest, index.
fn build_image(work: &Path) -> PathBuf {
    let rootfs = work.join("image-rootfs");
    busybox_rootfs(&rootfs);
    let layout = work.join("layout");
    std::fs::create_dir_all(layout.join("blobs/sha256")).unwrap();
    let layer = work.join("layer.tar");
    let st = Command::new("tar")
        .arg("-C")
        .arg(&rootfs)
        .args(["--numeric-owner", "-cf"])
        .arg(&layer)
        .arg(".")
        .status()
        .unwrap();
    assert!(st.success());
    let (layer_digest, layer_size) = add_blob(&layout, &layer);
    let arch = if cfg!(target_arch = "aarch64") {
        "arm64"
    } else {
        "amd64"
    };
    let config = serde_json::json!({
        "architecture": arch, "os": "linux",
        "config": {"Env": ["PATH=/bin"], "Cmd": ["/bin/sh"]},
        "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
    });
    let (cfg_digest, cfg_size) = add_json_blob(&layout, &work.join("cfg.json"), &config);
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": cfg_digest, "size": cfg_size},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": layer_digest, "size": layer_size}],
    });
    let (m_digest, m_size) = add_json_blob(&layout, &work.join("manifest.json"), &manifest);
    let index = serde_json::json!({
        "schemaVersion": 2,
        "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": m_digest, "size": m_size,
            "annotations": {"io.containerd.image.name": IMAGE, "org.opencontainers.image.ref.name": "test"},
        }],
    });
    std::fs::write(
        layout.join("index.json"),
        serde_json::to_vec(&index).unwrap(),
    )
    .unwrap();
    std::fs::write(
        layout.join("oci-layout"),
        r#"{"imageLayoutVersion":"1.0.0"}"#,
    )
    .unwrap();
    let archive = work.join("image.tar");
    let st = Command::new("tar")
        .arg("-C")
        .arg(&layout)
        .arg("-cf")
        .arg(&archive)
        .arg(".")
        .status()
        .unwrap();
    assert!(st.success());
    archive
}

/// containerd started for one test; on drop its tasks, shims and itself are stopped.
struct Containerd {
    child: Child,
    address: PathBuf,
    namespace: String,
    ids: Vec<String>,
}

impl Containerd {
    fn start(dir: &Path, kiwi_config: &Path) -> Containerd {
        let address = dir.join("ctrd.sock");
        let config = dir.join("containerd.toml");
        std::fs::write(
            &config,
            "version = 2\ndisabled_plugins = [\"io.containerd.grpc.v1.cri\", \"io.containerd.snapshotter.v1.btrfs\", \"io.containerd.snapshotter.v1.zfs\", \"io.containerd.snapshotter.v1.devmapper\", \"io.containerd.snapshotter.v1.aufs\"]\n",
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
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        let c = Containerd {
            child,
            address,
            namespace: unique_id("kiwitest"),
            ids: Vec::new(),
        };
        let t0 = Instant::now();
        while !c.ctr(&["version"]).status.success() {
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "containerd did not come up"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        c
    }

    fn ctr(&self, args: &[&str]) -> std::process::Output {
        Command::new(which("ctr").unwrap())
            .arg("--address")
            .arg(&self.address)
            .args(["--namespace", &self.namespace])
            .args(args)
            .stdin(Stdio::null())
            .output()
            .unwrap()
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        for id in self.ids.clone() {
            let _ = self.ctr(&["task", "kill", "-s", "SIGKILL", &id]);
            std::thread::sleep(Duration::from_millis(200));
            let _ = self.ctr(&["task", "delete", "-f", &id]);
            let _ = self.ctr(&["container", "delete", &id]);
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
        // The shim's runc state root for our namespace; removed only if empty.
        let _ = std::fs::remove_dir(Path::new("/run/containerd/runc").join(&self.namespace));
        // SAFETY: kill our own child by pid with a valid signal.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(5) {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn claimed_container_through_containerd() {
    if !require(&[
        "containerd",
        "ctr",
        "containerd-shim-runc-v2",
        "runc",
        "busybox",
        "gcc",
        "tar",
        "sha256sum",
    ]) {
        return;
    }
    let fx = Fixture::new();
    let arbiter = FakeArbiter::start(&fx.socket_dir);
    let archive = build_image(fx.path());
    let mut ctrd = Containerd::start(fx.path(), &fx.config);
    let out = ctrd.ctr(&["images", "import", archive.to_str().unwrap()]);
    assert!(out.status.success(), "import: {out:?}");
    let out = ctrd.ctr(&["images", "ls", "-q"]);
    assert!(
        String::from_utf8_lossy(&out.stdout).contains(IMAGE),
        "{out:?}"
    );

    let script = "echo SHIM=$(cat /usr/lib/kiwi/libkiwi.so); echo PRELOAD=$(cat /etc/ld.so.preload | tr '\\n' ' '); \
        stat -c 'NODE %n %t:%T' /dev/nvidia0 /dev/nvidiactl; echo OPEN=$(cat /dev/nvidia0 2>&1 | head -1); \
        /bin/uconnect /run/kiwi/client/arbiter.sock containerd; echo DONE";
    for (claimed, env) in [(true, "KIWI_VISIBLE_DEVICES=0"), (false, "OTHER=1")] {
        let id = unique_id("kiwi-ctr");
        ctrd.ids.push(id.clone());
        let out = ctrd.ctr(&[
            "run",
            "--rm",
            "--runc-binary",
            RUNTIME,
            "--env",
            env,
            IMAGE,
            &id,
            "/bin/sh",
            "-c",
            script,
        ]);
        let (stdout, stderr) = text(&out);
        let log = std::fs::read_to_string(fx.path().join("containerd.log")).unwrap_or_default();
        assert!(
            out.status.success(),
            "ctr run: {stderr}\n{stdout}\ncontainerd log tail:\n{}",
            tail(&log)
        );
        assert!(stdout.contains("DONE"), "{stdout}");
        if claimed {
            assert!(stdout.contains(&format!("SHIM={SHIM_CONTENT}")), "{stdout}");
            assert!(
                stdout.contains("PRELOAD=/usr/lib/kiwi/libkiwi.so /lib/libimage-own.so"),
                "{stdout}"
            );
            assert!(stdout.contains("NODE /dev/nvidia0 c3:0"), "{stdout}");
            assert!(stdout.contains("NODE /dev/nvidiactl c3:ff"), "{stdout}");
            assert!(
                stdout.contains("OPEN=cat: can't open '/dev/nvidia0': No such device or address"),
                "{stdout}"
            );
            assert!(stdout.contains("UCONNECT-REPLY:ok"), "{stdout}");
            // `ctr run --rm` deletes the container: its socket goes.
            assert_own_socket(&arbiter, "hello from containerd", &fx.socket_dir, true);
        } else {
            assert!(
                stdout.contains("PRELOAD=/lib/libimage-own.so\n")
                    || stdout.contains("PRELOAD=/lib/libimage-own.so \n"),
                "{stdout}"
            );
            assert!(!stdout.contains("SHIM=kiwi"), "{stdout}");
            assert!(!stdout.contains("NODE /dev/nvidia0"), "{stdout}");
            assert!(!stdout.contains("UCONNECT-REPLY"), "{stdout}");
        }
    }
    assert_eq!(
        arbiter.heard.lock().unwrap().len(),
        3,
        "only the claimed container was attached and connected"
    );
}

fn tail(s: &str) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(15)..].join("\n")
}
