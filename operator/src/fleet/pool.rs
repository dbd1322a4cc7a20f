//! The `ProxyPool` controller: reads the pool's members, the hosts (the providers config
//! for names and `maxDomains`, `ProviderHealth` for reachability) and the fast probe's
//! verdicts, asks [`plan`] what to do, and does it with plain Kubernetes writes: create a
//! Proxy (owned by the pool, pinned to the chosen host), annotate one to drain it, delete
//! one. The Proxy controller makes and removes the VMs.
//!
//! A pool at rest is judged from the controller's caches and nothing is read
//! ([`super::at_rest`]). Whenever there is anything to do, the members are listed from the
//! API server and the plan is made again on that, so a Proxy created by the previous
//! reconcile is always counted and never created twice.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::api::{DeleteParams, ListParams, ObjectMeta, Patch, PatchParams, PostParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use kube::{Api, Client, Resource, ResourceExt};
use tokio::sync::watch;

use crate::api::provider_health::ProviderHealth;
use crate::api::proxy::Proxy;
use crate::api::proxy_pool::{
    DRAINING_ANNOTATION, HostCount, POOL_LABEL, ProxyPool, ProxyPoolStatus, TEMPLATE_HASH_LABEL,
};
use crate::config::ValidConfig;
use crate::controller::status::set_condition;
use crate::status_apply::Applied;

use super::failures::{CreateBackoff, FailureBook, Observed};
use super::plan::{self, HostSlot, Plan, PoolShape};
use super::{FleetError, FleetMetrics, LivenessBoard, Member, pool_selector};

/// Field manager of the pool controller's status writes.
const STATUS_MANAGER: &str = "egress-operator-pool";
/// How soon a pool under way is looked at again when no event comes.
const PROGRESS_RESYNC: Duration = Duration::from_secs(5);
/// Resync of a settled pool.
const RESYNC: Duration = Duration::from_secs(60);

/// A wall clock (replaceable in tests).
pub type Clock = Arc<dyn Fn() -> jiff::Timestamp + Send + Sync>;

/// What the fleet controllers share.
pub struct FleetContext {
    /// The API client.
    pub client: Client,
    /// The providers config read at start: host names, the proxy port, the replace grace.
    pub config: Arc<ValidConfig>,
    /// The config in force, which a reload replaces (hosts' `maxDomains`); `None`:
    /// `config` for good.
    pub live: Option<Arc<crate::config::live::Live>>,
    /// The providers, to judge members' revisions (`None`: by their condition alone).
    pub providers: Option<Arc<crate::provider::registry::Registry>>,
    /// The fast probe's verdicts.
    pub board: Arc<LivenessBoard>,
    /// Metrics.
    pub metrics: FleetMetrics,
    /// Events.
    pub recorder: Recorder,
    /// The proxy port (`serving.port`).
    pub port: u16,
    /// True while this replica leads: a deposed replica writes nothing (invariant F4).
    pub leading: watch::Receiver<bool>,
    /// Condition and drain times.
    pub clock: Clock,
    /// Where the pool and lease caches are shown to the object-state metrics, when exported.
    pub state: Option<crate::state_metrics::StateMetrics>,
    /// Each pool's members that failed in a row (the leader's memory).
    pub failures: FailureBook,
    /// How creates back off while a pool's members keep failing.
    pub create_backoff: CreateBackoff,
    /// UIDs of the pools whose `InsufficientHosts` event is written (once per shortage;
    /// the condition alone could be read stale from the cache).
    short: std::sync::Mutex<std::collections::HashSet<String>>,
    /// The pool controller's reflected watches, once [`run`] has made them.
    pool_caches: std::sync::OnceLock<super::at_rest::PoolCaches>,
}

impl std::fmt::Debug for FleetContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FleetContext")
            .field("port", &self.port)
            .finish_non_exhaustive()
    }
}

impl FleetContext {
    /// A context; `instance` names this replica in events.
    pub fn new(
        client: Client,
        config: Arc<ValidConfig>,
        board: Arc<LivenessBoard>,
        metrics: FleetMetrics,
        leading: watch::Receiver<bool>,
        instance: Option<String>,
    ) -> Self {
        let recorder = Recorder::new(
            client.clone(),
            Reporter {
                controller: "egress-operator-fleet".into(),
                instance,
            },
        );
        let port = config.serving.port;
        Self {
            client,
            config,
            live: None,
            providers: None,
            board,
            metrics,
            recorder,
            port,
            leading,
            clock: Arc::new(jiff::Timestamp::now),
            state: None,
            failures: FailureBook::default(),
            create_backoff: CreateBackoff::default(),
            short: std::sync::Mutex::default(),
            pool_caches: std::sync::OnceLock::new(),
        }
    }

