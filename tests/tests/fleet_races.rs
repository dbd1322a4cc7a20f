//! The pool's drain and delete against a lease that takes the proxy in between (issue 33,
//! item 4), on the real control plane: the pool writes only to the version of the Proxy
//! it planned with, so a proxy relabelled since is neither drained nor deleted.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

use anyhow::Result;
use egress_operator::api::proxy::Proxy;
use egress_operator::api::proxy_pool::{DRAINING_ANNOTATION, LEASE_LABEL};
use egress_operator::fleet::pool::{Written, delete_if_unchanged, drain_if_unchanged};
use integration_tests::harness::ControlPlane;
use kube::api::{Patch, PatchParams, PostParams};
use kube::{Api, ResourceExt};
use serde_json::json;

#[tokio::test]
async fn a_proxy_taken_after_the_plan_is_neither_drained_nor_deleted() -> Result<()> {
    let cp = ControlPlane::shared()?;
    cp.install_crds().await?;
    let ns = cp.namespace("race").await?;
    let client = cp.client().await?;
    let api: Api<Proxy> = Api::namespaced(client, ns.name());
    let proxy: Proxy = serde_json::from_value(json!({
        "apiVersion": "egress-operator.dev/v1alpha1",
        "kind": "Proxy",
        "metadata": {"name": "p"},
        "spec": {"provider": "kvm2"},
    }))?;
    let planned = api.create(&PostParams::default(), &proxy).await?;
    let planned_version = planned.resource_version().unwrap();

    // A lease binds the proxy after the pool listed it (the label write is the take).
    let take = json!({"metadata": {"labels": {LEASE_LABEL: "lease-1"}}});
    api.patch("p", &PatchParams::default(), &Patch::Merge(&take))
        .await?;

    let now = jiff::Timestamp::now();
    assert_eq!(
        drain_if_unchanged(&api, "p", &planned_version, now).await?,
        Written::Changed
    );
    assert_eq!(
        delete_if_unchanged(&api, "p", &planned_version).await?,
        Written::Changed
    );
    let kept = api.get("p").await?;
    assert!(
        !kept.annotations().contains_key(DRAINING_ANNOTATION),
        "a taken proxy was drained"
    );
    assert!(kept.metadata.deletion_timestamp.is_none());

    // At the version it is now, both go through; a second delete finds it gone.
    let current = kept.resource_version().unwrap();
    assert_eq!(
        drain_if_unchanged(&api, "p", &current, now).await?,
        Written::Done
    );
    let drained = api.get("p").await?;
    assert!(drained.annotations().contains_key(DRAINING_ANNOTATION));
    let current = drained.resource_version().unwrap();
    assert_eq!(
        delete_if_unchanged(&api, "p", &current).await?,
        Written::Done
    );
    assert_eq!(
        delete_if_unchanged(&api, "p", &current).await?,
        Written::Gone
    );
    Ok(())
}
