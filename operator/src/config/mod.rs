//! The providers config: loading, validation and its JSON Schema.
//!
//! The only way to get a [`ValidConfig`] is through [`load_file`] or [`parse`], which run
//! every rule in [`validate`]; so code downstream (placement, XML, volume names, paths)
//! never sees an unchecked value.

pub mod live;
pub mod types;
pub mod validate;

use std::ops::Deref;
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use types::*;

use crate::cluster_identity::ClusterIdentity;
use crate::error::{Classified, ErrorClass};
use crate::validation::Problem;

/// A config file larger than this is refused before parsing: real configs are a few KB,
/// and YAML aliases can turn a small file into a large document.
pub const MAX_CONFIG_BYTES: u64 = 1024 * 1024;

/// Why a config could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config file {}: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The file is larger than [`MAX_CONFIG_BYTES`].
    #[error("config file {} is {size} bytes; at most {MAX_CONFIG_BYTES} are accepted", path.display())]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// Its size.
        size: u64,
    },
    /// The YAML is malformed or does not fit the types (unknown field, wrong type).
    #[error("{document}: {field}: {message}")]
    Parse {
        /// Where the document came from (a file name or `<input>`).
        document: String,
        /// Path of the offending field (`kvm2.hosts[0]`), `.` for the document itself.
        field: String,
        /// The parser's message, with line and column.
        message: String,
    },
    /// The document parsed but some values are refused.
    #[error("{document}: {} problem(s):\n{}", problems.len(), render_problems(problems))]
    Invalid {
        /// Where the document came from.
        document: String,
        /// Every problem, in document order.
        problems: Vec<Problem>,
    },
}

fn render_problems(problems: &[Problem]) -> String {
    problems
        .iter()
        .map(|p| format!("  {p}"))
        .collect::<Vec<_>>()
        .join("\n")
}

impl ConfigError {
    /// Every problem as `path: message` lines, for CLI output and status conditions.
    pub fn problems(&self) -> Vec<String> {
        match self {
            ConfigError::Invalid { problems, .. } => {
                problems.iter().map(ToString::to_string).collect()
            }
            ConfigError::Parse { field, message, .. } => vec![format!("{field}: {message}")],
            other => vec![other.to_string()],
        }
    }
}

impl Classified for ConfigError {
    fn class(&self) -> ErrorClass {
        // A config is fixed until someone edits it: retrying changes nothing.
        ErrorClass::Permanent
    }
}

/// A providers config that passed every rule, with relative file paths resolved, and the
/// cluster identity built from it (shared by every clone, so it is resolved once for all).
#[derive(Debug, Clone)]
pub struct ValidConfig(ProvidersConfig, Arc<ClusterIdentity>);

impl PartialEq for ValidConfig {
    fn eq(&self, other: &Self) -> bool {
        self.0 == other.0
    }
}

impl Deref for ValidConfig {
    type Target = ProvidersConfig;
    fn deref(&self) -> &ProvidersConfig {
        &self.0
    }
}

impl ValidConfig {
    /// Who this cluster is in the marks and announcements it writes: resolved from the
    /// `kube-system` UID by the operator, or the configured `clusterId` alone by the CLI.
    pub fn identity(&self) -> &ClusterIdentity {
        &self.1
    }
    /// This config with `old`'s identity (resolved at start): a reload must not write
    /// marks under an identity not yet resolved. [`live::needs_restart`] refused a changed
    /// `clusterId` before this is called.
    pub fn with_identity_of(self, old: &ValidConfig) -> Self {
        Self(self.0, old.1.clone())
    }
    /// The host of that name.
    pub fn host(&self, name: &str) -> Option<&HostConfig> {
        self.0.kvm2.hosts.iter().find(|h| h.name == name)
    }
    /// The image of that name.
    pub fn image(&self, name: &str) -> Option<&ImageConfig> {
        self.0.kvm2.images.iter().find(|i| i.name == name)
    }
    /// The machine type of that name.
    pub fn machine_type(&self, name: &str) -> Option<&MachineTypeConfig> {
        self.0.kvm2.machine_types.iter().find(|m| m.name == name)
    }
    /// One line that says what the config holds.
    pub fn summary(&self) -> String {
        let k = &self.0.kvm2;
        format!(
            "cluster {}: {} host(s), {} image(s), {} machine type(s)",
            match &self.0.cluster_id {
                Some(id) => format!("{id:?}"),
                None => "(clusterId derived from the cluster UID)".to_string(),
            },
            k.hosts.len(),
            k.images.len(),
            k.machine_types.len()
        )
    }
}

