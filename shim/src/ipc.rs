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
//!
//! Its parts: `export` (`cuIpcGetMemHandle`, the shares and their pins), `broker` (the
//! exporter's thread that serves importers), `import` (`cuIpcOpenMemHandle`,
//! `cuIpcCloseMemHandle`) and `socket` (descriptors over Unix sockets, connecting,
//! peer credentials); here the handle and the wire format they share.

use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use crate::cuda::*;
use crate::devices::{current_context, exportable};
use crate::mem::PinError;
use crate::real::call_real as call;

mod broker;
mod export;
mod import;
mod socket;

use broker::Broker;
pub use export::get_mem_handle;
use export::{exports, pin_in_turn, pin_lock, unpin, Share};
pub use import::{close_mem_handle, open_mem_handle};
use socket::{connect, peer_cred, peer_pid, recv_fd, send_fd};

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

/// The calling thread's current device, as the driver numbers it.
fn current_device() -> Result<CUdevice, CUresult> {
    let mut d: CUdevice = 0;
    call!(cuCtxGetDevice: fn(*mut CUdevice)(&mut d))?;
    Ok(d)
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
}
