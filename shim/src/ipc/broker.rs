//! The exporter's broker: a thread listening on an abstract Unix socket that
//! authenticates importers by token, hands them the segments' shareable fds, and
//! gives a pin back when an importer's connection closes. Bounded: at most
//! [`MAX_CONNECTIONS`] connections, [`MAX_PENDING`] unauthenticated ones.

use super::*;

pub(super) struct Broker {
    pub(super) id: u64,
}

static BROKER: OnceLock<Result<Broker, String>> = OnceLock::new();

impl Broker {
    /// The process's broker, started on first use.
    pub(super) fn get() -> Result<&'static Broker, String> {
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
