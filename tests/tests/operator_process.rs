#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! The operator as an operator: `egress-operator run` as a process acting as its
//! ServiceAccount (`egress-system/egress-operator`, RBAC from `config/rbac` as shipped),
//! against the local control plane, with the real kvm2 provider over the harness's sshd
//! and libvirtd (QEMU). Controller, GC, health monitor and elector all run.
//!
//! The VM's image does not boot (a small blank qcow2), so the proxy itself is stood in for
//! on loopback: the host's static address pool is `127.77.0.0/24`, and a CONNECT responder
//! listens on those addresses, so the operator's real Serving probe passes once the domain
//! runs. Everything else is real: image download and verification, overlay, seed, domain
//! from the plugins, define, start, status by server-side apply, events, finalizer, delete.
//!
//! Any request of the operator the API server refused with 403 (read from the API
//! server's audit log) fails the test.

use std::collections::BTreeSet;
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use egress_operator::api::provider_health::ProviderHealth;
use egress_operator::api::proxy::Proxy;
use integration_tests::connect_responder::ConnectResponder;
use integration_tests::harness::controlplane::{OPERATOR_NAMESPACE, OPERATOR_SERVICE_ACCOUNT};
use integration_tests::harness::{self, ControlPlane, Libvirtd, Need, Sshd};
use integration_tests::http::{HttpServer, Route};
use integration_tests::monitoring;
use integration_tests::operator_process::{OperatorOptions, OperatorProcess};
use integration_tests::{TestImage, provider_config_yaml, small_qcow2};
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, PostParams};

/// Hang guard of every wait: generous, never a performance assertion.
const GUARD: Duration = Duration::from_secs(240);
/// The loopback addresses the static pool hands out, and the responder answers on.
const POOL_FIRST: u8 = 10;
const POOL_LAST: u8 = 19;

fn binary() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_operator-under-test"))
}

/// The sum of `egress_kube_requests_total` samples with this verb.
fn kube_requests(metrics: &str, verb: &str) -> u64 {
    let prefix = format!("egress_kube_requests_total{{verb=\"{verb}\"");
    metrics
        .lines()
        .filter(|l| l.starts_with(&prefix))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum()
}

fn pool_addresses() -> impl Iterator<Item = Ipv4Addr> {
    (POOL_FIRST..=POOL_LAST).map(|i| Ipv4Addr::new(127, 77, 0, i))
}

