//! The control socket (root's, `kiwictl` and `kiwi-hook`): its accept loop, at most
//! [`MAX_CONTROL_CONNS`] connections (they live in the descriptors client
//! connections never take), and one function per request, each answered under the
//! state lock (container sockets' attach and detach in [`containers`]).

use std::sync::Arc;
use std::time::Duration;

use kiwi_protocol::frame::decode_payload;
use kiwi_protocol::{
    ClientMsg, ControlReply, ControlRequest, ErrorCode, FrameDecoder, Settings, StatusReport,
};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::watch;

use super::limits::AcceptBackoff;
use super::logging::log_safe;
use super::state::{Shared, State};
use super::{containers, pool};
use crate::clock::monotonic_ns;
use crate::sched::{GpuScheduler, Output};

/// Simultaneous control connections (root's); they live in
/// [`FD_RESERVE`](super::FD_RESERVE).
pub(super) const MAX_CONTROL_CONNS: usize = 16;

pub(super) async fn accept_control(
    shared: Arc<Shared>,
    listener: UnixListener,
    mut stop: watch::Receiver<bool>,
) {
    let mut tasks = tokio::task::JoinSet::new();
    let mut backoff = AcceptBackoff::new();
    loop {
        tokio::select! {
            res = listener.accept() => match res {
                Ok((stream, _)) => {
                    backoff.reset();
                    if tasks.len() >= MAX_CONTROL_CONNS {
                        warn_throttled!(shared.warn, "{MAX_CONTROL_CONNS} control connections open, the limit; refusing one");
                        let reply = ControlReply::Error {
                            code: ErrorCode::RateLimited,
                            message: format!("{MAX_CONTROL_CONNS} kiwictl connections are open already; try again"),
                        };
                        if let Ok(buf) = kiwi_protocol::encode(&reply) {
                            let _ = stream.try_write(&buf);
                        }
                        continue;
                    }
                    let shared = shared.clone();
                    tasks.spawn(control_connection(shared, stream));
                }
                Err(e) => backoff.failed("control accept", &e).await,
            },
            Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
            _ = stop.changed() => break,
        }
    }
    tasks.shutdown().await;
}

async fn control_connection(shared: Arc<Shared>, stream: UnixStream) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let who = stream
        .peer_cred()
        .ok()
        .and_then(|c| c.pid())
        .map_or("?".to_string(), |p| p.to_string());
    let mut stream = stream;
    let mut decoder = FrameDecoder::new();
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match tokio::time::timeout(Duration::from_secs(300), stream.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) | Err(_) => return,
            Ok(Ok(n)) => n,
        };
        decoder.push(&buf[..n]);
        loop {
            let (reply, fatal) = match decoder.next_payload() {
                Ok(None) => break,
                Ok(Some(p)) => match decode_payload::<ControlRequest>(p) {
                    Ok(req) => match req.validate() {
                        Ok(()) => (handle_control(&shared, req, &who), false),
                        Err(f) => (
                            ControlReply::Error {
                                code: ErrorCode::InvalidArgument,
                                message: format!("invalid request: {f}"),
                            },
                            false,
                        ),
                    },
                    Err(e) => {
                        let wrong = decode_payload::<ClientMsg>(p).is_ok();
                        let (code, message) = if wrong {
                            (
                                ErrorCode::WrongSocket,
                                "client messages belong on the client socket".to_string(),
                            )
                        } else {
                            (e.code(), log_safe(&e.to_string()).into_owned())
                        };
                        (ControlReply::Error { code, message }, false)
                    }
                },
                Err(e) => (
                    ControlReply::Error {
                        code: e.code(),
                        message: e.to_string(),
                    },
                    true,
                ),
            };
            // A reply too large for a frame becomes an error reply, never silence.
            let out = match kiwi_protocol::encode(&reply) {
                Ok(out) => out,
                Err(e) => {
                    log_line!("WARN", "a reply to kiwictl (pid {who}) was too large: {e}");
                    let err = ControlReply::Error {
                        code: e.code(),
                        message: format!(
                            "the arbiter's reply was too large to send ({e}); narrow the request (--gpu)"
                        ),
                    };
                    match kiwi_protocol::encode(&err) {
                        Ok(out) => out,
                        Err(_) => return,
                    }
                }
            };
            if stream.write_all(&out).await.is_err() || fatal {
                return;
            }
        }
    }
}