    /// The pool controller's caches (see [`super::at_rest`]).
    pub(super) fn pool_caches(&self) -> Option<&super::at_rest::PoolCaches> {
        self.pool_caches.get()
    }

    /// The same context, placing with the config in force in `live`.
    pub fn with_live(mut self, live: Arc<crate::config::live::Live>) -> Self {
        self.live = Some(live);
        self
    }

    /// The config in force now.
    pub fn current_config(&self) -> Arc<ValidConfig> {
        crate::config::live::current(&self.config, self.live.as_deref())
    }

    /// The same context, judging members' revisions with `providers` itself.
    pub fn with_providers(mut self, providers: Arc<crate::provider::registry::Registry>) -> Self {
        self.providers = Some(providers);
        self
    }

    /// Whether `p` was made from inputs that changed since, judged now against the
    /// config in force: its recorded revision against what its provider would make. The
    /// Proxy controller's `UpToDate` condition says the same, but only at its next look
    /// (up to a probe period after a reload); a pool acting on a condition not judged
    /// again yet would roll too late, or replace members a rollback just made current
    /// again. `None` when it cannot tell (no revision or host recorded, no provider, a
    /// plugin still loading): the condition decides then.
    /// `p` as the fleet sees it: [`Member::of`] with its revision judged now
    /// ([`Self::member_outdated`]). Every fleet controller (pool, at-rest check, leases)
    /// reads members through this, so none acts on a stale `UpToDate` condition.
    pub fn member(&self, p: &Proxy) -> Member {
        let mut m = Member::of(p, &self.board);
        if let Some(outdated) = self.member_outdated(p) {
            m.outdated = outdated;
        }
        m
    }

    pub fn member_outdated(&self, p: &Proxy) -> Option<bool> {
        let status = p.status.as_ref()?;
        let recorded = status.revision.as_ref()?;
        let host = status.host.as_deref()?;
        let provider = self.providers.as_ref()?.get(&p.spec.provider)?;
        let (_, changed) =
            crate::revision::compare(provider.as_ref(), &p.spec, host, Some(recorded))?;
        Some(!changed.is_empty())
    }

    /// A key that changes whenever a reload installs another config: a streak of failed
    /// members is of one template under one config, and a new config starts afresh.
    pub fn config_generation(&self) -> u64 {
        self.live.as_ref().map_or(0, |l| l.snapshot().generation)
    }

    /// The same context with another create backoff (tests shorten it).
    pub fn with_create_backoff(mut self, backoff: CreateBackoff) -> Self {
        self.create_backoff = backoff;
        self
    }

    /// The same context, showing the pool and lease caches to `state`.
    pub fn with_state(mut self, state: crate::state_metrics::StateMetrics) -> Self {
        self.state = Some(state);
        self
    }

    /// Now.
    pub fn now(&self) -> jiff::Timestamp {
        (self.clock)()
    }

    /// Whether this replica may write.
    pub fn leading(&self) -> bool {
        *self.leading.borrow()
    }

    /// Whether the pool `uid`'s shortage of hosts was told already (by this replica, or
    /// by the pool's condition).
    fn shortage_told(&self, uid: &str, pool: &ProxyPool) -> bool {
        self.short.lock().is_ok_and(|known| known.contains(uid))
            || degraded_reason(pool) == Some("InsufficientHosts")
    }

    /// Records whether the pool `uid` is short of hosts now (after its event was told).
    pub(super) fn set_shortage(&self, uid: &str, short: bool) {
        if let Ok(mut known) = self.short.lock() {
            if short {
                known.insert(uid.to_string());
            } else {
                known.remove(uid);
            }
        }
    }
}

/// Publishes an event on the pool; a failure is logged only.
pub(super) async fn publish(
    ctx: &FleetContext,
    pool: &ProxyPool,
    type_: EventType,
    reason: &str,
    action: &str,
    note: String,
) {
    let ev = Event {
        type_,
        reason: reason.into(),
        // Cut as the Proxy controller's notes are: the API server refuses a longer one
        // (422), and the whole event would be lost.
        note: Some(crate::controller::event_note(note)),
        action: action.into(),
        secondary: None,
    };
    if let Err(e) = ctx.recorder.publish(&ev, &pool.object_ref(&())).await {
        tracing::warn!(error = %e, reason, "could not publish event");
    }
}

