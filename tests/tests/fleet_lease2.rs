#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! `ProxyLease`, round two, on the real control plane (issues 33 and 35): the lease's own
//! status decides what it holds, whatever a Proxy's labels say; a release empties the
//! lease's slices before it frees the proxy; an expiry never moves earlier; the orphan
//! sweep survives a stuck release; a lease at rest writes nothing; a lease is not given up
//! while the fast probe is not trusted.
//!
//! As in `fleet_lease.rs`, the lease controller runs in-process as the operator's
//! ServiceAccount and the tests play the pool's Proxies (Proxy objects owned by a
//! `ProxyPool`, with a status written by the admin; addresses from 198.51.100.0/24, a
//! documentation range nothing is sent to).

use std::collections::BTreeSet;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use egress_operator::api::proxy::Proxy;
use egress_operator::api::proxy_lease::{LEASE_LABEL, LeasePhase, ProxyLease};
use egress_operator::api::proxy_pool::{
    DRAINING_ANNOTATION, POOL_LABEL, ProxyPool, TEMPLATE_HASH_LABEL,
};
use egress_operator::config::ValidConfig;
use egress_operator::fleet::lease::{LeaseContext, LeaseMetrics};
use egress_operator::fleet::pool::FleetContext;
use egress_operator::fleet::{FleetMetrics, LivenessBoard};
use integration_tests::harness::ControlPlane;
use integration_tests::harness::controlplane::operator_user;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client, Resource, ResourceExt};
use tokio::sync::watch;
use tokio::time::Instant;

/// Hang guard of every wait: generous, never a performance assertion.
const GUARD: Duration = Duration::from_secs(180);

/// One test at a time: each starts a lease controller that watches every namespace.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn config() -> Arc<ValidConfig> {
    Arc::new(
        egress_operator::config::parse(
            &integration_tests::fleet_config::fleet_config(1),
            "fleet.yaml",
            std::path::Path::new("/"),
        )
        .unwrap(),
    )
}

/// Polls `probe` every 100 ms until it yields a value, under the hang guard.
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
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

struct Setup {
    cp: &'static ControlPlane,
    admin: Client,
    ns: String,
    _ns: integration_tests::harness::TestNamespace,
}

async fn setup(prefix: &str) -> Setup {
    let cp = ControlPlane::shared().unwrap();
    cp.install_crds().await.unwrap();
    cp.install_rbac().unwrap();
    let admin = cp.client().await.unwrap();
    let handle = cp.namespace(prefix).await.unwrap();
    Setup {
        cp,
        admin,
        ns: handle.name().to_string(),
        _ns: handle,
    }
}

/// A lease controller as the operator's ServiceAccount, on `board`.
struct Instance {
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
    _leading: watch::Sender<bool>,
}

async fn instance(
    cp: &ControlPlane,
    metrics: &LeaseMetrics,
    board: Arc<LivenessBoard>,
) -> Instance {
    instance_with(cp, metrics, board, |_| {}).await
}

/// [`instance`], with `tune` applied to the context (sweep and resync periods).
async fn instance_with(
    cp: &ControlPlane,
    metrics: &LeaseMetrics,
    board: Arc<LivenessBoard>,
    tune: impl FnOnce(&mut LeaseContext),
) -> Instance {
    let client = cp
        .client_for(&cp.operator_kubeconfig().unwrap())
        .await
        .unwrap();
    let (leading, leading_rx) = watch::channel(true);
    let (stop, stop_rx) = watch::channel(false);
    let fleet = Arc::new(FleetContext::new(
        client,
        config(),
        board,
        FleetMetrics::default(),
        leading_rx,
        Some("replica-0".to_string()),
    ));
    let mut ctx = LeaseContext::new(fleet, metrics.clone());
    ctx.orphan_sweep = Duration::from_secs(1);
    tune(&mut ctx);
    let ctx = Arc::new(ctx);
    let mut rx = stop_rx;
    let task = tokio::spawn(egress_operator::fleet::lease::run(ctx, async move {
        let _ = rx.wait_for(|s| *s).await;
    }));
    Instance {
        stop,
        task,
        _leading: leading,
    }
}

impl Instance {
    async fn shutdown(self) {
        let _ = self.stop.send(true);
        let _ = self.task.await;
    }
}

async fn make_pool(admin: &Client, ns: &str, name: &str, extra: serde_json::Value) -> ProxyPool {
    let mut spec = serde_json::json!({
        "replicas": 0,
        "template": {"provider": "kvm2", "image": "debian-12"},
        "drainSeconds": 0
    });
    if let (Some(s), Some(e)) = (spec.as_object_mut(), extra.as_object()) {
        for (k, v) in e {
            s.insert(k.clone(), v.clone());
        }
    }
    let pool: ProxyPool = serde_json::from_value(serde_json::json!({
        "apiVersion": "egress-operator.dev/v1alpha1",
        "kind": "ProxyPool",
        "metadata": {"name": name},
        "spec": spec,
    }))
    .unwrap();
    Api::<ProxyPool>::namespaced(admin.clone(), ns)
        .create(&PostParams::default(), &pool)
        .await
        .unwrap()
}

/// A Proxy of `pool` (owned by it, its labels, and `labels`), serving at `ip`.
async fn make_proxy_labelled(
    admin: &Client,
    ns: &str,
    pool: &ProxyPool,
    name: &str,
    ip: &str,
    labels: serde_json::Value,
) -> Proxy {
    let owner = pool.controller_owner_ref(&()).unwrap();
    let mut all = serde_json::json!({
        POOL_LABEL: pool.name_any(),
        TEMPLATE_HASH_LABEL: pool.spec.template.hash(),
    });
    if let (Some(a), Some(e)) = (all.as_object_mut(), labels.as_object()) {
        for (k, v) in e {
            a.insert(k.clone(), v.clone());
        }
    }
    let proxy: Proxy = serde_json::from_value(serde_json::json!({
        "apiVersion": "egress-operator.dev/v1alpha1",
        "kind": "Proxy",
        "metadata": {"name": name, "labels": all, "ownerReferences": [owner]},
        "spec": {"provider": "kvm2", "image": "debian-12", "host": "h1"},
    }))
    .unwrap();
    Api::<Proxy>::namespaced(admin.clone(), ns)
        .create(&PostParams::default(), &proxy)
        .await
        .unwrap();
    set_serving(admin, ns, name, ip, true).await
}

