//! `make demo`: the operator as users run it, end to end on one machine, with nothing
//! reaching outside it.
//!
//! 1. Brings up a one-node Kubernetes cluster (etcd, kube-apiserver, the controllers and the
//!    scheduler, containerd, kubelet and kube-proxy, built here; `scripts/node.sh`) in its own
//!    network namespace, builds the operator's image from the Dockerfile and a workload image
//!    (curl), and imports both into the node's containerd.
//! 2. Starts the proxy lab ([`integration_tests::guest_lab`]): sshd on the node tier's host
//!    address, an isolated libvirtd in its own network namespace with a bridge that routes
//!    nowhere, an HTTP server inside it, the Debian guest image served to the operator. A
//!    veth joins the node's namespace to libvirtd's, so pods reach the VMs' bridge and the
//!    VMs answer them; neither namespace has a default route.
//! 3. Installs the operator as a platform team does: the SSH Secret, then
//!    `kubectl apply -k` of `config/default` with the lab's providers config. Two replicas
//!    start from the image; one leads.
//! 4. Applies a pool of 2 proxies, waits until both serve, and has a workload pod fetch a
//!    page through the pool's Service: each answer names the VM that carried it. Then a
//!    lease of one proxy: its Service carries only that VM's traffic, and the pool's
//!    Service no longer goes through it. A client outside the allowed networks is refused.
//! 5. `kubectl delete`s the lease and the pool and shows that nothing is left (domains,
//!    volumes, objects), then takes the node down and checks the machine.
//!
//! Ctrl-C (SIGINT or SIGTERM) at any point stops the demo and tears everything down: the
//! VMs (with libvirtd's namespace), the daemons, the node and everything it made.
//!
//! Usage: `egress-demo GUEST.qcow2 PATH/TO/egress-operator`
#![allow(clippy::print_stdout)]

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use integration_tests::guest_lab::{GuestLab, HELLO, PROXY_PORT};
use integration_tests::harness::node::{self, POD_NET};
use integration_tests::harness::{self, Need, Node};
use integration_tests::installed::{self, Installed, NAMESPACE};

/// Namespace of the demo's pool, lease and workload.
const DEMO_NAMESPACE: &str = "demo";
const POOL: &str = "office";
const LEASE: &str = "feed";
/// How long the operator's replicas may take to start (image import included).
const OPERATOR_GUARD: Duration = Duration::from_secs(300);
/// How long two guests may take from define to serving: 2-3 minutes each under software
/// emulation on 2 cores, booting side by side, up to about 10 on a busy machine.
const READY_GUARD: Duration = Duration::from_secs(1200);

/// Set by SIGINT/SIGTERM; every wait of the demo checks it.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

fn interrupted() -> Result<()> {
    if INTERRUPTED.load(Ordering::SeqCst) {
        bail!("interrupted: tearing everything down");
    }
    Ok(())
}

/// Replaces the default (die at once, skipping every cleanup) with a flag the demo checks,
/// so an interrupt unwinds through the drops that stop what the demo started.
fn watch_signals() -> Result<tokio::runtime::Runtime> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let (mut int, mut term) = rt.block_on(async {
        use tokio::signal::unix::{SignalKind, signal};
        Ok::<_, std::io::Error>((
            signal(SignalKind::interrupt())?,
            signal(SignalKind::terminate())?,
        ))
    })?;
    std::thread::spawn(move || {
        let Ok(rt) = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        else {
            return;
        };
        rt.block_on(async {
            tokio::select! {
                _ = int.recv() => {}
                _ = term.recv() => {}
            }
        });
        INTERRUPTED.store(true, Ordering::SeqCst);
        println!("\n==> interrupted: stopping the workloads, the VMs, the daemons and the node");
    });
    Ok(rt)
}

fn step(title: &str) {
    println!("\n==> {title}");
}

/// Runs `cmd` with its output shown and returned (stdin closed); an interrupt during it
/// fails the step.
fn run_shown(cmd: &mut Command) -> Result<String> {
    interrupted()?;
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {cmd:?}"))?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    print!("{text}");
    eprint!("{}", String::from_utf8_lossy(&out.stderr));
    interrupted()?;
    if !out.status.success() {
        bail!("{cmd:?} failed: {}", out.status);
    }
    Ok(text)
}

/// `kubectl ARGS` as the admin, shown as the user would type it.
fn kubectl(node: &Node, args: &[&str]) -> Result<String> {
    println!("    $ kubectl {}", args.join(" "));
    run_shown(node.kubectl().args(args))
}

