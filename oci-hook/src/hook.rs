//! What `kiwi-hook` does: given the OCI state on stdin, enter the container's mount
//! namespace (before `pivot_root`, the rootfs still at `root.path`) and
//!
//! - bind the shim read-only at `/usr/lib/kiwi/libkiwi.so`,
//! - record the container and have the arbiter serve its own client socket
//!   (`<socket-dir>/containers/<key>/`, see [`crate::attach`]), and bind that directory
//!   read-only at `/run/kiwi/client` (a directory, so a socket the arbiter recreates
//!   after a restart is seen inside; read-only, so the container cannot replace it),
//! - bind a copy of `/etc/ld.so.preload` that lists the shim before the image's own
//!   entries (a bind, so the image is never modified and a read-only root works; only
//!   an image without the file gets an empty mount point),
//! - create the device nodes that are missing,
//! - add the directories of the driver libraries kiwi-runtime bound (`--ld-dir`) to the
//!   container's ld cache, with the host's `ldconfig -r <rootfs>`, as NVIDIA's toolkit
//!   does; never with the image's own ldconfig, which would run as root on the host.
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

use crate::attach;
use crate::claim::Claim;
use crate::gpu::{self, DeviceNode, Gpu, GpuError, HostDevices};
use crate::securejoin::secure_join;
use crate::spec::{Spec, SpecError};

/// The state JSON is small; more than this on stdin is not a runtime talking.
const MAX_STATE_BYTES: u64 = 1 << 20;

/// The largest image `/etc/ld.so.preload` the hook copies. Real ones list a library or
/// two; a bigger one (a sparse 300 MiB file costs the image nothing) would make the hook
/// spend seconds writing a full copy into the bundle, which lives in RAM-backed `/run`.
pub const MAX_PRELOAD_BYTES: u64 = 64 * 1024;

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
    #[error("cannot give the container its vGPU: the Kiwi shim {path} is missing on this host (runtime.shim_path; {origin})")]
    ShimMissing { path: PathBuf, origin: String },
    #[error(transparent)]
    Attach(#[from] attach::AttachError),
    #[error("cannot enter the mount namespace of container process {pid}: {reason}")]
    Namespace { pid: i32, reason: String },
    #[error("inside the container: {0}")]
    Inject(String),
    #[error("cannot update the container's ld cache: {0}")]
    LdCache(String),
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
    /// Directories of bound driver libraries, inside the container, for its ld cache.
    #[serde(default)]
    pub ld_dirs: Vec<PathBuf>,
    /// The host's ldconfig, when there are `ld_dirs`.
    #[serde(default)]
    pub host_ldconfig: Option<PathBuf>,
    /// Something the hook's log should say (the arbiter could not be asked).
    #[serde(default)]
    pub note: Option<String>,
}

