//! The provider health monitor: every period, checks each provider's targets, records the
//! result on that provider's [`HealthBoard`] (so placement skips dead hosts) and writes
//! it to the provider's `ProviderHealth` object (so people and alerting see it). A
//! provider's template plugins, when it has any ([`HealthMonitor::with_plugins`]), are
//! reported in the same status (`plugins`): loading, loaded or failed, with the reason.
//!
//! Kubernetes is reached only through [`HealthSink`], so the monitor's logic is tested
//! against a fake and [`KubeSink`] alone against a mock API server. A failed write is
//! logged, counted and simply written again by the next round; nothing here stops the
//! monitor except shutdown.

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kube::api::{Patch, PatchParams};
use kube::{Api, Resource as _};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use tokio::sync::watch;
use tokio::time::MissedTickBehavior;

use crate::api::provider_health::{
    PluginHealthStatus, PluginState, ProviderHealth, ProviderHealthStatus, TargetHealthStatus,
};
use crate::config::HealthCheckConfig;
use crate::provider::health::HealthBoard;
use crate::provider::{BoxFuture, SharedProvider, TargetHealth};
use crate::templates::{PluginHealth, TemplateSet};

/// Field manager of every write, so server-side apply knows these fields are ours.
pub const FIELD_MANAGER: &str = "egress-operator";

/// Why a sink could not write.
pub type SinkError = Box<dyn std::error::Error + Send + Sync>;

/// Where the monitor's results go (the cluster, or a fake in tests).
pub trait HealthSink: Send + Sync {
    /// Writes one provider's latest status, creating its object if needed.
    fn write<'a>(
        &'a self,
        provider: &'a str,
        status: &'a ProviderHealthStatus,
    ) -> BoxFuture<'a, Result<(), SinkError>>;
}

/// Writes `ProviderHealth` objects with server-side apply.
pub struct KubeSink {
    api: Api<ProviderHealth>,
    /// Providers whose object this process has applied; applying it every round would
    /// double the writes for nothing.
    applied: Mutex<BTreeSet<String>>,
}

impl std::fmt::Debug for KubeSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeSink").finish_non_exhaustive()
    }
}

impl KubeSink {
    /// A sink over this client (the objects are cluster-scoped).
    pub fn new(client: kube::Client) -> Self {
        Self {
            api: Api::all(client),
            applied: Mutex::default(),
        }
    }

    fn applied(&self) -> std::sync::MutexGuard<'_, BTreeSet<String>> {
        match self.applied.lock() {
            Ok(a) => a,
            Err(p) => p.into_inner(),
        }
    }

    fn params() -> PatchParams {
        PatchParams::apply(FIELD_MANAGER)
            .force()
            .validation_strict()
    }

    async fn apply_object(&self, provider: &str) -> Result<(), kube::Error> {
        let body = serde_json::json!({
            "apiVersion": ProviderHealth::api_version(&()),
            "kind": ProviderHealth::kind(&()),
            "metadata": { "name": provider },
            "spec": { "provider": provider },
        });
        self.api
            .patch(provider, &Self::params(), &Patch::Apply(body))
            .await?;
        self.applied().insert(provider.to_string());
        Ok(())
    }

    async fn apply_status(
        &self,
        provider: &str,
        status: &ProviderHealthStatus,
    ) -> Result<(), kube::Error> {
        let body = serde_json::json!({
            "apiVersion": ProviderHealth::api_version(&()),
            "kind": ProviderHealth::kind(&()),
            "metadata": { "name": provider },
            "status": status,
        });
        // Without the fields an older installed CRD lacks, when it must (issue 33, item
        // 12): a ProviderHealth has no events of its own, so the warn log tells of it.
        if let crate::status_apply::Applied::Dropped(what) =
            crate::status_apply::apply_status(&self.api, provider, FIELD_MANAGER, &body, None)
                .await?
        {
            tracing::warn!(%provider, unknown = %what, "ProviderHealth status written without fields the installed CRD does not know");
        }
        Ok(())
    }

    async fn write_inner(
        &self,
        provider: &str,
        status: &ProviderHealthStatus,
    ) -> Result<(), kube::Error> {
        if !self.applied().contains(provider) {
            self.apply_object(provider).await?;
        }
        match self.apply_status(provider, status).await {
            // Someone deleted the object since we applied it: make it again, once.
            Err(kube::Error::Api(s)) if s.is_not_found() => {
                self.applied().remove(provider);
                self.apply_object(provider).await?;
                self.apply_status(provider, status).await
            }
            other => other,
        }
    }
}

impl HealthSink for KubeSink {
    fn write<'a>(
        &'a self,
        provider: &'a str,
        status: &'a ProviderHealthStatus,
    ) -> BoxFuture<'a, Result<(), SinkError>> {
        Box::pin(async move {
            self.write_inner(provider, status)
                .await
                .map_err(|e| Box::new(e) as SinkError)
        })
    }
}

/// Labels of the per-target metrics.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TargetLabels {
    /// Provider name.
    pub provider: String,
    /// Target (host) name.
    pub target: String,
}

/// Labels of the per-provider metrics.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ProviderLabels {
    /// Provider name.
    pub provider: String,
}

/// Metrics of the monitor.
#[derive(Debug, Clone)]
pub struct HealthMetrics {
    up: Family<TargetLabels, Gauge>,
    latency: Family<TargetLabels, Histogram, fn() -> Histogram>,
    write_failures: Family<ProviderLabels, Counter>,
}

