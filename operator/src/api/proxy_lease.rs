//! The `ProxyLease` resource: a workload's exclusive hold on proxies of a pool.
//!
//! A lease names a pool in its namespace, how many proxies it wants (`count`), for how
//! long (`durationSeconds`) and who holds it (`holder`). The lease controller
//! (`crate::fleet::lease`) binds serving, unleased proxies of the pool to it. Both sides
//! point at each other by UID: the lease's `status.proxies` lists each bound Proxy's UID,
//! and the Proxy carries the label [`LEASE_LABEL`] with the lease's UID (a label, so the
//! pool, discovery and the lease controller select and watch it cheaply).
//!
//! The holder renews by setting `spec.renewTime` to the current time; a lease not renewed
//! within `durationSeconds` (counted from the renewal, or from creation) expires for good.
//! Deleting the lease releases its proxies. A released proxy goes back to the pool only
//! after it is recycled as the pool's `leaseRecycle` says ([`RecyclePolicy`]).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

pub use super::proxy_pool::LEASE_LABEL;

/// Annotation on a bound Proxy: the lease's name (the label holds its UID). It lets a
/// change of the Proxy wake the lease that holds it, and tells people who holds it.
pub const LEASE_NAME_ANNOTATION: &str = "egress-operator.dev/lease-name";
/// Label on a lease's Service: the lease's name.
pub const LEASE_SERVICE_LABEL: &str = "egress-operator.dev/lease";
/// Finalizer of a lease: its proxies are released before it goes.
pub const LEASE_FINALIZER: &str = "egress-operator.dev/lease-release";

/// CEL rule at the CRD's root, on create only (as the Proxy's name rule): a lease's name
/// names its Service, a DNS-1035 label (a letter first, no dots), and its slices add
/// `-ipv4`/`-ipv6` (at most 58 characters, as discovery holds pool names).
pub const LEASE_NAME_RULE: &str = "oldSelf.hasValue() || (size(self.metadata.name) <= 58 && \
                                   self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$'))";
/// What the API server answers when [`LEASE_NAME_RULE`] refuses a name.
pub const LEASE_NAME_RULE_MESSAGE: &str = "metadata.name must be a DNS-1035 label of at most 58 \
     characters (a letter first, then letters, digits and '-'): it names the lease's Service \
     and, with -ipv4/-ipv6, its EndpointSlices";

/// What a workload asks for.
// Each printcolumn(...) repeats the same keys; clippy reads them as duplicates.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "egress-operator.dev",
    version = "v1alpha1",
    kind = "ProxyLease",
    plural = "proxyleases",
    shortname = "egpl",
    category = "egress",
    namespaced,
    status = "ProxyLeaseStatus",
    doc = "An exclusive, renewable hold on proxies of a ProxyPool in the same namespace.",
    printcolumn(name = "Pool", type_ = "string", json_path = ".spec.pool"),
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase"),
    printcolumn(name = "Addresses", type_ = "string", json_path = ".status.addresses"),
    printcolumn(name = "Expiry", type_ = "string", json_path = ".status.expiryTime"),
    printcolumn(name = "Holder", type_ = "string", json_path = ".spec.holder"),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    ),
    validation = kube::core::Rule::new(LEASE_NAME_RULE)
        .message(LEASE_NAME_RULE_MESSAGE)
        .optional_old_self(true)
)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": "self.pool == oldSelf.pool", "message": "pool is immutable: make a new lease"},
    {"rule": "self.count == oldSelf.count", "message": "count is immutable: make a new lease"}
]))]
pub struct ProxyLeaseSpec {
    /// The ProxyPool (same namespace) the proxies come from.
    #[schemars(
        regex(pattern = "^[a-z]([-a-z0-9]*[a-z0-9])?$"),
        length(min = 1, max = 58)
    )]
    pub pool: String,
    /// How many proxies the lease holds.
    #[serde(default = "default_count")]
    #[schemars(range(min = 1, max = 16))]
    pub count: i32,
    /// How long the lease lasts after its creation or its last renewal.
    #[schemars(range(min = 1, max = 2_592_000))]
    pub duration_seconds: u32,
    /// Who holds the lease (a workload's identity, for people and audit).
    #[schemars(length(min = 1, max = 253))]
    pub holder: String,
    /// The holder's last renewal: set it to the current time (RFC 3339) to extend the
    /// lease by `durationSeconds` from then. A time in the future counts as the time the
    /// controller saw it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub renew_time: Option<Time>,
    /// How long a bound proxy may not serve before the lease gives it up (`Lost`) and
    /// rebinds to a serving spare.
    #[serde(default = "default_rebind_after")]
    #[schemars(range(min = 0, max = 3600))]
    pub rebind_after_seconds: u32,
    /// Whether the lease gets a Service of its own (named after the lease, no selector,
    /// an EndpointSlice listing the bound proxies), so the workload survives a rebind.
    #[serde(default = "default_service")]
    pub service: bool,
    /// Whether a bound proxy made from inputs that changed since (its `UpToDate` condition
    /// is False: a new plugin, image or setting) is swapped for an up-to-date one while the
    /// lease holds it. Off (the default), the lease keeps what it holds and its proxies are
    /// replaced once released. On, the lease takes a free, serving, up-to-date proxy of the
    /// pool first and only then gives the old one back: for a moment it holds one more
    /// than `count` (its Service lists both), never fewer. The swap waits until the pool
    /// has such a proxy; the address changes.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub replace_out_of_date: bool,
}

