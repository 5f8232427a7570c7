//! CUDA IPC of the shim's allocations (#13 item 6): `cuIpcGetMemHandle` in one
//! process, `cuIpcOpenMemHandle` in another, on the strict GPU simulator under a real
//! `kiwi-arbiter`, with another program contending for the GPU; and importers and
//! exporters that lie. The driver-API program is `tests/c/ipc.c`.
//!
//! Needs the workspace built (`cargo build --workspace --all-targets`), `gcc`, and
//! `cuda.h` (fetched once by `scripts/fetch-cuda-h.sh`).

mod common;
use common::*;

use std::io::{Read, Write};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kiwi_protocol::EventKind;
use kiwi_sim_core::harness::SimMachine;
use kiwi_tests::Arbiter;

/// `(working set, resident)` of each usage report of process `pid` (arbiter's log).
fn usages(arb: &Arbiter, pid: u32) -> Vec<(u64, u64)> {
    let events = arb.events();
    let clients: Vec<u64> = events
        .iter()
        .filter_map(|e| match e.kind {
            EventKind::Register { pid: p, .. } if p == pid => e.client,
            _ => None,
        })
        .collect();
    events
        .iter()
        .filter(|e| e.client.is_some_and(|c| clients.contains(&c)))
        .filter_map(|e| match e.kind {
            EventKind::Usage {
                working_set_bytes,
                resident_bytes,
            } => Some((working_set_bytes, resident_bytes)),
            _ => None,
        })
        .collect()
}

