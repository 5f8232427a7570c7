//! Pool connections: a client process borrows slices of the node's swap pool
//! ([`crate::pool`]) over a connection of its own, opened with `pool_open` instead of
//! a registration. The connection only answers requests (`pool_take` → `pool_lent`
//! with the slices' descriptors attached, or `pool_refused`; `pool_give`), so a
//! client that does not read stalls only its own task.
//!
//! What one process may hold is bounded by what it could have to swap out: the
//! working sets its registered clients report (the same host pid, from
//! `SO_PEERCRED`), plus a unit of rounding per request. Buffers prepared ahead
//! (`ahead`) are refused first: they never take the room the node's admitted swap
//! need still has to find in the pool. Whatever a connection holds comes back when it
//! closes.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::sync::Arc;
use std::time::Duration;

use kiwi_protocol::fds::send_with_fds;
use kiwi_protocol::frame::{encode, FrameDecoder};
use kiwi_protocol::{ArbiterMsg, ClientMsg, ErrorCode, PoolSlice};
use tokio::io::Interest;
use tokio::net::UnixStream;
use tokio::sync::watch;

use super::{decode_client, log_safe, read_into, ClientDecodeError, RateLimit, Shared};
use crate::events::Tenant;
use crate::pool::{Pool, PoolError};

/// Slack over a process's working sets that it may hold: requests are rounded up to
/// the pool's unit, and a buffer is sized before the working set it serves is
/// reported.
const SLACK: u64 = 64 << 20;
/// How long a reply may wait for a client that does not read it.
const WRITE_TIMEOUT: Duration = Duration::from_secs(5);

/// Serves a pool connection after its `pool_open`; `decoder` holds what arrived
/// behind it.
#[allow(clippy::too_many_arguments)]
pub(super) async fn serve(
    shared: Arc<Shared>,
    pool: Arc<Pool>,
    stream: Arc<UnixStream>,
    mut decoder: FrameDecoder,
    conn_id: u64,
    host_pid: u32,
    tenant: Tenant,
    mut rate: RateLimit,
    mut stop: watch::Receiver<bool>,
) {
    let stats = pool.stats();
    let opened = ArbiterMsg::PoolOpened {
        size_bytes: stats.size,
        slice_bytes: stats.slice,
    };
    if send(&stream, &opened, &[]).await.is_err() {
        pool.release_owner(conn_id);
        return;
    }
    let frame_timeout = shared.limits.frame_timeout;
    // Bytes this connection holds.
    let mut held = 0u64;
    let mut frame_by: Option<tokio::time::Instant> = None;
    'conn: loop {
        // Messages already buffered first.
        loop {
            let msg = match decoder.next_payload() {
                Ok(Some(p)) => decode_client(p),
                Ok(None) => break,
                Err(e) => Err(ClientDecodeError::Protocol(e)),
            };
            let msg = match msg {
                Ok(m) => m,
                Err(_) => {
                    let _ = send(
                        &stream,
                        &error(
                            ErrorCode::Malformed,
                            "malformed message on a pool connection; closing",
                        ),
                        &[],
                    )
                    .await;
                    break 'conn;
                }
            };
            if !rate.allow() {
                let _ = send(
                    &stream,
                    &error(ErrorCode::RateLimited, "too many messages; slow down"),
                    &[],
                )
                .await;
                break 'conn;
            }
            match msg {
                ClientMsg::PoolTake { bytes, ahead } => {
                    let reply = take(
                        &shared, &pool, conn_id, host_pid, &tenant, held, bytes, ahead,
                    )
                    .await;
                    if let Ok((_, lent)) = &reply {
                        held += lent.iter().map(|l| l.bytes).sum::<u64>();
                    }
                    let fds: Vec<BorrowedFd<'_>> = match &reply {
                        Ok((_, lent)) => lent.iter().map(|l| l.fd.as_fd()).collect(),
                        Err(_) => Vec::new(),
                    };
                    let msg = match &reply {
                        Ok((msg, _)) => msg.clone(),
                        Err(message) => ArbiterMsg::PoolRefused {
                            message: message.clone(),
                        },
                    };
                    if send(&stream, &msg, &fds).await.is_err() {
                        break 'conn;
                    }
                    // The descriptors sent are the client's now; ours close here.
                }
                ClientMsg::PoolKept { bytes } => {
                    let may = allowance(&shared, host_pid).saturating_add(SLACK);
                    pool.keep(conn_id, &tenant, bytes.min(may));
                }
                ClientMsg::PoolGive { ids } => {
                    held = held.saturating_sub(pool.give(conn_id, &ids));
                }
                other => {
                    let what = format!(
                        "{} is refused on a pool connection (it carries only pool_take and pool_give); closing",
                        kind(&other)
                    );
                    let _ = send(&stream, &error(ErrorCode::WrongSocket, &what), &[]).await;
                    break 'conn;
                }
            }
        }
        frame_by = decoder
            .partial_frame()
            .map(|_| frame_by.unwrap_or_else(|| tokio::time::Instant::now() + frame_timeout));
        if decoder.partial_frame().unwrap_or(0) > super::SMALL_FRAME {
            let _ = send(
                &stream,
                &error(ErrorCode::Oversize, "pool messages are small; closing"),
                &[],
            )
            .await;
            break;
        }
        let expired = super::sleep_until(frame_by);
        tokio::select! {
            r = stream.readable() => {
                if r.is_err() { break; }
                match read_into(&stream, &mut decoder) {
                    Ok(false) => break,
                    Ok(true) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                    Err(_) => break,
                }
            }
            _ = expired => {
                let _ = send(&stream, &error(ErrorCode::Timeout, "a frame was not completed in time; closing"), &[]).await;
                break;
            }
            _ = stop.changed() => break,
        }
    }
    let back = pool.release_owner(conn_id);
    if back > 0 {
        log_line!(
            "INFO",
            "pool connection of pid {host_pid} closed: {} MiB of the swap pool come back (scrubbed before anyone else gets them)",
            back >> 20
        );
    }
}

