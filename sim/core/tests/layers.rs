//! The simulator's `libcuda.so.1` (`sim/cuda/src`) is built in one-way layers: no
//! module uses, directly or through others, a module that uses it (issue #25: the
//! import circles `api` ↔ `dark_api` ↔ `exports` ↔ `procaddr` and `capture` ↔
//! `exec` ↔ `driver` ↔ `pool` were broken). Read from the sources: every
//! `crate::<module>` outside comments.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

fn uses() -> BTreeMap<String, BTreeSet<String>> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../cuda/src");
    let mut map = BTreeMap::new();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().and_then(|e| e.to_str()) != Some("rs") {
            continue;
        }
        let name = path.file_stem().unwrap().to_str().unwrap().to_string();
        let text = std::fs::read_to_string(&path).unwrap();
        let mut used = BTreeSet::new();
        for line in text.lines() {
            let code = line.split("//").next().unwrap_or("");
            let mut rest = code;
            while let Some(i) = rest.find("crate::") {
                rest = &rest[i + "crate::".len()..];
                let m: String = rest
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                if !m.is_empty() && m != name {
                    used.insert(m);
                }
            }
            // `use crate::{a, b}` lists.
            if let Some(i) = code.find("use crate::{") {
                for m in code[i + "use crate::{".len()..]
                    .split(['}', ','])
                    .map(|m| m.trim().split("::").next().unwrap_or("").to_string())
                    .filter(|m| !m.is_empty() && *m != name)
                {
                    used.insert(m);
                }
            }
        }
        map.insert(name, used);
    }
    map
}

#[test]
fn the_simulators_libcuda_modules_form_no_import_circle() {
    let uses = uses();
    assert!(uses.len() > 10, "{uses:?}");
    // Depth-first search for a cycle, reporting the first one found.
    fn visit(
        m: &str,
        uses: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(i) = path.iter().position(|p| p == m) {
            let mut cycle = path[i..].to_vec();
            cycle.push(m.to_string());
            return Some(cycle);
        }
        if done.contains(m) {
            return None;
        }
        path.push(m.to_string());
        for n in uses.get(m).into_iter().flatten() {
            if let Some(c) = visit(n, uses, path, done) {
                return Some(c);
            }
        }
        path.pop();
        done.insert(m.to_string());
        None
    }
    let mut done = BTreeSet::new();
    for m in uses.keys() {
        if let Some(cycle) = visit(m, &uses, &mut Vec::new(), &mut done) {
            panic!("an import circle: {}", cycle.join(" -> "));
        }
    }
}
