//! Decorators around any [`Provider`]: a tracing span and a log line per call
//! ([`Traced`]), Prometheus metrics ([`Metered`]), and leader fencing ([`Fenced`]). All
//! pass the optional health-check capability through, so wrapping never hides what the
//! inner provider can do.

use std::sync::Arc;
use std::time::{Duration, Instant};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use tracing::Instrument;

use prometheus_client::metrics::gauge::Gauge;

use super::{
    BoxFuture, CreateRequest, Fence, HealthCheck, Instance, InstanceId, LeaseLost, Provider,
    ProviderError, Severed, SharedProvider, TargetListing,
};
use crate::error::Classified;

fn outcome<T>(r: &Result<T, ProviderError>) -> &'static str {
    match r {
        Ok(_) => "ok",
        Err(e) => e.class().as_str(),
    }
}

/// Logs every call with its span: provider, operation, instance, duration, outcome.
/// The request's user-data is never recorded (only the Proxy's identity).
pub struct Traced<P: ?Sized> {
    inner: Arc<P>,
}

impl<P: Provider + ?Sized> std::fmt::Debug for Traced<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Traced")
            .field("provider", &self.inner.name())
            .finish()
    }
}

impl<P: Provider + ?Sized> Traced<P> {
    /// Wraps `inner`.
    pub fn new(inner: Arc<P>) -> Self {
        Self { inner }
    }
}

async fn traced<T>(
    provider: &str,
    op: &'static str,
    subject: String,
    fut: impl std::future::Future<Output = Result<T, ProviderError>>,
) -> Result<T, ProviderError> {
    let span = tracing::info_span!("provider", provider, op, subject = %subject);
    async move {
        let started = Instant::now();
        let r = fut.await;
        let ms = started.elapsed().as_millis() as u64;
        match &r {
            Ok(_) => tracing::info!(duration_ms = ms, outcome = "ok", "provider call"),
            Err(e) => {
                tracing::warn!(duration_ms = ms, outcome = e.class().as_str(), error = %e, "provider call")
            }
        }
        r
    }
    .instrument(span)
    .await
}

/// Logs each target whose listing failed, and passes the listings on.
fn warn_failed(provider: &str, listings: Vec<TargetListing>) -> Vec<TargetListing> {
    for t in &listings {
        if let Err(e) = &t.result {
            tracing::warn!(provider, target = %t.target, error = %e, "listing failed");
        }
    }
    listings
}

impl<P: Provider + ?Sized> Provider for Traced<P> {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn create<'a>(
        &'a self,
        req: &'a CreateRequest,
    ) -> BoxFuture<'a, Result<Instance, ProviderError>> {
        let subject = format!(
            "{}/{} uid={}",
            req.proxy.namespace, req.proxy.name, req.proxy.uid
        );
        Box::pin(traced(
            self.inner.name(),
            "create",
            subject,
            self.inner.create(req),
        ))
    }
    fn get<'a>(&'a self, id: &'a InstanceId) -> BoxFuture<'a, Result<Instance, ProviderError>> {
        Box::pin(traced(
            self.inner.name(),
            "get",
            id.to_string(),
            self.inner.get(id),
        ))
    }
    fn delete<'a>(&'a self, id: &'a InstanceId) -> BoxFuture<'a, Result<(), ProviderError>> {
        Box::pin(traced(
            self.inner.name(),
            "delete",
            id.to_string(),
            self.inner.delete(id),
        ))
    }
    fn get_owned<'a>(
        &'a self,
        id: &'a InstanceId,
        owner: &'a str,
    ) -> BoxFuture<'a, Result<Instance, ProviderError>> {
        Box::pin(traced(
            self.inner.name(),
            "get",
            id.to_string(),
            self.inner.get_owned(id, owner),
        ))
    }
    fn delete_owned<'a>(
        &'a self,
        id: &'a InstanceId,
        owner: &'a str,
    ) -> BoxFuture<'a, Result<(), ProviderError>> {
        Box::pin(traced(
            self.inner.name(),
            "delete",
            id.to_string(),
            self.inner.delete_owned(id, owner),
        ))
    }
    fn list(&self) -> BoxFuture<'_, Vec<TargetListing>> {
        Box::pin(async move { warn_failed(self.inner.name(), self.inner.list().await) })
    }
    fn instances_of<'a>(&'a self, owner: &'a str) -> BoxFuture<'a, Vec<TargetListing>> {
        Box::pin(
            async move { warn_failed(self.inner.name(), self.inner.instances_of(owner).await) },
        )
    }
    fn health(&self) -> Option<&dyn HealthCheck> {
        self.inner.health()
    }
    fn sever(&self, bound: Duration) -> BoxFuture<'_, Severed> {
        self.inner.sever(bound)
    }
    fn reconnect(&self) {
        self.inner.reconnect();
    }
    fn revision(
        &self,
        spec: &crate::api::proxy::ProxySpec,
        host: Option<&str>,
        user_data: crate::revision::UserData<'_>,
    ) -> Option<Result<crate::revision::Revision, String>> {
        self.inner.revision(spec, host, user_data)
    }
}

