//! What a lease reconcile reads: its pool, the pool's Proxies and the other leases, either
//! from the controller's reflected watches or fresh from the API server.
//!
//! A lease plans from the caches first (see [`crate::fleet::cache`]). When that plan
//! leaves everything as it is (the lease at rest), nothing more is read. When it would
//! write anything (a status, a take, a release, a label put back), the reconcile reads the
//! API server and plans again, and only that plan is written. Every write is guarded by a
//! resourceVersion as well, so a stale read can cost a retry, never a double binding.

use std::collections::HashSet;
use std::sync::Arc;

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::ListParams;
use kube::runtime::reflector::Store;
use kube::{Api, ResourceExt};

use crate::api::proxy::Proxy;
use crate::api::proxy_lease::{LEASE_LABEL, ProxyLease, RecyclePolicy};
use crate::api::proxy_pool::ProxyPool;
use crate::fleet::cache::Cache;
use crate::fleet::pool_selector;

use super::LeaseError;
use super::binding::{self, Seen};
use super::controller::LeaseContext;

/// Where a reconcile reads from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Read {
    /// The reflected watches: enough to learn that nothing is to be done.
    Cached,
    /// The API server: what every write is decided on.
    Fresh,
}

/// The lease controller's reflected watches, set by [`super::run`]. Without them (a
/// reconcile called on its own, in tests) every read is fresh.
#[derive(Debug, Clone)]
pub struct LeaseCaches {
    /// The pool-labelled Proxies.
    pub proxies: Cache<Proxy>,
    /// The pools (by name, for the recycle policy and the owner UID).
    pub pools: Cache<ProxyPool>,
    /// The leases' own Services (by label).
    pub services: Cache<Service>,
    /// The leases' own EndpointSlices (by label).
    pub slices: Cache<EndpointSlice>,
    /// The leases, as the controller decoded them.
    pub leases: Store<ProxyLease>,
}

/// The pool's Proxies as the lease sees them; the pool's recycle policy.
#[derive(Debug)]
pub struct PoolView {
    /// Each Proxy as binding judges it.
    pub seen: Vec<Seen>,
    /// The Proxies themselves (a take is guarded by their resourceVersion).
    pub proxies: Vec<Proxy>,
    /// The pool's recycle policy.
    pub recycle: RecyclePolicy,
    /// Whether the pool exists.
    pub exists: bool,
    /// Where this was read from.
    pub read: Read,
}

/// The pool and its Proxies from the caches, or `None` when a cache is not filled yet
/// (or there are none).
fn read_cached(ctx: &LeaseContext, ns: &str, pool: &str) -> Option<PoolView> {
    let caches = ctx.caches()?;
    let found = caches.pools.get(Some(ns), pool)?;
    let proxies = caches.proxies.labelled_for(ns, pool)?;
    let proxies: Vec<Proxy> = proxies.iter().map(|p| (**p).clone()).collect();
    Some(view(ctx, found.as_deref(), proxies, Read::Cached))
}

/// The pool and its Proxies, as `read` says (from the API server when the caches are not
/// filled).
pub async fn read_pool(
    ctx: &LeaseContext,
    ns: &str,
    pool: &str,
    read: Read,
) -> Result<PoolView, LeaseError> {
    if read == Read::Cached
        && let Some(v) = read_cached(ctx, ns, pool)
    {
        return Ok(v);
    }
    let client = ctx.fleet.client.clone();
    let found = Api::<ProxyPool>::namespaced(client.clone(), ns)
        .get_opt(pool)
        .await?;
    let proxies = Api::<Proxy>::namespaced(client, ns)
        .list(&ListParams::default().labels(&pool_selector(pool)))
        .await?
        .items;
    Ok(view(ctx, found.as_ref(), proxies, Read::Fresh))
}

fn view(
    ctx: &LeaseContext,
    found: Option<&ProxyPool>,
    proxies: Vec<Proxy>,
    read: Read,
) -> PoolView {
    let pool_uid = found.and_then(ResourceExt::uid);
    let seen = proxies
        .iter()
        .map(|p| Seen {
            member: ctx.fleet.member(p),
            holder: p
                .labels()
                .get(LEASE_LABEL)
                .filter(|v| !v.is_empty())
                .cloned(),
            in_pool: pool_uid.as_ref().is_some_and(|uid| {
                p.owner_references()
                    .iter()
                    .any(|o| o.controller == Some(true) && &o.uid == uid)
            }),
            listed_elsewhere: false,
        })
        .collect();
    PoolView {
        seen,
        proxies,
        recycle: found.map(|p| p.spec.lease_recycle).unwrap_or_default(),
        exists: found.is_some(),
        read,
    }
}

/// Marks the proxies of `view` that another lease of the namespace lists in its status,
/// when planning needs to know: see [`binding::needs_others`]. A cached view reads the
/// other leases from the controller's store, which leaves out a lease this binary cannot
/// decode; that can only make a proxy look free, so the plan then takes it, and a take is
/// planned again on fresh reads, which count such a lease.
pub async fn mark_others(
    ctx: &LeaseContext,
    ns: &str,
    lease: &ProxyLease,
    uid: &str,
    view: &mut PoolView,
    may_take: bool,
) -> Result<(), LeaseError> {
    let status = lease.status.clone().unwrap_or_default();
    if !binding::needs_others(uid, &lease.spec, &status, &view.seen, may_take) {
        return Ok(());
    }
    let listed = match (view.read, ctx.caches()) {
        (Read::Cached, Some(caches)) => {
            let leases: Vec<ProxyLease> = caches
                .leases
                .state()
                .into_iter()
                .filter(|l| l.namespace().as_deref() == Some(ns))
                .map(|l| (*l).clone())
                .collect();
            listed_by_others(&leases, uid)
        }
        _ => {
            // Each lease decoded on its own; what one this binary cannot read holds stays
            // held.
            let leases = crate::controller::watch::list_decoded::<ProxyLease>(
                ctx.fleet.client.clone(),
                Some(ns),
                &ListParams::default(),
            )
            .await?;
            let mut listed = listed_by_others(&leases.items, uid);
            listed.extend(
                leases
                    .undecodable
                    .iter()
                    .filter(|l| l.metadata.uid.as_deref() != Some(uid))
                    .flat_map(super::surge::held_uids),
            );
            listed
        }
    };
    for s in &mut view.seen {
        s.listed_elsewhere = listed.contains(&s.member.uid);
    }
    Ok(())
}

/// The proxy UIDs that the statuses of `leases`, except the one with UID `except`, list
/// as bound or claimed.
pub(super) fn listed_by_others(leases: &[ProxyLease], except: &str) -> HashSet<String> {
    leases
        .iter()
        .filter(|l| l.uid().as_deref() != Some(except))
        .filter_map(|l| l.status.as_ref())
        .flat_map(|s| {
            s.proxies
                .iter()
                .map(|p| p.uid.clone())
                .chain(s.claims.iter().map(|c| c.uid.clone()))
        })
        .collect()
}

/// A cached Service or slice of ours named `name` in `ns`, if the cache holds it. Absent
/// from the cache means "read it": the name may be taken by an object without our label.
pub fn cached<K>(cache: Option<&Cache<K>>, ns: &str, name: &str) -> Option<Arc<K>>
where
    K: kube::Resource + Clone + 'static,
    K::DynamicType: std::hash::Hash + Eq + Clone + Default,
{
    cache?.get(Some(ns), name).flatten()
}