/// An exporter shares 128 MiB of its `cuMemAlloc` memory with a second process and
/// keeps 256 MiB private; a 700 MiB notebook then takes the 1 GiB GPU from it. The
/// importer opened the shared memory (after every hostile handle failed), and writes
/// into it only after the exporter was swapped out; the exporter then sees exactly
/// those bytes and its private memory intact. Had the shared memory been swapped out
/// (and back in, at new physical memory), the importer's writes would have gone to
/// memory the exporter no longer maps. Once the importer closed it, an 800 MiB
/// notebook swaps the shared memory out too, and it comes back with every byte.
/// Without this change `cuIpcGetMemHandle`
/// failed (`CUDA_ERROR_INVALID_VALUE`: the driver refuses VMM memory).
#[test]
fn cuda_ipc_of_a_shim_allocation_works_and_it_stays_resident_while_open() {
    let dir = tempfile::tempdir().unwrap();
    let Some(exe) = compile("ipc", dir.path()) else {
        return;
    };
    let m = SimMachine::new("ipcshare", 1, 512 << 20).unwrap();
    let t0 = Instant::now();
    let arb = Arbiter::start(&["--tq", "0.2"]);
    let mut e = Command::new(&exe);
    let mut e = Stepped::spawn(under_kiwi_on(e.args(["export", "64", "128"]), &m, &arb));
    e.wait_for("READY");
    let pid = e.child.id();
    eprintln!("ready at {:?}", t0.elapsed());
    let b = notebook(&m, &arb, 300);
    // The private memory goes out for the notebook; the shared memory may not.
    let deadline = Instant::now() + Duration::from_secs(30);
    while swap_outs(&arb, pid).iter().sum::<u64>() < 64 << 20 {
        assert!(
            Instant::now() < deadline,
            "the exporter was never swapped out"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    eprintln!("swapped at {:?}", t0.elapsed());
    e.go();
    e.wait_for("CLOSED");
    eprintln!("closed at {:?}", t0.elapsed());
    let while_open = swap_outs(&arb, pid);
    // Closed by its importer: now it may go too. A notebook that needs all of the
    // GPU makes the exporter give up everything it has.
    let c = notebook(&m, &arb, 400);
    let deadline = Instant::now() + Duration::from_secs(30);
    // Shared, its 64 MiB were reported apart (memory no swap frees); closed, they are
    // in the working set again, and more than the 128 MiB private memory is out.
    let shared_out = |u: &(u64, u64)| u.0 >= 192 << 20 && u.1 + (128 << 20) < u.0;
    while !usages(&arb, pid).iter().any(shared_out) {
        assert!(
            Instant::now() < deadline,
            "the shared memory was never swapped out after it was closed: {:?}",
            usages(&arb, pid)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    eprintln!("swapped again at {:?}", t0.elapsed());
    e.go();
    let (oe, ob, oc) = (e.finish(), finish(b), finish(c));
    assert_eq!(oe.status.code(), Some(0), "{}", text(&oe));
    let out = String::from_utf8_lossy(&oe.stdout);
    assert!(out.contains("OK"), "{}", text(&oe));
    assert_eq!(ob.status.code(), Some(0), "{}", text(&ob));
    assert_eq!(oc.status.code(), Some(0), "{}", text(&oc));
    for line in ["wrong token: 400", "dead exporter: 400", "unknown flag: 1"] {
        assert!(out.contains(line), "no {line:?}: {}", text(&oe));
    }
    eprintln!(
        "exporter's swap-outs while shared: {while_open:?}, all: {:?}",
        swap_outs(&arb, pid)
    );
    assert!(
        while_open.iter().all(|&b| b <= 128 << 20),
        "more than the private memory swapped out at once while shared: {while_open:?}"
    );
}

/// A fake exporter (this test process: the importer checks that the handle's pid
/// answers, and it does) that never answers, or answers with lies: the importer's
/// `cuIpcOpenMemHandle` fails with an error code, within its timeout, every time.
#[test]
fn an_importer_never_hangs_on_a_lying_or_silent_exporter() {
    let dir = tempfile::tempdir().unwrap();
    let Some(exe) = compile("ipc", dir.path()) else {
        return;
    };
    let m = SimMachine::new("ipcliar", 1, 1 << 30).unwrap();
    let arb = Arbiter::start(&[]);
    let broker: u64 = 0x6b69_7769_7465_7374 ^ u64::from(std::process::id());
    let name = format!("kiwi-ipc.{}.{broker:016x}", std::process::id());
    let l =
        UnixListener::bind_addr(&SocketAddr::from_abstract_name(name.as_bytes()).unwrap()).unwrap();
    let mut h = [0u8; 64];
    h[..8].copy_from_slice(b"KIWIIPC1");
    h[8..12].copy_from_slice(&std::process::id().to_le_bytes());
    h[16..24].copy_from_slice(&0x7000_0000_0000u64.to_le_bytes());
    h[24..32].copy_from_slice(&(4u64 << 20).to_le_bytes());
    h[32..48].copy_from_slice(&[7u8; 16]);
    h[48..56].copy_from_slice(&broker.to_le_bytes());
    let hex: String = h.iter().map(|b| format!("{b:02x}")).collect();
    let header = |status: u32, n: u32, total: u64| {
        let mut r = [0u8; 48];
        r[..8].copy_from_slice(b"KIWIREP1");
        r[8..12].copy_from_slice(&status.to_le_bytes());
        r[12..16].copy_from_slice(&n.to_le_bytes());
        r[16..24].copy_from_slice(&0x7000_0000_0000u64.to_le_bytes());
        r[24..32].copy_from_slice(&(4u64 << 20).to_le_bytes());
        r[40..48].copy_from_slice(&total.to_le_bytes());
        r
    };
    // (what the fake exporter does, the error the importer must give)
    type Act = Box<dyn Fn(&mut UnixStream) + Send>;
    let cases: Vec<(&str, Act, i32)> = vec![
        (
            "silent",
            Box::new(|_| std::thread::sleep(Duration::from_secs(3))),
            909,
        ),
        (
            "garbage",
            Box::new(|s| s.write_all(&[0xab; 48]).unwrap()),
            400,
        ),
        (
            "a million segments",
            Box::new(move |s| s.write_all(&header(0, 1 << 20, 1 << 40)).unwrap()),
            400,
        ),
        (
            "a segment without its fd",
            Box::new(move |s| {
                s.write_all(&header(0, 1, 4 << 20)).unwrap();
                s.write_all(&(4u64 << 20).to_le_bytes()).unwrap();
            }),
            400,
        ),
        (
            "a header cut short",
            Box::new(move |s| s.write_all(&header(0, 1, 4 << 20)[..20]).unwrap()),
            400,
        ),
    ];
    for (what, act, want) in cases {
        let l = l.try_clone().unwrap();
        let server = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let mut req = [0u8; 32];
            s.read_exact(&mut req).unwrap();
            act(&mut s);
        });
        let mut c = Command::new(&exe);
        let c = under_kiwi_on(c.args(["open", &hex]), &m, &arb).env("KIWI_IPC_TIMEOUT_MS", "500");
        let t = Instant::now();
        let o = finish(c.spawn().unwrap());
        let took = t.elapsed();
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(
            out.contains(&format!("RESULT {want} ")),
            "{what}: want {want}: {}",
            text(&o)
        );
        assert!(took < Duration::from_secs(10), "{what}: took {took:?}");
        server.join().unwrap();
    }
}

/// An exporter's handle: as the program printed it, its bytes, and its broker's
/// abstract socket name.
struct Exported {
    hex: String,
    bytes: Vec<u8>,
    broker: String,
}

/// `ipc export 8 8` under Kiwi on `m`, once its handle is out and it is ready.
fn exporter(exe: &std::path::Path, m: &SimMachine, arb: &Arbiter) -> (Stepped, Exported) {
    let mut e = Command::new(exe);
    let mut e = Stepped::spawn(under_kiwi_on(e.args(["export", "8", "8"]), m, arb));
    let hex = e
        .wait_for("HANDLE")
        .trim_start_matches("HANDLE ")
        .to_string();
    e.wait_for("READY");
    let bytes: Vec<u8> = (0..64)
        .map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap())
        .collect();
    let pid = u32::from_le_bytes(bytes[8..12].try_into().unwrap());
    let broker = u64::from_le_bytes(bytes[48..56].try_into().unwrap());
    let broker = format!("kiwi-ipc.{pid}.{broker:016x}");
    (e, Exported { hex, bytes, broker })
}

/// Importers that lie to a real exporter's broker (silent connections past its
/// bound, garbage, a wrong token, bytes after the request) are refused or dropped;
/// the exporter goes on serving an honest importer and finishes its own run.
#[test]
fn an_exporter_survives_hostile_importers() {
    let dir = tempfile::tempdir().unwrap();
    let Some(exe) = compile("ipc", dir.path()) else {
        return;
    };
    let m = SimMachine::new("ipchostile", 1, 1 << 30).unwrap();
    let arb = Arbiter::start(&[]);
    let (mut e, x) = exporter(&exe, &m, &arb);
    let (handle, bytes) = (x.hex, x.bytes);
    let addr = SocketAddr::from_abstract_name(x.broker.as_bytes()).unwrap();
    let connect = || UnixStream::connect_addr(&addr).unwrap();
    // Garbage, and a wrong token for the right base: an error reply, then closed.
    let mut wrong_token = bytes.clone();
    wrong_token[32] ^= 1;
    for req in [vec![0x5a; 32], {
        let mut r = b"KIWIREQ1".to_vec();
        r.extend_from_slice(&wrong_token[32..48]);
        r.extend_from_slice(&bytes[16..24]);
        r
    }] {
        let mut s = connect();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        s.write_all(&req).unwrap();
        let mut reply = Vec::new();
        let _ = s.read_to_end(&mut reply);
        assert!(reply.len() <= 48, "{} bytes of reply", reply.len());
    }
    // An honest request followed by a flood: served, then cut off.
    let mut flood = connect();
    let mut req = b"KIWIREQ1".to_vec();
    req.extend_from_slice(&bytes[32..48]);
    req.extend_from_slice(&bytes[16..24]);
    flood.write_all(&req).unwrap();
    flood
        .set_write_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let junk = vec![0u8; 1 << 20];
    let mut cut_off = false;
    for _ in 0..64 {
        if flood.write_all(&junk).is_err() {
            cut_off = true;
            break;
        }
    }
    assert!(cut_off, "the broker read 64 MiB of junk after a request");
    drop(flood);
    // More silent connections than the broker keeps: the extra ones are refused at
    // once, the others dropped at their deadline.
    let mut silent: Vec<UnixStream> = (0..40).map(|_| connect()).collect();
    let mut refused = 0;
    for s in &mut silent {
        s.set_read_timeout(Some(Duration::from_millis(100)))
            .unwrap();
        let mut head = [0u8; 48];
        if s.read_exact(&mut head).is_ok() {
            assert_eq!(&head[..8], b"KIWIREP1");
            assert_eq!(u32::from_le_bytes(head[8..12].try_into().unwrap()), 711);
            refused += 1;
        }
    }
    assert!(refused >= 8, "{refused} of 40 silent connections refused");
    drop(silent);
    // An honest importer while the broker is full of fresh silent connections:
    // refused at first, it asks again with backoff until a place frees (they are
    // dropped at their 500 ms deadline). Before, it failed at once with 711.
    let silent: Vec<UnixStream> = (0..40).map(|_| connect()).collect();
    let mut c = Command::new(&exe);
    let o = finish(
        under_kiwi_on(c.args(["open", &handle]), &m, &arb)
            .spawn()
            .unwrap(),
    );
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("RESULT 0 "),
        "{}",
        text(&o)
    );
    drop(silent);
    // A connect flood (200 more, most refused): the exporting application's stderr
    // gets a few lines, not one per refusal.
    let flood: Vec<UnixStream> = (0..200).map(|_| connect()).collect();
    std::thread::sleep(Duration::from_millis(200));
    drop(flood);
    let refusal_lines = e
        .stderr_text()
        .lines()
        .filter(|l| l.contains("too many importers"))
        .count();
    // 3 per 10 s (a slow run may reach a second window): never one per refusal.
    assert!(
        (1..=9).contains(&refusal_lines),
        "{refusal_lines} refusal lines:\n{}",
        e.stderr_text()
    );
    e.go();
    e.wait_for("CLOSED");
    e.go();
    let oe = e.finish();
    assert_eq!(oe.status.code(), Some(0), "{}", text(&oe));
    assert!(String::from_utf8_lossy(&oe.stdout).contains("OK"));
}

