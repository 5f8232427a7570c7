//! A blocking connection over a Unix stream, for the shim, kiwictl and tests.
//!
//! Generic over the message types so one type serves both sockets:
//! `Connection<ClientMsg, ArbiterMsg>` for a client, `Connection<ControlRequest,
//! ControlReply>` for kiwictl (with the event log's pages read in one call).

use std::collections::VecDeque;
use std::io::{ErrorKind, Write};
use std::marker::PhantomData;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::frame::{encode_into, FrameDecoder};
use crate::{ControlReply, ControlRequest, Event, ProtocolError};

/// One framed connection. `S`: what this side sends; `R`: what it receives.
pub struct Connection<S, R> {
    stream: UnixStream,
    decoder: FrameDecoder,
    out: Vec<u8>,
    /// Descriptors received with messages (`SCM_RIGHTS`), in order: see
    /// [`Connection::take_fd`].
    fds: VecDeque<OwnedFd>,
    _types: PhantomData<fn(S) -> R>,
}

impl<S: Serialize, R: DeserializeOwned> Connection<S, R> {
    /// Connects to the socket at `path`.
    pub fn connect(path: &Path) -> Result<Self, ProtocolError> {
        Ok(Self::new(UnixStream::connect(path)?))
    }

    /// Wraps an already connected stream.
    pub fn new(stream: UnixStream) -> Self {
        Self {
            stream,
            decoder: FrameDecoder::new(),
            out: Vec::with_capacity(256),
            fds: VecDeque::new(),
            _types: PhantomData,
        }
    }

    /// The underlying stream (for polling, timeouts, shutdown).
    pub fn stream(&self) -> &UnixStream {
        &self.stream
    }

    /// Sends one message, whole.
    pub fn send(&mut self, msg: &S) -> Result<(), ProtocolError> {
        self.out.clear();
        encode_into(msg, &mut self.out)?;
        self.stream.write_all(&self.out)?;
        Ok(())
    }

    /// Receives one message, blocking (or until the stream's read timeout, which is
    /// then [`ProtocolError::TimedOut`], not the socket's `EAGAIN`).
    pub fn recv(&mut self) -> Result<R, ProtocolError> {
        loop {
            if let Some(m) = self.try_decode()? {
                return Ok(m);
            }
            match self.fill() {
                Err(ProtocolError::Io(e)) if is_timeout(&e) => {
                    return Err(ProtocolError::TimedOut {
                        after: self.stream.read_timeout().ok().flatten(),
                    })
                }
                other => other?,
            }
        }
    }

