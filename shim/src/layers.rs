//! The shim's layering, enforced: every module of `shim/src` belongs to one layer of
//! [`LAYERS`] and uses (`crate::<module>`, outside comments and literals) only modules
//! of its own layer or lower ones, and the module graph has no cycle. Data flows one
//! way: the C ABI → the hooked behaviour → the mechanisms (gate, memory, turns) → the
//! real driver; the leaves are for everyone. `docs/shim.md` draws the same table.

use std::collections::BTreeMap;
use std::path::Path;

/// Top (the C ABI) to bottom (the leaves anyone may use).
const LAYERS: &[(&str, &[&str])] = &[
    ("1 C ABI", &["exports", "dl", "procaddr", "nvml"]),
    (
        "2 hooked behaviour",
        &[
            "hooks", "attrs", "ipc", "submit", "pools", "room", "appvmm", "modules", "view",
        ],
    ),
    (
        "3 mechanisms",
        &[
            "gate", "mem", "client", "status", "capture", "devices", "hint", "managed", "pool",
        ],
    ),
    ("4 real driver", &["real", "symbols", "ffi"]),
    ("5 leaves", &["cuda", "log", "env", "stats", "idle", "live"]),
];

/// Files that are not modules of their own: the crate root, this test, and a test
/// submodule (`#[path]`) counted as part of its parent.
fn module_of(stem: &str) -> Option<&str> {
    match stem {
        "lib" | "layers" => None,
        "exports_coverage" => Some("exports"),
        s => Some(s),
    }
}

fn layer_of(module: &str) -> Option<usize> {
    LAYERS.iter().position(|(_, ms)| ms.contains(&module))
}

