//! Format-preserving edits of containerd's `config.toml`: register runtime `kiwi`
//! in the CRI plugin's runtime table, and take it out again.
//!
//! This module owns the pure text → text transformations only; reading, backing up
//! and writing files is `cli`'s job. Every change install makes carries a marker
//! comment (see `marker`), so uninstall can remove exactly that and restore the
//! original bytes.
//!
//! Where the runtime goes, by config version:
//!
//! | version | runtime table |
//! | --- | --- |
//! | 1 (no `version` key) | `plugins.cri.containerd.runtimes.kiwi` |
//! | 2 (also: empty file) | `plugins."io.containerd.grpc.v1.cri".containerd.runtimes.kiwi` |
//! | 3 (containerd 2.x) | `plugins."io.containerd.cri.v1.runtime".containerd.runtimes.kiwi` |

use toml_edit::{DocumentMut, Item, Key, Table, Value};

use crate::error::{line_of, EditError};
use crate::marker;

/// The runtime handler name (RuntimeClass `handler`, `docker run --runtime`).
pub const RUNTIME_NAME: &str = "kiwi";
/// Where `kiwi-runtime` is installed on a host by default.
pub const DEFAULT_RUNTIME_PATH: &str = "/usr/local/bin/kiwi-runtime";
/// containerd's runc shim, which calls `BinaryName` with runc's command line.
pub const RUNC_V2: &str = "io.containerd.runc.v2";
/// File name of the drop-in written by `--drop-in`, in `conf.d/` next to the config.
pub const DROP_IN_NAME: &str = "99-kiwi.toml";

/// containerd config schema version.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConfigVersion {
    V1,
    V2,
    V3,
}

impl ConfigVersion {
    /// The number written in `version = N`.
    pub fn number(self) -> i64 {
        match self {
            ConfigVersion::V1 => 1,
            ConfigVersion::V2 => 2,
            ConfigVersion::V3 => 3,
        }
    }

    /// Key under `plugins` of the plugin that owns the runtime table.
    pub fn cri_plugin(self) -> &'static str {
        match self {
            ConfigVersion::V1 => "cri",
            ConfigVersion::V2 => "io.containerd.grpc.v1.cri",
            ConfigVersion::V3 => "io.containerd.cri.v1.runtime",
        }
    }

    fn cri_path(self) -> [&'static str; 2] {
        ["plugins", self.cri_plugin()]
    }

    fn containerd_path(self) -> [&'static str; 3] {
        ["plugins", self.cri_plugin(), "containerd"]
    }

    fn runtimes_path(self) -> [&'static str; 4] {
        ["plugins", self.cri_plugin(), "containerd", "runtimes"]
    }
}

/// What `install` writes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainerdOptions {
    /// Runtime name; `kiwi` unless a test or an unusual setup says otherwise.
    pub runtime_name: String,
    /// Absolute path of `kiwi-runtime` as containerd sees it.
    pub runtime_path: String,
    /// Also set `default_runtime_name` to the runtime.
    pub set_as_default: bool,
    /// Also set `enable_cdi = true` in the CRI plugin.
    pub enable_cdi: bool,
    /// Take over a `kiwi` runtime that kiwictl did not write.
    pub force: bool,
}

impl Default for ContainerdOptions {
    fn default() -> Self {
        Self {
            runtime_name: RUNTIME_NAME.to_string(),
            runtime_path: DEFAULT_RUNTIME_PATH.to_string(),
            set_as_default: false,
            enable_cdi: false,
            force: false,
        }
    }
}

/// The result of a drop-in install: the new main config and the drop-in file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DropIn {
    pub main: String,
    pub drop_in: String,
}

/// The result of an uninstall: the new text and what the user should know.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Uninstalled {
    pub text: String,
    /// Things left in place on purpose (e.g. a `kiwi` runtime kiwictl did not add).
    pub notes: Vec<String>,
}

/// Parses a containerd config, naming the line of a syntax error.
pub fn parse(text: &str) -> Result<DocumentMut, EditError> {
    text.parse::<DocumentMut>()
        .map_err(|e| EditError::MalformedToml {
            line: e.span().map_or(1, |s| line_of(text, s.start)),
            message: e
                .message()
                .lines()
                .next()
                .unwrap_or("syntax error")
                .to_string(),
        })
}

/// The text of `text` as this module would write it unchanged; install output equal
/// to this means "nothing to do".
pub fn normalized(text: &str) -> Result<String, EditError> {
    Ok(parse(text)?.to_string())
}

