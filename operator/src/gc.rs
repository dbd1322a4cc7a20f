//! The garbage collector: deletes instances that no Proxy owns any more, and duplicates a
//! Proxy no longer names.
//!
//! A sweep lists every provider's instances, then which Proxies exist ([`ProxyIndex`]),
//! and deletes an instance when
//! - no Proxy has its UID (`no-proxy`), or
//! - its Proxy's `status.instanceId` names a *different* instance (`duplicate`: left by a
//!   replace, or by a placement while a host was unreachable),
//!
//! and, in both cases, it is older than the grace period. Design invariant 6 holds like
//! this:
//! - *Only our mark*: [`Provider::list`](crate::provider::Provider::list) returns, by contract, only instances carrying our
//!   managed mark for this cluster; a domain without it never reaches the collector. That
//!   is a provider property and is tested there (kvm2's listing tests), not faked here.
//!   The collector still ignores any instance with an empty owner UID.
//! - *Never on a failed listing*: a target whose listing failed is skipped for the round,
//!   never read as empty; if the Proxies cannot be listed, nothing is deleted at all
//!   (an empty owner set would make everything look orphaned).
//! - *Grace period*: age comes from the instance's `created_at`; one that cannot be dated
//!   is kept (and logged), so a Create in flight is never collected.
//!
//! The instance a Proxy's status names is never touched, and nothing of a Proxy whose
//! status names no instance yet is touched either: its Create may be about to write it.
//! A Proxy being deleted is treated like any other: its finalizer deletes the named
//! instance, and its duplicates are collected by the same rule.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use jiff::{SignedDuration, Timestamp};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::api::proxy::Proxy;
use crate::config::GcConfig;
use crate::error::{Classified, ErrorClass};
use crate::provider::{BoxFuture, Instance, InstanceId, ProviderError, SharedProvider};

/// What the collector needs to know about one existing Proxy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Owner {
    /// Proxy namespace.
    pub namespace: String,
    /// Proxy name.
    pub name: String,
    /// The instance its status names; `None` when none is named yet (or the value does
    /// not parse), which protects all of its instances.
    pub instance_id: Option<InstanceId>,
    /// Whether the Proxy has a deletion timestamp (for logs; it does not change the rules).
    pub deleting: bool,
}

/// Which Proxies exist, keyed by UID. A trait so sweeps are tested without a cluster.
pub trait ProxyIndex: Send + Sync {
    /// Every Proxy in the cluster by UID. An error means "unknown", never "none".
    fn owners(&self) -> BoxFuture<'_, Result<HashMap<String, Owner>, GcError>>;
}

/// A collector failure.
#[derive(Debug, thiserror::Error)]
pub enum GcError {
    /// The Proxies could not be listed; the sweep deletes nothing.
    #[error("listing Proxies failed: {source}")]
    ListProxies {
        /// Class of the failure.
        class: ErrorClass,
        /// What went wrong.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// A delete failed; the sweep goes on with the next instance.
    #[error("deleting instance {instance} of provider {provider:?} failed: {source}")]
    Delete {
        /// Provider name.
        provider: String,
        /// The instance.
        instance: InstanceId,
        /// What the provider said.
        #[source]
        source: ProviderError,
    },
}

impl Classified for GcError {
    fn class(&self) -> ErrorClass {
        match self {
            GcError::ListProxies { class, .. } => *class,
            GcError::Delete { source, .. } => source.class(),
        }
    }
}

/// Page size of the Proxy listing: bounds one response on a big cluster.
const LIST_PAGE: u32 = 500;

/// [`ProxyIndex`] over the Kubernetes API: lists every Proxy in every namespace.
///
/// A plain list (no resource version) is a consistent read, so a Proxy that existed when
/// the instances were listed is in it; a reflector cache could lag behind.
#[derive(Clone)]
pub struct KubeProxyIndex {
    api: kube::Api<Proxy>,
}

impl std::fmt::Debug for KubeProxyIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeProxyIndex").finish_non_exhaustive()
    }
}

impl KubeProxyIndex {
    /// An index over all namespaces.
    pub fn new(client: kube::Client) -> Self {
        Self {
            api: kube::Api::all(client),
        }
    }
}

impl ProxyIndex for KubeProxyIndex {
    fn owners(&self) -> BoxFuture<'_, Result<HashMap<String, Owner>, GcError>> {
        Box::pin(async move {
            let mut owners = HashMap::new();
            let mut params = kube::api::ListParams::default().limit(LIST_PAGE);
            loop {
                let page = self
                    .api
                    .list(&params)
                    .await
                    .map_err(|e| GcError::ListProxies {
                        class: crate::error::kube_error_class(&e),
                        source: Box::new(e),
                    })?;
                owners.extend(page.items.iter().filter_map(owner_of));
                match page.metadata.continue_ {
                    Some(token) if !token.is_empty() => {
                        params = kube::api::ListParams::default()
                            .limit(LIST_PAGE)
                            .continue_token(&token);
                    }
                    _ => break,
                }
            }
            Ok(owners)
        })
    }
}

