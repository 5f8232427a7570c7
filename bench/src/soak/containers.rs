//! The soak's containers: claimed containers as `kiwi-hook` makes them, without a
//! runtime. Each has an init (a `sleep` the soak starts: the record's pid), a record
//! written as the hook writes it (`ContainerRecord::write`), and a socket the arbiter
//! serves for it (`attach_container` on the control socket). Its clients reach that
//! socket as a container's processes do: `KIWI_SOCKET_DIR` names a directory whose
//! `client/` is the container's socket directory (a symbolic link here; the hook's
//! bind mount at `/run/kiwi/client` in a real container). They are in the host's pid
//! namespace, as the init is, so the arbiter counts them as the container's. A
//! container runs a few clients (two at once at most, three in its life), then stops
//! once they have exited, as a job's container does.
//!
//! A container ends as under runc: its init exits, then the poststop hook asks the
//! arbiter to `detach_container`; or the runtime crashed and no poststop comes, and
//! the arbiter must sweep the container's socket and record at its next attach (or
//! its next start). Either way nothing may be left: no record, socket or directory,
//! and no listener in the arbiter. A container detached while a process of it still
//! runs (one that outlived its init: a container in the host's pid namespace) leaves
//! that process the connections it has (the arbiter stops accepting on the socket,
//! not serving what it accepted): it must still verify every byte and exit 0. It can
//! open no new connection, so an arbiter restart cuts it off for good; the soak kills
//! such processes before it restarts the arbiter and counts them apart.
//!
//! Nothing here owns the clients; the run loop tells which run where.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kiwi_config::containers::{self, ContainerRecord};
use kiwi_protocol::blocking::Connection;
use kiwi_protocol::{ControlReply, ControlRequest, Event, EventKind};

use super::arbiter::listening_under;
use super::clients::ClientProc;

/// The pod namespace of every soak container's record.
pub(super) const NAMESPACE: &str = "soak";
/// What a container's client says it is (`KIWI_POD_NAME`, `KIWI_POD_NAMESPACE`,
/// `KIWI_CONTAINER_ID`): the arbiter must label it from its record instead.
pub(super) const IMPOSTOR: &str = "impostor";
/// A container takes a new client while it runs fewer than this...
const CLIENTS_PER_CONTAINER: usize = 2;
/// ...and this many in its life: then it stops once they have exited, as a job's
/// container does when its work is done.
const CLIENTS_PER_LIFE: usize = 3;
/// How long the arbiter may take to stop listening on a detached container's socket,
/// or to listen on an attached one's again after a restart.
const LISTENER_GRACE: Duration = Duration::from_secs(5);

/// A container's pod name (its record's), as failures and the log name it.
pub(super) fn name(no: usize) -> String {
    format!("ctr-{no}")
}

/// A container's runtime id (short enough to be its key).
pub(super) fn id(no: usize) -> String {
    format!("kiwi-soak-{no}")
}

/// One attached container.
pub(super) struct Container {
    pub(super) no: usize,
    key: String,
    pub(super) gpu: u32,
    /// Its processes' `KIWI_SOCKET_DIR`.
    pub(super) client_dir: PathBuf,
    /// Clients it was given.
    taken: usize,
    init: Child,
}

impl Container {
    /// Its init exits: the container stops.
    fn stop_init(&mut self) {
        let _ = self.init.kill();
        let _ = self.init.wait();
        let _ = std::fs::remove_dir_all(&self.client_dir);
    }
}

impl Drop for Container {
    fn drop(&mut self) {
        self.stop_init();
    }
}

/// What the containers went through in one run.
#[derive(Debug, Default)]
pub(super) struct Tally {
    pub(super) attached: usize,
    /// Detached by their poststop hook with no client left.
    pub(super) poststop: usize,
    /// Stopped without a poststop hook, and swept by the arbiter.
    pub(super) swept: usize,
    /// Detached while a client of theirs ran.
    pub(super) detached_live: usize,
    /// Clients of those that went on, verified every byte and exited 0.
    pub(super) ran_on: usize,
    /// The longest one of them ran after the detach, s.
    pub(super) ran_on_longest_s: f64,
    /// Clients of those killed before an arbiter restart (they could not reconnect).
    pub(super) cut_off: usize,
    /// Their processes: pid, and when their container was detached (`CLOCK_MONOTONIC`
    /// ns, the event log's clock).
    pub(super) orphans: Vec<(u32, u64)>,
}

