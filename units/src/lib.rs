//! Sizes as people write them, parsed once (issue #40): the config file's sizes,
//! the GPU list's `memory=`, and every command line that takes a size go through
//! [`parse_size`]. No dependencies, so the shim's `cdylib` may link it.
//!
//! Beside them, [`cgroup`]: a memory cgroup's figures as the kernel writes them,
//! which kiwi-config and the shim both read.

pub mod cgroup;

/// Parses sizes as people write them: `700MiB`, `1GiB`, `1.5GB`, `4096`, `512k`.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num
        .parse()
        .map_err(|_| format!("not a size: {s:?} (try 700MiB or 1GiB)"))?;
    let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kib" => 1024.0,
        "kb" => 1e3,
        "m" | "mib" => 1024.0 * 1024.0,
        "mb" => 1e6,
        "g" | "gib" => 1024.0 * 1024.0 * 1024.0,
        "gb" => 1e9,
        "t" | "tib" => 1024f64.powi(4),
        "tb" => 1e12,
        other => return Err(format!("unknown size unit {other:?} in {s:?}")),
    };
    let v = n * mult;
    if !v.is_finite() || v < 0.0 || v > u64::MAX as f64 {
        return Err(format!("size out of range: {s:?}"));
    }
    Ok(v.round() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_in_every_unit() {
        for (s, want) in [
            ("700MiB", 700u64 << 20),
            ("1GiB", 1 << 30),
            ("4096", 4096),
            ("1.5GB", 1_500_000_000),
            ("512k", 512 << 10),
            (" 80 GiB ", 80 << 30),
            ("1.5TiB", 3 << 39),
            ("2tb", 2_000_000_000_000),
        ] {
            assert_eq!(parse_size(s), Ok(want), "{s}");
        }
    }

    #[test]
    fn what_is_not_a_size_says_so() {
        assert!(parse_size("12 parsecs")
            .unwrap_err()
            .contains("unknown size unit"));
        assert!(parse_size("").unwrap_err().contains("not a size"));
        assert!(parse_size("-1GiB").unwrap_err().contains("not a size"));
        assert!(parse_size("1e30TiB").is_err());
        assert!(parse_size("99999999999999999999TiB")
            .unwrap_err()
            .contains("out of range"));
    }
}
