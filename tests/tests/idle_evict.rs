//! Idle eviction and `pressure` (issue #15) against a real `kiwi-arbiter` over its
//! real socket: on an oversubscribed GPU a client that neither holds nor waits and
//! has memory resident is asked to swap all of it out once it has been idle for
//! `idle_evict_seconds` (flag or config key); not when the working sets fit, and not
//! when the setting is 0. `pipelined` clients hear when the GPU becomes
//! oversubscribed. `kiwictl status` shows who is resident and for how long idle.

use std::process::Command;
use std::time::{Duration, Instant};

use kiwi_protocol::{ArbiterMsg, ClientMsg, EventKind, Usage};
use kiwi_tests::{bin, monotonic_ns, register_msg, Arbiter, Client};

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;
const GPU: &str = "GPU-idle-0";

/// A 1 GiB GPU schedules 896 MiB (the reserve is 1/8). B (400 MiB, 200 resident)
/// registers and goes idle; A (`a_mib`) asks and holds, all resident. Returns B, A,
/// and when B last said anything (its registration).
fn idle_b_beside_a(arb: &Arbiter, a_mib: u64) -> (Client, Client, u64) {
    let mut reg = register_msg(GPU, GIB, 400 * MIB);
    reg.resident_bytes = 200 * MIB;
    reg.name = Some("notebook-b".into());
    reg.pipelined = true;
    let b_seen = monotonic_ns();
    let b = Client::register(&arb.client_socket(), reg);
    let mut reg = register_msg(GPU, GIB, a_mib * MIB);
    reg.name = Some("trainer-a".into());
    let mut a = Client::register(&arb.client_socket(), reg);
    a.conn.send(&ClientMsg::Request).unwrap();
    a.wait_for(Duration::from_secs(5), |m| {
        matches!(m, ArbiterMsg::Grant { .. })
    })
    .expect("A is granted");
    a.conn
        .send(&ClientMsg::Usage(Usage {
            working_set_bytes: a_mib * MIB,
            resident_bytes: a_mib * MIB,
        }))
        .unwrap();
    (b, a, b_seen)
}

/// The first `reclaim` B hears within `within`, and when.
fn reclaim(b: &mut Client, within: Duration) -> Option<(u64, u64)> {
    match b.wait_for(within, |m| matches!(m, ArbiterMsg::Reclaim { .. }))? {
        ArbiterMsg::Reclaim { need_bytes } => Some((need_bytes, monotonic_ns())),
        _ => unreachable!(),
    }
}