/// Every container of a run, and what went wrong with them.
pub(super) struct Containers {
    /// The arbiter's socket directory.
    socket_dir: PathBuf,
    /// Where the containers' client directories go.
    work: PathBuf,
    next: usize,
    crashes: bool,
    /// Containers stopped when idle.
    stops: usize,
    attached: Vec<Container>,
    /// Stopped without their poststop hook, not yet seen swept.
    crashed: Vec<Container>,
    /// Sockets the arbiter listens on and should not, or should and does not, since
    /// when; and those already reported.
    odd: BTreeMap<PathBuf, Instant>,
    reported: BTreeSet<PathBuf>,
    pub(super) tally: Tally,
    /// What went wrong, for the run's failures.
    pub(super) failures: Vec<String>,
}

impl Containers {
    /// `crashes`: every other container that stops has no poststop hook (a runtime
    /// that crashed); otherwise each has one.
    pub(super) fn new(socket_dir: &Path, work: &Path, crashes: bool) -> Containers {
        Containers {
            crashes,
            stops: 0,
            socket_dir: socket_dir.to_path_buf(),
            work: work.to_path_buf(),
            next: 0,
            attached: Vec::new(),
            crashed: Vec::new(),
            odd: BTreeMap::new(),
            reported: BTreeSet::new(),
            tally: Tally::default(),
            failures: Vec::new(),
        }
    }

    /// Sockets the arbiter serves for the soak's containers now (each a descriptor).
    pub(super) fn served(&self) -> usize {
        self.attached.len() + self.crashed.len()
    }

    /// Containers numbered so far (`ctr-0` up to this, excluded).
    pub(super) fn numbered(&self) -> usize {
        self.next
    }

    /// A container on `gpu` (whose UUID is `uuid`) for a new client: the one of
    /// fewest clients there, or a new one when each has its share. Its number and
    /// its processes' `KIWI_SOCKET_DIR`; `None` when it could not be attached (a
    /// failure is recorded).
    pub(super) fn for_client(
        &mut self,
        gpu: u32,
        uuid: &str,
        live: &[ClientProc],
    ) -> Option<(usize, PathBuf)> {
        let best = self
            .attached
            .iter()
            .filter(|c| c.gpu == gpu && c.taken < CLIENTS_PER_LIFE)
            .map(|c| (clients_of(c.no, live), c.no))
            .filter(|(n, _)| *n < CLIENTS_PER_CONTAINER)
            .min()
            .map(|(_, no)| no);
        let no = match best {
            Some(no) => no,
            None => self.attach(gpu, uuid)?,
        };
        let c = self.attached.iter_mut().find(|c| c.no == no)?;
        c.taken += 1;
        Some((no, c.client_dir.clone()))
    }

    /// Stops the containers whose work is done (they had their clients, and these
    /// have exited).
    pub(super) fn stop_done(&mut self, live: &[ClientProc]) {
        let done: Vec<usize> = self
            .attached
            .iter()
            .filter(|c| c.taken >= CLIENTS_PER_LIFE && clients_of(c.no, live) == 0)
            .map(|c| c.no)
            .collect();
        for no in done {
            self.stop_idle(no);
        }
    }

    /// Stops idle container `no`: with its poststop hook, or every other time (when
    /// `crashes`) without one.
    pub(super) fn stop_idle(&mut self, no: usize) {
        self.stops += 1;
        let poststop = !self.crashes || self.stops.is_multiple_of(2);
        self.stop(no, poststop);
    }

