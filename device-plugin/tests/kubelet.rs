//! The plugin against an in-process fake kubelet: registration, the device stream,
//! health updates, Allocate, preferred allocation, and re-registration when the
//! kubelet restarts. GPUs come from the in-memory fake; everything else is real
//! (Unix sockets in a temp dir, gRPC both ways).

use std::path::PathBuf;
use std::time::Duration;

use tokio::sync::oneshot;
use tonic::transport::Channel;

use kiwi_device_plugin::api;
use kiwi_device_plugin::api::device_plugin_client::DevicePluginClient;
use kiwi_device_plugin::devices::{vgpu_id, DeviceListStrategy, HEALTHY, UNHEALTHY};
use kiwi_device_plugin::fake_kubelet::FakeKubelet;
use kiwi_device_plugin::kubelet::dial;
use kiwi_device_plugin::{run, PluginError, Settings};
use kiwi_nvml::{fake_uuid, FakeGpus};

const WAIT: Duration = Duration::from_secs(10);

struct Harness {
    dir: tempfile::TempDir,
    kubelet: FakeKubelet,
    gpus: FakeGpus,
    settings: Settings,
    shutdown: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Result<(), PluginError>>,
}

impl Harness {
    async fn start(gpu_count: u32, per: u32, strategy: DeviceListStrategy) -> Harness {
        let dir = tempfile::tempdir().unwrap();
        let kubelet = FakeKubelet::start(dir.path()).await.unwrap();
        Harness::start_in(dir, kubelet, gpu_count, per, strategy)
    }

    fn start_in(
        dir: tempfile::TempDir,
        kubelet: FakeKubelet,
        gpu_count: u32,
        per: u32,
        strategy: DeviceListStrategy,
    ) -> Harness {
        let gpus = FakeGpus::new(gpu_count);
        let settings = Settings {
            vgpus_per_gpu: per,
            kubelet_dir: dir.path().to_path_buf(),
            strategy,
            health_interval: Duration::from_millis(50),
            ..Settings::default()
        };
        let (tx, rx) = oneshot::channel::<()>();
        let task = tokio::spawn(run(settings.clone(), Box::new(gpus.clone()), async {
            let _ = rx.await;
        }));
        Harness {
            dir,
            kubelet,
            gpus,
            settings,
            shutdown: Some(tx),
            task,
        }
    }

    fn socket(&self) -> PathBuf {
        self.settings.socket_path()
    }

    async fn registered(&mut self) -> api::RegisterRequest {
        self.kubelet
            .next_registration(WAIT)
            .await
            .expect("the plugin did not register")
    }

    async fn client(&self) -> DevicePluginClient<Channel> {
        DevicePluginClient::new(dial(&self.socket()).await.expect("plugin socket answers"))
    }

    async fn stop(mut self) -> Result<(), PluginError> {
        let _ = self.shutdown.take().unwrap().send(());
        tokio::time::timeout(WAIT, &mut self.task)
            .await
            .expect("plugin did not stop")
            .unwrap()
    }
}

fn ids(gpu: u32, replicas: std::ops::Range<u32>) -> Vec<String> {
    replicas.map(|n| vgpu_id(&fake_uuid(gpu), n)).collect()
}

async fn next_list(stream: &mut tonic::Streaming<api::ListAndWatchResponse>) -> Vec<api::Device> {
    tokio::time::timeout(WAIT, stream.message())
        .await
        .expect("no ListAndWatch update")
        .expect("stream error")
        .expect("stream ended")
        .devices
}

fn health_of(list: &[api::Device], gpu: u32) -> Vec<&str> {
    let prefix = format!("{}::", fake_uuid(gpu));
    list.iter()
        .filter(|d| d.id.starts_with(&prefix))
        .map(|d| d.health.as_str())
        .collect()
}

