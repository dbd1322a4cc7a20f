#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! End-to-end test of the Proxy controller against a real Kubernetes API server: the local
//! control plane of the test harness (etcd and kube-apiserver built here, see
//! `integration_tests::harness::ControlPlane`), or the cluster of `KUBECONFIG` when set
//! (kind, k3d). It never skips. It:
//!
//! 1. applies both CRDs from `config/crd/bases` with server-side apply and waits until they
//!    are Established;
//! 2. creates a throwaway namespace `egress-e2e-<suffix>`, deleted at the end by a guard,
//!    also when the test fails (it strips our finalizer from Proxies left behind, so the
//!    namespace never hangs in `Terminating`);
//! 3. runs the controller in-process, with a [`FakeProvider`] registered as `kvm2`
//!    (hosts `h1`, `h2`) in place of libvirt, so no VM host is needed;
//! 4. creates a user-data Secret and a Proxy, and waits for `Ready=True` with an address;
//!    checks the finalizer, `status.instanceId` (an instance the fake holds), the printer
//!    columns as the API server renders them (a `Table` request) and the `Created` event;
//! 5. deletes the instance behind the controller's back and waits for the replacement
//!    and the `InstanceLost` event;
//! 6. deletes the Proxy and waits until it is gone and the fake holds nothing for it;
//! 7. checks that the CRD schema refuses an invalid Proxy (422) and that the CEL rule
//!    refuses a change of `spec` (422, "immutable");
//! 8. stops the controller and deletes the namespace.
//!
//! The controller watches Proxies in **all** namespaces, as the operator does: with
//! `KUBECONFIG`, use a throwaway cluster, not one where an egress-operator already runs
//! (this test's controller, whose provider is a fake, would reconcile its Proxies too).
//! The operator itself, as a process with its ServiceAccount's RBAC, is tested in
//! `operator_process.rs`.
//!
//! Every wait has a hang guard ([`GUARD`]): a stuck API server fails the test with a
//! message naming the step, never hangs it.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use egress_operator::api::provider_health::ProviderHealth;
use egress_operator::api::proxy::{
    GROUP, Proxy, ProxySpec, ProxyStatus, SecretKeyRef, UserDataSource,
};
use egress_operator::controller::{self, ControllerMetrics, FINALIZER};
use egress_operator::provider::fake::FakeProvider;
use egress_operator::provider::registry::Registry;
use egress_operator::provider::{InstanceId, Provider};
use integration_tests::harness::ControlPlane;
use k8s_openapi::api::core::v1::{Namespace, Secret};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{DeleteParams, ListParams, ObjectMeta, Patch, PatchParams, PostParams};
use kube::runtime::wait::{await_condition, conditions};
use kube::{Api, Client, CustomResourceExt, ResourceExt};

/// Hang guard of every wait and request: generous, never a performance assertion.
const GUARD: Duration = Duration::from_secs(120);
/// How long the first request may take before the cluster counts as unreachable.
const REACH_GUARD: Duration = Duration::from_secs(30);
const PROXY: &str = "e2e-proxy";
const PINNED: &str = "e2e-pinned";
const SECRET: &str = "e2e-user-data";
const SECRET_KEY: &str = "user-data";
/// The address the fake gives every instance.
const FAKE_ADDRESS: &str = "192.0.2.10";

/// Providers config of the in-process controller: the fake stands in for kvm2, so none of
/// the hosts, keys or plugins below is ever contacted or read.
const CONFIG: &str = r#"
clusterId: e2e
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
  machineTypes:
    - {name: tiny, vcpus: 1, memoryMiB: 512, diskGiB: 4}
  defaults: {machineType: tiny, image: debian-12}
  templates:
    domain: {path: /nonexistent/domain.wasm}
    vendorData: {path: /nonexistent/vendor-data.wasm}
serving: {periodSeconds: 5, timeoutSeconds: 2}
"#;

/// The fake's proxies, in memory: every probe is answered `200` without any network (the
/// fake's addresses are documentation addresses nothing may be sent to).
struct InMemoryProxies;