    /// Attaches a new container claiming `gpu` as `kiwi-hook` prestart does: its
    /// init, its record, `attach_container`, then the socket must be there. Then
    /// every container stopped without its poststop must have been swept.
    pub(super) fn attach(&mut self, gpu: u32, uuid: &str) -> Option<usize> {
        let no = self.next;
        self.next += 1;
        let what = format!("attaching container {} on GPU {gpu}", name(no));
        let init = match Command::new("sleep")
            .arg("infinity")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
        {
            Ok(c) => c,
            Err(e) => {
                self.failures
                    .push(format!("{what}: cannot start its init: {e}"));
                return None;
            }
        };
        let pid = init.id() as i32;
        let client_dir = self.work.join(name(no));
        let key = containers::key_for(&id(no)).expect("a valid id");
        let mut c = Container {
            no,
            key: key.clone(),
            gpu,
            client_dir,
            taken: 0,
            init,
        };
        let Some(pid_start) = containers::process_start(pid) else {
            self.failures.push(format!("{what}: its init is gone"));
            return None;
        };
        let record = ContainerRecord {
            id: id(no),
            pod_name: Some(name(no)),
            pod_namespace: Some(NAMESPACE.into()),
            container_name: Some("gpuburst".into()),
            gpus: vec![uuid.to_string()],
            any_gpu: false,
            pid,
            pid_start,
        };
        if let Err(e) = record.write(&self.socket_dir) {
            self.failures.push(format!("{what}: {e}"));
            return None;
        }
        if let Err(why) = self.control(ControlRequest::AttachContainer { key: key.clone() }) {
            self.failures
                .push(format!("{what}: the arbiter refused: {why}"));
            containers::remove(&self.socket_dir, &key);
            return None;
        }
        let socket = containers::container_socket(&self.socket_dir, &key);
        if !socket.exists() {
            self.failures.push(format!(
                "{what}: attach_container answered done, and {} is missing",
                socket.display()
            ));
        }
        let linked = std::fs::create_dir_all(&c.client_dir).and_then(|()| {
            std::os::unix::fs::symlink(
                containers::container_dir(&self.socket_dir, &key),
                kiwi_config::client_dir(&c.client_dir),
            )
        });
        if let Err(e) = linked {
            self.failures
                .push(format!("{what}: cannot link its client directory: {e}"));
            c.stop_init();
            let _ = self.control(ControlRequest::DetachContainer { key });
            return None;
        }
        self.attached.push(c);
        self.tally.attached += 1;
        self.check_swept("its next attach");
        Some(no)
    }

    /// Stops container `no`: its init exits, then its poststop hook detaches it (and
    /// nothing of it may be left), or, `poststop` false, none comes (a runtime that
    /// crashed: the arbiter's next attach or start must sweep it).
    fn stop(&mut self, no: usize, poststop: bool) {
        let Some(i) = self.attached.iter().position(|c| c.no == no) else {
            return;
        };
        let mut c = self.attached.swap_remove(i);
        c.stop_init();
        if poststop {
            self.detach(&c, "its poststop hook");
            self.tally.poststop += 1;
        } else {
            self.crashed.push(c);
        }
    }

    /// `detach_container` for `c`; nothing of it may be left after it answers.
    fn detach(&mut self, c: &Container, by: &str) {
        let r = self.control(ControlRequest::DetachContainer { key: c.key.clone() });
        if let Err(why) = r {
            self.failures.push(format!(
                "detaching container {} ({by}): the arbiter refused: {why}",
                name(c.no)
            ));
        }
        if let Some(left) = self.left_of(&c.key) {
            self.failures.push(format!(
                "container {} detached ({by}) left {left}",
                name(c.no)
            ));
        }
    }

    /// Detaches container `no` while a client of it runs (its init gone first).
    pub(super) fn detach_live(&mut self, no: usize) {
        if let Some(i) = self.attached.iter().position(|c| c.no == no) {
            let mut c = self.attached.swap_remove(i);
            c.stop_init();
            self.detach(&c, "while a client of it ran");
            self.tally.detached_live += 1;
        }
    }

