//! The plugin SDK as `plugin new` writes it beside a new crate.
//!
//! `templates-sdk` is not published on crates.io, so a plugin built outside this repository
//! gets a copy: its sources and WIT files, and the files they include from elsewhere in the
//! repository (its crate docs show `plugins/sdk-example` verbatim), are embedded in this
//! binary byte for byte (a test keeps the list complete) and written under the new crate's
//! [`DIR`] in the repository's layout, so every relative `include_str!` still resolves. The
//! crate depends on that copy by path and builds offline anywhere, against exactly the ABI
//! this operator speaks.
//!
//! The SDK's own `Cargo.toml` inherits from our workspace, which a standalone crate does not
//! have; [`cargo_toml`] writes one with the same dependencies, features and versions (the
//! versions our `Cargo.lock` resolves, pinned exactly, so the author builds what we test).

/// Folder of a new crate that holds the SDK copy, laid out as this repository is.
pub const DIR: &str = "sdk";

/// Where the SDK's package sits inside [`DIR`] (and in this repository).
pub const PACKAGE: &str = "templates-sdk";

/// One embedded file of the SDK: its path in this repository and its text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SdkFile {
    /// Path relative to the repository's root, `/`-separated.
    pub path: &'static str,
    /// Contents, as in the repository.
    pub text: &'static str,
}

/// The SDK's sources and WIT package, and what they include. Every file under
/// `templates-sdk/src` and `templates-sdk/wit` and every file an `include_str!` in them names
/// must be listed (a test walks the directories and reads the includes).
pub const FILES: &[SdkFile] = &[
    SdkFile {
        path: "templates-sdk/src/rules.md",
        text: include_str!("../../../templates-sdk/src/rules.md"),
    },
    SdkFile {
        path: "templates-sdk/src/cloud_config.rs",
        text: include_str!("../../../templates-sdk/src/cloud_config.rs"),
    },
    SdkFile {
        path: "templates-sdk/src/lib.rs",
        text: include_str!("../../../templates-sdk/src/lib.rs"),
    },
    SdkFile {
        path: "templates-sdk/src/settings.rs",
        text: include_str!("../../../templates-sdk/src/settings.rs"),
    },
    SdkFile {
        path: "templates-sdk/src/xml.rs",
        text: include_str!("../../../templates-sdk/src/xml.rs"),
    },
    SdkFile {
        path: "plugins/sdk-example/src/lib.rs",
        text: include_str!("../../../plugins/sdk-example/src/lib.rs"),
    },
    SdkFile {
        path: "templates-sdk/wit/templates.wit",
        text: include_str!("../../../templates-sdk/wit/templates.wit"),
    },
];

/// One dependency with the version our `Cargo.lock` resolves for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pin {
    /// Crate name.
    pub name: &'static str,
    /// Exact version.
    pub version: &'static str,
    /// Features enabled (as the workspace's `Cargo.toml` enables them).
    pub features: &'static [&'static str],
    /// Whether the crate's default features stay on.
    pub default_features: bool,
}

const fn pin(name: &'static str, version: &'static str) -> Pin {
    Pin {
        name,
        version,
        features: &[],
        default_features: true,
    }
}

/// The SDK's dependencies. A test checks names and features against
/// `templates-sdk/Cargo.toml` and the workspace's `Cargo.toml`, versions against
/// `Cargo.lock`: bump them here when the lock moves.
pub const SDK_DEPENDENCIES: &[Pin] = &[
    pin("schemars", "1.2.3"),
    Pin {
        features: &["derive"],
        ..pin("serde", "1.0.229")
    },
    pin("serde_json", "1.0.154"),
    pin("serde_path_to_error", "0.1.20"),
    pin("strsim", "0.11.1"),
    pin("serde_yaml_ng", "0.10.0"),
    Pin {
        features: &["macros", "realloc", "std", "bitflags"],
        default_features: false,
        ..pin("wit-bindgen", "0.51.0")
    },
];

/// The SDK's version, as its package declares it.
pub const SDK_VERSION: &str = "0.1.0";

/// The oldest Rust the SDK is built with here (the workspace's `rust-version`).
pub const RUST_VERSION: &str = "1.95";

/// A pin by name (for the plugin crate's own dependencies).
pub fn pinned(name: &str) -> Option<&'static Pin> {
    SDK_DEPENDENCIES.iter().find(|p| p.name == name)
}

