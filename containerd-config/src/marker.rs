//! Marker comments that record, inside the user's TOML file, what `kiwictl install`
//! added or replaced, so that `kiwictl uninstall` removes exactly that and restores
//! what was there before, byte for byte.
//!
//! A marker is one comment line `# [kiwictl] <note>` placed in the decor prefix of
//! the key or table header it describes, indented like the line it precedes. Notes:
//!
//! * `added` — the key or table did not exist; uninstall removes it.
//! * `was: <toml value>` — the key existed with that value (its original text);
//!   uninstall puts it back.
//! * `header` — the table existed only implicitly (no `[header]` line of its own)
//!   and install gave it a header to hold a new key; uninstall makes it implicit
//!   again once that key is gone.

/// The token every marker line starts with (after `#` and spaces).
pub const TOKEN: &str = "[kiwictl]";

/// `prefix` with the marker line `note` added just before the decorated item, at
/// the item's indentation.
pub fn add(prefix: &str, note: &str) -> String {
    let split = prefix.rfind('\n').map_or(0, |i| i + 1);
    let (head, indent) = prefix.split_at(split);
    // Only whitespace can indent a line; anything else (a comment without a
    // trailing newline cannot happen in a prefix) is kept in `head`.
    let (head, indent) = if indent.chars().all(|c| c == ' ' || c == '\t') {
        (head, indent)
    } else {
        (prefix, "")
    };
    format!("{head}{indent}# {TOKEN} {note}\n{indent}")
}

/// Finds the marker line in `prefix`: returns its note and `prefix` without it.
pub fn take(prefix: &str) -> Option<(String, String)> {
    let mut rest = String::with_capacity(prefix.len());
    let mut note = None;
    for line in prefix.split_inclusive('\n') {
        let body = line.trim_start_matches([' ', '\t']);
        if note.is_none() && line.ends_with('\n') {
            if let Some(n) = body
                .strip_prefix('#')
                .map(|s| s.trim_start())
                .and_then(|s| s.strip_prefix(TOKEN))
            {
                note = Some(n.trim().to_string());
                continue;
            }
        }
        rest.push_str(line);
    }
    note.map(|n| (n, rest))
}

/// The note of the marker in `prefix`, if any, without changing anything.
pub fn peek(prefix: &str) -> Option<String> {
    take(prefix).map(|(n, _)| n)
}

/// The indentation (whitespace after the last newline) of a decor prefix.
pub fn indent_of(prefix: &str) -> &str {
    let tail = &prefix[prefix.rfind('\n').map_or(0, |i| i + 1)..];
    if tail.chars().all(|c| c == ' ' || c == '\t') {
        tail
    } else {
        ""
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn add_then_take_restores_prefix() {
        for prefix in ["", "  ", "\n", "\n# user comment\n  ", "\n\n\t"] {
            let marked = add(prefix, "was: \"runc\"");
            let (note, rest) = take(&marked).expect("marker found");
            assert_eq!(note, "was: \"runc\"");
            assert_eq!(
                rest, prefix,
                "prefix {prefix:?} not restored from {marked:?}"
            );
        }
    }

    #[test]
    fn marker_is_indented_like_the_item() {
        assert_eq!(add("\n    ", "added"), "\n    # [kiwictl] added\n    ");
        assert_eq!(indent_of("\n# c\n  "), "  ");
    }

    #[test]
    fn user_comments_are_not_markers() {
        assert_eq!(take("# kiwictl was here\n"), None);
        assert_eq!(peek("  # [kiwictl] added\n  ").as_deref(), Some("added"));
    }
}
