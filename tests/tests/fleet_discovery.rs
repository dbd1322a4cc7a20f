#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! Discovery and pool membership on the real control plane: what a pool's Service lists
//! (issue 33, items 1, 2, 5, 8 and 13; issue 35, item 1).
//!
//! Discovery (and, where a test needs it, the fast probe) runs in-process as the operator's
//! ServiceAccount with the shipped `config/rbac`. No pool controller and no Proxy
//! controller run: each test writes the pool's members and their status itself, as those
//! controllers would (an address, `Ready`), so it decides exactly what discovery sees. The
//! fast probe, where it runs, dials an in-memory stand-in: no packet leaves the process.

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use egress_operator::api::proxy::Proxy;
use egress_operator::api::proxy_pool::{
    DRAINING_ANNOTATION, LEASE_LABEL, POOL_LABEL, PoolEndpoint, ProxyPool, TEMPLATE_HASH_LABEL,
};
use egress_operator::config::ValidConfig;
use egress_operator::fleet::liveness::{Liveness, LivenessOptions};
use egress_operator::fleet::pool::FleetContext;
use egress_operator::fleet::{FleetMetrics, LivenessBoard};
use egress_operator::serving::Dialer;
use integration_tests::harness::{ControlPlane, TestNamespace};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{ListParams, ObjectMeta, Patch, PatchParams, PostParams};
use kube::{Api, Client, Resource, ResourceExt};
use tokio::time::Instant;

/// Hang guard of every wait: generous, never a performance assertion.
const GUARD: Duration = Duration::from_secs(180);

/// Polls `probe` every 200 ms until it yields a value, under the hang guard.
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

/// The shared plane with the CRDs and the shipped RBAC, an admin client, a client acting
/// as the operator's ServiceAccount, and a fresh namespace.
async fn plane(prefix: &str) -> (&'static ControlPlane, Client, Client, TestNamespace) {
    let cp = ControlPlane::shared().unwrap();
    cp.install_crds().await.unwrap();
    cp.install_rbac().unwrap();
    let admin = cp.client().await.unwrap();
    let operator = cp
        .client_for(&cp.operator_kubeconfig().unwrap())
        .await
        .unwrap();
    let ns = cp.namespace(prefix).await.unwrap();
    (cp, admin, operator, ns)
}

/// The fleet's discovery (and, given a dialer, the fast probe) running as `client`.
struct Discovery {
    stop: tokio::sync::watch::Sender<bool>,
    tasks: tokio::task::JoinSet<()>,
    /// Held while the tasks run: a dropped sender reads as "not leading".
    _leading: tokio::sync::watch::Sender<bool>,
}

impl Discovery {
    /// `probe`: the fast probe's dialer and the bound of its all-fail hold.
    fn start(client: &Client, probe: Option<(Arc<dyn Dialer>, Duration)>) -> Self {
        let config: Arc<ValidConfig> = Arc::new(
            egress_operator::config::parse(
                &integration_tests::fleet_config::fleet_config(2),
                "fleet.yaml",
                std::path::Path::new("/"),
            )
            .unwrap(),
        );
        let (stop, stop_rx) = tokio::sync::watch::channel(false);
        let stopped = move || {
            let mut rx = stop_rx.clone();
            async move {
                let _ = rx.wait_for(|s| *s).await;
            }
        };
        let metrics = FleetMetrics::default();
        let board = Arc::new(match &probe {
            Some((_, max_hold)) => LivenessBoard::with_max_hold(*max_hold),
            None => LivenessBoard::default(),
        });
        let (leading_tx, leading) = tokio::sync::watch::channel(true);
        let fleet = Arc::new(FleetContext::new(
            client.clone(),
            config,
            board.clone(),
            metrics.clone(),
            leading,
            None,
        ));
        let mut tasks = tokio::task::JoinSet::new();
        if let Some((dialer, _)) = probe {
            let liveness =
                Liveness::new(board, LivenessOptions::default(), metrics).with_dialer(dialer);
            tasks.spawn(liveness.run(client.clone(), stopped()));
        }
        tasks.spawn(egress_operator::fleet::discovery::run(fleet, stopped()));
        Self {
            stop,
            tasks,
            _leading: leading_tx,
        }
    }

