#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! The node tier itself: a real kubelet node (containerd, runc, the bridge CNI, kube-proxy
//! in nftables mode) registers, runs pods placed by the scheduler, and carries traffic
//! through a Service's ClusterIP, from the host and from another pod. Everything it does
//! to the network stays in its own namespace.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddrV4, TcpStream};
use std::process::Command;
use std::time::{Duration, Instant};

use integration_tests::harness::node::{BUSYBOX_IMAGE, NODE_NAME};
use integration_tests::harness::{self, Need, Node};

/// Hang guard of the waits below: generous, never a performance assertion.
const GUARD: Duration = Duration::from_secs(120);

fn node() -> Option<&'static Node> {
    if harness::skip(&[Need::Node]) {
        return None;
    }
    Some(Node::shared().unwrap())
}

/// A namespace of one test, deleted at the end (also when it panics).
struct Namespace<'a> {
    node: &'a Node,
    name: String,
}

impl<'a> Namespace<'a> {
    fn new(node: &'a Node, name: &str) -> Self {
        node.kubectl_run(&["create", "namespace", name]).unwrap();
        Namespace {
            node,
            name: name.to_string(),
        }
    }
}

impl Drop for Namespace<'_> {
    fn drop(&mut self) {
        let _ = self
            .node
            .kubectl_run(&["delete", "namespace", &self.name, "--wait=false"]);
    }
}

/// `GET /` over HTTP/1.0; the body, or why not.
fn http_get(to: SocketAddrV4) -> Result<String, String> {
    let mut s = TcpStream::connect_timeout(&to.into(), Duration::from_secs(2))
        .map_err(|e| format!("connect {to}: {e}"))?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok();
    s.write_all(b"GET / HTTP/1.0\r\nHost: web\r\n\r\n")
        .map_err(|e| format!("write: {e}"))?;
    let mut answer = String::new();
    s.read_to_string(&mut answer)
        .map_err(|e| format!("read: {e}"))?;
    let (head, body) = answer
        .split_once("\r\n\r\n")
        .ok_or_else(|| format!("no HTTP answer: {answer:?}"))?;
    if !head.starts_with("HTTP/1.0 200") && !head.starts_with("HTTP/1.1 200") {
        return Err(format!("answer: {head}"));
    }
    Ok(body.trim().to_string())
}

fn web(namespace: &str, replicas: u32) -> String {
    format!(
        "apiVersion: apps/v1
kind: Deployment
metadata: {{name: web, namespace: {namespace}}}
spec:
  replicas: {replicas}
  selector: {{matchLabels: {{app: web}}}}
  template:
    metadata: {{labels: {{app: web}}}}
    spec:
      terminationGracePeriodSeconds: 1
      containers:
      - name: web
        image: {BUSYBOX_IMAGE}
        imagePullPolicy: Never
        command: [sh, -c, 'mkdir -p /tmp/www && hostname > /tmp/www/index.html && exec httpd -f -p 8080 -h /tmp/www']
        readinessProbe:
          httpGet: {{path: /, port: 8080}}
          periodSeconds: 1
---
apiVersion: v1
kind: Service
metadata: {{name: web, namespace: {namespace}}}
spec:
  selector: {{app: web}}
  ports: [{{port: 80, targetPort: 8080}}]
"
    )
}

