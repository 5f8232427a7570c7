//! The real containerd (Debian's 1.6, installed by `.ci/apt-packages`) loads what
//! `kiwictl install containerd` writes: `containerd --config FILE config dump`
//! (no daemon needed) shows runtime `kiwi` with our `BinaryName` and runc's options.
//!
//! containerd 1.6 reads config versions 1 and 2 only; version 3 output is checked by
//! content against containerd 2.x's tables in `containerd_samples.rs`.

use std::path::Path;
use std::process::Command;

use clap::Parser;
use kiwi_containerd_config::{run_install_to, run_uninstall_to, InstallArgs, UninstallArgs};
use toml_edit::{DocumentMut, Item};

const CRI: &str = "io.containerd.grpc.v1.cri";

/// `containerd` on PATH, or a loud skip outside CI (a failure in CI).
fn containerd() -> Option<&'static str> {
    let ok = Command::new("containerd")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if ok {
        return Some("containerd");
    }
    if std::env::var("CI").as_deref() == Ok("true") {
        panic!("containerd is not installed (apt-get install containerd; see .ci/apt-packages)");
    }
    eprintln!("SKIPPED: containerd is not installed; install it to run this test");
    None
}

fn dump(bin: &str, config: &Path) -> DocumentMut {
    let out = Command::new(bin)
        .arg("--config")
        .arg(config)
        .args(["config", "dump"])
        .output()
        .expect("run containerd config dump");
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "containerd rejected {}:\n{}\n--- config ---\n{}",
        config.display(),
        String::from_utf8_lossy(&out.stderr),
        std::fs::read_to_string(config).unwrap_or_default()
    );
    text.parse().expect("containerd dumps TOML")
}

fn runtime<'a>(doc: &'a DocumentMut, name: &str) -> Option<&'a Item> {
    doc["plugins"][CRI]["containerd"]["runtimes"].get(name)
}

#[derive(Parser)]
struct Install {
    #[command(flatten)]
    args: InstallArgs,
}

#[derive(Parser)]
struct Uninstall {
    #[command(flatten)]
    args: UninstallArgs,
}

fn install(argv: &[&str]) -> String {
    let cli = Install::try_parse_from(std::iter::once("install").chain(argv.iter().copied()))
        .expect("valid arguments");
    let mut out = Vec::new();
    run_install_to(&cli.args, &mut out).expect("install succeeds");
    String::from_utf8(out).unwrap()
}

fn uninstall(argv: &[&str]) -> String {
    let cli = Uninstall::try_parse_from(std::iter::once("uninstall").chain(argv.iter().copied()))
        .expect("valid arguments");
    let mut out = Vec::new();
    run_uninstall_to(&cli.args, &mut out).expect("uninstall succeeds");
    String::from_utf8(out).unwrap()
}

fn sample(name: &str) -> String {
    std::fs::read_to_string(format!("{}/tests/data/{name}", env!("CARGO_MANIFEST_DIR"))).unwrap()
}

#[test]
fn containerd_loads_the_runtime_for_versions_1_and_2() {
    let Some(bin) = containerd() else { return };
    let dir = tempfile::tempdir().unwrap();
    for name in ["v1.toml", "v2.toml", "empty.toml", "comments-only.toml"] {
        let cfg = dir.path().join(name);
        std::fs::write(&cfg, sample(name)).unwrap();
        let before = dump(bin, &cfg);
        assert!(runtime(&before, "kiwi").is_none());

        let msg = install(&[
            "containerd",
            "--config",
            cfg.to_str().unwrap(),
            "--set-as-default",
        ]);
        assert!(msg.contains("Restart containerd"), "{msg}");
        let after = dump(bin, &cfg);
        let kiwi = runtime(&after, "kiwi").unwrap_or_else(|| panic!("{name}: no kiwi runtime"));
        assert_eq!(
            kiwi["runtime_type"].as_str(),
            Some("io.containerd.runc.v2"),
            "{name}"
        );
        assert_eq!(
            kiwi["options"]["BinaryName"].as_str(),
            Some("/usr/local/bin/kiwi-runtime"),
            "{name}"
        );
        assert_eq!(
            after["plugins"][CRI]["containerd"]["default_runtime_name"].as_str(),
            Some("kiwi"),
            "{name}"
        );
        if name.starts_with('v') {
            assert_eq!(
                kiwi["options"]["SystemdCgroup"].as_bool(),
                Some(true),
                "{name}"
            );
            let nvidia = runtime(&after, "nvidia").expect("nvidia runtime kept");
            assert_eq!(
                nvidia["options"]["BinaryName"].as_str(),
                Some("/usr/bin/nvidia-container-runtime")
            );
            assert_eq!(
                after["plugins"][CRI]["containerd"]["snapshotter"].as_str(),
                Some("overlayfs")
            );
        }

        uninstall(&["containerd", "--config", cfg.to_str().unwrap()]);
        assert_eq!(
            std::fs::read_to_string(&cfg).unwrap(),
            sample(name),
            "{name}"
        );
        assert!(runtime(&dump(bin, &cfg), "kiwi").is_none());
    }
}

#[test]
fn containerd_loads_the_drop_in_and_keeps_the_main_settings() {
    let Some(bin) = containerd() else { return };
    for name in ["v1.toml", "v2.toml", "empty.toml"] {
        let dir = tempfile::tempdir().unwrap();
        let cfg = dir.path().join("config.toml");
        std::fs::write(&cfg, sample(name)).unwrap();
        install(&["containerd", "--config", cfg.to_str().unwrap(), "--drop-in"]);
        let drop_in = dir.path().join("conf.d/99-kiwi.toml");
        assert!(drop_in.exists());

        let after = dump(bin, &cfg);
        let kiwi = runtime(&after, "kiwi").unwrap_or_else(|| panic!("{name}: no kiwi runtime"));
        assert_eq!(
            kiwi["options"]["BinaryName"].as_str(),
            Some("/usr/local/bin/kiwi-runtime"),
            "{name}"
        );
        if name.starts_with('v') {
            // containerd 1.6 replaces the CRI section with the imported one: what the
            // main file said must still be in force through the drop-in's copy.
            assert!(runtime(&after, "nvidia").is_some(), "{name}: nvidia lost");
            assert_eq!(kiwi["options"]["SystemdCgroup"].as_bool(), Some(true));
            assert_eq!(
                after["plugins"][CRI]["containerd"]["default_runtime_name"].as_str(),
                Some("runc")
            );
        }

        let msg = uninstall(&["containerd", "--config", cfg.to_str().unwrap()]);
        assert!(msg.contains("Deleted"), "{msg}");
        assert!(!drop_in.exists());
        assert_eq!(
            std::fs::read_to_string(&cfg).unwrap(),
            sample(name),
            "{name}"
        );
        assert!(runtime(&dump(bin, &cfg), "kiwi").is_none());
    }
}
