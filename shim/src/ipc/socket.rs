//! The sockets under CUDA IPC: a file descriptor sent and received with its bytes
//! (`SCM_RIGHTS`), a connection to a broker's abstract name with a deadline, and the
//! peer's credentials (`SO_PEERCRED`).

use super::*;

pub(super) fn send_fd(s: &UnixStream, data: &[u8], fd: RawFd) -> std::io::Result<()> {
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
pub(super) fn recv_fd(s: &UnixStream, buf: &mut [u8]) -> std::io::Result<OwnedFd> {
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

pub(super) fn connect(name: &str, timeout: Duration) -> std::io::Result<UnixStream> {
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

pub(super) fn peer_pid(s: &UnixStream) -> std::io::Result<u32> {
    peer_cred(s).map(|c| c.pid as u32)
}

/// The peer's credentials (`SO_PEERCRED`), as the kernel took them at connect.
pub(super) fn peer_cred(s: &UnixStream) -> std::io::Result<libc::ucred> {
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
