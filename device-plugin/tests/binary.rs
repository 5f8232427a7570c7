//! The real `kiwi-device-plugin` binary, spawned as a process: flags and config file,
//! `--gpu-list` discovery and health, metrics, SIGTERM, and bad input.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kiwi_device_plugin::api;
use kiwi_device_plugin::api::device_plugin_client::DevicePluginClient;
use kiwi_device_plugin::devices::{HEALTHY, UNHEALTHY};
use kiwi_device_plugin::fake_kubelet::FakeKubelet;
use kiwi_device_plugin::kubelet::dial;

const BIN: &str = env!("CARGO_BIN_EXE_kiwi-device-plugin");
const WAIT: Duration = Duration::from_secs(15);
const U0: &str = "GPU-5a1c0e2b-1111-4c2e-9a3f-000000000000";
const U1: &str = "GPU-5a1c0e2b-2222-4c2e-9a3f-000000000001";

/// Kills the child if a test fails before it is stopped.
struct Plugin(Child);

impl Drop for Plugin {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Plugin {
    fn spawn(args: &[&str], dir: &Path) -> Plugin {
        let config = dir.join("empty.toml");
        if !config.exists() {
            std::fs::write(&config, "").unwrap();
        }
        let child = Command::new(BIN)
            .args(args)
            .env("KIWI_CONFIG", &config)
            .env("KIWI_LOG", "info")
            .stdin(Stdio::null())
            .spawn()
            .expect("spawn kiwi-device-plugin");
        Plugin(child)
    }

