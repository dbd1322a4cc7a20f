//! The Proxy controller: keeps exactly one running instance per Proxy and reports it.
//!
//! Built on kube-runtime's `Controller` (watch, per-object serialisation, requeue) and its
//! `finalizer` helper, as kube-rs's controller-rs does. One reconcile:
//!
//! - **apply**: check the spec against the providers config (a problem is permanent and
//!   shown in the `Ready` condition); if status names an instance, `get` it: running or
//!   starting → refresh status; lost (not found) or failed (crashed, shut off) → replace it
//!   (delete the old one first, then create); no instance → read the user-data Secret and
//!   create. Every step is idempotent, so a crash anywhere converges on the next reconcile
//!   (a Create of a Proxy whose domain exists adopts it). Then probe the instance's proxy
//!   ([`serving`]): `Ready` requires that it answers; one that has not answered for
//!   `serving.replaceAfterSeconds` is replaced the same way as a failed one.
//! - **cleanup** (the finalizer): delete the instance status names and any other instance
//!   a listing finds with this Proxy's UID; safe when nothing was ever created.
//!
//! Status is written whole with server-side apply, and only when it changed (apart from
//! the probe latency), so probing a steady proxy writes nothing; events mark state
//! changes (a failure reason once per failure streak, not once per retry); the error
//! class and the Proxy's failure count alone decide the requeue ([`requeue`]). The
//! controller's own status writes come back as watch events; [`requeue::Attempts`]
//! defers those to the requested delay, so a failing Proxy backs off whatever its status
//! says. The user-data Secret is read at create time into [`UserData`], which cannot be
//! printed, and no error names its content.
//!
//! A replica that lost the leader lease ([`Context::fence`]) starts no reconcile, writes
//! no status or event for a reconcile the loss cut short, and does not let a Proxy go
//! (the finalizer stays for the new leader).

pub mod metrics;
pub mod requeue;
pub mod serving;
pub mod status;
mod uptodate;
pub mod watch;

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Secret;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::finalizer::{Event as Finalizer, finalizer};
use kube::runtime::watcher;
use kube::{Api, Client, Resource, ResourceExt};

use crate::api::proxy::{Proxy, ProxyStatus};
use crate::config::ValidConfig;
use crate::error::{Classified, ErrorClass};
use crate::provider::registry::Registry;
use crate::provider::{
    CreateRequest, Fence, Instance, InstanceId, LeaseLost, ProviderError, ProxyRef, SharedProvider,
    UserData,
};
use crate::serving::Prober;
use crate::validation::Problems;

pub use metrics::ControllerMetrics;
pub use requeue::RequeuePolicy;

/// Finalizer on every Proxy the controller has seen: the instance is deleted before the
/// Proxy can go.
pub const FINALIZER: &str = "egress-operator.dev/instance";
/// Field manager of our server-side applies.
pub const FIELD_MANAGER: &str = "egress-operator";
/// Largest user-data accepted from a Secret (the NoCloud seed holds it in memory).
pub const MAX_USER_DATA: usize = 1024 * 1024;
/// The label a Secret must carry, with the value `"true"`, before a Proxy may use it as
/// user-data. The operator may read every Secret (RBAC cannot grant by label), so without
/// this opt-in anyone allowed to create a Proxy in a namespace could copy any Secret of
/// that namespace (a token, a TLS key) into a VM's seed and read it there. Only someone
/// who may label the Secret can opt it in.
pub const USER_DATA_LABEL: &str = "egress-operator.dev/user-data";

