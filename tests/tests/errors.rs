//! What a person reads when something is wrong: every binary says it in one line,
//! each cause once, with what to do, and a silent arbiter is a timeout, not `EAGAIN`.

use std::os::unix::net::UnixListener;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use kiwi_tests::bin;

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// The error line: the only stderr line, starting with `prefix`, saying its OS cause
/// at most once.
fn one_error_line(o: &Output, prefix: &str) -> String {
    assert!(!o.status.success(), "exited 0: {}", stderr(o));
    let err = stderr(o);
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(lines.len(), 1, "not one line:\n{err}");
    let line = lines[0];
    assert!(line.starts_with(prefix), "{line}");
    assert!(
        line.matches("os error").count() <= 1,
        "cause repeated: {line}"
    );
    line.to_string()
}

fn arbiter(args: &[&str]) -> Output {
    let dir = tempfile::tempdir().unwrap();
    Command::new(bin("kiwi-arbiter"))
        .env_remove("KIWI_CONFIG")
        .args(["--socket-dir", dir.path().to_str().unwrap()])
        .args(args)
        .output()
        .expect("run kiwi-arbiter")
}

#[test]
fn a_missing_config_file_is_one_line_that_says_what_to_do() {
    let line = one_error_line(
        &arbiter(&["--config", "/nonexistent/kiwi.toml"]),
        "kiwi-arbiter: ",
    );
    assert!(line.contains("/nonexistent/kiwi.toml"), "{line}");
    assert!(line.contains("--config or KIWI_CONFIG"), "{line}");

    let o = Command::new(bin("kiwictl"))
        .env("KIWI_CONFIG", "/nonexistent/kiwi.toml")
        .env_remove("KIWI_SOCKET_DIR")
        .arg("status")
        .output()
        .unwrap();
    let line = one_error_line(&o, "[ERROR] ");
    assert!(line.contains("/nonexistent/kiwi.toml"), "{line}");
}

#[test]
fn malformed_toml_is_one_line_naming_file_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.toml");
    // toml's message for a broken table header spans two lines.
    std::fs::write(&path, "socket_dir = \"/tmp\"\n[arbiter\ntq_seconds = 3\n").unwrap();
    let line = one_error_line(
        &arbiter(&["--config", path.to_str().unwrap()]),
        "kiwi-arbiter: ",
    );
    assert!(line.contains("bad.toml, line 2"), "{line}");
}

#[test]
fn an_arbiter_that_never_answers_is_a_timeout_not_eagain() {
    let dir = tempfile::tempdir().unwrap();
    // A control socket that accepts and then says nothing, as an overloaded arbiter.
    let listener = UnixListener::bind(dir.path().join("control.sock")).unwrap();
    let holder = std::thread::spawn(move || {
        let (conn, _) = listener.accept().unwrap();
        std::thread::sleep(Duration::from_secs(15));
        drop(conn);
    });
    let start = Instant::now();
    let o = Command::new(bin("kiwictl"))
        .env_remove("KIWI_CONFIG")
        .env("KIWI_SOCKET_DIR", dir.path())
        .arg("status")
        .output()
        .unwrap();
    let waited = start.elapsed();
    let line = one_error_line(&o, "[ERROR] ");
    assert!(line.contains("no answer within 10.0 s"), "{line}");
    assert!(line.contains("overloaded"), "{line}");
    assert!(!line.contains("temporarily unavailable"), "{line}");
    assert!(!line.contains("os error 11"), "{line}");
    assert!(waited < Duration::from_secs(14), "waited {waited:?}");
    drop(holder);
}

/// An arbiter that cannot bind says its error alone: no `[INFO]` about NVML or its
/// sockets before it (issue #27: an unusable socket directory printed two lines).
#[test]
fn an_arbiter_that_cannot_start_prints_only_its_error() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("a-file");
    std::fs::write(&file, "").unwrap();
    let under_a_file = file.join("kiwi");
    let o = Command::new(bin("kiwi-arbiter"))
        .env_remove("KIWI_CONFIG")
        .args(["--socket-dir", under_a_file.to_str().unwrap()])
        .output()
        .expect("run kiwi-arbiter");
    let line = one_error_line(&o, "kiwi-arbiter: cannot create socket directory");
    assert!(line.contains("Not a directory"), "{line}");

    // Its metrics address unusable: the sockets it had bound are gone again, and one
    // line says why.
    let sockets = tempfile::tempdir().unwrap();
    let o = Command::new(bin("kiwi-arbiter"))
        .env_remove("KIWI_CONFIG")
        .args(["--socket-dir", sockets.path().to_str().unwrap()])
        .args(["--metrics-addr", "127.0.0.1:99999"])
        .output()
        .expect("run kiwi-arbiter");
    let line = one_error_line(&o, "kiwi-arbiter: cannot serve metrics on 127.0.0.1:99999");
    assert!(line.contains("invalid port"), "{line}");
    assert!(!sockets.path().join("client/arbiter.sock").exists());
    assert!(!sockets.path().join("control.sock").exists());
}
