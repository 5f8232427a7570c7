//! gpuburst's allocation modes and its CUDA IPC pair (issue #38: the soak's clients
//! of every pattern), as real processes under the shim on the simulator with a real
//! `kiwi-arbiter`: memory the application maps itself as PyTorch's
//! `expandable_segments` does (`--alloc vmm`), managed memory (`--alloc managed`), and
//! an exporter and an importer of one `cuMemAlloc` (`--ipc`). Each takes turns with a
//! notebook on a simulated GPU that cannot hold both, so its memory is swapped out
//! and back (the arbiter's log shows it), and verifies every byte after every burst;
//! a corrupted byte fails it with a line saying where.

use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use kiwi_protocol::EventKind;
use kiwi_sim_core::harness::SimMachine;
use kiwi_tests::{bin, finish_within, output_text, wait_until, Arbiter};

const MIB: u64 = 1 << 20;

/// One simulated GPU of `mib` MiB whose contexts take the real 300 MiB.
fn machine(tag: &str, mib: u64) -> SimMachine {
    SimMachine::new(tag, 1, mib * MIB)
        .unwrap_or_else(|e| panic!("{e}"))
        .with_env("KIWI_SIM_CONTEXT_MEMORY", &(300 * MIB).to_string())
}

/// `gpuburst --verify --json` with `args` under the shim on `m`, talking to `arb`.
fn gpuburst(m: &SimMachine, arb: &Arbiter, args: &[&str]) -> Child {
    let mut c = Command::new(bin("gpuburst"));
    m.apply(&mut c)
        .args(args)
        .args(["--verify", "--json"])
        .env("LD_PRELOAD", bin("libkiwi.so"))
        .env("KIWI_SOCKET_DIR", arb.socket_dir())
        .env("KIWI_REQUIRE_ARBITER", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c.spawn().expect("spawn gpuburst")
}

/// Waits for every program of `kids` (each at most `limit`): each must exit 0 having
/// verified every byte (its `verify` event ok); their outputs, in order.
fn all_verified(kids: Vec<(&str, Child)>, limit: Duration) -> Vec<(u32, Output)> {
    let mut failed = Vec::new();
    let mut outs = Vec::new();
    for (name, c) in kids {
        let pid = c.id();
        let (out, hung) = finish_within(c, limit);
        let stdout = String::from_utf8_lossy(&out.stdout);
        let verified = stdout
            .lines()
            .any(|l| l.contains("\"event\":\"verify\"") && l.contains("\"ok\":true"));
        if hung || !out.status.success() || !verified {
            failed.push(format!("{name} (hung {hung}):\n{}", output_text(&out)));
        }
        outs.push((pid, out));
    }
    assert!(failed.is_empty(), "{}", failed.join("\n"));
    outs
}

/// Bytes process `pid` swapped (out, in), from the arbiter's log.
fn swapped(arb: &Arbiter, pid: u32) -> (u64, u64) {
    let events = arb.events();
    let clients: Vec<u64> = events
        .iter()
        .filter_map(|e| match e.kind {
            EventKind::Register { pid: p, .. } if p == pid => e.client,
            _ => None,
        })
        .collect();
    let mut out = (0, 0);
    for e in events
        .iter()
        .filter(|e| e.client.is_some_and(|c| clients.contains(&c)))
    {
        match e.kind {
            EventKind::SwapOut { bytes, .. } => out.0 += bytes,
            EventKind::SwapIn { bytes, .. } => out.1 += bytes,
            _ => {}
        }
    }
    out
}

/// The `ready` event of a finished program.
fn ready(o: &Output) -> serde_json::Value {
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|v| v["event"] == "ready")
        .unwrap_or_else(|| panic!("no ready event: {}", output_text(o)))
}