#[test]
fn an_idle_resident_client_is_asked_to_swap_out_when_oversubscribed() {
    let arb = Arbiter::start(&["--idle-evict-seconds", "0.5"]);
    // 600 + 400 MiB > 896 MiB: oversubscribed. Resident: 600 + 200 fits, so nobody
    // needs a reclaim to make room.
    let (mut b, _a, b_seen) = idle_b_beside_a(&arb, 600);
    let pressure = b.wait_for(Duration::from_secs(2), |m| {
        matches!(m, ArbiterMsg::Pressure { .. })
    });
    assert_eq!(
        pressure,
        Some(ArbiterMsg::Pressure {
            oversubscribed: true,
            idle_evict_ms: 500,
            shared: true,
        }),
        "B registered pipelined: it hears the GPU became oversubscribed, and the delay"
    );
    let (need, at) = reclaim(&mut b, Duration::from_secs(5)).expect("B is evicted");
    assert_eq!(need, 200 * MIB, "all it has resident");
    let idle_ms = (at - b_seen) / 1_000_000;
    assert!(
        (490..3_000).contains(&idle_ms),
        "asked after {idle_ms} ms idle"
    );
    // Logged with its reason; answered in the background.
    let events = arb.events();
    assert!(
        events.iter().any(|e| e.client == Some(b.id)
            && matches!(e.kind, EventKind::Reclaim { need_bytes, idle: true } if need_bytes == 200 * MIB)),
        "{events:#?}"
    );
    b.conn
        .send(&ClientMsg::Reclaimed(Usage {
            working_set_bytes: 400 * MIB,
            resident_bytes: 0,
        }))
        .unwrap();
    // Asked once: nothing more while it stays idle.
    assert!(reclaim(&mut b, Duration::from_millis(800)).is_none());

    // `kiwictl status` shows what is resident where, and since when B is idle.
    let st = arb.status();
    let cb = st.gpus[0].clients.iter().find(|c| c.id == b.id).unwrap();
    assert_eq!((cb.resident_bytes, cb.swapped_bytes), (0, 400 * MIB));
    let idle = cb.idle_since_ns.map(|t| st.now_ns - t);
    assert!(idle.is_some_and(|n| n >= 1_000_000_000), "{cb:?}");
    assert!(cb.idle_since_ns.is_some_and(|t| t >= b_seen), "{cb:?}");
    let o = Command::new(bin("kiwictl"))
        .env_remove("KIWI_CONFIG")
        .env("KIWI_SOCKET_DIR", arb.socket_dir())
        .arg("status")
        .output()
        .expect("run kiwictl");
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{out}");
    assert!(out.contains("IDLE"), "{out}");
    let row = out
        .lines()
        .find(|l| l.contains("notebook-b"))
        .unwrap_or_else(|| panic!("{out}"));
    assert!(
        row.contains("idle") && row.contains("0 MiB") && row.contains("400 MiB"),
        "{row}"
    );
    let json = Command::new(bin("kiwictl"))
        .env_remove("KIWI_CONFIG")
        .env("KIWI_SOCKET_DIR", arb.socket_dir())
        .args(["status", "--json"])
        .output()
        .expect("run kiwictl");
    let v: serde_json::Value = serde_json::from_slice(&json.stdout).expect("status --json");
    let clients = v["gpus"][0]["clients"].as_array().unwrap();
    let jb = clients.iter().find(|c| c["id"] == b.id).unwrap();
    assert_eq!(jb["idle_since_ns"].as_u64(), cb.idle_since_ns, "{jb}");
    let ja = clients.iter().find(|c| c["id"] != b.id).unwrap();
    assert!(
        ja.get("idle_since_ns").is_none(),
        "a holder is not idle: {ja}"
    );
}

#[test]
fn no_idle_eviction_when_the_gpu_fits_or_the_setting_is_0() {
    // Fits: 300 + 400 MiB ≤ 896 MiB.
    let arb = Arbiter::start(&["--idle-evict-seconds", "0.3"]);
    let (mut b, _a, _) = idle_b_beside_a(&arb, 300);
    assert!(arb.status().gpus[0].fits);
    assert!(reclaim(&mut b, Duration::from_millis(1_200)).is_none());
    drop(arb);

    // Oversubscribed, but idle eviction off through the config key (the flag is
    // absent).
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("kiwi.toml");
    std::fs::write(&cfg, "[arbiter]\nidle_evict_seconds = 0\n").unwrap();
    let arb = Arbiter::start(&["--config", cfg.to_str().unwrap()]);
    let (mut b, _a, _) = idle_b_beside_a(&arb, 600);
    assert!(!arb.status().gpus[0].fits);
    let t = Instant::now();
    assert!(reclaim(&mut b, Duration::from_millis(1_200)).is_none());
    assert!(t.elapsed() >= Duration::from_millis(1_000));
    drop(arb);

    // The config key turns it on (0.3 s) where the flag is absent.
    std::fs::write(&cfg, "[arbiter]\nidle_evict_seconds = 0.3\n").unwrap();
    let arb = Arbiter::start(&["--config", cfg.to_str().unwrap()]);
    let (mut b, _a, _) = idle_b_beside_a(&arb, 600);
    assert_eq!(
        reclaim(&mut b, Duration::from_secs(5)).map(|(n, _)| n),
        Some(200 * MIB)
    );
}

#[test]
fn a_bad_idle_evict_setting_is_one_line_and_exit_1() {
    let dir = tempfile::tempdir().unwrap();
    let o = Command::new(bin("kiwi-arbiter"))
        .env_remove("KIWI_CONFIG")
        .args(["--nvml", "off", "--socket-dir"])
        .arg(dir.path())
        .args(["--idle-evict-seconds", "-2"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(err.contains("--idle-evict-seconds"), "{err}");
}
