//! `kiwictl install` / `kiwictl uninstall`: the clap surface and the file handling
//! around the pure edits in `containerd` and `docker` — reading, `--dry-run` diffs,
//! backups, atomic writes, and the lines the user reads.
//!
//! Nothing here restarts or reloads a daemon: the messages say how to.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

use crate::containerd::{
    self, ContainerdOptions, DEFAULT_RUNTIME_PATH, DROP_IN_NAME, RUNTIME_NAME,
};
use crate::docker::{self, DockerOptions, DockerUndo};

/// Default containerd config.
pub const DEFAULT_CONTAINERD_CONFIG: &str = "/etc/containerd/config.toml";
/// Default docker config.
pub const DEFAULT_DOCKER_CONFIG: &str = "/etc/docker/daemon.json";
/// Suffix of the copy of a file taken before each change.
pub const BACKUP_SUFFIX: &str = ".kiwi-backup";
/// What to do after editing `daemon.json`. dockerd re-reads `runtimes` and
/// `default-runtime` on SIGHUP (`systemctl reload docker`); a restart would stop every
/// running container (without live-restore) for nothing.
pub const DOCKER_RELOAD_ADVICE: &str =
    "[INFO] Reload docker (SIGHUP; running containers keep running): systemctl reload docker";

/// Suffix of docker's undo record, next to `daemon.json`.
pub const DOCKER_UNDO_SUFFIX: &str = ".kiwi-undo";

/// `kiwictl install <target>`.
#[derive(Debug, clap::Args)]
pub struct InstallArgs {
    #[command(subcommand)]
    pub target: InstallTarget,
}

/// Which container engine to register the runtime with.
#[derive(Debug, clap::Subcommand)]
pub enum InstallTarget {
    /// Add runtime "kiwi" to containerd's CRI plugin (Kubernetes, nerdctl, ctr).
    Containerd(ContainerdInstallArgs),
    /// Add runtime "kiwi" to docker's daemon.json.
    Docker(DockerInstallArgs),
}

/// `kiwictl install containerd`.
#[derive(Debug, clap::Args)]
pub struct ContainerdInstallArgs {
    /// containerd config file (created if missing).
    #[arg(long, default_value = DEFAULT_CONTAINERD_CONFIG)]
    pub config: PathBuf,
    /// Write conf.d/99-kiwi.toml next to the config and add it to `imports`
    /// instead of editing the runtime table in place.
    #[arg(long)]
    pub drop_in: bool,
    /// Make "kiwi" containerd's default runtime.
    #[arg(long)]
    pub set_as_default: bool,
    /// Also enable CDI in the CRI plugin (`enable_cdi = true`).
    #[arg(long)]
    pub cdi: bool,
    /// Print the change as a unified diff and write nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// kiwi-runtime as containerd will exec it.
    #[arg(long, default_value = DEFAULT_RUNTIME_PATH)]
    pub runtime_path: String,
    /// Runtime name (the RuntimeClass handler).
    #[arg(long, default_value = RUNTIME_NAME)]
    pub runtime_name: String,
    /// The host's root as mounted here (e.g. /host in an installer container):
    /// paths written into the config are made relative to it.
    #[arg(long)]
    pub host_root: Option<PathBuf>,
    /// Take over a runtime of the same name that kiwictl did not write.
    #[arg(long)]
    pub force: bool,
}

/// `kiwictl install docker`.
#[derive(Debug, clap::Args)]
pub struct DockerInstallArgs {
    /// docker daemon config file (created if missing).
    #[arg(long, default_value = DEFAULT_DOCKER_CONFIG)]
    pub config: PathBuf,
    /// Make "kiwi" docker's default runtime.
    #[arg(long)]
    pub set_as_default: bool,
    /// Print the change as a unified diff and write nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// kiwi-runtime as dockerd will exec it.
    #[arg(long, default_value = DEFAULT_RUNTIME_PATH)]
    pub runtime_path: String,
    /// Runtime name (`docker run --runtime <name>`).
    #[arg(long, default_value = RUNTIME_NAME)]
    pub runtime_name: String,
}

/// `kiwictl uninstall <target>`.
#[derive(Debug, clap::Args)]
pub struct UninstallArgs {
    #[command(subcommand)]
    pub target: UninstallTarget,
}

