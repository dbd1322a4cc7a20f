#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! `ProxyPool` and discovery on the real control plane (issue 23's "done when").
//!
//! The operator's parts run in-process as its ServiceAccount (the shipped `config/rbac`,
//! the fleet's rules included): the Proxy controller over a [`FakeProvider`]
//! (hosts `h1`, `h2`), and the pool, discovery and liveness controllers. The fake's proxies
//! live in memory: every probe (the Proxy controller's slow one and the fast liveness one)
//! is answered by an in-memory dialer, so no packet leaves the process, and a test turns a
//! proxy "off" by refusing its address there.
//!
//! One test walks the whole story, as each step builds on the last:
//!
//! 1. a pool of 3 over 2 hosts converges (at most 2 per host), its Service (no selector,
//!    the proxy port) and its IPv4 EndpointSlice list the 3 proxies, ready;
//! 2. a template change rolls it surge-first while a sampler reads the slice every 100 ms:
//!    the ready endpoints never drop below 3 (invariant F2);
//! 3. a deleted slice and a hand-edited one are put back;
//! 4. `kubectl scale` to 5, one proxy stops serving (it leaves the slice; the time is
//!    printed), `kubectl scale` to 2 removes it first and then the newest.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::future::Future;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use egress_operator::api::proxy::Proxy;
use egress_operator::api::proxy_pool::{POOL_LABEL, ProxyPool, TEMPLATE_HASH_LABEL};
use egress_operator::config::ValidConfig;
use egress_operator::controller::{self, ControllerMetrics};
use egress_operator::fleet::liveness::{Liveness, LivenessOptions};
use egress_operator::fleet::pool::FleetContext;
use egress_operator::fleet::{FleetMetrics, LivenessBoard};
use egress_operator::provider::fake::FakeProvider;
use egress_operator::provider::registry::Registry;
use egress_operator::provider::{
    BoxFuture, CreateRequest, Instance, InstanceId, Provider, ProviderError, TargetListing,
};
use egress_operator::serving::{Dialer, ProbeStream};
use integration_tests::harness::ControlPlane;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client, ResourceExt};
use tokio::time::Instant;

/// Hang guard of every wait: generous, never a performance assertion.
const GUARD: Duration = Duration::from_secs(180);
const POOL: &str = "office";
const PORT: i32 = 3128;

const CONFIG: &str = r#"
clusterId: fleet
kvm2:
  ssh:
    user: egress
    privateKeyFile: /nonexistent/id_ed25519
    knownHostsFile: /nonexistent/known_hosts
  hosts:
    - {name: h1, address: "192.0.2.1", storagePool: default, bridge: br0}
    - {name: h2, address: "192.0.2.2", storagePool: default, bridge: br0}
  images:
    - name: debian-12
      url: https://images.example.org/debian-12.qcow2
      sha256: "1111111111111111111111111111111111111111111111111111111111111111"
      format: qcow2
    - name: debian-13
      url: https://images.example.org/debian-13.qcow2
      sha256: "2222222222222222222222222222222222222222222222222222222222222222"
      format: qcow2
  machineTypes:
    - {name: tiny, vcpus: 1, memoryMiB: 512, diskGiB: 4}
  defaults: {machineType: tiny, image: debian-12}
  templates:
    domain: {path: /nonexistent/domain.wasm}
    vendorData: {path: /nonexistent/vendor-data.wasm}
serving: {periodSeconds: 5, timeoutSeconds: 2}
"#;

/// The fake provider with one address per instance (the fake gives all the same one),
/// from 198.51.100.0/24 (documentation addresses: nothing is ever sent there).
struct DistinctAddresses {
    inner: FakeProvider,
    given: Mutex<HashMap<String, Ipv4Addr>>,
}

impl DistinctAddresses {
    fn fix(&self, mut i: Instance) -> Instance {
        let mut given = self.given.lock().unwrap();
        let next = u8::try_from(given.len() + 1).unwrap();
        let ip = *given
            .entry(i.id.name.clone())
            .or_insert(Ipv4Addr::new(198, 51, 100, next));
        i.addresses = vec![IpAddr::V4(ip)];
        i
    }
}

