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
//! closes: scrubbed at once when its process has exited, else left to the process
//! until it does (a connection can close under a live client that still has
//! swapped-out memory in its slices), counted in what the process may hold.
//!
//! With a disk tier (`--spill-dir`), [`Book`] keeps what each process borrows, and
//! the pool's tick ([`run_wanted`]) asks the processes idle longest
//! ([`ArbiterMsg::PoolReclaim`], on one of their registered connections) to give
//! back their spare buffers and move swapped-out contents to disk (`pool_spill`),
//! whenever the pool's free memory falls below what the holders of oversubscribed
//! GPUs will swap out next (at least a quarter of the pool), or a swap-out's take
//! found it full: such a take waits (at most [`SPILL_WAIT`]) for the room the
//! spills make, rather than going to the process's own memory.

use std::collections::HashMap;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kiwi_protocol::fds::send_with_fds;
use kiwi_protocol::frame::{encode, FrameDecoder};
use kiwi_protocol::{ArbiterMsg, ClientMsg, ErrorCode, PoolSlice};
use tokio::io::Interest;
use tokio::net::UnixStream;
use tokio::sync::watch;

use super::client::{decode_client, read_into, sleep_until, ClientDecodeError};
use super::limits::{RateLimit, SMALL_FRAME};
use super::logging::log_safe;
use super::state::Shared;
use crate::events::Tenant;
use crate::pool::{Pool, PoolError, Process};

/// Slack over a process's working sets that it may hold: requests are rounded up to
/// the pool's unit, and a buffer is sized before the working set it serves is
/// reported.
const SLACK: u64 = 64 << 20;
/// How long a reply may wait for a client that does not read it.
const WRITE_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a swap-out's take that found the pool full waits for the disk tier to
/// make room (within the shim's 10 s wait for an answer, and half the grace period).
pub(super) const SPILL_WAIT: Duration = Duration::from_secs(8);
/// How often a take waiting for room tries again.
const SPILL_RETRY: Duration = Duration::from_millis(25);
/// A process asked to reclaim is not asked again before this.
const ASK_EVERY: Duration = Duration::from_secs(1);
/// How long after its last spill (asked, or one it made) a process is not
/// checkpointed: a spill unregisters the process's buffers with the driver while its
/// shim holds its allocator, and a call of a process the driver locks waits there
/// until the restore; its other threads would wait on the allocator meanwhile (its
/// reconnection to a restarted arbiter among them).
pub(super) const SPILL_QUIET: Duration = Duration::from_secs(5);

/// What each process borrows from the pool (by host pid), and what the disk tier's
/// tick must find: the bytes of takes waiting for room, and whom it asked when.
#[derive(Debug, Default)]
pub(super) struct Book {
    inner: Mutex<BookInner>,
}

#[derive(Debug, Default)]
struct BookInner {
    held: HashMap<u32, u64>,
    asked: HashMap<u32, Instant>,
    /// When each process was last asked to spill or spilled ([`SPILL_QUIET`]).
    spilled: HashMap<u32, Instant>,
    /// The largest take now waiting for room.
    short: u64,
}