/// `kubectl apply -f -` of `manifest`, shown.
fn kubectl_apply(node: &Node, manifest: &str) -> Result<()> {
    println!(
        "    $ kubectl apply -f - <<EOF\n{}    EOF",
        indent(manifest)
    );
    interrupted()?;
    let mut child = node
        .kubectl()
        .args(["apply", "-f", "-"])
        .stdin(Stdio::piped())
        .spawn()
        .context("running kubectl apply")?;
    if let Some(mut stdin) = child.stdin.take() {
        use std::io::Write;
        stdin.write_all(manifest.as_bytes())?;
    }
    let status = child.wait()?;
    if !status.success() {
        bail!("kubectl apply failed: {status}");
    }
    Ok(())
}

fn indent(text: &str) -> String {
    text.lines().map(|l| format!("    {l}\n")).collect()
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let (image, operator) = match args.as_slice() {
        [_, image, operator] => (PathBuf::from(image), PathBuf::from(operator)),
        _ => bail!("usage: egress-demo GUEST.qcow2 PATH/TO/egress-operator"),
    };
    if let Some(reason) = harness::skip_reason(&[Need::Sshd, Need::Libvirtd, Need::Node]) {
        bail!("the demo cannot run here: {reason}");
    }
    let _signals = watch_signals()?;
    let result = demo(&image, &operator);
    if INTERRUPTED.load(Ordering::SeqCst) {
        println!("demo interrupted; everything it started is stopped and removed");
        std::process::exit(130);
    }
    result
}

/// The node, taken down when the demo ends, however it ends; the report of what was left
/// behind (nothing, normally) is printed.
struct NodeGuard(Option<Node>);

impl NodeGuard {
    fn node(&self) -> Result<&Node> {
        self.0.as_ref().ok_or_else(|| anyhow!("the node is down"))
    }

    fn down(&mut self) -> Result<()> {
        match self.0.take() {
            Some(node) => node.down(),
            None => Ok(()),
        }
    }
}

impl Drop for NodeGuard {
    fn drop(&mut self) {
        if let Err(e) = self.down() {
            eprintln!("taking the node down: {e:#}");
        }
    }
}