impl Provider for DistinctAddresses {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn create<'a>(
        &'a self,
        req: &'a CreateRequest,
    ) -> BoxFuture<'a, Result<Instance, ProviderError>> {
        Box::pin(async move { self.inner.create(req).await.map(|i| self.fix(i)) })
    }
    fn get<'a>(&'a self, id: &'a InstanceId) -> BoxFuture<'a, Result<Instance, ProviderError>> {
        Box::pin(async move { self.inner.get(id).await.map(|i| self.fix(i)) })
    }
    fn delete<'a>(&'a self, id: &'a InstanceId) -> BoxFuture<'a, Result<(), ProviderError>> {
        self.inner.delete(id)
    }
    fn list(&self) -> BoxFuture<'_, Vec<TargetListing>> {
        self.inner.list()
    }
}

/// In-memory proxies: every address answers like a proxy except those in `down`.
#[derive(Default)]
struct InMemoryProxies {
    down: Mutex<HashSet<IpAddr>>,
}

impl Dialer for InMemoryProxies {
    fn dial(
        &self,
        addr: SocketAddr,
    ) -> egress_operator::serving::BoxFuture<'_, std::io::Result<Box<dyn ProbeStream>>> {
        let down = self.down.lock().unwrap().contains(&addr.ip());
        Box::pin(async move {
            if down {
                return Err(std::io::ErrorKind::ConnectionRefused.into());
            }
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
            Ok(Box::new(client) as Box<dyn ProbeStream>)
        })
    }
}

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

