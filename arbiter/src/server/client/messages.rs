//! What each client message does, under the state lock: [`handle_client_msg`] sorts
//! a message by what it is and whether its connection registered; one function per
//! message answers it or steps its GPU's scheduler, and the outputs are dispatched
//! ([`State::dispatch`]).

use kiwi_protocol::{ArbiterMsg, ClientMsg, ErrorCode, Register, Usage, PROTOCOL_VERSION};

use super::Origin;
use crate::clock::monotonic_ns;
use crate::gpus;
use crate::sched::{ClientId, ClientInfo, Output};
use crate::server::checkpoints;
use crate::server::logging::log_safe;
use crate::server::peer::Peer;
use crate::server::state::{Shared, State};
use crate::swap;

/// Who sent the message being handled, and when: what every handler is given.
#[derive(Clone, Copy)]
struct Sender<'a> {
    shared: &'a Shared,
    id: ClientId,
    host_pid: u32,
    origin: &'a Origin,
    peer: &'a Peer,
    now: u64,
}

/// What a handler leaves to [`handle_client_msg`].
enum Next {
    /// Close the connection.
    Close,
    /// Nothing more: the answer is sent.
    Done,
    /// Dispatch these outputs of the named GPU's scheduler (waking the timer task if
    /// its deadline moved).
    Dispatch(String, Vec<Output>),
}

/// The group a registering client belongs to ([`crate::gang`]): the name it gives
/// (`KIWI_GROUP`), scoped to its tenant so no tenant joins another's group; else its
/// container's pod or the container (from the container's record); else its process
/// (a process using several GPUs is one job); a client whose process is unknown is a
/// group of its own.
fn group_key(
    origin: &Origin,
    tenant: Option<&str>,
    named: Option<&str>,
    host_pid: u32,
    id: ClientId,
) -> String {
    if let Some(name) = named {
        return format!("{} / {name}", tenant.unwrap_or("?"));
    }
    if let Origin::Container(c) = origin {
        if tenant.is_some_and(|t| t.starts_with("container ")) {
            return c.group_key();
        }
    }
    if host_pid != 0 {
        return format!("pid {host_pid}");
    }
    format!("client {id}")
}

/// The line a refused growth prints: what bounds it (the swap pool, or the budget)
/// and who fills the pool most.
fn refusal_line(
    a: &swap::Admission,
    working_set: u64,
    pool: Option<&crate::pool::PoolStats>,
) -> String {
    let what = match pool {
        Some(p) if p.size <= a.budget && p.spill_dir.is_some() => format!(
            "the node's swap pool and its disk tier ({} MiB together)",
            a.budget >> 20
        ),
        Some(p) if p.size <= a.budget => format!("the node's swap pool ({} MiB)", p.size >> 20),
        _ => format!("the node's swap budget ({} MiB)", a.budget >> 20),
    };
    let mut line = format!(
        "growing this GPU's working set to {} MiB would need {} MiB of GPU memory swapped out on this node, more than {what} holds",
        working_set >> 20,
        a.need_after >> 20
    );
    if let Some(p) = pool {
        let mut top = p.tenants.clone();
        top.sort_by_key(|t| std::cmp::Reverse(t.1));
        let names: Vec<String> = top
            .iter()
            .take(3)
            .map(|(t, b)| format!("{} ({} MiB)", log_safe(t), b >> 20))
            .collect();
        if !names.is_empty() {
            line.push_str(&format!("; it is lent most to {}", names.join(", ")));
        }
    }
    line
}