/// Why a reconcile failed. Every variant has a class; none carries Secret content.
#[derive(Debug, thiserror::Error)]
pub enum ControllerError {
    /// The spec names things the providers config does not have, or breaks its rules.
    #[error("the Proxy does not fit the providers config: {0}")]
    InvalidSpec(String),
    /// The Proxy object lacks something the API server always sets.
    #[error("the Proxy has no {0}")]
    Incomplete(&'static str),
    /// `spec.provider` names no configured provider.
    #[error("provider {0:?} is not configured")]
    UnknownProvider(String),
    /// The user-data Secret or its key is missing or unusable.
    #[error("user-data Secret {namespace}/{name} key {key:?}: {problem}")]
    UserData {
        /// Secret namespace.
        namespace: String,
        /// Secret name.
        name: String,
        /// Key in the Secret.
        key: String,
        /// What is wrong (never the content).
        problem: String,
        /// Missing things are `NotFound`, a bad value `Permanent`.
        class: ErrorClass,
    },
    /// The provider failed.
    #[error("provider: {0}")]
    Provider(#[from] ProviderError),
    /// The Kubernetes API failed.
    #[error("kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    /// Adding or removing our finalizer lost a race with another writer: kube-runtime's
    /// JSON patch carries `test` ops on the finalizer list, which the API server answers
    /// with a 422 when the list changed meanwhile. The next reconcile reads the new list.
    #[error("the finalizer patch lost a race with another writer: {0}")]
    FinalizerRace(#[source] kube::Error),
    /// This replica lost the leader lease; the new leader reconciles the Proxy.
    #[error(transparent)]
    LeaseLost(#[from] LeaseLost),
}

impl Classified for ControllerError {
    fn class(&self) -> ErrorClass {
        match self {
            ControllerError::InvalidSpec(_)
            | ControllerError::Incomplete(_)
            | ControllerError::UnknownProvider(_) => ErrorClass::Permanent,
            ControllerError::UserData { class, .. } => *class,
            ControllerError::Provider(e) => e.class(),
            ControllerError::Kube(e) => kube_class(e),
            ControllerError::FinalizerRace(_) => ErrorClass::Transient,
            ControllerError::LeaseLost(e) => e.class(),
        }
    }
}

impl ControllerError {
    /// The condition reason shown for this error.
    pub fn reason(&self) -> &'static str {
        match self {
            ControllerError::InvalidSpec(_) | ControllerError::Incomplete(_) => "InvalidSpec",
            ControllerError::UnknownProvider(_) => "UnknownProvider",
            ControllerError::UserData { .. } => "UserDataUnavailable",
            ControllerError::Provider(e) => match e.class() {
                ErrorClass::Quota => "CapacityExceeded",
                ErrorClass::Permanent => "ProviderRefused",
                _ => "ProviderError",
            },
            ControllerError::Kube(_) | ControllerError::FinalizerRace(_) => "KubernetesAPIError",
            ControllerError::LeaseLost(_) => "LeaseLost",
        }
    }

    /// Whether the reconcile was cut short because this replica lost the lease: nothing
    /// was learnt about the Proxy, so nothing is written or announced for it.
    pub fn is_lease_lost(&self) -> bool {
        match self {
            ControllerError::LeaseLost(_) => true,
            ControllerError::Provider(e) => e.is_lease_lost(),
            _ => false,
        }
    }
}

/// Class of a Kubernetes API error (one table for the whole operator).
pub use crate::error::kube_error_class as kube_class;

/// Everything a reconcile needs.
pub struct Context {
    /// The API client.
    pub client: Client,
    /// The providers config (validated at start): the serving settings, which take effect
    /// only at start.
    pub config: Arc<ValidConfig>,
    /// The config in force, which a reload replaces (images, machine types, plugins);
    /// `None`: `config` for good.
    pub live: Option<Arc<crate::config::live::Live>>,
    /// Providers by name.
    pub providers: Arc<Registry>,
    /// Event recorder.
    pub recorder: Recorder,
    /// Metrics.
    pub metrics: ControllerMetrics,
    /// Requeue policy.
    pub policy: RequeuePolicy,
    /// Per Proxy: failures, announced warnings, when the next reconcile is due.
    pub attempts: requeue::Attempts,
    /// Jitter source, replaceable in tests.
    pub jitter: fn() -> f64,
    /// Held while this replica leads; unfenced without leader election.
    pub fence: Fence,
    /// Probes the Proxies' proxies (bounded by `serving.concurrency` across all of them).
    pub prober: Prober,
    /// Per Proxy: probe failures, the instance last fetched, the status last written.
    pub serving: serving::Memory,
    /// The wall clock of condition times and the replacement grace; replaceable in tests.
    pub clock: Clock,
    /// Spec fields this binary does not know, per Proxy (filled by the watch).
    pub skew: watch::Skew,
    /// Where the Proxy cache is shown to the object-state metrics, when they are exported.
    pub state: Option<crate::state_metrics::StateMetrics>,
}

/// A wall clock.
pub type Clock = Arc<dyn Fn() -> jiff::Timestamp + Send + Sync>;

impl Context {
    /// Now, by [`Context::clock`].
    pub fn now(&self) -> jiff::Timestamp {
        (self.clock)()
    }
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("providers", &self.providers)
            .field("policy", &self.policy)
            .finish_non_exhaustive()
    }
}

impl Context {
    /// A context with the default policy; `instance` names this replica in events.
    pub fn new(
        client: Client,
        config: Arc<ValidConfig>,
        providers: Arc<Registry>,
        metrics: ControllerMetrics,
        instance: Option<String>,
    ) -> Self {
        let recorder = Recorder::new(
            client.clone(),
            Reporter {
                controller: "egress-operator".into(),
                instance,
            },
        );
        let prober = Prober::new(&config.serving, metrics.probes.clone());
        Self {
            client,
            config,
            live: None,
            providers,
            recorder,
            metrics,
            policy: RequeuePolicy::default(),
            attempts: requeue::Attempts::default(),
            jitter: requeue::random_unit,
            fence: Fence::unfenced(),
            prober,
            serving: serving::Memory::default(),
            clock: Arc::new(jiff::Timestamp::now),
            skew: watch::Skew::default(),
            state: None,
        }
    }

    /// The same context, showing its Proxy cache to `state` (egress_proxies and friends).
    pub fn with_state(mut self, state: crate::state_metrics::StateMetrics) -> Self {
        self.state = Some(state);
        self
    }

    /// The same context, acting only while `fence` is held.
    pub fn with_fence(mut self, fence: Fence) -> Self {
        self.fence = fence;
        self
    }

    /// The same context, checking specs against the config in force in `live`.
    pub fn with_live(mut self, live: Arc<crate::config::live::Live>) -> Self {
        self.live = Some(live);
        self
    }

    /// The config in force now.
    pub fn current_config(&self) -> Arc<ValidConfig> {
        crate::config::live::current(&self.config, self.live.as_deref())
    }
}

/// Runs the controller until `shutdown` resolves; then stops taking new work and waits for
/// reconciles in flight (a Create finishes or cleans up after itself), so no half-made VM
/// is left behind.
pub async fn run<F>(ctx: Arc<Context>, concurrency: u16, shutdown: F)
where
    F: std::future::Future<Output = ()> + Send + Sync + 'static,
{
    let (reader, writer) = kube::runtime::reflector::store();
    if let Some(state) = &ctx.state {
        state.set_proxies(reader.clone());
    }
    let events = watch::proxies(
        ctx.client.clone(),
        watcher::Config::default().any_semantic(),
        ctx.metrics.watch.clone(),
        ctx.skew.clone(),
    );
    // Nothing here reads managedFields, and they are most of a Proxy's size once its
    // status has been applied a few times: the cache keeps every Proxy, so they go before
    // it (at 1000 Proxies they were tens of MiB of the operator's RSS, issue 22).
    let events = kube::runtime::WatchStreamExt::modify(events, strip_for_cache);
    let proxies = kube::runtime::WatchStreamExt::applied_objects(
        kube::runtime::WatchStreamExt::reflect(events, writer),
    );
    Controller::for_stream(proxies, reader)
        .with_config(kube::runtime::controller::Config::default().concurrency(concurrency))
        .graceful_shutdown_on(shutdown)
        .run(reconcile, error_policy, ctx)
        .for_each(|result| async move {
            match result {
                Ok((obj, action)) => tracing::debug!(proxy = %obj, ?action, "reconciled"),
                // error_policy has logged the reconcile failure.
                Err(kube::runtime::controller::Error::ReconcilerFailed(..)) => {}
                // Watch failures were counted and logged by the watch (readyz: degraded).
                Err(kube::runtime::controller::Error::QueueError(e)) => {
                    tracing::debug!(error = %e, "controller queue")
                }
                Err(kube::runtime::controller::Error::ObjectNotFound(o)) => {
                    tracing::debug!(proxy = %o, "trigger for a Proxy that is gone")
                }
                Err(e) => tracing::warn!(error = %e, "controller stream"),
            }
        })
        .await;
}

/// What the Proxy cache does not keep of a watched Proxy: its managedFields.
fn strip_for_cache(proxy: &mut Proxy) {
    proxy.metadata.managed_fields = None;
}

/// One reconcile of one Proxy.
///
/// A trigger that changed nothing [`requeue::trigger_of`] looks at (our own status write,
/// a re-list) before the Proxy's requested delay ran out only reschedules it.
pub async fn reconcile(proxy: Arc<Proxy>, ctx: Arc<Context>) -> Result<Action, ControllerError> {
    ctx.fence.check("a reconcile")?;
    if let Some(uid) = proxy.uid()
        && let Some(wait) = ctx
            .attempts
            .early(&uid, requeue::trigger_of(&proxy.metadata))
    {
        ctx.metrics.deferred();
        tracing::trace!(proxy = %proxy.name_any(), retry_in = ?wait, "trigger before the requested delay; deferred");
        return Ok(Action::requeue(wait));
    }
    let deleting = proxy.metadata.deletion_timestamp.is_some();
    let uid = proxy.uid();
    if deleting
        && let Some(uid) = &uid
        && ctx.attempts.released(uid)
    {
        tracing::trace!(proxy = %proxy.name_any(), "finalizer already removed; the cache is behind");
        return Ok(Action::await_change());
    }
    let started = Instant::now();
    let ns = proxy
        .namespace()
        .ok_or(ControllerError::Incomplete("metadata.namespace"))?;
    let api = Api::<Proxy>::namespaced(ctx.client.clone(), &ns);
    let result = finalizer(&api, FINALIZER, proxy, |event| async {
        match event {
            Finalizer::Apply(p) => apply(&p, &ctx).await,
            Finalizer::Cleanup(p) => cleanup(&p, &ctx).await,
        }
    })
    .await;
    // A finalizer removal told 404 found the Proxy gone: what the removal was for.
    let result = match result {
        Err(kube::runtime::finalizer::Error::RemoveFinalizer(kube::Error::Api(s)))
            if s.code == 404 =>
        {
            Ok(Action::await_change())
        }
        other => other,
    }
    .map_err(|e| match e {
        kube::runtime::finalizer::Error::ApplyFailed(e)
        | kube::runtime::finalizer::Error::CleanupFailed(e) => e,
        kube::runtime::finalizer::Error::AddFinalizer(e)
        | kube::runtime::finalizer::Error::RemoveFinalizer(e) => finalizer_error(e),
        kube::runtime::finalizer::Error::UnnamedObject => {
            ControllerError::Incomplete("metadata.name")
        }
        kube::runtime::finalizer::Error::InvalidFinalizer => {
            ControllerError::InvalidSpec(format!("finalizer name {FINALIZER:?} is invalid"))
        }
    });
    if deleting
        && result.is_ok()
        && let Some(uid) = &uid
    {
        ctx.attempts.release(uid);
    }
    let outcome = match &result {
        Ok(_) => "ok",
        Err(e) => e.class().as_str(),
    };
    ctx.metrics
        .reconciled(outcome, started.elapsed().as_secs_f64());
    result
}

/// A failed finalizer patch: a failed `test` op (the finalizer list changed under us:
/// another controller added or removed its own) is a race to retry at once; everything
/// else, a refusal by validation among them, is classed like any API error (issue 33,
/// item 11: a 422 from a CRD rule or an admission policy is permanent, and says why).
fn finalizer_error(e: kube::Error) -> ControllerError {
    match &e {
        kube::Error::Api(s) if is_failed_test_op(s) => ControllerError::FinalizerRace(e),
        _ => ControllerError::Kube(e),
    }
}

/// Whether a 422 is a JSON patch whose `test` op failed. The API server answers that with
/// its generic message and the patch library's error as an `UnexpectedServerResponse`
/// cause; a refusal by validation names the object ("Proxy.egress-operator.dev \"p\" is
/// invalid: ...", or the admission policy) and gives field causes.
fn is_failed_test_op(s: &kube::core::Status) -> bool {
    const GENERIC: &str = "the server rejected our request due to an error in our request";
    let causes = s.details.as_ref().map_or(&[][..], |d| d.causes.as_slice());
    s.code == 422
        && s.message.starts_with(GENERIC)
        && causes
            .iter()
            .all(|c| c.reason.is_empty() || c.reason == "UnexpectedServerResponse")
}

/// Requeue by error class and the Proxy's failure count, with jitter; the delay is also
/// remembered, so no watch event of ours runs the Proxy before it.
pub fn error_policy(proxy: Arc<Proxy>, error: &ControllerError, ctx: Arc<Context>) -> Action {
    if error.is_lease_lost() {
        // The controller is stopping; the new leader takes the Proxy from here.
        tracing::debug!(proxy = %proxy.name_any(), error = %error, "reconcile cut short: not the leader");
        return Action::await_change();
    }
    let uid = proxy.uid().unwrap_or_default();
    let attempt = ctx.attempts.fail(&uid, proxy.metadata.generation);
    let class = error.class();
    let delay = ctx.policy.after_error(class, attempt, (ctx.jitter)());
    ctx.attempts
        .schedule(&uid, requeue::trigger_of(&proxy.metadata), Some(delay));
    tracing::warn!(
        proxy = %format!("{}/{}", proxy.namespace().unwrap_or_default(), proxy.name_any()),
        class = %class,
        attempt,
        retry_in = ?delay,
        error = %error,
        "reconcile failed"
    );
    Action::requeue(delay)
}

/// What an apply did to the instance, for events and metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Change {
    Created,
    ReplacedLost,
    ReplacedFailed,
    ReplacedNotServing,
    ReplacedOutOfDate,
}

struct Target<'a> {
    proxy: &'a Proxy,
    owner: ProxyRef,
    generation: Option<i64>,
    prev: ProxyStatus,
}