async fn make_proxy(admin: &Client, ns: &str, pool: &ProxyPool, name: &str, ip: &str) -> Proxy {
    make_proxy_labelled(admin, ns, pool, name, ip, serde_json::json!({})).await
}

/// Writes the Proxy's status as the Proxy controller would: running at `ip`, `Ready` and
/// `Serving` as `serving` says.
async fn set_serving(admin: &Client, ns: &str, name: &str, ip: &str, serving: bool) -> Proxy {
    let now = jiff::Timestamp::now().to_string();
    let (status, reason) = if serving {
        ("True", "ProbePassed")
    } else {
        ("False", "ConnectFailed")
    };
    let cond = |t: &str| {
        serde_json::json!({"type": t, "status": status, "reason": reason, "message": "",
                           "lastTransitionTime": now})
    };
    let body = serde_json::json!({
        "status": {
            "phase": "Running",
            "host": "h1",
            "address": ip,
            "addresses": [ip],
            "conditions": [cond("Ready"), cond("Serving")],
        }
    });
    Api::<Proxy>::namespaced(admin.clone(), ns)
        .patch_status(name, &PatchParams::default(), &Patch::Merge(&body))
        .await
        .unwrap()
}

fn lease_obj(name: &str, pool: &str, spec: serde_json::Value) -> ProxyLease {
    let mut s = serde_json::json!({"pool": pool, "durationSeconds": 3600, "holder": "tests"});
    if let (Some(s), Some(e)) = (s.as_object_mut(), spec.as_object()) {
        for (k, v) in e {
            s.insert(k.clone(), v.clone());
        }
    }
    serde_json::from_value(serde_json::json!({
        "apiVersion": "egress-operator.dev/v1alpha1",
        "kind": "ProxyLease",
        "metadata": {"name": name},
        "spec": s,
    }))
    .unwrap()
}

async fn create_lease(
    admin: &Client,
    ns: &str,
    name: &str,
    pool: &str,
    spec: serde_json::Value,
) -> ProxyLease {
    Api::<ProxyLease>::namespaced(admin.clone(), ns)
        .create(&PostParams::default(), &lease_obj(name, pool, spec))
        .await
        .unwrap()
}

async fn get_lease(admin: &Client, ns: &str, name: &str) -> Option<ProxyLease> {
    Api::<ProxyLease>::namespaced(admin.clone(), ns)
        .get_opt(name)
        .await
        .unwrap()
}

fn phase(l: &ProxyLease) -> Option<LeasePhase> {
    l.status.as_ref()?.phase
}

/// The proxy UIDs a lease's status lists, bound or claimed.
fn listed(l: &ProxyLease) -> Vec<String> {
    l.status
        .as_ref()
        .map(|s| {
            s.proxies
                .iter()
                .map(|p| p.uid.clone())
                .chain(s.claims.iter().map(|c| c.uid.clone()))
                .collect()
        })
        .unwrap_or_default()
}

fn holder(p: &Proxy) -> Option<String> {
    p.labels().get(LEASE_LABEL).cloned()
}

async fn wait_phase(admin: &Client, ns: &str, name: &str, want: LeasePhase) -> ProxyLease {
    poll(&format!("lease {name} {}", want.as_str()), || async {
        get_lease(admin, ns, name)
            .await
            .filter(|l| phase(l) == Some(want))
    })
    .await
}

/// Deletes every lease of `ns` while the controller runs (so the finalizers are honoured)
/// and waits until they are gone.
async fn delete_leases(admin: &Client, ns: &str) {
    let api = Api::<ProxyLease>::namespaced(admin.clone(), ns);
    api.delete_collection(&DeleteParams::default(), &ListParams::default())
        .await
        .unwrap();
    poll("leases gone", || async {
        api.list(&ListParams::default())
            .await
            .ok()?
            .items
            .is_empty()
            .then_some(())
    })
    .await;
}

/// A ServiceAccount `name` in `ns` allowed only `verbs` on proxies, and a client for it.
async fn tenant(s: &Setup, name: &str, verbs: &[&str]) -> Client {
    let sa = serde_json::json!({
        "apiVersion": "v1", "kind": "ServiceAccount",
        "metadata": {"name": name, "namespace": s.ns},
    });
    let role = serde_json::json!({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
        "metadata": {"name": name, "namespace": s.ns},
        "rules": [{"apiGroups": ["egress-operator.dev"], "resources": ["proxies"], "verbs": verbs}],
    });
    let binding = serde_json::json!({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
        "metadata": {"name": name, "namespace": s.ns},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": s.ns}],
    });
    for obj in [sa, role, binding] {
        apply_json(s.cp, &obj);
    }
    let kubeconfig = s.cp.service_account_kubeconfig(&s.ns, name).unwrap();
    s.cp.client_for(&kubeconfig).await.unwrap()
}

/// `kubectl apply` of one object given as JSON, as the admin.
fn apply_json(cp: &ControlPlane, obj: &serde_json::Value) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("object.json");
    std::fs::write(&path, obj.to_string()).unwrap();
    cp.kubectl_run(&["apply", "-f", &path.to_string_lossy()])
        .unwrap();
}

