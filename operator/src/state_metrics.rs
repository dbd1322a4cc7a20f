//! Object-state metrics, computed on each scrape from the controllers' caches (as
//! kube-state-metrics does): Proxies by phase, Proxies not serving and for how long, pool
//! conditions, and leases waiting for proxies.
//!
//! Why at scrape time: these are facts about objects, not events. Counting them in the
//! reconcilers would need bookkeeping for every way an object can go (deleted while the
//! operator was down, a watch relist); reading the cache the controllers already hold costs
//! no API call and no memory of its own, and is exact. Per-object series exist only for
//! objects in trouble (not serving, waiting), so a healthy fleet of thousands exports a
//! handful of series.
//!
//! Only the leader has caches; a standby replica exports none of these series, so alerts
//! aggregate with `max` or `sum` over replicas.

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::ResourceExt;
use kube::runtime::reflector::Store;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::api::proxy::{Proxy, ProxyPhase};
use crate::api::proxy_lease::{LeasePhase, ProxyLease};
use crate::api::proxy_pool::ProxyPool;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PhaseLabels {
    namespace: String,
    phase: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ProxyLabels {
    namespace: String,
    proxy: String,
    /// The `Serving` condition's reason (`Refused`, `Timeout`, `NoAddress`, ...).
    reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PoolLabels {
    namespace: String,
    pool: String,
    condition: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DriftLabels {
    namespace: String,
    provider: String,
    /// The pool that controls the Proxy (by its owner reference, not a label anyone can
    /// write); empty for a standalone Proxy.
    pool: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LeaseLabels {
    namespace: String,
    lease: String,
    phase: String,
}

/// What the caches held at one scrape.
#[derive(Default)]
struct Snapshot {
    proxies: Vec<Arc<Proxy>>,
    pools: Vec<Arc<ProxyPool>>,
    leases: Vec<Arc<ProxyLease>>,
}

#[derive(Default)]
struct Caches {
    proxies: Option<Store<Proxy>>,
    pools: Option<Store<ProxyPool>>,
    leases: Option<Store<ProxyLease>>,
}

/// The caches of the current leadership term; cheap to clone (one shared cell).
#[derive(Clone, Default)]
pub struct StateMetrics {
    caches: Arc<Mutex<Caches>>,
    /// `serving.replaceAfterSeconds`, exported so an alert can compare against it.
    replace_after: Arc<Gauge>,
}

impl std::fmt::Debug for StateMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StateMetrics").finish_non_exhaustive()
    }
}

impl StateMetrics {
    /// Registers the collector and `egress_serving_replace_after_seconds`.
    pub fn register(registry: &mut Registry, replace_after_seconds: u32) -> Self {
        let m = Self::default();
        m.replace_after.set(i64::from(replace_after_seconds));
        registry.register(
            "egress_serving_replace_after_seconds",
            "serving.replaceAfterSeconds: how long a Proxy may fail its probe before it is replaced",
            Gauge::clone(&m.replace_after),
        );
        registry.register_collector(Box::new(m.clone()));
        m
    }

    fn with(&self, f: impl FnOnce(&mut Caches)) {
        if let Ok(mut c) = self.caches.lock() {
            f(&mut c);
        }
    }

    /// The Proxy controller's cache, for this term.
    pub fn set_proxies(&self, store: Store<Proxy>) {
        self.with(|c| c.proxies = Some(store));
    }

    /// The pool controller's cache, for this term.
    pub fn set_pools(&self, store: Store<ProxyPool>) {
        self.with(|c| c.pools = Some(store));
    }

    /// The lease controller's cache, for this term.
    pub fn set_leases(&self, store: Store<ProxyLease>) {
        self.with(|c| c.leases = Some(store));
    }

    /// Forgets the caches when a term ends: a replica that no longer leads must not export
    /// what its stopped controllers last saw.
    pub fn clear(&self) {
        self.with(|c| *c = Caches::default());
    }

    fn snapshot(&self) -> Snapshot {
        let Ok(c) = self.caches.lock() else {
            return Snapshot::default();
        };
        Snapshot {
            proxies: c.proxies.as_ref().map(Store::state).unwrap_or_default(),
            pools: c.pools.as_ref().map(Store::state).unwrap_or_default(),
            leases: c.leases.as_ref().map(Store::state).unwrap_or_default(),
        }
    }
}

fn phase_name(p: Option<ProxyPhase>) -> &'static str {
    match p {
        None => "Unknown",
        Some(ProxyPhase::Pending) => "Pending",
        Some(ProxyPhase::Provisioning) => "Provisioning",
        Some(ProxyPhase::Running) => "Running",
        Some(ProxyPhase::Degraded) => "Degraded",
        Some(ProxyPhase::Failed) => "Failed",
        Some(ProxyPhase::Deleting) => "Deleting",
    }
}

fn condition<'a>(conditions: &'a [Condition], type_: &str) -> Option<&'a Condition> {
    conditions.iter().find(|c| c.type_ == type_)
}