async fn apply(proxy: &Proxy, ctx: &Context) -> Result<Action, ControllerError> {
    let target = Target {
        proxy,
        owner: owner_of(proxy)?,
        generation: proxy.metadata.generation,
        prev: proxy.status.clone().unwrap_or_default(),
    };
    // The status as the API server last got it: the object's, until converge marks the
    // Proxy as provisioning. What follows builds on that, so a replacement moves the
    // conditions' transition times and a failed one does not advertise the lost address.
    let mut current = target.prev.clone();
    match converge_serving(&target, ctx, &mut current).await {
        Ok((instance, change, check, failures)) => {
            let now = ctx.now();
            let mut new = status::observed(&current, target.generation, &instance, &check, now);
            uptodate::judge(ctx, proxy, &instance, &mut new, now);
            if ctx.serving.needs_write(&target.owner.uid, &current, &new) {
                write_status(ctx, proxy, &new).await?;
            }
            // Readiness reached in this reconcile: its own event, unless the instance was
            // made in this same reconcile, whose event then says so (one event per
            // reconcile's outcome: at 1000 Proxies that is 1000 fewer writes).
            let ready = status::is_ready(&new);
            let became_ready = ready && !status::is_ready(&current);
            let ready_note = || format!("ready at {}", new.address.as_deref().unwrap_or("-"));
            if let Some(change) = change {
                let (reason, action, note) = match change {
                    Change::Created => ("Created", "Create", "created"),
                    Change::ReplacedLost => {
                        ("Replaced", "Replace", "replaced a lost instance with")
                    }
                    Change::ReplacedFailed => {
                        ("Replaced", "Replace", "replaced a failed instance with")
                    }
                    Change::ReplacedNotServing => (
                        "Replaced",
                        "Replace",
                        "replaced an instance whose proxy did not serve with",
                    ),
                    Change::ReplacedOutOfDate => (
                        "Replaced",
                        "Replace",
                        "replaced an out-of-date instance (updatePolicy Replace) with",
                    ),
                };
                ctx.metrics.instance(match change {
                    Change::Created => "created",
                    Change::ReplacedLost => "replaced-lost",
                    Change::ReplacedFailed => "replaced-failed",
                    Change::ReplacedNotServing => "replaced-not-serving",
                    Change::ReplacedOutOfDate => "replaced-out-of-date",
                });
                let mut note = format!("{note} instance {}", instance.id);
                if became_ready {
                    note = format!("{note}, {}", ready_note());
                }
                event(ctx, proxy, EventType::Normal, reason, action, note).await;
            } else if became_ready {
                event(
                    ctx,
                    proxy,
                    EventType::Normal,
                    "Ready",
                    "Refresh",
                    ready_note(),
                )
                .await;
            }
            // A proxy that stops serving (or a guest that never read its seed) is news
            // once, when the condition changes, not at every failed probe.
            // A paused VM says so in its phase; that is no proxy failure.
            let stopped = status::is_serving(&current) && !check.serving && check.running;
            let seed = check.seed_not_read()
                && status::condition(&current, status::SERVING)
                    .is_none_or(|c| c.reason != serving::SEED_NOT_READ);
            if stopped || seed {
                let reason = if seed { check.reason } else { "NotServing" };
                event(
                    ctx,
                    proxy,
                    EventType::Warning,
                    reason,
                    "Probe",
                    check.message.clone(),
                )
                .await;
            }
            let period = Duration::from_secs(u64::from(ctx.config.serving.period_seconds));
            let delay = if ready {
                period
            } else if instance.state == crate::provider::InstanceState::Running
                && !instance.addresses.is_empty()
            {
                serving::retry_after(failures, period, ctx.policy.jitter, (ctx.jitter)())
            } else {
                ctx.policy.not_ready_refresh
            };
            ctx.attempts.succeeded(&target.owner.uid);
            ctx.attempts.schedule(
                &target.owner.uid,
                requeue::trigger_of(&proxy.metadata),
                Some(delay),
            );
            Ok(Action::requeue(delay))
        }
        Err(e) if e.is_lease_lost() => Err(e),
        Err(e) => {
            let now = ctx.now();
            let class = e.class();
            let message = e.to_string();
            let new = status::errored(
                &current,
                target.generation,
                class,
                e.reason(),
                &message,
                now,
            );
            if let Err(w) = write_status(ctx, proxy, &new).await {
                tracing::warn!(error = %w, "could not record the error in status");
            }
            if announce(ctx, &target.owner.uid, target.generation, e.reason()) {
                event(
                    ctx,
                    proxy,
                    EventType::Warning,
                    e.reason(),
                    "Reconcile",
                    message,
                )
                .await;
            }
            Err(e)
        }
    }
}

