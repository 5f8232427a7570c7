//! What the gpuburst process tests share: starting gpuburst on a simulated machine
//! and collecting its outcome.

use std::process::{Child, Command, Stdio};

use kiwi_sim_core::harness::SimMachine;

pub const GPUBURST: &str = env!("CARGO_BIN_EXE_gpuburst");

/// gpuburst with `args` on machine `m`, stdout and stderr captured.
pub fn gpuburst(m: &SimMachine, args: &[&str]) -> Child {
    m.apply(&mut Command::new(GPUBURST))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Waits for `c`: (success, exit code, stdout and stderr).
pub fn finish(c: Child) -> (bool, Option<i32>, String) {
    let o = c.wait_with_output().unwrap();
    let t = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    (o.status.success(), o.status.code(), t)
}