/// A `[dependencies]` line for `pin`.
pub fn dependency_line(pin: &Pin) -> String {
    let mut fields = vec![format!("version = \"={}\"", pin.version)];
    if !pin.default_features {
        fields.push("default-features = false".into());
    }
    if !pin.features.is_empty() {
        let list: Vec<String> = pin.features.iter().map(|f| format!("\"{f}\"")).collect();
        fields.push(format!("features = [{}]", list.join(", ")));
    }
    if fields.len() == 1 {
        format!("{} = \"={}\"", pin.name, pin.version)
    } else {
        format!("{} = {{ {} }}", pin.name, fields.join(", "))
    }
}

/// The standalone `Cargo.toml` of the SDK copy.
pub fn cargo_toml() -> String {
    let mut deps = String::new();
    for p in SDK_DEPENDENCIES {
        deps.push_str(&dependency_line(p));
        deps.push('\n');
    }
    format!(
        "# Written by `egress-operator plugin new`: a copy of the operator's templates-sdk\n\
         # (not published on crates.io). Replace the whole sdk/ folder to update it.\n\
         [package]\n\
         name = \"templates-sdk\"\n\
         description = \"SDK for egress-operator template plugins (WebAssembly components)\"\n\
         version = \"{SDK_VERSION}\"\n\
         edition = \"2024\"\n\
         rust-version = \"{RUST_VERSION}\"\n\
         license = \"Apache-2.0\"\n\
         publish = false\n\
         \n\
         [dependencies]\n\
         {deps}\
         \n\
         [features]\n\
         default = [\"domain\", \"vendor-data\"]\n\
         # Bindings of one world each; a plugin enables exactly one so only its world is linked in.\n\
         domain = []\n\
         vendor-data = []\n"
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;
    use std::path::{Path, PathBuf};

    fn repo() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_default()
    }

    fn walk(dir: &Path, root: &Path, out: &mut Vec<String>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(&path, root, out);
            } else {
                let rel = path.strip_prefix(root).unwrap();
                out.push(rel.to_string_lossy().replace('\\', "/"));
            }
        }
    }

    /// The paths (repository-relative) that `include_str!("...")` calls in `text`, a file at
    /// `at`, name.
    fn includes(at: &str, text: &str) -> Vec<String> {
        let dir = Path::new(at).parent().unwrap().to_path_buf();
        text.split("include_str!(\"")
            .skip(1)
            .filter_map(|rest| rest.split('"').next())
            .map(|rel| {
                let mut path = dir.clone();
                for part in rel.split('/') {
                    match part {
                        ".." => {
                            path.pop();
                        }
                        "." => {}
                        p => path.push(p),
                    }
                }
                path.to_string_lossy().replace('\\', "/")
            })
            .collect()
    }

    #[test]
    fn the_embedded_sdk_is_every_file_of_the_repository_copy() {
        let root = repo();
        let mut wanted = Vec::new();
        walk(&root.join("templates-sdk/src"), &root, &mut wanted);
        walk(&root.join("templates-sdk/wit"), &root, &mut wanted);
        // What the SDK's sources include from elsewhere, until nothing new turns up.
        let mut i = 0;
        while i < wanted.len() {
            let text = std::fs::read_to_string(root.join(&wanted[i])).unwrap_or_default();
            for inc in includes(&wanted[i], &text) {
                if !wanted.contains(&inc) {
                    wanted.push(inc);
                }
            }
            i += 1;
        }
        wanted.sort();
        let mut embedded: Vec<String> = FILES.iter().map(|f| f.path.to_string()).collect();
        embedded.sort();
        assert_eq!(
            embedded, wanted,
            "authoring/sdk.rs FILES must list every file of templates-sdk/src and wit and \
             every file they include"
        );
        for f in FILES {
            let text = std::fs::read_to_string(root.join(f.path)).unwrap();
            assert!(text == f.text, "{} differs from the embedded copy", f.path);
        }
        assert_eq!(
            includes(
                "templates-sdk/src/lib.rs",
                "x include_str!(\"../../a/b.rs\") y"
            ),
            ["a/b.rs"]
        );
    }

    /// `name` → versions of every package in `Cargo.lock`, and the dependency strings of
    /// templates-sdk (`name` or `name version`).
    fn lock() -> (BTreeMap<String, Vec<String>>, Vec<String>) {
        let text = std::fs::read_to_string(repo().join("Cargo.lock")).unwrap();
        let mut versions: BTreeMap<String, Vec<String>> = BTreeMap::new();
        let mut sdk_deps = Vec::new();
        for block in text.split("[[package]]").skip(1) {
            let field = |key: &str| {
                block.lines().find_map(|l| {
                    l.strip_prefix(&format!("{key} = \""))
                        .and_then(|r| r.strip_suffix('"'))
                        .map(str::to_string)
                })
            };
            let (name, version) = (field("name").unwrap(), field("version").unwrap());
            if name == "templates-sdk" {
                let deps = block.split("dependencies = [").nth(1).unwrap();
                let deps = deps.split(']').next().unwrap();
                sdk_deps = deps
                    .lines()
                    .map(|l| l.trim().trim_end_matches(',').trim_matches('"').to_string())
                    .filter(|l| !l.is_empty())
                    .collect();
            }
            versions.entry(name).or_default().push(version);
        }
        (versions, sdk_deps)
    }

    #[test]
    fn pins_are_the_versions_cargo_lock_resolves_for_the_sdk() {
        let (versions, sdk_deps) = lock();
        assert_eq!(sdk_deps.len(), SDK_DEPENDENCIES.len(), "{sdk_deps:?}");
        for dep in &sdk_deps {
            let mut parts = dep.split(' ');
            let name = parts.next().unwrap();
            let version = match parts.next() {
                Some(v) => v.to_string(),
                None => {
                    let all = &versions[name];
                    assert_eq!(all.len(), 1, "{name}");
                    all[0].clone()
                }
            };
            let pin = pinned(name).unwrap_or_else(|| panic!("no pin for {name}"));
            assert_eq!(
                pin.version, version,
                "authoring/sdk.rs pins {name} {}, Cargo.lock resolves {version}",
                pin.version
            );
        }
    }

    #[test]
    fn pins_name_the_sdk_dependencies_with_the_workspace_features() {
        let sdk = std::fs::read_to_string(repo().join("templates-sdk/Cargo.toml")).unwrap();
        let deps = sdk.split("[dependencies]").nth(1).unwrap();
        let deps = deps.split("\n[").next().unwrap();
        let mut names: Vec<&str> = deps
            .lines()
            .filter_map(|l| l.split('.').next())
            .map(str::trim)
            .filter(|n| !n.is_empty())
            .collect();
        names.sort();
        let mut ours: Vec<&str> = SDK_DEPENDENCIES.iter().map(|p| p.name).collect();
        ours.sort();
        assert_eq!(names, ours);
        let workspace = std::fs::read_to_string(repo().join("Cargo.toml")).unwrap();
        for p in SDK_DEPENDENCIES {
            let line = workspace
                .lines()
                .find(|l| l.starts_with(&format!("{} = ", p.name)))
                .unwrap_or_else(|| panic!("{} is not in the workspace dependencies", p.name));
            for f in p.features {
                assert!(line.contains(&format!("\"{f}\"")), "{line}: {f}");
            }
            let features = line.matches("\", \"").count() + usize::from(line.contains("features"));
            assert_eq!(features, p.features.len(), "{line}");
            assert_eq!(
                line.contains("default-features = false"),
                !p.default_features,
                "{line}"
            );
        }
    }

    #[test]
    fn the_rust_version_is_the_workspace_one() {
        let workspace = std::fs::read_to_string(repo().join("Cargo.toml")).unwrap();
        assert!(
            workspace.contains(&format!("\nrust-version = \"{RUST_VERSION}\"\n")),
            "authoring/sdk.rs RUST_VERSION differs from the workspace's rust-version"
        );
        assert!(cargo_toml().contains(&format!("rust-version = \"{RUST_VERSION}\"")));
    }

    #[test]
    fn dependency_lines_pin_exactly() {
        assert_eq!(
            dependency_line(&pin("strsim", "0.11.1")),
            "strsim = \"=0.11.1\""
        );
        let line = dependency_line(pinned("wit-bindgen").unwrap());
        assert_eq!(
            line,
            "wit-bindgen = { version = \"=0.51.0\", default-features = false, features = [\"macros\", \"realloc\", \"std\", \"bitflags\"] }"
        );
        assert!(cargo_toml().contains(&line));
    }
}