/// The owner entry of a listed Proxy; `None` for an object without a UID (never the case
/// for an object read from the API server, but it could not be keyed).
fn owner_of(p: &Proxy) -> Option<(String, Owner)> {
    let uid = p.metadata.uid.clone().filter(|u| !u.is_empty())?;
    let namespace = p.metadata.namespace.clone().unwrap_or_default();
    let name = p.metadata.name.clone().unwrap_or_default();
    let named = p.status.as_ref().and_then(|s| s.instance_id.as_deref());
    let instance_id = match named.map(InstanceId::parse) {
        None => None,
        Some(Ok(id)) => Some(id),
        Some(Err(e)) => {
            tracing::warn!(namespace, name, error = %e, "Proxy status has an unreadable instance ID; none of its instances will be collected");
            None
        }
    };
    Some((
        uid,
        Owner {
            namespace,
            name,
            instance_id,
            deleting: p.metadata.deletion_timestamp.is_some(),
        },
    ))
}

#[derive(Debug, Default)]
struct FakeIndexState {
    owners: HashMap<String, Owner>,
    fail_next: Option<ErrorClass>,
    calls: usize,
}

/// An in-memory [`ProxyIndex`] for tests.
#[derive(Debug, Default)]
pub struct FakeProxyIndex {
    state: Mutex<FakeIndexState>,
}

impl FakeProxyIndex {
    /// An index with no Proxies.
    pub fn new() -> Self {
        Self::default()
    }

    fn state(&self) -> std::sync::MutexGuard<'_, FakeIndexState> {
        match self.state.lock() {
            Ok(s) => s,
            Err(p) => p.into_inner(),
        }
    }

    /// Adds (or replaces) the Proxy with this UID.
    pub fn insert(&self, uid: &str, owner: Owner) {
        self.state().owners.insert(uid.into(), owner);
    }

    /// Removes the Proxy with this UID.
    pub fn remove(&self, uid: &str) {
        self.state().owners.remove(uid);
    }

    /// Makes the next listing fail with `class`.
    pub fn fail_next(&self, class: ErrorClass) {
        self.state().fail_next = Some(class);
    }

    /// How many listings were asked for.
    pub fn calls(&self) -> usize {
        self.state().calls
    }
}

impl ProxyIndex for FakeProxyIndex {
    fn owners(&self) -> BoxFuture<'_, Result<HashMap<String, Owner>, GcError>> {
        Box::pin(async move {
            let mut s = self.state();
            s.calls += 1;
            match s.fail_next.take() {
                Some(class) => Err(GcError::ListProxies {
                    class,
                    source: "injected Proxy listing failure".into(),
                }),
                None => Ok(s.owners.clone()),
            }
        })
    }
}

/// Why an instance is collected.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OrphanReason {
    /// No Proxy has its UID.
    NoProxy,
    /// Its Proxy's status names another instance.
    Duplicate {
        /// The instance the status names.
        named: InstanceId,
    },
}

impl OrphanReason {
    /// Stable label for logs and metrics.
    pub fn as_str(&self) -> &'static str {
        match self {
            OrphanReason::NoProxy => "no-proxy",
            OrphanReason::Duplicate { .. } => "duplicate",
        }
    }
}

/// Why an instance is kept.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeepReason {
    /// Its mark has no owner UID (cannot happen through a correct provider).
    NoOwnerUid,
    /// Its Proxy's status names it.
    Named,
    /// Its Proxy names no instance yet: a Create may be about to write this one.
    NotYetNamed,
    /// It is an orphan, but younger than the grace period.
    Young {
        /// Age in seconds (negative if the host's clock is ahead).
        age_seconds: i64,
    },
    /// Its `created_at` does not parse as RFC 3339: what cannot be dated is not deleted.
    Undatable {
        /// The value found.
        created_at: String,
    },
}

/// An instance of one provider.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InstanceRef {
    /// Provider name.
    pub provider: String,
    /// The instance.
    pub id: InstanceId,
}

/// A target whose listing failed: nothing on it was judged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SkippedTarget {
    /// Provider name.
    pub provider: String,
    /// Target (host) name.
    pub target: String,
    /// Class of the failure.
    pub class: ErrorClass,
    /// The failure.
    pub message: String,
}

/// An instance kept, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Kept {
    /// The instance.
    pub instance: InstanceRef,
    /// Why.
    pub reason: KeepReason,
}

/// An instance deleted, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Deleted {
    /// The instance.
    pub instance: InstanceRef,
    /// The UID in its mark.
    pub proxy_uid: String,
    /// Why.
    pub reason: OrphanReason,
}

/// A delete that failed.
#[derive(Debug)]
pub struct FailedDelete {
    /// The instance.
    pub instance: InstanceRef,
    /// Why it was to be deleted.
    pub reason: OrphanReason,
    /// The failure.
    pub error: GcError,
}

/// What one sweep saw and did.
#[derive(Debug, Default)]
pub struct GcReport {
    /// Every instance listed (on targets that answered).
    pub seen: Vec<InstanceRef>,
    /// Targets whose listing failed.
    pub skipped_targets: Vec<SkippedTarget>,
    /// Set when the Proxies could not be listed: then nothing was judged or deleted.
    pub owners_error: Option<GcError>,
    /// Instances judged and kept.
    pub kept: Vec<Kept>,
    /// Instances deleted.
    pub deleted: Vec<Deleted>,
    /// Deletes that failed.
    pub failed: Vec<FailedDelete>,
    /// Set when shutdown stopped the sweep before it judged everything.
    pub interrupted: bool,
}