/// Handles one client message. `false`: close the connection.
pub(super) fn handle_client_msg(
    shared: &Shared,
    id: ClientId,
    host_pid: u32,
    origin: &Origin,
    peer: &Peer,
    msg: ClientMsg,
    used: Option<u64>,
) -> bool {
    let now = monotonic_ns();
    let from = Sender {
        shared,
        id,
        host_pid,
        origin,
        peer,
        now,
    };
    let mut st = shared.lock();
    let deadline_before = st.next_deadline();
    let gpu = st.clients.get(&id).and_then(|c| c.gpu.clone());
    let next = match (msg, gpu) {
        (ClientMsg::Ping { token }, gpu) => ping(from, &mut st, token, gpu),
        (ClientMsg::Register(r), None) => register(from, &mut st, r),
        (
            ClientMsg::PoolOpen
            | ClientMsg::PoolTake { .. }
            | ClientMsg::PoolGive { .. }
            | ClientMsg::PoolKept { .. }
            | ClientMsg::PoolSpill { .. },
            _,
        ) => {
            peer.send(&ArbiterMsg::Error {
                code: ErrorCode::InvalidArgument,
                message: "swap pool messages belong on a pool connection (opened with pool_open)"
                    .into(),
            });
            Next::Done
        }
        (ClientMsg::View { gpu_uuid }, _) => view(from, &st, gpu_uuid),
        (ClientMsg::Register(_), Some(_)) => {
            peer.send(&ArbiterMsg::Error {
                code: ErrorCode::AlreadyRegistered,
                message: "already registered on this connection".into(),
            });
            Next::Done
        }
        (_, None) => {
            peer.send(&ArbiterMsg::Error {
                code: ErrorCode::NotRegistered,
                message: "register first".into(),
            });
            Next::Done
        }
        (ClientMsg::Admit { working_set_bytes }, Some(uuid)) => {
            admit(from, &mut st, uuid, working_set_bytes)
        }
        (msg, Some(uuid)) => step(from, &mut st, uuid, msg, used),
    };
    let (gpu, outs) = match next {
        Next::Close => return false,
        Next::Done => return true,
        Next::Dispatch(gpu, outs) => (gpu, outs),
    };
    st.dispatch(&gpu, outs);
    // Wake the timer task only when its deadline moved: on the hand-off path every
    // avoided wake-up is CPU the next holder's process can have.
    let moved = st.next_deadline() != deadline_before;
    drop(st);
    if moved {
        shared.timer.notify_one();
    }
    true
}

/// `ping`: answered with `pong`, after any `room` due to the client.
fn ping(from: Sender, st: &mut State, token: u64, gpu: Option<String>) -> Next {
    let Sender { id, peer, now, .. } = from;
    // A `room` due to this client goes before the answer: the shim's
    // `cuMemGetInfo` counts on it (docs/protocol.md, "Memory no swap frees").
    if let Some(uuid) = gpu {
        st.step(&uuid, |s| s.flush_room(now, id));
    }
    peer.send(&ArbiterMsg::Pong { token });
    Next::Done
}

/// `register`: the version, the GPU (a container's claim, then what the arbiter knows
/// of it, [`State::admit_gpu`]) are checked before the client joins the GPU
/// ([`join_gpu`]); a refusal closes the connection.
fn register(from: Sender, st: &mut State, r: Register) -> Next {
    let Sender {
        shared,
        id,
        host_pid,
        origin,
        peer,
        now,
    } = from;
    if r.version != PROTOCOL_VERSION {
        peer.send(&ArbiterMsg::Error {
            code: ErrorCode::Version,
            message: format!(
                "protocol version {} is not supported (the arbiter speaks {PROTOCOL_VERSION})",
                r.version
            ),
        });
        return Next::Close;
    }
    if r.gpu_uuid.is_empty() || r.gpu_uuid.len() > 128 || r.gpu_total_memory == 0 {
        peer.send(&ArbiterMsg::Error {
            code: ErrorCode::InvalidArgument,
            message: "registration needs a GPU UUID (≤128 bytes) and its total memory".into(),
        });
        return Next::Close;
    }
    let uuid = r.gpu_uuid.clone();
    if let Origin::Container(c) = origin {
        if let Err(message) = c.may_use(&uuid) {
            warn_throttled!(
                shared.warn,
                "client {id} (pid {host_pid}) of container {} refused: {}",
                c.key,
                log_safe(&message)
            );
            peer.send(&ArbiterMsg::Error {
                code: ErrorCode::UnknownGpu,
                message,
            });
            return Next::Close;
        }
    }
    if let Err(refusal) = st.admit_gpu(now, &uuid, r.gpu_total_memory) {
        warn_throttled!(
            shared.warn,
            "client {id} (pid {host_pid}) refused: {refusal}"
        );
        let code = match refusal {
            gpus::Refusal::WrongTotal { .. } => ErrorCode::InvalidArgument,
            gpus::Refusal::UnknownGpu { .. } | gpus::Refusal::TooManyGpus { .. } => {
                ErrorCode::UnknownGpu
            }
        };
        peer.send(&ArbiterMsg::Error {
            code,
            message: refusal.to_string(),
        });
        return Next::Close;
    }
    join_gpu(from, st, r, uuid)
}

