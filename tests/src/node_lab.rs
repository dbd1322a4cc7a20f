//! The node tier's lab: the operator installed as users install it (`kubectl apply -k` of
//! `config/default`, its image built from the Dockerfile) on a real node, a host for it
//! (sshd on the node tier's host address, an isolated libvirtd), a web server, stand-ins
//! for the proxy VMs that carry traffic, and a workload pod. Shared by the node tier's
//! test (`tests/tests/node_operator.rs`) and the traffic bench (`tests/benches/traffic.rs`).
//!
//! The VMs are real domains on the lab's libvirtd, but they boot no proxy: each gets a
//! static address from the lab range, where a stand-in ([`ConnectResponder`]) answers the
//! operator's probe and tunnels the workload's `CONNECT` to the web server from that
//! address. [`NodeLab::follow_proxies`] keeps the stand-ins in step with the Proxies, as
//! the VMs would be: an address answers while a Proxy with it exists and is not being
//! deleted, and a test can take one down ([`NodeLab::fail`]) as a stopped proxy.

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, anyhow, bail};
use tempfile::TempDir;

use crate::connect_responder::ConnectResponder;
use crate::harness::node::{self, HOST_ADDRESS};
use crate::harness::{Libvirtd, Node, Sshd};
use crate::http::{HttpServer, Route};
use crate::{TestImage, provider_config_yaml, small_qcow2, workspace_root};

/// The operator's namespace, as `config/default` has it.
pub const NAMESPACE: &str = "egress-system";
/// Where the Deployment mounts the SSH Secret.
pub const SSH_DIR: &str = "/etc/egress-operator/ssh";
/// Where the image keeps the plugins.
pub const PLUGIN_DIR: &str = "/usr/lib/egress-operator/plugins";
/// The workload image (curl), built by `scripts/operator-image.sh`.
pub const WORKLOAD_IMAGE: &str = "localhost/eotest/workload:1";
/// The label of the operator's pods.
const OPERATOR_PODS: &str = "app.kubernetes.io/component=operator";
/// The host's static address pool, in the node tier's lab range.
const POOL_FIRST: u8 = 10;
const POOL_LAST: u8 = 60;

/// The addresses the lab's host hands out, and the stand-ins listen on.
pub fn pool_addresses() -> impl Iterator<Item = Ipv4Addr> {
    (POOL_FIRST..=POOL_LAST).map(|i| Ipv4Addr::new(10, 247, 0, i))
}

/// The lab; dropping it stops the lab's daemons (the node stays for the process's other
/// tests and goes with its watchdog).
#[derive(Debug)]
pub struct NodeLab {
    node: &'static Node,
    web: HttpServer,
    responder: Arc<ConnectResponder>,
    /// Addresses a test took down: [`NodeLab::follow_proxies`] leaves them down.
    failed: Arc<Mutex<BTreeSet<Ipv4Addr>>>,
    follower: Option<(Arc<AtomicBool>, JoinHandle<()>)>,
    _sshd: Sshd,
    _libvirtd: Libvirtd,
    _scratch: TempDir,
}