    /// The socket (as its processes name it) and the GPU of an attached container
    /// picked with `rng`, if any: where a misbehaving tenant in it connects.
    pub(super) fn any(&self, rng: &mut super::Rng) -> Option<(PathBuf, u32)> {
        let c = self
            .attached
            .get(rng.pick(&(0..self.attached.len()).collect::<Vec<_>>())?)?;
        Some((kiwi_config::client_socket(&c.client_dir), c.gpu))
    }

    /// Attached containers with no client running.
    pub(super) fn idle(&self, live: &[ClientProc]) -> Vec<usize> {
        self.attached
            .iter()
            .filter(|c| clients_of(c.no, live) == 0)
            .map(|c| c.no)
            .collect()
    }

    /// Attached containers with a client running, each of whose processes the
    /// arbiter lists as registered in it (`registered`: host pid → container id, from
    /// its status). One not yet connected (starting, or reconnecting after a restart)
    /// would find no socket once its container is detached.
    pub(super) fn busy(
        &self,
        live: &[ClientProc],
        registered: &BTreeMap<u32, Option<String>>,
    ) -> Vec<usize> {
        self.attached
            .iter()
            .filter(|c| {
                let mut procs = live
                    .iter()
                    .filter(|l| l.container == Some(c.no) && l.orphaned.is_none())
                    .flat_map(|l| l.procs.iter())
                    .peekable();
                let want = Some(id(c.no));
                procs.peek().is_some()
                    && procs.all(|p| registered.get(&p.child.id()) == Some(&want))
            })
            .map(|c| c.no)
            .collect()
    }

    /// After the arbiter's restart: it swept the containers stopped without their
    /// poststop, and listens anew (the old one's listeners are gone with it).
    pub(super) fn after_restart(&mut self) {
        self.odd.clear();
        self.check_swept("the arbiter's start");
    }

    /// Each container stopped without its poststop must be gone once the arbiter
    /// attached another or started (`by`); one that is not is a failure (and gets
    /// its poststop late).
    fn check_swept(&mut self, by: &str) {
        let deadline = Instant::now() + Duration::from_secs(5);
        for c in std::mem::take(&mut self.crashed) {
            let left = loop {
                let left = self.left_of(&c.key);
                if left.is_none() || Instant::now() >= deadline {
                    break left;
                }
                std::thread::sleep(Duration::from_millis(50));
            };
            match left {
                None => self.tally.swept += 1,
                Some(left) => {
                    self.failures.push(format!(
                        "container {} stopped without its poststop hook: {by} left {left}",
                        name(c.no)
                    ));
                    self.detach(&c, "a late poststop");
                }
            }
        }
    }

    /// Checks what the arbiter `pid` listens on: every attached container's socket,
    /// and no other container's for longer than [`LISTENER_GRACE`].
    pub(super) fn look(&mut self, pid: u32) {
        let top = containers::containers_dir(&self.socket_dir);
        let Some(listening) = listening_under(pid, &top) else {
            return;
        };
        let sock = |key: &str| containers::container_socket(&self.socket_dir, key);
        let expected: BTreeSet<PathBuf> = self.attached.iter().map(|c| sock(&c.key)).collect();
        // Whether a crashed one is still served depends on whether it was swept yet.
        let either: BTreeSet<PathBuf> = self.crashed.iter().map(|c| sock(&c.key)).collect();
        let odd: BTreeSet<PathBuf> = listening
            .symmetric_difference(&expected)
            .filter(|p| !either.contains(*p))
            .cloned()
            .collect();
        let now = Instant::now();
        self.odd.retain(|p, _| odd.contains(p));
        for p in odd {
            let since = *self.odd.entry(p.clone()).or_insert(now);
            if now.duration_since(since) > LISTENER_GRACE && self.reported.insert(p.clone()) {
                self.failures.push(if listening.contains(&p) {
                    format!(
                        "the arbiter still listens on {} for {:.0?}, the socket of a container no longer attached",
                        p.display(),
                        now.duration_since(since)
                    )
                } else {
                    format!(
                        "the arbiter has not served {} for {:.0?}, the socket of an attached container",
                        p.display(),
                        now.duration_since(since)
                    )
                });
            }
        }
    }