fn latency_histogram() -> Histogram {
    // A healthy check is a few round trips; a dead host takes the whole timeout.
    Histogram::new([
        0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    ])
}

impl Default for HealthMetrics {
    fn default() -> Self {
        Self {
            up: Family::default(),
            latency: Family::new_with_constructor(latency_histogram as fn() -> Histogram),
            write_failures: Family::default(),
        }
    }
}

impl HealthMetrics {
    /// Metrics registered under `egress_provider_*`.
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self::default();
        registry.register(
            "egress_provider_target_up",
            "1 when the last check found the target reachable, else 0",
            m.up.clone(),
        );
        registry.register(
            "egress_provider_health_check_seconds",
            "how long a target's health check took",
            m.latency.clone(),
        );
        registry.register(
            "egress_provider_health_write_failures",
            "ProviderHealth writes that failed (retried next round)",
            m.write_failures.clone(),
        );
        m
    }

    /// The up gauge of a target (for tests).
    pub fn target_up(&self, provider: &str, target: &str) -> i64 {
        self.up
            .get_or_create(&target_labels(provider, target))
            .get()
    }

    /// Failed writes of a provider (for tests).
    pub fn write_failures(&self, provider: &str) -> u64 {
        self.write_failures
            .get_or_create(&ProviderLabels {
                provider: provider.into(),
            })
            .get()
    }

    fn observe(&self, provider: &str, t: &TargetHealth) {
        let labels = target_labels(provider, &t.target);
        self.up.get_or_create(&labels).set(i64::from(t.reachable));
        self.latency
            .get_or_create(&labels)
            .observe(t.latency.as_secs_f64());
    }
}

fn target_labels(provider: &str, target: &str) -> TargetLabels {
    TargetLabels {
        provider: provider.into(),
        target: target.into(),
    }
}

/// Timing of the monitor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MonitorOptions {
    /// Time between the starts of two rounds.
    pub period: Duration,
    /// Budget of one target's check (the provider enforces it).
    pub timeout: Duration,
    /// Budget of one provider's whole check, in case the provider does not keep to
    /// `timeout`: past it, every target of that provider is reported as timed out.
    pub round_timeout: Duration,
    /// Budget of one ProviderHealth write: a stalled API connection must not hold up the
    /// next round (the board, which placement reads, is updated before the write).
    pub write_timeout: Duration,
}

/// Default budget of one ProviderHealth write: an API server answers a small apply in
/// milliseconds; past this it is stuck, and the next round writes again.
pub const DEFAULT_WRITE_TIMEOUT: Duration = Duration::from_secs(10);

impl MonitorOptions {
    /// From the config; the outer budget is twice the target budget plus a second, so a
    /// provider that checks its targets one after the other still fits a few.
    pub fn from_config(c: &HealthCheckConfig) -> Self {
        let timeout = Duration::from_secs(u64::from(c.timeout_seconds));
        Self {
            period: Duration::from_secs(u64::from(c.period_seconds)),
            timeout,
            round_timeout: timeout.saturating_mul(2) + Duration::from_secs(1),
            write_timeout: DEFAULT_WRITE_TIMEOUT,
        }
    }
}

/// What the monitor reads the time from (tests pin it).
pub type Clock = Arc<dyn Fn() -> jiff::Timestamp + Send + Sync>;

/// The monitor. Build it, keep [`HealthMonitor::readiness`] if needed, then spawn
/// [`HealthMonitor::run`].
pub struct HealthMonitor {
    providers: Vec<SharedProvider>,
    boards: BTreeMap<String, HealthBoard>,
    /// Template plugins of each provider that has them, read at every round.
    plugins: BTreeMap<String, PluginSource>,
    sink: Arc<dyn HealthSink>,
    options: MonitorOptions,
    metrics: HealthMetrics,
    clock: Clock,
    checked: watch::Sender<bool>,
    /// Target names of each provider's last answered check, in its order: what a check
    /// that hangs past the round budget is reported for.
    known: Mutex<BTreeMap<String, Vec<String>>>,
}

impl std::fmt::Debug for HealthMonitor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HealthMonitor")
            .field(
                "providers",
                &self.providers.iter().map(|p| p.name()).collect::<Vec<_>>(),
            )
            .field("boards", &self.boards.keys().collect::<Vec<_>>())
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

impl HealthMonitor {
    /// A monitor of `providers` (those without a health capability are ignored).
    /// `boards` maps a provider name to the board its placement reads; a provider
    /// without one is only reported.
    pub fn new(
        providers: Vec<SharedProvider>,
        boards: BTreeMap<String, HealthBoard>,
        sink: Arc<dyn HealthSink>,
        options: MonitorOptions,
        metrics: HealthMetrics,
    ) -> Self {
        Self {
            providers,
            boards,
            plugins: BTreeMap::new(),
            sink,
            options,
            metrics,
            clock: Arc::new(jiff::Timestamp::now),
            checked: watch::Sender::new(false),
            known: Mutex::default(),
        }
    }

    /// Reports `plugins` in `provider`'s status at every round.
    pub fn with_plugins(mut self, provider: &str, plugins: Arc<TemplateSet>) -> Self {
        self.plugins
            .insert(provider.to_string(), PluginSource::Fixed(plugins));
        self
    }