/// Which container engine to take the runtime out of.
#[derive(Debug, clap::Subcommand)]
pub enum UninstallTarget {
    /// Remove what `kiwictl install containerd` added (in place or drop-in).
    Containerd(ContainerdUninstallArgs),
    /// Remove what `kiwictl install docker` added.
    Docker(DockerUninstallArgs),
}

/// `kiwictl uninstall containerd`.
#[derive(Debug, clap::Args)]
pub struct ContainerdUninstallArgs {
    #[arg(long, default_value = DEFAULT_CONTAINERD_CONFIG)]
    pub config: PathBuf,
    #[arg(long)]
    pub dry_run: bool,
    #[arg(long, default_value = RUNTIME_NAME)]
    pub runtime_name: String,
    #[arg(long)]
    pub host_root: Option<PathBuf>,
}

/// `kiwictl uninstall docker`.
#[derive(Debug, clap::Args)]
pub struct DockerUninstallArgs {
    #[arg(long, default_value = DEFAULT_DOCKER_CONFIG)]
    pub config: PathBuf,
    #[arg(long)]
    pub dry_run: bool,
    #[arg(long, default_value = RUNTIME_NAME)]
    pub runtime_name: String,
}

/// Runs `kiwictl install`, printing to stdout.
pub fn run_install(args: &InstallArgs) -> Result<()> {
    run_install_to(args, &mut std::io::stdout().lock())
}

/// Runs `kiwictl uninstall`, printing to stdout.
pub fn run_uninstall(args: &UninstallArgs) -> Result<()> {
    run_uninstall_to(args, &mut std::io::stdout().lock())
}

/// `run_install` with the user's messages written to `out`.
pub fn run_install_to(args: &InstallArgs, out: &mut dyn Write) -> Result<()> {
    match &args.target {
        InstallTarget::Containerd(a) => install_containerd_cmd(a, out),
        InstallTarget::Docker(a) => install_docker_cmd(a, out),
    }
}

/// `run_uninstall` with the user's messages written to `out`.
pub fn run_uninstall_to(args: &UninstallArgs, out: &mut dyn Write) -> Result<()> {
    match &args.target {
        UninstallTarget::Containerd(a) => uninstall_containerd_cmd(a, out),
        UninstallTarget::Docker(a) => uninstall_docker_cmd(a, out),
    }
}

/// The drop-in file as this process sees it, and the path containerd sees.
pub fn drop_in_paths(config: &Path, host_root: Option<&Path>) -> Result<(PathBuf, String)> {
    let dir = config.parent().unwrap_or(Path::new("/"));
    let local = dir.join("conf.d").join(DROP_IN_NAME);
    let seen = match host_root {
        None => local.clone(),
        Some(root) => {
            let rel = local.strip_prefix(root).with_context(|| {
                format!(
                    "--config {} is not under --host-root {}",
                    config.display(),
                    root.display()
                )
            })?;
            Path::new("/").join(rel)
        }
    };
    let seen = seen
        .to_str()
        .with_context(|| format!("path {} is not UTF-8", seen.display()))?
        .to_string();
    Ok((local, seen))
}

fn validate_name_and_path(name: &str, path: &str) -> Result<()> {
    let valid_name = !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_');
    if !valid_name {
        bail!("invalid runtime name {name:?}: use lowercase letters, digits, '-' and '_' (at most 63)");
    }
    if path.trim().is_empty() || path.contains(['\n', '\0']) {
        bail!("invalid runtime path {path:?}");
    }
    Ok(())
}

