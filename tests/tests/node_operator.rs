#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! The operator as users run it: its image, built from the Dockerfile, runs as the
//! Deployment that `kubectl apply -k config/default` installs, on a real node. The only
//! changes are the lab's: the providers config (the lab's sshd and libvirtd) and the SSH
//! Secret that config/README.md tells users to create.
//!
//! Checked on the running pods: both replicas start from the image and pass their probes,
//! one leads, the root filesystem is read-only, the process is uid 65532, the SSH key the
//! kubelet wrote (fsGroup) is readable as documented, the plugins load from the image's
//! paths, and the leader reaches the lab's host over SSH. Deleting the leader's pod hands
//! the Lease to the other replica; the time to a new leader and to its first health round
//! are printed.

use std::path::{Component, Path, PathBuf};
use std::time::{Duration, Instant};

use std::net::{Ipv4Addr, SocketAddr};

use integration_tests::connect_responder::ConnectResponder;
use integration_tests::harness::node::{self, HOST_ADDRESS};
use integration_tests::harness::{self, Libvirtd, Need, Node, Sshd};
use integration_tests::http::{HttpServer, Route};
use integration_tests::{TestImage, provider_config_yaml, small_qcow2, workspace_root};

/// Hang guard of the waits below: generous, never a performance assertion.
const GUARD: Duration = Duration::from_secs(240);
const NAMESPACE: &str = "egress-system";
/// Where the Deployment mounts the Secret and the image keeps the plugins.
const SSH_DIR: &str = "/etc/egress-operator/ssh";
const PLUGIN_DIR: &str = "/usr/lib/egress-operator/plugins";
/// The host's static address pool, in the node tier's lab range.
const POOL_FIRST: u8 = 10;
const POOL_LAST: u8 = 40;

fn pool_addresses() -> impl Iterator<Item = Ipv4Addr> {
    (POOL_FIRST..=POOL_LAST).map(|i| Ipv4Addr::new(10, 247, 0, i))
}

fn binary() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_operator-under-test"))
}

/// Polls `f` until it gives a value. Fails at once, with the operator's last words, when
/// an operator container restarted: both replicas must start right the first time.
fn wait_for<T>(what: &str, node: &Node, mut f: impl FnMut() -> Option<T>) -> T {
    let start = Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        let restarted = restarted_pods(node);
        assert!(
            restarted.is_empty(),
            "{what}: operator containers restarted: {restarted:?}\n{}",
            operator_logs(node, true)
        );
        assert!(
            start.elapsed() < GUARD,
            "{what}: not within {GUARD:?} (hang guard)\npods: {}\noperator: {}\nkubelet: {}",
            node.kubectl_run(&["get", "pods", "-A", "-o", "wide"])
                .unwrap_or_default(),
            operator_logs(node, false),
            node.log_tail("kubelet", 20)
        );
        std::thread::sleep(Duration::from_millis(250));
    }
}

fn operator_logs(node: &Node, previous: bool) -> String {
    let mut args = vec![
        "logs",
        "-n",
        NAMESPACE,
        "-l",
        "app.kubernetes.io/component=operator",
        "--tail=15",
        "--prefix",
    ];
    if previous {
        args.push("--previous");
    }
    let from_api = node.kubectl_run(&args).unwrap_or_else(|e| format!("{e:#}"));
    // The kubelet's files hold what the API may no longer serve (a crashed container's log).
    let mut files = String::new();
    if let Ok(pods) = std::fs::read_dir(node.dir().join("pod-logs")) {
        for pod in pods.flatten() {
            if !pod.file_name().to_string_lossy().starts_with(NAMESPACE) {
                continue;
            }
            for log in std::fs::read_dir(pod.path().join("operator"))
                .into_iter()
                .flatten()
                .flatten()
            {
                let text = std::fs::read_to_string(log.path()).unwrap_or_default();
                let tail: Vec<&str> = text.lines().rev().take(10).collect();
                files.push_str(&format!("--- {}\n", log.path().display()));
                for line in tail.into_iter().rev() {
                    files.push_str(line);
                    files.push('\n');
                }
            }
        }
    }
    format!("{from_api}\n{files}")
}