/// Issue 35 item 2: a user who may only patch Proxies relabels lease X's proxy to lease
/// Y, which is waiting for a proxy. Before the fix, Y adopted any serving pool proxy whose
/// label named it (Y went Bound) and X lost it (X went Lost); a label naming no lease at
/// all made the orphan sweep release and drain X's proxy. Now the lease's status decides:
/// X keeps the proxy and writes its label back, Y stays Pending and never lists it, and
/// the sweep leaves it alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relabelled_proxy_never_leaves_its_lease() {
    let _serial = SERIAL.lock().await;
    let s = setup("lease-hijack").await;
    let (admin, ns) = (s.admin.clone(), s.ns.clone());
    let metrics = LeaseMetrics::default();
    let inst = instance(s.cp, &metrics, Arc::new(LivenessBoard::default())).await;
    let pool = make_pool(&admin, &ns, "office", serde_json::json!({})).await;
    let proxy = make_proxy(&admin, &ns, &pool, "office-a", "198.51.100.1").await;
    let puid = proxy.uid().unwrap();
    let x = create_lease(
        &admin,
        &ns,
        "x",
        "office",
        serde_json::json!({"service": false}),
    )
    .await;
    wait_phase(&admin, &ns, "x", LeasePhase::Bound).await;
    let y = create_lease(
        &admin,
        &ns,
        "y",
        "office",
        serde_json::json!({"service": false}),
    )
    .await;
    wait_phase(&admin, &ns, "y", LeasePhase::Pending).await;
    let (xuid, yuid) = (x.uid().unwrap(), y.uid().unwrap());

    // Sample both leases throughout: X never leaves Bound, Y never lists the proxy.
    let on = Arc::new(AtomicBool::new(true));
    let bad = Arc::new(Mutex::new(Vec::<String>::new()));
    let sampler = {
        let (admin, ns, on, bad, puid) = (
            admin.clone(),
            ns.clone(),
            on.clone(),
            bad.clone(),
            puid.clone(),
        );
        tokio::spawn(async move {
            while on.load(Ordering::SeqCst) {
                let x = get_lease(&admin, &ns, "x").await.unwrap();
                let y = get_lease(&admin, &ns, "y").await.unwrap();
                {
                    let mut b = bad.lock().unwrap();
                    if phase(&x) != Some(LeasePhase::Bound) || listed(&x) != [puid.clone()] {
                        b.push(format!("x: {:?} {:?}", phase(&x), listed(&x)));
                    }
                    if listed(&y).contains(&puid) || phase(&y) != Some(LeasePhase::Pending) {
                        b.push(format!("y: {:?} {:?}", phase(&y), listed(&y)));
                    }
                }
                tokio::time::sleep(Duration::from_millis(30)).await;
            }
        })
    };

    let mallory = tenant(&s, "mallory", &["patch"]).await;
    let as_mallory = Api::<Proxy>::namespaced(mallory, &ns);
    let api = Api::<Proxy>::namespaced(admin.clone(), &ns);
    // To Y (label and name annotation), then to a lease that does not exist (the sweep's
    // business), then cleared: each time the label comes back to X.
    let forged = [
        serde_json::json!({"metadata": {"labels": {LEASE_LABEL: yuid},
                           "annotations": {"egress-operator.dev/lease-name": "y"}}}),
        serde_json::json!({"metadata": {"labels": {LEASE_LABEL: "00000000-0000-0000-0000-000000000000"}}}),
        serde_json::json!({"metadata": {"labels": {LEASE_LABEL: null}}}),
    ];
    for (i, body) in forged.iter().enumerate() {
        println!("forged label {i}: {body}");
        as_mallory
            .patch("office-a", &PatchParams::default(), &Patch::Merge(body))
            .await
            .unwrap();
        poll("the label written back to X", || async {
            let p = api.get("office-a").await.ok()?;
            (holder(&p).as_deref() == Some(xuid.as_str())).then_some(())
        })
        .await;
        // Give Y's and the sweep's reconciles time to act on the forged label (the sweep
        // runs every second here).
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    on.store(false, Ordering::SeqCst);
    sampler.await.unwrap();
    let bad = bad.lock().unwrap().clone();
    assert!(bad.is_empty(), "the relabel moved the proxy: {bad:#?}");
    let p = api.get("office-a").await.unwrap();
    assert!(
        !p.annotations().contains_key(DRAINING_ANNOTATION),
        "nobody recycled X's proxy"
    );
    assert!(p.metadata.deletion_timestamp.is_none());
    let y = get_lease(&admin, &ns, "y").await.unwrap();
    assert_eq!(phase(&y), Some(LeasePhase::Pending));
    let events = Api::<k8s_openapi::api::events::v1::Event>::namespaced(admin.clone(), &ns)
        .list(&ListParams::default())
        .await
        .unwrap()
        .items;
    assert!(
        events
            .iter()
            .any(|e| e.reason.as_deref() == Some("LabelRestored")),
        "the restore is told"
    );

    delete_leases(&admin, &ns).await;
    inst.shutdown().await;
}

/// The audit log so far (a local plane always has one).
fn audit(cp: &ControlPlane) -> Vec<integration_tests::harness::controlplane::AuditedRequest> {
    cp.audit()
        .unwrap()
        .expect("a local control plane keeps an audit log")
}

async fn slice_addresses(admin: &Client, ns: &str, name: &str) -> Option<BTreeSet<String>> {
    let s = Api::<EndpointSlice>::namespaced(admin.clone(), ns)
        .get_opt(&format!("{name}-ipv4"))
        .await
        .ok()??;
    Some(
        s.endpoints
            .iter()
            .filter(|e| e.conditions.as_ref().and_then(|c| c.ready) == Some(true))
            .flat_map(|e| e.addresses.clone())
            .collect(),
    )
}

/// Where, in the audit log from `from` on, the operator released `proxy` (its last patch
/// of the Proxy) and whether it wrote `slice` before that.
fn slice_written_before_release(
    log: &[integration_tests::harness::controlplane::AuditedRequest],
    from: usize,
    ns: &str,
    proxy: &str,
    slice: &str,
) -> (Option<usize>, bool) {
    let user = operator_user();
    let mine = |i: &usize, resource: &str, name: &str| {
        let r = &log[*i];
        r.user == user
            && r.verb == "patch"
            && r.resource == resource
            && r.namespace.as_deref() == Some(ns)
            && r.name.as_deref() == Some(name)
            && r.code < 300
    };
    let release = (from..log.len()).rev().find(|i| mine(i, "proxies", proxy));
    let before = release.is_some_and(|end| (from..end).any(|i| mine(&i, "endpointslices", slice)));
    (release, before)
}

