//! The driver's checkpoint API (`cuCheckpointProcess*`, driver 570 / CUDA 12.8): one
//! process locks, checkpoints, restores and unlocks another by pid. The sources and
//! what the real driver does are in `docs/checkpoint.md`.
//!
//! As on the real driver, the work happens inside the target process, on a thread the
//! driver starts there (the "restore thread", whose id
//! `cuCheckpointProcessGetRestoreThreadId` returns): `cuInit` starts it, serving a
//! socket at [`kiwi_sim_core::machine::checkpoint_socket_path`] (mode 0600, so only
//! the process's user or root can reach it); a caller connects to it through
//! `/proc/<pid>/root`, so a process in a container is reached by its host pid. A pid
//! without that socket has no CUDA state: `CUDA_ERROR_INVALID_VALUE`.
//!
//! This module owns the process's state and its gate: every export but the
//! checkpoint calls and the error strings enters [`enter`] first, which blocks while
//! the process is not RUNNING. Lock stops new calls, waits for the calls in progress
//! to return and then for every context's submitted work (until its timeout); a
//! checkpoint takes the process's device memory, contexts and modules off the GPU's
//! capacity in the machine segment, moves the bytes out of the GPUs' memory files
//! into the process's own host memory (as the driver does; no call can touch them
//! meanwhile) and charges the modelled time; a restore moves them back (out of
//! memory when they no longer fit) and leaves the process LOCKED; unlock lets the
//! blocked calls go on.

use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU32, AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use kiwi_sim_core::machine::checkpoint_socket_path;

use crate::abi::*;
use crate::driver::{driver, Driver};
use crate::ffi::out;

/// This process's state (`CUprocessState`).
static STATE: AtomicU32 = AtomicU32::new(CU_PROCESS_STATE_RUNNING);
/// Calls past the gate right now.
static INFLIGHT: AtomicU64 = AtomicU64::new(0);
/// The restore thread's id (0: not started).
static RESTORE_TID: AtomicI32 = AtomicI32::new(0);
/// A legacy IPC handle was taken (`cuIpcGetMemHandle`): the process cannot be
/// checkpointed, as the real driver refuses CUDA IPC memory.
pub static IPC_EXPORTED: AtomicBool = AtomicBool::new(false);
/// Wakes blocked callers on unlock, and the locker when the last call leaves.
static GATE: Mutex<()> = Mutex::new(());
static GATE_CV: Condvar = Condvar::new();
/// What the last checkpoint took off each GPU, for the restore.
static SAVED: Mutex<Vec<u64>> = Mutex::new(Vec::new());

/// A call past the gate; leaving wakes a locker waiting for the last one.
pub struct Entered(());

impl Drop for Entered {
    fn drop(&mut self) {
        if INFLIGHT.fetch_sub(1, Ordering::SeqCst) == 1
            && STATE.load(Ordering::SeqCst) != CU_PROCESS_STATE_RUNNING
        {
            let _g = GATE.lock().unwrap_or_else(|e| e.into_inner());
            GATE_CV.notify_all();
        }
    }
}

/// The gate every export (but the checkpoint calls) passes: returns at once while the
/// process runs, and blocks while it is locked or checkpointed.
#[inline]
pub fn enter() -> Entered {
    loop {
        INFLIGHT.fetch_add(1, Ordering::SeqCst);
        if STATE.load(Ordering::SeqCst) == CU_PROCESS_STATE_RUNNING {
            return Entered(());
        }
        drop(Entered(()));
        let mut g = GATE.lock().unwrap_or_else(|e| e.into_inner());
        while STATE.load(Ordering::SeqCst) != CU_PROCESS_STATE_RUNNING {
            g = GATE_CV.wait(g).unwrap_or_else(|e| e.into_inner());
        }
    }
}

fn set_state(s: u32) {
    let _g = GATE.lock().unwrap_or_else(|e| e.into_inner());
    STATE.store(s, Ordering::SeqCst);
    GATE_CV.notify_all();
}

// ------------------------------------------------------------ the target's side

