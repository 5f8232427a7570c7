//! Edits of docker's `daemon.json`: add `runtimes.kiwi.path` (and optionally
//! `default-runtime`), keeping every other key in its place, and take them out again.
//!
//! JSON has no comments, so what install changed beyond the `kiwi` entry itself (a
//! `runtimes` object it created, a `default-runtime` it replaced) is recorded in a
//! small undo record that `cli` keeps next to the file. This module owns the pure
//! text → text transformations only.

use serde::Serialize;
use serde_json::{Map, Value};

use crate::containerd::{DEFAULT_RUNTIME_PATH, RUNTIME_NAME};
use crate::error::EditError;

/// What `install` writes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DockerOptions {
    pub runtime_name: String,
    pub runtime_path: String,
    pub set_as_default: bool,
}

impl Default for DockerOptions {
    fn default() -> Self {
        Self {
            runtime_name: RUNTIME_NAME.to_string(),
            runtime_path: DEFAULT_RUNTIME_PATH.to_string(),
            set_as_default: false,
        }
    }
}

/// What install changed besides `runtimes.<name>`, so uninstall can put it back.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DockerUndo {
    /// Install created the `runtimes` object.
    pub created_runtimes: bool,
    /// `default-runtime` before install set it: `Some(None)` = it was absent.
    pub previous_default: Option<Option<Value>>,
}

impl DockerUndo {
    /// Nothing to undo beyond removing the runtime entry.
    pub fn is_empty(&self) -> bool {
        *self == DockerUndo::default()
    }

    /// The record as JSON text.
    pub fn to_json(&self) -> String {
        let mut m = Map::new();
        m.insert(
            "created_runtimes".into(),
            Value::Bool(self.created_runtimes),
        );
        if let Some(prev) = &self.previous_default {
            m.insert(
                "default_runtime_was_set".into(),
                Value::Bool(prev.is_some()),
            );
            if let Some(v) = prev {
                m.insert("previous_default_runtime".into(), v.clone());
            }
        }
        let mut s = serde_json::to_string_pretty(&Value::Object(m)).expect("plain JSON");
        s.push('\n');
        s
    }

    /// Reads a record written by `to_json`.
    pub fn from_json(text: &str) -> Result<Self, EditError> {
        let v = parse(text)?;
        let created_runtimes = v
            .get("created_runtimes")
            .and_then(Value::as_bool)
            .unwrap_or(false);
        let previous_default = match v.get("default_runtime_was_set").and_then(Value::as_bool) {
            None => None,
            Some(false) => Some(None),
            Some(true) => Some(v.get("previous_default_runtime").cloned()),
        };
        Ok(DockerUndo {
            created_runtimes,
            previous_default,
        })
    }
}

/// Parses `daemon.json`; an empty file is an empty object.
pub fn parse(text: &str) -> Result<Value, EditError> {
    if text.trim().is_empty() {
        return Ok(Value::Object(Map::new()));
    }
    serde_json::from_str(text).map_err(|e| EditError::MalformedJson {
        line: e.line().max(1),
        message: e
            .to_string()
            .split(" at line ")
            .next()
            .unwrap_or("")
            .to_string(),
    })
}

/// Adds the runtime to `text`; returns the new text and the updated undo record
/// (`undo` is the record of an earlier install, if any). Text that needs no change
/// is returned as it was.
pub fn install_docker(
    text: &str,
    undo: &DockerUndo,
    opts: &DockerOptions,
) -> Result<(String, DockerUndo), EditError> {
    let original = parse(text)?;
    let mut root = original.clone();
    let mut undo = undo.clone();
    let obj = as_object(&mut root, "the top level")?;

    if !obj.contains_key("runtimes") {
        obj.insert("runtimes".into(), Value::Object(Map::new()));
        undo.created_runtimes = true;
    }
    let runtimes = as_object(obj.get_mut("runtimes").expect("present"), "\"runtimes\"")?;
    match runtimes.get_mut(&opts.runtime_name) {
        Some(Value::Object(entry)) => {
            entry.insert("path".into(), Value::from(opts.runtime_path.as_str()));
        }
        Some(_) => {
            return Err(EditError::Layout {
                path: format!("runtimes.{}", opts.runtime_name),
                reason: "must be an object".into(),
            })
        }
        None => {
            let mut entry = Map::new();
            entry.insert("path".into(), Value::from(opts.runtime_path.as_str()));
            runtimes.insert(opts.runtime_name.clone(), Value::Object(entry));
        }
    }

    if opts.set_as_default {
        let current = obj.get("default-runtime").cloned();
        if current.as_ref().and_then(Value::as_str) != Some(opts.runtime_name.as_str()) {
            if undo.previous_default.is_none() {
                undo.previous_default = Some(current);
            }
            obj.insert(
                "default-runtime".into(),
                Value::from(opts.runtime_name.as_str()),
            );
        }
    }

    if root == original {
        return Ok((text.to_string(), undo));
    }
    Ok((render(&root, text), undo))
}