fn error(code: ErrorCode, message: &str) -> ArbiterMsg {
    ArbiterMsg::Error {
        code,
        message: message.into(),
    }
}

/// The message's name on the wire (its `type`).
fn kind(msg: &ClientMsg) -> String {
    serde_json::to_value(msg)
        .ok()
        .and_then(|v| v.get("type").and_then(|t| t.as_str()).map(str::to_owned))
        .unwrap_or_else(|| "this message".into())
}

/// Decides and serves one `pool_take`: `Ok` with the reply and the slices whose
/// descriptors go with it, or the refusal's line.
#[allow(clippy::too_many_arguments)]
async fn take(
    shared: &Shared,
    pool: &Arc<Pool>,
    conn_id: u64,
    host_pid: u32,
    tenant: &Tenant,
    held: u64,
    bytes: u64,
    ahead: bool,
) -> Result<(ArbiterMsg, Vec<crate::pool::Lent>), String> {
    let allowance = allowance(shared, host_pid);
    let (need, swapped) = {
        let st = shared.lock();
        let need = crate::swap::node_swap_need(st.gpus.values().map(|g| &g.sched));
        let swapped = crate::swap::node_swapped_bytes(st.gpus.values().map(|g| &g.sched));
        (need, swapped)
    };
    if allowance == 0 {
        return Err(format!(
            "the node's swap pool lends only to processes with registered GPU memory (pid {host_pid} has none)"
        ));
    }
    if held.saturating_add(bytes) > allowance.saturating_add(SLACK) {
        return Err(format!(
            "this process already borrows {} MiB of the node's swap pool for a working set of {} MiB",
            held >> 20,
            allowance >> 20
        ));
    }
    if ahead {
        // Room the admitted swap need still has to find in the pool stays free.
        let s = pool.stats();
        let still_needed = need.saturating_sub(swapped);
        if s.lent.saturating_add(bytes).saturating_add(still_needed) > s.size {
            return Err(
                "the node's swap pool keeps its free memory for swap-outs under way".into(),
            );
        }
    }
    let p = pool.clone();
    let who = tenant.to_string();
    let got = tokio::task::spawn_blocking(move || p.take(conn_id, &who, bytes))
        .await
        .map_err(|e| format!("the swap pool failed: {e}"))?;
    match got {
        Ok(lent) => {
            let slices = lent
                .iter()
                .map(|l| PoolSlice {
                    id: l.id,
                    bytes: l.bytes,
                })
                .collect();
            Ok((ArbiterMsg::PoolLent { slices }, lent))
        }
        Err(e) => Err(refusal(&e)),
    }
}

