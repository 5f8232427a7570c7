//! Hand-offs between notebooks (issue #15): the early release of an idle holder on a
//! loaded machine, pipelined hand-offs and cold ones. Real processes on the GPU
//! simulator under a real `kiwi-arbiter`, driver-API programs of `tests/c` built
//! against NVIDIA's `cuda.h`.
//!
//! Needs the workspace built (`cargo build --workspace --all-targets`), `gcc`, and
//! `cuda.h` (fetched once by `scripts/fetch-cuda-h.sh`).

mod common;
use common::*;

use std::process::Command;
use std::time::Duration;

use kiwi_protocol::EventKind;
use kiwi_sim_core::harness::SimMachine;
use kiwi_tests::Arbiter;

/// The tests of this file measure time: one at a time (the first loads every core).
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// What one early release took, from the arbiter's log and the idle program's clock.
struct IdleRelease {
    /// B's grant after A's last work was done, in ms.
    latency_ms: f64,
    /// A's swap-out before its release, in ms.
    swap_ms: f64,
    early: bool,
    /// The holder's releases while the waiter waited, before it went idle.
    releases_before_idle: usize,
    /// The waiter was granted before the holder's release (a pipelined hand-off).
    granted_before_release: bool,
}

/// Measures the release of `holder` (host pid), idle since `idle_at` (its clock), to
/// `waiter`, whose request is already in the log.
fn idle_release(arb: &Arbiter, holder: u32, waiter: u32, idle_at: u64) -> IdleRelease {
    let grant = wait_event(arb, "the waiter's grant", Duration::from_secs(30), |ev| {
        let c = client_of(ev, waiter)?;
        ev.iter()
            .find(|e| {
                e.client == Some(c)
                    && e.t_ns >= idle_at
                    && matches!(e.kind, EventKind::Grant { .. })
            })
            .cloned()
    });
    let ev = arb.events();
    let ch = client_of(&ev, holder).expect("holder registered");
    for e in ev
        .iter()
        .filter(|e| e.t_ns + 500_000_000 >= idle_at && e.seq <= grant.seq)
    {
        eprintln!(
            "  {:+8.1} ms client {:?} {:?}",
            (e.t_ns as f64 - idle_at as f64) / 1e6,
            e.client,
            e.kind
        );
    }
    // A pipelined early release (`drained` first) hands over before its release.
    let release = wait_event(arb, "the holder's release", Duration::from_secs(30), |ev| {
        ev.iter()
            .find(|e| {
                e.client == Some(ch)
                    && e.t_ns >= idle_at
                    && matches!(e.kind, EventKind::Release { .. })
            })
            .cloned()
    });
    let swap_ns: u64 = ev
        .iter()
        .filter(|e| e.client == Some(ch) && e.t_ns >= idle_at && e.seq <= grant.seq)
        .filter_map(|e| match e.kind {
            EventKind::SwapOut { duration_ns, .. } => Some(duration_ns),
            _ => None,
        })
        .sum();
    IdleRelease {
        latency_ms: grant.t_ns.saturating_sub(idle_at) as f64 / 1e6,
        swap_ms: swap_ns as f64 / 1e6,
        early: matches!(release.kind, EventKind::Release { early: true, .. }),
        releases_before_idle: 0,
        granted_before_release: grant.seq < release.seq,
    }
}