/// Reads, parses and validates a config file. Relative file paths inside it are resolved
/// against the file's directory.
pub fn load_file(path: &Path) -> Result<ValidConfig, ConfigError> {
    let text = read_capped(path)?;
    let base = path.parent().unwrap_or(Path::new("."));
    parse(&text, &path.display().to_string(), base)
}

/// Reads a YAML document of at most [`MAX_CONFIG_BYTES`], checking the size first.
pub(crate) fn read_capped(path: &Path) -> Result<String, ConfigError> {
    let read_err = |source| ConfigError::Read {
        path: path.to_path_buf(),
        source,
    };
    let size = std::fs::metadata(path).map_err(read_err)?.len();
    if size > MAX_CONFIG_BYTES {
        return Err(ConfigError::TooLarge {
            path: path.to_path_buf(),
            size,
        });
    }
    std::fs::read_to_string(path).map_err(read_err)
}

/// Parses and validates a config document. `source` names it in errors; relative file
/// paths are resolved against `base_dir`.
pub fn parse(text: &str, source: &str, base_dir: &Path) -> Result<ValidConfig, ConfigError> {
    if text.len() as u64 > MAX_CONFIG_BYTES {
        return Err(ConfigError::Parse {
            document: source.to_string(),
            field: ".".into(),
            message: format!(
                "document is {} bytes; at most {MAX_CONFIG_BYTES} are accepted",
                text.len()
            ),
        });
    }
    let mut config: ProvidersConfig = parse_yaml(text, source)?;
    let problems = validate::validate(&config).into_vec();
    if !problems.is_empty() {
        return Err(ConfigError::Invalid {
            document: source.to_string(),
            problems,
        });
    }
    config
        .kvm2
        .images
        .iter_mut()
        .for_each(|i| i.sha256.make_ascii_lowercase());
    for t in [
        &mut config.kvm2.templates.domain,
        &mut config.kvm2.templates.vendor_data,
    ] {
        if let Some(s) = t.sha256.as_mut() {
            s.make_ascii_lowercase();
        }
        if let Some(p) = t.path.as_mut() {
            *p = resolve(base_dir, p);
        }
        if let Some(p) = t.credentials_file.as_mut() {
            *p = resolve(base_dir, p);
        }
    }
    let ssh = &mut config.kvm2.ssh;
    ssh.private_key_file = resolve(base_dir, &ssh.private_key_file);
    ssh.known_hosts_file = resolve(base_dir, &ssh.known_hosts_file);
    let identity = Arc::new(ClusterIdentity::new(config.cluster_id.clone()));
    Ok(ValidConfig(config, identity))
}

/// Deserialises YAML into `T`, reporting the path of the field that failed.
pub fn parse_yaml<T: serde::de::DeserializeOwned>(
    text: &str,
    source: &str,
) -> Result<T, ConfigError> {
    let de = serde_yaml_ng::Deserializer::from_str(text);
    serde_path_to_error::deserialize(de).map_err(|e| ConfigError::Parse {
        document: source.to_string(),
        field: e.path().to_string(),
        message: e.into_inner().to_string(),
    })
}

fn resolve(base: &Path, file: &str) -> String {
    let p = Path::new(file);
    if p.is_absolute() {
        file.to_string()
    } else {
        base.join(p).display().to_string()
    }
}