/// A stream that yields once per change of the board (for `reconcile_all_on`).
pub(super) fn board_changes(
    board: &LivenessBoard,
) -> impl futures_util::Stream<Item = ()> + Send + 'static {
    futures_util::stream::unfold(board.subscribe(), |mut rx| async move {
        match rx.recv().await {
            Ok(()) | Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => Some(((), rx)),
            Err(tokio::sync::broadcast::error::RecvError::Closed) => None,
        }
    })
}

/// A stream that yields once per config a reload installs (never without `live`): every
/// pool then looks at once at which members the new config made out of date.
fn config_changes(
    live: Option<&crate::config::live::Live>,
) -> impl futures_util::Stream<Item = ()> + Send + 'static {
    let rx = live.map(crate::config::live::Live::subscribe);
    futures_util::stream::unfold(rx, |rx| async move {
        let mut rx = rx?;
        match rx.changed().await {
            Ok(()) => Some(((), Some(rx))),
            Err(_) => None,
        }
    })
}

/// The pool's shape for [`plan::plan`].
pub fn shape_of(pool: &ProxyPool, config: &ValidConfig) -> PoolShape {
    let s = &pool.spec;
    let n = |v: i32| usize::try_from(v).unwrap_or(0);
    PoolShape {
        replicas: n(s.replicas),
        max_surge: n(s.max_surge),
        max_unavailable: n(s.max_unavailable),
        drain: Duration::from_secs(u64::from(s.drain_seconds)),
        template_hash: s.template.hash(),
        replace_after: Duration::from_secs(u64::from(config.serving.replace_after_seconds)),
        creates: plan::CreateGate::Open,
        progress_deadline: Duration::from_secs(u64::from(s.progress_deadline_seconds)),
    }
}

/// The hosts a pool may use: the configured ones (or the pool's subset), their health from
/// `health` (a host it does not mention counts as healthy), and their room given `used`
/// Proxies per host.
pub fn host_slots(
    pool: &ProxyPool,
    config: &ValidConfig,
    health: Option<&ProviderHealth>,
    used: &BTreeMap<String, usize>,
) -> Vec<HostSlot> {
    let wanted = pool.spec.hosts.as_ref();
    config
        .kvm2
        .hosts
        .iter()
        .filter(|h| wanted.is_none_or(|w| w.iter().any(|n| n.0 == h.name)))
        .map(|h| {
            let healthy = health
                .and_then(|ph| ph.status.as_ref())
                .and_then(|s| s.targets.iter().find(|t| t.name == h.name))
                .is_none_or(|t| t.reachable);
            let max = usize::try_from(h.max_domains).unwrap_or(usize::MAX);
            HostSlot {
                name: h.name.clone(),
                healthy,
                room: max.saturating_sub(used.get(&h.name).copied().unwrap_or(0)),
            }
        })
        .collect()
}

/// Proxies per host across the whole cluster (status host, else the pinned one) that hold
/// a VM or may be about to: one with an instance, or one not failed (a Create may be in
/// flight). A Proxy that failed without ever getting an instance holds no room: counting it
/// would let anyone allowed to create Proxies pin failing ones to every host and starve
/// every pool of every tenant, paying for no VM. The provider's own placement still checks
/// `maxDomains` at Create time, so an estimate that runs low costs a retried Create, never
/// an overfull host.
fn usage(all: &[Proxy]) -> BTreeMap<String, usize> {
    let mut used = BTreeMap::new();
    for p in all.iter().filter(|p| holds_room(p)) {
        let host = p
            .status
            .as_ref()
            .and_then(|s| s.host.clone())
            .or_else(|| p.spec.host.clone());
        if let Some(h) = host {
            *used.entry(h).or_insert(0) += 1;
        }
    }
    used
}

fn holds_room(p: &Proxy) -> bool {
    let Some(s) = p.status.as_ref() else {
        return true;
    };
    s.instance_id.is_some()
        || (s.last_error_class.is_none() && s.phase != Some(crate::api::proxy::ProxyPhase::Failed))
}

