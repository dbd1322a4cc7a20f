#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! The operator as users run it: its image, built from the Dockerfile, runs as the
//! Deployment that `kubectl apply -k config/default` installs, on a real node. The only
//! changes are the lab's: the providers config (the lab's sshd and libvirtd) and the SSH
//! Secret that config/README.md tells users to create (`integration_tests::node_lab`).
//!
//! Checked on the running pods: both replicas start from the image and pass their probes,
//! one leads, the root filesystem is read-only, the process is uid 65532, the SSH key the
//! kubelet wrote (fsGroup) is readable as documented, the plugins load from the image's
//! paths, and the leader reaches the lab's host over SSH. Deleting the leader's pod hands
//! the Lease to another replica (the time to a new leader and to its first health round
//! are printed). Then workloads: pages fetched through a pool's Service name the pool proxy
//! that carried them, a lease's Service carries only the leased proxy and the pool's never
//! does, and the leader's pod deleted under a steady client fails no request.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use integration_tests::harness::{self, Need};
use integration_tests::node_lab::{NAMESPACE, NodeLab, PLUGIN_DIR, SSH_DIR};

/// Hang guard of the waits below: generous, never a performance assertion.
const GUARD: Duration = Duration::from_secs(240);

fn binary() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_operator-under-test"))
}

fn json(lab: &NodeLab, args: &[&str]) -> serde_json::Value {
    let mut all = args.to_vec();
    all.extend(["-o", "json"]);
    serde_json::from_str(&lab.node().kubectl_run(&all).unwrap()).unwrap()
}

