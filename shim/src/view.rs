//! What NVML tells a process under Kiwi (issue #39): its own view of a GPU, the one
//! `cuMemGetInfo` gives it, not the physical GPU's with every tenant on it.
//!
//! - **Free memory** is what CUDA says this process can have: on a GPU where it has
//!   a turn, [`crate::hooks::told_free`] (the same figure, at the same moment); on
//!   one where it has none yet (NVML before CUDA), the total less the memory no swap
//!   frees that the arbiter says the clients there hold (what a registration would
//!   be told, [`kiwi_protocol::ArbiterMsg::Room`]). Where the arbiter schedules no
//!   one on the GPU, the driver's own figure is the truth.
//! - **Processes** are the caller's tenant's own clients on the GPU (its container;
//!   on the host, its uid), with what Kiwi counts for each (resident and swapped,
//!   and their contexts), as the arbiter lists them ([`kiwi_protocol::ClientMsg::View`]).
//!   On a GPU where Kiwi schedules no one, a host process sees the driver's entries
//!   of its own user in its own pid namespace; a container's sees none (the
//!   driver's pids are the host's). Another tenant's pids and sizes are never shown.
//!   (A process of the same user that runs without the shim, beside Kiwi's clients,
//!   is not listed: the driver's pids cannot be told apart from another tenant's
//!   containers running as the same uid without the arbiter, which does not lend
//!   them.)
//!
//! The arbiter is asked over a connection of this module's own (a view connection:
//! it never registers), kept open and opened again when it breaks. A process the
//! arbiter does not answer for (no arbiter: the process runs without Kiwi) sees the
//! driver's figures, except that one with turns sees only itself listed.
//! `KIWI_NVML_VIEW=0` turns the view off.

use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixStream;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use kiwi_protocol::blocking::Connection;
use kiwi_protocol::{ArbiterMsg, ClientMsg, ViewProcess};

use crate::client;

type Conn = Connection<ClientMsg, ArbiterMsg>;

/// How long the arbiter may take to answer a `view`.
const ANSWER_WAIT: Duration = Duration::from_secs(2);
/// The most messages read past while looking for the answer (the arbiter sends a
/// view connection nothing else; an older one may answer with an error).
const MAX_SKIPPED: usize = 8;

/// Whether the view is on (`KIWI_NVML_VIEW`, read once).
pub fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| crate::env::ShimEnv::from_env().nvml_view)
}

/// What the arbiter says of a GPU for this process's tenant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    /// The arbiter schedules clients on the GPU.
    pub known: bool,
    pub unswappable: u64,
    pub processes: Vec<ViewProcess>,
    /// The caller is a host process: the driver's pids are its own.
    pub host: bool,
}

/// What NVML's free memory is for GPU `uuid` in this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Free {
    /// The driver's own figure (no view, or nothing of Kiwi's on the GPU).
    Driver,
    /// Exactly this (the process's turn on the GPU says it).
    Bytes(u64),
    /// The GPU's total less this much.
    Besides(u64),
}

/// Free memory on GPU `uuid` as this process's CUDA sees it.
pub fn free(uuid: &str) -> Free {
    if !enabled() {
        return Free::Driver;
    }
    if let Some(turn) = turn_on(uuid) {
        return Free::Bytes(crate::hooks::told_free(turn).0);
    }
    match ask(uuid) {
        Some(a) if a.known => Free::Besides(a.unswappable),
        _ => Free::Driver,
    }
}

/// The processes NVML lists on GPU `uuid` for this process: `None`, the driver's own
/// list (no view, no Kiwi); else the tenant's own, with `driver` (the driver's list
/// of the same kind, `(pid, bytes)`; `None` where it failed) giving, on the host, the
/// same user's processes Kiwi does not schedule. `compute`: the compute list (Kiwi's
/// clients are compute processes; graphics and MPS lists hold only the driver's).
pub fn processes(
    uuid: &str,
    compute: bool,
    driver: impl FnOnce() -> Option<Vec<(u32, u64)>>,
) -> Option<Vec<(u32, u64)>> {
    if !enabled() {
        return None;
    }
    let Some(a) = ask(uuid) else {
        // No arbiter answers: a process with turns still sees only itself.
        client::global()?;
        let me = turn_on(uuid)
            .filter(|_| compute)
            .map(|t| (std::process::id(), own_bytes(t)));
        return Some(me.into_iter().collect());
    };
    if a.known {
        return Some(if compute {
            a.processes.iter().map(|p| (p.pid, p.used_bytes)).collect()
        } else {
            Vec::new()
        });
    }
    // Nothing of Kiwi's on the GPU: the driver's list, of this user's processes in
    // this pid namespace only (a host process's; none for a container's, whose
    // driver pids are the host's).
    if !a.host {
        return Some(Vec::new());
    }
    let me = unsafe_geteuid();
    let ns = pid_namespace("self");
    Some(
        driver()
            .unwrap_or_default()
            .into_iter()
            .filter(|&(pid, _)| {
                owner_of(pid) == Some(me) && ns.is_some() && pid_namespace(&pid.to_string()) == ns
            })
            .collect(),
    )
}

