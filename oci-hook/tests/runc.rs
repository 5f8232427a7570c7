//! A busybox container run for real through `kiwi-runtime run` (runc underneath).

mod common;

use std::time::Duration;

use common::*;

/// Prints one `KEY=...` line per fact the assertions check.
fn probe_script(driver: &str) -> String {
    format!(
        r#"
echo "SHIM=$(cat /usr/lib/kiwi/libkiwi.so 2>&1)"
if (echo x > /usr/lib/kiwi/libkiwi.so) 2>/dev/null; then echo SHIM_RW=writable; else echo SHIM_RW=readonly; fi
echo "PRELOAD=$(cat /etc/ld.so.preload 2>&1 | tr '\n' ' ')"
for d in /dev/nvidia0 /dev/nvidia1 /dev/nvidiactl /dev/nvidia-uvm /dev/nvidia-uvm-tools; do
  if [ -e $d ]; then echo "NODE $(stat -c '%n %t:%T %a %F' $d)"; echo "OPEN $d $(cat $d 2>&1 | head -1)"; else echo "NODE $d absent"; fi
done
if [ -d /run/kiwi/client ]; then echo SOCKDIR=present; else echo SOCKDIR=absent; fi
if [ -e /usr/lib/kiwi/libkiwi.so ]; then echo SHIMFILE=present; else echo SHIMFILE=absent; fi
/bin/uconnect /run/kiwi/client/arbiter.sock container 2>&1
echo "DRIVER=$(cat {driver} 2>&1)"
echo "FRAMEWORK_ENV=[$XLA_PYTHON_CLIENT_PREALLOCATE] [$TF_FORCE_GPU_ALLOW_GROWTH]"
echo DONE
"#
    )
}

fn line<'a>(out: &'a str, key: &str) -> &'a str {
    out.lines()
        .find_map(|l| l.strip_prefix(key))
        .unwrap_or_else(|| panic!("no {key} line in:\n{out}"))
}

#[test]
fn claimed_container_gets_shim_preload_socket_and_devices() {
    if !require(&["runc", "busybox", "gcc"]) {
        return;
    }
    let fx = Fixture::new();
    let arbiter = FakeArbiter::start(&fx.socket_dir);
    let driver = fx.driver_file.display().to_string();
    // By UUID, through the configured GPU list: UUID1 is GPU 1, so nvidia0 stays out.
    let claim = format!("KIWI_VISIBLE_DEVICES={UUID1}");
    let bundle = fx.bundle("claimed", &probe_script(&driver), &[&claim]);
    let out = fx.run_container(&bundle);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "run failed: {stderr}\n{stdout}");
    assert!(stdout.contains("DONE"), "{stdout}");

    assert_eq!(line(&stdout, "SHIM="), SHIM_CONTENT);
    assert_eq!(line(&stdout, "SHIM_RW="), "readonly");
    assert_eq!(
        line(&stdout, "PRELOAD="),
        "/usr/lib/kiwi/libkiwi.so /lib/libimage-own.so ",
        "the shim first, the image's entry kept"
    );
    assert!(stdout.contains("NODE /dev/nvidia0 absent"), "{stdout}");
    // busybox stat prints majors and minors in hex: 195 = c3, 255 = ff, 250 = fa.
    assert!(
        stdout.contains("NODE /dev/nvidia1 c3:1 666 character special file"),
        "{stdout}"
    );
    assert!(stdout.contains("NODE /dev/nvidiactl c3:ff 666"), "{stdout}");
    assert!(
        stdout.contains("NODE /dev/nvidia-uvm c3:fa 666"),
        "{stdout}"
    );
    assert!(
        stdout.contains("NODE /dev/nvidia-uvm-tools c3:fb 666"),
        "{stdout}"
    );
    // The device cgroup (runc spec: deny all) lets them be opened: no driver → ENXIO.
    for d in [
        "/dev/nvidia1",
        "/dev/nvidiactl",
        "/dev/nvidia-uvm",
        "/dev/nvidia-uvm-tools",
    ] {
        let l = stdout
            .lines()
            .find(|l| l.starts_with(&format!("OPEN {d} ")))
            .unwrap();
        assert!(l.contains("No such device or address"), "{l}");
        assert!(!l.contains("not permitted"), "{l}");
    }
    assert_eq!(line(&stdout, "SOCKDIR="), "present");
    assert_eq!(line(&stdout, "UCONNECT-REPLY:"), "ok");
    // Its own socket, gone with the container (`runc run` deletes it at the end).
    assert_own_socket(&arbiter, "hello from container", &fx.socket_dir, true);
    assert_eq!(line(&stdout, "DRIVER="), DRIVER_CONTENT);
    // Frameworks are told not to hoard the GPU.
    assert_eq!(line(&stdout, "FRAMEWORK_ENV="), "[false] [true]");

    // The image itself was not modified: the preload list is a bind, not a write.
    let image_preload = std::fs::read_to_string(bundle.join("rootfs/etc/ld.so.preload")).unwrap();
    assert_eq!(image_preload, "/lib/libimage-own.so\n");
    // The spec carries the devices, allow rules and the hook with our config file.
    let spec: serde_json::Value =
        serde_json::from_slice(&std::fs::read(bundle.join("config.json")).unwrap()).unwrap();
    let rules = spec["linux"]["resources"]["devices"].as_array().unwrap();
    assert!(rules
        .iter()
        .any(|r| r["allow"] == true && r["major"] == 195 && r["minor"] == 1));
    let hook = &spec["hooks"]["prestart"][0];
    assert_eq!(hook["path"], HOOK);
    let args: Vec<&str> = hook["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    let cfg = std::fs::canonicalize(&fx.config).unwrap();
    assert_eq!(args[1..3], ["--config", cfg.to_str().unwrap()]);
    assert!(fx.runc_list().is_empty(), "container left behind");
}

