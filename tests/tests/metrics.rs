//! The arbiter's Prometheus endpoint, scraped while real clients move counters.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use kiwi_protocol::{ArbiterMsg, ClientMsg, SwapDirection, Usage};
use kiwi_tests::{register_msg, Arbiter, Client};

const MIB: u64 = 1 << 20;

fn scrape(port: u16) -> String {
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect metrics");
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: kiwi\r\n\r\n")
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    assert!(out.starts_with("HTTP/1.1 200"), "{out}");
    out
}

/// The value of the first sample line starting with `prefix`.
fn value(text: &str, prefix: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(prefix))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no sample {prefix} in\n{text}"))
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[test]
fn counters_move_as_clients_contend() {
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let arb = Arbiter::start(&["--tq", "0.2", "--metrics-addr", &addr]);
    let sock = arb.client_socket();
    let mut reg = register_msg("GPU-m", 1 << 30, 700 * MIB);
    reg.pod_name = Some("nb-a".into());
    reg.pod_namespace = Some("team".into());
    let mut a = Client::register(&sock, reg);
    let mut b = Client::register(&sock, register_msg("GPU-m", 1 << 30, 700 * MIB));

    let before = scrape(port);
    assert_eq!(value(&before, "kiwi_clients{gpu=\"GPU-m\"}"), 2.0);
    assert_eq!(value(&before, "kiwi_scheduler_on{gpu=\"GPU-m\"}"), 1.0);
    assert_eq!(value(&before, "kiwi_tq_seconds{gpu=\"GPU-m\"}"), 0.2);

    a.conn.send(&ClientMsg::Request).unwrap();
    a.wait_for(Duration::from_secs(5), |m| {
        matches!(m, ArbiterMsg::Grant { .. })
    })
    .unwrap();
    a.conn
        .send(&ClientMsg::Usage(Usage {
            working_set_bytes: 700 * MIB,
            resident_bytes: 700 * MIB,
        }))
        .unwrap();
    b.conn.send(&ClientMsg::Request).unwrap();
    let mid = scrape(port);
    assert_eq!(value(&mid, "kiwi_queue_length{gpu=\"GPU-m\"}"), 1.0);
    assert_eq!(
        value(&mid, "kiwi_holder_client{gpu=\"GPU-m\"}"),
        a.id as f64
    );
    assert!(mid.contains("pod=\"nb-a\""), "{mid}");
    // TQ passes: A is dropped, swaps out and releases; B is granted.
    a.wait_for(Duration::from_secs(5), |m| {
        matches!(m, ArbiterMsg::Drop { .. })
    })
    .unwrap();
    a.conn
        .send(&ClientMsg::Swapped {
            direction: SwapDirection::Out,
            bytes: 512 * MIB,
            duration_ns: 20_000_000,
        })
        .unwrap();
    a.conn
        .send(&ClientMsg::Release(Usage {
            working_set_bytes: 700 * MIB,
            resident_bytes: 188 * MIB,
        }))
        .unwrap();
    b.wait_for(Duration::from_secs(5), |m| {
        matches!(m, ArbiterMsg::Grant { .. })
    })
    .unwrap();
    // B gives the GPU back early.
    b.conn.send(&ClientMsg::Release(Usage::default())).unwrap();
    std::thread::sleep(Duration::from_millis(100));

    let after = scrape(port);
    assert_eq!(value(&after, "kiwi_grants_total{gpu=\"GPU-m\"}"), 2.0);
    assert_eq!(value(&after, "kiwi_drops_tq_total{gpu=\"GPU-m\"}"), 1.0);
    assert_eq!(
        value(&after, "kiwi_early_releases_total{gpu=\"GPU-m\"}"),
        1.0
    );
    assert_eq!(
        value(
            &after,
            "kiwi_swap_bytes_total{gpu=\"GPU-m\",direction=\"out\"}"
        ),
        (512 * MIB) as f64
    );
    assert_eq!(
        value(&after, "kiwi_handoff_seconds_count{gpu=\"GPU-m\"}"),
        1.0
    );
    assert_eq!(value(&after, "kiwi_wait_seconds_count{gpu=\"GPU-m\"}"), 2.0);
    assert!(
        value(&after, "kiwi_wait_seconds_sum{gpu=\"GPU-m\"}") > 0.1,
        "B waited for A's TQ"
    );
    let swapped_a = after
        .lines()
        .find(|l| l.starts_with("kiwi_client_swapped_bytes") && l.contains("pod=\"nb-a\""))
        .unwrap();
    assert!(
        swapped_a.ends_with(&format!(" {}", 512 * MIB)),
        "{swapped_a}"
    );
    assert_eq!(value(&after, "kiwi_queue_length{gpu=\"GPU-m\"}"), 0.0);

    // A client that leaves disappears from the per-client series.
    drop(b);
    std::thread::sleep(Duration::from_millis(100));
    let gone = scrape(port);
    assert_eq!(
        gone.matches("kiwi_client_resident_bytes{").count(),
        1,
        "{gone}"
    );
}

