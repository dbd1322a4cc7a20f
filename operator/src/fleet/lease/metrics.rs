//! The lease controller's metrics: leases by phase, time to bind, pending time, rebinds
//! and expiries.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::api::proxy_lease::LeasePhase;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PhaseLabel {
    namespace: String,
    /// `Pending`, `Bound`, `Lost`, `Expired`.
    phase: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct NamespaceLabel {
    namespace: String,
}

/// Cheap to clone (shared cells).
#[derive(Clone, Debug)]
pub struct LeaseMetrics {
    phases: Family<PhaseLabel, Gauge>,
    /// The phase each lease was last counted in, so the gauges are exact counts.
    known: Arc<Mutex<HashMap<(String, String), LeasePhase>>>,
    bind: Histogram,
    pending: Histogram,
    rebinds: Family<NamespaceLabel, Counter>,
    expiries: Family<NamespaceLabel, Counter>,
}

/// Seconds: a bind takes a few API round trips; a pending lease waits for a proxy to
/// free up or a pool to grow, which can take minutes.
const BUCKETS: [f64; 12] = [
    0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0,
];

impl Default for LeaseMetrics {
    fn default() -> Self {
        Self {
            phases: Family::default(),
            known: Arc::default(),
            bind: Histogram::new(BUCKETS),
            pending: Histogram::new(BUCKETS),
            rebinds: Family::default(),
            expiries: Family::default(),
        }
    }
}

impl LeaseMetrics {
    /// Registered under `egress_fleet_lease*`.
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self::default();
        registry.register(
            "egress_fleet_leases",
            "ProxyLeases by namespace and phase",
            m.phases.clone(),
        );
        registry.register(
            "egress_fleet_lease_bind_seconds",
            "time from a lease's creation to its first Bound",
            m.bind.clone(),
        );
        registry.register(
            "egress_fleet_lease_pending_seconds",
            "time a lease spent without all its proxies (Pending or Lost) until Bound",
            m.pending.clone(),
        );
        registry.register(
            "egress_fleet_lease_rebinds",
            "lost proxies replaced by a spare",
            m.rebinds.clone(),
        );
        registry.register(
            "egress_fleet_lease_expiries",
            "leases that expired, not renewed in time",
            m.expiries.clone(),
        );
        m
    }

    fn gauge(&self, namespace: &str, phase: LeasePhase) -> Gauge {
        self.phases
            .get_or_create(&PhaseLabel {
                namespace: namespace.into(),
                phase: phase.as_str().into(),
            })
            .clone()
    }

    /// Counts a lease in `phase` (None: it is gone).
    pub(super) fn phase(&self, namespace: &str, name: &str, phase: Option<LeasePhase>) {
        let Ok(mut known) = self.known.lock() else {
            return;
        };
        let key = (namespace.to_string(), name.to_string());
        let before = match phase {
            Some(p) => known.insert(key, p),
            None => known.remove(&key),
        };
        if before == phase {
            return;
        }
        if let Some(b) = before {
            self.gauge(namespace, b).dec();
        }
        if let Some(p) = phase {
            self.gauge(namespace, p).inc();
        }
    }

    /// Leases counted in `phase` (for tests).
    pub fn leases_in(&self, namespace: &str, phase: LeasePhase) -> i64 {
        self.gauge(namespace, phase).get()
    }

    pub(super) fn bound_after(&self, seconds: f64) {
        self.bind.observe(seconds);
    }

    pub(super) fn pending_for(&self, seconds: f64) {
        self.pending.observe(seconds);
    }

    pub(super) fn rebind(&self, namespace: &str) {
        self.rebinds
            .get_or_create(&NamespaceLabel {
                namespace: namespace.into(),
            })
            .inc();
    }

    /// Rebinds counted (for tests).
    pub fn rebinds(&self, namespace: &str) -> u64 {
        self.rebinds
            .get_or_create(&NamespaceLabel {
                namespace: namespace.into(),
            })
            .get()
    }

    pub(super) fn expired(&self, namespace: &str) {
        self.expiries
            .get_or_create(&NamespaceLabel {
                namespace: namespace.into(),
            })
            .inc();
    }

    /// Expiries counted (for tests).
    pub fn expiries(&self, namespace: &str) -> u64 {
        self.expiries
            .get_or_create(&NamespaceLabel {
                namespace: namespace.into(),
            })
            .get()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phase_gauges_count_each_lease_once() {
        let m = LeaseMetrics::default();
        m.phase("ns", "a", Some(LeasePhase::Pending));
        m.phase("ns", "b", Some(LeasePhase::Pending));
        m.phase("ns", "a", Some(LeasePhase::Pending));
        assert_eq!(m.leases_in("ns", LeasePhase::Pending), 2);
        m.phase("ns", "a", Some(LeasePhase::Bound));
        assert_eq!(m.leases_in("ns", LeasePhase::Pending), 1);
        assert_eq!(m.leases_in("ns", LeasePhase::Bound), 1);
        m.phase("ns", "a", None);
        m.phase("ns", "a", None);
        assert_eq!(m.leases_in("ns", LeasePhase::Bound), 0);
    }
}
