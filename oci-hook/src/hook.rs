//! What `kiwi-hook` does: given the OCI state on stdin, enter the container's mount
//! namespace (before `pivot_root`, the rootfs still at `root.path`) and
//!
//! - bind the shim read-only at `/usr/lib/kiwi/libkiwi.so`,
//! - bind the host's `<socket-dir>/client` read-only at `/run/kiwi/client` (a directory,
//!   so a socket the arbiter recreates after a restart is seen inside; read-only, so a
//!   container cannot replace the arbiter's socket for everyone),
//! - bind a copy of `/etc/ld.so.preload` that lists the shim before the image's own
//!   entries (a bind, so the image is never modified and a read-only root works; only
//!   an image without the file gets an empty mount point),
//! - create the device nodes that are missing.
//!
//! The namespace work runs in a forked child, so the hook's own process never changes
//! namespace and every error comes back to it as one line. An unclaimed container is
//! left alone: the hook returns before reading any configuration.

use std::ffi::CString;
use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use kiwi_config::{Config, CONTAINER_CLIENT_DIR, CONTAINER_SHIM_PATH};
use nix::mount::{mount, MsFlags};
use nix::sys::stat::{makedev, mknod, Mode, SFlag};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::claim::Claim;
use crate::gpu::{self, DeviceNode, GpuError, HostDevices, StaticGpus};
use crate::securejoin::secure_join;
use crate::spec::{Spec, SpecError};

/// The state JSON is small; more than this on stdin is not a runtime talking.
const MAX_STATE_BYTES: u64 = 1 << 20;

