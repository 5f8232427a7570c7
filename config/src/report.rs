//! How every Kiwi binary prints an error: one line, each cause once.
//!
//! Library errors in this workspace often say their cause in their own message
//! (`cannot read config file X: No such file`) *and* return it from `source()`, so a
//! plain walk of the chain (`{:#}`) repeats it. Parsers (TOML, JSON) may also put a
//! newline in a message. A person reading a terminal or a container's failure reason
//! needs one line that says what went wrong once; this module owns that rendering.

use std::error::Error;

/// Renders `err` and its causes as one line: `outer: cause: cause`, skipping a cause
/// whose text the line already contains, with every run of whitespace (newlines
/// included) folded into one space.
pub fn one_line(err: &(dyn Error + 'static)) -> String {
    let mut line = fold(&err.to_string());
    let mut next = err.source();
    while let Some(cause) = next {
        let text = fold(&cause.to_string());
        if !text.is_empty() && !line.contains(&text) {
            line.push_str(": ");
            line.push_str(&text);
        }
        next = cause.source();
    }
    line
}

fn fold(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("cannot read config file /x: {source}")]
    struct Outer {
        source: std::io::Error,
    }

    #[derive(Debug, thiserror::Error)]
    #[error("startup failed")]
    struct Wrapper {
        #[source]
        inner: Outer,
    }

    #[test]
    fn a_cause_already_in_the_message_is_not_repeated() {
        let e = Wrapper {
            inner: Outer {
                source: std::io::Error::from(std::io::ErrorKind::NotFound),
            },
        };
        let line = one_line(&e);
        assert_eq!(
            line,
            "startup failed: cannot read config file /x: entity not found"
        );
    }

    #[test]
    fn a_cause_not_in_the_message_is_appended() {
        #[derive(Debug, thiserror::Error)]
        #[error("cannot start")]
        struct Plain(#[source] std::io::Error);
        let e = Plain(std::io::Error::other("disk full"));
        assert_eq!(one_line(&e), "cannot start: disk full");
    }

    #[test]
    fn newlines_are_folded() {
        let e = std::io::Error::other("line one\n  line two\n");
        assert_eq!(one_line(&e), "line one line two");
    }
}
