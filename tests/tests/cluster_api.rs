//! What a real kube-apiserver demands of the operator (issue 18, findings 1-6), against
//! the control plane of the harness (or the cluster `KUBECONFIG` names):
//!
//! - **admission** after applying `config/crd/bases` by server-side apply: enum and
//!   pattern violations, spec edits (a `templateSettings` key rename, a value change,
//!   null versus absent) and dotted or over-long names are refused with a 422; what is
//!   no edit (a label, the same spec again) passes;
//! - **write semantics** of the controller, run in-process against the real server with
//!   the fake provider: a reconcile that changes nothing bumps no resourceVersion; the
//!   status is owned by our manager through Apply on the status subresource; a finalizer
//!   race with another writer is transient and recovers; an error text over 2 KB still
//!   gives an event (notes are cut to 1024 bytes);
//! - **skew**: an installed CRD with a spec field this binary does not know, and a Proxy
//!   using it, is reported by name while the other Proxies still decode.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Result;
use egress_operator::api::proxy::{Proxy, ProxySpec};
use egress_operator::api::proxy_lease::ProxyLease;
use egress_operator::api::proxy_pool::ProxyPool;
use egress_operator::controller::{self, Context, ControllerError, ControllerMetrics};
use egress_operator::error::{Classified, ErrorClass};
use futures_util::StreamExt;
use integration_tests::harness::ControlPlane;
use k8s_openapi::api::events::v1::Event as KubeEvent;
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use kube::{Api, ResourceExt};
use serde_json::{Value, json};

/// Hang guard for one API round trip or a short wait; never a timing assertion.
const GUARD: Duration = Duration::from_secs(60);

async fn guard<F: std::future::Future>(what: &str, f: F) -> F::Output {
    match tokio::time::timeout(GUARD, f).await {
        Ok(out) => out,
        Err(_) => panic!("{what}: no answer within {GUARD:?}"),
    }
}

/// The shared control plane with the CRDs installed.
async fn plane() -> Result<&'static ControlPlane> {
    let cp = ControlPlane::shared()?;
    cp.install_crds().await?;
    Ok(cp)
}

fn proxy_json(name: &str, spec: Value) -> Value {
    json!({
        "apiVersion": "egress-operator.dev/v1alpha1",
        "kind": "Proxy",
        "metadata": {"name": name},
        "spec": spec,
    })
}

/// The HTTP code of a refusal, or 0 for a success.
fn code<T>(r: &Result<T, kube::Error>) -> u16 {
    match r {
        Ok(_) => 0,
        Err(kube::Error::Api(s)) => s.code,
        Err(e) => panic!("not an API answer: {e}"),
    }
}

async fn create(api: &Api<Proxy>, body: Value) -> Result<Proxy, kube::Error> {
    let p: Proxy = serde_json::from_value(body).unwrap();
    guard("create", api.create(&PostParams::default(), &p)).await
}

// ---- (a) Admission ------------------------------------------------------------------