/// Whether a warning with this reason is news for this Proxy's failure streak.
fn announce(ctx: &Context, uid: &str, generation: Option<i64>, reason: &str) -> bool {
    ctx.attempts.announce(uid, generation, reason)
}

/// The status no longer names an instance known to be gone (deleted, or not found): a
/// retry then goes straight to the Create, without another look-up of the old one.
fn forget_instance(current: &mut ProxyStatus) {
    current.instance_id = None;
    current.host = None;
    current.instance_state = None;
}

/// [`converge`], then checks the instance's proxy and replaces an instance whose proxy
/// has not served for longer than the grace. Returns the instance, what changed, the
/// check and the probe failures before it (for the retry delay).
async fn converge_serving(
    t: &Target<'_>,
    ctx: &Context,
    current: &mut ProxyStatus,
) -> Result<(Instance, Option<Change>, serving::Check, u32), ControllerError> {
    let (mut instance, mut change) = converge(t, ctx, current).await?;
    if change.is_none()
        && let Some(changed) =
            uptodate::replace_due(ctx, t.proxy, &instance, current.revision.as_ref())
    {
        let id = instance.id.clone();
        let note = format!(
            "instance {id} was made from inputs that changed since ({}); replacing it \
             (updatePolicy Replace)",
            changed.join(", ")
        );
        instance = replace(
            t,
            ctx,
            current,
            &id,
            (EventType::Normal, "InstanceOutOfDate"),
            &note,
        )
        .await?;
        change = Some(Change::ReplacedOutOfDate);
    }
    let check = serving::check(&ctx.prober, &instance).await;
    // The probe took time: a replica that lost the lease meanwhile reports nothing.
    ctx.fence.check("reporting the probe")?;
    let failures = ctx.serving.checked(&t.owner.uid, &instance.id.host, &check);
    let grace = Duration::from_secs(u64::from(ctx.config.serving.replace_after_seconds));
    let Some(since) = serving::overdue(grace, current, &instance, &check, ctx.now()) else {
        return Ok((instance, change, check, failures));
    };
    // The prober guard: when most of the host or the fleet fails on the path at once, the
    // operator's own path is suspected and nothing is replaced.
    let window = 2 * Duration::from_secs(u64::from(ctx.config.serving.period_seconds));
    if let Some(why) = ctx.serving.prober_suspected(&instance.id.host, window) {
        ctx.metrics.instance("replacement-withheld");
        // News once, when the condition turns to it, not at every held-back check.
        if status::condition(current, status::SERVING)
            .is_none_or(|c| c.reason != serving::PROBER_SUSPECTED)
        {
            let note = format!("instance {}'s proxy is not replaced: {why}", instance.id);
            let reason = serving::PROBER_SUSPECTED;
            event(ctx, t.proxy, EventType::Warning, reason, "Replace", note).await;
        }
        return Ok((instance, change, check.suspected(&why), failures));
    }
    let id = instance.id.clone();
    let note = format!(
        "instance {id}'s proxy has not served since {since} (serving.replaceAfterSeconds is \
         {}): {}; replacing it",
        grace.as_secs(),
        check.message
    );
    let instance = replace(
        t,
        ctx,
        current,
        &id,
        (EventType::Warning, "InstanceNotServing"),
        &note,
    )
    .await?;
    let check = serving::check(&ctx.prober, &instance).await;
    ctx.fence.check("reporting the probe")?;
    let failures = ctx.serving.checked(&t.owner.uid, &instance.id.host, &check);
    Ok((instance, Some(Change::ReplacedNotServing), check, failures))
}

