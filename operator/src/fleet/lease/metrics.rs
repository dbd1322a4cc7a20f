//! The lease controller's metrics: leases by phase, time to bind, pending time, rebinds,
//! expiries and orphan releases that failed.
//!
//! Series are per namespace. A namespace's series go when its last lease goes (counted
//! through the finalizer, and by [`LeaseMetrics::retain`] from the orphan sweep for a lease
//! that went without it), so namespace churn does not grow the registry.

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
    swaps: Family<NamespaceLabel, Counter>,
    orphan_failures: Counter,
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
            swaps: Family::default(),
            orphan_failures: Counter::default(),
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
        registry.register(
            "egress_fleet_lease_out_of_date_swaps",
            "out-of-date bound proxies swapped for up-to-date ones (leases with replaceOutOfDate)",
            m.swaps.clone(),
        );
        registry.register(
            "egress_fleet_lease_orphan_release_failures",
            "proxies of a vanished lease that the orphan sweep failed to give back",
            m.orphan_failures.clone(),
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
        if phase.is_none() {
            self.prune(&known, namespace);
        }
    }

    /// Forgets every lease not in `live` (namespace, name): leases that went without the
    /// finalizer's reconcile (a finalizer removed by hand, a deletion while no replica
    /// led), and the series of namespaces left with none.
    pub fn retain(&self, live: &std::collections::HashSet<(String, String)>) {
        let Ok(mut known) = self.known.lock() else {
            return;
        };
        let gone: Vec<((String, String), LeasePhase)> = known
            .iter()
            .filter(|(k, _)| !live.contains(*k))
            .map(|(k, p)| (k.clone(), *p))
            .collect();
        for ((namespace, name), p) in gone {
            known.remove(&(namespace.clone(), name));
            self.gauge(&namespace, p).dec();
            self.prune(&known, &namespace);
        }
    }

    /// Removes the series of `namespace` once no lease of it is counted.
    fn prune(&self, known: &HashMap<(String, String), LeasePhase>, namespace: &str) {
        if known.keys().any(|(ns, _)| ns == namespace) {
            return;
        }
        for p in [
            LeasePhase::Pending,
            LeasePhase::Bound,
            LeasePhase::Lost,
            LeasePhase::Expired,
        ] {
            self.phases.remove(&PhaseLabel {
                namespace: namespace.into(),
                phase: p.as_str().into(),
            });
        }
        let ns = NamespaceLabel {
            namespace: namespace.into(),
        };
        self.rebinds.remove(&ns);
        self.expiries.remove(&ns);
        self.swaps.remove(&ns);
    }

    /// Counts an orphan release that failed.
    pub(super) fn orphan_failed(&self) {
        self.orphan_failures.inc();
    }

    /// Orphan releases that failed (for tests).
    pub fn orphan_failures(&self) -> u64 {
        self.orphan_failures.get()
    }

    /// Leases counted in `phase` (for tests; reading does not create a series).
    pub fn leases_in(&self, namespace: &str, phase: LeasePhase) -> i64 {
        self.phases
            .get(&PhaseLabel {
                namespace: namespace.into(),
                phase: phase.as_str().into(),
            })
            .map_or(0, |g| g.get())
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
            .get(&NamespaceLabel {
                namespace: namespace.into(),
            })
            .map_or(0, |c| c.get())
    }

    pub(super) fn expired(&self, namespace: &str) {
        self.expiries
            .get_or_create(&NamespaceLabel {
                namespace: namespace.into(),
            })
            .inc();
    }

    pub(super) fn swapped(&self, namespace: &str) {
        self.swaps
            .get_or_create(&NamespaceLabel {
                namespace: namespace.into(),
            })
            .inc();
    }

    /// Out-of-date swaps counted (for tests).
    pub fn swaps(&self, namespace: &str) -> u64 {
        self.swaps
            .get(&NamespaceLabel {
                namespace: namespace.into(),
            })
            .map_or(0, |c| c.get())
    }

    /// Expiries counted (for tests).
    pub fn expiries(&self, namespace: &str) -> u64 {
        self.expiries
            .get(&NamespaceLabel {
                namespace: namespace.into(),
            })
            .map_or(0, |c| c.get())
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

    fn encoded(registry: &Registry) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, registry).unwrap();
        out
    }

    #[test]
    fn a_namespaces_series_go_with_its_last_lease() {
        let mut registry = Registry::default();
        let m = LeaseMetrics::register(&mut registry);
        m.phase("ns", "a", Some(LeasePhase::Bound));
        m.phase("ns", "b", Some(LeasePhase::Pending));
        m.rebind("ns");
        m.expired("ns");
        m.phase("other", "c", Some(LeasePhase::Bound));
        m.phase("ns", "a", None);
        assert!(encoded(&registry).contains("namespace=\"ns\""), "b is left");
        // b went without its finalizer: the sweep's list no longer has it.
        let live = std::collections::HashSet::from([("other".to_string(), "c".to_string())]);
        m.retain(&live);
        let text = encoded(&registry);
        assert!(!text.contains("namespace=\"ns\""), "{text}");
        assert!(text.contains("namespace=\"other\""), "{text}");
        assert_eq!(m.leases_in("other", LeasePhase::Bound), 1);
    }
}
