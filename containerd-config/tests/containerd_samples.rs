//! Install / uninstall on real-world shaped containerd configs of every version:
//! the runtime lands where containerd looks for it, with runc's options copied,
//! comments survive, a second install changes nothing, and uninstall gives back
//! the original bytes.

use kiwi_containerd_config::containerd::{
    detect_version, install_containerd, install_containerd_drop_in, is_our_drop_in, parse,
    uninstall_containerd, ConfigVersion, ContainerdOptions, RUNC_V2,
};
use kiwi_containerd_config::EditError;
use toml_edit::{DocumentMut, Item};

const IMPORT: &str = "/etc/containerd/conf.d/99-kiwi.toml";

fn sample(name: &str) -> String {
    let path = format!("{}/tests/data/{name}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// (file, schema, key of the plugin holding the runtimes)
const SAMPLES: &[(&str, ConfigVersion, &str)] = &[
    ("v1.toml", ConfigVersion::V1, "cri"),
    ("v2.toml", ConfigVersion::V2, "io.containerd.grpc.v1.cri"),
    ("v3.toml", ConfigVersion::V3, "io.containerd.cri.v1.runtime"),
    ("empty.toml", ConfigVersion::V2, "io.containerd.grpc.v1.cri"),
    (
        "comments-only.toml",
        ConfigVersion::V2,
        "io.containerd.grpc.v1.cri",
    ),
];

fn plugin<'a>(doc: &'a DocumentMut, key: &str) -> &'a Item {
    &doc["plugins"][key]
}

fn comment_lines(text: &str) -> Vec<String> {
    text.lines()
        .filter_map(|l| l.find('#').map(|i| l[i..].to_string()))
        .collect()
}

#[test]
fn every_version_gets_the_runtime_in_the_right_table() {
    for &(name, version, key) in SAMPLES {
        let original = sample(name);
        let out = install_containerd(&original, &ContainerdOptions::default())
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let doc = parse(&out).unwrap();
        assert_eq!(detect_version(&doc).unwrap().0, version, "{name}");
        let kiwi = &plugin(&doc, key)["containerd"]["runtimes"]["kiwi"];
        assert_eq!(
            kiwi["runtime_type"].as_str(),
            Some(RUNC_V2),
            "{name}:\n{out}"
        );
        assert_eq!(
            kiwi["options"]["BinaryName"].as_str(),
            Some("/usr/local/bin/kiwi-runtime"),
            "{name}:\n{out}"
        );
        if version != ConfigVersion::V1 {
            assert_eq!(
                doc["version"].as_integer(),
                Some(version.number()),
                "{name} must say its version:\n{out}"
            );
        }
        // Nothing lands in another version's table.
        for other in [
            "cri",
            "io.containerd.grpc.v1.cri",
            "io.containerd.cri.v1.runtime",
        ] {
            if other != key {
                let kiwi = doc["plugins"]
                    .get(other)
                    .and_then(|p| p.get("containerd"))
                    .and_then(|c| c.get("runtimes"))
                    .and_then(|r| r.get("kiwi"));
                assert!(kiwi.is_none(), "{name}: kiwi in {other}");
            }
        }
    }
}

#[test]
fn runc_options_are_copied_and_other_runtimes_untouched() {
    for &(name, _, key) in &SAMPLES[..3] {
        let original = sample(name);
        let out = install_containerd(&original, &ContainerdOptions::default()).unwrap();
        let doc = parse(&out).unwrap();
        let before = parse(&original).unwrap();
        let runtimes = &plugin(&doc, key)["containerd"]["runtimes"];
        assert_eq!(
            runtimes["kiwi"]["options"]["SystemdCgroup"].as_bool(),
            Some(true),
            "{name}: SystemdCgroup not copied:\n{out}"
        );
        for other in ["runc", "nvidia"] {
            assert_eq!(
                runtimes[other].to_string(),
                plugin(&before, key)["containerd"]["runtimes"][other].to_string(),
                "{name}: runtime {other} changed"
            );
        }
        // The v3 runc table has sandboxer = 'podsandbox': copied as well.
        if name == "v3.toml" {
            assert_eq!(runtimes["kiwi"]["sandboxer"].as_str(), Some("podsandbox"));
        }
    }
}

