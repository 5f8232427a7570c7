//! `kiwictl top` in a real terminal: tmux runs it in a shell against a private
//! arbiter with protocol-level clients; `capture-pane` reads the screen as a person
//! would see it. Covers the frame, a change on the next refresh, the swap rate,
//! `q`, Ctrl-C, a tiny window, a lost arbiter, and the terminal given back intact.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use kiwi_protocol::{ArbiterMsg, ClientMsg, SwapDirection, Usage};
use kiwi_tests::{bin, register_msg, require_tool, Arbiter, Client};

const MIB: u64 = 1 << 20;

/// A tmux server of its own (private socket) with one session running `sh`.
struct Tmux {
    dir: tempfile::TempDir,
}

impl Tmux {
    fn start(socket_dir: &Path, width: u32, height: u32) -> Tmux {
        let dir = tempfile::tempdir().unwrap();
        let t = Tmux { dir };
        let o = t
            .cmd_with(|c| {
                c.env_remove("KIWI_CONFIG")
                    .env("KIWI_SOCKET_DIR", socket_dir)
                    .env("PS1", "test-prompt$ ")
                    .env("ENV", "/dev/null");
            })
            .args(["-f", "/dev/null", "new-session", "-d", "-s", "top", "-x"])
            .arg(width.to_string())
            .arg("-y")
            .arg(height.to_string())
            .arg("sh")
            .output()
            .expect("run tmux");
        assert!(o.status.success(), "tmux new-session: {}", text(&o));
        // dash ignores PS1 from the environment when run as root.
        t.type_line("PS1='test-prompt$ '; clear");
        t
    }

    fn cmd_with(&self, f: impl FnOnce(&mut Command)) -> Command {
        let mut c = Command::new("tmux");
        c.arg("-S").arg(self.socket());
        f(&mut c);
        c
    }

    fn socket(&self) -> PathBuf {
        self.dir.path().join("tmux.sock")
    }

    fn run(&self, args: &[&str]) -> String {
        let o = self.cmd_with(|_| {}).args(args).output().expect("tmux");
        assert!(o.status.success(), "tmux {args:?}: {}", text(&o));
        String::from_utf8_lossy(&o.stdout).to_string()
    }

    /// Types a line into the shell.
    fn type_line(&self, line: &str) {
        self.run(&["send-keys", "-t", "top", "-l", line]);
        self.run(&["send-keys", "-t", "top", "Enter"]);
    }

    fn screen(&self) -> String {
        self.run(&["capture-pane", "-p", "-t", "top"])
    }

    fn var(&self, name: &str) -> String {
        self.run(&[
            "display-message",
            "-p",
            "-t",
            "top",
            &format!("#{{{name}}}"),
        ])
        .trim()
        .to_string()
    }