/// The pid namespace of `/proc/<pid>` (`self` for this process).
fn pid_namespace(pid: &str) -> Option<std::path::PathBuf> {
    std::fs::read_link(format!("/proc/{pid}/ns/pid")).ok()
}

/// Whether pid `pid` may be named to this process (its pid appears in its view's
/// lists; used for the per-process queries that take a pid).
pub fn may_name(uuid: &str, pid: u32) -> bool {
    processes(uuid, true, || None).is_none_or(|l| l.iter().any(|&(p, _)| p == pid))
}

/// What Kiwi counts for this process on `t`'s GPU: its working set (its own VMM
/// memory in it) and its contexts.
fn own_bytes(t: &client::Turn) -> u64 {
    t.figures()
        .working_set
        .saturating_add(t.info().context_bytes)
}

fn unsafe_geteuid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// The uid owning process `pid` (as `/proc` shows it), if it exists.
fn owner_of(pid: u32) -> Option<u32> {
    std::fs::metadata(format!("/proc/{pid}"))
        .ok()
        .map(|m| m.uid())
}

/// This process's turn on GPU `uuid`, if it has one.
fn turn_on(uuid: &str) -> Option<&'static client::Turn> {
    client::global()?
        .turns()
        .find(|t| t.info().uuid == uuid)
        .map(|t| &**t)
}

/// The view connection, opened on first use.
static CONN: Mutex<Option<Conn>> = Mutex::new(None);

/// Asks the arbiter what this process's tenant may see of GPU `uuid`; `None` where
/// no arbiter answers. One retry on a fresh connection (the last may have broken).
pub fn ask(uuid: &str) -> Option<Answer> {
    let mut conn = CONN.lock().unwrap_or_else(|p| p.into_inner());
    for _ in 0..2 {
        if conn.is_none() {
            *conn = connect();
            conn.as_ref()?;
        }
        match round_trip(conn.as_mut()?, uuid) {
            Ok(a) => return Some(a),
            Err(why) => {
                crate::kdebug!("NVML view: the arbiter did not answer ({why}); reconnecting");
                *conn = None;
            }
        }
    }
    None
}

fn connect() -> Option<Conn> {
    let path = crate::env::ShimEnv::from_env().client_socket();
    let stream = UnixStream::connect(&path).ok()?;
    stream.set_read_timeout(Some(ANSWER_WAIT)).ok()?;
    stream.set_write_timeout(Some(ANSWER_WAIT)).ok()?;
    Some(Conn::new(stream))
}

fn round_trip(conn: &mut Conn, uuid: &str) -> Result<Answer, String> {
    conn.send(&ClientMsg::View {
        gpu_uuid: uuid.to_string(),
    })
    .map_err(|e| e.to_string())?;
    for _ in 0..MAX_SKIPPED {
        match conn.recv().map_err(|e| e.to_string())? {
            ArbiterMsg::View {
                gpu_uuid,
                known,
                unswappable_bytes,
                processes,
                host,
            } if gpu_uuid == uuid => {
                return Ok(Answer {
                    known,
                    unswappable: unswappable_bytes,
                    processes,
                    host,
                })
            }
            // A GPU this container did not claim: nothing of it is the caller's.
            ArbiterMsg::Error {
                code: kiwi_protocol::ErrorCode::UnknownGpu,
                ..
            } => {
                return Ok(Answer {
                    known: false,
                    unswappable: 0,
                    processes: Vec::new(),
                    host: false,
                })
            }
            ArbiterMsg::Error { code, message } => {
                return Err(format!("{code:?}: {message}"));
            }
            _ => continue,
        }
    }
    Err("no answer among the arbiter's messages".into())
}
