//! GPU UUIDs resolved through NVML (`dlopen("libnvidia-ml.so.1")`), here the GPU
//! simulator's stand-in: by kiwi-runtime in-process, and by kiwi-hook in a forked
//! child (it must stay single-threaded to enter the container's mount namespace).

mod common;

use std::process::{Command, Stdio};

use common::*;
use kiwi_sim_core::harness::SimMachine;

fn sim_machine() -> Option<SimMachine> {
    match SimMachine::new("kiwi-oci", 2, 1 << 30) {
        Ok(m) => Some(m),
        Err(e) if is_ci() => panic!("the GPU simulator is not built: {e}"),
        Err(e) => {
            eprintln!("\n!!!!!!!! SKIPPED: the GPU simulator is not built ({e}); run `cargo build --workspace --all-targets` !!!!!!!!\n");
            None
        }
    }
}

/// The fixture's config without the GPU list, so UUIDs go to NVML.
fn config_without_gpu_list(fx: &Fixture, runtimes: &str) {
    fx.write_config_with(runtimes, &fx.shim, "");
    let text = std::fs::read_to_string(&fx.config).unwrap();
    let text: String = text
        .lines()
        .filter(|l| !l.starts_with("gpu_list"))
        .map(|l| format!("{l}\n"))
        .collect();
    std::fs::write(&fx.config, text).unwrap();
}

#[test]
fn runtime_resolves_uuids_through_nvml() {
    let Some(m) = sim_machine() else { return };
    let fx = Fixture::new();
    config_without_gpu_list(&fx, "[\"/bin/true\"]");
    let uuid1 = kiwi_sim_core::ident::gpu_uuid_string(&m.name, 1);
    let b = fx.path().join("b");
    std::fs::create_dir_all(&b).unwrap();
    for (claim, ok) in [
        (uuid1.as_str(), true),
        ("GPU-00000000-dead-beef-0000-000000000000", false),
    ] {
        std::fs::write(
            b.join("config.json"),
            format!(r#"{{"process":{{"env":["KIWI_VISIBLE_DEVICES={claim}"]}}}}"#),
        )
        .unwrap();
        let mut c = fx.kiwi_runtime();
        m.apply(&mut c);
        let out = c
            .args(["create", "--bundle"])
            .arg(&b)
            .arg("x")
            .output()
            .unwrap();
        let (_, stderr) = text(&out);
        assert_eq!(out.status.success(), ok, "{claim}: {stderr}");
        if ok {
            let spec = kiwi_oci::spec::Spec::load(&b).unwrap();
            let gpus: Vec<String> = spec
                .nvidia_devices()
                .iter()
                .map(|n| n.path.display().to_string())
                .collect();
            assert_eq!(gpus[0], "/dev/nvidia1", "{gpus:?}");
        } else {
            assert!(
                stderr.contains("unknown GPU GPU-00000000-dead-beef") && stderr.contains("NVML"),
                "{stderr}"
            );
        }
    }
}

#[test]
fn hook_alone_resolves_uuids_through_nvml_in_a_child() {
    let Some(m) = sim_machine() else { return };
    if !require(&["runc", "busybox", "gcc"]) {
        return;
    }
    let fx = Fixture::new();
    config_without_gpu_list(&fx, "[\"runc\"]");
    let _arbiter = FakeArbiter::start(&fx.socket_dir);
    let uuid0 = kiwi_sim_core::ident::gpu_uuid_string(&m.name, 0);
    let b = fx.bundle(
        "nvml",
        "stat -c 'NODE %n %t:%T' /dev/nvidia0; ls /dev/nvidia1 2>&1; cat /usr/lib/kiwi/libkiwi.so; echo",
        &[&format!("KIWI_VISIBLE_DEVICES={uuid0}")],
    );
    // No devices in the spec (a hooks.d engine adds none): the hook resolves the UUID.
    let p = b.join("config.json");
    let mut spec: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    spec["hooks"] = serde_json::json!({"prestart": [{"path": HOOK, "args": ["kiwi-hook", "--config", fx.config, "prestart"]}]});
    std::fs::write(&p, serde_json::to_vec(&spec).unwrap()).unwrap();
    let id = unique_id("kiwi-nvml");
    let _g = RuncDelete {
        root: fx.runc_root.clone(),
        id: id.clone(),
    };
    let mut c = Command::new(which("runc").unwrap());
    m.apply(&mut c); // the hook inherits runc's environment: LD_LIBRARY_PATH → the simulator
    let out = c
        .arg("--root")
        .arg(&fx.runc_root)
        .args(["run", "--bundle"])
        .arg(&b)
        .arg(&id)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}\n{stdout}");
    assert!(stdout.contains("NODE /dev/nvidia0 c3:0"), "{stdout}");
    assert!(stdout.contains("/dev/nvidia1: No such file"), "{stdout}");
    assert!(stdout.contains(SHIM_CONTENT), "{stdout}");
}