/// Seconds from `since` to `now`, never negative (a clock behind the API server's).
fn age(since: &Time, now: Timestamp) -> f64 {
    let d = now.as_millisecond() - since.0.as_millisecond();
    d.max(0) as f64 / 1000.0
}

/// What one scrape exports, computed from snapshots of the caches.
#[derive(Default)]
struct Rows {
    proxies: Family<PhaseLabels, Gauge>,
    not_serving: Family<ProxyLabels, Gauge<f64, AtomicU64>>,
    pools: Family<PoolLabels, Gauge>,
    waiting: Family<LeaseLabels, Gauge<f64, AtomicU64>>,
    out_of_date: Family<DriftLabels, Gauge>,
    out_of_date_oldest: Family<DriftLabels, Gauge<f64, AtomicU64>>,
}

/// The pool that controls `p`, from its controller owner reference.
fn controlling_pool(p: &Proxy) -> String {
    p.owner_references()
        .iter()
        .find(|o| o.controller == Some(true) && o.kind == "ProxyPool")
        .map(|o| o.name.clone())
        .unwrap_or_default()
}

fn rows(
    proxies: &[Arc<Proxy>],
    pools: &[Arc<ProxyPool>],
    leases: &[Arc<ProxyLease>],
    now: Timestamp,
) -> Rows {
    let r = Rows::default();
    for p in proxies {
        let ns = p.namespace().unwrap_or_default();
        let status = p.status.as_ref();
        let phase = status.and_then(|s| s.phase);
        r.proxies
            .get_or_create(&PhaseLabels {
                namespace: ns.clone(),
                phase: phase_name(phase).into(),
            })
            .inc();
        // A Proxy being deleted is going away on purpose; one without an instance yet has
        // no proxy to serve (its phase tells that story).
        if p.metadata.deletion_timestamp.is_some() || phase == Some(ProxyPhase::Deleting) {
            continue;
        }
        let outdated = status.and_then(|s| condition(&s.conditions, "UpToDate"));
        if let Some(c) = outdated.filter(|c| c.status == "False") {
            let labels = DriftLabels {
                namespace: ns.clone(),
                provider: p.spec.provider.clone(),
                pool: controlling_pool(p),
            };
            r.out_of_date.get_or_create(&labels).inc();
            let waited = age(&c.last_transition_time, now);
            let oldest = r.out_of_date_oldest.get_or_create(&labels);
            if waited > oldest.get() {
                oldest.set(waited);
            }
        }
        let serving = status.and_then(|s| condition(&s.conditions, "Serving"));
        if let Some(c) = serving.filter(|c| c.status != "True") {
            r.not_serving
                .get_or_create(&ProxyLabels {
                    namespace: ns,
                    proxy: p.name_any(),
                    reason: c.reason.clone(),
                })
                .set(age(&c.last_transition_time, now));
        }
    }
    for pool in pools {
        let Some(status) = pool.status.as_ref() else {
            continue;
        };
        for c in &status.conditions {
            r.pools
                .get_or_create(&PoolLabels {
                    namespace: pool.namespace().unwrap_or_default(),
                    pool: pool.name_any(),
                    condition: c.type_.clone(),
                })
                .set(i64::from(c.status == "True"));
        }
    }
    for lease in leases {
        let status = lease.status.as_ref();
        let phase = status.and_then(|s| s.phase).unwrap_or(LeasePhase::Pending);
        if !matches!(phase, LeasePhase::Pending | LeasePhase::Lost) {
            continue;
        }
        // Waiting since the Bound condition last changed; a lease never reconciled has
        // waited since it was made.
        let since = status
            .and_then(|s| condition(&s.conditions, "Bound"))
            .map(|c| c.last_transition_time.clone())
            .or_else(|| lease.metadata.creation_timestamp.clone());
        let Some(since) = since else { continue };
        r.waiting
            .get_or_create(&LeaseLabels {
                namespace: lease.namespace().unwrap_or_default(),
                lease: lease.name_any(),
                phase: phase.as_str().into(),
            })
            .set(age(&since, now));
    }
    r
}

fn emit(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    metric: &impl EncodeMetric,
) -> Result<(), std::fmt::Error> {
    let e = encoder.encode_descriptor(name, help, None, metric.metric_type())?;
    metric.encode(e)
}