#[tokio::test]
async fn admission_refuses_bad_values_names_and_spec_edits() -> Result<()> {
    let cp = plane().await?;
    let ns = cp.namespace("admission").await?;
    let client = cp.client().await?;
    let api: Api<Proxy> = Api::namespaced(client.clone(), ns.name());
    // Untyped, so that values our types could not even hold reach the server.
    let raw: Api<kube::api::DynamicObject> = Api::namespaced_with(
        client.clone(),
        ns.name(),
        &kube::api::ApiResource::erase::<Proxy>(&()),
    );
    let create_raw = |name: &str, spec: Value| {
        let raw = raw.clone();
        let body: kube::api::DynamicObject =
            serde_json::from_value(proxy_json(name, spec)).unwrap();
        async move { guard("create", raw.create(&PostParams::default(), &body)).await }
    };

    // Values the schema refuses.
    let table: Vec<(&str, Value)> = vec![
        ("enum", json!({"provider": "aws"})),
        (
            "pattern machineType",
            json!({"provider": "kvm2", "machineType": "Small_1"}),
        ),
        (
            "pattern image",
            json!({"provider": "kvm2", "image": "debian 12"}),
        ),
        ("pattern host", json!({"provider": "kvm2", "host": "-h1"})),
        (
            "pattern secret name",
            json!({"provider": "kvm2", "userData": {"secretRef": {"name": "UD", "key": "k"}}}),
        ),
        (
            "pattern secret key",
            json!({"provider": "kvm2", "userData": {"secretRef": {"name": "ud", "key": "a/b"}}}),
        ),
        ("missing provider", json!({"image": "debian"})),
    ];
    for (i, (what, spec)) in table.into_iter().enumerate() {
        let r = create_raw(&format!("bad-{i}"), spec).await;
        assert_eq!(code(&r), 422, "{what}: {r:?}");
    }

    // Names: a DNS subdomain is not enough, a Proxy's name must be a label.
    let spec = json!({"provider": "kvm2"});
    for (what, name) in [
        ("dotted", "office.egress".to_string()),
        ("64 characters", "a".repeat(64)),
        (
            "253 characters, dotted",
            format!(
                "{}.{}.{}.{}",
                "a".repeat(63),
                "b".repeat(63),
                "c".repeat(63),
                "d".repeat(61)
            ),
        ),
    ] {
        let r = create(&api, proxy_json(&name, spec.clone())).await;
        assert_eq!(code(&r), 422, "{what}: {r:?}");
        let text = r.unwrap_err().to_string();
        assert!(text.contains("DNS-1123 label"), "{what}: {text}");
    }
    let r = create(&api, proxy_json(&"a".repeat(63), spec.clone())).await;
    assert_eq!(code(&r), 0, "63 characters is a label: {r:?}");

    // Pool and lease names: what their Service and Proxies are named must be valid too
    // (issue 33, item 11). A pool's Proxies add a 6-character suffix; Services want a
    // letter first.
    let pools: Api<ProxyPool> = Api::namespaced(client.clone(), ns.name());
    let leases: Api<ProxyLease> = Api::namespaced(client.clone(), ns.name());
    let pool = |name: &str| -> ProxyPool {
        serde_json::from_value(json!({
            "apiVersion": "egress-operator.dev/v1alpha1", "kind": "ProxyPool",
            "metadata": {"name": name},
            "spec": {"template": {"provider": "kvm2"}},
        }))
        .unwrap()
    };
    let lease = |name: &str| -> ProxyLease {
        serde_json::from_value(json!({
            "apiVersion": "egress-operator.dev/v1alpha1", "kind": "ProxyLease",
            "metadata": {"name": name},
            "spec": {"pool": "office", "holder": "crawler", "durationSeconds": 600},
        }))
        .unwrap()
    };
    for (what, name) in [
        ("dotted", "office.egress".to_string()),
        ("a digit first", "1office".to_string()),
        ("58 characters", "a".repeat(58)),
    ] {
        let r = guard("pool", pools.create(&PostParams::default(), &pool(&name))).await;
        assert_eq!(code(&r), 422, "pool {what}: {r:?}");
        let text = r.unwrap_err().to_string();
        assert!(text.contains("DNS-1035 label"), "pool {what}: {text}");
    }
    let r = guard(
        "pool",
        pools.create(&PostParams::default(), &pool(&"a".repeat(57))),
    )
    .await;
    assert_eq!(code(&r), 0, "57 characters fit a pool: {r:?}");
    for (what, name) in [
        ("dotted", "crawler.a".to_string()),
        ("a digit first", "1crawler".to_string()),
        ("59 characters", "a".repeat(59)),
    ] {
        let r = guard(
            "lease",
            leases.create(&PostParams::default(), &lease(&name)),
        )
        .await;
        assert_eq!(code(&r), 422, "lease {what}: {r:?}");
        let text = r.unwrap_err().to_string();
        assert!(text.contains("DNS-1035 label"), "lease {what}: {text}");
    }
    let r = guard(
        "lease",
        leases.create(&PostParams::default(), &lease(&"a".repeat(58))),
    )
    .await;
    assert_eq!(code(&r), 0, "58 characters fit a lease: {r:?}");
    // The rules hold on create only: an update of what exists passes.
    let relabel = json!({"metadata": {"labels": {"team": "a"}}});
    let r = guard(
        "relabel",
        pools.patch(
            &"a".repeat(57),
            &PatchParams::default(),
            &Patch::Merge(&relabel),
        ),
    )
    .await;
    assert_eq!(code(&r), 0, "{r:?}");

    // Spec edits, each on a fresh Proxy.
    let base = json!({
        "provider": "kvm2",
        "image": "debian",
        "templateSettings": {"domain": {"a": 1, "n": null}, "vendorData": {"x": {"y": 1, "z": 2}}},
    });
    let edits: Vec<(&str, Value)> = vec![
        (
            "a templateSettings key renamed (same size, same value)",
            json!([{"op": "move", "from": "/spec/templateSettings/domain/a",
                    "path": "/spec/templateSettings/domain/b"}]),
        ),
        (
            "a templateSettings value changed",
            json!([{"op": "replace", "path": "/spec/templateSettings/domain/a", "value": 2}]),
        ),
        (
            "a nested templateSettings value changed",
            json!([{"op": "replace", "path": "/spec/templateSettings/vendorData/x/z",
                    "value": 3}]),
        ),
        (
            "a templateSettings null removed (null versus absent)",
            json!([{"op": "remove", "path": "/spec/templateSettings/domain/n"}]),
        ),
        (
            "a templateSettings key set to null (absent versus null)",
            json!([{"op": "add", "path": "/spec/templateSettings/domain/z", "value": null}]),
        ),
        (
            "a spec field set to null where it was absent",
            json!([{"op": "add", "path": "/spec/host", "value": null}]),
        ),
        (
            "a spec field changed",
            json!([{"op": "replace", "path": "/spec/image", "value": "ubuntu"}]),
        ),
        (
            "a spec field removed",
            json!([{"op": "remove", "path": "/spec/image"}]),
        ),
    ];
    for (i, (what, patch)) in edits.into_iter().enumerate() {
        let name = format!("edit-{i}");
        create_raw(&name, base.clone()).await.unwrap();
        let patch: json_patch::Patch = serde_json::from_value(patch).unwrap();
        let r = guard(
            "patch",
            raw.patch(&name, &PatchParams::default(), &Patch::Json::<()>(patch)),
        )
        .await;
        assert_eq!(code(&r), 422, "{what}: {r:?}");
        let text = r.unwrap_err().to_string();
        assert!(text.contains("spec is immutable"), "{what}: {text}");
    }

    // Not edits: a label, and the same spec again with its keys in another order.
    create_raw("steady", base.clone()).await.unwrap();
    let r = guard(
        "label",
        raw.patch(
            "steady",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"team": "a"}}})),
        ),
    )
    .await;
    assert_eq!(code(&r), 0, "{r:?}");
    let reordered = json!({
        "templateSettings": {"vendorData": {"x": {"z": 2, "y": 1}}, "domain": {"n": null, "a": 1}},
        "image": "debian",
        "provider": "kvm2",
    });
    // A JSON patch, not a merge patch: a merge patch's null would delete the key.
    let same: json_patch::Patch =
        serde_json::from_value(json!([{"op": "replace", "path": "/spec", "value": reordered}]))?;
    let r = guard(
        "same spec",
        raw.patch("steady", &PatchParams::default(), &Patch::Json::<()>(same)),
    )
    .await;
    assert_eq!(code(&r), 0, "{r:?}");
    Ok(())
}

