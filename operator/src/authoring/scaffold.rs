//! `plugin new`: writes a standalone plugin crate with an example that renders and passes
//! the operator's checks, a settings type with its schema, unit tests, a README, and a
//! copy of the SDK as a path dependency (under `sdk/`, see [`sdk`]).
//!
//! Everything is written into a fresh directory beside the target and renamed into place
//! at the end, so a failure leaves nothing behind and a crate is never half written.

use std::path::{Path, PathBuf};

use super::{AuthoringError, Kind, sdk};

const DOMAIN_LIB: &str = include_str!("scaffold/domain_lib.rs.tmpl");
const VENDOR_DATA_LIB: &str = include_str!("scaffold/vendor_data_lib.rs.tmpl");
const README: &str = include_str!("scaffold/README.md.tmpl");
const CARGO_TOML: &str = include_str!("scaffold/Cargo.toml.tmpl");
const GITIGNORE: &str = "/target\n";

/// What the new crate's test fixtures give each field of the WIT's `host-facts` record, by
/// WIT name. The fields are read from the embedded WIT, so the fixtures follow the ABI; a
/// field missing here gets `Default::default()` (a unit test asks for a real value).
const HOST_FACT_VALUES: &[(&str, &str)] = &[
    ("name", "\"kvm-a\".into()"),
    ("arch", "\"x86_64\".into()"),
    ("kvm", "false"),
    ("libvirt-version", "\"9.0.0\".into()"),
    ("cpus", "4"),
    ("numa-nodes", "1"),
];

/// Indentation of the host facts' fields in the templates' fixtures.
const HOST_FACTS_INDENT: usize = 16;

/// The field names of `record NAME { ... }` in WIT text, in order.
fn wit_record_fields(wit: &str, record: &str) -> Vec<String> {
    let open = format!("record {record} {{");
    let Some(start) = wit.find(&open) else {
        return Vec::new();
    };
    wit[start + open.len()..]
        .lines()
        .map(str::trim)
        .take_while(|l| !l.starts_with('}'))
        .filter(|l| !l.starts_with("//") && !l.is_empty())
        .filter_map(|l| l.split_once(':').map(|(name, _)| name.trim().to_string()))
        .collect()
}

/// The fields of a `HostFacts` literal for the templates' fixtures, one per line.
fn host_facts_fields() -> String {
    let wit = sdk::FILES
        .iter()
        .find(|f| f.path.ends_with(".wit"))
        .map(|f| f.text)
        .unwrap_or_default();
    wit_record_fields(wit, "host-facts")
        .iter()
        .map(|field| {
            let value = HOST_FACT_VALUES
                .iter()
                .find(|(name, _)| name == field)
                .map(|(_, v)| *v)
                .unwrap_or("Default::default()");
            format!(
                "{}{}: {value},\n",
                " ".repeat(HOST_FACTS_INDENT),
                field.replace('-', "_")
            )
        })
        .collect()
}

/// Longest crate name accepted (crates.io's limit).
const MAX_NAME: usize = 64;

/// Names a crate may not take: Rust keywords (cargo refuses them), the standard crates
/// (they would shadow them), names cargo reserves, and the SDK it depends on.
const RESERVED: &[&str] = &[
    "abstract",
    "as",
    "async",
    "await",
    "become",
    "box",
    "break",
    "const",
    "continue",
    "crate",
    "do",
    "dyn",
    "else",
    "enum",
    "extern",
    "false",
    "final",
    "fn",
    "for",
    "gen",
    "if",
    "impl",
    "in",
    "let",
    "loop",
    "macro",
    "match",
    "mod",
    "move",
    "mut",
    "override",
    "priv",
    "pub",
    "ref",
    "return",
    "self",
    "static",
    "struct",
    "super",
    "trait",
    "true",
    "try",
    "type",
    "typeof",
    "unsafe",
    "unsized",
    "use",
    "virtual",
    "where",
    "while",
    "yield",
    "alloc",
    "core",
    "proc_macro",
    "std",
    "test",
    "build",
    "deps",
    "examples",
    "incremental",
    "templates_sdk",
];

/// Checks that `name` is a crate name cargo accepts and that builds to a file name the
/// README can promise: ASCII lower-case letters, digits, `-` and `_`, starting with a
/// letter, not reserved.
pub fn check_name(name: &str) -> Result<(), AuthoringError> {
    let refuse = |reason: &str| AuthoringError::InvalidName {
        name: name.to_string(),
        reason: reason.to_string(),
    };
    if name.is_empty() {
        return Err(refuse("it is empty"));
    }
    if name.len() > MAX_NAME {
        return Err(refuse(&format!("it is longer than {MAX_NAME} characters")));
    }
    if !name.starts_with(|c: char| c.is_ascii_lowercase()) {
        return Err(refuse("it must start with a lower-case ASCII letter"));
    }
    if let Some(c) = name
        .chars()
        .find(|c| !(c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '-' || *c == '_'))
    {
        return Err(refuse(&format!(
            "{c:?} is not allowed; use lower-case ASCII letters, digits, '-' and '_'"
        )));
    }
    if name.ends_with(['-', '_']) {
        return Err(refuse("it must not end with '-' or '_'"));
    }
    if RESERVED.contains(&crate_name(name).as_str()) {
        return Err(refuse(
            "it is reserved (a Rust keyword, a standard crate, a name cargo uses, or the SDK's)",
        ));
    }
    Ok(())
}

