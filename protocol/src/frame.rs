//! Framing: `b"KW"`, version (u16 BE), payload length (u32 BE), payload.
//!
//! [`FrameDecoder`] is an incremental parser: feed it whatever bytes arrived and pull
//! whole frames out. It checks magic, version and length from the header alone, so an
//! oversize or foreign stream is rejected before its payload is buffered. It also
//! tells a server how large the frame it is in the middle of will be
//! ([`FrameDecoder::partial_frame`]), so the bytes a peer can make it buffer are
//! known, and budgeted, from the header on.

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::{ProtocolError, PROTOCOL_VERSION};

/// First two bytes of every frame.
pub const MAGIC: [u8; 2] = *b"KW";
/// Header size in bytes.
pub const HEADER_LEN: usize = 8;
/// Hard limit on a frame's payload. Event-log replies are paginated to stay under it.
pub const MAX_PAYLOAD: usize = 1 << 20;
/// A decoder whose buffer is empty gives back a capacity larger than this, so a
/// connection that once received a large frame does not keep its memory.
const KEEP_CAPACITY: usize = 64 * 1024;

/// Encodes `msg` as one frame.
pub fn encode<T: Serialize>(msg: &T) -> Result<Vec<u8>, ProtocolError> {
    let mut out = Vec::with_capacity(128);
    encode_into(msg, &mut out)?;
    Ok(out)
}

/// Appends one frame holding `msg` to `out`.
pub fn encode_into<T: Serialize>(msg: &T, out: &mut Vec<u8>) -> Result<(), ProtocolError> {
    let start = out.len();
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&PROTOCOL_VERSION.to_be_bytes());
    out.extend_from_slice(&[0; 4]);
    serde_json::to_writer(&mut *out, msg).map_err(|e| ProtocolError::Malformed(e.to_string()))?;
    let len = out.len() - start - HEADER_LEN;
    if len > MAX_PAYLOAD {
        out.truncate(start);
        return Err(ProtocolError::Oversize { len });
    }
    out[start + 4..start + 8].copy_from_slice(&(len as u32).to_be_bytes());
    Ok(())
}

/// Decodes one payload into a message type.
pub fn decode_payload<T: DeserializeOwned>(payload: &[u8]) -> Result<T, ProtocolError> {
    serde_json::from_slice(payload).map_err(|e| ProtocolError::Malformed(e.to_string()))
}

/// Parses a header; `Ok(payload length)`.
pub fn parse_header(h: &[u8; HEADER_LEN]) -> Result<usize, ProtocolError> {
    if h[0..2] != MAGIC {
        return Err(ProtocolError::BadMagic([h[0], h[1]]));
    }
    let version = u16::from_be_bytes([h[2], h[3]]);
    if version != PROTOCOL_VERSION {
        return Err(ProtocolError::Version { got: version });
    }
    let len = u32::from_be_bytes([h[4], h[5], h[6], h[7]]) as usize;
    if len > MAX_PAYLOAD {
        return Err(ProtocolError::Oversize { len });
    }
    Ok(len)
}

/// Incremental frame parser over a byte stream.
#[derive(Debug, Default)]
pub struct FrameDecoder {
    buf: Vec<u8>,
    /// Read position in `buf`; compacted lazily so small frames cost no memmove.
    pos: usize,
}

