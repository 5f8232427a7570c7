//! The NVML path end to end: the real binary, with no `--gpu-list`, loads the GPU
//! simulator's `libnvidia-ml.so.1` (through `LD_LIBRARY_PATH`, as on a node), finds
//! the simulated GPUs, and turns the simulator's injected faults (XID events, a lost
//! GPU, clearing) into `ListAndWatch` health updates.
//!
//! Needs the simulator's cdylibs (`cargo build --workspace`): a missing simulator
//! fails the test under `CI=true` and skips it loudly elsewhere.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use kiwi_device_plugin::api;
use kiwi_device_plugin::api::device_plugin_client::DevicePluginClient;
use kiwi_device_plugin::devices::{HEALTHY, UNHEALTHY};
use kiwi_device_plugin::fake_kubelet::FakeKubelet;
use kiwi_device_plugin::kubelet::dial;
use kiwi_sim_core::harness::{in_ci, SimMachine};
use kiwi_sim_core::ident::gpu_uuid_string;
use kiwi_sim_core::Machine;

const BIN: &str = env!("CARGO_BIN_EXE_kiwi-device-plugin");
const WAIT: Duration = Duration::from_secs(15);

struct Plugin(Child);

impl Drop for Plugin {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn machine(tag: &str, gpus: u32) -> Option<SimMachine> {
    match SimMachine::new(tag, gpus, 1 << 30) {
        Ok(m) => Some(m),
        Err(e) if !in_ci() => {
            eprintln!("SKIPPED: GPU simulator not available ({e}); CI=true would fail this test");
            None
        }
        Err(e) => panic!("GPU simulator not available: {e}"),
    }
}

fn spawn(m: &SimMachine, dir: &Path) -> Plugin {
    let config = dir.join("empty.toml");
    std::fs::write(&config, "").unwrap();
    let mut cmd = Command::new(BIN);
    m.apply(&mut cmd);
    let child = cmd
        .args([
            "--kubelet-dir",
            dir.to_str().unwrap(),
            "--vgpus-per-gpu",
            "3",
            "--health-interval-ms",
            "100",
        ])
        .env("KIWI_CONFIG", &config)
        .env("KIWI_LOG", "info")
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    Plugin(child)
}

async fn next(s: &mut tonic::Streaming<api::ListAndWatchResponse>) -> Vec<api::Device> {
    tokio::time::timeout(WAIT, s.message())
        .await
        .expect("no ListAndWatch update")
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
async fn nvml_discovery_and_fault_health_on_the_simulator() {
    let Some(m) = machine("dp-nvml", 2) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let mut kubelet = FakeKubelet::start(dir.path()).await.unwrap();
    let mut plugin = spawn(&m, dir.path());
    let reg = kubelet.next_registration(WAIT).await.expect("registered");
    let socket = dir.path().join(&reg.endpoint);
    let mut client = DevicePluginClient::new(dial(&socket).await.unwrap());
    let mut stream = client
        .list_and_watch(api::Empty {})
        .await
        .unwrap()
        .into_inner();

    // Discovery: the simulator's GPUs by UUID, 3 vGPUs each, all healthy.
    let u0 = gpu_uuid_string(&m.name, 0);
    let u1 = gpu_uuid_string(&m.name, 1);
    let list = next(&mut stream).await;
    let ids: Vec<&str> = list.iter().map(|d| d.id.as_str()).collect();
    assert_eq!(
        ids,
        [
            format!("{u0}::0"),
            format!("{u0}::1"),
            format!("{u0}::2"),
            format!("{u1}::0"),
            format!("{u1}::1"),
            format!("{u1}::2")
        ]
    );
    assert!(list.iter().all(|d| d.health == HEALTHY));
    let resp = client
        .allocate(api::AllocateRequest {
            container_requests: vec![api::ContainerAllocateRequest {
                devices_ids: vec![format!("{u1}::2"), format!("{u1}::0")],
            }],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(resp.container_responses[0].envs["KIWI_VISIBLE_DEVICES"], u1);

    let sim = Machine::open_existing(&m.name)
        .unwrap()
        .expect("the plugin's NVML opened the simulated machine");

    // An application XID is ignored: no update within several probe intervals.
    sim.set_fault(1, 13, false).unwrap();
    let quiet = tokio::time::timeout(Duration::from_millis(600), stream.message()).await;
    assert!(quiet.is_err(), "XID 13 changed health: {quiet:?}");

    // A critical XID: GPU 1 unhealthy at once (event), back after a quiet interval.
    sim.set_fault(1, 79, false).unwrap();
    let list = next(&mut stream).await;
    assert_eq!(health(&list, &u1), vec![UNHEALTHY; 3]);
    assert_eq!(health(&list, &u0), vec![HEALTHY; 3]);
    sim.set_fault(1, 0, false).unwrap();
    let list = next(&mut stream).await;
    assert_eq!(health(&list, &u1), vec![HEALTHY; 3]);

    // Lost: unhealthy while NVML answers GPU_IS_LOST, healthy once cleared.
    sim.set_fault(0, 0, true).unwrap();
    let list = next(&mut stream).await;
    assert_eq!(health(&list, &u0), vec![UNHEALTHY; 3]);
    assert_eq!(
        health(&list, &u1),
        vec![HEALTHY; 3],
        "only the lost GPU goes out"
    );
    let still = tokio::time::timeout(Duration::from_millis(500), stream.message()).await;
    assert!(still.is_err(), "a lost GPU must stay unhealthy: {still:?}");
    sim.set_fault(0, 0, false).unwrap();
    let list = next(&mut stream).await;
    assert!(list.iter().all(|d| d.health == HEALTHY), "{list:?}");

    drop(stream);
    drop(client);
    // SAFETY: kill(2) on our own, not yet reaped child.
    unsafe { libc::kill(plugin.0.id() as libc::pid_t, libc::SIGTERM) };
    for _ in 0..200 {
        if plugin.0.try_wait().unwrap().is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let status = plugin.0.try_wait().unwrap().expect("exited on SIGTERM");
    assert!(status.success(), "{status}");
    assert!(!socket.exists());
}