/// Another user's silent connections (issue #27, item 4): a tenant of uid 65534 keeps
/// 40 connections open to an exporter's broker, replacing each one the broker closes
/// at once. The broker keeps at most 8 of one user's connections waiting for their
/// request, so an honest importer of another user is served at once; before, the
/// tenant held all 32 places and the importer waited with backoff for one to free.
#[test]
fn another_users_silent_connections_do_not_keep_an_importer_out() {
    let dir = tempfile::tempdir().unwrap();
    let Some(exe) = compile("ipc", dir.path()) else {
        return;
    };
    let m = SimMachine::new("ipcquota", 1, 1 << 30).unwrap();
    let arb = Arbiter::start(&[]);
    let (mut e, x) = exporter(&exe, &m, &arb);
    let (handle, name) = (x.hex, x.broker);
    let squatter = r#"
import select, socket, sys, time
addr = "\0" + sys.argv[1]
def conn():
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(addr)
    return s
socks = [conn() for _ in range(40)]
print("HOLDING", flush=True)
end = time.time() + 20
while time.time() < end:
    ready, _, _ = select.select(socks, [], [], 0.01)
    for s in ready:  # refused or closed at its deadline: replaced at once
        socks.remove(s)
        s.close()
        socks.append(conn())
"#;
    let mut sq = Command::new("python3");
    sq.args(["-c", squatter, &name])
        .uid(65534)
        .gid(65534)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut sq = Stepped::spawn(&mut sq);
    sq.wait_for("HOLDING");
    std::thread::sleep(Duration::from_millis(100));
    let mut c = Command::new(&exe);
    let o = finish(
        under_kiwi_on(c.args(["open", &handle]), &m, &arb)
            .spawn()
            .unwrap(),
    );
    let _ = sq.child.kill();
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    let took: f64 = out
        .lines()
        .find_map(|l| l.strip_prefix("RESULT 0 in "))
        .and_then(|t| t.trim_end_matches(" s").parse().ok())
        .unwrap_or_else(|| panic!("the open failed: {}", text(&o)));
    assert!(took < 0.5, "the open took {took:.3} s: {}", text(&o));
    e.go();
    e.wait_for("CLOSED");
    e.go();
    let oe = e.finish();
    assert_eq!(oe.status.code(), Some(0), "{}", text(&oe));
}
