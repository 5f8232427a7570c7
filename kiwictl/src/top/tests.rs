//! `top`'s frame: what the tracker makes of reports and events, as text (what
//! `--once` prints) and as ratatui draws it on a screen of a given size.

use kiwi_protocol::{Event, EventKind, StatusReport};
use ratatui::backend::TestBackend;
use ratatui::buffer::Buffer;
use ratatui::style::Modifier;
use ratatui::text::Line;
use ratatui::Terminal;

use super::tracker::Tracker;
use super::view::Screen;

/// A report through serde, so fields added to the protocol later (with
/// defaults) do not break these tests.
fn report(now_ns: u64, queue: &[u64], fits: bool) -> StatusReport {
    let client = |id: u64, state: &str, res: u64, ws: u64| {
        serde_json::json!({
            "id": id, "pid": 100 + id, "host_pid": 200 + id,
            "name": format!("nb-{id}"), "container_id": null,
            "pod_name": "pod", "pod_namespace": "team", "state": state,
            "working_set_bytes": ws, "resident_bytes": res,
            "swapped_bytes": ws - res, "waited_ns": 0, "held_ns": 3_000_000_000u64
        })
    };
    serde_json::from_value(serde_json::json!({
        "default_settings": {"scheduler_on": true, "tq_ms": 10_000},
        "now_ns": now_ns,
        "gpus": [{
            "index": 0, "uuid": "GPU-x",
            "settings": {"scheduler_on": true, "tq_ms": 10_000},
            "total_memory_bytes": 1u64 << 30, "capacity_bytes": 1000u64 << 20,
            "fits": fits, "holders": [1], "queue": queue,
            "clients": [client(1, "holding", 700 << 20, 700 << 20),
                        client(2, if queue.is_empty() { "idle" } else { "waiting" }, 0, 700 << 20)]
        }]
    }))
    .unwrap()
}

fn ev(seq: u64, t_ns: u64, client: u64, kind: EventKind) -> Event {
    Event {
        seq,
        t_ns,
        gpu: "GPU-x".into(),
        client: Some(client),
        kind,
    }
}

fn text(t: &Tracker, r: &StatusReport) -> String {
    t.frame(r, false)
        .iter()
        .map(|l| l.to_string() + "\n")
        .collect()
}

#[test]
fn time_left_counts_from_the_grant_when_someone_waits() {
    let mut t = Tracker::default();
    let grant = ev(
        1,
        1_000_000_000,
        1,
        EventKind::Grant {
            exclusive: true,
            waited_ns: 0,
        },
    );
    let r = report(5_000_000_000, &[2], false);
    t.fold(&r, &[grant], 5_000_000_000);
    let s = text(&t, &r);
    assert!(s.contains("holder #1 nb-1 (team/pod)"), "{s}");
    assert!(s.contains("~6.0s left of its TQ, 1 waiting"), "{s}");
    assert!(s.contains("queue  1. #2 nb-2 (team/pod)"), "{s}");
    assert!(
        s.contains("working sets 1400 MiB (140% of capacity)"),
        "{s}"
    );

    // Nobody waits: no TQ runs.
    let r = report(6_000_000_000, &[], false);
    t.fold(&r, &[], 6_000_000_000);
    assert!(text(&t, &r).contains("no one waits"));

    // Asked to give it back.
    let r = report(12_000_000_000, &[2], false);
    let drop = ev(
        2,
        11_000_000_000,
        1,
        EventKind::Drop {
            need_bytes: 1,
            reason: kiwi_protocol::DropReason::TqExpired,
        },
    );
    t.fold(&r, &[drop], 12_000_000_000);
    assert!(text(&t, &r).contains("TQ over: giving the GPU back"));
}

#[test]
fn swap_rates_come_from_the_events_between_two_refreshes() {
    let mut t = Tracker::default();
    let r = report(1, &[], false);
    t.fold(&r, &[], 1_000_000_000);
    // One refresh: no interval yet, so no rate.
    let s = text(&t, &r);
    let row = s
        .lines()
        .find(|l| l.trim_start().starts_with("1 "))
        .unwrap();
    let tail: Vec<&str> = row.split_whitespace().rev().take(2).collect();
    assert_eq!(tail, ["-", "-"], "{s}");
    let swaps = [
        ev(
            5,
            1_500_000_000,
            1,
            EventKind::SwapOut {
                bytes: 100 << 20,
                duration_ns: 1,
            },
        ),
        ev(
            6,
            1_600_000_000,
            2,
            EventKind::SwapIn {
                bytes: 50 << 20,
                duration_ns: 1,
            },
        ),
    ];
    t.fold(&r, &swaps, 3_000_000_000);
    assert_eq!(t.next_seq, 7);
    let s = text(&t, &r);
    let row = |id: &str| {
        s.lines()
            .find(|l| l.split_whitespace().next() == Some(id))
            .unwrap()
            .to_string()
    };
    assert!(row("1").trim_end().ends_with("0.0      50.0"), "{s}");
    assert!(row("2").trim_end().ends_with("25.0       0.0"), "{s}");
}