/// Labels of provider call metrics.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ProviderLabels {
    /// Provider name.
    pub provider: String,
    /// `create`, `get`, `delete`, `list`.
    pub op: String,
    /// `ok` or the error class.
    pub outcome: String,
}

/// Provider call metrics.
#[derive(Debug, Clone)]
pub struct ProviderMetrics {
    calls: Family<ProviderLabels, Counter>,
    duration: Family<ProviderLabels, Histogram, fn() -> Histogram>,
}

fn histogram() -> Histogram {
    // A get is a round trip; a Create with an image upload takes minutes.
    Histogram::new([0.01, 0.05, 0.25, 1.0, 5.0, 15.0, 60.0, 300.0, 1800.0])
}

impl Default for ProviderMetrics {
    fn default() -> Self {
        Self {
            calls: Family::default(),
            duration: Family::new_with_constructor(histogram as fn() -> Histogram),
        }
    }
}

impl ProviderMetrics {
    /// Registered under `egress_provider_*`.
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self::default();
        registry.register(
            "egress_provider_calls",
            "provider calls by operation and outcome",
            m.calls.clone(),
        );
        registry.register(
            "egress_provider_call_duration_seconds",
            "provider call duration by operation and outcome",
            m.duration.clone(),
        );
        m
    }

    /// Calls counted with these labels (for tests).
    pub fn calls(&self, provider: &str, op: &str, outcome: &str) -> u64 {
        self.calls
            .get_or_create(&ProviderLabels {
                provider: provider.into(),
                op: op.into(),
                outcome: outcome.into(),
            })
            .get()
    }

    fn record(&self, provider: &str, op: &str, outcome: &str, took: Duration) {
        let labels = ProviderLabels {
            provider: provider.into(),
            op: op.into(),
            outcome: outcome.into(),
        };
        self.calls.get_or_create(&labels).inc();
        self.duration
            .get_or_create(&labels)
            .observe(took.as_secs_f64());
    }
}

/// Counts calls and measures their duration by operation and outcome class.
pub struct Metered<P: ?Sized> {
    inner: Arc<P>,
    metrics: ProviderMetrics,
}

impl<P: Provider + ?Sized> std::fmt::Debug for Metered<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metered")
            .field("provider", &self.inner.name())
            .finish()
    }
}

impl<P: Provider + ?Sized> Metered<P> {
    /// Wraps `inner`.
    pub fn new(inner: Arc<P>, metrics: ProviderMetrics) -> Self {
        Self { inner, metrics }
    }

    async fn measure<T>(
        &self,
        op: &'static str,
        fut: impl std::future::Future<Output = Result<T, ProviderError>>,
    ) -> Result<T, ProviderError> {
        let started = Instant::now();
        let r = fut.await;
        self.metrics
            .record(self.inner.name(), op, outcome(&r), started.elapsed());
        r
    }
}

impl<P: Provider + ?Sized> Metered<P> {
    /// Records a listing as `op`: `partial` when a target failed.
    async fn measure_listing(
        &self,
        op: &'static str,
        fut: impl std::future::Future<Output = Vec<TargetListing>>,
    ) -> Vec<TargetListing> {
        let started = Instant::now();
        let r = fut.await;
        let failed = r.iter().any(|t| t.result.is_err());
        self.metrics.record(
            self.inner.name(),
            op,
            if failed { "partial" } else { "ok" },
            started.elapsed(),
        );
        r
    }
}

