//! The `Proxy` resource: one egress proxy VM.
//!
//! [`Proxy`] is the custom resource the controller reconciles; the same [`ProxySpec`] is
//! read from plain manifest files by `render` and `provision` ([`ProxyManifest`]), so a
//! file that works there works in the cluster. What can be checked without the providers
//! config lives in the CRD schema (patterns, enums, CEL), so the API server refuses it at
//! write time; what needs the config ([`ProxySpec::check`]) is checked by the controller
//! and reported as a permanent error on the Proxy.

use std::path::Path;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::CustomResource;
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

/// CRD group.
pub const GROUP: &str = "egress-operator.dev";

/// What a Proxy asks for. The spec is immutable (a CEL rule): a VM is replaced, not
/// edited, so a change means a new Proxy, and the controller never has to reconcile a
/// running VM towards a different machine type or image.
///
/// The spec types accept fields they do not know (no `deny_unknown_fields`): under a CRD
/// newer than the binary, one Proxy using a new field must not make the whole LIST
/// undecodable. The controller names such fields and refuses that Proxy
/// ([`unknown_fields`]); manifest files are checked the same way ([`load_manifest`]).
// Each printcolumn(...) repeats the same keys; clippy reads them as duplicates.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "egress-operator.dev",
    version = "v1alpha1",
    kind = "Proxy",
    plural = "proxies",
    shortname = "egp",
    category = "egress",
    namespaced,
    status = "ProxyStatus",
    doc = "An egress proxy VM on a KVM/libvirt host.",
    printcolumn(name = "Host", type_ = "string", json_path = ".status.host"),
    printcolumn(name = "Address", type_ = "string", json_path = ".status.address"),
    printcolumn(
        name = "Ready",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].status"
    ),
    printcolumn(
        name = "UpToDate",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"UpToDate\")].status"
    ),
    printcolumn(
        name = "Phase",
        type_ = "string",
        json_path = ".status.phase",
        priority = "1"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    ),
    validation = kube::core::Rule::new(NAME_RULE)
        .message(NAME_RULE_MESSAGE)
        .optional_old_self(true)
)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [{
    "rule": "self == oldSelf",
    "message": "spec is immutable: create a new Proxy to change it"
}]))]
pub struct ProxySpec {
    /// Provider that runs the VM; `kvm2`.
    #[schemars(extend("enum" = ["kvm2"]))]
    pub provider: String,
    /// Machine type name from the providers config; its default when left out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = DNS1123_LABEL), length(max = 63))]
    pub machine_type: Option<String>,
    /// Image name from the providers config; its default when left out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = DNS1123_LABEL), length(max = 63))]
    pub image: Option<String>,
    /// Pin the VM to this host; the provider places it when left out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = DNS1123_LABEL), length(max = 63))]
    pub host: Option<String>,
    /// cloud-init user-data, read from a Secret at create time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user_data: Option<UserDataSource>,
    /// Plugin settings for this Proxy only, merged over the config's (top-level keys).
    /// Only keys the providers config lists in `templates.<kind>.overridableSettings` are
    /// accepted; the merged settings are checked against the plugin's schema.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub template_settings: Option<TemplateSettingsOverrides>,
    /// What happens when the instance was made from inputs the config no longer has (its
    /// `UpToDate` condition turns False): `Manual` (the default) only shows it; `Replace`
    /// replaces the instance in place: deleted, then made again from the current inputs,
    /// so the proxy is down for one Create and its address may change. A pool's members
    /// leave this unset: the pool rolls them surge-first instead.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub update_policy: Option<UpdatePolicy>,
}

/// See [`ProxySpec::update_policy`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum UpdatePolicy {
    /// Only the `UpToDate` condition says the instance is out of date.
    #[default]
    Manual,
    /// An out-of-date instance is replaced in place.
    Replace,
}

/// CEL rule at the CRD's root: a Proxy's name must be a DNS-1123 label. Kubernetes already
/// holds every name to a DNS-1123 subdomain, so "no dots and at most 63 characters" is
/// exactly a label (and costs the API server less than a regular expression).
///
/// Checked on create only (`optionalOldSelf`: `oldSelf` has a value on updates): a name
/// cannot change, and a Proxy made before the rule must still be able to lose its
/// finalizer, which an update-time check would refuse forever.
pub const NAME_RULE: &str = "oldSelf.hasValue() || (size(self.metadata.name) <= 63 && \
                             !self.metadata.name.contains('.'))";
/// What the API server answers when [`NAME_RULE`] refuses a name.
pub const NAME_RULE_MESSAGE: &str = "metadata.name must be a DNS-1123 label (at most 63 \
     characters, no dots): it becomes the host name of the VM and its domain mark";