// ---- (b) Write semantics --------------------------------------------------------------

const CONFIG: &str = r#"
clusterId: test
kvm2:
  ssh: {user: egress, privateKeyFile: /k/id, knownHostsFile: /k/known_hosts}
  hosts:
    - {name: h1, address: "127.0.0.1:2222", storagePool: default, bridge: br0}
  images:
    - name: debian
      url: https://images.example.org/debian.qcow2
      sha256: "0000000000000000000000000000000000000000000000000000000000000000"
      format: qcow2
  machineTypes:
    - {name: small, vcpus: 1, memoryMiB: 512, diskGiB: 4}
  defaults: {machineType: small, image: debian}
  templates:
    domain: {path: /p/domain.wasm}
    vendorData: {path: /p/vendor-data.wasm}
"#;

/// Every probed proxy answers `200 Connection established`, in memory (no network).
struct Answers;

impl egress_operator::serving::Dialer for Answers {
    fn dial(
        &self,
        _: std::net::SocketAddr,
    ) -> egress_operator::serving::BoxFuture<
        '_,
        std::io::Result<Box<dyn egress_operator::serving::ProbeStream>>,
    > {
        Box::pin(async move {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let (client, mut proxy) = tokio::io::duplex(4096);
            tokio::spawn(async move {
                let mut head = [0u8; 512];
                let _ = proxy.read(&mut head).await;
                let _ = proxy
                    .write_all(b"HTTP/1.1 200 Connection established\r\n\r\n")
                    .await;
                let mut rest = Vec::new();
                let _ = proxy.read_to_end(&mut rest).await;
            });
            Ok(Box::new(client) as Box<dyn egress_operator::serving::ProbeStream>)
        })
    }
}

/// A controller context on `client` with the fake provider as `kvm2`.
fn context(
    client: kube::Client,
) -> (
    Arc<Context>,
    Arc<egress_operator::provider::fake::FakeProvider>,
) {
    let config = Arc::new(
        egress_operator::config::parse(CONFIG, "cluster-api.yaml", Path::new("/")).unwrap(),
    );
    let fake = Arc::new(egress_operator::provider::fake::FakeProvider::named(
        "kvm2",
        &["h1"],
    ));
    let mut registry = egress_operator::provider::registry::Registry::new();
    registry.insert(fake.clone());
    let mut ctx = Context::new(
        client,
        config.clone(),
        Arc::new(registry),
        ControllerMetrics::default(),
        Some("cluster-api-test".into()),
    );
    ctx.prober = egress_operator::serving::Prober::with_dialer(
        &config.serving,
        Arc::new(Answers),
        ctx.metrics.probes.clone(),
    );
    (Arc::new(ctx), fake)
}

/// Reconciles the Proxy as it is on the server now (due now, not deferred).
async fn reconcile(
    api: &Api<Proxy>,
    ctx: &Arc<Context>,
    name: &str,
) -> (
    Proxy,
    Result<kube::runtime::controller::Action, ControllerError>,
) {
    let p = guard("get", api.get(name)).await.unwrap();
    ctx.attempts.expire(&p.uid().unwrap());
    let r = guard(
        "reconcile",
        controller::reconcile(Arc::new(p.clone()), ctx.clone()),
    )
    .await;
    (p, r)
}

async fn new_proxy(api: &Api<Proxy>, name: &str) -> Proxy {
    let p = Proxy::new(
        name,
        ProxySpec {
            provider: "kvm2".into(),
            ..Default::default()
        },
    );
    guard("create", api.create(&PostParams::default(), &p))
        .await
        .unwrap()
}