#[test]
fn group_members_are_marked_and_the_gpus_turn_says_whose_it_is() {
    let t = Tracker::default();
    let mut r = report(1, &[2], false);
    assert!(!text(&t, &r).contains("group"));
    r.gpus[0].clients[0].group = Some("uid 0 / train".into());
    r.gpus[0].group_turn = Some(kiwi_protocol::GroupTurn {
        group: "uid 0 / train".into(),
        running: true,
    });
    for s in [text(&t, &r), crate::status::render(&r)] {
        let row = s
            .lines()
            .find(|l| l.split_whitespace().next() == Some("1"))
            .unwrap();
        assert!(row.contains("holding*"), "{s}");
        assert!(
            s.contains("turn reserved for group uid 0 / train: its turn runs on all its GPUs"),
            "{s}"
        );
        assert!(
            s.contains("* group uid 0 / train (clients 1 here): granted together"),
            "{s}"
        );
    }
}

#[test]
fn a_checkpointed_client_says_so_and_the_legend_says_what_it_means() {
    let t = Tracker::default();
    let mut r = report(1, &[2], false);
    assert!(!text(&t, &r).contains("ckpt"));
    r.gpus[0].clients[1].checkpointed = true;
    let s = text(&t, &r);
    let row = s
        .lines()
        .find(|l| l.split_whitespace().next() == Some("2"))
        .unwrap();
    assert!(row.contains("wait+ck"), "{s}");
    assert!(s.contains("ckpt: the whole process is checkpointed"), "{s}");
    assert!(crate::status::render(&r).contains("wait+ck"));
}