/// DNS-1123 label, as Kubernetes and the providers config spell it.
const DNS1123_LABEL: &str = "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$";
/// DNS-1123 subdomain (Secret names).
const DNS1123_SUBDOMAIN: &str =
    "^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$";
/// A Secret data key.
const SECRET_KEY: &str = "^[-._a-zA-Z0-9]+$";

/// Where the cloud-init user-data comes from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct UserDataSource {
    /// A key of a Secret in the Proxy's namespace.
    pub secret_ref: SecretKeyRef,
}

/// A key of a Secret in the same namespace.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SecretKeyRef {
    /// Secret name.
    #[schemars(regex(pattern = DNS1123_SUBDOMAIN), length(min = 1, max = 253))]
    pub name: String,
    /// Key within the Secret.
    #[schemars(regex(pattern = SECRET_KEY), length(min = 1, max = 253))]
    pub key: String,
}

/// Per-Proxy plugin settings. Free-form objects in the schema: the plugin's own settings
/// schema is what checks them, at reconcile time.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TemplateSettingsOverrides {
    /// Merged over `templates.domain.settings`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "free_form_object")]
    pub domain: Option<serde_json::Map<String, serde_json::Value>>,
    /// Merged over `templates.vendorData.settings`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "free_form_object")]
    pub vendor_data: Option<serde_json::Map<String, serde_json::Value>>,
}

/// A map of JSON values, bounded. A map (`additionalProperties`), not an object with
/// `x-kubernetes-preserve-unknown-fields`: the API server's CEL equality skips the keys of
/// such an object that the other side lacks, so `self == oldSelf` let `{a: 1}` become
/// `{b: 1}`. As a map, every key is looked up on both sides and the values (preserved,
/// untyped) compare deeply; `null` values are kept (nullable), so a key set to null and a
/// missing key differ too.
///
/// Bounded at admission (issue 35, item 4): every Proxy sits in three watch caches of the
/// operator, and the 64 KiB cap on the merged settings applies only at reconcile time, so
/// without a bound a tenant could fill the operator's memory with a few hundred Proxies of
/// the API server's 3 MiB request limit. At most [`MAX_SETTINGS`] keys; a value is a scalar
/// (a string of at most [`MAX_SETTING_STRING`] characters) or a list or map of at most
/// [`MAX_SETTING_ITEMS`] scalars (strings of at most [`MAX_SETTING_INNER_STRING`]): about
/// 135 KiB per field at worst. The value validations hold on untyped nodes for whichever
/// type the value has; `maxItems`/`maxProperties` 0 one level down keep inner values
/// scalar. Key lengths cannot be bounded in a structural schema (and a CEL rule over these
/// untyped values does not compile), so `config/admission/template_settings.yaml` bounds
/// them.
fn free_form_object(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    let inner = serde_json::json!({
        "nullable": true,
        "x-kubernetes-preserve-unknown-fields": true,
        "maxLength": MAX_SETTING_INNER_STRING,
        "maxItems": 0,
        "maxProperties": 0
    });
    schemars::json_schema!({
        "type": "object",
        "nullable": true,
        "maxProperties": MAX_SETTINGS,
        "additionalProperties": {
            "nullable": true,
            "x-kubernetes-preserve-unknown-fields": true,
            "maxLength": MAX_SETTING_STRING,
            "maxItems": MAX_SETTING_ITEMS,
            "maxProperties": MAX_SETTING_ITEMS,
            "items": inner,
            "additionalProperties": inner
        }
    })
}

/// Most keys in `spec.templateSettings.domain` or `.vendorData`.
pub const MAX_SETTINGS: usize = 16;
/// Longest string value of a setting.
pub const MAX_SETTING_STRING: usize = 4096;
/// Most entries of a list or map value of a setting.
pub const MAX_SETTING_ITEMS: usize = 32;
/// Longest string inside a list or map value of a setting.
pub const MAX_SETTING_INNER_STRING: usize = 128;

/// Paths (under `prefix`) set in `raw` but missing from `known`, `raw`'s round trip through
/// our types: the fields our types dropped because they do not know them. `null` counts as
/// unset; free-form maps round-trip whole.
pub fn unknown_fields(
    prefix: &str,
    raw: &serde_json::Value,
    known: &serde_json::Value,
) -> Vec<String> {
    let mut out = Vec::new();
    collect_unknown(prefix, raw, known, &mut out);
    out
}

fn collect_unknown(
    path: &str,
    raw: &serde_json::Value,
    known: &serde_json::Value,
    out: &mut Vec<String>,
) {
    let (serde_json::Value::Object(raw), serde_json::Value::Object(known)) = (raw, known) else {
        return;
    };
    for (k, v) in raw {
        if v.is_null() {
            continue;
        }
        let p = format!("{path}.{k}");
        match known.get(k) {
            None => out.push(p),
            Some(kv) => collect_unknown(&p, v, kv, out),
        }
    }
}

