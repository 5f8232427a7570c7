//! The writing half of a client connection ([`Peer`]), which other tasks write to as
//! well: a release in one connection writes the grant straight to the next holder's
//! socket, without a task hop. Writes never block: what the socket does not take now
//! waits in the peer's [`Outbox`] for its own connection task, bounded by
//! [`MAX_PENDING_WRITE`] (states are replaced, not queued).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use kiwi_protocol::frame::encode_into;
use kiwi_protocol::ArbiterMsg;
use tokio::net::UnixStream;
use tokio::sync::Notify;

/// Bytes a slow reader may leave unread before it is disconnected. A client's
/// messages are under 1 KiB each and it reads them as they come, so 64 KiB is far
/// more than an honest client ever leaves; at the default connection cap it bounds
/// unread replies to 256 MiB node-wide.
pub(super) const MAX_PENDING_WRITE: usize = 64 << 10;

/// The writing half of a client connection, shared with other tasks that must
/// send to it (a release in one connection grants in another).
pub(super) struct Peer {
    pub(super) stream: Arc<UnixStream>,
    pending: Mutex<Outbox>,
    pub(super) flush: Notify,
    pub(super) closing: AtomicBool,
    /// The connection closes because its unread replies passed the cap.
    pub(super) unread: AtomicBool,
    /// The last error it was sent (`code: message`), for the line that says why its
    /// connection closed.
    pub(super) told: Mutex<Option<String>>,
}

/// The messages that say a state (`pressure`, `room`, `waiting`, `contended`): a
/// newer one makes an unsent older one of its kind pointless.
const STATE_KINDS: usize = 4;

fn state_kind(msg: &ArbiterMsg) -> Option<usize> {
    match msg {
        ArbiterMsg::Pressure { .. } => Some(0),
        ArbiterMsg::Room { .. } => Some(1),
        ArbiterMsg::Waiting { .. } => Some(2),
        ArbiterMsg::Contended { .. } => Some(3),
        _ => None,
    }
}

/// What a peer has not read yet: bytes in order, and, while the socket is full, the
/// latest unsent message of each state kind (a holder's `contended` follows every
/// usage report of a waiter, so it can storm too). A slow reader is sent the latest state,
/// never a backlog of states (so it is never disconnected for them); the bytes are
/// bounded by [`MAX_PENDING_WRITE`]. A message that is not a state moves the states
/// waiting before it into the bytes first, so the order a client sees is the order
/// sent (a `ping`'s `pong` follows the `room` due before it).
#[derive(Default)]
struct Outbox {
    bytes: Vec<u8>,
    latest: [Option<Vec<u8>>; STATE_KINDS],
}

impl Outbox {
    fn is_empty(&self) -> bool {
        self.bytes.is_empty() && self.latest.iter().all(Option::is_none)
    }

    /// Moves the waiting states into the byte queue, in kind order.
    fn settle_states(&mut self) {
        for slot in &mut self.latest {
            if let Some(b) = slot.take() {
                self.bytes.extend_from_slice(&b);
            }
        }
    }
}

impl Peer {
    pub(super) fn new(stream: Arc<UnixStream>) -> Self {
        Self {
            stream,
            pending: Mutex::new(Outbox::default()),
            flush: Notify::new(),
            closing: AtomicBool::new(false),
            unread: AtomicBool::new(false),
            told: Mutex::new(None),
        }
    }

    /// Writes now if the socket takes it; otherwise queues for the owner task. `kind`:
    /// the message's state kind, if it is one.
    fn send_bytes(&self, bytes: &[u8], kind: Option<usize>) {
        let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        let mut rest = bytes;
        if pending.is_empty() {
            while !rest.is_empty() {
                match self.stream.try_write(rest) {
                    Ok(n) => rest = &rest[n..],
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    Err(_) => {
                        self.closing.store(true, Ordering::Relaxed);
                        self.flush.notify_one();
                        return;
                    }
                }
            }
        }
        if rest.is_empty() {
            return;
        }
        match kind {
            // Whole and a state: it replaces the older one of its kind.
            Some(k) if rest.len() == bytes.len() => pending.latest[k] = Some(rest.to_vec()),
            _ => {
                pending.settle_states();
                if pending.bytes.len() + rest.len() > MAX_PENDING_WRITE {
                    // A client that never reads must not grow our memory.
                    self.unread.store(true, Ordering::Relaxed);
                    self.closing.store(true, Ordering::Relaxed);
                } else {
                    pending.bytes.extend_from_slice(rest);
                }
            }
        }
        self.flush.notify_one();
    }