/// A notebook of `mib` MiB of `cuMemAlloc` memory, 4 bursts with pauses between.
fn notebook(m: &SimMachine, arb: &Arbiter, mib: u64) -> Child {
    gpuburst(
        m,
        arb,
        &[
            "--mem",
            &format!("{mib}MiB"),
            "--bursts",
            "4",
            "--gpu-ms",
            "150",
            "--cpu-ms",
            "200",
            "--name",
            "notebook",
        ],
    )
}

/// A program of `--alloc mode` (500 MiB, then 100 MiB more mid-run) and a notebook
/// of 500 MiB on a 1.5 GiB GPU (two 300 MiB contexts: they do not fit together)
/// take turns: both verify every byte after every burst, and the program's own
/// memory went out and came back.
fn takes_turns_and_verifies(mode: &str) {
    let m = machine(&format!("modes-{mode}"), 1536);
    let arb = Arbiter::start(&["--tq", "0.3"]);
    let app = gpuburst(
        &m,
        &arb,
        &[
            "--alloc",
            mode,
            "--mem",
            "500MiB",
            "--script",
            "gpu:150,cpu:200,grow:100,gpu:150,cpu:200,gpu:150,cpu:200,gpu:150",
            "--name",
            mode,
        ],
    );
    let nb = notebook(&m, &arb, 500);
    let outs = all_verified(
        vec![(mode, app), ("notebook", nb)],
        Duration::from_secs(180),
    );
    let (pid, o) = &outs[0];
    assert_eq!(ready(o)["alloc"], mode, "{}", output_text(o));
    let (out, back) = swapped(&arb, *pid);
    eprintln!("{mode}: {} MiB out, {} MiB in", out >> 20, back >> 20);
    assert!(
        out >= 100 * MIB && back >= 100 * MIB,
        "the {mode} program swapped {} MiB out and {} MiB in: {}",
        out >> 20,
        back >> 20,
        output_text(o)
    );
}

/// PyTorch's `expandable_segments`: one reserved range, 20 MiB handles mapped into it
/// as it grows, kernels across handles.
#[test]
fn an_expandable_segments_program_takes_turns_and_verifies_every_byte() {
    takes_turns_and_verifies("vmm");
}

#[test]
fn a_managed_memory_program_takes_turns_and_verifies_every_byte() {
    takes_turns_and_verifies("managed");
}

/// `--inject-fault` adds to one allocation behind the program's back: each mode
/// exits 3 with one line naming the device, the allocation, how it was allocated and
/// the first wrong word.
#[test]
fn a_corrupted_word_fails_each_mode_saying_where() {
    let m = machine("modes-fault", 1536);
    let arb = Arbiter::start(&["--tq", "0.3"]);
    for (mode, source) in [
        ("device", "cuMemAlloc"),
        ("vmm", "cuMemCreate/cuMemMap"),
        ("managed", "cuMemAllocManaged"),
    ] {
        let c = gpuburst(
            &m,
            &arb,
            &[
                "--alloc",
                mode,
                "--mem",
                "64MiB",
                "--bursts",
                "2",
                "--gpu-ms",
                "20",
                "--inject-fault",
            ],
        );
        let (o, hung) = finish_within(c, Duration::from_secs(60));
        assert!(!hung, "{mode}: {}", output_text(&o));
        assert_eq!(o.status.code(), Some(3), "{mode}: {}", output_text(&o));
        let err = String::from_utf8_lossy(&o.stderr);
        let line = err
            .lines()
            .find(|l| l.contains("verification failed"))
            .unwrap_or_else(|| panic!("{mode}: {}", output_text(&o)));
        for want in [
            "device 0, allocation ",
            source,
            "first wrong word 0 (byte offset 0x0)",
        ] {
            assert!(line.contains(want), "{mode}: no {want:?} in {line}");
        }
    }
}

/// The exporter's FILE with its value changed by one: what an importer that reads
/// other bytes than the exporter wrote would see.
fn with_wrong_value(file: &Path, to: &Path) {
    let line = std::fs::read_to_string(file).unwrap();
    let mut f: Vec<String> = line.split_whitespace().map(String::from).collect();
    let v: u32 = f[3].parse().unwrap();
    f[3] = v.wrapping_add(1).to_string();
    std::fs::write(to, f.join(" ") + "\n").unwrap();
}