/// `src` without comments, string and character literals (replaced by spaces).
fn code_only(src: &str) -> String {
    let b = src.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let rest = &b[i..];
        if rest.starts_with(b"//") {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if rest.starts_with(b"/*") {
            let mut depth = 0;
            while i < b.len() {
                if b[i..].starts_with(b"/*") {
                    depth += 1;
                    i += 2;
                } else if b[i..].starts_with(b"*/") {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
        } else if rest.starts_with(b"r\"") || rest.starts_with(b"r#") {
            // A raw string: r"…" or r#…#"…"#…#.
            let hashes = rest[1..].iter().take_while(|&&c| c == b'#').count();
            let close: Vec<u8> = std::iter::once(b'"')
                .chain(std::iter::repeat_n(b'#', hashes))
                .collect();
            i += 2 + hashes;
            while i < b.len() && !b[i..].starts_with(&close) {
                i += 1;
            }
            i += close.len();
        } else if b[i] == b'"' {
            i += 1;
            while i < b.len() && b[i] != b'"' {
                i += if b[i] == b'\\' { 2 } else { 1 };
            }
            i += 1;
        } else if b[i] == b'\'' && rest.get(1) == Some(&b'\\') {
            // '\n', '\'', '\u{…}'
            i += 2;
            while i < b.len() && b[i] != b'\'' {
                i += 1;
            }
            i += 1;
        } else if b[i] == b'\'' && rest.get(2) == Some(&b'\'') {
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
            continue;
        }
        out.push(b' ');
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn ident_at(s: &str) -> &str {
    let end = s
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .unwrap_or(s.len());
    &s[..end]
}

/// The first path segment of every `crate::…` path in `code`, with `crate::{a, b}`
/// groups spread, and whether it names a macro (`crate::kwarn!`).
fn crate_refs(code: &str) -> Vec<(String, bool)> {
    let mut refs = Vec::new();
    for (at, _) in code.match_indices("crate::") {
        // `$crate::` is the same crate.
        let before = code[..at].chars().next_back();
        if before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_') {
            continue;
        }
        let rest = &code[at + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let mut depth = 0usize;
            let mut item_start = true;
            for (k, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => item_start = true,
                    c if item_start && !c.is_whitespace() => {
                        item_start = false;
                        let id = ident_at(&group[k..]);
                        refs.push((id.to_string(), group[k + id.len()..].starts_with('!')));
                    }
                    _ => {}
                }
            }
        } else {
            let id = ident_at(rest);
            refs.push((id.to_string(), rest[id.len()..].starts_with('!')));
        }
    }
    refs
}

/// module → the modules it uses, read from `shim/src`.
fn graph() -> BTreeMap<String, BTreeMap<String, ()>> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut sources = Vec::new();
    let rs = |path: &Path| path.extension().is_some_and(|e| e == "rs");
    for entry in std::fs::read_dir(&dir).expect("shim/src") {
        let path = entry.expect("dir entry").path();
        let stem = path.file_stem().unwrap().to_string_lossy().into_owned();
        if rs(&path) {
            let text = std::fs::read_to_string(&path).expect("readable source");
            sources.push((stem, text));
        } else if path.is_dir() {
            // A module's submodules (`mem/swap.rs`) are part of it.
            for sub in std::fs::read_dir(&path).expect("module folder") {
                let sub = sub.expect("dir entry").path();
                if rs(&sub) {
                    let text = std::fs::read_to_string(&sub).expect("readable source");
                    sources.push((stem.clone(), text));
                }
            }
        }
    }
    // Exported macros (`crate::kwarn!`) belong to the module that defines them.
    let mut macros = BTreeMap::new();
    for (stem, text) in &sources {
        let mut exported = false;
        for line in text.lines() {
            let line = line.trim();
            if line.starts_with("#[macro_export]") {
                exported = true;
            } else if let Some(rest) = line.strip_prefix("macro_rules!").filter(|_| exported) {
                macros.insert(ident_at(rest.trim()).to_string(), stem.clone());
                exported = false;
            }
        }
    }
    let mut g: BTreeMap<String, BTreeMap<String, ()>> = BTreeMap::new();
    for (stem, text) in &sources {
        let Some(module) = module_of(stem) else {
            continue;
        };
        let uses = g.entry(module.to_string()).or_default();
        for (name, is_macro) in crate_refs(&code_only(text)) {
            let used = if is_macro {
                macros
                    .get(&name)
                    .cloned()
                    .unwrap_or_else(|| panic!("{stem}.rs: crate::{name}! is no exported macro"))
            } else {
                name
            };
            if used != module {
                uses.insert(used, ());
            }
        }
    }
    g
}

/// A cycle through the graph, if any, as `a → b → … → a`.
fn find_cycle(g: &BTreeMap<String, BTreeMap<String, ()>>) -> Option<Vec<String>> {
    fn visit(
        g: &BTreeMap<String, BTreeMap<String, ()>>,
        m: &str,
        state: &mut BTreeMap<String, u8>,
        path: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        match state.get(m) {
            Some(2) => return None,
            Some(1) => {
                let start = path.iter().position(|p| p == m).unwrap();
                let mut cycle = path[start..].to_vec();
                cycle.push(m.to_string());
                return Some(cycle);
            }
            _ => {}
        }
        state.insert(m.to_string(), 1);
        path.push(m.to_string());
        for next in g.get(m).into_iter().flat_map(|u| u.keys()) {
            if let Some(c) = visit(g, next, state, path) {
                return Some(c);
            }
        }
        path.pop();
        state.insert(m.to_string(), 2);
        None
    }
    let mut state = BTreeMap::new();
    g.keys()
        .find_map(|m| visit(g, m, &mut state, &mut Vec::new()))
}

#[test]
fn every_module_uses_only_its_own_layer_and_lower_ones() {
    let g = graph();
    let mut problems = Vec::new();
    for (module, uses) in &g {
        let Some(own) = layer_of(module) else {
            problems.push(format!(
                "{module}: in no layer (add it to LAYERS and docs/shim.md)"
            ));
            continue;
        };
        for used in uses.keys() {
            match layer_of(used) {
                None => problems.push(format!("{module} uses {used}, which is in no layer")),
                Some(l) if l < own => problems.push(format!(
                    "{module} (layer {}) uses {used} (layer {}): a higher layer",
                    LAYERS[own].0, LAYERS[l].0
                )),
                Some(_) => {}
            }
        }
    }
    if let Some(cycle) = find_cycle(&g) {
        problems.push(format!("cycle: {}", cycle.join(" → ")));
    }
    assert!(
        problems.is_empty(),
        "layering broken:\n{}",
        problems.join("\n")
    );
}

#[test]
fn docs_draw_the_same_layers() {
    let doc =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/shim.md"))
            .expect("docs/shim.md");
    // The table's rows: `| 1 C ABI | `exports`, `dl`, … |`.
    for (name, modules) in LAYERS {
        let row = doc
            .lines()
            .find(|l| l.starts_with(&format!("| {name} |")))
            .unwrap_or_else(|| panic!("docs/shim.md has no row `| {name} |`"));
        let listed: Vec<&str> = row.split('`').skip(1).step_by(2).collect();
        let mut want: Vec<&str> = modules.to_vec();
        let mut got = listed.clone();
        want.sort_unstable();
        got.sort_unstable();
        assert_eq!(got, want, "docs/shim.md row {name}");
    }
}

#[test]
fn the_scanner_sees_paths_not_comments() {
    let code = code_only(
        "use crate::{gate::GATE, mem};\n// crate::client\n/// [`crate::hooks`]\n\
         let s = \"crate::ipc\"; let c = '\"'; crate::kwarn!(\"x\"); $crate::log::write();",
    );
    let refs: Vec<(String, bool)> = crate_refs(&code);
    let names: Vec<&str> = refs.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["gate", "mem", "kwarn", "log"]);
    assert!(refs[2].1 && !refs[0].1);
    let mut g = BTreeMap::new();
    g.insert("a".to_string(), BTreeMap::from([("b".to_string(), ())]));
    g.insert("b".to_string(), BTreeMap::from([("a".to_string(), ())]));
    assert_eq!(find_cycle(&g).unwrap(), ["a", "b", "a"]);
}