impl FrameDecoder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends received bytes.
    pub fn push(&mut self, bytes: &[u8]) {
        // Compact lazily: only when everything was consumed or the dead prefix is large,
        // so a stream of small frames costs no memmove per frame.
        if self.pos > 0 && (self.pos == self.buf.len() || self.pos >= 64 * 1024) {
            self.buf.drain(..self.pos);
            self.pos = 0;
        }
        // Inside a frame whose header is known, grow to exactly its size once rather
        // than doubling past it.
        if let Some(total) = self.partial_frame() {
            let have = self.buffered();
            if total > have {
                self.buf.reserve_exact(total - have);
            }
        }
        self.buf.extend_from_slice(bytes);
    }

    /// When a frame has started but is not complete: the bytes it will occupy once
    /// complete (header and payload; just the header while the header itself is
    /// incomplete). `None` between frames. A header that does not parse also
    /// reports just its own size ([`Self::next_payload`] refuses it).
    pub fn partial_frame(&self) -> Option<usize> {
        let avail = &self.buf[self.pos..];
        if avail.is_empty() {
            return None;
        }
        if avail.len() < HEADER_LEN {
            return Some(HEADER_LEN);
        }
        let mut h = [0u8; HEADER_LEN];
        h.copy_from_slice(&avail[..HEADER_LEN]);
        let total = parse_header(&h).map_or(HEADER_LEN, |len| HEADER_LEN + len);
        // Several whole frames may be buffered: only an incomplete one counts.
        (avail.len() < total).then_some(total)
    }

    /// Bytes received but not yet returned as frames.
    pub fn buffered(&self) -> usize {
        self.buf.len() - self.pos
    }

    /// The next whole frame's payload, `None` if more bytes are needed. After an
    /// error the stream is not at a frame boundary: drop the connection.
    pub fn next_payload(&mut self) -> Result<Option<&[u8]>, ProtocolError> {
        if self.pos == self.buf.len() && self.buf.capacity() > KEEP_CAPACITY {
            self.buf = Vec::new();
            self.pos = 0;
        }
        let avail = &self.buf[self.pos..];
        if avail.len() < HEADER_LEN {
            return Ok(None);
        }
        let mut h = [0u8; HEADER_LEN];
        h.copy_from_slice(&avail[..HEADER_LEN]);
        let len = parse_header(&h)?;
        if avail.len() < HEADER_LEN + len {
            return Ok(None);
        }
        let start = self.pos + HEADER_LEN;
        self.pos = start + len;
        Ok(Some(&self.buf[start..self.pos]))
    }

    /// The next whole frame decoded as `T`.
    pub fn next_msg<T: DeserializeOwned>(&mut self) -> Result<Option<T>, ProtocolError> {
        match self.next_payload()? {
            Some(p) => decode_payload(p).map(Some),
            None => Ok(None),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::msg::*;
    use proptest::prelude::*;

    #[test]
    fn round_trip_split_anywhere() {
        let msgs = vec![
            ClientMsg::Request,
            ClientMsg::Usage(Usage {
                working_set_bytes: 7 << 20,
                resident_bytes: 3 << 20,
            }),
            ClientMsg::Ping { token: 42 },
        ];
        let mut bytes = Vec::new();
        for m in &msgs {
            encode_into(m, &mut bytes).unwrap();
        }
        for split in 0..bytes.len() {
            let mut d = FrameDecoder::new();
            let mut got = Vec::new();
            d.push(&bytes[..split]);
            while let Some(m) = d.next_msg::<ClientMsg>().unwrap() {
                got.push(m);
            }
            d.push(&bytes[split..]);
            while let Some(m) = d.next_msg::<ClientMsg>().unwrap() {
                got.push(m);
            }
            assert_eq!(got, msgs, "split at {split}");
        }
    }

    #[test]
    fn oversize_rejected_from_header() {
        let mut d = FrameDecoder::new();
        let mut h = MAGIC.to_vec();
        h.extend_from_slice(&PROTOCOL_VERSION.to_be_bytes());
        h.extend_from_slice(&((MAX_PAYLOAD as u32) + 1).to_be_bytes());
        d.push(&h);
        assert!(matches!(
            d.next_payload(),
            Err(ProtocolError::Oversize { .. })
        ));
    }

    #[test]
    fn wrong_version_and_magic() {
        let mut frame = encode(&ClientMsg::Request).unwrap();
        frame[3] = 9;
        let mut d = FrameDecoder::new();
        d.push(&frame);
        assert!(matches!(
            d.next_payload(),
            Err(ProtocolError::Version { got: 9 })
        ));
        let mut d = FrameDecoder::new();
        d.push(b"GET / HTTP/1.1\r\n\r\n");
        assert!(matches!(d.next_payload(), Err(ProtocolError::BadMagic(_))));
    }

    #[test]
    fn many_frames_do_not_grow_buffer_forever() {
        let frame = encode(&ClientMsg::Request).unwrap();
        let mut d = FrameDecoder::new();
        for _ in 0..100_000 {
            d.push(&frame);
            d.push(&frame[..3]);
            assert!(d.next_msg::<ClientMsg>().unwrap().is_some());
            d.push(&frame[3..]);
            assert!(d.next_msg::<ClientMsg>().unwrap().is_some());
        }
        assert!(d.buf.capacity() < 1 << 20);
    }

    #[test]
    fn partial_frame_is_known_from_the_header_and_memory_is_given_back() {
        let frame = encode(&ClientMsg::Register(Register {
            name: Some("n".repeat(200_000)),
            ..Register::new("GPU-1", 1, 0)
        }))
        .unwrap();
        let mut d = FrameDecoder::new();
        assert_eq!(d.partial_frame(), None);
        d.push(&frame[..3]);
        assert_eq!(d.partial_frame(), Some(HEADER_LEN));
        d.push(&frame[3..20_000]);
        assert_eq!(d.partial_frame(), Some(frame.len()));
        assert!(d.next_payload().unwrap().is_none());
        d.push(&frame[20_000..]);
        assert_eq!(d.partial_frame(), None);
        assert!(d.buf.capacity() <= frame.len() + 16, "grown exactly");
        assert!(d.next_msg::<ClientMsg>().unwrap().is_some());
        assert!(d.next_payload().unwrap().is_none());
        assert!(
            d.buf.capacity() <= KEEP_CAPACITY,
            "large buffer kept when idle"
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]
        /// Arbitrary bytes, with or without a valid header in front, never panic.
        #[test]
        fn decoding_arbitrary_bytes_never_panics(
            bytes in proptest::collection::vec(any::<u8>(), 0..2048),
            with_header in any::<bool>(),
        ) {
            let mut d = FrameDecoder::new();
            if with_header {
                let mut h = MAGIC.to_vec();
                h.extend_from_slice(&PROTOCOL_VERSION.to_be_bytes());
                h.extend_from_slice(&(bytes.len() as u32).to_be_bytes());
                d.push(&h);
            }
            d.push(&bytes);
            for _ in 0..4 {
                match d.next_payload() {
                    Ok(Some(p)) => {
                        let p = p.to_vec();
                        let _ = decode_payload::<ClientMsg>(&p);
                        let _ = decode_payload::<ArbiterMsg>(&p);
                        let _ = decode_payload::<ControlRequest>(&p);
                        let _ = decode_payload::<ControlReply>(&p);
                    }
                    Ok(None) | Err(_) => break,
                }
            }
        }

        /// JSON-shaped garbage (valid JSON of the wrong shape) never panics either.
        #[test]
        fn decoding_json_garbage_never_panics(s in "\\PC{0,300}") {
            let _ = decode_payload::<ClientMsg>(s.as_bytes());
            let _ = decode_payload::<ControlRequest>(s.as_bytes());
            let wrapped = format!("{{\"type\":\"register\",{s}}}");
            let _ = decode_payload::<ClientMsg>(wrapped.as_bytes());
        }
    }
}
