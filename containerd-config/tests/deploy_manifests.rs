//! The Kubernetes side of installing Kiwi (`deploy/`): the Helm chart is rendered by
//! Helm's own engine, linted, and every object validated against the Kubernetes
//! schemas (`deploy/tools/chart.py check`, Python packages in .ci/pip-packages);
//! the committed plain manifests must equal the chart's output; and the objects
//! carry what Kiwi needs (names, host paths, the installer's command, a config
//! file every Kiwi component can read).

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root")
        .to_path_buf()
}

/// Runs `deploy/tools/chart.py`; `None` (a loud skip) when Python or its packages
/// are missing outside CI, a failure in CI.
fn chart_py(args: &[&str]) -> Option<std::process::Output> {
    let out = Command::new("python3")
        .arg(repo().join("deploy/tools/chart.py"))
        .args(args)
        .output();
    let missing = match &out {
        Err(_) => true,
        Ok(o) => o.status.code() == Some(3),
    };
    if missing {
        let why = out
            .as_ref()
            .map(|o| String::from_utf8_lossy(&o.stderr).to_string())
            .unwrap_or_else(|e| format!("python3: {e}"));
        if std::env::var("CI").as_deref() == Ok("true") {
            panic!("deploy checks need python3 with .ci/pip-packages installed: {why}");
        }
        eprintln!("SKIPPED: {why}");
        return None;
    }
    out.ok()
}

fn render(args: &[&str]) -> Option<Vec<Value>> {
    let mut argv = vec!["render"];
    argv.extend_from_slice(args);
    let out = chart_py(&argv)?;
    assert!(
        out.status.success(),
        "render failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let docs: Vec<Value> = serde_json::from_slice(&out.stdout).expect("render prints JSON");
    Some(docs.into_iter().map(|d| d["object"].clone()).collect())
}

fn find<'a>(docs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    docs.iter()
        .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name}"))
}

fn config_of(docs: &[Value]) -> kiwi_config::Config {
    let text = find(docs, "ConfigMap", "kiwi-config")["data"]["config.toml"]
        .as_str()
        .expect("config.toml in the ConfigMap")
        .to_string();
    kiwi_config::Config::from_str_at(&text, Path::new("kiwi-config/config.toml"))
        .unwrap_or_else(|e| panic!("Kiwi cannot read the chart's config: {e}\n{text}"))
}

fn init_script(ds: &Value) -> String {
    let init = &ds["spec"]["template"]["spec"]["initContainers"][0];
    assert_eq!(init["name"], "install");
    init["args"][0].as_str().expect("script").to_string()
}