fn install_containerd_cmd(a: &ContainerdInstallArgs, out: &mut dyn Write) -> Result<()> {
    validate_name_and_path(&a.runtime_name, &a.runtime_path)?;
    let opts = ContainerdOptions {
        runtime_name: a.runtime_name.clone(),
        runtime_path: a.runtime_path.clone(),
        set_as_default: a.set_as_default,
        enable_cdi: a.cdi,
        force: a.force,
    };
    let cfg = &a.config;
    let old = read_optional(cfg)?;
    let old_text = old.as_deref().unwrap_or("");
    let mut changes: Vec<(PathBuf, Option<String>, String)> = Vec::new();

    if a.drop_in {
        let (drop_path, import_path) = drop_in_paths(cfg, a.host_root.as_deref())?;
        let r = containerd::install_containerd_drop_in(old_text, &import_path, &opts)
            .map_err(in_file(cfg))?;
        let old_drop = read_optional(&drop_path)?;
        if let Some(existing) = &old_drop {
            if !containerd::is_our_drop_in(existing) && !a.force {
                bail!(
                    "{} exists and was not written by kiwictl; remove it or pass --force",
                    drop_path.display()
                );
            }
        }
        push_change(&mut changes, cfg, old.as_deref(), r.main)?;
        if old_drop.as_deref() != Some(r.drop_in.as_str()) {
            changes.push((drop_path, old_drop, r.drop_in));
        }
    } else {
        let new = containerd::install_containerd(old_text, &opts).map_err(in_file(cfg))?;
        push_change(&mut changes, cfg, old.as_deref(), new)?;
    }

    if changes.is_empty() {
        return already_configured(out, &a.runtime_name, cfg);
    }
    if a.dry_run {
        return print_diffs(&changes, out);
    }
    // A runtime kiwictl added before (in the config or the drop-in) is updated.
    let verb = if changes.iter().any(|(_, old, _)| {
        old.as_deref()
            .is_some_and(|t| t.contains("[kiwictl] added runtime"))
    }) {
        "Updated"
    } else {
        "Added"
    };
    let backups = apply(&changes)?;
    writeln!(
        out,
        "[INFO] {verb} runtime \"{}\" in {}{}.",
        a.runtime_name,
        changes
            .iter()
            .map(|(p, _, _)| p.display().to_string())
            .collect::<Vec<_>>()
            .join(" and "),
        backup_note(&backups)
    )?;
    if a.set_as_default {
        writeln!(
            out,
            "[INFO] \"{}\" is now containerd's default runtime.",
            a.runtime_name
        )?;
    }
    writeln!(
        out,
        "[INFO] Restart containerd to use it: systemctl restart containerd"
    )?;
    Ok(())
}

fn uninstall_containerd_cmd(a: &ContainerdUninstallArgs, out: &mut dyn Write) -> Result<()> {
    let cfg = &a.config;
    let (drop_path, import_path) = drop_in_paths(cfg, a.host_root.as_deref())?;
    let mut changes: Vec<(PathBuf, Option<String>, String)> = Vec::new();
    let old = read_optional(cfg)?;
    if let Some(old_text) = &old {
        let r = containerd::uninstall_containerd(old_text, &a.runtime_name, &import_path)
            .map_err(in_file(cfg))?;
        for note in &r.notes {
            writeln!(out, "[WARN] {}: {note}", cfg.display())?;
        }
        push_change(&mut changes, cfg, Some(old_text), r.text)?;
    }
    let old_drop = read_optional(&drop_path)?;
    let remove_drop = old_drop.as_deref().is_some_and(containerd::is_our_drop_in);
    if old_drop.is_some() && !remove_drop {
        writeln!(
            out,
            "[WARN] {} was not written by kiwictl; left in place",
            drop_path.display()
        )?;
    }

    if changes.is_empty() && !remove_drop {
        writeln!(
            out,
            "[INFO] No runtime \"{}\" added by kiwictl in {}; nothing changed.",
            a.runtime_name,
            cfg.display()
        )?;
        return Ok(());
    }
    if a.dry_run {
        print_diffs(&changes, out)?;
        if remove_drop {
            writeln!(out, "would delete {}", drop_path.display())?;
        }
        return Ok(());
    }
    let backups = apply(&changes)?;
    if remove_drop {
        std::fs::remove_file(&drop_path)
            .with_context(|| format!("cannot delete {}", drop_path.display()))?;
        writeln!(out, "[INFO] Deleted {}.", drop_path.display())?;
    }
    removed(out, &a.runtime_name, cfg, &backups)?;
    writeln!(
        out,
        "[INFO] Restart containerd to apply: systemctl restart containerd"
    )?;
    Ok(())
}

/// The user's line for an install that found its runtime already there.
fn already_configured(out: &mut dyn Write, runtime_name: &str, cfg: &Path) -> Result<()> {
    writeln!(
        out,
        "[INFO] Runtime \"{runtime_name}\" is already configured in {}; nothing changed.",
        cfg.display()
    )?;
    Ok(())
}

/// The user's line for an uninstall that took the runtime out of `cfg`.
fn removed(out: &mut dyn Write, runtime_name: &str, cfg: &Path, backups: &[PathBuf]) -> Result<()> {
    writeln!(
        out,
        "[INFO] Removed runtime \"{runtime_name}\" from {}{}.",
        cfg.display(),
        backup_note(backups)
    )?;
    Ok(())
}