impl Book {
    fn lock(&self) -> std::sync::MutexGuard<'_, BookInner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn add(&self, pid: u32, bytes: u64) {
        *self.lock().held.entry(pid).or_default() += bytes;
    }

    fn sub(&self, pid: u32, bytes: u64) {
        let mut b = self.lock();
        if let Some(h) = b.held.get_mut(&pid) {
            *h = h.saturating_sub(bytes);
            if *h == 0 {
                b.held.remove(&pid);
                b.asked.remove(&pid);
                b.spilled.remove(&pid);
            }
        }
    }

    /// Bytes of the pool process `pid` holds now (0 for an unknown pid).
    pub(crate) fn held(&self, pid: u32) -> u64 {
        if pid == 0 {
            return 0;
        }
        self.lock().held.get(&pid).copied().unwrap_or(0)
    }

    fn short(&self, bytes: u64) {
        let mut b = self.lock();
        b.short = b.short.max(bytes);
    }

    fn spilling(&self, pid: u32, now: Instant) {
        self.lock().spilled.insert(pid, now);
    }

    /// How long ago process `pid` was last asked to spill or spilled, if within
    /// [`SPILL_QUIET`].
    pub(super) fn spilled_lately(&self, pid: u32) -> Option<Duration> {
        let ago = self.lock().spilled.get(&pid)?.elapsed();
        (ago < SPILL_QUIET).then_some(ago)
    }
}

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
    // The process, to tell it from a later one with its pid: what it was lent stays
    // its own while it lives, even past this connection.
    let process = super::checkpoints::identity(host_pid);
    if send(&stream, &opened, &[]).await.is_err() {
        pool.release_owner(conn_id, alive(process));
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
                    // What earlier connections of this process left it counts too.
                    let holds = held + process.map_or(0, |p| pool.orphaned(p));
                    let reply = take(
                        &shared, &pool, conn_id, host_pid, &tenant, holds, bytes, ahead,
                    )
                    .await;
                    if let Ok((_, lent)) = &reply {
                        let n = lent.iter().map(|l| l.bytes).sum::<u64>();
                        held += n;
                        shared.pool_book.add(host_pid, n);
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
                    pool.keep(conn_id, process, &tenant, bytes.min(may));
                }
                ClientMsg::PoolGive { ids } => {
                    let n = pool.give(conn_id, &ids).min(held);
                    held -= n;
                    shared.pool_book.sub(host_pid, n);
                }
                ClientMsg::PoolSpill { ids } => {
                    shared.pool_book.spilling(host_pid, Instant::now());
                    let p = pool.clone();
                    let who = tenant.to_string();
                    let asked = ids.len();
                    let got =
                        tokio::task::spawn_blocking(move || p.spill(conn_id, &who, &ids)).await;
                    let files = match got {
                        Ok(Ok(files)) if files.len() == asked => Ok(files),
                        Ok(Ok(files)) => {
                            // Never: the pool moves all of a request or none. Said,
                            // not hidden; the client keeps what it was told of.
                            log_line!(
                                "WARN",
                                "swap pool: a spill of pid {host_pid} moved {} of {asked} slices",
                                files.len()
                            );
                            Ok(files)
                        }
                        Ok(Err(e)) => Err(refusal(&e)),
                        Err(e) => Err(format!("the swap pool failed: {e}")),
                    };
                    let msg = match &files {
                        Ok(files) => {
                            let n = files.iter().map(|f| f.bytes).sum::<u64>().min(held);
                            held -= n;
                            shared.pool_book.sub(host_pid, n);
                            ArbiterMsg::PoolSpilled {
                                files: files
                                    .iter()
                                    .map(|f| PoolSlice {
                                        id: f.id,
                                        bytes: f.bytes,
                                    })
                                    .collect(),
                            }
                        }
                        Err(message) => ArbiterMsg::PoolRefused {
                            message: message.clone(),
                        },
                    };
                    let fds: Vec<BorrowedFd<'_>> = match &files {
                        Ok(files) => files.iter().map(|f| f.fd.as_fd()).collect(),
                        Err(_) => Vec::new(),
                    };
                    if send(&stream, &msg, &fds).await.is_err() {
                        // The client may not have its spill files: the slices stay
                        // its own (the connection's end keeps them while it lives).
                        break 'conn;
                    }
                    // It has them: the slices are scrubbed now, never before.
                    pool.spill_sent(conn_id);
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
        if decoder.partial_frame().unwrap_or(0) > SMALL_FRAME {
            let _ = send(
                &stream,
                &error(ErrorCode::Oversize, "pool messages are small; closing"),
                &[],
            )
            .await;
            break;
        }
        let expired = sleep_until(frame_by);
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
    let back = pool.release_owner(conn_id, alive(process));
    shared.pool_book.sub(host_pid, held);
    if back > 0 {
        log_line!(
            "INFO",
            "pool connection of pid {host_pid} closed: {} MiB of the swap pool come back (scrubbed before anyone else gets them)",
            back >> 20
        );
    }
}

/// `process` if it still runs (the same pid, started at the same time).
fn alive(process: Option<Process>) -> Option<Process> {
    process.filter(|&p| runs(p))
}

fn runs((pid, start): Process) -> bool {
    kiwi_config::containers::process_start(pid as i32) == Some(start)
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
    // A swap-out that finds the pool full waits while the disk tier makes room.
    let start = pool.stats();
    let spills = !ahead && start.spill_dir.is_some();
    // Within half the grace period: the swap-out waiting here is a dropped holder's,
    // which the arbiter revokes past the grace.
    let grace = Duration::from_millis(shared.lock().cfg.grace_ms);
    let deadline = Instant::now() + SPILL_WAIT.min(grace / 2);
    // What this swap-out may still take: the room to ask the idle for at once, not
    // one buffer at a time.
    let short = bytes.max(allowance.saturating_sub(held));
    let got = loop {
        let p = pool.clone();
        let who = tenant.to_string();
        let got = tokio::task::spawn_blocking(move || p.take(conn_id, &who, bytes))
            .await
            .map_err(|e| format!("the swap pool failed: {e}"))?;
        match got {
            // Until the disk tier refuses a spill (full, missing): then no room comes.
            Err(PoolError::Full { .. })
                if spills
                    && Instant::now() < deadline
                    && pool.stats().spill_failures == start.spill_failures =>
            {
                shared.pool_book.short(short);
                tokio::time::sleep(SPILL_RETRY).await;
            }
            got => break got,
        }
    };
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
                // What connections that closed under a live process left it is
                // scrubbed once the process has exited.
                pool.reap(runs);
                reclaim(&shared, &pool);
            }
            _ = stop.changed() => return,
        }
    }
}

