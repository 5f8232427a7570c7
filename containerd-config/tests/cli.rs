//! What a user of `kiwictl install|uninstall` sees and what happens to the files:
//! dry runs write nothing, backups are kept, bad files are named and left alone,
//! a second run says nothing changed.

use std::path::Path;

use clap::Parser;
use kiwi_containerd_config::{run_install_to, run_uninstall_to, InstallArgs, UninstallArgs};

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

fn install(argv: &[&str]) -> anyhow::Result<String> {
    let cli = Install::try_parse_from(std::iter::once("install").chain(argv.iter().copied()))?;
    let mut out = Vec::new();
    run_install_to(&cli.args, &mut out)?;
    Ok(String::from_utf8(out)?)
}

fn uninstall(argv: &[&str]) -> anyhow::Result<String> {
    let cli = Uninstall::try_parse_from(std::iter::once("uninstall").chain(argv.iter().copied()))?;
    let mut out = Vec::new();
    run_uninstall_to(&cli.args, &mut out)?;
    Ok(String::from_utf8(out)?)
}

fn sample(name: &str) -> String {
    std::fs::read_to_string(format!("{}/tests/data/{name}", env!("CARGO_MANIFEST_DIR"))).unwrap()
}

fn read(p: &Path) -> String {
    std::fs::read_to_string(p).unwrap()
}

#[test]
fn containerd_dry_run_prints_a_diff_and_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("config.toml");
    std::fs::write(&cfg, sample("v2.toml")).unwrap();
    let out = install(&["containerd", "--config", cfg.to_str().unwrap(), "--dry-run"]).unwrap();
    let path = cfg.display().to_string();
    assert!(out.contains(&format!("--- {path}\n+++ {path}\n")), "{out}");
    assert!(
        out.contains(
            "+          [plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.kiwi.options]"
        ),
        "{out}"
    );
    assert!(out.contains("+            BinaryName = \"/usr/local/bin/kiwi-runtime\""));
    assert_eq!(read(&cfg), sample("v2.toml"));
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        1,
        "no backup, no temp file"
    );
}

#[test]
fn containerd_install_backs_up_reports_and_is_idempotent() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("config.toml");
    std::fs::write(&cfg, sample("v1.toml")).unwrap();
    let c = cfg.to_str().unwrap();
    let out = install(&["containerd", "--config", c]).unwrap();
    assert!(
        out.contains(&format!(
            "[INFO] Added runtime \"kiwi\" in {c} (backup: {c}.kiwi-backup)."
        )),
        "{out}"
    );
    assert!(out.contains("Restart containerd to use it: systemctl restart containerd"));
    assert_eq!(
        read(&dir.path().join("config.toml.kiwi-backup")),
        sample("v1.toml")
    );
    let installed = read(&cfg);

    let out = install(&["containerd", "--config", c]).unwrap();
    assert!(out.contains("already configured"), "{out}");
    assert_eq!(read(&cfg), installed);
    let out = install(&[
        "containerd",
        "--config",
        c,
        "--runtime-path",
        "/opt/kiwi-runtime",
        "--dry-run",
    ])
    .unwrap();
    assert!(
        out.contains("+        BinaryName = \"/opt/kiwi-runtime\""),
        "{out}"
    );
    let out = install(&[
        "containerd",
        "--config",
        c,
        "--runtime-path",
        "/opt/kiwi-runtime",
    ])
    .unwrap();
    assert!(out.contains("[INFO] Updated runtime \"kiwi\""), "{out}");
    install(&["containerd", "--config", c]).unwrap();
    assert_eq!(read(&cfg), installed);

    let out = uninstall(&["containerd", "--config", c]).unwrap();
    assert!(out.contains("Removed runtime \"kiwi\""), "{out}");
    assert_eq!(read(&cfg), sample("v1.toml"));
    let out = uninstall(&["containerd", "--config", c]).unwrap();
    assert!(out.contains("nothing changed"), "{out}");
}