/// Issue 33 item 7: with `Reuse`, the lease's slices dropped the proxy only after its
/// label was cleared (on expiry the slices were emptied after the release; on deletion
/// not at all, they went with the lease after the finalizer), so for a moment another
/// lease could hold a proxy the old holder's Service still routed to. The audit log
/// orders the operator's writes: the slice is now written before the release, on expiry
/// and on deletion, and ends empty.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_released_proxy_leaves_the_lease_service_before_it_is_free() {
    let _serial = SERIAL.lock().await;
    let s = setup("lease-order").await;
    let (admin, ns) = (s.admin.clone(), s.ns.clone());
    let metrics = LeaseMetrics::default();
    let inst = instance(s.cp, &metrics, Arc::new(LivenessBoard::default())).await;
    let pool = make_pool(
        &admin,
        &ns,
        "reuse",
        serde_json::json!({"leaseRecycle": "Reuse"}),
    )
    .await;
    make_proxy(&admin, &ns, &pool, "reuse-a", "198.51.100.1").await;
    let addr = BTreeSet::from(["198.51.100.1".to_string()]);
    let api = Api::<Proxy>::namespaced(admin.clone(), &ns);

    // Expiry.
    create_lease(
        &admin,
        &ns,
        "r1",
        "reuse",
        serde_json::json!({"durationSeconds": 6}),
    )
    .await;
    wait_phase(&admin, &ns, "r1", LeasePhase::Bound).await;
    poll("r1's slice lists the proxy", || async {
        (slice_addresses(&admin, &ns, "r1").await? == addr).then_some(())
    })
    .await;
    let from = audit(s.cp).len();
    wait_phase(&admin, &ns, "r1", LeasePhase::Expired).await;
    poll("the proxy released", || async {
        holder(&api.get("reuse-a").await.ok()?)
            .is_none()
            .then_some(())
    })
    .await;
    let (release, before) =
        slice_written_before_release(&audit(s.cp), from, &ns, "reuse-a", "r1-ipv4");
    assert!(release.is_some(), "the release is in the audit log");
    assert!(
        before,
        "expiry: the slice was not emptied before the label was cleared"
    );
    assert_eq!(
        slice_addresses(&admin, &ns, "r1").await,
        Some(BTreeSet::new())
    );

    // Deletion.
    create_lease(&admin, &ns, "r2", "reuse", serde_json::json!({})).await;
    wait_phase(&admin, &ns, "r2", LeasePhase::Bound).await;
    poll("r2's slice lists the proxy", || async {
        (slice_addresses(&admin, &ns, "r2").await? == addr).then_some(())
    })
    .await;
    let from = audit(s.cp).len();
    Api::<ProxyLease>::namespaced(admin.clone(), &ns)
        .delete("r2", &DeleteParams::default())
        .await
        .unwrap();
    poll("r2 gone, the proxy free", || async {
        let gone = get_lease(&admin, &ns, "r2").await.is_none();
        (gone && holder(&api.get("reuse-a").await.ok()?).is_none()).then_some(())
    })
    .await;
    let (release, before) =
        slice_written_before_release(&audit(s.cp), from, &ns, "reuse-a", "r2-ipv4");
    assert!(release.is_some(), "the release is in the audit log");
    assert!(
        before,
        "deletion: the slice was not emptied before the label was cleared"
    );

    delete_leases(&admin, &ns).await;
    inst.shutdown().await;
}

/// Issue 33 item 9: a renewal whose `renewTime` is older than the one counted (a holder
/// replica with a slow clock) moved the expiry earlier, and a removed `renewTime` sent it
/// back to creation + duration; `Expired` is final, so the lease could end under its
/// holder. Now the expiry only ever moves later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewal_never_shortens_a_lease() {
    let _serial = SERIAL.lock().await;
    let s = setup("lease-renew").await;
    let (admin, ns) = (s.admin.clone(), s.ns.clone());
    let metrics = LeaseMetrics::default();
    let inst = instance(s.cp, &metrics, Arc::new(LivenessBoard::default())).await;
    let pool = make_pool(&admin, &ns, "office", serde_json::json!({})).await;
    make_proxy(&admin, &ns, &pool, "office-a", "198.51.100.1").await;
    create_lease(
        &admin,
        &ns,
        "slow",
        "office",
        serde_json::json!({"durationSeconds": 600, "service": false}),
    )
    .await;
    wait_phase(&admin, &ns, "slow", LeasePhase::Bound).await;
    let leases = Api::<ProxyLease>::namespaced(admin.clone(), &ns);
    let renew = |at: Option<jiff::Timestamp>| {
        let leases = leases.clone();
        async move {
            let body = serde_json::json!({"spec": {"renewTime": at.map(|t| t.to_string())}});
            leases
                .patch("slow", &PatchParams::default(), &Patch::Merge(&body))
                .await
                .unwrap();
        }
    };
    let expiry_of = |l: &ProxyLease| l.status.as_ref().unwrap().expiry_time.clone().unwrap().0;
    let observed = |at: Option<jiff::Timestamp>| {
        let (admin, ns) = (admin.clone(), ns.clone());
        async move {
            let want = at.map(|t| jiff::Timestamp::from_second(t.as_second()).unwrap());
            poll("the renewal counted", || async {
                get_lease(&admin, &ns, "slow").await.filter(|l| {
                    l.status
                        .as_ref()
                        .unwrap()
                        .observed_renew_time
                        .as_ref()
                        .map(|t| t.0)
                        == want
                })
            })
            .await
        }
    };
    let now = jiff::Timestamp::now();
    renew(Some(now)).await;
    let first = expiry_of(&observed(Some(now)).await);
    // The other replica's clock is 500 s behind.
    let behind = now - jiff::SignedDuration::from_secs(500);
    renew(Some(behind)).await;
    let after = observed(Some(behind)).await;
    assert!(
        expiry_of(&after) >= first,
        "an older renewal moved the expiry from {first} to {}",
        expiry_of(&after)
    );
    assert_eq!(phase(&after), Some(LeasePhase::Bound));
    // renewTime removed: the expiry stays, it does not fall back to creation + duration.
    renew(None).await;
    let cleared = observed(None).await;
    assert!(expiry_of(&cleared) >= first);
    assert_eq!(phase(&cleared), Some(LeasePhase::Bound));

    delete_leases(&admin, &ns).await;
    inst.shutdown().await;
}