#[tokio::test]
async fn a_steady_proxy_writes_nothing_and_status_is_our_apply() -> Result<()> {
    let cp = plane().await?;
    let ns = cp.namespace("steady").await?;
    let client = cp.client().await?;
    let api: Api<Proxy> = Api::namespaced(client.clone(), ns.name());
    let (ctx, fake) = context(client);
    new_proxy(&api, "p").await;

    // Finalizer, then create and status.
    reconcile(&api, &ctx, "p").await.1.unwrap();
    reconcile(&api, &ctx, "p").await.1.unwrap();
    assert_eq!(fake.instances().len(), 1);
    let p = guard("get", api.get("p")).await?;
    let status = p.status.clone().expect("status written");
    assert!(status.address.is_some(), "{status:?}");
    assert!(
        p.finalizers().iter().any(|f| f == controller::FINALIZER),
        "{:?}",
        p.finalizers()
    );

    // Status is ours, by Apply, on the status subresource, and only there.
    let fields = p.metadata.managed_fields.clone().unwrap_or_default();
    let ours: Vec<_> = fields
        .iter()
        .filter(|m| m.manager.as_deref() == Some(controller::FIELD_MANAGER))
        .collect();
    assert!(
        ours.iter().any(|m| m.operation.as_deref() == Some("Apply")
            && m.subresource.as_deref() == Some("status")),
        "managedFields: {fields:#?}"
    );
    assert!(
        ours.iter()
            .filter(|m| m.operation.as_deref() == Some("Apply"))
            .all(|m| m.subresource.as_deref() == Some("status")),
        "{fields:#?}"
    );

    // Nothing changed: more reconciles bump no resourceVersion.
    let before = p.resource_version();
    for _ in 0..3 {
        reconcile(&api, &ctx, "p").await.1.unwrap();
    }
    let after = guard("get", api.get("p")).await?.resource_version();
    assert_eq!(
        before, after,
        "a reconcile that changed nothing wrote the Proxy"
    );

    // Delete: the finalizer goes after the instance.
    guard("delete", api.delete("p", &Default::default())).await?;
    reconcile(&api, &ctx, "p").await.1.unwrap();
    assert!(fake.instances().is_empty());
    guard("gone", async {
        while api.get_opt("p").await.unwrap().is_some() {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    Ok(())
}

#[tokio::test]
async fn a_finalizer_race_with_another_writer_is_transient_and_recovers() -> Result<()> {
    let cp = plane().await?;
    let ns = cp.namespace("race").await?;
    let client = cp.client().await?;
    let api: Api<Proxy> = Api::namespaced(client.clone(), ns.name());
    let (ctx, _fake) = context(client);
    new_proxy(&api, "p").await;

    // Our read, then another controller adds its finalizer, then our patch.
    let stale = guard("get", api.get("p")).await?;
    guard(
        "other writer",
        api.patch(
            "p",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"finalizers": ["example.org/other"]}})),
        ),
    )
    .await?;
    let e = guard(
        "reconcile",
        controller::reconcile(Arc::new(stale.clone()), ctx.clone()),
    )
    .await
    .expect_err("the stale finalizer patch must fail");
    assert!(matches!(e, ControllerError::FinalizerRace(_)), "{e:?}");
    assert_eq!(e.class(), ErrorClass::Transient);
    let action = controller::error_policy(Arc::new(stale), &e, ctx.clone());
    // Action has no getter: read the delay from its Debug form. The transient ladder starts
    // at 5 s with +-20 % jitter; a permanent error would wait an hour.
    let text = format!("{action:?}");
    let secs: f64 = text
        .split("Some(")
        .nth(1)
        .and_then(|rest| rest.split("s)").next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no requeue delay in {text}"));
    assert!(
        (4.0..=6.0).contains(&secs),
        "retried in seconds, not after the permanent delay: {action:?}"
    );

    // The retry reads the new list and adds ours beside the other one.
    reconcile(&api, &ctx, "p").await.1.unwrap();
    let p = guard("get", api.get("p")).await?;
    assert_eq!(
        p.finalizers(),
        [
            "example.org/other".to_string(),
            controller::FINALIZER.to_string()
        ]
    );
    // Let the namespace go.
    guard(
        "drop finalizers",
        api.patch(
            "p",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"finalizers": null}})),
        ),
    )
    .await?;
    Ok(())
}