impl NodeLab {
    /// Starts the node (shared per process), builds and imports the images, starts the
    /// lab's host, web server and stand-ins, creates the SSH Secret as config/README.md
    /// says, and applies `config/default` with the lab's providers config. `extra_config`
    /// is appended to that config (top-level keys). Returns once applied; see
    /// [`NodeLab::wait_operator`].
    pub fn start(binary: &Path, extra_config: &str) -> Result<NodeLab> {
        let node = Node::shared()?;
        let images = node::images(binary)?;
        node.import_image(&images.join("egress-operator.tar"))?;
        node.import_image(&images.join("workload.tar"))?;

        let sshd = Sshd::start_on(HOST_ADDRESS)?;
        let libvirtd = Libvirtd::start()?;
        libvirtd.define_dir_pool("default")?;
        let scratch = tempfile::tempdir()?;
        let (qcow2, sha256) = small_qcow2(scratch.path(), "node-lab")?;
        let web = HttpServer::start_on(
            HOST_ADDRESS,
            vec![
                ("/base.qcow2".to_string(), Route::File(qcow2)),
                ("/".to_string(), Route::Peer),
            ],
        )?;
        let web_addr: SocketAddr = web
            .url("")
            .trim_start_matches("http://")
            .parse()
            .context("the web server's address")?;
        let responder = Arc::new(ConnectResponder::start_tunnelling(
            pool_addresses(),
            web_addr,
        )?);
        let image = TestImage {
            name: "base".into(),
            url: web.url("/base.qcow2"),
            sha256,
            max_size_mib: None,
        };
        let mut yaml = provider_config_yaml(&sshd, &libvirtd, "h1", &[image], &[])?;
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
                &crate::plugin_path("domain-default")?.display().to_string(),
                &format!("{PLUGIN_DIR}/domain-default.wasm"),
            )
            .replace(
                &crate::plugin_path("vendor-data-default")?
                    .display()
                    .to_string(),
                &format!("{PLUGIN_DIR}/vendor-data-default.wasm"),
            )
            .replacen(
                "disableKvm: true}",
                &format!(
                    "disableKvm: true, addressPool: {{cidr: 10.247.0.0/24, \
                     rangeStart: 10.247.0.{POOL_FIRST}, rangeEnd: 10.247.0.{POOL_LAST}}}, \
                     maxDomains: 12}}"
                ),
                1,
            )
            // A second machine type, so a pool's template can change (a rollout).
            .replacen(
                "  machineTypes:\n",
                "  machineTypes:\n    - {name: small2, vcpus: 1, memoryMiB: 160, diskGiB: 1}\n",
                1,
            );
        yaml.push_str(&format!(
            "serving: {{port: {}, periodSeconds: 5, timeoutSeconds: 2}}\n\
             healthCheck: {{periodSeconds: 5, timeoutSeconds: 3}}\n{extra_config}",
            responder.port()
        ));

