//! CUDA IPC of the shim's allocations: `cuIpcGetMemHandle`, `cuIpcOpenMemHandle`
//! (`_v2`) and `cuIpcCloseMemHandle`. The driver refuses legacy IPC of VMM memory,
//! which every shim allocation is, so the shim does it over VMM's own sharing.
//!
//! - Every shim allocation's physical handles are created asking for
//!   `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR` ([`crate::devices::alloc_prop`]; a driver that refuses
//!   that type gets plain handles, and the shim's IPC is then off).
//! - **Exporter**: `cuIpcGetMemHandle(ptr)` pins the allocation holding `ptr` (taking
//!   the turn first, as a submission would, if it is swapped out): a pinned segment is
//!   never evicted, so its physical handles stay those importers mapped, and its bytes
//!   count as memory no swap frees ([`crate::mem::Memory::pin_shared`]). The 64-byte
//!   handle holds a magic, the exporter's pid and device, the allocation's base and
//!   size, a 128-bit random token (the capability) and the id of the exporter's
//!   broker. The broker is a thread (started with the first export) listening on the
//!   abstract Unix socket `kiwi-ipc.<pid>.<broker id>`; it hands the segments'
//!   shareable fds (`SCM_RIGHTS`) to whoever presents a live token.
//! - **Importer**: `cuIpcOpenMemHandle` connects (checking with `SO_PEERCRED` that the
//!   exporter's pid answers), presents the token, receives the layout and the fds,
//!   imports them (`cuMemImportFromShareableHandle`), maps them into a VA range of
//!   its own and grants its device read-write access. The connection stays open
//!   while the memory is open: it is the open count the exporter sees.
//!   `cuIpcCloseMemHandle` unmaps, frees the range and closes the connection.
//! - **The pin rule**: an allocation is pinned from its `cuIpcGetMemHandle` until the
//!   first importer connects (that pin becomes the importer's), and while any importer
//!   holds it open (one pin per connection). When the last connection closes it may
//!   be swapped again; a later open (or `cuIpcGetMemHandle`) pins it again, waiting
//!   for the exporter's turn if it was swapped out meanwhile. Freeing it ends the
//!   share (its pins go; importers keep their own mappings, as with the driver).
//! - Handles without the shim's magic (from processes without Kiwi) go to the driver.
//!
//! Wire format (little-endian): the handle is `KIWIIPC1`, pid u32, device u32, base
//! u64, size u64, token [16], broker id u64, 8 zero bytes. The request is
//! `KIWIREQ1`, token [16], base u64. The reply is `KIWIREP1`, status u32 (a
//! `CUresult`; not 0: nothing follows), segments u32, base u64, size u64, offset of
//! the allocation in the first segment u64, total bytes u64; then per segment its
//! size u64 sent with its fd.
//!
//! Hostile input: a wrong token, a garbage handle or reply, a peer that never answers
//! get an error code, never a hang (timeouts on every read and write) or a crash. The
//! broker holds at most [`MAX_CONNECTIONS`] open connections and [`MAX_PENDING`]
//! unauthenticated ones ([`MAX_PENDING_PER_UID`] per user), each for
//! [`REQUEST_DEADLINE`] and [`REQUEST_LEN`] bytes; a connection that sends anything
//! after its request is closed.

use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use crate::cuda::*;
use crate::devices::{exportable, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR};
use crate::mem::PinError;
use crate::real::original_of;
use crate::symbols::Sym;

/// `CUipcMemHandle`: 64 opaque bytes, passed by value.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CUipcMemHandle {
    pub reserved: [u8; 64],
}

const CUDA_ERROR_MAP_FAILED: CUresult = 205;
const CUDA_ERROR_OPERATING_SYSTEM: CUresult = 304;
const CUDA_ERROR_INVALID_HANDLE: CUresult = 400;
const CUDA_ERROR_TOO_MANY_PEERS: CUresult = 711;
const CUDA_ERROR_TIMEOUT: CUresult = 909;
const CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS: Uint = 1;

/// First bytes of a handle the shim made.
const MAGIC: &[u8; 8] = b"KIWIIPC1";
const REQUEST_MAGIC: &[u8; 8] = b"KIWIREQ1";
const REPLY_MAGIC: &[u8; 8] = b"KIWIREP1";
/// Request: magic, token, base.
pub const REQUEST_LEN: usize = 32;
/// Reply header: magic, status, segments, base, size, offset, total.
const REPLY_LEN: usize = 48;
/// Most open importer connections the broker keeps.
pub const MAX_CONNECTIONS: usize = 1024;
/// Most connections that have not sent their request yet.
pub const MAX_PENDING: usize = 32;
/// Most of those from one user (`SO_PEERCRED`): another tenant's silent connections
/// cannot take every place.
pub const MAX_PENDING_PER_UID: usize = 8;
/// How long a new connection has to send its request (an importer sends it at once
/// after connecting).
pub const REQUEST_DEADLINE: Duration = Duration::from_millis(500);
/// Most segments an importer accepts (64 MiB each: 4 TiB).
const MAX_SEGMENTS: u32 = 1 << 16;
/// How long the broker may take to send a reply once it has it.
const SEND_TIMEOUT: Duration = Duration::from_secs(2);

// ---------------------------------------------------------------- the handle

