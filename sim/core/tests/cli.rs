//! `kiwi-sim` answers bad input with one clear line and a non-zero exit.

use std::process::Command;

fn kiwi_sim(args: &[&str]) -> (Option<i32>, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_kiwi-sim"))
        .args(args)
        .output()
        .unwrap();
    let t = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    (o.status.code(), t)
}

#[test]
fn bad_commands_fail_with_one_line() {
    for (args, needle) in [
        (&["frobnicate"][..], "unknown command"),
        (
            &["fault", "--gpu", "0", "--name", "nope"],
            "--xid X, --lost or --clear",
        ),
        (&["fault", "--xid", "79", "--name", "nope"], "--gpu"),
        (
            &["fault", "--gpu", "x", "--xid", "1"],
            "--gpu must be a GPU index",
        ),
        (
            &[
                "fault",
                "--gpu",
                "0",
                "--xid",
                "79",
                "--name",
                "no-such-machine-kiwi",
            ],
            "no simulated machine",
        ),
        (&["status", "--name", "../etc"], "invalid machine name"),
        (&["status", "--bogus"], "unexpected argument"),
        (
            &["install-dir", "--profile-dir", "/nonexistent-kiwi"],
            "cargo build --workspace",
        ),
    ] {
        let (code, t) = kiwi_sim(args);
        assert_eq!(code, Some(1), "{args:?}: {t}");
        assert!(t.contains(needle), "{args:?}: {t}");
        assert_eq!(t.trim().lines().count(), 1, "{args:?}: {t}");
    }
}

#[test]
fn status_of_a_machine_nobody_created() {
    let (code, t) = kiwi_sim(&["status", "--json", "--name", "never-created-kiwi"]);
    assert_eq!(code, Some(0), "{t}");
    assert!(t.contains("\"exists\":false"), "{t}");
}
