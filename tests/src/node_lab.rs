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
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, anyhow, bail};
use tempfile::TempDir;

use crate::connect_responder::ConnectResponder;
use crate::harness::node::{self, HOST_ADDRESS};
use crate::harness::{Libvirtd, Node, Sshd};
use crate::http::{HttpServer, Route};
use crate::installed::{self, Installed};
use crate::{TestImage, provider_config_yaml, small_qcow2};

pub use crate::installed::{NAMESPACE, PLUGIN_DIR, SSH_DIR, WORKLOAD_IMAGE};

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
    installed: Installed<'static>,
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
    /// [`Installed::wait_operator`].
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
        let yaml = provider_config_yaml(&sshd, &libvirtd, "h1", &[image], &[])?;
        let plugins = crate::target_dir().join("plugins");
        let mut yaml = installed::as_shipped(&yaml, &sshd, &plugins)
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

        installed::install(node, &sshd, &yaml, scratch.path())?;
        Ok(NodeLab {
            installed: Installed::on(node),
            web,
            responder,
            failed: Arc::new(Mutex::new(BTreeSet::new())),
            follower: None,
            _sshd: sshd,
            _libvirtd: libvirtd,
            _scratch: scratch,
        })
    }

    /// The lab's web server.
    pub fn web(&self) -> &HttpServer {
        &self.web
    }

    /// The page whose body names the proxy that carried the request.
    pub fn page(&self) -> String {
        self.web.url("/")
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
        self.installed
            .fetch_through(namespace, pod, proxy, &self.page(), count, true)
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
        let mut cmd = self.node().kubectl();
        cmd.args(["exec", "-n", namespace, pod, "--", "sh", "-c", &script]);
        let mut stopper = self.node().kubectl();
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
        let mut cmd = self.node().kubectl();
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

/// The lab looks at its operator as the demo does.
impl std::ops::Deref for NodeLab {
    type Target = Installed<'static>;

    fn deref(&self) -> &Installed<'static> {
        &self.installed
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