impl<P: Provider + ?Sized> Provider for Metered<P> {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn create<'a>(
        &'a self,
        req: &'a CreateRequest,
    ) -> BoxFuture<'a, Result<Instance, ProviderError>> {
        Box::pin(self.measure("create", self.inner.create(req)))
    }
    fn get<'a>(&'a self, id: &'a InstanceId) -> BoxFuture<'a, Result<Instance, ProviderError>> {
        Box::pin(self.measure("get", self.inner.get(id)))
    }
    fn delete<'a>(&'a self, id: &'a InstanceId) -> BoxFuture<'a, Result<(), ProviderError>> {
        Box::pin(self.measure("delete", self.inner.delete(id)))
    }
    fn get_owned<'a>(
        &'a self,
        id: &'a InstanceId,
        owner: &'a str,
    ) -> BoxFuture<'a, Result<Instance, ProviderError>> {
        Box::pin(self.measure("get", self.inner.get_owned(id, owner)))
    }
    fn delete_owned<'a>(
        &'a self,
        id: &'a InstanceId,
        owner: &'a str,
    ) -> BoxFuture<'a, Result<(), ProviderError>> {
        Box::pin(self.measure("delete", self.inner.delete_owned(id, owner)))
    }
    fn list(&self) -> BoxFuture<'_, Vec<TargetListing>> {
        Box::pin(self.measure_listing("list", self.inner.list()))
    }
    fn instances_of<'a>(&'a self, owner: &'a str) -> BoxFuture<'a, Vec<TargetListing>> {
        Box::pin(self.measure_listing("instances-of", self.inner.instances_of(owner)))
    }
    fn health(&self) -> Option<&dyn HealthCheck> {
        self.inner.health()
    }
    fn sever(&self, bound: Duration) -> BoxFuture<'_, Severed> {
        self.inner.sever(bound)
    }
    fn reconnect(&self) {
        self.inner.reconnect();
    }
    fn revision(
        &self,
        spec: &crate::api::proxy::ProxySpec,
        host: Option<&str>,
        user_data: crate::revision::UserData<'_>,
    ) -> Option<Result<crate::revision::Revision, String>> {
        self.inner.revision(spec, host, user_data)
    }
}

/// Labels of the fence's count of cancelled calls.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FenceLabels {
    /// Provider name.
    pub provider: String,
    /// The operation cancelled (`create`, `delete`, `delete volumes`, ...).
    pub op: String,
}

/// Labels of the fence's per-provider metrics.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FenceProviderLabels {
    /// Provider name.
    pub provider: String,
}

/// What the leader fence did after the lease was lost.
#[derive(Debug, Clone, Default)]
pub struct FenceMetrics {
    cancelled: Family<FenceLabels, Counter>,
    cut: Family<FenceProviderLabels, Counter>,
    still_running: Family<FenceProviderLabels, Gauge>,
}

impl FenceMetrics {
    /// Registered under `egress_fence_*`.
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self::default();
        registry.register(
            "egress_fence_cancelled_calls",
            "provider calls in flight when the leader lease was lost and cancelled after the grace, by operation",
            m.cancelled.clone(),
        );
        registry.register(
            "egress_fence_severed_calls",
            "blocking calls still running when the provider was cut off after the lease was lost",
            m.cut.clone(),
        );
        registry.register(
            "egress_fence_calls_still_running",
            "blocking calls the cut did not release (still running after its wait); 0 once fenced",
            m.still_running.clone(),
        );
        m
    }

    fn labels(provider: &str, op: &str) -> FenceLabels {
        FenceLabels {
            provider: provider.into(),
            op: op.into(),
        }
    }

    fn of(provider: &str) -> FenceProviderLabels {
        FenceProviderLabels {
            provider: provider.into(),
        }
    }

    /// Calls of `op` cancelled by the fence (for tests).
    pub fn cancelled(&self, provider: &str, op: &str) -> u64 {
        self.cancelled
            .get_or_create(&Self::labels(provider, op))
            .get()
    }

    /// Blocking calls found running at cuts (for tests).
    pub fn cut(&self, provider: &str) -> u64 {
        self.cut.get_or_create(&Self::of(provider)).get()
    }

    /// Blocking calls still running after the last cut (for tests).
    pub fn still_running(&self, provider: &str) -> i64 {
        self.still_running.get_or_create(&Self::of(provider)).get()
    }
}

