//! Errors of the pure config-editing functions. File I/O errors are added by the
//! callers in `cli`, which know the path.

/// What can go wrong editing a containerd or docker config document.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum EditError {
    /// The text is not valid TOML.
    #[error("malformed TOML, line {line}: {message}")]
    MalformedToml { line: usize, message: String },
    /// The text is not valid JSON.
    #[error("malformed JSON, line {line}: {message}")]
    MalformedJson { line: usize, message: String },
    /// `version = N` with an N containerd does not have.
    #[error("unsupported containerd config version {0} (expected 1, 2 or 3)")]
    UnsupportedVersion(i64),
    /// A key Kiwi must edit has a shape it cannot edit safely (e.g. an inline table,
    /// or a string where a table belongs).
    #[error("cannot edit {path}: {reason}")]
    Layout { path: String, reason: String },
    /// Runtime `kiwi` exists and was not written by kiwictl.
    #[error(
        "runtime \"{0}\" is already configured and was not added by kiwictl; \
         remove it first or pass --force to take it over"
    )]
    ForeignRuntime(String),
}

/// Line (1-based) of byte offset `offset` in `text`.
pub(crate) fn line_of(text: &str, offset: usize) -> usize {
    let end = offset.min(text.len());
    text.as_bytes()[..end]
        .iter()
        .filter(|&&b| b == b'\n')
        .count()
        + 1
}
