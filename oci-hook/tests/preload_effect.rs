//! The preload takes effect: inside a claimed container, a dynamically linked program
//! gets the (stand-in) shim loaded by ld.so from `/etc/ld.so.preload`, first in symbol
//! lookup, with the image's own preloaded library still loaded; an unclaimed
//! container's program gets exactly what the image asked for.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;

fn announce_lib(out: &Path, tag: &str) {
    let def = format!("-DTAG=\"{tag}\"");
    gcc(
        &["-shared", "-fPIC", &def, &format!("{HELPERS}/announce.c")],
        out,
    );
}

/// Copies the program's shared libraries (from `ldd`) into the rootfs at their paths.
fn copy_libs(program: &Path, rootfs: &Path) {
    let out = Command::new("ldd").arg(program).output().unwrap();
    assert!(out.status.success(), "ldd {}", program.display());
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let path = line
            .split_whitespace()
            .find(|w| w.starts_with('/'))
            .map(PathBuf::from);
        let Some(path) = path else { continue };
        let dst = rootfs.join(path.strip_prefix("/").unwrap());
        std::fs::create_dir_all(dst.parent().unwrap()).unwrap();
        std::fs::copy(&path, &dst).unwrap();
    }
}

#[test]
fn claimed_programs_load_the_shim_after_the_images_own_preload() {
    if !require(&["runc", "busybox", "gcc", "ldd"]) {
        return;
    }
    let fx = Fixture::new();
    let _arbiter = FakeArbiter::start(&fx.socket_dir);
    // The stand-in shim replaces the fixture's text file.
    announce_lib(&fx.shim, "KIWI");
    let hello = fx.path().join("hello");
    gcc(&[&format!("{HELPERS}/hello.c")], &hello);

    for (claimed, env) in [
        (true, "KIWI_VISIBLE_DEVICES=0"),
        (false, "KIWI_VISIBLE_DEVICES="),
    ] {
        let b = fx.bundle(
            if claimed {
                "dyn-claimed"
            } else {
                "dyn-unclaimed"
            },
            "/bin/hello",
            &[env],
        );
        let rootfs = b.join("rootfs");
        std::fs::copy(&hello, rootfs.join("bin/hello")).unwrap();
        copy_libs(&hello, &rootfs);
        std::fs::create_dir_all(rootfs.join("lib")).unwrap();
        announce_lib(&rootfs.join("lib/libimage-own.so"), "IMAGE");

        let out = fx.run_container(&b);
        let (stdout, stderr) = text(&out);
        assert!(out.status.success(), "{stderr}\n{stdout}");
        let mut lines: Vec<&str> = stdout.lines().collect();
        let said = lines.pop();
        lines.sort_unstable(); // constructors run in reverse load order
        if claimed {
            assert_eq!(lines, ["LOADED:IMAGE", "LOADED:KIWI"], "{stderr}");
            // Listed first, the shim's symbols win over the image's preload.
            assert_eq!(
                said,
                Some("KIWI says: HELLO-FROM-DYNAMIC-PROGRAM"),
                "{stdout}"
            );
        } else {
            assert_eq!(lines, ["LOADED:IMAGE"], "{stderr}");
            assert_eq!(
                said,
                Some("IMAGE says: HELLO-FROM-DYNAMIC-PROGRAM"),
                "{stdout}"
            );
        }
        assert!(!stderr.contains("cannot be preloaded"), "{stderr}");
    }
}