/// Which schema the document uses, and whether it is empty (no keys at all), in
/// which case install writes `version = 2` (understood by containerd 1.x and
/// migrated by containerd 2.x).
pub fn detect_version(doc: &DocumentMut) -> Result<(ConfigVersion, bool), EditError> {
    match doc.get("version") {
        None if doc.as_table().is_empty() => Ok((ConfigVersion::V2, true)),
        None => Ok((ConfigVersion::V1, false)),
        Some(item) => match item.as_integer() {
            Some(1) => Ok((ConfigVersion::V1, false)),
            Some(2) => Ok((ConfigVersion::V2, false)),
            Some(3) => Ok((ConfigVersion::V3, false)),
            Some(n) => Err(EditError::UnsupportedVersion(n)),
            None => Err(EditError::Layout {
                path: "version".into(),
                reason: "must be an integer".into(),
            }),
        },
    }
}

/// Registers the runtime in `text` (the whole main config) and returns the new text.
pub fn install_containerd(text: &str, opts: &ContainerdOptions) -> Result<String, EditError> {
    let mut doc = parse(text)?;
    let (version, empty) = detect_version(&doc)?;
    if empty {
        set_marked(doc.as_table_mut(), "version", Value::from(version.number()))?;
    }
    let base = base_runtime(&doc, version)?;
    install_into(&mut doc, version, base.as_ref(), opts)?;
    Ok(doc.to_string())
}

/// `--drop-in`: the runtime goes into a file of its own, `import_path` (the path
/// containerd reads, i.e. without any host-root prefix), and the main config only
/// gains that path in `imports`.
///
/// containerd 1.x replaces a plugin's whole section with the one of an imported
/// file rather than merging into it, so the drop-in carries a copy of the main
/// config's CRI plugin section with the runtime added; re-running install after
/// editing that section refreshes the copy.
pub fn install_containerd_drop_in(
    main_text: &str,
    import_path: &str,
    opts: &ContainerdOptions,
) -> Result<DropIn, EditError> {
    let mut main = parse(main_text)?;
    let (version, empty) = detect_version(&main)?;
    if empty {
        set_marked(
            main.as_table_mut(),
            "version",
            Value::from(version.number()),
        )?;
    }
    let base = base_runtime(&main, version)?;

    let mut drop_in = DocumentMut::new();
    if version != ConfigVersion::V1 {
        drop_in.insert("version", toml_edit::value(version.number()));
    }
    let section = main
        .get("plugins")
        .and_then(Item::as_table)
        .and_then(|p| p.get(version.cri_plugin()))
        .cloned();
    if let Some(section) = section {
        let section = match section {
            Item::Table(t) => t,
            _ => {
                return Err(EditError::Layout {
                    path: format!("plugins.{}", version.cri_plugin()),
                    reason: "must be a table".into(),
                })
            }
        };
        let mut plugins = Table::new();
        plugins.set_implicit(true);
        plugins.insert(version.cri_plugin(), Item::Table(section));
        drop_in.insert("plugins", Item::Table(plugins));
    }
    install_into(&mut drop_in, version, base.as_ref(), opts)?;
    let header = format!(
        "# Written by `kiwictl install containerd --drop-in`; `kiwictl uninstall containerd`\n\
         # deletes it. It holds a copy of the `{}` plugin section of the main\n\
         # config (containerd 1.x replaces, not merges, a section from an imported file):\n\
         # after editing that section, run the install again to refresh this copy.\n",
        version.cri_plugin()
    );
    let drop_in = format!("{header}{}", drop_in.to_string().trim_start_matches('\n'));

    add_import(&mut main, import_path)?;
    Ok(DropIn {
        main: main.to_string(),
        drop_in,
    })
}