#[test]
fn metrics_address_in_use_is_a_clear_error() {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let dir = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(kiwi_tests::bin("kiwi-arbiter"))
        .arg("--socket-dir")
        .arg(dir.path())
        .arg("--metrics-addr")
        .arg(&addr)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cannot serve metrics"), "{err}");
    assert!(
        !kiwi_config::client_socket(dir.path()).exists(),
        "no socket left behind"
    );
}

#[test]
fn forgotten_gpus_leave_no_series_behind() {
    // Without NVML, a GPU entry goes when its last client leaves; its counters must
    // go too, or made-up UUIDs would grow the metrics without bound.
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let arb = Arbiter::start(&["--metrics-addr", &addr]);
    let sock = arb.client_socket();
    for i in 0..20 {
        let uuid = format!("GPU-made-up-{i}");
        let mut c = Client::register(&sock, register_msg(&uuid, 1 << 30, 10 * MIB));
        c.conn.send(&ClientMsg::Request).unwrap();
        c.wait_for(Duration::from_secs(5), |m| {
            matches!(m, ArbiterMsg::Grant { .. })
        });
        assert!(scrape(port).contains(&format!("kiwi_grants_total{{gpu=\"{uuid}\"}}")));
    }
    // The last client's exit is processed after its connection closes.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let text = scrape(port);
        if !text.contains("GPU-made-up-") {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "series of forgotten GPUs remain:\n{}",
            text.lines()
                .filter(|l| l.contains("GPU-made-up-"))
                .collect::<Vec<_>>()
                .join("\n")
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Issue #38, item 2: every connection the arbiter closes is counted by why
/// (`kiwi_client_disconnects_total{reason}`), and the client is told why where a
/// message can still reach it; a client's own close is not counted. Before, a
/// connection whose unread replies passed the cap was closed without a word.
#[test]
fn closed_connections_are_counted_by_reason_and_told_why() {
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let arb = Arbiter::start(&["--metrics-addr", &addr]);
    let gpu = "GPU-38000000-0000-0000-0000-000000000002";
    // Bytes that are no frame: malformed.
    let mut junk = std::os::unix::net::UnixStream::connect(arb.client_socket()).unwrap();
    junk.write_all(b"not a frame at all, no magic here")
        .unwrap();
    let mut reply = Vec::new();
    junk.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let _ = junk.read_to_end(&mut reply);
    assert!(
        String::from_utf8_lossy(&reply).contains("malformed"),
        "the client was not told why: {:?}",
        String::from_utf8_lossy(&reply)
    );
    // A slow reader (a message every 2 ms, as a shim busy swapping) whose 6,000
    // pings, sent at once, are answered faster than it reads: past the 64 KiB cap of
    // unread replies it is closed, and, reading on, hears why before the end.
    let mut slow = Client::register(&arb.client_socket(), register_msg(gpu, 1 << 30, 0));
    let mut pings = Vec::new();
    for token in 0..6_000u64 {
        pings.extend(kiwi_protocol::encode(&ClientMsg::Ping { token }).unwrap());
    }
    let mut raw = slow.conn.stream().try_clone().unwrap();
    let sender = std::thread::spawn(move || {
        let _ = raw.write_all(&pings);
    });
    let mut last = None;
    while let Ok(Some(m)) = slow.conn.recv_timeout(Duration::from_secs(5)) {
        last = Some(m);
        std::thread::sleep(Duration::from_millis(2));
    }
    sender.join().unwrap();
    assert!(
        matches!(&last, Some(ArbiterMsg::Error { message, .. }) if message.contains("unread")),
        "its last message: {last:?}"
    );
    // A client that leaves on its own is not the arbiter's doing.
    drop(Client::register(
        &arb.client_socket(),
        register_msg(gpu, 1 << 30, 0),
    ));
    let mut text = String::new();
    for _ in 0..50 {
        text = scrape(port);
        if text.contains("reason=\"unread_replies\"") && text.contains("reason=\"malformed\"") {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let closed = |reason: &str| {
        value(
            &text,
            &format!("kiwi_client_disconnects_total{{reason=\"{reason}\"}}"),
        )
    };
    assert_eq!(closed("malformed"), 1.0);
    assert_eq!(closed("unread_replies"), 1.0);
    assert!(!text.contains("reason=\"client\""), "{text}");
}
