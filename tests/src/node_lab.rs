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
use std::time::Duration;

use anyhow::{Context, Result, anyhow};
use tempfile::TempDir;

use crate::connect_responder::ConnectResponder;
use crate::harness::node::{self, HOST_ADDRESS};
use crate::harness::{Libvirtd, Node, Sshd};
use crate::http::{HttpServer, Route};
use crate::installed::{self, Installed};
use crate::{TestImage, provider_config_yaml, small_qcow2};

pub use crate::installed::{
    NAMESPACE, PLUGIN_DIR, Request, SSH_DIR, Steady, SteadyClient, WORKLOAD_IMAGE, now, quantile,
};

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

    /// A client in `pod` fetching the page through `proxy` back to back, tunnelled
    /// ([`Installed::steady_client_to`]).
    pub fn steady_client(
        &self,
        namespace: &str,
        pod: &str,
        proxy: &str,
        max_seconds: u32,
    ) -> SteadyClient {
        self.installed
            .steady_client_to(namespace, pod, proxy, &self.page(), true, max_seconds)
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