/// Issue 33, item 11: a finalizer patch refused by validation (here a
/// ValidatingAdmissionPolicy bound to this test's namespace only; a CRD rule answers the
/// same 422) is a permanent error that says why, not a finalizer race retried every few
/// seconds forever. Before the fix every 422 on the finalizer patch was classed a race. A
/// lost race (a failed `test` op) stays transient: see the test above.
#[tokio::test]
async fn a_finalizer_patch_refused_by_validation_is_permanent_not_a_race() -> Result<()> {
    let cp = plane().await?;
    let ns = cp.namespace("fin-refused").await?;
    let client = cp.client().await?;
    let api: Api<Proxy> = Api::namespaced(client.clone(), ns.name());
    let (ctx, _fake) = context(client.clone());
    let policy = format!("egress-test-no-finalizers-{}", ns.name());
    let objects = json!({"apiVersion": "v1", "kind": "List", "items": [
        {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy",
         "metadata": {"name": policy},
         "spec": {"failurePolicy": "Fail",
                  "matchConstraints": {"resourceRules": [{
                      "apiGroups": ["egress-operator.dev"], "apiVersions": ["*"],
                      "operations": ["UPDATE"], "resources": ["proxies"]}]},
                  "validations": [{
                      "expression": "!has(object.metadata.finalizers) || size(object.metadata.finalizers) == 0",
                      "message": "finalizers are not allowed here", "reason": "Invalid"}]}},
        {"apiVersion": "admissionregistration.k8s.io/v1",
         "kind": "ValidatingAdmissionPolicyBinding",
         "metadata": {"name": policy},
         "spec": {"policyName": policy, "validationActions": ["Deny"],
                  "matchResources": {"namespaceSelector": {"matchLabels": {
                      "kubernetes.io/metadata.name": ns.name()}}}}},
    ]});
    let file = cp
        .dir()
        .map(|d| d.join(format!("{policy}.json")))
        .unwrap_or_else(|| std::env::temp_dir().join(format!("{policy}.json")));
    std::fs::write(&file, objects.to_string())?;
    cp.kubectl_run(&["apply", "-f", &file.to_string_lossy()])?;
    new_proxy(&api, "p").await;
    // The policy refuses once the API server has loaded it; until then a patch that got
    // through is undone (waited for with a plain label patch, so the controller's own
    // finalizer is never taken before the policy holds).
    let deadline = std::time::Instant::now() + GUARD;
    loop {
        let r = guard(
            "probe",
            api.patch(
                "p",
                &PatchParams::default(),
                &Patch::Merge(json!({"metadata": {"finalizers": ["example.org/probe"]}})),
            ),
        )
        .await;
        match r {
            Err(kube::Error::Api(s)) if s.code == 422 => break,
            Ok(_) => {
                guard(
                    "undo",
                    api.patch(
                        "p",
                        &PatchParams::default(),
                        &Patch::Merge(json!({"metadata": {"finalizers": null}})),
                    ),
                )
                .await?;
            }
            Err(e) => return Err(e.into()),
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the policy never refused"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (_, r) = reconcile(&api, &ctx, "p").await;
    let e = r.expect_err("the finalizer patch is refused");
    println!("{e}");
    assert!(
        !matches!(e, ControllerError::FinalizerRace(_)),
        "a refusal by validation is not a race: {e:?}"
    );
    assert_eq!(e.class(), ErrorClass::Permanent, "{e:?}");
    assert!(
        format!("{e:?}").contains("finalizers are not allowed here"),
        "the refusal says why: {e:?}"
    );
    cp.kubectl_run(&["delete", "-f", &file.to_string_lossy()])?;
    Ok(())
}

#[tokio::test]
async fn an_error_over_2_kb_still_produces_an_event() -> Result<()> {
    let cp = plane().await?;
    let ns = cp.namespace("events").await?;
    let client = cp.client().await?;
    let api: Api<Proxy> = Api::namespaced(client.clone(), ns.name());
    let (ctx, fake) = context(client.clone());
    let p = new_proxy(&api, "p").await;
    reconcile(&api, &ctx, "p").await.1.unwrap(); // the finalizer
    // A spec the controller refuses with a long message: fields of a newer operator.
    let fields: Vec<String> = (0..60)
        .map(|i| format!("spec.someFieldFromANewerOperatorVersion{i:03}"))
        .collect();
    ctx.skew.set(&p.uid().unwrap(), fields);

    let e = reconcile(&api, &ctx, "p").await.1.expect_err("refused");
    assert!(e.to_string().len() > 2048, "{}", e.to_string().len());
    assert!(fake.instances().is_empty());

    let events: Api<KubeEvent> = Api::namespaced(client, ns.name());
    let found = guard("the event", async {
        loop {
            let list = events.list(&ListParams::default()).await.unwrap();
            if let Some(e) = list
                .items
                .into_iter()
                .find(|e| e.reason.as_deref() == Some("InvalidSpec"))
            {
                return e;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    let note = found.note.unwrap_or_default();
    assert!(note.len() <= controller::MAX_EVENT_NOTE, "{}", note.len());
    assert!(note.ends_with(" [truncated]"), "{note}");
    assert_eq!(found.regarding.and_then(|r| r.name).as_deref(), Some("p"));
    // The condition message is cut too; the status write went through.
    let s = guard("get", api.get("p")).await?.status.unwrap_or_default();
    assert_eq!(s.last_error_class.as_deref(), Some("permanent"));
    Ok(())
}

/// Issue 35, item 5: the collector's refusal of a host (two clusters under one
/// `clusterId`) reaches the API server as a Warning event on the provider's
/// ProviderHealth object, which is cluster-scoped (so the event lands in `default`), its
/// note cut to what events.k8s.io accepts.
#[tokio::test]
async fn a_refused_host_is_an_event_on_the_provider_health_object() -> Result<()> {
    use egress_operator::gc::events::{COLLECTION_REFUSED, GcEvents, KubeGcEvents};
    let cp = plane().await?;
    let client = cp.client().await?;
    // A name of this run's own: events of earlier runs stay in `default`.
    let provider = format!(
        "kvm2-{}-{}",
        std::process::id(),
        jiff::Timestamp::now().as_millisecond()
    );
    let sink = KubeGcEvents::new(client.clone(), Some("cluster-api-test".into()));
    let why = format!("two clusters share a clusterId; {}", "x".repeat(3000));
    sink.refused(&provider, &[("h1".to_string(), why)]).await;
    let events: Api<KubeEvent> = Api::namespaced(client, "default");
    let found = guard("the CollectionRefused event", async {
        loop {
            let list = events.list(&ListParams::default()).await.unwrap();
            if let Some(e) = list.items.into_iter().find(|e| {
                e.reason.as_deref() == Some(COLLECTION_REFUSED)
                    && e.regarding.as_ref().and_then(|r| r.name.as_deref())
                        == Some(provider.as_str())
            }) {
                return e;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    assert_eq!(found.type_.as_deref(), Some("Warning"));
    let regarding = found.regarding.unwrap_or_default();
    assert_eq!(regarding.kind.as_deref(), Some("ProviderHealth"));
    let note = found.note.unwrap_or_default();
    assert!(note.len() <= controller::MAX_EVENT_NOTE, "{}", note.len());
    assert!(
        note.starts_with(
            "garbage collection refused on 1 host(s): h1: two clusters share a clusterId"
        ),
        "{note}"
    );
    Ok(())
}

// ---- Skew ----------------------------------------------------------------------------

#[tokio::test]
async fn a_proxy_using_a_field_of_a_newer_crd_is_named_and_the_others_still_decode() -> Result<()> {
    let cp = plane().await?;
    // Its own CRD version would disturb the other tests: a newer CRD is one that adds a
    // spec field, which the others never set, so adding it is invisible to them.
    let client = cp.client().await?;
    let crds: Api<k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition> =
        Api::all(client.clone());
    let mut crd = guard("crd", crds.get("proxies.egress-operator.dev")).await?;
    let mut schema = serde_json::to_value(&crd.spec.versions[0].schema)?;
    schema["openAPIV3Schema"]["properties"]["spec"]["properties"]["dnsServers"] =
        json!({"type": "array", "items": {"type": "string"}});
    crd.spec.versions[0].schema = Some(serde_json::from_value(schema)?);
    crd.metadata.managed_fields = None;
    guard(
        "newer crd",
        crds.replace("proxies.egress-operator.dev", &PostParams::default(), &crd),
    )
    .await?;

    let ns = cp.namespace("skew").await?;
    let raw: Api<kube::api::DynamicObject> = Api::namespaced_with(
        client.clone(),
        ns.name(),
        &kube::api::ApiResource::erase::<Proxy>(&()),
    );
    // The API server serves the new schema a moment after the update: until then the
    // field is pruned, so create until it is kept.
    guard("the newer schema in use", async {
        loop {
            let spec = json!({"provider": "kvm2", "dnsServers": ["192.0.2.53"]});
            let body: kube::api::DynamicObject =
                serde_json::from_value(proxy_json("newer", spec)).unwrap();
            let made = raw.create(&PostParams::default(), &body).await.unwrap();
            if made.data["spec"]["dnsServers"].is_array() {
                return;
            }
            raw.delete("newer", &Default::default()).await.unwrap();
            while raw.get_opt("newer").await.unwrap().is_some() {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    })
    .await;
    let body: kube::api::DynamicObject =
        serde_json::from_value(proxy_json("older", json!({"provider": "kvm2"})))?;
    guard("create", raw.create(&PostParams::default(), &body)).await?;
    // kube-runtime's own typed watcher of these Proxies: would the LIST decode? It does
    // (the spec types accept unknown fields), and the controller's watch names the field.
    let health = egress_operator::controller::watch::WatchHealth::default();
    let skew = egress_operator::controller::watch::Skew::default();
    let events = controller::watch::proxies(
        client.clone(),
        kube::runtime::watcher::Config::default().any_semantic(),
        health.clone(),
        skew.clone(),
    );
    tokio::pin!(events);
    let mut seen = Vec::new();
    guard("the initial list", async {
        while let Some(e) = events.next().await {
            match e.unwrap() {
                kube::runtime::watcher::Event::InitApply(p)
                    if p.namespace().as_deref() == Some(ns.name()) =>
                {
                    seen.push(p)
                }
                kube::runtime::watcher::Event::InitDone => break,
                _ => {}
            }
        }
    })
    .await;
    let mut names: Vec<String> = seen.iter().map(|p| p.name_any()).collect();
    names.sort();
    assert_eq!(names, ["newer", "older"]);
    let newer = seen.iter().find(|p| p.name_any() == "newer").unwrap();
    let older = seen.iter().find(|p| p.name_any() == "older").unwrap();
    assert_eq!(skew.unknown(&newer.uid().unwrap()), ["spec.dnsServers"]);
    assert!(skew.unknown(&older.uid().unwrap()).is_empty());
    assert_eq!(health.errors("decode"), 0);

    // Back to the shipped CRD (for a cluster that outlives this test).
    let mut crd = guard("crd", crds.get("proxies.egress-operator.dev")).await?;
    let mut schema = serde_json::to_value(&crd.spec.versions[0].schema)?;
    if let Some(props) =
        schema["openAPIV3Schema"]["properties"]["spec"]["properties"].as_object_mut()
    {
        props.remove("dnsServers");
    }
    crd.spec.versions[0].schema = Some(serde_json::from_value(schema)?);
    crd.metadata.managed_fields = None;
    guard(
        "shipped crd",
        crds.replace("proxies.egress-operator.dev", &PostParams::default(), &crd),
    )
    .await?;
    Ok(())
}

// ---- (e) The garbage collector's index pages ----------------------------------------

/// Past one page (500) of Proxies, the collector's index still sees every one: it follows
/// the server's continue tokens, as the operator's ServiceAccount. A Proxy missed here
/// would have its VM collected as an orphan.
#[tokio::test]
async fn the_gc_index_pages_past_500_proxies() -> Result<()> {
    use egress_operator::gc::{KubeProxyIndex, ProxyIndex};

    const N: usize = 505;
    let cp = plane().await?;
    cp.install_rbac()?;
    let admin = cp.client().await?;
    let ns = cp.namespace("gc-pages").await?;
    let api: Api<Proxy> = Api::namespaced(admin, ns.name());
    let created: Vec<Result<Proxy, kube::Error>> = futures_util::stream::iter(0..N)
        .map(|i| {
            let api = api.clone();
            async move {
                create(
                    &api,
                    proxy_json(&format!("p-{i:04}"), json!({"provider": "kvm2"})),
                )
                .await
            }
        })
        .buffer_unordered(16)
        .collect()
        .await;
    let failed: Vec<_> = created.iter().filter_map(|r| r.as_ref().err()).collect();
    assert!(failed.is_empty(), "creates failed: {failed:?}");

    let operator = cp.client_for(&cp.operator_kubeconfig()?).await?;
    let owners = guard("the index", KubeProxyIndex::new(operator).owners()).await?;
    let ours = owners.values().filter(|o| o.namespace == ns.name()).count();
    assert_eq!(ours, N, "the index missed Proxies past the first page");

    let user = integration_tests::harness::controlplane::operator_user();
    if let Some(audit) = cp.audit()? {
        let lists: Vec<&str> = audit
            .iter()
            .filter(|r| r.user == user && r.verb == "list" && r.resource == "proxies")
            .map(|r| r.uri.as_str())
            .collect();
        assert!(
            lists.iter().any(|u| u.contains("limit=500"))
                && lists.iter().any(|u| u.contains("continue=")),
            "no paged list with a continue token: {lists:?}"
        );
    }
    Ok(())
}

/// The shapes of `templateSettings` beyond the CRD's bounds (issue 35, item 4), with what
/// each one exceeds.
fn over_bound_settings() -> Vec<(&'static str, Value)> {
    let many: serde_json::Map<String, Value> =
        (0..17).map(|i| (format!("k{i}"), json!(1))).collect();
    vec![
        ("17 keys", Value::Object(many)),
        ("a 4097-character string", json!({"s": "x".repeat(4097)})),
        ("a list of 33", json!({"l": vec![1; 33]})),
        (
            "a map of 33",
            Value::Object(
                [(
                    "m".to_string(),
                    Value::Object((0..33).map(|i| (format!("k{i}"), json!(1))).collect()),
                )]
                .into_iter()
                .collect(),
            ),
        ),
        (
            "a 129-character string in a list",
            json!({"l": ["x".repeat(129)]}),
        ),
        ("a list in a list", json!({"l": [[1]]})),
        ("a map in a map", json!({"m": {"n": {"o": 1}}})),
    ]
}

/// Settings at every bound of the CRD's schema at once.
fn at_bound_settings() -> Value {
    let mut m: serde_json::Map<String, Value> =
        (0..13).map(|i| (format!("k{i}"), json!(i))).collect();
    m.insert("s".into(), json!("x".repeat(4096)));
    m.insert("l".into(), json!(vec!["y".repeat(128); 32]));
    m.insert(
        "m".into(),
        Value::Object(
            (0..32)
                .map(|i| (format!("k{i}"), json!("z".repeat(128))))
                .collect(),
        ),
    );
    Value::Object(m)
}

/// Issue 35, item 4: `templateSettings` is bounded at admission, on Proxies and on pool
/// templates alike (one schema type): every over-bound shape is refused with a 422 for
/// both plugins' settings, and settings at every bound pass. Before the fix the schema
/// had no bound, and each of these was accepted.
#[tokio::test]
async fn admission_bounds_template_settings_on_proxies_and_pools() -> Result<()> {
    let cp = plane().await?;
    let ns = cp.namespace("settings-bounds").await?;
    let client = cp.client().await?;
    let proxies: Api<kube::api::DynamicObject> = Api::namespaced_with(
        client.clone(),
        ns.name(),
        &kube::api::ApiResource::erase::<Proxy>(&()),
    );
    let pools: Api<kube::api::DynamicObject> = Api::namespaced_with(
        client.clone(),
        ns.name(),
        &kube::api::ApiResource::erase::<ProxyPool>(&()),
    );
    let create = |kind: &'static str, name: String, settings: Value| {
        let (proxies, pools) = (proxies.clone(), pools.clone());
        async move {
            let (api, body) = match kind {
                "Proxy" => (
                    proxies,
                    proxy_json(
                        &name,
                        json!({"provider": "kvm2", "templateSettings": settings}),
                    ),
                ),
                _ => (
                    pools,
                    json!({
                        "apiVersion": "egress-operator.dev/v1alpha1",
                        "kind": "ProxyPool",
                        "metadata": {"name": name},
                        "spec": {"replicas": 1, "template": {
                            "provider": "kvm2", "templateSettings": settings}},
                    }),
                ),
            };
            let body: kube::api::DynamicObject = serde_json::from_value(body).unwrap();
            guard("create", api.create(&PostParams::default(), &body)).await
        }
    };
    for kind in ["Proxy", "ProxyPool"] {
        for field in ["domain", "vendorData"] {
            for (i, (what, value)) in over_bound_settings().into_iter().enumerate() {
                let name = format!("over-{}-{i}", field.to_lowercase());
                let r = create(kind, name, json!({ field: value })).await;
                assert_eq!(code(&r), 422, "{kind} {field}: {what}: {r:?}");
            }
        }
        let name = format!("at-bound-{}", kind.to_lowercase());
        let both = json!({"domain": at_bound_settings(), "vendorData": at_bound_settings()});
        let r = create(kind, name, both).await;
        assert_eq!(code(&r), 0, "{kind}: settings at every bound: {r:?}");
    }
    Ok(())
}

/// Issue 35, item 4, the keys: a structural schema cannot bound a map's key length, so
/// `config/admission/template_settings.yaml` does, on a control plane of its own (the
/// policies are cluster-wide). Keys of 129 characters, of a setting or of a map value,
/// are refused on Proxies and pools; 128 pass; neither policy has type-checking warnings;
/// a pool made before the policy with a long key can still be labelled.
#[tokio::test]
async fn admission_bounds_template_settings_keys_on_proxies_and_pools() -> Result<()> {
    use k8s_openapi::api::admissionregistration::v1::ValidatingAdmissionPolicy;
    let cp = ControlPlane::start()?;
    cp.install_crds().await?;
    let client = cp.client().await?;
    let ns = cp.namespace("settings-keys").await?;
    let proxies: Api<Proxy> = Api::namespaced(client.clone(), ns.name());
    let pools: Api<ProxyPool> = Api::namespaced(client.clone(), ns.name());
    let legacy: ProxyPool = serde_json::from_value(json!({
        "apiVersion": "egress-operator.dev/v1alpha1",
        "kind": "ProxyPool",
        "metadata": {"name": "legacy"},
        "spec": {"replicas": 1, "template": {"provider": "kvm2",
                 "templateSettings": {"domain": {"k".repeat(129): 1}}}},
    }))?;
    guard("create", pools.create(&PostParams::default(), &legacy)).await?;
    let policy = integration_tests::workspace_root().join("config/admission");
    cp.kubectl_run(&["apply", "-k", &policy.to_string_lossy()])?;
    let proxy = |name: &str, settings: Value| -> Proxy {
        serde_json::from_value(proxy_json(
            name,
            json!({"provider": "kvm2", "templateSettings": settings}),
        ))
        .unwrap()
    };
    let pool = |name: &str, settings: Value| -> ProxyPool {
        serde_json::from_value(json!({
            "apiVersion": "egress-operator.dev/v1alpha1",
            "kind": "ProxyPool",
            "metadata": {"name": name},
            "spec": {"replicas": 1, "template": {"provider": "kvm2", "templateSettings": settings}},
        }))
        .unwrap()
    };
    let refused = |r: &Result<(), kube::Error>| match r {
        Err(kube::Error::Api(e)) => e.code == 422 && e.message.contains("longer than"),
        _ => false,
    };
    let (long, fits) = ("k".repeat(129), "k".repeat(128));
    // The policies take effect once the API server has loaded them: until the first
    // over-long key is refused, a try that got through is deleted and tried again.
    let deadline = std::time::Instant::now() + GUARD;
    loop {
        let r = guard(
            "create",
            proxies.create(
                &PostParams::default(),
                &proxy("probe", json!({"domain": {&long: 1}})),
            ),
        )
        .await
        .map(drop);
        if refused(&r) {
            break;
        }
        if r.is_ok() {
            guard("delete", proxies.delete("probe", &Default::default())).await?;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the policy never refused: {r:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for name in [
        "egress-operator-proxy-settings-keys",
        "egress-operator-pool-settings-keys",
    ] {
        let vap = guard(
            "get policy",
            Api::<ValidatingAdmissionPolicy>::all(client.clone()).get(name),
        )
        .await?;
        let warnings = vap
            .status
            .and_then(|s| s.type_checking)
            .and_then(|t| t.expression_warnings);
        assert!(
            warnings.as_ref().is_none_or(Vec::is_empty),
            "{name}: {warnings:#?}"
        );
    }
    let shapes = |key: &str| {
        vec![
            json!({"domain": {key: 1}}),
            json!({"vendorData": {key: "v"}}),
            json!({"vendorData": {"m": {key: 1}}}),
        ]
    };
    // Pools get one settle of their own: the second policy may load after the first.
    let mut pool_loaded = false;
    for (i, settings) in shapes(&long).into_iter().enumerate() {
        let r = guard(
            "create",
            proxies.create(
                &PostParams::default(),
                &proxy(&format!("long-{i}"), settings.clone()),
            ),
        )
        .await
        .map(drop);
        assert!(refused(&r), "Proxy {settings}: {r:?}");
        let deadline = std::time::Instant::now() + GUARD;
        loop {
            let name = format!("long-{i}");
            let r = guard(
                "create",
                pools.create(&PostParams::default(), &pool(&name, settings.clone())),
            )
            .await
            .map(drop);
            if refused(&r) {
                pool_loaded = true;
                break;
            }
            assert!(!pool_loaded, "ProxyPool {settings}: {r:?}");
            if r.is_ok() {
                guard("delete", pools.delete(&name, &Default::default())).await?;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "ProxyPool {settings}: {r:?}"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    // Made before the policy: its settings are not changed by a label, so it passes.
    guard(
        "label the legacy pool",
        pools.patch(
            "legacy",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"team": "a"}}})),
        ),
    )
    .await?;
    for (i, settings) in shapes(&fits).into_iter().enumerate() {
        let name = format!("fits-{i}");
        guard(
            "create",
            proxies.create(&PostParams::default(), &proxy(&name, settings.clone())),
        )
        .await?;
        guard(
            "create",
            pools.create(&PostParams::default(), &pool(&name, settings)),
        )
        .await?;
    }
    Ok(())
}