/// What a shim handle says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Handle {
    pid: u32,
    device: u32,
    base: u64,
    size: u64,
    token: [u8; 16],
    broker: u64,
}

impl Handle {
    fn encode(&self) -> CUipcMemHandle {
        let mut b = [0u8; 64];
        b[..8].copy_from_slice(MAGIC);
        b[8..12].copy_from_slice(&self.pid.to_le_bytes());
        b[12..16].copy_from_slice(&self.device.to_le_bytes());
        b[16..24].copy_from_slice(&self.base.to_le_bytes());
        b[24..32].copy_from_slice(&self.size.to_le_bytes());
        b[32..48].copy_from_slice(&self.token);
        b[48..56].copy_from_slice(&self.broker.to_le_bytes());
        CUipcMemHandle { reserved: b }
    }

    /// `None`: not a shim handle (the driver's business).
    fn decode(h: &CUipcMemHandle) -> Option<Handle> {
        let b = &h.reserved;
        if &b[..8] != MAGIC || b[56..].iter().any(|&x| x != 0) {
            return None;
        }
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        Some(Handle {
            pid: u32_at(8),
            device: u32_at(12),
            base: u64_at(16),
            size: u64_at(24),
            token: b[32..48].try_into().expect("16 bytes"),
            broker: u64_at(48),
        })
    }
}

fn broker_name(pid: u32, broker: u64) -> String {
    format!("kiwi-ipc.{pid}.{broker:016x}")
}

fn random_bytes<const N: usize>() -> [u8; N] {
    let mut b = [0u8; N];
    let mut got = 0;
    while got < N {
        // SAFETY: writes at most N - got bytes into our own buffer.
        let r = unsafe { libc::getrandom(b[got..].as_mut_ptr().cast(), N - got, 0) };
        if r > 0 {
            got += r as usize;
        } else if std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
            panic!("getrandom failed: {}", std::io::Error::last_os_error());
        }
    }
    b
}

// ---------------------------------------------------------------- driver calls

macro_rules! call {
    ($sym:ident : fn($($ty:ty),*) ($($arg:expr),*)) => {{
        let p = original_of(Sym::$sym);
        if p.is_null() {
            Err(crate::cuda::CUDA_ERROR_NOT_FOUND)
        } else {
            // SAFETY: the driver's own symbol of this name, with cuda.h's signature.
            let f = unsafe { std::mem::transmute::<*mut c_void, unsafe extern "C" fn($($ty),*) -> CUresult>(p) };
            // SAFETY: arguments valid per cuda.h (pointers to live locals).
            match unsafe { f($($arg),*) } {
                CUDA_SUCCESS => Ok(()),
                e => Err(e),
            }
        }
    }};
}

fn current_device() -> Result<CUdevice, CUresult> {
    let mut d: CUdevice = 0;
    call!(cuCtxGetDevice: fn(*mut CUdevice)(&mut d))?;
    Ok(d)
}

fn current_context() -> CUcontext {
    let mut c: CUcontext = std::ptr::null_mut();
    let _ = call!(cuCtxGetCurrent: fn(*mut CUcontext)(&mut c));
    c
}

// ---------------------------------------------------------------- exporter

/// One shared allocation of this process.
#[derive(Clone, Copy)]
struct Share {
    id: u64,
    device: usize,
    base: u64,
    /// The pin taken by `cuIpcGetMemHandle`, not yet handed to an importer.
    export_pin: bool,
    /// Importers with it open (one pin each).
    conns: u32,
}

#[derive(Default)]
struct Exports {
    by_token: HashMap<[u8; 16], Share>,
}

static EXPORTS: OnceLock<Mutex<Exports>> = OnceLock::new();

fn exports() -> MutexGuard<'static, Exports> {
    EXPORTS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner())
}

/// Shares kept before stale ones (freed allocations) are pruned.
const PRUNE_AT: usize = 4096;

/// Serializes the decisions to take, hand over and give back pins (held while a pin
/// waits for the turn: other exports and opens wait meanwhile).
static PIN_LOCK: Mutex<()> = Mutex::new(());

fn pin_lock() -> MutexGuard<'static, ()> {
    PIN_LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

/// Pins the allocation at `base` on device `d` for share `id`; if it is swapped
/// out, waits for the turn as a submission to `d` would and pins it during it.
fn pin_in_turn(d: usize, base: u64, id: u64, first: bool) -> Result<(), CUresult> {
    let try_pin = || {
        crate::devices::with_device_memory(d, |m| m.pin_shared(base, id, first))
            .unwrap_or(Err(PinError::Stale))
    };
    let gate = &crate::gate::GATE;
    for _ in 0..1000 {
        match try_pin() {
            Ok(()) => return Ok(()),
            Err(PinError::Stale) => return Err(CUDA_ERROR_INVALID_VALUE),
            Err(PinError::NotResident) => {}
        }
        // Inside the gate no drop can evict (it waits for us), and the gate opens
        // only over resident memory.
        if gate.try_enter() || gate.try_enter_device(d) {
            let r = try_pin();
            gate.exit();
            match r {
                Ok(()) => return Ok(()),
                Err(PinError::Stale) => return Err(CUDA_ERROR_INVALID_VALUE),
                Err(PinError::NotResident) => {}
            }
        }
        crate::client::acquire(gate, Some(d))?;
    }
    Err(CUDA_ERROR_OUT_OF_MEMORY)
}