/// Where the host's ldconfig is looked for (glibc's is statically linked).
const HOST_LDCONFIG: [&str; 2] = ["/sbin/ldconfig", "/usr/sbin/ldconfig"];
/// The file the hook writes in the container's `/etc/ld.so.conf.d`, so an `ldconfig`
/// the container runs later (a package install) keeps the driver's directories.
pub const LD_CONF_FILE: &str = "/etc/ld.so.conf.d/00-kiwi-driver.conf";
/// How long ldconfig may take (it reads every library in the image's directories).
const LDCONFIG_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

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
    ld_dirs: &[PathBuf],
) -> Result<Injection, HookError> {
    if let Some(d) = ld_dirs.iter().find(|d| !d.is_absolute()) {
        return Err(HookError::LdCache(format!(
            "--ld-dir {} is not an absolute path",
            d.display()
        )));
    }
    let host_ldconfig = if ld_dirs.is_empty() {
        None
    } else {
        Some(
            HOST_LDCONFIG
                .iter()
                .map(PathBuf::from)
                .find(|p| p.is_file())
                .ok_or_else(|| {
                    HookError::LdCache(format!(
                        "no ldconfig on this host ({})",
                        HOST_LDCONFIG.join(", ")
                    ))
                })?,
        )
    };
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
            origin: crate::runtime::config_origin(cfg),
        });
    }
    // NVML starts threads; keep them out of this process, which must stay
    // single-threaded to fork safely below. Asked at most once, and only for a claim
    // that needs it (an index or `all`, or a UUID kiwi-runtime did not resolve).
    let table: std::cell::OnceCell<Result<Vec<Gpu>, String>> = Default::default();
    let discover = || {
        table
            .get_or_init(|| {
                in_child(|| {
                    let mut discovery =
                        gpu::discovery_from_config(cfg).map_err(|e| e.to_string())?;
                    discovery.discover().map_err(|e| e.to_string())
                })
            })
            .clone()
    };
    let in_spec = spec.nvidia_devices();
    let nodes = if in_spec.iter().any(is_gpu_node) {
        in_spec
    } else {
        let devices = HostDevices::new(&cfg.runtime.device_root);
        gpu::resolve_claim(claim, &devices, |uuid| {
            let gpus = discover().map_err(GpuError::DiscoveryIn)?;
            Ok(kiwi_nvml::minor_for_uuid(&gpus, uuid)?)
        })?
    };
    // The container's own client socket, for the GPUs it claimed.
    let (gpus, any_gpu) = attach::claimed_uuids(claim, || discover().ok());
    let record = attach::record(&state.id, pid, spec, gpus, any_gpu)?;
    let (client_dir, note) = attach::attach(socket_dir, &record)?;
    Ok(Injection {
        pid,
        bundle: state.bundle.clone(),
        rootfs: spec.rootfs(&state.bundle),
        shim: cfg.runtime.shim_path.clone(),
        client_dir,
        nodes,
        ld_dirs: ld_dirs.to_vec(),
        host_ldconfig,
        note,
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

fn preload_too_big(len: u64) -> String {
    format!(
        "/etc/ld.so.preload in the image is {len} bytes, more than the {MAX_PRELOAD_BYTES} \
         Kiwi accepts; a claimed container needs a smaller one"
    )
}

/// Reads the image's `/etc/ld.so.preload`, at most [`MAX_PRELOAD_BYTES`] of it. Opened
/// without following a symlink and without blocking, and checked again once open, so an
/// image that swaps the file for a FIFO or a link after the check gets an error, not a hang.
fn read_image_preload(path: &Path) -> Result<String, String> {
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| format!("cannot read /etc/ld.so.preload: {e}"))?;
    let md = f
        .metadata()
        .map_err(|e| format!("cannot read /etc/ld.so.preload: {e}"))?;
    if !md.is_file() {
        return Err("/etc/ld.so.preload exists in the image and is not a regular file".into());
    }
    if md.len() > MAX_PRELOAD_BYTES {
        return Err(preload_too_big(md.len()));
    }
    let mut buf = Vec::new();
    f.take(MAX_PRELOAD_BYTES + 1)
        .read_to_end(&mut buf)
        .map_err(|e| format!("cannot read /etc/ld.so.preload: {e}"))?;
    if buf.len() as u64 > MAX_PRELOAD_BYTES {
        return Err(preload_too_big(buf.len() as u64));
    }
    String::from_utf8(buf).map_err(|_| "/etc/ld.so.preload in the image is not UTF-8 text".into())
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
        Some(k) if k.is_file() => read_image_preload(&preload_target)?,
        Some(_) => {
            return Err("/etc/ld.so.preload exists in the image and is not a regular file".into())
        }
    };
    let preload = preload_contents(&existing);
    if !inj.ld_dirs.is_empty()
        && kind_of(&join(Path::new(LD_CONF_FILE))?).is_some_and(|k| !k.is_file())
    {
        return Err(format!(
            "{LD_CONF_FILE} exists in the image and is not a regular file"
        ));
    }

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
    update_ld_cache(inj)
}