/// A holder whose queued work is done releases within `KIWI_IDLE_MS` + 20 ms when
/// another program waits, with both cores kept busy by other processes, and not
/// before its work has been done for `KIWI_IDLE_MS` (issue #15, item 4). A works in
/// bursts that end with an 80 ms kernel, B asks for the GPU and waits, A stops
/// submitting two seconds later: B's grant (arbiter's log) comes `KIWI_IDLE_MS` to
/// `KIWI_IDLE_MS` + 20 ms after A's last work was done (A's own clock, the
/// arbiter's), plus the swap-out A did before releasing (its `swap_out` event). Then
/// the same with the roles swapped. The shim measured idleness from the last
/// submission (the running kernel counted as idle time: released ~80 ms early), gave
/// up whenever its drain took more than 2 ms, looked every 20 ms (socket timeouts
/// that count in scheduler ticks) and pinned ahead on the same thread.
#[test]
fn an_idle_holder_releases_within_idle_ms_on_a_loaded_machine() {
    let idle_ms = 100u64;
    let idle = idle_ms.to_string();
    // Each burst ends with an 80 ms kernel: a shim that counted it as idle time
    // released that much too early. The threshold is fixed at KIWI_IDLE_MS: this test
    // is about the detector's timing under load, not what it learns (see the tests
    // after it).
    let Some((first, second)) = two_idle_releases(Pair {
        tag: "idlerel",
        gpu: 1 << 30,
        args: ["700", "80"],
        env: &[("KIWI_IDLE_MS", &idle), ("KIWI_IDLE_MIN_MS", &idle)],
        busy: true,
    }) else {
        return;
    };
    for (who, r) in [("A → B", &first), ("B → A", &second)] {
        let less_swap = r.latency_ms - r.swap_ms;
        assert!(r.early, "{who}: the release was not early");
        assert!(
            less_swap <= (idle_ms + 20) as f64,
            "{who}: granted {less_swap:.1} ms after the holder went idle (less its swap-out); the bound is {} ms",
            idle_ms + 20,
        );
        // The holder's clock reads its work done a little after it was (it must be
        // scheduled to read it): a few ms of slack.
        assert!(
            less_swap + 10.0 >= idle_ms as f64,
            "{who}: granted {less_swap:.1} ms after the holder went idle (less its swap-out): released before it was idle for {idle_ms} ms"
        );
    }
}

/// A holder that learned its pauses are short releases well before `KIWI_IDLE_MS`
/// (`shim/src/idle.rs`): A works in bursts it synchronizes, resubmitting at once, while
/// B waits; when A stops, B is granted within a fraction of `KIWI_IDLE_MS` (400 ms
/// here) after A's last work, less A's swap-out. A shim with the fixed threshold
/// granted it only after 400 ms.
#[test]
fn a_holder_with_short_pauses_releases_before_idle_ms() {
    let Some((first, second)) = two_idle_releases(Pair::learning("learnshort", &[])) else {
        return;
    };
    for (who, r) in [("A → B", &first), ("B → A", &second)] {
        let less_swap = r.latency_ms - r.swap_ms;
        assert!(r.early, "{who}: the release was not early");
        // Well under 400 ms: 110–157 ms seen, the latter with a build running beside
        // the suite (the holder's tick and the learned threshold's trust both slip
        // under load).
        assert!(
            less_swap < 250.0,
            "{who}: granted {less_swap:.1} ms after the holder went idle (less its swap-out); KIWI_IDLE_MS is 400 and the holder's pauses are short"
        );
    }
}

/// The other side (`shim/src/idle.rs`): a holder that pauses 60 ms on the CPU after
/// each burst, as a training loop that loads its next batch, keeps its turn through
/// those pauses while another waits (the threshold it learns is 4 × 60 ms), and still
/// releases early once it stops. A threshold of `KIWI_IDLE_MIN_MS` would have given
/// the turn away in its first pause.
#[test]
fn a_holder_that_pauses_between_steps_keeps_its_turn_through_them() {
    let Some((first, second)) =
        two_idle_releases(Pair::learning("learnpause", &[("PAUSE_MS", "60")]))
    else {
        return;
    };
    for (who, r) in [("A → B", &first), ("B → A", &second)] {
        assert!(r.early, "{who}: the release was not early");
        assert_eq!(
            r.releases_before_idle, 0,
            "{who}: the holder gave its turn away {} time(s) in a 60 ms pause between its steps",
            r.releases_before_idle
        );
        let less_swap = r.latency_ms - r.swap_ms;
        assert!(
            (200.0..=420.0).contains(&less_swap),
            "{who}: granted {less_swap:.1} ms after the holder went idle (less its swap-out); its pauses of 60 ms make the threshold 240 ms"
        );
    }
}