/// Issue 33 item 13: one release that kept failing stopped the orphan sweep at that
/// proxy, every minute, so the orphans after it were never given back. A
/// ValidatingAdmissionPolicy here refuses to let one orphan lose its lease label (as a
/// stuck admission webhook, a quota or a broken object would); the sweep now counts that
/// failure and releases the next orphan anyway.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_stuck_release_does_not_stop_the_orphan_sweep() {
    let _serial = SERIAL.lock().await;
    let s = setup("lease-sweep").await;
    let (admin, ns) = (s.admin.clone(), s.ns.clone());
    let policy = format!("eotest-stuck-{ns}");
    let vap = serde_json::json!({
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": policy},
        "spec": {
            "failurePolicy": "Fail",
            "matchConstraints": {"resourceRules": [{
                "apiGroups": ["egress-operator.dev"], "apiVersions": ["*"],
                "operations": ["UPDATE"], "resources": ["proxies"],
            }]},
            "validations": [{
                "expression": "!has(object.metadata.labels) || !('eotest.dev/stuck' in object.metadata.labels) || ('egress-operator.dev/lease-uid' in object.metadata.labels)",
                "message": "this proxy keeps its lease label (test)",
                "reason": "Invalid",
            }],
        },
    });
    let binding = serde_json::json!({
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": policy},
        "spec": {
            "policyName": policy,
            "validationActions": ["Deny"],
            "matchResources": {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}}},
        },
    });
    apply_json(s.cp, &vap);
    apply_json(s.cp, &binding);
    let pool = make_pool(&admin, &ns, "office", serde_json::json!({})).await;
    make_proxy_labelled(
        &admin,
        &ns,
        &pool,
        "a-stuck",
        "198.51.100.1",
        serde_json::json!({"eotest.dev/stuck": "true"}),
    )
    .await;
    let api = Api::<Proxy>::namespaced(admin.clone(), &ns);
    // The policy is in force once it refuses a write that leaves the stuck proxy
    // unlabelled.
    poll("the policy in force", || async {
        let body = serde_json::json!({"metadata": {"annotations": {"probe": jiff::Timestamp::now().to_string()}}});
        api.patch("a-stuck", &PatchParams::default(), &Patch::Merge(&body))
            .await
            .is_err()
            .then_some(())
    })
    .await;
    let gone = "00000000-0000-0000-0000-000000000000";
    let label = serde_json::json!({"metadata": {"labels": {LEASE_LABEL: gone}}});
    api.patch("a-stuck", &PatchParams::default(), &Patch::Merge(&label))
        .await
        .unwrap();
    make_proxy_labelled(
        &admin,
        &ns,
        &pool,
        "b-orphan",
        "198.51.100.2",
        serde_json::json!({LEASE_LABEL: gone}),
    )
    .await;

    let metrics = LeaseMetrics::default();
    let inst = instance(s.cp, &metrics, Arc::new(LivenessBoard::default())).await;
    poll("the orphan after the stuck one recycled", || async {
        let p = api.get("b-orphan").await.ok()?;
        (holder(&p).is_none() && p.annotations().contains_key(DRAINING_ANNOTATION)).then_some(())
    })
    .await;
    poll("the stuck release counted", || async {
        (metrics.orphan_failures() >= 1).then_some(())
    })
    .await;
    assert_eq!(
        holder(&api.get("a-stuck").await.unwrap()).as_deref(),
        Some(gone),
        "the policy held the stuck one"
    );
    inst.shutdown().await;
    s.cp.kubectl_run(&["delete", "validatingadmissionpolicybinding", &policy])
        .unwrap();
    s.cp.kubectl_run(&["delete", "validatingadmissionpolicy", &policy])
        .unwrap();
}

/// The text exposition of `registry`.
fn exposition(registry: &prometheus_client::registry::Registry) -> String {
    let mut out = String::new();
    prometheus_client::encoding::text::encode(&mut out, registry).unwrap();
    out
}

/// Issue 33 item 13: the lease metrics kept the series of every namespace that ever had a
/// lease, and a lease that went without its finalizer's reconcile (deleted while no
/// replica led) stayed counted in its phase for good. Now a namespace's series go with
/// its last lease, and the sweep forgets leases that are gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leases_metric_series_go_when_it_goes() {
    let _serial = SERIAL.lock().await;
    let s = setup("lease-metrics").await;
    let (admin, ns) = (s.admin.clone(), s.ns.clone());
    let mut registry = prometheus_client::registry::Registry::default();
    let metrics = LeaseMetrics::register(&mut registry);
    let inst = instance(s.cp, &metrics, Arc::new(LivenessBoard::default())).await;
    let pool = make_pool(&admin, &ns, "office", serde_json::json!({})).await;
    make_proxy(&admin, &ns, &pool, "office-a", "198.51.100.1").await;
    make_proxy(&admin, &ns, &pool, "office-b", "198.51.100.2").await;
    for name in ["m1", "m2"] {
        create_lease(
            &admin,
            &ns,
            name,
            "office",
            serde_json::json!({"service": false}),
        )
        .await;
        wait_phase(&admin, &ns, name, LeasePhase::Bound).await;
    }
    poll("both counted", || async {
        (metrics.leases_in(&ns, LeasePhase::Bound) == 2).then_some(())
    })
    .await;
    let series = format!("namespace=\"{ns}\"");
    assert!(exposition(&registry).contains(&series));
    let leases = Api::<ProxyLease>::namespaced(admin.clone(), &ns);
    // m1 through its finalizer.
    leases.delete("m1", &DeleteParams::default()).await.unwrap();
    poll("m1 gone", || async {
        get_lease(&admin, &ns, "m1").await.is_none().then_some(())
    })
    .await;
    // m2 while no controller runs, its finalizer removed by hand.
    inst.shutdown().await;
    let strip = serde_json::json!({"metadata": {"finalizers": null}});
    leases
        .patch("m2", &PatchParams::default(), &Patch::Merge(&strip))
        .await
        .unwrap();
    leases.delete("m2", &DeleteParams::default()).await.unwrap();
    poll("m2 gone", || async {
        get_lease(&admin, &ns, "m2").await.is_none().then_some(())
    })
    .await;
    let inst = instance(s.cp, &metrics, Arc::new(LivenessBoard::default())).await;
    poll("the namespace's series gone", || async {
        (!exposition(&registry).contains(&series)).then_some(())
    })
    .await;
    assert_eq!(metrics.leases_in(&ns, LeasePhase::Bound), 0);
    inst.shutdown().await;
}

/// Is `r` a write (anything but get, list and watch)?
fn is_write(r: &integration_tests::harness::controlplane::AuditedRequest) -> bool {
    !matches!(r.verb.as_str(), "get" | "list" | "watch")
}

