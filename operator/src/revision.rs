//! What a Proxy is made from, as a revision: one short digest per input, kept by name.
//!
//! A fleet lives for months while its inputs change under it: a plugin rebuilt for a
//! security fix, a new base image, a machine type given more memory. The revision is what
//! lets the operator tell which proxies were made from what is configured now, and say
//! *which* input changed ("domainPlugin, image"), not just that something did. So it is
//! kept as parts, each the digest of one input, and the whole is the digest of the parts.
//!
//! Parts ([`PARTS`]):
//! - `image`: the base image's URL, sha256 and format;
//! - `domainPlugin`, `vendorDataPlugin`: the plugin's sha256 and its effective settings
//!   (the configured ones with the Proxy's overrides merged over them);
//! - `machineType`: its values (vCPUs, memory, disk, firmware), not its name;
//! - `userData`: a digest of the user-data read at Create (never the content);
//! - `hostPolicy`: what of the host shapes the render (driver, pool, bridge, MTU, CPU
//!   placement, NVRAM templates, KVM, addressing mode); not how it is reached.
//!
//! The user-data part is recorded at Create and carried over by later checks: the operator
//! does not watch Secrets (it would have to read every Secret in the cluster), so a changed
//! Secret is seen only by the next Create.

use std::collections::BTreeMap;

use sha2::{Digest, Sha256};

use crate::api::proxy::{ProxyRevision, ProxySpec};
use crate::config::{HostConfig, ValidConfig};

/// The parts of a revision, in the order they are shown.
pub const PARTS: [&str; 6] = [
    IMAGE,
    DOMAIN_PLUGIN,
    VENDOR_DATA_PLUGIN,
    MACHINE_TYPE,
    USER_DATA,
    HOST_POLICY,
];
/// The base image part.
pub const IMAGE: &str = "image";
/// The domain plugin part.
pub const DOMAIN_PLUGIN: &str = "domainPlugin";
/// The vendor-data plugin part.
pub const VENDOR_DATA_PLUGIN: &str = "vendorDataPlugin";
/// The machine type part.
pub const MACHINE_TYPE: &str = "machineType";
/// The user-data part.
pub const USER_DATA: &str = "userData";
/// The host policy part.
pub const HOST_POLICY: &str = "hostPolicy";

/// Hex digits kept of each digest: 64 bits tell revisions apart, and a status stays short.
const DIGEST_HEX: usize = 16;

/// The host fields that shape a render (by their config names). The rest say how the host
/// is reached or how full it may get, and changing them must not roll a fleet.
const HOST_POLICY_FIELDS: [&str; 7] = [
    "driver",
    "storagePool",
    "bridge",
    "bridgeMtu",
    "cpuPlacement",
    "nvramTemplates",
    "disableKvm",
];

/// A revision: a digest per part.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Revision {
    /// Part name → digest.
    pub parts: BTreeMap<String, String>,
}

/// What user-data a revision is computed with.
#[derive(Debug, Clone, Copy)]
pub enum UserData<'a> {
    /// The bytes read for a Create (`None`: the Proxy has none).
    Read(Option<&'a [u8]>),
    /// The part as recorded in status (a check after the Create: Secrets are not read).
    Recorded(Option<&'a str>),
}

/// The loaded plugins' digests, which the config alone does not know for a `path` plugin
/// without a pinned sha256.
#[derive(Debug, Clone, Copy)]
pub struct PluginDigests<'a> {
    /// sha256 of the domain plugin's component.
    pub domain: &'a str,
    /// sha256 of the vendor-data plugin's component.
    pub vendor_data: &'a str,
}

impl Revision {
    /// The revision of a Proxy with `spec` placed on `host` (`None`: not placed yet, and
    /// no `hostPolicy` part), under `config` with the plugins of `digests`. Fails (naming the field) only for a spec the config cannot
    /// make, which the controller refuses before it gets here.
    pub fn of(
        config: &ValidConfig,
        digests: PluginDigests<'_>,
        spec: &ProxySpec,
        host: Option<&str>,
        user_data: UserData<'_>,
    ) -> Result<Self, String> {
        let defaults = config.kvm2.defaults.as_ref();
        let image_name = spec
            .image
            .as_deref()
            .or(defaults.and_then(|d| d.image.as_deref()))
            .ok_or("spec.image: not set and the config has no default")?;
        let image = config
            .image(image_name)
            .ok_or_else(|| format!("spec.image: {image_name:?} is not in the config"))?;
        let mt_name = spec
            .machine_type
            .as_deref()
            .or(defaults.and_then(|d| d.machine_type.as_deref()))
            .ok_or("spec.machineType: not set and the config has no default")?;
        let mt = config
            .machine_type(mt_name)
            .ok_or_else(|| format!("spec.machineType: {mt_name:?} is not in the config"))?;
        let host_config = match host {
            Some(h) => Some(
                config
                    .host(h)
                    .ok_or_else(|| format!("host {h:?} is not in the config"))?,
            ),
            None => None,
        };
        let overrides = spec.template_settings.as_ref();
        let templates = &config.kvm2.templates;

        let mut parts = BTreeMap::new();
        parts.insert(
            IMAGE.to_string(),
            digest_of(&serde_json::json!({
                "url": image.url, "sha256": image.sha256, "format": image.format,
            })),
        );
        parts.insert(
            DOMAIN_PLUGIN.to_string(),
            plugin_part(
                digests.domain,
                &templates.domain.settings,
                overrides.and_then(|o| o.domain.as_ref()),
            ),
        );
        parts.insert(
            VENDOR_DATA_PLUGIN.to_string(),
            plugin_part(
                digests.vendor_data,
                &templates.vendor_data.settings,
                overrides.and_then(|o| o.vendor_data.as_ref()),
            ),
        );
        parts.insert(
            MACHINE_TYPE.to_string(),
            digest_of(&serde_json::json!({
                "vcpus": mt.vcpus, "memoryMiB": mt.memory_mib, "diskGiB": mt.disk_gib,
                "firmware": mt.firmware,
            })),
        );
        let user_data = match user_data {
            UserData::Read(None) => Some(digest_bytes(b"none")),
            UserData::Read(Some(bytes)) => {
                let mut h = Sha256::new();
                h.update(b"bytes:");
                h.update(bytes);
                Some(short(&h.finalize()))
            }
            UserData::Recorded(part) => part.map(str::to_string),
        };
        if let Some(u) = user_data {
            parts.insert(USER_DATA.to_string(), u);
        }
        if let Some(h) = host_config {
            parts.insert(HOST_POLICY.to_string(), host_policy(h));
        }
        Ok(Self { parts })
    }