/// The JSON Schema of the config, pretty-printed, as committed in
/// `config/schema/providers-config.schema.json`.
pub fn json_schema() -> String {
    let schema = schemars::schema_for!(ProvidersConfig);
    // Serialising a schemars schema (a JSON value) cannot fail.
    let mut text = serde_json::to_string_pretty(&schema).unwrap_or_default();
    text.push('\n');
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_err(text: &str) -> ConfigError {
        parse(text, "test.yaml", Path::new("/base")).unwrap_err()
    }

    #[test]
    fn unknown_field_is_refused_with_its_path() {
        let text = validate::tests::VALID.replace("bridge: br0}", "bridge: br0, bridg: br1}");
        match parse_err(&text) {
            ConfigError::Parse { field, message, .. } => {
                assert_eq!(field, "kvm2.hosts[0].bridg");
                assert!(message.contains("unknown field `bridg`"), "{message}");
            }
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn wrong_type_is_refused_with_its_path() {
        let text = validate::tests::VALID.replace("vcpus: 1", "vcpus: many");
        match parse_err(&text) {
            ConfigError::Parse { field, .. } => assert_eq!(field, "kvm2.machineTypes[0].vcpus"),
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn nul_and_newline_in_yaml_values_are_refused() {
        for bad in ["bridge: \"br\\0\"", "bridge: \"br\\n0\""] {
            let text = validate::tests::VALID.replace("bridge: br0}", &format!("{bad}}}"));
            let err = parse_err(&text);
            assert!(
                err.problems()
                    .iter()
                    .any(|p| p.starts_with("kvm2.hosts[0].bridge: ")),
                "{bad}: {err}"
            );
        }
    }

    #[test]
    fn relative_paths_resolve_against_the_config_dir() {
        let text = validate::tests::VALID
            .replace("privateKeyFile: /k/id", "privateKeyFile: keys/id")
            .replace("path: /p/domain.wasm", "path: ../plugins/d.wasm");
        let c = parse(&text, "t", Path::new("/etc/eo")).unwrap();
        assert_eq!(c.kvm2.ssh.private_key_file, "/etc/eo/keys/id");
        assert_eq!(c.kvm2.ssh.known_hosts_file, "/k/known_hosts");
        assert_eq!(
            c.kvm2.templates.domain.path.as_deref(),
            Some("/etc/eo/../plugins/d.wasm")
        );
    }

    #[test]
    fn digests_are_normalised_to_lower_case() {
        let text = validate::tests::VALID.replace(&"0".repeat(64), &"AB".repeat(32));
        let c = parse(&text, "t", Path::new("/")).unwrap();
        assert_eq!(c.kvm2.images[0].sha256, "ab".repeat(32));
    }

    #[test]
    fn oversized_documents_are_refused_before_parsing() {
        let big = format!(
            "# {}\n{}",
            "x".repeat(MAX_CONFIG_BYTES as usize),
            validate::tests::VALID
        );
        assert!(parse_err(&big).to_string().contains("at most"));
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("big.yaml");
        std::fs::write(&file, &big).unwrap();
        assert!(matches!(
            load_file(&file),
            Err(ConfigError::TooLarge { .. })
        ));
    }

    #[test]
    fn missing_file_names_the_file() {
        let err = load_file(Path::new("/nonexistent/config.yaml")).unwrap_err();
        assert!(
            err.to_string().contains("/nonexistent/config.yaml"),
            "{err}"
        );
        assert_eq!(err.class(), ErrorClass::Permanent);
    }

    #[test]
    fn lookups_and_summary() {
        let c = parse(validate::tests::VALID, "t", Path::new("/")).unwrap();
        assert_eq!(
            c.host("h2").map(|h| h.address.as_str()),
            Some("h2.example.org")
        );
        assert!(c.host("h3").is_none());
        assert_eq!(
            c.image("debian").map(|i| i.format),
            Some(ImageFormat::Qcow2)
        );
        assert_eq!(c.machine_type("small").map(|m| m.vcpus), Some(1));
        assert_eq!(
            c.summary(),
            "cluster \"test\": 2 host(s), 1 image(s), 1 machine type(s)"
        );
        let h = c.host("h1").unwrap();
        assert_eq!(h.libvirt_socket, DEFAULT_LIBVIRT_SOCKET);
        assert_eq!(h.driver, LibvirtDriver::Qemu);
        assert!(!h.insecure_ignore_host_key);
    }
}