/// One reconcile of one pool.
pub async fn reconcile(pool: Arc<ProxyPool>, ctx: Arc<FleetContext>) -> Result<Action, FleetError> {
    if !ctx.leading() || pool.metadata.deletion_timestamp.is_some() {
        return Ok(Action::await_change());
    }
    let ns = pool
        .namespace()
        .ok_or(FleetError::Incomplete("metadata.namespace"))?;
    let name = pool.name_any();
    let owner = pool
        .controller_owner_ref(&())
        .ok_or(FleetError::Incomplete("metadata.uid"))?;
    // At rest the caches say so, and nothing is read (issue 35, item 4).
    if let Some(action) = super::at_rest::look(&ctx, &pool, &ns, &name, &owner.uid) {
        return Ok(action);
    }
    let proxies = Api::<Proxy>::namespaced(ctx.client.clone(), &ns);
    let mine = proxies
        .list(&ListParams::default().labels(&pool_selector(&name)))
        .await?;
    let demand = super::lease::surge::for_pool(&ctx.client, &pool).await?;
    let members: Vec<Member> = mine
        .items
        .iter()
        // Only Proxies this pool controls (a copied label does not make one ours), by the
        // same rule discovery uses.
        .filter(|p| super::membership::controlled_by(p, &owner.uid))
        .map(|p| {
            let mut m = ctx.member(p);
            // Claimed by a lease: the lease's to take, not the pool's to remove.
            m.leased |= demand.claimed.contains(&m.uid);
            m
        })
        .collect();
    let health = Api::<ProviderHealth>::all(ctx.client.clone())
        .get_opt(&pool.spec.template.provider)
        .await?;
    let mut shape = shape_of(&pool, &ctx.config);
    shape.replicas += demand.surge;
    let now = ctx.now();
    // A streak belongs to one template under one config: a reload (a fixed plugin, the
    // old digest put back) starts afresh, so a stalled rollout resumes.
    let failures = ctx.failures.observe(
        owner.uid.as_str(),
        super::failures::Current {
            template_hash: &shape.template_hash,
            config_generation: ctx.config_generation(),
            deadline: shape.progress_deadline,
            replicas: shape.replicas,
        },
        &members,
        &failure_messages(&mine.items),
        now,
        ctx.create_backoff,
    );
    // Told at once: a failure is counted once, and the writes below may fail.
    report_failures(&ctx, &pool, &ns, &name, &failures).await;
    shape.creates = failures.gate();
    // First without the cluster's usage (cheap); creates need the real room, so only
    // then every Proxy is listed.
    let mut slots = host_slots(
        &pool,
        &ctx.current_config(),
        health.as_ref(),
        &BTreeMap::new(),
    );
    let mut p = plan::plan(&shape, &members, &slots, now);
    if !p.create.is_empty() {
        let all = Api::<Proxy>::all(ctx.client.clone())
            .list(&ListParams::default())
            .await?;
        slots = host_slots(
            &pool,
            &ctx.current_config(),
            health.as_ref(),
            &usage(&all.items),
        );
        p = plan::plan(&shape, &members, &slots, now);
    }
    // What each Proxy was when the plan was made: the drain and the delete apply only to
    // that version, so a lease that took the proxy meanwhile keeps it.
    let listed: BTreeMap<String, String> = mine
        .items
        .iter()
        .filter_map(|p| {
            Some((
                p.metadata.name.clone()?,
                p.metadata.resource_version.clone()?,
            ))
        })
        .collect();
    let told = ctx.shortage_told(&owner.uid, &pool);
    execute(&ctx, &pool, &ns, &owner, &shape, &p, &listed).await?;
    // Once per shortage, not once per look: the condition says it meanwhile.
    if p.insufficient_hosts && !told {
        publish(
            &ctx,
            &pool,
            EventType::Warning,
            "InsufficientHosts",
            "Place",
            "no healthy host with room for another proxy".into(),
        )
        .await;
    }
    // While the backoff holds creates back, whether the hosts could take them is not
    // known: the shortage stands as it was.
    if !p.held_back {
        ctx.set_shortage(&owner.uid, p.insufficient_hosts);
    }
    write_status(&ctx, &pool, &ns, &name, &shape, &p, &failures).await?;
    ctx.metrics.rollout(
        &ns,
        &name,
        i32::try_from(p.counts.updated).unwrap_or(i32::MAX),
        pool.spec.replicas,
    );
    Ok(Action::requeue(next_look(&p)))
}

/// When to look at a pool again if nothing wakes it sooner. A pool under way is looked at
/// every few seconds; one that only waits for host room is not (issue 33, item 13): every
/// look lists the cluster's Proxies, and ProviderHealth and member changes wake it anyway.
pub(super) fn next_look(p: &Plan) -> Duration {
    let acting = !p.create.is_empty() || !p.drain.is_empty() || !p.delete.is_empty();
    match p.requeue {
        Some(r) => r.min(PROGRESS_RESYNC),
        None if p.insufficient_hosts && !acting => RESYNC,
        None if p.counts.progressing => PROGRESS_RESYNC,
        None => RESYNC,
    }
}