#[derive(Debug, thiserror::Error)]
pub enum HookError {
    #[error("cannot read the container state on stdin: {0}")]
    StdinRead(std::io::Error),
    #[error("the container state on stdin is not valid OCI state JSON: {0}")]
    State(String),
    #[error(transparent)]
    Spec(#[from] SpecError),
    #[error(transparent)]
    Config(#[from] kiwi_config::ConfigError),
    #[error("cannot give the container its vGPU: {0}")]
    Gpu(#[from] GpuError),
    #[error("cannot give the container its vGPU: the Kiwi shim {path} is missing on this host (runtime.shim_path)")]
    ShimMissing { path: PathBuf },
    #[error("cannot create the client socket directory {path}: {source}")]
    ClientDir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot enter the mount namespace of container process {pid}: {reason}")]
    Namespace { pid: i32, reason: String },
    #[error("inside the container: {0}")]
    Inject(String),
}

/// The OCI state a runtime passes to hooks on stdin.
#[derive(Debug, Clone, Deserialize)]
pub struct State {
    #[serde(rename = "ociVersion")]
    pub oci_version: String,
    pub id: String,
    #[serde(default)]
    pub status: Option<String>,
    #[serde(default)]
    pub pid: Option<i32>,
    pub bundle: PathBuf,
}

/// Parses the state JSON.
pub fn parse_state(bytes: &[u8]) -> Result<State, HookError> {
    let st: State = serde_json::from_slice(bytes).map_err(|e| HookError::State(e.to_string()))?;
    if st.bundle.as_os_str().is_empty() {
        return Err(HookError::State("\"bundle\" is empty".into()));
    }
    Ok(st)
}

/// Reads the state from a reader (stdin), refusing oversize input.
pub fn read_state(r: impl Read) -> Result<State, HookError> {
    let mut buf = Vec::new();
    r.take(MAX_STATE_BYTES + 1)
        .read_to_end(&mut buf)
        .map_err(HookError::StdinRead)?;
    if buf.len() as u64 > MAX_STATE_BYTES {
        return Err(HookError::State(format!(
            "more than {MAX_STATE_BYTES} bytes"
        )));
    }
    parse_state(&buf)
}

/// Everything the namespace work needs, computed on the host side first.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Injection {
    pub pid: i32,
    pub bundle: PathBuf,
    pub rootfs: PathBuf,
    pub shim: PathBuf,
    pub client_dir: PathBuf,
    pub nodes: Vec<DeviceNode>,
}

/// The container's claim and the spec, or `None` when nothing claims a vGPU.
pub fn claimed_spec(state: &State) -> Result<Option<(Spec, Claim)>, HookError> {
    let spec = Spec::load(&state.bundle)?;
    let claim = spec.claim()?;
    Ok(claim.is_claimed().then_some((spec, claim)))
}

fn is_gpu_node(n: &DeviceNode) -> bool {
    n.path
        .to_str()
        .and_then(|p| p.strip_prefix("/dev/nvidia"))
        .is_some_and(|r| !r.is_empty() && r.bytes().all(|b| b.is_ascii_digit()))
}

/// Plans the injection for a claimed container. The device nodes come from the spec
/// when kiwi-runtime already put them there; otherwise (CDI, `hooks.d`) from the claim.
pub fn plan(
    state: &State,
    spec: &Spec,
    claim: &Claim,
    cfg: &Config,
    socket_dir: &Path,
) -> Result<Injection, HookError> {
    let pid = match state.pid {
        Some(p) if p > 0 => p,
        _ => {
            return Err(HookError::State(
                "no container \"pid\" (is this a prestart or createRuntime hook?)".into(),
            ))
        }
    };
    if !cfg.runtime.shim_path.is_file() {
        return Err(HookError::ShimMissing {
            path: cfg.runtime.shim_path.clone(),
        });
    }
    let in_spec = spec.nvidia_devices();
    let nodes = if in_spec.iter().any(is_gpu_node) {
        in_spec
    } else {
        let devices = HostDevices::new(&cfg.runtime.device_root);
        gpu::resolve_claim(claim, &devices, || {
            // NVML starts threads; keep them out of this process, which must stay
            // single-threaded to fork safely below.
            let gpus = in_child(|| {
                gpu::discovery_from_config(cfg)
                    .and_then(|d| d.gpus())
                    .map_err(|e| e.to_string())
            })
            .map_err(GpuError::Nvml)?;
            Ok(Box::new(StaticGpus(gpus)))
        })?
    };
    let client_dir = kiwi_config::client_dir(socket_dir);
    if !client_dir.is_dir() {
        std::fs::create_dir_all(&client_dir).map_err(|source| HookError::ClientDir {
            path: client_dir.clone(),
            source,
        })?;
        let _ = std::fs::set_permissions(&client_dir, std::fs::Permissions::from_mode(0o755));
    }
    Ok(Injection {
        pid,
        bundle: state.bundle.clone(),
        rootfs: spec.rootfs(&state.bundle),
        shim: cfg.runtime.shim_path.clone(),
        client_dir,
        nodes,
    })
}

/// Runs `f` in a forked child and returns its result. The caller must be
/// single-threaded (the hook is), so the child may allocate freely.
pub fn in_child<T, F>(f: F) -> Result<T, String>
where
    T: Serialize + DeserializeOwned,
    F: FnOnce() -> Result<T, String>,
{
    let (rd, wr) = nix::unistd::pipe().map_err(|e| format!("pipe: {e}"))?;
    // SAFETY: the hook process is single-threaded (no runtime, no threads started), so
    // the child is a full copy in which allocation and std I/O are safe.
    match unsafe { nix::unistd::fork() }.map_err(|e| format!("fork: {e}"))? {
        nix::unistd::ForkResult::Child => {
            drop(rd);
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f))
                .unwrap_or_else(|_| Err("internal error (panic)".into()));
            let bytes = serde_json::to_vec(&result).unwrap_or_default();
            let mut w = std::fs::File::from(wr);
            let _ = w.write_all(&bytes);
            drop(w);
            // SAFETY: _exit ends the child without running the parent's atexit handlers
            // or flushing its copied stdio buffers twice.
            unsafe { libc::_exit(0) }
        }
        nix::unistd::ForkResult::Parent { child } => {
            drop(wr);
            let mut buf = Vec::new();
            let mut r = std::fs::File::from(rd);
            let read = r.read_to_end(&mut buf);
            let status = nix::sys::wait::waitpid(child, None);
            read.map_err(|e| format!("reading from the helper process: {e}"))?;
            match serde_json::from_slice::<Result<T, String>>(&buf) {
                Ok(r) => r,
                Err(_) => Err(format!(
                    "helper process died without an answer ({status:?})"
                )),
            }
        }
    }
}

/// Enters the container's mount namespace in a child and injects everything.
pub fn inject(inj: &Injection) -> Result<(), HookError> {
    let ns = format!("/proc/{}/ns/mnt", inj.pid);
    let ns_fd = std::fs::File::open(&ns).map_err(|e| HookError::Namespace {
        pid: inj.pid,
        reason: format!("{ns}: {e}"),
    })?;
    in_child(|| {
        nix::sched::setns(&ns_fd, nix::sched::CloneFlags::CLONE_NEWNS)
            .map_err(|e| format!("setns({ns}): {e}"))?;
        inject_here(inj)
    })
    .map_err(HookError::Inject)
}