/// Operator pods whose container has restarted.
fn restarted_pods(node: &Node) -> Vec<String> {
    let Ok(pods) = node.kubectl_run(&[
        "get",
        "pods",
        "-n",
        NAMESPACE,
        "-l",
        "app.kubernetes.io/component=operator",
        "-o",
        "jsonpath={range .items[*]}{.metadata.name} {.status.containerStatuses[0].restartCount}{\"\\n\"}{end}",
    ]) else {
        return Vec::new();
    };
    pods.lines()
        .filter_map(|l| l.split_once(' '))
        .filter(|(_, n)| n.trim().parse::<u32>().is_ok_and(|n| n > 0))
        .map(|(p, _)| p.to_string())
        .collect()
}

/// `to` relative to `from` (kustomize refuses absolute resource paths).
fn relative(from: &Path, to: &Path) -> PathBuf {
    let from: Vec<Component> = from.components().collect();
    let to: Vec<Component> = to.components().collect();
    let common = from.iter().zip(&to).take_while(|(a, b)| a == b).count();
    let mut path = PathBuf::new();
    for _ in common..from.len() {
        path.push("..");
    }
    for c in &to[common..] {
        path.push(c.as_os_str());
    }
    path
}

fn json(node: &Node, args: &[&str]) -> serde_json::Value {
    let mut all = args.to_vec();
    all.extend(["-o", "json"]);
    serde_json::from_str(&node.kubectl_run(&all).unwrap()).unwrap()
}

fn lease_holder(node: &Node) -> Option<String> {
    node.kubectl_run(&[
        "get",
        "lease",
        "egress-operator",
        "-n",
        NAMESPACE,
        "-o",
        "jsonpath={.spec.holderIdentity}",
    ])
    .ok()
    .filter(|h| !h.trim().is_empty())
}

/// The operator's pods that are Ready, by name.
fn ready_pods(node: &Node) -> Vec<String> {
    let pods = json(
        node,
        &[
            "get",
            "pods",
            "-n",
            NAMESPACE,
            "-l",
            "app.kubernetes.io/component=operator",
        ],
    );
    pods["items"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["metadata"]["deletionTimestamp"].is_null())
        .filter(|p| {
            p["status"]["conditions"].as_array().is_some_and(|c| {
                c.iter()
                    .any(|c| c["type"] == "Ready" && c["status"] == "True")
            })
        })
        .map(|p| p["metadata"]["name"].as_str().unwrap().to_string())
        .collect()
}

fn exec(node: &Node, pod: &str, script: &str) -> std::process::Output {
    node.kubectl()
        .args(["exec", "-n", NAMESPACE, pod, "--", "sh", "-c", script])
        .output()
        .unwrap()
}