#[test]
fn comments_and_formatting_survive() {
    for &(name, _, _) in SAMPLES {
        let original = sample(name);
        let out = install_containerd(&original, &ContainerdOptions::default()).unwrap();
        let mut expected = comment_lines(&original);
        let mut got = comment_lines(&out);
        got.retain(|c| !c.contains("[kiwictl]"));
        expected.sort();
        got.sort();
        assert_eq!(got, expected, "{name}: comments changed:\n{out}");
        // Every original line is still there, in order (the edit only inserts).
        let mut out_lines = out.lines();
        for line in original.lines() {
            assert!(
                out_lines.any(|l| l == line),
                "{name}: line {line:?} lost or reordered:\n{out}"
            );
        }
    }
}

#[test]
fn install_twice_changes_nothing_and_uninstall_restores_bytes() {
    let variants = [
        ContainerdOptions::default(),
        ContainerdOptions {
            set_as_default: true,
            enable_cdi: true,
            ..Default::default()
        },
    ];
    for &(name, _, _) in SAMPLES {
        let original = sample(name);
        for opts in &variants {
            let once = install_containerd(&original, opts).unwrap();
            assert_ne!(once, original, "{name}: install changed nothing");
            let twice = install_containerd(&once, opts).unwrap();
            assert_eq!(twice, once, "{name}: second install changed the file");
            let removed = uninstall_containerd(&once, "kiwi", IMPORT).unwrap();
            assert!(removed.notes.is_empty(), "{name}: {:?}", removed.notes);
            assert_eq!(removed.text, original, "{name} {opts:?}: not restored");
        }
    }
}

#[test]
fn set_as_default_and_cdi_are_recorded_and_undone() {
    let original = sample("v2.toml");
    let opts = ContainerdOptions {
        set_as_default: true,
        enable_cdi: true,
        ..Default::default()
    };
    let out = install_containerd(&original, &opts).unwrap();
    let doc = parse(&out).unwrap();
    let cri = plugin(&doc, "io.containerd.grpc.v1.cri");
    assert_eq!(
        cri["containerd"]["default_runtime_name"].as_str(),
        Some("kiwi")
    );
    assert_eq!(cri["enable_cdi"].as_bool(), Some(true));
    assert!(
        out.contains("      # [kiwictl] was: \"runc\"\n      default_runtime_name = \"kiwi\"   # keep runc for system pods\n"),
        "old value and trailing comment kept:\n{out}"
    );

    // v3: enable_cdi belongs to the runtime plugin.
    let out = install_containerd(&sample("v3.toml"), &opts).unwrap();
    let doc = parse(&out).unwrap();
    let rt = plugin(&doc, "io.containerd.cri.v1.runtime");
    assert_eq!(rt["enable_cdi"].as_bool(), Some(true));
    assert_eq!(
        rt["containerd"]["default_runtime_name"].as_str(),
        Some("kiwi")
    );
}

#[test]
fn uninstall_leaves_a_default_the_user_changed_since() {
    let opts = ContainerdOptions {
        set_as_default: true,
        ..Default::default()
    };
    let out = install_containerd(&sample("v2.toml"), &opts).unwrap();
    let edited = out.replace(
        "default_runtime_name = \"kiwi\"",
        "default_runtime_name = \"nvidia\"",
    );
    let removed = uninstall_containerd(&edited, "kiwi", IMPORT).unwrap();
    let doc = parse(&removed.text).unwrap();
    assert_eq!(
        plugin(&doc, "io.containerd.grpc.v1.cri")["containerd"]["default_runtime_name"].as_str(),
        Some("nvidia")
    );
    assert!(!removed.text.contains("[kiwictl]"));
}

