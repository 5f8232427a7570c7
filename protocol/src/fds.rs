//! File descriptors alongside frames (`SCM_RIGHTS`): the node swap pool lends its
//! slices as descriptors ([`crate::ArbiterMsg::PoolLent`]). The descriptors of one
//! message travel with the message's first byte, so a reader that keeps every
//! descriptor it receives, in order, finds a message's descriptors queued by the time
//! the whole message has been decoded.

use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

/// Most descriptors one message carries (and one read accepts).
pub const MAX_FDS: usize = 64;

/// Bytes of control buffer for [`MAX_FDS`] descriptors.
fn cmsg_space() -> usize {
    // SAFETY: CMSG_SPACE only computes a size.
    unsafe { libc::CMSG_SPACE((MAX_FDS * std::mem::size_of::<RawFd>()) as u32) as usize }
}

/// Sends `data` with `fds` attached to its first byte; returns the bytes sent (the
/// caller sends the rest, if any, as plain bytes). Non-blocking sockets answer
/// `WouldBlock` as `write` does. At most [`MAX_FDS`] descriptors.
pub fn send_with_fds(sock: RawFd, data: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<usize> {
    if fds.len() > MAX_FDS {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "{} descriptors in one message; at most {MAX_FDS}",
                fds.len()
            ),
        ));
    }
    let mut iov = libc::iovec {
        iov_base: data.as_ptr() as *mut libc::c_void,
        iov_len: data.len(),
    };
    let mut control = vec![0u8; cmsg_space()];
    // SAFETY: a zeroed msghdr is valid; every pointer set below outlives the call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if !fds.is_empty() {
        let payload = std::mem::size_of_val(fds) as u32;
        msg.msg_control = control.as_mut_ptr().cast();
        // SAFETY: CMSG_SPACE only computes a size.
        msg.msg_controllen = unsafe { libc::CMSG_SPACE(payload) } as _;
        // SAFETY: the control buffer holds CMSG_SPACE(payload) bytes (at most
        // cmsg_space()), so its first header and data lie inside it.
        unsafe {
            let cmsg = libc::CMSG_FIRSTHDR(&msg);
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len = libc::CMSG_LEN(payload) as _;
            let out = libc::CMSG_DATA(cmsg) as *mut RawFd;
            for (k, fd) in fds.iter().enumerate() {
                out.add(k).write_unaligned(fd.as_raw_fd());
            }
        }
    }
    loop {
        // SAFETY: `msg` points to live buffers; the kernel copies what it sends.
        let n = unsafe { libc::sendmsg(sock, &msg, libc::MSG_NOSIGNAL) };
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Reads into `buf`, queueing any descriptors that arrive (close-on-exec) on `fds`,
/// of which at most [`MAX_FDS`] are kept (more are closed: a peer cannot make the
/// reader hold descriptors without bound). `Ok(0)`: end of stream.
pub fn recv_with_fds(
    sock: RawFd,
    buf: &mut [u8],
    fds: &mut VecDeque<OwnedFd>,
) -> io::Result<usize> {
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    let mut control = vec![0u8; cmsg_space()];
    // SAFETY: a zeroed msghdr is valid; every pointer set below outlives the call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = control.len() as _;
    // SAFETY: `msg` describes buffers this function owns, valid for the call.
    let n = unsafe { libc::recvmsg(sock, &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel filled `msg_controllen` bytes of the control buffer with
    // well-formed headers; CMSG_NXTHDR stays inside it.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(cmsg) as *const RawFd;
                let bytes = (*cmsg).cmsg_len as usize - (data as usize - cmsg as usize);
                for k in 0..bytes / std::mem::size_of::<RawFd>() {
                    let fd = OwnedFd::from_raw_fd(data.add(k).read_unaligned());
                    if fds.len() < MAX_FDS {
                        fds.push_back(fd);
                    }
                }
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    Ok(n as usize)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Seek, Write};
    use std::os::fd::AsFd;
    use std::os::unix::net::UnixStream;

    #[test]
    fn descriptors_travel_with_the_first_byte_and_stay_bounded() {
        let (a, b) = UnixStream::pair().unwrap();
        let mut files: Vec<std::fs::File> = (0..3)
            .map(|k| {
                let mut f = tempfile();
                write!(f, "file {k}").unwrap();
                f
            })
            .collect();
        let borrowed: Vec<BorrowedFd<'_>> = files.iter().map(|f| f.as_fd()).collect();
        assert_eq!(
            send_with_fds(a.as_raw_fd(), b"hello", &borrowed).unwrap(),
            5
        );
        let mut buf = [0u8; 16];
        let mut got = VecDeque::new();
        let n = recv_with_fds(b.as_raw_fd(), &mut buf, &mut got).unwrap();
        assert_eq!(&buf[..n], b"hello");
        assert_eq!(got.len(), 3);
        for (k, fd) in got.into_iter().enumerate() {
            let mut f = std::fs::File::from(fd);
            f.rewind().unwrap();
            let mut s = String::new();
            f.read_to_string(&mut s).unwrap();
            assert_eq!(s, format!("file {k}"));
        }
        // Too many descriptors are refused before anything is sent.
        files.truncate(1);
        let many: Vec<BorrowedFd<'_>> = (0..MAX_FDS + 1).map(|_| files[0].as_fd()).collect();
        assert!(send_with_fds(a.as_raw_fd(), b"x", &many).is_err());
    }

    fn tempfile() -> std::fs::File {
        let name = c"kiwi-fds-test";
        // SAFETY: memfd_create with a valid name; the descriptor is owned by the File.
        let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: a fresh descriptor nobody else owns.
        unsafe { std::fs::File::from_raw_fd(fd) }
    }
}
