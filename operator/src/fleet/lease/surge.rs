//! Pool surge for waiting leases: a pool whose `leaseSurge` is above 0 keeps up to that
//! many proxies above `replicas` while leases of the pool wait because nothing is free.
//!
//! A lease waits when it is `Pending` or `Lost` with no claim in flight (the lease
//! controller found no serving, unleased proxy); what it misses is `count` minus its bound
//! proxies. The pool adds `min(missing, leaseSurge)` to the replicas it plans for. Once the
//! leases bind the new proxies the demand drops, but the plan never removes a leased proxy,
//! so the pool stays larger exactly as long as the leases hold; when a lease ends its
//! proxy is recycled and the pool shrinks back.
//!
//! A proxy a lease has claimed but not yet taken (its claim is in the lease's status, the
//! label not yet on the proxy) counts as leased for the pool (issue 33, item 4): the claim
//! ends the lease's wait, so the surge drops at once, and without this the pool would see
//! the claimed proxy as its own surplus and drain it under the lease's take: the take
//! fails, the lease waits again, the pool creates again.

use std::collections::BTreeSet;

use kube::api::ListParams;
use kube::runtime::reflector::ObjectRef;
use kube::{Client, ResourceExt};

use crate::api::proxy_lease::{LeasePhase, ProxyLease};
use crate::api::proxy_pool::ProxyPool;

/// Proxies the leases of `pool` miss and wait for.
pub fn waiting(pool: &str, leases: &[ProxyLease]) -> usize {
    leases
        .iter()
        .filter(|l| l.spec.pool == pool && l.metadata.deletion_timestamp.is_none())
        .filter_map(|l| {
            let s = l.status.as_ref()?;
            let waits = matches!(s.phase, Some(LeasePhase::Pending | LeasePhase::Lost))
                && s.claims.is_empty();
            let count = usize::try_from(l.spec.count).unwrap_or(0);
            waits.then(|| count.saturating_sub(s.proxies.len()))
        })
        .sum()
}

/// UIDs of the proxies the leases of `pool` have claimed (taken or about to be).
pub fn claimed(pool: &str, leases: &[ProxyLease]) -> BTreeSet<String> {
    leases
        .iter()
        .filter(|l| l.spec.pool == pool)
        .filter_map(|l| l.status.as_ref())
        .flat_map(|s| s.claims.iter().map(|c| c.uid.clone()))
        .collect()
}

/// What the leases of a pool ask of it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Demand {
    /// What to add to the pool's replicas for its waiting leases (0 unless `leaseSurge`
    /// is above 0).
    pub surge: usize,
    /// Proxies claimed by a lease: the pool treats them as leased.
    pub claimed: BTreeSet<String>,
}

/// What the leases of `pool` ask of it. Each lease is decoded on its own: one this binary
/// cannot read adds no surge, and the proxies its status names still count as claimed.
pub async fn for_pool(client: &Client, pool: &ProxyPool) -> Result<Demand, kube::Error> {
    let Some(ns) = pool.namespace() else {
        return Ok(Demand::default());
    };
    let listed = crate::controller::watch::list_decoded::<ProxyLease>(
        client.clone(),
        Some(&ns),
        &ListParams::default(),
    )
    .await?;
    let name = pool.name_any();
    let limit = usize::try_from(pool.spec.lease_surge).unwrap_or(0);
    let mut claimed = claimed(&name, &listed.items);
    claimed.extend(listed.undecodable.iter().flat_map(held_uids));
    Ok(Demand {
        surge: waiting(&name, &listed.items).min(limit),
        claimed,
    })
}

/// The proxy UIDs an untyped lease's status names (bound and claimed), read leniently: a
/// lease this binary cannot decode still holds what it holds.
pub fn held_uids(lease: &kube::api::DynamicObject) -> Vec<String> {
    let status = &lease.data["status"];
    ["proxies", "claims"]
        .iter()
        .filter_map(|k| status[k].as_array())
        .flatten()
        .filter_map(|e| e["uid"].as_str().map(str::to_string))
        .collect()
}

/// The pool a lease draws from (a lease change wakes its pool).
pub fn pool_of(lease: ProxyLease) -> Option<ObjectRef<ProxyPool>> {
    let ns = lease.namespace()?;
    Some(ObjectRef::new(&lease.spec.pool).within(&ns))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::proxy_lease::{BoundProxy, ProxyClaim, ProxyLeaseSpec, ProxyLeaseStatus};

    fn lease(pool: &str, count: i32, phase: LeasePhase, bound: usize, claims: usize) -> ProxyLease {
        let mut l = ProxyLease::new(
            "l",
            ProxyLeaseSpec {
                pool: pool.into(),
                count,
                duration_seconds: 60,
                holder: "h".into(),
                renew_time: None,
                rebind_after_seconds: 30,
                service: false,
                replace_out_of_date: false,
            },
        );
        l.status = Some(ProxyLeaseStatus {
            phase: Some(phase),
            proxies: vec![BoundProxy::default(); bound],
            claims: vec![ProxyClaim::default(); claims],
            ..Default::default()
        });
        l
    }

    #[test]
    fn only_leases_waiting_for_a_free_proxy_count() {
        let leases = [
            lease("office", 1, LeasePhase::Pending, 0, 0),
            lease("office", 3, LeasePhase::Pending, 1, 0),
            lease("office", 1, LeasePhase::Lost, 0, 0),
            // Taking one: not waiting.
            lease("office", 1, LeasePhase::Pending, 0, 1),
            lease("office", 1, LeasePhase::Bound, 1, 0),
            lease("office", 1, LeasePhase::Expired, 0, 0),
            lease("other", 1, LeasePhase::Pending, 0, 0),
        ];
        assert_eq!(waiting("office", &leases), 4);
        assert_eq!(
            claimed("office", &leases).len(),
            1,
            "the one taking a proxy"
        );
        assert!(claimed("other", &leases).is_empty());
        let mut fresh = lease("office", 1, LeasePhase::Pending, 0, 0);
        fresh.status = None;
        assert_eq!(waiting("office", &[fresh]), 0);
    }
}