#[test]
fn claim_by_index_and_all() {
    if !require(&["runc", "busybox", "gcc"]) {
        return;
    }
    let fx = Fixture::new();
    let _arbiter = FakeArbiter::start(&fx.socket_dir);
    let script = "for d in /dev/nvidia0 /dev/nvidia1; do [ -e $d ] && echo HAS $d; done; cat /etc/ld.so.preload; echo DONE";
    let b0 = fx.bundle("idx", script, &["KIWI_VISIBLE_DEVICES=0"]);
    let (o0, e0) = text(&fx.run_container(&b0));
    assert!(
        o0.contains("HAS /dev/nvidia0") && !o0.contains("HAS /dev/nvidia1"),
        "{o0}{e0}"
    );
    assert!(o0.contains("/usr/lib/kiwi/libkiwi.so"), "{o0}");
    let ba = fx.bundle("all", script, &["KIWI_VISIBLE_DEVICES=all"]);
    let (oa, ea) = text(&fx.run_container(&ba));
    assert!(
        oa.contains("HAS /dev/nvidia0") && oa.contains("HAS /dev/nvidia1"),
        "{oa}{ea}"
    );
}

#[test]
fn the_containers_own_framework_env_wins_and_the_key_turns_the_defaults_off() {
    if !require(&["runc", "busybox", "gcc"]) {
        return;
    }
    let fx = Fixture::new();
    let _arbiter = FakeArbiter::start(&fx.socket_dir);
    let script = "env | grep -E '^(XLA_PYTHON_CLIENT_PREALLOCATE|TF_FORCE_GPU_ALLOW_GROWTH)=' | sort; echo DONE";
    let b = fx.bundle(
        "ownenv",
        script,
        &[
            "XLA_PYTHON_CLIENT_PREALLOCATE=true",
            "KIWI_VISIBLE_DEVICES=0",
        ],
    );
    let out = fx.run_container(&b);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert_eq!(
        stdout, "TF_FORCE_GPU_ALLOW_GROWTH=true\nXLA_PYTHON_CLIENT_PREALLOCATE=true\nDONE\n",
        "the spec's own value, once; the other default added"
    );

    // `[hook] framework_defaults = false`: the claim is served, nothing is added.
    fx.write_config("\n[hook]\nframework_defaults = false");
    let b = fx.bundle("noenv", script, &["KIWI_VISIBLE_DEVICES=0"]);
    let out = fx.run_container(&b);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert_eq!(stdout, "DONE\n");
    let spec: serde_json::Value =
        serde_json::from_slice(&std::fs::read(b.join("config.json")).unwrap()).unwrap();
    assert_eq!(spec["hooks"]["prestart"][0]["path"], HOOK, "still claimed");
}

#[test]
fn unclaimed_container_is_untouched() {
    if !require(&["runc", "busybox", "gcc"]) {
        return;
    }
    let fx = Fixture::new();
    let arbiter = FakeArbiter::start(&fx.socket_dir);
    let driver = fx.driver_file.display().to_string();
    for (name, env) in [
        ("noclaim", vec![]),
        ("none", vec!["KIWI_VISIBLE_DEVICES=none"]),
    ] {
        let bundle = fx.bundle(name, &probe_script(&driver), &env);
        let before = std::fs::read(bundle.join("config.json")).unwrap();
        let out = fx.run_container(&bundle);
        let (stdout, stderr) = text(&out);
        assert!(out.status.success(), "{stderr}");
        assert_eq!(
            std::fs::read(bundle.join("config.json")).unwrap(),
            before,
            "config.json must stay byte-for-byte"
        );
        assert_eq!(line(&stdout, "SHIMFILE="), "absent");
        assert_eq!(line(&stdout, "PRELOAD="), "/lib/libimage-own.so ");
        assert_eq!(line(&stdout, "SOCKDIR="), "absent");
        for d in ["nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"] {
            assert!(
                stdout.contains(&format!("NODE /dev/{d} absent")),
                "{stdout}"
            );
        }
        assert!(
            line(&stdout, "DRIVER=").contains("No such file"),
            "{stdout}"
        );
        assert_eq!(line(&stdout, "FRAMEWORK_ENV="), "[] []");
        assert!(
            !bundle.join("rootfs/usr/lib/kiwi").exists(),
            "nothing created in the image"
        );
    }
    assert!(
        arbiter.heard.lock().unwrap().is_empty(),
        "no connection expected"
    );
}