#[test]
fn runtime_path_is_updated_in_place() {
    let once = install_containerd(&sample("v2.toml"), &ContainerdOptions::default()).unwrap();
    let moved = install_containerd(
        &once,
        &ContainerdOptions {
            runtime_path: "/opt/kiwi/bin/kiwi-runtime".into(),
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(
        moved,
        once.replace("/usr/local/bin/kiwi-runtime", "/opt/kiwi/bin/kiwi-runtime")
    );
}

#[test]
fn a_foreign_kiwi_runtime_is_refused_unless_forced() {
    let text = "version = 2\n[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.kiwi]\n  runtime_type = \"io.containerd.runc.v2\"\n";
    assert_eq!(
        install_containerd(text, &ContainerdOptions::default()),
        Err(EditError::ForeignRuntime("kiwi".into()))
    );
    let removed = uninstall_containerd(text, "kiwi", IMPORT).unwrap();
    assert_eq!(
        removed.text, text,
        "uninstall must not remove what it did not add"
    );
    assert_eq!(removed.notes.len(), 1);
    let forced = install_containerd(
        text,
        &ContainerdOptions {
            force: true,
            ..Default::default()
        },
    )
    .unwrap();
    assert!(
        forced.contains("BinaryName = \"/usr/local/bin/kiwi-runtime\""),
        "{forced}"
    );
}

#[test]
fn malformed_and_unsupported_configs_are_errors_with_a_line() {
    let bad = "version = 2\n[plugins]\n  x = \n";
    match install_containerd(bad, &ContainerdOptions::default()) {
        Err(EditError::MalformedToml { line, message }) => {
            assert_eq!(line, 3, "{message}");
            assert!(!message.is_empty());
        }
        other => panic!("unexpected {other:?}"),
    }
    assert_eq!(
        install_containerd("version = 4\n", &ContainerdOptions::default()),
        Err(EditError::UnsupportedVersion(4))
    );
    assert!(matches!(
        install_containerd(
            "version = 2\n[plugins]\n\"io.containerd.grpc.v1.cri\" = { containerd = { snapshotter = \"x\" } }\n",
            &ContainerdOptions::default()
        ),
        Err(EditError::Layout { .. })
    ));
}

#[test]
fn drop_in_carries_the_cri_section_and_imports_it() {
    for &(name, version, key) in SAMPLES {
        let original = sample(name);
        let r = install_containerd_drop_in(&original, IMPORT, &ContainerdOptions::default())
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(is_our_drop_in(&r.drop_in));
        let main = parse(&r.main).unwrap();
        let imports: Vec<&str> = main["imports"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|v| v.as_str())
            .collect();
        assert!(imports.contains(&IMPORT), "{name}: {imports:?}");
        assert!(
            main.get("plugins")
                .and_then(|p| p.get(key))
                .and_then(|p| p.get("containerd"))
                .and_then(|c| c.get("runtimes"))
                .and_then(|r| r.get("kiwi"))
                .is_none(),
            "{name}: main config must not get the runtime table"
        );
        let drop = parse(&r.drop_in).unwrap();
        let runtimes = &drop["plugins"][key]["containerd"]["runtimes"];
        assert_eq!(
            runtimes["kiwi"]["options"]["BinaryName"].as_str(),
            Some("/usr/local/bin/kiwi-runtime")
        );
        if version != ConfigVersion::V1 {
            assert_eq!(
                drop.get("version").and_then(Item::as_integer),
                Some(version.number()),
                "{name}:\n{}",
                r.drop_in
            );
        }
        if name.starts_with('v') {
            // The copy keeps the rest of the section (containerd 1.x replaces it whole).
            assert!(runtimes.get("nvidia").is_some(), "{name}:\n{}", r.drop_in);
            assert_eq!(
                runtimes["kiwi"]["options"]["SystemdCgroup"].as_bool(),
                Some(true)
            );
        }
        let again =
            install_containerd_drop_in(&r.main, IMPORT, &ContainerdOptions::default()).unwrap();
        assert_eq!(again, r, "{name}: second drop-in install differs");
        let removed = uninstall_containerd(&r.main, "kiwi", IMPORT).unwrap();
        assert_eq!(removed.text, original, "{name}: imports not undone");
    }
}

#[test]
fn drop_in_reuses_an_existing_glob_and_appends_to_imports() {
    let text = "version = 2\nimports = [\"/etc/containerd/conf.d/*.toml\"]\n";
    let r = install_containerd_drop_in(text, IMPORT, &ContainerdOptions::default()).unwrap();
    assert_eq!(r.main, text, "covered by the glob: main unchanged");

    let v3 = sample("v3.toml");
    let r = install_containerd_drop_in(&v3, IMPORT, &ContainerdOptions::default()).unwrap();
    assert!(
        r.main.contains(&format!(
            "imports = ['/etc/containerd/certs.conf', \"{IMPORT}\"]"
        )),
        "{}",
        r.main
    );
    assert_eq!(
        uninstall_containerd(&r.main, "kiwi", IMPORT).unwrap().text,
        v3
    );
}

fn kiwi_of(out: &str) -> toml_edit::Table {
    let doc = parse(out).unwrap();
    doc["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]["kiwi"]
        .as_table()
        .unwrap_or_else(|| panic!("no kiwi table:\n{out}"))
        .clone()
}

#[test]
fn unusual_runc_layouts_are_copied_too() {
    // Dotted keys and an inline options table.
    for text in [
        "version = 2\n[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.runc]\n  runtime_type = \"io.containerd.runc.v2\"\n  options.SystemdCgroup = true\n",
        "version = 2\n[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.runc]\n  runtime_type = \"io.containerd.runc.v2\"\n  options = { SystemdCgroup = true, NoPivotRoot = false }\n",
    ] {
        let out = install_containerd(text, &ContainerdOptions::default()).unwrap();
        let kiwi = kiwi_of(&out);
        assert_eq!(kiwi["options"]["SystemdCgroup"].as_bool(), Some(true), "{out}");
        assert_eq!(
            kiwi["options"]["BinaryName"].as_str(),
            Some("/usr/local/bin/kiwi-runtime")
        );
        assert_eq!(uninstall_containerd(&out, "kiwi", IMPORT).unwrap().text, text);
    }
}

#[test]
fn without_runc_the_default_runc_shim_runtime_is_the_base() {
    let text = "version = 2\n[plugins.\"io.containerd.grpc.v1.cri\".containerd]\n  default_runtime_name = \"nvidia\"\n[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.nvidia]\n  runtime_type = \"io.containerd.runc.v2\"\n[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.nvidia.options]\n  BinaryName = \"/usr/bin/nvidia-container-runtime\"\n  SystemdCgroup = true\n";
    let out = install_containerd(text, &ContainerdOptions::default()).unwrap();
    let kiwi = kiwi_of(&out);
    assert_eq!(kiwi["options"]["SystemdCgroup"].as_bool(), Some(true));
    assert_eq!(
        kiwi["options"]["BinaryName"].as_str(),
        Some("/usr/local/bin/kiwi-runtime"),
        "BinaryName replaced, not copied"
    );

    // A runtime of another shim (e.g. gVisor) is not a base: fresh settings.
    let text = "version = 2\n[plugins.\"io.containerd.grpc.v1.cri\".containerd]\n  default_runtime_name = \"runsc\"\n[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.runsc]\n  runtime_type = \"io.containerd.runsc.v1\"\n";
    let out = install_containerd(text, &ContainerdOptions::default()).unwrap();
    let kiwi = kiwi_of(&out);
    assert_eq!(kiwi["runtime_type"].as_str(), Some(RUNC_V2));
    assert_eq!(kiwi["options"].as_table().unwrap().len(), 1, "{out}");
}

#[test]
fn an_old_runtime_type_is_replaced_by_the_runc_v2_shim() {
    let text = "[plugins.cri.containerd.runtimes.runc]\n  runtime_type = \"io.containerd.runtime.v1.linux\"\n";
    let out = install_containerd(text, &ContainerdOptions::default()).unwrap();
    // runc is not a runc.v2 runtime, so it is not copied; kiwi gets the v2 shim.
    let doc = parse(&out).unwrap();
    let kiwi = &doc["plugins"]["cri"]["containerd"]["runtimes"]["kiwi"];
    assert_eq!(kiwi["runtime_type"].as_str(), Some(RUNC_V2), "{out}");
}
