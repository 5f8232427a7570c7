//! A process's memory cgroups as the kernel writes them (issue #40): which lines of
//! its `/proc/<pid>/cgroup` name one (v2's `0::PATH`, v1's `memory` controller), the
//! files holding each one's limit and use, and the room those figures leave.
//!
//! Reading the files, and which levels of the hierarchy to read, are the callers':
//! `kiwi_config::cgroup` (the arbiter, before it checkpoints a process into its own
//! memory) and the shim's pinning thread (before it pins host memory ahead). Here
//! because both link this dependency-free crate; the shim cannot link kiwi-config.

/// A memory cgroup a process belongs to, from one line of its `/proc/<pid>/cgroup`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryCgroup<'a> {
    /// Its path as the reader's cgroup namespace sees it (`/kubepods/pod1/abc`).
    pub path: &'a str,
    /// Where its hierarchy is mounted, under `/sys/fs/cgroup`: `""` (v2) or
    /// `"memory"` (v1).
    pub mount: &'static str,
    /// The file holding its limit: `memory.max` (v2), `memory.limit_in_bytes` (v1).
    pub limit_file: &'static str,
    /// The file holding its use: `memory.current` (v2), `memory.usage_in_bytes` (v1).
    pub usage_file: &'static str,
}

/// The memory cgroups named by `text`, the contents of a `/proc/<pid>/cgroup`, in
/// order; other controllers' lines and malformed lines are passed over.
pub fn memory_cgroups(text: &str) -> impl Iterator<Item = MemoryCgroup<'_>> {
    text.lines().filter_map(|line| {
        let mut parts = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next())
        else {
            return None;
        };
        if controllers.is_empty() {
            Some(MemoryCgroup {
                path,
                mount: "",
                limit_file: "memory.max",
                usage_file: "memory.current",
            })
        } else if controllers.split(',').any(|c| c == "memory") {
            Some(MemoryCgroup {
                path,
                mount: "memory",
                limit_file: "memory.limit_in_bytes",
                usage_file: "memory.usage_in_bytes",
            })
        } else {
            None
        }
    })
}

/// Room left under one limit, from the texts of its limit and use files; `None` when
/// unlimited (v2's `max`, v1's page-rounded `i64::MAX`) or unreadable.
pub fn room(limit: &str, usage: &str) -> Option<u64> {
    let limit = limit.trim().parse::<u64>().ok()?;
    let usage = usage.trim().parse::<u64>().ok()?;
    (limit < 1 << 62).then(|| limit.saturating_sub(usage))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_cgroups_of_either_version_are_named() {
        let text = "12:pids:/docker/abc\n4:cpu,memory:/docker/abc\n0::/kubepods/pod1\ngarbage\n";
        let got: Vec<_> = memory_cgroups(text)
            .map(|c| (c.path, c.mount, c.limit_file, c.usage_file))
            .collect();
        assert_eq!(
            got,
            [
                (
                    "/docker/abc",
                    "memory",
                    "memory.limit_in_bytes",
                    "memory.usage_in_bytes"
                ),
                ("/kubepods/pod1", "", "memory.max", "memory.current"),
            ]
        );
    }

    #[test]
    fn room_under_a_limit_and_none_without_one() {
        assert_eq!(room("max\n", "123\n"), None);
        assert_eq!(room("1073741824\n", "536870912\n"), Some(512 << 20));
        assert_eq!(room("100\n", "200\n"), Some(0));
        assert_eq!(room("9223372036854771712\n", "5\n"), None, "v1 unlimited");
        assert_eq!(room("", "5"), None);
    }
}