/// A registration admitted on GPU `uuid`: the client is labelled (a container's
/// from its record), registered with the GPU's scheduler, told the node's bounds
/// if it asked, and put in its group ([`group_key`]).
fn join_gpu(from: Sender, st: &mut State, r: Register, uuid: String) -> Next {
    let Sender {
        shared,
        id,
        host_pid,
        origin,
        now,
        ..
    } = from;
    if let Some(c) = st.clients.get_mut(&id) {
        c.gpu = Some(uuid.clone());
    }
    log_line!(
        "INFO",
        "client {id} registered: pid {} (host pid {host_pid}) {} on GPU {uuid}{}",
        r.pid,
        r.name.as_deref().unwrap_or("?"),
        if r.resume.is_some() { " (resumed)" } else { "" }
    );
    let mut info = ClientInfo::from_register(&r, host_pid);
    info.tenant = st.clients.get(&id).map(|c| c.tenant.to_string());
    if let Origin::Container(c) = origin {
        // Who a container's client is comes from its record, not from itself.
        c.label(&mut info);
    }
    let group = group_key(
        origin,
        info.tenant.as_deref(),
        r.group.as_deref(),
        host_pid,
        id,
    );
    let usage = Usage {
        working_set_bytes: r.working_set_bytes,
        resident_bytes: r.resident_bytes,
    };
    let mut outs = st
        .gpus
        .get_mut(&uuid)
        .map(|g| g.sched.register(now, id, info, usage, r.resume))
        .unwrap_or_default();
    // The node's bounds, right after `registered` (the scheduler's), so the
    // shim has them before any drop or reclaim; only to a client that asked.
    let registered = outs
        .iter()
        .position(|o| matches!(o, Output::Send(to, ArbiterMsg::Registered { .. }) if *to == id));
    if let (true, Some(k)) = (r.bounds, registered) {
        let bounds = ArbiterMsg::Bounds {
            hint_wait_ms: st.cfg.max_hint_wait_ms,
        };
        outs.insert(k + 1, Output::Send(id, bounds));
    }
    if r.resume.is_some() && host_pid != 0 {
        checkpoints::learn_if_left(st, &uuid, id, host_pid);
    }
    if r.resume.is_some_and(|x| x.holding)
        && outs
            .iter()
            .any(|o| matches!(o, Output::Send(to, ArbiterMsg::Revoked { .. }) if *to == id))
    {
        warn_throttled!(
            shared.warn,
            "client {id} (pid {host_pid}) claims to hold GPU {uuid}, which the arbiter did not grant it: refused, queued"
        );
    }
    st.dispatch(&uuid, outs);
    st.join_group(now, id, &group, &uuid);
    Next::Dispatch(uuid, Vec::new())
}