fn demo(image: &Path, operator: &Path) -> Result<()> {
    step(
        "bringing up a one-node cluster in netns eotest-node: etcd, kube-apiserver, controllers, scheduler, containerd, kubelet, kube-proxy (nftables)",
    );
    let mut guard = NodeGuard(Some(Node::start()?));
    interrupted()?;
    let node = guard.node()?;
    kubectl(node, &["get", "nodes", "-o", "wide"])?;

    step(
        "building the operator's image from the Dockerfile (buildah) and a workload image (curl); importing both into the node's containerd",
    );
    let images = node::images(operator)?;
    interrupted()?;
    for archive in ["egress-operator.tar", "workload.tar"] {
        node.import_image(&images.join(archive))?;
    }
    println!("    imported {}", images.display());

    step(
        "starting the proxy lab: sshd on the host address, an isolated libvirtd and an HTTP server in its own netns, a veth from the node's netns to it",
    );
    let lab = GuestLab::start_for_node(image)?;
    interrupted()?;
    println!(
        "    libvirtd in netns {}, bridge {} ({}, no route out); sshd at {}; HTTP server at {}",
        lab.libvirtd.netns(),
        lab.libvirtd.bridge(),
        lab.bridge_net(),
        lab.sshd.address(),
        lab.hello_url()
    );
    println!(
        "    the node's netns routes {} to libvirtd's netns, which routes the pods ({POD_NET}) back",
        lab.bridge_net()
    );

    step(
        "installing the operator as users do: the SSH Secret, then kubectl apply -k config/default with the lab's providers config",
    );
    let plugins = integration_tests::target_dir().join("plugins");
    let (local, shipped) = lab.node_config_yaml(&plugins);
    let config = lab.dir().join("providers-config.yaml");
    std::fs::write(&config, &local)?;
    run_shown(Command::new(operator).arg("validate-config").arg(&config))?;
    println!(
        "    providers config (the ConfigMap egress-operator-config):\n{}",
        indent(&shipped)
    );
    installed::install(node, &lab.sshd, &shipped, lab.dir())?;
    let cluster = Installed::on(node);
    let (pods, leader) = wait(
        &cluster,
        "both replicas Ready and one leading",
        OPERATOR_GUARD,
        || {
            let pods = cluster.ready_operator_pods();
            let leader = cluster.lease_holder()?;
            (pods.len() == 2).then_some((pods, leader))
        },
    )?;
    println!("    replicas {pods:?} Ready from the image; {leader} leads");
    kubectl(
        node,
        &["get", "deployment,pods", "-n", NAMESPACE, "-o", "wide"],
    )?;
    kubectl(node, &["get", "lease", "egress-operator", "-n", NAMESPACE])?;

    step("kubectl apply: a pool of 2 proxies");
    kubectl(node, &["create", "namespace", DEMO_NAMESPACE])?;
    kubectl_apply(
        node,
        &format!(
            "apiVersion: egress-operator.dev/v1alpha1\nkind: ProxyPool\nmetadata:\n  name: {POOL}\n  \
             namespace: {DEMO_NAMESPACE}\nspec:\n  replicas: 2\n  template:\n    provider: kvm2\n"
        ),
    )?;

    step(
        "waiting until both proxies serve (the guests boot under software emulation: 3-10 minutes)",
    );
    let started = Instant::now();
    let members = wait(
        &cluster,
        "2 serving proxies in the pool's EndpointSlices",
        READY_GUARD,
        || {
            let ready = cluster.ready_endpoints(DEMO_NAMESPACE, POOL);
            (ready.len() == 2).then_some(ready)
        },
    )?;
    println!(
        "    serving after {:.0} s, boots included: {members:?}",
        started.elapsed().as_secs_f64()
    );
    kubectl(
        node,
        &["get", "proxypool,egp", "-n", DEMO_NAMESPACE, "-o", "wide"],
    )?;
    kubectl(
        node,
        &["get", "service,endpointslices", "-n", DEMO_NAMESPACE],
    )?;

    step("a workload pod fetches a page through the pool's Service");
    cluster.start_client(DEMO_NAMESPACE, "client")?;
    let pool_service = cluster.service_address(DEMO_NAMESPACE, POOL)?;
    let pages = fetch(&cluster, &pool_service, &lab.hello_url(), 8)?;
    for page in &pages {
        let via = carried_by(page)?;
        if !members.iter().any(|m| *m == via.to_string()) {
            bail!("a page came through {via}, which is not one of the pool's proxies {members:?}");
        }
    }

    step("kubectl apply: a lease of one proxy, with a Service of its own");
    kubectl_apply(
        node,
        &format!(
            "apiVersion: egress-operator.dev/v1alpha1\nkind: ProxyLease\nmetadata:\n  name: {LEASE}\n  \
             namespace: {DEMO_NAMESPACE}\nspec:\n  pool: {POOL}\n  count: 1\n  durationSeconds: 600\n  \
             holder: demo/user\n  service: true\n"
        ),
    )?;
    let leased = wait(
        &cluster,
        "the lease bound and its Service listing its proxy",
        READY_GUARD,
        || {
            let out = node
                .kubectl_run(&[
                    "get",
                    "proxylease",
                    LEASE,
                    "-n",
                    DEMO_NAMESPACE,
                    "-o",
                    "jsonpath={.status.phase} {.status.addresses}",
                ])
                .ok()?;
            let (phase, address) = out.trim().split_once(' ')?;
            let ready = cluster.ready_endpoints(DEMO_NAMESPACE, LEASE);
            (phase == "Bound" && ready == [address.to_string()]).then(|| address.to_string())
        },
    )?;
    wait(
        &cluster,
        "the pool's slices without the leased proxy",
        READY_GUARD,
        || {
            let ready = cluster.ready_endpoints(DEMO_NAMESPACE, POOL);
            (!ready.is_empty() && !ready.contains(&leased)).then_some(())
        },
    )?;
    // kube-proxy applies a slice change within its 1 s minimum sync period.
    std::thread::sleep(Duration::from_secs(3));
    kubectl(
        node,
        &["get", "proxylease,egp", "-n", DEMO_NAMESPACE, "-o", "wide"],
    )?;
    println!("    through the lease's Service: only the leased proxy {leased}");
    let lease_service = cluster.service_address(DEMO_NAMESPACE, LEASE)?;
    for page in fetch(&cluster, &lease_service, &lab.hello_url(), 4)? {
        if carried_by(&page)?.to_string() != leased {
            bail!("the lease's Service carried a request through another proxy: {page}");
        }
    }
    println!("    through the pool's Service: never the leased proxy");
    for page in fetch(&cluster, &pool_service, &lab.hello_url(), 4)? {
        if carried_by(&page)?.to_string() == leased {
            bail!("the pool's Service carried a request through the leased proxy: {page}");
        }
    }

    step("a client outside the allowed CIDRs is refused");
    interrupted()?;
    let address: Ipv4Addr = leased.parse().context("the leased proxy's address")?;
    let (code, _) = lab.curl_via(address, lab.outsider(), &lab.hello_url(), false)?;
    println!(
        "    curl --interface {} -x http://{address}:{PROXY_PORT} {} -> HTTP {code}",
        lab.outsider(),
        lab.hello_url()
    );
    if code != 403 {
        bail!("a client outside the allowed CIDRs got HTTP {code}, not 403");
    }

    step("kubectl delete the lease and the pool: the operator's finalizers remove the VMs");
    kubectl(
        node,
        &[
            "delete",
            "proxylease",
            LEASE,
            "-n",
            DEMO_NAMESPACE,
            "--wait=true",
            "--timeout=300s",
        ],
    )?;
    kubectl(
        node,
        &[
            "delete",
            "proxypool",
            POOL,
            "-n",
            DEMO_NAMESPACE,
            "--wait=true",
            "--timeout=600s",
        ],
    )?;
    wait(&cluster, "the pool's Proxies gone", READY_GUARD, || {
        let left = node
            .kubectl_run(&["get", "proxies", "-n", DEMO_NAMESPACE, "-o", "name"])
            .ok()?;
        left.trim().is_empty().then_some(())
    })?;
    kubectl(
        node,
        &[
            "delete",
            "namespace",
            DEMO_NAMESPACE,
            "--wait=true",
            "--timeout=120s",
        ],
    )?;
    kubectl(node, &["get", "egp,proxypool,proxylease", "-A"])?;
    nothing_left(&lab)?;

    step(
        "stopping: the lab, then the node (scripts/node.sh down checks that nothing is left on the machine)",
    );
    drop(lab);
    guard.down()?;
    println!(
        "demo finished: the operator ran as its Deployment, made a pool of 2 proxy VMs, a workload's \
         pages came through the pool's Service and then a lease's; kubectl delete removed them; \
         nothing left"
    );
    Ok(())
}

