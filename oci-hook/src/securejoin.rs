//! Resolving a path inside a container's rootfs as the container will see it: symlinks
//! are followed relative to the rootfs and `..` never climbs above it.
//!
//! The hook creates mount points and device nodes in an image it does not trust; an
//! image with `/etc -> /host/etc` must not make it write on the host. Safe here because
//! the hook runs before the container's first process exists (nothing can swap a path
//! under it between the check and the use).

use std::collections::VecDeque;
use std::ffi::OsString;
use std::io;
use std::path::{Component, Path, PathBuf};

/// Symlinks followed before giving up, as the kernel's limit for one lookup.
const MAX_LINKS: usize = 255;

/// `root` joined with `path`, symlinks in the existing part resolved within `root`.
/// Components that do not exist yet are kept as they are.
pub fn secure_join(root: &Path, path: &Path) -> io::Result<PathBuf> {
    let mut pending: VecDeque<OsString> = VecDeque::new();
    push_components(&mut pending, path, false);
    let mut resolved: Vec<OsString> = Vec::new();
    let mut links = 0;
    while let Some(c) = pending.pop_front() {
        if c == ".." {
            resolved.pop();
            continue;
        }
        let mut candidate = root.to_path_buf();
        candidate.extend(&resolved);
        candidate.push(&c);
        match std::fs::symlink_metadata(&candidate) {
            Ok(md) if md.file_type().is_symlink() => {
                links += 1;
                if links > MAX_LINKS {
                    return Err(io::Error::from_raw_os_error(libc::ELOOP));
                }
                let target = std::fs::read_link(&candidate)?;
                if target.is_absolute() {
                    resolved.clear();
                }
                push_components(&mut pending, &target, true);
            }
            _ => resolved.push(c),
        }
    }
    let mut out = root.to_path_buf();
    out.extend(&resolved);
    Ok(out)
}

fn push_components(queue: &mut VecDeque<OsString>, path: &Path, front: bool) {
    let comps: Vec<OsString> = path
        .components()
        .filter_map(|c| match c {
            Component::Normal(n) => Some(n.to_os_string()),
            Component::ParentDir => Some(OsString::from("..")),
            _ => None,
        })
        .collect();
    if front {
        for c in comps.into_iter().rev() {
            queue.push_front(c);
        }
    } else {
        queue.extend(comps);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    #[test]
    fn symlinks_stay_inside_the_root() {
        let d = tempfile::tempdir().unwrap();
        let root = d.path();
        std::fs::create_dir_all(root.join("real/etc")).unwrap();
        symlink("/real/etc", root.join("etc")).unwrap();
        symlink("../../../../..", root.join("up")).unwrap();
        symlink("/", root.join("slash")).unwrap();
        assert_eq!(
            secure_join(root, Path::new("/etc/ld.so.preload")).unwrap(),
            root.join("real/etc/ld.so.preload")
        );
        assert_eq!(
            secure_join(root, Path::new("/up/x")).unwrap(),
            root.join("x")
        );
        assert_eq!(
            secure_join(root, Path::new("/slash/../../tmp")).unwrap(),
            root.join("tmp")
        );
        assert_eq!(
            secure_join(root, Path::new("/usr/lib/kiwi/libkiwi.so")).unwrap(),
            root.join("usr/lib/kiwi/libkiwi.so")
        );
    }

    #[test]
    fn symlink_loops_end() {
        let d = tempfile::tempdir().unwrap();
        symlink("b", d.path().join("a")).unwrap();
        symlink("a", d.path().join("b")).unwrap();
        let e = secure_join(d.path(), Path::new("/a/x")).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ELOOP));
    }
}
