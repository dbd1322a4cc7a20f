//! A pool's look from the pool controller's caches: when it finds nothing to do, the
//! reconcile ends there and reads nothing (issue 35, item 4).
//!
//! Every verdict change of the fast probe and every resync reconciles every pool. Before,
//! each of those looks listed the pool's Proxies and its namespace's leases and read its
//! provider's health. Now a pool is judged at rest when, from the caches:
//! - no member has failed and no failure streak runs (those are counted, once, on fresh
//!   reads);
//! - the plan creates, drains and deletes nothing and finds no shortage of hosts;
//! - the status the controller owns already says what the plan's counts say.
//!
//! Anything else, and any cache not filled yet, falls through to the full reconcile on
//! fresh reads, which plans again before it writes (see [`super::cache`]). A lease this
//! binary cannot decode is missing from the lease cache; its claims then look free, which
//! can only make the look find work and fall through to the fresh reads, which count it.

use std::collections::BTreeMap;

use kube::ResourceExt;
use kube::runtime::controller::Action;

use crate::api::provider_health::ProviderHealth;
use crate::api::proxy::Proxy;
use crate::api::proxy_lease::ProxyLease;
use crate::api::proxy_pool::ProxyPool;

use super::cache::Cache;
use super::failures::Observed;
use super::plan::{self, CreateGate};
use super::pool::{
    FleetContext, failure_messages, host_slots, next_look, next_status, shape_of, status_current,
};
use super::{Member, membership};

/// The pool controller's reflected watches, set by [`super::pool::run`].
#[derive(Debug, Clone)]
pub struct PoolCaches {
    /// The pool-labelled Proxies.
    pub proxies: Cache<Proxy>,
    /// The providers' health (cluster-scoped, by provider name).
    pub health: Cache<ProviderHealth>,
    /// The leases, as the pool controller decoded them.
    pub leases: Cache<ProxyLease>,
}

/// The pool's reconcile when the caches show it at rest; `None`: look on fresh reads.
pub fn look(
    ctx: &FleetContext,
    pool: &ProxyPool,
    ns: &str,
    name: &str,
    pool_uid: &str,
) -> Option<Action> {
    let caches = ctx.pool_caches()?;
    let labelled = caches.proxies.labelled_for(ns, name)?;
    let health = caches.health.get(None, &pool.spec.template.provider)?;
    let leases: Vec<ProxyLease> = caches
        .leases
        .select(ns, |_| true)?
        .iter()
        .map(|l| (**l).clone())
        .collect();
    let mine: Vec<Proxy> = labelled
        .iter()
        .filter(|p| membership::controlled_by(p, pool_uid))
        .map(|p| (**p).clone())
        .collect();
    if !failure_messages(&mine).is_empty() || ctx.failures.in_streak(pool_uid) {
        return None;
    }
    let claimed = super::lease::surge::claimed(name, &leases);
    let limit = usize::try_from(pool.spec.lease_surge).unwrap_or(0);
    let members: Vec<Member> = mine
        .iter()
        .map(|p| {
            let mut m = ctx.member(p);
            m.leased |= p.uid().is_some_and(|u| claimed.contains(&u));
            m
        })
        .collect();
    let mut shape = shape_of(pool, &ctx.config);
    shape.replicas += super::lease::surge::waiting(name, &leases).min(limit);
    shape.creates = CreateGate::Open;
    let now = ctx.now();
    let slots = host_slots(
        pool,
        &ctx.current_config(),
        health.as_deref(),
        &BTreeMap::new(),
    );
    let p = plan::plan(&shape, &members, &slots, now);
    let acting = !p.create.is_empty() || !p.drain.is_empty() || !p.delete.is_empty();
    if acting || p.insufficient_hosts || p.held_back {
        return None;
    }
    let next = next_status(pool, name, &shape, &p, &Observed::default(), now);
    if !status_current(pool, &next) {
        return None;
    }
    // No shortage now: a later one is told again.
    ctx.set_shortage(pool_uid, false);
    ctx.metrics.rollout(
        ns,
        name,
        i32::try_from(p.counts.updated).unwrap_or(i32::MAX),
        pool.spec.replicas,
    );
    Some(Action::requeue(next_look(&p)))
}