fn unpin(s: &Share) {
    crate::devices::with_device_memory(s.device, |m| m.unpin_shared(s.base, s.id));
}

/// `cuIpcGetMemHandle`.
///
/// # Safety
/// `real` is the driver's original; `handle` is the caller's out-pointer.
pub unsafe fn get_mem_handle(
    real: unsafe extern "C" fn(*mut CUipcMemHandle, CUdeviceptr) -> CUresult,
    handle: *mut CUipcMemHandle,
    dptr: CUdeviceptr,
) -> CUresult {
    let found = crate::devices::with_allocation(dptr, |d, (base, size), m| {
        (d, base, size, m.share_id(base))
    });
    let Some((d, base, size, mem_id)) = found else {
        // SAFETY: forwarding the caller's arguments.
        return unsafe { real(handle, dptr) };
    };
    if handle.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    if !exportable() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    let broker = match Broker::get() {
        Ok(b) => b,
        Err(e) => {
            crate::kerror!("cuIpcGetMemHandle: cannot start the IPC broker: {e}");
            return CUDA_ERROR_OPERATING_SYSTEM;
        }
    };
    // Deciding whether to pin and recording it happen under PIN_LOCK, as in the
    // broker: a pin is never taken twice for one slot, nor lost.
    let _pinning = pin_lock();
    let (token, share) = {
        let mut ex = exports();
        if ex.by_token.len() >= PRUNE_AT {
            prune(&mut ex);
        }
        // The live share of this allocation, if any (one whose id the allocator still
        // knows: a share of a freed allocation at the same address is stale).
        let hit = ex
            .by_token
            .iter()
            .find(|(_, s)| s.device == d && s.base == base && Some(s.id) == mem_id)
            .map(|(t, s)| (*t, *s));
        match hit {
            Some(x) => x,
            None => {
                ex.by_token
                    .retain(|_, s| !(s.device == d && s.base == base && s.conns == 0));
                let s = Share {
                    id: mem_id.unwrap_or_else(|| u64::from_le_bytes(random_bytes()) | 1),
                    device: d,
                    base,
                    export_pin: false,
                    conns: 0,
                };
                let t = random_bytes();
                ex.by_token.insert(t, s);
                (t, s)
            }
        }
    };
    if !share.export_pin && share.conns == 0 {
        if let Err(e) = pin_in_turn(d, base, share.id, true) {
            return e;
        }
        if let Some(s) = exports().by_token.get_mut(&token) {
            s.export_pin = true;
        }
    }
    let h = Handle {
        pid: std::process::id(),
        device: d as u32,
        base,
        size,
        token,
        broker: broker.id,
    };
    // SAFETY: non-null out-pointer from the caller.
    unsafe { handle.write(h.encode()) };
    crate::kdebug!(
        "cuIpcGetMemHandle: {size} bytes at {base:#x} shared (pinned while exported or open)"
    );
    CUDA_SUCCESS
}

/// Drops shares whose allocation was freed and that nobody has open.
fn prune(ex: &mut Exports) {
    ex.by_token.retain(|_, s| {
        s.conns > 0
            || crate::devices::with_device_memory(s.device, |m| m.share_id(s.base) == Some(s.id))
                .unwrap_or(false)
    });
}

// ---------------------------------------------------------------- the broker

struct Broker {
    id: u64,
}

static BROKER: OnceLock<Result<Broker, String>> = OnceLock::new();

impl Broker {
    /// The process's broker, started on first use.
    fn get() -> Result<&'static Broker, String> {
        BROKER
            .get_or_init(|| {
                let id = u64::from_le_bytes(random_bytes());
                let name = broker_name(std::process::id(), id);
                let addr =
                    SocketAddr::from_abstract_name(name.as_bytes()).map_err(|e| e.to_string())?;
                let l = UnixListener::bind_addr(&addr).map_err(|e| format!("bind {name}: {e}"))?;
                l.set_nonblocking(true).map_err(|e| e.to_string())?;
                std::thread::Builder::new()
                    .name("kiwi-ipc".into())
                    .spawn(move || crate::ffi::inside(|| serve(l)))
                    .map_err(|e| e.to_string())?;
                Ok(Broker { id })
            })
            .as_ref()
            .map_err(Clone::clone)
    }
}

enum Conn {
    /// Waiting for the request.
    Pending {
        s: UnixStream,
        got: Vec<u8>,
        deadline: Instant,
        uid: u32,
    },
    /// Holding a pin for share `token` until it closes.
    Open { s: UnixStream, token: [u8; 16] },
}

impl Conn {
    fn fd(&self) -> RawFd {
        match self {
            Conn::Pending { s, .. } | Conn::Open { s, .. } => s.as_raw_fd(),
        }
    }
}