/// Where a Proxy is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum ProxyPhase {
    /// Accepted; no instance yet.
    Pending,
    /// An instance is being created (or replaced).
    Provisioning,
    /// The instance runs.
    Running,
    /// The instance exists but is not running (paused, shutting down, ...).
    Degraded,
    /// The Proxy cannot be served until it or the config changes (a permanent error).
    Failed,
    /// The finalizer is deleting the instance.
    Deleting,
}

/// What the controller last saw. Written with server-side apply by the controller only.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ProxyStatus {
    /// Summary of the conditions, for people. A phase this binary does not know (written
    /// by a newer one) reads as none rather than making the whole Proxy undecodable.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "lenient_phase"
    )]
    pub phase: Option<ProxyPhase>,
    /// Host the instance runs on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    /// Provider instance ID (`HOST/NAME`): how the controller finds the instance again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance_id: Option<String>,
    /// Run state the provider reported (`running`, `paused`, ...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance_state: Option<String>,
    /// The guest's first address (IPv4 first); what consumers connect to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub address: Option<String>,
    /// Where `address` came from: `static` (allocated by the operator from the host's
    /// address pool), `lease` (libvirt's DHCP lease), `agent` (the guest agent) or `arp`
    /// (the host's neighbour table).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub address_source: Option<String>,
    /// Every address the provider found, best first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub addresses: Vec<String>,
    /// `Provisioned` (an instance exists), `Serving` (its proxy answered the last probe: an
    /// HTTP CONNECT to its proxy port; the reason says how it failed, e.g. `SeedNotRead`
    /// when the guest never read its cloud-init seed) and `Ready` (it runs, has an address
    /// and serves). `phase` is about the VM only.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
    /// `metadata.generation` this status was computed from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Class of the last error (`transient`, `permanent`, `notFound`, `quota`); cleared on
    /// success.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error_class: Option<String>,
    /// What the instance was made from (see the `UpToDate` condition for how that compares
    /// with what is configured now).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revision: Option<ProxyRevision>,
}

/// The revision a Proxy's instance was made from: a digest per input, so a change can be
/// named ("domainPlugin, image"), and the digest of them all.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ProxyRevision {
    /// The digest of all parts.
    pub hash: String,
    /// Input name (`image`, `domainPlugin`, `vendorDataPlugin`, `machineType`, `userData`,
    /// `hostPolicy`) → a short sha256 of that input.
    #[serde(default)]
    pub parts: std::collections::BTreeMap<String, String>,
    /// True when the revision was first recorded on an instance made before revisions were
    /// kept: it is what was configured when the operator first saw it, not necessarily what
    /// it was made from. Such a Proxy is never rolled on that account.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub adopted: Option<bool>,
}

fn lenient_phase<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<ProxyPhase>, D::Error> {
    let v = Option::<serde_json::Value>::deserialize(d)?;
    Ok(v.and_then(|v| serde_json::from_value(v).ok()))
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
        if let Some(ts) = &self.template_settings {
            let t = &config.kvm2.templates;
            check_overrides("domain", ts.domain.as_ref(), &t.domain, p);
            check_overrides("vendorData", ts.vendor_data.as_ref(), &t.vendor_data, p);
        }
    }
}

/// `spec.templateSettings.<field>` of a Proxy, or its entry `key`. A key that is not a
/// plain identifier is quoted, so hostile keys cannot forge a path.
pub fn override_path(field: &str, key: Option<&str>) -> String {
    match key {
        None => format!("spec.templateSettings.{field}"),
        Some(k) if config::validate::settings_key(k).is_ok() => {
            format!("spec.templateSettings.{field}.{k}")
        }
        Some(k) => format!("spec.templateSettings.{field}[{}]", rules::show(k)),
    }
}