/// Stops a replica that lost the leader lease from acting through a provider.
///
/// - A call made while the lease is not held is refused at once ([`LeaseLost::Refused`])
///   and never reaches the inner provider; a listing reports one failed target, so nobody
///   reads it as "nothing there".
/// - A call in flight when the lease is lost may go on for `grace`, then it is dropped and
///   fails with [`LeaseLost::Cancelled`] (counted in `egress_fence_cancelled_calls`). The
///   grace lets a libvirt call finish rather than be abandoned half-way. Dropping the
///   call does not stop a thread blocked in libvirt: [`fence_off`] then cuts the
///   provider off its targets, which does. Both fit in the elector's fencing margin
///   ([`crate::leader::LeaderOptions::fencing_margin`]), so the two replicas' calls do not
///   overlap.
/// - A Create carries this fence in its request, so the provider checks the lease again
///   right before define and before start, and cleans up after itself when it is lost.
///
/// Health checks pass through unfenced: they only read.
pub struct Fenced<P: ?Sized> {
    inner: Arc<P>,
    fence: Fence,
    grace: Duration,
    metrics: FenceMetrics,
}

impl<P: Provider + ?Sized> std::fmt::Debug for Fenced<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fenced")
            .field("provider", &self.inner.name())
            .field("held", &self.fence.is_held())
            .field("grace", &self.grace)
            .finish()
    }
}

impl<P: Provider + ?Sized> Fenced<P> {
    /// Wraps `inner`: calls need `fence` held, and stop `grace` after it is lost.
    pub fn new(inner: Arc<P>, fence: Fence, grace: Duration) -> Self {
        Self {
            inner,
            fence,
            grace,
            metrics: FenceMetrics::default(),
        }
    }

    /// Counts cancelled calls in `metrics`.
    pub fn with_metrics(mut self, metrics: FenceMetrics) -> Self {
        self.metrics = metrics;
        self
    }

    async fn bounded<T>(
        &self,
        op: &'static str,
        fut: impl std::future::Future<Output = Result<T, ProviderError>>,
    ) -> Result<T, ProviderError> {
        fenced_call(
            self.inner.name(),
            &self.fence,
            self.grace,
            &self.metrics,
            op,
            fut,
        )
        .await
    }
}

impl<P: Provider + ?Sized> Fenced<P> {
    /// A listing that needs the fence held and stops with it; a refusal or a cut is one
    /// failed listing for every target.
    async fn fenced_listing(
        &self,
        op: &'static str,
        fut: impl std::future::Future<Output = Vec<TargetListing>>,
    ) -> Vec<TargetListing> {
        let failed = |e: ProviderError| {
            vec![TargetListing {
                target: ALL_TARGETS.to_string(),
                result: Err(e),
            }]
        };
        if let Err(e) = self.fence.check(op) {
            return failed(refused(self.inner.name(), e));
        }
        match self.bounded(op, async { Ok(fut.await) }).await {
            Ok(listing) => listing,
            Err(e) => failed(e),
        }
    }
}

/// How long after the grace [`fence_off`] cuts the providers off.
pub const CUT_AFTER_GRACE: Duration = Duration::from_millis(100);