/// The most a status reply may encode to: the frame limit, less room for the
/// counts of what was left out.
const STATUS_BUDGET: usize = kiwi_protocol::MAX_PAYLOAD - 1024;

/// Encoded length of a JSON value (`usize::MAX` if it would not encode).
macro_rules! json_len {
    ($v:expr) => {
        serde_json::to_vec($v).map_or(usize::MAX, |b| b.len())
    };
}

/// Cuts a status report to fit in one frame: clients from the last GPU backwards
/// (holders and queue still list every id), then whole GPUs; counts what it left
/// out in `omitted_clients` and `omitted_gpus`.
fn fit_status(r: &mut StatusReport, budget: usize) {
    let mut len = json_len!(&*r);
    while len > budget {
        let excess = len - budget;
        let mut cut = 0;
        for g in r.gpus.iter_mut().rev() {
            while cut < excess {
                let Some(c) = g.clients.pop() else { break };
                cut += json_len!(&c) + 1;
                r.omitted_clients += 1;
            }
        }
        if cut < excess {
            if let Some(g) = r.gpus.pop() {
                r.omitted_gpus += 1;
                r.omitted_clients += g.clients.len() as u64;
            } else {
                return;
            }
        }
        len = json_len!(&*r);
    }
}

/// Answers one control request. A setting or status is answered under the state
/// lock, and the timer task is woken after it (a setting may move a deadline).
fn handle_control(shared: &Arc<Shared>, req: ControlRequest, who: &str) -> ControlReply {
    let now = monotonic_ns();
    let mut st = shared.lock();
    let reply = match req {
        ControlRequest::SetScheduler { on, gpu } => set_scheduler(&mut st, now, on, gpu, who),
        ControlRequest::SetTq { tq_ms, gpu } => set_tq(&mut st, now, tq_ms, gpu, who),
        ControlRequest::Status { gpu } => status(shared, &st, now, gpu),
        ControlRequest::AttachContainer { key } => {
            drop(st);
            return containers::attach(shared, &key, who);
        }
        ControlRequest::DetachContainer { key } => {
            drop(st);
            return containers::detach(shared, &key, who);
        }
        ControlRequest::Events {
            gpu,
            since_seq,
            limit,
        } => events(&st, now, gpu, since_seq, limit),
    };
    drop(st);
    shared.timer.notify_one();
    reply
}

/// The GPUs a request names: every GPU, or the one `gpu` selects (a UUID or an
/// index); an error reply that lists the known ones when it selects none.
fn select(st: &State, gpu: &Option<String>) -> Result<Vec<String>, ControlReply> {
    match gpu {
        None => Ok(st.gpus.keys().cloned().collect()),
        Some(sel) => st
            .resolve_gpu(sel)
            .map(|u| vec![u])
            .ok_or_else(|| ControlReply::Error {
                code: ErrorCode::UnknownGpu,
                message: format!(
                    "no GPU {sel:?} is known to the arbiter (known: {})",
                    if st.gpus.is_empty() {
                        "none yet".to_string()
                    } else {
                        st.gpus
                            .iter()
                            .map(|(u, g)| format!("{} = {u}", g.index))
                            .collect::<Vec<_>>()
                            .join(", ")
                    }
                ),
            }),
    }
}

/// A setting made on the GPUs `gpu` selects, each one's scheduler stepped with
/// `step`; made on every GPU, it is also the default of GPUs to come
/// (`set_default`). `Ok`: the GPUs it was made on.
fn apply_setting(
    st: &mut State,
    gpu: &Option<String>,
    set_default: impl FnOnce(&mut Settings),
    step: impl Fn(&mut GpuScheduler) -> Vec<Output>,
) -> Result<Vec<String>, ControlReply> {
    let uuids = select(st, gpu)?;
    if gpu.is_none() {
        set_default(&mut st.defaults);
    }
    for u in &uuids {
        st.step(u, &step);
    }
    Ok(uuids)
}