/// Refuses override keys that `kvm2.templates.<field>.overridableSettings` does not list,
/// and an override document larger than a settings document may be. Values are checked
/// against the plugin's schema when the provider renders.
fn check_overrides(
    field: &str,
    overrides: Option<&serde_json::Map<String, serde_json::Value>>,
    template: &config::TemplateConfig,
    p: &mut Problems,
) {
    let Some(overrides) = overrides else {
        return;
    };
    let allowed = &template.overridable_settings;
    let listed = || {
        if allowed.is_empty() {
            "lists nothing, so no Proxy may override these settings".to_string()
        } else {
            let names: Vec<String> = allowed.iter().map(|k| rules::show(k)).collect();
            format!("lists only {}", names.join(", "))
        }
    };
    for key in overrides.keys() {
        if !allowed.iter().any(|a| a == key) {
            p.push(
                override_path(field, Some(key)),
                format!(
                    "is not overridable: kvm2.templates.{field}.overridableSettings {}",
                    listed()
                ),
            );
        }
    }
    let size = serde_json::to_vec(overrides)
        .map(|v| v.len())
        .unwrap_or(usize::MAX);
    let max = config::validate::limits::TEMPLATE_SETTINGS_BYTES;
    if size > max {
        p.push(
            override_path(field, None),
            format!("is {size} bytes serialised, at most {max} allowed"),
        );
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
    let raw: serde_json::Value = config::parse_yaml(&text, &source)?;
    let mut problems = manifest.check(config);
    let known = serde_json::to_value(&manifest.spec).unwrap_or_default();
    for field in unknown_fields("spec", &raw["spec"], &known) {
        problems.push(field, "is not a known field");
    }
    let problems = problems.into_vec();
    if problems.is_empty() {
        Ok(manifest)
    } else {
        Err(ConfigError::Invalid {
            document: source,
            problems,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::CustomResourceExt;
    use serde_json::json;

    #[test]
    fn a_spec_with_fields_of_a_newer_crd_still_decodes() {
        let p: Proxy = serde_json::from_value(json!({
            "apiVersion": API_VERSION, "kind": KIND,
            "metadata": {"name": "p"},
            "spec": {"provider": "kvm2", "dnsServers": ["192.0.2.1"],
                     "userData": {"secretRef": {"name": "s", "key": "k", "optional": true}}},
            "status": {"phase": "Draining"},
        }))
        .expect("unknown fields and an unknown phase must not fail the decode");
        assert_eq!(p.spec.provider, "kvm2");
        assert_eq!(p.status.unwrap().phase, None);
    }

    #[test]
    fn unknown_fields_are_named_with_their_path() {
        let raw = json!({"a": 1, "b": {"c": 2, "d": null}, "e": null, "f": {"g": 3}});
        let known = json!({"a": 1, "b": {}, "f": {"g": 3}});
        assert_eq!(unknown_fields("spec", &raw, &known), ["spec.b.c"]);
    }

    #[test]
    fn a_manifest_file_with_an_unknown_field_is_refused_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let config = crate::config::parse(
            r#"
clusterId: test
kvm2:
  ssh: {user: egress, privateKeyFile: /k/id, knownHostsFile: /k/known_hosts}
  hosts:
    - {name: h1, address: "127.0.0.1:2222", storagePool: default, bridge: br0}
  images:
    - name: debian
      url: https://images.example.org/debian.qcow2
      sha256: "0000000000000000000000000000000000000000000000000000000000000000"
      format: qcow2
  machineTypes:
    - {name: small, vcpus: 1, memoryMiB: 512, diskGiB: 4}
  defaults: {machineType: small, image: debian}
  templates:
    domain: {path: /p/domain.wasm}
    vendorData: {path: /p/vendor-data.wasm}
"#,
            "test.yaml",
            Path::new("/"),
        )
        .unwrap();
        let proxy = dir.path().join("proxy.yaml");
        std::fs::write(
            &proxy,
            "apiVersion: egress-operator.dev/v1alpha1\nkind: Proxy\nmetadata: {name: p}\n\
             spec: {provider: kvm2, imgae: debian}\n",
        )
        .unwrap();
        let err = load_manifest(&proxy, &config).unwrap_err().to_string();
        assert!(err.contains("spec.imgae"), "{err}");
    }

    #[test]
    fn the_crd_holds_the_name_rule_and_template_settings_are_maps() {
        let crd = serde_json::to_value(Proxy::crd()).unwrap();
        let schema = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"];
        assert_eq!(
            schema["x-kubernetes-validations"],
            json!([{"rule": NAME_RULE, "message": NAME_RULE_MESSAGE, "optionalOldSelf": true}])
        );
        for field in ["domain", "vendorData"] {
            let s = &schema["properties"]["spec"]["properties"]["templateSettings"]["properties"]
                [field];
            let value = &s["additionalProperties"];
            assert_eq!(value["nullable"], json!(true), "{field}: {s}");
            assert_eq!(
                value["x-kubernetes-preserve-unknown-fields"],
                json!(true),
                "{field}: {s}"
            );
            assert_eq!(s["maxProperties"], json!(MAX_SETTINGS), "{field}: {s}");
            assert_eq!(
                value["maxLength"],
                json!(MAX_SETTING_STRING),
                "{field}: {s}"
            );
            for inner in ["items", "additionalProperties"] {
                assert_eq!(value[inner]["maxItems"], json!(0), "{field}.{inner}: {s}");
                assert_eq!(
                    value[inner]["maxProperties"],
                    json!(0),
                    "{field}.{inner}: {s}"
                );
            }
            assert!(
                s.get("x-kubernetes-preserve-unknown-fields").is_none(),
                "{s}"
            );
        }
    }
}