    async fn stop(mut self) {
        let _ = self.stop.send(true);
        while self.tasks.join_next().await.is_some() {}
    }
}

/// A pool of `template_image`'s proxies, created as an admin would.
async fn create_pool(admin: &Client, ns: &str, name: &str) -> ProxyPool {
    let pool: ProxyPool = serde_json::from_value(serde_json::json!({
        "apiVersion": "egress-operator.dev/v1alpha1",
        "kind": "ProxyPool",
        "metadata": {"name": name},
        "spec": {"replicas": 3, "template": {"provider": "kvm2", "image": "debian-12"}},
    }))
    .unwrap();
    Api::<ProxyPool>::namespaced(admin.clone(), ns)
        .create(&PostParams::default(), &pool)
        .await
        .unwrap()
}

/// A member of `pool` on `host` exactly as the pool controller makes it: owned by the
/// pool, its labels, the template's spec.
fn member_of(pool: &ProxyPool, name: &str, host: &str) -> Proxy {
    let pool_name = pool.name_any();
    Proxy {
        metadata: ObjectMeta {
            name: Some(name.into()),
            labels: Some(BTreeMap::from([
                (POOL_LABEL.to_string(), pool_name),
                (TEMPLATE_HASH_LABEL.to_string(), pool.spec.template.hash()),
            ])),
            owner_references: Some(vec![pool.controller_owner_ref(&()).unwrap()]),
            ..Default::default()
        },
        spec: pool.spec.template.proxy_spec(Some(host.into())),
        status: None,
    }
}

/// Creates `proxy` as `client`, then gives it the status the Proxy controller writes for
/// a running instance at `ip` (`Ready` as `ready` says).
async fn create_running(client: &Client, ns: &str, proxy: &Proxy, ip: &str, ready: bool) {
    let api = Api::<Proxy>::namespaced(client.clone(), ns);
    api.create(&PostParams::default(), proxy).await.unwrap();
    set_ready(client, ns, &proxy.name_any(), ip, ready).await;
}

/// Writes a running instance's status at `ip`, `Ready` and `Serving` as `ready` says.
async fn set_ready(client: &Client, ns: &str, name: &str, ip: &str, ready: bool) {
    let now = jiff::Timestamp::now().to_string();
    let (status, reason) = if ready {
        ("True", "Serving")
    } else {
        ("False", "ProbeFailed")
    };
    let cond = |type_: &str| {
        serde_json::json!({"type": type_, "status": status, "reason": reason, "message": "",
                           "lastTransitionTime": now})
    };
    let body = serde_json::json!({"status": {
        "phase": "Running", "address": ip, "host": "h1",
        "conditions": [cond("Ready"), cond("Serving")],
    }});
    Api::<Proxy>::namespaced(client.clone(), ns)
        .patch_status(name, &PatchParams::default(), &Patch::Merge(&body))
        .await
        .unwrap();
}

/// One endpoint of a pool's slices: (ready, serving, terminating).
type Conditions = (bool, bool, bool);

/// What all of `pool`'s slices list, by address (None: no slice yet).
async fn slice_endpoints(
    client: &Client,
    ns: &str,
    pool: &str,
) -> Option<BTreeMap<String, Conditions>> {
    let slices = Api::<EndpointSlice>::namespaced(client.clone(), ns)
        .list(&ListParams::default().labels(&format!("kubernetes.io/service-name={pool}")))
        .await
        .ok()?;
    if slices.items.is_empty() {
        return None;
    }
    let mut out = BTreeMap::new();
    for s in slices.items {
        for e in s.endpoints {
            let c = e.conditions.unwrap_or_default();
            let flags = (
                c.ready.unwrap_or(false),
                c.serving.unwrap_or(false),
                c.terminating.unwrap_or(false),
            );
            for a in e.addresses {
                out.insert(a, flags);
            }
        }
    }
    Some(out)
}