impl GcReport {
    /// IDs of the deleted instances.
    pub fn deleted_ids(&self) -> Vec<&InstanceId> {
        self.deleted.iter().map(|d| &d.instance.id).collect()
    }

    /// Why `id` was kept, if it was.
    pub fn kept_reason(&self, id: &InstanceId) -> Option<&KeepReason> {
        self.kept
            .iter()
            .find(|k| &k.instance.id == id)
            .map(|k| &k.reason)
    }

    fn result(&self) -> &'static str {
        if self.owners_error.is_some() {
            "skipped"
        } else if self.interrupted {
            "interrupted"
        } else if !self.skipped_targets.is_empty() {
            "partial"
        } else {
            "ok"
        }
    }
}

/// Labels: sweep result (`ok`, `partial`, `skipped`, `interrupted`).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SweepLabels {
    /// Result.
    pub result: String,
}

/// Labels: provider.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ProviderLabel {
    /// Provider name.
    pub provider: String,
}

/// Labels: provider and orphan reason (`no-proxy`, `duplicate`).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OrphanLabels {
    /// Provider name.
    pub provider: String,
    /// Reason.
    pub reason: String,
}

/// Labels: provider and delete outcome (`ok` or the error class).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DeleteLabels {
    /// Provider name.
    pub provider: String,
    /// Outcome.
    pub outcome: String,
}

/// Labels: provider and target.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TargetLabels {
    /// Provider name.
    pub provider: String,
    /// Target (host) name.
    pub target: String,
}

/// Garbage collector metrics.
#[derive(Debug, Clone, Default)]
pub struct GcMetrics {
    sweeps: Family<SweepLabels, Counter>,
    seen: Family<ProviderLabel, Counter>,
    orphans: Family<OrphanLabels, Counter>,
    deletes: Family<DeleteLabels, Counter>,
    skipped: Family<TargetLabels, Counter>,
    last_sweep_timestamp: Gauge<f64, AtomicU64>,
    last_sweep_duration: Gauge<f64, AtomicU64>,
}

impl GcMetrics {
    /// Metrics registered under `egress_gc_*`.
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self::default();
        registry.register(
            "egress_gc_sweeps",
            "garbage collection sweeps by result (ok, partial, skipped, interrupted)",
            m.sweeps.clone(),
        );
        registry.register(
            "egress_gc_instances_seen",
            "instances listed by garbage collection sweeps, by provider",
            m.seen.clone(),
        );
        registry.register(
            "egress_gc_orphans",
            "instances past the grace period found to be collected, by provider and reason",
            m.orphans.clone(),
        );
        registry.register(
            "egress_gc_deletes",
            "deletes by the garbage collector, by provider and outcome (ok or error class)",
            m.deletes.clone(),
        );
        registry.register(
            "egress_gc_targets_skipped",
            "targets skipped by a sweep because their listing failed",
            m.skipped.clone(),
        );
        registry.register(
            "egress_gc_last_sweep_timestamp_seconds",
            "when the last sweep that ran to its end finished (Unix time)",
            m.last_sweep_timestamp.clone(),
        );
        registry.register(
            "egress_gc_last_sweep_duration_seconds",
            "how long the last sweep that ran to its end took",
            m.last_sweep_duration.clone(),
        );
        m
    }

    /// Sweeps counted with this result (for tests).
    pub fn sweeps(&self, result: &str) -> u64 {
        self.sweeps
            .get_or_create(&SweepLabels {
                result: result.into(),
            })
            .get()
    }

    /// Deletes counted with this outcome (for tests).
    pub fn deletes(&self, provider: &str, outcome: &str) -> u64 {
        self.deletes
            .get_or_create(&DeleteLabels {
                provider: provider.into(),
                outcome: outcome.into(),
            })
            .get()
    }

    fn record(&self, report: &GcReport, finished: Timestamp, took: Duration) {
        self.sweeps
            .get_or_create(&SweepLabels {
                result: report.result().into(),
            })
            .inc();
        for s in &report.seen {
            self.seen
                .get_or_create(&ProviderLabel {
                    provider: s.provider.clone(),
                })
                .inc();
        }
        for t in &report.skipped_targets {
            self.skipped
                .get_or_create(&TargetLabels {
                    provider: t.provider.clone(),
                    target: t.target.clone(),
                })
                .inc();
        }
        let judged = report
            .deleted
            .iter()
            .map(|d| (&d.instance, &d.reason, "ok"))
            .chain(
                report
                    .failed
                    .iter()
                    .map(|f| (&f.instance, &f.reason, f.error.class().as_str())),
            );
        for (instance, reason, outcome) in judged {
            self.orphans
                .get_or_create(&OrphanLabels {
                    provider: instance.provider.clone(),
                    reason: reason.as_str().into(),
                })
                .inc();
            self.deletes
                .get_or_create(&DeleteLabels {
                    provider: instance.provider.clone(),
                    outcome: outcome.into(),
                })
                .inc();
        }
        if report.owners_error.is_none() && !report.interrupted {
            self.last_sweep_timestamp
                .set(finished.as_millisecond() as f64 / 1000.0);
            self.last_sweep_duration.set(took.as_secs_f64());
        }
    }
}