/// `KIWI_PIPELINED=0` (for measuring a swap alone on the link): the early release
/// says no `drained`, so the waiter is granted only at the release, after the whole
/// swap-out; by default it is granted before it (pipelined).
#[test]
fn without_pipelining_the_waiter_is_granted_at_the_release() {
    for (env, pipelined) in [(&[][..], true), (&[("KIWI_PIPELINED", "0")][..], false)] {
        let Some((first, second)) = two_idle_releases(Pair::learning("nopipe", env)) else {
            return;
        };
        for (who, r) in [("A → B", &first), ("B → A", &second)] {
            assert!(r.early, "{who}: the release was not early");
            assert_eq!(
                r.granted_before_release, pipelined,
                "{who}: {env:?}: granted before the release: {}",
                r.granted_before_release
            );
        }
    }
}

/// Two `idle_holder` programs on one simulated GPU, taking turns (TQ 30 s).
struct Pair<'a> {
    tag: &'a str,
    gpu: u64,
    /// `idle_holder MIB SPIN_MS`.
    args: [&'a str; 2],
    env: &'a [(&'a str, &'a str)],
    /// Every core kept busy by other processes.
    busy: bool,
}

impl<'a> Pair<'a> {
    /// 300 MiB programs on a 512 MiB GPU, `KIWI_IDLE_MS` 400 ms, the threshold learned;
    /// and `env`.
    fn learning(tag: &'a str, env: &'a [(&'a str, &'a str)]) -> Self {
        Pair {
            tag,
            gpu: 512 << 20,
            args: ["300", "20"],
            env,
            busy: false,
        }
    }
}

/// A works while B waits, then stops (B is granted); then the same with the roles
/// swapped. Returns both releases, each with the count of the holder's releases
/// before it went idle (`None`: no C compiler, outside CI).
fn two_idle_releases(p: Pair) -> Option<(IdleRelease, IdleRelease)> {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let exe = compile("idle_holder", dir.path())?;
    let m = SimMachine::new(p.tag, 1, p.gpu).unwrap();
    let arb = Arbiter::start(&["--tq", "30"]);
    let _load = p.busy.then(kiwi_tests::BusyLoad::every_core);
    let spawn = || {
        let mut c = Command::new(&exe);
        c.args(p.args);
        under_kiwi_on(&mut c, &m, &arb);
        if !p.env.iter().any(|(k, _)| *k == "KIWI_IDLE_MS") {
            c.env("KIWI_IDLE_MS", "400");
        }
        c.envs(p.env.iter().copied());
        Stepped::spawn(&mut c)
    };
    let mut a = spawn();
    a.wait_for("RUNNING");
    let mut b = spawn();
    let (pa, pb) = (a.child.id(), b.child.id());
    let req = wait_request(&arb, pb, 0);
    // A works on for two seconds while B waits.
    std::thread::sleep(Duration::from_secs(2));
    a.go();
    let idle_at: u64 = a.wait_for("IDLE ")[5..].parse().expect("IDLE <ns>");
    let mut first = idle_release(&arb, pa, pb, idle_at);
    first.releases_before_idle = releases_between(&arb, pa, req.t_ns, idle_at);
    b.wait_for("RUNNING");
    a.go();
    let req = wait_request(&arb, pa, req.seq);
    std::thread::sleep(Duration::from_secs(2));
    b.go();
    let idle_at: u64 = b.wait_for("IDLE ")[5..].parse().expect("IDLE <ns>");
    let mut second = idle_release(&arb, pb, pa, idle_at);
    second.releases_before_idle = releases_between(&arb, pb, req.t_ns, idle_at);
    let oa = a.finish();
    let ob = b.finish();
    assert_eq!(oa.status.code(), Some(0), "A: {}", text(&oa));
    assert_eq!(ob.status.code(), Some(0), "B: {}", text(&ob));
    for (who, r) in [("A → B", &first), ("B → A", &second)] {
        eprintln!(
            "{who}: granted {:.1} ms after the holder's last work (its swap-out {:.1} ms); early {}; releases before: {}",
            r.latency_ms, r.swap_ms, r.early, r.releases_before_idle
        );
    }
    Some((first, second))
}

