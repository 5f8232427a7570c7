//! The two other ways in: a CDI spec (`kiwictl cdi generate`) and an OCI `hooks.d`
//! entry. Both leave the work to kiwi-hook alone, run here under plain runc.

mod common;

use std::path::Path;
use std::process::{Command, Stdio};

use common::*;
use kiwi_oci::cdi::{run_cdi_generate, CdiGenerateArgs, CdiSpec};
use kiwi_oci::spec::Spec;

fn generate(fx: &Fixture) -> CdiSpec {
    let out = fx.path().join("cdi/kiwi.json");
    std::fs::create_dir_all(out.parent().unwrap()).unwrap();
    run_cdi_generate(&CdiGenerateArgs {
        output: Some(out.clone()),
        config: Some(fx.config.clone()),
    })
    .unwrap();
    // Parses back with unknown fields refused, as CDI consumers do.
    serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap()
}

#[test]
fn cdi_spec_parses_back_and_matches_what_the_runtime_injects() {
    let fx = Fixture::new();
    let cdi = generate(&fx);
    assert_eq!(cdi.kind, "kiwi.dev/gpu");
    assert_eq!(cdi.cdi_version, "0.5.0");
    let names: Vec<&str> = cdi.devices.iter().map(|d| d.name.as_str()).collect();
    assert_eq!(names, ["0", UUID0, "1", UUID1, "all"]);
    let dev = |n: &str| cdi.devices.iter().find(|d| d.name == n).unwrap();
    assert_eq!(
        dev(UUID1).container_edits.env,
        [format!("KIWI_VISIBLE_DEVICES={UUID1}")]
    );
    assert_eq!(
        dev("0").container_edits.env,
        [format!("KIWI_VISIBLE_DEVICES={UUID0}")]
    );
    assert_eq!(dev("all").container_edits.env, ["KIWI_VISIBLE_DEVICES=all"]);
    assert_eq!(dev("all").container_edits.device_nodes.len(), 2);
    let hook = &cdi.container_edits.hooks[0];
    assert_eq!(hook.hook_name, "createRuntime");
    assert_eq!(hook.path, Path::new(HOOK));
    let cfg = std::fs::canonicalize(&fx.config).unwrap();
    assert_eq!(
        hook.args[1..3],
        ["--config".to_string(), cfg.display().to_string()]
    );

    // The same claim through kiwi-runtime (real runtime: /bin/true) gives the same nodes.
    fx.write_config_with("[\"/bin/true\"]", &fx.shim, "");
    let b = fx.path().join("b");
    std::fs::create_dir_all(&b).unwrap();
    std::fs::write(
        b.join("config.json"),
        format!(r#"{{"process":{{"env":["KIWI_VISIBLE_DEVICES={UUID1}"]}}}}"#),
    )
    .unwrap();
    let st = fx
        .kiwi_runtime()
        .args(["create", "-b"])
        .arg(&b)
        .arg("x")
        .status()
        .unwrap();
    assert!(st.success());
    let spec = Spec::load(&b).unwrap();
    let from_runtime: Vec<(String, u64, u64)> = spec
        .nvidia_devices()
        .iter()
        .map(|n| (n.path.display().to_string(), n.major, n.minor))
        .collect();
    let from_cdi: Vec<(String, u64, u64)> = dev(UUID1)
        .container_edits
        .device_nodes
        .iter()
        .chain(&cdi.container_edits.device_nodes)
        .map(|n| (n.path.display().to_string(), n.major, n.minor))
        .collect();
    assert_eq!(from_runtime, from_cdi);
    let rt_hook = &spec.hooks("prestart")[0];
    assert_eq!(rt_hook.path, hook.path);
    // The same arguments, plus the bound driver libraries' directory for the ld cache
    // (CDI binds no driver files).
    let driver_dir = fx.driver_file.parent().unwrap().display().to_string();
    let mut expected = hook.args[..hook.args.len() - 1].to_vec();
    expected.extend(["--ld-dir".to_string(), driver_dir]);
    assert_eq!(rt_hook.args[..rt_hook.args.len() - 1], expected);
}

/// Runs a bundle with plain runc (no kiwi-runtime).
fn plain_runc(fx: &Fixture, bundle: &Path) -> (bool, String, String) {
    let id = unique_id("kiwi-alone");
    let _g = RuncDelete {
        root: fx.runc_root.clone(),
        id: id.clone(),
    };
    let out = Command::new(which("runc").unwrap())
        .arg("--root")
        .arg(&fx.runc_root)
        .args(["run", "--bundle"])
        .arg(bundle)
        .arg(&id)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let (o, e) = text(&out);
    (out.status.success(), o, e)
}

const SCRIPT: &str = "echo SHIM=$(cat /usr/lib/kiwi/libkiwi.so); echo PRELOAD=$(cat /etc/ld.so.preload | tr '\\n' ' '); \
    stat -c 'NODE %n %t:%T' /dev/nvidia1 /dev/nvidiactl; echo OPEN=$(cat /dev/nvidia1 2>&1 | head -1); \
    /bin/uconnect /run/kiwi/client/arbiter.sock alone; echo DONE";

#[test]
fn cdi_edits_applied_by_an_engine_work_under_plain_runc() {
    if !require(&["runc", "busybox", "gcc"]) {
        return;
    }
    let fx = Fixture::new();
    let _arbiter = FakeArbiter::start(&fx.socket_dir);
    let cdi = generate(&fx);
    let b = fx.bundle("cdi", SCRIPT, &[]);
    // Apply device "1" and the spec-wide edits the way a CDI-aware engine does.
    let p = b.join("config.json");
    let mut spec: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    let d = cdi.devices.iter().find(|d| d.name == "1").unwrap();
    for e in d.container_edits.env.iter().chain(&cdi.container_edits.env) {
        spec["process"]["env"]
            .as_array_mut()
            .unwrap()
            .push(e.clone().into());
    }
    spec["linux"]["devices"] = serde_json::json!([]);
    for n in d
        .container_edits
        .device_nodes
        .iter()
        .chain(&cdi.container_edits.device_nodes)
    {
        let node = serde_json::json!({"path": n.path, "type": "c", "major": n.major, "minor": n.minor, "fileMode": n.file_mode});
        spec["linux"]["devices"].as_array_mut().unwrap().push(node);
        spec["linux"]["resources"]["devices"]
            .as_array_mut()
            .unwrap()
            .push(serde_json::json!({"allow": true, "type": "c", "major": n.major, "minor": n.minor, "access": n.permissions}));
    }
    let hooks: Vec<serde_json::Value> = cdi
        .container_edits
        .hooks
        .iter()
        .map(|h| serde_json::json!({"path": h.path, "args": h.args}))
        .collect();
    let stages: Vec<&str> = cdi
        .container_edits
        .hooks
        .iter()
        .map(|h| h.hook_name.as_str())
        .collect();
    assert_eq!(stages, ["createRuntime", "poststop"]);
    spec["hooks"] = serde_json::json!({"createRuntime": [hooks[0]], "poststop": [hooks[1]]});
    std::fs::write(&p, serde_json::to_vec(&spec).unwrap()).unwrap();

    let (ok, out, err) = plain_runc(&fx, &b);
    assert!(ok, "{err}\n{out}");
    assert!(out.contains(&format!("SHIM={SHIM_CONTENT}")), "{out}");
    assert!(
        out.contains("PRELOAD=/usr/lib/kiwi/libkiwi.so /lib/libimage-own.so"),
        "{out}"
    );
    assert!(out.contains("NODE /dev/nvidia1 c3:1"), "{out}");
    assert!(out.contains("NODE /dev/nvidiactl c3:ff"), "{out}");
    assert!(
        out.contains("OPEN=cat: can't open '/dev/nvidia1': No such device or address"),
        "{out}"
    );
    assert!(out.contains("UCONNECT-REPLY:ok"), "{out}");
    assert_own_socket(&_arbiter, "hello from alone", &fx.socket_dir, true);
}

#[test]
fn hooks_d_entry_alone_creates_nodes_and_injects() {
    if !require(&["runc", "busybox", "gcc"]) {
        return;
    }
    let fx = Fixture::new();
    let _arbiter = FakeArbiter::start(&fx.socket_dir);
    let file = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/hooks.d/kiwi-hook.json");
    let entry: serde_json::Value = serde_json::from_slice(&std::fs::read(&file).unwrap()).unwrap();
    assert_eq!(entry["version"], "1.0.0");
    assert_eq!(
        entry["when"]["always"], true,
        "kiwi-hook checks the claim itself"
    );
    let stages: Vec<String> = entry["stages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap().to_string())
        .collect();
    assert_eq!(stages, ["prestart", "poststop"], "one entry, both stages");
    let mut args: Vec<String> = entry["hook"]["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap().to_string())
        .collect();
    // As installed, the hook reads /etc/kiwi/config.toml; here, the fixture's.
    args.splice(
        1..1,
        ["--config".to_string(), fx.config.display().to_string()],
    );

    for (claimed, env) in [
        (true, "KIWI_VISIBLE_DEVICES=1"),
        (false, "KIWI_VISIBLE_DEVICES=void"),
    ] {
        let b = fx.bundle(
            if claimed { "hd-claimed" } else { "hd-void" },
            SCRIPT,
            &[env],
        );
        let p = b.join("config.json");
        let mut spec: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
        let hook = serde_json::json!([{"path": HOOK, "args": args}]);
        spec["hooks"] = serde_json::json!({ "prestart": hook.clone(), "poststop": hook });
        std::fs::write(&p, serde_json::to_vec(&spec).unwrap()).unwrap();
        let (ok, out, err) = plain_runc(&fx, &b);
        assert!(ok, "{err}\n{out}");
        if claimed {
            assert!(out.contains(&format!("SHIM={SHIM_CONTENT}")), "{out}");
            // Created by the hook, with the host's numbers; the spec's device cgroup
            // (deny all, nothing added by a hooks.d engine) refuses them: EPERM.
            assert!(out.contains("NODE /dev/nvidia1 c3:1"), "{out}");
            assert!(out.contains("NODE /dev/nvidiactl c3:ff"), "{out}");
            assert!(out.contains("Operation not permitted"), "{out}");
            assert!(out.contains("UCONNECT-REPLY:ok"), "{out}");
            // One entry, both stages: the hook tells poststop by the state's status.
            assert_own_socket(&_arbiter, "hello from alone", &fx.socket_dir, true);
        } else {
            assert!(!out.contains("SHIM=kiwi"), "{out}");
            assert!(
                out.contains("PRELOAD=/lib/libimage-own.so\n")
                    || out.contains("PRELOAD=/lib/libimage-own.so \n"),
                "{out}"
            );
            assert!(!out.contains("NODE /dev/nvidia1"), "{out}");
        }
    }
    assert_eq!(
        _arbiter.heard.lock().unwrap().len(),
        3,
        "the unclaimed one is left alone"
    );
}

/// Unmounts a test's bind mount on drop.
struct Unmount(std::path::PathBuf);

impl Drop for Unmount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

#[test]
fn read_only_bundle_directory_still_gets_the_preload() {
    if !require(&["runc", "busybox", "gcc", "mount", "umount"]) {
        return;
    }
    let fx = Fixture::new();
    let b = fx.bundle(
        "robundle",
        "cat /etc/ld.so.preload; echo DONE",
        &["KIWI_VISIBLE_DEVICES=0"],
    );
    let p = b.join("config.json");
    let mut spec: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    spec["hooks"] = serde_json::json!({"prestart": [{"path": HOOK, "args": ["kiwi-hook", "--config", fx.config, "prestart"]}]});
    std::fs::write(&p, serde_json::to_vec(&spec).unwrap()).unwrap();
    // The bundle directory read-only (the rootfs below it is a separate bind, writable).
    let rootfs = b.join("rootfs");
    let st = Command::new("mount")
        .args(["--bind"])
        .arg(&b)
        .arg(&b)
        .status()
        .unwrap();
    assert!(st.success());
    let _u = Unmount(b.clone());
    let st = Command::new("mount")
        .args(["-o", "remount,bind,ro"])
        .arg(&b)
        .status()
        .unwrap();
    assert!(st.success());
    let st = Command::new("mount")
        .args(["--bind"])
        .arg(&rootfs)
        .arg(&rootfs)
        .status()
        .unwrap();
    assert!(st.success());
    let _ur = Unmount(rootfs.clone());
    let st = Command::new("mount")
        .args(["-o", "remount,bind,rw"])
        .arg(&rootfs)
        .status()
        .unwrap();
    assert!(st.success());
    assert!(
        std::fs::write(b.join("probe"), "x").is_err(),
        "bundle must be read-only"
    );

    let (ok, out, err) = plain_runc(&fx, &b);
    assert!(ok, "{err}\n{out}");
    assert!(
        out.contains("/usr/lib/kiwi/libkiwi.so\n/lib/libimage-own.so\nDONE"),
        "{out}"
    );
    let left: Vec<_> = std::fs::read_dir("/run")
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .starts_with(".kiwi-ld.so.preload")
        })
        .collect();
    assert!(left.is_empty(), "{left:?}");
}