    /// Polls the screen until `pred` holds; panics with the screen after 10 s.
    fn wait_screen(&self, what: &str, pred: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let s = self.screen();
            if pred(&s) {
                return s;
            }
            if Instant::now() > deadline {
                panic!("timed out waiting for {what}; the screen:\n{s}");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = self
            .cmd_with(|_| {})
            .arg("kill-server")
            .stderr(std::process::Stdio::null())
            .status();
    }
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// The row of client `id` in the client table.
fn row(screen: &str, id: u64) -> Option<String> {
    screen
        .lines()
        .find(|l| l.split_whitespace().next() == Some(&id.to_string()))
        .map(str::to_string)
}

fn client(arb: &Arbiter, name: &str, pod: &str) -> Client {
    let mut reg = register_msg("GPU-top", 1 << 30, 700 * MIB);
    reg.name = Some(name.into());
    reg.pod_name = Some(pod.into());
    reg.pod_namespace = Some("team".into());
    Client::register(&arb.client_socket(), reg)
}

#[test]
fn top_shows_the_node_live_and_gives_the_terminal_back() {
    if !require_tool("tmux") {
        return;
    }
    let mut arb = Arbiter::start(&["--tq", "30"]);
    let mut a = client(&arb, "nb-alice", "alice");
    a.conn.send(&ClientMsg::Request).unwrap();
    a.wait_for(Duration::from_secs(5), |m| {
        matches!(m, ArbiterMsg::Grant { .. })
    })
    .expect("alice granted");
    a.conn
        .send(&ClientMsg::Usage(Usage {
            working_set_bytes: 700 * MIB,
            resident_bytes: 700 * MIB,
        }))
        .unwrap();
    // Bob's working set does not fit beside Alice's: she becomes the exclusive holder.
    let mut b = client(&arb, "nb-bob", "bob");

    let tmux = Tmux::start(arb.socket_dir(), 150, 40);
    let kiwictl = bin("kiwictl");
    let d = tmux.dir.path().display().to_string();
    tmux.type_line(&format!(
        "stty -g > {d}/before; {} top; echo \"TOP-EXITED rc=$?\"; stty -g > {d}/after",
        kiwictl.display()
    ));
    let s = tmux.wait_screen("the first frame", |s| {
        s.contains("GPU 0  GPU-top  scheduler on  TQ 30 s") && row(s, b.id).is_some()
    });
    assert!(
        s.contains(&format!("holder #{} nb-alice (team/alice)", a.id)),
        "{s}"
    );
    assert!(s.contains("no one waits"), "{s}");
    assert!(
        s.contains("resident 700 MiB") && s.contains("working sets 1400 MiB"),
        "{s}"
    );
    let alice = row(&s, a.id).unwrap();
    assert!(
        alice.contains("nb-alice") && alice.contains("team/alice") && alice.contains("holding"),
        "{alice}"
    );
    assert!(row(&s, b.id).unwrap().contains("idle"), "{s}");
    assert_eq!(
        tmux.var("alternate_on"),
        "1",
        "top draws on the alternate screen"
    );

    // Bob asks: the next refresh shows him waiting, in the queue, and Alice's TQ running.
    b.conn.send(&ClientMsg::Request).unwrap();
    let s = tmux.wait_screen("bob waiting", |s| {
        s.contains(&format!("queue  1. #{} nb-bob (team/bob)", b.id))
    });
    assert!(s.contains("left of its TQ, 1 waiting"), "{s}");
    // The screen as a person sees it (docs/install.md shows one).
    println!("kiwictl top, Bob waiting:\n{s}");
    assert!(row(&s, b.id).unwrap().contains("waiting"), "{s}");

    // Alice swaps 512 MiB out and gives the GPU back early: Bob holds it, and
    // Alice's swap-out rate shows for one refresh.
    a.conn
        .send(&ClientMsg::Swapped {
            direction: SwapDirection::Out,
            bytes: 512 * MIB,
            duration_ns: 10_000_000,
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
    .expect("bob granted");
    // The swap shows for one refresh, possibly before the hand-over does.
    tmux.wait_screen("alice's swap-out rate", |s| {
        row(s, a.id)
            .and_then(|r| r.split_whitespace().last().map(str::to_string))
            .and_then(|v| v.parse::<f64>().ok())
            .is_some_and(|r| r > 50.0)
    });
    let s = tmux.wait_screen("bob holding", |s| {
        s.contains(&format!("holder #{} nb-bob", b.id))
    });
    let alice = row(&s, a.id).unwrap();
    assert!(
        alice.contains("idle") && alice.contains("512 MiB"),
        "{alice}"
    );

    // q: top exits 0 and the shell gets its screen and terminal mode back.
    tmux.run(&["send-keys", "-t", "top", "q"]);
    let s = tmux.wait_screen("top to exit on q", |s| s.contains("TOP-EXITED rc=0"));
    assert_eq!(tmux.var("alternate_on"), "0", "alternate screen left");
    assert!(
        !s.contains("GPU-top"),
        "the frame stayed on the screen:\n{s}"
    );
    tmux.wait_screen("the prompt", |s| s.trim_end().ends_with("test-prompt$"));
    let before = std::fs::read_to_string(tmux.dir.path().join("before")).unwrap();
    let after = std::fs::read_to_string(tmux.dir.path().join("after")).unwrap();
    assert_eq!(before, after, "terminal mode not restored");

    // A window far too small for the frame: top keeps running, draws what fits.
    tmux.run(&["send-keys", "-t", "top", "clear", "Enter"]);
    tmux.type_line(&format!("{} top; echo \"TOP2 rc=$?\"", kiwictl.display()));
    tmux.wait_screen("the second run", |s| s.contains("GPU-top"));
    tmux.run(&["resize-window", "-t", "top", "-x", "12", "-y", "3"]);
    std::thread::sleep(Duration::from_millis(1500));
    let s = tmux.screen();
    assert!(s.lines().count() <= 3, "{s}");
    assert!(!s.contains("TOP2"), "top ended in a tiny window:\n{s}");
    assert_eq!(tmux.var("alternate_on"), "1");
    tmux.run(&["resize-window", "-t", "top", "-x", "150", "-y", "40"]);
    // Ctrl-C quits as q does.
    tmux.run(&["send-keys", "-t", "top", "C-c"]);
    tmux.wait_screen("top to exit on Ctrl-C", |s| s.contains("TOP2 rc=0"));
    assert_eq!(tmux.var("alternate_on"), "0");

    // The arbiter goes away: top exits 1 with one line saying so.
    tmux.run(&["send-keys", "-t", "top", "clear", "Enter"]);
    tmux.type_line(&format!("{} top; echo \"TOP3 rc=$?\"", kiwictl.display()));
    tmux.wait_screen("the third run", |s| s.contains("GPU-top"));
    arb.child.kill().unwrap();
    arb.child.wait().unwrap();
    let s = tmux.wait_screen("top to exit when the arbiter dies", |s| {
        s.contains("TOP3 rc=1")
    });
    assert_eq!(tmux.var("alternate_on"), "0");
    let errors: Vec<&str> = s.lines().filter(|l| l.contains("[ERROR]")).collect();
    assert_eq!(errors.len(), 1, "{s}");
    assert!(errors[0].contains("lost the arbiter"), "{s}");
    let next = s
        .lines()
        .skip_while(|l| !l.contains("[ERROR]"))
        .nth(1)
        .unwrap_or("");
    assert!(
        next.starts_with("TOP3 rc=1"),
        "one line, then the shell:\n{s}"
    );
}

#[test]
fn top_once_prints_one_frame_without_a_terminal() {
    let arb = Arbiter::start(&["--tq", "30"]);
    let a = client(&arb, "nb-alice", "alice");
    let o = Command::new(bin("kiwictl"))
        .env_remove("KIWI_CONFIG")
        .env("KIWI_SOCKET_DIR", arb.socket_dir())
        .args(["top", "--once"])
        .output()
        .unwrap();
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    assert!(!t.contains('\x1b'), "no escape sequences in --once:\n{t:?}");
    assert!(t.contains("GPU 0  GPU-top  scheduler on  TQ 30 s"), "{t}");
    assert!(row(&t, a.id).unwrap().contains("team/alice"), "{t}");
    // Without a terminal and without --once: one clear line.
    let o = Command::new(bin("kiwictl"))
        .env_remove("KIWI_CONFIG")
        .env("KIWI_SOCKET_DIR", arb.socket_dir())
        .arg("top")
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("needs a terminal"), "{err}");
}