/// Replaces the instance `id` that still runs: says why (`reason`, `note`: in status, and
/// in an event of `type_` once per streak), deletes it (checking it is the Proxy's) and
/// creates another.
async fn replace(
    t: &Target<'_>,
    ctx: &Context,
    current: &mut ProxyStatus,
    id: &InstanceId,
    (type_, reason): (EventType, &str),
    note: &str,
) -> Result<Instance, ControllerError> {
    mark_provisioning(ctx, t, current, "Replacing", note).await?;
    if announce(ctx, &t.owner.uid, t.generation, reason) {
        event(ctx, t.proxy, type_, reason, "Replace", note.to_string()).await;
    }
    let provider = provider_for(ctx, &t.proxy.spec.provider)?;
    match provider.delete_owned(id, &t.owner.uid).await {
        Ok(()) => {}
        Err(e) if e.is_not_found() => {}
        Err(e) => return Err(e.into()),
    }
    forget_instance(current);
    create(t, ctx, &provider, current).await
}

/// Brings the instance to "exists and is not failed"; returns it and what changed.
async fn converge(
    t: &Target<'_>,
    ctx: &Context,
    current: &mut ProxyStatus,
) -> Result<(Instance, Option<Change>), ControllerError> {
    let spec = &t.proxy.spec;
    let mut problems = Problems::new();
    check_name(&t.owner.name, &mut problems);
    for field in ctx.skew.unknown(&t.owner.uid) {
        problems.push(
            field,
            "is not a field this operator knows (is the installed CRD newer than the operator?); \
             nothing is created until the operator is updated or the field removed",
        );
    }
    spec.check(&ctx.current_config(), &mut problems);
    let problems = problems.into_vec();
    if !problems.is_empty() {
        let text = problems
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("; ");
        return Err(ControllerError::InvalidSpec(text));
    }
    let provider = provider_for(ctx, &spec.provider)?;

    let mut change = Change::Created;
    let trigger = requeue::trigger_of(&t.proxy.metadata);
    if let Some(text) = &t.prev.instance_id {
        // Served at the last probe and fetched recently: the probe is the check.
        if let Some(instance) = InstanceId::parse(text).ok().and_then(|id| {
            ctx.serving
                .fresh(&t.owner.uid, &id, trigger, ctx.policy.ready_refresh)
        }) {
            return Ok((instance, None));
        }
        match InstanceId::parse(text) {
            Ok(id) => match provider.get_owned(&id, &t.owner.uid).await {
                Ok(instance) if !instance.state.is_failed() => {
                    ctx.serving.fetched(&t.owner.uid, trigger, &instance);
                    return Ok((instance, None));
                }
                Ok(instance) => {
                    let note = format!("instance {id} is {}; replacing it", instance.state);
                    mark_provisioning(ctx, t, current, "Replacing", &note).await?;
                    if announce(ctx, &t.owner.uid, t.generation, "InstanceFailed") {
                        event(
                            ctx,
                            t.proxy,
                            EventType::Warning,
                            "InstanceFailed",
                            "Replace",
                            note,
                        )
                        .await;
                    }
                    // Ownership was checked by the get_owned above.
                    provider.delete(&id).await?;
                    forget_instance(current);
                    change = Change::ReplacedFailed;
                }
                Err(e) if e.is_not_found() => {
                    let note = format!("instance {id} is gone; creating a new one");
                    forget_instance(current);
                    mark_provisioning(ctx, t, current, "Replacing", &note).await?;
                    if announce(ctx, &t.owner.uid, t.generation, "InstanceLost") {
                        event(
                            ctx,
                            t.proxy,
                            EventType::Warning,
                            "InstanceLost",
                            "Replace",
                            note,
                        )
                        .await;
                    }
                    change = Change::ReplacedLost;
                }
                Err(e) => return Err(e.into()),
            },
            Err(e) => {
                tracing::warn!(error = %e, "status.instanceId unreadable; creating (adopts an existing instance)");
            }
        }
    } else if t.prev.phase != Some(crate::api::proxy::ProxyPhase::Provisioning) {
        mark_provisioning(ctx, t, current, "Creating", "creating the instance").await?;
    }

    let instance = create(t, ctx, &provider, current).await?;
    tracing::info!(
        proxy = %format!("{}/{}", t.owner.namespace, t.owner.name),
        instance = %instance.id,
        ?change,
        "instance ready for the Proxy"
    );
    Ok((instance, Some(change)))
}