/// Decides one instance's fate. Pure, so every rule is tested on its own.
fn judge(
    instance: &Instance,
    owners: &HashMap<String, Owner>,
    now: Timestamp,
    grace: SignedDuration,
) -> Result<OrphanReason, KeepReason> {
    if instance.proxy.uid.is_empty() {
        return Err(KeepReason::NoOwnerUid);
    }
    let reason = match owners.get(&instance.proxy.uid) {
        None => OrphanReason::NoProxy,
        Some(owner) => match &owner.instance_id {
            None => return Err(KeepReason::NotYetNamed),
            Some(named) if *named == instance.id => return Err(KeepReason::Named),
            Some(named) => OrphanReason::Duplicate {
                named: named.clone(),
            },
        },
    };
    let Ok(created) = instance.created_at.parse::<Timestamp>() else {
        return Err(KeepReason::Undatable {
            created_at: instance.created_at.clone(),
        });
    };
    let age = now.duration_since(created);
    if age <= grace {
        return Err(KeepReason::Young {
            age_seconds: age.as_secs(),
        });
    }
    Ok(reason)
}

/// Lets [`GarbageCollector::run`] stop a sweep between deletes, and tells it whether a
/// delete is in flight (then it waits for it instead of dropping it half-way).
#[derive(Debug, Default)]
struct SweepControl {
    stop: AtomicBool,
    in_delete: AtomicBool,
}

/// Where "now" comes from; injectable so the grace period is tested without sleeping.
pub type Clock = Arc<dyn Fn() -> Timestamp + Send + Sync>;

/// Sweeps every provider for instances to collect.
pub struct GarbageCollector {
    providers: Vec<SharedProvider>,
    index: Arc<dyn ProxyIndex>,
    period: Duration,
    grace: SignedDuration,
    metrics: GcMetrics,
    clock: Clock,
}

impl std::fmt::Debug for GarbageCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let providers: Vec<&str> = self.providers.iter().map(|p| p.name()).collect();
        f.debug_struct("GarbageCollector")
            .field("providers", &providers)
            .field("period", &self.period)
            .field("grace", &self.grace)
            .finish_non_exhaustive()
    }
}

impl GarbageCollector {
    /// A collector over `providers`, with period and grace period from `config`.
    pub fn new(
        providers: Vec<SharedProvider>,
        index: Arc<dyn ProxyIndex>,
        config: &GcConfig,
        metrics: GcMetrics,
    ) -> Self {
        Self {
            providers,
            index,
            // A zero period would make `tokio::time::interval` panic; the schema forbids
            // it, this keeps a hand-built config from crashing the operator.
            period: Duration::from_secs(u64::from(config.period_seconds.max(1))),
            grace: SignedDuration::from_secs(i64::from(config.grace_period_seconds)),
            metrics,
            clock: Arc::new(Timestamp::now),
        }
    }

