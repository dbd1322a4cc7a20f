//! Who belongs to a pool: only Proxies the operator made for it.
//!
//! Anyone allowed to create Proxies can write a Proxy's labels and owner references, so
//! neither alone makes a member (a forged member would join the pool's EndpointSlices
//! with a VM of its maker's choosing and intercept other workloads' egress). Two layers:
//!
//! - here, the operator accepts a Proxy as a member of a pool ([`made_by`]) only when
//!   the pool controls it (a controller owner reference to the pool, by UID) and its spec
//!   is exactly what the pool's template makes for its host. A member made from an older
//!   template (a rollout under way) stays accepted only while discovery already lists it:
//!   its UID is in the pool's slices, which only the operator writes. A Proxy that only
//!   claims an older template never gets in;
//! - at the API server, the ValidatingAdmissionPolicy in `config/admission` lets only the
//!   operator's ServiceAccount set or change the fleet's labels, the draining annotation
//!   and owner references to pools and leases on Proxies.

use std::collections::HashSet;

use kube::{Resource, ResourceExt};

use crate::api::proxy::Proxy;
use crate::api::proxy_pool::{ProxyPool, TEMPLATE_HASH_LABEL};

/// Whether `proxy` is a member the operator made for `pool`: the pool controls it
/// ([`controlled_by`]), and its spec is what the pool's template makes for its host, or
/// it was made from an older template (its template-hash label is not the current one)
/// and is already listed (`listed`: the Proxy UIDs the pool's slices point at).
pub fn made_by(pool: &ProxyPool, proxy: &Proxy, listed: &HashSet<String>) -> bool {
    let Some(pool_uid) = pool.uid() else {
        return false;
    };
    if !controlled_by(proxy, &pool_uid) {
        return false;
    }
    // The pool pins every Proxy it makes to a host.
    let Some(host) = proxy.spec.host.clone() else {
        return false;
    };
    if proxy.spec == pool.spec.template.proxy_spec(Some(host)) {
        return true;
    }
    let older = proxy
        .labels()
        .get(TEMPLATE_HASH_LABEL)
        .is_some_and(|h| *h != pool.spec.template.hash());
    older && proxy.uid().is_some_and(|uid| listed.contains(&uid))
}

/// Whether `proxy` carries the controller owner reference the pool controller sets: a
/// `ProxyPool` of this API group with `pool_uid`. A copied label, or a reference to
/// another kind with the same UID, does not make a Proxy the pool's.
pub fn controlled_by(proxy: &Proxy, pool_uid: &str) -> bool {
    proxy.owner_references().iter().any(|o| {
        o.controller == Some(true)
            && o.uid == pool_uid
            && o.kind == ProxyPool::kind(&())
            && o.api_version.split('/').next() == Some(&*ProxyPool::group(&()))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;

    fn proxy(owner: Option<OwnerReference>) -> Proxy {
        let mut p = Proxy::new("p", Default::default());
        p.metadata.owner_references = owner.map(|o| vec![o]);
        p
    }

    fn pool_ref() -> OwnerReference {
        OwnerReference {
            api_version: "egress-operator.dev/v1alpha1".into(),
            kind: "ProxyPool".into(),
            name: "office".into(),
            uid: "pool-uid".into(),
            controller: Some(true),
            block_owner_deletion: Some(true),
        }
    }

    fn pool() -> ProxyPool {
        let mut pool: ProxyPool = serde_json::from_value(serde_json::json!({
            "apiVersion": "egress-operator.dev/v1alpha1",
            "kind": "ProxyPool",
            "metadata": {"name": "office", "namespace": "ns", "uid": "pool-uid"},
            "spec": {"template": {"provider": "kvm2", "image": "debian-12"}},
        }))
        .unwrap();
        pool.metadata.uid = Some("pool-uid".into());
        pool
    }

    /// A Proxy as the pool controller makes it on `h1`.
    fn made(pool: &ProxyPool) -> Proxy {
        let mut p = Proxy::new("office-a", pool.spec.template.proxy_spec(Some("h1".into())));
        p.metadata.uid = Some("proxy-uid".into());
        p.metadata.owner_references = Some(vec![pool.controller_owner_ref(&()).unwrap()]);
        p.labels_mut()
            .insert(TEMPLATE_HASH_LABEL.into(), pool.spec.template.hash());
        p
    }

    #[test]
    fn a_member_has_the_spec_the_template_makes_for_its_host() {
        let pool = pool();
        let none = HashSet::new();
        assert!(made_by(&pool, &made(&pool), &none));
        // Another host is still the template's spec.
        let mut other_host = made(&pool);
        other_host.spec.host = Some("h2".into());
        assert!(made_by(&pool, &other_host, &none));
        // The pool never makes an unpinned Proxy.
        let mut unpinned = made(&pool);
        unpinned.spec.host = None;
        assert!(!made_by(&pool, &unpinned, &none));
        // Its own user-data: a VM of its maker's choosing.
        let mut forged: Proxy = made(&pool);
        forged.spec.user_data = serde_json::from_value(
            serde_json::json!({"secretRef": {"name": "mine", "key": "user-data"}}),
        )
        .unwrap();
        assert!(!made_by(&pool, &forged, &none));
        let mut unowned = made(&pool);
        unowned.metadata.owner_references = None;
        assert!(!made_by(&pool, &unowned, &none));
    }

    #[test]
    fn an_older_templates_member_stays_only_while_listed() {
        let before = pool();
        let member = made(&before);
        let mut after = before.clone();
        after.spec.template.machine_type = Some("tiny".into());
        let listed = HashSet::from(["proxy-uid".to_string()]);
        assert!(!made_by(&after, &member, &HashSet::new()));
        assert!(made_by(&after, &member, &listed));
        // Claiming an older template with the current hash label does not help.
        let mut relabelled = member.clone();
        relabelled
            .labels_mut()
            .insert(TEMPLATE_HASH_LABEL.into(), after.spec.template.hash());
        assert!(!made_by(&after, &relabelled, &listed));
    }

    #[test]
    fn only_the_pools_controller_reference_makes_a_member() {
        assert!(controlled_by(&proxy(Some(pool_ref())), "pool-uid"));
        assert!(!controlled_by(&proxy(None), "pool-uid"), "a label alone");
        assert!(!controlled_by(&proxy(Some(pool_ref())), "other-uid"));
        let mut not_controller = pool_ref();
        not_controller.controller = None;
        assert!(!controlled_by(&proxy(Some(not_controller)), "pool-uid"));
        let mut other_kind = pool_ref();
        other_kind.kind = "ReplicaSet".into();
        assert!(!controlled_by(&proxy(Some(other_kind)), "pool-uid"));
        let mut other_group = pool_ref();
        other_group.api_version = "example.com/v1".into();
        assert!(!controlled_by(&proxy(Some(other_group)), "pool-uid"));
    }
}
