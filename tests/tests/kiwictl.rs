//! kiwictl against a real arbiter: control commands, status, and refused input; and
//! the environment `kiwictl run` gives its program.

use std::process::{Command, Output};

use kiwi_protocol::ClientMsg;
use kiwi_tests::{bin, register_msg, Arbiter, Client};

const MIB: u64 = 1 << 20;

fn kiwictl(arb: Option<&Arbiter>, args: &[&str]) -> Output {
    let mut c = Command::new(bin("kiwictl"));
    c.env_remove("KIWI_CONFIG").env_remove("KIWI_SOCKET_DIR");
    if let Some(a) = arb {
        c.env("KIWI_SOCKET_DIR", a.socket_dir());
    }
    c.args(args).output().expect("run kiwictl")
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

#[test]
fn bad_arguments_are_refused() {
    for args in [
        &["-T", "0"][..],
        &["-T", "-3"],
        &["-T", "abc"],
        &["-S", "maybe"],
        &["--tq=nan"],
    ] {
        let o = kiwictl(None, args);
        assert!(!o.status.success(), "{args:?} accepted");
        let t = text(&o);
        assert!(
            t.contains("TQ must be") || t.contains("expected \"on\" or \"off\""),
            "{args:?}: {t}"
        );
    }
}

#[test]
fn unreachable_arbiter_is_one_clear_line() {
    let dir = tempfile::tempdir().unwrap();
    let o = Command::new(bin("kiwictl"))
        .env_remove("KIWI_CONFIG")
        .arg("--socket-dir")
        .arg(dir.path())
        .arg("status")
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("cannot reach the arbiter"), "{err}");
}

#[test]
fn scheduler_and_tq_change_a_running_arbiter() {
    let arb = Arbiter::start(&["--tq", "30"]);
    let mut c = Client::register(
        &arb.client_socket(),
        register_msg("GPU-aaaa", 1 << 30, 700 * MIB),
    );
    c.conn.send(&ClientMsg::Request).unwrap();

    let o = kiwictl(Some(&arb), &["-S", "off"]);
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(
        String::from_utf8_lossy(&o.stdout).trim(),
        "[INFO] Successfully turned off the Kiwi scheduler."
    );
    let o = kiwictl(Some(&arb), &["-T", "2.5", "--gpu", "0"]);
    assert!(o.status.success(), "{}", text(&o));
    let st = arb.status();
    assert!(!st.gpus[0].settings.scheduler_on);
    assert_eq!(st.gpus[0].settings.tq_ms, 2500);
    assert!(
        !st.default_settings.scheduler_on,
        "-S without --gpu also sets the default"
    );
    assert_eq!(
        st.default_settings.tq_ms, 30_000,
        "-T with --gpu leaves the default"
    );

    let o = kiwictl(Some(&arb), &["-S", "on", "--gpu", "GPU-nope"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(text(&o).contains("no GPU \"GPU-nope\""), "{}", text(&o));

    let o = kiwictl(Some(&arb), &["--scheduler", "on"]);
    assert!(o.status.success());
    assert!(arb.status().gpus[0].settings.scheduler_on);

    // Status: the human table and JSON.
    let o = kiwictl(Some(&arb), &["status"]);
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    assert!(t.contains("GPU 0  GPU-aaaa  scheduler on  TQ 2.5 s"), "{t}");
    assert!(t.contains("running"), "{t}");
    let o = kiwictl(Some(&arb), &["status", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("status --json is JSON");
    assert_eq!(v["gpus"][0]["uuid"], "GPU-aaaa");
    assert_eq!(v["gpus"][0]["clients"][0]["state"], "running");
    assert_eq!(v["gpus"][0]["clients"][0]["host_pid"], std::process::id());

    // The event log is readable: register, request, grant, scheduler changes.
    let o = kiwictl(Some(&arb), &["events"]);
    let kinds: Vec<String> = String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            v["kind"]["event"].as_str().unwrap().to_string()
        })
        .collect();
    for k in ["register", "request", "grant", "scheduler", "tq"] {
        assert!(kinds.iter().any(|x| x == k), "{k} missing from {kinds:?}");
    }
}

#[test]
fn install_and_uninstall_through_kiwictl() {
    let dir = tempfile::tempdir().unwrap();
    let daemon = dir.path().join("daemon.json");
    let original = "{\n  \"log-level\": \"warn\",\n  \"runtimes\": {\"nvidia\": {\"path\": \"nvidia-container-runtime\"}}\n}\n";
    std::fs::write(&daemon, original).unwrap();
    let d = daemon.to_str().unwrap();
    let o = kiwictl(None, &["install", "docker", "--config", d]);
    assert!(o.status.success(), "{}", text(&o));
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&daemon).unwrap()).unwrap();
    assert_eq!(v["runtimes"]["kiwi"]["path"], "/usr/local/bin/kiwi-runtime");
    assert_eq!(v["runtimes"]["nvidia"]["path"], "nvidia-container-runtime");
    assert_eq!(v["log-level"], "warn");
    let o = kiwictl(None, &["uninstall", "docker", "--config", d]);
    assert!(o.status.success(), "{}", text(&o));
    // Same content (docker's JSON is re-indented, every key and value kept).
    let back: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&daemon).unwrap()).unwrap();
    assert_eq!(
        back,
        serde_json::from_str::<serde_json::Value>(original).unwrap()
    );

    // containerd, from an empty file; malformed input is refused with file and line.
    let cfg = dir.path().join("config.toml");
    std::fs::write(&cfg, "version = 2\n[plugins\n").unwrap();
    let o = kiwictl(
        None,
        &["install", "containerd", "--config", cfg.to_str().unwrap()],
    );
    assert!(!o.status.success());
    assert!(text(&o).contains("config.toml"), "{}", text(&o));
    assert_eq!(
        std::fs::read_to_string(&cfg).unwrap(),
        "version = 2\n[plugins\n"
    );
}