    /// This revision with the `hostPolicy` part of `other` (taken once placement chose
    /// the host).
    pub fn with_host_part(mut self, other: &Revision) -> Self {
        if let Some(h) = other.parts.get(HOST_POLICY) {
            self.parts.insert(HOST_POLICY.to_string(), h.clone());
        }
        self
    }

    /// The digest of the whole: of every part, by name.
    pub fn hash(&self) -> String {
        let mut h = Sha256::new();
        for (k, v) in &self.parts {
            h.update(k.as_bytes());
            h.update(b"=");
            h.update(v.as_bytes());
            h.update(b"\n");
        }
        short(&h.finalize())
    }

    /// The parts in which `recorded` differs from this revision, in [`PARTS`] order; a part
    /// only one side has counts as changed, except `userData`, which a revision computed
    /// after the Create carries over (see the module docs).
    pub fn changed_from(&self, recorded: &ProxyRevision) -> Vec<&'static str> {
        PARTS
            .iter()
            .copied()
            .filter(|p| self.parts.get(*p) != recorded.parts.get(*p))
            .filter(|p| *p != USER_DATA || self.parts.contains_key(*p))
            .collect()
    }

    /// The status record of this revision; `adopted` for one first recorded on a Proxy
    /// made before revisions were kept (what it was made from is not known).
    pub fn to_status(&self, adopted: bool) -> ProxyRevision {
        ProxyRevision {
            hash: self.hash(),
            parts: self.parts.clone(),
            adopted: adopted.then_some(true),
        }
    }
}

/// What `provider` would make now of `spec` on `host`, and the parts in which `recorded`
/// (the status record, if any) differs from it: the one comparison the Proxy controller's
/// `UpToDate`, its `updatePolicy: Replace` and the pool's rollout all make. The user-data
/// part is carried over from the record (Secrets are not read again). `None` when the
/// provider cannot tell (it keeps no revisions, a plugin still loads, the config cannot
/// make the spec).
pub fn compare(
    provider: &dyn crate::provider::Provider,
    spec: &ProxySpec,
    host: &str,
    recorded: Option<&ProxyRevision>,
) -> Option<(Revision, Vec<&'static str>)> {
    let user_data = recorded
        .and_then(|r| r.parts.get(USER_DATA))
        .map(String::as_str);
    let now = match provider.revision(spec, Some(host), UserData::Recorded(user_data))? {
        Ok(r) => r,
        Err(e) => {
            tracing::debug!(error = %e, "no revision for the Proxy's spec");
            return None;
        }
    };
    let changed = recorded.map(|r| now.changed_from(r)).unwrap_or_default();
    Some((now, changed))
}

fn plugin_part(
    digest: &str,
    configured: &serde_json::Value,
    overrides: Option<&serde_json::Map<String, serde_json::Value>>,
) -> String {
    // The merge the plugin host does: each override replaces its top-level key.
    let mut settings = configured.clone();
    if let (Some(obj), Some(o)) = (settings.as_object_mut(), overrides) {
        for (k, v) in o {
            obj.insert(k.clone(), v.clone());
        }
    }
    digest_of(&serde_json::json!({ "sha256": digest, "settings": settings }))
}

fn host_policy(host: &HostConfig) -> String {
    let whole = serde_json::to_value(host).unwrap_or_default();
    let mut picked = serde_json::Map::new();
    for field in HOST_POLICY_FIELDS {
        if let Some(v) = whole.get(field) {
            picked.insert(field.to_string(), v.clone());
        }
    }
    let addressing = if host.address_pool.is_some() {
        "static"
    } else {
        "dhcp"
    };
    picked.insert("addressing".into(), addressing.into());
    digest_of(&serde_json::Value::Object(picked))
}

/// The digest of a JSON value written canonically (keys sorted at every level), so the
/// same input gives the same digest whatever order a file listed its keys in.
fn digest_of(v: &serde_json::Value) -> String {
    let mut out = String::new();
    canonical(v, &mut out);
    digest_bytes(out.as_bytes())
}

fn canonical(v: &serde_json::Value, out: &mut String) {
    match v {
        serde_json::Value::Object(m) => {
            let mut keys: Vec<&String> = m.keys().collect();
            keys.sort();
            out.push('{');
            for (i, k) in keys.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&serde_json::Value::String(k.clone()).to_string());
                out.push(':');
                canonical(&m[k], out);
            }
            out.push('}');
        }
        serde_json::Value::Array(a) => {
            out.push('[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                canonical(x, out);
            }
            out.push(']');
        }
        other => out.push_str(&other.to_string()),
    }
}

fn digest_bytes(b: &[u8]) -> String {
    short(&Sha256::digest(b))
}

fn short(d: &[u8]) -> String {
    let mut s = hex::encode(d);
    s.truncate(DIGEST_HEX);
    s
}

#[cfg(test)]
mod tests;