/// `count` fetches of `url` from the demo's workload pod through the proxy Service at
/// `service`, shown as the pod's curl prints them.
fn fetch(cluster: &Installed<'_>, service: &str, url: &str, count: usize) -> Result<Vec<String>> {
    interrupted()?;
    println!(
        "    $ kubectl exec -n {DEMO_NAMESPACE} client -- sh -c 'for i in $(seq {count}); do http_proxy=http://{service} curl -sS {url}; done'"
    );
    let pages = cluster.fetch_through(DEMO_NAMESPACE, "client", service, url, count, false)?;
    for page in &pages {
        println!("    {page}");
    }
    Ok(pages)
}

/// The proxy VM that carried a page: the lab's HTTP server names the address the request
/// came from.
fn carried_by(page: &str) -> Result<Ipv4Addr> {
    if !page.contains(HELLO) {
        bail!("not the lab's page: {page}");
    }
    page.rsplit_once("(from ")
        .and_then(|(_, rest)| rest.strip_suffix(')'))
        .and_then(|a| a.parse().ok())
        .ok_or_else(|| anyhow!("the page does not name the address it came from: {page}"))
}

/// Lists what is left on the lab's libvirtd: no domain, and no volume but the image cache's.
fn nothing_left(lab: &GuestLab) -> Result<()> {
    let uri = lab.libvirtd.qemu_uri();
    let domains = lab.libvirtd.virsh(&uri, &["list", "--all", "--name"])?;
    lab.libvirtd.virsh(&uri, &["pool-refresh", "default"])?;
    let volumes = lab.libvirtd.virsh(&uri, &["vol-list", "default"])?;
    println!(
        "    domains left: {}",
        if domains.trim().is_empty() {
            "none"
        } else {
            domains.trim()
        }
    );
    println!("    volumes left (the verified base image stays cached for the next Create):");
    print!("{}", indent(&volumes));
    let instance_volumes: Vec<&str> = volumes
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|v| *v != "Name" && !v.starts_with('-'))
        .filter(|v| {
            // The image cache's own volumes stay: base data, commit marker, and the
            // cluster's announcement of the images it uses.
            !["egress-image-", "egress-imgok-", "egress-imguse-"]
                .iter()
                .any(|p| v.starts_with(p))
        })
        .collect();
    if !domains.trim().is_empty() || !instance_volumes.is_empty() {
        bail!("something of the demo's VMs was left behind: {domains} {instance_volumes:?}");
    }
    Ok(())
}

/// [`Installed::wait_for`] that an interrupt ends at once.
fn wait<T>(
    cluster: &Installed<'_>,
    what: &str,
    guard: Duration,
    mut f: impl FnMut() -> Option<T>,
) -> Result<T> {
    cluster.wait_for(what, guard, || {
        if INTERRUPTED.load(Ordering::SeqCst) {
            return Some(Err(anyhow!("interrupted: tearing everything down")));
        }
        f().map(Ok)
    })?
}