    /// Receives one message, waiting at most `timeout`; `Ok(None)` on timeout.
    pub fn recv_timeout(&mut self, timeout: Duration) -> Result<Option<R>, ProtocolError> {
        if let Some(m) = self.try_decode()? {
            return Ok(Some(m));
        }
        let deadline = Instant::now() + timeout;
        let old = self.stream.read_timeout()?;
        let res = loop {
            let left = deadline.saturating_duration_since(Instant::now());
            self.stream
                .set_read_timeout(Some(left.max(Duration::from_micros(1))))?;
            match self.read_once() {
                Err(ProtocolError::Io(e)) if e.kind() == ErrorKind::Interrupted => continue,
                other => break other,
            }
        };
        self.stream.set_read_timeout(old)?;
        match res {
            Ok(()) => self.try_decode(),
            Err(ProtocolError::Io(e)) if is_timeout(&e) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// A message already received and buffered, without blocking.
    pub fn try_decode(&mut self) -> Result<Option<R>, ProtocolError> {
        self.decoder.next_msg()
    }

    /// Sends a request and waits for the next message.
    pub fn call(&mut self, msg: &S) -> Result<R, ProtocolError> {
        self.send(msg)?;
        self.recv()
    }

    /// Reads what is there, retrying reads that a signal interrupted. On Linux a
    /// socket with a read timeout returns `EINTR` even without a signal handler when
    /// the process is stopped and continued (`SIGSTOP`/`SIGCONT`, a cgroup freeze: a
    /// notebook suspended with Ctrl-Z): that is no reason to drop the connection.
    fn fill(&mut self) -> Result<(), ProtocolError> {
        loop {
            match self.read_once() {
                Err(ProtocolError::Io(e)) if e.kind() == ErrorKind::Interrupted => continue,
                other => return other,
            }
        }
    }

    /// The oldest descriptor received and not taken yet: a message that carries
    /// descriptors ([`crate::ArbiterMsg::PoolLent`]) finds its own here, in order,
    /// once it is decoded (they arrive with its first byte).
    pub fn take_fd(&mut self) -> Option<OwnedFd> {
        self.fds.pop_front()
    }

    fn read_once(&mut self) -> Result<(), ProtocolError> {
        let mut buf = [0u8; 16 * 1024];
        let n = crate::fds::recv_with_fds(self.stream.as_raw_fd(), &mut buf, &mut self.fds)?;
        if n == 0 {
            return Err(ProtocolError::Closed);
        }
        self.decoder.push(&buf[..n]);
        Ok(())
    }
}

impl Connection<ControlRequest, ControlReply> {
    /// [`read_event_log`] on this connection: any reply but a page of events (an
    /// error among them) is [`ProtocolError::Malformed`].
    pub fn events(
        &mut self,
        gpu: Option<String>,
        since: u64,
    ) -> Result<(Vec<Event>, u64), ProtocolError> {
        read_event_log(
            gpu,
            since,
            |req| self.call(req),
            |other| ProtocolError::Malformed(format!("unexpected reply to `events`: {other:?}")),
        )
    }
}

/// The event log from `since` on (`seq >= since`; `gpu`'s, or every GPU's), asked for
/// page after page through `call`, and the arbiter's clock at the last page; any
/// other reply is `unexpected`'s error. `call` may make errors of replies itself.
pub fn read_event_log<E>(
    gpu: Option<String>,
    since: u64,
    mut call: impl FnMut(&ControlRequest) -> Result<ControlReply, E>,
    unexpected: impl FnOnce(ControlReply) -> E,
) -> Result<(Vec<Event>, u64), E> {
    let mut out = Vec::new();
    let mut since = since;
    loop {
        match call(&ControlRequest::Events {
            gpu: gpu.clone(),
            since_seq: since,
            limit: 2_000,
        })? {
            ControlReply::Events {
                events,
                next_seq,
                more,
                now_ns,
            } => {
                out.extend(events);
                since = next_seq;
                if !more {
                    return Ok((out, now_ns));
                }
            }
            other => return Err(unexpected(other)),
        }
    }
}

/// A read that ran into the socket's timeout (`SO_RCVTIMEO` reports `EAGAIN`).
fn is_timeout(e: &std::io::Error) -> bool {
    matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::msg::ClientMsg;

    extern "C" fn ignore(_: libc::c_int) {}

    /// A read timeout and a signal whose handler does not ask for `SA_RESTART`: the
    /// read fails with `EINTR`, as after a stop and continue.
    #[test]
    fn a_read_interrupted_by_a_signal_is_retried() {
        // SAFETY: a zeroed sigaction with an empty mask and no flags, and a handler
        // that does nothing; SIGUSR2 is used by no other test of this crate.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = ignore as extern "C" fn(libc::c_int) as usize;
            libc::sigemptyset(&mut sa.sa_mask);
            assert_eq!(libc::sigaction(libc::SIGUSR2, &sa, std::ptr::null_mut()), 0);
        }
        for timed in [false, true] {
            let (a, b) = UnixStream::pair().unwrap();
            a.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            let (tx, rx) = std::sync::mpsc::channel();
            let reader = std::thread::spawn(move || {
                let mut conn: Connection<ClientMsg, ClientMsg> = Connection::new(a);
                // SAFETY: pthread_self has no preconditions.
                tx.send(unsafe { libc::pthread_self() }).unwrap();
                if timed {
                    conn.recv_timeout(Duration::from_secs(10))
                        .map(|m| m.expect("a message, not a timeout"))
                } else {
                    conn.recv()
                }
            });
            let thread = rx.recv().unwrap();
            for _ in 0..10 {
                std::thread::sleep(Duration::from_millis(10));
                // SAFETY: the reader thread is alive until it receives the message,
                // which is sent only after the last signal.
                assert_eq!(unsafe { libc::pthread_kill(thread, libc::SIGUSR2) }, 0);
            }
            let mut writer: Connection<ClientMsg, ClientMsg> = Connection::new(b);
            writer.send(&ClientMsg::Request).unwrap();
            let got = reader.join().unwrap();
            assert!(
                matches!(got, Ok(ClientMsg::Request)),
                "timed {timed}: {got:?}"
            );
        }
    }
}