    /// Replaces the clock (tests).
    pub fn with_clock(mut self, clock: impl Fn() -> Timestamp + Send + Sync + 'static) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    /// The metrics.
    pub fn metrics(&self) -> &GcMetrics {
        &self.metrics
    }

    /// One sweep at the clock's "now".
    pub async fn sweep_once(&self) -> GcReport {
        self.sweep(&SweepControl::default()).await
    }

    async fn sweep(&self, ctl: &SweepControl) -> GcReport {
        let started = Instant::now();
        let now = (self.clock)();
        let mut report = GcReport::default();

        // Instances first, Proxies second: a Proxy that existed when an instance was
        // listed is then always in the owner set, so only the grace period has to cover
        // Proxies created during the sweep.
        let mut candidates: Vec<(&SharedProvider, Instance)> = Vec::new();
        for provider in &self.providers {
            for listing in provider.list().await {
                match listing.result {
                    Ok(instances) => {
                        for instance in instances {
                            report.seen.push(InstanceRef {
                                provider: provider.name().into(),
                                id: instance.id.clone(),
                            });
                            candidates.push((provider, instance));
                        }
                    }
                    Err(e) => {
                        tracing::warn!(provider = provider.name(), target = %listing.target, class = %e.class(), error = %e, "gc: listing failed; target skipped this round");
                        report.skipped_targets.push(SkippedTarget {
                            provider: provider.name().into(),
                            target: listing.target,
                            class: e.class(),
                            message: e.to_string(),
                        });
                    }
                }
            }
        }

        let owners = match self.index.owners().await {
            Ok(o) => o,
            Err(e) => {
                tracing::warn!(class = %e.class(), error = %e, "gc: cannot list Proxies; nothing is deleted this round");
                report.owners_error = Some(e);
                self.finish(&report, started);
                return report;
            }
        };

        for (provider, instance) in candidates {
            let at = InstanceRef {
                provider: provider.name().into(),
                id: instance.id.clone(),
            };
            let reason = match judge(&instance, &owners, now, self.grace) {
                Ok(reason) => reason,
                Err(keep) => {
                    if let KeepReason::Undatable { created_at } = &keep {
                        tracing::warn!(provider = provider.name(), instance = %instance.id, created_at, "gc: creation time unreadable; instance kept");
                    }
                    report.kept.push(Kept {
                        instance: at,
                        reason: keep,
                    });
                    continue;
                }
            };
            if ctl.stop.load(Ordering::SeqCst) {
                report.interrupted = true;
                break;
            }
            ctl.in_delete.store(true, Ordering::SeqCst);
            let outcome = provider.delete(&instance.id).await;
            ctl.in_delete.store(false, Ordering::SeqCst);
            match outcome {
                Ok(()) => {
                    tracing::info!(
                        provider = provider.name(),
                        instance = %instance.id,
                        proxy_uid = %instance.proxy.uid,
                        proxy = %format_args!("{}/{}", instance.proxy.namespace, instance.proxy.name),
                        reason = reason.as_str(),
                        "gc: deleted instance"
                    );
                    report.deleted.push(Deleted {
                        instance: at,
                        proxy_uid: instance.proxy.uid.clone(),
                        reason,
                    });
                }
                Err(source) => {
                    let error = GcError::Delete {
                        provider: provider.name().into(),
                        instance: instance.id.clone(),
                        source,
                    };
                    tracing::warn!(proxy_uid = %instance.proxy.uid, reason = reason.as_str(), class = %error.class(), error = %error, "gc: delete failed");
                    report.failed.push(FailedDelete {
                        instance: at,
                        reason,
                        error,
                    });
                }
            }
        }
        self.finish(&report, started);
        report
    }

    fn finish(&self, report: &GcReport, started: Instant) {
        let took = started.elapsed();
        self.metrics.record(report, Timestamp::now(), took);
        tracing::info!(
            result = report.result(),
            seen = report.seen.len(),
            kept = report.kept.len(),
            deleted = report.deleted.len(),
            failed = report.failed.len(),
            skipped_targets = report.skipped_targets.len(),
            duration_ms = took.as_millis() as u64,
            "gc: sweep done"
        );
    }

    /// Sweeps every period until `shutdown` completes. On shutdown a sweep stops at once,
    /// except that a delete in flight is finished (a half-done delete would leave
    /// volumes behind until the next sweep).
    pub async fn run(self, shutdown: impl Future<Output = ()>) {
        let mut shutdown = std::pin::pin!(shutdown);
        let mut ticks = tokio::time::interval(self.period);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tracing::info!(
            period_s = self.period.as_secs(),
            grace_s = self.grace.as_secs(),
            "gc: started"
        );
        loop {
            tokio::select! {
                biased;
                () = &mut shutdown => break,
                _ = ticks.tick() => {}
            }
            let ctl = SweepControl::default();
            let mut sweep = std::pin::pin!(self.sweep(&ctl));
            let stopped = tokio::select! {
                biased;
                _ = &mut sweep => false,
                () = &mut shutdown => true,
            };
            if stopped {
                ctl.stop.store(true, Ordering::SeqCst);
                if ctl.in_delete.load(Ordering::SeqCst) {
                    let _ = sweep.await;
                }
                break;
            }
        }
        tracing::info!("gc: stopped");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::provider::fake::FakeProvider;
    use crate::provider::{
        CreateRequest, InstanceState, Provider, ProviderError, ProxyRef, TargetListing,
    };
    use tokio::sync::Notify;

    const GRACE: u32 = 600;

    fn now() -> Timestamp {
        "2026-03-01T12:00:00Z".parse().unwrap()
    }

    fn ago(secs: i64) -> String {
        (now() - SignedDuration::from_secs(secs)).to_string()
    }

    fn id(host: &str, name: &str) -> InstanceId {
        InstanceId {
            host: host.into(),
            name: name.into(),
        }
    }

    fn instance(host: &str, uid: &str, created_at: &str) -> Instance {
        Instance {
            id: id(host, &format!("egress-{uid}")),
            proxy: ProxyRef {
                namespace: "ns".into(),
                name: format!("p-{uid}"),
                uid: uid.into(),
            },
            state: InstanceState::Running,
            addresses: vec![],
            created_at: created_at.into(),
        }
    }

    fn owner(instance_id: Option<InstanceId>) -> Owner {
        Owner {
            namespace: "ns".into(),
            name: "p".into(),
            instance_id,
            deleting: false,
        }
    }

    fn collector(
        providers: Vec<SharedProvider>,
        index: Arc<FakeProxyIndex>,
        metrics: GcMetrics,
    ) -> GarbageCollector {
        let config = GcConfig {
            period_seconds: 3600,
            grace_period_seconds: GRACE,
        };
        GarbageCollector::new(providers, index, &config, metrics).with_clock(now)
    }

    fn setup(targets: &[&str]) -> (Arc<FakeProvider>, Arc<FakeProxyIndex>, GarbageCollector) {
        let fake = Arc::new(FakeProvider::new(targets));
        let index = Arc::new(FakeProxyIndex::new());
        let gc = collector(vec![fake.clone()], index.clone(), GcMetrics::default());
        (fake, index, gc)
    }

    fn ids(fake: &FakeProvider) -> Vec<InstanceId> {
        fake.instances().into_iter().map(|i| i.id).collect()
    }

    fn deletes(fake: &FakeProvider) -> usize {
        fake.calls().iter().filter(|c| **c == "delete").count()
    }

    #[tokio::test]
    async fn an_orphan_past_the_grace_period_is_deleted() {
        let (fake, _index, gc) = setup(&["a"]);
        fake.insert(instance("a", "u1", &ago(i64::from(GRACE) + 1)));
        let report = gc.sweep_once().await;
        assert_eq!(report.deleted_ids(), vec![&id("a", "egress-u1")]);
        assert_eq!(report.deleted[0].reason, OrphanReason::NoProxy);
        assert_eq!(report.deleted[0].proxy_uid, "u1");
        assert!(ids(&fake).is_empty());
    }

    #[tokio::test]
    async fn an_orphan_within_the_grace_period_is_kept() {
        let (fake, _index, gc) = setup(&["a"]);
        fake.insert(instance("a", "u1", &ago(i64::from(GRACE) - 1)));
        let report = gc.sweep_once().await;
        assert!(report.deleted.is_empty());
        assert!(matches!(
            report.kept_reason(&id("a", "egress-u1")),
            Some(KeepReason::Young { age_seconds: 599 })
        ));
        assert_eq!(deletes(&fake), 0);
        assert_eq!(ids(&fake).len(), 1);
    }

    #[tokio::test]
    async fn an_instance_that_cannot_be_dated_is_kept() {
        let (fake, _index, gc) = setup(&["a"]);
        fake.insert(instance("a", "u1", "last tuesday"));
        let report = gc.sweep_once().await;
        assert_eq!(
            report.kept_reason(&id("a", "egress-u1")),
            Some(&KeepReason::Undatable {
                created_at: "last tuesday".into()
            })
        );
        assert_eq!(deletes(&fake), 0);
    }

    #[tokio::test]
    async fn a_failed_target_listing_skips_that_target_only() {
        let (fake, _index, gc) = setup(&["a", "b"]);
        fake.insert(instance("a", "u1", &ago(7200)));
        fake.insert(instance("b", "u2", &ago(7200)));
        fake.set_down("a", true);
        let report = gc.sweep_once().await;
        assert_eq!(report.skipped_targets.len(), 1);
        assert_eq!(report.skipped_targets[0].target, "a");
        assert_eq!(report.skipped_targets[0].class, ErrorClass::Transient);
        assert_eq!(report.deleted_ids(), vec![&id("b", "egress-u2")]);
        assert!(report.failed.is_empty(), "no delete was tried on target a");
        assert_eq!(deletes(&fake), 1);
        assert_eq!(ids(&fake), vec![id("a", "egress-u1")]);
        assert_eq!(gc.metrics().sweeps("partial"), 1);
    }

    #[tokio::test]
    async fn a_failed_proxy_listing_deletes_nothing() {
        let (fake, index, gc) = setup(&["a", "b"]);
        fake.insert(instance("a", "u1", &ago(7200)));
        fake.insert(instance("b", "u2", &ago(7200)));
        index.fail_next(ErrorClass::Transient);
        let report = gc.sweep_once().await;
        assert!(report.owners_error.is_some());
        assert!(report.deleted.is_empty() && report.failed.is_empty());
        assert_eq!(deletes(&fake), 0);
        assert_eq!(ids(&fake).len(), 2);
        assert_eq!(gc.metrics().sweeps("skipped"), 1);
        // The same instances are collected once the Proxies can be listed.
        let report = gc.sweep_once().await;
        assert_eq!(report.deleted.len(), 2);
    }

    #[tokio::test]
    async fn a_duplicate_past_the_grace_period_is_deleted_and_the_named_one_kept() {
        let (fake, index, gc) = setup(&["a", "b", "c"]);
        let named = id("a", "egress-u1");
        index.insert("u1", owner(Some(named.clone())));
        fake.insert(instance("a", "u1", &ago(7200)));
        fake.insert(instance("b", "u1", &ago(7200)));
        fake.insert(instance("c", "u1", &ago(10)));
        let report = gc.sweep_once().await;
        assert_eq!(report.deleted_ids(), vec![&id("b", "egress-u1")]);
        assert_eq!(
            report.deleted[0].reason,
            OrphanReason::Duplicate {
                named: named.clone()
            }
        );
        assert_eq!(report.kept_reason(&named), Some(&KeepReason::Named));
        assert!(matches!(
            report.kept_reason(&id("c", "egress-u1")),
            Some(KeepReason::Young { .. })
        ));
        assert_eq!(ids(&fake), vec![named, id("c", "egress-u1")]);
    }

    #[tokio::test]
    async fn a_proxy_that_names_no_instance_yet_keeps_all_of_its_instances() {
        let (fake, index, gc) = setup(&["a", "b"]);
        index.insert("u1", owner(None));
        fake.insert(instance("a", "u1", &ago(7200)));
        fake.insert(instance("b", "u1", &ago(7200)));
        let report = gc.sweep_once().await;
        assert!(report.deleted.is_empty());
        assert_eq!(
            report.kept_reason(&id("a", "egress-u1")),
            Some(&KeepReason::NotYetNamed)
        );
        assert_eq!(
            report.kept_reason(&id("b", "egress-u1")),
            Some(&KeepReason::NotYetNamed)
        );
        assert_eq!(deletes(&fake), 0);
    }

    #[tokio::test]
    async fn an_instance_without_an_owner_uid_is_kept() {
        let (fake, _index, gc) = setup(&["a"]);
        fake.insert(instance("a", "", &ago(7200)));
        let report = gc.sweep_once().await;
        assert_eq!(
            report.kept_reason(&id("a", "egress-")),
            Some(&KeepReason::NoOwnerUid)
        );
        assert_eq!(deletes(&fake), 0);
    }

    #[tokio::test]
    async fn a_failed_delete_does_not_stop_the_sweep() {
        let (fake, _index, gc) = setup(&["a"]);
        for uid in ["u1", "u2", "u3"] {
            fake.insert(instance("a", uid, &ago(7200)));
        }
        fake.fail_next("delete", ErrorClass::Transient);
        let report = gc.sweep_once().await;
        assert_eq!(report.failed.len(), 1);
        assert_eq!(report.failed[0].error.class(), ErrorClass::Transient);
        assert_eq!(report.failed[0].instance.id, id("a", "egress-u1"));
        assert_eq!(report.deleted.len(), 2);
        assert_eq!(ids(&fake), vec![id("a", "egress-u1")]);
        assert_eq!(gc.metrics().deletes("fake", "transient"), 1);
        assert_eq!(gc.metrics().deletes("fake", "ok"), 2);
    }

    #[tokio::test]
    async fn a_sweep_is_counted_in_the_metrics() {
        let mut registry = Registry::default();
        let metrics = GcMetrics::register(&mut registry);
        let fake = Arc::new(FakeProvider::new(&["a", "b"]));
        let index = Arc::new(FakeProxyIndex::new());
        let gc = collector(vec![fake.clone()], index.clone(), metrics);
        index.insert("u2", owner(Some(id("a", "egress-u2"))));
        fake.insert(instance("a", "u1", &ago(7200)));
        fake.insert(instance("a", "u2", &ago(7200)));
        fake.insert(instance("a", "u3", &ago(7200)));
        fake.set_down("b", true);
        fake.fail_next("delete", ErrorClass::Quota);
        gc.sweep_once().await;

        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        for line in [
            "egress_gc_sweeps_total{result=\"partial\"} 1",
            "egress_gc_instances_seen_total{provider=\"fake\"} 3",
            "egress_gc_orphans_total{provider=\"fake\",reason=\"no-proxy\"} 2",
            "egress_gc_deletes_total{provider=\"fake\",outcome=\"quota\"} 1",
            "egress_gc_deletes_total{provider=\"fake\",outcome=\"ok\"} 1",
            "egress_gc_targets_skipped_total{provider=\"fake\",target=\"b\"} 1",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} missing in\n{text}");
        }
        let stamp = text
            .lines()
            .find_map(|l| l.strip_prefix("egress_gc_last_sweep_timestamp_seconds "))
            .unwrap();
        assert!(stamp.parse::<f64>().unwrap() > 1.0e9, "{text}");
        assert!(
            text.lines()
                .any(|l| l.starts_with("egress_gc_last_sweep_duration_seconds ")),
            "{text}"
        );
    }

    #[tokio::test]
    async fn run_stops_on_shutdown() {
        let (fake, index, gc) = setup(&["a"]);
        fake.insert(instance("a", "u1", &ago(7200)));
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(gc.run(async move {
            let _ = rx.await;
        }));
        // The first tick is immediate: wait for that sweep, then ask to stop while the
        // collector waits an hour for the next one.
        tokio::time::timeout(Duration::from_secs(5), async {
            while ids(&fake).len() == 1 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .unwrap();
        assert_eq!(index.calls(), 1);
        tx.send(()).unwrap();
        tokio::time::timeout(Duration::from_secs(5), task)
            .await
            .expect("run() did not stop on shutdown")
            .unwrap();
    }

    /// Delegates to a [`FakeProvider`], but every delete waits to be released.
    struct Gated {
        inner: Arc<FakeProvider>,
        entered: Notify,
        release: Notify,
    }

    impl Provider for Gated {
        fn name(&self) -> &str {
            "gated"
        }
        fn create<'a>(
            &'a self,
            req: &'a CreateRequest,
        ) -> BoxFuture<'a, Result<Instance, ProviderError>> {
            self.inner.create(req)
        }
        fn get<'a>(&'a self, id: &'a InstanceId) -> BoxFuture<'a, Result<Instance, ProviderError>> {
            self.inner.get(id)
        }
        fn delete<'a>(&'a self, id: &'a InstanceId) -> BoxFuture<'a, Result<(), ProviderError>> {
            Box::pin(async move {
                self.entered.notify_one();
                self.release.notified().await;
                self.inner.delete(id).await
            })
        }
        fn list(&self) -> BoxFuture<'_, Vec<TargetListing>> {
            self.inner.list()
        }
    }