/// The crate name as Rust and the output file see it: `-` becomes `_`.
pub fn crate_name(name: &str) -> String {
    name.replace('-', "_")
}

/// One file of the new crate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewFile {
    /// Path inside the crate directory.
    pub path: PathBuf,
    /// Contents.
    pub text: String,
}

/// Every file of a new crate called `name` of `kind` (the name was checked).
pub fn files(kind: Kind, name: &str) -> Vec<NewFile> {
    let (kind_str, config_key, config_file, other_file, lib) = match kind {
        Kind::Domain => (
            "domain",
            "domain",
            "domain-default.wasm",
            "vendor-data-default.wasm",
            DOMAIN_LIB,
        ),
        Kind::VendorData => (
            "vendor-data",
            "vendorData",
            "vendor-data-default.wasm",
            "domain-default.wasm",
            VENDOR_DATA_LIB,
        ),
    };
    let dep = |n: &str| sdk::pinned(n).map(sdk::dependency_line).unwrap_or_default();
    let fill = |template: &str| {
        template
            .replace("{{name}}", name)
            .replace("{{crate_name}}", &crate_name(name))
            .replace("{{kind}}", kind_str)
            .replace("{{config_key}}", config_key)
            .replace("{{config_file}}", config_file)
            .replace("{{other_file}}", other_file)
            .replace("{{schemars}}", &dep("schemars"))
            .replace("{{serde}}", &dep("serde"))
            .replace("{{host_facts}}", &host_facts_fields())
            .replace("{{rust_version}}", sdk::RUST_VERSION)
    };
    let mut files = vec![
        NewFile {
            path: "Cargo.toml".into(),
            text: fill(CARGO_TOML),
        },
        NewFile {
            path: "README.md".into(),
            text: fill(README),
        },
        NewFile {
            path: ".gitignore".into(),
            text: GITIGNORE.into(),
        },
        NewFile {
            path: "src/lib.rs".into(),
            text: fill(lib),
        },
        NewFile {
            path: Path::new(sdk::DIR).join(sdk::PACKAGE).join("Cargo.toml"),
            text: sdk::cargo_toml(),
        },
    ];
    files.extend(sdk::FILES.iter().map(|f| NewFile {
        path: Path::new(sdk::DIR).join(f.path),
        text: f.text.to_string(),
    }));
    files
}

