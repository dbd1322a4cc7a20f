#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! `ProxyLease` on the real control plane (issue 24's "done when").
//!
//! The lease controller runs in-process as the operator's ServiceAccount (the shipped
//! `config/rbac`). No VM and no Proxy controller: the tests play the pool's Proxies
//! themselves, creating Proxy objects owned by a `ProxyPool` and writing their status
//! (`Ready`, an address from 198.51.100.0/24, a documentation range nothing is sent to)
//! with the admin client. The pool controller does not run unless a test says so, so the
//! tests decide when a proxy serves, stops, or is replaced.
//!
//! - The race: 100 leases for 10 serving proxies, reconciled by several lease controller
//!   instances at once (each with its own client and watch cache, as two replicas around a
//!   handover and stale caches would), one of them deposed mid-race and another started.
//!   Exactly 10 end up bound, and a sampler that reads every lease and every proxy
//!   throughout never sees a proxy bound twice or a `Bound` lease its proxy does not name.
//! - Expiry, renewal and release: a lease that is not renewed expires and its proxy is
//!   recycled (`Replace`: drained, never bound again) before another lease is bound; a
//!   renewed one stays bound; `Reuse` gives the same proxy to the next lease; a deleted
//!   lease releases its proxy.
//! - Loss: the bound proxy stops serving, the lease goes `Lost`, rebinds to the spare,
//!   and its Service's EndpointSlice follows.
//! - The pool's scale-in (its real reconcile) never removes the leased proxy.

use std::collections::{BTreeMap, BTreeSet};
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
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client, Resource, ResourceExt};
use tokio::sync::watch;
use tokio::time::Instant;

/// Hang guard of every wait: generous, never a performance assertion.
const GUARD: Duration = Duration::from_secs(180);