    /// SIGTERM, then the exit status. Async, so this test's gRPC clients keep running
    /// and see the server go away, as a kubelet would.
    async fn terminate(&mut self) -> std::process::ExitStatus {
        // SAFETY: kill(2) on our own, not yet reaped child.
        unsafe { libc::kill(self.0.id() as libc::pid_t, libc::SIGTERM) };
        let t0 = Instant::now();
        loop {
            if let Some(status) = self.0.try_wait().unwrap() {
                return status;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(2),
                "plugin took over 2 s to stop on SIGTERM"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

fn write_list(path: &Path, gpus: &[(u32, &str)]) {
    let text: String = gpus
        .iter()
        .map(|(i, u)| format!("{i} {u} Test GPU\n"))
        .collect();
    // Write then rename, so the plugin never reads half a file.
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

async fn first_list(
    socket: &Path,
) -> (
    tonic::Streaming<api::ListAndWatchResponse>,
    Vec<api::Device>,
) {
    let mut c = DevicePluginClient::new(dial(socket).await.unwrap());
    let mut s = c.list_and_watch(api::Empty {}).await.unwrap().into_inner();
    let list = next(&mut s).await;
    (s, list)
}

async fn next(s: &mut tonic::Streaming<api::ListAndWatchResponse>) -> Vec<api::Device> {
    tokio::time::timeout(WAIT, s.message())
        .await
        .expect("no update")
        .unwrap()
        .expect("stream ended")
        .devices
}

fn health(list: &[api::Device], uuid: &str) -> Vec<String> {
    list.iter()
        .filter(|d| d.id.starts_with(uuid))
        .map(|d| d.health.clone())
        .collect()
}

#[tokio::test]
async fn gpu_list_plugin_serves_tracks_health_and_cleans_up_on_sigterm() {
    let dir = tempfile::tempdir().unwrap();
    let list = dir.path().join("gpus");
    write_list(&list, &[(0, U0), (1, U1)]);
    let mut kubelet = FakeKubelet::start(dir.path()).await.unwrap();
    let mut plugin = Plugin::spawn(
        &[
            "--kubelet-dir",
            dir.path().to_str().unwrap(),
            "--gpu-list",
            list.to_str().unwrap(),
            "--health-interval-ms",
            "50",
        ],
        dir.path(),
    );
    let reg = kubelet.next_registration(WAIT).await.expect("registered");
    assert_eq!(reg.resource_name, "kiwi.dev/gpu");
    let socket = dir.path().join(&reg.endpoint);
    let (mut stream, devices) = first_list(&socket).await;
    assert_eq!(devices.len(), 20, "2 GPUs x the default 10 vGPUs");
    assert!(devices.iter().all(|d| d.health == HEALTHY));

    // GPU 1 disappears from the list: unhealthy; back: healthy.
    write_list(&list, &[(0, U0)]);
    let devices = next(&mut stream).await;
    assert_eq!(health(&devices, U1), vec![UNHEALTHY; 10]);
    assert_eq!(health(&devices, U0), vec![HEALTHY; 10]);
    write_list(&list, &[(0, U0), (1, U1)]);
    let devices = next(&mut stream).await;
    assert_eq!(health(&devices, U1), vec![HEALTHY; 10]);

    let status = plugin.terminate().await;
    assert!(status.success(), "{status}");
    assert!(!socket.exists(), "socket left behind");
}

#[tokio::test]
async fn config_file_gives_defaults_and_flags_win() {
    let dir = tempfile::tempdir().unwrap();
    let list = dir.path().join("gpus");
    write_list(&list, &[(0, U0), (1, U1)]);
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let config = dir.path().join("kiwi.toml");
    std::fs::write(
        &config,
        format!(
            "[device_plugin]\nresource_name = \"example.com/vgpu\"\nvgpus_per_gpu = 3\nkubelet_dir = {:?}\n\
             gpu_list = {:?}\ndevice_list_strategy = \"cdi-cri\"\nmetrics_addr = \"127.0.0.1:{port}\"\n",
            dir.path(),
            list
        ),
    )
    .unwrap();
    let mut kubelet = FakeKubelet::start(dir.path()).await.unwrap();
    let mut plugin = Plugin::spawn(
        &["--config", config.to_str().unwrap(), "--vgpus-per-gpu", "2"],
        dir.path(),
    );
    let reg = kubelet.next_registration(WAIT).await.expect("registered");
    assert_eq!(reg.resource_name, "example.com/vgpu");
    assert_eq!(reg.endpoint, "example.com-vgpu.sock");
    let socket = dir.path().join(&reg.endpoint);
    let (_s, devices) = first_list(&socket).await;
    assert_eq!(
        devices.len(),
        4,
        "the flag's 2 vGPUs per GPU, not the file's 3"
    );

    let resp = DevicePluginClient::new(dial(&socket).await.unwrap())
        .allocate(api::AllocateRequest {
            container_requests: vec![api::ContainerAllocateRequest {
                devices_ids: vec![format!("{U1}::1")],
            }],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        resp.container_responses[0].cdi_devices[0].name,
        format!("kiwi.dev/gpu={U1}")
    );

    let body = http_get(port, "/metrics").await;
    assert!(
        body.contains("kiwi_device_plugin_vgpus_advertised 4\n"),
        "{body}"
    );
    assert!(
        body.contains("kiwi_device_plugin_healthy_gpus 2\n"),
        "{body}"
    );
    assert!(
        body.contains("kiwi_device_plugin_allocate_calls_total 1\n"),
        "{body}"
    );
    assert!(plugin.terminate().await.success());
}

async fn http_get(port: u16, path: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    s.write_all(format!("GET {path} HTTP/1.0\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    out
}

fn run_to_exit(args: &[&str], config: Option<&Path>) -> (i32, String) {
    let dir = tempfile::tempdir().unwrap();
    let empty = dir.path().join("empty.toml");
    std::fs::write(&empty, "").unwrap();
    let mut child = Command::new(BIN)
        .args(args)
        .env("KIWI_CONFIG", config.unwrap_or(&empty))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if t0.elapsed() > WAIT {
            let _ = child.kill();
            panic!("{args:?} did not exit");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn bad_input_is_one_clear_line_and_a_nonzero_exit() {
    let dir = tempfile::tempdir().unwrap();
    let list = dir.path().join("gpus");
    write_list(&list, &[(0, U0)]);
    let list = list.to_str().unwrap();
    let kdir = dir.path().to_str().unwrap();
    let bad_list = dir.path().join("bad-gpus");
    std::fs::write(&bad_list, format!("0 {U0}\nzero {U1}\n")).unwrap();
    let bad_config = dir.path().join("bad.toml");
    std::fs::write(&bad_config, "[device_plugin]\nvgpus_per_gpu = \"ten\"\n").unwrap();
    let missing_kdir: PathBuf = dir.path().join("no-such-dir");

    let cases: Vec<(Vec<&str>, Option<&Path>, &str)> = vec![
        (
            vec!["--gpu-list", "/nonexistent/gpus", "--kubelet-dir", kdir],
            None,
            "/nonexistent/gpus",
        ),
        (
            vec![
                "--gpu-list",
                bad_list.to_str().unwrap(),
                "--kubelet-dir",
                kdir,
            ],
            None,
            "line 2",
        ),
        (
            vec!["--gpu-list", list, "--kubelet-dir", kdir],
            Some(&bad_config),
            "bad.toml",
        ),
        (
            vec![
                "--gpu-list",
                list,
                "--kubelet-dir",
                kdir,
                "--resource-name",
                "gpu",
            ],
            None,
            "resource name",
        ),
        (
            vec![
                "--gpu-list",
                list,
                "--kubelet-dir",
                missing_kdir.to_str().unwrap(),
            ],
            None,
            "must name the kubelet's device plugin directory",
        ),
        (
            vec!["--gpu-list", list, "--config", "/nonexistent/kiwi.toml"],
            None,
            "/nonexistent/kiwi.toml",
        ),
    ];
    for (args, config, needle) in cases {
        let (code, stderr) = run_to_exit(&args, config);
        assert_eq!(code, 1, "{args:?}: {stderr}");
        let last = stderr.lines().last().unwrap_or_default();
        assert!(
            last.starts_with("kiwi-device-plugin: "),
            "{args:?}: {stderr}"
        );
        assert!(last.contains(needle), "{args:?}: {last}");
        // The cause is said once (a `{:#}` chain used to repeat the OS error).
        assert!(last.matches("os error").count() <= 1, "{args:?}: {last}");
    }
    // Flag syntax errors come from the argument parser (exit 2).
    for args in [
        vec!["--vgpus-per-gpu", "0"],
        vec!["--device-list-strategy", "mounts"],
        vec!["--metrics-addr", "nowhere"],
        vec!["--no-such-flag"],
    ] {
        let (code, stderr) = run_to_exit(&args, None);
        assert_eq!(code, 2, "{args:?}: {stderr}");
        assert!(stderr.contains("error"), "{args:?}: {stderr}");
    }
}

#[test]
fn without_nvml_it_says_to_use_gpu_list() {
    if Path::new("/dev/nvidiactl").exists() {
        eprintln!("SKIP: this machine has an NVIDIA driver, so NVML may load");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (code, stderr) = run_to_exit(&["--kubelet-dir", dir.path().to_str().unwrap()], None);
    assert_eq!(code, 1, "{stderr}");
    let last = stderr.lines().last().unwrap_or_default();
    assert!(
        last.contains("NVML") && last.contains("--gpu-list"),
        "{last}"
    );
}

#[test]
fn bench_subcommand_measures_and_cleans_up() {
    // Small and with a lenient goal: this checks the tool, not the machine's speed.
    let out = Command::new(BIN)
        .args([
            "bench",
            "--gpus",
            "2",
            "--vgpus-per-gpu",
            "4",
            "--calls",
            "50",
            "--goal-ms",
            "5000",
        ])
        .env("KIWI_LOG", "warn")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("2 GPUs x 4 vGPUs = 8 devices"), "{stdout}");
    for needle in [
        "Allocate ",
        "GetDevicePluginOptions",
        "ratio",
        "plugin RSS",
        "socket removed",
    ] {
        assert!(stdout.contains(needle), "{needle}: {stdout}");
    }
}
