//! An OCI runtime spec (`<bundle>/config.json`) as a JSON tree: read it, find the
//! claim, add Kiwi's edits, write it back atomically.
//!
//! The spec is kept as a `serde_json::Value` so that every field Kiwi does not know
//! survives the round trip. Only the fields Kiwi edits are given a shape here. This
//! module decides nothing about *whether* to edit; [`crate::runtime`] does.

use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use serde_json::{json, Map, Value};

use crate::claim::{claim_from_env, Claim, ClaimError};
use crate::gpu::DeviceNode;

/// config.json is read whole; a bigger one is refused rather than slurped.
const MAX_SPEC_BYTES: u64 = 64 << 20;

/// Errors reading, understanding or writing a spec.
#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} is not a valid OCI spec: {message}")]
    Invalid { path: PathBuf, message: String },
    #[error("{path}: {source}")]
    Claim { path: PathBuf, source: ClaimError },
    #[error("cannot write {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// A hook entry of the OCI spec.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Hook {
    pub path: PathBuf,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub args: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout: Option<u32>,
}

/// A parsed `config.json`.
#[derive(Debug, Clone)]
pub struct Spec {
    path: PathBuf,
    value: Value,
}

impl Spec {
    /// Path of the spec in a bundle.
    pub fn path_in(bundle: &Path) -> PathBuf {
        bundle.join("config.json")
    }

    /// Reads and checks `<bundle>/config.json`.
    pub fn load(bundle: &Path) -> Result<Spec, SpecError> {
        let path = Self::path_in(bundle);
        let read_err = |source| SpecError::Read {
            path: path.clone(),
            source,
        };
        let f = std::fs::File::open(&path).map_err(read_err)?;
        let len = f.metadata().map_err(read_err)?.len();
        if len > MAX_SPEC_BYTES {
            return Err(SpecError::Invalid {
                path,
                message: format!("{len} bytes is larger than the {MAX_SPEC_BYTES}-byte limit"),
            });
        }
        let bytes = std::fs::read(&path).map_err(read_err)?;
        Self::parse(&bytes, &path)
    }

    /// Parses spec bytes; `path` is only used in messages.
    pub fn parse(bytes: &[u8], path: &Path) -> Result<Spec, SpecError> {
        let invalid = |message: String| SpecError::Invalid {
            path: path.to_path_buf(),
            message,
        };
        let value: Value = serde_json::from_slice(bytes).map_err(|e| invalid(e.to_string()))?;
        if !value.is_object() {
            return Err(invalid("the top level is not a JSON object".into()));
        }
        let spec = Spec {
            path: path.to_path_buf(),
            value,
        };
        spec.check_shape().map_err(invalid)?;
        Ok(spec)
    }