/// Issue 33 item 13: 200 leases at rest (150 bound with a Service each, 25 waiting for a
/// proxy, 25 expired) write nothing, and a change of a probe verdict wakes only the leases
/// that have not ended: before, every expired lease was reconciled on every verdict change,
/// forever (a GET of its Service each time). At rest no lease reads the API server (issue
/// 35, item 4: it plans from its caches). Prints what rest and a verdict change cost in
/// reads, for the README.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_leases_at_rest_write_nothing() {
    let _serial = SERIAL.lock().await;
    let s = setup("lease-rest").await;
    let (admin, ns) = (s.admin.clone(), s.ns.clone());
    let pool = make_pool(&admin, &ns, "office", serde_json::json!({})).await;
    make_pool(&admin, &ns, "empty", serde_json::json!({})).await;
    let bound_n = 150;
    futures_util::future::join_all((0..bound_n).map(|i| {
        let (admin, ns, pool) = (admin.clone(), ns.clone(), pool.clone());
        async move {
            make_proxy(
                &admin,
                &ns,
                &pool,
                &format!("office-{i:03}"),
                &format!("198.51.100.{}", i + 1),
            )
            .await;
        }
    }))
    .await;
    // A short resync, so the window below sees every lease's resync: the cost per resync
    // scales to the default period.
    let resync = Duration::from_secs(20);
    let metrics = LeaseMetrics::default();
    let board = Arc::new(LivenessBoard::default());
    let inst = instance_with(s.cp, &metrics, board.clone(), |c| {
        c.resync = resync;
        c.orphan_sweep = Duration::from_secs(60);
    })
    .await;
    let api = Api::<ProxyLease>::namespaced(admin.clone(), &ns);
    let create = |name: String, pool: &'static str, spec: serde_json::Value| {
        let api = api.clone();
        async move {
            api.create(&PostParams::default(), &lease_obj(&name, pool, spec))
                .await
                .unwrap();
        }
    };
    futures_util::future::join_all((0..25).map(|i| {
        create(
            format!("e-{i:03}"),
            "empty",
            serde_json::json!({"durationSeconds": 3}),
        )
    }))
    .await;
    futures_util::future::join_all(
        (0..bound_n).map(|i| create(format!("b-{i:03}"), "office", serde_json::json!({}))),
    )
    .await;
    let count = |leases: &[ProxyLease], want: LeasePhase| {
        leases.iter().filter(|l| phase(l) == Some(want)).count()
    };
    poll("150 bound, 25 expired", || async {
        let all = api.list(&ListParams::default()).await.ok()?.items;
        (count(&all, LeasePhase::Bound) == bound_n && count(&all, LeasePhase::Expired) == 25)
            .then_some(())
    })
    .await;
    futures_util::future::join_all(
        (0..25).map(|i| create(format!("w-{i:03}"), "office", serde_json::json!({}))),
    )
    .await;
    poll("25 waiting with nothing free", || async {
        let all = api.list(&ListParams::default()).await.ok()?.items;
        let waiting = all
            .iter()
            .filter(|l| {
                l.status.as_ref().is_some_and(|s| {
                    s.claims.is_empty()
                        && s.conditions
                            .iter()
                            .any(|c| c.type_ == "Bound" && c.reason == "NoFreeProxy")
                })
            })
            .count();
        (waiting == 25 && all.len() == 200).then_some(())
    })
    .await;
    // Settle: the last Services and slices written, the Bound events sent.
    tokio::time::sleep(Duration::from_secs(5)).await;

    // At rest: two resync periods.
    let user = operator_user();
    let from = audit(s.cp).len();
    let window = resync * 2;
    tokio::time::sleep(window).await;
    let log = audit(s.cp);
    let rest: Vec<_> = log[from..].iter().filter(|r| r.user == user).collect();
    let writes: Vec<_> = rest.iter().filter(|r| is_write(r)).collect();
    let reads = rest
        .iter()
        .filter(|r| matches!(r.verb.as_str(), "get" | "list"))
        .count();
    let per_resync = reads as f64 / 200.0 / (window.as_secs_f64() / resync.as_secs_f64());
    let default_per_minute =
        per_resync * 200.0 * 60.0 / egress_operator::fleet::lease::controller::RESYNC.as_secs_f64();
    println!(
        "200 leases at rest over {window:?} (resync {resync:?}): {} writes, {reads} reads \
         ({per_resync:.2} reads per lease per resync; at the default resync of {:?}: \
         {default_per_minute:.0} reads per minute, plus the orphan sweep's 2)",
        writes.len(),
        egress_operator::fleet::lease::controller::RESYNC,
    );
    assert!(writes.is_empty(), "writes at rest: {writes:#?}");
    // Issue 35 item 4: a resync plans from the controller's caches, so at rest no lease
    // reads the API server; only the orphan sweep (2 LISTs a period) may fall in the
    // window. Before, each live lease read 5 objects per resync (about 1750 here).
    let lease_reads: Vec<_> = rest
        .iter()
        .filter(|r| matches!(r.verb.as_str(), "get" | "list"))
        // The sweep's LISTs are cluster-wide; a lease's reads are all in its namespace.
        .filter(|r| !(r.verb == "list" && r.namespace.is_none()))
        .collect();
    assert!(
        lease_reads.is_empty(),
        "reads at rest beyond the orphan sweep's: {} (e.g. {:?})",
        lease_reads.len(),
        lease_reads.first()
    );
    assert!(
        reads <= 4,
        "{reads} reads at rest, more than two orphan sweeps'"
    );

    // Verdict changes (a proxy of another pool comes and goes on the board): the expired
    // leases are not woken.
    use egress_operator::fleet::liveness::{PoolKey, Target};
    let from = audit(s.cp).len();
    let flapper = Target {
        uid: "not-a-lease-proxy".into(),
        pool: PoolKey {
            namespace: ns.clone(),
            name: "elsewhere".into(),
        },
        ip: "192.0.2.200".parse().unwrap(),
        // Not Ready before its first probe, so each passing round is a verdict change.
        ready: false,
    };
    let changes = 3;
    for _ in 0..changes {
        // New and up: a change; then forgotten (no change), so the next round is new again.
        board.apply(&[(flapper.clone(), true)], 2, Instant::now());
        board.apply(&[], 2, Instant::now());
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    let log = audit(s.cp);
    let after: Vec<_> = log[from..].iter().filter(|r| r.user == user).collect();
    let expired_reads: Vec<_> = after
        .iter()
        .filter(|r| r.name.as_deref().is_some_and(|n| n.starts_with("e-")))
        .collect();
    let reads = after
        .iter()
        .filter(|r| matches!(r.verb.as_str(), "get" | "list"))
        .count();
    println!(
        "{changes} verdict changes: {reads} reads ({:.0} per change), {} writes",
        reads as f64 / f64::from(changes),
        after.iter().filter(|r| is_write(r)).count()
    );
    assert!(
        expired_reads.is_empty(),
        "expired leases reconciled on a verdict change: {} requests, e.g. {:?}",
        expired_reads.len(),
        expired_reads.first()
    );
    assert!(
        after.iter().all(|r| !is_write(r)),
        "a verdict change of no lease's proxy wrote"
    );

    delete_leases(&admin, &ns).await;
    inst.shutdown().await;
}