/// `view`: what this client's tenant may see of a GPU (on a container's socket,
/// only of the GPUs the container claimed).
fn view(from: Sender, st: &State, gpu_uuid: String) -> Next {
    let Sender {
        id, origin, peer, ..
    } = from;
    if let Origin::Container(c) = origin {
        if let Err(message) = c.may_use(&gpu_uuid) {
            peer.send(&ArbiterMsg::Error {
                code: ErrorCode::UnknownGpu,
                message,
            });
            return Next::Done;
        }
    }
    peer.send(&st.view(id, gpu_uuid));
    Next::Done
}

/// `admit`: whether the node's swap budget lets this GPU's working set grow
/// ([`swap::decide`]); the answer first, then an admitted working set recorded.
fn admit(from: Sender, st: &mut State, uuid: String, working_set_bytes: u64) -> Next {
    let Sender {
        shared,
        id,
        host_pid,
        peer,
        now,
        ..
    } = from;
    let Some(g) = st.gpus.get(&uuid) else {
        return Next::Close;
    };
    let held = |pid: u32| shared.pool_book.held(pid);
    let a = swap::decide(
        st.cfg.swap_budget_bytes,
        st.gpus.values().map(|g| &g.sched),
        &g.sched,
        id,
        working_set_bytes,
        &held,
    );
    // The answer first: the client is blocked in its allocator waiting for it.
    let message = (!a.ok && g.sched.takes_notices(id)).then(|| {
        let pool = shared.pool.as_ref().map(|p| p.stats());
        refusal_line(&a, working_set_bytes, pool.as_ref())
    });
    peer.send(&ArbiterMsg::Admitted {
        ok: a.ok,
        swap_needed_bytes: a.need_after,
        swap_budget_bytes: a.budget,
        message,
    });
    if !a.ok {
        st.metrics.admission_refused();
        log_line!(
            "INFO",
            "swap budget: refused client {id} (pid {host_pid}) on GPU {uuid} a working set of {} MiB ({working_set_bytes} bytes): node swap need would be {} MiB ({} bytes), budget {} MiB ({} bytes)",
            working_set_bytes >> 20,
            a.need_after >> 20,
            a.need_after,
            a.budget >> 20,
            a.budget
        );
        return Next::Done;
    }
    let outs = st
        .gpus
        .get_mut(&uuid)
        .map(|g| g.sched.admit(now, id, working_set_bytes))
        .unwrap_or_default();
    Next::Dispatch(uuid, outs)
}

/// Any other message of a registered client: a step of its GPU's scheduler.
fn step(from: Sender, st: &mut State, uuid: String, msg: ClientMsg, used: Option<u64>) -> Next {
    let Sender { id, now, .. } = from;
    let Some(g) = st.gpus.get_mut(&uuid) else {
        return Next::Close;
    };
    let s = &mut g.sched;
    let outs = match msg {
        ClientMsg::Request => s.request(now, id),
        ClientMsg::Release(u) => s.release(now, id, u),
        ClientMsg::Usage(u) => s.usage(now, id, u),
        ClientMsg::Reclaimed(u) => s.reclaimed(now, id, u),
        ClientMsg::Unswappable { bytes } => s.unswappable(now, id, bytes),
        ClientMsg::Swapped {
            direction,
            bytes,
            duration_ns,
        } => s.swapped(now, id, direction, bytes, duration_ns),
        ClientMsg::Drained => s.drained(now, id),
        ClientMsg::NoRoom { missing_bytes } => s.no_room(now, id, missing_bytes, || used),
        ClientMsg::Register(_)
        | ClientMsg::Ping { .. }
        | ClientMsg::Admit { .. }
        | ClientMsg::PoolOpen
        | ClientMsg::PoolTake { .. }
        | ClientMsg::PoolGive { .. }
        | ClientMsg::PoolKept { .. }
        | ClientMsg::PoolSpill { .. }
        | ClientMsg::View { .. } => Vec::new(),
    };
    Next::Dispatch(uuid, outs)
}
