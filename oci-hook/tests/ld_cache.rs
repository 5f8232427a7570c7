//! Driver libraries bound at host paths the image does not know (a RHEL host's
//! `/usr/lib64` under an Ubuntu image; here the fixture's `<tmp>/driver`) are found by the
//! container's loader: kiwi-hook adds their directories to the container's ld cache with
//! the host's `ldconfig -r <rootfs>`. The image's own `/sbin/ldconfig` is never run: the
//! hook runs as root on the host, and an image can put anything there.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;

/// Copies the program's shared libraries (from `ldd`) into the rootfs at their paths.
fn copy_libs(program: &Path, rootfs: &Path) {
    let out = Command::new("ldd").arg(program).output().unwrap();
    assert!(out.status.success(), "ldd {}", program.display());
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Some(path) = line
            .split_whitespace()
            .find(|w| w.starts_with('/'))
            .map(PathBuf::from)
        else {
            continue;
        };
        let dst = rootfs.join(path.strip_prefix("/").unwrap());
        std::fs::create_dir_all(dst.parent().unwrap()).unwrap();
        std::fs::copy(&path, &dst).unwrap();
    }
}

/// A glibc image: busybox, a dynamically linked program that dlopens libcuda.so.1, its
/// libraries, an ld.so.conf that includes ld.so.conf.d, and an `/sbin/ldconfig` that
/// only leaves a mark, so running it would show.
fn glibc_bundle(fx: &Fixture, name: &str, dlcuda: &Path, env: &[&str]) -> PathBuf {
    let b = fx.bundle(name, "/bin/dlcuda", env);
    let rootfs = b.join("rootfs");
    std::fs::copy(dlcuda, rootfs.join("bin/dlcuda")).unwrap();
    copy_libs(dlcuda, &rootfs);
    // No image preload here: this test is about the loader finding libcuda.
    std::fs::remove_file(rootfs.join("etc/ld.so.preload")).unwrap();
    std::fs::write(
        rootfs.join("etc/ld.so.conf"),
        "include /etc/ld.so.conf.d/*.conf\n",
    )
    .unwrap();
    std::fs::create_dir_all(rootfs.join("sbin")).unwrap();
    let ldconfig = rootfs.join("sbin/ldconfig");
    std::fs::write(&ldconfig, "#!/bin/sh\necho ran > /IMAGE-LDCONFIG-RAN\n").unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&ldconfig, std::fs::Permissions::from_mode(0o755)).unwrap();
    b
}

#[test]
fn driver_libraries_at_host_paths_resolve_inside_the_container() {
    if !require(&["runc", "busybox", "gcc", "ldd", "ldconfig"]) {
        return;
    }
    let fx = Fixture::new();
    let _arbiter = FakeArbiter::start(&fx.socket_dir);
    // The shim must be a loadable library: ld.so loads it from the preload.
    gcc(
        &["-shared", "-fPIC", &format!("{HELPERS}/fakecuda.c")],
        &fx.shim,
    );
    // The host's libcuda.so.1, in a directory no image searches.
    gcc(
        &[
            "-shared",
            "-fPIC",
            "-Wl,-soname,libcuda.so.1",
            &format!("{HELPERS}/fakecuda.c"),
        ],
        &fx.driver_file,
    );
    let dlcuda = fx.path().join("dlcuda");
    gcc(&[&format!("{HELPERS}/dlcuda.c")], &dlcuda);
    let driver_dir = fx.driver_file.parent().unwrap().display().to_string();

    let b = glibc_bundle(&fx, "ld-claimed", &dlcuda, &["KIWI_VISIBLE_DEVICES=0"]);
    let out = fx.run_container(&b);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}\n{stdout}");
    assert!(
        stdout.contains("DLOPEN-OK:FAKE-LIBCUDA"),
        "libcuda.so.1 not found by the container's loader:\n{stdout}\n{stderr}"
    );
    let rootfs = b.join("rootfs");
    assert!(
        !rootfs.join("IMAGE-LDCONFIG-RAN").exists(),
        "the hook ran the image's own ldconfig"
    );
    let conf =
        std::fs::read_to_string(rootfs.join("etc/ld.so.conf.d/00-kiwi-driver.conf")).unwrap();
    assert!(conf.lines().any(|l| l == driver_dir), "{conf}");
    // The cache the container's loader read lists libcuda.so.1 at its bound path.
    let cache = Command::new("ldconfig")
        .arg("-p")
        .arg("-C")
        .arg(rootfs.join("etc/ld.so.cache"))
        .output()
        .unwrap();
    let cache = String::from_utf8_lossy(&cache.stdout);
    assert!(
        cache.contains(&format!(
            "libcuda.so.1 (libc6,x86-64) => {}",
            fx.driver_file.display()
        )) || !cfg!(target_arch = "x86_64"),
        "{cache}"
    );

    // The same image unclaimed: nothing bound, no cache written, libcuda not found.
    let b = glibc_bundle(&fx, "ld-unclaimed", &dlcuda, &[]);
    let out = fx.run_container(&b);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.contains("DLOPEN-FAIL"), "{stdout}");
    assert!(!b.join("rootfs/etc/ld.so.cache").exists());
    assert!(!b.join("rootfs/etc/ld.so.conf.d").exists());
}