#[tokio::test]
async fn register_request_is_complete_and_endpoint_answers() {
    let mut h = Harness::start(2, 4, DeviceListStrategy::Envvar).await;
    let reg = h.registered().await;
    assert_eq!(reg.version, "v1beta1");
    assert_eq!(reg.resource_name, "kiwi.dev/gpu");
    assert_eq!(reg.endpoint, "kiwi.dev-gpu.sock");
    let opts = reg.options.expect("options sent");
    assert!(opts.get_preferred_allocation_available);
    assert!(!opts.pre_start_required);
    // The endpoint is a file name inside the kubelet's directory, and it answers.
    let path = h.dir.path().join(&reg.endpoint);
    assert!(path.exists(), "{} missing", path.display());
    let mut c = h.client().await;
    let got = c
        .get_device_plugin_options(api::Empty {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(got, opts);
    let pre = c
        .pre_start_container(api::PreStartContainerRequest {
            devices_ids: ids(1, 0..2),
        })
        .await;
    assert!(pre.is_ok());
    h.stop().await.unwrap();
}

#[tokio::test]
async fn first_list_then_unhealthy_and_healthy_again() {
    let mut h = Harness::start(3, 4, DeviceListStrategy::Envvar).await;
    h.registered().await;
    let mut c = h.client().await;
    let mut stream = c.list_and_watch(api::Empty {}).await.unwrap().into_inner();

    let first = next_list(&mut stream).await;
    assert_eq!(first.len(), 12);
    assert_eq!(first[0].id, vgpu_id(&fake_uuid(0), 0));
    assert!(first.iter().all(|d| d.health == HEALTHY));
    assert_eq!(
        first[5].topology.as_ref().unwrap().nodes[0].id,
        1,
        "GPU 1 is on NUMA node 1"
    );

    // The GPU falls off the bus: its vGPUs, and only those, turn unhealthy.
    h.gpus.lose(&fake_uuid(1));
    let list = next_list(&mut stream).await;
    assert_eq!(health_of(&list, 1), vec![UNHEALTHY; 4]);
    assert_eq!(health_of(&list, 0), vec![HEALTHY; 4]);
    assert_eq!(health_of(&list, 2), vec![HEALTHY; 4]);

    h.gpus.clear(&fake_uuid(1));
    let list = next_list(&mut stream).await;
    assert!(list.iter().all(|d| d.health == HEALTHY), "{list:?}");

    // A critical XID event: unhealthy at once, healthy after a quiet interval.
    h.gpus.fault(&fake_uuid(2), "XID 79");
    let list = next_list(&mut stream).await;
    assert_eq!(health_of(&list, 2), vec![UNHEALTHY; 4]);
    let list = next_list(&mut stream).await;
    assert_eq!(health_of(&list, 2), vec![HEALTHY; 4]);

    // Shutdown ends the stream instead of hanging the server.
    let t0 = std::time::Instant::now();
    h.stop().await.unwrap();
    assert!(
        t0.elapsed() < Duration::from_secs(1),
        "shutdown took {:?}",
        t0.elapsed()
    );
    let end = tokio::time::timeout(WAIT, stream.message())
        .await
        .expect("stream hung");
    assert!(!matches!(end, Ok(Some(_))), "{end:?}");
}

#[tokio::test]
async fn allocate_sets_the_claim_once_per_gpu_and_refuses_unknown_ids() {
    let mut h = Harness::start(3, 4, DeviceListStrategy::Envvar).await;
    h.registered().await;
    let mut c = h.client().await;
    let mut two = ids(2, 0..2);
    two.push(vgpu_id(&fake_uuid(0), 3));
    let resp = c
        .allocate(api::AllocateRequest {
            container_requests: vec![
                api::ContainerAllocateRequest { devices_ids: two },
                api::ContainerAllocateRequest {
                    devices_ids: ids(1, 1..2),
                },
            ],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(resp.container_responses.len(), 2);
    let env = &resp.container_responses[0].envs;
    assert_eq!(
        env["KIWI_VISIBLE_DEVICES"],
        format!("{},{}", fake_uuid(0), fake_uuid(2))
    );
    assert_eq!(env.len(), 1);
    assert!(resp.container_responses[0].cdi_devices.is_empty());
    assert_eq!(
        resp.container_responses[1].envs["KIWI_VISIBLE_DEVICES"],
        fake_uuid(1)
    );

    for bad in [
        vec!["GPU-nope::0".to_string()],
        vec![vgpu_id(&fake_uuid(0), 4)],
        vec![vgpu_id(&fake_uuid(0), 0), "garbage".into()],
        vec![],
    ] {
        let err = c
            .allocate(api::AllocateRequest {
                container_requests: vec![api::ContainerAllocateRequest {
                    devices_ids: bad.clone(),
                }],
            })
            .await
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{bad:?}: {err}");
    }
    let err = c
        .allocate(api::AllocateRequest::default())
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    // Still serving after the refusals.
    assert!(c.get_device_plugin_options(api::Empty {}).await.is_ok());
    h.stop().await.unwrap();
}

#[tokio::test]
async fn allocate_with_cdi_strategies() {
    let mut h = Harness::start(2, 2, DeviceListStrategy::CdiCri).await;
    h.registered().await;
    let resp = h
        .client()
        .await
        .allocate(api::AllocateRequest {
            container_requests: vec![api::ContainerAllocateRequest {
                devices_ids: ids(1, 0..2),
            }],
        })
        .await
        .unwrap()
        .into_inner();
    let r = &resp.container_responses[0];
    assert_eq!(r.envs["KIWI_VISIBLE_DEVICES"], fake_uuid(1));
    assert_eq!(
        r.cdi_devices,
        vec![api::CdiDevice {
            name: format!("kiwi.dev/gpu={}", fake_uuid(1))
        }]
    );
    h.stop().await.unwrap();

    let mut h = Harness::start(2, 2, DeviceListStrategy::CdiAnnotations).await;
    h.registered().await;
    let resp = h
        .client()
        .await
        .allocate(api::AllocateRequest {
            container_requests: vec![api::ContainerAllocateRequest {
                devices_ids: ids(0, 1..2),
            }],
        })
        .await
        .unwrap()
        .into_inner();
    let r = &resp.container_responses[0];
    assert!(r.cdi_devices.is_empty());
    assert_eq!(
        r.annotations[&format!("cdi.k8s.io/kiwi-device-plugin_{}", fake_uuid(0))],
        format!("kiwi.dev/gpu={}", fake_uuid(0))
    );
    h.stop().await.unwrap();
}

#[tokio::test]
async fn preferred_allocation_spreads_over_least_loaded_gpus() {
    let mut h = Harness::start(4, 4, DeviceListStrategy::Envvar).await;
    h.registered().await;
    let mut c = h.client().await;
    // GPUs 0 and 1 have two vGPUs taken each, GPU 2 three, GPU 3 none.
    let mut available = ids(0, 2..4);
    available.extend(ids(1, 2..4));
    available.extend(ids(2, 3..4));
    available.extend(ids(3, 0..4));
    let resp = c
        .get_preferred_allocation(api::PreferredAllocationRequest {
            container_requests: vec![
                api::ContainerPreferredAllocationRequest {
                    available_device_i_ds: available.clone(),
                    must_include_device_i_ds: vec![],
                    allocation_size: 3,
                },
                api::ContainerPreferredAllocationRequest {
                    available_device_i_ds: available.clone(),
                    must_include_device_i_ds: ids(3, 1..2),
                    allocation_size: 2,
                },
            ],
        })
        .await
        .unwrap()
        .into_inner();
    let gpu_of = |id: &str| (0..4).find(|&g| id.starts_with(&fake_uuid(g))).unwrap();
    let first: Vec<u32> = resp.container_responses[0]
        .device_i_ds
        .iter()
        .map(|i| gpu_of(i))
        .collect();
    assert_eq!(first, vec![3, 0, 1], "least loaded first, each GPU once");
    let second = &resp.container_responses[1].device_i_ds;
    assert_eq!(second[0], vgpu_id(&fake_uuid(3), 1));
    assert_eq!(
        gpu_of(&second[1]),
        0,
        "a GPU other than the must-include one"
    );
    let err = c
        .get_preferred_allocation(api::PreferredAllocationRequest {
            container_requests: vec![api::ContainerPreferredAllocationRequest {
                available_device_i_ds: vec!["GPU-nope::1".into()],
                must_include_device_i_ds: vec![],
                allocation_size: 1,
            }],
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    h.stop().await.unwrap();
}

#[tokio::test]
async fn reregisters_within_two_seconds_after_kubelet_restart() {
    let mut h = Harness::start(1, 2, DeviceListStrategy::Envvar).await;
    h.registered().await;
    for round in 0..2 {
        let t0 = std::time::Instant::now();
        // Like the kubelet: every socket in the directory goes, kubelet.sock comes back.
        h.kubelet.restart().await.unwrap();
        let reg = h.registered().await;
        assert!(
            t0.elapsed() < Duration::from_secs(2),
            "round {round}: took {:?}",
            t0.elapsed()
        );
        assert_eq!(reg.version, "v1beta1");
        assert!(h.dir.path().join(&reg.endpoint).exists());
        let mut c = h.client().await;
        let mut s = c.list_and_watch(api::Empty {}).await.unwrap().into_inner();
        assert_eq!(next_list(&mut s).await.len(), 2);
    }
    assert!(
        h.kubelet
            .next_registration(Duration::from_millis(500))
            .await
            .is_none(),
        "one registration per restart"
    );
    h.stop().await.unwrap();
}

#[tokio::test]
async fn reregisters_when_only_its_socket_or_only_kubelet_sock_is_replaced() {
    let mut h = Harness::start(1, 2, DeviceListStrategy::Envvar).await;
    h.registered().await;
    std::fs::remove_file(h.socket()).unwrap();
    let t0 = std::time::Instant::now();
    h.registered().await;
    assert!(
        t0.elapsed() < Duration::from_secs(2),
        "took {:?}",
        t0.elapsed()
    );
    assert!(h
        .client()
        .await
        .get_device_plugin_options(api::Empty {})
        .await
        .is_ok());

    // kubelet.sock recreated, plugin socket left alone.
    h.kubelet.stop().await;
    let dir = h.dir.path().to_path_buf();
    h.kubelet = FakeKubelet::start(&dir).await.unwrap();
    let t0 = std::time::Instant::now();
    h.registered().await;
    assert!(
        t0.elapsed() < Duration::from_secs(2),
        "took {:?}",
        t0.elapsed()
    );
    h.stop().await.unwrap();
}

#[tokio::test]
async fn waits_for_the_kubelet_and_retries_a_refusal() {
    let dir = tempfile::tempdir().unwrap();
    // No kubelet yet: the plugin serves and waits.
    let mut kubelet = FakeKubelet::start(dir.path()).await.unwrap();
    kubelet.stop().await;
    kubelet.refuse(Some("resource name already taken"));
    let mut h = Harness::start_in(dir, kubelet, 1, 1, DeviceListStrategy::Envvar);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(h.socket().exists(), "serves before registering");
    let dir = h.dir.path().to_path_buf();
    let mut k2 = FakeKubelet::start(&dir).await.unwrap();
    k2.refuse(Some("resource name already taken"));
    assert!(k2
        .next_registration(Duration::from_millis(700))
        .await
        .is_none());
    k2.refuse(None);
    let reg = k2
        .next_registration(WAIT)
        .await
        .expect("registers once accepted");
    assert_eq!(reg.resource_name, "kiwi.dev/gpu");
    h.kubelet = k2;
    h.stop().await.unwrap();
}

#[tokio::test]
async fn shutdown_removes_the_socket() {
    let mut h = Harness::start(1, 1, DeviceListStrategy::Envvar).await;
    h.registered().await;
    let socket = h.socket();
    assert!(socket.exists());
    h.stop().await.unwrap();
    assert!(!socket.exists());
}

#[tokio::test]
async fn discovery_failures_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let settings = Settings {
        kubelet_dir: dir.path().to_path_buf(),
        ..Settings::default()
    };
    let none = run(
        settings.clone(),
        Box::new(FakeGpus::new(0)),
        std::future::pending(),
    )
    .await;
    assert!(matches!(none, Err(PluginError::NoGpus(_))), "{none:?}");
    let broken = FakeGpus::new(1);
    broken.fail_discovery("driver not loaded");
    let e = run(settings.clone(), Box::new(broken), std::future::pending())
        .await
        .unwrap_err();
    assert!(e.to_string().contains("driver not loaded"), "{e}");
    let missing_dir = Settings {
        kubelet_dir: dir.path().join("missing"),
        ..settings
    };
    let e = run(
        missing_dir,
        Box::new(FakeGpus::new(1)),
        std::future::pending(),
    )
    .await
    .unwrap_err();
    assert!(e.to_string().contains("missing"), "{e}");
}

#[tokio::test]
async fn the_kubelet_side_follows_devices_and_health_across_a_restart() {
    let mut h = Harness::start(2, 3, DeviceListStrategy::Envvar).await;
    h.registered().await;
    // What the kubelet itself received on the stream it opened after Register.
    let list = h
        .kubelet
        .next_devices(WAIT)
        .await
        .expect("kubelet got a device list");
    assert_eq!(list.len(), 6);
    assert!(list.iter().all(|d| d.health == HEALTHY));
    h.gpus.lose(&fake_uuid(0));
    let list = h
        .kubelet
        .next_devices(WAIT)
        .await
        .expect("kubelet got an update");
    assert_eq!(health_of(&list, 0), vec![UNHEALTHY; 3]);
    assert_eq!(health_of(&list, 1), vec![HEALTHY; 3]);

    // After a kubelet restart the new kubelet gets the current state, GPU 0 still out.
    h.kubelet.restart().await.unwrap();
    let t0 = std::time::Instant::now();
    h.registered().await;
    // No health change happened meanwhile, so the old stream sent nothing more: this
    // is the new kubelet's first list.
    let list = h
        .kubelet
        .next_devices(WAIT)
        .await
        .expect("list after restart");
    assert_eq!(list.len(), 6);
    assert!(
        t0.elapsed() < Duration::from_secs(2),
        "took {:?}",
        t0.elapsed()
    );
    assert_eq!(health_of(&list, 0), vec![UNHEALTHY; 3]);
    h.gpus.clear(&fake_uuid(0));
    let list = h.kubelet.next_devices(WAIT).await.expect("recovery seen");
    assert!(list.iter().all(|d| d.health == HEALTHY));
    h.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_calls_while_health_flaps() {
    let mut h = Harness::start(4, 8, DeviceListStrategy::CdiCri).await;
    h.registered().await;
    let mut tasks = Vec::new();
    for t in 0..8u32 {
        let mut c = h.client().await;
        tasks.push(tokio::spawn(async move {
            for i in 0..100u32 {
                let gpu = (t + i) % 4;
                let resp = c
                    .allocate(api::AllocateRequest {
                        container_requests: vec![api::ContainerAllocateRequest {
                            devices_ids: vec![vgpu_id(&fake_uuid(gpu), i % 8)],
                        }],
                    })
                    .await
                    .unwrap()
                    .into_inner();
                assert_eq!(
                    resp.container_responses[0].envs["KIWI_VISIBLE_DEVICES"],
                    fake_uuid(gpu)
                );
                if i % 10 == 0 {
                    let mut s = c.list_and_watch(api::Empty {}).await.unwrap().into_inner();
                    assert_eq!(next_list(&mut s).await.len(), 32);
                }
            }
        }));
    }
    for i in 0..20 {
        h.gpus.lose(&fake_uuid(i % 4));
        tokio::time::sleep(Duration::from_millis(5)).await;
        h.gpus.clear(&fake_uuid(i % 4));
    }
    for t in tasks {
        tokio::time::timeout(WAIT, t)
            .await
            .expect("calls hung")
            .unwrap();
    }
    let t0 = std::time::Instant::now();
    h.stop().await.unwrap();
    assert!(
        t0.elapsed() < Duration::from_secs(1),
        "stop took {:?}",
        t0.elapsed()
    );
}