/// Adds `inj.ld_dirs` to the container's ld cache, as NVIDIA's toolkit does: a file in
/// `/etc/ld.so.conf.d` listing them, then the host's `ldconfig -r <rootfs>` (which
/// chroots itself) with the directories on its command line too, so they count even
/// where `/etc/ld.so.conf` does not include `ld.so.conf.d`. `-X`: no symlinks are made in
/// the image's directories. Only images with glibc's files (an ldconfig or a cache) get
/// this; a musl or busybox image has no cache to update. The image's own ldconfig is
/// never run: from here it would run as root on the host, inside nothing but a chroot.
fn update_ld_cache(inj: &Injection) -> Result<(), String> {
    let Some(ldconfig) = inj
        .host_ldconfig
        .as_ref()
        .filter(|_| !inj.ld_dirs.is_empty())
    else {
        return Ok(());
    };
    let root = &inj.rootfs;
    let join = |p: &str| {
        secure_join(root, Path::new(p))
            .map_err(|e| format!("cannot resolve {p} in the rootfs: {e}"))
    };
    let mut glibc = false;
    for p in ["/sbin/ldconfig", "/usr/sbin/ldconfig", "/etc/ld.so.cache"] {
        glibc |= kind_of(&join(p)?).is_some();
    }
    if !glibc {
        return Ok(());
    }
    let fail = |what: String| format!("cannot update the container's ld cache: {what}");

    // Checked with the other targets before anything was mounted; O_NOFOLLOW below.
    let conf = join(LD_CONF_FILE)?;
    if let Some(dir) = conf.parent() {
        std::fs::create_dir_all(dir).map_err(|e| fail(format!("/etc/ld.so.conf.d: {e}")))?;
    }
    let mut text = String::from("# Kiwi: the NVIDIA driver libraries bound from the host\n");
    for d in &inj.ld_dirs {
        text.push_str(&d.to_string_lossy());
        text.push('\n');
    }
    {
        use std::os::unix::fs::OpenOptionsExt;
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o644)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(&conf)
            .map_err(|e| fail(format!("{LD_CONF_FILE}: {e}")))?;
        f.write_all(text.as_bytes())
            .map_err(|e| fail(format!("{LD_CONF_FILE}: {e}")))?;
    }

    // A Debian host's ldconfig does not search /lib64 and /usr/lib64 by itself; a
    // non-Debian image's loader does (NVIDIA's toolkit adds them the same way).
    let mut dirs: Vec<PathBuf> = inj.ld_dirs.clone();
    let debian_image = kind_of(&join("/etc/debian_version")?).is_some_and(|k| k.is_file());
    if Path::new("/etc/debian_version").is_file() && !debian_image {
        for d in ["/lib64", "/usr/lib64"] {
            if kind_of(&join(d)?).is_some_and(|k| k.is_dir()) && !dirs.iter().any(|x| x == d) {
                dirs.push(PathBuf::from(d));
            }
        }
    }
    let mut child = std::process::Command::new(ldconfig)
        .arg("-r")
        .arg(root)
        .args(["-X", "-f", "/etc/ld.so.conf", "-C", "/etc/ld.so.cache"])
        .args(&dirs)
        .env_clear()
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| fail(format!("cannot run {}: {e}", ldconfig.display())))?;
    // Drained on a thread so a chatty ldconfig cannot fill the pipe and stall.
    let mut stderr = child.stderr.take().expect("piped");
    let reader = std::thread::spawn(move || {
        let mut buf = Vec::new();
        let _ = stderr.read_to_end(&mut buf);
        buf
    });
    let t0 = std::time::Instant::now();
    let status = loop {
        match child.try_wait() {
            Ok(Some(st)) => break st,
            Ok(None) if t0.elapsed() > LDCONFIG_TIMEOUT => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(fail(format!(
                    "{} took more than {}s",
                    ldconfig.display(),
                    LDCONFIG_TIMEOUT.as_secs()
                )));
            }
            Ok(None) => std::thread::sleep(std::time::Duration::from_millis(2)),
            Err(e) => return Err(fail(format!("waiting for {}: {e}", ldconfig.display()))),
        }
    };
    let err = reader.join().unwrap_or_default();
    if !status.success() {
        let err = String::from_utf8_lossy(&err);
        let last = err
            .lines()
            .rfind(|l| !l.trim().is_empty())
            .unwrap_or("no message");
        return Err(fail(format!("{} {status}: {last}", ldconfig.display())));
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