/// The deposed replica's fencing, once the term's loop saw the lease go: waits out
/// `grace` (the calls in flight finish, or their [`Fenced`] cancels them), then cuts
/// every provider off its targets ([`Provider::sever`]: a thread blocked in libvirt
/// returns, nothing queued reaches a host), waiting at most `bound` for their blocking
/// calls to return. Logs and exports what it found; a call still running after the wait
/// is a warning naming the provider, and the replica stays cut off until it leads again.
pub async fn fence_off(
    providers: &[SharedProvider],
    grace: Duration,
    bound: Duration,
    metrics: &FenceMetrics,
) -> Vec<(String, Severed)> {
    // A hair after the grace, so that each call's own cancellation has fired first and a
    // released thread's error does not reach a caller that still waits.
    tokio::time::sleep(grace + CUT_AFTER_GRACE).await;
    let cuts = providers.iter().map(|p| async move {
        let severed = p.sever(bound).await;
        (p.name().to_string(), severed)
    });
    let found = futures_util::future::join_all(cuts).await;
    for (provider, severed) in &found {
        let labels = FenceMetrics::of(provider);
        metrics
            .cut
            .get_or_create(&labels)
            .inc_by(severed.at_cut as u64);
        metrics
            .still_running
            .get_or_create(&labels)
            .set(severed.still_running as i64);
        if severed.still_running > 0 {
            tracing::warn!(
                provider,
                at_cut = severed.at_cut,
                still_running = severed.still_running,
                ?bound,
                "lost the leader lease: blocking calls still run after the provider was cut off"
            );
        } else {
            tracing::info!(
                provider,
                at_cut = severed.at_cut,
                "lost the leader lease: cut off the provider's targets; no call of ours still runs"
            );
        }
    }
    found
}

/// Lifts [`fence_off`] at the start of a new term.
pub fn reconnect(providers: &[SharedProvider], metrics: &FenceMetrics) {
    for p in providers {
        p.reconnect();
        metrics
            .still_running
            .get_or_create(&FenceMetrics::of(p.name()))
            .set(0);
    }
}

/// Runs `fut` only while `fence` is held, and drops it `grace` after the lease is lost.
async fn fenced_call<T>(
    provider: &str,
    fence: &Fence,
    grace: Duration,
    metrics: &FenceMetrics,
    op: &'static str,
    fut: impl std::future::Future<Output = Result<T, ProviderError>>,
) -> Result<T, ProviderError> {
    fence.check(op).map_err(|e| refused(provider, e))?;
    let deposed = async {
        fence.lost().await;
        tokio::time::sleep(grace).await;
    };
    tokio::select! {
        r = fut => r,
        () = deposed => {
            tracing::warn!(provider, op, ?grace,
                "lost the leader lease: cancelled a provider call still in flight");
            metrics.cancelled.get_or_create(&FenceMetrics::labels(provider, op)).inc();
            Err(ProviderError::new(LeaseLost::Cancelled { op, grace }))
        }
    }
}

/// The garbage collector's volume deletes behind the leader fence, as [`Fenced`] puts a
/// provider's calls: a replica that lost the lease starts no delete, and one in flight is
/// dropped `grace` after the loss, so a deposed replica cannot delete a volume the new
/// leader's Create just made. Listing candidates only reads and passes through.
pub struct FencedVolumes {
    inner: Arc<dyn crate::gc::VolumeCollector>,
    fence: Fence,
    grace: Duration,
    metrics: FenceMetrics,
}

impl std::fmt::Debug for FencedVolumes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FencedVolumes")
            .field("provider", &self.inner.name())
            .field("held", &self.fence.is_held())
            .field("grace", &self.grace)
            .finish()
    }
}

impl FencedVolumes {
    /// Wraps `inner`: deletes need `fence` held, and stop `grace` after it is lost.
    pub fn new(inner: Arc<dyn crate::gc::VolumeCollector>, fence: Fence, grace: Duration) -> Self {
        Self {
            inner,
            fence,
            grace,
            metrics: FenceMetrics::default(),
        }
    }

    /// Counts cancelled deletes in `metrics`.
    pub fn with_metrics(mut self, metrics: FenceMetrics) -> Self {
        self.metrics = metrics;
        self
    }
}

impl crate::gc::VolumeCollector for FencedVolumes {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn volume_candidates(&self) -> BoxFuture<'_, Vec<crate::gc::VolumeListing>> {
        self.inner.volume_candidates()
    }
    fn delete_volumes<'a>(
        &'a self,
        target: &'a str,
        candidate: &'a crate::gc::VolumeCandidate,
    ) -> BoxFuture<'a, Result<crate::gc::VolumeDeleteOutcome, ProviderError>> {
        Box::pin(fenced_call(
            self.inner.name(),
            &self.fence,
            self.grace,
            &self.metrics,
            "delete volumes",
            self.inner.delete_volumes(target, candidate),
        ))
    }
}