/// The tests run one at a time: each starts lease controllers that watch every namespace,
/// so in parallel they would reconcile each other's leases (correctly, but with metrics
/// and timing that are not the test's own).
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn config() -> Arc<ValidConfig> {
    Arc::new(
        egress_operator::config::parse(
            &integration_tests::fleet_config::fleet_config(2),
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

/// The control plane with CRDs and RBAC, an admin client, and a fresh namespace.
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

/// A lease controller instance: its own client (its own watches and cache), its own
/// leadership switch.
struct Instance {
    leading: watch::Sender<bool>,
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

async fn instance(cp: &ControlPlane, metrics: &LeaseMetrics, name: &str) -> Instance {
    let client = cp
        .client_for(&cp.operator_kubeconfig().unwrap())
        .await
        .unwrap();
    let (leading, leading_rx) = watch::channel(true);
    let (stop, stop_rx) = watch::channel(false);
    let fleet = Arc::new(FleetContext::new(
        client,
        config(),
        Arc::new(LivenessBoard::default()),
        FleetMetrics::default(),
        leading_rx,
        Some(name.to_string()),
    ));
    let mut ctx = LeaseContext::new(fleet, metrics.clone());
    ctx.orphan_sweep = Duration::from_secs(1);
    let ctx = Arc::new(ctx);
    let mut rx = stop_rx;
    let task = tokio::spawn(egress_operator::fleet::lease::run(ctx, async move {
        let _ = rx.wait_for(|s| *s).await;
    }));
    Instance {
        leading,
        stop,
        task,
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

/// A Proxy of `pool` (owned by it, its labels), serving at `ip` when `serving`.
async fn make_proxy(admin: &Client, ns: &str, pool: &ProxyPool, name: &str, ip: &str) -> Proxy {
    let owner = pool.controller_owner_ref(&()).unwrap();
    let proxy: Proxy = serde_json::from_value(serde_json::json!({
        "apiVersion": "egress-operator.dev/v1alpha1",
        "kind": "Proxy",
        "metadata": {
            "name": name,
            "labels": {
                POOL_LABEL: pool.name_any(),
                TEMPLATE_HASH_LABEL: pool.spec.template.hash(),
            },
            "ownerReferences": [owner],
        },
        "spec": {"provider": "kvm2", "image": "debian-12", "host": "h1"},
    }))
    .unwrap();
    Api::<Proxy>::namespaced(admin.clone(), ns)
        .create(&PostParams::default(), &proxy)
        .await
        .unwrap();
    set_serving(admin, ns, name, ip, true).await
}

/// Writes the Proxy's status as the Proxy controller would: running at `ip`, `Ready`
/// and `Serving` as `serving` says.
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

async fn create_lease(admin: &Client, ns: &str, lease: &ProxyLease) -> ProxyLease {
    Api::<ProxyLease>::namespaced(admin.clone(), ns)
        .create(&PostParams::default(), lease)
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

fn bound_uids(l: &ProxyLease) -> Vec<String> {
    l.status
        .as_ref()
        .map(|s| s.proxies.iter().map(|p| p.uid.clone()).collect())
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

async fn all_proxies(admin: &Client, ns: &str) -> Vec<Proxy> {
    Api::<Proxy>::namespaced(admin.clone(), ns)
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
}

/// One snapshot's violations of F1: a proxy listed by two leases, a `Bound` lease whose
/// proxy does not name it, more leased proxies than there are.
fn violations(leases: &[ProxyLease], proxies: &[Proxy]) -> Vec<String> {
    let mut out = Vec::new();
    let mut owner_of: BTreeMap<String, String> = BTreeMap::new();
    for l in leases {
        for uid in bound_uids(l) {
            if let Some(other) = owner_of.insert(uid.clone(), l.name_any()) {
                out.push(format!(
                    "proxy {uid} listed by {other} and {}",
                    l.name_any()
                ));
            }
        }
    }
    let by_uid: BTreeMap<String, &Proxy> = proxies.iter().map(|p| (p.uid().unwrap(), p)).collect();
    for l in leases
        .iter()
        .filter(|l| phase(l) == Some(LeasePhase::Bound))
    {
        for uid in bound_uids(l) {
            let names = by_uid.get(&uid).and_then(|p| holder(p));
            if names != l.uid() {
                out.push(format!(
                    "lease {} is Bound to {uid}, whose label says {names:?}",
                    l.name_any()
                ));
            }
        }
    }
    out
}

/// 100 leases race for 10 proxies, several instances reconciling at once, one deposed and
/// one started mid-race; sampled throughout.
async fn race_round(round: usize) {
    let s = setup("lease-race").await;
    let (admin, ns) = (s.admin.clone(), s.ns.clone());
    let pool = make_pool(&admin, &ns, "office", serde_json::json!({})).await;
    for i in 0..10 {
        make_proxy(
            &admin,
            &ns,
            &pool,
            &format!("office-{i}"),
            &format!("198.51.100.{}", i + 1),
        )
        .await;
    }
    let metrics = LeaseMetrics::default();
    let mut instances = Vec::new();
    for i in 0..3 {
        instances.push(instance(s.cp, &metrics, &format!("replica-{i}")).await);
    }

    let sampling = Arc::new(AtomicBool::new(true));
    let found = Arc::new(Mutex::new((0usize, Vec::<String>::new(), 0usize)));
    let sampler = {
        let (admin, ns, on, found) = (admin.clone(), ns.clone(), sampling.clone(), found.clone());
        tokio::spawn(async move {
            while on.load(Ordering::SeqCst) {
                // Leases first, then proxies: a proxy's label is set before its lease
                // says Bound, and nothing is released during the race.
                let leases = Api::<ProxyLease>::namespaced(admin.clone(), &ns)
                    .list(&ListParams::default())
                    .await
                    .unwrap()
                    .items;
                let proxies = all_proxies(&admin, &ns).await;
                let v = violations(&leases, &proxies);
                let bound = leases
                    .iter()
                    .filter(|l| phase(l) == Some(LeasePhase::Bound))
                    .count();
                {
                    let mut f = found.lock().unwrap();
                    f.0 += 1;
                    f.1.extend(v);
                    f.2 = f.2.max(bound);
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
    };

    let api = Api::<ProxyLease>::namespaced(admin.clone(), &ns);
    let creates = (0..100).map(|i| {
        let api = api.clone();
        async move {
            api.create(
                &PostParams::default(),
                &lease_obj(
                    &format!("lease-{i:03}"),
                    "office",
                    serde_json::json!({"service": false}),
                ),
            )
            .await
            .unwrap()
        }
    });
    futures_util::future::join_all(creates).await;

    // Mid-race: replica-0 is deposed (a deposed replica writes nothing) and a fourth
    // instance, fresh caches, joins.
    poll("some leases bound", || async {
        (found.lock().unwrap().2 >= 2).then_some(())
    })
    .await;
    let _ = instances[0].leading.send(false);
    instances.push(instance(s.cp, &metrics, "replica-3").await);

    let settled = poll("10 bound, 90 pending for want of a proxy", || async {
        let bad = found.lock().unwrap().1.clone();
        assert!(bad.is_empty(), "F1 violated during the race: {bad:#?}");
        let leases = api.list(&ListParams::default()).await.ok()?.items;
        let bound: Vec<&ProxyLease> = leases
            .iter()
            .filter(|l| phase(l) == Some(LeasePhase::Bound))
            .collect();
        let waiting = leases
            .iter()
            .filter(|l| {
                phase(l) == Some(LeasePhase::Pending)
                    && l.status.as_ref().is_some_and(|s| {
                        s.claims.is_empty()
                            && s.conditions
                                .iter()
                                .any(|c| c.type_ == "Bound" && c.reason == "NoFreeProxy")
                    })
            })
            .count();
        (bound.len() == 10 && waiting == 90).then(|| leases.clone())
    })
    .await;
    // Keep sampling a little while the controllers resync.
    tokio::time::sleep(Duration::from_secs(2)).await;
    sampling.store(false, Ordering::SeqCst);
    sampler.await.unwrap();

    let proxies = all_proxies(&admin, &ns).await;
    let bound: BTreeMap<String, String> = settled
        .iter()
        .filter(|l| phase(l) == Some(LeasePhase::Bound))
        .map(|l| (bound_uids(l)[0].clone(), l.uid().unwrap()))
        .collect();
    assert_eq!(bound.len(), 10, "10 distinct proxies bound");
    for p in &proxies {
        assert_eq!(
            holder(p).as_ref(),
            bound.get(&p.uid().unwrap()),
            "proxy {} and its lease point at each other",
            p.name_any()
        );
    }
    let (samples, bad, _) = found.lock().unwrap().clone();
    println!(
        "race round {round}: {samples} samples of every lease and proxy, {} violations",
        bad.len()
    );
    assert!(samples >= 5, "too few samples: {samples}");
    assert!(bad.is_empty(), "F1 violated: {bad:#?}");
    poll("metrics count 10 bound", || async {
        (metrics.leases_in(&ns, LeasePhase::Bound) == 10).then_some(())
    })
    .await;

    // Tear down while the controllers run, so the finalizers are honoured.
    api.delete_collection(&DeleteParams::default(), &ListParams::default())
        .await
        .unwrap();
    poll("leases released and gone", || async {
        let left = api.list(&ListParams::default()).await.ok()?.items.len();
        let leased = all_proxies(&admin, &ns)
            .await
            .iter()
            .filter(|p| holder(p).is_some())
            .count();
        (left == 0 && leased == 0).then_some(())
    })
    .await;
    for i in instances {
        i.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_hundred_leases_race_for_ten_proxies_and_exactly_ten_bind_once_each() {
    let _serial = SERIAL.lock().await;
    let rounds: usize = std::env::var("LEASE_RACE_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2);
    for round in 1..=rounds {
        race_round(round).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unrenewed_lease_expires_and_its_proxy_is_recycled_before_the_next_holder() {
    let _serial = SERIAL.lock().await;
    let s = setup("lease-expiry").await;
    let (admin, ns) = (s.admin.clone(), s.ns.clone());
    let metrics = LeaseMetrics::default();
    let inst = instance(s.cp, &metrics, "replica-0").await;

    // Replace (the default): one proxy, two leases.
    let pool = make_pool(&admin, &ns, "office", serde_json::json!({})).await;
    let first = make_proxy(&admin, &ns, &pool, "office-a", "198.51.100.1").await;
    let short = create_lease(
        &admin,
        &ns,
        &lease_obj(
            "short",
            "office",
            serde_json::json!({"durationSeconds": 5, "service": false}),
        ),
    )
    .await;
    let bound = wait_phase(&admin, &ns, "short", LeasePhase::Bound).await;
    assert_eq!(bound_uids(&bound), [first.uid().unwrap()]);
    let st = bound.status.clone().unwrap();
    assert_eq!(st.addresses.as_deref(), Some("198.51.100.1"));
    assert!(st.expiry_time.is_some());
    let api = Api::<Proxy>::namespaced(admin.clone(), &ns);
    assert_eq!(holder(&api.get("office-a").await.unwrap()), short.uid());
    create_lease(
        &admin,
        &ns,
        &lease_obj("next", "office", serde_json::json!({"service": false})),
    )
    .await;
    let waiting = wait_phase(&admin, &ns, "next", LeasePhase::Pending).await;
    assert!(bound_uids(&waiting).is_empty());

    // Not renewed: Expired, its proxy drained and unlabelled; the next lease never gets it.
    let expired = wait_phase(&admin, &ns, "short", LeasePhase::Expired).await;
    assert!(bound_uids(&expired).is_empty());
    let recycled = poll("office-a drained and unlabelled", || async {
        let p = api.get("office-a").await.ok()?;
        (holder(&p).is_none() && p.annotations().contains_key(DRAINING_ANNOTATION)).then_some(p)
    })
    .await;
    assert!(recycled.metadata.deletion_timestamp.is_none());
    tokio::time::sleep(Duration::from_secs(2)).await;
    let still = get_lease(&admin, &ns, "next").await.unwrap();
    assert_eq!(
        phase(&still),
        Some(LeasePhase::Pending),
        "a draining proxy is never bound"
    );
    // The pool replaces it (played here): the next lease gets the fresh proxy.
    api.delete("office-a", &DeleteParams::default())
        .await
        .unwrap();
    let fresh = make_proxy(&admin, &ns, &pool, "office-b", "198.51.100.2").await;
    let next = wait_phase(&admin, &ns, "next", LeasePhase::Bound).await;
    assert_eq!(bound_uids(&next), [fresh.uid().unwrap()]);
    assert!(metrics.expiries(&ns) >= 1);

    // A renewed lease stays bound past its duration, then expires once renewals stop.
    let spare = make_proxy(&admin, &ns, &pool, "office-c", "198.51.100.3").await;
    create_lease(
        &admin,
        &ns,
        &lease_obj(
            "renewed",
            "office",
            serde_json::json!({"durationSeconds": 5, "service": false}),
        ),
    )
    .await;
    wait_phase(&admin, &ns, "renewed", LeasePhase::Bound).await;
    let leases = Api::<ProxyLease>::namespaced(admin.clone(), &ns);
    let began = Instant::now();
    while began.elapsed() < Duration::from_secs(12) {
        let renew = serde_json::json!({"spec": {"renewTime": jiff::Timestamp::now().to_string()}});
        leases
            .patch("renewed", &PatchParams::default(), &Patch::Merge(&renew))
            .await
            .unwrap();
        let l = get_lease(&admin, &ns, "renewed").await.unwrap();
        assert_eq!(phase(&l), Some(LeasePhase::Bound), "renewed in time");
        assert_eq!(bound_uids(&l), [spare.uid().unwrap()]);
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    wait_phase(&admin, &ns, "renewed", LeasePhase::Expired).await;

    // Reuse: the same proxy goes to the next lease as it is.
    let reuse = make_pool(
        &admin,
        &ns,
        "reuse",
        serde_json::json!({"leaseRecycle": "Reuse"}),
    )
    .await;
    let kept = make_proxy(&admin, &ns, &reuse, "reuse-a", "198.51.100.10").await;
    create_lease(
        &admin,
        &ns,
        &lease_obj(
            "r1",
            "reuse",
            serde_json::json!({"durationSeconds": 4, "service": false}),
        ),
    )
    .await;
    wait_phase(&admin, &ns, "r1", LeasePhase::Bound).await;
    wait_phase(&admin, &ns, "r1", LeasePhase::Expired).await;
    create_lease(
        &admin,
        &ns,
        &lease_obj("r2", "reuse", serde_json::json!({"service": false})),
    )
    .await;
    let r2 = wait_phase(&admin, &ns, "r2", LeasePhase::Bound).await;
    assert_eq!(bound_uids(&r2), [kept.uid().unwrap()]);
    let p = api.get("reuse-a").await.unwrap();
    assert!(!p.annotations().contains_key(DRAINING_ANNOTATION));

    // A deleted lease releases its proxy, then goes.
    leases.delete("r2", &DeleteParams::default()).await.unwrap();
    poll("r2 gone and reuse-a free", || async {
        let gone = get_lease(&admin, &ns, "r2").await.is_none();
        let p = api.get("reuse-a").await.ok()?;
        (gone && holder(&p).is_none()).then_some(())
    })
    .await;

    // A proxy whose lease vanished without releasing it (a finalizer removed by hand) is
    // found by the sweep and recycled.
    let orphan = make_proxy(&admin, &ns, &pool, "office-orphan", "198.51.100.20").await;
    let label = serde_json::json!({"metadata": {"labels": {LEASE_LABEL: "00000000-0000-0000-0000-000000000000"}}});
    api.patch(
        &orphan.name_any(),
        &PatchParams::default(),
        &Patch::Merge(&label),
    )
    .await
    .unwrap();
    poll("the orphaned proxy is recycled", || async {
        let p = api.get("office-orphan").await.ok()?;
        (holder(&p).is_none() && p.annotations().contains_key(DRAINING_ANNOTATION)).then_some(())
    })
    .await;

    leases
        .delete_collection(&DeleteParams::default(), &ListParams::default())
        .await
        .unwrap();
    poll("leases gone", || async {
        leases
            .list(&ListParams::default())
            .await
            .ok()?
            .items
            .is_empty()
            .then_some(())
    })
    .await;
    inst.shutdown().await;
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_proxy_is_given_up_and_the_lease_and_its_service_rebind_to_a_spare() {
    let _serial = SERIAL.lock().await;
    let s = setup("lease-loss").await;
    let (admin, ns) = (s.admin.clone(), s.ns.clone());
    let metrics = LeaseMetrics::default();
    let inst = instance(s.cp, &metrics, "replica-0").await;
    let pool = make_pool(&admin, &ns, "office", serde_json::json!({})).await;
    let ips = BTreeMap::from([
        ("office-a".to_string(), "198.51.100.1".to_string()),
        ("office-b".to_string(), "198.51.100.2".to_string()),
    ]);
    for (name, ip) in &ips {
        make_proxy(&admin, &ns, &pool, name, ip).await;
    }
    let lease = create_lease(
        &admin,
        &ns,
        &lease_obj(
            "crawler",
            "office",
            serde_json::json!({"rebindAfterSeconds": 1}),
        ),
    )
    .await;
    let bound = wait_phase(&admin, &ns, "crawler", LeasePhase::Bound).await;
    let first = bound.status.clone().unwrap().proxies[0].clone();
    let spare = ips.keys().find(|n| **n != first.name).unwrap().clone();
    let svc = poll("the lease's Service", || async {
        Api::<Service>::namespaced(admin.clone(), &ns)
            .get_opt("crawler")
            .await
            .ok()?
    })
    .await;
    assert!(
        svc.spec.as_ref().unwrap().selector.is_none(),
        "selector-less"
    );
    assert_eq!(svc.owner_references()[0].uid, lease.uid().unwrap());
    let want = BTreeSet::from([ips[&first.name].clone()]);
    poll("the slice lists the bound proxy", || async {
        (slice_addresses(&admin, &ns, "crawler").await? == want).then_some(())
    })
    .await;

    // A sampler watches the lease through the loss.
    let on = Arc::new(AtomicBool::new(true));
    let phases = Arc::new(Mutex::new(Vec::<LeasePhase>::new()));
    let sampler = {
        let (admin, ns, on, phases) = (admin.clone(), ns.clone(), on.clone(), phases.clone());
        tokio::spawn(async move {
            while on.load(Ordering::SeqCst) {
                if let Some(p) = get_lease(&admin, &ns, "crawler")
                    .await
                    .as_ref()
                    .and_then(phase)
                {
                    let mut ph = phases.lock().unwrap();
                    if ph.last() != Some(&p) {
                        ph.push(p);
                    }
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };
    set_serving(&admin, &ns, &first.name, &ips[&first.name], false).await;
    let rebound = poll("rebound to the spare", || async {
        get_lease(&admin, &ns, "crawler").await.filter(|l| {
            phase(l) == Some(LeasePhase::Bound)
                && l.status
                    .as_ref()
                    .unwrap()
                    .proxies
                    .first()
                    .map(|p| p.name.as_str())
                    == Some(spare.as_str())
        })
    })
    .await;
    on.store(false, Ordering::SeqCst);
    sampler.await.unwrap();
    let st = rebound.status.unwrap();
    assert_eq!(st.rebinds, 1);
    let want = BTreeSet::from([ips[&spare].clone()]);
    poll("the slice follows the rebind", || async {
        (slice_addresses(&admin, &ns, "crawler").await? == want).then_some(())
    })
    .await;
    // A deleted slice is put back.
    Api::<EndpointSlice>::namespaced(admin.clone(), &ns)
        .delete("crawler-ipv4", &DeleteParams::default())
        .await
        .unwrap();
    poll("the deleted slice is back", || async {
        (slice_addresses(&admin, &ns, "crawler").await? == want).then_some(())
    })
    .await;
    let lost = Api::<Proxy>::namespaced(admin.clone(), &ns)
        .get(&first.name)
        .await
        .unwrap();
    assert!(holder(&lost).is_none(), "the lost proxy is released");
    assert!(
        lost.annotations().contains_key(DRAINING_ANNOTATION),
        "and recycled"
    );
    let seen = phases.lock().unwrap().clone();
    println!("phases through the loss: {seen:?}");
    // The Lost step may be shorter than a sample; the event and the counter say it too.
    assert!(metrics.rebinds(&ns) >= 1);
    let events = Api::<k8s_openapi::api::events::v1::Event>::namespaced(admin.clone(), &ns)
        .list(&ListParams::default())
        .await
        .unwrap()
        .items;
    assert!(
        events
            .iter()
            .any(|e| e.reason.as_deref() == Some("ProxyLost")
                && e.note.as_deref().unwrap_or_default().contains(&first.name)),
        "a ProxyLost event names the proxy"
    );

    Api::<ProxyLease>::namespaced(admin.clone(), &ns)
        .delete("crawler", &DeleteParams::default())
        .await
        .unwrap();
    poll("lease gone", || async {
        get_lease(&admin, &ns, "crawler")
            .await
            .is_none()
            .then_some(())
    })
    .await;
    inst.shutdown().await;
    // The shipped RBAC covered every call of the lease controller: the API server
    // refused none of the ServiceAccount's requests.
    let user = integration_tests::harness::controlplane::operator_user();
    if let Some(audit) = s.cp.audit().unwrap() {
        let refused: Vec<_> = audit
            .iter()
            .filter(|r| r.user == user && r.code == 403)
            .collect();
        assert!(refused.is_empty(), "refused (403):\n{refused:#?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pools_scale_in_never_removes_a_leased_proxy() {
    let _serial = SERIAL.lock().await;
    let s = setup("lease-scale").await;
    let (admin, ns) = (s.admin.clone(), s.ns.clone());
    let metrics = LeaseMetrics::default();
    let inst = instance(s.cp, &metrics, "replica-0").await;
    let pool = make_pool(&admin, &ns, "office", serde_json::json!({"replicas": 3})).await;
    for i in 0..3 {
        make_proxy(
            &admin,
            &ns,
            &pool,
            &format!("office-{i}"),
            &format!("198.51.100.{}", i + 1),
        )
        .await;
    }
    let l = create_lease(
        &admin,
        &ns,
        &lease_obj("keep", "office", serde_json::json!({"service": false})),
    )
    .await;
    let bound = wait_phase(&admin, &ns, "keep", LeasePhase::Bound).await;
    let leased = bound.status.unwrap().proxies[0].name.clone();

    // Scale to 0 and run the pool's own reconcile (as the operator, the real planner).
    let pools = Api::<ProxyPool>::namespaced(admin.clone(), &ns);
    pools
        .patch(
            "office",
            &PatchParams::default(),
            &Patch::Merge(&serde_json::json!({"spec": {"replicas": 0}})),
        )
        .await
        .unwrap();
    let operator =
        s.cp.client_for(&s.cp.operator_kubeconfig().unwrap())
            .await
            .unwrap();
    let (_leading, leading_rx) = watch::channel(true);
    let fleet = Arc::new(FleetContext::new(
        operator,
        config(),
        Arc::new(LivenessBoard::default()),
        FleetMetrics::default(),
        leading_rx,
        None,
    ));
    let api = Api::<Proxy>::namespaced(admin.clone(), &ns);
    let left = poll("the unleased proxies scaled in", || async {
        let p = pools.get("office").await.ok()?;
        egress_operator::fleet::pool::reconcile(Arc::new(p), fleet.clone())
            .await
            .ok()?;
        let left: Vec<Proxy> = api
            .list(&ListParams::default())
            .await
            .ok()?
            .items
            .into_iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .collect();
        (left.len() == 1).then_some(left)
    })
    .await;
    assert_eq!(left[0].name_any(), leased);
    assert_eq!(holder(&left[0]), l.uid());
    assert!(!left[0].annotations().contains_key(DRAINING_ANNOTATION));
    let still = get_lease(&admin, &ns, "keep").await.unwrap();
    assert_eq!(phase(&still), Some(LeasePhase::Bound));

    Api::<ProxyLease>::namespaced(admin.clone(), &ns)
        .delete("keep", &DeleteParams::default())
        .await
        .unwrap();
    poll("lease gone", || async {
        get_lease(&admin, &ns, "keep").await.is_none().then_some(())
    })
    .await;
    inst.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_with_lease_surge_grows_for_a_waiting_lease_and_no_further() {
    let _serial = SERIAL.lock().await;
    let s = setup("lease-surge").await;
    let (admin, ns) = (s.admin.clone(), s.ns.clone());
    let metrics = LeaseMetrics::default();
    let inst = instance(s.cp, &metrics, "replica-0").await;
    let pool = make_pool(
        &admin,
        &ns,
        "office",
        serde_json::json!({"replicas": 1, "leaseSurge": 1}),
    )
    .await;
    let first = make_proxy(&admin, &ns, &pool, "office-first", "198.51.100.1").await;
    create_lease(
        &admin,
        &ns,
        &lease_obj("one", "office", serde_json::json!({"service": false})),
    )
    .await;
    let one = wait_phase(&admin, &ns, "one", LeasePhase::Bound).await;
    assert_eq!(bound_uids(&one), [first.uid().unwrap()]);
    for name in ["two", "three"] {
        create_lease(
            &admin,
            &ns,
            &lease_obj(name, "office", serde_json::json!({"service": false})),
        )
        .await;
    }
    wait_phase(&admin, &ns, "two", LeasePhase::Pending).await;
    wait_phase(&admin, &ns, "three", LeasePhase::Pending).await;

    // The pool's own reconcile, as the operator; the test plays the Proxy controller
    // (a new Proxy gets a serving status).
    let operator =
        s.cp.client_for(&s.cp.operator_kubeconfig().unwrap())
            .await
            .unwrap();
    let (_leading, leading_rx) = watch::channel(true);
    let fleet = Arc::new(FleetContext::new(
        operator,
        config(),
        Arc::new(LivenessBoard::default()),
        FleetMetrics::default(),
        leading_rx,
        None,
    ));
    let pools = Api::<ProxyPool>::namespaced(admin.clone(), &ns);
    let api = Api::<Proxy>::namespaced(admin.clone(), &ns);
    let mut next_ip = 10;
    let mut reconcile_and_serve = || {
        let (pools, api, fleet, admin, ns) = (
            pools.clone(),
            api.clone(),
            fleet.clone(),
            admin.clone(),
            ns.clone(),
        );
        next_ip += 1;
        let ip = format!("198.51.100.{next_ip}");
        async move {
            let p = pools.get("office").await.unwrap();
            egress_operator::fleet::pool::reconcile(Arc::new(p), fleet)
                .await
                .unwrap();
            for p in api.list(&ListParams::default()).await.unwrap().items {
                if p.status.as_ref().and_then(|s| s.address.clone()).is_none() {
                    set_serving(&admin, &ns, &p.name_any(), &ip, true).await;
                }
            }
        }
    };
    let bound = poll("a surged proxy bound to a waiting lease", || {
        let step = reconcile_and_serve();
        let admin = admin.clone();
        let ns = ns.clone();
        async move {
            step.await;
            let two = get_lease(&admin, &ns, "two").await?;
            let three = get_lease(&admin, &ns, "three").await?;
            [two, three]
                .into_iter()
                .find(|l| phase(l) == Some(LeasePhase::Bound))
        }
    })
    .await;
    // One surged proxy (leaseSurge 1): the other lease keeps waiting and the pool grows
    // no further, and removes none of the leased ones.
    for _ in 0..3 {
        reconcile_and_serve().await;
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let live: Vec<Proxy> = api
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|p| {
            p.metadata.deletion_timestamp.is_none()
                && !p.annotations().contains_key(DRAINING_ANNOTATION)
        })
        .collect();
    assert_eq!(live.len(), 2, "replicas 1 + leaseSurge 1");
    assert!(live.iter().all(|p| holder(p).is_some()), "both leased");
    let other = if bound.name_any() == "two" {
        "three"
    } else {
        "two"
    };
    let waiting = get_lease(&admin, &ns, other).await.unwrap();
    assert_eq!(phase(&waiting), Some(LeasePhase::Pending));

    Api::<ProxyLease>::namespaced(admin.clone(), &ns)
        .delete_collection(&DeleteParams::default(), &ListParams::default())
        .await
        .unwrap();
    poll("leases gone", || async {
        Api::<ProxyLease>::namespaced(admin.clone(), &ns)
            .list(&ListParams::default())
            .await
            .ok()?
            .items
            .is_empty()
            .then_some(())
    })
    .await;
    inst.shutdown().await;
}
