//! `kiwi-device-plugin bench`: starts this very binary as a plugin (GPUs from a
//! generated `--gpu-list`) against an in-process fake kubelet, then measures over one
//! gRPC connection the latency of `Allocate` and, as the baseline in the same run,
//! of the empty `GetDevicePluginOptions`; prints p50/p99 of both, their ratio, and the
//! plugin process's RSS.

use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use kiwi_device_plugin::api;
use kiwi_device_plugin::api::device_plugin_client::DevicePluginClient;
use kiwi_device_plugin::devices::vgpu_id;
use kiwi_device_plugin::fake_kubelet::FakeKubelet;
use kiwi_device_plugin::kubelet::dial;

#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    /// Physical GPUs.
    #[arg(long, default_value_t = 8)]
    gpus: u32,
    /// vGPUs per GPU.
    #[arg(long, default_value_t = 64)]
    vgpus_per_gpu: u32,
    /// Measured calls of each kind.
    #[arg(long, default_value_t = 1000)]
    calls: usize,
    /// The p99 Allocate latency to stay under, in milliseconds; exit 1 above it.
    #[arg(long, default_value_t = 2.0)]
    goal_ms: f64,
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn rss_kib(pid: u32, field: &str) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    text.lines()
        .find(|l| l.starts_with(field))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub async fn run(args: BenchArgs) -> anyhow::Result<()> {
    if args.gpus == 0 || args.vgpus_per_gpu == 0 || args.calls == 0 {
        bail!("--gpus, --vgpus-per-gpu and --calls must be at least 1");
    }
    let dir = tempfile::tempdir().context("cannot create a temporary directory")?;
    let list = dir.path().join("gpus");
    let uuids: Vec<String> = (0..args.gpus)
        .map(|i| format!("GPU-{i:08x}-be4c-4b1e-9c5a-{:012x}", 0xb0_0000 + i))
        .collect();
    let text: String = uuids
        .iter()
        .enumerate()
        .map(|(i, u)| format!("{i} {u} memory=80GiB Bench GPU\n"))
        .collect();
    std::fs::write(&list, text)?;
    let config = dir.path().join("config.toml");
    std::fs::write(&config, "")?;
    let mut kubelet = FakeKubelet::start(dir.path()).await?;

    let exe = std::env::current_exe().context("cannot find this program")?;
    let child = std::process::Command::new(exe)
        .arg("--config")
        .arg(&config)
        .arg("--kubelet-dir")
        .arg(dir.path())
        .arg("--gpu-list")
        .arg(&list)
        .arg("--vgpus-per-gpu")
        .arg(args.vgpus_per_gpu.to_string())
        .env("KIWI_LOG", "warn")
        .spawn()
        .context("cannot start the plugin")?;
    let mut child = Child(child);
    let pid = child.0.id();
    let reg = kubelet
        .next_registration(Duration::from_secs(20))
        .await
        .context("the plugin did not register within 20 s")?;
    let socket = dir.path().join(&reg.endpoint);
    let mut client = DevicePluginClient::new(dial(&socket).await?);

    let mut stream = client.list_and_watch(api::Empty {}).await?.into_inner();
    let first = stream
        .message()
        .await?
        .context("ListAndWatch ended at once")?;
    let expected = (args.gpus * args.vgpus_per_gpu) as usize;
    if first.devices.len() != expected {
        bail!(
            "ListAndWatch listed {} devices, expected {expected}",
            first.devices.len()
        );
    }

    // Requests: 1 to 4 vGPUs on pseudo-random GPUs (a fixed LCG: the same every run).
    let mut seed: u64 = 0x2545_f491_4f6c_dd1d;
    let mut next = move || {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (seed >> 33) as u32
    };
    let requests: Vec<api::AllocateRequest> = (0..args.calls + 100)
        .map(|i| {
            let k = 1 + (i % 4) as u32;
            let devices_ids = (0..k)
                .map(|_| {
                    vgpu_id(
                        &uuids[(next() % args.gpus) as usize],
                        next() % args.vgpus_per_gpu,
                    )
                })
                .collect();
            api::AllocateRequest {
                container_requests: vec![api::ContainerAllocateRequest { devices_ids }],
            }
        })
        .collect();

    // Warm-up, then interleave the two kinds so both see the same machine state.
    for r in &requests[..100] {
        client.allocate(r.clone()).await?;
        client.get_device_plugin_options(api::Empty {}).await?;
    }
    let mut alloc = Vec::with_capacity(args.calls);
    let mut base = Vec::with_capacity(args.calls);
    for r in &requests[100..] {
        let t = Instant::now();
        client.get_device_plugin_options(api::Empty {}).await?;
        base.push(t.elapsed());
        let t = Instant::now();
        let resp = client.allocate(r.clone()).await?.into_inner();
        alloc.push(t.elapsed());
        if resp.container_responses.len() != 1
            || !resp.container_responses[0]
                .envs
                .contains_key("KIWI_VISIBLE_DEVICES")
        {
            bail!("Allocate answered without KIWI_VISIBLE_DEVICES: {resp:?}");
        }
    }
    let rss = rss_kib(pid, "VmRSS:");
    let hwm = rss_kib(pid, "VmHWM:");
    alloc.sort();
    base.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let (a50, a99) = (percentile(&alloc, 0.5), percentile(&alloc, 0.99));
    let (b50, b99) = (percentile(&base, 0.5), percentile(&base, 0.99));
    println!(
        "kiwi-device-plugin bench: {} GPUs x {} vGPUs = {expected} devices, {} calls each",
        args.gpus, args.vgpus_per_gpu, args.calls
    );
    println!(
        "  Allocate                p50 {:.3} ms  p99 {:.3} ms  max {:.3} ms",
        ms(a50),
        ms(a99),
        ms(*alloc.last().unwrap_or(&Duration::ZERO))
    );
    println!(
        "  GetDevicePluginOptions  p50 {:.3} ms  p99 {:.3} ms  (baseline: empty call, same connection)",
        ms(b50),
        ms(b99)
    );
    println!(
        "  ratio Allocate/baseline p50 {:.2}x  p99 {:.2}x",
        ms(a50) / ms(b50).max(1e-9),
        ms(a99) / ms(b99).max(1e-9)
    );
    println!(
        "  plugin RSS {} KiB (peak {} KiB), pid {pid}",
        rss.map_or("?".into(), |v| v.to_string()),
        hwm.map_or("?".into(), |v| v.to_string())
    );

    // SIGTERM must remove the socket, promptly.
    drop(stream);
    drop(client);
    let t0 = Instant::now();
    // SAFETY: kill(2) with a pid we spawned and still own (not yet waited for).
    unsafe { libc::kill(pid as libc::pid_t, libc::SIGTERM) };
    let status = loop {
        if let Some(status) = child.0.try_wait()? {
            break status;
        }
        if t0.elapsed() > Duration::from_secs(5) {
            bail!("the plugin did not stop within 5 s of SIGTERM");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    let stop_time = t0.elapsed();
    if !status.success() {
        bail!("the plugin exited with {status} after SIGTERM");
    }
    if socket.exists() {
        bail!("the plugin left {} behind after SIGTERM", socket.display());
    }
    let goal = Duration::from_secs_f64(args.goal_ms / 1e3);
    if a99 > goal {
        bail!(
            "p99 Allocate latency {:.3} ms is over the {} ms goal",
            ms(a99),
            args.goal_ms
        );
    }
    println!(
        "  SIGTERM to exit {:.1} ms, socket removed; p99 under the {} ms goal: ok",
        ms(stop_time),
        args.goal_ms
    );
    Ok(())
}