#[test]
fn the_deployment_from_config_default_runs_the_image_leads_and_carries_traffic() {
    if harness::skip(&[Need::Node, Need::Sshd, Need::Libvirtd]) {
        return;
    }
    let lab = NodeLab::start(&binary(), "").unwrap_or_else(|e| panic!("{e:#}"));
    let applied = Instant::now();
    let node = lab.node();

    // ---- Both replicas from the image, Ready (probes pass); one leads ---------------
    let (pods, leader) = lab.wait_operator(GUARD).unwrap_or_else(|e| panic!("{e:#}"));
    println!(
        "2 replicas Ready {:.1}s after apply; leader {leader}",
        applied.elapsed().as_secs_f64()
    );
    assert!(pods.contains(&leader), "leader {leader} of {pods:?}");
    let deployment = json(
        &lab,
        &["get", "deployment", "egress-operator", "-n", NAMESPACE],
    );
    assert_eq!(
        deployment["spec"]["template"]["spec"]["containers"][0]["image"], "egress-operator:0.1.0",
        "the image reference as shipped"
    );
    for pod in &pods {
        let p = json(&lab, &["get", "pod", pod, "-n", NAMESPACE]);
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
    let out = node
        .kubectl()
        .args(["exec", "-n", NAMESPACE, &leader, "--", "sh", "-c"])
        .arg(format!(
            "id -u; id -g; stat -c '%a %u:%g' {SSH_DIR}/..data/id_ed25519; \
             head -c 35 {SSH_DIR}/id_ed25519; echo; ls {PLUGIN_DIR}; \
             touch /probe 2>&1 || true"
        ))
        .output()
        .unwrap();
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
    let health = lab
        .wait_for(
            "ProviderHealth: h1 reachable, plugins loaded",
            GUARD,
            || {
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
            },
        )
        .unwrap_or_else(|e| panic!("{e:#}"));
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

    // ---- kubectl delete pod of the leader: another replica takes over --------------
    let other = pods.iter().find(|p| **p != leader).unwrap().clone();
    let deleted = Instant::now();
    node.kubectl_run(&["delete", "pod", &leader, "-n", NAMESPACE, "--wait=false"])
        .unwrap();
    let new_leader = lab
        .wait_for("a new leader", GUARD, || {
            lab.lease_holder().filter(|h| *h != leader)
        })
        .unwrap_or_else(|e| panic!("{e:#}"));
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
    let acquired: jiff::Timestamp = lab.lease_acquired().unwrap().parse().unwrap();
    lab.wait_for("the new leader's first health round", GUARD, || {
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
        (last.as_second() >= acquired.as_second()).then_some(())
    })
    .unwrap_or_else(|e| panic!("{e:#}"));
    let to_round = deleted.elapsed();
    // The replacement pod's container can start and take the Lease before the kubelet
    // reports the pod running; until then `kubectl logs` refuses (ContainerCreating).
    let log = lab
        .wait_for("the new leader's log", GUARD, || {
            node.kubectl_run(&["logs", "-n", NAMESPACE, &new_leader])
                .ok()
                .filter(|l| l.contains("acquired leadership"))
        })
        .unwrap_or_else(|e| panic!("{e:#}"));
    assert!(log.contains("acquired leadership"), "{log}");
    println!(
        "leader pod deleted: new leader {new_leader} ({by}) after {:.1}s, its first health round after {:.1}s",
        to_leader.as_secs_f64(),
        to_round.as_secs_f64()
    );
    lab.wait_for("two Ready replicas again", GUARD, || {
        (lab.ready_operator_pods().len() == 2).then_some(())
    })
    .unwrap_or_else(|e| panic!("{e:#}"));

    // ---- Workloads use the Services -------------------------------------------------
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
"
    ))
    .unwrap();
    lab.start_client(ns, "client").unwrap();
    let members = lab
        .wait_for("3 ready endpoints in the pool's slices", GUARD, || {
            let ready = lab.ready_endpoints(ns, "office");
            (ready.len() == 3).then_some(ready)
        })
        .unwrap_or_else(|e| panic!("{e:#}"));
    println!("pool office serves on {members:?}");
    let pool_service = lab.service_address(ns, "office").unwrap();
    let answers = lab.fetch(ns, "client", &pool_service, 12).unwrap();
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
    let leased = lab
        .wait_for(
            "the lease bound, its Service listing its proxy",
            GUARD,
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
                let ready = lab.ready_endpoints(ns, "feed");
                (phase == "Bound" && ready == [address.to_string()]).then(|| address.to_string())
            },
        )
        .unwrap_or_else(|e| panic!("{e:#}"));
    lab.wait_for("the pool's slices without the leased proxy", GUARD, || {
        let ready = lab.ready_endpoints(ns, "office");
        (!ready.is_empty() && !ready.contains(&leased)).then_some(())
    })
    .unwrap_or_else(|e| panic!("{e:#}"));
    // kube-proxy applies a slice change within its 1 s minimum sync period.
    std::thread::sleep(Duration::from_secs(3));
    let lease_service = lab.service_address(ns, "feed").unwrap();
    let through_lease = lab.fetch(ns, "client", &lease_service, 10).unwrap();
    println!("10 requests through the lease's Service {lease_service}: {through_lease:?}");
    assert!(
        through_lease.iter().all(|a| *a == leased),
        "the lease's Service carries only {leased}: {through_lease:?}"
    );
    let through_pool = lab.fetch(ns, "client", &pool_service, 20).unwrap();
    println!("20 requests through the pool's Service: {through_pool:?}");
    assert!(
        !through_pool.contains(&leased),
        "the pool's Service never goes through the leased proxy {leased}: {through_pool:?}"
    );

    // ---- The leader's pod deleted under a steady client: the data path does not depend
    //      on the operator, so no request fails --------------------------------------
    let steady = lab.steady_client(ns, "client", &pool_service, 120);
    std::thread::sleep(Duration::from_secs(5));
    let (leader, next) = lab.delete_leader(GUARD).unwrap_or_else(|e| panic!("{e:#}"));
    std::thread::sleep(Duration::from_secs(3));
    let steady = steady.finish().unwrap();
    println!(
        "leader {leader} deleted under a steady client through the pool's Service: \
         new leader {next}; {} requests, {} failed (goal 0)",
        steady.sent(),
        steady.failed()
    );
    assert!(
        steady.sent() > 20,
        "the client sent {} requests",
        steady.sent()
    );
    assert_eq!(
        steady.failed(),
        0,
        "requests failed while the leader changed"
    );

    // The web server saw only the pool's proxies: nothing reached it another way.
    let outside = lab.peers_outside_pool();
    assert!(outside.is_empty(), "{outside:?}");
}
