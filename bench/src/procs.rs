//! Helper processes the benchmarks start: an arbiter of their own (this binary
//! re-executed in the `__arbiter` role), protocol-only clients of it, and /proc
//! readings.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use kiwi_protocol::blocking::Connection;
use kiwi_protocol::{ArbiterMsg, ClientMsg, Register};

/// CLOCK_MONOTONIC in ns: the arbiter's clock, shared by every process.
pub use kiwi_protocol::monotonic_ns;

/// An arbiter process on a private socket directory, killed on drop.
pub struct ArbiterProc {
    pub child: Child,
    pub dir: tempfile::TempDir,
}

impl ArbiterProc {
    pub fn start(tq_s: f64, extra: &[&str]) -> Result<Self> {
        Self::start_with(tq_s, extra, |c| c)
    }

    /// [`ArbiterProc::start`], its command shaped by `shape` first (the simulator's
    /// environment, for an arbiter that loads its libcuda).
    pub fn start_with(
        tq_s: f64,
        extra: &[&str],
        shape: impl FnOnce(&mut Command) -> &mut Command,
    ) -> Result<Self> {
        let dir = tempfile::Builder::new().prefix("kiwi-bench").tempdir()?;
        let mut cmd = Command::new(std::env::current_exe()?);
        let child = shape(&mut cmd)
            .arg("__arbiter")
            .arg("--socket-dir")
            .arg(dir.path())
            .arg("--tq")
            .arg(tq_s.to_string())
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("cannot start the arbiter")?;
        let a = Self { child, dir };
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::os::unix::net::UnixStream::connect(a.client_socket()).is_err() {
            if Instant::now() > deadline {
                bail!("arbiter did not come up");
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        Ok(a)
    }

    pub fn socket_dir(&self) -> &std::path::Path {
        self.dir.path()
    }

    pub fn client_socket(&self) -> PathBuf {
        kiwi_config::client_socket(self.dir.path())
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for ArbiterProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What a protocol-only client (no CUDA, no memory of its own) registers as: this
/// process, `name`, wanting `working_set_bytes` of `gpu_uuid` (`gpu_total_memory`
/// bytes), none of it resident, no other claim.
pub fn registration(
    gpu_uuid: String,
    gpu_total_memory: u64,
    working_set_bytes: u64,
    name: &str,
) -> Register {
    Register {
        name: Some(name.into()),
        ..Register::new(gpu_uuid, gpu_total_memory, working_set_bytes)
    }
}

/// Connects to the arbiter's client `socket` (reads time out after `read_timeout`)
/// and registers `reg`: the connection and the client id it was given. Any other
/// answer fails with `refused` and the answer.
pub fn register(
    socket: &Path,
    read_timeout: Duration,
    reg: Register,
    refused: &str,
) -> Result<(Connection<ClientMsg, ArbiterMsg>, u64)> {
    let mut c = Connection::connect(socket)?;
    c.stream().set_read_timeout(Some(read_timeout))?;
    match c.call(&ClientMsg::Register(reg))? {
        ArbiterMsg::Registered { client_id, .. } => Ok((c, client_id)),
        other => bail!("{refused}: {other:?}"),
    }
}

/// Resident set size of `pid` in bytes.
pub fn rss_bytes(pid: u32) -> Result<u64> {
    status_kib(pid, "VmRSS:").map(|kb| kb * 1024)
}

/// The part of `pid`'s resident memory that is its own (`RssAnon`): not the shared
/// memory it maps for a while (the swap pool's slices, which the arbiter maps to
/// populate or spill them and which the pool's size bounds).
pub fn anon_rss_bytes(pid: u32) -> Result<u64> {
    status_kib(pid, "RssAnon:").map(|kb| kb * 1024)
}

fn status_kib(pid: u32, field: &str) -> Result<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    s.lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .with_context(|| format!("no {field} in /proc/{pid}/status"))
}

/// User + system CPU time of `pid`, in seconds.
pub fn cpu_seconds(pid: u32) -> Result<f64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the command name (which may contain spaces) start after ')'.
    let rest = &s[s.rfind(')').context("bad stat")? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let utime: f64 = f.get(11).context("utime")?.parse()?;
    let stime: f64 = f.get(12).context("stime")?.parse()?;
    // SAFETY: sysconf has no memory-safety preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    Ok((utime + stime) / hz)
}
