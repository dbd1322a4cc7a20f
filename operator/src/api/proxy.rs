//! The `Proxy` resource: one egress proxy VM.
//!
//! Until the CRD and controller land these types are read from files (`render`, samples);
//! the spec is already the one the CRD will carry, so files written now stay valid.

use std::path::Path;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::config::{self, ConfigError, ValidConfig};
use crate::validation::{self as rules, Problems};

/// API group and version of the Proxy resource.
pub const API_VERSION: &str = "egress-operator.dev/v1alpha1";
/// Kind of the Proxy resource.
pub const KIND: &str = "Proxy";
/// The only provider so far.
pub const PROVIDER_KVM2: &str = "kvm2";

/// What a Proxy asks for.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ProxySpec {
    /// Provider that runs the VM; `kvm2`.
    pub provider: String,
    /// Machine type name from the providers config; its default when left out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub machine_type: Option<String>,
    /// Image name from the providers config; its default when left out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    /// Pin the VM to this host; the provider places it when left out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    /// cloud-init user-data, read from a Secret at create time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user_data: Option<UserDataSource>,
}

/// Where the cloud-init user-data comes from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct UserDataSource {
    /// A key of a Secret in the Proxy's namespace.
    pub secret_ref: SecretKeyRef,
}

/// A key of a Secret in the same namespace.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SecretKeyRef {
    /// Secret name.
    pub name: String,
    /// Key within the Secret.
    pub key: String,
}

/// The parts of object metadata a Proxy file carries.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ObjectMeta {
    /// Object name; becomes the guest's host name, so it must be a DNS-1123 label.
    pub name: String,
    /// Namespace; `default` when left out.
    #[serde(default = "default_namespace")]
    pub namespace: String,
    /// Everything else (labels, annotations, uid, ...) is kept but not interpreted here.
    #[serde(flatten)]
    pub rest: serde_json::Map<String, serde_json::Value>,
}

fn default_namespace() -> String {
    "default".into()
}

/// A Proxy as written in a manifest file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ProxyManifest {
    /// Must be [`API_VERSION`].
    pub api_version: String,
    /// Must be [`KIND`].
    pub kind: String,
    /// Name and namespace.
    pub metadata: ObjectMeta,
    /// The request.
    pub spec: ProxySpec,
    /// Ignored when read from a file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<serde_json::Value>,
}

impl ProxySpec {
    /// Checks the spec's own values and that every name it uses exists in `config`.
    pub fn check(&self, config: &ValidConfig, p: &mut Problems) {
        if self.provider != PROVIDER_KVM2 {
            p.push(
                "spec.provider",
                format!(
                    "{} is not a known provider (known: \"kvm2\")",
                    rules::show(&self.provider)
                ),
            );
        }
        let defaults = config.kvm2.defaults.as_ref();
        resolve_name(
            "spec.machineType",
            self.machine_type.as_deref(),
            defaults.and_then(|d| d.machine_type.as_deref()),
            "kvm2.machineTypes",
            config.kvm2.machine_types.iter().map(|m| m.name.as_str()),
            p,
        );
        resolve_name(
            "spec.image",
            self.image.as_deref(),
            defaults.and_then(|d| d.image.as_deref()),
            "kvm2.images",
            config.kvm2.images.iter().map(|i| i.name.as_str()),
            p,
        );
        if let Some(host) = &self.host {
            config::validate::reference(
                "spec.host",
                host,
                "kvm2.hosts",
                config.kvm2.hosts.iter().map(|h| h.name.as_str()),
                p,
            );
        }
        if let Some(ud) = &self.user_data {
            p.check(
                "spec.userData.secretRef.name",
                rules::dns1123_subdomain(&ud.secret_ref.name),
            );
            p.check(
                "spec.userData.secretRef.key",
                rules::secret_key(&ud.secret_ref.key),
            );
        }
    }
}

fn resolve_name<'a>(
    path: &str,
    given: Option<&str>,
    default: Option<&str>,
    list: &str,
    names: impl Iterator<Item = &'a str>,
    p: &mut Problems,
) {
    match given.or(default) {
        Some(name) => config::validate::reference(path, name, list, names, p),
        None => p.push(
            path,
            "is required: the providers config sets no default (kvm2.defaults) for it",
        ),
    }
}

impl ProxyManifest {
    /// Checks kind, metadata and spec against `config`, collecting every problem.
    pub fn check(&self, config: &ValidConfig) -> Problems {
        let mut p = Problems::new();
        if self.api_version != API_VERSION {
            p.push(
                "apiVersion",
                format!("{} is not {API_VERSION:?}", rules::show(&self.api_version)),
            );
        }
        if self.kind != KIND {
            p.push(
                "kind",
                format!("{} is not {KIND:?}", rules::show(&self.kind)),
            );
        }
        p.check("metadata.name", rules::dns1123_label(&self.metadata.name));
        p.check(
            "metadata.namespace",
            rules::dns1123_label(&self.metadata.namespace),
        );
        self.spec.check(config, &mut p);
        p
    }
}

/// Reads a Proxy manifest file and checks it against `config`.
pub fn load_manifest(path: &Path, config: &ValidConfig) -> Result<ProxyManifest, ConfigError> {
    let source = path.display().to_string();
    let text = config::read_capped(path)?;
    let manifest: ProxyManifest = config::parse_yaml(&text, &source)?;
    let problems = manifest.check(config).into_vec();
    if problems.is_empty() {
        Ok(manifest)
    } else {
        Err(ConfigError::Invalid {
            document: source,
            problems,
        })
    }
}