    #[tokio::test]
    async fn shutdown_during_a_delete_finishes_that_delete_and_starts_no_other() {
        let fake = Arc::new(FakeProvider::new(&["a"]));
        fake.insert(instance("a", "u1", &ago(7200)));
        fake.insert(instance("a", "u2", &ago(7200)));
        let gated = Arc::new(Gated {
            inner: fake.clone(),
            entered: Notify::new(),
            release: Notify::new(),
        });
        let index = Arc::new(FakeProxyIndex::new());
        let gc = collector(vec![gated.clone()], index, GcMetrics::default());
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(gc.run(async move {
            let _ = rx.await;
        }));
        tokio::time::timeout(Duration::from_secs(5), gated.entered.notified())
            .await
            .unwrap();
        tx.send(()).unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(
            !task.is_finished(),
            "run() returned with a delete in flight"
        );
        gated.release.notify_one();
        tokio::time::timeout(Duration::from_secs(5), task)
            .await
            .expect("run() did not stop after the delete")
            .unwrap();
        assert_eq!(
            ids(&fake),
            vec![id("a", "egress-u2")],
            "first delete done, second not started"
        );
    }

    #[test]
    fn owners_come_from_uid_status_and_deletion_timestamp() {
        use crate::api::proxy::{ProxySpec, ProxyStatus};
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

        let mut p = Proxy::new("web", ProxySpec::default());
        p.metadata.namespace = Some("ns".into());
        assert_eq!(owner_of(&p), None, "no UID: cannot be keyed");

        p.metadata.uid = Some("u1".into());
        let (uid, o) = owner_of(&p).unwrap();
        assert_eq!(uid, "u1");
        assert_eq!((o.namespace.as_str(), o.name.as_str()), ("ns", "web"));
        assert_eq!(o.instance_id, None);
        assert!(!o.deleting);

        p.status = Some(ProxyStatus {
            instance_id: Some("kvm-a/egress-u1".into()),
            ..Default::default()
        });
        p.metadata.deletion_timestamp = Some(Time(now()));
        let (_, o) = owner_of(&p).unwrap();
        assert_eq!(o.instance_id, Some(id("kvm-a", "egress-u1")));
        assert!(o.deleting);

        p.status = Some(ProxyStatus {
            instance_id: Some("not an id".into()),
            ..Default::default()
        });
        assert_eq!(owner_of(&p).unwrap().1.instance_id, None);
    }

