//! The operator installed as users install it, on the node tier: the SSH Secret as
//! `config/README.md` says, `kubectl apply -k` of `config/default` with a providers config
//! of the caller's, and what a test (or the demo) then looks at through kubectl: the
//! replicas, the Lease, the pools' Services and a workload pod's requests through them.
//! Shared by the node tier's lab ([`crate::node_lab`], stand-in proxies) and `make demo`
//! (real guests).

use std::path::{Component, Path, PathBuf};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, anyhow, bail};

use crate::harness::{Node, Sshd};
use crate::workspace_root;

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

/// `yaml`, a providers config written for a process on this machine, as the Deployment
/// needs it: no `clusterId` (as shipped), and the SSH key, known_hosts and plugins at the
/// paths the Deployment mounts and the image holds.
pub fn as_shipped(yaml: &str, sshd: &Sshd, plugins: &Path) -> String {
    let mut yaml = yaml
        .replacen("clusterId: test\n", "", 1)
        .replacen("clusterId: lab\n", "", 1)
        .replace(
            &sshd.client_key().display().to_string(),
            &format!("{SSH_DIR}/id_ed25519"),
        )
        .replace(
            &sshd.known_hosts().display().to_string(),
            &format!("{SSH_DIR}/known_hosts"),
        );
    for plugin in ["domain-default", "vendor-data-default"] {
        yaml = yaml.replace(
            &plugins.join(format!("{plugin}.wasm")).display().to_string(),
            &format!("{PLUGIN_DIR}/{plugin}.wasm"),
        );
    }
    yaml
}

/// Installs the operator on `node` as users do: its namespace, the SSH Secret from
/// `sshd`'s client key and known_hosts, then `kubectl apply -k` of an overlay (written
/// under `dir`) that is `config/default` with `config_yaml` as its providers config.
/// Returns once applied; see [`Installed::wait_operator`].
pub fn install(node: &Node, sshd: &Sshd, config_yaml: &str, dir: &Path) -> Result<()> {
    let overlay = dir.join("overlay");
    std::fs::create_dir_all(&overlay)?;
    std::fs::write(overlay.join("config.yaml"), config_yaml)?;
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
    Ok(())
}

/// The operator installed on a node, looked at through kubectl.
#[derive(Debug, Clone, Copy)]
pub struct Installed<'n> {
    node: &'n Node,
}

impl<'n> Installed<'n> {
    /// The operator [`install`]ed on `node`.
    pub fn on(node: &'n Node) -> Self {
        Self { node }
    }

    /// The node.
    pub fn node(&self) -> &'n Node {
        self.node
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

    /// `count` fetches of `url` from `pod` through the proxy at `proxy` (`HOST:PORT`), one
    /// curl each, as a workload configured with `http_proxy` does; `tunnel` makes curl
    /// `CONNECT` (`--proxytunnel`), as it does for https with `HTTPS_PROXY`. Every fetch
    /// must succeed; returns the bodies, one line each.
    pub fn fetch_through(
        &self,
        namespace: &str,
        pod: &str,
        proxy: &str,
        url: &str,
        count: usize,
        tunnel: bool,
    ) -> Result<Vec<String>> {
        let tunnel = if tunnel { " --proxytunnel" } else { "" };
        let script = format!(
            "for i in $(seq 1 {count}); do \
               http_proxy=http://{proxy} curl -sS --max-time 10{tunnel} {url} || echo FAILED; \
             done"
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

    /// A client in `pod` fetching `url` through `proxy` back to back (a pause of 50 ms
    /// between requests), `tunnel`led with `CONNECT` or not, until [`SteadyClient::finish`],
    /// for at most `max_seconds`. Each request has 1 s to connect and 3 s in all, as a
    /// client behind a Service with several backends sets it: a connect to a vanished
    /// proxy fails after 1 s and the next request may reach another backend.
    pub fn steady_client_to(
        &self,
        namespace: &str,
        pod: &str,
        proxy: &str,
        url: &str,
        tunnel: bool,
        max_seconds: u32,
    ) -> SteadyClient {
        let tunnel = if tunnel { " --proxytunnel" } else { "" };
        let stop = format!("/tmp/steady-stop-{}", now().to_bits());
        let script = format!(
            "end=$(( $(date +%s) + {max_seconds} )); \
             while [ ! -e {stop} ] && [ $(date +%s) -lt $end ]; do \
               s=$(date +%s.%N); \
               if http_proxy=http://{proxy} curl -sS --connect-timeout 1 --max-time 3{tunnel} -o /dev/null {url} 2>/dev/null; \
               then v=OK; else v=FAILED; fi; \
               echo \"$s $(date +%s.%N) $v\"; \
               sleep 0.05; \
             done"
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
                let [start, end, verdict] = line.split(' ').collect::<Vec<_>>()[..] else {
                    continue;
                };
                requests.push(Request {
                    start: start.parse().context("a request's start time")?,
                    end: end.parse().context("a request's end time")?,
                    ok: verdict == "OK",
                });
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
}

/// A steady client running in a pod ([`Installed::steady_client_to`]).
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

/// One request of a steady client; times in seconds since the epoch.
#[derive(Debug, Clone, Copy)]
pub struct Request {
    /// When it was sent.
    pub start: f64,
    /// When it succeeded, failed or timed out.
    pub end: f64,
    /// Whether it succeeded.
    pub ok: bool,
}

/// What a steady client saw.
#[derive(Debug, Clone)]
pub struct Steady {
    /// Its requests, in order.
    pub requests: Vec<Request>,
}

impl Steady {
    /// Requests sent.
    pub fn sent(&self) -> usize {
        self.requests.len()
    }

    /// Requests that failed.
    pub fn failed(&self) -> usize {
        self.requests.iter().filter(|r| !r.ok).count()
    }

    /// Seconds from `since` to the end of the last request that failed after it: until
    /// then the client saw failures. A request to a proxy that vanished fails only when
    /// its timeout ends, so its end, not its start, is when the client stopped failing.
    /// 0 when nothing failed after `since`.
    pub fn last_failure_after(&self, since: f64) -> f64 {
        self.requests
            .iter()
            .filter(|r| !r.ok && r.end >= since)
            .map(|r| r.end - since)
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