fn default_count() -> i32 {
    1
}
fn default_rebind_after() -> u32 {
    30
}
fn default_service() -> bool {
    true
}

/// How a proxy a lease released goes back to its pool (the pool's `leaseRecycle`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum RecyclePolicy {
    /// The proxy is drained and deleted, and the pool makes a fresh one in its place: no
    /// state (connections, caches, the guest's disk) passes to the next holder.
    #[default]
    Replace,
    /// The proxy's lease label is cleared and it serves the pool again as it is.
    Reuse,
}

/// Where a lease stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum LeasePhase {
    /// Not all of `count` proxies are bound yet (the `Bound` condition says why).
    Pending,
    /// `count` proxies are bound: each one's label names this lease and this lease lists
    /// each one's UID.
    Bound,
    /// A bound proxy stopped serving for `rebindAfterSeconds` and was given up; the lease
    /// rebinds to a serving spare when the pool has one.
    Lost,
    /// Not renewed in time: the proxies were released. Final; make a new lease.
    Expired,
}

impl LeasePhase {
    /// The phase as written.
    pub fn as_str(self) -> &'static str {
        match self {
            LeasePhase::Pending => "Pending",
            LeasePhase::Bound => "Bound",
            LeasePhase::Lost => "Lost",
            LeasePhase::Expired => "Expired",
        }
    }
}

/// A proxy bound to the lease.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct BoundProxy {
    /// The Proxy's name.
    pub name: String,
    /// The Proxy's UID (its lease label holds this lease's UID).
    pub uid: String,
    /// Its address.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub address: Option<String>,
    /// Its proxy port.
    pub port: i32,
    /// Since when it does not serve (the loss timer); absent while it serves.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub not_serving_since: Option<Time>,
}

/// A proxy the lease chose and is taking: recorded here before the guarded write that
/// labels the Proxy, so a crash between the two leaves a trace the next reconcile
/// finishes or undoes. A claim is not a binding.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ProxyClaim {
    /// The Proxy's name.
    pub name: String,
    /// The Proxy's UID.
    pub uid: String,
}

/// What the lease controller last saw and did.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ProxyLeaseStatus {
    /// `Pending`, `Bound`, `Lost` or `Expired`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<LeasePhase>,
    /// The bound proxies (both sides agree).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "atomic"))]
    pub proxies: Vec<BoundProxy>,
    /// Proxies being taken (not bound yet).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "atomic"))]
    pub claims: Vec<ProxyClaim>,
    /// The bound proxies' addresses, comma-separated (for `kubectl get`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub addresses: Option<String>,
    /// When the lease expires unless renewed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expiry_time: Option<Time>,
    /// The `spec.renewTime` `expiryTime` was computed from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_renew_time: Option<Time>,
    /// How many times a lost proxy was replaced by a spare.
    #[serde(default)]
    pub rebinds: i32,
    /// `Bound` (True when `count` proxies are bound; the reason says why not: `NoFreeProxy`,
    /// `PoolNotFound`, `ProxyLost`, `Binding`, `Expired`) and `ServiceReady` (the lease's
    /// Service; `ServiceConflict` when another object owns that name).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
    /// `metadata.generation` this status was computed from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_fill_in_when_left_out() {
        let spec: ProxyLeaseSpec =
            serde_json::from_str(r#"{"pool":"office","durationSeconds":60,"holder":"crawler"}"#)
                .unwrap();
        assert_eq!(spec.count, 1);
        assert_eq!(spec.rebind_after_seconds, 30);
        assert!(spec.service);
        assert!(spec.renew_time.is_none());
    }

    #[test]
    fn the_sample_reads() {
        let text = include_str!("../../../config/samples/proxylease.yaml");
        let lease: ProxyLease = serde_yaml_ng::from_str(text).unwrap();
        assert_eq!(lease.spec.pool, "office-pool");
        assert_eq!(lease.spec.duration_seconds, 300);
    }

    #[test]
    fn unknown_fields_are_refused() {
        let r: Result<ProxyLeaseSpec, _> = serde_json::from_str(
            r#"{"pool":"office","durationSeconds":60,"holder":"c","renew":"x"}"#,
        );
        assert!(r.is_err());
    }
}