fn cpath(p: &Path) -> Result<CString, String> {
    CString::new(p.as_os_str().as_encoded_bytes())
        .map_err(|_| format!("{} contains a NUL byte", p.display()))
}

/// A mount point for a file: the file itself if there is one, else an empty new file.
fn ensure_file(target: &Path, shown: &str) -> Result<(), String> {
    match std::fs::symlink_metadata(target) {
        Ok(md) if md.is_file() => Ok(()),
        Ok(_) => Err(format!(
            "{shown} exists in the image and is not a regular file"
        )),
        Err(_) => {
            if let Some(parent) = target.parent() {
                std::fs::create_dir_all(parent)
                    .map_err(|e| format!("cannot create the directory for {shown}: {e}"))?;
            }
            std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode_0644()
                .open(target)
                .map(drop)
                .map_err(|e| format!("cannot create the mount point {shown}: {e}"))
        }
    }
}

trait Mode0644 {
    fn mode_0644(&mut self) -> &mut Self;
}

impl Mode0644 for std::fs::OpenOptions {
    fn mode_0644(&mut self) -> &mut Self {
        use std::os::unix::fs::OpenOptionsExt;
        self.mode(0o644)
    }
}

/// Binds `source` on `target`, then makes the bind read-only, nosuid and nodev.
fn bind_ro(source: &Path, target: &Path, shown: &str, extra: MsFlags) -> Result<(), String> {
    let (s, t) = (cpath(source)?, cpath(target)?);
    mount(
        Some(s.as_c_str()),
        t.as_c_str(),
        None::<&str>,
        MsFlags::MS_BIND,
        None::<&str>,
    )
    .map_err(|e| format!("cannot bind {} on {shown}: {e}", source.display()))?;
    let flags = MsFlags::MS_BIND
        | MsFlags::MS_REMOUNT
        | MsFlags::MS_RDONLY
        | MsFlags::MS_NOSUID
        | MsFlags::MS_NODEV
        | extra;
    mount(
        None::<&str>,
        t.as_c_str(),
        None::<&str>,
        flags,
        None::<&str>,
    )
    .map_err(|e| format!("cannot make {shown} read-only: {e}"))
}

/// The new `/etc/ld.so.preload`: the shim first, so its symbols (the CUDA driver API,
/// `dlsym`) win symbol lookup over any other preloaded library, then the image's own
/// entries, unchanged. `None` when the image already lists the shim.
pub fn preload_contents(existing: &str) -> Option<String> {
    let listed = existing
        .split(|c: char| c.is_whitespace() || c == ':')
        .any(|e| e == CONTAINER_SHIM_PATH);
    if listed {
        return None;
    }
    let mut out = format!("{CONTAINER_SHIM_PATH}\n");
    out.push_str(existing);
    if !out.ends_with('\n') {
        out.push('\n');
    }
    Some(out)
}

/// What a path in the image is, for the checks made before anything changes.
fn kind_of(target: &Path) -> Option<std::fs::FileType> {
    std::fs::symlink_metadata(target)
        .ok()
        .map(|m| m.file_type())
}