/// Releases by `pid` from `from_ns` to `to_ns` (the arbiter's clock).
fn releases_between(arb: &Arbiter, pid: u32, from_ns: u64, to_ns: u64) -> usize {
    let ev = arb.events();
    let Some(c) = client_of(&ev, pid) else {
        return 0;
    };
    ev.iter()
        .filter(|e| {
            e.client == Some(c)
                && e.t_ns > from_ns
                && e.t_ns < to_ns
                && matches!(e.kind, EventKind::Release { .. })
        })
        .count()
}

/// A pipelined hand-off (issue #15, item 3): when the arbiter drops A for B, A says
/// `drained` once its work is done and swaps out segment by segment, freeing each
/// segment's memory as soon as its copy is done; B is granted at once
/// (`grant {pipelined}`) and swaps in as that memory comes free, on the other PCIe
/// direction. Two 700 MiB programs on a 1 GiB GPU (504 MiB must move each way): each
/// hand-off (the drop to the new holder's first kernel, simulator trace) takes at
/// most 1.2 × the longer of the old holder's swap-out alone and the new holder's
/// swap-in alone, both measured in the same run, steady (early releases, where
/// nothing else swaps, after a first round that pinned the buffers). Without
/// pipelining a hand-off is their sum.
///
/// And no swap pays for pinning (item 1): each program's first swap-out ever (cold)
/// takes at most 1.2 × its steady one, because its buffers were pinned in the
/// background once the GPU became oversubscribed (`pressure`), before anyone asked
/// (the test waits for the shim to say so).
/// A shim that pinned them once others waited (or on the swap-out) took ~1.5 × as
/// long (pinning at 0.5 GB/s next to a 2 GB/s link).
///
/// The bounds are on single swaps of a few hundred milliseconds, and on these VMs one
/// swap now and then takes 100–400 ms longer than its neighbours, with nothing in
/// either shim's log to account for it (4 of 14 runs on a quiet machine, then none in
/// 24; once in a local `.ci/run`): a failed run is run once more, never a third time.
/// A shim that pins on the critical path, or does not pipeline, misses the bounds in
/// every run (with `KIWI_PIPELINED=0`: both runs miss).
#[test]
fn hand_offs_pipelined_or_cold_cost_about_one_steady_swap() {
    let _serial = serial();
    if let Err(first) = pipelined_and_cold_hand_offs() {
        eprintln!("the first run missed: {first}; running it once more");
        if let Err(second) = pipelined_and_cold_hand_offs() {
            panic!("{second} (the first run: {first})");
        }
    }
}

