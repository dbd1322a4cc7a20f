//! Tenancy limits on the real control plane: a ResourceQuota on the fleet's objects caps
//! what one namespace can make, as the README's security section tells tenants' admins to
//! set (`count/proxies.egress-operator.dev` and friends).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

use std::time::{Duration, Instant};

use anyhow::Result;
use egress_operator::api::proxy::Proxy;
use egress_operator::api::proxy_pool::ProxyPool;
use integration_tests::harness::ControlPlane;
use k8s_openapi::api::core::v1::ResourceQuota;
use kube::Api;
use kube::api::PostParams;
use serde_json::json;

/// Hang guard of a wait; never a timing assertion.
const GUARD: Duration = Duration::from_secs(90);

#[tokio::test]
async fn a_resource_quota_caps_a_namespaces_proxies_and_pools() -> Result<()> {
    let cp = ControlPlane::shared()?;
    cp.install_crds().await?;
    let ns = cp.namespace("quota").await?;
    let client = cp.client().await?;
    let quotas: Api<ResourceQuota> = Api::namespaced(client.clone(), ns.name());
    let quota: ResourceQuota = serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "ResourceQuota",
        "metadata": {"name": "egress"},
        "spec": {"hard": {
            "count/proxies.egress-operator.dev": "2",
            "count/proxypools.egress-operator.dev": "1",
            "count/proxyleases.egress-operator.dev": "1",
        }},
    }))?;
    quotas.create(&PostParams::default(), &quota).await?;
    // Quota admission refuses every create of a resource until the quota controller has
    // counted that resource ("status unknown for quota"), and it counts each one on its
    // own: wait for all three.
    let start = Instant::now();
    loop {
        let q = quotas.get("egress").await?;
        let counted = q.status.is_some_and(|s| {
            let (hard, used) = (s.hard.unwrap_or_default(), s.used.unwrap_or_default());
            [
                "count/proxies.egress-operator.dev",
                "count/proxypools.egress-operator.dev",
                "count/proxyleases.egress-operator.dev",
            ]
            .iter()
            .all(|k| hard.contains_key(*k) && used.contains_key(*k))
        });
        if counted {
            break;
        }
        assert!(
            start.elapsed() < GUARD,
            "the quota controller never counted"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    let proxies: Api<Proxy> = Api::namespaced(client.clone(), ns.name());
    let proxy = |name: &str| -> Proxy {
        serde_json::from_value(json!({
            "apiVersion": "egress-operator.dev/v1alpha1",
            "kind": "Proxy",
            "metadata": {"name": name},
            "spec": {"provider": "kvm2"},
        }))
        .unwrap()
    };
    for name in ["a", "b"] {
        proxies.create(&PostParams::default(), &proxy(name)).await?;
    }
    match proxies.create(&PostParams::default(), &proxy("c")).await {
        Err(kube::Error::Api(s)) => {
            assert_eq!(s.code, 403, "{s:?}");
            assert!(s.message.contains("exceeded quota"), "{}", s.message);
            assert!(
                s.message.contains("count/proxies.egress-operator.dev"),
                "{}",
                s.message
            );
        }
        other => panic!("a third Proxy was not refused: {other:?}"),
    }

    let pools: Api<ProxyPool> = Api::namespaced(client.clone(), ns.name());
    let pool = |name: &str| -> ProxyPool {
        serde_json::from_value(json!({
            "apiVersion": "egress-operator.dev/v1alpha1",
            "kind": "ProxyPool",
            "metadata": {"name": name},
            "spec": {"replicas": 1, "template": {"provider": "kvm2"}},
        }))
        .unwrap()
    };
    pools.create(&PostParams::default(), &pool("first")).await?;
    match pools.create(&PostParams::default(), &pool("second")).await {
        Err(kube::Error::Api(s)) => assert_eq!(s.code, 403, "{s:?}"),
        other => panic!("a second pool was not refused: {other:?}"),
    }
    Ok(())
}
