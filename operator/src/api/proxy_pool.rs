//! The `ProxyPool` resource: N Proxies from one template, spread over hosts, replaced
//! surge-first and published through a Service and EndpointSlices.
//!
//! The pool owns its Proxies (owner references, names `<pool>-<suffix>`, the label
//! [`POOL_LABEL`]). A Proxy's spec is immutable, so a template change rolls the pool onto
//! new Proxies; [`ProxyTemplate::hash`] tells a Proxy made from the current template from
//! an older one. The fleet controllers (`crate::fleet`) reconcile it; they never call a
//! provider.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::proxy::{ProxySpec, TemplateSettingsOverrides, UserDataSource};

/// Label on every Proxy of a pool: the pool's name. What the pool lists its Proxies by,
/// and the scale subresource's selector.
pub const POOL_LABEL: &str = "egress-operator.dev/pool";
/// Label on every Proxy of a pool: [`ProxyTemplate::hash`] of the template it was made
/// from.
pub const TEMPLATE_HASH_LABEL: &str = "egress-operator.dev/template-hash";
/// Label the leasing controller sets on a Proxy it binds (the lease's UID). The pool
/// never scales in, drains or rolls a Proxy that carries it: the lease recycles it.
pub const LEASE_LABEL: &str = "egress-operator.dev/lease-uid";
/// Annotation the pool sets on a Proxy it drains: the RFC 3339 time the drain began. The
/// Proxy is listed `terminating` until the pool's drain period ran out, then deleted.
pub const DRAINING_ANNOTATION: &str = "egress-operator.dev/draining-since";

/// What a pool asks for.
// Each printcolumn(...) repeats the same keys; clippy reads them as duplicates.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "egress-operator.dev",
    version = "v1alpha1",
    kind = "ProxyPool",
    plural = "proxypools",
    shortname = "egpp",
    category = "egress",
    namespaced,
    status = "ProxyPoolStatus",
    scale(
        spec_replicas_path = ".spec.replicas",
        status_replicas_path = ".status.replicas",
        label_selector_path = ".status.selector"
    ),
    doc = "A pool of egress proxy VMs made from one template, published as a Service.",
    printcolumn(name = "Desired", type_ = "integer", json_path = ".spec.replicas"),
    printcolumn(name = "Current", type_ = "integer", json_path = ".status.replicas"),
    printcolumn(name = "Ready", type_ = "integer", json_path = ".status.readyReplicas"),
    printcolumn(
        name = "Up-to-date",
        type_ = "integer",
        json_path = ".status.updatedReplicas"
    ),
    printcolumn(
        name = "Available",
        type_ = "integer",
        json_path = ".status.availableReplicas"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    ),
    validation = kube::core::Rule::new(POOL_NAME_RULE)
        .message(POOL_NAME_RULE_MESSAGE)
        .optional_old_self(true)
)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(extend("x-kubernetes-validations" = [{
    "rule": "self.maxSurge > 0 || self.maxUnavailable > 0",
    "message": "maxSurge and maxUnavailable cannot both be 0: a rollout could never start"
}]))]
pub struct ProxyPoolSpec {
    /// How many Proxies the pool keeps.
    #[serde(default = "default_replicas")]
    #[schemars(range(min = 0, max = 1000))]
    pub replicas: i32,
    /// What each Proxy is made from. A change rolls the pool onto new Proxies.
    pub template: ProxyTemplate,
    /// The hosts the pool may place Proxies on; every configured host when left out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 256))]
    pub hosts: Option<Vec<HostName>>,
    /// How many Proxies a rollout or replacement may create above `replicas`.
    #[serde(default = "default_max_surge")]
    #[schemars(range(min = 0, max = 100))]
    pub max_surge: i32,
    /// How many Proxies below `replicas` may serve during a rollout.
    #[serde(default)]
    #[schemars(range(min = 0, max = 100))]
    pub max_unavailable: i32,
    /// How long a Proxy that leaves the pool stays listed `terminating` (so clients stop
    /// opening connections through it) before it is deleted.
    #[serde(default = "default_drain_seconds")]
    #[schemars(range(min = 0, max = 3600))]
    pub drain_seconds: u32,
    /// How a proxy a `ProxyLease` released goes back to the pool: `Replace` (drained and
    /// replaced by a fresh VM, so nothing passes to the next holder) or `Reuse`.
    #[serde(default)]
    pub lease_recycle: super::proxy_lease::RecyclePolicy,
    /// How many proxies the pool may add above `replicas` for `ProxyLease`s that wait
    /// because every serving proxy is leased (0: none; leases wait for a proxy to free up
    /// or for a scale-out).
    #[serde(default)]
    #[schemars(range(min = 0, max = 100))]
    pub lease_surge: i32,
    /// How long a new Proxy of the current template and config may take to serve. One
    /// that has not served by then counts as failed: the pool backs off its creates and
    /// its rollout halts (`Progressing=False`, reason `RolloutStalled`) instead of
    /// replacing it over and over. 0: no deadline.
    #[serde(default = "default_progress_deadline_seconds")]
    #[schemars(range(min = 0, max = 86400))]
    pub progress_deadline_seconds: u32,
}

/// CEL rule at the CRD's root, on create only (as the Proxy's name rule): a pool's name
/// names its Service (a DNS-1035 label: a letter first, no dots) and, with a 6-character
/// `-xxxxx` suffix, each of its Proxies (at most 63 characters). A name the API server would
/// refuse for those is refused here, before the pool exists.
pub const POOL_NAME_RULE: &str = "oldSelf.hasValue() || (size(self.metadata.name) <= 57 && \
                                  self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$'))";
