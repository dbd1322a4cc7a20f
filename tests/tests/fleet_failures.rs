#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! A pool whose members keep failing, and a pool with no host for its members, on the real
//! control plane (issue 33, items 6 and 13).
//!
//! The pool controller runs in-process as the operator's ServiceAccount with the shipped
//! `config/rbac`. No Proxy controller runs: the test plays it, writing each member's status
//! (`Failed` with a render error, or `Running` and `Ready`), so it decides exactly what the
//! pool sees. Without a Proxy controller there is no finalizer, and a deleted member is
//! gone at once, as fast as a churning pool could make the next one.

use std::collections::BTreeSet;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use egress_operator::api::proxy::Proxy;
use egress_operator::api::proxy_pool::{
    DRAINING_ANNOTATION, LEASE_LABEL, POOL_LABEL, ProxyPool, TEMPLATE_HASH_LABEL,
};
use egress_operator::config::ValidConfig;
use egress_operator::fleet::failures::CreateBackoff;
use egress_operator::fleet::pool::FleetContext;
use egress_operator::fleet::{FleetMetrics, LivenessBoard};
use integration_tests::harness::ControlPlane;
use k8s_openapi::api::events::v1::Event as KubeEvent;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client, Resource, ResourceExt};
use tokio::time::Instant;

/// Hang guard of every wait: generous, never a performance assertion.
const GUARD: Duration = Duration::from_secs(180);

/// What the test's stand-in Proxy controller writes on a failed member.
const RENDER_ERROR: &str = "domain plugin: settings.cpuMode: \"fast\" is not one of the choices";

/// The backoff of the test's pool controller: short, so the test takes seconds, and long
/// against the stand-in's reaction (a few hundred milliseconds), so a pool that does not
/// back off shows many more creates.
const BACKOFF: CreateBackoff = CreateBackoff {
    first: Duration::from_secs(2),
    max: Duration::from_secs(4),
};