#[test]
fn containerd_missing_config_is_created_with_version_2() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("etc/containerd/config.toml");
    install(&["containerd", "--config", cfg.to_str().unwrap(), "--cdi"]).unwrap();
    let text = read(&cfg);
    assert!(text.contains("version = 2\n"), "{text}");
    assert!(text.contains("enable_cdi = true"), "{text}");
    assert!(!dir
        .path()
        .join("etc/containerd/config.toml.kiwi-backup")
        .exists());
}

#[test]
fn malformed_files_are_named_with_their_line_and_left_alone() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("config.toml");
    let bad = "version = 2\n\n[plugins.\"io.containerd.grpc.v1.cri\"\n  sandbox_image = \"x\"\n";
    std::fs::write(&cfg, bad).unwrap();
    let err = install(&["containerd", "--config", cfg.to_str().unwrap()]).unwrap_err();
    let msg = err.to_string();
    assert!(msg.starts_with(&cfg.display().to_string()), "{msg}");
    assert!(msg.contains("line 3"), "{msg}");
    assert!(!msg.contains('\n'), "one line: {msg}");
    assert_eq!(read(&cfg), bad);
    assert!(uninstall(&["containerd", "--config", cfg.to_str().unwrap()]).is_err());
    assert_eq!(read(&cfg), bad);

    let json = dir.path().join("daemon.json");
    std::fs::write(&json, "{\n  \"debug\": true,\n}\n").unwrap();
    let msg = install(&["docker", "--config", json.to_str().unwrap()])
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("daemon.json") && msg.contains("line 3"),
        "{msg}"
    );
    assert_eq!(read(&json), "{\n  \"debug\": true,\n}\n");
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 2);
}

#[test]
fn bad_arguments_are_refused() {
    assert!(install(&[
        "containerd",
        "--runtime-name",
        "Kiwi Runtime",
        "--config",
        "/nonexistent/x"
    ])
    .is_err());
    assert!(install(&["podman"]).is_err());
    assert!(install(&["containerd", "--no-such-flag"]).is_err());
}

#[test]
fn host_root_makes_the_import_path_the_hosts() {
    let dir = tempfile::tempdir().unwrap();
    let host = dir.path().join("host");
    let cfg = host.join("etc/containerd/config.toml");
    std::fs::create_dir_all(cfg.parent().unwrap()).unwrap();
    std::fs::write(&cfg, sample("v2.toml")).unwrap();
    let c = cfg.to_str().unwrap();
    let h = host.to_str().unwrap();
    install(&["containerd", "--config", c, "--drop-in", "--host-root", h]).unwrap();
    let text = read(&cfg);
    assert!(
        text.contains("imports = [\"/etc/containerd/conf.d/99-kiwi.toml\"]"),
        "{text}"
    );
    assert!(host.join("etc/containerd/conf.d/99-kiwi.toml").exists());
    let out = install(&["containerd", "--config", c, "--drop-in", "--host-root", h]).unwrap();
    assert!(out.contains("already configured"), "{out}");
    uninstall(&["containerd", "--config", c, "--host-root", h]).unwrap();
    assert_eq!(read(&cfg), sample("v2.toml"));
    assert!(!host.join("etc/containerd/conf.d/99-kiwi.toml").exists());

    let err = install(&[
        "containerd",
        "--config",
        "/etc/containerd/config.toml",
        "--drop-in",
        "--host-root",
        h,
    ])
    .unwrap_err();
    assert!(err.to_string().contains("not under --host-root"), "{err}");
}