#[test]
fn image_kiwi_cannot_serve_fails_before_anything_is_injected() {
    if !require(&["runc", "busybox", "gcc"]) {
        return;
    }
    let fx = Fixture::new();
    let b = fx.bundle("blocked", "echo STARTED", &["KIWI_VISIBLE_DEVICES=0"]);
    // The image has a file where the socket directory must be mounted.
    std::fs::create_dir_all(b.join("rootfs/run/kiwi")).unwrap();
    std::fs::write(b.join("rootfs/run/kiwi/client"), "not a dir").unwrap();
    let out = fx.run_container(&b);
    let (stdout, stderr) = text(&out);
    assert!(!out.status.success(), "{stdout}");
    assert!(
        !stdout.contains("STARTED"),
        "the container must not start without Kiwi"
    );
    assert!(
        stderr.contains("kiwi-hook: inside the container: /run/kiwi/client exists in the image and is not a directory"),
        "{stderr}"
    );
    assert!(
        !b.join("rootfs/usr/lib/kiwi").exists(),
        "nothing created before the check"
    );
    assert!(fx.runc_list().is_empty(), "no container left");
    let leftovers: Vec<_> = std::fs::read_dir(&b)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with(".kiwi"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

#[test]
fn image_symlinks_cannot_make_the_hook_write_on_the_host() {
    if !require(&["runc", "busybox", "gcc"]) {
        return;
    }
    let fx = Fixture::new();
    let _arbiter = FakeArbiter::start(&fx.socket_dir);
    let host_target = fx.path().join("host-etc");
    std::fs::create_dir_all(&host_target).unwrap();
    let b = fx.bundle(
        "evil",
        "cat /etc/ld.so.preload; cat /usr/lib/kiwi/libkiwi.so; echo; echo DONE",
        &["KIWI_VISIBLE_DEVICES=0"],
    );
    let rootfs = b.join("rootfs");
    // /etc and /usr point at absolute host paths; inside the container they resolve
    // within the rootfs, and so must the hook.
    std::fs::remove_dir_all(rootfs.join("etc")).unwrap();
    std::os::unix::fs::symlink(&host_target, rootfs.join("etc")).unwrap();
    std::os::unix::fs::symlink(&host_target, rootfs.join("usr")).unwrap();
    let out = fx.run_container(&b);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stdout.contains("/usr/lib/kiwi/libkiwi.so") && stdout.contains(SHIM_CONTENT),
        "{stdout}"
    );
    assert_eq!(
        std::fs::read_dir(&host_target).unwrap().count(),
        0,
        "the hook wrote through an image symlink onto the host"
    );
    assert!(rootfs
        .join(host_target.strip_prefix("/").unwrap())
        .join("ld.so.preload")
        .exists());
}

#[test]
fn huge_preload_in_the_image_is_refused_quickly_without_a_copy() {
    if !require(&["runc", "busybox", "gcc"]) {
        return;
    }
    let fx = Fixture::new();
    let _arbiter = FakeArbiter::start(&fx.socket_dir);
    let b = fx.bundle("hugepreload", "echo STARTED", &["KIWI_VISIBLE_DEVICES=0"]);
    // Sparse: 300 MiB that cost the image nothing, and would cost the hook a full copy.
    let f = std::fs::File::create(b.join("rootfs/etc/ld.so.preload")).unwrap();
    f.set_len(300 << 20).unwrap();
    drop(f);
    let t0 = std::time::Instant::now();
    let out = fx.run_container(&b);
    let took = t0.elapsed();
    let (stdout, stderr) = text(&out);
    assert!(!out.status.success(), "{stdout}");
    assert!(
        !stdout.contains("STARTED"),
        "a claimed container must not start without Kiwi"
    );
    assert!(
        stderr.contains(
            "kiwi-hook: inside the container: /etc/ld.so.preload in the image is 314572800 bytes, \
             more than the 65536 Kiwi accepts"
        ),
        "{stderr}"
    );
    assert!(took < Duration::from_secs(3), "took {took:?}");
    let leftovers: Vec<_> = std::fs::read_dir(&b)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with(".kiwi"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
    assert!(fx.runc_list().is_empty(), "no container left");

    // Exactly at the cap it still works: the limit is on size, not on having a file.
    let b = fx.bundle(
        "bigpreload",
        "echo STARTED; head -c 30 /etc/ld.so.preload",
        &["KIWI_VISIBLE_DEVICES=0"],
    );
    let mut text64 = "/lib/libimage-own.so\n".repeat(64 * 1024 / 21);
    text64.push_str(&"#".repeat(64 * 1024 - text64.len()));
    std::fs::write(b.join("rootfs/etc/ld.so.preload"), &text64).unwrap();
    let out = fx.run_container(&b);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stdout.contains("STARTED\n/usr/lib/kiwi/libkiwi.so\n/lib"),
        "{stdout}"
    );
}