    /// The fields Kiwi reads or edits must have the spec's types, so that an edit never
    /// silently drops or mangles them. `null` counts as absent, as it does for runc.
    fn check_shape(&self) -> Result<(), String> {
        let v = &self.value;
        let obj = |p: &str| -> Result<(), String> {
            match v.pointer(p) {
                None | Some(Value::Null) | Some(Value::Object(_)) => Ok(()),
                Some(_) => Err(format!(
                    "{} must be an object",
                    p.trim_start_matches('/').replace('/', ".")
                )),
            }
        };
        let arr = |p: &str| -> Result<(), String> {
            match v.pointer(p) {
                None | Some(Value::Null) | Some(Value::Array(_)) => Ok(()),
                Some(_) => Err(format!(
                    "{} must be an array",
                    p.trim_start_matches('/').replace('/', ".")
                )),
            }
        };
        for p in ["/process", "/root", "/linux", "/linux/resources", "/hooks"] {
            obj(p)?;
        }
        for p in [
            "/process/env",
            "/linux/devices",
            "/linux/resources/devices",
            "/mounts",
            "/hooks/prestart",
            "/hooks/createRuntime",
        ] {
            arr(p)?;
        }
        if let Some(Value::Array(env)) = v.pointer("/process/env") {
            if env.iter().any(|e| !e.is_string()) {
                return Err("process.env must hold only strings".into());
            }
        }
        match v.pointer("/root/path") {
            None | Some(Value::Null) | Some(Value::String(_)) => Ok(()),
            Some(_) => Err("root.path must be a string".into()),
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn value(&self) -> &Value {
        &self.value
    }

    /// The container process's environment.
    pub fn env(&self) -> impl Iterator<Item = &str> {
        self.value
            .pointer("/process/env")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
    }

    /// An annotation's value (`annotations.<key>`), when it is a string.
    pub fn annotation(&self, key: &str) -> Option<&str> {
        self.value
            .get("annotations")
            .and_then(|a| a.get(key))
            .and_then(Value::as_str)
    }

    /// The vGPU claim in the process environment.
    pub fn claim(&self) -> Result<Claim, SpecError> {
        claim_from_env(self.env()).map_err(|source| SpecError::Claim {
            path: self.path.clone(),
            source,
        })
    }

    /// The raw value of the claim variable, if any (last assignment wins).
    pub fn claim_value(&self) -> Option<&str> {
        self.env()
            .filter_map(|kv| kv.strip_prefix("KIWI_VISIBLE_DEVICES="))
            .last()
    }

    /// The rootfs on the host: `root.path`, relative to the bundle unless absolute.
    pub fn rootfs(&self, bundle: &Path) -> PathBuf {
        let p = self
            .value
            .pointer("/root/path")
            .and_then(Value::as_str)
            .unwrap_or("rootfs");
        bundle.join(p)
    }

    /// Whether the spec mounts the root filesystem read-only.
    pub fn root_readonly(&self) -> bool {
        self.value
            .pointer("/root/readonly")
            .and_then(Value::as_bool)
            .unwrap_or(false)
    }

    /// `linux.devices` entries for NVIDIA character devices (`/dev/nvidia*`).
    pub fn nvidia_devices(&self) -> Vec<DeviceNode> {
        self.value
            .pointer("/linux/devices")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter_map(|d| {
                let path = d.get("path")?.as_str()?;
                if !path.starts_with("/dev/nvidia") || d.get("type")?.as_str()? != "c" {
                    return None;
                }
                Some(DeviceNode {
                    path: PathBuf::from(path),
                    major: d.get("major")?.as_u64()?,
                    minor: d.get("minor")?.as_u64()?,
                    mode: d
                        .get("fileMode")
                        .and_then(Value::as_u64)
                        .map(|m| m as u32 & 0o777)
                        .unwrap_or(0o666),
                })
            })
            .collect()
    }

    fn object_at(&mut self, keys: &[&str]) -> &mut Map<String, Value> {
        let mut cur = &mut self.value;
        for k in keys {
            let obj = cur.as_object_mut().expect("shape checked at parse");
            cur = obj.entry(k.to_string()).or_insert(Value::Null);
            if cur.is_null() {
                *cur = json!({});
            }
        }
        cur.as_object_mut().expect("shape checked at parse")
    }

    fn array_at(&mut self, keys: &[&str]) -> &mut Vec<Value> {
        let (last, parents) = keys.split_last().expect("non-empty key path");
        let slot = self
            .object_at(parents)
            .entry(last.to_string())
            .or_insert(Value::Null);
        if slot.is_null() {
            *slot = json!([]);
        }
        slot.as_array_mut().expect("shape checked at parse")
    }

    /// Adds (or corrects) the device node in `linux.devices` and a matching allow rule
    /// in `linux.resources.devices`, so the device cgroup stays right whenever the
    /// cgroup manager re-applies the spec.
    pub fn add_device(&mut self, node: &DeviceNode) {
        let path = node.path.to_string_lossy().into_owned();
        let entry = json!({
            "path": path,
            "type": "c",
            "major": node.major,
            "minor": node.minor,
            "fileMode": node.mode,
            "uid": 0,
            "gid": 0,
        });
        let devices = self.array_at(&["linux", "devices"]);
        match devices
            .iter_mut()
            .find(|d| d.get("path").and_then(Value::as_str) == Some(path.as_str()))
        {
            Some(existing) => *existing = entry,
            None => devices.push(entry),
        }
        let rule = json!({
            "allow": true,
            "type": "c",
            "major": node.major,
            "minor": node.minor,
            "access": "rwm",
        });
        let rules = self.array_at(&["linux", "resources", "devices"]);
        if !rules.contains(&rule) {
            rules.push(rule);
        }
    }

    /// Appends `hook` to `hooks.<stage>` unless a hook with the same path is there.
    pub fn add_hook(&mut self, stage: &str, hook: &Hook) {
        let hooks = self.array_at(&["hooks", stage]);
        let path = hook.path.to_string_lossy();
        if hooks
            .iter()
            .any(|h| h.get("path").and_then(Value::as_str) == Some(path.as_ref()))
        {
            return;
        }
        hooks.push(serde_json::to_value(hook).expect("a hook serializes"));
    }

    /// Hooks of one stage.
    pub fn hooks(&self, stage: &str) -> Vec<Hook> {
        self.value
            .pointer(&format!("/hooks/{stage}"))
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter_map(|h| serde_json::from_value(h.clone()).ok())
            .collect()
    }

    /// Sets `KEY=value` in the process environment, replacing earlier assignments.
    pub fn set_env(&mut self, key: &str, value: &str) {
        let prefix = format!("{key}=");
        let env = self.array_at(&["process", "env"]);
        env.retain(|e| !e.as_str().is_some_and(|s| s.starts_with(&prefix)));
        env.push(Value::String(format!("{key}={value}")));
    }

    /// Whether the process environment assigns `key` (any value, empty included).
    pub fn has_env(&self, key: &str) -> bool {
        self.env()
            .any(|kv| kv.split_once('=').map_or(kv, |(k, _)| k) == key)
    }

    /// Sets `KEY=value` only where the process environment does not assign `key`
    /// already: the image's, the pod's or the user's value wins. Returns whether it
    /// was added.
    pub fn set_env_default(&mut self, key: &str, value: &str) -> bool {
        if self.has_env(key) {
            return false;
        }
        self.array_at(&["process", "env"])
            .push(Value::String(format!("{key}={value}")));
        true
    }

    /// Adds a read-only bind mount of a host file unless something is already mounted
    /// at `destination`.
    pub fn add_ro_bind(&mut self, source: &Path, destination: &Path) {
        let dst = destination.to_string_lossy().into_owned();
        let mounts = self.array_at(&["mounts"]);
        if mounts
            .iter()
            .any(|m| m.get("destination").and_then(Value::as_str) == Some(dst.as_str()))
        {
            return;
        }
        mounts.push(json!({
            "destination": dst,
            "type": "bind",
            "source": source.to_string_lossy(),
            "options": ["bind", "ro", "nosuid", "nodev"],
        }));
    }

    /// Mount destinations in the spec.
    pub fn mount_destinations(&self) -> Vec<String> {
        self.value
            .pointer("/mounts")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter_map(|m| m.get("destination")?.as_str().map(str::to_string))
            .collect()
    }

    /// Writes the spec back to where it was read from: a temporary file in the same
    /// directory, renamed over the original, so no reader (and no failed write) ever
    /// sees half a spec. No fsync: the bundle only matters to a container created right
    /// now, which a machine crash ends anyway, and fsync costs milliseconds on a busy
    /// disk for every create.
    pub fn write_back(&self) -> Result<(), SpecError> {
        let werr = |source| SpecError::Write {
            path: self.path.clone(),
            source,
        };
        let dir = self.path.parent().unwrap_or(Path::new("."));
        let mode = std::fs::metadata(&self.path)
            .map(|m| m.permissions().mode() & 0o7777)
            .unwrap_or(0o644);
        let tmp = dir.join(format!(".config.json.kiwi-{}", std::process::id()));
        let result = (|| {
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .open(&tmp)?;
            f.write_all(&serde_json::to_vec(&self.value).expect("a JSON value serializes"))?;
            f.set_permissions(std::fs::Permissions::from_mode(mode))?;
            std::fs::rename(&tmp, &self.path)
        })();
        if result.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        result.map_err(werr)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(text: &str) -> Spec {
        Spec::parse(text.as_bytes(), Path::new("config.json")).unwrap()
    }

    #[test]
    fn unknown_fields_survive_and_edits_are_idempotent() {
        let mut s = spec(
            r#"{"ociVersion":"1.0.2","x-vendor":{"a":[1,2]},"process":{"env":["A=1"],"weird":true},
               "linux":{"resources":{"devices":[{"allow":false,"access":"rwm"}]},"seccomp":{"k":1}}}"#,
        );
        let node = DeviceNode {
            path: "/dev/nvidia0".into(),
            major: 195,
            minor: 0,
            mode: 0o666,
        };
        s.add_device(&node);
        s.add_device(&node);
        let hook = Hook {
            path: "/usr/local/bin/kiwi-hook".into(),
            args: vec!["kiwi-hook".into()],
            env: vec![],
            timeout: None,
        };
        s.add_hook("prestart", &hook);
        s.add_hook("prestart", &hook);
        s.set_env("NVIDIA_VISIBLE_DEVICES", "0");
        let v = s.value();
        assert_eq!(v["x-vendor"]["a"][1], 2);
        assert_eq!(v["process"]["weird"], true);
        assert_eq!(v["linux"]["seccomp"]["k"], 1);
        assert_eq!(v["linux"]["devices"].as_array().unwrap().len(), 1);
        let rules = v["linux"]["resources"]["devices"].as_array().unwrap();
        assert_eq!(rules.len(), 2, "deny-all stays first, one allow appended");
        assert_eq!(rules[1]["major"], 195);
        assert_eq!(s.hooks("prestart").len(), 1);
        assert_eq!(s.nvidia_devices(), vec![node]);
        assert!(s.env().any(|e| e == "NVIDIA_VISIBLE_DEVICES=0"));
    }

    #[test]
    fn nulls_count_as_absent() {
        let mut s = spec(
            r#"{"process":{"env":null},"root":{"path":null},"linux":{"devices":null,"resources":null},"hooks":null,"mounts":null}"#,
        );
        assert_eq!(s.claim().unwrap(), Claim::None);
        s.add_device(&DeviceNode {
            path: "/dev/nvidia0".into(),
            major: 195,
            minor: 0,
            mode: 0o666,
        });
        s.add_ro_bind(Path::new("/a"), Path::new("/b"));
        s.set_env("A", "1");
        s.add_hook(
            "prestart",
            &Hook {
                path: "/h".into(),
                args: vec![],
                env: vec![],
                timeout: None,
            },
        );
        assert_eq!(s.nvidia_devices().len(), 1);
        assert_eq!(s.value()["linux"]["resources"]["devices"][0]["minor"], 0);
        assert_eq!(s.mount_destinations(), ["/b"]);
        assert_eq!(s.hooks("prestart").len(), 1);
        assert!(s.env().any(|e| e == "A=1"));
    }

    #[test]
    fn env_defaults_never_replace_an_assignment() {
        let mut s = spec(r#"{"process":{"env":["A=1","B=","C"]}}"#);
        assert!(!s.set_env_default("A", "2"));
        assert!(!s.set_env_default("B", "2"), "an empty value is a value");
        assert!(!s.set_env_default("C", "2"));
        assert!(!s.set_env_default("A", "3"));
        assert!(s.set_env_default("AB", "x"));
        assert!(!s.set_env_default("AB", "y"), "added once");
        assert_eq!(
            s.env().collect::<Vec<_>>(),
            ["A=1", "B=", "C", "AB=x"],
            "existing entries kept as they were, in order"
        );
        let mut s = spec(r#"{"process":{"env":null}}"#);
        assert!(s.set_env_default("A", "1"));
        assert_eq!(s.env().collect::<Vec<_>>(), ["A=1"]);
    }

    #[test]
    fn wrong_shapes_are_refused() {
        for bad in [
            "[]",
            "{",
            r#"{"process":{"env":"A=1"}}"#,
            r#"{"process":{"env":[1]}}"#,
            r#"{"linux":{"devices":{}}}"#,
            r#"{"hooks":[]}"#,
            r#"{"root":{"path":3}}"#,
        ] {
            let e = Spec::parse(bad.as_bytes(), Path::new("/b/config.json")).unwrap_err();
            assert!(
                e.to_string()
                    .starts_with("/b/config.json is not a valid OCI spec"),
                "{e}"
            );
        }
    }

    #[test]
    fn write_back_keeps_mode_and_content() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("config.json");
        std::fs::write(
            &p,
            r#"{"process":{"env":["KIWI_VISIBLE_DEVICES=0"]},"z":1}"#,
        )
        .unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        let mut s = Spec::load(dir.path()).unwrap();
        s.set_env("X", "y");
        s.write_back().unwrap();
        let again = Spec::load(dir.path()).unwrap();
        assert_eq!(again.value()["z"], 1);
        assert!(again.env().any(|e| e == "X=y"));
        let mode = std::fs::metadata(&p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert_eq!(
            std::fs::read_dir(dir.path()).unwrap().count(),
            1,
            "no temp file left"
        );
    }
}
