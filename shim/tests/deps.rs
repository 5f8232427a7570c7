//! The shim is injected into any container, however small its image: it may need no
//! shared library beyond the C library's own (libc, the loader, libgcc_s for
//! unwinding). A `powf` once made it need libm, and a gpuburst in a busybox image
//! then failed to start (`libm.so.6: cannot open shared object file`).

mod common;

use std::process::Command;

#[test]
fn the_shim_needs_only_libc_the_loader_and_libgcc_s() {
    let shim = common::shim();
    assert!(shim.exists(), "{} is not built", shim.display());
    let out = Command::new("ldd").arg(&shim).output().expect("run ldd");
    assert!(out.status.success(), "ldd {}", shim.display());
    let text = String::from_utf8_lossy(&out.stdout);
    let allowed = ["linux-vdso.so", "libc.so.6", "libgcc_s.so.1", "ld-linux"];
    let extra: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !allowed.iter().any(|a| l.contains(a)))
        .collect();
    assert!(
        extra.is_empty(),
        "the shim needs more than libc: {extra:?}\n{text}"
    );
}