/// The ready addresses the IPv4 slice lists (None: no slice).
async fn ready_in_slice(client: &Client, ns: &str) -> Option<BTreeSet<String>> {
    let s = Api::<EndpointSlice>::namespaced(client.clone(), ns)
        .get_opt(&format!("{POOL}-ipv4"))
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

async fn proxies(client: &Client, ns: &str) -> Vec<Proxy> {
    Api::<Proxy>::namespaced(client.clone(), ns)
        .list(&ListParams::default().labels(POOL_LABEL))
        .await
        .map(|l| l.items)
        .unwrap_or_default()
}

fn address(p: &Proxy) -> Option<String> {
    p.status.as_ref()?.address.clone()
}

fn pool_status(p: &ProxyPool) -> (i32, i32, i32) {
    let s = p.status.clone().unwrap_or_default();
    (s.replicas, s.updated_replicas, s.available_replicas)
}

/// Waits until the pool has exactly `n` proxies of the current template, all serving and
/// listed ready, none draining; returns them.
async fn settled(client: &Client, ns: &str, n: usize) -> Vec<Proxy> {
    let pools = Api::<ProxyPool>::namespaced(client.clone(), ns);
    poll(&format!("pool settled at {n}"), || async {
        let pool = pools.get(POOL).await.ok()?;
        let hash = pool.spec.template.hash();
        let n32 = i32::try_from(n).unwrap();
        if pool_status(&pool) != (n32, n32, n32) {
            return None;
        }
        let ps = proxies(client, ns).await;
        let live: Vec<Proxy> = ps
            .into_iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .collect();
        if live.len() != n
            || live
                .iter()
                .any(|p| p.labels().get(TEMPLATE_HASH_LABEL) != Some(&hash))
        {
            return None;
        }
        let addrs: BTreeSet<String> = live.iter().filter_map(address).collect();
        (ready_in_slice(client, ns).await? == addrs && addrs.len() == n).then_some(live)
    })
    .await
}

fn per_host(ps: &[Proxy]) -> BTreeMap<String, usize> {
    let mut m = BTreeMap::new();
    for p in ps {
        *m.entry(p.spec.host.clone().unwrap_or_default())
            .or_insert(0) += 1;
    }
    m
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_converges_rolls_surge_first_keeps_its_slices_and_scales() {
    let cp = ControlPlane::shared().unwrap();
    cp.install_crds().await.unwrap();
    cp.install_rbac().unwrap();
    let admin = cp.client().await.unwrap();
    let operator = cp
        .client_for(&cp.operator_kubeconfig().unwrap())
        .await
        .unwrap();
    let ns_handle = cp.namespace("fleet").await.unwrap();
    let ns = ns_handle.name().to_string();

    // The operator's parts, in-process, as its ServiceAccount.
    let config: Arc<ValidConfig> = Arc::new(
        egress_operator::config::parse(CONFIG, "fleet.yaml", std::path::Path::new("/")).unwrap(),
    );
    let mut registry = Registry::new();
    registry.insert(Arc::new(DistinctAddresses {
        inner: FakeProvider::named("kvm2", &["h1", "h2"]),
        given: Mutex::default(),
    }));
    let dialer = Arc::new(InMemoryProxies::default());
    let metrics = ControllerMetrics::default();
    let mut ctx = controller::Context::new(
        operator.clone(),
        config.clone(),
        Arc::new(registry),
        metrics.clone(),
        None,
    );
    ctx.prober = egress_operator::serving::Prober::with_dialer(
        &config.serving,
        dialer.clone(),
        metrics.probes.clone(),
    );
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stop = move || {
        let mut rx = stop_rx.clone();
        async move {
            let _ = rx.wait_for(|s| *s).await;
        }
    };
    let board = Arc::new(LivenessBoard::default());
    let (_leading_tx, leading) = tokio::sync::watch::channel(true);
    let fleet_metrics = FleetMetrics::default();
    let fleet = Arc::new(FleetContext::new(
        operator.clone(),
        config.clone(),
        board.clone(),
        fleet_metrics.clone(),
        leading,
        None,
    ));
    let liveness = Liveness::new(
        board.clone(),
        LivenessOptions::default(),
        fleet_metrics.clone(),
    )
    .with_dialer(dialer.clone());
    let mut tasks = tokio::task::JoinSet::new();
    tasks.spawn(controller::run(Arc::new(ctx), 8, stop()));
    tasks.spawn(liveness.run(operator.clone(), stop()));
    tasks.spawn(egress_operator::fleet::pool::run(fleet.clone(), stop()));
    tasks.spawn(egress_operator::fleet::discovery::run(fleet, stop()));

    // 1. A pool of 3 over 2 hosts.
    let pools = Api::<ProxyPool>::namespaced(admin.clone(), &ns);
    let pool: ProxyPool = serde_json::from_value(serde_json::json!({
        "apiVersion": "egress-operator.dev/v1alpha1",
        "kind": "ProxyPool",
        "metadata": {"name": POOL},
        "spec": {
            "replicas": 3,
            "template": {"provider": "kvm2", "image": "debian-12"},
            "drainSeconds": 2
        }
    }))
    .unwrap();
    pools.create(&PostParams::default(), &pool).await.unwrap();
    let first = settled(&admin, &ns, 3).await;
    let spread = per_host(&first);
    println!("converged: {spread:?}");
    assert!(spread.values().all(|&n| n <= 2), "{spread:?}");
    assert_eq!(spread.len(), 2, "{spread:?}");
    for p in &first {
        assert!(
            p.name_any().starts_with(&format!("{POOL}-")),
            "{}",
            p.name_any()
        );
        let owner = &p.owner_references()[0];
        assert_eq!(
            (owner.kind.as_str(), owner.name.as_str()),
            ("ProxyPool", POOL)
        );
    }
    // At rest, a reconcile writes nothing: an annotation (no generation bump, a watch
    // event all the same) makes the pool controller and discovery look again, and they
    // leave the pool's status, Service and slices as they are.
    let status_writes = || {
        cp.operator_requests(|r| {
            ["proxypools/status", "services", "endpointslices"].contains(&r.resource.as_str())
                && r.verb == "patch"
                && r.namespace.as_deref() == Some(ns.as_str())
        })
        .unwrap()
    };
    // And reads nothing (issue 35, item 4): the pool controller and discovery judge a pool
    // at rest from their caches. Before, each look listed the pool's Proxies (both) and
    // the namespace's leases (the pool controller).
    let fleet_lists = || {
        cp.operator_requests(|r| {
            ["proxies", "proxyleases"].contains(&r.resource.as_str())
                && r.verb == "list"
                && r.namespace.as_deref() == Some(ns.as_str())
        })
        .unwrap()
    };
    // Let the last reconcile of the convergence land first.
    tokio::time::sleep(Duration::from_secs(6)).await;
    let before = status_writes();
    let lists_before = fleet_lists();
    pools
        .patch(
            POOL,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"metadata": {"annotations": {"touched": "yes"}}})),
        )
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        status_writes(),
        before,
        "a settled pool's reconcile wrote its unchanged status, Service or slices"
    );
    assert_eq!(
        fleet_lists(),
        lists_before,
        "a settled pool's reconcile listed its Proxies or leases instead of reading its caches"
    );
    let svc = Api::<Service>::namespaced(admin.clone(), &ns)
        .get(POOL)
        .await
        .unwrap();
    let spec = svc.spec.unwrap();
    assert!(spec.selector.is_none(), "selector-less");
    assert_eq!(spec.ports.unwrap()[0].port, PORT);
    let slice = Api::<EndpointSlice>::namespaced(admin.clone(), &ns)
        .get(&format!("{POOL}-ipv4"))
        .await
        .unwrap();
    assert_eq!(
        slice
            .labels()
            .get("endpointslice.kubernetes.io/managed-by")
            .map(String::as_str),
        Some("discovery.egress-operator.dev")
    );
    assert_eq!(
        slice
            .labels()
            .get("kubernetes.io/service-name")
            .map(String::as_str),
        Some(POOL)
    );

    // 2. A template change, sampled throughout.
    let sampling = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let samples = Arc::new(Mutex::new(Vec::<usize>::new()));
    let sampler = {
        let (client, ns, on, samples) =
            (admin.clone(), ns.clone(), sampling.clone(), samples.clone());
        tokio::spawn(async move {
            while on.load(std::sync::atomic::Ordering::SeqCst) {
                if let Some(ready) = ready_in_slice(&client, &ns).await {
                    samples.lock().unwrap().push(ready.len());
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };
    let patch = serde_json::json!({"spec": {"template": {"image": "debian-13"}}});
    pools
        .patch(POOL, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap();
    let rolled = settled(&admin, &ns, 3).await;
    sampling.store(false, std::sync::atomic::Ordering::SeqCst);
    sampler.await.unwrap();
    let samples = samples.lock().unwrap().clone();
    let min = samples.iter().min().copied().unwrap_or(0);
    println!(
        "rollout: {} samples of the slice, fewest ready {min}",
        samples.len()
    );
    assert!(samples.len() > 5, "too few samples: {samples:?}");
    assert!(min >= 3, "F2: ready endpoints fell to {min}: {samples:?}");
    let old: BTreeSet<String> = first.iter().map(|p| p.name_any()).collect();
    assert!(
        rolled.iter().all(|p| !old.contains(&p.name_any())),
        "all replaced"
    );
    assert_eq!(
        rolled
            .iter()
            .map(|p| p.spec.image.clone().unwrap())
            .collect::<BTreeSet<_>>(),
        BTreeSet::from(["debian-13".to_string()])
    );

    // 3. A deleted slice and a hand-edited one are put back.
    let want: BTreeSet<String> = rolled.iter().filter_map(address).collect();
    let slices = Api::<EndpointSlice>::namespaced(admin.clone(), &ns);
    slices
        .delete(&format!("{POOL}-ipv4"), &DeleteParams::default())
        .await
        .unwrap();
    poll("the deleted slice is back", || async {
        (ready_in_slice(&admin, &ns).await? == want).then_some(())
    })
    .await;
    let edit = serde_json::json!({"endpoints": [{"addresses": ["203.0.113.9"], "conditions": {"ready": true}}]});
    slices
        .patch(
            &format!("{POOL}-ipv4"),
            &PatchParams::default(),
            &Patch::Merge(&edit),
        )
        .await
        .unwrap();
    poll("the hand-edited slice is put back", || async {
        (ready_in_slice(&admin, &ns).await? == want).then_some(())
    })
    .await;
    Api::<Service>::namespaced(admin.clone(), &ns)
        .delete(POOL, &DeleteParams::default())
        .await
        .unwrap();
    poll("the deleted Service is back", || async {
        Api::<Service>::namespaced(admin.clone(), &ns)
            .get_opt(POOL)
            .await
            .ok()?
    })
    .await;

    // 4. kubectl scale to 5; one stops serving; scale to 2 removes it first.
    cp.kubectl_run(&[
        "scale",
        "-n",
        &ns,
        &format!("proxypool/{POOL}"),
        "--replicas=5",
    ])
    .unwrap();
    let five = settled(&admin, &ns, 5).await;
    let mut by_age = five.clone();
    by_age.sort_by_key(|p| p.metadata.creation_timestamp.clone().map(|t| t.0));
    let broken = by_age[0].clone();
    let broken_ip = address(&broken).unwrap();
    dialer
        .down
        .lock()
        .unwrap()
        .insert(broken_ip.parse().unwrap());
    let stopped = Instant::now();
    poll("the stopped proxy leaves the slice", || async {
        (!ready_in_slice(&admin, &ns).await?.contains(&broken_ip)).then_some(())
    })
    .await;
    println!(
        "a proxy that stopped serving left the slice after {:.2} s (bound 5 s)",
        stopped.elapsed().as_secs_f64()
    );
    cp.kubectl_run(&[
        "scale",
        "-n",
        &ns,
        &format!("proxypool/{POOL}"),
        "--replicas=2",
    ])
    .unwrap();
    let two = poll("scaled in to 2", || async {
        let live: Vec<Proxy> = proxies(&admin, &ns)
            .await
            .into_iter()
            .filter(|p| {
                p.metadata.deletion_timestamp.is_none()
                    && !p
                        .annotations()
                        .contains_key("egress-operator.dev/draining-since")
            })
            .collect();
        (live.len() == 2).then_some(live)
    })
    .await;
    let left: BTreeSet<String> = two.iter().map(|p| p.name_any()).collect();
    assert!(
        !left.contains(&broken.name_any()),
        "the non-serving proxy went first"
    );
    // Then the newest: the two oldest serving ones stay.
    let oldest_serving: BTreeSet<String> = by_age[1..3].iter().map(|p| p.name_any()).collect();
    assert_eq!(left, oldest_serving);
    let pool = pools.get(POOL).await.unwrap();
    assert_eq!(pool.spec.replicas, 2);
    assert!(fleet_metrics.actions(&ns, POOL, "created") >= 8);

    // Tear down while the controllers still run, so the Proxies' finalizers are honoured.
    pools
        .delete(POOL, &DeleteParams::background())
        .await
        .unwrap();
    poll("the pool's proxies are gone", || async {
        proxies(&admin, &ns).await.is_empty().then_some(())
    })
    .await;
    let _ = stop_tx.send(true);
    while tasks.join_next().await.is_some() {}
    drop(ns_handle);

    // The shipped RBAC covered every call of the pool, discovery and liveness controllers:
    // the API server refused none of the ServiceAccount's requests.
    let user = integration_tests::harness::controlplane::operator_user();
    if let Some(audit) = cp.audit().unwrap() {
        let refused: Vec<_> = audit
            .iter()
            .filter(|r| r.user == user && r.code == 403)
            .collect();
        assert!(refused.is_empty(), "refused (403):\n{refused:#?}");
    }
}