#[test]
fn the_deployment_from_config_default_runs_the_image_leads_and_fails_over() {
    if harness::skip(&[Need::Node, Need::Sshd, Need::Libvirtd]) {
        return;
    }
    let node = Node::shared().unwrap_or_else(|e| panic!("{e:#}"));
    let images = node::images(&binary()).unwrap_or_else(|e| panic!("{e:#}"));
    node.import_image(&images.join("egress-operator.tar"))
        .unwrap();

    // ---- The lab: a host the pods reach at the node tier's host address -----------
    let sshd = Sshd::start_on(HOST_ADDRESS).unwrap();
    let libvirtd = Libvirtd::start().unwrap();
    libvirtd.define_dir_pool("default").unwrap();
    let scratch = tempfile::tempdir().unwrap();
    let (qcow2, sha256) = small_qcow2(scratch.path(), "node-operator").unwrap();
    // The lab's web server: the base image, and a page that names the client's address
    // (behind a proxy, the proxy's).
    let web = HttpServer::start_on(
        HOST_ADDRESS,
        vec![
            ("/base.qcow2".to_string(), Route::File(qcow2)),
            ("/".to_string(), Route::Peer),
        ],
    )
    .unwrap();
    let web_addr: SocketAddr = web.url("").trim_start_matches("http://").parse().unwrap();
    // The proxies' stand-ins on the static pool's addresses: the VMs boot no proxy here.
    let responder = ConnectResponder::start_tunnelling(pool_addresses(), web_addr).unwrap();
    let image = TestImage {
        name: "base".into(),
        url: web.url("/base.qcow2"),
        sha256,
        max_size_mib: None,
    };
    let mut yaml = provider_config_yaml(&sshd, &libvirtd, "h1", &[image], &[]).unwrap();
    yaml = yaml.replacen(
        "disableKvm: true}",
        &format!(
            "disableKvm: true, addressPool: {{cidr: 10.247.0.0/24, rangeStart: 10.247.0.{POOL_FIRST}, \
             rangeEnd: 10.247.0.{POOL_LAST}}}, maxDomains: 8}}"
        ),
        1,
    );
    yaml.push_str(&format!(
        "serving: {{port: {}, periodSeconds: 5, timeoutSeconds: 2}}\n",
        responder.port()
    ));
    // As shipped: no clusterId; the key, known_hosts and plugins at the paths the
    // Deployment mounts and the image holds.
    yaml = yaml
        .replacen("clusterId: test\n", "", 1)
        .replace(
            &sshd.client_key().display().to_string(),
            &format!("{SSH_DIR}/id_ed25519"),
        )
        .replace(
            &sshd.known_hosts().display().to_string(),
            &format!("{SSH_DIR}/known_hosts"),
        )
        .replace(
            &integration_tests::plugin_path("domain-default")
                .unwrap()
                .display()
                .to_string(),
            &format!("{PLUGIN_DIR}/domain-default.wasm"),
        )
        .replace(
            &integration_tests::plugin_path("vendor-data-default")
                .unwrap()
                .display()
                .to_string(),
            &format!("{PLUGIN_DIR}/vendor-data-default.wasm"),
        );
    yaml.push_str("healthCheck: {periodSeconds: 5, timeoutSeconds: 3}\n");

    // ---- kubectl apply -k: config/default, with the lab's config --------------------
    let overlay = tempfile::tempdir().unwrap();
    std::fs::write(overlay.path().join("config.yaml"), &yaml).unwrap();
    let base = relative(overlay.path(), &workspace_root().join("config/default"));
    std::fs::write(
        overlay.path().join("kustomization.yaml"),
        format!(
            "# The lab's overlay: config/default as shipped, with the lab's providers config.\n\
             resources:\n  - {}\n\
             configMapGenerator:\n  - name: egress-operator-config\n    namespace: {NAMESPACE}\n    \
             behavior: replace\n    files: [config.yaml]\n\
             generatorOptions:\n  disableNameSuffixHash: true\n",
            base.display()
        ),
    )
    .unwrap();
    node.kubectl_run(&["create", "namespace", NAMESPACE])
        .unwrap();
    // The Secret as config/README.md has users create it.
    node.kubectl_run(&[
        "create",
        "secret",
        "generic",
        "egress-operator-ssh",
        "-n",
        NAMESPACE,
        &format!("--from-file=id_ed25519={}", sshd.client_key().display()),
        &format!("--from-file=known_hosts={}", sshd.known_hosts().display()),
    ])
    .unwrap();
    let applied = Instant::now();
    node.kubectl_run(&["apply", "-k", &overlay.path().display().to_string()])
        .unwrap();

    // ---- Both replicas from the image, Ready (probes pass); one leads ---------------
    let pods = wait_for("both replicas Ready", node, || {
        let pods = ready_pods(node);
        (pods.len() == 2).then_some(pods)
    });
    let leader = wait_for("a leader", node, || lease_holder(node));
    println!(
        "2 replicas Ready {:.1}s after apply; leader {leader}",
        applied.elapsed().as_secs_f64()
    );
    assert!(pods.contains(&leader), "leader {leader} of {pods:?}");
    let deployment = json(
        node,
        &["get", "deployment", "egress-operator", "-n", NAMESPACE],
    );
    assert_eq!(
        deployment["spec"]["template"]["spec"]["containers"][0]["image"], "egress-operator:0.1.0",
        "the image reference as shipped"
    );
    for pod in &pods {
        let p = json(node, &["get", "pod", pod, "-n", NAMESPACE]);
        let status = &p["status"]["containerStatuses"][0];
        assert_eq!(status["restartCount"], 0, "{pod}: {status}");
        assert!(
            status["imageID"]
                .as_str()
                .is_some_and(|i| i.contains("sha256:")),
            "{pod}: {status}"
        );
    }

    // ---- What the Deployment promises, seen from inside the container -----------------
    let out = exec(
        node,
        &leader,
        &format!(
            "id -u; id -g; stat -c '%a %u:%g' {SSH_DIR}/..data/id_ed25519; \
             head -c 35 {SSH_DIR}/id_ed25519; echo; ls {PLUGIN_DIR}; \
             touch /probe 2>&1 || true"
        ),
    );
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    println!("inside {leader}:\n{text}");
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.first(), Some(&"65532"), "uid: {text}");
    assert_eq!(lines.get(1), Some(&"65532"), "gid: {text}");
    assert_eq!(
        lines.get(2),
        Some(&"440 0:65532"),
        "the key as the README says: root-owned, group 65532 (fsGroup), 0440: {text}"
    );
    assert_eq!(
        lines.get(3),
        Some(&"-----BEGIN OPENSSH PRIVATE KEY-----"),
        "the key is readable by the operator's user: {text}"
    );
    assert!(
        text.contains("domain-default.wasm") && text.contains("vendor-data-default.wasm"),
        "{text}"
    );
    assert!(
        text.contains("Read-only file system"),
        "root is read-only: {text}"
    );

    // ---- The leader loads the plugins from the image and reaches the lab's host ------
    let health = wait_for("ProviderHealth: h1 reachable, plugins loaded", node, || {
        let h = node
            .kubectl_run(&["get", "providerhealth", "kvm2", "-o", "json"])
            .ok()?;
        let h: serde_json::Value = serde_json::from_str(&h).ok()?;
        let status = &h["status"];
        let reachable = status["targets"]
            .as_array()?
            .iter()
            .any(|t| t["name"] == "h1" && t["reachable"] == true);
        let plugins = status["plugins"].as_array()?;
        let loaded = plugins.len() == 2 && plugins.iter().all(|p| p["state"] == "Loaded");
        (reachable && loaded).then(|| status.clone())
    });
    let plugins: Vec<&str> = health["plugins"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|p| p["name"].as_str())
        .collect();
    println!(
        "ProviderHealth kvm2: h1 reachable over SSH from the pod; plugins loaded: {plugins:?}"
    );
    assert!(
        plugins.iter().all(|p| p.contains(PLUGIN_DIR)),
        "{plugins:?}"
    );

    // ---- kubectl delete pod of the leader: the other replica takes over ------------
    let other = pods.iter().find(|p| **p != leader).unwrap().clone();
    let deleted = Instant::now();
    node.kubectl_run(&["delete", "pod", &leader, "-n", NAMESPACE, "--wait=false"])
        .unwrap();
    let new_leader = wait_for("a new leader", node, || {
        lease_holder(node).filter(|h| *h != leader)
    });
    let to_leader = deleted.elapsed();
    // The leader released the Lease as it stopped; the standby or the Deployment's
    // replacement pod (when it starts first) takes it: either is a running replica.
    let by = if new_leader == other {
        "the standby"
    } else {
        "the replacement pod"
    };
    // Its first act as leader: a health round, written to ProviderHealth after the Lease
    // changed hands (lastChecked has whole seconds).
    let acquired: jiff::Timestamp = node
        .kubectl_run(&[
            "get",
            "lease",
            "egress-operator",
            "-n",
            NAMESPACE,
            "-o",
            "jsonpath={.spec.acquireTime}",
        ])
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let acquired_second = acquired.as_second();
    wait_for("the new leader's first health round", node, || {
        let last = node
            .kubectl_run(&[
                "get",
                "providerhealth",
                "kvm2",
                "-o",
                "jsonpath={.status.lastChecked}",
            ])
            .ok()?;
        let last: jiff::Timestamp = last.trim().parse().ok()?;
        (last.as_second() >= acquired_second).then_some(())
    });
    let to_round = deleted.elapsed();
    let log = node
        .kubectl_run(&["logs", "-n", NAMESPACE, &new_leader])
        .unwrap();
    assert!(log.contains("acquired leadership"), "{log}");
    println!(
        "leader pod deleted: new leader {new_leader} ({by}) after {:.1}s, its first health round after {:.1}s",
        to_leader.as_secs_f64(),
        to_round.as_secs_f64()
    );

    // The Deployment replaces the pod; it starts from the image and stands by.
    wait_for("two Ready replicas again", node, || {
        (ready_pods(node).len() == 2).then_some(())
    });

    // ---- Workloads use the Services -------------------------------------------------
    node.import_image(&images.join("workload.tar")).unwrap();
    let ns = "node-traffic";
    node.kubectl_run(&["create", "namespace", ns]).unwrap();
    node.apply(&format!(
        "apiVersion: egress-operator.dev/v1alpha1
kind: ProxyPool
metadata: {{name: office, namespace: {ns}}}
spec:
  replicas: 3
  template: {{provider: kvm2, machineType: small, image: base}}
  hosts: [h1]
---
apiVersion: v1
kind: Pod
metadata: {{name: client, namespace: {ns}}}
spec:
  terminationGracePeriodSeconds: 1
  securityContext: {{runAsNonRoot: true, runAsUser: 65532}}
  containers:
  - name: client
    image: localhost/eotest/workload:1
    imagePullPolicy: Never
    command: [sleep, infinity]
"
    ))
    .unwrap();
    let members = wait_for("3 ready endpoints in the pool's slices", node, || {
        let ready = ready_endpoints(node, ns, "office");
        (ready.len() == 3).then_some(ready)
    });
    println!("pool office serves on {members:?}");
    node.kubectl_run(&[
        "wait",
        "--for=condition=Ready",
        "pod/client",
        "-n",
        ns,
        "--timeout=120s",
    ])
    .unwrap();
    let pool_service = service_address(node, ns, "office");
    let page = web.url("/");
    let answers = fetch(node, ns, &pool_service, &page, 12);
    println!("12 requests through the pool's Service {pool_service}: {answers:?}");
    for a in &answers {
        assert!(
            members.contains(a),
            "each page names the pool proxy that carried it: {a:?} of {members:?}"
        );
    }

    // ---- A lease's Service carries only the leased proxy; the pool's never does -------
    node.apply(&format!(
        "apiVersion: egress-operator.dev/v1alpha1
kind: ProxyLease
metadata: {{name: feed, namespace: {ns}}}
spec: {{pool: office, count: 1, durationSeconds: 600, holder: tests/node, service: true}}
"
    ))
    .unwrap();
    let leased = wait_for(
        "the lease bound, its Service listing its proxy",
        node,
        || {
            let addresses = node
                .kubectl_run(&[
                    "get",
                    "proxylease",
                    "feed",
                    "-n",
                    ns,
                    "-o",
                    "jsonpath={.status.phase} {.status.addresses}",
                ])
                .ok()?;
            let (phase, address) = addresses.trim().split_once(' ')?;
            let ready = ready_endpoints(node, ns, "feed");
            (phase == "Bound" && ready == [address.to_string()]).then(|| address.to_string())
        },
    );
    wait_for("the pool's slices without the leased proxy", node, || {
        let ready = ready_endpoints(node, ns, "office");
        (!ready.is_empty() && !ready.contains(&leased)).then_some(())
    });
    // kube-proxy applies a slice change within its 1 s minimum sync period.
    std::thread::sleep(Duration::from_secs(3));
    let lease_service = service_address(node, ns, "feed");
    let through_lease = fetch(node, ns, &lease_service, &page, 10);
    println!("10 requests through the lease's Service {lease_service}: {through_lease:?}");
    assert!(
        through_lease.iter().all(|a| *a == leased),
        "the lease's Service carries only {leased}: {through_lease:?}"
    );
    let through_pool = fetch(node, ns, &pool_service, &page, 20);
    println!("20 requests through the pool's Service: {through_pool:?}");
    assert!(
        !through_pool.contains(&leased),
        "the pool's Service never goes through the leased proxy {leased}: {through_pool:?}"
    );
    // ---- The leader's pod deleted under a steady client: the data path does not depend
    //      on the operator, so no request fails --------------------------------------
    let leader = lease_holder(node).unwrap();
    let steady = {
        let (kubectl, kubeconfig) = (node.kubectl(), node.kubeconfig().to_path_buf());
        let program = kubectl.get_program().to_os_string();
        let (proxy, url) = (pool_service.clone(), page.clone());
        std::thread::spawn(move || steady_client(&program, &kubeconfig, ns, &proxy, &url, 20))
    };
    std::thread::sleep(Duration::from_secs(5));
    node.kubectl_run(&["delete", "pod", &leader, "-n", NAMESPACE, "--wait=false"])
        .unwrap();
    let next = wait_for("a new leader under load", node, || {
        lease_holder(node).filter(|h| *h != leader)
    });
    let (sent, failed) = steady.join().unwrap();
    println!(
        "leader {leader} deleted under a steady client through the pool's Service: \
         new leader {next}; {sent} requests, {failed} failed (goal 0)"
    );
    assert!(sent > 20, "the client sent {sent} requests");
    assert_eq!(failed, 0, "requests failed while the leader changed");

    // The web server saw only the pool's proxies: nothing reached it another way.
    let peers = web.peers();
    assert!(
        peers
            .iter()
            .all(|p| pool_addresses().any(|a| std::net::IpAddr::V4(a) == *p)),
        "{peers:?}"
    );
}