/// The pool's `status.endpoints`, by proxy name.
async fn status_endpoints(client: &Client, ns: &str, pool: &str) -> BTreeSet<String> {
    Api::<ProxyPool>::namespaced(client.clone(), ns)
        .get(pool)
        .await
        .unwrap()
        .status
        .map(|s| s.endpoints)
        .unwrap_or_default()
        .into_iter()
        .map(|e: PoolEndpoint| e.proxy)
        .collect()
}

/// Waits until the slices list exactly `want` (address to conditions), and returns.
async fn wait_for_slices(
    client: &Client,
    ns: &str,
    pool: &str,
    what: &str,
    want: &BTreeMap<String, Conditions>,
) {
    poll(what, || async {
        (slice_endpoints(client, ns, pool).await? == *want).then_some(())
    })
    .await;
}

fn ready(addrs: &[&str]) -> BTreeMap<String, Conditions> {
    addrs
        .iter()
        .map(|a| (a.to_string(), (true, true, false)))
        .collect()
}

/// Issue 33 item 1: a leased proxy serves its lease alone. Before the fix the pool's
/// slices and `status.endpoints` listed it like any other serving member, so anyone using
/// the pool's Service left through the leased proxy's address.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leased_proxy_is_not_in_the_pools_slices_or_status() {
    let (_cp, admin, operator, ns) = plane("disc-leased").await;
    let ns = ns.name().to_string();
    let pool = create_pool(&admin, &ns, "office").await;
    let discovery = Discovery::start(&operator, None);

    // The leased member first, so the reconcile that lists the free one saw it whole.
    let mut leased = member_of(&pool, "office-leased", "h1");
    leased
        .labels_mut()
        .insert(LEASE_LABEL.into(), "uid-of-some-lease".into());
    create_running(&operator, &ns, &leased, "198.51.100.2", true).await;
    create_running(
        &operator,
        &ns,
        &member_of(&pool, "office-free", "h2"),
        "198.51.100.1",
        true,
    )
    .await;
    wait_for_slices(
        &admin,
        &ns,
        "office",
        "the free member alone in the slices",
        &ready(&["198.51.100.1"]),
    )
    .await;
    let listed = poll("the free member in status.endpoints", || async {
        let e = status_endpoints(&admin, &ns, "office").await;
        e.contains("office-free").then_some(e)
    })
    .await;
    assert_eq!(listed, BTreeSet::from(["office-free".to_string()]));

    // Given back to the pool (the label cleared, as `Reuse` does), it is listed again:
    // only the lease kept it out.
    Api::<Proxy>::namespaced(operator.clone(), &ns)
        .patch(
            "office-leased",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"metadata": {"labels": {LEASE_LABEL: null}}})),
        )
        .await
        .unwrap();
    wait_for_slices(
        &admin,
        &ns,
        "office",
        "the released member back in the slices",
        &ready(&["198.51.100.1", "198.51.100.2"]),
    )
    .await;
    discovery.stop().await;
}

/// Issue 33 item 13: a draining member that still answers is listed `serving=true,
/// ready=false, terminating=true` (before: `serving` copied `ready`, which took away
/// kube-proxy's serving-but-terminating fallback), and a hand-made Proxy that only
/// carries the pool's label is never listed (before: discovery selected by label alone).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_member_stays_serving_and_a_copied_label_makes_no_member() {
    let (_cp, admin, operator, ns) = plane("disc-serving").await;
    let ns = ns.name().to_string();
    let pool = create_pool(&admin, &ns, "office").await;
    let discovery = Discovery::start(&operator, None);

    let mut handmade = member_of(&pool, "office-handmade", "h1");
    handmade.metadata.owner_references = None;
    create_running(&admin, &ns, &handmade, "198.51.100.3", true).await;
    let mut draining = member_of(&pool, "office-draining", "h1");
    draining.annotations_mut().insert(
        DRAINING_ANNOTATION.into(),
        jiff::Timestamp::now().to_string(),
    );
    create_running(&operator, &ns, &draining, "198.51.100.2", true).await;
    create_running(
        &operator,
        &ns,
        &member_of(&pool, "office-a", "h2"),
        "198.51.100.1",
        true,
    )
    .await;
    let mut want = ready(&["198.51.100.1"]);
    want.insert("198.51.100.2".into(), (false, true, true));
    wait_for_slices(
        &admin,
        &ns,
        "office",
        "the draining member serving and terminating, the hand-made one absent",
        &want,
    )
    .await;
    let listed = poll("status.endpoints", || async {
        let e = status_endpoints(&admin, &ns, "office").await;
        (e.len() == 2).then_some(e)
    })
    .await;
    assert_eq!(
        listed,
        BTreeSet::from(["office-a".to_string(), "office-draining".to_string()])
    );
    discovery.stop().await;
}