/// An edit's error, prefixed with the file it was about.
fn in_file<E: std::fmt::Display>(path: &Path) -> impl Fn(E) -> anyhow::Error + '_ {
    move |e| anyhow::anyhow!("{}: {e}", path.display())
}

/// docker's undo record at `undo_file` (none yet: an empty one).
fn read_undo(undo_file: &Path) -> Result<DockerUndo> {
    match read_optional(undo_file)? {
        Some(t) => DockerUndo::from_json(&t).map_err(in_file(undo_file)),
        None => Ok(DockerUndo::default()),
    }
}

fn undo_path(config: &Path) -> PathBuf {
    let mut s = config.as_os_str().to_owned();
    s.push(DOCKER_UNDO_SUFFIX);
    PathBuf::from(s)
}

fn install_docker_cmd(a: &DockerInstallArgs, out: &mut dyn Write) -> Result<()> {
    validate_name_and_path(&a.runtime_name, &a.runtime_path)?;
    let cfg = &a.config;
    let old = read_optional(cfg)?;
    let undo_file = undo_path(cfg);
    let undo = read_undo(&undo_file)?;
    let opts = DockerOptions {
        runtime_name: a.runtime_name.clone(),
        runtime_path: a.runtime_path.clone(),
        set_as_default: a.set_as_default,
    };
    let (new, new_undo) =
        docker::install_docker(old.as_deref().unwrap_or(""), &undo, &opts).map_err(in_file(cfg))?;
    if old.as_deref() == Some(new.as_str()) {
        return already_configured(out, &a.runtime_name, cfg);
    }
    let mut changes = vec![(cfg.clone(), old, new)];
    if new_undo != undo && !new_undo.is_empty() {
        let old_undo = read_optional(&undo_file)?;
        changes.push((undo_file, old_undo, new_undo.to_json()));
    }
    if a.dry_run {
        return print_diffs(&changes[..1], out);
    }
    let backups = apply(&changes[..1])?;
    // The undo record goes without a backup: it is kiwictl's own file.
    if let Some((path, _, text)) = changes.get(1) {
        write_atomic(path, text)?;
    }
    writeln!(
        out,
        "[INFO] Added runtime \"{}\" to {}{}.",
        a.runtime_name,
        cfg.display(),
        backup_note(&backups)
    )?;
    writeln!(
        out,
        "{DOCKER_RELOAD_ADVICE} to use it; then \
         docker run --runtime {} -e KIWI_VISIBLE_DEVICES=0 ...",
        a.runtime_name
    )?;
    Ok(())
}

fn uninstall_docker_cmd(a: &DockerUninstallArgs, out: &mut dyn Write) -> Result<()> {
    let cfg = &a.config;
    let undo_file = undo_path(cfg);
    let undo = read_undo(&undo_file)?;
    let Some(old) = read_optional(cfg)? else {
        writeln!(
            out,
            "[INFO] {} does not exist; nothing changed.",
            cfg.display()
        )?;
        return Ok(());
    };
    let new = docker::uninstall_docker(&old, &undo, &a.runtime_name).map_err(in_file(cfg))?;
    if new == old {
        writeln!(
            out,
            "[INFO] No runtime \"{}\" in {}; nothing changed.",
            a.runtime_name,
            cfg.display()
        )?;
        return Ok(());
    }
    let changes = vec![(cfg.clone(), Some(old), new)];
    if a.dry_run {
        return print_diffs(&changes, out);
    }
    let backups = apply(&changes)?;
    if undo_file.exists() {
        std::fs::remove_file(&undo_file)
            .with_context(|| format!("cannot delete {}", undo_file.display()))?;
    }
    removed(out, &a.runtime_name, cfg, &backups)?;
    writeln!(out, "{DOCKER_RELOAD_ADVICE} to apply")?;
    Ok(())
}

/// Queues `new` for `path` unless it equals what is there, byte for byte or as
/// the TOML editor would write the old text unchanged.
fn push_change(
    changes: &mut Vec<(PathBuf, Option<String>, String)>,
    path: &Path,
    old: Option<&str>,
    new: String,
) -> Result<()> {
    let unchanged = match old {
        Some(o) => o == new || containerd::normalized(o).is_ok_and(|n| n == new),
        None => false,
    };
    if !unchanged {
        changes.push((path.to_path_buf(), old.map(str::to_string), new));
    }
    Ok(())
}