/// What failed, by Proxy UID, for the failed ones: the `Ready` condition's reason and
/// message, as the Proxy controller wrote them.
pub(super) fn failure_messages(proxies: &[Proxy]) -> BTreeMap<String, String> {
    proxies
        .iter()
        .filter(|p| {
            p.status
                .as_ref()
                .is_some_and(|s| s.phase == Some(crate::api::proxy::ProxyPhase::Failed))
        })
        .filter_map(|p| {
            let st = p.status.as_ref()?;
            let ready = crate::controller::status::condition(st, crate::controller::status::READY)?;
            Some((p.uid()?, format!("{}: {}", ready.reason, ready.message)))
        })
        .collect()
}

/// One Warning event per member seen failed (its Proxy, and so its status, goes once it
/// is replaced), and one Normal event when a streak ends.
async fn report_failures(
    ctx: &FleetContext,
    pool: &ProxyPool,
    ns: &str,
    name: &str,
    failures: &Observed,
) {
    for (_, what) in &failures.new {
        ctx.metrics.action(ns, name, "failed");
        let next = failures
            .streak
            .as_ref()
            .map(|s| {
                format!(
                    "; {} failed in a row, next create not before {}",
                    s.count, s.until
                )
            })
            .unwrap_or_default();
        publish(
            ctx,
            pool,
            EventType::Warning,
            "ProxyFailed",
            "Create",
            format!("{what}{next}"),
        )
        .await;
    }
    if failures.cleared {
        publish(
            ctx,
            pool,
            EventType::Normal,
            "ProxiesServing",
            "Create",
            "a proxy of the current template serves: creates are no longer held back".into(),
        )
        .await;
    }
}

/// The reason of the pool's `Degraded` condition when it is True.
fn degraded_reason(pool: &ProxyPool) -> Option<&str> {
    pool.status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == "Degraded" && c.status == "True")
        .map(|c| c.reason.as_str())
}

async fn execute(
    ctx: &FleetContext,
    pool: &ProxyPool,
    ns: &str,
    owner: &k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference,
    shape: &PoolShape,
    p: &Plan,
    listed: &BTreeMap<String, String>,
) -> Result<(), FleetError> {
    let name = pool.name_any();
    let api = Api::<Proxy>::namespaced(ctx.client.clone(), ns);
    for victim in &p.delete {
        // Victims come from the listed members; one without a version is not written.
        let Some(version) = listed.get(victim) else {
            continue;
        };
        if delete_if_unchanged(&api, victim, version).await? != Written::Done {
            continue;
        }
        ctx.metrics.action(ns, &name, "deleted");
        publish(
            ctx,
            pool,
            EventType::Normal,
            "ProxyDeleted",
            "ScaleIn",
            format!("deleted {victim}"),
        )
        .await;
    }
    for victim in &p.drain {
        let Some(version) = listed.get(victim) else {
            continue;
        };
        if drain_if_unchanged(&api, victim, version, ctx.now()).await? != Written::Done {
            continue;
        }
        ctx.metrics.action(ns, &name, "drained");
        publish(
            ctx,
            pool,
            EventType::Normal,
            "ProxyDraining",
            "ScaleIn",
            format!(
                "draining {victim} for {} s before deleting it",
                shape.drain.as_secs()
            ),
        )
        .await;
    }
    for host in &p.create {
        let proxy = Proxy {
            metadata: ObjectMeta {
                generate_name: Some(format!("{name}-")),
                namespace: Some(ns.into()),
                labels: Some(BTreeMap::from([
                    (POOL_LABEL.to_string(), name.clone()),
                    (TEMPLATE_HASH_LABEL.to_string(), shape.template_hash.clone()),
                ])),
                owner_references: Some(vec![owner.clone()]),
                ..Default::default()
            },
            spec: pool.spec.template.proxy_spec(Some(host.clone())),
            status: None,
        };
        let made = api.create(&PostParams::default(), &proxy).await?;
        ctx.metrics.action(ns, &name, "created");
        publish(
            ctx,
            pool,
            EventType::Normal,
            "ProxyCreated",
            "ScaleOut",
            format!("created {} on {host}", made.name_any()),
        )
        .await;
    }
    Ok(())
}