/// Issue 35 item 1, the operator's half: a Proxy owned by the pool (its UID) but with a
/// spec the template does not make (its own user-data: a VM of its maker's choosing) is
/// never listed; after a template change, a member that was listed stays listed, while a
/// Proxy that only claims the older template never gets in. Before the fix, the owner
/// reference (or, earlier still, the label) was all it took.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_a_member_the_template_made_is_listed() {
    let (_cp, admin, operator, ns) = plane("disc-made").await;
    let ns = ns.name().to_string();
    let before = create_pool(&admin, &ns, "office").await;
    let discovery = Discovery::start(&operator, None);

    let mut forged = member_of(&before, "office-forged", "h1");
    forged.spec.user_data = Some(
        serde_json::from_value(
            serde_json::json!({"secretRef": {"name": "mine", "key": "user-data"}}),
        )
        .unwrap(),
    );
    create_running(&admin, &ns, &forged, "198.51.100.3", true).await;
    create_running(
        &operator,
        &ns,
        &member_of(&before, "office-a", "h1"),
        "198.51.100.1",
        true,
    )
    .await;
    wait_for_slices(
        &admin,
        &ns,
        "office",
        "the template's member alone",
        &ready(&["198.51.100.1"]),
    )
    .await;

    // A template change: the listed member of the older template stays (a rollout
    // replaces it surge-first); one claiming the older template after the fact does not
    // get in; one of the new template does.
    let after = Api::<ProxyPool>::namespaced(admin.clone(), &ns)
        .patch(
            "office",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"spec": {"template": {"machineType": "tiny"}}})),
        )
        .await
        .unwrap();
    create_running(
        &admin,
        &ns,
        &member_of(&before, "office-late", "h2"),
        "198.51.100.4",
        true,
    )
    .await;
    create_running(
        &operator,
        &ns,
        &member_of(&after, "office-b", "h2"),
        "198.51.100.2",
        true,
    )
    .await;
    wait_for_slices(
        &admin,
        &ns,
        "office",
        "the listed older member and the new one",
        &ready(&["198.51.100.1", "198.51.100.2"]),
    )
    .await;
    discovery.stop().await;
}

/// The pool's `ServiceReady` condition as (status, reason).
async fn service_ready(client: &Client, ns: &str, pool: &str) -> Option<(String, String)> {
    let pool = Api::<ProxyPool>::namespaced(client.clone(), ns)
        .get(pool)
        .await
        .ok()?;
    let c = pool
        .status?
        .conditions
        .into_iter()
        .find(|c| c.type_ == "ServiceReady")?;
    Some((c.status, c.reason))
}