/// Removes what install added to `text`: the runtime table, the settings it
/// changed (restored to their old values), the `imports` entry `import_path`, and
/// `version` if install added it to an empty file.
pub fn uninstall_containerd(
    text: &str,
    runtime_name: &str,
    import_path: &str,
) -> Result<Uninstalled, EditError> {
    let mut doc = parse(text)?;
    let mut notes = Vec::new();
    // Check every schema's tables: a file may have been re-versioned since install.
    for version in [ConfigVersion::V1, ConfigVersion::V2, ConfigVersion::V3] {
        if let Some(runtimes) = table_at(doc.as_table_mut(), &version.runtimes_path(), false)? {
            let ours = runtimes
                .get(runtime_name)
                .and_then(Item::as_table)
                .map(|t| has_marker(t.decor().prefix()));
            match ours {
                Some(true) => {
                    runtimes.remove(runtime_name);
                }
                Some(false) => notes.push(format!(
                    "runtime \"{runtime_name}\" in plugins.\"{}\" was not added by kiwictl; left in place",
                    version.cri_plugin()
                )),
                None => {}
            }
        }
        if let Some(containerd) = table_at(doc.as_table_mut(), &version.containerd_path(), false)? {
            restore_marked(
                containerd,
                "default_runtime_name",
                &Value::from(runtime_name),
            )?;
            unheader_if_ours(containerd);
        }
        if let Some(cri) = table_at(doc.as_table_mut(), &version.cri_path(), false)? {
            restore_marked(cri, "enable_cdi", &Value::from(true))?;
            unheader_if_ours(cri);
        }
    }
    remove_import(&mut doc, import_path)?;
    // `version` goes only if nothing else is left: removing it from a file that has
    // since gained content would switch containerd to reading it as version 1.
    let only_version = doc
        .as_table()
        .iter()
        .all(|(k, item)| k == "version" || is_blank(item));
    if only_version && doc.contains_key("version") {
        restore_marked(doc.as_table_mut(), "version", &Value::from(2))?;
    }
    Ok(Uninstalled {
        text: doc.to_string(),
        notes,
    })
}

/// An implicit table holding nothing but other such tables: renders as nothing.
fn is_blank(item: &Item) -> bool {
    match item {
        Item::Table(t) => t.is_implicit() && t.iter().all(|(_, i)| is_blank(i)),
        _ => false,
    }
}

/// Whether the drop-in text is one kiwictl wrote (uninstall deletes only those).
pub fn is_our_drop_in(text: &str) -> bool {
    text.starts_with("# Written by `kiwictl install containerd --drop-in`")
}

/// The runtime whose settings the new one copies: `runc` if configured, else the
/// default runtime if it is a runc-shim runtime.
fn base_runtime(doc: &DocumentMut, version: ConfigVersion) -> Result<Option<Table>, EditError> {
    let Some(containerd) = get_table(doc.as_table(), &version.containerd_path())? else {
        return Ok(None);
    };
    let Some(runtimes) = containerd.get("runtimes").and_then(Item::as_table) else {
        return Ok(None);
    };
    let is_runc_shim = |t: &Table| {
        t.get("runtime_type")
            .and_then(Item::as_str)
            .is_none_or(|s| s == RUNC_V2)
    };
    let default = containerd
        .get("default_runtime_name")
        .and_then(Item::as_str)
        .filter(|&n| n != RUNTIME_NAME);
    for name in std::iter::once("runc").chain(default) {
        match runtimes.get(name) {
            Some(Item::Table(t)) if is_runc_shim(t) => return Ok(Some(t.clone())),
            Some(Item::Value(Value::InlineTable(t))) => {
                let t = t.clone().into_table();
                if is_runc_shim(&t) {
                    return Ok(Some(t));
                }
            }
            _ => {}
        }
    }
    Ok(None)
}

fn install_into(
    doc: &mut DocumentMut,
    version: ConfigVersion,
    base: Option<&Table>,
    opts: &ContainerdOptions,
) -> Result<(), EditError> {
    let runtimes =
        table_at(doc.as_table_mut(), &version.runtimes_path(), true)?.expect("created on demand");
    match runtimes.get_mut(&opts.runtime_name) {
        None => {
            let table = new_runtime_table(base, opts);
            runtimes.insert(&opts.runtime_name, Item::Table(table));
        }
        Some(Item::Table(existing)) => {
            if !has_marker(existing.decor().prefix()) {
                if !opts.force {
                    return Err(EditError::ForeignRuntime(opts.runtime_name.clone()));
                }
                let prefix = decor_prefix(existing.decor().prefix());
                existing
                    .decor_mut()
                    .set_prefix(marker::add(&prefix, &runtime_note(&opts.runtime_name)));
            }
            update_runtime_table(existing, opts)?;
        }
        Some(_) => {
            return Err(EditError::Layout {
                path: format!("runtimes.{}", opts.runtime_name),
                reason: "is not a [table]".into(),
            })
        }
    }

    if opts.set_as_default {
        let containerd = table_at(doc.as_table_mut(), &version.containerd_path(), true)?
            .expect("created on demand");
        give_header(containerd);
        set_marked(
            containerd,
            "default_runtime_name",
            Value::from(opts.runtime_name.as_str()),
        )?;
    }
    if opts.enable_cdi {
        let cri =
            table_at(doc.as_table_mut(), &version.cri_path(), true)?.expect("created on demand");
        give_header(cri);
        set_marked(cri, "enable_cdi", Value::from(true))?;
    }
    Ok(())
}

