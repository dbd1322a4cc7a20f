//! Pool surge for waiting leases: a pool whose `leaseSurge` is above 0 keeps up to that
//! many proxies above `replicas` while leases of the pool wait because nothing is free.
//!
//! A lease waits when it is `Pending` or `Lost` with no claim in flight (the lease
//! controller found no serving, unleased proxy); what it misses is `count` minus its bound
//! proxies. The pool adds `min(missing, leaseSurge)` to the replicas it plans for. Once the
//! leases bind the new proxies the demand drops, but the plan never removes a leased proxy,
//! so the pool stays larger exactly as long as the leases hold; when a lease ends its
//! proxy is recycled and the pool shrinks back.

use kube::api::ListParams;
use kube::runtime::reflector::ObjectRef;
use kube::{Api, Client, ResourceExt};

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

/// What to add to `pool`'s replicas for its waiting leases (0 unless `leaseSurge` > 0).
pub async fn for_pool(client: &Client, pool: &ProxyPool) -> Result<usize, kube::Error> {
    let limit = usize::try_from(pool.spec.lease_surge).unwrap_or(0);
    if limit == 0 {
        return Ok(0);
    }
    let Some(ns) = pool.namespace() else {
        return Ok(0);
    };
    let leases = Api::<ProxyLease>::namespaced(client.clone(), &ns)
        .list(&ListParams::default())
        .await?
        .items;
    Ok(waiting(&pool.name_any(), &leases).min(limit))
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
        let mut fresh = lease("office", 1, LeasePhase::Pending, 0, 0);
        fresh.status = None;
        assert_eq!(waiting("office", &[fresh]), 0);
    }
}