/// A client in the `client` pod fetching `url` through `proxy` back to back for `seconds`:
/// (requests sent, requests failed).
fn steady_client(
    kubectl: &std::ffi::OsStr,
    kubeconfig: &Path,
    namespace: &str,
    proxy: &str,
    url: &str,
    seconds: u32,
) -> (usize, usize) {
    let script = format!(
        "end=$(( $(date +%s) + {seconds} )); \
         while [ $(date +%s) -lt $end ]; do \
           if http_proxy=http://{proxy} curl -sS --max-time 3 --proxytunnel -o /dev/null {url}; \
           then echo OK; else echo FAILED; fi; \
           sleep 0.05; \
         done"
    );
    let out = std::process::Command::new(kubectl)
        .env("KUBECONFIG", kubeconfig)
        .args(["exec", "-n", namespace, "client", "--", "sh", "-c", &script])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let sent = text
        .lines()
        .filter(|l| *l == "OK" || *l == "FAILED")
        .count();
    let failed = text.lines().filter(|l| *l == "FAILED").count();
    (sent, failed)
}

/// The addresses of a Service's ready endpoints, sorted.
fn ready_endpoints(node: &Node, namespace: &str, service: &str) -> Vec<String> {
    let Ok(text) = node.kubectl_run(&[
        "get",
        "endpointslices",
        "-n",
        namespace,
        "-l",
        &format!("kubernetes.io/service-name={service}"),
        "-o",
        "json",
    ]) else {
        return Vec::new();
    };
    let slices: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
    let mut ready: Vec<String> = slices["items"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|s| s["endpoints"].as_array().cloned().unwrap_or_default())
        .filter(|e| e["conditions"]["ready"] == true)
        .filter_map(|e| e["addresses"][0].as_str().map(String::from))
        .collect();
    ready.sort();
    ready
}