        let overlay = scratch.path().join("overlay");
        std::fs::create_dir_all(&overlay)?;
        std::fs::write(overlay.join("config.yaml"), &yaml)?;
        let base = relative(&overlay, &workspace_root().join("config/default"));
        std::fs::write(
            overlay.join("kustomization.yaml"),
            format!(
                "# The lab's overlay: config/default as shipped, with the lab's providers config.\n\
                 resources:\n  - {}\n\
                 configMapGenerator:\n  - name: egress-operator-config\n    namespace: {NAMESPACE}\n    \
                 behavior: replace\n    files: [config.yaml]\n\
                 generatorOptions:\n  disableNameSuffixHash: true\n",
                base.display()
            ),
        )?;
        node.kubectl_run(&["create", "namespace", NAMESPACE])?;
        node.kubectl_run(&[
            "create",
            "secret",
            "generic",
            "egress-operator-ssh",
            "-n",
            NAMESPACE,
            &format!("--from-file=id_ed25519={}", sshd.client_key().display()),
            &format!("--from-file=known_hosts={}", sshd.known_hosts().display()),
        ])?;
        node.kubectl_run(&["apply", "-k", &overlay.display().to_string()])?;
        Ok(NodeLab {
            node,
            web,
            responder,
            failed: Arc::new(Mutex::new(BTreeSet::new())),
            follower: None,
            _sshd: sshd,
            _libvirtd: libvirtd,
            _scratch: scratch,
        })
    }

    /// The node.
    pub fn node(&self) -> &'static Node {
        self.node
    }

    /// The lab's web server.
    pub fn web(&self) -> &HttpServer {
        &self.web
    }

    /// The page whose body names the proxy that carried the request.
    pub fn page(&self) -> String {
        self.web.url("/")
    }

    /// Polls `f` until it gives a value, for at most `guard` (a hang guard). Fails at
    /// once, with the operator's last words, when an operator container restarted: the
    /// replicas must start right the first time.
    pub fn wait_for<T>(
        &self,
        what: &str,
        guard: Duration,
        mut f: impl FnMut() -> Option<T>,
    ) -> Result<T> {
        let start = Instant::now();
        loop {
            if let Some(v) = f() {
                return Ok(v);
            }
            let restarted = self.restarted_operator_pods();
            if !restarted.is_empty() {
                bail!(
                    "{what}: operator containers restarted: {restarted:?}\n{}",
                    self.operator_logs(true)
                );
            }
            if start.elapsed() > guard {
                bail!(
                    "{what}: not within {guard:?} (hang guard)\npods: {}\noperator: {}\nkubelet: {}",
                    self.node
                        .kubectl_run(&["get", "pods", "-A", "-o", "wide"])
                        .unwrap_or_default(),
                    self.operator_logs(false),
                    self.node.log_tail("kubelet", 20)
                );
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// Waits until both replicas are Ready and one holds the Lease: (pods, leader).
    pub fn wait_operator(&self, guard: Duration) -> Result<(Vec<String>, String)> {
        let pods = self.wait_for("both replicas Ready", guard, || {
            let pods = self.ready_operator_pods();
            (pods.len() == 2).then_some(pods)
        })?;
        let leader = self.wait_for("a leader", guard, || self.lease_holder())?;
        Ok((pods, leader))
    }

    /// The holder of the operator's Lease.
    pub fn lease_holder(&self) -> Option<String> {
        self.lease_field("holderIdentity")
    }

    /// When the holder of the operator's Lease acquired it (RFC 3339).
    pub fn lease_acquired(&self) -> Option<String> {
        self.lease_field("acquireTime")
    }

    fn lease_field(&self, field: &str) -> Option<String> {
        self.node
            .kubectl_run(&[
                "get",
                "lease",
                "egress-operator",
                "-n",
                NAMESPACE,
                "-o",
                &format!("jsonpath={{.spec.{field}}}"),
            ])
            .ok()
            .map(|h| h.trim().to_string())
            .filter(|h| !h.is_empty())
    }

    /// Deletes the leader's pod and waits until another replica leads and the Deployment
    /// has two Ready replicas again: (old leader, new leader).
    pub fn delete_leader(&self, guard: Duration) -> Result<(String, String)> {
        let leader = self
            .lease_holder()
            .ok_or_else(|| anyhow!("the operator's Lease has no holder"))?;
        self.node
            .kubectl_run(&["delete", "pod", &leader, "-n", NAMESPACE, "--wait=false"])?;
        let next = self.wait_for("a new leader", guard, || {
            self.lease_holder().filter(|h| *h != leader)
        })?;
        self.wait_for(
            "two Ready replicas after the leader's deletion",
            guard,
            || (self.ready_operator_pods().len() == 2).then_some(()),
        )?;
        Ok((leader, next))
    }

    /// The operator's pods that are Ready and not being deleted.
    pub fn ready_operator_pods(&self) -> Vec<String> {
        let Ok(text) = self.node.kubectl_run(&[
            "get",
            "pods",
            "-n",
            NAMESPACE,
            "-l",
            OPERATOR_PODS,
            "-o",
            "json",
        ]) else {
            return Vec::new();
        };
        let pods: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
        pods["items"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|p| p["metadata"]["deletionTimestamp"].is_null())
            .filter(|p| {
                p["status"]["conditions"].as_array().is_some_and(|c| {
                    c.iter()
                        .any(|c| c["type"] == "Ready" && c["status"] == "True")
                })
            })
            .filter_map(|p| p["metadata"]["name"].as_str().map(String::from))
            .collect()
    }

    /// Operator pods whose container has restarted.
    pub fn restarted_operator_pods(&self) -> Vec<String> {
        let Ok(pods) = self.node.kubectl_run(&[
            "get",
            "pods",
            "-n",
            NAMESPACE,
            "-l",
            OPERATOR_PODS,
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

    /// The operator pods' last log lines, from the API and from the kubelet's files (which
    /// hold what the API may no longer serve: a crashed container's log).
    pub fn operator_logs(&self, previous: bool) -> String {
        let mut args = vec![
            "logs",
            "-n",
            NAMESPACE,
            "-l",
            OPERATOR_PODS,
            "--tail=15",
            "--prefix",
        ];
        if previous {
            args.push("--previous");
        }
        let from_api = self
            .node
            .kubectl_run(&args)
            .unwrap_or_else(|e| format!("{e:#}"));
        let mut files = String::new();
        if let Ok(pods) = std::fs::read_dir(self.node.dir().join("pod-logs")) {
            for pod in pods.flatten() {
                if !pod.file_name().to_string_lossy().starts_with(NAMESPACE) {
                    continue;
                }
                let logs = std::fs::read_dir(pod.path().join("operator"));
                for log in logs.into_iter().flatten().flatten() {
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

    /// Starts a workload pod (curl) named `name` in `namespace` and waits until it runs.
    pub fn start_client(&self, namespace: &str, name: &str) -> Result<()> {
        self.node.apply(&format!(
            "apiVersion: v1
kind: Pod
metadata: {{name: {name}, namespace: {namespace}}}
spec:
  terminationGracePeriodSeconds: 1
  securityContext: {{runAsNonRoot: true, runAsUser: 65532}}
  containers:
  - name: client
    image: {WORKLOAD_IMAGE}
    imagePullPolicy: Never
    command: [sleep, infinity]
"
        ))?;
        self.node.kubectl_run(&[
            "wait",
            "--for=condition=Ready",
            &format!("pod/{name}"),
            "-n",
            namespace,
            "--timeout=120s",
        ])?;
        Ok(())
    }

    /// The addresses of a Service's ready endpoints, sorted.
    pub fn ready_endpoints(&self, namespace: &str, service: &str) -> Vec<String> {
        let Ok(text) = self.node.kubectl_run(&[
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

    /// `CLUSTER_IP:PORT` of a Service. Cluster DNS is not part of the node tier, so
    /// workloads name Services by ClusterIP.
    pub fn service_address(&self, namespace: &str, service: &str) -> Result<String> {
        Ok(self
            .node
            .kubectl_run(&[
                "get",
                "service",
                service,
                "-n",
                namespace,
                "-o",
                "jsonpath={.spec.clusterIP}:{.spec.ports[0].port}",
            ])?
            .trim()
            .to_string())
    }

    /// `count` fetches of the page from `pod` through the proxy at `proxy`, one curl each,
    /// as a workload configured with `http_proxy` does; `--proxytunnel` makes curl
    /// `CONNECT`, as it does for https with `HTTPS_PROXY`. Every fetch must succeed;
    /// returns the pages (each the address of the proxy that carried it).
    pub fn fetch(
        &self,
        namespace: &str,
        pod: &str,
        proxy: &str,
        count: usize,
    ) -> Result<Vec<String>> {
        let script = format!(
            "for i in $(seq 1 {count}); do \
               http_proxy=http://{proxy} curl -sS --max-time 10 --proxytunnel {url} || echo FAILED; \
             done",
            url = self.page()
        );
        let out = self
            .node
            .kubectl()
            .args(["exec", "-n", namespace, pod, "--", "sh", "-c", &script])
            .output()?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        if !out.status.success() || text.contains("FAILED") {
            bail!(
                "fetches through {proxy}: {text}\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let pages: Vec<String> = text.lines().map(|l| l.trim().to_string()).collect();
        if pages.len() != count {
            bail!(
                "{count} fetches through {proxy} gave {} pages: {text}",
                pages.len()
            );
        }
        Ok(pages)
    }

    /// A client in `pod` fetching the page through `proxy` back to back (a pause of 50 ms
    /// between requests) until [`SteadyClient::finish`], for at most `max_seconds`.
    pub fn steady_client(
        &self,
        namespace: &str,
        pod: &str,
        proxy: &str,
        max_seconds: u32,
    ) -> SteadyClient {
        let stop = format!("/tmp/steady-stop-{}", now().to_bits());
        let script = format!(
            "end=$(( $(date +%s) + {max_seconds} )); \
             while [ ! -e {stop} ] && [ $(date +%s) -lt $end ]; do \
               s=$(date +%s.%N); \
               if http_proxy=http://{proxy} curl -sS --max-time 3 --proxytunnel -o /dev/null {url} 2>/dev/null; \
               then echo \"$s OK\"; else echo \"$s FAILED\"; fi; \
               sleep 0.05; \
             done",
            url = self.page()
        );
        let mut cmd = self.node.kubectl();
        cmd.args(["exec", "-n", namespace, pod, "--", "sh", "-c", &script]);
        let mut stopper = self.node.kubectl();
        stopper.args(["exec", "-n", namespace, pod, "--", "touch", &stop]);
        let thread = std::thread::spawn(move || {
            let out = cmd.output()?;
            let text = String::from_utf8_lossy(&out.stdout);
            let mut requests = Vec::new();
            for line in text.lines() {
                let Some((at, verdict)) = line.split_once(' ') else {
                    continue;
                };
                let at: f64 = at.parse().context("a request's start time")?;
                requests.push((at, verdict == "OK"));
            }
            if requests.is_empty() {
                bail!(
                    "the steady client sent nothing: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            Ok(Steady { requests })
        });
        SteadyClient { thread, stopper }
    }

    /// Keeps the stand-ins in step with the Proxies of `namespace`, as their VMs would be:
    /// an address answers while a Proxy with it exists and is not being deleted (and a
    /// test did not [`NodeLab::fail`] it). Runs until the lab is dropped.
    pub fn follow_proxies(&mut self, namespace: &str) {
        let stop = Arc::new(AtomicBool::new(false));
        let (flag, responder, failed) = (stop.clone(), self.responder.clone(), self.failed.clone());
        let mut cmd = self.node.kubectl();
        cmd.args([
            "get",
            "proxies",
            "-n",
            namespace,
            "-o",
            "jsonpath={range .items[*]}{.status.address} {.metadata.deletionTimestamp}{\"\\n\"}{end}",
        ]);
        let thread = std::thread::spawn(move || {
            while !flag.load(Ordering::Relaxed) {
                if let Ok(out) = cmd.output()
                    && out.status.success()
                {
                    let text = String::from_utf8_lossy(&out.stdout);
                    let live: BTreeSet<Ipv4Addr> = text
                        .lines()
                        .filter_map(|l| {
                            let mut words = l.split_whitespace();
                            let address = words.next()?.parse().ok()?;
                            words.next().is_none().then_some(address)
                        })
                        .collect();
                    let failed = failed.lock().map(|f| f.clone()).unwrap_or_default();
                    for a in pool_addresses() {
                        let _ = responder.set_up(a, live.contains(&a) && !failed.contains(&a));
                    }
                }
                std::thread::sleep(Duration::from_millis(200));
            }
        });
        self.follower = Some((stop, thread));
    }

    /// Takes the proxy at `address` down (connections refused, as with a stopped
    /// tinyproxy), or lets it answer again.
    pub fn fail(&self, address: Ipv4Addr, failed: bool) -> Result<()> {
        {
            let mut set = self.failed.lock().map_err(|_| anyhow!("poisoned"))?;
            if failed {
                set.insert(address);
            } else {
                set.remove(&address);
            }
        }
        if failed {
            self.responder.set_up(address, false)?;
        } else if self.follower.is_none() {
            self.responder.set_up(address, true)?;
        }
        Ok(())
    }

    /// The addresses the web server saw requests from, all of which must be the pool's.
    pub fn peers_outside_pool(&self) -> Vec<IpAddr> {
        self.web
            .peers()
            .into_iter()
            .filter(|p| !pool_addresses().any(|a| IpAddr::V4(a) == *p))
            .collect()
    }
}

impl Drop for NodeLab {
    fn drop(&mut self) {
        if let Some((stop, thread)) = self.follower.take() {
            stop.store(true, Ordering::Relaxed);
            let _ = thread.join();
        }
    }
}

/// A steady client running in a pod ([`NodeLab::steady_client`]).
#[derive(Debug)]
pub struct SteadyClient {
    thread: JoinHandle<Result<Steady>>,
    stopper: std::process::Command,
}

impl SteadyClient {
    /// Stops the client and returns what it saw.
    pub fn finish(mut self) -> Result<Steady> {
        let _ = self.stopper.output();
        self.thread
            .join()
            .map_err(|_| anyhow!("the steady client's thread panicked"))?
    }
}

/// What a steady client saw: each request's start (seconds since the epoch) and whether
/// it succeeded.
#[derive(Debug, Clone)]
pub struct Steady {
    /// (start, succeeded), in order.
    pub requests: Vec<(f64, bool)>,
}

impl Steady {
    /// Requests sent.
    pub fn sent(&self) -> usize {
        self.requests.len()
    }

    /// Requests that failed.
    pub fn failed(&self) -> usize {
        self.requests.iter().filter(|(_, ok)| !ok).count()
    }

    /// Seconds from `since` to the start of the last failed request after it (0 when none
    /// failed after it).
    pub fn last_failure_after(&self, since: f64) -> f64 {
        self.requests
            .iter()
            .filter(|(at, ok)| !ok && *at >= since)
            .map(|(at, _)| at - since)
            .fold(0.0, f64::max)
    }
}

/// Now, in seconds since the epoch (the pods share this machine's clock).
pub fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
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

/// The `q` quantile (0..=1) of `values`, nearest rank.
pub fn quantile(values: &[f64], q: f64) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return 0.0;
    }
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    v[rank - 1]
}