fn print_diffs(changes: &[(PathBuf, Option<String>, String)], out: &mut dyn Write) -> Result<()> {
    for (path, old, new) in changes {
        let name = path.display().to_string();
        let diff = similar::TextDiff::from_lines(old.as_deref().unwrap_or(""), new.as_str());
        let old_name = if old.is_some() {
            name.clone()
        } else {
            "/dev/null".to_string()
        };
        write!(
            out,
            "{}",
            diff.unified_diff()
                .context_radius(3)
                .header(&old_name, &name)
        )?;
    }
    writeln!(out, "[INFO] Dry run: nothing was written.")?;
    Ok(())
}

/// Backs up and writes every change; returns the backups made.
fn apply(changes: &[(PathBuf, Option<String>, String)]) -> Result<Vec<PathBuf>> {
    let mut backups = Vec::new();
    for (path, old, new) in changes {
        // The drop-in is kiwictl's own file: no backup of it (which would also sit
        // in conf.d/ among the files containerd imports).
        let ours = path.file_name() == Some(std::ffi::OsStr::new(DROP_IN_NAME));
        if let (Some(old), false) = (old, ours) {
            let mut b = path.as_os_str().to_owned();
            b.push(BACKUP_SUFFIX);
            let b = PathBuf::from(b);
            write_atomic(&b, old)?;
            backups.push(b);
        }
        write_atomic(path, new)?;
    }
    Ok(backups)
}

fn backup_note(backups: &[PathBuf]) -> String {
    if backups.is_empty() {
        String::new()
    } else {
        format!(
            " (backup: {})",
            backups
                .iter()
                .map(|b| b.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        )
    }
}

/// The file's text, or `None` if it does not exist.
fn read_optional(path: &Path) -> Result<Option<String>> {
    match std::fs::read_to_string(path) {
        Ok(t) => Ok(Some(t)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e).with_context(|| format!("cannot read {}", path.display())),
    }
}

/// Writes through a temporary file in the same directory and a rename, so a
/// daemon never reads half a config; an existing file's permissions are kept.
fn write_atomic(path: &Path, text: &str) -> Result<()> {
    // A config that is a symlink (e.g. into a configuration-management tree) is
    // edited where it points; the link stays.
    let resolved;
    let path = if std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink()) {
        resolved = std::fs::canonicalize(path)
            .with_context(|| format!("cannot resolve symlink {}", path.display()))?;
        resolved.as_path()
    } else {
        path
    };
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let name = path
        .file_name()
        .with_context(|| format!("{} names no file", path.display()))?;
    let mut tmp_name = std::ffi::OsString::from(".");
    tmp_name.push(name);
    tmp_name.push(format!(".kiwi-tmp-{}", std::process::id()));
    let tmp = dir.join(tmp_name);
    std::fs::write(&tmp, text).with_context(|| format!("cannot write {}", tmp.display()))?;
    if let Ok(meta) = std::fs::metadata(path) {
        let _ = std::fs::set_permissions(&tmp, meta.permissions());
    }
    std::fs::rename(&tmp, path).with_context(|| {
        let _ = std::fs::remove_file(&tmp);
        format!("cannot replace {}", path.display())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Docker picks up `runtimes` on SIGHUP, so the advice is a reload: a restart would
    /// stop the node's running containers for nothing. (tests/tests/docker.rs follows
    /// this advice against a real dockerd.)
    #[test]
    fn docker_advice_is_a_reload_not_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let args = |dry_run| DockerInstallArgs {
            config: dir.path().join("daemon.json"),
            set_as_default: false,
            dry_run,
            runtime_path: DEFAULT_RUNTIME_PATH.into(),
            runtime_name: RUNTIME_NAME.into(),
        };
        let mut out = Vec::new();
        install_docker_cmd(&args(false), &mut out).unwrap();
        let out = String::from_utf8(out).unwrap();
        assert!(out.contains("systemctl reload docker to use it"), "{out}");
        assert!(!out.contains("restart"), "{out}");

        let mut out = Vec::new();
        let un = DockerUninstallArgs {
            config: dir.path().join("daemon.json"),
            dry_run: false,
            runtime_name: RUNTIME_NAME.into(),
        };
        uninstall_docker_cmd(&un, &mut out).unwrap();
        let out = String::from_utf8(out).unwrap();
        assert!(out.contains("systemctl reload docker to apply"), "{out}");
        assert!(!out.contains("restart"), "{out}");
    }
}