async fn poll<T, F, Fut>(what: &str, mut probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + GUARD;
    loop {
        if let Some(v) = probe().await {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: not seen within {GUARD:?} (hang guard)"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The pool controller running as the operator.
struct PoolController {
    metrics: FleetMetrics,
    stop: tokio::sync::watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
    _leading: tokio::sync::watch::Sender<bool>,
}

impl PoolController {
    fn start(operator: &Client) -> Self {
        let config: Arc<ValidConfig> = Arc::new(
            egress_operator::config::parse(
                &integration_tests::fleet_config::fleet_config(2),
                "fleet.yaml",
                std::path::Path::new("/"),
            )
            .unwrap(),
        );
        let metrics = FleetMetrics::default();
        let (leading_tx, leading) = tokio::sync::watch::channel(true);
        let ctx = FleetContext::new(
            operator.clone(),
            config,
            Arc::new(LivenessBoard::default()),
            metrics.clone(),
            leading,
            None,
        )
        .with_create_backoff(BACKOFF);
        let (stop, mut stop_rx) = tokio::sync::watch::channel(false);
        let task = tokio::spawn(egress_operator::fleet::pool::run(
            Arc::new(ctx),
            async move {
                let _ = stop_rx.wait_for(|s| *s).await;
            },
        ));
        Self {
            metrics,
            stop,
            task,
            _leading: leading_tx,
        }
    }

    async fn stop(self) {
        let _ = self.stop.send(true);
        let _ = tokio::time::timeout(GUARD, self.task).await;
    }
}

/// An admin client, one acting as the operator, and a fresh namespace on `cp`.
async fn setup(
    cp: &ControlPlane,
    prefix: &str,
) -> (
    Client,
    Client,
    String,
    integration_tests::harness::TestNamespace,
) {
    cp.install_crds().await.unwrap();
    cp.install_rbac().unwrap();
    let admin = cp.client().await.unwrap();
    let operator = cp
        .client_for(&cp.operator_kubeconfig().unwrap())
        .await
        .unwrap();
    let ns = cp.namespace(prefix).await.unwrap();
    (admin, operator, ns.name().to_string(), ns)
}

async fn create_pool(admin: &Client, ns: &str, spec: serde_json::Value) -> ProxyPool {
    let pool: ProxyPool = serde_json::from_value(serde_json::json!({
        "apiVersion": "egress-operator.dev/v1alpha1",
        "kind": "ProxyPool",
        "metadata": {"name": "office"},
        "spec": spec,
    }))
    .unwrap();
    Api::<ProxyPool>::namespaced(admin.clone(), ns)
        .create(&PostParams::default(), &pool)
        .await
        .unwrap()
}

fn degraded(pool: &ProxyPool) -> Option<Condition> {
    pool.status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == "Degraded")
        .cloned()
}

async fn pool_events(admin: &Client, ns: &str, reason: &str) -> Vec<KubeEvent> {
    Api::<KubeEvent>::namespaced(admin.clone(), ns)
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|e| {
            e.reason.as_deref() == Some(reason)
                && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("office")
        })
        .collect()
}

/// How many times `events` were written: the recorder folds repeats of one reason on one
/// object into a series.
fn written(events: &[KubeEvent]) -> i32 {
    events
        .iter()
        .map(|e| e.series.as_ref().map_or(1, |s| s.count))
        .sum()
}

/// Writes the status the Proxy controller writes for a render error: `Failed`, permanent.
async fn fail(admin: &Client, ns: &str, name: &str) {
    let now = jiff::Timestamp::now().to_string();
    let cond = |t: &str| {
        serde_json::json!({"type": t, "status": "False", "reason": "RenderFailed",
                           "message": RENDER_ERROR, "lastTransitionTime": now})
    };
    let body = serde_json::json!({"status": {
        "phase": "Failed", "lastErrorClass": "permanent",
        "conditions": [cond("Provisioned"), cond("Ready")],
    }});
    Api::<Proxy>::namespaced(admin.clone(), ns)
        .patch_status(name, &PatchParams::default(), &Patch::Merge(&body))
        .await
        .unwrap();
}

/// Writes the status of a running, serving member.
async fn serve(admin: &Client, ns: &str, name: &str, ip: &str) {
    let now = jiff::Timestamp::now().to_string();
    let cond = |t: &str| {
        serde_json::json!({"type": t, "status": "True", "reason": "Serving", "message": "",
                           "lastTransitionTime": now})
    };
    let body = serde_json::json!({"status": {
        "phase": "Running", "address": ip, "host": "h1", "instanceId": format!("h1/{name}"),
        "conditions": [cond("Provisioned"), cond("Serving"), cond("Ready")],
    }});
    Api::<Proxy>::namespaced(admin.clone(), ns)
        .patch_status(name, &PatchParams::default(), &Patch::Merge(&body))
        .await
        .unwrap();
}

/// Issue 33, item 6: every member of a pool fails (a render error). Before the fix each
/// reconcile deleted the failed member and created the next at once, and the error left
/// with the deleted Proxy. Now:
/// - after the first members fail, creates back off (2 s, then 4 s): successive members are
///   created at least the backoff apart, one on trial at a time;
/// - the pool says why: `Degraded` (`ProxiesFailing`) names the last member and its
///   error, and a Warning event per failed member carries it;
/// - once a member serves, the streak ends: `Degraded` clears, an event says so, and the
///   pool fills up at once;
/// - once the pool is gone, its metric series go too (item 13).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_whose_members_keep_failing_backs_off_and_says_why() {
    // The shared plane, with no other pool controller on it: each test that runs one
    // (they watch every namespace) has a plane of its own.
    let cp = ControlPlane::shared().unwrap();
    let (admin, operator, ns, _ns) = setup(cp, "pool-fail").await;
    create_pool(
        &admin,
        &ns,
        serde_json::json!({"replicas": 2, "template": {"provider": "kvm2", "image": "debian-12"}}),
    )
    .await;
    let controller = PoolController::start(&operator);
    let proxies = Api::<Proxy>::namespaced(admin.clone(), &ns);
    let members = ListParams::default().labels(&format!("{POOL_LABEL}=office"));

    // The stand-in fails every member it sees without a status, until 6 have failed.
    let mut failed: BTreeSet<String> = BTreeSet::new();
    let mut created: Vec<(jiff::Timestamp, String)> = Vec::new();
    let deadline = Instant::now() + GUARD;
    while failed.len() < 6 {
        assert!(
            Instant::now() < deadline,
            "6 failures not seen (hang guard)"
        );
        for p in proxies.list(&members).await.unwrap().items {
            let name = p.name_any();
            if !created.iter().any(|(_, n)| *n == name) {
                created.push((p.creation_timestamp().unwrap().0, name.clone()));
            }
            if p.status.is_none() && failed.insert(name.clone()) {
                fail(&admin, &ns, &name).await;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    created.sort();
    println!("created: {created:?}");
    // The first two are created together; after that one at a time, each at least the
    // backoff (4 s by then) after the one before it. Creation times are whole seconds,
    // hence the second of slack.
    for pair in created[1..].windows(2) {
        let gap = pair[1].0.duration_since(pair[0].0);
        assert!(
            gap >= jiff::SignedDuration::from_secs(3),
            "{} created {gap:?} after {}: {created:?}",
            pair[1].1,
            pair[0].1
        );
    }
    assert!(
        created.len() <= failed.len() + 1,
        "at most one member on trial beyond the failed ones: {created:?}"
    );

    // The pool says why, with the error the deleted Proxies carried.
    let cond = poll("Degraded: ProxiesFailing", || async {
        let p = Api::<ProxyPool>::namespaced(admin.clone(), &ns)
            .get("office")
            .await
            .ok()?;
        degraded(&p).filter(|c| c.status == "True" && c.reason == "ProxiesFailing")
    })
    .await;
    println!("Degraded: {}", cond.message);
    assert!(cond.message.contains(RENDER_ERROR), "{}", cond.message);
    assert!(cond.message.contains("RenderFailed"), "{}", cond.message);
    // The recorder folds events of one reason into a series: counted by its count.
    let events = poll("a ProxyFailed event per failed member", || async {
        let e = pool_events(&admin, &ns, "ProxyFailed").await;
        (written(&e) >= 6).then_some(e)
    })
    .await;
    for e in &events {
        assert_eq!(e.type_.as_deref(), Some("Warning"));
        let note = e.note.as_deref().unwrap_or_default();
        assert!(note.contains(RENDER_ERROR), "{note}");
    }
    poll("the 6 failures counted", || async {
        (controller.metrics.actions(&ns, "office", "failed") >= 6).then_some(())
    })
    .await;

    // The template is fixed (the stand-in now makes members serve): the next member on
    // trial serves, the streak ends and the pool fills up.
    let serving = poll("two serving members", || {
        let (admin, ns, proxies, members) =
            (admin.clone(), ns.clone(), proxies.clone(), members.clone());
        let failed = failed.clone();
        async move {
            let mut up = 0;
            for p in proxies.list(&members).await.ok()?.items {
                let name = p.name_any();
                if failed.contains(&name) {
                    continue;
                }
                if p.status.is_none() {
                    // Written to status only: nothing is sent there.
                    serve(&admin, &ns, &name, "198.51.100.7").await;
                }
                up += 1;
            }
            (up == 2).then_some(up)
        }
    })
    .await;
    assert_eq!(serving, 2);
    poll("Degraded cleared", || async {
        let p = Api::<ProxyPool>::namespaced(admin.clone(), &ns)
            .get("office")
            .await
            .ok()?;
        degraded(&p).filter(|c| c.status == "False")
    })
    .await;
    poll("the ProxiesServing event", || async {
        (!pool_events(&admin, &ns, "ProxiesServing").await.is_empty()).then_some(())
    })
    .await;

    // The pool goes, and so do its series.
    assert!(
        controller
            .metrics
            .pools_with_series()
            .contains(&(ns.clone(), "office".to_string()))
    );
    Api::<ProxyPool>::namespaced(admin.clone(), &ns)
        .delete("office", &Default::default())
        .await
        .unwrap();
    poll("the pool's series removed", || async {
        (!controller
            .metrics
            .pools_with_series()
            .contains(&(ns.clone(), "office".to_string())))
        .then_some(())
    })
    .await;
    assert_eq!(controller.metrics.actions(&ns, "office", "created"), 0);
    controller.stop().await;
}

/// Issue 33, item 13: a pool with no usable host. Before the fix every reconcile published
/// `InsufficientHosts` again (the event's series count grew by one per look, every 5 s)
/// after a cluster-wide list of Proxies. Now the condition holds it, and the event is
/// written once per shortage, however often the pool is looked at.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_without_a_host_says_so_once() {
    let cp = ControlPlane::start().unwrap();
    let (admin, operator, ns, _ns) = setup(&cp, "pool-nohost").await;
    // h9 is not a configured host: the pool has nowhere to put a member.
    create_pool(
        &admin,
        &ns,
        serde_json::json!({"replicas": 2, "hosts": ["h9"],
                           "template": {"provider": "kvm2", "image": "debian-12"}}),
    )
    .await;
    let controller = PoolController::start(&operator);
    let pools = Api::<ProxyPool>::namespaced(admin.clone(), &ns);
    let generation = |p: &ProxyPool| p.status.as_ref().and_then(|s| s.observed_generation);
    poll("Degraded: InsufficientHosts", || async {
        let p = pools.get("office").await.ok()?;
        degraded(&p).filter(|c| c.status == "True" && c.reason == "InsufficientHosts")
    })
    .await;
    // Five more looks, each a spec change the status must acknowledge.
    for surge in [2, 3, 2, 3, 2] {
        let p = pools
            .patch(
                "office",
                &PatchParams::default(),
                &Patch::Merge(serde_json::json!({"spec": {"maxSurge": surge}})),
            )
            .await
            .unwrap();
        let want = p.metadata.generation;
        poll("the change seen", || async {
            let p = pools.get("office").await.ok()?;
            (generation(&p) == want).then_some(())
        })
        .await;
    }
    let events = pool_events(&admin, &ns, "InsufficientHosts").await;
    println!("InsufficientHosts events: {events:#?}");
    assert_eq!(
        written(&events),
        1,
        "one event per shortage, not one per look"
    );
    let p = pools.get("office").await.unwrap();
    assert_eq!(
        degraded(&p).map(|c| c.reason),
        Some("InsufficientHosts".to_string())
    );
    controller.stop().await;
}

/// Issue 33, items 10 and 12, on a control plane of its own (CRDs are cluster-wide): the
/// installed ProxyPool CRD is skewed against this binary both ways. Its spec has a field
/// this binary does not know (a newer CRD), and its status lacks `hosts`, which this
/// binary writes (an older CRD).
/// - A pool that uses the new field cannot be decoded (pool specs refuse unknown fields:
///   the pool must not make Proxies from a template it only half reads). It is reported
///   (`/readyz` lines, `egress_controller_watch_errors{kind="decode"}`) and left out;
///   the other pool is reconciled. Before the fix the typed watch failed on the whole
///   list, so no pool was reconciled at all, and the error was logged at debug.
/// - The other pool's status is written without `hosts`, with a `StatusFieldsDropped`
///   Warning event and a count. Before the fix every status write was refused (422) and
///   the pool kept no status.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_skewed_crd_leaves_one_pool_out_and_drops_unknown_status_fields_visibly() {
    use kube::CustomResourceExt;
    let cp = ControlPlane::start().unwrap();
    cp.install_crds().await.unwrap();
    cp.install_rbac().unwrap();
    // The CRD is cluster-wide: on a cluster of KUBECONFIG, it is put back at the end.
    let mut crd = serde_json::to_value(ProxyPool::crd()).unwrap();
    let schema = &mut crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"];
    schema["spec"]["properties"]["dnsServers"] =
        serde_json::json!({"type": "array", "items": {"type": "string"}});
    let status = schema["status"]["properties"].as_object_mut().unwrap();
    assert!(
        status.remove("hosts").is_some(),
        "the binary writes status.hosts"
    );
    let file = cp.dir().unwrap().join("skewed-proxypools.json");
    std::fs::write(&file, crd.to_string()).unwrap();
    cp.kubectl_run(&[
        "apply",
        "--server-side",
        "--force-conflicts",
        "--field-manager=egress-operator-tests",
        "-f",
        &file.to_string_lossy(),
    ])
    .unwrap();
    let admin = cp.client().await.unwrap();
    let operator = cp
        .client_for(&cp.operator_kubeconfig().unwrap())
        .await
        .unwrap();
    let ns_handle = cp.namespace("pool-skew").await.unwrap();
    let ns = ns_handle.name().to_string();
    let raw: Api<kube::api::DynamicObject> = Api::namespaced_with(
        admin.clone(),
        &ns,
        &kube::api::ApiResource::erase::<ProxyPool>(&()),
    );
    // The skewed schema is served once a pool with the new field keeps it.
    let newer: kube::api::DynamicObject = serde_json::from_value(serde_json::json!({
        "apiVersion": "egress-operator.dev/v1alpha1", "kind": "ProxyPool",
        "metadata": {"name": "newer"},
        "spec": {"replicas": 1, "dnsServers": ["192.0.2.53"],
                 "template": {"provider": "kvm2", "image": "debian-12"}},
    }))
    .unwrap();
    poll("the skewed CRD served", || async {
        match raw.get_opt("newer").await.ok()? {
            Some(o) if o.data["spec"].get("dnsServers").is_some() => Some(()),
            Some(_) => {
                let _ = raw.delete("newer", &Default::default()).await;
                None
            }
            None => {
                let _ = raw.create(&PostParams::default(), &newer).await;
                None
            }
        }
    })
    .await;
    create_pool(
        &admin,
        &ns,
        serde_json::json!({"replicas": 1, "template": {"provider": "kvm2", "image": "debian-12"}}),
    )
    .await;

    let controller = PoolController::start(&operator);
    // The plain pool is reconciled: its member is made, its status written.
    let proxies = Api::<Proxy>::namespaced(admin.clone(), &ns);
    poll("the plain pool's member", || async {
        let l = proxies
            .list(&ListParams::default().labels(&format!("{POOL_LABEL}=office")))
            .await
            .ok()?;
        (l.items.len() == 1).then_some(())
    })
    .await;
    let pools = Api::<ProxyPool>::namespaced(admin.clone(), &ns);
    let status = poll("the plain pool's status", || async {
        let p = pools.get("office").await.ok()?;
        p.status.filter(|s| s.observed_generation.is_some())
    })
    .await;
    assert_eq!(status.replicas, 1, "{status:?}");
    assert!(status.hosts.is_empty(), "the CRD dropped hosts: {status:?}");
    let events = poll("the StatusFieldsDropped event", || async {
        let e = pool_events(&admin, &ns, "StatusFieldsDropped").await;
        (!e.is_empty()).then_some(e)
    })
    .await;
    let note = events[0].note.clone().unwrap_or_default();
    println!("StatusFieldsDropped: {note}");
    assert!(note.contains("hosts"), "{note}");
    assert!(controller.metrics.skew.dropped_of("ProxyPool") >= 1);
    // Told once, written once: the stored status lacks `hosts`, so every look finds it
    // different, but the same fallback write is not made again on the object it left.
    // Before, each look wrote twice (refused, then merged) and sent another event.
    let status_writes = || {
        cp.operator_requests(|r| {
            r.resource == "proxypools/status"
                && r.namespace.as_deref() == Some(ns.as_str())
                && r.name.as_deref() == Some("office")
        })
        .unwrap()
    };
    let (writes, dropped) = (
        status_writes(),
        controller.metrics.skew.dropped_of("ProxyPool"),
    );
    for i in 0..3 {
        pools
            .patch(
                "office",
                &PatchParams::default(),
                &Patch::Merge(
                    serde_json::json!({"metadata": {"annotations": {"touched": i.to_string()}}}),
                ),
            )
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    println!(
        "three looks at the settled pool: {} status writes, {} more dropped",
        status_writes() - writes,
        controller.metrics.skew.dropped_of("ProxyPool") - dropped
    );
    assert_eq!(status_writes(), writes, "the same status written again");
    assert_eq!(controller.metrics.skew.dropped_of("ProxyPool"), dropped);

    // The newer pool is reported, not reconciled.
    let lines = poll("the newer pool reported", || async {
        controller.metrics.watch.degraded().filter(|l| {
            l.iter()
                .any(|l| l.starts_with(&format!("proxypool {ns}/newer cannot be decoded")))
        })
    })
    .await;
    println!("readyz lines: {lines:?}");
    assert!(controller.metrics.watch.errors_of("decode", "proxypool") >= 1);
    let made = proxies
        .list(&ListParams::default().labels(&format!("{POOL_LABEL}=newer")))
        .await
        .unwrap();
    assert!(
        made.items.is_empty(),
        "nothing made for the undecodable pool"
    );
    // Deleted, it is no longer reported.
    raw.delete("newer", &Default::default()).await.unwrap();
    poll("the newer pool no longer reported", || async {
        let lines = controller.metrics.watch.degraded().unwrap_or_default();
        (!lines.iter().any(|l| l.contains("/newer"))).then_some(())
    })
    .await;
    controller.stop().await;
    cp.reinstall_crds().await.unwrap();
}

/// Issue 33, item 13: a pool whose members beyond `replicas` are all leased has nothing to
/// do (the leases give them back), so it is not `Progressing`. Before the fix it counted
/// every member of the current template against `replicas`, stayed `Progressing=True`
/// (`RollingOut`) for as long as the leases held, and was looked at every 5 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leased_members_beyond_replicas_are_not_a_rollout() {
    let cp = ControlPlane::start().unwrap();
    let (admin, operator, ns, _ns) = setup(&cp, "pool-leased").await;
    let pool = create_pool(
        &admin,
        &ns,
        serde_json::json!({"replicas": 1, "template": {"provider": "kvm2", "image": "debian-12"}}),
    )
    .await;
    // Two members, both leased and serving, made as the pool controller makes them.
    let proxies = Api::<Proxy>::namespaced(admin.clone(), &ns);
    for name in ["office-a", "office-b"] {
        let mut p = Proxy::new(name, pool.spec.template.proxy_spec(Some("h1".into())));
        p.metadata.labels = Some(std::collections::BTreeMap::from([
            (POOL_LABEL.to_string(), "office".to_string()),
            (TEMPLATE_HASH_LABEL.to_string(), pool.spec.template.hash()),
            (LEASE_LABEL.to_string(), format!("lease-of-{name}")),
        ]));
        p.metadata.owner_references = Some(vec![pool.controller_owner_ref(&()).unwrap()]);
        proxies.create(&PostParams::default(), &p).await.unwrap();
        serve(&admin, &ns, name, "198.51.100.7").await;
    }
    let controller = PoolController::start(&operator);
    let pools = Api::<ProxyPool>::namespaced(admin.clone(), &ns);
    let progressing = poll("the pool's status", || async {
        let p = pools.get("office").await.ok()?;
        p.status?
            .conditions
            .into_iter()
            .find(|c| c.type_ == "Progressing")
    })
    .await;
    println!("Progressing: {progressing:?}");
    assert_eq!(progressing.status, "False", "{progressing:?}");
    assert_eq!(progressing.reason, "Settled");
    // Nothing was drained, deleted or created.
    let listed = proxies.list(&ListParams::default()).await.unwrap().items;
    assert!(
        listed
            .iter()
            .all(|p| !p.annotations().contains_key(DRAINING_ANNOTATION)),
        "{listed:?}"
    );
    let names: BTreeSet<String> = listed.iter().map(|p| p.name_any()).collect();
    assert_eq!(
        names,
        BTreeSet::from(["office-a".into(), "office-b".into()])
    );
    assert_eq!(controller.metrics.actions(&ns, "office", "created"), 0);
    controller.stop().await;
}
