//! The soak's misbehaving tenants: protocol-level clients on the node's socket that
//! storm the arbiter with reports or never read its replies. They run on threads of
//! the soak; what is checked is that the others do not pay for them.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Result;
use kiwi_protocol::blocking::Connection;
use kiwi_protocol::{ArbiterMsg, ClientMsg, Register, Usage, PROTOCOL_VERSION};

/// A tenant that flips its working set between 0 and 3 GiB as fast as the rate limit
/// lets it, for `for_`, then leaves.
pub(super) fn storm(socket: PathBuf, uuid: String, total: u64, for_: Duration) -> Result<()> {
    let mut c: Connection<ClientMsg, ArbiterMsg> = Connection::connect(&socket)?;
    c.send(&ClientMsg::Register(register(&uuid, total)))?;
    let end = Instant::now() + for_;
    let mut token = 0;
    while Instant::now() < end {
        for k in 0..4_000u64 {
            let ws = if k % 2 == 0 { 3 << 30 } else { 0 };
            c.send(&ClientMsg::Usage(Usage {
                working_set_bytes: ws,
                resident_bytes: 0,
            }))?;
        }
        token += 1;
        c.send(&ClientMsg::Ping { token })?;
        // Its replies are read: it is not the deaf one.
        while let Ok(Some(m)) = c.recv_timeout(Duration::from_secs(10)) {
            if matches!(m, ArbiterMsg::Pong { token: t } if t == token) {
                break;
            }
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    Ok(())
}

/// A tenant that registers, asks and never reads a reply, for `for_`.
pub(super) fn deaf(socket: PathBuf, uuid: String, total: u64, for_: Duration) -> Result<()> {
    let mut c: Connection<ClientMsg, ArbiterMsg> = Connection::connect(&socket)?;
    c.send(&ClientMsg::Register(register(&uuid, total)))?;
    let end = Instant::now() + for_;
    let mut token = 0;
    while Instant::now() < end {
        token += 1;
        if c.send(&ClientMsg::Ping { token }).is_err() {
            break;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    Ok(())
}

fn register(uuid: &str, total: u64) -> Register {
    Register {
        version: PROTOCOL_VERSION,
        pid: std::process::id(),
        gpu_uuid: uuid.to_string(),
        gpu_total_memory: total,
        working_set_bytes: 0,
        resident_bytes: 0,
        container_id: None,
        pod_name: None,
        pod_namespace: None,
        name: Some("soak-tenant".into()),
        resume: None,
        wait_info: false,
        unswappable_bytes: Some(0),
        pipelined: false,
        room_info: false,
        bounds: false,
        group: None,
    }
}
