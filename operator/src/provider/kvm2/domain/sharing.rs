//! Hosts shared with other clusters, as metrics: a twin (another cluster under this
//! cluster's `clusterId`) stops collection on its host, and a shared host keeps retired
//! images that no announcement accounts for; both are invisible in the logs of a quiet
//! fleet, so each gets a gauge per host that an alert can watch.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct HostLabels {
    host: String,
}

/// Gauges of what other clusters leave on our hosts.
#[derive(Debug, Clone, Default)]
pub struct SharingMetrics {
    twins: Family<HostLabels, Gauge>,
    kept_shared: Family<HostLabels, Gauge>,
}

impl SharingMetrics {
    /// Registered as `egress_cluster_id_conflict_domains` and
    /// `egress_gc_images_kept_shared`.
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self::default();
        registry.register(
            "egress_cluster_id_conflict_domains",
            "domains on the host marked with this cluster's clusterId by another cluster (its kube-system UID differs); nothing on the host is collected while above 0",
            m.twins.clone(),
        );
        registry.register(
            "egress_gc_images_kept_shared",
            "retired base images on the host kept because another cluster may still use them",
            m.kept_shared.clone(),
        );
        m
    }

    /// Records the latest count of a twin's domains on `host`.
    pub fn observe_twins(&self, host: &str, domains: usize) {
        self.twins
            .get_or_create(&labels(host))
            .set(i64::try_from(domains).unwrap_or(i64::MAX));
    }

    /// The latest count of a twin's domains on `host`.
    pub fn twins(&self, host: &str) -> i64 {
        self.twins.get_or_create(&labels(host)).get()
    }

    /// Records how many retired images the last sweep of `host` kept for other clusters.
    pub fn observe_kept_shared(&self, host: &str, images: usize) {
        self.kept_shared
            .get_or_create(&labels(host))
            .set(i64::try_from(images).unwrap_or(i64::MAX));
    }

    /// How many retired images the last sweep of `host` kept for other clusters.
    pub fn kept_shared(&self, host: &str) -> i64 {
        self.kept_shared.get_or_create(&labels(host)).get()
    }
}

fn labels(host: &str) -> HostLabels {
    HostLabels {
        host: host.to_string(),
    }
}