/// The injection proper, run inside the container's mount namespace. Every target is
/// resolved and checked first, so an image the hook cannot serve fails before anything
/// is created or mounted.
fn inject_here(inj: &Injection) -> Result<(), String> {
    let root = &inj.rootfs;
    let join = |p: &Path| {
        secure_join(root, p)
            .map_err(|e| format!("cannot resolve {} in the rootfs: {e}", p.display()))
    };

    // Check.
    let mut new_nodes = Vec::new();
    for node in &inj.nodes {
        let target = join(&node.path)?;
        if kind_of(&target).is_none() {
            new_nodes.push((target, node));
        }
    }
    let shim_target = join(Path::new(CONTAINER_SHIM_PATH))?;
    if kind_of(&shim_target).is_some_and(|k| !k.is_file()) {
        return Err(format!(
            "{CONTAINER_SHIM_PATH} exists in the image and is not a regular file"
        ));
    }
    let client_target = join(Path::new(CONTAINER_CLIENT_DIR))?;
    if kind_of(&client_target).is_some_and(|k| !k.is_dir()) {
        return Err(format!(
            "{CONTAINER_CLIENT_DIR} exists in the image and is not a directory"
        ));
    }
    let preload_target = join(Path::new("/etc/ld.so.preload"))?;
    let existing = match kind_of(&preload_target) {
        None => String::new(),
        Some(k) if k.is_file() => std::fs::read_to_string(&preload_target)
            .map_err(|e| format!("cannot read /etc/ld.so.preload: {e}"))?,
        Some(_) => {
            return Err("/etc/ld.so.preload exists in the image and is not a regular file".into())
        }
    };
    let preload = preload_contents(&existing);

    // Act. Device nodes first: they need a writable /dev, which binds never affect.
    for (target, node) in new_nodes {
        let shown = node.path.display();
        if let Some(parent) = target.parent() {
            std::fs::create_dir_all(parent)
                .map_err(|e| format!("cannot create the directory for {shown}: {e}"))?;
        }
        let mode = Mode::from_bits_truncate(node.mode as libc::mode_t);
        mknod(
            &target,
            SFlag::S_IFCHR,
            mode,
            makedev(node.major, node.minor),
        )
        .map_err(|e| format!("cannot create device node {shown}: {e}"))?;
        // mknod applies the umask; the node must have the host's mode.
        std::fs::set_permissions(&target, std::fs::Permissions::from_mode(node.mode))
            .map_err(|e| format!("cannot set the mode of {shown}: {e}"))?;
    }

    ensure_file(&shim_target, CONTAINER_SHIM_PATH)?;
    bind_ro(
        &inj.shim,
        &shim_target,
        CONTAINER_SHIM_PATH,
        MsFlags::empty(),
    )?;

    if kind_of(&client_target).is_none() {
        std::fs::create_dir_all(&client_target)
            .map_err(|e| format!("cannot create the mount point {CONTAINER_CLIENT_DIR}: {e}"))?;
    }
    bind_ro(
        &inj.client_dir,
        &client_target,
        CONTAINER_CLIENT_DIR,
        MsFlags::MS_NOEXEC,
    )?;

    if let Some(contents) = preload {
        ensure_file(&preload_target, "/etc/ld.so.preload")?;
        // The bind source is a file in the bundle directory (the runtime's, normally
        // writable; else /run, else the temp dir), removed as soon as it is mounted: the
        // mount keeps its contents and nothing is left behind. (A memfd cannot be a bind
        // source: EINVAL.)
        let name = format!(".kiwi-ld.so.preload.{}", std::process::id());
        let mut tried = Vec::new();
        let mut source = None;
        for dir in [
            inj.bundle.clone(),
            PathBuf::from("/run"),
            std::env::temp_dir(),
        ] {
            let candidate = dir.join(&name);
            match std::fs::write(&candidate, &contents) {
                Ok(()) => {
                    source = Some(candidate);
                    break;
                }
                Err(e) => tried.push(format!("{}: {e}", dir.display())),
            }
        }
        let source = source.ok_or_else(|| {
            format!(
                "cannot write the new /etc/ld.so.preload anywhere ({})",
                tried.join("; ")
            )
        })?;
        let _ = std::fs::set_permissions(&source, std::fs::Permissions::from_mode(0o644));
        let bound = bind_ro(
            &source,
            &preload_target,
            "/etc/ld.so.preload",
            MsFlags::MS_NOEXEC,
        );
        let _ = std::fs::remove_file(&source);
        bound?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn preload_keeps_image_entries_and_adds_the_shim_once() {
        assert_eq!(preload_contents("").unwrap(), "/usr/lib/kiwi/libkiwi.so\n");
        assert_eq!(
            preload_contents("/lib/libjemalloc.so").unwrap(),
            "/usr/lib/kiwi/libkiwi.so\n/lib/libjemalloc.so\n"
        );
        assert_eq!(preload_contents("/a.so /usr/lib/kiwi/libkiwi.so\n"), None);
    }

    #[test]
    fn state_must_be_oci_state() {
        let ok = parse_state(
            br#"{"ociVersion":"1.0.2","id":"c1","status":"creating","pid":42,"bundle":"/b"}"#,
        )
        .unwrap();
        assert_eq!(ok.pid, Some(42));
        for bad in [
            &b"garbage"[..],
            b"{}",
            br#"{"ociVersion":"1","id":"x","bundle":""}"#,
            b"\xff\xfe",
        ] {
            let e = parse_state(bad).unwrap_err();
            assert!(
                e.to_string().starts_with("the container state on stdin"),
                "{e}"
            );
        }
    }

    #[test]
    fn child_results_and_errors_come_back() {
        assert_eq!(in_child(|| Ok::<u32, String>(7)).unwrap(), 7);
        assert_eq!(
            in_child(|| Err::<u32, String>("nope".into())).unwrap_err(),
            "nope"
        );
    }
}
