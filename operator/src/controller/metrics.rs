//! Controller metrics: how reconciles end, what they did to instances, and how the
//! proxies' probes went.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use super::watch::WatchHealth;
use crate::serving::ProbeMetrics;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Outcome {
    outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Action {
    action: String,
}

/// Counters and a latency histogram; cheap to clone (shared cells).
#[derive(Clone, Debug)]
pub struct ControllerMetrics {
    reconciles: Family<Outcome, Counter>,
    duration: Family<Outcome, Histogram, fn() -> Histogram>,
    instances: Family<Action, Counter>,
    deferred: Counter,
    events_failed: Counter,
    /// The proxy probes behind the `Serving` condition.
    pub probes: ProbeMetrics,
    /// The Proxy watch: its failures and the Proxies it cannot decode (also `/readyz`).
    pub watch: WatchHealth,
    /// Status writes that dropped fields an older installed CRD lacks (every controller's).
    pub skew: crate::status_apply::SkewMetrics,
}

fn histogram() -> Histogram {
    // A refresh is one provider round trip; a Create can include an image download.
    Histogram::new([0.01, 0.05, 0.25, 1.0, 5.0, 30.0, 120.0, 600.0])
}

impl Default for ControllerMetrics {
    fn default() -> Self {
        Self {
            reconciles: Family::default(),
            duration: Family::new_with_constructor(histogram as fn() -> Histogram),
            instances: Family::default(),
            deferred: Counter::default(),
            events_failed: Counter::default(),
            probes: ProbeMetrics::default(),
            watch: WatchHealth::default(),
            skew: crate::status_apply::SkewMetrics::default(),
        }
    }
}

impl ControllerMetrics {
    /// Registered under `egress_controller_*`.
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self {
            probes: ProbeMetrics::register(registry, "egress_controller"),
            watch: WatchHealth::register(registry),
            skew: crate::status_apply::SkewMetrics::register(registry),
            ..Self::default()
        };
        registry.register(
            "egress_controller_reconciles",
            "Proxy reconciles by outcome (ok or the error class)",
            m.reconciles.clone(),
        );
        registry.register(
            "egress_controller_reconcile_duration_seconds",
            "Proxy reconcile duration by outcome",
            m.duration.clone(),
        );
        registry.register(
            "egress_controller_instance_actions",
            "instances created, replaced and deleted by the controller",
            m.instances.clone(),
        );
        registry.register(
            "egress_controller_deferred_triggers",
            "watch triggers (our own status writes among them) that changed nothing a reconcile \
             depends on and came before the requested delay, so only rescheduled the Proxy",
            m.deferred.clone(),
        );
        registry.register(
            "egress_controller_events_failed",
            "events the API server refused or that could not be sent",
            m.events_failed.clone(),
        );
        m
    }

    pub(super) fn event_failed(&self) {
        self.events_failed.inc();
    }

    /// Events that could not be published (for tests).
    pub fn events_failed(&self) -> u64 {
        self.events_failed.get()
    }

    pub(super) fn reconciled(&self, outcome: &str, seconds: f64) {
        let l = Outcome {
            outcome: outcome.into(),
        };
        self.reconciles.get_or_create(&l).inc();
        self.duration.get_or_create(&l).observe(seconds);
    }

    pub(super) fn deferred(&self) {
        self.deferred.inc();
    }

    /// Triggers deferred to the requested delay (for tests).
    pub fn deferred_triggers(&self) -> u64 {
        self.deferred.get()
    }

    pub(super) fn instance(&self, action: &str) {
        self.instances
            .get_or_create(&Action {
                action: action.into(),
            })
            .inc();
    }

    /// Reconciles counted with this outcome (for tests).
    pub fn reconciles(&self, outcome: &str) -> u64 {
        self.reconciles
            .get_or_create(&Outcome {
                outcome: outcome.into(),
            })
            .get()
    }

    /// Instance actions counted (for tests): `created`, `replaced-lost`, `replaced-failed`,
    /// `replaced-not-serving`, `deleted`, and `replacement-withheld` (the prober guard
    /// held back a replacement that was due).
    pub fn instances(&self, action: &str) -> u64 {
        self.instances
            .get_or_create(&Action {
                action: action.into(),
            })
            .get()
    }
}