/// Starts the restore thread (once, from `cuInit`). A failure leaves the process
/// without the API, as a pid with no CUDA state; the reason goes to stderr.
pub fn start(d: &'static Driver) {
    let path = checkpoint_socket_path(&d.name, std::process::id());
    let _ = std::fs::remove_file(&path);
    let listener = match UnixListener::bind(&path) {
        Ok(l) => l,
        Err(e) => {
            eprintln!(
                "kiwi-sim libcuda: checkpoint socket {}: {e}",
                path.display()
            );
            return;
        }
    };
    let _ = std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600));
    // SAFETY: registers a plain function with no arguments to run at exit.
    unsafe { libc::atexit(remove_socket_at_exit) };
    let spawned = std::thread::Builder::new()
        .name("cuda-restore".into())
        .spawn(move || {
            // SAFETY: gettid has no preconditions.
            RESTORE_TID.store(unsafe { libc::gettid() }, Ordering::SeqCst);
            for conn in listener.incoming() {
                let Ok(conn) = conn else { continue };
                serve(d, conn);
            }
        });
    if let Err(e) = spawned {
        eprintln!("kiwi-sim libcuda: checkpoint thread: {e}");
    }
}

extern "C" fn remove_socket_at_exit() {
    if let Ok(d) = driver() {
        let _ = std::fs::remove_file(checkpoint_socket_path(&d.name, std::process::id()));
    }
}

/// Requests on the socket: 4 bytes of operation, 4 of argument (a lock's timeout in
/// ms); the answer: 4 bytes of `CUresult`, 4 of value.
const OP_STATE: u32 = 1;
const OP_TID: u32 = 2;
const OP_LOCK: u32 = 3;
pub(crate) const OP_CHECKPOINT: u32 = 4;
pub(crate) const OP_RESTORE: u32 = 5;
pub(crate) const OP_UNLOCK: u32 = 6;

fn serve(d: &'static Driver, mut conn: UnixStream) {
    if !peer_may_checkpoint(&conn) {
        return;
    }
    let mut req = [0u8; 8];
    if conn.read_exact(&mut req).is_err() {
        return;
    }
    let op = u32::from_le_bytes(req[..4].try_into().expect("4 bytes"));
    let arg = u32::from_le_bytes(req[4..].try_into().expect("4 bytes"));
    let (rc, value) = match op {
        OP_STATE => (CUDA_SUCCESS, STATE.load(Ordering::SeqCst) as i32),
        OP_TID => (CUDA_SUCCESS, RESTORE_TID.load(Ordering::SeqCst)),
        OP_LOCK => (lock(d, arg), 0),
        OP_CHECKPOINT => (checkpoint(d), 0),
        OP_RESTORE => (restore(d), 0),
        OP_UNLOCK => (unlock(), 0),
        _ => (CUDA_ERROR_INVALID_VALUE, 0),
    };
    let mut answer = [0u8; 8];
    answer[..4].copy_from_slice(&rc.to_le_bytes());
    answer[4..].copy_from_slice(&value.to_le_bytes());
    let _ = conn.write_all(&answer);
}