/// A Proxy's name becomes the VM's host name and goes into the domain's mark, which both
/// want a DNS-1123 label; Kubernetes allows any DNS subdomain (dots, 253 characters). The
/// CRD refuses such names at admission; this catches objects made before that rule.
fn check_name(name: &str, problems: &mut Problems) {
    if let Err(why) = crate::validation::dns1123_label(name) {
        problems.push(
            "metadata.name",
            format!(
                "{why}; a Proxy's name must be a DNS-1123 label (at most 63 characters, no \
                 dots) because it becomes the VM's host name and its domain mark"
            ),
        );
    }
}

/// Reads the user-data and creates (or adopts) the Proxy's instance.
async fn create(
    t: &Target<'_>,
    ctx: &Context,
    provider: &SharedProvider,
    current: &mut ProxyStatus,
) -> Result<Instance, ControllerError> {
    let user_data = read_user_data(ctx, t.proxy, &t.owner.namespace).await?;
    // Taken before the Create: a config that changes during it then leaves the instance
    // recorded as older than it may be, and rolled once more; never the other way. Only
    // the host's part waits for placement.
    let revision = |host: Option<&str>| {
        let bytes = user_data.as_ref().map(|u| u.expose());
        provider
            .revision(&t.proxy.spec, host, crate::revision::UserData::Read(bytes))
            .and_then(Result::ok)
    };
    let before = revision(None);
    let req = CreateRequest {
        proxy: t.owner.clone(),
        spec: t.proxy.spec.clone(),
        user_data: user_data.clone(),
        fence: ctx.fence.clone(),
    };
    let instance = match provider.create(&req).await {
        Ok(instance) => instance,
        Err(e) => {
            if let Some(LeaseLost::Cancelled { grace, .. }) = e.lease_lost() {
                // The cancelled Create could not clean up (no libvirt call may follow the
                // loss); say so where the Proxy's owner looks. The log of the replica names
                // what it left; the new leader adopts it or the collector takes it.
                let note = format!(
                    "this replica lost the leader lease while creating the instance and                      cancelled the Create {grace:?} later, before it ended; what it made                      (named after the Proxy's UID, listed in this replica's log) is adopted                      by the new leader's Create or collected after the GC grace period"
                );
                event(
                    ctx,
                    t.proxy,
                    EventType::Warning,
                    "CreateCancelled",
                    "Create",
                    note,
                )
                .await;
            }
            return Err(e.into());
        }
    };
    ctx.serving.fetched(
        &t.owner.uid,
        requeue::trigger_of(&t.proxy.metadata),
        &instance,
    );
    current.revision = match (before, revision(Some(&instance.id.host))) {
        (Some(before), Some(placed)) => Some(before.with_host_part(&placed).to_status(false)),
        // A plugin not loaded before the Create cannot have rendered it.
        _ => None,
    };
    Ok(instance)
}

