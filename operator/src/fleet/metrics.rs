//! The fleet's metrics: endpoints per pool, how fast a failing proxy leaves them, rollout
//! progress, liveness rounds and the all-fail guard.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

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
    /// The pools that have series (namespace, name), so a pool that goes loses them.
    pools: Arc<Mutex<HashSet<(String, String)>>>,
    /// Status writes that dropped fields an older installed CRD lacks (shared with the
    /// Proxy controller's, see [`FleetMetrics::sharing`]).
    pub skew: crate::status_apply::SkewMetrics,
    /// The pool and lease watches' health (shared with the Proxy controller's: one
    /// `/readyz` and one metric family, see [`FleetMetrics::sharing`]).
    pub watch: crate::controller::watch::WatchHealth,
}

/// `egress_fleet_pool_actions` values.
const ACTIONS: [&str; 4] = ["created", "drained", "deleted", "failed"];
/// `egress_fleet_endpoints` states.
const STATES: [&str; 3] = ["serving", "terminating", "not_serving"];

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
            pools: Arc::default(),
            skew: crate::status_apply::SkewMetrics::default(),
            watch: crate::controller::watch::WatchHealth::default(),
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
            "proxies the pool created, drained and deleted, and members it saw failed",
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

    /// The same metrics, sharing the Proxy controller's dropped-field counter and watch
    /// health (each one registered family, and one `/readyz` line set).
    pub fn sharing(mut self, controller: &crate::controller::ControllerMetrics) -> Self {
        self.skew = controller.skew.clone();
        self.watch = controller.watch.clone();
        self
    }

    pub(super) fn endpoints(
        &self,
        namespace: &str,
        pool: &str,
        serving: usize,
        terminating: usize,
        not: usize,
    ) {
        self.known(namespace, pool);
        for (state, n) in STATES.into_iter().zip([serving, terminating, not]) {
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
        // Read without creating: a pruned series stays gone.
        self.endpoints
            .get(&EndpointState {
                namespace: namespace.into(),
                pool: pool.into(),
                state: state.into(),
            })
            .map_or(0, |g| g.get())
    }

    pub(super) fn removed_after(&self, seconds: f64) {
        self.removal.observe(seconds);
    }

    pub(super) fn rollout(&self, namespace: &str, pool: &str, updated: i32, desired: i32) {
        self.known(namespace, pool);
        let l = PoolLabel {
            namespace: namespace.into(),
            pool: pool.into(),
        };
        self.updated.get_or_create(&l).set(i64::from(updated));
        self.desired.get_or_create(&l).set(i64::from(desired));
    }

    pub(super) fn action(&self, namespace: &str, pool: &str, action: &str) {
        self.known(namespace, pool);
        self.actions
            .get_or_create(&PoolAction {
                namespace: namespace.into(),
                pool: pool.into(),
                action: action.into(),
            })
            .inc();
    }

    /// Pool actions counted (for tests): `created`, `drained`, `deleted`, `failed`.
    pub fn actions(&self, namespace: &str, pool: &str, action: &str) -> u64 {
        self.actions
            .get(&PoolAction {
                namespace: namespace.into(),
                pool: pool.into(),
                action: action.into(),
            })
            .map_or(0, |c| c.get())
    }

    fn known(&self, namespace: &str, pool: &str) {
        if let Ok(mut pools) = self.pools.lock()
            && !pools.contains(&(namespace.to_string(), pool.to_string()))
        {
            pools.insert((namespace.into(), pool.into()));
        }
    }

    /// Removes the series of every pool not in `live` (namespace, name): per-pool series
    /// would otherwise grow with pool-name churn (issue 33, item 13; issue 35, item 4).
    pub fn retain_pools(&self, live: &HashSet<(String, String)>) {
        let Ok(mut pools) = self.pools.lock() else {
            return;
        };
        let gone: Vec<(String, String)> = pools.difference(live).cloned().collect();
        for (namespace, pool) in gone {
            for state in STATES {
                self.endpoints.remove(&EndpointState {
                    namespace: namespace.clone(),
                    pool: pool.clone(),
                    state: state.into(),
                });
            }
            for action in ACTIONS {
                self.actions.remove(&PoolAction {
                    namespace: namespace.clone(),
                    pool: pool.clone(),
                    action: action.into(),
                });
            }
            let l = PoolLabel {
                namespace: namespace.clone(),
                pool: pool.clone(),
            };
            self.updated.remove(&l);
            self.desired.remove(&l);
            pools.remove(&(namespace, pool));
        }
    }

    /// The pools that have series now (for tests).
    pub fn pools_with_series(&self) -> HashSet<(String, String)> {
        self.pools.lock().map(|p| p.clone()).unwrap_or_default()
    }

    pub(super) fn liveness_round(&self, probed: usize) {
        self.rounds.inc();
        self.probed.set(i64::try_from(probed).unwrap_or(i64::MAX));
    }

    pub(super) fn set_held(&self, held: bool) {
        self.held.set(i64::from(held));
    }
}