/// Root, or the process's own user (the socket's mode already keeps others out).
fn peer_may_checkpoint(conn: &UnixStream) -> bool {
    use std::os::fd::AsRawFd;
    let mut cred = libc::ucred {
        pid: 0,
        uid: u32::MAX,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: SO_PEERCRED fills a ucred of the given length on a valid socket.
    let rc = unsafe {
        libc::getsockopt(
            conn.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    // SAFETY: geteuid has no preconditions.
    rc == 0 && (cred.uid == 0 || cred.uid == unsafe { libc::geteuid() })
}

fn lock(d: &'static Driver, timeout_ms: u32) -> CUresult {
    if STATE
        .compare_exchange(
            CU_PROCESS_STATE_RUNNING,
            CU_PROCESS_STATE_LOCKED,
            Ordering::SeqCst,
            Ordering::SeqCst,
        )
        .is_err()
    {
        return CUDA_ERROR_ILLEGAL_STATE;
    }
    let deadline =
        (timeout_ms > 0).then(|| Instant::now() + Duration::from_millis(timeout_ms.into()));
    // The calls in progress return first (new ones wait at the gate)...
    let mut in_time = true;
    {
        let mut g = GATE.lock().unwrap_or_else(|e| e.into_inner());
        while INFLIGHT.load(Ordering::SeqCst) > 0 {
            match deadline {
                None => g = GATE_CV.wait(g).unwrap_or_else(|e| e.into_inner()),
                Some(dl) => {
                    let now = Instant::now();
                    if now >= dl {
                        in_time = false;
                        break;
                    }
                    g = GATE_CV
                        .wait_timeout(g, dl - now)
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                }
            }
        }
    }
    // ...then the work they submitted, stream callbacks included.
    if in_time {
        let contexts = d.contexts.all();
        in_time = contexts.iter().all(|c| c.wait_all_until(deadline));
    }
    if !in_time {
        // The header: "If timeoutMs is specified and the timeout is reached the
        // process will be left in the RUNNING state upon return."
        set_state(CU_PROCESS_STATE_RUNNING);
        return CUDA_ERROR_NOT_READY;
    }
    CUDA_SUCCESS
}

fn checkpoint(d: &'static Driver) -> CUresult {
    if STATE.load(Ordering::SeqCst) != CU_PROCESS_STATE_LOCKED {
        return CUDA_ERROR_ILLEGAL_STATE;
    }
    if IPC_EXPORTED.load(Ordering::SeqCst) || d.mem.holds_unmovable() {
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    let t0 = Instant::now();
    // The bytes move into this process's host memory, as the driver's checkpoint
    // moves them into host memory of the process (its cgroup pays).
    if !d.mem.to_host() {
        d.mem.to_device();
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    let saved: Vec<u64> = (0..d.gpus).map(|g| d.machine.own_bytes(g)).collect();
    for (g, &b) in saved.iter().enumerate() {
        if b > 0 {
            d.machine.release(g as u32, b);
        }
    }
    let total: u64 = saved.iter().sum();
    *SAVED.lock().unwrap_or_else(|e| e.into_inner()) = saved;
    charge(t0, d.checkpoint_s, d.checkpoint_bps, total);
    STATE.store(CU_PROCESS_STATE_CHECKPOINTED, Ordering::SeqCst);
    CUDA_SUCCESS
}

fn restore(d: &'static Driver) -> CUresult {
    if STATE.load(Ordering::SeqCst) != CU_PROCESS_STATE_CHECKPOINTED {
        return CUDA_ERROR_ILLEGAL_STATE;
    }
    let t0 = Instant::now();
    let saved = SAVED.lock().unwrap_or_else(|e| e.into_inner()).clone();
    for (g, &b) in saved.iter().enumerate() {
        if b == 0 {
            continue;
        }
        if d.machine.reserve(g as u32, b).is_err() {
            // What others took meanwhile leaves no room: nothing comes back, the
            // process stays CHECKPOINTED and can be restored later.
            for (h, &c) in saved.iter().enumerate().take(g) {
                if c > 0 {
                    d.machine.release(h as u32, c);
                }
            }
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
    }
    if !d.mem.to_device() {
        // The file has no room for what fits the capacity (fragmented by others'
        // granule rounding): as out of memory; what moved back goes out again.
        d.mem.to_host();
        for (g, &c) in saved.iter().enumerate() {
            if c > 0 {
                d.machine.release(g as u32, c);
            }
        }
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    charge(t0, d.restore_s, d.restore_bps, saved.iter().sum());
    STATE.store(CU_PROCESS_STATE_LOCKED, Ordering::SeqCst);
    CUDA_SUCCESS
}

fn unlock() -> CUresult {
    if STATE.load(Ordering::SeqCst) != CU_PROCESS_STATE_LOCKED {
        return CUDA_ERROR_ILLEGAL_STATE;
    }
    set_state(CU_PROCESS_STATE_RUNNING);
    CUDA_SUCCESS
}

/// Sleeps until `fixed_s` plus `bytes` at `bps` (0: free) have passed since `t0`.
fn charge(t0: Instant, fixed_s: f64, bps: f64, bytes: u64) {
    let mut s = fixed_s;
    if bps > 0.0 {
        s += bytes as f64 / bps;
    }
    let due = t0 + Duration::from_secs_f64(s);
    let now = Instant::now();
    if due > now {
        std::thread::sleep(due - now);
    }
}

// ------------------------------------------------------------ the caller's side

/// Sends one request to process `pid` and returns its answer.
fn ask(pid: i32, op: u32, arg: u32) -> Result<i32, CUresult> {
    let d = driver()?;
    if !d.checkpoint_api {
        return Err(CUDA_ERROR_NOT_SUPPORTED);
    }
    if pid <= 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let inner = namespace_pid(pid).ok_or(CUDA_ERROR_INVALID_VALUE)?;
    let path = std::path::Path::new(&format!("/proc/{pid}/root")).join(
        checkpoint_socket_path(&d.name, inner)
            .strip_prefix("/")
            .expect("absolute"),
    );
    // No socket (or a stale one of a dead process): no CUDA state there.
    let mut conn = UnixStream::connect(&path).map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
    let mut req = [0u8; 8];
    req[..4].copy_from_slice(&op.to_le_bytes());
    req[4..].copy_from_slice(&arg.to_le_bytes());
    conn.write_all(&req).map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
    let mut answer = [0u8; 8];
    // A target that dies (or refuses the caller) mid-request answers nothing.
    conn.read_exact(&mut answer)
        .map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
    let rc = CUresult::from_le_bytes(answer[..4].try_into().expect("4 bytes"));
    let value = i32::from_le_bytes(answer[4..].try_into().expect("4 bytes"));
    if rc != CUDA_SUCCESS {
        return Err(rc);
    }
    Ok(value)
}

/// `pid`'s number in its own (innermost) pid namespace, from `/proc/<pid>/status`.
fn namespace_pid(pid: i32) -> Option<u32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("NSpid:"))?;
    line.split_whitespace().last()?.parse().ok()
}

/// Reserved fields must be zero (the header: "must be zeroed").
fn reserved_zero(args: *const u64, words: usize) -> Result<(), CUresult> {
    if args.is_null() {
        return Ok(());
    }
    for i in 0..words {
        // SAFETY: the C API contract: a non-NULL args points to the whole struct,
        // `words` 64-bit words long.
        if unsafe { args.add(i).read_unaligned() } != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
    }
    Ok(())
}

/// `cuCheckpointProcessGetState`.
pub(crate) fn get_state(pid: i32, state: *mut u32) -> Result<(), CUresult> {
    if state.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let s = ask(pid, OP_STATE, 0)?;
    out(state, s as u32)
}

/// `cuCheckpointProcessGetRestoreThreadId`.
pub(crate) fn restore_thread_id(pid: i32, tid: *mut i32) -> Result<(), CUresult> {
    if tid.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let t = ask(pid, OP_TID, 0)?;
    out(tid, t)
}

/// `cuCheckpointProcessLock`; `CUcheckpointLockArgs`: `timeoutMs` (u32),
/// `reserved0` (u32), `reserved1[7]`.
pub(crate) fn lock_process(pid: i32, args: *const u64) -> Result<(), CUresult> {
    let timeout_ms = if args.is_null() {
        0
    } else {
        // SAFETY: the C API contract: a non-NULL args points to a whole
        // CUcheckpointLockArgs (8 words).
        let first = unsafe { args.read_unaligned() };
        if first >> 32 != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: as above; words 1..8 are `reserved1`.
        reserved_zero(unsafe { args.add(1) }, 7)?;
        first as u32
    };
    ask(pid, OP_LOCK, timeout_ms).map(drop)
}

/// `cuCheckpointProcessCheckpoint` ([`OP_CHECKPOINT`]), `…Restore`
/// ([`OP_RESTORE`]), `…Unlock` ([`OP_UNLOCK`]): their arguments are all reserved
/// (8 words).
pub(crate) fn request(pid: i32, args: *const u64, op: u32) -> Result<(), CUresult> {
    reserved_zero(args, 8)?;
    ask(pid, op, 0).map(drop)
}