/// Issue 33 item 2, the lease's part: while the fast probe is not trusted (every proxy
/// fails at once: the operator's own path is the likelier culprit), a lease does not give
/// up its proxy, so it does not go `Lost` and `Replace` does not drain a leased proxy
/// because of the operator's own network. Here the leased proxy's verdict went down just
/// before every probe failed; before the fix the lease went `Lost` after
/// `rebindAfterSeconds` and drained it. Once the probe is trusted again and the proxy is
/// still down, the lease does give it up and rebinds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_keeps_its_proxy_while_the_probe_is_not_trusted() {
    use egress_operator::fleet::liveness::{PoolKey, Target};
    let _serial = SERIAL.lock().await;
    let s = setup("lease-trust").await;
    let (admin, ns) = (s.admin.clone(), s.ns.clone());
    let pool = make_pool(&admin, &ns, "office", serde_json::json!({})).await;
    let mut targets = Vec::new();
    for i in 0..4 {
        let ip = format!("198.51.100.{}", i + 1);
        let p = make_proxy(&admin, &ns, &pool, &format!("office-{i}"), &ip).await;
        targets.push(Target {
            uid: p.uid().unwrap(),
            pool: PoolKey {
                namespace: ns.clone(),
                name: "office".into(),
            },
            ip: ip.parse().unwrap(),
            ready: true,
        });
    }
    let board = Arc::new(LivenessBoard::default());
    let round = |up: &dyn Fn(usize) -> bool| {
        let results: Vec<_> = targets
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), up(i)))
            .collect();
        board.apply(&results, 2, Instant::now())
    };
    round(&|_| true);
    let metrics = LeaseMetrics::default();
    let inst = instance(s.cp, &metrics, board.clone()).await;
    create_lease(
        &admin,
        &ns,
        "crawler",
        "office",
        serde_json::json!({"rebindAfterSeconds": 1, "service": false}),
    )
    .await;
    let bound = wait_phase(&admin, &ns, "crawler", LeasePhase::Bound).await;
    let leased = bound.status.unwrap().proxies[0].uid.clone();
    let li = targets.iter().position(|t| t.uid == leased).unwrap();

    // The leased proxy fails first, then every probe fails: the board holds.
    round(&|i| i != li);
    let r = round(&|i| i != li);
    assert_eq!(r.went_down, std::slice::from_ref(&leased));
    let r = round(&|_| false);
    assert!(r.held && !board.trusted());
    // Several rebindAfterSeconds pass: the lease keeps its proxy, which is not recycled.
    let began = Instant::now();
    let api = Api::<Proxy>::namespaced(admin.clone(), &ns);
    let name = &bound_name(&admin, &ns, "crawler").await;
    while began.elapsed() < Duration::from_secs(5) {
        round(&|_| false);
        let l = get_lease(&admin, &ns, "crawler").await.unwrap();
        assert_eq!(
            phase(&l),
            Some(LeasePhase::Bound),
            "gave up while the probe is held"
        );
        assert_eq!(listed(&l), std::slice::from_ref(&leased));
        let p = api.get(name).await.unwrap();
        assert!(
            !p.annotations().contains_key(DRAINING_ANNOTATION),
            "drained while held"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }

    // Trusted again, and the leased proxy is still down: given up and rebound.
    let r = round(&|i| i != li);
    assert!(!r.held && board.trusted());
    let rebound = poll("rebound to a spare", || async {
        get_lease(&admin, &ns, "crawler").await.filter(|l| {
            phase(l) == Some(LeasePhase::Bound)
                && !listed(l).is_empty()
                && listed(l) != [leased.clone()]
        })
    })
    .await;
    assert_eq!(rebound.status.unwrap().rebinds, 1);
    delete_leases(&admin, &ns).await;
    inst.shutdown().await;
}

async fn bound_name(admin: &Client, ns: &str, lease: &str) -> String {
    get_lease(admin, ns, lease)
        .await
        .unwrap()
        .status
        .unwrap()
        .proxies[0]
        .name
        .clone()
}

/// Issue 30: a lease's proxies are never rolled while it holds them; the lease says when
/// they were made from inputs that changed since (`UpToDate=False`, naming them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_says_when_its_proxies_are_out_of_date_and_keeps_them() {
    let _serial = SERIAL.lock().await;
    let s = setup("lease-drift").await;
    let (admin, ns) = (s.admin.clone(), s.ns.clone());
    let metrics = LeaseMetrics::default();
    let inst = instance(s.cp, &metrics, Arc::new(LivenessBoard::default())).await;
    let pool = make_pool(&admin, &ns, "office", serde_json::json!({})).await;
    let proxy = make_proxy(&admin, &ns, &pool, "office-a", "198.51.100.1").await;
    create_lease(
        &admin,
        &ns,
        "held",
        "office",
        serde_json::json!({"service": false}),
    )
    .await;
    wait_phase(&admin, &ns, "held", LeasePhase::Bound).await;
    let up_to_date = |want: &'static str| {
        let (admin, ns) = (admin.clone(), ns.clone());
        async move {
            poll(&format!("the lease's UpToDate {want}"), || async {
                let l = get_lease(&admin, &ns, "held").await?;
                let c = l
                    .status
                    .as_ref()?
                    .conditions
                    .iter()
                    .find(|c| c.type_ == "UpToDate" && c.status == want)
                    .cloned()?;
                Some((l, c))
            })
            .await
        }
    };
    let (_, current) = up_to_date("True").await;
    assert_eq!(current.reason, "Current");

    // The Proxy controller finds the proxy made from inputs that changed since.
    let now = jiff::Timestamp::now().to_string();
    let cond = |t: &str, status: &str, reason: &str| {
        serde_json::json!({"type": t, "status": status, "reason": reason, "message": "",
                           "lastTransitionTime": now})
    };
    let body = serde_json::json!({"status": {"conditions": [
        cond("Ready", "True", "ProbePassed"),
        cond("Serving", "True", "ProbePassed"),
        cond("UpToDate", "False", "InputsChanged"),
    ]}});
    Api::<Proxy>::namespaced(admin.clone(), &ns)
        .patch_status("office-a", &PatchParams::default(), &Patch::Merge(&body))
        .await
        .unwrap();
    let (lease, stale) = up_to_date("False").await;
    assert_eq!(stale.reason, "InputsChanged");
    assert!(stale.message.contains("office-a"), "{}", stale.message);
    assert_eq!(phase(&lease), Some(LeasePhase::Bound), "kept while leased");
    assert_eq!(listed(&lease), vec![proxy.uid().unwrap()]);

    delete_leases(&admin, &ns).await;
    inst.shutdown().await;
}