    /// At the end, every client gone: every container stops with its poststop (late
    /// for those that had none), then nothing may be left under the containers'
    /// directory and the arbiter `pid` may listen on no container socket.
    pub(super) fn finish(&mut self, pid: u32) {
        for no in self.attached.iter().map(|c| c.no).collect::<Vec<_>>() {
            self.stop(no, true);
        }
        for c in std::mem::take(&mut self.crashed) {
            self.detach(&c, "a late poststop");
        }
        let top = containers::containers_dir(&self.socket_dir);
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let files: Vec<String> = std::fs::read_dir(&top)
                .map(|rd| {
                    rd.flatten()
                        .map(|e| e.file_name().to_string_lossy().into_owned())
                        .collect()
                })
                .unwrap_or_default();
            let listening = listening_under(pid, &top).unwrap_or_default();
            if files.is_empty() && listening.is_empty() {
                return;
            }
            if Instant::now() > deadline {
                self.failures.push(format!(
                    "left behind once every container was detached: {files:?} in {}, the arbiter listening on {listening:?}",
                    top.display()
                ));
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// What is left of container `key`'s record, socket and directory, if anything.
    fn left_of(&self, key: &str) -> Option<String> {
        let d = &self.socket_dir;
        let left: Vec<String> = [
            containers::record_path(d, key),
            containers::container_socket(d, key),
            containers::container_dir(d, key),
        ]
        .into_iter()
        .filter(|p| std::fs::symlink_metadata(p).is_ok())
        .map(|p| p.display().to_string())
        .collect();
        (!left.is_empty()).then(|| left.join(", "))
    }

    /// A request on the control socket, as `kiwi-hook` makes it: the arbiter's
    /// message when done.
    fn control(&self, req: ControlRequest) -> Result<String, String> {
        let path = kiwi_config::control_socket(&self.socket_dir);
        let mut c: Connection<ControlRequest, ControlReply> =
            Connection::connect(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        let _ = c.stream().set_read_timeout(Some(Duration::from_secs(10)));
        match c.call(&req) {
            Ok(ControlReply::Done { message, .. }) => Ok(message),
            Ok(ControlReply::Error { code, message }) => Err(format!("{code:?}: {message}")),
            Ok(other) => Err(format!("unexpected answer {other:?}")),
            Err(e) => Err(e.to_string()),
        }
    }
}

/// Clients of container `no` still running, apart from those it left running when
/// it was detached.
fn clients_of(no: usize, live: &[ClientProc]) -> usize {
    live.iter()
        .filter(|c| c.container == Some(no) && c.orphaned.is_none())
        .count()
}

/// Swap-outs and swap-ins the arbiter logged for `orphans` (pid, detached at) after
/// their container was detached, and their bytes: it went on serving them. Client ids
/// map to pids by the registrations of the same arbiter (a log whose `seq` goes back
/// is a restarted arbiter's).
pub(super) fn swaps_after_detach(events: &[Event], orphans: &[(u32, u64)]) -> (usize, u64) {
    let mut pid_of: BTreeMap<u64, u32> = BTreeMap::new();
    let (mut last_seq, mut swaps, mut bytes) = (0, 0, 0);
    for e in events {
        if e.seq <= last_seq {
            pid_of.clear();
        }
        last_seq = e.seq;
        let Some(id) = e.client else {
            continue;
        };
        match e.kind {
            EventKind::Register { host_pid, .. } => {
                pid_of.insert(id, host_pid);
            }
            EventKind::SwapOut { bytes: b, .. } | EventKind::SwapIn { bytes: b, .. } => {
                let after = pid_of
                    .get(&id)
                    .is_some_and(|pid| orphans.iter().any(|&(p, t)| p == *pid && e.t_ns > t));
                if after {
                    swaps += 1;
                    bytes += b;
                }
            }
            _ => {}
        }
    }
    (swaps, bytes)
}

/// What the arbiter's log says of the containers' clients: none registered under the
/// identity it claimed, each under its container's record (`attached`: how many
/// containers there were, `verified`: how many of their clients exited 0).
pub(super) fn check_labels(events: &[Event], attached: usize, verified: usize) -> Vec<String> {
    let mut failures = Vec::new();
    let mut labelled = 0;
    for e in events {
        let EventKind::Register {
            host_pid,
            pod_name,
            pod_namespace,
            ..
        } = &e.kind
        else {
            continue;
        };
        let claimed = [pod_name, pod_namespace]
            .iter()
            .any(|v| v.as_deref() == Some(IMPOSTOR));
        if claimed {
            failures.push(format!(
                "pid {host_pid} registered on {} as it said it was ({pod_namespace:?}/{pod_name:?}), not as its container's record says",
                e.gpu
            ));
        }
        if pod_namespace.as_deref() == Some(NAMESPACE) {
            labelled += 1;
            let known = pod_name
                .as_deref()
                .and_then(|n| n.strip_prefix("ctr-"))
                .and_then(|n| n.parse::<usize>().ok())
                .is_some_and(|n| n < attached);
            if !known {
                failures.push(format!(
                    "pid {host_pid} registered as {pod_namespace:?}/{pod_name:?}, no container of the soak"
                ));
            }
        }
    }
    if verified > 0 && labelled == 0 {
        failures.push(format!(
            "{verified} clients in containers verified every byte, and none registered under its container's record"
        ));
    }
    failures
}

#[cfg(test)]
mod tests {
    use super::*;

    fn register(pod: Option<&str>, ns: Option<&str>) -> Event {
        Event {
            seq: 1,
            t_ns: 1,
            gpu: "GPU-0".into(),
            client: Some(1),
            kind: EventKind::Register {
                pid: 7,
                host_pid: 7,
                name: Some("gpuburst".into()),
                pod_name: pod.map(str::to_string),
                pod_namespace: ns.map(str::to_string),
                working_set_bytes: 0,
                resumed: false,
            },
        }
    }

    fn event(seq: u64, t_ns: u64, client: u64, kind: EventKind) -> Event {
        Event {
            seq,
            t_ns,
            gpu: "GPU-0".into(),
            client: Some(client),
            kind,
        }
    }

    #[test]
    fn swaps_after_a_detach_are_the_orphans_own_by_the_same_arbiters_ids() {
        let reg = |pid| EventKind::Register {
            pid,
            host_pid: pid,
            name: None,
            pod_name: None,
            pod_namespace: None,
            working_set_bytes: 0,
            resumed: false,
        };
        let out = |bytes| EventKind::SwapOut {
            bytes,
            duration_ns: 1,
        };
        let log = [
            event(1, 10, 1, reg(100)),
            event(2, 11, 2, reg(200)),
            // Before the detach (at 20), and another process's.
            event(3, 15, 1, out(1)),
            event(4, 25, 2, out(2)),
            event(5, 30, 1, out(4)),
            // A restarted arbiter gives id 1 to someone else.
            event(1, 40, 1, reg(300)),
            event(2, 50, 1, out(8)),
        ];
        assert_eq!(swaps_after_detach(&log, &[(100, 20)]), (1, 4));
    }

    #[test]
    fn a_container_client_must_be_registered_under_its_record_and_never_as_it_said() {
        let ours = register(Some("ctr-1"), Some(NAMESPACE));
        let node = register(None, None);
        assert!(check_labels(&[ours.clone(), node.clone()], 2, 1).is_empty());
        // Believed as it said it was.
        let believed = register(Some(IMPOSTOR), Some(IMPOSTOR));
        let f = check_labels(&[believed, node.clone()], 2, 1);
        assert_eq!(f.len(), 2, "{f:?}");
        assert!(f[0].contains("as it said"), "{f:?}");
        assert!(f[1].contains("none registered"), "{f:?}");
        // A container the soak never attached.
        let f = check_labels(&[register(Some("ctr-5"), Some(NAMESPACE))], 2, 1);
        assert!(f[0].contains("no container of the soak"), "{f:?}");
        // No client in a container verified: none need be in the log.
        assert!(check_labels(&[node], 2, 0).is_empty());
    }
}