/// What a write conditioned on the version the pool planned with did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Written {
    /// Written.
    Done,
    /// The Proxy is gone already.
    Gone,
    /// The Proxy changed since it was listed (a lease may have taken it): nothing was
    /// written; its change triggers a new reconcile, which plans again.
    Changed,
}

fn conditional(r: Result<(), kube::Error>) -> Result<Written, FleetError> {
    match r {
        Ok(()) => Ok(Written::Done),
        Err(kube::Error::Api(s)) if s.is_not_found() => Ok(Written::Gone),
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(Written::Changed),
        Err(e) => Err(e.into()),
    }
}

/// Marks `name` draining, only if it is still at `version` (the API server checks a
/// `resourceVersion` in a patch body): between the pool's plan and this write a lease may
/// bind the proxy, and a leased proxy must not be drained.
pub async fn drain_if_unchanged(
    api: &Api<Proxy>,
    name: &str,
    version: &str,
    now: jiff::Timestamp,
) -> Result<Written, FleetError> {
    let body = serde_json::json!({
        "metadata": {
            "resourceVersion": version,
            "annotations": { DRAINING_ANNOTATION: now.to_string() },
        }
    });
    conditional(
        api.patch(name, &PatchParams::default(), &Patch::Merge(&body))
            .await
            .map(drop),
    )
}

/// Deletes `name`, only if it is still at `version` (a delete precondition), for the same
/// reason as [`drain_if_unchanged`].
pub async fn delete_if_unchanged(
    api: &Api<Proxy>,
    name: &str,
    version: &str,
) -> Result<Written, FleetError> {
    let params = DeleteParams {
        preconditions: Some(kube::api::Preconditions {
            resource_version: Some(version.to_string()),
            uid: None,
        }),
        ..DeleteParams::background()
    };
    conditional(api.delete(name, &params).await.map(drop))
}

async fn write_status(
    ctx: &FleetContext,
    pool: &ProxyPool,
    ns: &str,
    name: &str,
    shape: &PoolShape,
    p: &Plan,
    failures: &Observed,
) -> Result<(), FleetError> {
    let next = next_status(pool, name, shape, p, failures, ctx.now());
    // A settled pool is reconciled every minute and on every liveness change: write only
    // what changed, so a fleet at rest makes no status writes (the endpoints and
    // `EndpointsHeld` are discovery's, and compared there).
    if status_current(pool, &next) {
        return Ok(());
    }
    let body = serde_json::json!({
        "apiVersion": ProxyPool::api_version(&()),
        "kind": ProxyPool::kind(&()),
        "metadata": { "name": name, "namespace": ns },
        "status": {
            "replicas": next.replicas,
            "readyReplicas": next.ready_replicas,
            "updatedReplicas": next.updated_replicas,
            "availableReplicas": next.available_replicas,
            "selector": next.selector,
            "hosts": next.hosts,
            "observedGeneration": next.observed_generation,
            "conditions": next.conditions,
        },
    });
    let api = Api::<ProxyPool>::namespaced(ctx.client.clone(), ns);
    let applied = crate::status_apply::apply_status(
        &api,
        name,
        STATUS_MANAGER,
        &body,
        serde_json::to_value(&pool.status).ok().as_ref(),
    )
    .await?;
    skewed(ctx, pool, &applied).await;
    Ok(())
}

/// Whether the pool's status already says `next` in the fields the pool controller owns.
pub(super) fn status_current(pool: &ProxyPool, next: &ProxyPoolStatus) -> bool {
    pool.status.as_ref().is_some_and(|seen| {
        let mut seen = seen.clone();
        seen.conditions.retain(is_pool_condition);
        seen.endpoints.clear();
        &seen == next
    })
}