/// Removes the runtime and undoes what `undo` records.
pub fn uninstall_docker(
    text: &str,
    undo: &DockerUndo,
    runtime_name: &str,
) -> Result<String, EditError> {
    let original = parse(text)?;
    let mut root = original.clone();
    let obj = as_object(&mut root, "the top level")?;

    if let Some(Value::Object(runtimes)) = obj.get_mut("runtimes") {
        runtimes.shift_remove(runtime_name);
        if runtimes.is_empty() && undo.created_runtimes {
            obj.shift_remove("runtimes");
        }
    }
    if obj.get("default-runtime").and_then(Value::as_str) == Some(runtime_name) {
        match &undo.previous_default {
            Some(Some(prev)) => {
                obj.insert("default-runtime".into(), prev.clone());
            }
            // Absent before, or no record: docker's own default (runc) is the only
            // safe value once the runtime is gone.
            _ => {
                obj.shift_remove("default-runtime");
            }
        }
    }

    if root == original {
        return Ok(text.to_string());
    }
    Ok(render(&root, text))
}

fn as_object<'a>(v: &'a mut Value, what: &str) -> Result<&'a mut Map<String, Value>, EditError> {
    v.as_object_mut().ok_or_else(|| EditError::Layout {
        path: what.to_string(),
        reason: "must be a JSON object".into(),
    })
}

/// Pretty JSON indented like `original` (four spaces for a new file), ending in a
/// newline unless `original` did not.
fn render(v: &Value, original: &str) -> String {
    let indent = original
        .lines()
        .skip(1)
        .map(|l| &l[..l.len() - l.trim_start().len()])
        .find(|w| !w.is_empty())
        .unwrap_or("    ");
    let mut out = Vec::new();
    let fmt = serde_json::ser::PrettyFormatter::with_indent(indent.as_bytes());
    let mut ser = serde_json::Serializer::with_formatter(&mut out, fmt);
    v.serialize(&mut ser)
        .expect("serializing a JSON value cannot fail");
    let mut s = String::from_utf8(out).expect("serde_json writes UTF-8");
    if original.trim().is_empty() || original.ends_with('\n') {
        s.push('\n');
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    const DAEMON: &str = r#"{
    "data-root": "/var/lib/docker",
    "runtimes": {
        "nvidia": {
            "args": [],
            "path": "nvidia-container-runtime"
        }
    },
    "default-runtime": "nvidia",
    "log-driver": "json-file"
}
"#;

    #[test]
    fn install_keeps_every_key_and_order_and_uninstall_restores_bytes() {
        let opts = DockerOptions {
            set_as_default: true,
            ..Default::default()
        };
        let (out, undo) = install_docker(DAEMON, &DockerUndo::default(), &opts).unwrap();
        let v: Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v["runtimes"]["kiwi"]["path"], "/usr/local/bin/kiwi-runtime");
        assert_eq!(v["runtimes"]["nvidia"]["path"], "nvidia-container-runtime");
        assert_eq!(v["default-runtime"], "kiwi");
        assert_eq!(v["log-driver"], "json-file");
        let keys: Vec<&String> = v.as_object().unwrap().keys().collect();
        assert_eq!(
            keys,
            ["data-root", "runtimes", "default-runtime", "log-driver"]
        );
        assert_eq!(undo.previous_default, Some(Some(Value::from("nvidia"))));

        let (again, undo2) = install_docker(&out, &undo, &opts).unwrap();
        assert_eq!(again, out, "second install changes nothing");
        assert_eq!(undo2, undo);

        let undo = DockerUndo::from_json(&undo.to_json()).unwrap();
        assert_eq!(uninstall_docker(&out, &undo, "kiwi").unwrap(), DAEMON);
    }

    #[test]
    fn empty_and_missing_files_get_a_minimal_config() {
        let (out, undo) =
            install_docker("", &DockerUndo::default(), &DockerOptions::default()).unwrap();
        assert_eq!(
            out,
            "{\n    \"runtimes\": {\n        \"kiwi\": {\n            \"path\": \"/usr/local/bin/kiwi-runtime\"\n        }\n    }\n}\n"
        );
        assert!(undo.created_runtimes);
        assert_eq!(uninstall_docker(&out, &undo, "kiwi").unwrap(), "{}\n");
    }

    #[test]
    fn tab_indent_is_kept() {
        let text = "{\n\t\"debug\": true\n}\n";
        let (out, _) =
            install_docker(text, &DockerUndo::default(), &DockerOptions::default()).unwrap();
        assert!(
            out.contains("\n\t\"debug\": true,\n\t\"runtimes\": {\n\t\t\"kiwi\""),
            "{out}"
        );
    }

    #[test]
    fn malformed_json_names_the_line() {
        let err = install_docker(
            "{\n  \"a\": 1,\n  \"b\" 2\n}\n",
            &DockerUndo::default(),
            &DockerOptions::default(),
        )
        .unwrap_err();
        match err {
            EditError::MalformedJson { line, .. } => assert_eq!(line, 3),
            other => panic!("unexpected {other:?}"),
        }
        assert!(matches!(
            install_docker("[1]", &DockerUndo::default(), &DockerOptions::default()),
            Err(EditError::Layout { .. })
        ));
    }

    #[test]
    fn uninstall_without_record_still_leaves_a_working_docker() {
        let text = "{\n  \"default-runtime\": \"kiwi\",\n  \"runtimes\": {\"kiwi\": {\"path\": \"/x\"}}\n}\n";
        let out = uninstall_docker(text, &DockerUndo::default(), "kiwi").unwrap();
        let v: Value = serde_json::from_str(&out).unwrap();
        assert!(v.get("default-runtime").is_none());
        assert_eq!(v["runtimes"], serde_json::json!({}));
    }
}
