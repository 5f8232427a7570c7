//! Values as people write them, checked once where they come in (a flag, a config
//! key): the one error type their parsers return, and the one line a daemon prints
//! for a flag whose value one of them refused.

use clap::error::{ContextKind, ContextValue, ErrorKind};

/// A value a person wrote that a setting refuses; the message names the setting
/// (`TQ must be ...`, `checkpoint must be ...`) and the value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ValueError(pub String);

impl From<String> for ValueError {
    fn from(message: String) -> Self {
        ValueError(message)
    }
}

/// A size flag's value (`64GiB`, `512MiB`, `4096`), in bytes.
pub fn size_arg(s: &str) -> Result<u64, ValueError> {
    crate::parse_size(s).map_err(ValueError)
}

/// A size flag's value that must not be 0 (a bound that 0 would turn into a lockout).
pub fn positive_size_arg(s: &str) -> Result<u64, ValueError> {
    match size_arg(s)? {
        0 => Err(ValueError("must be at least 1".into())),
        n => Ok(n),
    }
}

/// A count or duration flag's value that must not be 0.
pub fn at_least_one<T>(s: &str) -> Result<T, ValueError>
where
    T: std::str::FromStr + PartialEq + From<u8>,
{
    let v: T = s
        .trim()
        .parse()
        .map_err(|_| ValueError(format!("not a whole number: {s:?}")))?;
    if v == T::from(0) {
        return Err(ValueError("must be at least 1".into()));
    }
    Ok(v)
}

/// The one line for a command-line error where one of these parsers refused a flag's
/// value (`--tq: TQ must be a positive number of seconds, not 0`); `None` for every
/// other command-line error (unknown flags, `--help`), which clap reports itself.
pub fn flag_error(e: &clap::Error) -> Option<String> {
    if e.kind() != ErrorKind::ValueValidation {
        return None;
    }
    let why = std::error::Error::source(e)?.downcast_ref::<ValueError>()?;
    let flag = match e.get(ContextKind::InvalidArg)? {
        // `--tq <TQ>`: the flag without its value name.
        ContextValue::String(arg) => arg.split_whitespace().next().unwrap_or(arg),
        _ => return None,
    };
    Some(format!("{flag}: {why}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_and_sizes() {
        assert_eq!(at_least_one::<u64>("5"), Ok(5));
        assert_eq!(
            at_least_one::<usize>("0").unwrap_err().to_string(),
            "must be at least 1"
        );
        assert!(at_least_one::<u64>("-1").is_err());
        assert_eq!(size_arg("1MiB"), Ok(1 << 20));
        assert_eq!(size_arg("0"), Ok(0));
        assert!(positive_size_arg("0").is_err());
        assert!(size_arg("12 parsecs").is_err());
    }
}