/// Issue 33 item 8: a Service of the pool's name that the pool does not own is left as it
/// is, and the pool says so (`ServiceReady=False`, reason `ServiceConflict`). Before the
/// fix discovery applied its Service over it with force: the user's Service gained the
/// pool's owner reference (deleted with the pool) and was rewritten.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_of_the_pools_name_that_is_not_the_pools_is_left_alone() {
    use k8s_openapi::api::core::v1::Service;
    let (_cp, admin, operator, ns) = plane("disc-conflict").await;
    let ns = ns.name().to_string();
    let services = Api::<Service>::namespaced(admin.clone(), &ns);
    let theirs: Service = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "office", "labels": {"team": "web"}},
        "spec": {"selector": {"app": "web"}, "ports": [{"name": "http", "port": 80}]},
    }))
    .unwrap();
    services
        .create(&PostParams::default(), &theirs)
        .await
        .unwrap();
    let pool = create_pool(&admin, &ns, "office").await;
    let discovery = Discovery::start(&operator, None);
    create_running(
        &operator,
        &ns,
        &member_of(&pool, "office-a", "h1"),
        "198.51.100.1",
        true,
    )
    .await;
    poll("ServiceReady=False (ServiceConflict)", || async {
        (service_ready(&admin, &ns, "office").await?
            == ("False".to_string(), "ServiceConflict".to_string()))
            .then_some(())
    })
    .await;
    // Let discovery reconcile again (a member's change) and look once more.
    set_ready(&operator, &ns, "office-a", "198.51.100.1", false).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let svc = services.get("office").await.unwrap();
    assert!(
        svc.metadata.owner_references.is_none(),
        "{:?}",
        svc.metadata
    );
    assert_eq!(
        svc.metadata.labels,
        Some(BTreeMap::from([("team".to_string(), "web".to_string())]))
    );
    let spec = svc.spec.unwrap();
    assert_eq!(spec.ports.unwrap()[0].port, 80);
    assert!(spec.selector.is_some());
    assert!(
        slice_endpoints(&admin, &ns, "office")
            .await
            .is_none_or(|e| e.is_empty()),
        "the pool's slices feed another's Service"
    );

    // Their Service gone (discovery does not watch it: a member's change wakes it), the
    // pool's is made, and the member listed.
    services
        .delete("office", &Default::default())
        .await
        .unwrap();
    set_ready(&operator, &ns, "office-a", "198.51.100.1", true).await;
    poll("ServiceReady=True", || async {
        (service_ready(&admin, &ns, "office").await?.0 == "True").then_some(())
    })
    .await;
    wait_for_slices(
        &admin,
        &ns,
        "office",
        "the member in the pool's slices",
        &ready(&["198.51.100.1"]),
    )
    .await;
    let svc = services.get("office").await.unwrap();
    assert_eq!(
        svc.owner_references()[0].uid,
        pool.metadata.uid.clone().unwrap()
    );
    discovery.stop().await;
}

/// Whether `r` was refused by the fleet membership admission policy.
fn refused_by_policy<T: std::fmt::Debug>(r: &Result<T, kube::Error>) -> bool {
    match r {
        Err(kube::Error::Api(e)) => e.message.contains("only the egress-operator may"),
        _ => false,
    }
}

