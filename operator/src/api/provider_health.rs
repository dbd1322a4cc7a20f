//! The `ProviderHealth` resource: what the health monitor last saw of each target of one
//! provider. Cluster-scoped, one object per provider, named after it; written only by the
//! operator, read by people (`kubectl get providerhealths`) and alerting.

use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Which provider this object reports on. Its name is the provider's name too; the spec
/// repeats it so a listing shows it without parsing names.
// Each printcolumn(...) repeats the same keys; clippy reads them as duplicates.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "egress-operator.dev",
    version = "v1alpha1",
    kind = "ProviderHealth",
    plural = "providerhealths",
    shortname = "eph",
    category = "egress",
    status = "ProviderHealthStatus",
    doc = "Health of one provider's targets (hosts), written by the egress operator.",
    printcolumn(name = "Provider", type_ = "string", json_path = ".spec.provider"),
    printcolumn(
        name = "Healthy",
        type_ = "integer",
        json_path = ".status.healthyTargets"
    ),
    printcolumn(
        name = "Targets",
        type_ = "integer",
        json_path = ".status.totalTargets"
    ),
    printcolumn(name = "Checked", type_ = "date", json_path = ".status.lastChecked")
)]
#[serde(rename_all = "camelCase")]
pub struct ProviderHealthSpec {
    /// Provider name (`kvm2`).
    pub provider: String,
}

/// The last round of checks.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ProviderHealthStatus {
    /// One entry per target, in config order.
    #[serde(default)]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"]))]
    pub targets: Vec<TargetHealthStatus>,
    /// How many targets are reachable.
    pub healthy_targets: i32,
    /// How many targets there are.
    pub total_targets: i32,
    /// When the round finished (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_checked: Option<String>,
    /// The provider's template plugins (kvm2: `domain` and `vendorData`), as of the
    /// round. A plugin that is not `Loaded` leaves the operator running and ready, but
    /// Creates that need it fail until it is.
    #[serde(default)]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["kind"]))]
    pub plugins: Vec<PluginHealthStatus>,
}

/// Where a template plugin stands.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum PluginState {
    /// Not loaded yet; loading is retried in the background (e.g. its URL does not answer
    /// yet). Creates that need it fail transiently and are retried.
    #[default]
    Loading,
    /// Loaded and usable.
    Loaded,
    /// Failed for good (bad settings, sha256 mismatch, a forbidden import, a missing
    /// file): stays so until the config is fixed and the operator restarted.
    Failed,
}

/// One template plugin's state.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PluginHealthStatus {
    /// Which plugin: its key under `kvm2.templates` (`domain`, `vendorData`).
    pub kind: String,
    /// Its name, `<kind>:<path or url>`.
    pub name: String,
    /// Loading, Loaded or Failed.
    pub state: PluginState,
    /// Why it is not loaded (the last failure), for people; empty when loaded.
    #[serde(default)]
    pub message: String,
}

/// One target's result.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TargetHealthStatus {
    /// Target (host) name.
    pub name: String,
    /// Whether it answered and looks usable; placement skips it when not.
    pub reachable: bool,
    /// Short reason code when not reachable (`connect`, `host-key`, `timeout`, ...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// The stage of the dial that failed (`dns`, `tcp-connect`, `ssh-handshake`,
    /// `ssh-auth`, `channel`, `libvirt-open`), when a dial failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stage: Option<String>,
    /// Detail for people.
    #[serde(default)]
    pub message: String,
    /// How long the check took, in milliseconds.
    pub latency_millis: i64,
    /// When this target was checked (RFC 3339).
    pub last_checked: String,
}