    /// Reports the plugins of the config in force in `live` (a reload replaces them).
    pub fn with_live_plugins(
        mut self,
        provider: &str,
        live: Arc<crate::config::live::Live>,
    ) -> Self {
        self.plugins
            .insert(provider.to_string(), PluginSource::Live(live));
        self
    }

    /// Replaces the clock (tests).
    pub fn with_clock(mut self, clock: Clock) -> Self {
        self.clock = clock;
        self
    }

    /// Turns `true` once the first round has finished (a readiness gate can wait on it).
    pub fn readiness(&self) -> watch::Receiver<bool> {
        self.checked.subscribe()
    }

    /// Whether at least one round has finished.
    pub fn has_checked(&self) -> bool {
        *self.checked.borrow()
    }

    /// One round: every provider checked concurrently, recorded, written. Never fails:
    /// what went wrong is logged and counted.
    pub async fn round(&self) {
        let rounds = self
            .providers
            .iter()
            .filter_map(|p| Some((p.name(), p.health()?)))
            .map(|(name, check)| self.check_provider(name, check));
        futures_util::future::join_all(rounds).await;
        self.checked.send_replace(true);
    }

    fn known_targets(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Vec<String>>> {
        match self.known.lock() {
            Ok(k) => k,
            Err(p) => p.into_inner(),
        }
    }

    async fn check_provider(&self, name: &str, check: &dyn crate::provider::HealthCheck) {
        let board = self.boards.get(name);
        let results = match tokio::time::timeout(
            self.options.round_timeout,
            check.check(self.options.timeout),
        )
        .await
        {
            Ok(results) => {
                self.known_targets().insert(
                    name.to_string(),
                    results.iter().map(|t| t.target.clone()).collect(),
                );
                results
            }
            Err(_) => {
                // A provider that never answered has no targets we could name.
                tracing::warn!(provider = name, budget = ?self.options.round_timeout,
                    "health check of the whole provider timed out");
                let targets = self.known_targets().get(name).cloned().unwrap_or_default();
                targets
                    .into_iter()
                    .map(|target| TargetHealth {
                        target,
                        reachable: false,
                        reason: Some("timeout".into()),
                        stage: None,
                        message: format!(
                            "the provider's check did not finish within {:?}",
                            self.options.round_timeout
                        ),
                        latency: self.options.round_timeout,
                    })
                    .collect()
            }
        };
        for t in &results {
            self.metrics.observe(name, t);
            if !t.reachable {
                tracing::info!(provider = name, target = %t.target,
                    reason = t.reason.as_deref().unwrap_or("unknown"), message = %t.message,
                    "target unhealthy");
            }
        }
        if let Some(b) = board {
            b.record(&results);
        }
        let mut status = status_of(&results, (self.clock)());
        if let Some(source) = self.plugins.get(name) {
            status.plugins = plugin_statuses(&source.current().health());
        }
        let written =
            tokio::time::timeout(self.options.write_timeout, self.sink.write(name, &status))
                .await
                .unwrap_or_else(|_| {
                    Err(format!(
                        "the write did not finish within {:?}",
                        self.options.write_timeout
                    )
                    .into())
                });
        if let Err(e) = written {
            self.metrics
                .write_failures
                .get_or_create(&ProviderLabels {
                    provider: name.into(),
                })
                .inc();
            tracing::warn!(provider = name, error = %e,
                "could not write ProviderHealth; the next round writes it again");
        }
    }

    /// Runs a round every period until `shutdown` resolves; a round in progress is
    /// abandoned at shutdown (the next process checks again).
    pub async fn run(self, shutdown: impl Future<Output = ()> + Send) {
        let mut shutdown = std::pin::pin!(shutdown);
        let mut tick = tokio::time::interval(self.options.period);
        tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                biased;
                () = &mut shutdown => break,
                _ = tick.tick() => {}
            }
            tokio::select! {
                biased;
                () = &mut shutdown => break,
                () = self.round() => {}
            }
        }
        tracing::debug!("health monitor stopped");
    }
}

/// The status a round writes: targets in the provider's order, all stamped `now`.
pub fn status_of(results: &[TargetHealth], now: jiff::Timestamp) -> ProviderHealthStatus {
    let now = format!("{now:.0}");
    let targets: Vec<TargetHealthStatus> = results
        .iter()
        .map(|t| TargetHealthStatus {
            name: t.target.clone(),
            reachable: t.reachable,
            reason: t.reason.clone(),
            stage: t.stage.clone(),
            message: t.message.clone(),
            latency_millis: i64::try_from(t.latency.as_millis()).unwrap_or(i64::MAX),
            last_checked: now.clone(),
        })
        .collect();
    let count = |n: usize| i32::try_from(n).unwrap_or(i32::MAX);
    ProviderHealthStatus {
        healthy_targets: count(targets.iter().filter(|t| t.reachable).count()),
        total_targets: count(targets.len()),
        targets,
        last_checked: Some(now),
        plugins: Vec::new(),
    }
}

/// Where a provider's plugins are read from at each round.
enum PluginSource {
    /// One set for good.
    Fixed(Arc<TemplateSet>),
    /// The set of the config in force.
    Live(Arc<crate::config::live::Live>),
}