#[test]
fn chart_lints_validates_and_matches_the_plain_manifests() {
    let Some(out) = chart_py(&["check"]) else {
        return;
    };
    assert!(
        out.status.success(),
        "chart.py check failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    println!("{}", String::from_utf8_lossy(&out.stdout));
}

#[test]
fn plain_manifests_have_what_kiwi_needs() {
    let Some(docs) = render(&["--plain"]) else {
        return;
    };
    let kinds: Vec<&str> = docs.iter().filter_map(|d| d["kind"].as_str()).collect();
    assert_eq!(
        kinds,
        [
            "Namespace",
            "ConfigMap",
            "RuntimeClass",
            "DaemonSet",
            "DaemonSet"
        ]
    );
    assert_eq!(find(&docs, "Namespace", "kiwi-system")["kind"], "Namespace");
    assert_eq!(find(&docs, "RuntimeClass", "kiwi")["handler"], "kiwi");

    let arbiter = find(&docs, "DaemonSet", "kiwi-scheduler");
    assert_eq!(arbiter["metadata"]["namespace"], "kiwi-system");
    let pod = &arbiter["spec"]["template"];
    assert_eq!(pod["metadata"]["labels"]["name"], "kiwi-scheduler");
    let spec = &pod["spec"];
    assert_eq!(spec["hostPID"], true);
    assert_eq!(spec["priorityClassName"], "system-node-critical");
    assert!(spec["nodeSelector"]
        .as_object()
        .is_some_and(|m| !m.is_empty()));
    assert!(spec["tolerations"]
        .as_array()
        .unwrap()
        .iter()
        .any(|t| t["key"] == "nvidia.com/gpu"));
    let c = &spec["containers"][0];
    assert_eq!(
        c["command"],
        serde_json::json!(["kiwi-arbiter", "--socket-dir", "/run/kiwi"])
    );
    let run_kiwi = spec["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["hostPath"]["path"] == "/run/kiwi")
        .expect("hostPath /run/kiwi");
    assert!(c["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .any(|m| m["name"] == run_kiwi["name"] && m["mountPath"] == "/run/kiwi"));
    assert!(c["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .any(|m| m["mountPath"] == "/etc/kiwi"));
    assert_eq!(c["ports"][0]["containerPort"], 9400);
    // Pods have no LimitNOFILE: the arbiter raises its own (CAP_SYS_RESOURCE).
    assert!(c["env"]
        .as_array()
        .unwrap()
        .iter()
        .any(|e| e["name"] == "KIWI_LIMIT_NOFILE" && e["value"] == "65536"));
    assert_eq!(
        c["securityContext"]["capabilities"]["add"],
        serde_json::json!(["SYS_RESOURCE"])
    );

    let script = init_script(arbiter);
    for needed in [
        "kiwictl install containerd",
        "--config \"/host/etc/containerd/config.toml\" --host-root /host",
        "--runtime-path \"/usr/local/bin/kiwi-runtime\"",
        "for b in kiwi-runtime kiwi-hook kiwictl; do",
        "/host/usr/local/lib/kiwi/libkiwi.so",
        "must be restarted",
    ] {
        assert!(
            script.contains(needed),
            "installer lacks {needed:?}:\n{script}"
        );
    }
    assert!(
        !script.contains("nsenter"),
        "restarting containerd is opt-in"
    );

    let plugin = find(&docs, "DaemonSet", "kiwi-device-plugin");
    let spec = &plugin["spec"]["template"]["spec"];
    let vol = spec["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["hostPath"]["path"] == "/var/lib/kubelet/device-plugins")
        .expect("kubelet device-plugin dir");
    assert!(spec["containers"][0]["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .any(|m| m["name"] == vol["name"] && m["mountPath"] == "/var/lib/kubelet/device-plugins"));

    let cfg = config_of(&docs);
    assert_eq!(cfg.arbiter.tq_seconds, 30.0);
    assert!(cfg.arbiter.scheduler.is_on());
    assert_eq!(cfg.device_plugin.vgpus_per_gpu, 10);
    assert_eq!(cfg.device_plugin.resource_name, "kiwi.dev/gpu");
    assert_eq!(cfg.socket_dir, Path::new("/run/kiwi"));
    assert_eq!(cfg.runtime.hook_path, Path::new("/usr/local/bin/kiwi-hook"));
    assert_eq!(
        cfg.runtime.shim_path,
        Path::new("/usr/local/lib/kiwi/libkiwi.so")
    );
    assert_eq!(cfg.arbiter.metrics_addr.as_deref(), Some("0.0.0.0:9400"));
}

#[test]
fn chart_values_reach_the_config_and_the_installer() {
    let Some(docs) = render(&[
        "--set",
        "tq=2.5,scheduler=off,vgpusPerGpu=4,resourceName=example.com/vgpu,swapBudgetMiB=65536",
        "--set",
        "installer.restartContainerd=true,installer.dropIn=true,installer.setAsDefault=true",
        "--set",
        "image.repository=registry.local/kiwi,image.tag=dev,metrics.enabled=false",
    ]) else {
        return;
    };
    let cfg = config_of(&docs);
    assert_eq!(cfg.arbiter.tq_seconds, 2.5);
    assert_eq!(cfg.arbiter.swap_budget_mib, Some(65536));
    assert!(!cfg.arbiter.scheduler.is_on());
    assert_eq!(cfg.device_plugin.vgpus_per_gpu, 4);
    assert_eq!(cfg.device_plugin.resource_name, "example.com/vgpu");
    assert_eq!(cfg.arbiter.metrics_addr, None);
    assert!(
        docs.iter().all(|d| d["kind"] != "Namespace"),
        "helm users pass --create-namespace"
    );

    let arbiter = find(&docs, "DaemonSet", "kiwi-scheduler");
    let script = init_script(arbiter);
    assert!(script.contains("nsenter -t 1 -m -u -i -n -p -- systemctl restart containerd"));
    assert!(script.contains("--drop-in --set-as-default)"), "{script}");
    let init = &arbiter["spec"]["template"]["spec"]["initContainers"][0];
    assert_eq!(init["securityContext"]["privileged"], true);
    assert_eq!(init["image"], "registry.local/kiwi:dev");
}

/// The arbiter gets the driver (a RuntimeClass of NVIDIA's runtime, every GPU) and
/// the capabilities of the checkpoint API only when the values ask for it.
#[test]
fn the_arbiter_gets_the_driver_for_checkpoints_only_when_asked() {
    let arbiter_of = |docs: &[Value]| find(docs, "DaemonSet", "kiwi-scheduler").clone();
    let container = |ds: &Value| ds["spec"]["template"]["spec"]["containers"][0].clone();
    let env = |c: &Value, k: &str| {
        c["env"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|e| e["name"] == k)
            .map(|e| e["value"].clone())
    };
    let Some(plain) = render(&[]) else {
        return;
    };
    let ds = arbiter_of(&plain);
    let c = container(&ds);
    assert!(ds["spec"]["template"]["spec"]["runtimeClassName"].is_null());
    assert_eq!(
        c["securityContext"]["capabilities"]["add"],
        serde_json::json!(["SYS_RESOURCE"])
    );
    assert_eq!(env(&c, "NVIDIA_VISIBLE_DEVICES"), None);
    let Some(docs) = render(&["--set", "arbiter.checkpointRuntimeClassName=nvidia"]) else {
        return;
    };
    let ds = arbiter_of(&docs);
    let c = container(&ds);
    assert_eq!(ds["spec"]["template"]["spec"]["runtimeClassName"], "nvidia");
    assert_eq!(
        c["securityContext"]["capabilities"]["add"],
        serde_json::json!(["SYS_RESOURCE", "SYS_ADMIN", "SYS_PTRACE"])
    );
    assert_eq!(env(&c, "NVIDIA_VISIBLE_DEVICES"), Some("all".into()));
}

#[test]
fn bad_values_are_refused_by_the_chart() {
    for set in [
        "tq=0",
        "scheduler=maybe",
        "vgpusPerGpu=0",
        "swapBudgetMiB=-1",
    ] {
        let Some(out) = chart_py(&["render", "--set", set]) else {
            return;
        };
        assert!(!out.status.success(), "{set} accepted");
        let err = String::from_utf8_lossy(&out.stderr);
        let key = set.split('=').next().unwrap();
        assert!(err.contains(key), "{set}: {err}");
    }
}

#[test]
fn systemd_units_run_the_daemons_with_the_design_paths() {
    let unit = std::fs::read_to_string(repo().join("deploy/systemd/kiwi-arbiter.service")).unwrap();
    assert!(unit.contains("\nExecStart=/usr/local/bin/kiwi-arbiter --socket-dir /run/kiwi\n"));
    assert!(
        unit.contains("\nRuntimeDirectoryPreserve=yes\n"),
        "containers bind /run/kiwi/client"
    );
    assert!(unit.contains("\n[Install]\nWantedBy=multi-user.target\n"));
    assert!(
        unit.contains("\nLimitNOFILE=65536\n"),
        "room for 4096 client connections and the control socket"
    );
    let unit =
        std::fs::read_to_string(repo().join("deploy/systemd/kiwi-device-plugin.service")).unwrap();
    assert!(unit.contains("\nExecStart=/usr/local/bin/kiwi-device-plugin\n"));
    assert!(unit.contains("After=kubelet.service"));
}

/// The `kiwictl` stand-in built from `examples/kiwictl.rs` (by `cargo test`).
fn kiwictl_example() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let path = exe.parent()?.parent()?.join("examples").join("kiwictl");
    if path.is_file() {
        return Some(path);
    }
    if std::env::var("CI").as_deref() == Ok("true") {
        panic!("{} missing: cargo test builds it", path.display());
    }
    eprintln!(
        "SKIPPED: {} missing; run `cargo test -p kiwi-containerd-config` (which builds examples)",
        path.display()
    );
    None
}

/// A fake node: the image's files, the host's root, and stubs for `nsenter`.
struct Node {
    _dir: tempfile::TempDir,
    img: PathBuf,
    host: PathBuf,
    nsenter_log: PathBuf,
}

impl Node {
    fn new(kiwictl: &Path, containerd_config: Option<&str>) -> Node {
        let dir = tempfile::tempdir().unwrap();
        let img = dir.path().join("img");
        let host = dir.path().join("host");
        std::fs::create_dir_all(img.join("bin")).unwrap();
        for b in ["kiwi-runtime", "kiwi-hook"] {
            std::fs::write(img.join("bin").join(b), format!("#!/bin/sh\necho {b}\n")).unwrap();
        }
        std::fs::copy(kiwictl, img.join("bin/kiwictl")).unwrap();
        std::fs::write(img.join("libkiwi.so"), b"\x7fELF shim").unwrap();
        std::fs::write(img.join("config.toml"), "[arbiter]\ntq_seconds = 5\n").unwrap();
        let nsenter_log = dir.path().join("nsenter.log");
        std::fs::write(
            img.join("bin/nsenter"),
            format!("#!/bin/sh\necho \"$*\" >> {}\n", nsenter_log.display()),
        )
        .unwrap();
        for b in ["kiwi-runtime", "kiwi-hook", "nsenter"] {
            use std::os::unix::fs::PermissionsExt;
            let p = img.join("bin").join(b);
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        // What the DaemonSet's hostPath volumes (DirectoryOrCreate) provide.
        for d in [
            "usr/local/bin",
            "usr/local/lib/kiwi",
            "etc/kiwi",
            "etc/containerd",
        ] {
            std::fs::create_dir_all(host.join(d)).unwrap();
        }
        if let Some(text) = containerd_config {
            std::fs::write(host.join("etc/containerd/config.toml"), text).unwrap();
        }
        Node {
            _dir: dir,
            img,
            host,
            nsenter_log,
        }
    }

    /// Runs the chart's init script with the image's and the host's paths moved
    /// into this node's directories; returns (success, output).
    fn run(&self, script: &str) -> (bool, String) {
        let img = self.img.display().to_string();
        let script = script
            .replace(
                "put 0755 \"/usr/local/bin/",
                &format!("put 0755 \"{img}/bin/"),
            )
            .replace(
                "put 0644 /usr/local/lib/kiwi/libkiwi.so",
                &format!("put 0644 {img}/libkiwi.so"),
            )
            .replace(
                "put 0644 /etc/kiwi/config.toml",
                &format!("put 0644 {img}/config.toml"),
            )
            .replace("/host", &self.host.display().to_string());
        let path = format!("{img}/bin:{}", std::env::var("PATH").unwrap_or_default());
        let out = Command::new("sh")
            .args(["-c", &script])
            .env("PATH", path)
            .output()
            .expect("run sh");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        (out.status.success(), text)
    }
}

#[test]
fn the_installer_script_installs_kiwi_on_a_node_once() {
    let Some(kiwictl) = kiwictl_example() else {
        return;
    };
    let Some(docs) = render(&["--plain"]) else {
        return;
    };
    let script = init_script(find(&docs, "DaemonSet", "kiwi-scheduler"));
    let v2 =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/v2.toml"))
            .unwrap();
    let node = Node::new(&kiwictl, Some(&v2));

    let (ok, out) = node.run(&script);
    assert!(ok, "installer failed:\n{out}");
    assert!(out.contains("Added runtime \"kiwi\""), "{out}");
    assert!(out.contains("must be restarted"), "{out}");
    for (file, mode) in [
        ("usr/local/bin/kiwi-runtime", 0o755),
        ("usr/local/bin/kiwi-hook", 0o755),
        ("usr/local/bin/kiwictl", 0o755),
        ("usr/local/lib/kiwi/libkiwi.so", 0o644),
        ("etc/kiwi/config.toml", 0o644),
    ] {
        use std::os::unix::fs::PermissionsExt;
        let meta = std::fs::metadata(node.host.join(file))
            .unwrap_or_else(|e| panic!("{file} not installed: {e}\n{out}"));
        assert_eq!(meta.permissions().mode() & 0o777, mode, "{file}");
    }
    let leftovers: Vec<_> = std::fs::read_dir(node.host.join("usr/local/bin"))
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().contains("kiwi-new"))
        .collect();
    assert!(leftovers.is_empty(), "temporary files left: {leftovers:?}");
    let cfg = std::fs::read_to_string(node.host.join("etc/containerd/config.toml")).unwrap();
    assert!(
        cfg.contains("BinaryName = \"/usr/local/bin/kiwi-runtime\""),
        "host path, not the container's:\n{cfg}"
    );
    assert!(!cfg.contains(&node.host.display().to_string()));
    assert!(
        !node.nsenter_log.exists(),
        "containerd restarted without being asked"
    );

    // A pod restart re-runs the installer: nothing changes, nothing is asked for.
    let (ok, out) = node.run(&script);
    assert!(ok, "{out}");
    assert!(out.contains("nothing changed"), "{out}");
    assert!(!out.contains("must be restarted"), "{out}");
    assert_eq!(
        std::fs::read_to_string(node.host.join("etc/containerd/config.toml")).unwrap(),
        cfg
    );
}

#[test]
fn the_installer_restarts_containerd_only_when_asked_and_needed() {
    let Some(kiwictl) = kiwictl_example() else {
        return;
    };
    let Some(docs) = render(&[
        "--set",
        "installer.restartContainerd=true,installer.dropIn=true",
    ]) else {
        return;
    };
    let script = init_script(find(&docs, "DaemonSet", "kiwi-scheduler"));
    // No containerd config on the node yet: the installer creates one.
    let node = Node::new(&kiwictl, None);
    let (ok, out) = node.run(&script);
    assert!(ok, "installer failed:\n{out}");
    assert_eq!(
        std::fs::read_to_string(&node.nsenter_log).unwrap(),
        "-t 1 -m -u -i -n -p -- systemctl restart containerd\n"
    );
    let main = std::fs::read_to_string(node.host.join("etc/containerd/config.toml")).unwrap();
    assert!(
        main.contains("imports = [\"/etc/containerd/conf.d/99-kiwi.toml\"]"),
        "{main}"
    );
    assert!(node
        .host
        .join("etc/containerd/conf.d/99-kiwi.toml")
        .exists());

    let (ok, out) = node.run(&script);
    assert!(ok, "{out}");
    assert_eq!(
        std::fs::read_to_string(&node.nsenter_log)
            .unwrap()
            .lines()
            .count(),
        1,
        "restarted again although nothing changed"
    );
}

#[test]
fn monitoring_objects_are_off_by_default_and_installed_when_asked() {
    let Some(docs) = render(&[]) else {
        return;
    };
    assert!(
        docs.iter()
            .all(|d| d["kind"] != "PrometheusRule" && d["kind"] != "PodMonitor"),
        "monitoring objects need the Prometheus Operator's CRDs: opt-in"
    );
    assert!(docs
        .iter()
        .all(|d| d["metadata"]["name"] != "kiwi-grafana-dashboard"));

    let Some(docs) = render(&[
        "--set",
        "dashboard.enabled=true,dashboard.namespace=monitoring,prometheusRule.enabled=true",
        "--set",
        "prometheusRule.labels.release=kps,podMonitor.enabled=true",
    ]) else {
        return;
    };
    let files = repo().join("deploy/helm/kiwi/files");

    // The dashboard: a ConfigMap the Grafana sidecar picks up, holding the file.
    let cm = find(&docs, "ConfigMap", "kiwi-grafana-dashboard");
    assert_eq!(cm["metadata"]["namespace"], "monitoring");
    assert_eq!(cm["metadata"]["labels"]["grafana_dashboard"], "1");
    let json = cm["data"]["kiwi-dashboard.json"]
        .as_str()
        .expect("the dashboard in the ConfigMap");
    let installed: Value = serde_json::from_str(json).expect("the installed dashboard is JSON");
    let file: Value =
        serde_json::from_str(&std::fs::read_to_string(files.join("kiwi-dashboard.json")).unwrap())
            .unwrap();
    assert_eq!(installed, file);

    // The alerts: a PrometheusRule carrying every rule of the rule file.
    let rule = find(&docs, "PrometheusRule", "kiwi");
    assert_eq!(rule["apiVersion"], "monitoring.coreos.com/v1");
    assert_eq!(rule["metadata"]["namespace"], "kiwi-system");
    assert_eq!(rule["metadata"]["labels"]["release"], "kps");
    let alerts: Vec<&str> = rule["spec"]["groups"][0]["rules"]
        .as_array()
        .expect("rules")
        .iter()
        .filter_map(|r| r["alert"].as_str())
        .collect();
    let text = std::fs::read_to_string(files.join("kiwi-alerts.yaml")).unwrap();
    assert_eq!(alerts.len(), text.matches("- alert:").count(), "{alerts:?}");
    for a in [
        "KiwiTenantWaitingTooLong",
        "KiwiSwapBudgetNearlyUsed",
        "KiwiGpuUnhealthy",
    ] {
        assert!(alerts.contains(&a), "{a} missing from {alerts:?}");
    }
    for r in rule["spec"]["groups"][0]["rules"].as_array().unwrap() {
        assert!(
            r["expr"].as_str().is_some_and(|e| e.contains("kiwi_")),
            "{r}"
        );
    }

    // Scraping: both daemons' metrics ports.
    let pm = find(&docs, "PodMonitor", "kiwi");
    assert_eq!(pm["spec"]["podMetricsEndpoints"][0]["port"], "metrics");
    let wanted = &pm["spec"]["selector"]["matchExpressions"][0]["values"];
    for ds in ["kiwi-scheduler", "kiwi-device-plugin"] {
        let pod_labels = &find(&docs, "DaemonSet", ds)["spec"]["template"]["metadata"]["labels"];
        assert_eq!(pod_labels["name"], ds);
        assert!(
            wanted.as_array().unwrap().iter().any(|v| v == ds),
            "{wanted}"
        );
        let ports =
            &find(&docs, "DaemonSet", ds)["spec"]["template"]["spec"]["containers"][0]["ports"];
        assert!(
            ports
                .as_array()
                .unwrap()
                .iter()
                .any(|p| p["name"] == "metrics"),
            "{ds}: {ports}"
        );
    }

    // No PodMonitor without metrics endpoints.
    let Some(docs) = render(&["--set", "podMonitor.enabled=true,metrics.enabled=false"]) else {
        return;
    };
    assert!(docs.iter().all(|d| d["kind"] != "PodMonitor"));
}