/// Writes the provisioning status; `current` becomes it once the API server has it.
async fn mark_provisioning(
    ctx: &Context,
    t: &Target<'_>,
    current: &mut ProxyStatus,
    reason: &str,
    message: &str,
) -> Result<(), ControllerError> {
    let s = status::provisioning(current, t.generation, reason, message, ctx.now());
    write_status(ctx, t.proxy, &s).await?;
    *current = s;
    Ok(())
}

async fn cleanup(proxy: &Proxy, ctx: &Context) -> Result<Action, ControllerError> {
    let owner = owner_of(proxy)?;
    let prev = proxy.status.clone().unwrap_or_default();
    let s = status::deleting(&prev, proxy.metadata.generation, ctx.now());
    if let Err(e) = write_status(ctx, proxy, &s).await {
        // The object may already be half gone; the deletion itself is what matters.
        tracing::debug!(error = %e, "could not mark the Proxy as deleting");
    }
    let provider = match provider_for(ctx, &proxy.spec.provider) {
        Ok(p) => p,
        Err(e) => {
            let note = format!("nothing to delete: {e}");
            event(ctx, proxy, EventType::Warning, "NotDeleted", "Delete", note).await;
            ctx.attempts.forget(&owner.uid);
            ctx.serving.forget(&owner.uid);
            return Ok(Action::await_change());
        }
    };
    let mut deleted = Vec::new();
    if let Some(id) = prev
        .instance_id
        .as_deref()
        .and_then(|t| InstanceId::parse(t).ok())
    {
        delete_one(ctx, proxy, &provider, &id).await?;
        deleted.push(id);
    }
    // A Create that finished after a crash, before its status was written, left an
    // instance status does not name: find it by UID. A host whose listing fails is left
    // to the garbage collector (the Proxy will be gone, so it counts as an orphan).
    for listing in provider.instances_of(&owner.uid).await {
        match listing.result {
            Ok(instances) => {
                for i in instances.iter().filter(|i| i.proxy.uid == owner.uid) {
                    if !deleted.contains(&i.id) {
                        delete_one(ctx, proxy, &provider, &i.id).await?;
                        deleted.push(i.id.clone());
                    }
                }
            }
            // Not the leader: the finalizer must stay for the one that is.
            Err(e) if e.is_lease_lost() => return Err(e.into()),
            Err(e) => tracing::warn!(
                target_host = %listing.target,
                error = %e,
                "listing failed during cleanup; the garbage collector will find leftovers"
            ),
        }
    }
    ctx.fence.check("removing the finalizer")?;
    let note = if deleted.is_empty() {
        "no instance existed".to_string()
    } else {
        format!(
            "deleted {}",
            deleted
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        )
    };
    event(ctx, proxy, EventType::Normal, "Deleted", "Delete", note).await;
    ctx.attempts.forget(&owner.uid);
    ctx.serving.forget(&owner.uid);
    Ok(Action::await_change())
}

async fn delete_one(
    ctx: &Context,
    proxy: &Proxy,
    provider: &SharedProvider,
    id: &InstanceId,
) -> Result<(), ControllerError> {
    // Through the mark: an instance that names another Proxy is left alone (permanent,
    // reported below), whatever this Proxy's status says.
    let owner = proxy
        .uid()
        .ok_or(ControllerError::Incomplete("metadata.uid"))?;
    match provider.delete_owned(id, &owner).await {
        Ok(()) => {
            ctx.metrics.instance("deleted");
            Ok(())
        }
        Err(e) if e.is_not_found() => Ok(()),
        Err(e) if e.class() == ErrorClass::Permanent => {
            // Not ours to delete (e.g. the name is taken by a domain without our mark):
            // leaving it is right, and the Proxy must not be stuck on it.
            let note = format!("left instance {id} in place: {e}");
            event(ctx, proxy, EventType::Warning, "NotDeleted", "Delete", note).await;
            Ok(())
        }
        Err(e) => Err(e.into()),
    }
}

fn owner_of(proxy: &Proxy) -> Result<ProxyRef, ControllerError> {
    Ok(ProxyRef {
        namespace: proxy
            .namespace()
            .ok_or(ControllerError::Incomplete("metadata.namespace"))?,
        name: proxy
            .metadata
            .name
            .clone()
            .ok_or(ControllerError::Incomplete("metadata.name"))?,
        uid: proxy
            .uid()
            .ok_or(ControllerError::Incomplete("metadata.uid"))?,
    })
}

fn provider_for(ctx: &Context, name: &str) -> Result<SharedProvider, ControllerError> {
    ctx.providers
        .get(name)
        .cloned()
        .ok_or_else(|| ControllerError::UnknownProvider(name.to_string()))
}