/// `lines` drawn by ratatui on a `width` × `height` screen, as the live view draws
/// them.
fn draw(lines: &[Line<'_>], width: u16, height: u16) -> Buffer {
    let mut term = Terminal::new(TestBackend::new(width, height)).unwrap();
    term.draw(|f| f.render_widget(Screen(lines), f.area()))
        .unwrap();
    term.backend().buffer().clone()
}

/// The screen's rows as a person reads them, trailing blanks kept.
fn rows(buf: &Buffer) -> Vec<String> {
    let a = buf.area;
    (a.top()..a.bottom())
        .map(|y| {
            (a.left()..a.right())
                .map(|x| buf[(x, y)].symbol())
                .collect()
        })
        .collect()
}

/// The first `width` columns of `line`, blank-padded: what one row shows of it.
fn cut_to(line: &Line<'_>, width: usize) -> String {
    format!(
        "{:<width$}",
        line.to_string().chars().take(width).collect::<String>()
    )
}

#[test]
fn a_tiny_terminal_gets_a_cut_frame() {
    let t = Tracker::default();
    let lines = t.frame(&report(1, &[2], false), true);
    assert!(lines.len() > 3);
    for (w, h) in [(1u16, 1u16), (5, 2), (0, 0), (12, 3), (200, 100)] {
        let shown = rows(&draw(&lines, w, h));
        assert_eq!(shown.len(), h as usize, "{w}x{h}");
        for (i, row) in shown.iter().enumerate() {
            // Row i is line i cut to the width: nothing wraps onto the next row,
            // nothing scrolls the first lines away.
            let want = lines
                .get(i)
                .map_or_else(|| " ".repeat(w as usize), |l| cut_to(l, w as usize));
            assert_eq!(row, &want, "{w}x{h}, row {i}:\n{}", shown.join("\n"));
        }
    }
}

/// Two GPUs: GPU-x oversubscribed, client 1 holding it as a member of a group whose
/// turn runs, client 2 waiting for it; GPU-y free, with an idle client whose name
/// carries an escape sequence.
fn two_gpu_report() -> StatusReport {
    let client = |id: u64, name: &str, state: &str, res: u64, ws: u64, group: Option<&str>| {
        serde_json::json!({
            "id": id, "pid": 100 + id, "host_pid": 200 + id,
            "name": name, "container_id": null,
            "pod_name": format!("pod-{id}"), "pod_namespace": "team", "state": state,
            "working_set_bytes": ws, "resident_bytes": res,
            "swapped_bytes": ws - res, "waited_ns": 2_500_000_000u64,
            "held_ns": 4_000_000_000u64, "group": group
        })
    };
    serde_json::from_value(serde_json::json!({
        "default_settings": {"scheduler_on": true, "tq_ms": 10_000},
        "now_ns": 5_000_000_000u64,
        "gpus": [{
            "index": 0, "uuid": "GPU-x",
            "settings": {"scheduler_on": true, "tq_ms": 10_000},
            "total_memory_bytes": 1u64 << 30, "capacity_bytes": 1000u64 << 20,
            "fits": false, "holders": [1], "queue": [2],
            "group_turn": {"group": "uid 0 / train", "running": true},
            "clients": [
                client(1, "trainer", "holding", 600 << 20, 600 << 20, Some("uid 0 / train")),
                client(2, "nb-bob", "waiting", 0, 700 << 20, None),
            ]
        }, {
            "index": 1, "uuid": "GPU-y",
            "settings": {"scheduler_on": false, "tq_ms": 5_000},
            "total_memory_bytes": 2u64 << 30, "capacity_bytes": 2000u64 << 20,
            "fits": true, "holders": [], "queue": [],
            "clients": [client(3, "evil\u{1b}[2J", "idle", 0, 100 << 20, None)]
        }]
    }))
    .unwrap()
}

#[test]
fn a_frame_drawn_by_ratatui_shows_the_gpus_the_group_mark_and_the_waiter() {
    let mut t = Tracker::default();
    let r = two_gpu_report();
    let grant = ev(
        1,
        1_000_000_000,
        1,
        EventKind::Grant {
            exclusive: true,
            waited_ns: 0,
        },
    );
    t.fold(&r, &[grant], 5_000_000_000);
    let lines = t.frame(&r, true);
    let buf = draw(&lines, 150, 40);
    let shown = rows(&buf);
    let screen = shown.join("\n");
    let find = |what: &str| {
        shown
            .iter()
            .position(|row| row.contains(what))
            .unwrap_or_else(|| panic!("no row with {what:?}:\n{screen}"))
    };
    let client_row = |id: &str| {
        shown
            .iter()
            .find(|row| row.split_whitespace().next() == Some(id))
            .unwrap_or_else(|| panic!("no row for client {id}:\n{screen}"))
    };

    assert!(
        shown[0].starts_with("kiwictl top  2 GPU(s)  3 client(s)   q: quit"),
        "{screen}"
    );
    let gpu0 =
        find("GPU 0  GPU-x  scheduler on  TQ 10 s  capacity 1000 MiB of 1024 MiB  oversubscribed");
    let gpu1 = find(
        "GPU 1  GPU-y  scheduler off  TQ 5 s  capacity 2000 MiB of 2048 MiB  working sets fit",
    );
    assert!(gpu0 < gpu1, "{screen}");

    // GPU-x: the group member holds it, marked; the waiter is queued and says so.
    let holder = find("holder #1 trainer (team/pod-1)");
    assert!(
        shown[holder].contains("held 4.0s  ~6.0s left of its TQ, 1 waiting"),
        "{screen}"
    );
    let queue = find("queue  1. #2 nb-bob (team/pod-2)");
    assert!(gpu0 < holder && holder < queue && queue < gpu1, "{screen}");
    let trainer = client_row("1");
    assert!(
        trainer.contains("trainer") && trainer.contains("holding*"),
        "{trainer}"
    );
    let bob = client_row("2");
    assert!(
        bob.contains("nb-bob") && bob.contains("team/pod-2"),
        "{bob}"
    );
    assert!(bob.contains(" waiting ") && !bob.contains('*'), "{bob}");
    let turn = find("  turn reserved for group uid 0 / train: its turn runs on all its GPUs");
    let legend =
        find("  * group uid 0 / train (clients 1 here): granted together with its other GPUs");
    assert!(gpu0 < turn && turn < legend && legend < gpu1, "{screen}");

    // GPU-y: free; its client's escape sequence shows as text, not as a command.
    assert!(find("  holder -  (the GPU is free)") > gpu1, "{screen}");
    let evil = client_row("3");
    assert!(evil.contains("evil?[2J") && evil.contains("idle"), "{evil}");
    assert!(!screen.contains('\u{1b}'), "{screen}");

    // The header and the table headings are inverse across the whole row; each
    // GPU's line is bold; the rest plain.
    let last = buf.area.right() - 1;
    for y in [0, find("ID     PID NAME") as u16] {
        for x in [0, last] {
            assert!(
                buf[(x, y)].modifier.contains(Modifier::REVERSED),
                "cell ({x}, {y}) not inverse"
            );
        }
    }
    for y in [gpu0, gpu1] {
        assert!(buf[(0, y as u16)].modifier.contains(Modifier::BOLD));
        assert!(!buf[(0, y as u16)].modifier.contains(Modifier::REVERSED));
    }
    assert!(buf[(2, holder as u16)].modifier.is_empty());
}

#[test]
fn a_resized_window_gets_the_frame_drawn_again_at_its_new_size() {
    let t = Tracker::default();
    let lines = t.frame(&two_gpu_report(), true);
    let mut term = Terminal::new(TestBackend::new(150, 40)).unwrap();
    term.draw(|f| f.render_widget(Screen(&lines), f.area()))
        .unwrap();
    assert!(rows(term.backend().buffer())
        .iter()
        .any(|r| r.contains("oversubscribed")));
    // The live loop draws the same lines again on a resize event.
    term.backend_mut().resize(20, 4);
    term.draw(|f| f.render_widget(Screen(&lines), f.area()))
        .unwrap();
    let shown = rows(term.backend().buffer());
    let want: Vec<String> = lines.iter().take(4).map(|l| cut_to(l, 20)).collect();
    assert_eq!(shown, want);
}