/// `kiwictl -S`: the scheduler on or off, on one GPU or on all (and for GPUs to come).
fn set_scheduler(
    st: &mut State,
    now: u64,
    on: bool,
    gpu: Option<String>,
    who: &str,
) -> ControlReply {
    let word = if on { "ON" } else { "OFF" };
    log_line!("INFO", "Received SCHED_{word} from kiwictl (pid {who})");
    let set = apply_setting(
        st,
        &gpu,
        |d| d.scheduler_on = on,
        |s| s.set_scheduler(now, on),
    );
    match set {
        Err(e) => e,
        Ok(uuids) => {
            log_line!(
                "INFO",
                "Scheduler status changed to {word}, broadcasting it"
            );
            ControlReply::Done {
                message: format!(
                    "Successfully turned {} the Kiwi scheduler.",
                    if on { "on" } else { "off" }
                ),
                gpus: uuids,
            }
        }
    }
}

/// `kiwictl -T`: the time quantum, on one GPU or on all (and for GPUs to come).
fn set_tq(st: &mut State, now: u64, tq_ms: u64, gpu: Option<String>, who: &str) -> ControlReply {
    log_line!(
        "INFO",
        "Received SET_TQ {tq_ms} ms from kiwictl (pid {who})"
    );
    // The wire's number, untyped until here: checked once, as every quantum is.
    let tq = match kiwi_config::Quantum::from_millis(tq_ms) {
        Ok(tq) => tq,
        Err(e) => {
            return ControlReply::Error {
                code: ErrorCode::InvalidArgument,
                message: e.to_string(),
            }
        }
    };
    match apply_setting(st, &gpu, |d| d.tq_ms = tq_ms, |s| s.set_tq(now, tq)) {
        Err(e) => e,
        Ok(uuids) => ControlReply::Done {
            message: format!(
                "Successfully set the Kiwi scheduler's time quantum to {} s.",
                tq_ms as f64 / 1000.0
            ),
            gpus: uuids,
        },
    }
}

/// `kiwictl status`: the node's swap figures and the selected GPUs', cut to a frame.
fn status(shared: &Shared, st: &State, now: u64, gpu: Option<String>) -> ControlReply {
    match select(st, &gpu) {
        Err(e) => e,
        Ok(uuids) => {
            let swap = st.node_swap();
            let mut report = StatusReport {
                default_settings: st.defaults,
                gpus: uuids.iter().filter_map(|u| st.gpu_status(now, u)).collect(),
                now_ns: now,
                swap_budget_bytes: swap.budget_bytes,
                swap_need_bytes: swap.need_bytes,
                swap_in_use_bytes: swap.in_use_bytes,
                swap_pool: shared.pool.as_ref().map(|p| Box::new(pool::status(p))),
                omitted_clients: 0,
                omitted_gpus: 0,
            };
            fit_status(&mut report, STATUS_BUDGET);
            ControlReply::Status(report)
        }
    }
}

/// `kiwictl events` (and `top`, `timeline`): a page of the event log, of one GPU or
/// of all.
fn events(st: &State, now: u64, gpu: Option<String>, since_seq: u64, limit: u32) -> ControlReply {
    match gpu.as_ref().map(|g| select(st, &Some(g.clone()))) {
        Some(Err(e)) => e,
        sel => {
            let uuid = sel.and_then(|r| r.ok()).and_then(|v| v.into_iter().next());
            let (events, more) = st.events.page(uuid.as_deref(), since_seq, limit as usize);
            let next_seq = events.last().map_or(since_seq.max(1), |e| e.seq + 1);
            ControlReply::Events {
                events,
                next_seq,
                more,
                now_ns: now,
            }
        }
    }
}