impl egress_operator::serving::Dialer for InMemoryProxies {
    fn dial(
        &self,
        _: std::net::SocketAddr,
    ) -> egress_operator::serving::BoxFuture<
        '_,
        std::io::Result<Box<dyn egress_operator::serving::ProbeStream>>,
    > {
        Box::pin(async {
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

/// An error and its sources, on one line ("client error (Connect): connection refused").
fn chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let text = s.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = s.source();
    }
    out
}

/// Runs `fut` under the hang guard; a timeout or an error fails the test naming `what`.
async fn step<T, E: std::error::Error>(
    what: &str,
    limit: Duration,
    fut: impl Future<Output = Result<T, E>>,
) -> T {
    match tokio::time::timeout(limit, fut).await {
        Ok(Ok(v)) => v,
        Ok(Err(e)) => panic!("{what}: {}", chain(&e)),
        Err(_) => panic!("{what}: no answer within {limit:?} (hang guard)"),
    }
}

/// Polls `probe` every second until it yields a value, under the hang guard.
async fn poll<T, F, Fut>(what: &str, mut probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + GUARD;
    loop {
        if let Some(v) = probe().await {
            return v;
        }
        if tokio::time::Instant::now() >= deadline {
            panic!("{what}: not seen within {GUARD:?} (hang guard)");
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// The HTTP status of an API error, if it is one.
fn api_code(e: &kube::Error) -> Option<u16> {
    match e {
        kube::Error::Api(s) => Some(s.code),
        _ => None,
    }
}

/// A short random-enough suffix for the namespace name (no RNG crate needed).
fn suffix() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    let mixed = (nanos as u64) ^ (u64::from(std::process::id()) << 32);
    format!("{:08x}", mixed & 0xffff_ffff)
}

fn is_ready(p: &Proxy) -> bool {
    let Some(s) = &p.status else { return false };
    let ready = s
        .conditions
        .iter()
        .any(|c| c.type_ == "Ready" && c.status == "True");
    ready && s.address.is_some() && s.instance_id.is_some()
}

fn status_of(p: &Proxy) -> ProxyStatus {
    p.status.clone().unwrap_or_default()
}

/// Deletes the namespace on drop, also while a failed assertion unwinds: stops our
/// controller first (its shutdown sender), deletes the namespace, then strips our
/// finalizer from any Proxy still in it, so the namespace can go even though the
/// controller no longer runs.
struct NamespaceGuard {
    client: Client,
    name: String,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
}

impl NamespaceGuard {
    fn stop_controller(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }

    async fn cleanup(client: Client, ns: String) -> Result<(), kube::Error> {
        let namespaces = Api::<Namespace>::all(client.clone());
        match namespaces.delete(&ns, &DeleteParams::background()).await {
            Ok(_) => {}
            Err(e) if api_code(&e) == Some(404) => return Ok(()),
            Err(e) => return Err(e),
        }
        let proxies = Api::<Proxy>::namespaced(client, &ns);
        for p in proxies.list(&ListParams::default()).await? {
            if p.finalizers().is_empty() {
                continue;
            }
            let body = serde_json::json!({"metadata": {"finalizers": null}});
            match proxies
                .patch(&p.name_any(), &PatchParams::default(), &Patch::Merge(&body))
                .await
            {
                Ok(_) => println!(
                    "cleanup: stripped the finalizer of Proxy {ns}/{}",
                    p.name_any()
                ),
                Err(e) if api_code(&e) == Some(404) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

impl Drop for NamespaceGuard {
    fn drop(&mut self) {
        self.stop_controller();
        let ns = self.name.clone();
        let client = self.client.clone();
        let Ok(handle) = tokio::runtime::Handle::try_current() else {
            eprintln!(
                "cleanup: no runtime; delete namespace {ns} by hand (kubectl delete ns {ns})"
            );
            return;
        };
        let result = tokio::task::block_in_place(|| {
            handle.block_on(tokio::time::timeout(
                Duration::from_secs(60),
                Self::cleanup(client, ns.clone()),
            ))
        });
        match result {
            Ok(Ok(())) => println!("cleanup: namespace {ns} is being deleted"),
            Ok(Err(e)) => eprintln!("cleanup: deleting namespace {ns} failed: {e}"),
            Err(_) => eprintln!("cleanup: deleting namespace {ns} timed out"),
        }
    }
}

/// Events in `ns` about the object `name` with this reason.
async fn events_for(client: &Client, ns: &str, name: &str, reason: &str) -> Vec<Event> {
    let events = Api::<Event>::namespaced(client.clone(), ns);
    match events.list(&ListParams::default()).await {
        Ok(list) => list
            .items
            .into_iter()
            .filter(|e| {
                e.reason.as_deref() == Some(reason)
                    && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name)
            })
            .collect(),
        Err(e) => {
            eprintln!("listing events in {ns}: {e} (retrying)");
            Vec::new()
        }
    }
}

async fn wait_for_event(client: &Client, ns: &str, name: &str, reason: &str) -> Event {
    poll(&format!("event {reason} for Proxy {ns}/{name}"), || async {
        events_for(client, ns, name, reason)
            .await
            .into_iter()
            .next()
    })
    .await
}

/// The Proxy as `kubectl get` shows it: column name → cell, rendered by the API server
/// from the CRD's printer columns.
async fn printer_columns(client: &Client, ns: &str, name: &str) -> BTreeMap<String, String> {
    let req = http::Request::get(format!(
        "/apis/{GROUP}/v1alpha1/namespaces/{ns}/proxies/{name}"
    ))
    .header(
        http::header::ACCEPT,
        "application/json;as=Table;v=v1;g=meta.k8s.io",
    )
    .body(Vec::new())
    .unwrap();
    let text = step("get the Proxy as a Table", GUARD, client.request_text(req)).await;
    let table: serde_json::Value = serde_json::from_str(&text).unwrap();
    let names: Vec<String> = table["columnDefinitions"]
        .as_array()
        .unwrap_or_else(|| panic!("no columnDefinitions in {table}"))
        .iter()
        .map(|c| c["name"].as_str().unwrap_or_default().to_string())
        .collect();
    let cells = table["rows"][0]["cells"]
        .as_array()
        .unwrap_or_else(|| panic!("no rows in {table}"));
    names
        .into_iter()
        .zip(cells.iter())
        .map(|(n, c)| {
            let v = match c {
                serde_json::Value::String(s) => s.clone(),
                serde_json::Value::Null => String::new(),
                other => other.to_string(),
            };
            (n, v)
        })
        .collect()
}

fn proxy(name: &str, spec: ProxySpec) -> Proxy {
    Proxy::new(name, spec)
}

fn kvm2_spec() -> ProxySpec {
    ProxySpec {
        provider: "kvm2".into(),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn proxy_lifecycle_on_a_real_cluster() {
    // ---- Connect -------------------------------------------------------------------
    let plane = ControlPlane::shared().unwrap_or_else(|e| panic!("{e:#}"));
    let client = plane.client().await.unwrap_or_else(|e| panic!("{e:#}"));
    let version = step(
        "reach the API server (is the control plane up?)",
        REACH_GUARD,
        client.apiserver_version(),
    )
    .await;
    println!(
        "cluster: {} ({}), Kubernetes {}",
        plane.server().unwrap_or_default(),
        if plane.is_local() {
            "local control plane"
        } else {
            "KUBECONFIG"
        },
        version.git_version
    );

    // ---- 1. CRDs ---------------------------------------------------------------------
    // As a platform team installs them: the committed manifests, by server-side apply.
    plane
        .install_crds()
        .await
        .unwrap_or_else(|e| panic!("{e:#}"));
    let crds = Api::<CustomResourceDefinition>::all(client.clone());
    for crd in [Proxy::crd(), ProviderHealth::crd()] {
        let name = crd.name_any();
        step(
            &format!("wait for CRD {name} to be Established"),
            GUARD,
            await_condition(crds.clone(), &name, conditions::is_crd_established()),
        )
        .await;
        println!("1. CRD {name} applied and Established");
    }

    // ---- 2. Namespace ----------------------------------------------------------------
    let ns = format!("egress-e2e-{}", suffix());
    let namespaces = Api::<Namespace>::all(client.clone());
    let namespace = Namespace {
        metadata: ObjectMeta {
            name: Some(ns.clone()),
            labels: Some(BTreeMap::from([(
                "app.kubernetes.io/created-by".to_string(),
                "egress-operator-e2e".to_string(),
            )])),
            ..Default::default()
        },
        ..Default::default()
    };
    step(
        &format!("create namespace {ns}"),
        GUARD,
        namespaces.create(&PostParams::default(), &namespace),
    )
    .await;
    let (shutdown_tx, shutdown_rx) = tokio::sync::oneshot::channel::<()>();
    let mut guard = NamespaceGuard {
        client: client.clone(),
        name: ns.clone(),
        shutdown: Some(shutdown_tx),
    };
    println!("2. namespace {ns} created");

    // ---- 3. Controller ---------------------------------------------------------------
    let valid =
        egress_operator::config::parse(CONFIG, "cluster-e2e.yaml", std::path::Path::new("/"))
            .unwrap_or_else(|e| panic!("the test's providers config: {e}"));
    let fake = Arc::new(FakeProvider::named("kvm2", &["h1", "h2"]));
    let mut registry = Registry::new();
    registry.insert(fake.clone());
    let mut ctx = controller::Context::new(
        client.clone(),
        Arc::new(valid),
        Arc::new(registry),
        ControllerMetrics::default(),
        Some("cluster-e2e".into()),
    );
    // A ready Proxy is looked at again every few seconds instead of every few minutes
    // (probed every `serving.periodSeconds`, asked of the provider at most every
    // `ready_refresh`), so the loss in step 5 is noticed quickly. Its probes stay in memory.
    ctx.policy.ready_refresh = Duration::from_secs(2);
    ctx.prober = egress_operator::serving::Prober::with_dialer(
        &ctx.config.serving,
        Arc::new(InMemoryProxies),
        ctx.metrics.probes.clone(),
    );
    let controller_task = tokio::spawn(controller::run(Arc::new(ctx), 2, async move {
        let _ = shutdown_rx.await;
    }));
    println!("3. controller running in-process (fake kvm2 provider, hosts h1 and h2)");

    // ---- 4. Secret, Proxy, Ready -----------------------------------------------------
    let secrets = Api::<Secret>::namespaced(client.clone(), &ns);
    let secret = Secret {
        metadata: ObjectMeta {
            name: Some(SECRET.into()),
            // The opt-in label: the operator uses no Secret without it.
            labels: Some(BTreeMap::from([(
                "egress-operator.dev/user-data".to_string(),
                "true".to_string(),
            )])),
            ..Default::default()
        },
        string_data: Some(BTreeMap::from([(
            SECRET_KEY.to_string(),
            "#cloud-config\nhostname: e2e\n".to_string(),
        )])),
        ..Default::default()
    };
    step(
        "create the user-data Secret",
        GUARD,
        secrets.create(&PostParams::default(), &secret),
    )
    .await;
    let proxies = Api::<Proxy>::namespaced(client.clone(), &ns);
    let spec = ProxySpec {
        user_data: Some(UserDataSource {
            secret_ref: SecretKeyRef {
                name: SECRET.into(),
                key: SECRET_KEY.into(),
            },
        }),
        ..kvm2_spec()
    };
    let created = step(
        "create the Proxy",
        GUARD,
        proxies.create(&PostParams::default(), &proxy(PROXY, spec)),
    )
    .await;
    let uid = created.uid().expect("the API server sets metadata.uid");
    let ready = step(
        &format!("wait for Proxy {ns}/{PROXY} to be Ready with an address"),
        GUARD,
        await_condition(proxies.clone(), PROXY, |p: Option<&Proxy>| {
            p.is_some_and(is_ready)
        }),
    )
    .await
    .expect("a Proxy that is Ready exists");
    let s = status_of(&ready);
    assert!(
        ready.finalizers().iter().any(|f| f == FINALIZER),
        "finalizer {FINALIZER} missing: {:?}",
        ready.finalizers()
    );
    let instance_id = s.instance_id.clone().unwrap();
    let held = fake.instances();
    let instance = held
        .iter()
        .find(|i| i.id.to_string() == instance_id)
        .unwrap_or_else(|| panic!("status.instanceId {instance_id} is not in the fake: {held:?}"));
    assert_eq!(
        instance.proxy.uid, uid,
        "the instance belongs to another Proxy"
    );
    assert_eq!(instance.proxy.namespace, ns);
    assert_eq!(instance.proxy.name, PROXY);
    assert_eq!(s.address.as_deref(), Some(FAKE_ADDRESS));
    assert_eq!(s.host.as_deref(), Some(instance.id.host.as_str()));
    let requests = fake.create_requests();
    assert_eq!(requests.len(), 1, "one create for one Proxy");
    assert!(
        requests[0].user_data.is_some(),
        "the Secret's user-data did not reach the provider"
    );
    let columns = printer_columns(&client, &ns, PROXY).await;
    assert_eq!(
        columns.get("Host").map(String::as_str),
        Some(instance.id.host.as_str()),
        "printer columns: {columns:?}"
    );
    assert_eq!(
        columns.get("Address").map(String::as_str),
        Some(FAKE_ADDRESS),
        "printer columns: {columns:?}"
    );
    assert_eq!(
        columns.get("Ready").map(String::as_str),
        Some("True"),
        "printer columns: {columns:?}"
    );
    wait_for_event(&client, &ns, PROXY, "Created").await;
    println!(
        "4. Proxy {ns}/{PROXY} Ready at {FAKE_ADDRESS} on {instance_id}; finalizer, printer columns and Created event present"
    );

    // ---- 5. Loss and replacement -----------------------------------------------------
    let id = InstanceId::parse(&instance_id)
        .unwrap_or_else(|e| panic!("status.instanceId {instance_id}: {e}"));
    step("delete the instance in the fake", GUARD, fake.delete(&id)).await;
    wait_for_event(&client, &ns, PROXY, "InstanceLost").await;
    let replaced = poll("the replacement instance", || async {
        if fake.create_requests().len() < 2 {
            return None;
        }
        let p = proxies.get(PROXY).await.ok()?;
        if !is_ready(&p) {
            return None;
        }
        let id = status_of(&p).instance_id?;
        fake.instances()
            .iter()
            .any(|i| i.id.to_string() == id && i.proxy.uid == uid)
            .then_some(id)
    })
    .await;
    wait_for_event(&client, &ns, PROXY, "Replaced").await;
    println!("5. lost instance noticed (InstanceLost) and replaced by {replaced}");

    // ---- 6. Deletion through the finalizer -------------------------------------------
    step(
        "delete the Proxy",
        GUARD,
        proxies.delete(PROXY, &DeleteParams::default()),
    )
    .await;
    step(
        &format!("wait for Proxy {ns}/{PROXY} to be gone"),
        GUARD,
        await_condition(proxies.clone(), PROXY, conditions::is_deleted(&uid)),
    )
    .await;
    let left: Vec<_> = fake
        .instances()
        .into_iter()
        .filter(|i| i.proxy.uid == uid)
        .collect();
    assert!(left.is_empty(), "instances left after deletion: {left:?}");
    println!("6. Proxy deleted; the finalizer deleted its instance");

    // ---- 7. Schema and CEL at the API server -----------------------------------------
    let bad_provider = ProxySpec {
        provider: "nope".into(),
        ..Default::default()
    };
    let bad_machine_type = ProxySpec {
        machine_type: Some("Not_A_Label".into()),
        ..kvm2_spec()
    };
    for (name, spec, field) in [
        ("e2e-bad-provider", bad_provider, "spec.provider"),
        ("e2e-bad-machine-type", bad_machine_type, "spec.machineType"),
    ] {
        let result = tokio::time::timeout(
            GUARD,
            proxies.create(&PostParams::default(), &proxy(name, spec)),
        )
        .await
        .unwrap_or_else(|_| panic!("create {name}: no answer within {GUARD:?}"));
        match result {
            Err(e) if api_code(&e) == Some(422) => {
                assert!(
                    e.to_string().contains(field),
                    "422 does not name {field}: {e}"
                );
            }
            Err(e) => panic!("create {name}: expected 422 from the schema, got {e}"),
            Ok(_) => panic!("the API server accepted the invalid Proxy {name}"),
        }
    }
    let pinned_spec = ProxySpec {
        host: Some("h1".into()),
        ..kvm2_spec()
    };
    let pinned = step(
        "create the pinned Proxy",
        GUARD,
        proxies.create(&PostParams::default(), &proxy(PINNED, pinned_spec)),
    )
    .await;
    let pinned_uid = pinned.uid().expect("the API server sets metadata.uid");
    let change = serde_json::json!({"spec": {"host": "h2"}});
    let result = tokio::time::timeout(
        GUARD,
        proxies.patch(PINNED, &PatchParams::default(), &Patch::Merge(&change)),
    )
    .await
    .unwrap_or_else(|_| panic!("patch {PINNED}: no answer within {GUARD:?}"));
    match result {
        Err(e) if api_code(&e) == Some(422) => {
            assert!(
                e.to_string().contains("immutable"),
                "422 without \"immutable\": {e}"
            );
        }
        Err(e) => panic!("patch spec.host: expected 422 from the CEL rule, got {e}"),
        Ok(p) => panic!("the API server accepted a spec change: {:?}", p.spec),
    }
    let unchanged = step("get the pinned Proxy", GUARD, proxies.get(PINNED)).await;
    assert_eq!(unchanged.spec.host.as_deref(), Some("h1"));
    step(
        "delete the pinned Proxy",
        GUARD,
        proxies.delete(PINNED, &DeleteParams::default()),
    )
    .await;
    step(
        &format!("wait for Proxy {ns}/{PINNED} to be gone"),
        GUARD,
        await_condition(proxies.clone(), PINNED, conditions::is_deleted(&pinned_uid)),
    )
    .await;
    println!(
        "7. schema refused spec.provider and spec.machineType (422); CEL refused a spec change (422, immutable)"
    );

    // ---- 8. Stop and clean up --------------------------------------------------------
    guard.stop_controller();
    step(
        "controller shutdown",
        GUARD + controller::SHUTDOWN_WAIT_HINT,
        controller_task,
    )
    .await;
    drop(guard);
    println!("8. controller stopped; namespace {ns} deleted");
}
