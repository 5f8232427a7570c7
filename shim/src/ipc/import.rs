//! The importer's side: `cuIpcOpenMemHandle` asks the exporter's broker for the
//! segments, imports and maps them into a range of its own; `cuIpcCloseMemHandle`
//! unmaps them and closes the connection (the exporter's pin goes with it).

use super::*;

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