/// Issue 35 item 1, the admission half, on a control plane of its own (the policy is
/// cluster-wide): with `config/admission` applied, a user who holds only `create` and
/// `patch` on Proxies cannot make a Proxy a pool member, bind it to a lease, mark it
/// draining, or give it a pool's owner reference, neither at create nor by a patch, while
/// the operator's ServiceAccount can. Before the fix there was no policy to apply.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_operator_may_write_fleet_membership_on_proxies() {
    use k8s_openapi::api::admissionregistration::v1::ValidatingAdmissionPolicy;
    let cp = ControlPlane::start().unwrap();
    cp.install_crds().await.unwrap();
    cp.install_rbac().unwrap();
    let policy = integration_tests::workspace_root().join("config/admission");
    cp.kubectl_run(&["apply", "-k", &policy.to_string_lossy()])
        .unwrap();
    let admin = cp.client().await.unwrap();
    let operator = cp
        .client_for(&cp.operator_kubeconfig().unwrap())
        .await
        .unwrap();
    let ns_handle = cp.namespace("disc-admission").await.unwrap();
    let ns = ns_handle.name().to_string();

    // A tenant with create and patch on Proxies, nothing more.
    let grant = serde_json::json!({
    "apiVersion": "v1", "kind": "List", "items": [
        {"apiVersion": "v1", "kind": "ServiceAccount",
         "metadata": {"name": "tenant", "namespace": ns}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
         "metadata": {"name": "tenant", "namespace": ns},
         "rules": [{"apiGroups": ["egress-operator.dev"], "resources": ["proxies"],
                    "verbs": ["create", "patch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": {"name": "tenant", "namespace": ns},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "tenant"},
         "subjects": [{"kind": "ServiceAccount", "name": "tenant", "namespace": ns}]},
    ]});
    let file = cp.dir().unwrap().join(format!("tenant-{ns}.json"));
    std::fs::write(&file, grant.to_string()).unwrap();
    cp.kubectl_run(&["apply", "-f", &file.to_string_lossy()])
        .unwrap();
    let tenant = cp
        .client_for(&cp.service_account_kubeconfig(&ns, "tenant").unwrap())
        .await
        .unwrap();
    let as_tenant = Api::<Proxy>::namespaced(tenant.clone(), &ns);
    let as_operator = Api::<Proxy>::namespaced(operator.clone(), &ns);
    let pool = create_pool(&admin, &ns, "office").await;

    // The policy takes effect once the API server has loaded it: until the forged member
    // is refused, a try that got through is deleted and tried again.
    let forged = member_of(&pool, "office-forged", "h1");
    poll("the policy refuses a forged pool member", || async {
        let r = as_tenant.create(&PostParams::default(), &forged).await;
        if r.is_ok() {
            let _ = Api::<Proxy>::namespaced(admin.clone(), &ns)
                .delete("office-forged", &Default::default())
                .await;
        }
        refused_by_policy(&r).then_some(())
    })
    .await;

    // The CEL type-checks against the Proxy schema without warnings (where the API server
    // reports its type check).
    let vap = Api::<ValidatingAdmissionPolicy>::all(admin.clone())
        .get("egress-operator-fleet-membership")
        .await
        .unwrap();
    let checked = vap.status.and_then(|s| s.type_checking);
    println!("type checking: {checked:?}");
    let warnings = checked.and_then(|t| t.expression_warnings);
    assert!(warnings.as_ref().is_none_or(Vec::is_empty), "{warnings:#?}");

    // Each piece alone is refused at create.
    let plain = |name: &str| Proxy::new(name, pool.spec.template.proxy_spec(Some("h1".into())));
    let with_label = |name: &str, k: &str, v: &str| {
        let mut p = plain(name);
        p.labels_mut().insert(k.into(), v.into());
        p
    };
    let mut owned = plain("t-owned");
    owned.metadata.owner_references = Some(vec![pool.controller_owner_ref(&()).unwrap()]);
    let mut draining = plain("t-draining");
    draining
        .annotations_mut()
        .insert(DRAINING_ANNOTATION.into(), "2020-01-01T00:00:00Z".into());
    for p in [
        with_label("t-pool", POOL_LABEL, "office"),
        with_label("t-lease", LEASE_LABEL, "some-lease-uid"),
        with_label("t-hash", TEMPLATE_HASH_LABEL, &pool.spec.template.hash()),
        owned,
        draining,
    ] {
        let r = as_tenant.create(&PostParams::default(), &p).await;
        assert!(refused_by_policy(&r), "{}: {r:?}", p.name_any());
    }

    // A plain Proxy is the tenant's to make and label; the fleet's keys are not.
    as_tenant
        .create(&PostParams::default(), &plain("t-plain"))
        .await
        .unwrap();
    let patch = |body: serde_json::Value| {
        let api = as_tenant.clone();
        async move {
            api.patch("t-plain", &PatchParams::default(), &Patch::Merge(body))
                .await
        }
    };
    patch(serde_json::json!({"metadata": {"labels": {"team": "a"}}}))
        .await
        .unwrap();
    for body in [
        serde_json::json!({"metadata": {"labels": {POOL_LABEL: "office"}}}),
        serde_json::json!({"metadata": {"labels": {LEASE_LABEL: "x"}}}),
        serde_json::json!({"metadata": {"labels": {TEMPLATE_HASH_LABEL: "x"}}}),
        serde_json::json!({"metadata": {"annotations": {DRAINING_ANNOTATION: "2020-01-01T00:00:00Z"}}}),
        serde_json::json!({"metadata": {"ownerReferences": [pool.controller_owner_ref(&()).unwrap()]}}),
    ] {
        let r = patch(body.clone()).await;
        assert!(refused_by_policy(&r), "{body}: {r:?}");
    }

    // The operator makes a member; the tenant can neither relabel, unlabel, drain nor
    // disown it, but may add labels of its own.
    as_operator
        .create(&PostParams::default(), &member_of(&pool, "office-a", "h1"))
        .await
        .unwrap();
    let patch_member = |body: serde_json::Value| {
        let api = as_tenant.clone();
        async move {
            api.patch("office-a", &PatchParams::default(), &Patch::Merge(body))
                .await
        }
    };
    for body in [
        serde_json::json!({"metadata": {"labels": {POOL_LABEL: null}}}),
        serde_json::json!({"metadata": {"labels": {POOL_LABEL: "other"}}}),
        serde_json::json!({"metadata": {"labels": {LEASE_LABEL: "my-lease"}}}),
        serde_json::json!({"metadata": {"annotations": {DRAINING_ANNOTATION: "2999-01-01T00:00:00Z"}}}),
        serde_json::json!({"metadata": {"ownerReferences": null}}),
    ] {
        let r = patch_member(body.clone()).await;
        assert!(refused_by_policy(&r), "{body}: {r:?}");
    }
    patch_member(serde_json::json!({"metadata": {"labels": {"team": "a"}}}))
        .await
        .unwrap();
    // The operator's own writes pass.
    as_operator
        .patch(
            "office-a",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"metadata": {
                "labels": {LEASE_LABEL: "uid-of-a-lease"},
                "annotations": {DRAINING_ANNOTATION: "2020-01-01T00:00:00Z"}}})),
        )
        .await
        .unwrap();
    drop(ns_handle);
}