/// Polls `f` every 250 ms until it yields, under [`GUARD`]; the failure names `what` and
/// carries the operator's log.
async fn wait_for<T, Fut: std::future::Future<Output = Option<T>>>(
    what: &str,
    op: &OperatorProcess,
    mut f: impl FnMut() -> Fut,
) -> T {
    let start = Instant::now();
    loop {
        if let Some(v) = f().await {
            return v;
        }
        if start.elapsed() > GUARD {
            panic!(
                "{what}: not seen within {GUARD:?} (hang guard); the operator logged:\n{}",
                op.log()
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// How many times the operator's ServiceAccount listed Proxies (a watcher relists after
/// its watch expired); 0 against an external cluster (no audit log).
fn proxy_lists(plane: &ControlPlane) -> usize {
    let user = integration_tests::harness::controlplane::operator_user();
    plane.audit().unwrap().map_or(0, |audit| {
        audit
            .iter()
            .filter(|r| r.user == user && r.verb == "list" && r.resource == "proxies")
            .count()
    })
}

fn condition(p: &Proxy, type_: &str) -> Option<String> {
    p.status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == type_)
        .map(|c| c.status.clone())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_operator_runs_as_its_service_account_and_is_never_refused() {
    if harness::skip(&[Need::Sshd, Need::Libvirtd]) {
        return;
    }
    let plane = ControlPlane::shared().unwrap_or_else(|e| panic!("{e:#}"));
    plane.install_crds().await.unwrap();
    plane.install_rbac().unwrap();
    let operator_kubeconfig = plane.operator_kubeconfig().unwrap();
    let client = plane.client().await.unwrap();
    let ns = plane.namespace("egress-op").await.unwrap();

    // ---- The host: sshd, libvirtd with QEMU, an image server, the stand-in proxies ----
    let sshd = Sshd::start().unwrap();
    let libvirtd = Libvirtd::start().unwrap();
    libvirtd.define_dir_pool("default").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (image, sha) = small_qcow2(dir.path(), "operator-process").unwrap();
    let http = HttpServer::start(vec![("/base.qcow2".to_string(), Route::File(image))]).unwrap();
    let responder = ConnectResponder::start(pool_addresses()).unwrap();
    let images = [TestImage {
        name: "base".into(),
        url: http.url("/base.qcow2"),
        sha256: sha,
        max_size_mib: None,
    }];
    let mut yaml = provider_config_yaml(&sshd, &libvirtd, "h1", &images, &[]).unwrap();
    // As shipped: no clusterId, so the operator derives it from the cluster's UID.
    assert!(yaml.contains("clusterId: test\n"), "{yaml}");
    yaml = yaml.replacen("clusterId: test\n", "", 1);
    yaml = yaml.replacen(
        "disableKvm: true}",
        &format!(
            "disableKvm: true, addressPool: {{cidr: 127.77.0.0/24, rangeStart: 127.77.0.{POOL_FIRST}, \
             rangeEnd: 127.77.0.{POOL_LAST}}}, maxDomains: 8}}"
        ),
        1,
    );
    yaml.push_str(&format!(
        "serving: {{port: {}, periodSeconds: 5, timeoutSeconds: 2}}\n\
         healthCheck: {{periodSeconds: 5, timeoutSeconds: 3}}\n\
         gc: {{periodSeconds: 10, gracePeriodSeconds: 30}}\n",
        responder.port()
    ));
    let config = dir.path().join("providers-config.yaml");
    std::fs::write(&config, &yaml).unwrap();

    // ---- The operator, as its ServiceAccount ----------------------------------------
    let options = OperatorOptions::new(
        &binary(),
        &config,
        &operator_kubeconfig,
        "egress-operator-0",
        OPERATOR_NAMESPACE,
        dir.path(),
    );
    let mut op = OperatorProcess::start(&options).unwrap();
    op.wait_ready(GUARD).unwrap();
    println!("operator ready (leading) as {OPERATOR_NAMESPACE}/{OPERATOR_SERVICE_ACCOUNT}");

    // ---- A Proxy, from Secret to Ready -----------------------------------------------
    let secret: k8s_openapi::api::core::v1::Secret = serde_json::from_value(serde_json::json!({
        // The opt-in label: the operator uses no Secret without it.
        "metadata": {"name": "user-data", "labels": {"egress-operator.dev/user-data": "true"}},
        "stringData": {"user-data": "#cloud-config\nhostname: renamed-by-user-data\n"},
    }))
    .unwrap();
    Api::namespaced(client.clone(), ns.name())
        .create(&PostParams::default(), &secret)
        .await
        .unwrap();
    let proxies: Api<Proxy> = Api::namespaced(client.clone(), ns.name());
    let proxy: Proxy = serde_json::from_value(serde_json::json!({
        "apiVersion": "egress-operator.dev/v1alpha1",
        "kind": "Proxy",
        "metadata": {"name": "office"},
        "spec": {"provider": "kvm2", "userData": {"secretRef": {"name": "user-data", "key": "user-data"}}},
    }))
    .unwrap();
    let created = proxies
        .create(&PostParams::default(), &proxy)
        .await
        .unwrap();
    let uid = created.uid().unwrap();
    let ready = wait_for("the Proxy Ready with an address", &op, || async {
        let p = proxies.get("office").await.ok()?;
        (condition(&p, "Ready").as_deref() == Some("True")).then_some(p)
    })
    .await;
    let status = ready.status.clone().unwrap();
    let address: Ipv4Addr = status.address.clone().unwrap().parse().unwrap();
    assert!(
        pool_addresses().any(|a| a == address),
        "address {address} is not from the pool"
    );
    assert_eq!(status.host.as_deref(), Some("h1"));
    assert!(
        responder.answered() > 0,
        "Ready without a probe answered by the stand-in proxy"
    );
    println!("Proxy {}/office Ready at {address} on h1", ns.name());

    // Its mark names this cluster by the derived clusterId and the kube-system UID.
    let cluster_uid = Api::<k8s_openapi::api::core::v1::Namespace>::all(client.clone())
        .get("kube-system")
        .await
        .unwrap()
        .metadata
        .uid
        .unwrap();
    let domain_xml = libvirtd
        .virsh(&libvirtd.qemu_uri(), &["dumpxml", &format!("egress-{uid}")])
        .unwrap();
    let mark = egress_operator::provider::kvm2::metadata::mark_from_domain_xml(&domain_xml)
        .unwrap()
        .expect("the domain carries the mark");
    assert_eq!(mark.cluster_uid.as_deref(), Some(cluster_uid.as_str()));
    assert_eq!(
        mark.cluster_id,
        egress_operator::cluster_identity::derive_id(&cluster_uid)
    );

    // The health monitor wrote ProviderHealth for kvm2.
    let health: Api<ProviderHealth> = Api::all(client.clone());
    wait_for("ProviderHealth kvm2", &op, || async {
        health.get("kvm2").await.ok()
    })
    .await;

    // ---- ProviderHealth deleted by hand: the monitor writes it again -------------------
    let first = health.get("kvm2").await.unwrap().uid();
    health
        .delete("kvm2", &DeleteParams::default())
        .await
        .unwrap();
    wait_for("ProviderHealth kvm2 re-created", &op, || async {
        let h = health.get_opt("kvm2").await.ok()??;
        (h.uid() != first && h.status.is_some()).then_some(())
    })
    .await;
    println!("ProviderHealth kvm2 re-created after its deletion");

    // ---- /metrics: every metric and label the alerts and the dashboard read is exported --
    let (code, metrics) = op.http_get("/metrics").expect("GET /metrics");
    assert_eq!(code, 200, "{metrics}");
    let families = monitoring::families(&metrics);
    let registered = monitoring::registered_in_source();
    let mut problems = Vec::new();
    let mut unchecked = Vec::new();
    let queries = monitoring::alerts()
        .unwrap()
        .into_iter()
        .map(|a| (format!("alert {}", a.name), a.expr))
        .chain(
            monitoring::dashboard_queries()
                .unwrap()
                .into_iter()
                .map(|(id, q)| (format!("dashboard panel {id}"), q)),
        );
    for (what, expr) in queries {
        let (p, u) = monitoring::missing(&families, &registered, &what, &expr);
        problems.extend(p);
        unchecked.extend(u);
    }
    assert!(
        problems.is_empty(),
        "the monitoring reads what the operator does not export:\n{}\n/metrics:\n{metrics}",
        problems.join("\n")
    );
    unchecked.sort();
    unchecked.dedup();
    println!(
        "alerts and dashboard: every metric exported or registered; labels not checked for families without samples yet: {unchecked:?}"
    );
    // The object-state series describe what the cluster holds now.
    let proxies_running = format!(
        "egress_proxies{{namespace=\"{}\",phase=\"Running\"}} 1",
        ns.name()
    );
    assert!(metrics.contains(&proxies_running), "{metrics}");
    assert!(metrics.contains("egress_leader_is_leader 1"), "{metrics}");
    let counted_writes = kube_requests(&metrics, "PATCH");
    assert!(counted_writes > 0, "no PATCH counted:\n{metrics}");

    // ---- kube-apiserver restarts: the watches resume, a new Proxy is reconciled -------
    let lists_before = proxy_lists(plane);
    // While a restarted kube-apiserver starts, its authorizer may answer 403 before its
    // RBAC caches are filled (its port opens before `/readyz` passes, and the operator's
    // elector does not wait): requests received in that window are not the operator's
    // fault, and are left out of the "never refused" check below.
    let mut restart_window = None;
    if plane.is_local() {
        let stopping = jiff::Timestamp::now();
        plane.restart_apiserver().unwrap();
        restart_window = Some((stopping, jiff::Timestamp::now()));
    }
    let second: Proxy = serde_json::from_value(serde_json::json!({
        "apiVersion": "egress-operator.dev/v1alpha1",
        "kind": "Proxy",
        "metadata": {"name": "after-restart"},
        "spec": {"provider": "kvm2", "userData": {"secretRef": {"name": "user-data", "key": "user-data"}}},
    }))
    .unwrap();
    proxies
        .create(&PostParams::default(), &second)
        .await
        .unwrap();
    wait_for("the Proxy made after the restart Ready", &op, || async {
        let p = proxies.get("after-restart").await.ok()?;
        (condition(&p, "Ready").as_deref() == Some("True")).then_some(())
    })
    .await;
    println!(
        "after a kube-apiserver restart a new Proxy became Ready; the operator listed Proxies {} times before it, {} after",
        lists_before,
        proxy_lists(plane) - lists_before
    );
    proxies
        .delete("after-restart", &DeleteParams::default())
        .await
        .unwrap();
    wait_for("the Proxy made after the restart gone", &op, || async {
        proxies
            .get_opt("after-restart")
            .await
            .ok()?
            .is_none()
            .then_some(())
    })
    .await;

    // ---- Delete: the finalizer removes the VM, nothing is left ------------------------
    proxies
        .delete("office", &DeleteParams::default())
        .await
        .unwrap();
    wait_for("the Proxy gone", &op, || async {
        match proxies.get_opt("office").await {
            Ok(None) => Some(()),
            Ok(Some(p)) if p.uid().as_deref() != Some(uid.as_str()) => Some(()),
            _ => None,
        }
    })
    .await;
    let domains = libvirtd
        .virsh(&libvirtd.qemu_uri(), &["list", "--all", "--name"])
        .unwrap();
    assert!(domains.trim().is_empty(), "domains left: {domains}");
    libvirtd
        .virsh(&libvirtd.qemu_uri(), &["pool-refresh", "default"])
        .unwrap();
    let volumes = libvirtd
        .virsh(&libvirtd.qemu_uri(), &["vol-list", "default"])
        .unwrap();
    let instance_volumes: Vec<&str> = volumes
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|v| {
            // The image cache's own volumes stay: base data, commit marker, and the
            // cluster's announcement of the images it uses.
            !["egress-image-", "egress-imgok-", "egress-imguse-"]
                .iter()
                .any(|p| v.starts_with(p))
        })
        .filter(|v| *v != "Name" && !v.starts_with('-'))
        .collect();
    assert!(
        instance_volumes.is_empty(),
        "instance volumes left: {instance_volumes:?}\n{volumes}"
    );

    // ---- SIGTERM: a clean stop --------------------------------------------------------
    let exit = op.terminate().unwrap();
    assert!(
        exit.success(),
        "the operator exited with {exit}; it logged:\n{}",
        op.log()
    );

    // ---- Never refused ----------------------------------------------------------------
    let user = integration_tests::harness::controlplane::operator_user();
    if let Some(audit) = plane.audit().unwrap() {
        let ours: Vec<_> = audit.iter().filter(|r| r.user == user).collect();
        assert!(!ours.is_empty(), "the audit log shows no request of {user}");
        // Every PATCH the operator counted before the scrape reached the API server.
        let patches = ours.iter().filter(|r| r.verb == "patch").count() as u64;
        assert!(
            (1..=patches).contains(&counted_writes),
            "egress_kube_requests_total counted {counted_writes} PATCHes by the scrape, the audit log has {patches} in all"
        );
        let in_restart = |r: &&&integration_tests::harness::controlplane::AuditedRequest| {
            let received = r
                .received
                .as_deref()
                .and_then(|t| t.parse::<jiff::Timestamp>().ok());
            matches!((received, restart_window), (Some(t), Some((from, to))) if t >= from && t <= to)
        };
        let refused: Vec<_> = ours
            .iter()
            .filter(|r| r.code == 403 && !in_restart(r))
            .collect();
        let while_starting = ours
            .iter()
            .filter(|r| r.code == 403 && in_restart(r))
            .count();
        println!("403 answers while the restarted API server started: {while_starting}");
        assert!(
            refused.is_empty(),
            "the API server refused the operator (403):\n{refused:#?}\nthe operator logged:\n{}",
            op.log()
        );
        let calls: BTreeSet<String> = ours
            .iter()
            .map(|r| format!("{} {}/{}", r.verb, r.group, r.resource))
            .collect();
        println!(
            "the operator's calls ({} requests, none refused):",
            ours.len()
        );
        for c in &calls {
            println!("  {c}");
        }
    }
    // A refusal answered while the restarted API server started is logged when its answer
    // arrives, a moment after the window closes; the log's own timestamp says when.
    let logged_while_starting = |l: &str| {
        let at = serde_json::from_str::<serde_json::Value>(l)
            .ok()
            .and_then(|v| v["timestamp"].as_str().map(str::to_owned))
            .and_then(|t| t.parse::<jiff::Timestamp>().ok());
        matches!((at, restart_window), (Some(t), Some((from, to)))
            if t >= from && t <= to + jiff::SignedDuration::from_secs(5))
    };
    let forbidden: Vec<String> = op
        .warnings()
        .into_iter()
        .filter(|l| !logged_while_starting(l))
        // 403 as a number of its own: a timestamp like `02:19:21.204032Z` holds "403" too.
        .filter(|l| {
            l.to_ascii_lowercase().contains("forbidden")
                || l.split(|c: char| !c.is_ascii_digit()).any(|n| n == "403")
        })
        .collect();
    assert!(
        forbidden.is_empty(),
        "the operator logged refusals:\n{}",
        forbidden.join("\n")
    );
}