fn runtime_note(name: &str) -> String {
    format!("added runtime \"{name}\"; `kiwictl uninstall containerd` removes it")
}

/// A new runtime table: the base runtime's keys and options (comments dropped,
/// indentation kept), `runtime_type` forced to the runc shim, `BinaryName` set.
fn new_runtime_table(base: Option<&Table>, opts: &ContainerdOptions) -> Table {
    // Headers are spaced and indented like the base runtime's.
    let header = base.map_or("\n".to_string(), |b| {
        without_comments(&decor_prefix(b.decor().prefix()))
    });
    let mut table = Table::new();
    table
        .decor_mut()
        .set_prefix(marker::add(&header, &runtime_note(&opts.runtime_name)));
    let mut base_options: Option<Table> = None;
    if let Some(base) = base {
        for (key, item) in base.iter() {
            match item {
                Item::Value(Value::InlineTable(t)) if key == "options" => {
                    base_options = Some(t.clone().into_table());
                }
                Item::Table(t) if key == "options" => base_options = Some(t.clone()),
                Item::Value(v) => {
                    let k = base.key(key).map_or_else(|| Key::new(key), clean_key);
                    table.insert_formatted(&k, Item::Value(clean_value(v)));
                }
                // Other sub-tables of a runtime are not runc-shim settings.
                _ => {}
            }
        }
    }
    set_keeping_decor(&mut table, "runtime_type", Value::from(RUNC_V2));

    let mut options = Table::new();
    let options_header = base_options.as_ref().map_or("\n".to_string(), |o| {
        without_comments(&decor_prefix(o.decor().prefix()))
    });
    options.decor_mut().set_prefix(options_header);
    if let Some(base_options) = &base_options {
        for (key, item) in base_options.iter() {
            if let Item::Value(v) = item {
                let k = base_options
                    .key(key)
                    .map_or_else(|| Key::new(key), clean_key);
                options.insert_formatted(&k, Item::Value(clean_value(v)));
            }
        }
    }
    set_keeping_decor(
        &mut options,
        "BinaryName",
        Value::from(opts.runtime_path.as_str()),
    );
    table.insert("options", Item::Table(options));
    table
}

/// Brings a runtime table kiwictl wrote up to date without moving it: only values
/// that differ are touched, so a second install changes nothing.
fn update_runtime_table(table: &mut Table, opts: &ContainerdOptions) -> Result<(), EditError> {
    if table.get("runtime_type").and_then(Item::as_str) != Some(RUNC_V2) {
        set_keeping_decor(table, "runtime_type", Value::from(RUNC_V2));
    }
    let options = match table.get_mut("options") {
        None => {
            table.insert("options", Item::Table(Table::new()));
            table["options"].as_table_mut().expect("just inserted")
        }
        Some(Item::Table(t)) => t,
        Some(_) => {
            return Err(EditError::Layout {
                path: format!("runtimes.{}.options", opts.runtime_name),
                reason: "is not a [table]".into(),
            })
        }
    };
    if options.get("BinaryName").and_then(Item::as_str) != Some(opts.runtime_path.as_str()) {
        set_keeping_decor(
            options,
            "BinaryName",
            Value::from(opts.runtime_path.as_str()),
        );
    }
    Ok(())
}

/// Sets `key` to `value`, keeping the key's and the old value's formatting.
fn set_keeping_decor(table: &mut Table, key: &str, mut value: Value) {
    if let Some(Item::Value(old)) = table.get(key) {
        *value.decor_mut() = old.decor().clone();
        table[key] = Item::Value(value);
    } else {
        let indent = sibling_indent(table);
        let mut k = Key::new(key);
        k.leaf_decor_mut().set_prefix(indent);
        table.insert_formatted(&k, Item::Value(value));
    }
}

