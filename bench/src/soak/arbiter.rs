//! The soak's arbiter: the workspace's `kiwi-arbiter`, started, SIGKILLed and
//! restarted on one socket directory, and what the soak reads of it from `/proc`
//! (its memory, its descriptors, the sockets it listens on).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use super::disk::SpillDisk;
use super::{SWAP_POOL, TQ_S};
use crate::jobs::{Build, Sim};

/// The arbiter: the workspace's `kiwi-arbiter`, which the soak kills and restarts on
/// the same socket directory.
pub(super) struct Arbiter {
    exe: PathBuf,
    dir: PathBuf,
    disk: SpillDisk,
    child: Option<Child>,
}

impl Arbiter {
    pub(super) fn start(
        b: &Build,
        sim: &Sim,
        gpus: u32,
        dir: &Path,
        disk: SpillDisk,
    ) -> Result<Arbiter> {
        let exe = b
            .gpuburst
            .parent()
            .context("no build directory")?
            .join("kiwi-arbiter");
        if !exe.exists() {
            bail!("{} is missing: build the workspace first", exe.display());
        }
        let mut a = Arbiter {
            exe,
            dir: dir.to_path_buf(),
            disk,
            child: None,
        };
        a.spawn(b, sim, gpus)?;
        Ok(a)
    }

    pub(super) fn spawn(&mut self, b: &Build, sim: &Sim, gpus: u32) -> Result<()> {
        let mut cmd = Command::new(&self.exe);
        sim.apply(b, &mut cmd)
            .env("KIWI_SIM_GPUS", gpus.to_string())
            .env_remove("KIWI_CONFIG")
            .arg("--socket-dir")
            .arg(&self.dir)
            .args([
                "--tq",
                &TQ_S.to_string(),
                "--nvml",
                "auto",
                "--checkpoint",
                "auto",
                "--swap-pool",
                SWAP_POOL,
            ])
            .arg("--spill-dir")
            .arg(self.disk.spill_dir())
            // Every soak client is a child of this process, of one uid.
            .args(["--max-conns-per-group", "100000"])
            .stdin(Stdio::null())
            .stdout(Stdio::null());
        // Its log, across restarts, beside the clients' (kept when a run fails).
        let log = self.dir.parent().unwrap_or(&self.dir).join("arbiter.log");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .with_context(|| format!("cannot open {}", log.display()))?;
        cmd.stderr(log);
        self.disk.prepare(&mut cmd)?;
        self.child = Some(cmd.spawn().context("cannot start kiwi-arbiter")?);
        let socket = kiwi_config::client_socket(&self.dir);
        let control = kiwi_config::control_socket(&self.dir);
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::os::unix::net::UnixStream::connect(&socket).is_err()
            || std::os::unix::net::UnixStream::connect(&control).is_err()
        {
            if Instant::now() > deadline {
                bail!("the arbiter did not come up");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(())
    }

    pub(super) fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    pub(super) fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Arbiter {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The arbiter's own resident memory (anonymous) and open descriptors.
pub(super) fn arbiter_footprint(pid: u32) -> Option<(u64, usize)> {
    // Its own memory: the swap pool's slices it maps while it populates or spills
    // them are the pool's, bounded by its size.
    let rss = crate::procs::anon_rss_bytes(pid).ok()?;
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.count();
    Some((rss, fds))
}

/// The paths of the Unix sockets `pid` listens on under `under` (sockets it still
/// holds after their files were removed included: the kernel keeps a bound name);
/// `None` when `/proc` does not tell.
pub(super) fn listening_under(pid: u32, under: &Path) -> Option<BTreeSet<PathBuf>> {
    let mut inodes = BTreeSet::new();
    for e in std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.flatten() {
        let Ok(target) = std::fs::read_link(e.path()) else {
            continue;
        };
        let target = target.to_string_lossy();
        if let Some(n) = target
            .strip_prefix("socket:[")
            .and_then(|t| t.strip_suffix(']'))
            .and_then(|t| t.parse::<u64>().ok())
        {
            inodes.insert(n);
        }
    }
    let table = std::fs::read_to_string(format!("/proc/{pid}/net/unix")).ok()?;
    Some(listeners(&table, &inodes, under))
}

/// `__SO_ACCEPTCON` in `/proc/net/unix`'s flags: a listening socket.
const ACCEPTCON: u32 = 0x0001_0000;

/// The listening sockets among `inodes` bound under `under`, from a `/proc/net/unix`
/// table (`Num RefCount Protocol Flags Type St Inode Path`).
fn listeners(table: &str, inodes: &BTreeSet<u64>, under: &Path) -> BTreeSet<PathBuf> {
    table
        .lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let flags = u32::from_str_radix(f.get(3)?, 16).ok()?;
            let inode: u64 = f.get(6)?.parse().ok()?;
            let path = Path::new(f.get(7)?);
            (flags & ACCEPTCON != 0 && inodes.contains(&inode) && path.starts_with(under))
                .then(|| path.to_path_buf())
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listeners_are_the_listening_sockets_of_the_process_under_the_directory() {
        let table = "Num       RefCount Protocol Flags    Type St Inode Path
0000000000000000: 00000002 00000000 00010000 0001 01 101 /run/k/containers/a/arbiter.sock
0000000000000000: 00000002 00000000 00010000 0001 01 102 /run/k/client/arbiter.sock
0000000000000000: 00000003 00000000 00000000 0001 03 103 /run/k/containers/b/arbiter.sock
0000000000000000: 00000002 00000000 00010000 0001 01 104 /run/k/containers/c/arbiter.sock
0000000000000000: 00000002 00000000 00010000 0001 01 105
";
        let mine: BTreeSet<u64> = [101, 102, 103, 105].into();
        let got = listeners(table, &mine, Path::new("/run/k/containers"));
        // 102 is elsewhere, 103 a connection, 104 another process's, 105 unnamed.
        assert_eq!(
            got,
            [PathBuf::from("/run/k/containers/a/arbiter.sock")].into()
        );
    }

    #[test]
    fn this_process_listening_is_seen_and_its_closed_listener_is_not() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        let l = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let me = std::process::id();
        let got = listening_under(me, dir.path()).expect("/proc tells");
        assert_eq!(got, [path.clone()].into());
        // A removed file does not hide a listener still open.
        std::fs::remove_file(&path).unwrap();
        assert_eq!(listening_under(me, dir.path()).unwrap(), [path].into());
        drop(l);
        assert!(listening_under(me, dir.path()).unwrap().is_empty());
    }
}