fn refused(provider: &str, e: LeaseLost) -> ProviderError {
    tracing::debug!(provider, error = %e, "provider call refused: not the leader");
    ProviderError::new(e)
}

impl<P: Provider + ?Sized> Provider for Fenced<P> {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn create<'a>(
        &'a self,
        req: &'a CreateRequest,
    ) -> BoxFuture<'a, Result<Instance, ProviderError>> {
        Box::pin(async move {
            let fenced = CreateRequest {
                fence: self.fence.clone(),
                ..req.clone()
            };
            self.bounded("create", self.inner.create(&fenced)).await
        })
    }
    fn get<'a>(&'a self, id: &'a InstanceId) -> BoxFuture<'a, Result<Instance, ProviderError>> {
        Box::pin(self.bounded("get", self.inner.get(id)))
    }
    fn delete<'a>(&'a self, id: &'a InstanceId) -> BoxFuture<'a, Result<(), ProviderError>> {
        Box::pin(self.bounded("delete", self.inner.delete(id)))
    }
    fn get_owned<'a>(
        &'a self,
        id: &'a InstanceId,
        owner: &'a str,
    ) -> BoxFuture<'a, Result<Instance, ProviderError>> {
        Box::pin(self.bounded("get", self.inner.get_owned(id, owner)))
    }
    fn delete_owned<'a>(
        &'a self,
        id: &'a InstanceId,
        owner: &'a str,
    ) -> BoxFuture<'a, Result<(), ProviderError>> {
        Box::pin(self.bounded("delete", self.inner.delete_owned(id, owner)))
    }
    fn list(&self) -> BoxFuture<'_, Vec<TargetListing>> {
        Box::pin(self.fenced_listing("list", self.inner.list()))
    }
    fn instances_of<'a>(&'a self, owner: &'a str) -> BoxFuture<'a, Vec<TargetListing>> {
        Box::pin(self.fenced_listing("instances-of", self.inner.instances_of(owner)))
    }
    fn health(&self) -> Option<&dyn HealthCheck> {
        self.inner.health()
    }
    fn sever(&self, bound: Duration) -> BoxFuture<'_, Severed> {
        self.inner.sever(bound)
    }
    fn reconnect(&self) {
        self.inner.reconnect();
    }
    fn revision(
        &self,
        spec: &crate::api::proxy::ProxySpec,
        host: Option<&str>,
        user_data: crate::revision::UserData<'_>,
    ) -> Option<Result<crate::revision::Revision, String>> {
        self.inner.revision(spec, host, user_data)
    }
}