impl PluginSource {
    fn current(&self) -> Arc<TemplateSet> {
        match self {
            PluginSource::Fixed(s) => s.clone(),
            PluginSource::Live(l) => l.templates(),
        }
    }
}

/// The `plugins` list of a status, in the set's order.
pub fn plugin_statuses(health: &[PluginHealth]) -> Vec<PluginHealthStatus> {
    health
        .iter()
        .map(|h| PluginHealthStatus {
            kind: h.kind.field().to_string(),
            name: h.plugin.clone(),
            state: match (&h.problem, h.loading) {
                (None, _) => PluginState::Loaded,
                (Some(_), true) => PluginState::Loading,
                (Some(_), false) => PluginState::Failed,
            },
            message: h.problem.clone().unwrap_or_default(),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::provider::fake::FakeProvider;
    use crate::provider::{
        CreateRequest, HealthCheck, Instance, InstanceId, Provider, ProviderError, TargetListing,
    };
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

    /// A hang fails the test instead of blocking it; not a timing assertion.
    const HANG_GUARD: Duration = Duration::from_secs(20);
    const NOW: &str = "2026-01-02T03:04:05Z";

    /// Records every write; fails the first `fail` of them; never answers while `stall`.
    #[derive(Default)]
    struct FakeSink {
        stall: AtomicBool,
        fail: AtomicUsize,
        attempts: AtomicUsize,
        written: Mutex<Vec<(String, ProviderHealthStatus)>>,
    }

    impl FakeSink {
        fn failing(n: usize) -> Self {
            let s = Self::default();
            s.fail.store(n, Ordering::SeqCst);
            s
        }

        fn written(&self) -> Vec<(String, ProviderHealthStatus)> {
            self.written.lock().unwrap().clone()
        }

        fn last(&self, provider: &str) -> ProviderHealthStatus {
            self.written()
                .into_iter()
                .rev()
                .find(|(p, _)| p == provider)
                .map(|(_, s)| s)
                .unwrap_or_else(|| panic!("nothing written for {provider}"))
        }
    }

    impl HealthSink for FakeSink {
        fn write<'a>(
            &'a self,
            provider: &'a str,
            status: &'a ProviderHealthStatus,
        ) -> BoxFuture<'a, Result<(), SinkError>> {
            Box::pin(async move {
                self.attempts.fetch_add(1, Ordering::SeqCst);
                if self.stall.load(Ordering::SeqCst) {
                    // A stalled API connection: the request never completes.
                    std::future::pending::<()>().await;
                }
                let fail = self
                    .fail
                    .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                    .is_ok();
                if fail {
                    return Err("injected write failure".into());
                }
                self.written
                    .lock()
                    .unwrap()
                    .push((provider.to_string(), status.clone()));
                Ok(())
            })
        }
    }

    /// A provider whose check answers for two targets, or hangs for an hour when told.
    struct Slow {
        hang: AtomicBool,
    }

    /// Only its check is used.
    fn unused<T: Send + 'static>() -> BoxFuture<'static, Result<T, ProviderError>> {
        Box::pin(async { Err(ProviderError::msg(crate::ErrorClass::Permanent, "unused")) })
    }

    impl Provider for Slow {
        fn name(&self) -> &str {
            "slow"
        }
        fn create<'a>(
            &'a self,
            _: &'a CreateRequest,
        ) -> BoxFuture<'a, Result<Instance, ProviderError>> {
            unused()
        }
        fn get<'a>(&'a self, _: &'a InstanceId) -> BoxFuture<'a, Result<Instance, ProviderError>> {
            unused()
        }
        fn delete<'a>(&'a self, _: &'a InstanceId) -> BoxFuture<'a, Result<(), ProviderError>> {
            unused()
        }
        fn list(&self) -> BoxFuture<'_, Vec<TargetListing>> {
            Box::pin(async { Vec::new() })
        }
        fn health(&self) -> Option<&dyn HealthCheck> {
            Some(self)
        }
    }

    impl HealthCheck for Slow {
        fn check(&self, _: Duration) -> BoxFuture<'_, Vec<TargetHealth>> {
            Box::pin(async move {
                if self.hang.load(Ordering::SeqCst) {
                    tokio::time::sleep(Duration::from_secs(3600)).await;
                }
                ["y", "x"]
                    .into_iter()
                    .map(|t| TargetHealth {
                        target: t.into(),
                        reachable: true,
                        reason: None,
                        stage: None,
                        message: "ok".into(),
                        latency: Duration::from_millis(2),
                    })
                    .collect()
            })
        }
    }

    fn options() -> MonitorOptions {
        MonitorOptions {
            period: Duration::from_millis(20),
            timeout: Duration::from_millis(50),
            round_timeout: Duration::from_millis(200),
            write_timeout: Duration::from_millis(100),
        }
    }

    fn fixed_clock() -> Clock {
        Arc::new(|| NOW.parse().unwrap())
    }

    fn monitor(
        providers: Vec<SharedProvider>,
        boards: &[(&str, &HealthBoard)],
        sink: Arc<FakeSink>,
        metrics: HealthMetrics,
    ) -> HealthMonitor {
        let boards = boards
            .iter()
            .map(|(n, b)| (n.to_string(), (*b).clone()))
            .collect();
        HealthMonitor::new(providers, boards, sink, options(), metrics).with_clock(fixed_clock())
    }

    async fn guarded<F: Future>(f: F) -> F::Output {
        tokio::time::timeout(HANG_GUARD, f)
            .await
            .expect("hang guard")
    }

    fn target<'a>(s: &'a ProviderHealthStatus, name: &str) -> &'a TargetHealthStatus {
        s.targets
            .iter()
            .find(|t| t.name == name)
            .unwrap_or_else(|| panic!("no target {name} in {s:?}"))
    }

    #[tokio::test]
    async fn a_down_target_is_reported_with_its_reason_marked_unhealthy_and_recovers() {
        let fake = Arc::new(FakeProvider::new(&["a", "b"]));
        let board = HealthBoard::new();
        let sink = Arc::new(FakeSink::default());
        let metrics = HealthMetrics::default();
        let m = monitor(
            vec![fake.clone()],
            &[("fake", &board)],
            sink.clone(),
            metrics.clone(),
        );
        let mut ready = m.readiness();
        assert!(!m.has_checked() && !*ready.borrow());

        fake.set_down("b", true);
        guarded(m.round()).await;
        assert!(m.has_checked());
        assert!(ready.has_changed().unwrap() && *ready.borrow_and_update());
        let s = sink.last("fake");
        assert_eq!((s.healthy_targets, s.total_targets), (1, 2), "{s:?}");
        assert_eq!(s.last_checked.as_deref(), Some(NOW));
        assert_eq!(
            s.targets
                .iter()
                .map(|t| t.name.as_str())
                .collect::<Vec<_>>(),
            vec!["a", "b"],
            "provider order"
        );
        let b = target(&s, "b");
        assert!(!b.reachable);
        assert_eq!(b.reason.as_deref(), Some("connect"));
        assert_eq!(b.message, "down");
        assert_eq!(b.last_checked, NOW);
        assert_eq!(b.latency_millis, 1);
        assert!(target(&s, "a").reachable);
        assert!(board.is_unhealthy("b"));
        assert!(!board.is_unhealthy("a"));
        assert_eq!(metrics.target_up("fake", "a"), 1);
        assert_eq!(metrics.target_up("fake", "b"), 0);

        fake.set_down("b", false);
        guarded(m.round()).await;
        let s = sink.last("fake");
        assert_eq!((s.healthy_targets, s.total_targets), (2, 2), "{s:?}");
        assert!(target(&s, "b").reachable && target(&s, "b").reason.is_none());
        assert!(!board.is_unhealthy("b"));
        assert_eq!(metrics.target_up("fake", "b"), 1);
        assert_eq!(sink.written().len(), 2);
        assert_eq!(metrics.write_failures("fake"), 0);
    }

    #[tokio::test]
    async fn plugin_health_is_written_with_the_status_and_follows_the_set() {
        use crate::templates::{TemplateError, TemplateErrorKind, TemplateKind};
        let templates: crate::config::TemplatesConfig = serde_json::from_value(serde_json::json!({
            "domain": { "url": "https://127.0.0.1:1/d.wasm", "sha256": "ab".repeat(32) },
            "vendorData": { "path": "/p/v.wasm" },
        }))
        .unwrap();
        let set = Arc::new(TemplateSet::loading(&templates));
        let sink = Arc::new(FakeSink::default());
        let m = monitor(
            vec![
                Arc::new(FakeProvider::new(&["a"])),
                Arc::new(FakeProvider::named("other", &["b"])),
            ],
            &[],
            sink.clone(),
            HealthMetrics::default(),
        )
        .with_plugins("fake", set.clone());
        guarded(m.round()).await;
        let s = sink.last("fake");
        assert_eq!(
            s.plugins,
            vec![
                PluginHealthStatus {
                    kind: "domain".into(),
                    name: "domain:https://127.0.0.1:1/d.wasm".into(),
                    state: PluginState::Loading,
                    message: "no load attempt has finished yet".into(),
                },
                PluginHealthStatus {
                    kind: "vendorData".into(),
                    name: "vendor-data:/p/v.wasm".into(),
                    state: PluginState::Loading,
                    message: "no load attempt has finished yet".into(),
                },
            ]
        );
        assert!(sink.last("other").plugins.is_empty(), "not its plugins");

        set.mark_failed(
            TemplateKind::Domain,
            &TemplateError {
                plugin: "domain:https://127.0.0.1:1/d.wasm".into(),
                kind: TemplateErrorKind::Settings { issues: vec![] },
            },
            false,
        );
        guarded(m.round()).await;
        let s = sink.last("fake");
        assert_eq!(s.plugins[0].state, PluginState::Failed);
        assert!(
            s.plugins[0].message.starts_with("settings refused"),
            "{s:?}"
        );
        assert_eq!(s.plugins[1].state, PluginState::Loading);
        // The written JSON uses the CRD's names.
        let json = serde_json::to_value(&s).unwrap();
        assert_eq!(json["plugins"][0]["state"], "Failed");
        assert_eq!(json["plugins"][1]["kind"], "vendorData");

        let loaded = plugin_statuses(&[PluginHealth {
            kind: crate::templates::TemplateKind::VendorData,
            plugin: "vendor-data:/p/v.wasm".into(),
            problem: None,
            loading: false,
        }]);
        assert_eq!(
            (loaded[0].state, loaded[0].message.as_str()),
            (PluginState::Loaded, "")
        );
    }

    #[tokio::test]
    async fn a_provider_without_a_board_is_still_reported() {
        let fake = Arc::new(FakeProvider::new(&["a"]));
        fake.set_down("a", true);
        let unrelated = HealthBoard::new();
        let sink = Arc::new(FakeSink::default());
        let m = monitor(
            vec![fake],
            &[("other", &unrelated)],
            sink.clone(),
            HealthMetrics::default(),
        );
        guarded(m.round()).await;
        let s = sink.last("fake");
        assert_eq!((s.healthy_targets, s.total_targets), (0, 1));
        assert!(unrelated.snapshot().is_empty(), "another provider's board");
    }

    #[tokio::test]
    async fn a_hanging_check_is_reported_as_timed_out_and_the_round_finishes() {
        let slow = Arc::new(Slow {
            hang: AtomicBool::new(true),
        });
        let fake = Arc::new(FakeProvider::new(&["a"]));
        let (slow_board, fake_board) = (HealthBoard::new(), HealthBoard::new());
        let sink = Arc::new(FakeSink::default());
        let metrics = HealthMetrics::default();
        let m = monitor(
            vec![slow.clone(), fake],
            &[("slow", &slow_board), ("fake", &fake_board)],
            sink.clone(),
            metrics.clone(),
        );

        // Never answered: nothing to name, but the object is still written.
        guarded(m.round()).await;
        let s = sink.last("slow");
        assert_eq!((s.healthy_targets, s.total_targets), (0, 0), "{s:?}");
        assert_eq!(sink.last("fake").healthy_targets, 1, "the other provider");
        assert!(m.has_checked());

        slow.hang.store(false, Ordering::SeqCst);
        guarded(m.round()).await;
        assert_eq!(sink.last("slow").healthy_targets, 2);
        assert!(!slow_board.is_unhealthy("x"));

        // Hangs again: the targets it named last time are reported as timed out.
        slow.hang.store(true, Ordering::SeqCst);
        let started = std::time::Instant::now();
        guarded(m.round()).await;
        assert!(
            started.elapsed() < HANG_GUARD / 2,
            "{:?}",
            started.elapsed()
        );
        let s = sink.last("slow");
        assert_eq!((s.healthy_targets, s.total_targets), (0, 2), "{s:?}");
        assert_eq!(
            s.targets
                .iter()
                .map(|t| t.name.as_str())
                .collect::<Vec<_>>(),
            vec!["y", "x"],
            "order of the last answer"
        );
        for t in &s.targets {
            assert!(!t.reachable);
            assert_eq!(t.reason.as_deref(), Some("timeout"), "{t:?}");
            assert_eq!(t.latency_millis, 200);
        }
        assert!(slow_board.is_unhealthy("x") && slow_board.is_unhealthy("y"));
        assert_eq!(metrics.target_up("slow", "x"), 0);
        assert_eq!(sink.last("fake").healthy_targets, 1);
        assert!(!fake_board.is_unhealthy("a"));
    }

    #[tokio::test(start_paused = true)]
    async fn a_stalled_sink_does_not_freeze_the_board_or_the_rounds() {
        let fake = Arc::new(FakeProvider::new(&["a", "b"]));
        let board = HealthBoard::new();
        let sink = Arc::new(FakeSink::default());
        sink.stall.store(true, Ordering::SeqCst);
        let metrics = HealthMetrics::default();
        let m = monitor(
            vec![fake.clone()],
            &[("fake", &board)],
            sink.clone(),
            metrics.clone(),
        );
        fake.set_down("a", true);
        guarded(m.round()).await;
        assert!(board.is_unhealthy("a"));
        assert_eq!(
            metrics.write_failures("fake"),
            1,
            "the stalled write gave up"
        );
        // The next round runs and updates the board although the sink still hangs.
        fake.set_down("a", false);
        guarded(m.round()).await;
        assert!(!board.is_unhealthy("a"), "the board moved on");
        assert_eq!(sink.attempts.load(Ordering::SeqCst), 2);
        assert_eq!(metrics.write_failures("fake"), 2);
        // Once the API answers again, the status is written.
        sink.stall.store(false, Ordering::SeqCst);
        guarded(m.round()).await;
        assert_eq!(sink.last("fake").healthy_targets, 2);
    }

    #[tokio::test]
    async fn a_failed_write_is_counted_and_the_next_round_writes_again() {
        let fake = Arc::new(FakeProvider::new(&["a", "b"]));
        let board = HealthBoard::new();
        let sink = Arc::new(FakeSink::failing(1));
        let metrics = HealthMetrics::default();
        let m = monitor(
            vec![fake.clone()],
            &[("fake", &board)],
            sink.clone(),
            metrics.clone(),
        );
        fake.set_down("a", true);
        guarded(m.round()).await;
        assert_eq!(sink.attempts.load(Ordering::SeqCst), 1);
        assert!(sink.written().is_empty());
        assert_eq!(metrics.write_failures("fake"), 1);
        assert!(m.has_checked(), "the round finished");
        assert!(
            board.is_unhealthy("a"),
            "recorded even though the write failed"
        );

        guarded(m.round()).await;
        assert_eq!(sink.written().len(), 1);
        assert_eq!(sink.last("fake").healthy_targets, 1);
        assert_eq!(metrics.write_failures("fake"), 1);
    }

    #[tokio::test]
    async fn run_keeps_going_after_failed_writes_and_stops_at_shutdown() {
        let fake = Arc::new(FakeProvider::new(&["a"]));
        let sink = Arc::new(FakeSink::failing(2));
        let metrics = HealthMetrics::default();
        let m = monitor(vec![fake], &[], sink.clone(), metrics.clone());
        let mut ready = m.readiness();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(m.run(async move {
            let _ = stopped.await;
        }));
        guarded(ready.wait_for(|r| *r)).await.unwrap();
        guarded(async {
            while sink.written().len() < 2 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await;
        assert_eq!(metrics.write_failures("fake"), 2);
        stop.send(()).unwrap();
        tokio::time::timeout(Duration::from_secs(5), task)
            .await
            .expect("run stops promptly at shutdown")
            .unwrap();
    }

    #[tokio::test]
    async fn run_stops_at_shutdown_even_inside_a_hanging_round() {
        let slow = Arc::new(Slow {
            hang: AtomicBool::new(true),
        });
        let sink = Arc::new(FakeSink::default());
        let mut opts = options();
        opts.round_timeout = Duration::from_secs(3600);
        let m = HealthMonitor::new(
            vec![slow],
            BTreeMap::new(),
            sink.clone(),
            opts,
            HealthMetrics::default(),
        );
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(m.run(async move {
            let _ = stopped.await;
        }));
        tokio::time::sleep(Duration::from_millis(50)).await;
        stop.send(()).unwrap();
        tokio::time::timeout(Duration::from_secs(5), task)
            .await
            .expect("run stops promptly at shutdown")
            .unwrap();
        assert!(sink.written().is_empty());
    }

    #[test]
    fn status_counts_targets_and_stamps_whole_seconds() {
        let t = |name: &str, reachable: bool, ms: u64| TargetHealth {
            target: name.into(),
            reachable,
            reason: (!reachable).then(|| "host-key".to_string()),
            stage: None,
            message: "m".into(),
            latency: Duration::from_micros(ms * 1000 + 700),
        };
        let now: jiff::Timestamp = "2026-01-02T03:04:05.123456789Z".parse().unwrap();
        let s = status_of(&[t("a", false, 7), t("b", true, 3), t("c", true, 0)], now);
        assert_eq!((s.healthy_targets, s.total_targets), (2, 3));
        assert_eq!(s.last_checked.as_deref(), Some(NOW));
        assert_eq!(s.targets[0].latency_millis, 7);
        assert_eq!(s.targets[0].reason.as_deref(), Some("host-key"));
        assert!(s.targets.iter().all(|x| x.last_checked == NOW));
        let empty = status_of(&[], now);
        assert_eq!((empty.healthy_targets, empty.total_targets), (0, 0));
    }

    #[tokio::test]
    async fn metrics_are_registered_under_their_names() {
        let mut registry = Registry::default();
        let metrics = HealthMetrics::register(&mut registry);
        let fake = Arc::new(FakeProvider::new(&["a", "b"]));
        fake.set_down("b", true);
        let sink = Arc::new(FakeSink::failing(1));
        let m = monitor(vec![fake], &[], sink, metrics);
        guarded(m.round()).await;
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        for line in [
            r#"egress_provider_target_up{provider="fake",target="a"} 1"#,
            r#"egress_provider_target_up{provider="fake",target="b"} 0"#,
            r#"egress_provider_health_check_seconds_count{provider="fake",target="b"} 1"#,
            r#"egress_provider_health_write_failures_total{provider="fake"} 1"#,
        ] {
            assert!(text.lines().any(|l| l == line), "{line} not in\n{text}");
        }
    }

    // --- KubeSink against a mock API server ----------------------------------------------

    type Handle = tower_test::mock::Handle<
        http::Request<kube::client::Body>,
        http::Response<kube::client::Body>,
    >;

    fn mock() -> (KubeSink, Handle) {
        let (service, handle) = tower_test::mock::pair::<
            http::Request<kube::client::Body>,
            http::Response<kube::client::Body>,
        >();
        (KubeSink::new(kube::Client::new(service, "default")), handle)
    }

    /// What one request looked like.
    #[derive(Debug)]
    struct Seen {
        method: http::Method,
        path: String,
        query: BTreeMap<String, String>,
        content_type: String,
        body: serde_json::Value,
    }

    /// Takes the next request and answers it with `code` and `answer`.
    async fn serve(handle: &mut Handle, code: u16, answer: serde_json::Value) -> Seen {
        let (req, send) = guarded(handle.next_request()).await.expect("a request");
        let uri = req.uri().clone();
        let query = uri
            .query()
            .unwrap_or_default()
            .split('&')
            .filter(|kv| !kv.is_empty())
            .map(|kv| match kv.split_once('=') {
                Some((k, v)) => (k.to_string(), v.to_string()),
                None => (kv.to_string(), String::new()),
            })
            .collect();
        let seen = Seen {
            method: req.method().clone(),
            path: uri.path().to_string(),
            query,
            content_type: req
                .headers()
                .get(http::header::CONTENT_TYPE)
                .map(|v| v.to_str().unwrap().to_string())
                .unwrap_or_default(),
            body: serde_json::from_slice(&req.into_body().collect_bytes().await.unwrap()).unwrap(),
        };
        send.send_response(
            http::Response::builder()
                .status(code)
                .header(http::header::CONTENT_TYPE, "application/json")
                .body(kube::client::Body::from(
                    serde_json::to_vec(&answer).unwrap(),
                ))
                .unwrap(),
        );
        seen
    }

    fn object(name: &str) -> serde_json::Value {
        serde_json::json!({
            "apiVersion": "egress-operator.dev/v1alpha1",
            "kind": "ProviderHealth",
            "metadata": { "name": name, "resourceVersion": "1" },
            "spec": { "provider": name },
        })
    }

    fn not_found() -> serde_json::Value {
        serde_json::json!({
            "kind": "Status", "apiVersion": "v1", "status": "Failure",
            "reason": "NotFound", "code": 404, "message": "providerhealths \"kvm2\" not found",
        })
    }

    const BASE: &str = "/apis/egress-operator.dev/v1alpha1/providerhealths/kvm2";

    fn assert_apply(seen: &Seen, path: &str) {
        assert_eq!(seen.method, http::Method::PATCH, "{seen:?}");
        assert_eq!(seen.path, path, "{seen:?}");
        assert_eq!(
            seen.query.get("fieldManager").map(String::as_str),
            Some(FIELD_MANAGER),
            "{seen:?}"
        );
        assert_eq!(seen.query.get("force").map(String::as_str), Some("true"));
        assert_eq!(seen.content_type, "application/apply-patch+yaml");
        assert_eq!(seen.body["apiVersion"], "egress-operator.dev/v1alpha1");
        assert_eq!(seen.body["kind"], "ProviderHealth");
        assert_eq!(seen.body["metadata"]["name"], "kvm2");
    }

    fn sample_status() -> ProviderHealthStatus {
        let now: jiff::Timestamp = NOW.parse().unwrap();
        status_of(
            &[
                TargetHealth {
                    target: "h1".into(),
                    reachable: true,
                    reason: None,
                    stage: None,
                    message: "pool default has 5 bytes free".into(),
                    latency: Duration::from_millis(12),
                },
                TargetHealth {
                    target: "h2".into(),
                    reachable: false,
                    reason: Some("connect".into()),
                    stage: None,
                    message: "connection refused".into(),
                    latency: Duration::from_millis(3),
                },
            ],
            now,
        )
    }

    #[tokio::test]
    async fn kube_sink_applies_the_object_once_then_only_the_status() {
        let (sink, mut handle) = mock();
        let status = sample_status();
        let server = tokio::spawn(async move {
            let first = serve(&mut handle, 200, object("kvm2")).await;
            assert_apply(&first, BASE);
            assert_eq!(first.body["spec"]["provider"], "kvm2");
            assert!(first.body.get("status").is_none(), "{first:?}");

            let second = serve(&mut handle, 200, object("kvm2")).await;
            assert_apply(&second, &format!("{BASE}/status"));
            let s = &second.body["status"];
            assert_eq!(s["healthyTargets"], 1);
            assert_eq!(s["totalTargets"], 2);
            assert_eq!(s["lastChecked"], NOW);
            assert_eq!(s["targets"][0]["name"], "h1");
            assert_eq!(s["targets"][0]["reachable"], true);
            assert_eq!(s["targets"][0]["latencyMillis"], 12);
            assert_eq!(s["targets"][1]["name"], "h2");
            assert_eq!(s["targets"][1]["reachable"], false);
            assert_eq!(s["targets"][1]["reason"], "connect");
            assert!(second.body.get("spec").is_none(), "{second:?}");

            // The next round: status only.
            let third = serve(&mut handle, 200, object("kvm2")).await;
            assert_apply(&third, &format!("{BASE}/status"));
            handle
        });
        guarded(sink.write("kvm2", &status)).await.unwrap();
        guarded(sink.write("kvm2", &status)).await.unwrap();
        let mut handle = guarded(server).await.unwrap();
        // Nothing else was sent.
        drop(sink);
        assert!(handle.next_request().await.is_none());
    }

    #[tokio::test]
    async fn kube_sink_recreates_a_deleted_object_and_reports_api_errors() {
        let (sink, mut handle) = mock();
        let status = sample_status();
        let server = tokio::spawn(async move {
            assert_apply(&serve(&mut handle, 200, object("kvm2")).await, BASE);
            let status_path = format!("{BASE}/status");
            assert_apply(&serve(&mut handle, 200, object("kvm2")).await, &status_path);
            // Deleted behind our back: status 404, object applied again, status again.
            assert_apply(&serve(&mut handle, 404, not_found()).await, &status_path);
            assert_apply(&serve(&mut handle, 200, object("kvm2")).await, BASE);
            assert_apply(&serve(&mut handle, 200, object("kvm2")).await, &status_path);
            // A server error is the caller's to retry.
            let failed = serde_json::json!({
                "kind": "Status", "apiVersion": "v1", "status": "Failure",
                "reason": "InternalError", "code": 500, "message": "etcd is sad",
            });
            assert_apply(&serve(&mut handle, 500, failed).await, &status_path);
        });
        guarded(sink.write("kvm2", &status)).await.unwrap();
        guarded(sink.write("kvm2", &status)).await.unwrap();
        let e = guarded(sink.write("kvm2", &status)).await.unwrap_err();
        assert!(e.to_string().contains("etcd is sad"), "{e}");
        guarded(server).await.unwrap();
    }
}
