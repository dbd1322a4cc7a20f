//! The fleet's metrics: endpoints per pool, how fast a failing proxy leaves them, rollout
//! progress, liveness rounds and the all-fail guard.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EndpointState {
    namespace: String,
    pool: String,
    /// `serving`, `terminating` or `not_serving`.
    state: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PoolLabel {
    namespace: String,
    pool: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PoolAction {
    namespace: String,
    pool: String,
    /// `created`, `drained`, `deleted`.
    action: String,
}

/// Cheap to clone (shared cells).
#[derive(Clone, Debug)]
pub struct FleetMetrics {
    endpoints: Family<EndpointState, Gauge>,
    removal: Histogram,
    updated: Family<PoolLabel, Gauge>,
    desired: Family<PoolLabel, Gauge>,
    actions: Family<PoolAction, Counter>,
    rounds: Counter,
    probed: Gauge,
    held: Gauge,
}

impl Default for FleetMetrics {
    fn default() -> Self {
        Self {
            endpoints: Family::default(),
            // The bound is 5 s; the buckets around it show how much room is left.
            removal: Histogram::new([0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 7.5, 10.0, 30.0]),
            updated: Family::default(),
            desired: Family::default(),
            actions: Family::default(),
            rounds: Counter::default(),
            probed: Gauge::default(),
            held: Gauge::default(),
        }
    }
}

impl FleetMetrics {
    /// Registered under `egress_fleet_*`.
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self::default();
        registry.register(
            "egress_fleet_endpoints",
            "proxies per pool by endpoint state (serving, terminating, not_serving)",
            m.endpoints.clone(),
        );
        registry.register(
            "egress_fleet_endpoint_removal_seconds",
            "time from the first failing fast probe to the EndpointSlice write without the proxy",
            m.removal.clone(),
        );
        registry.register(
            "egress_fleet_pool_updated_replicas",
            "rollout progress: proxies of the current template per pool",
            m.updated.clone(),
        );
        registry.register(
            "egress_fleet_pool_desired_replicas",
            "spec.replicas per pool",
            m.desired.clone(),
        );
        registry.register(
            "egress_fleet_pool_actions",
            "proxies the pool created, drained and deleted",
            m.actions.clone(),
        );
        registry.register(
            "egress_fleet_liveness_rounds",
            "rounds of the fast liveness probe",
            m.rounds.clone(),
        );
        registry.register(
            "egress_fleet_liveness_probed_proxies",
            "proxies probed in the last liveness round",
            m.probed.clone(),
        );
        registry.register(
            "egress_fleet_endpoints_held",
            "1 while every proxy fails the fast probe at once and the last endpoints are kept",
            m.held.clone(),
        );
        m
    }

    pub(super) fn endpoints(
        &self,
        namespace: &str,
        pool: &str,
        serving: usize,
        terminating: usize,
        not: usize,
    ) {
        for (state, n) in [
            ("serving", serving),
            ("terminating", terminating),
            ("not_serving", not),
        ] {
            self.endpoints
                .get_or_create(&EndpointState {
                    namespace: namespace.into(),
                    pool: pool.into(),
                    state: state.into(),
                })
                .set(i64::try_from(n).unwrap_or(i64::MAX));
        }
    }

    /// Endpoints counted in this state (for tests).
    pub fn endpoints_in(&self, namespace: &str, pool: &str, state: &str) -> i64 {
        self.endpoints
            .get_or_create(&EndpointState {
                namespace: namespace.into(),
                pool: pool.into(),
                state: state.into(),
            })
            .get()
    }

    pub(super) fn removed_after(&self, seconds: f64) {
        self.removal.observe(seconds);
    }

    pub(super) fn rollout(&self, namespace: &str, pool: &str, updated: i32, desired: i32) {
        let l = PoolLabel {
            namespace: namespace.into(),
            pool: pool.into(),
        };
        self.updated.get_or_create(&l).set(i64::from(updated));
        self.desired.get_or_create(&l).set(i64::from(desired));
    }

    pub(super) fn action(&self, namespace: &str, pool: &str, action: &str) {
        self.actions
            .get_or_create(&PoolAction {
                namespace: namespace.into(),
                pool: pool.into(),
                action: action.into(),
            })
            .inc();
    }

    /// Pool actions counted (for tests): `created`, `drained`, `deleted`.
    pub fn actions(&self, namespace: &str, pool: &str, action: &str) -> u64 {
        self.actions
            .get_or_create(&PoolAction {
                namespace: namespace.into(),
                pool: pool.into(),
                action: action.into(),
            })
            .get()
    }

    pub(super) fn liveness_round(&self, probed: usize) {
        self.rounds.inc();
        self.probed.set(i64::try_from(probed).unwrap_or(i64::MAX));
    }

    pub(super) fn set_held(&self, held: bool) {
        self.held.set(i64::from(held));
    }
}
