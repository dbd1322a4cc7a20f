//! Plugin authoring: `plugin new` writes a standalone plugin crate, `plugin test` renders a
//! built plugin against a matrix of inputs and runs every output through the operator's
//! own checks.
//!
//! Both serve a site engineer working outside this repository: the new crate carries its
//! own copy of the SDK ([`sdk`]), so it builds anywhere, and `plugin test` needs no host,
//! no cluster and no providers config (a sample one stands in).
//!
//! - [`scaffold`]: the crate `plugin new` writes (name rules, files, the write itself);
//! - [`sdk`]: the SDK's sources, embedded in the binary, and the pinned versions;
//! - [`matrix`]: the cases `plugin test` renders (machine types, NICs, addressing, hosts);
//! - [`runner`]: loads the plugin with the given settings and renders every case;
//! - [`table`]: the report, one row per case with the rule and path of each refusal;
//! - [`push`]: `plugin push`, which publishes a built plugin to an OCI registry.

pub mod matrix;
pub mod push;
pub mod runner;
pub mod scaffold;
pub mod sdk;
pub mod table;

use crate::error::{Classified, ErrorClass};
use crate::templates::TemplateKind;

/// Why `plugin new` or `plugin test` could not do its job (a failing case of `plugin
/// test` is a result, not an error).
#[derive(Debug, thiserror::Error)]
pub enum AuthoringError {
    /// The plugin name is not a usable crate name.
    #[error("NAME {name:?} is not a valid crate name: {reason}")]
    InvalidName {
        /// The name given.
        name: String,
        /// Why.
        reason: String,
    },
    /// The directory to write the crate into exists and holds something.
    #[error(
        "{path} (--dir, ./NAME by default) exists and is not empty: choose another directory or remove it"
    )]
    TargetNotEmpty {
        /// The directory.
        path: String,
    },
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file or directory.
        path: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The `--settings` file is not a YAML or JSON document.
    #[error("--settings {path}: {reason}")]
    SettingsFile {
        /// The file.
        path: String,
        /// Why.
        reason: String,
    },
    /// The `--config` file was refused.
    #[error("--config: {0}")]
    Config(#[source] crate::config::ConfigError),
    /// The plugin could not be loaded, or its settings were refused.
    #[error(transparent)]
    Plugin(#[from] crate::templates::TemplateError),
    /// The plugin exports neither kind's interface (when `--kind` was left out).
    #[error(
        "PLUGIN {path}: exports neither a domain nor a vendor-data template: as domain: {domain}; as vendor-data: {vendor_data}"
    )]
    UnknownKind {
        /// The component file.
        path: String,
        /// Why it did not load as a domain plugin.
        domain: String,
        /// Why it did not load as a vendor-data plugin.
        vendor_data: String,
    },
    /// The file given to `plugin push` is not a WebAssembly component.
    #[error("PLUGIN {path}: {reason}")]
    NotAComponent {
        /// The file.
        path: String,
        /// Why.
        reason: String,
    },
    /// A registry push or pull failed, or its reference was refused.
    #[error("{0}")]
    Oci(#[from] crate::templates::oci::OciError),
    /// The matrix could not be set up from the config (no machine types, say).
    #[error("cannot set up the test matrix: {reason}")]
    Matrix {
        /// Why.
        reason: String,
    },
    /// The inputs of a case could not be assembled (a config without images, say).
    #[error("cannot assemble the inputs of case {case}: {reason}")]
    Inputs {
        /// The case.
        case: String,
        /// Why.
        reason: String,
    },
}

impl AuthoringError {
    fn io(path: &std::path::Path, source: std::io::Error) -> Self {
        Self::Io {
            path: path.display().to_string(),
            source,
        }
    }
}

impl Classified for AuthoringError {
    fn class(&self) -> ErrorClass {
        match self {
            AuthoringError::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound => {
                ErrorClass::NotFound
            }
            AuthoringError::Io { .. } => ErrorClass::Transient,
            AuthoringError::Plugin(e) => e.class(),
            AuthoringError::Oci(e) => e.class(),
            // Everything else repeats until the input changes.
            _ => ErrorClass::Permanent,
        }
    }
}

/// The two plugin kinds, as the command line names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Kind {
    /// Renders libvirt domain XML.
    Domain,
    /// Renders cloud-init vendor-data.
    VendorData,
}

impl From<Kind> for TemplateKind {
    fn from(k: Kind) -> Self {
        match k {
            Kind::Domain => TemplateKind::Domain,
            Kind::VendorData => TemplateKind::VendorData,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_carry_a_class() {
        let io = |kind| AuthoringError::Io {
            path: "/x".into(),
            source: std::io::Error::from(kind),
        };
        assert_eq!(
            io(std::io::ErrorKind::NotFound).class(),
            ErrorClass::NotFound
        );
        assert_eq!(
            io(std::io::ErrorKind::PermissionDenied).class(),
            ErrorClass::Transient
        );
        let name = AuthoringError::InvalidName {
            name: "X".into(),
            reason: "upper case".into(),
        };
        assert_eq!(name.class(), ErrorClass::Permanent);
        let plugin = AuthoringError::Plugin(crate::templates::TemplateError {
            plugin: "domain:x".into(),
            kind: crate::templates::TemplateErrorKind::Limit {
                limit: crate::templates::Limit::Timeout,
            },
        });
        assert_eq!(plugin.class(), ErrorClass::Transient);
    }
}