/// `kiwictl run -- sh -c 'echo $XLA_PYTHON_CLIENT_PREALLOCATE $TF_FORCE_GPU_ALLOW_GROWTH'`
/// with `config` as the config file and `env` added to kiwictl's environment. No arbiter
/// is needed (kiwictl only warns); the shim is a stand-in file, which the loader skips
/// with a line on stderr, so `sh` runs without it.
fn run_echo_framework_env(config: &str, env: &[(&str, &str)]) -> Output {
    run_sh(
        config,
        env,
        "echo $XLA_PYTHON_CLIENT_PREALLOCATE $TF_FORCE_GPU_ALLOW_GROWTH",
    )
}

/// `kiwictl run -- sh -c SCRIPT`, as [`run_echo_framework_env`].
fn run_sh(config: &str, env: &[(&str, &str)], script: &str) -> Output {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("kiwi.toml");
    std::fs::write(&cfg, config).unwrap();
    let shim = dir.path().join("libkiwi.so");
    std::fs::write(&shim, "not a library").unwrap();
    let mut c = Command::new(bin("kiwictl"));
    c.env("KIWI_CONFIG", &cfg)
        .env_remove("KIWI_SOCKET_DIR")
        .env_remove("KIWI_SHIM")
        .env_remove("LD_PRELOAD")
        .env_remove("XLA_PYTHON_CLIENT_PREALLOCATE")
        .env_remove("TF_FORCE_GPU_ALLOW_GROWTH")
        .env_remove("KIWI_GROUP")
        .envs(env.iter().copied())
        .arg("--socket-dir")
        .arg(dir.path())
        .args(["run", "--shim"])
        .arg(&shim)
        .args(["--", "sh", "-c", script]);
    c.output().expect("run kiwictl")
}

#[test]
fn run_makes_its_processes_one_group_unless_the_caller_names_one() {
    let line = |env: &[(&str, &str)]| {
        let o = run_sh("", env, "echo \"$KIWI_GROUP|$$\"");
        assert!(o.status.success(), "{}", text(&o));
        let out = String::from_utf8_lossy(&o.stdout).trim_end().to_string();
        let (group, pid) = out.split_once('|').expect("group|pid");
        (group.to_string(), pid.to_string())
    };
    // The program keeps kiwictl's pid (exec): the group is named after it.
    let (group, pid) = line(&[]);
    assert_eq!(group, format!("kiwictl run {pid}"));
    assert_eq!(line(&[("KIWI_GROUP", "train")]).0, "train");
    assert_eq!(line(&[("KIWI_GROUP", "")]).0, "");
}

#[test]
fn run_tells_frameworks_not_to_hoard_unless_the_caller_says_otherwise() {
    let stdout = |o: &Output| {
        assert!(o.status.success(), "{}", text(o));
        String::from_utf8_lossy(&o.stdout).into_owned()
    };
    // Defaults: JAX does not preallocate, TensorFlow grows.
    let o = run_echo_framework_env("", &[]);
    assert_eq!(stdout(&o), "false true\n");
    // The caller's value wins and is the only one the program sees.
    let o = run_echo_framework_env("", &[("XLA_PYTHON_CLIENT_PREALLOCATE", "true")]);
    assert_eq!(stdout(&o), "true true\n");
    let o = run_echo_framework_env(
        "[hook]\nframework_defaults = true\n",
        &[("TF_FORCE_GPU_ALLOW_GROWTH", "false")],
    );
    assert_eq!(stdout(&o), "false false\n");
    // Turned off in the config file: nothing set.
    let o = run_echo_framework_env("[hook]\nframework_defaults = false\n", &[]);
    assert_eq!(stdout(&o), "\n");
    // A value that is not a bool: one line naming the file and the line; nothing runs.
    let o = run_echo_framework_env("[hook]\nframework_defaults = \"no\"\n", &[]);
    assert_eq!(o.status.code(), Some(1));
    assert!(o.stdout.is_empty(), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.starts_with("[ERROR] config file ") && err.contains("kiwi.toml, line 2: "),
        "{err}"
    );
}
