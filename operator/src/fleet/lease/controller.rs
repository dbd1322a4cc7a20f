//! The `ProxyLease` controller: reads the lease, its pool and the pool's Proxies, asks
//! [`binding`] what to do, and does it with guarded writes. It plans from its caches
//! first, and a plan that writes anything is made again on fresh reads from the API
//! server ([`super::view`]): a stale view is what let Metal3 bind one host twice. And:
//!
//! - every lease status write is a replace carrying the lease's resourceVersion;
//! - every write that takes or gives back a Proxy is a patch carrying the Proxy's
//!   resourceVersion.
//!
//! So when several reconciles race (two replicas around a handover, a stale cache), the
//! API server lets one write through and answers the others 409 Conflict; they look again.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Event, EventType};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use kube::{Api, Resource, ResourceExt};

use crate::api::proxy::Proxy;
use crate::api::proxy_lease::{
    LEASE_FINALIZER, LEASE_LABEL, LEASE_NAME_ANNOTATION, LEASE_SERVICE_LABEL, LeasePhase,
    ProxyLease, ProxyLeaseStatus, RecyclePolicy,
};
use crate::api::proxy_pool::{DRAINING_ANNOTATION, POOL_LABEL, ProxyPool};
use crate::controller::status::set_condition;

use super::super::Member;
use super::super::pool::FleetContext;
use super::binding;
use super::service::{self, ServiceState};
use super::view::{LeaseCaches, PoolView, Read, listed_by_others, mark_others, read_pool};
use super::{LeaseError, LeaseMetrics};

/// Condition type of the lease's Service.
pub const SERVICE_READY: &str = "ServiceReady";
/// Resync of a lease when no event comes: a safety net only. Every change that matters
/// wakes a lease by itself (its Proxies, Service and slices are watched, a proxy freeing
/// up wakes the leases that wait, a probe verdict change wakes every lease that has not
/// ended, the expiry and the loss timer are requeues of their own), so a lease at rest
/// costs one reconcile per resync: a GET of its pool and a LIST of the pool's Proxies,
/// plus a GET of its Service and two of its slices when it has one. No write.
pub const RESYNC: Duration = Duration::from_secs(300);
/// How soon a reconcile that lost a race looks again.
const CONFLICT_RETRY: Duration = Duration::from_millis(200);
/// Attempts at giving a proxy back when its resourceVersion keeps moving (the Proxy
/// controller writes status while the lease writes labels).
const RELEASE_ATTEMPTS: usize = 8;

/// How often proxies are looked for whose lease label names a lease that no longer
/// exists: rare (a finalizer removed by hand), so a slow sweep suffices.
pub const ORPHAN_SWEEP: Duration = Duration::from_secs(60);

/// What the lease controller needs: the fleet's context and its own metrics.
#[derive(Debug)]
pub struct LeaseContext {
    /// Client, liveness board, recorder, port, leadership, clock.
    pub fleet: Arc<FleetContext>,
    /// Lease metrics.
    pub metrics: LeaseMetrics,
    /// Period of [`sweep_orphans`].
    pub orphan_sweep: Duration,
    /// Period of a lease's resync ([`RESYNC`]).
    pub resync: Duration,
    /// The controller's reflected watches, once [`run`] has made them.
    caches: std::sync::OnceLock<LeaseCaches>,
}

impl LeaseContext {
    /// A context with the default sweep period.
    pub fn new(fleet: Arc<FleetContext>, metrics: LeaseMetrics) -> Self {
        Self {
            fleet,
            metrics,
            orphan_sweep: ORPHAN_SWEEP,
            resync: RESYNC,
            caches: std::sync::OnceLock::new(),
        }
    }

    /// The reflected watches a reconcile plans from first (see [`super::view`]).
    pub(super) fn caches(&self) -> Option<&LeaseCaches> {
        self.caches.get()
    }
}

fn is_conflict(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 409)
}

fn is_not_found(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 404)
}

async fn publish(
    ctx: &LeaseContext,
    lease: &ProxyLease,
    type_: EventType,
    reason: &str,
    note: String,
) {
    let ev = Event {
        type_,
        reason: reason.into(),
        // Cut as the Proxy controller's notes are: the API server refuses a longer one
        // (422), and the whole event would be lost.
        note: Some(crate::controller::event_note(note)),
        action: "Lease".into(),
        secondary: None,
    };
    if let Err(e) = ctx
        .fleet
        .recorder
        .publish(&ev, &lease.object_ref(&()))
        .await
    {
        tracing::warn!(error = %e, reason, "could not publish event");
    }
}