impl Collector for StateMetrics {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let s = self.snapshot();
        let r = rows(&s.proxies, &s.pools, &s.leases, Timestamp::now());
        emit(
            &mut encoder,
            "egress_proxies",
            "Proxies by namespace and phase (leader only)",
            &r.proxies,
        )?;
        emit(
            &mut encoder,
            "egress_proxy_not_serving_seconds",
            "seconds since a Proxy's Serving condition turned False, for each Proxy not \
             serving and not being deleted (leader only)",
            &r.not_serving,
        )?;
        emit(
            &mut encoder,
            "egress_pool_condition",
            "1 while the pool's condition is True, 0 otherwise, by condition type (leader only)",
            &r.pools,
        )?;
        emit(
            &mut encoder,
            "egress_proxies_out_of_date",
            "Proxies whose UpToDate condition is False (made from inputs the config no longer \
             has), by namespace, provider and controlling pool (empty: standalone) (leader only)",
            &r.out_of_date,
        )?;
        emit(
            &mut encoder,
            "egress_proxy_out_of_date_oldest_seconds",
            "seconds since the longest out-of-date Proxy of each namespace, provider and pool \
             turned UpToDate=False (leader only)",
            &r.out_of_date_oldest,
        )?;
        emit(
            &mut encoder,
            "egress_lease_waiting_seconds",
            "seconds a Pending or Lost lease has waited for its proxies (leader only)",
            &r.waiting,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::proxy::{ProxySpec, ProxyStatus};
    use crate::api::proxy_lease::{ProxyLeaseSpec, ProxyLeaseStatus};
    use crate::api::proxy_pool::ProxyPoolStatus;
    use prometheus_client::encoding::text::encode;

    fn cond(type_: &str, status: &str, reason: &str, at: Timestamp) -> Condition {
        Condition {
            type_: type_.into(),
            status: status.into(),
            reason: reason.into(),
            message: String::new(),
            last_transition_time: Time(at),
            observed_generation: None,
        }
    }

    fn proxy(name: &str, phase: ProxyPhase, serving: Option<Condition>) -> Arc<Proxy> {
        let mut p = Proxy::new(name, ProxySpec::default());
        p.metadata.namespace = Some("team-a".into());
        p.status = Some(ProxyStatus {
            phase: Some(phase),
            conditions: serving.into_iter().collect(),
            ..ProxyStatus::default()
        });
        Arc::new(p)
    }

    fn scrape(m: &StateMetrics) -> String {
        let mut registry = Registry::default();
        registry.register_collector(Box::new(m.clone()));
        let mut out = String::new();
        encode(&mut out, &registry).unwrap();
        out
    }

    #[test]
    fn out_of_date_proxies_are_counted_by_controlling_pool_with_the_oldest_age() {
        let now = Timestamp::now();
        let ago = |s: u64| now - std::time::Duration::from_secs(s);
        let stale = |name: &str, since: u64, pool: Option<&str>| {
            let mut p = (*proxy(
                name,
                ProxyPhase::Running,
                Some(cond("UpToDate", "False", "InputsChanged", ago(since))),
            ))
            .clone();
            p.spec.provider = "kvm2".into();
            if let Some(pool) = pool {
                p.metadata.owner_references = Some(vec![
                    k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference {
                        api_version: "egress-operator.dev/v1alpha1".into(),
                        kind: "ProxyPool".into(),
                        name: pool.into(),
                        uid: "u".into(),
                        controller: Some(true),
                        ..Default::default()
                    },
                ]);
            }
            Arc::new(p)
        };
        let mut labelled = (*stale("copied-label", 30, None)).clone();
        labelled
            .metadata
            .labels
            .get_or_insert_default()
            .insert("egress-operator.dev/pool".into(), "office".into());
        let proxies = [
            stale("a", 600, Some("office")),
            stale("b", 60, Some("office")),
            stale("c", 90, None),
            Arc::new(labelled),
            proxy(
                "current",
                ProxyPhase::Running,
                Some(cond("UpToDate", "True", "Current", ago(5))),
            ),
        ];
        let r = rows(&proxies, &[], &[], now);
        let mut registry = Registry::default();
        registry.register("x", "x", r.out_of_date.clone());
        registry.register("y", "y", r.out_of_date_oldest.clone());
        let mut out = String::new();
        encode(&mut out, &registry).unwrap();
        assert!(
            out.contains(r#"x{namespace="team-a",provider="kvm2",pool="office"} 2"#),
            "{out}"
        );
        // A copied pool label does not make a Proxy the pool's.
        assert!(
            out.contains(r#"x{namespace="team-a",provider="kvm2",pool=""} 2"#),
            "{out}"
        );
        let oldest = out
            .lines()
            .find(|l| l.starts_with(r#"y{namespace="team-a",provider="kvm2",pool="office"}"#))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap();
        assert!((599.0..=601.0).contains(&oldest), "{out}");
        assert!(!out.contains("current"), "{out}");
    }

    #[test]
    fn counts_phases_and_lists_only_proxies_in_trouble() {
        let now = Timestamp::now();
        let minute_ago = now - std::time::Duration::from_secs(60);
        let proxies = [
            proxy(
                "ok",
                ProxyPhase::Running,
                Some(cond("Serving", "True", "Answered", minute_ago)),
            ),
            proxy(
                "down",
                ProxyPhase::Running,
                Some(cond("Serving", "False", "Refused", minute_ago)),
            ),
            proxy("new", ProxyPhase::Pending, None),
        ];
        let r = rows(&proxies, &[], &[], now);
        let running = PhaseLabels {
            namespace: "team-a".into(),
            phase: "Running".into(),
        };
        assert_eq!(r.proxies.get_or_create(&running).get(), 2);
        let down = ProxyLabels {
            namespace: "team-a".into(),
            proxy: "down".into(),
            reason: "Refused".into(),
        };
        let secs = r.not_serving.get_or_create(&down).get();
        assert!((59.0..=61.0).contains(&secs), "{secs}");
        let mut out = String::new();
        let mut registry = Registry::default();
        registry.register("x", "x", r.not_serving.clone());
        encode(&mut out, &registry).unwrap();
        assert!(!out.contains("proxy=\"ok\""), "{out}");
        assert!(!out.contains("proxy=\"new\""), "{out}");
    }

    #[test]
    fn pools_and_waiting_leases() {
        let now = Timestamp::now();
        let then = now - std::time::Duration::from_secs(600);
        let mut pool: ProxyPool = serde_json::from_value(serde_json::json!({
            "apiVersion": "egress-operator.dev/v1alpha1",
            "kind": "ProxyPool",
            "metadata": {"name": "web", "namespace": "team-a"},
            "spec": {"template": {"provider": "kvm2", "image": "debian-12"}},
        }))
        .unwrap();
        pool.status = Some(ProxyPoolStatus {
            conditions: vec![
                cond("Available", "False", "TooFewServing", then),
                cond("Degraded", "True", "InsufficientHosts", then),
            ],
            ..ProxyPoolStatus::default()
        });
        let spec = ProxyLeaseSpec {
            pool: "web".into(),
            count: 1,
            duration_seconds: 60,
            holder: "h".into(),
            renew_time: None,
            rebind_after_seconds: 30,
            service: false,
            replace_out_of_date: false,
        };
        let mut waiting = ProxyLease::new("crawler", spec.clone());
        waiting.metadata.namespace = Some("team-a".into());
        waiting.status = Some(ProxyLeaseStatus {
            phase: Some(LeasePhase::Pending),
            conditions: vec![cond("Bound", "False", "NoSpare", then)],
            ..ProxyLeaseStatus::default()
        });
        let mut bound = ProxyLease::new("bound", spec);
        bound.metadata.namespace = Some("team-a".into());
        bound.status = Some(ProxyLeaseStatus {
            phase: Some(LeasePhase::Bound),
            ..ProxyLeaseStatus::default()
        });
        let r = rows(
            &[],
            &[Arc::new(pool)],
            &[Arc::new(waiting), Arc::new(bound)],
            now,
        );
        let l = |c: &str| PoolLabels {
            namespace: "team-a".into(),
            pool: "web".into(),
            condition: c.into(),
        };
        assert_eq!(r.pools.get_or_create(&l("Available")).get(), 0);
        assert_eq!(r.pools.get_or_create(&l("Degraded")).get(), 1);
        let w = r
            .waiting
            .get_or_create(&LeaseLabels {
                namespace: "team-a".into(),
                lease: "crawler".into(),
                phase: "Pending".into(),
            })
            .get();
        assert!((599.0..=601.0).contains(&w), "{w}");
        let mut out = String::new();
        let mut registry = Registry::default();
        registry.register("x", "x", r.waiting.clone());
        encode(&mut out, &registry).unwrap();
        assert!(!out.contains("lease=\"bound\""), "{out}");
    }

    #[test]
    fn a_replica_without_caches_exports_no_series_and_a_cleared_one_forgets() {
        let mut registry = Registry::default();
        let m = StateMetrics::register(&mut registry, 120);
        let out = scrape(&m);
        assert!(!out.contains("egress_proxies{"), "{out}");
        let (reader, mut writer) = kube::runtime::reflector::store::<Proxy>();
        writer.apply_watcher_event(&kube::runtime::watcher::Event::Apply(Proxy::clone(&proxy(
            "a",
            ProxyPhase::Running,
            None,
        ))));
        m.set_proxies(reader);
        let out = scrape(&m);
        assert!(
            out.contains("egress_proxies{namespace=\"team-a\",phase=\"Running\"} 1"),
            "{out}"
        );
        m.clear();
        assert!(!scrape(&m).contains("egress_proxies{"));
        let mut text = String::new();
        encode(&mut text, &registry).unwrap();
        assert!(
            text.contains("egress_serving_replace_after_seconds 120"),
            "{text}"
        );
    }
}