/// The status the pool controller owns, for the plan `p` made now (the endpoints and
/// `EndpointsHeld` are discovery's: left out).
pub(super) fn next_status(
    pool: &ProxyPool,
    name: &str,
    shape: &PoolShape,
    p: &Plan,
    failures: &Observed,
    now: jiff::Timestamp,
) -> ProxyPoolStatus {
    let c = &p.counts;
    let generation = pool.metadata.generation;
    let mut conditions: Vec<Condition> = pool
        .status
        .as_ref()
        .map(|s| s.conditions.clone())
        .unwrap_or_default();
    conditions.retain(is_pool_condition);
    let min = shape.replicas.saturating_sub(shape.max_unavailable);
    let available = c.available >= min;
    set_condition(
        &mut conditions,
        "Available",
        available,
        if available {
            "MinimumServing"
        } else {
            "BelowMinimum"
        },
        &format!("{} of at least {min} serve", c.available),
        generation,
        now,
    );
    // A rollout whose new members keep failing halts: the backoff holds creates back and
    // no serving old member goes (surge-first), until the template or the config changes
    // again or a new member serves.
    let stalled = c.progressing && failures.streak.is_some();
    set_condition(
        &mut conditions,
        "Progressing",
        c.progressing && !stalled,
        if stalled {
            "RolloutStalled"
        } else if c.progressing {
            "RollingOut"
        } else {
            "Settled"
        },
        &format!(
            "{} of {} made from the current template and config{}",
            c.updated,
            shape.replicas,
            if stalled {
                "; new members keep failing, so no old member is removed (see Degraded)"
            } else {
                ""
            }
        ),
        generation,
        now,
    );
    let (degraded, reason, msg) = if let Some(s) = &failures.streak {
        (
            true,
            "ProxiesFailing",
            format!(
                "{} proxies of the current template failed in a row; the last: {}; creates \
                 held back until {}, then one at a time",
                s.count, s.last, s.until
            ),
        )
    } else if p.insufficient_hosts {
        (
            true,
            "InsufficientHosts",
            "no healthy host with room for another proxy (see ProviderHealth and maxDomains)"
                .to_string(),
        )
    } else {
        (false, "AsExpected", String::new())
    };
    set_condition(
        &mut conditions,
        "Degraded",
        degraded,
        reason,
        &crate::controller::event_note(msg),
        generation,
        now,
    );
    let n = |v: usize| i32::try_from(v).unwrap_or(i32::MAX);
    let hosts: Vec<HostCount> = c
        .hosts
        .iter()
        .map(|(h, k)| HostCount {
            host: h.clone(),
            replicas: n(*k),
        })
        .collect();
    ProxyPoolStatus {
        replicas: n(c.replicas),
        ready_replicas: n(c.ready),
        updated_replicas: n(c.updated),
        available_replicas: n(c.available),
        selector: Some(pool_selector(name)),
        hosts,
        observed_generation: generation,
        conditions,
        endpoints: Vec::new(),
    }
}

/// Tells of a status written without fields the installed CRD lacks (issue 33, item 12).
pub(super) async fn skewed(ctx: &FleetContext, pool: &ProxyPool, applied: &Applied) {
    if let Applied::Dropped(what) = applied {
        ctx.metrics.skew.dropped("ProxyPool");
        tracing::warn!(pool = %pool.name_any(), unknown = %what, "pool status written without fields the installed CRD does not know");
        publish(
            ctx,
            pool,
            EventType::Warning,
            "StatusFieldsDropped",
            "WriteStatus",
            crate::status_apply::dropped_note(what),
        )
        .await;
    }
}

/// The condition types the pool controller owns (discovery owns `EndpointsHeld`).
fn is_pool_condition(c: &Condition) -> bool {
    matches!(c.type_.as_str(), "Available" | "Progressing" | "Degraded")
}

fn error_policy(pool: Arc<ProxyPool>, error: &FleetError, _ctx: Arc<FleetContext>) -> Action {
    tracing::warn!(pool = %pool.name_any(), error = %error, "pool reconcile failed");
    Action::requeue(Duration::from_secs(5))
}