/// Writes a new crate called `name` of `kind` into `dir`, which must not exist or be
/// empty. Returns the files written (paths inside `dir`).
pub fn create(kind: Kind, name: &str, dir: &Path) -> Result<Vec<PathBuf>, AuthoringError> {
    check_name(name)?;
    let not_empty = || AuthoringError::TargetNotEmpty {
        path: dir.display().to_string(),
    };
    match std::fs::read_dir(dir) {
        Ok(mut entries) => {
            if entries.next().is_some() {
                return Err(not_empty());
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotADirectory => return Err(not_empty()),
        Err(e) => return Err(AuthoringError::io(dir, e)),
    }
    let parent = match dir.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    std::fs::create_dir_all(&parent).map_err(|e| AuthoringError::io(&parent, e))?;
    // Staged beside the target (same file system, so the rename is atomic); removed on
    // every error path by the guard's drop.
    let staging = tempfile::Builder::new()
        .prefix(".plugin-new-")
        .tempdir_in(&parent)
        .map_err(|e| AuthoringError::io(&parent, e))?;
    let files = files(kind, name);
    for f in &files {
        let path = staging.path().join(&f.path);
        if let Some(d) = path.parent() {
            std::fs::create_dir_all(d).map_err(|e| AuthoringError::io(d, e))?;
        }
        std::fs::write(&path, &f.text).map_err(|e| AuthoringError::io(&dir.join(&f.path), e))?;
    }
    // rename(2) replaces an empty directory; one that filled up meanwhile is refused.
    std::fs::rename(staging.path(), dir).map_err(|e| match e.kind() {
        std::io::ErrorKind::DirectoryNotEmpty => not_empty(),
        _ => AuthoringError::io(dir, e),
    })?;
    // The staging directory is the crate now: nothing left to remove.
    let _ = staging.keep();
    Ok(files.into_iter().map(|f| f.path).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_names_are_refused_naming_the_argument() {
        for (name, why) in [
            ("", "empty"),
            ("My-Plugin", "lower-case"),
            ("1plugin", "lower-case"),
            ("my plugin", "' '"),
            ("my.plugin", "'.'"),
            ("plugin-", "end"),
            ("fn", "reserved"),
            ("test", "reserved"),
            ("templates-sdk", "reserved"),
            ("ünicode", "lower-case"),
        ] {
            let e = check_name(name).expect_err(name);
            let text = e.to_string();
            assert!(text.starts_with("NAME "), "{text}");
            assert!(text.contains(why), "{name}: {text}");
        }
        let long = "a".repeat(65);
        assert!(check_name(&long).is_err());
        for good in ["my-domain", "site_vendor_data", "a1", "x"] {
            check_name(good).unwrap();
        }
    }

    #[test]
    fn the_crate_names_its_output_file_and_its_kind() {
        let files = files(Kind::Domain, "my-domain");
        let get = |p: &str| {
            files
                .iter()
                .find(|f| f.path == Path::new(p))
                .map(|f| f.text.clone())
                .unwrap()
        };
        let cargo = get("Cargo.toml");
        assert!(cargo.contains("name = \"my-domain\""));
        assert!(cargo.contains("crate-type = [\"cdylib\"]"));
        assert!(cargo.contains("features = [\"domain\"]"));
        assert!(cargo.contains("serde = { version = \"=1.0."));
        assert!(cargo.contains("\n[workspace]\n"));
        assert!(!cargo.contains("{{"), "{cargo}");
        let readme = get("README.md");
        assert!(readme.contains("target/wasm32-wasip2/release/my_domain.wasm"));
        assert!(readme.contains("vendor-data-default.wasm"));
        assert!(!readme.contains("{{"));
        assert!(get("src/lib.rs").contains("export_domain_plugin!(Plugin)"));
        let wit = sdk::FILES
            .iter()
            .find(|f| f.path == "templates-sdk/wit/templates.wit")
            .unwrap();
        assert_eq!(get("sdk/templates-sdk/wit/templates.wit"), wit.text);
        assert!(get("sdk/templates-sdk/Cargo.toml").contains("name = \"templates-sdk\""));

        let files = super::files(Kind::VendorData, "v");
        let lib = &files
            .iter()
            .find(|f| f.path == Path::new("src/lib.rs"))
            .unwrap()
            .text;
        assert!(lib.contains("export_vendor_data_plugin!(Plugin)"));
    }

    #[test]
    fn fixtures_give_every_host_fact_of_the_wit_a_value() {
        let wit = sdk::FILES
            .iter()
            .find(|f| f.path == "templates-sdk/wit/templates.wit")
            .unwrap()
            .text;
        let fields = wit_record_fields(wit, "host-facts");
        assert!(fields.len() >= 4, "{fields:?}");
        for f in &fields {
            assert!(
                HOST_FACT_VALUES.iter().any(|(name, _)| name == f),
                "host-facts field {f:?} has no fixture value in HOST_FACT_VALUES"
            );
        }
        let lines = host_facts_fields();
        assert!(
            lines.contains("                libvirt_version: \"9.0.0\".into(),\n"),
            "{lines}"
        );
        assert_eq!(
            wit_record_fields(
                "record x {\n  /// doc: with colon\n  a-b: u32,\n  c: string,\n}\n",
                "x"
            ),
            ["a-b", "c"]
        );
    }

    #[test]
    fn a_non_empty_target_is_refused_and_nothing_is_left_behind() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("taken");
        std::fs::create_dir(&dir).unwrap();
        std::fs::write(dir.join("keep.txt"), "mine").unwrap();
        let e = create(Kind::Domain, "p", &dir).unwrap_err();
        assert!(matches!(e, AuthoringError::TargetNotEmpty { .. }), "{e}");
        assert!(
            e.to_string()
                .contains("(--dir, ./NAME by default) exists and is not empty"),
            "{e}"
        );
        let left: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().collect();
        assert_eq!(left.len(), 1, "only the user's directory stays");
        assert_eq!(
            std::fs::read_to_string(dir.join("keep.txt")).unwrap(),
            "mine"
        );

        // A file in the way is not a directory to write into either.
        let file = tmp.path().join("file");
        std::fs::write(&file, "x").unwrap();
        assert!(matches!(
            create(Kind::Domain, "p", &file),
            Err(AuthoringError::TargetNotEmpty { .. })
        ));
    }

    #[test]
    fn writes_into_a_new_or_empty_directory() {
        let tmp = tempfile::tempdir().unwrap();
        let empty = tmp.path().join("empty");
        std::fs::create_dir(&empty).unwrap();
        let written = create(Kind::VendorData, "site-vd", &empty).unwrap();
        assert!(written.contains(&PathBuf::from("src/lib.rs")));
        for f in &written {
            assert!(empty.join(f).is_file(), "{}", f.display());
        }
        let fresh = tmp.path().join("a/b/fresh");
        create(Kind::Domain, "site-domain", &fresh).unwrap();
        assert!(fresh.join("sdk/templates-sdk/src/lib.rs").is_file());
        // No staging directory is left beside them.
        let names: Vec<String> = std::fs::read_dir(tmp.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert!(
            names.iter().all(|n| !n.starts_with(".plugin-new-")),
            "{names:?}"
        );
    }
}