/// Issue 30, item 4: a lease that opts in (`replaceOutOfDate`) swaps an out-of-date bound
/// proxy for a free, up-to-date one of its pool, taking the new one before it gives the old
/// one back; an out-of-date spare is never taken for a swap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_that_opts_in_swaps_an_out_of_date_proxy_make_before_break() {
    let _serial = SERIAL.lock().await;
    let s = setup("lease-swap").await;
    let (admin, ns) = (s.admin.clone(), s.ns.clone());
    let metrics = LeaseMetrics::default();
    let inst = instance(s.cp, &metrics, Arc::new(LivenessBoard::default())).await;
    let pool = make_pool(&admin, &ns, "office", serde_json::json!({})).await;
    let old = make_proxy(&admin, &ns, &pool, "office-a", "198.51.100.1").await;
    create_lease(
        &admin,
        &ns,
        "held",
        "office",
        serde_json::json!({"service": false, "replaceOutOfDate": true}),
    )
    .await;
    wait_phase(&admin, &ns, "held", LeasePhase::Bound).await;

    // office-a goes out of date; the only spare is out of date too: no swap.
    let now = jiff::Timestamp::now().to_string();
    let stale = |ip: &str| {
        let cond = |t: &str, status: &str, reason: &str| {
            serde_json::json!({"type": t, "status": status, "reason": reason, "message": "",
                               "lastTransitionTime": now})
        };
        serde_json::json!({"status": {"phase": "Running", "host": "h1", "address": ip,
            "addresses": [ip], "conditions": [
            cond("Ready", "True", "ProbePassed"),
            cond("Serving", "True", "ProbePassed"),
            cond("UpToDate", "False", "InputsChanged"),
        ]}})
    };
    let proxies = Api::<Proxy>::namespaced(admin.clone(), &ns);
    make_proxy(&admin, &ns, &pool, "office-b", "198.51.100.2").await;
    proxies
        .patch_status(
            "office-b",
            &PatchParams::default(),
            &Patch::Merge(&stale("198.51.100.2")),
        )
        .await
        .unwrap();
    proxies
        .patch_status(
            "office-a",
            &PatchParams::default(),
            &Patch::Merge(&stale("198.51.100.1")),
        )
        .await
        .unwrap();
    let lease = poll("the lease's UpToDate False", || async {
        get_lease(&admin, &ns, "held").await.filter(|l| {
            l.status.as_ref().is_some_and(|s| {
                s.conditions
                    .iter()
                    .any(|c| c.type_ == "UpToDate" && c.status == "False")
            })
        })
    })
    .await;
    let message = lease
        .status
        .as_ref()
        .and_then(|s| s.conditions.iter().find(|c| c.type_ == "UpToDate"))
        .map(|c| c.message.clone())
        .unwrap_or_default();
    assert!(message.contains("replaceOutOfDate"), "{message}");
    // Give an eager swap the time to happen: it must not.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let lease = get_lease(&admin, &ns, "held").await.unwrap();
    assert_eq!(
        listed(&lease),
        vec![old.uid().unwrap()],
        "no out-of-date spare taken"
    );
    assert_eq!(metrics.swaps(&ns), 0);

    // An up-to-date spare appears: the lease takes it, then gives office-a back. A sampler
    // reads the lease throughout: it never holds fewer than its count.
    let (done, done_rx) = watch::channel(false);
    let sampler = {
        let (admin, ns) = (admin.clone(), ns.clone());
        tokio::spawn(async move {
            let (mut fewest, mut most) = (usize::MAX, 0);
            while !*done_rx.borrow() {
                if let Some(l) = get_lease(&admin, &ns, "held").await {
                    let n = l.status.map_or(0, |s| s.proxies.len());
                    (fewest, most) = (fewest.min(n), most.max(n));
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            (fewest, most)
        })
    };
    let fresh = make_proxy(&admin, &ns, &pool, "office-c", "198.51.100.3").await;
    let lease = poll("the lease swapped to office-c", || async {
        get_lease(&admin, &ns, "held")
            .await
            .filter(|l| listed(l) == vec![fresh.uid().unwrap()])
    })
    .await;
    assert_eq!(phase(&lease), Some(LeasePhase::Bound));
    let up = lease
        .status
        .as_ref()
        .and_then(|s| s.conditions.iter().find(|c| c.type_ == "UpToDate"))
        .cloned()
        .unwrap();
    assert_eq!(
        (up.status.as_str(), up.reason.as_str()),
        ("True", "Current")
    );
    assert_eq!(
        lease.status.as_ref().unwrap().rebinds,
        0,
        "a swap is not a rebind"
    );
    let a =
        poll("office-a given back", || async {
            proxies.get_opt("office-a").await.unwrap().filter(|p| {
                holder(p).is_none() || p.annotations().contains_key(DRAINING_ANNOTATION)
            })
        })
        .await;
    assert_ne!(
        holder(&a).as_deref(),
        lease.uid().as_deref(),
        "office-a no longer names the lease"
    );
    let b = proxies.get("office-b").await.unwrap();
    assert!(
        holder(&b).is_none(),
        "the out-of-date spare was never taken"
    );
    done.send(true).unwrap();
    let (fewest, most) = sampler.await.unwrap();
    assert!(
        fewest >= 1,
        "the lease held {fewest} proxies at some point during the swap"
    );
    assert_eq!(metrics.swaps(&ns), 1);
    let events = Api::<k8s_openapi::api::events::v1::Event>::namespaced(admin.clone(), &ns)
        .list(&ListParams::default())
        .await
        .unwrap()
        .items;
    let swap = events
        .iter()
        .find(|e| e.reason.as_deref() == Some("OutOfDateSwapped"))
        .and_then(|e| e.note.clone())
        .unwrap_or_default();
    assert!(swap.contains("office-a"), "the swap is told: {swap:?}");
    assert!(
        !events
            .iter()
            .any(|e| e.reason.as_deref() == Some("ProxyLost")),
        "a swap is not a loss"
    );
    println!("swapped office-a for office-c (sampled bound counts {fewest}..={most}): {swap}");

    delete_leases(&admin, &ns).await;
    inst.shutdown().await;
}