#[test]
fn the_node_registers_ready_with_containerd_and_keeps_its_rules_in_its_namespace() {
    let Some(node) = node() else { return };
    let ready = node
        .kubectl_run(&[
            "get",
            "node",
            NODE_NAME,
            "-o",
            "jsonpath={.status.conditions[?(@.type==\"Ready\")].status} {.status.nodeInfo.containerRuntimeVersion} {.status.nodeInfo.kubeletVersion}",
        ])
        .unwrap();
    println!("node {NODE_NAME}: {ready}");
    let mut words = ready.split_whitespace();
    assert_eq!(words.next(), Some("True"), "{ready}");
    assert!(
        words.next().is_some_and(|r| r.starts_with("containerd://")),
        "{ready}"
    );
    // kube-proxy's nftables table is in the node's namespace, and not in the host's.
    let inside = Command::new("nsenter")
        .args(["--net=/run/netns/eotest-node", "nft", "list", "tables"])
        .output()
        .unwrap();
    let inside = String::from_utf8_lossy(&inside.stdout);
    assert!(
        inside.contains("ip kube-proxy"),
        "tables in the node: {inside}"
    );
    let host = Command::new("nft")
        .args(["list", "tables"])
        .output()
        .unwrap();
    let host = String::from_utf8_lossy(&host.stdout);
    assert!(!host.contains("kube-proxy"), "tables in the host: {host}");
}

#[test]
fn a_service_carries_traffic_to_every_ready_pod_from_the_host_and_from_a_pod() {
    let Some(node) = node() else { return };
    let ns = Namespace::new(node, "node-svc");
    node.apply(&web(&ns.name, 2)).unwrap();
    node.kubectl_run(&[
        "rollout",
        "status",
        "deployment/web",
        "-n",
        &ns.name,
        "--timeout=120s",
    ])
    .unwrap_or_else(|e| panic!("{e:#}\nkubelet: {}", node.log_tail("kubelet", 30)));
    let pods = node
        .kubectl_run(&[
            "get",
            "pods",
            "-n",
            &ns.name,
            "-l",
            "app=web",
            "-o",
            "jsonpath={.items[*].metadata.name}",
        ])
        .unwrap();
    let mut pods: Vec<String> = pods.split_whitespace().map(String::from).collect();
    pods.sort();
    assert_eq!(pods.len(), 2, "{pods:?}");
    let ip: Ipv4Addr = node
        .kubectl_run(&[
            "get",
            "service",
            "web",
            "-n",
            &ns.name,
            "-o",
            "jsonpath={.spec.clusterIP}",
        ])
        .unwrap()
        .trim()
        .parse()
        .unwrap();

    // From the host, through the route into the node's namespace and kube-proxy's rules:
    // each pod answers with its own name, so both are behind the ClusterIP.
    let start = Instant::now();
    let mut seen = std::collections::BTreeSet::new();
    let mut last = String::new();
    while seen.len() < pods.len() {
        assert!(
            start.elapsed() < GUARD,
            "the Service reached {seen:?} of {pods:?} (last: {last}) within {GUARD:?}\nkube-proxy: {}",
            node.log_tail("kube-proxy", 20)
        );
        match http_get(SocketAddrV4::new(ip, 80)) {
            Ok(name) => {
                seen.insert(name);
            }
            Err(e) => {
                last = e;
                std::thread::sleep(Duration::from_millis(200));
            }
        }
    }
    assert_eq!(seen.into_iter().collect::<Vec<_>>(), pods);

    // From another pod, through the same ClusterIP (pod -> Service -> pod).
    node.apply(&format!(
        "apiVersion: v1
kind: Pod
metadata: {{name: client, namespace: {ns}}}
spec:
  terminationGracePeriodSeconds: 1
  containers:
  - name: client
    image: {BUSYBOX_IMAGE}
    imagePullPolicy: Never
    command: [sh, -c, 'while :; do sleep 1; done']
",
        ns = ns.name
    ))
    .unwrap();
    node.kubectl_run(&[
        "wait",
        "--for=condition=Ready",
        "pod/client",
        "-n",
        &ns.name,
        "--timeout=120s",
    ])
    .unwrap();
    let request = format!("printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc {ip} 80");
    let answer = node
        .kubectl_run(&["exec", "-n", &ns.name, "client", "--", "sh", "-c", &request])
        .unwrap();
    let body = answer.split("\r\n\r\n").nth(1).unwrap_or_default().trim();
    assert!(
        pods.iter().any(|p| p == body),
        "a pod's answer names a web pod: {answer:?}"
    );
}
