//! Parsing the vGPU claim, `KIWI_VISIBLE_DEVICES`, as DESIGN.md defines it: GPU UUIDs
//! or indexes, comma-separated, or `all`; `none`, `void` or empty means no claim.
//!
//! This module only parses; turning a claim into device nodes is [`crate::gpu`]'s job.

use std::fmt;

/// One GPU named in a claim.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum GpuRef {
    /// A GPU index, resolved to `/dev/nvidia<N>`.
    Index(u32),
    /// A GPU (or MIG) UUID such as `GPU-1b2c...`.
    Uuid(String),
}

impl fmt::Display for GpuRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GpuRef::Index(i) => write!(f, "{i}"),
            GpuRef::Uuid(u) => f.write_str(u),
        }
    }
}

/// What a container's environment asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// No vGPU: the container is left exactly as it is.
    None,
    /// Every GPU on the node.
    All,
    /// These GPUs, in the order given, without duplicates.
    Gpus(Vec<GpuRef>),
}

impl Claim {
    pub fn is_claimed(&self) -> bool {
        !matches!(self, Claim::None)
    }
}

/// A claim that cannot be understood; the container must not start.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{var}={value:?}: {reason}", var = crate::CLAIM_ENV)]
pub struct ClaimError {
    pub value: String,
    pub reason: String,
}

/// Parses the value of `KIWI_VISIBLE_DEVICES`.
pub fn parse_claim(value: &str) -> Result<Claim, ClaimError> {
    let err = |reason: String| ClaimError {
        value: value.to_string(),
        reason,
    };
    let v = value.trim();
    match v.to_ascii_lowercase().as_str() {
        "" | "none" | "void" => return Ok(Claim::None),
        "all" => return Ok(Claim::All),
        _ => {}
    }
    let mut gpus = Vec::new();
    for item in v.split(',') {
        let item = item.trim();
        if item.is_empty() {
            return Err(err("empty entry in the GPU list".into()));
        }
        // The device plugin names replicas `<uuid>::<n>`; the GPU is the part before `::`.
        let base = item.split("::").next().unwrap_or(item);
        let gpu = if base.bytes().all(|b| b.is_ascii_digit()) {
            GpuRef::Index(
                base.parse()
                    .map_err(|_| err(format!("GPU index {base:?} is out of range")))?,
            )
        } else if is_uuid_like(base) {
            GpuRef::Uuid(base.to_string())
        } else if base.eq_ignore_ascii_case("all") {
            return Err(err("`all` cannot be combined with other GPUs".into()));
        } else {
            return Err(err(format!(
                "{base:?} is neither a GPU index nor a GPU UUID (GPU-...)"
            )));
        };
        if !gpus.contains(&gpu) {
            gpus.push(gpu);
        }
    }
    Ok(Claim::Gpus(gpus))
}

fn is_uuid_like(s: &str) -> bool {
    let rest = s
        .strip_prefix("GPU-")
        .or_else(|| s.strip_prefix("MIG-"))
        .unwrap_or("");
    !rest.is_empty()
        && rest
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'/')
}

/// The claim in an OCI process environment (`KEY=VALUE` strings). The last assignment
/// wins, as it does when runc populates the process environment.
pub fn claim_from_env<'a, I: IntoIterator<Item = &'a str>>(env: I) -> Result<Claim, ClaimError> {
    let prefix = concat!("KIWI_VISIBLE_DEVICES", "=");
    let mut last = None;
    for kv in env {
        if let Some(v) = kv.strip_prefix(prefix) {
            last = Some(v);
        }
    }
    match last {
        Some(v) => parse_claim(v),
        None => Ok(Claim::None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_claim_values() {
        for v in ["", "none", "void", "  ", "NONE"] {
            assert_eq!(parse_claim(v).unwrap(), Claim::None, "{v:?}");
        }
    }

    #[test]
    fn all_indexes_and_uuids() {
        assert_eq!(parse_claim("all").unwrap(), Claim::All);
        assert_eq!(
            parse_claim("0, 2,0").unwrap(),
            Claim::Gpus(vec![GpuRef::Index(0), GpuRef::Index(2)])
        );
        assert_eq!(
            parse_claim("GPU-abc-123::4,1").unwrap(),
            Claim::Gpus(vec![GpuRef::Uuid("GPU-abc-123".into()), GpuRef::Index(1)])
        );
    }

    #[test]
    fn garbage_is_refused_with_the_value() {
        for v in ["banana", "0,,1", "GPU-", "all,0", "-1", "99999999999"] {
            let e = parse_claim(v).unwrap_err();
            assert!(e.to_string().contains("KIWI_VISIBLE_DEVICES"), "{e}");
        }
    }

    #[test]
    fn last_env_assignment_wins() {
        let env = [
            "PATH=/bin",
            "KIWI_VISIBLE_DEVICES=0",
            "KIWI_VISIBLE_DEVICES=none",
        ];
        assert_eq!(claim_from_env(env).unwrap(), Claim::None);
        let env = ["KIWI_VISIBLE_DEVICES_X=0", "PATH=/bin"];
        assert_eq!(claim_from_env(env).unwrap(), Claim::None);
        let env = ["KIWI_VISIBLE_DEVICES=1"];
        assert_eq!(
            claim_from_env(env).unwrap(),
            Claim::Gpus(vec![GpuRef::Index(1)])
        );
    }
}