/// One run of [`hand_offs_pipelined_or_cold_cost_about_one_steady_swap`]: `Err` says
/// which bound was missed (a broken premise panics).
fn pipelined_and_cold_hand_offs() -> Result<(), String> {
    let dir = tempfile::tempdir().unwrap();
    let Some(exe) = compile("idle_holder", dir.path()) else {
        return Ok(());
    };
    // A slow link (2 GB/s each way): the link, which the simulator models per
    // direction, not the host's memcpy, sets the swaps' pace, as on hardware.
    let m = SimMachine::new("pipeho", 1, 1 << 30)
        .unwrap()
        .with_env("KIWI_SIM_PCIE_GBPS", "2")
        // Page-locking slower than the link: a swap-out that pins its buffers cannot
        // hide it behind its copies.
        .with_env("KIWI_SIM_PIN_GBPS", "0.5");
    let arb = Arbiter::start(&["--tq", "30"]);
    let spawn = |wait: bool| {
        let mut c = Command::new(&exe);
        // Short bursts (1 MiB touched, a 1 ms kernel): a drop drains at once.
        c.args(["700", "1", "1"]);
        if wait {
            c.arg("wait");
        }
        under_kiwi_on(&mut c, &m, &arb)
            .env("KIWI_IDLE_MS", "50")
            // Debug: the test waits for the line that says the pinning ahead is done.
            .env("KIWI_LOG", "debug");
        Stepped::spawn(&mut c)
    };
    // The premise of "no swap pays for pinning": the buffers are pinned before
    // anyone asks. Page-locking takes at least as long as the host takes to fault
    // the pages in (0.5 GB/s modelled here; 64 MiB of fresh memory took 26 to 194 ms
    // to fault in on these VMs), so the test waits for the shim to say it is done
    // rather than for a fixed time.
    let pinned_ahead = |p: &Stepped| p.wait_stderr("pinning ahead done", Duration::from_secs(30));
    let mut a = spawn(false);
    a.wait_for("RUNNING");
    // B allocates (the GPU is oversubscribed from now on) and asks only a second
    // later: A idles as soon as B asks.
    let mut b = spawn(true);
    b.wait_for("ALLOCATED");
    std::thread::sleep(Duration::from_secs(2));
    pinned_ahead(&a);
    b.go();
    let (pa, pb) = (a.child.id(), b.child.id());
    let mut last = wait_request(&arb, pb, 0).seq;
    let ev = arb.events();
    let (ca, cb) = (client_of(&ev, pa).unwrap(), client_of(&ev, pb).unwrap());
    let who = |c: u64| if c == ca { "A" } else { "B" };
    // `holder` idles and releases early while `waiter` waits (it asked already): the
    // holder's swap-out, then the waiter's swap-in, each alone. Returns both (ns) and
    // the seq of the swap-in; the waiter then works, the holder waits for a line.
    let early = |holder: &mut Stepped, ch: u64, cw: u64, after: u64| {
        std::thread::sleep(Duration::from_secs(2));
        pinned_ahead(holder);
        holder.go();
        holder.wait_for("IDLE ");
        let swap_in = wait_event(
            &arb,
            "the waiter's swap-in",
            Duration::from_secs(30),
            |ev| {
                let grant = ev.iter().find(|e| {
                    e.client == Some(cw)
                        && e.seq > after
                        && matches!(e.kind, EventKind::Grant { .. })
                })?;
                ev.iter()
                    .find(|e| {
                        e.client == Some(cw)
                            && e.seq > grant.seq
                            && matches!(e.kind, EventKind::SwapIn { .. })
                    })
                    .cloned()
            },
        );
        let ev = arb.events();
        let out = ev
            .iter()
            .filter(|e| e.client == Some(ch) && e.seq > after && e.seq < swap_in.seq)
            .find_map(|e| match e.kind {
                EventKind::SwapOut { duration_ns, .. } => Some(duration_ns),
                _ => None,
            })
            .expect("the holder swapped out");
        let EventKind::SwapIn { duration_ns, .. } = swap_in.kind else {
            unreachable!()
        };
        eprintln!(
            "alone: {}'s swap-out {:.1} ms, {}'s swap-in {:.1} ms",
            who(ch),
            out as f64 / 1e6,
            who(cw),
            duration_ns as f64 / 1e6
        );
        (out, duration_ns, swap_in.seq)
    };
    // A → B (B has nothing to swap in yet), B → A (the first swaps: buffers pinned),
    // A → B, B → A (steady).
    a.go();
    a.wait_for("IDLE ");
    b.wait_for("RUNNING");
    a.go();
    last = wait_request(&arb, pa, last).seq;
    let (_, _, s) = early(&mut b, cb, ca, last);
    b.go();
    last = wait_request(&arb, pb, s).seq;
    let (a_out, b_in, s) = early(&mut a, ca, cb, last);
    a.go();
    last = wait_request(&arb, pa, s).seq;
    let (b_out, a_in, s) = early(&mut b, cb, ca, last);
    // The first swap-out of each (cold) against its steady one.
    let ev = arb.events();
    let first_out = |c: u64| {
        ev.iter()
            .find_map(|e| match e.kind {
                EventKind::SwapOut { duration_ns, .. } if e.client == Some(c) => Some(duration_ns),
                _ => None,
            })
            .expect("a swap-out")
    };
    let cold = [("A", first_out(ca), a_out), ("B", first_out(cb), b_out)];
    // B works again and asks; a quantum shorter than A has held drops A (A → B), and
    // once B has held a while, B (B → A): pipelined hand-offs.
    b.go();
    last = wait_request(&arb, pb, s).seq;
    let mut c = arb.control();
    let mut set_tq = |tq_ms| {
        let r = c
            .call(&kiwi_protocol::ControlRequest::SetTq { tq_ms, gpu: None })
            .expect("set tq");
        assert!(
            matches!(r, kiwi_protocol::ControlReply::Done { .. }),
            "{r:?}"
        );
    };
    let mut hand_off = |from: u64, to: u64, after: u64| {
        std::thread::sleep(Duration::from_millis(1500));
        set_tq(1000);
        let swapped = wait_event(
            &arb,
            "the swap-in after a drop",
            Duration::from_secs(30),
            |ev| {
                let drop = ev.iter().find(|e| {
                    e.client == Some(from)
                        && e.seq > after
                        && matches!(e.kind, EventKind::Drop { .. })
                })?;
                ev.iter()
                    .find(|e| {
                        e.client == Some(to)
                            && e.seq > drop.seq
                            && matches!(e.kind, EventKind::SwapIn { .. })
                    })
                    .cloned()
            },
        );
        set_tq(30_000);
        swapped.seq
    };
    let first = hand_off(ca, cb, last);
    hand_off(cb, ca, first);
    let oa = a.finish();
    let ob = b.finish();
    assert_eq!(oa.status.code(), Some(0), "A: {}", text(&oa));
    assert_eq!(ob.status.code(), Some(0), "B: {}", text(&ob));
    // Every check is made; on a failure both programs' logs (debug) and the
    // arbiter's events of the hand-offs are printed: what a slow swap was doing.
    let mut failed = Vec::new();
    for (name, cold, steady) in cold {
        let (cold, steady) = (cold as f64 / 1e6, steady as f64 / 1e6);
        eprintln!("{name}: first swap-out {cold:.1} ms, steady {steady:.1} ms");
        if cold > 1.2 * steady {
            failed.push(format!(
                "{name}'s first swap-out took {cold:.1} ms, its steady one {steady:.1} ms: more than 1.2 ×"
            ));
        }
    }
    let ev = arb.events();
    let trace = m.read_trace();
    for (from, to, to_pid, after, alone) in [
        (ca, cb, pb, last, a_out.max(b_in)),
        (cb, ca, pa, first, b_out.max(a_in)),
    ] {
        let find = |client: u64, after: u64, f: &dyn Fn(&EventKind) -> bool| {
            ev.iter()
                .find(|e| e.client == Some(client) && e.seq > after && f(&e.kind))
                .unwrap_or_else(|| panic!("an event of client {client} is missing: {ev:#?}"))
        };
        let drop = find(from, after, &|k| matches!(k, EventKind::Drop { .. }));
        let grant = find(to, drop.seq, &|k| matches!(k, EventKind::Grant { .. }));
        let release = find(from, drop.seq, &|k| matches!(k, EventKind::Release { .. }));
        let first_kernel = trace
            .iter()
            .filter(|r| r.pid == to_pid && r.start_ns >= grant.t_ns)
            .map(|r| r.start_ns)
            .min()
            .expect("a kernel after the grant");
        let handoff_ms = (first_kernel - drop.t_ns) as f64 / 1e6;
        let alone_ms = alone as f64 / 1e6;
        let name = format!("{} → {}", who(from), who(to));
        eprintln!(
            "hand-off {name}: {handoff_ms:.1} ms from the drop to the first kernel; granted {:.1} ms after the drop, released {:.1} ms after it; the longer swap alone {alone_ms:.1} ms",
            (grant.t_ns - drop.t_ns) as f64 / 1e6,
            (release.t_ns - drop.t_ns) as f64 / 1e6,
        );
        if grant.seq > release.seq {
            failed.push(format!(
                "{name} was not pipelined: granted after the release"
            ));
        }
        if handoff_ms > 1.2 * alone_ms {
            failed.push(format!(
                "{name} took {handoff_ms:.1} ms; 1.2 × the longer swap alone is {:.1} ms",
                1.2 * alone_ms
            ));
        }
    }
    if !failed.is_empty() || std::env::var_os("HLOG").is_some() {
        eprintln!("A: {}\nB: {}", text(&oa), text(&ob));
        for e in ev
            .iter()
            .filter(|e| e.seq > last && !matches!(e.kind, EventKind::Usage { .. }))
        {
            eprintln!("EV {} {:?} {:?}", e.t_ns / 1000, e.client, e.kind);
        }
    }
    if failed.is_empty() {
        Ok(())
    } else {
        Err(failed.join("; "))
    }
}