/// The fast probe's stand-in: no proxy can be reached (every dial fails on the path, as
/// from a node with no route to the bridges).
struct Unreachable;

impl Dialer for Unreachable {
    fn dial(
        &self,
        _addr: std::net::SocketAddr,
    ) -> egress_operator::serving::BoxFuture<
        '_,
        std::io::Result<Box<dyn egress_operator::serving::ProbeStream>>,
    > {
        Box::pin(async { Err(std::io::ErrorKind::HostUnreachable.into()) })
    }
}

/// The pool's `EndpointsHeld` status.
async fn endpoints_held(client: &Client, ns: &str, pool: &str) -> Option<String> {
    let pool = Api::<ProxyPool>::namespaced(client.clone(), ns)
        .get(pool)
        .await
        .ok()?;
    pool.status?
        .conditions
        .into_iter()
        .find(|c| c.type_ == "EndpointsHeld")
        .map(|c| c.status)
}

/// Issue 33 item 2: a new leader whose fast probe reaches no proxy (a node with no route
/// to the bridges) keeps the slices as the last term left them, `EndpointsHeld=True`,
/// instead of emptying them; and the hold is bounded: after it, the probe is believed.
/// Before the fix the new term's empty board believed its first all-fail round (the
/// slices emptied), and a hold, once begun, never ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_term_that_reaches_no_proxy_holds_the_slices_for_a_bounded_time() {
    let (_cp, admin, operator, ns) = plane("disc-term").await;
    let ns = ns.name().to_string();
    let pool = create_pool(&admin, &ns, "office").await;
    let addrs = ["198.51.100.1", "198.51.100.2", "198.51.100.3"];
    for (i, ip) in addrs.iter().enumerate() {
        let m = member_of(&pool, &format!("office-{i}"), "h1");
        create_running(&operator, &ns, &m, ip, true).await;
    }
    // The last term listed the three.
    let last_term = Discovery::start(&operator, None);
    wait_for_slices(&admin, &ns, "office", "the three listed", &ready(&addrs)).await;
    last_term.stop().await;

    // A new term that reaches none of them: held, the slices as they were.
    let term = Discovery::start(
        &operator,
        Some((Arc::new(Unreachable), Duration::from_secs(3600))),
    );
    poll("EndpointsHeld=True", || async {
        (endpoints_held(&admin, &ns, "office").await? == "True").then_some(())
    })
    .await;
    // A few probe rounds later (1 s each), still as they were.
    for _ in 0..10 {
        assert_eq!(
            slice_endpoints(&admin, &ns, "office").await.unwrap(),
            ready(&addrs),
            "the slices changed under the hold"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    term.stop().await;

    // A term whose hold is bounded at 3 s: then the probe is believed.
    let term = Discovery::start(
        &operator,
        Some((Arc::new(Unreachable), Duration::from_secs(3))),
    );
    wait_for_slices(
        &admin,
        &ns,
        "office",
        "the slices emptied once the hold ran out",
        &BTreeMap::new(),
    )
    .await;
    poll("EndpointsHeld=False", || async {
        (endpoints_held(&admin, &ns, "office").await? == "False").then_some(())
    })
    .await;
    term.stop().await;
}

/// Issue 33 item 5: a pool of more than 1000 serving members (the schema's maximum of
/// 1000 replicas plus a surge) is listed over slices of at most 100 endpoints, as
/// Kubernetes' endpointslice controller writes them; after a scale-in the rest is packed
/// again and the surplus slices are deleted. Before the fix one slice per family held
/// them all, and the API server refused it (at most 1000 endpoints).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn more_than_a_thousand_members_are_split_over_slices() {
    use futures_util::StreamExt;
    const MEMBERS: usize = 1050;
    const KEPT: usize = 30;
    let (_cp, admin, operator, ns) = plane("disc-split").await;
    let ns = ns.name().to_string();
    let pool = create_pool(&admin, &ns, "big").await;
    // Addresses are only written to status: no packet is ever sent to them.
    let ip = |i: usize| format!("10.200.{}.{}", i / 250, i % 250 + 1);
    futures_util::stream::iter(0..MEMBERS)
        .for_each_concurrent(16, |i| {
            let (operator, ns, pool) = (operator.clone(), ns.clone(), pool.clone());
            async move {
                let mut m = member_of(&pool, &format!("big-{i:04}"), "h1");
                if i < KEPT {
                    m.labels_mut().insert("kept".into(), "yes".into());
                }
                create_running(&operator, &ns, &m, &ip(i), true).await;
            }
        })
        .await;
    let discovery = Discovery::start(&operator, None);
    let all: Vec<String> = (0..MEMBERS).map(ip).collect();
    let all: Vec<&str> = all.iter().map(String::as_str).collect();
    wait_for_slices(&admin, &ns, "big", "all 1050 listed", &ready(&all)).await;
    let slices = Api::<EndpointSlice>::namespaced(admin.clone(), &ns)
        .list(&ListParams::default().labels("kubernetes.io/service-name=big"))
        .await
        .unwrap()
        .items;
    let names: BTreeSet<String> = slices.iter().map(|s| s.name_any()).collect();
    println!("{} slices: {names:?}", slices.len());
    assert!(slices.iter().all(|s| s.endpoints.len() <= 100));
    assert!(names.contains("big-ipv4") && names.contains("big-ipv4-10"));
    // Discovery writes the slices first and the pool's status after them, in the same
    // reconcile: the status may still be catching up when the slices are complete.
    poll("the pool's status lists all 1050 members", || async {
        (status_endpoints(&admin, &ns, "big").await.len() == MEMBERS).then_some(())
    })
    .await;

    // Scale in to 30: one IPv4 slice is enough, the others go.
    Api::<Proxy>::namespaced(admin.clone(), &ns)
        .delete_collection(
            &Default::default(),
            &ListParams::default().labels(&format!("{POOL_LABEL}=big,!kept")),
        )
        .await
        .unwrap();
    let kept: Vec<String> = (0..KEPT).map(ip).collect();
    let kept: Vec<&str> = kept.iter().map(String::as_str).collect();
    wait_for_slices(&admin, &ns, "big", "the 30 left listed", &ready(&kept)).await;
    poll("the surplus slices deleted", || async {
        let names: BTreeSet<String> = Api::<EndpointSlice>::namespaced(admin.clone(), &ns)
            .list(&ListParams::default().labels("kubernetes.io/service-name=big"))
            .await
            .ok()?
            .items
            .iter()
            .map(|s| s.name_any())
            .collect();
        (names == BTreeSet::from(["big-ipv4".to_string(), "big-ipv6".to_string()])).then_some(())
    })
    .await;
    discovery.stop().await;
}