/// Sets `key` to `value` and records in a marker what was there before, unless it
/// already has that value (then nothing is changed and nothing will be undone).
fn set_marked(table: &mut Table, key: &str, mut value: Value) -> Result<(), EditError> {
    match table.get(key) {
        Some(Item::Value(old)) => {
            if same_value(old, &value) {
                return Ok(());
            }
            let mut bare = old.clone();
            bare.decor_mut().clear();
            let was = bare.to_string();
            *value.decor_mut() = old.decor().clone();
            let prefix = table
                .key(key)
                .map(|k| decor_prefix(k.leaf_decor().prefix()))
                .unwrap_or_default();
            table[key] = Item::Value(value);
            if marker::peek(&prefix).is_none() {
                if let Some(mut k) = table.key_mut(key) {
                    k.leaf_decor_mut()
                        .set_prefix(marker::add(&prefix, &format!("was: {was}")));
                }
            }
            Ok(())
        }
        Some(_) => Err(EditError::Layout {
            path: key.to_string(),
            reason: "is a table, expected a value".into(),
        }),
        None => {
            let mut k = Key::new(key);
            k.leaf_decor_mut()
                .set_prefix(marker::add(&sibling_indent(table), "added"));
            table.insert_formatted(&k, Item::Value(value));
            Ok(())
        }
    }
}

/// Undoes `set_marked` if the key still holds the value install set; if the user
/// has changed it since, only the marker goes.
fn restore_marked(table: &mut Table, key: &str, installed: &Value) -> Result<(), EditError> {
    let Some(prefix) = table
        .key(key)
        .map(|k| decor_prefix(k.leaf_decor().prefix()))
    else {
        return Ok(());
    };
    let Some((note, rest)) = marker::take(&prefix) else {
        return Ok(());
    };
    let still_ours = table
        .get(key)
        .and_then(Item::as_value)
        .is_some_and(|v| same_value(v, installed));
    if still_ours && note == "added" {
        table.remove(key);
        return Ok(());
    }
    if still_ours {
        if let Some(was) = note.strip_prefix("was: ") {
            let mut old: Value = was.parse().map_err(|_| EditError::Layout {
                path: key.to_string(),
                reason: format!("cannot parse the recorded old value {was:?}"),
            })?;
            if let Some(Item::Value(cur)) = table.get(key) {
                *old.decor_mut() = cur.decor().clone();
            }
            table[key] = Item::Value(old);
        }
    }
    if let Some(mut k) = table.key_mut(key) {
        k.leaf_decor_mut().set_prefix(rest);
    }
    Ok(())
}

/// An implicit table (no header line) that is to hold a key needs a header; the
/// marker lets uninstall take it away again.
fn give_header(table: &mut Table) {
    if table.is_implicit() {
        table.set_implicit(false);
        let prefix = decor_prefix(table.decor().prefix());
        let prefix = if prefix.is_empty() {
            "\n".to_string()
        } else {
            prefix
        };
        table.decor_mut().set_prefix(marker::add(&prefix, "header"));
    }
}

fn unheader_if_ours(table: &mut Table) {
    let prefix = decor_prefix(table.decor().prefix());
    if let Some((note, rest)) = marker::take(&prefix) {
        if note == "header" && !table.iter().any(|(_, i)| i.is_value()) {
            table.decor_mut().set_prefix(rest);
            table.set_implicit(true);
        }
    }
}

fn add_import(doc: &mut DocumentMut, import_path: &str) -> Result<(), EditError> {
    match doc.get_mut("imports") {
        None => {
            let mut arr = toml_edit::Array::new();
            arr.push(import_path);
            set_marked(doc.as_table_mut(), "imports", Value::Array(arr))
        }
        Some(Item::Value(Value::Array(arr))) => {
            let covered = arr
                .iter()
                .filter_map(Value::as_str)
                .any(|p| p == import_path || glob_covers(p, import_path));
            if !covered {
                arr.push(import_path);
            }
            Ok(())
        }
        Some(_) => Err(EditError::Layout {
            path: "imports".into(),
            reason: "must be an array of paths".into(),
        }),
    }
}

fn remove_import(doc: &mut DocumentMut, import_path: &str) -> Result<(), EditError> {
    let Some(Item::Value(Value::Array(arr))) = doc.get_mut("imports") else {
        return Ok(());
    };
    let before = arr.len();
    arr.retain(|v| v.as_str() != Some(import_path));
    if arr.len() != before && arr.is_empty() {
        // `imports = []` left by removing our only entry: drop the key if we added it.
        let prefix = doc
            .as_table()
            .key("imports")
            .map(|k| decor_prefix(k.leaf_decor().prefix()))
            .unwrap_or_default();
        if marker::peek(&prefix).as_deref() == Some("added") {
            doc.remove("imports");
        }
    }
    Ok(())
}

