//! Issue #42: tenants that lie to the arbiter about their memory, on the simulator
//! with its NVML and its checkpoint API (the defaults on a driver ≥ 570): what they
//! claim is checked against the driver's per-process figures before it costs any
//! other tenant anything.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kiwi_protocol::blocking::Connection;
use kiwi_protocol::{ArbiterMsg, ClientMsg, EventKind, Usage};
use kiwi_sim_core::harness::SimMachine;
use kiwi_sim_core::ident::gpu_uuid_string;
use kiwi_tests::{bin, finish_within, register_msg, wait_until, Arbiter};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// A simulated 4 GiB GPU whose contexts take the real 300 MiB.
fn machine(tag: &str) -> SimMachine {
    SimMachine::new(tag, 1, 4 * GIB)
        .unwrap_or_else(|e| panic!("{e}"))
        .with_env("KIWI_SIM_CONTEXT_MEMORY", &(300 * MIB).to_string())
}

/// `gpuburst` under the shim on `m`, talking to `arb`.
fn gpuburst(m: &SimMachine, arb: &Arbiter, args: &[&str]) -> Child {
    let mut cmd = Command::new(bin("gpuburst"));
    m.apply(&mut cmd)
        .args(args)
        .env("LD_PRELOAD", bin("libkiwi.so"))
        .env("KIWI_SOCKET_DIR", arb.socket_dir())
        .env("KIWI_REQUIRE_ARBITER", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd.spawn().expect("spawn gpuburst")
}

fn text(o: &std::process::Output) -> String {
    format!(
        "status {:?}\n--- stdout\n{}--- stderr\n{}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn verified(tag: &str, o: &std::process::Output) {
    assert!(o.status.success(), "{tag}: {}", text(o));
}

/// Issue #42, item 2: a client with no GPU memory at all (a protocol client, no
/// context) that claims a 3.7 GiB working set and answers its turn with `no_room`
/// got an idle tenant checkpointed and restored over and over (19 times in 45 s).
/// The driver shows its process holding nothing: nobody is checkpointed for it,
/// the event log says why, and the idle tenant verifies every byte.
#[test]
fn a_client_with_no_gpu_memory_gets_nobody_checkpointed() {
    let m = machine("he-nomem");
    let arb = Arbiter::start_evicting(&["--tq", "1", "--nvml", "auto"], m.env());
    let victim = gpuburst(
        &m,
        &arb,
        &[
            "--mem",
            "200MiB",
            "--script",
            "gpu:100,idle:8000,gpu:100",
            "--verify",
            "--name",
            "victim",
        ],
    );
    wait_until("the victim is registered", Duration::from_secs(20), || {
        arb.status()
            .gpus
            .iter()
            .any(|g| g.clients.iter().any(|c| c.resident_bytes >= 200 * MIB))
    });
    let uuid = gpu_uuid_string(&m.name, 0);
    let ws = 3700 * MIB;
    let mut reg = register_msg(&uuid, m.memory, ws);
    reg.unswappable_bytes = Some(0);
    let mut liar: Connection<ClientMsg, ArbiterMsg> =
        Connection::connect(&arb.client_socket()).unwrap();
    assert!(matches!(
        liar.call(&ClientMsg::Register(reg)).unwrap(),
        ArbiterMsg::Registered { .. }
    ));
    liar.send(&ClientMsg::Request).unwrap();
    // Five seconds of turns answered with `no_room`, as often as the shim says it.
    let end = Instant::now() + Duration::from_secs(5);
    while Instant::now() < end {
        while let Ok(Some(_)) = liar.recv_timeout(Duration::from_millis(1)) {}
        let _ = liar.send(&ClientMsg::Usage(Usage {
            working_set_bytes: ws,
            resident_bytes: 0,
        }));
        let _ = liar.send(&ClientMsg::NoRoom { missing_bytes: ws });
        std::thread::sleep(Duration::from_millis(250));
    }
    let events = arb.events();
    drop(liar);
    let out = finish_within(victim, Duration::from_secs(30));
    let checkpoints = events
        .iter()
        .filter(|e| matches!(e.kind, EventKind::Checkpoint { .. }))
        .count();
    assert_eq!(
        checkpoints, 0,
        "the idle tenant was checkpointed for the liar"
    );
    assert!(
        events.iter().any(|e| matches!(
            &e.kind,
            EventKind::CheckpointSkipped { reason } if reason.contains("no GPU memory")
        )),
        "the log does not say why nobody was checkpointed"
    );
    assert!(!out.1, "the victim hung");
    verified("victim", &out.0);
}

/// A process run without Kiwi that holds `bytes` of the simulated GPU and also
/// registers a client of its own from the same process (so it is no outsider), then
/// changes its usage report every 700 ms: resident 0, then all, and back. Written in
/// Python with ctypes over the simulator's libcuda (`shim/tests/py/simcuda.py`) and
/// the wire protocol's frames.
const FLIPPER: &str = r#"
import ctypes, json, os, socket, struct, sys, time
from simcuda import check, open_context
sock_path, uuid, total, size = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
cu = open_context()
ptr = ctypes.c_uint64()
check(cu.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(size)), "cuMemAlloc")
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(sock_path)
def send(msg):
    b = json.dumps(msg).encode()
    s.sendall(b"KW" + struct.pack(">HI", 1, len(b)) + b)
send({"type": "register", "version": 1, "pid": os.getpid(), "gpu_uuid": uuid,
      "gpu_total_memory": total, "working_set_bytes": size, "resident_bytes": 0,
      "unswappable_bytes": 0})
print("READY", flush=True)
i = 0
while True:
    send({"type": "usage", "working_set_bytes": size, "resident_bytes": size if i % 2 else 0})
    i += 1
    time.sleep(0.7)
"#;

fn flipper(m: &SimMachine, arb: &Arbiter, dir: &Path, bytes: u64) -> Child {
    let script = dir.join("flipper.py");
    std::fs::write(&script, FLIPPER).unwrap();
    let mut cmd = Command::new("python3");
    m.apply(&mut cmd)
        // The driver-API set-up the Python test scripts share.
        .env(
            "PYTHONPATH",
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../shim/tests/py"),
        )
        .arg(&script)
        .arg(arb.client_socket())
        .arg(gpu_uuid_string(&m.name, 0))
        .arg(m.memory.to_string())
        .arg(bytes.to_string())
        .env_remove("LD_PRELOAD")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    let mut c = cmd.spawn().expect("spawn python3");
    let mut line = String::new();
    BufReader::new(c.stdout.as_mut().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line.trim(), "READY", "the flipper did not start");
    c
}

/// Issue #42, item 6: a process outside Kiwi that registers a client from its own
/// process and changes its report every half second escaped the driver's figure
/// (neither `outside_kiwi` nor `unreported`), and a JAX-like newcomer told its 2 GiB
/// as free waited for room until killed. Counted from the driver's figure at what it
/// claimed least, it is memory no swap frees: the newcomer is told the truth, sizes
/// its preallocation from it and verifies every byte.
#[test]
fn a_client_that_flips_its_reports_is_counted_from_the_drivers_figure() {
    let m = machine("he-flip");
    let dir = tempfile::tempdir().unwrap();
    let arb = Arbiter::start_evicting(&["--tq", "1", "--nvml", "auto"], m.env());
    let mut flip = flipper(&m, &arb, dir.path(), 2 * GIB);
    let counted = || {
        arb.events().into_iter().rev().find_map(|e| match e.kind {
            EventKind::Unreported { bytes } => Some(bytes),
            _ => None,
        })
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    while counted().is_none_or(|b| b < 2 * GIB) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    let seen = counted();
    let newcomer = gpuburst(
        &m,
        &arb,
        &[
            "--prealloc",
            "0.75",
            "--mem",
            "200MiB",
            "--bursts",
            "2",
            "--verify",
            "--name",
            "newcomer",
        ],
    );
    let (out, hung) = finish_within(newcomer, Duration::from_secs(40));
    let _ = flip.kill();
    let _ = flip.wait();
    assert!(
        seen.is_some_and(|b| b >= 2 * GIB),
        "the flipper's 2 GiB were not counted: {seen:?}"
    );
    let log: Vec<String> = arb.events().iter().map(|e| format!("{e:?}")).collect();
    assert!(
        !hung,
        "the newcomer hung: {}\n{}",
        text(&out),
        log.join("\n")
    );
    verified("newcomer", &out);
}