/// Runs the pool controller until `shutdown`: pools, their Proxies, ProviderHealth and
/// the fast probe's verdicts trigger reconciles.
pub async fn run<F>(ctx: Arc<FleetContext>, shutdown: F)
where
    F: std::future::Future<Output = ()> + Send + Sync + 'static,
{
    let client = ctx.client.clone();
    let (reader, writer) = kube::runtime::reflector::store();
    let pool_events = kube::runtime::WatchStreamExt::reflect(
        super::events::<ProxyPool>(client.clone(), ctx.metrics.watch.clone()),
        writer,
    );
    let controller = Controller::for_stream(
        kube::runtime::WatchStreamExt::applied_objects(pool_events),
        reader,
    );
    let pools = controller.store();
    if let Some(state) = &ctx.state {
        state.set_pools(controller.store());
    }
    let prune = prune_gone_pools(ctx.clone(), controller.store());
    // Reflected, so a pool at rest is judged from them (see `super::at_rest`).
    let (proxies, proxy_events) = super::cache::pool_proxies(client.clone());
    let (health, health_events) = super::cache::reflected(
        Api::<ProviderHealth>::all(client.clone()),
        watcher::Config::default().any_semantic(),
    );
    let (leases, lease_writer) = kube::runtime::reflector::store();
    let lease_events =
        kube::runtime::WatchStreamExt::touched_objects(kube::runtime::WatchStreamExt::reflect(
            super::events::<crate::api::proxy_lease::ProxyLease>(
                client.clone(),
                ctx.metrics.watch.clone(),
            ),
            lease_writer,
        ));
    let _ = ctx.pool_caches.set(super::at_rest::PoolCaches {
        proxies,
        health,
        leases: super::cache::Cache::new(leases),
    });
    let run = controller
        .owns_stream(proxy_events)
        .watches_stream(health_events, move |_| {
            pools
                .state()
                .into_iter()
                .map(|p| ObjectRef::from_obj(&*p))
                .collect::<Vec<_>>()
        })
        .watches_stream(lease_events, super::lease::surge::pool_of)
        .reconcile_all_on(futures_util::stream::select(
            board_changes(&ctx.board),
            config_changes(ctx.live.as_deref()),
        ))
        .with_config(super::controller_config())
        .graceful_shutdown_on(shutdown)
        .run(reconcile, error_policy, ctx)
        .for_each(|r| async move {
            if let Err(e) = r {
                tracing::debug!(error = %e, "pool controller stream");
            }
        });
    // The pruning never ends on its own: the controller's end ends both.
    tokio::select! {
        () = run => {}
        () = prune => {}
    }
}

/// How often the series and failure streaks of pools that went are dropped.
const PRUNE_EVERY: Duration = Duration::from_secs(10);

/// Drops the metric series and failure streaks of pools that are gone. A pool without a
/// finalizer goes without a last reconcile, so this reads the cache instead, once it holds
/// the first full list (an empty cache before that would drop every pool's series).
async fn prune_gone_pools(
    ctx: Arc<FleetContext>,
    store: kube::runtime::reflector::Store<ProxyPool>,
) {
    if store.wait_until_ready().await.is_err() {
        return std::future::pending().await;
    }
    let mut tick = tokio::time::interval(PRUNE_EVERY);
    loop {
        tick.tick().await;
        let pools = store.state();
        let live: std::collections::HashSet<(String, String)> = pools
            .iter()
            .filter_map(|p| Some((p.namespace()?, p.name_any())))
            .collect();
        ctx.metrics.retain_pools(&live);
        let uids: std::collections::HashSet<String> =
            pools.iter().filter_map(|p| p.uid()).collect();
        ctx.failures.retain(&uids);
        if let Ok(mut short) = ctx.short.lock() {
            short.retain(|uid| uids.contains(uid));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::proxy::{ProxyPhase, ProxySpec, ProxyStatus};

    fn on_h1(status: Option<ProxyStatus>) -> Proxy {
        let mut p = Proxy::new(
            "p",
            ProxySpec {
                host: Some("h1".into()),
                ..ProxySpec::default()
            },
        );
        p.status = status;
        p
    }

    #[test]
    fn only_proxies_with_a_vm_or_a_create_ahead_hold_room() {
        let failed_without_vm = on_h1(Some(ProxyStatus {
            phase: Some(ProxyPhase::Failed),
            last_error_class: Some("permanent".into()),
            ..ProxyStatus::default()
        }));
        let stuck_without_vm = on_h1(Some(ProxyStatus {
            phase: Some(ProxyPhase::Provisioning),
            last_error_class: Some("notFound".into()),
            ..ProxyStatus::default()
        }));
        let running = on_h1(Some(ProxyStatus {
            phase: Some(ProxyPhase::Running),
            host: Some("h1".into()),
            instance_id: Some("h1/egress-a".into()),
            ..ProxyStatus::default()
        }));
        let failed_with_vm = on_h1(Some(ProxyStatus {
            phase: Some(ProxyPhase::Failed),
            host: Some("h1".into()),
            instance_id: Some("h1/egress-b".into()),
            last_error_class: Some("permanent".into()),
            ..ProxyStatus::default()
        }));
        let creating = on_h1(Some(ProxyStatus {
            phase: Some(ProxyPhase::Provisioning),
            ..ProxyStatus::default()
        }));
        let new = on_h1(None);
        let attackers = vec![failed_without_vm; 50]
            .into_iter()
            .chain(vec![stuck_without_vm; 50]);
        let all: Vec<Proxy> = attackers
            .chain([running, failed_with_vm, creating, new])
            .collect();
        assert_eq!(usage(&all).get("h1"), Some(&4));
    }
}