/// `dir/*.toml` (or `dir/*`) covers `dir/name.toml`.
fn glob_covers(pattern: &str, path: &str) -> bool {
    let (Some((pdir, pfile)), Some((dir, file))) =
        (pattern.rsplit_once('/'), path.rsplit_once('/'))
    else {
        return false;
    };
    pdir == dir
        && match pfile.strip_prefix('*') {
            Some(suffix) => !pfile[1..].contains(['*', '?', '[']) && file.ends_with(suffix),
            None => false,
        }
}

/// Walks (and with `create`, makes, as implicit tables) the table at `path`.
fn table_at<'a>(
    root: &'a mut Table,
    path: &[&str],
    create: bool,
) -> Result<Option<&'a mut Table>, EditError> {
    let mut cur = root;
    for (i, seg) in path.iter().enumerate() {
        let item = if create {
            cur.entry(seg).or_insert_with(|| {
                let mut t = Table::new();
                t.set_implicit(true);
                Item::Table(t)
            })
        } else {
            match cur.get_mut(seg) {
                Some(item) => item,
                None => return Ok(None),
            }
        };
        cur = match item {
            Item::Table(t) => t,
            Item::Value(Value::InlineTable(_)) => {
                return Err(EditError::Layout {
                    path: path[..=i].join("."),
                    reason: "is an inline table; write it as a [table] to let kiwictl edit it"
                        .into(),
                })
            }
            _ => {
                return Err(EditError::Layout {
                    path: path[..=i].join("."),
                    reason: "is not a table".into(),
                })
            }
        };
    }
    Ok(Some(cur))
}

fn get_table<'a>(root: &'a Table, path: &[&str]) -> Result<Option<&'a Table>, EditError> {
    let mut cur = root;
    for (i, seg) in path.iter().enumerate() {
        cur = match cur.get(seg) {
            None => return Ok(None),
            Some(Item::Table(t)) => t,
            Some(_) => {
                return Err(EditError::Layout {
                    path: path[..=i].join("."),
                    reason: "is not a [table]".into(),
                })
            }
        };
    }
    Ok(Some(cur))
}

fn has_marker(prefix: Option<&toml_edit::RawString>) -> bool {
    prefix
        .and_then(|p| p.as_str())
        .and_then(marker::peek)
        .is_some()
}

fn decor_prefix(prefix: Option<&toml_edit::RawString>) -> String {
    prefix.and_then(|p| p.as_str()).unwrap_or("").to_string()
}

/// Indentation of the table's first key, so added keys line up with it.
fn sibling_indent(table: &Table) -> String {
    table
        .iter()
        .filter(|(_, i)| i.is_value())
        .find_map(|(k, _)| table.key(k))
        .map(|k| marker::indent_of(&decor_prefix(k.leaf_decor().prefix())).to_string())
        .unwrap_or_default()
}

/// A decor prefix without its comment lines (blank lines and indentation kept).
fn without_comments(prefix: &str) -> String {
    prefix
        .split_inclusive('\n')
        .filter(|l| !l.trim_start().starts_with('#'))
        .collect()
}

/// A copy of a key with comments dropped from its decor, indentation kept.
fn clean_key(key: &Key) -> Key {
    let mut k = Key::new(key.get());
    let prefix = decor_prefix(key.leaf_decor().prefix());
    k.leaf_decor_mut()
        .set_prefix(marker::indent_of(&prefix).to_string());
    if let Some(s) = key.leaf_decor().suffix().and_then(|s| s.as_str()) {
        k.leaf_decor_mut().set_suffix(s.to_string());
    }
    k
}

/// A copy of a value without trailing comments.
fn clean_value(v: &Value) -> Value {
    let mut v = v.clone();
    let prefix = v
        .decor()
        .prefix()
        .and_then(|p| p.as_str())
        .unwrap_or(" ")
        .to_string();
    v.decor_mut().clear();
    v.decor_mut().set_prefix(prefix);
    v
}

fn same_value(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::String(x), Value::String(y)) => x.value() == y.value(),
        (Value::Integer(x), Value::Integer(y)) => x.value() == y.value(),
        (Value::Boolean(x), Value::Boolean(y)) => x.value() == y.value(),
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y.iter()).all(|(p, q)| same_value(p, q))
        }
        _ => false,
    }
}