/// The broker's loop: accepts importers, serves their requests, and releases a pin
/// when its connection closes.
fn serve(l: UnixListener) {
    crate::capture::relax_this_thread();
    let mut conns: Vec<Conn> = Vec::new();
    let mut refusals = crate::log::Throttle::new(3);
    loop {
        let mut fds = Vec::with_capacity(conns.len() + 1);
        fds.push(libc::pollfd {
            fd: l.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        });
        fds.extend(conns.iter().map(|c| libc::pollfd {
            fd: c.fd(),
            events: libc::POLLIN,
            revents: 0,
        }));
        // SAFETY: polling an array of pollfds we own, of the length given.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 500) };
        if n < 0 && std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
            crate::kerror!(
                "IPC broker: poll failed: {}",
                std::io::Error::last_os_error()
            );
            std::thread::sleep(Duration::from_millis(100));
            continue;
        }
        let now = Instant::now();
        let mut keep = Vec::with_capacity(conns.len());
        for (c, p) in conns.into_iter().zip(&fds[1..]) {
            let ready = p.revents != 0;
            // A bug serving one importer must not take the broker down for all.
            let stepped =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| step(c, ready, now)));
            match stepped {
                Ok(Some(c)) => keep.push(c),
                Ok(None) => {}
                Err(_) => crate::kerror!("IPC broker: serving an importer panicked; dropped it"),
            }
        }
        conns = keep;
        if fds[0].revents != 0 {
            accept(&l, &mut conns, &mut refusals);
        }
    }
}

/// Refusals the broker says on stderr: 3 lines per 10 s at most (a connect flood
/// wrote one line per connection into the exporting application's stderr).
fn accept(l: &UnixListener, conns: &mut Vec<Conn>, refusals: &mut crate::log::Throttle) {
    loop {
        let s = match l.accept() {
            Ok((s, _)) => s,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
            Err(e) => {
                crate::kdebug!("IPC broker: accept failed: {e}");
                return;
            }
        };
        // Unknown credentials share one group.
        let uid = peer_cred(&s).map_or(u32::MAX, |c| c.uid);
        let (pending, mine) = conns.iter().fold((0, 0), |(all, mine), c| match c {
            Conn::Pending { uid: u, .. } => (all + 1, mine + usize::from(*u == uid)),
            Conn::Open { .. } => (all, mine),
        });
        if conns.len() >= MAX_CONNECTIONS || pending >= MAX_PENDING || mine >= MAX_PENDING_PER_UID {
            if let Some(note) = refusals.allow() {
                crate::kwarn!("IPC broker: too many importers; refusing one{note}");
            }
            let _ = refuse(&s, CUDA_ERROR_TOO_MANY_PEERS);
            continue;
        }
        if s.set_nonblocking(true).is_err() {
            continue;
        }
        conns.push(Conn::Pending {
            s,
            got: Vec::with_capacity(REQUEST_LEN),
            deadline: Instant::now() + REQUEST_DEADLINE,
            uid,
        });
    }
}

/// Advances one connection; `None` when it is closed (its pin given back).
fn step(c: Conn, ready: bool, now: Instant) -> Option<Conn> {
    match c {
        Conn::Pending {
            mut s,
            mut got,
            deadline,
            uid,
        } => {
            if !ready {
                return (now < deadline).then_some(Conn::Pending {
                    s,
                    got,
                    deadline,
                    uid,
                });
            }
            let mut buf = [0u8; REQUEST_LEN];
            let want = REQUEST_LEN - got.len();
            match s.read(&mut buf[..want]) {
                Ok(0) => None,
                Ok(k) => {
                    got.extend_from_slice(&buf[..k]);
                    if got.len() < REQUEST_LEN {
                        return (now < deadline).then_some(Conn::Pending {
                            s,
                            got,
                            deadline,
                            uid,
                        });
                    }
                    match answer(&s, &got) {
                        Ok(token) => Some(Conn::Open { s, token }),
                        Err(e) => {
                            let _ = refuse(&s, e);
                            None
                        }
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    (now < deadline).then_some(Conn::Pending {
                        s,
                        got,
                        deadline,
                        uid,
                    })
                }
                Err(_) => None,
            }
        }
        Conn::Open { mut s, token } => {
            if !ready {
                return Some(Conn::Open { s, token });
            }
            let mut b = [0u8; 1];
            match s.read(&mut b) {
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    Some(Conn::Open { s, token })
                }
                // End of file (closed), an error, or bytes it had no business sending.
                _ => {
                    close_share(&token);
                    None
                }
            }
        }
    }
}

/// An importer closed: its pin goes.
fn close_share(token: &[u8; 16]) {
    let _pinning = pin_lock();
    let s = {
        let mut ex = exports();
        let Some(s) = ex.by_token.get_mut(token) else {
            return;
        };
        s.conns = s.conns.saturating_sub(1);
        *s
    };
    unpin(&s);
}