    pub(super) fn send(&self, msg: &ArbiterMsg) {
        if let ArbiterMsg::Error { code, message } = msg {
            *self.told.lock().unwrap_or_else(|e| e.into_inner()) =
                Some(format!("{code:?}: {message}"));
        }
        let mut buf = Vec::with_capacity(96);
        if encode_into(msg, &mut buf).is_ok() {
            self.send_bytes(&buf, state_kind(msg));
        }
    }

    /// The last message of a connection closed for its unread replies, in place of
    /// the backlog it did not read (lost with the connection anyway): it follows what
    /// the socket already holds, once the client reads.
    pub(super) fn replace_with_last(&self, msg: &ArbiterMsg) {
        if let ArbiterMsg::Error { code, message } = msg {
            *self.told.lock().unwrap_or_else(|e| e.into_inner()) =
                Some(format!("{code:?}: {message}"));
        }
        let mut p = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        *p = Outbox::default();
        let _ = encode_into(msg, &mut p.bytes);
    }

    pub(super) fn has_pending(&self) -> bool {
        !self
            .pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_empty()
    }

    /// Writes as much of the queue as the socket takes now, without waiting
    /// (a client that never reads must not stall its own connection task).
    pub(super) fn try_flush(&self) -> std::io::Result<()> {
        let mut p = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if p.bytes.is_empty() {
                // The bytes are out: the latest states follow.
                p.settle_states();
                if p.bytes.is_empty() {
                    break;
                }
            }
            match self.stream.try_write(&p.bytes) {
                Ok(n) => {
                    p.bytes.drain(..n);
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod peer_tests {
    use std::time::Duration;

    use kiwi_protocol::FrameDecoder;

    use super::*;

    /// Everything `b` can read now, decoded.
    fn read_all(b: &mut std::os::unix::net::UnixStream) -> Vec<ArbiterMsg> {
        use std::io::Read;
        let mut dec = FrameDecoder::new();
        let mut buf = vec![0u8; 1 << 16];
        let mut out = Vec::new();
        loop {
            match b.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => dec.push(&buf[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) => panic!("{e}"),
            }
            while let Some(m) = dec.next_msg::<ArbiterMsg>().unwrap() {
                out.push(m);
            }
        }
        out
    }

    #[tokio::test]
    async fn a_slow_reader_gets_the_latest_state_in_order_and_stays_connected() {
        let (a, mut b) = std::os::unix::net::UnixStream::pair().unwrap();
        a.set_nonblocking(true).unwrap();
        b.set_nonblocking(true).unwrap();
        let peer = Peer::new(Arc::new(UnixStream::from_std(a).unwrap()));
        // 100,000 states (~6 MB) to a client that reads nothing: far past the 64 KiB
        // of unread replies that disconnect a client.
        const N: u64 = 100_000;
        for i in 0..N {
            peer.send(&ArbiterMsg::Room {
                others_unswappable_bytes: i,
                keep: None,
            });
        }
        peer.send(&ArbiterMsg::Pong { token: 7 });
        peer.send(&ArbiterMsg::Room {
            others_unswappable_bytes: N,
            keep: None,
        });
        assert!(!peer.closing.load(Ordering::Relaxed), "disconnected");
        let mut got = Vec::new();
        while peer.has_pending() {
            got.extend(read_all(&mut b));
            // As the connection's task does: tokio learns the socket drained from
            // its reactor, which runs while we wait.
            tokio::time::timeout(Duration::from_secs(5), peer.stream.writable())
                .await
                .expect("writable")
                .unwrap();
            peer.try_flush().unwrap();
        }
        got.extend(read_all(&mut b));
        let n = got.len();
        assert!(n < 20_000, "{n} messages: the backlog was sent");
        // The latest state before the pong, the pong, then the latest state.
        assert_eq!(
            got[n - 3..],
            [
                ArbiterMsg::Room {
                    others_unswappable_bytes: N - 1,
                    keep: None,
                },
                ArbiterMsg::Pong { token: 7 },
                ArbiterMsg::Room {
                    others_unswappable_bytes: N,
                    keep: None,
                },
            ]
        );
        // What was written before the socket filled came in order.
        for w in got[..n - 3].windows(2) {
            match w {
                [ArbiterMsg::Room {
                    others_unswappable_bytes: x,
                    keep: None,
                }, ArbiterMsg::Room {
                    others_unswappable_bytes: y,
                    keep: None,
                }] => assert_eq!(x + 1, *y),
                other => panic!("{other:?}"),
            }
        }
    }
}