/// `CLUSTER_IP:PORT` of a Service. Cluster DNS is not part of the node tier, so workloads
/// name the Service by its ClusterIP.
fn service_address(node: &Node, namespace: &str, service: &str) -> String {
    node.kubectl_run(&[
        "get",
        "service",
        service,
        "-n",
        namespace,
        "-o",
        "jsonpath={.spec.clusterIP}:{.spec.ports[0].port}",
    ])
    .unwrap()
    .trim()
    .to_string()
}

/// `count` fetches of `url` from the client pod through the proxy at `proxy`, one curl
/// each, as a workload configured with `http_proxy` does; `--proxytunnel` makes curl
/// CONNECT, as it does for https with `HTTPS_PROXY`. Every fetch must succeed; returns
/// the pages (each the address of the proxy that carried it).
fn fetch(node: &Node, namespace: &str, proxy: &str, url: &str, count: usize) -> Vec<String> {
    let script = format!(
        "for i in $(seq 1 {count}); do \
           http_proxy=http://{proxy} curl -sS --max-time 10 --proxytunnel {url} || echo FAILED; \
         done"
    );
    let out = node
        .kubectl()
        .args(["exec", "-n", namespace, "client", "--", "sh", "-c", &script])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success() && !text.contains("FAILED"),
        "fetches through {proxy}: {text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let pages: Vec<String> = text.lines().map(|l| l.trim().to_string()).collect();
    assert_eq!(pages.len(), count, "{text}");
    pages
}