/// Serves a complete request: takes a pin for the connection and sends the layout
/// and the segments' fds. `Err`: the status to refuse with.
fn answer(s: &UnixStream, req: &[u8]) -> Result<[u8; 16], CUresult> {
    if &req[..8] != REQUEST_MAGIC {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let token: [u8; 16] = req[8..24].try_into().expect("16 bytes");
    let base = u64::from_le_bytes(req[24..32].try_into().expect("8 bytes"));
    // Take the pin: the exporter's own, or a new one (in the exporter's turn).
    let share = {
        let _pinning = pin_lock();
        let (share, transferred) = {
            let mut ex = exports();
            let s = ex
                .by_token
                .get_mut(&token)
                .filter(|s| s.base == base)
                .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
            let transferred = std::mem::take(&mut s.export_pin);
            (*s, transferred)
        };
        if !transferred {
            pin_in_turn(share.device, share.base, share.id, false)?;
        }
        let mut ex = exports();
        let s = ex
            .by_token
            .get_mut(&token)
            .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        s.conns += 1;
        *s
    };
    match send_layout(s, &share) {
        Ok(()) => Ok(token),
        Err(e) => {
            close_share(&token);
            Err(e)
        }
    }
}

fn send_layout(s: &UnixStream, share: &Share) -> Result<(), CUresult> {
    let layout =
        crate::devices::with_device_memory(share.device, |m| m.shared_layout(share.base, share.id))
            .flatten()
            .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
    let mut fds = Vec::with_capacity(layout.segments.len());
    for &(_, h) in &layout.segments {
        let mut fd: c_int = -1;
        call!(cuMemExportToShareableHandle: fn(*mut c_void, CUmemGenericAllocationHandle, c_int, u64)
            ((&mut fd as *mut c_int).cast(), h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0))?;
        // SAFETY: the driver just made this descriptor for us.
        fds.push(unsafe { OwnedFd::from_raw_fd(fd) });
    }
    let total: u64 = layout.segments.iter().map(|&(n, _)| n).sum();
    let mut head = [0u8; REPLY_LEN];
    head[..8].copy_from_slice(REPLY_MAGIC);
    head[12..16].copy_from_slice(&(layout.segments.len() as u32).to_le_bytes());
    head[16..24].copy_from_slice(&layout.base.to_le_bytes());
    head[24..32].copy_from_slice(&layout.size.to_le_bytes());
    head[32..40].copy_from_slice(&layout.offset.to_le_bytes());
    head[40..48].copy_from_slice(&total.to_le_bytes());
    let io = |_| CUDA_ERROR_OPERATING_SYSTEM;
    s.set_nonblocking(false).map_err(io)?;
    s.set_write_timeout(Some(SEND_TIMEOUT)).map_err(io)?;
    let mut w = s;
    w.write_all(&head).map_err(io)?;
    for (&(n, _), fd) in layout.segments.iter().zip(&fds) {
        send_fd(s, &n.to_le_bytes(), fd.as_raw_fd()).map_err(io)?;
    }
    s.set_nonblocking(true).map_err(io)?;
    Ok(())
}

/// Best effort: tells a refused importer why (a header with only a status).
fn refuse(s: &UnixStream, status: CUresult) -> std::io::Result<()> {
    let mut head = [0u8; REPLY_LEN];
    head[..8].copy_from_slice(REPLY_MAGIC);
    head[8..12].copy_from_slice(&status.to_le_bytes());
    s.set_nonblocking(true)?;
    let mut w = s;
    w.write_all(&head)
}

fn send_fd(s: &UnixStream, data: &[u8], fd: RawFd) -> std::io::Result<()> {
    // SAFETY: CMSG_SPACE is a pure computation.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<c_int>() as u32) } as usize;
    let mut cbuf = vec![0u64; space.div_ceil(8)];
    let mut iov = libc::iovec {
        iov_base: data.as_ptr() as *mut c_void,
        iov_len: data.len(),
    };
    // SAFETY: zeroed msghdr is a valid empty header; filled in below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: msg_control points to `space` bytes, room for one cmsg with one int.
    unsafe {
        let c = libc::CMSG_FIRSTHDR(&msg);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<c_int>() as u32) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(c).cast::<c_int>(), fd);
    }
    // SAFETY: msg describes live buffers (data, cbuf) for the duration of the call.
    let r = unsafe { libc::sendmsg(s.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    if (r as usize) < data.len() {
        let mut w = s;
        w.write_all(&data[r as usize..])?;
    }
    Ok(())
}

/// Receives exactly `buf.len()` bytes and the one fd sent with them. Extra fds are
/// closed; none, or a truncated control message, is an error.
fn recv_fd(s: &UnixStream, buf: &mut [u8]) -> std::io::Result<OwnedFd> {
    const ROOM: usize = 4;
    // SAFETY: CMSG_SPACE is a pure computation.
    let space = unsafe { libc::CMSG_SPACE((ROOM * std::mem::size_of::<c_int>()) as u32) } as usize;
    let mut cbuf = vec![0u64; space.div_ceil(8)];
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: zeroed msghdr is a valid empty header; filled in below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: msg describes live buffers we own for the duration of the call.
    let r = unsafe { libc::recvmsg(s.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let mut got: Vec<OwnedFd> = Vec::new();
    // SAFETY: walking the control messages the kernel wrote into cbuf.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let n = ((*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize)
                    / std::mem::size_of::<c_int>();
                for k in 0..n {
                    let fd = std::ptr::read_unaligned(libc::CMSG_DATA(c).cast::<c_int>().add(k));
                    got.push(OwnedFd::from_raw_fd(fd));
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    let bad = |m: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, m.to_string());
    if msg.msg_flags & libc::MSG_CTRUNC != 0 {
        return Err(bad("truncated control message"));
    }
    if r == 0 {
        return Err(bad("closed"));
    }
    if (r as usize) < buf.len() {
        let mut rd = s;
        rd.read_exact(&mut buf[r as usize..])?;
    }
    // Any fds past the first are dropped (closed) here.
    got.into_iter().next().ok_or_else(|| bad("no descriptor"))
}

// ---------------------------------------------------------------- importer

/// Memory this process opened from another's handle.
struct Opened {
    token: [u8; 16],
    ctx: usize,
    ptr: CUdeviceptr,
    va: CUdeviceptr,
    total: u64,
    /// The mappings' lengths, in address order from `va`.
    lens: Vec<u64>,
    refs: u32,
    /// The connection to the exporter's broker: open while the memory is.
    _conn: UnixStream,
}

static OPENED: Mutex<Vec<Opened>> = Mutex::new(Vec::new());

fn opened() -> MutexGuard<'static, Vec<Opened>> {
    OPENED.lock().unwrap_or_else(|p| p.into_inner())
}

/// How long an importer waits for the exporter's answer (the exporter may have to
/// wait for its turn to pin memory that was swapped out): `KIWI_IPC_TIMEOUT_MS`,
/// default 30 s.
fn reply_timeout() -> Duration {
    static T: OnceLock<Duration> = OnceLock::new();
    *T.get_or_init(|| {
        std::env::var("KIWI_IPC_TIMEOUT_MS")
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
            .filter(|&ms| ms > 0)
            .map_or(Duration::from_secs(30), Duration::from_millis)
    })
}

/// `cuIpcOpenMemHandle` and `_v2`.
///
/// # Safety
/// `real` is the driver's original; `pdptr` is the caller's out-pointer.
pub unsafe fn open_mem_handle(
    real: unsafe extern "C" fn(*mut CUdeviceptr, CUipcMemHandle, Uint) -> CUresult,
    pdptr: *mut CUdeviceptr,
    handle: CUipcMemHandle,
    flags: Uint,
) -> CUresult {
    let Some(h) = Handle::decode(&handle) else {
        // SAFETY: forwarding the caller's arguments.
        return unsafe { real(pdptr, handle, flags) };
    };
    if pdptr.is_null() || flags & !CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS != 0 {
        return CUDA_ERROR_INVALID_VALUE;
    }
    let ctx = current_context();
    if ctx.is_null() {
        return CUDA_ERROR_INVALID_CONTEXT;
    }
    if h.pid == std::process::id() {
        // The driver refuses a process opening its own handle.
        return CUDA_ERROR_INVALID_CONTEXT;
    }
    {
        let mut o = opened();
        if let Some(m) = o
            .iter_mut()
            .find(|m| m.token == h.token && m.ctx == ctx as usize)
        {
            m.refs += 1;
            // SAFETY: non-null out-pointer from the caller.
            unsafe { pdptr.write(m.ptr) };
            return CUDA_SUCCESS;
        }
    }
    // A broker full of other importers (CUDA_ERROR_TOO_MANY_PEERS) frees a place
    // when one is served or times out: asked again, with backoff, until the IPC
    // timeout (a flood of silent connections made every honest open fail at once).
    let deadline = Instant::now() + reply_timeout();
    let mut pause = Duration::from_millis(10);
    let imported = loop {
        match import(&h, ctx) {
            Err((CUDA_ERROR_TOO_MANY_PEERS, _)) if Instant::now() + pause < deadline => {
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(250));
            }
            r => break r,
        }
    };
    match imported {
        Ok(m) => {
            // SAFETY: non-null out-pointer from the caller.
            unsafe { pdptr.write(m.ptr) };
            opened().push(m);
            CUDA_SUCCESS
        }
        Err((code, why)) => {
            crate::kwarn!(
                "cuIpcOpenMemHandle: cannot open the memory of pid {} ({} bytes): {why}",
                h.pid,
                h.size
            );
            code
        }
    }
}

type Failure = (CUresult, String);

fn import(h: &Handle, ctx: CUcontext) -> Result<Opened, Failure> {
    let device = current_device().map_err(|e| (e, "no current device".to_string()))?;
    let timeout = reply_timeout();
    let s = connect(&broker_name(h.pid, h.broker), timeout).map_err(|e| {
        (
            CUDA_ERROR_INVALID_HANDLE,
            format!("the exporter does not answer: {e}"),
        )
    })?;
    let io = |what: &'static str| {
        move |e: std::io::Error| {
            let code = if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) {
                CUDA_ERROR_TIMEOUT
            } else {
                CUDA_ERROR_INVALID_HANDLE
            };
            (code, format!("{what}: {e}"))
        }
    };
    // The socket's name is public: the peer must be the exporter itself.
    let peer = peer_pid(&s).map_err(io("peer credentials"))?;
    if peer != h.pid {
        return Err((
            CUDA_ERROR_INVALID_HANDLE,
            format!("pid {peer} answers for pid {}", h.pid),
        ));
    }
    let mut req = [0u8; REQUEST_LEN];
    req[..8].copy_from_slice(REQUEST_MAGIC);
    req[8..24].copy_from_slice(&h.token);
    req[24..32].copy_from_slice(&h.base.to_le_bytes());
    let sent = (&s).write_all(&req);
    let mut head = [0u8; REPLY_LEN];
    let mut got = 0;
    let read = loop {
        match (&s).read(&mut head[got..]) {
            Ok(0) => break Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(k) => {
                got += k;
                if got == REPLY_LEN {
                    break Ok(());
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => break Err(e),
        }
    };
    // Closed without a word: the broker dropped the connection at its request
    // deadline before the request came (this thread was descheduled past it), as
    // busy as a full broker: asked again.
    if got == 0
        && read
            .as_ref()
            .is_err_and(|e| e.kind() == std::io::ErrorKind::UnexpectedEof)
    {
        return Err((
            CUDA_ERROR_TOO_MANY_PEERS,
            "the exporter closed the connection before answering".into(),
        ));
    }
    // A full broker refuses at accept and closes: the request may then meet a closed
    // socket (EPIPE) while the refusal waits to be read. The reply, when there is
    // one, says why.
    if let Err(e) = sent {
        if read.is_err() || &head[..8] != REPLY_MAGIC {
            return Err(io("sending the request")(e));
        }
    }
    read.map_err(io("reading the reply"))?;
    let u32_at = |i: usize| u32::from_le_bytes(head[i..i + 4].try_into().expect("4 bytes"));
    let u64_at = |i: usize| u64::from_le_bytes(head[i..i + 8].try_into().expect("8 bytes"));
    if &head[..8] != REPLY_MAGIC {
        return Err((CUDA_ERROR_INVALID_HANDLE, "not a Kiwi IPC reply".into()));
    }
    let status = u32_at(8) as CUresult;
    if status != CUDA_SUCCESS {
        return Err((
            status,
            format!("the exporter refused (CUDA error {status})"),
        ));
    }
    let (n, base, size, offset, total) =
        (u32_at(12), u64_at(16), u64_at(24), u64_at(32), u64_at(40));
    let sane = n > 0
        && n <= MAX_SEGMENTS
        && base == h.base
        && size == h.size
        && size > 0
        && offset.checked_add(size).is_some_and(|end| end <= total)
        && total <= u64::from(n) * (crate::mem::SEGMENT_MAX.max(2 << 20) * 2);
    if !sane {
        return Err((
            CUDA_ERROR_INVALID_HANDLE,
            format!("a malformed layout ({n} segments, {total} bytes)"),
        ));
    }
    // Receive and import every segment before mapping anything.
    let mut handles: Vec<(u64, CUmemGenericAllocationHandle)> = Vec::with_capacity(n as usize);
    let release_all = |hs: &[(u64, CUmemGenericAllocationHandle)]| {
        for &(_, x) in hs {
            let _ = call!(cuMemRelease: fn(CUmemGenericAllocationHandle)(x));
        }
    };
    let mut sum = 0u64;
    for _ in 0..n {
        let mut b = [0u8; 8];
        let fd = match recv_fd(&s, &mut b) {
            Ok(fd) => fd,
            Err(e) => {
                release_all(&handles);
                return Err(io("receiving a segment")(e));
            }
        };
        let len = u64::from_le_bytes(b);
        let mut ph: CUmemGenericAllocationHandle = 0;
        let r = call!(cuMemImportFromShareableHandle: fn(*mut CUmemGenericAllocationHandle, *mut c_void, c_int)
            (&mut ph, fd.as_raw_fd() as usize as *mut c_void, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
        drop(fd);
        if let Err(e) = r {
            release_all(&handles);
            return Err((e, format!("importing a segment failed with CUDA error {e}")));
        }
        handles.push((len, ph));
        sum = sum.saturating_add(len);
    }
    if sum != total {
        release_all(&handles);
        return Err((
            CUDA_ERROR_INVALID_HANDLE,
            format!("segments of {sum} bytes, {total} announced"),
        ));
    }
    let mapped = map_all(&handles, total, device);
    // The mappings keep the memory; the handles are no longer needed.
    release_all(&handles);
    let va = mapped.map_err(|e| (e, format!("mapping failed with CUDA error {e}")))?;
    Ok(Opened {
        token: h.token,
        ctx: ctx as usize,
        ptr: va + offset,
        va,
        total,
        lens: handles.iter().map(|&(n, _)| n).collect(),
        refs: 1,
        _conn: s,
    })
}

/// Reserves `total` bytes of VA, maps the handles one after the other and grants
/// `device` read-write access; undone on failure.
fn map_all(
    handles: &[(u64, CUmemGenericAllocationHandle)],
    total: u64,
    device: CUdevice,
) -> Result<CUdeviceptr, CUresult> {
    let mut va: CUdeviceptr = 0;
    call!(cuMemAddressReserve: fn(*mut CUdeviceptr, usize, usize, CUdeviceptr, u64)
        (&mut va, total as usize, 0, 0, 0))?;
    let mut at = 0u64;
    let undo = |at: u64| {
        if at > 0 {
            let _ = call!(cuMemUnmap: fn(CUdeviceptr, usize)(va, at as usize));
        }
        let _ = call!(cuMemAddressFree: fn(CUdeviceptr, usize)(va, total as usize));
    };
    for &(len, h) in handles {
        if let Err(e) = call!(cuMemMap: fn(CUdeviceptr, usize, usize, CUmemGenericAllocationHandle, u64)
            (va + at, len as usize, 0, h, 0))
        {
            unmap_each(handles, va, at);
            undo(0);
            return Err(if e == CUDA_ERROR_OUT_OF_MEMORY {
                e
            } else {
                CUDA_ERROR_MAP_FAILED
            });
        }
        at += len;
    }
    let desc = CUmemAccessDesc {
        location: CUmemLocation {
            type_: CU_MEM_LOCATION_TYPE_DEVICE,
            id: device,
        },
        flags: CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    };
    if let Err(e) = call!(cuMemSetAccess: fn(CUdeviceptr, usize, *const CUmemAccessDesc, usize)
        (va, total as usize, &desc, 1))
    {
        unmap_each(handles, va, at);
        undo(0);
        return Err(e);
    }
    Ok(va)
}

/// Unmaps the first `upto` bytes of mappings made by [`map_all`], one mapping at a
/// time (the driver unmaps whole mappings).
fn unmap_each(handles: &[(u64, CUmemGenericAllocationHandle)], va: CUdeviceptr, upto: u64) {
    let mut at = 0;
    for &(len, _) in handles {
        if at >= upto {
            break;
        }
        let _ = call!(cuMemUnmap: fn(CUdeviceptr, usize)(va + at, len as usize));
        at += len;
    }
}

/// `cuIpcCloseMemHandle`.
///
/// # Safety
/// `real` is the driver's original.
pub unsafe fn close_mem_handle(
    real: unsafe extern "C" fn(CUdeviceptr) -> CUresult,
    dptr: CUdeviceptr,
) -> CUresult {
    let done = {
        let mut o = opened();
        let Some(k) = o.iter().position(|m| m.ptr == dptr) else {
            drop(o);
            // SAFETY: forwarding the caller's argument.
            return unsafe { real(dptr) };
        };
        o[k].refs -= 1;
        if o[k].refs > 0 {
            return CUDA_SUCCESS;
        }
        o.swap_remove(k)
    };
    let mut r = Ok(());
    let mut at = done.va;
    for &len in &done.lens {
        r = r.and(call!(cuMemUnmap: fn(CUdeviceptr, usize)(at, len as usize)));
        at += len;
    }
    let r = r.and(call!(cuMemAddressFree: fn(CUdeviceptr, usize)(done.va, done.total as usize)));
    // Dropping `done` closes the connection: the exporter's pin goes.
    drop(done);
    match r {
        Ok(()) => CUDA_SUCCESS,
        Err(e) => e,
    }
}

fn connect(name: &str, timeout: Duration) -> std::io::Result<UnixStream> {
    // SAFETY: a zeroed sockaddr_un is valid; filled in below.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let bytes = name.as_bytes();
    if bytes.len() + 1 > addr.sun_path.len() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "name too long",
        ));
    }
    for (k, &b) in bytes.iter().enumerate() {
        addr.sun_path[k + 1] = b as libc::c_char;
    }
    let len = (std::mem::size_of::<libc::sa_family_t>() + 1 + bytes.len()) as libc::socklen_t;
    // SAFETY: creating a socket; the fd is owned below.
    let raw = unsafe {
        libc::socket(
            libc::AF_UNIX,
            libc::SOCK_STREAM | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
            0,
        )
    };
    if raw < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: socket() just returned this fd.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    let deadline = Instant::now() + timeout.min(Duration::from_secs(5));
    loop {
        // SAFETY: addr is a valid sockaddr_un of `len` bytes.
        let r = unsafe {
            libc::connect(
                fd.as_raw_fd(),
                (&addr as *const libc::sockaddr_un).cast(),
                len,
            )
        };
        if r == 0 {
            break;
        }
        let e = std::io::Error::last_os_error();
        // A full backlog: the broker is busy; try again until the deadline.
        if e.kind() == std::io::ErrorKind::WouldBlock && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
            continue;
        }
        return Err(e);
    }
    let s = UnixStream::from(fd);
    s.set_nonblocking(false)?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    Ok(s)
}