/// Reads the user-data the Proxy names. The bytes go straight into [`UserData`].
async fn read_user_data(
    ctx: &Context,
    proxy: &Proxy,
    namespace: &str,
) -> Result<Option<UserData>, ControllerError> {
    let Some(source) = &proxy.spec.user_data else {
        return Ok(None);
    };
    let r = &source.secret_ref;
    let err = |problem: &str, class| ControllerError::UserData {
        namespace: namespace.to_string(),
        name: r.name.clone(),
        key: r.key.clone(),
        problem: problem.to_string(),
        class,
    };
    // One answer, one class, for "no such Secret", "not opted in" and "no such key": a user
    // who may create Proxies but not read Secrets must not learn from a Proxy's status or
    // events which Secrets exist in the namespace or what they hold.
    let unusable = || {
        err(
            &format!(
                "no such Secret, or it does not carry the label {USER_DATA_LABEL}=true (a \
                 Proxy may only use a Secret that opts in to being copied into a VM's seed), \
                 or it has no such key"
            ),
            ErrorClass::NotFound,
        )
    };
    let secrets = Api::<Secret>::namespaced(ctx.client.clone(), namespace);
    let secret = secrets.get_opt(&r.name).await?.ok_or_else(unusable)?;
    let opted_in = secret
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(USER_DATA_LABEL))
        .is_some_and(|v| v == "true");
    if !opted_in {
        return Err(unusable());
    }
    let bytes = secret
        .data
        .as_ref()
        .and_then(|d| d.get(&r.key))
        .map(|b| b.0.clone())
        .or_else(|| {
            secret
                .string_data
                .as_ref()
                .and_then(|d| d.get(&r.key))
                .map(|s| s.clone().into_bytes())
        })
        .ok_or_else(unusable)?;
    if bytes.len() > MAX_USER_DATA {
        return Err(err(
            &format!(
                "{} bytes is over the {MAX_USER_DATA}-byte limit",
                bytes.len()
            ),
            ErrorClass::Permanent,
        ));
    }
    Ok(Some(UserData::new(bytes)))
}

async fn write_status(
    ctx: &Context,
    proxy: &Proxy,
    status: &ProxyStatus,
) -> Result<(), ControllerError> {
    let ns = proxy
        .namespace()
        .ok_or(ControllerError::Incomplete("metadata.namespace"))?;
    let api = Api::<Proxy>::namespaced(ctx.client.clone(), &ns);
    let body = serde_json::json!({
        "apiVersion": Proxy::api_version(&()),
        "kind": Proxy::kind(&()),
        "status": status,
    });
    let uid = proxy.uid().unwrap_or_default();
    // Server-side apply of the whole status, forced (the controller owns every status
    // field), strict, and without the fields an older installed CRD lacks when it must.
    let seen = serde_json::to_value(&proxy.status).ok();
    match crate::status_apply::apply_status(
        &api,
        &proxy.name_any(),
        FIELD_MANAGER,
        &body,
        seen.as_ref(),
    )
    .await
    {
        Ok(crate::status_apply::Applied::Whole) => {
            ctx.serving.written(&uid, Some(status));
            Ok(())
        }
        // Written so before, and told then: the object is as that write left it.
        Ok(crate::status_apply::Applied::AsBefore) => {
            ctx.serving.written(&uid, None);
            Ok(())
        }
        Ok(crate::status_apply::Applied::Dropped(what)) => {
            // What the server kept differs from what we hold: the next reconcile compares
            // against the object as read, so nothing is remembered as written.
            ctx.serving.written(&uid, None);
            ctx.metrics.skew.dropped("Proxy");
            tracing::warn!(proxy = %proxy.name_any(), unknown = %what, "status written without fields the installed CRD does not know");
            event(
                ctx,
                proxy,
                EventType::Warning,
                "StatusFieldsDropped",
                "WriteStatus",
                crate::status_apply::dropped_note(&what),
            )
            .await;
            Ok(())
        }
        Err(e) => {
            ctx.serving.written(&uid, None);
            Err(e.into())
        }
    }
}

/// The largest event note events.k8s.io accepts, in bytes; a longer one is refused
/// with a 422, so the whole event would be lost.
pub const MAX_EVENT_NOTE: usize = 1024;
/// Ends a note that was cut to [`MAX_EVENT_NOTE`].
const NOTE_CUT: &str = " [truncated]";

/// `note` cut to at most [`MAX_EVENT_NOTE`] bytes on a UTF-8 character boundary, marked
/// as cut; unchanged when it fits.
pub fn event_note(note: String) -> String {
    if note.len() <= MAX_EVENT_NOTE {
        return note;
    }
    let mut end = MAX_EVENT_NOTE - NOTE_CUT.len();
    while !note.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}{NOTE_CUT}", &note[..end])
}

/// Publishes an event; a failure is logged at warn (events are how people learn of a
/// failure), never fails the reconcile.
async fn event(
    ctx: &Context,
    proxy: &Proxy,
    type_: EventType,
    reason: &str,
    action: &str,
    note: String,
) {
    let ev = Event {
        type_,
        reason: reason.into(),
        note: Some(event_note(note)),
        action: action.into(),
        secondary: None,
    };
    if let Err(e) = ctx.recorder.publish(&ev, &proxy.object_ref(&())).await {
        ctx.metrics.event_failed();
        tracing::warn!(
            proxy = %format!("{}/{}", proxy.namespace().unwrap_or_default(), proxy.name_any()),
            error = %e,
            reason,
            "could not publish event"
        );
    }
}

/// How long a reconcile may hold the shutdown: the bounded waits inside a Create.
pub const SHUTDOWN_WAIT_HINT: Duration = Duration::from_secs(120);

#[cfg(test)]
mod tests;