#[test]
fn docker_install_set_as_default_and_uninstall_restore_everything() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("daemon.json");
    let original = "{\n  \"default-runtime\": \"nvidia\",\n  \"runtimes\": {\n    \"nvidia\": {\n      \"path\": \"nvidia-container-runtime\",\n      \"runtimeArgs\": []\n    }\n  },\n  \"log-opts\": {\n    \"max-size\": \"10m\"\n  }\n}\n";
    std::fs::write(&cfg, original).unwrap();
    let c = cfg.to_str().unwrap();

    let out = install(&["docker", "--config", c, "--dry-run", "--set-as-default"]).unwrap();
    assert!(
        out.contains("-  \"default-runtime\": \"nvidia\",\n+  \"default-runtime\": \"kiwi\","),
        "{out}"
    );
    assert_eq!(read(&cfg), original);

    let out = install(&["docker", "--config", c, "--set-as-default"]).unwrap();
    assert!(
        out.contains("docker run --runtime kiwi -e KIWI_VISIBLE_DEVICES=0"),
        "{out}"
    );
    let v: serde_json::Value = serde_json::from_str(&read(&cfg)).unwrap();
    assert_eq!(v["runtimes"]["kiwi"]["path"], "/usr/local/bin/kiwi-runtime");
    assert_eq!(v["runtimes"]["nvidia"]["path"], "nvidia-container-runtime");
    assert_eq!(v["default-runtime"], "kiwi");
    assert_eq!(v["log-opts"]["max-size"], "10m");
    assert_eq!(read(&dir.path().join("daemon.json.kiwi-backup")), original);
    assert!(dir.path().join("daemon.json.kiwi-undo").exists());

    let out = install(&["docker", "--config", c, "--set-as-default"]).unwrap();
    assert!(out.contains("already configured"), "{out}");

    uninstall(&["docker", "--config", c]).unwrap();
    assert_eq!(read(&cfg), original);
    assert!(!dir.path().join("daemon.json.kiwi-undo").exists());
}

#[test]
fn docker_missing_file_is_created() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("docker/daemon.json");
    install(&["docker", "--config", cfg.to_str().unwrap()]).unwrap();
    let v: serde_json::Value = serde_json::from_str(&read(&cfg)).unwrap();
    assert_eq!(
        v,
        serde_json::json!({"runtimes": {"kiwi": {"path": "/usr/local/bin/kiwi-runtime"}}})
    );
    uninstall(&["docker", "--config", cfg.to_str().unwrap()]).unwrap();
    assert_eq!(read(&cfg), "{}\n");
}

#[test]
fn a_symlinked_config_is_edited_where_it_points() {
    let dir = tempfile::tempdir().unwrap();
    let real = dir.path().join("managed-config.toml");
    std::fs::write(&real, sample("v2.toml")).unwrap();
    let link = dir.path().join("config.toml");
    std::os::unix::fs::symlink(&real, &link).unwrap();
    install(&["containerd", "--config", link.to_str().unwrap()]).unwrap();
    assert!(std::fs::symlink_metadata(&link)
        .unwrap()
        .file_type()
        .is_symlink());
    assert!(read(&real).contains("runtimes.kiwi]"));
    uninstall(&["containerd", "--config", link.to_str().unwrap()]).unwrap();
    assert_eq!(read(&real), sample("v2.toml"));
}

#[test]
fn the_drop_in_is_rewritten_without_a_backup_in_conf_d() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("config.toml");
    std::fs::write(&cfg, sample("v2.toml")).unwrap();
    let c = cfg.to_str().unwrap();
    install(&["containerd", "--config", c, "--drop-in"]).unwrap();
    // A change to the main CRI section is carried into the drop-in on the next run.
    let edited = read(&cfg).replace("pause:3.9", "pause:3.10");
    std::fs::write(&cfg, &edited).unwrap();
    let out = install(&["containerd", "--config", c, "--drop-in"]).unwrap();
    assert!(out.contains("99-kiwi.toml"), "{out}");
    let drop_in = read(&dir.path().join("conf.d/99-kiwi.toml"));
    assert!(drop_in.contains("pause:3.10"), "{drop_in}");
    let names: Vec<String> = std::fs::read_dir(dir.path().join("conf.d"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
        .collect();
    assert_eq!(names, ["99-kiwi.toml"]);
}