fn peer_pid(s: &UnixStream) -> std::io::Result<u32> {
    peer_cred(s).map(|c| c.pid as u32)
}

/// The peer's credentials (`SO_PEERCRED`), as the kernel took them at connect.
fn peer_cred(s: &UnixStream) -> std::io::Result<libc::ucred> {
    // SAFETY: a zeroed ucred is valid; getsockopt fills it.
    let mut cred: libc::ucred = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: valid socket, out-buffer of `len` bytes.
    let r = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(cred)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_round_trip_and_foreign_ones_are_not_ours() {
        let h = Handle {
            pid: 4711,
            device: 1,
            base: 0x7000_0020_0000,
            size: 12345,
            token: random_bytes(),
            broker: 99,
        };
        assert_eq!(Handle::decode(&h.encode()), Some(h));
        let mut foreign = h.encode();
        foreign.reserved[..8].copy_from_slice(b"KIWISIM\0");
        assert_eq!(Handle::decode(&foreign), None);
        let mut junk = h.encode();
        junk.reserved[60] = 1;
        assert_eq!(Handle::decode(&junk), None);
    }

    #[test]
    fn fds_cross_a_socket_and_bytes_without_one_are_refused() {
        let (a, b) = UnixStream::pair().unwrap();
        let f = tempfile::tempfile().unwrap();
        send_fd(&a, &42u64.to_le_bytes(), f.as_raw_fd()).unwrap();
        let mut buf = [0u8; 8];
        let got = recv_fd(&b, &mut buf).unwrap();
        assert_eq!(u64::from_le_bytes(buf), 42);
        assert!(got.as_raw_fd() >= 0);
        // Bytes without a descriptor are refused.
        (&a).write_all(&[0u8; 8]).unwrap();
        assert!(recv_fd(&b, &mut buf).is_err());
    }
}