/// The target a fenced listing names when it lists nothing: every target of the provider.
pub const ALL_TARGETS: &str = "(all targets)";

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorClass;
    use crate::provider::fake::FakeProvider;

    /// A volume collector whose deletes take `delay` and are counted when they finish.
    struct SlowVolumes {
        delay: Duration,
        deleted: std::sync::atomic::AtomicUsize,
    }

    impl crate::gc::VolumeCollector for SlowVolumes {
        fn name(&self) -> &str {
            "kvm2"
        }
        fn volume_candidates(&self) -> BoxFuture<'_, Vec<crate::gc::VolumeListing>> {
            Box::pin(async { Vec::new() })
        }
        fn delete_volumes<'a>(
            &'a self,
            _target: &'a str,
            _candidate: &'a crate::gc::VolumeCandidate,
        ) -> BoxFuture<'a, Result<crate::gc::VolumeDeleteOutcome, ProviderError>> {
            Box::pin(async move {
                tokio::time::sleep(self.delay).await;
                self.deleted
                    .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                Ok(crate::gc::VolumeDeleteOutcome::Deleted)
            })
        }
    }

    /// The link to a target as a thread blocked in libvirt sees it: a request waits there
    /// until the target answers (it lands) or the link is cut (the thread returns with a
    /// transport error, and the request never reached the target).
    #[derive(Default)]
    struct Wire {
        state: std::sync::Mutex<WireState>,
        changed: std::sync::Condvar,
    }

    #[derive(Default)]
    struct WireState {
        answering: bool,
        cut: bool,
        waiting: usize,
        landed: Vec<&'static str>,
    }

    impl Wire {
        fn lock(&self) -> std::sync::MutexGuard<'_, WireState> {
            self.state
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
        }

        /// Blocks the calling thread until the request lands or the link is cut.
        fn carry(&self, op: &'static str) -> Result<(), ProviderError> {
            let mut st = self.lock();
            st.waiting += 1;
            while !st.answering && !st.cut {
                st = self
                    .changed
                    .wait(st)
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
            }
            st.waiting -= 1;
            if st.cut {
                return Err(ProviderError::msg(
                    ErrorClass::Transient,
                    "transport closed",
                ));
            }
            st.landed.push(op);
            Ok(())
        }

        fn set(&self, f: impl FnOnce(&mut WireState)) {
            f(&mut self.lock());
            self.changed.notify_all();
        }
    }

    /// A provider whose deletes block a real thread on the [`Wire`] (not an async sleep,
    /// which dropping the future would stop), and whose cut closes the wire, as closing a
    /// kvm2 host's tunnel does.
    struct Blocking {
        wire: Arc<Wire>,
    }

    impl Provider for Blocking {
        fn name(&self) -> &str {
            "kvm2"
        }
        fn create<'a>(
            &'a self,
            _req: &'a CreateRequest,
        ) -> BoxFuture<'a, Result<Instance, ProviderError>> {
            Box::pin(async { Err(ProviderError::msg(ErrorClass::Permanent, "not here")) })
        }
        fn get<'a>(
            &'a self,
            _id: &'a InstanceId,
        ) -> BoxFuture<'a, Result<Instance, ProviderError>> {
            Box::pin(async { Err(ProviderError::msg(ErrorClass::NotFound, "none")) })
        }
        fn delete<'a>(&'a self, _id: &'a InstanceId) -> BoxFuture<'a, Result<(), ProviderError>> {
            let wire = self.wire.clone();
            Box::pin(async move {
                tokio::task::spawn_blocking(move || wire.carry("delete"))
                    .await
                    .unwrap()
            })
        }
        fn list(&self) -> BoxFuture<'_, Vec<TargetListing>> {
            Box::pin(async { Vec::new() })
        }
        fn sever(&self, bound: Duration) -> BoxFuture<'_, Severed> {
            Box::pin(async move {
                let at_cut = self.wire.lock().waiting;
                self.wire.set(|st| st.cut = true);
                let started = tokio::time::Instant::now();
                while self.wire.lock().waiting > 0 && started.elapsed() < bound {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                Severed {
                    at_cut,
                    still_running: self.wire.lock().waiting,
                }
            })
        }
    }

    /// A delete blocked on a real thread when the lease goes: dropping its future after
    /// the grace leaves the thread running, and on the old contract its request landed
    /// whenever the target answered, however late (well into the new leader's term). The
    /// fencing now cuts the provider off after the grace and waits for the thread: it
    /// returns, the metrics say what was cut and that nothing still runs, and a target that
    /// answers afterwards receives nothing.
    #[tokio::test]
    async fn a_call_blocked_on_a_thread_lands_nowhere_once_the_replica_is_fenced() {
        let wire = Arc::new(Wire::default());
        // A failed assertion must not leave the thread blocked: the runtime would wait for
        // it forever at the end of the test.
        struct Release(Arc<Wire>);
        impl Drop for Release {
            fn drop(&mut self) {
                self.0.set(|st| st.answering = true);
            }
        }
        let _release = Release(wire.clone());
        let (tx, rx) = tokio::sync::watch::channel(true);
        let grace = Duration::from_millis(100);
        let metrics = FenceMetrics::default();
        let fenced: SharedProvider = Arc::new(
            Fenced::new(
                Arc::new(Blocking { wire: wire.clone() }),
                Fence::new(rx),
                grace,
            )
            .with_metrics(metrics.clone()),
        );
        let in_flight = tokio::spawn({
            let fenced = fenced.clone();
            async move {
                let id = InstanceId {
                    host: "h1".into(),
                    name: "egress-u1".into(),
                };
                fenced.delete(&id).await
            }
        });
        // Hang guard only: the delete's thread is blocked on the wire.
        for _ in 0..1000 {
            if wire.lock().waiting == 1 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(wire.lock().waiting, 1, "the delete never blocked");

        tx.send(false).unwrap();
        let found = fence_off(
            std::slice::from_ref(&fenced),
            grace,
            Duration::from_secs(30),
            &metrics,
        )
        .await;
        let err = in_flight.await.unwrap().unwrap_err();
        assert!(err.is_lease_lost(), "{err}");

        // The target gets round to answering: nothing of the deposed replica lands.
        wire.set(|st| st.answering = true);
        for _ in 0..20 {
            if wire.lock().waiting == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(
            wire.lock().landed.is_empty(),
            "landed after fencing: {:?}",
            wire.lock().landed
        );
        assert_eq!(
            found,
            vec![(
                "kvm2".to_string(),
                Severed {
                    at_cut: 1,
                    still_running: 0
                }
            )]
        );
        assert_eq!(metrics.cancelled("kvm2", "delete"), 1);
        assert_eq!(metrics.cut("kvm2"), 1);
        assert_eq!(metrics.still_running("kvm2"), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_deposed_replica_deletes_no_volumes() {
        use crate::gc::VolumeCollector as _;
        let inner = Arc::new(SlowVolumes {
            delay: Duration::from_secs(60),
            deleted: Default::default(),
        });
        let (tx, rx) = tokio::sync::watch::channel(true);
        let grace = Duration::from_secs(5);
        let fenced = FencedVolumes::new(inner.clone(), Fence::new(rx), grace);
        let candidate = crate::gc::VolumeCandidate {
            key: "egress-u1".into(),
            kind: crate::gc::VolumeKind::Instance,
            owner_uid: Some("u1".into()),
            volumes: vec!["egress-u1-root".into()],
        };
        // In flight when the lease goes: dropped after the grace, never finished.
        let started = tokio::time::Instant::now();
        let in_flight = fenced.delete_volumes("h1", &candidate);
        let lose = async {
            tokio::time::sleep(Duration::from_secs(1)).await;
            tx.send(false).unwrap();
        };
        let (err, ()) = tokio::join!(in_flight, lose);
        let err = err.unwrap_err();
        assert!(err.is_lease_lost(), "{err}");
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "cancelled, not waited out"
        );
        // Not held: refused before reaching the provider.
        let err = fenced.delete_volumes("h1", &candidate).await.unwrap_err();
        assert!(err.is_lease_lost(), "{err}");
        tokio::time::sleep(Duration::from_secs(120)).await;
        assert_eq!(
            inner.deleted.load(std::sync::atomic::Ordering::SeqCst),
            0,
            "no delete ran to its end"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_leader_deletes_volumes_through_the_fence() {
        use crate::gc::VolumeCollector as _;
        let inner = Arc::new(SlowVolumes {
            delay: Duration::from_secs(1),
            deleted: Default::default(),
        });
        let (_tx, rx) = tokio::sync::watch::channel(true);
        let fenced = FencedVolumes::new(inner.clone(), Fence::new(rx), Duration::from_secs(5));
        let candidate = crate::gc::VolumeCandidate {
            key: "egress-u1".into(),
            kind: crate::gc::VolumeKind::Instance,
            owner_uid: Some("u1".into()),
            volumes: vec!["egress-u1-root".into()],
        };
        assert_eq!(
            fenced.delete_volumes("h1", &candidate).await.unwrap(),
            crate::gc::VolumeDeleteOutcome::Deleted
        );
        assert_eq!(inner.deleted.load(std::sync::atomic::Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn decorators_count_calls_and_keep_the_health_capability() {
        let fake = Arc::new(FakeProvider::new(&["a", "b"]));
        let metrics = ProviderMetrics::default();
        let p = Metered::new(Arc::new(Traced::new(fake.clone())), metrics.clone());
        assert!(p.health().is_some(), "health check survives two decorators");
        let id = InstanceId {
            host: "a".into(),
            name: "x".into(),
        };
        let e = p.get(&id).await.unwrap_err();
        assert_eq!(e.class(), ErrorClass::NotFound);
        assert_eq!(metrics.calls("fake", "get", "not_found"), 1);
        let health = p.health().unwrap().check(Duration::from_secs(1)).await;
        assert_eq!(health.len(), 2);
    }
}