/// What the API server answers when [`POOL_NAME_RULE`] refuses a name.
pub const POOL_NAME_RULE_MESSAGE: &str = "metadata.name must be a DNS-1035 label of at most 57 \
     characters (a letter first, then letters, digits and '-'): it names the pool's Service, and \
     its Proxies add a 6-character suffix";

/// A host name (a DNS-1123 label, as the providers config spells it).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize, JsonSchema)]
#[serde(transparent)]
pub struct HostName(
    #[schemars(regex(pattern = "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"), length(max = 63))] pub String,
);

fn default_replicas() -> i32 {
    1
}
fn default_max_surge() -> i32 {
    1
}
fn default_drain_seconds() -> u32 {
    10
}
/// As a Deployment's: a VM boot and its proxy's first answer take well under it.
fn default_progress_deadline_seconds() -> u32 {
    600
}

/// The Proxy spec a pool's Proxies get, apart from `host` (the pool places them).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ProxyTemplate {
    /// Provider that runs the VMs; `kvm2`.
    #[schemars(extend("enum" = ["kvm2"]))]
    pub provider: String,
    /// Machine type name from the providers config; its default when left out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"), length(max = 63))]
    pub machine_type: Option<String>,
    /// Image name from the providers config; its default when left out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"), length(max = 63))]
    pub image: Option<String>,
    /// cloud-init user-data, read from a Secret in the pool's namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user_data: Option<UserDataSource>,
    /// Plugin settings for the pool's Proxies, as a Proxy's `templateSettings`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub template_settings: Option<TemplateSettingsOverrides>,
}

impl ProxyTemplate {
    /// The Proxy spec for a Proxy of this template pinned to `host`.
    pub fn proxy_spec(&self, host: Option<String>) -> ProxySpec {
        ProxySpec {
            provider: self.provider.clone(),
            machine_type: self.machine_type.clone(),
            image: self.image.clone(),
            host,
            user_data: self.user_data.clone(),
            template_settings: self.template_settings.clone(),
            // The pool rolls its members itself, surge-first.
            update_policy: None,
        }
    }

    /// A short, stable digest of the template (10 hex digits of the SHA-256 of its JSON):
    /// equal templates give equal hashes, so it is a label value that tells current
    /// Proxies from outdated ones.
    pub fn hash(&self) -> String {
        // serde_json writes struct fields in declaration order and maps sorted (no
        // preserve_order feature), so equal templates serialise to equal bytes.
        let json = serde_json::to_vec(self).unwrap_or_default();
        let digest = Sha256::digest(&json);
        hex::encode(&digest[..5])
    }
}

/// What the pool controller and discovery last saw.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ProxyPoolStatus {
    /// Proxies the pool has (draining ones included).
    #[serde(default)]
    pub replicas: i32,
    /// Proxies whose `Ready` condition is True.
    #[serde(default)]
    pub ready_replicas: i32,
    /// Proxies made from the current template (draining ones excluded).
    #[serde(default)]
    pub updated_replicas: i32,
    /// Proxies serving now (listed ready in the EndpointSlices).
    #[serde(default)]
    pub available_replicas: i32,
    /// The label selector of the pool's Proxies, for the scale subresource.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<String>,
    /// Proxies per host.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["host"]))]
    pub hosts: Vec<HostCount>,
    /// `metadata.generation` the counts were computed from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `Available` (at least `replicas - maxUnavailable` serve), `Progressing` (a rollout
    /// or scale is under way), `Degraded` (e.g. `InsufficientHosts`), and discovery's
    /// `EndpointsHeld` (every proxy failed the fast probe at once: the operator's own
    /// path is suspect, so the last known endpoints are kept).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
    /// What the EndpointSlices list, for clients that do not use kube-proxy.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "atomic"))]
    pub endpoints: Vec<PoolEndpoint>,
}

/// How many of the pool's Proxies a host carries.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct HostCount {
    /// Host name.
    pub host: String,
    /// Proxies of this pool on it.
    pub replicas: i32,
}

/// One listed proxy.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PoolEndpoint {
    /// The Proxy's name.
    pub proxy: String,
    /// Its address.
    pub address: String,
    /// Its proxy port.
    pub port: i32,
    /// Host it runs on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    /// Whether it takes new connections (it serves and is not draining).
    pub ready: bool,
    /// Whether it is draining (leaving the pool).
    pub terminating: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hash_follows_the_template_only() {
        let a = ProxyTemplate {
            provider: "kvm2".into(),
            image: Some("debian-12".into()),
            ..Default::default()
        };
        let mut b = a.clone();
        assert_eq!(a.hash(), b.hash());
        assert_eq!(a.hash().len(), 10);
        b.image = Some("debian-13".into());
        assert_ne!(a.hash(), b.hash());
    }

    #[test]
    fn defaults_fill_in_when_left_out() {
        let spec: ProxyPoolSpec =
            serde_json::from_str(r#"{"template":{"provider":"kvm2"}}"#).unwrap();
        assert_eq!(spec.replicas, 1);
        assert_eq!(spec.max_surge, 1);
        assert_eq!(spec.max_unavailable, 0);
        assert_eq!(spec.drain_seconds, 10);
        assert_eq!(spec.progress_deadline_seconds, 600);
    }
}