/// A CUDA IPC pair and a notebook on a 1.5 GiB GPU with three 300 MiB contexts:
/// the exporter (200 MiB of its own, 32 MiB shared) and the importer (200 MiB of its
/// own, `--alloc vmm`) take turns with the notebook (600 MiB), and their own memory
/// goes out and comes back; the importer checks the exporter's bytes after every
/// burst, the exporter its shared memory too (and once more after the importer
/// closed it). An importer told another value than the exporter wrote fails,
/// naming the imported allocation: it really reads the exporter's bytes.
#[test]
fn an_ipc_pair_takes_turns_with_a_notebook_and_both_verify_the_shared_bytes() {
    let m = machine("modes-ipc", 1536);
    let arb = Arbiter::start(&["--tq", "0.3"]);
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("pair");
    let steps = "gpu:150,cpu:200,gpu:150,cpu:200,gpu:150,cpu:200,gpu:150";
    let export = format!("export:{}", file.display());
    let exporter = gpuburst(
        &m,
        &arb,
        &[
            "--ipc",
            &export,
            "--ipc-mem",
            "32MiB",
            "--mem",
            "200MiB",
            "--script",
            steps,
            "--name",
            "exporter",
        ],
    );
    wait_until("the exporter's FILE", Duration::from_secs(60), || {
        file.exists()
    });
    // An importer of the right handle told a wrong value: exit 3, where.
    let liar = dir.path().join("liar");
    with_wrong_value(&file, &liar);
    let c = gpuburst(
        &m,
        &arb,
        &[
            "--ipc",
            &format!("import:{}", liar.display()),
            "--mem",
            "16MiB",
            "--bursts",
            "1",
            "--gpu-ms",
            "10",
        ],
    );
    let (o, hung) = finish_within(c, Duration::from_secs(60));
    assert!(!hung && o.status.code() == Some(3), "{}", output_text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("cuIpcOpenMemHandle") && err.contains("first wrong word 0"),
        "{}",
        output_text(&o)
    );
    // The real pair, with a notebook.
    let importer = gpuburst(
        &m,
        &arb,
        &[
            "--ipc",
            &format!("import:{}", file.display()),
            "--alloc",
            "vmm",
            "--mem",
            "200MiB",
            "--script",
            steps,
            "--name",
            "importer",
        ],
    );
    // 600 MiB: beside it, the room (636 MiB) leaves less than either side of the
    // pair, so every notebook turn swaps out part of both (a 300 MiB notebook fit
    // beside the exporter, which then never had to swap).
    let nb = notebook(&m, &arb, 600);
    let outs = all_verified(
        vec![
            ("exporter", exporter),
            ("importer", importer),
            ("notebook", nb),
        ],
        Duration::from_secs(180),
    );
    let (ep, eo) = &outs[0];
    let (ip, io) = &outs[1];
    let (e, i) = (ready(eo), ready(io));
    assert_eq!(
        (e["ipc"].as_str(), i["ipc"].as_str()),
        (Some("export"), Some("import"))
    );
    assert_eq!(i["ipc_exporter_pid"], u64::from(*ep), "{}", output_text(io));
    assert_eq!(i["ipc_bytes"], 32 * MIB);
    assert!(
        std::path::PathBuf::from(format!("{}.closed", file.display())).exists(),
        "the importer did not mark its close"
    );
    for (pid, o, who) in [(ep, eo, "exporter"), (ip, io, "importer")] {
        let (out, back) = swapped(&arb, *pid);
        eprintln!("{who}: {} MiB out, {} MiB in", out >> 20, back >> 20);
        assert!(
            out >= 50 * MIB && back >= 50 * MIB,
            "the {who} swapped {} MiB out and {} MiB in: {}",
            out >> 20,
            back >> 20,
            output_text(o)
        );
    }
}