    /// The Kubernetes index against a mock API server: it follows continue tokens across
    /// pages, keys owners by UID with the instance their status names, and a failing page
    /// fails the whole listing (never a partial owner set, which would read as orphans).
    #[tokio::test]
    async fn the_kubernetes_index_reads_every_page_and_fails_whole() {
        use http::{Request, Response};
        use kube::client::Body;

        let proxy = |name: &str, uid: &str, instance: Option<&str>| {
            serde_json::json!({
                "apiVersion": "egress-operator.dev/v1alpha1", "kind": "Proxy",
                "metadata": {"name": name, "namespace": "ns", "uid": uid},
                "spec": {"provider": "kvm2"},
                "status": instance.map(|i| serde_json::json!({"instanceId": i})),
            })
        };
        let page = |items: Vec<serde_json::Value>, next: &str| {
            serde_json::json!({
                "apiVersion": "egress-operator.dev/v1alpha1", "kind": "ProxyList",
                "metadata": {"resourceVersion": "9", "continue": next}, "items": items,
            })
        };
        for fail_second_page in [false, true] {
            let (service, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
            let pages = vec![
                page(vec![proxy("a", "u-a", Some("h1/egress-u-a"))], "tok-1"),
                page(vec![proxy("b", "u-b", None)], ""),
            ];
            let server = tokio::spawn(async move {
                let mut queries = Vec::new();
                for (n, body) in pages.into_iter().enumerate() {
                    let (request, send) = handle.next_request().await.expect("a list request");
                    assert_eq!(
                        request.uri().path(),
                        "/apis/egress-operator.dev/v1alpha1/proxies"
                    );
                    queries.push(request.uri().query().unwrap_or_default().to_string());
                    let (code, body) = if n == 1 && fail_second_page {
                        (
                            503,
                            serde_json::json!({"kind": "Status", "apiVersion": "v1",
                                "status": "Failure", "code": 503, "message": "busy"}),
                        )
                    } else {
                        (200, body)
                    };
                    send.send_response(
                        Response::builder()
                            .status(code)
                            .body(Body::from(serde_json::to_vec(&body).unwrap()))
                            .unwrap(),
                    );
                }
                queries
            });
            let index = KubeProxyIndex::new(kube::Client::new(service, "default"));
            let result = index.owners().await;
            let queries = server.await.unwrap();
            assert!(queries[0].contains("limit=500"), "{queries:?}");
            assert!(queries[1].contains("continue=tok-1"), "{queries:?}");
            if fail_second_page {
                let e = result.unwrap_err();
                assert_eq!(e.class(), ErrorClass::Transient, "{e}");
            } else {
                let owners = result.unwrap();
                assert_eq!(owners.len(), 2, "{owners:?}");
                assert_eq!(
                    owners["u-a"].instance_id,
                    Some(InstanceId::parse("h1/egress-u-a").unwrap())
                );
                assert_eq!(owners["u-b"].instance_id, None);
                assert_eq!(owners["u-b"].name, "b");
            }
        }
    }
}
