//! The runc-compatible command line `kiwi-runtime` accepts: just enough of runc's
//! grammar (urfave/cli: `-flag`, `--flag`, `--flag=value`; flags stop at the first
//! positional argument) to find the subcommand and the bundle of `create` and `run`.
//!
//! Nothing is ever rewritten: the argv is handed to the real runtime as it came.

use std::ffi::OsString;
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;

/// runc's global flags that take a value (runc 1.1: `--root`, `--log`, `--log-format`,
/// `--criu`, `--rootless`). Boolean ones (`--debug`, `--systemd-cgroup`) need no entry.
const GLOBAL_VALUE_FLAGS: [&str; 5] = ["root", "log", "log-format", "criu", "rootless"];
/// Value-taking flags of `create` and `run`, so their values are not taken for the id.
const CREATE_VALUE_FLAGS: [&str; 5] = ["bundle", "b", "console-socket", "pid-file", "preserve-fds"];
/// runc 1.2 adds `--pidfd-socket`.
const CREATE_VALUE_FLAGS_NEW: [&str; 1] = ["pidfd-socket"];

/// What the wrapper needs from a command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuncCommand {
    /// The subcommand (`create`, `run`, `start`, …), if any.
    pub subcommand: Option<String>,
    /// The bundle of `create`/`run`: `--bundle`/`-b`, else the current directory.
    pub bundle: Option<PathBuf>,
    /// runc's `--log` file (containerd reads the last error from it).
    pub log: Option<PathBuf>,
    /// runc's `--log-format`.
    pub log_format: Option<String>,
}

impl RuncCommand {
    /// Whether this command creates a container, i.e. whether Kiwi may edit the spec.
    pub fn creates(&self) -> bool {
        matches!(self.subcommand.as_deref(), Some("create" | "run"))
    }
}

/// Splits `-name`, `--name` or `--name=value` into (name, inline value).
fn flag(arg: &[u8]) -> Option<(&[u8], Option<&[u8]>)> {
    let body = arg.strip_prefix(b"--").or_else(|| arg.strip_prefix(b"-"))?;
    if body.is_empty() {
        return None;
    }
    match body.iter().position(|&b| b == b'=') {
        Some(i) => Some((&body[..i], Some(&body[i + 1..]))),
        None => Some((body, None)),
    }
}

fn os(b: &[u8]) -> OsString {
    std::ffi::OsStr::from_bytes(b).to_os_string()
}

/// Parses runc's argv (without argv\[0\]).
pub fn parse(args: &[OsString]) -> RuncCommand {
    let mut cmd = RuncCommand {
        subcommand: None,
        bundle: None,
        log: None,
        log_format: None,
    };
    let mut i = 0;
    while i < args.len() {
        let a = args[i].as_bytes();
        if a == b"--" {
            i += 1;
            break;
        }
        let Some((name, inline)) = flag(a) else { break };
        let name = std::str::from_utf8(name).unwrap_or("");
        if GLOBAL_VALUE_FLAGS.contains(&name) {
            let value = match inline {
                Some(v) => Some(os(v)),
                None => {
                    i += 1;
                    args.get(i).cloned()
                }
            };
            match name {
                "log" => cmd.log = value.map(PathBuf::from),
                "log-format" => cmd.log_format = value.and_then(|v| v.into_string().ok()),
                _ => {}
            }
        }
        i += 1;
    }
    let Some(sub) = args.get(i) else { return cmd };
    cmd.subcommand = sub.to_str().map(str::to_string);
    if !cmd.creates() {
        return cmd;
    }
    i += 1;
    while i < args.len() {
        let a = args[i].as_bytes();
        if a == b"--" {
            break;
        }
        let Some((name, inline)) = flag(a) else { break };
        let name = std::str::from_utf8(name).unwrap_or("");
        if CREATE_VALUE_FLAGS.contains(&name) || CREATE_VALUE_FLAGS_NEW.contains(&name) {
            let value = match inline {
                Some(v) => Some(os(v)),
                None => {
                    i += 1;
                    args.get(i).cloned()
                }
            };
            if name == "bundle" || name == "b" {
                cmd.bundle = value.map(PathBuf::from);
            }
        }
        i += 1;
    }
    cmd
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &str) -> RuncCommand {
        let v: Vec<OsString> = s.split_whitespace().map(OsString::from).collect();
        parse(&v)
    }

    #[test]
    fn containerd_shim_create() {
        let c = p("--root /run/containerd/runc/k8s.io --log /x/log.json --log-format json --systemd-cgroup create --bundle /b --pid-file /b/init.pid id1");
        assert_eq!(c.subcommand.as_deref(), Some("create"));
        assert_eq!(c.bundle, Some(PathBuf::from("/b")));
        assert_eq!(c.log, Some(PathBuf::from("/x/log.json")));
        assert_eq!(c.log_format.as_deref(), Some("json"));
        assert!(c.creates());
    }

    #[test]
    fn docker_style_and_short_forms() {
        let c = p("--root=/r --debug run -d -b=/bb --console-socket /s --no-pivot myid");
        assert_eq!(c.subcommand.as_deref(), Some("run"));
        assert_eq!(c.bundle, Some(PathBuf::from("/bb")));
        let c = p("-root /r create -bundle /c x");
        assert_eq!(c.bundle, Some(PathBuf::from("/c")));
        let c = p("create id");
        assert_eq!(c.bundle, None, "runc defaults to the current directory");
    }

    #[test]
    fn flags_after_the_id_are_not_ours_and_values_are_not_flags() {
        let c = p("create --pid-file -b id --bundle /nope");
        assert_eq!(c.bundle, None);
        let c = p("--log /l start id");
        assert_eq!(c.subcommand.as_deref(), Some("start"));
        assert!(!c.creates());
        let c = p("--version");
        assert_eq!(c.subcommand, None);
    }
}