/// What one process may borrow: the working sets its registered clients report.
fn allowance(shared: &Shared, host_pid: u32) -> u64 {
    let st = shared.lock();
    st.clients
        .iter()
        .filter(|(_, c)| c.process.is_some_and(|(pid, _)| pid == host_pid))
        .filter_map(|(id, c)| {
            let g = st.gpus.get(c.gpu.as_ref()?)?;
            Some(g.sched.working_set_of(*id))
        })
        .fold(0u64, u64::saturating_add)
}

/// One line for a refused take: the pool, and who fills it.
fn refusal(e: &PoolError) -> String {
    log_safe(&e.to_string()).into_owned()
}

/// Sends `msg` with `fds` attached to its first byte, waiting (bounded) for a client
/// that reads slowly.
async fn send(
    stream: &UnixStream,
    msg: &ArbiterMsg,
    fds: &[BorrowedFd<'_>],
) -> std::io::Result<()> {
    let bytes = encode(msg).map_err(std::io::Error::other)?;
    let fd = stream.as_raw_fd();
    let mut sent = 0;
    let write = async {
        while sent < bytes.len() {
            stream.writable().await?;
            let attach = if sent == 0 { fds } else { &[] };
            match stream.try_io(Interest::WRITABLE, || {
                send_with_fds(fd, &bytes[sent..], attach)
            }) {
                Ok(n) => sent += n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    };
    tokio::time::timeout(WRITE_TIMEOUT, write)
        .await
        .unwrap_or_else(|_| Err(std::io::ErrorKind::TimedOut.into()))
}

/// How often the pool is told what the node's shared GPUs may soon swap.
const WANTED_EVERY: Duration = Duration::from_millis(100);

/// Keeps the pool populated ahead: what the working sets on shared GPUs could need
/// (each client's buffers are prepared as its working set grows, before anyone asks).
pub(super) async fn run_wanted(
    shared: Arc<Shared>,
    pool: Arc<Pool>,
    mut stop: watch::Receiver<bool>,
) {
    let mut tick = tokio::time::interval(WANTED_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    loop {
        tokio::select! {
            _ = tick.tick() => {
                let wanted = {
                    let st = shared.lock();
                    st.gpus
                        .values()
                        .map(|g| g.sched.shared_working_sets())
                        .fold(0u64, u64::saturating_add)
                };
                pool.set_wanted(wanted);
            }
            _ = stop.changed() => return,
        }
    }
}

/// The pool as `kiwictl status` shows it.
pub(super) fn status(pool: &Pool) -> kiwi_protocol::PoolStatus {
    let s = pool.stats();
    let mut tenants = s.tenants;
    tenants.sort_by_key(|t| std::cmp::Reverse(t.1));
    tenants.truncate(16);
    kiwi_protocol::PoolStatus {
        size_bytes: s.size,
        populated_bytes: s.populated,
        ready_bytes: s.ready,
        lent_bytes: s.lent,
        scrubbing_bytes: s.scrubbing,
        page_mode: s.page_mode.to_string(),
        tenants,
    }
}
