//! A process's memory cgroup, read from the host: how much more memory it may be
//! charged before its limit (and the kernel's OOM killer) stops it. The arbiter asks
//! before it checkpoints a process through the driver, which keeps the process's GPU
//! memory in that process's host memory (issue #37).
//!
//! Both cgroup versions: v2 (`0::PATH` in `/proc/<pid>/cgroup`; `memory.max`,
//! `memory.current`) and v1 (the `memory` controller's line;
//! `memory.limit_in_bytes`, `memory.usage_in_bytes`), under `/sys/fs/cgroup`. A
//! limit of an ancestor binds too, so every level up to the root is read and the
//! least room wins. Paths are as the reader's cgroup namespace sees them: a reader
//! that cannot see the process's cgroup (another namespace) learns nothing (`None`).

use std::path::{Path, PathBuf};

use kiwi_units::cgroup::{memory_cgroups, room};

/// Room left under `pid`'s memory limits (the least over its cgroup and its
/// ancestors); `None` when it has no limit or none can be read.
pub fn memory_room(pid: u32) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    memory_room_in(Path::new("/sys/fs/cgroup"), &text)
}

/// [`memory_room`] for a process whose `/proc/<pid>/cgroup` reads `text`, with the
/// cgroup file systems mounted under `root`.
pub fn memory_room_in(root: &Path, text: &str) -> Option<u64> {
    let mut least: Option<u64> = None;
    for (dir, max, cur) in limit_files(root, text) {
        let mut at: Option<&Path> = Some(&dir);
        while let Some(d) = at {
            let room = std::fs::read_to_string(d.join(max))
                .ok()
                .zip(std::fs::read_to_string(d.join(cur)).ok())
                .and_then(|(m, c)| room(&m, &c));
            if let Some(r) = room {
                least = Some(least.map_or(r, |l| l.min(r)));
            }
            at = d.parent().filter(|p| p.starts_with(root));
        }
    }
    least
}

/// The directories of a process's memory cgroups and their limit and usage files.
fn limit_files(root: &Path, text: &str) -> Vec<(PathBuf, &'static str, &'static str)> {
    memory_cgroups(text)
        // A path outside the reader's namespace ("/.."): not ours to read.
        .filter(|c| !c.path.split('/').any(|part| part == ".."))
        .map(|c| {
            let rel = c.path.trim_start_matches('/');
            (root.join(c.mount).join(rel), c.limit_file, c.usage_file)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_least_room_up_the_hierarchy_wins_in_either_version() {
        let root = tempfile::tempdir().unwrap();
        let write = |rel: &str, file: &str, v: &str| {
            let d = root.path().join(rel);
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join(file), v).unwrap();
        };
        // v2: the pod's limit (1 GiB, 900 MiB used) binds before the container's.
        write("kubepods/pod1", "memory.max", &(1u64 << 30).to_string());
        write(
            "kubepods/pod1",
            "memory.current",
            &(900u64 << 20).to_string(),
        );
        write("kubepods/pod1/ctr", "memory.max", "max");
        write(
            "kubepods/pod1/ctr",
            "memory.current",
            &(800u64 << 20).to_string(),
        );
        assert_eq!(
            memory_room_in(root.path(), "0::/kubepods/pod1/ctr\n"),
            Some(124 << 20)
        );
        // v1: the memory controller's line.
        write(
            "memory/docker/abc",
            "memory.limit_in_bytes",
            &(512u64 << 20).to_string(),
        );
        write(
            "memory/docker/abc",
            "memory.usage_in_bytes",
            &(100u64 << 20).to_string(),
        );
        let v1 = "12:pids:/docker/abc\n4:memory:/docker/abc\n0::/docker/abc\n";
        assert_eq!(memory_room_in(root.path(), v1), Some(412 << 20));
        // Unlimited, unreadable, or another namespace's: nothing known.
        assert_eq!(memory_room_in(root.path(), "0::/nowhere\n"), None);
        assert_eq!(
            memory_room_in(root.path(), "0::/../../kubepods/pod1/ctr\n"),
            None
        );
        write("free", "memory.max", "max");
        write("free", "memory.current", "5");
        assert_eq!(memory_room_in(root.path(), "0::/free\n"), None);
    }
}