/// The members of `view` that `status` lists as bound.
fn members(view: &PoolView, status: &ProxyLeaseStatus) -> Vec<Member> {
    view.seen
        .iter()
        .filter(|s| status.proxies.iter().any(|b| b.uid == s.member.uid))
        .map(|s| s.member.clone())
        .collect()
}

/// Replaces the lease's status, guarded by `lease`'s resourceVersion.
async fn write_status(
    api: &Api<ProxyLease>,
    lease: &ProxyLease,
    status: ProxyLeaseStatus,
) -> Result<ProxyLease, kube::Error> {
    let mut next = lease.clone();
    next.status = Some(status);
    api.replace_status(&lease.name_any(), &PostParams::default(), &next)
        .await
}

/// The lease label of `proxy`, if set.
fn holder_of(proxy: &Proxy) -> Option<&str> {
    proxy
        .labels()
        .get(LEASE_LABEL)
        .map(String::as_str)
        .filter(|v| !v.is_empty())
}

/// Takes `proxy` for the lease: sets the lease label (and the lease name annotation) with
/// the Proxy's resourceVersion as read, so a concurrent take of the same proxy fails.
/// Ok(false): another write came first (409) or the proxy is gone.
async fn take(
    api: &Api<Proxy>,
    proxy: &Proxy,
    lease_uid: &str,
    lease_name: &str,
) -> Result<bool, kube::Error> {
    let Some(rv) = proxy.resource_version() else {
        return Ok(false);
    };
    let body = serde_json::json!({
        "metadata": {
            "resourceVersion": rv,
            "labels": { LEASE_LABEL: lease_uid },
            "annotations": { LEASE_NAME_ANNOTATION: lease_name },
        }
    });
    match api
        .patch(
            &proxy.name_any(),
            &PatchParams::default(),
            &Patch::Merge(&body),
        )
        .await
    {
        Ok(_) => Ok(true),
        Err(e) if is_conflict(&e) || is_not_found(&e) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Gives `name` back if it still names the lease: clears the label and, with `Replace`,
/// marks it draining so the pool deletes it and makes a fresh one. Guarded by the Proxy's
/// resourceVersion (a stale release must not clear the next holder's label), retried
/// while other writes move it.
async fn release(
    api: &Api<Proxy>,
    name: &str,
    lease_uid: &str,
    policy: RecyclePolicy,
    now: jiff::Timestamp,
) -> Result<(), LeaseError> {
    for _ in 0..RELEASE_ATTEMPTS {
        let Some(p) = api.get_opt(name).await? else {
            return Ok(());
        };
        if p.labels().get(LEASE_LABEL).map(String::as_str) != Some(lease_uid) {
            return Ok(());
        }
        let mut annotations = serde_json::json!({ LEASE_NAME_ANNOTATION: null });
        if policy == RecyclePolicy::Replace && !p.annotations().contains_key(DRAINING_ANNOTATION) {
            annotations[DRAINING_ANNOTATION] = serde_json::json!(now.to_string());
        }
        let body = serde_json::json!({
            "metadata": {
                "resourceVersion": p.resource_version(),
                "labels": { LEASE_LABEL: null },
                "annotations": annotations,
            }
        });
        match api
            .patch(name, &PatchParams::default(), &Patch::Merge(&body))
            .await
        {
            Ok(_) => return Ok(()),
            Err(e) if is_conflict(&e) => continue,
            Err(e) if is_not_found(&e) => return Ok(()),
            Err(e) => return Err(e.into()),
        }
    }
    Err(LeaseError::Contended(name.to_string()))
}

async fn release_all(
    ctx: &LeaseContext,
    ns: &str,
    names: &[String],
    lease_uid: &str,
    policy: RecyclePolicy,
) -> Result<(), LeaseError> {
    let api = Api::<Proxy>::namespaced(ctx.fleet.client.clone(), ns);
    for name in names {
        release(&api, name, lease_uid, policy, ctx.fleet.now()).await?;
    }
    Ok(())
}

/// What one orphan sweep did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct SweepReport {
    /// Proxies given back.
    pub released: usize,
    /// Proxies whose release failed, with the error (retried on the next sweep).
    pub failed: Vec<(String, String)>,
}

/// Gives back every proxy whose lease label names a lease that no longer exists (its
/// finalizer was removed by hand, so it never released them), recycled as its pool says.
/// The proxies are listed before the leases: a label was set by a lease that existed then,
/// so a UID missing from the later list is gone for good, and a lease created meanwhile
/// cannot be mistaken for a missing one. A release that fails is counted, logged and
/// retried on the next sweep; the sweep goes on with the others, so one stuck proxy does
/// not hold back the rest. The same list of leases prunes the metrics of leases that went
/// without their finalizer.
pub async fn sweep_orphans(ctx: &LeaseContext) -> Result<SweepReport, LeaseError> {
    let mut report = SweepReport::default();
    if !ctx.fleet.leading() {
        return Ok(report);
    }
    let client = ctx.fleet.client.clone();
    let labelled = Api::<Proxy>::all(client.clone())
        .list(&ListParams::default().labels(LEASE_LABEL))
        .await?
        .items;
    // Each lease decoded on its own: one this binary cannot read is reported and set
    // apart, and still counts as live (its proxies are not released, its metrics kept).
    let crate::controller::watch::Listed::<ProxyLease> {
        items: all,
        undecodable,
    } = crate::controller::watch::list_decoded(client.clone(), None, &ListParams::default())
        .await?;
    let metas = all
        .iter()
        .map(|l| &l.metadata)
        .chain(undecodable.iter().map(|l| &l.metadata));
    let live: std::collections::HashSet<(String, String)> = metas
        .clone()
        .filter_map(|m| Some((m.namespace.clone()?, m.name.clone()?)))
        .collect();
    ctx.metrics.retain(&live);
    let leases: std::collections::HashSet<String> = metas.filter_map(|m| m.uid.clone()).collect();
    // A proxy a live lease lists is that lease's, whatever its label says (the lease
    // writes its label back).
    let mut listed = listed_by_others(&all, "");
    listed.extend(undecodable.iter().flat_map(super::surge::held_uids));
    for p in &labelled {
        let (Some(holder), Some(ns)) = (p.labels().get(LEASE_LABEL), p.namespace()) else {
            continue;
        };
        if leases.contains(holder) || p.uid().is_some_and(|u| listed.contains(&u)) {
            continue;
        }
        if !ctx.fleet.leading() {
            return Ok(report);
        }
        let name = p.name_any();
        match release_orphan(ctx, p, &ns, holder).await {
            Ok(()) => {
                tracing::warn!(proxy = %name, namespace = %ns, lease_uid = %holder,
                    "released a proxy whose lease no longer exists");
                report.released += 1;
            }
            Err(e) => {
                tracing::warn!(proxy = %name, namespace = %ns, lease_uid = %holder, error = %e,
                    "could not release a proxy whose lease no longer exists; will retry");
                ctx.metrics.orphan_failed();
                report.failed.push((format!("{ns}/{name}"), e.to_string()));
            }
        }
    }
    Ok(report)
}

async fn release_orphan(
    ctx: &LeaseContext,
    p: &Proxy,
    ns: &str,
    holder: &str,
) -> Result<(), LeaseError> {
    let client = ctx.fleet.client.clone();
    let policy = match p.labels().get(POOL_LABEL) {
        Some(pool) => Api::<ProxyPool>::namespaced(client.clone(), ns)
            .get_opt(pool)
            .await?
            .map(|p| p.spec.lease_recycle)
            .unwrap_or_default(),
        None => RecyclePolicy::default(),
    };
    let api = Api::<Proxy>::namespaced(client, ns);
    release(&api, &p.name_any(), holder, policy, ctx.fleet.now()).await
}

/// One reconcile of one lease.
pub async fn reconcile(
    lease: Arc<ProxyLease>,
    ctx: Arc<LeaseContext>,
) -> Result<Action, LeaseError> {
    if !ctx.fleet.leading() {
        return Ok(Action::await_change());
    }
    let ns = lease
        .namespace()
        .ok_or(LeaseError::Incomplete("metadata.namespace"))?;
    let name = lease.name_any();
    let uid = lease.uid().ok_or(LeaseError::Incomplete("metadata.uid"))?;
    let api = Api::<ProxyLease>::namespaced(ctx.fleet.client.clone(), &ns);
    let result = if lease.metadata.deletion_timestamp.is_some() {
        finalize(&ctx, &api, &lease, &ns, &uid).await
    } else {
        bind(&ctx, &api, (*lease).clone(), &ns, &uid).await
    };
    match result {
        Err(LeaseError::Kube(e)) if is_conflict(&e) => {
            tracing::debug!(lease = %name, "lost a write race; looking again");
            Ok(Action::requeue(CONFLICT_RETRY))
        }
        other => other,
    }
}

/// A deleted lease: drop everything from its status, give its proxies back, then let it
/// go.
async fn finalize(
    ctx: &LeaseContext,
    api: &Api<ProxyLease>,
    lease: &ProxyLease,
    ns: &str,
    uid: &str,
) -> Result<Action, LeaseError> {
    if !lease.finalizers().iter().any(|f| f == LEASE_FINALIZER) {
        return Ok(Action::await_change());
    }
    let status = lease.status.clone().unwrap_or_default();
    let mut view = read_pool(ctx, ns, &lease.spec.pool, Read::Fresh).await?;
    mark_others(ctx, ns, lease, uid, &mut view, false).await?;
    let names = binding::to_release(uid, &status, &view.seen);
    let mut lease = lease.clone();
    if !status.proxies.is_empty() || !status.claims.is_empty() {
        let next = binding::ended(&status, false, lease.metadata.generation, ctx.fleet.now());
        lease = write_status(api, &lease, next).await?;
    }
    // The Service stops routing to the proxies before anyone else can take them (the
    // slices go with the lease only after the finalizer is gone).
    if !names.is_empty() {
        let owner = lease
            .controller_owner_ref(&())
            .ok_or(LeaseError::Incomplete("metadata.uid"))?;
        lease = sync_service(ctx, lease, ns, &owner, &[]).await?;
    }
    release_all(ctx, ns, &names, uid, view.recycle).await?;
    let rest: Vec<String> = lease
        .finalizers()
        .iter()
        .filter(|f| *f != LEASE_FINALIZER)
        .cloned()
        .collect();
    let body = serde_json::json!({
        "metadata": { "resourceVersion": lease.resource_version(), "finalizers": rest }
    });
    match api
        .patch(
            &lease.name_any(),
            &PatchParams::default(),
            &Patch::Merge(&body),
        )
        .await
    {
        Ok(_) => {}
        Err(e) if is_not_found(&e) => {}
        Err(e) => return Err(e.into()),
    }
    ctx.metrics.phase(ns, &lease.name_any(), None);
    Ok(Action::await_change())
}

async fn bind(
    ctx: &LeaseContext,
    api: &Api<ProxyLease>,
    mut lease: ProxyLease,
    ns: &str,
    uid: &str,
) -> Result<Action, LeaseError> {
    let name = lease.name_any();
    if !lease.finalizers().iter().any(|f| f == LEASE_FINALIZER) {
        let mut all = lease.finalizers().to_vec();
        all.push(LEASE_FINALIZER.to_string());
        let body = serde_json::json!({
            "metadata": { "resourceVersion": lease.resource_version(), "finalizers": all }
        });
        lease = api
            .patch(&name, &PatchParams::default(), &Patch::Merge(&body))
            .await?;
    }
    // Planned on the caches first: at rest that is all. Anything to write is planned again
    // on fresh reads (see `super::view`).
    if let Some(done) = bind_with(ctx, api, lease.clone(), ns, uid, Read::Cached).await? {
        return Ok(done);
    }
    let done = bind_with(ctx, api, lease, ns, uid, Read::Fresh).await?;
    // A fresh view always decides; were it not to, looking again soon is the safe answer.
    Ok(done.unwrap_or(Action::requeue(CONFLICT_RETRY)))
}

/// One pass of [`bind`] on what `read` says. `None`: the cached view calls for a write, so
/// the caller plans again on fresh reads (nothing was written).
async fn bind_with(
    ctx: &LeaseContext,
    api: &Api<ProxyLease>,
    mut lease: ProxyLease,
    ns: &str,
    uid: &str,
    read: Read,
) -> Result<Option<Action>, LeaseError> {
    let name = lease.name_any();
    let generation = lease.metadata.generation;
    let status = lease.status.clone().unwrap_or_default();
    let mut view = read_pool(ctx, ns, &lease.spec.pool, read).await?;
    let cached = view.read == Read::Cached;
    let now = ctx.fleet.now();
    let created = lease
        .metadata
        .creation_timestamp
        .as_ref()
        .map_or(now, |t| t.0);
    let owner = lease
        .controller_owner_ref(&())
        .ok_or(LeaseError::Incomplete("metadata.uid"))?;

    let ended = status.phase == Some(LeasePhase::Expired);
    mark_others(ctx, ns, &lease, uid, &mut view, !ended).await?;
    if ended {
        // Final. Anything still naming the lease (a release cut short) goes back.
        let names = binding::to_release(uid, &ProxyLeaseStatus::default(), &view.seen);
        if cached && !names.is_empty() {
            return Ok(None);
        }
        sync_service(ctx, lease, ns, &owner, &[]).await?;
        release_all(ctx, ns, &names, uid, view.recycle).await?;
        ctx.metrics.phase(ns, &name, Some(LeasePhase::Expired));
        return Ok(Some(Action::await_change()));
    }

    let (expiry, observed_renew) = binding::expiry(&lease.spec, &status, created, now);
    if now >= expiry {
        if cached {
            return Ok(None);
        }
        let mut next = binding::ended(&status, true, generation, now);
        next.expiry_time = Some(Time(expiry));
        next.observed_renew_time = observed_renew;
        let names = binding::to_release(uid, &status, &view.seen);
        lease = write_status(api, &lease, next).await?;
        // Slices first: the Service stops routing to the proxies before they are free.
        lease = sync_service(ctx, lease, ns, &owner, &[]).await?;
        release_all(ctx, ns, &names, uid, view.recycle).await?;
        ctx.metrics.expired(ns);
        ctx.metrics.phase(ns, &name, Some(LeasePhase::Expired));
        publish(
            ctx,
            &lease,
            EventType::Normal,
            "Expired",
            format!(
                "not renewed by {expiry}; released {}",
                if names.is_empty() {
                    "nothing".to_string()
                } else {
                    names.join(", ")
                }
            ),
        )
        .await;
        return Ok(Some(Action::await_change()));
    }

    let port = i32::from(ctx.fleet.port);
    let pool = lease.spec.pool.clone();
    let pool = pool.as_str();
    let mut step = binding::plan(
        uid,
        &lease.spec,
        &status,
        &view.seen,
        pool,
        port,
        generation,
        now,
        ctx.fleet.board.trusted(),
    );
    if !view.exists && step.status.phase != Some(LeasePhase::Bound) {
        set_condition(
            &mut step.status.conditions,
            binding::BOUND,
            false,
            "PoolNotFound",
            &format!("no ProxyPool {pool} in namespace {ns}"),
            generation,
            now,
        );
    }
    // The lease's proxies are never rolled while it holds them: it says when they were
    // made from inputs that changed since (replaced once released, or swapped at once
    // with `replaceOutOfDate`, see `binding::plan`).
    if !step.status.proxies.is_empty() {
        let outdated: Vec<&str> = step
            .status
            .proxies
            .iter()
            .filter(|b| {
                view.seen
                    .iter()
                    .any(|s| s.member.uid == b.uid && s.member.outdated)
            })
            .map(|b| b.name.as_str())
            .collect();
        let (ok, reason, message) = if outdated.is_empty() {
            (
                true,
                "Current",
                "every bound proxy is up to date".to_string(),
            )
        } else {
            (
                false,
                "InputsChanged",
                if lease.spec.replace_out_of_date {
                    format!(
                        "bound proxies made from inputs that changed since (see their \
                         UpToDate condition), swapped as soon as the pool has a free, \
                         up-to-date proxy (replaceOutOfDate): {}",
                        outdated.join(", ")
                    )
                } else {
                    format!(
                        "bound proxies made from inputs that changed since (see their \
                         UpToDate condition), replaced once released (or set \
                         replaceOutOfDate to swap them now): {}",
                        outdated.join(", ")
                    )
                },
            )
        };
        set_condition(
            &mut step.status.conditions,
            crate::controller::status::UP_TO_DATE,
            ok,
            reason,
            &message,
            generation,
            now,
        );
    } else {
        step.status
            .conditions
            .retain(|c| c.type_ != crate::controller::status::UP_TO_DATE);
    }
    step.status.expiry_time = Some(Time(expiry));
    step.status.observed_renew_time = observed_renew;
    let before = status.phase;
    let writes = step.status != status
        || !step.lost.is_empty()
        || !step.release.is_empty()
        || !step.take.is_empty()
        || !step.restore.is_empty();
    if cached && writes {
        return Ok(None);
    }

    // 1. Record: losses, drops and the chosen proxies.
    if step.status != status {
        lease = write_status(api, &lease, step.status.clone()).await?;
    }
    for (proxy, why) in &step.lost {
        publish(ctx, &lease, EventType::Warning, "ProxyLost", why.clone()).await;
        tracing::info!(lease = %name, %proxy, %why, "lease gave up a proxy");
    }
    for (proxy, why) in &step.swapped {
        publish(
            ctx,
            &lease,
            EventType::Normal,
            "OutOfDateSwapped",
            why.clone(),
        )
        .await;
        tracing::info!(lease = %name, %proxy, %why, "lease swapped an out-of-date proxy");
        ctx.metrics.swapped(ns);
    }
    // 2. Give back what was dropped from the status (never before that write), once the
    // lease's slices no longer list it: the old holder's Service must not route to a
    // proxy another lease may already hold.
    if !step.release.is_empty() {
        let kept = members(&view, &step.status);
        lease = sync_service(ctx, lease, ns, &owner, &kept).await?;
    }
    release_all(ctx, ns, &step.release, uid, view.recycle).await?;
    // 3. Take the chosen proxies, each guarded by its resourceVersion; write back the
    // label of a bound proxy that someone else changed.
    let proxies = Api::<Proxy>::namespaced(ctx.fleet.client.clone(), ns);
    let mut taken = Vec::new();
    let mut raced = false;
    // The lease came from the watch cache: write a label back only if the lease as
    // stored now still lists the proxy (a stale copy must not take back what it released).
    let fresh = if step.restore.is_empty() {
        None
    } else {
        api.get_opt(&name).await?
    };
    for r in &step.restore {
        let still = fresh
            .as_ref()
            .and_then(|l| l.status.as_ref())
            .is_some_and(|st| st.proxies.iter().any(|b| b.uid == r.uid));
        let Some(p) = view
            .proxies
            .iter()
            .find(|p| p.uid().as_deref() == Some(r.uid.as_str()))
            .filter(|_| still)
        else {
            continue;
        };
        if !ctx.fleet.leading() {
            return Ok(Some(Action::await_change()));
        }
        let found = holder_of(p).unwrap_or("none").to_string();
        if take(&proxies, p, uid, &name).await? {
            let why = format!(
                "proxy {}'s lease label read {found}, which no lease's status agrees with: \
                 written back (only the operator assigns proxies)",
                r.name
            );
            tracing::warn!(lease = %name, proxy = %r.name, %found, "restored a proxy's lease label");
            publish(ctx, &lease, EventType::Warning, "LabelRestored", why).await;
        } else {
            raced = true;
        }
    }
    for c in &step.take {
        let Some(p) = view
            .proxies
            .iter()
            .find(|p| p.uid().as_deref() == Some(c.uid.as_str()))
        else {
            continue;
        };
        if !ctx.fleet.leading() {
            return Ok(Some(Action::await_change()));
        }
        if take(&proxies, p, uid, &name).await? {
            taken.push(c.uid.clone());
        } else {
            raced = true;
        }
    }
    // 4. Both sides agree: bound. A take went through with the resourceVersion read, so the
    // proxy is exactly as seen (its address included).
    let mut current = step.status.clone();
    if !taken.is_empty() {
        current = binding::promote(
            &step.status,
            &taken,
            &view.seen,
            lease.spec.count,
            pool,
            port,
            generation,
            now,
        );
        lease = write_status(api, &lease, current.clone()).await?;
    }
    observe(ctx, &lease, ns, before, &current, &status, created, now).await;

    let bound = members(&view, &current);
    sync_service(ctx, lease, ns, &owner, &bound).await?;

    let until_expiry = Duration::try_from(expiry.duration_since(now)).unwrap_or_default();
    let mut next = if raced { CONFLICT_RETRY } else { ctx.resync };
    next = next.min(until_expiry + Duration::from_millis(50));
    if let Some(r) = step.requeue {
        next = next.min(r + Duration::from_millis(50));
    }
    Ok(Some(Action::requeue(next)))
}

/// Metrics and events of a phase change.
#[allow(clippy::too_many_arguments)]
async fn observe(
    ctx: &LeaseContext,
    lease: &ProxyLease,
    ns: &str,
    before: Option<LeasePhase>,
    current: &ProxyLeaseStatus,
    prev: &ProxyLeaseStatus,
    created: jiff::Timestamp,
    now: jiff::Timestamp,
) {
    let name = lease.name_any();
    let after = current.phase;
    ctx.metrics.phase(ns, &name, after);
    let rebound = current.rebinds > prev.rebinds;
    if rebound {
        ctx.metrics.rebind(ns);
    }
    // A loss and its rebind can fall in one reconcile: the phase reads Bound before and
    // after, the rebind count tells.
    if after != Some(LeasePhase::Bound) || (before == after && !rebound) {
        return;
    }
    let seconds = |since: jiff::Timestamp| now.duration_since(since).as_secs_f64().max(0.0);
    // Since when it was short of proxies: the Bound condition's last change to False (a
    // loss and rebind in one reconcile waited no time).
    let short_since = prev
        .conditions
        .iter()
        .find(|c| c.type_ == binding::BOUND && c.status == "False")
        .map_or(if rebound { now } else { created }, |c| {
            c.last_transition_time.0
        });
    ctx.metrics.pending_for(seconds(short_since));
    if current.rebinds == 0 {
        ctx.metrics.bound_after(seconds(created));
    }
    let addrs = current.addresses.clone().unwrap_or_default();
    publish(
        ctx,
        lease,
        EventType::Normal,
        "Bound",
        format!("bound to {addrs}"),
    )
    .await;
}

/// Writes the lease's Service and slices (listing `bound`) where they differ, and the
/// `ServiceReady` condition when it changes; returns the lease as it now stands.
async fn sync_service(
    ctx: &LeaseContext,
    lease: ProxyLease,
    ns: &str,
    owner: &k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference,
    bound: &[Member],
) -> Result<ProxyLease, LeaseError> {
    if !lease.spec.service || !ctx.fleet.leading() {
        return Ok(lease);
    }
    let name = lease.name_any();
    super::check_name(&name)?;
    let state = service::sync(
        &ctx.fleet.client,
        &name,
        ns,
        owner,
        ctx.fleet.port,
        bound,
        ctx.caches(),
    )
    .await?;
    let (ok, reason, message) = match &state {
        ServiceState::Ready => (
            true,
            "Written",
            format!("Service {name} lists the serving bound proxies"),
        ),
        ServiceState::Conflict(why) => (false, "ServiceConflict", why.clone()),
    };
    let had = lease
        .status
        .as_ref()
        .and_then(|s| s.conditions.iter().find(|c| c.type_ == SERVICE_READY))
        .map(|c| (c.status == "True", c.reason.clone()));
    if had != Some((ok, reason.to_string())) {
        let mut status = lease.status.clone().unwrap_or_default();
        set_condition(
            &mut status.conditions,
            SERVICE_READY,
            ok,
            reason,
            &message,
            lease.metadata.generation,
            ctx.fleet.now(),
        );
        let api = Api::<ProxyLease>::namespaced(ctx.fleet.client.clone(), ns);
        return Ok(write_status(&api, &lease, status).await?);
    }
    Ok(lease)
}

fn error_policy(lease: Arc<ProxyLease>, error: &LeaseError, ctx: Arc<LeaseContext>) -> Action {
    tracing::warn!(lease = %lease.name_any(), error = %error, "lease reconcile failed");
    Action::requeue(match error {
        LeaseError::BadName { .. } => ctx.resync,
        _ => Duration::from_secs(2),
    })
}

/// The leases a probe verdict change can matter to: every one that has not ended. An
/// expired lease holds nothing and takes nothing, so the probe's flaps cost it nothing.
fn woken_by_verdicts(
    leases: &kube::runtime::reflector::Store<ProxyLease>,
) -> Vec<ObjectRef<ProxyLease>> {
    leases
        .state()
        .iter()
        .filter(|l| l.status.as_ref().and_then(|s| s.phase) != Some(LeasePhase::Expired))
        .map(|l| ObjectRef::from_obj(&**l))
        .collect()
}

/// Whether `lease` waits to swap an out-of-date proxy (`replaceOutOfDate`, and its own
/// `UpToDate` condition is False): a proxy of its pool that changes may be its swap.
fn swaps(lease: &ProxyLease) -> bool {
    lease.spec.replace_out_of_date
        && lease.status.as_ref().is_some_and(|s| {
            s.phase == Some(LeasePhase::Bound)
                && s.conditions.iter().any(|c| {
                    c.type_ == crate::controller::status::UP_TO_DATE && c.status == "False"
                })
        })
}

/// Runs the lease controller until `shutdown`, with the orphan sweep beside it. Leases,
/// the Proxies that name one (name annotation) or that a lease's status lists, every
/// change of a pool's Proxies (a proxy freeing up or starting to serve wakes the leases of
/// that pool that still want one), the leases' Services and slices, and a change of the
/// fast probe's verdicts (for the leases that have not ended) trigger reconciles.
pub async fn run<F>(ctx: Arc<LeaseContext>, shutdown: F)
where
    F: std::future::Future<Output = ()> + Send + Sync + 'static,
{
    let client = ctx.fleet.client.clone();
    let sweeper = {
        let ctx = ctx.clone();
        async move {
            let mut tick = tokio::time::interval(ctx.orphan_sweep);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                match sweep_orphans(&ctx).await {
                    Ok(r) if !r.failed.is_empty() => tracing::warn!(
                        released = r.released,
                        failed = r.failed.len(),
                        "lease orphan sweep: some releases failed"
                    ),
                    Ok(_) => {}
                    Err(e) => tracing::warn!(error = %e, "lease orphan sweep failed"),
                }
            }
        }
    };
    let (reader, writer) = kube::runtime::reflector::store();
    let lease_events = kube::runtime::WatchStreamExt::reflect(
        super::super::events::<ProxyLease>(client.clone(), ctx.fleet.metrics.watch.clone()),
        writer,
    );
    let controller = Controller::for_stream(
        kube::runtime::WatchStreamExt::applied_objects(lease_events),
        reader,
    );
    let leases = controller.store();
    if let Some(state) = &ctx.fleet.state {
        state.set_leases(controller.store());
    }
    let verdicts = {
        let leases = controller.store();
        super::super::pool::board_changes(&ctx.fleet.board)
            .flat_map(move |()| futures_util::stream::iter(woken_by_verdicts(&leases)))
    };
    // Reflected, so a reconcile at rest reads them here (see `super::view`).
    let (proxies, proxy_events) = crate::fleet::cache::pool_proxies(client.clone());
    let (services, service_events) = crate::fleet::cache::reflected(
        Api::<Service>::all(client.clone()),
        watcher::Config::default()
            .labels(LEASE_SERVICE_LABEL)
            .any_semantic(),
    );
    let (slices, slice_events) = crate::fleet::cache::reflected(
        Api::<EndpointSlice>::all(client.clone()),
        watcher::Config::default()
            .labels(LEASE_SERVICE_LABEL)
            .any_semantic(),
    );
    // Decoded one by one (a pool this binary cannot read is left out, and a lease of it
    // then plans on fresh reads); its watch health is the pool controller's to report.
    let (pools, pool_writer) = kube::runtime::reflector::store();
    let pool_events =
        kube::runtime::WatchStreamExt::touched_objects(kube::runtime::WatchStreamExt::reflect(
            super::super::events::<ProxyPool>(
                client.clone(),
                crate::controller::watch::WatchHealth::default(),
            ),
            pool_writer,
        ));
    let _ = ctx.caches.set(LeaseCaches {
        proxies,
        pools: crate::fleet::cache::Cache::new(pools),
        services,
        slices,
        leases: controller.store(),
    });
    let of_pool = {
        let leases = controller.store();
        move |p: ProxyPool| {
            let (ns, name) = (p.namespace(), p.name_any());
            leases
                .state()
                .into_iter()
                .filter(|l| l.namespace() == ns && l.spec.pool == name)
                .map(|l| ObjectRef::from_obj(&*l))
                .collect::<Vec<_>>()
        }
    };
    let controller = controller
        .watches_stream(pool_events, of_pool)
        .watches_stream(proxy_events, move |p: Proxy| {
            let ns = p.namespace();
            let pool = p.labels().get(POOL_LABEL).cloned();
            let holder = p.annotations().get(LEASE_NAME_ANNOTATION).cloned();
            let uid = p.uid().unwrap_or_default();
            leases
                .state()
                .into_iter()
                // The holder (by the name annotation, and by its status: a label or
                // annotation changed by hand must still wake the lease that holds
                // the proxy), and the leases of the pool that still want a proxy (a
                // Bound or Expired one has nothing to gain from another proxy's change,
                // unless it swaps out-of-date proxies and holds one: `swaps`).
                .filter(|l| {
                    let wants = !matches!(
                        l.status.as_ref().and_then(|s| s.phase),
                        Some(LeasePhase::Bound | LeasePhase::Expired)
                    ) || swaps(l);
                    let lists = l.status.as_ref().is_some_and(|s| {
                        s.proxies.iter().any(|b| b.uid == uid)
                            || s.claims.iter().any(|c| c.uid == uid)
                    });
                    l.namespace() == ns
                        && ((wants && Some(&l.spec.pool) == pool.as_ref())
                            || lists
                            || holder.as_deref() == Some(l.name_any().as_str()))
                })
                .map(|l| ObjectRef::from_obj(&*l))
                .collect::<Vec<_>>()
        })
        .owns_stream(service_events)
        .owns_stream(slice_events)
        .reconcile_on(verdicts)
        .with_config(super::super::controller_config())
        .graceful_shutdown_on(shutdown)
        .run(reconcile, error_policy, ctx)
        .for_each(|r| async move {
            if let Err(e) = r {
                tracing::debug!(error = %e, "lease controller stream");
            }
        });
    // The sweep never ends by itself: it stops with the controller.
    tokio::select! {
        () = controller => {}
        () = sweeper => {}
    }
}