/// The free memory the disk tier keeps in the pool: what the holders of
/// oversubscribed GPUs will swap out next (`next`), at least a quarter of the pool,
/// at most all of it.
fn free_target(size: u64, next: u64) -> u64 {
    next.max(size / 4).min(size)
}

/// With a disk tier: when the pool's free memory is below [`free_target`] (what the
/// holders of oversubscribed GPUs will swap out next), or a take waits for room, asks the processes idle longest (none of whose clients holds or
/// waits for a GPU) to give back what they borrow, enough to cover the shortfall,
/// each at most once per [`ASK_EVERY`].
fn reclaim(shared: &Shared, pool: &Pool) {
    let s = pool.stats();
    if s.spill_dir.is_none() {
        return;
    }
    let free = s.size.saturating_sub(s.lent + s.populating + s.scrubbing);
    let next = {
        let st = shared.lock();
        st.gpus
            .values()
            .map(|g| g.sched.next_swap_out())
            .fold(0u64, u64::saturating_add)
    };
    let now = Instant::now();
    let (mut want, held) = {
        let mut b = shared.pool_book.lock();
        let short = std::mem::take(&mut b.short);
        let want = free_target(s.size, next).max(short).saturating_sub(free);
        let asked = &b.asked;
        let held: Vec<(u32, u64)> = b
            .held
            .iter()
            .filter(|(pid, _)| {
                asked
                    .get(pid)
                    .is_none_or(|t| now.duration_since(*t) >= ASK_EVERY)
            })
            .map(|(&pid, &h)| (pid, h))
            .collect();
        (want, held)
    };
    if want == 0 || held.is_empty() {
        return;
    }
    let asks = {
        let st = shared.lock();
        // Each candidate's standing (idle before waiting, then its last activity,
        // the latest over its clients) and a connection to ask on; a process with a
        // client holding a GPU is never asked (it swaps now, or soon).
        let mut idle: Vec<(bool, u64, u32, u64, u64)> = Vec::new();
        for (pid, bytes) in held {
            let (mut waits, mut last) = (false, 0u64);
            let mut to = None;
            let mut busy = false;
            for (&id, c) in st.clients.iter() {
                if c.process.is_none_or(|(p, _)| p != pid) {
                    continue;
                }
                let standing = c
                    .gpu
                    .as_ref()
                    .and_then(|g| st.gpus.get(g))
                    .map(|g| g.sched.activity(id));
                match standing {
                    Some(Some((w, t))) => {
                        waits |= w;
                        last = last.max(t);
                        to.get_or_insert(id);
                    }
                    Some(None) => busy = true,
                    None => {}
                }
            }
            if let (false, Some(to)) = (busy, to) {
                idle.push((waits, last, pid, to, bytes));
            }
        }
        idle.sort_unstable();
        let mut asks = Vec::new();
        for (_, _, pid, to, bytes) in idle {
            if want == 0 {
                break;
            }
            let ask = bytes.min(want);
            want -= ask;
            if let Some(c) = st.clients.get(&to) {
                c.peer.send(&ArbiterMsg::PoolReclaim { bytes: ask });
                asks.push((pid, ask));
            }
        }
        asks
    };
    let mut b = shared.pool_book.lock();
    for (pid, ask) in asks {
        b.asked.insert(pid, now);
        b.spilled.insert(pid, now);
        log_line!(
            "INFO",
            "swap pool: {} MiB free of {} MiB; asked pid {pid} (idle longest) to move up to {} MiB of its swapped-out memory to the disk tier",
            free >> 20,
            s.size >> 20,
            ask >> 20
        );
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
        memfds: s.memfds as u64,
        tenants,
        spill: s.spill_dir.clone().map(|dir| {
            let mut tenants = s.spilled_tenants.clone();
            tenants.truncate(16);
            kiwi_protocol::SpillStatus {
                dir,
                spilled_bytes: s.spilled,
                budget_bytes: s.spill_budget,
                files: s.spill_files as u64,
                failures: s.spill_failures,
                tenants,
                last_error: s.last_spill_error.clone(),
            }
        }),
    }
}
