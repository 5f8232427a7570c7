//! A blocking connection over a Unix stream, for the shim, kiwictl and tests.
//!
//! Generic over the message types so one type serves both sockets:
//! `Connection<ClientMsg, ArbiterMsg>` for a client, `Connection<ControlRequest,
//! ControlReply>` for kiwictl.

use std::io::{Read, Write};
use std::marker::PhantomData;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::frame::{encode_into, FrameDecoder};
use crate::ProtocolError;

/// One framed connection. `S`: what this side sends; `R`: what it receives.
pub struct Connection<S, R> {
    stream: UnixStream,
    decoder: FrameDecoder,
    out: Vec<u8>,
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
        let old = self.stream.read_timeout()?;
        self.stream
            .set_read_timeout(Some(timeout.max(Duration::from_micros(1))))?;
        let res = self.fill();
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

    fn fill(&mut self) -> Result<(), ProtocolError> {
        let mut buf = [0u8; 16 * 1024];
        let n = self.stream.read(&mut buf)?;
        if n == 0 {
            return Err(ProtocolError::Closed);
        }
        self.decoder.push(&buf[..n]);
        Ok(())
    }
}

/// A read that ran into the socket's timeout (`SO_RCVTIMEO` reports `EAGAIN`).
fn is_timeout(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
    )
}