/// Idle eviction of a holder (issue #15 item 2): B holds the GPU alone, goes idle on
/// an oversubscribed GPU, and nobody waits. Past the arbiter's idle eviction delay it
/// gives the GPU back with everything swapped out, before anyone asks; A, asking
/// later, is granted at once and pays only its own swap-in. (Without it, B held the
/// GPU until A asked, and only then released and swapped out.)
#[test]
fn an_idle_lone_holder_swaps_out_before_anyone_asks() {
    let _serial = serial();
    let m = SimMachine::new("idle-holder", 1, 1 << 30).unwrap();
    let arb = Arbiter::start(&["--tq", "5", "--idle-evict-seconds", "0.5"]);
    let burst = |script: &str| {
        let mut c = Command::new(kiwi_tests::bin("gpuburst"));
        c.args(["--mem", "600MiB", "--verify", "--json", "--script", script]);
        c
    };
    // A fills its memory and idles 3 s; B starts once A is ready, fills (A releases
    // early for it), works 100 ms and idles 3 s as the lone holder.
    let mut a = burst("idle:3000,gpu:100");
    let mut a = Stepped::spawn(under_kiwi_on(&mut a, &m, &arb));
    a.wait_for("{\"event\":\"ready\"");
    let mut b = burst("gpu:100,idle:3000");
    let b = under_kiwi_on(&mut b, &m, &arb).spawn().expect("spawn B");
    let (pa, pb) = (a.child.id(), b.id());
    let oa = a.finish();
    let ob = finish(b);
    assert_eq!(oa.status.code(), Some(0), "A\n{}", text(&oa));
    assert_eq!(ob.status.code(), Some(0), "B\n{}", text(&ob));
    let ev = arb.events();
    let (ca, cb) = (client_of(&ev, pa).unwrap(), client_of(&ev, pb).unwrap());
    let b_granted = ev
        .iter()
        .find(|e| e.client == Some(cb) && matches!(e.kind, EventKind::Grant { .. }))
        .expect("B granted")
        .t_ns;
    // A's request for its burst: its last one.
    let a_request = ev
        .iter()
        .rev()
        .find(|e| e.client == Some(ca) && matches!(e.kind, EventKind::Request))
        .expect("A asked")
        .t_ns;
    assert!(a_request > b_granted, "A asked again after B got the GPU");
    let b_release = ev
        .iter()
        .find(|e| {
            e.client == Some(cb)
                && e.t_ns > b_granted
                && matches!(e.kind, EventKind::Release { .. })
        })
        .expect("B released");
    assert!(
        b_release.t_ns < a_request,
        "B held the GPU until A asked: {:.0} ms after A's request",
        (b_release.t_ns - a_request) as f64 / 1e6
    );
    assert!(
        matches!(
            b_release.kind,
            EventKind::Release {
                early: true,
                resident_bytes: 0
            }
        ),
        "B gave it back with everything swapped out: {:?}",
        b_release.kind
    );
    let a_grant = ev
        .iter()
        .find(|e| {
            e.client == Some(ca) && e.t_ns >= a_request && matches!(e.kind, EventKind::Grant { .. })
        })
        .expect("A granted")
        .t_ns;
    let waited_ms = (a_grant - a_request) as f64 / 1e6;
    assert!(
        waited_ms < 50.0,
        "A waited {waited_ms:.1} ms for a GPU nobody held"
    );
}
