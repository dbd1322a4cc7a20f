//! `make demo`: the operator as an operator, end to end on one machine, with nothing
//! reaching outside it.
//!
//! 1. Starts a local Kubernetes control plane (etcd, kube-apiserver and the namespace and
//!    garbage-collector controllers, built here; see `integration_tests::harness::ControlPlane`)
//!    and the proxy lab ([`integration_tests::guest_lab`]: sshd on 127.0.0.1, an isolated
//!    libvirtd in its own network namespace with a bridge that routes nowhere, an HTTP
//!    server inside the namespace, the Debian guest image served from loopback).
//! 2. Applies the CRDs and the RBAC of `config/` with kubectl, as a platform team would
//!    (the Deployment aside: there is no kubelet here), and runs `egress-operator run` as a
//!    process acting as its ServiceAccount (a token from the TokenRequest API), with
//!    leader election, against the lab's sshd and libvirtd.
//! 3. `kubectl apply`s a user-data Secret and a Proxy, `kubectl wait`s for `Ready`, shows
//!    `kubectl get egp` and the Proxy's events, fetches a page THROUGH the VM's proxy,
//!    shows that a client outside the allowed networks is refused, `kubectl delete`s the
//!    Proxy and shows that nothing is left (domains, volumes, objects).
//!
//! Ctrl-C (SIGINT or SIGTERM) at any point stops the demo and tears everything down: the
//! operator, the VM (with libvirtd's namespace), the daemons, the control plane, the
//! namespaces and the temp dirs.
//!
//! Usage: `egress-demo GUEST.qcow2 PATH/TO/egress-operator`
#![allow(clippy::print_stdout)]

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use integration_tests::guest_lab::{GuestLab, HELLO, PROXY_PORT};
use integration_tests::harness::controlplane::{OPERATOR_NAMESPACE, OPERATOR_SERVICE_ACCOUNT};
use integration_tests::harness::{self, ControlPlane, Need};
use integration_tests::operator_process::{OperatorOptions, OperatorProcess};

/// Namespace of the demo's Proxy and Secret.
const DEMO_NAMESPACE: &str = "demo";
const PROXY_NAME: &str = "demo-egress";
/// How long the guest may take from define to a serving proxy: 2-3 minutes under software
/// emulation on 2 cores, up to about 5 on a busy machine.
const READY_GUARD: Duration = Duration::from_secs(900);

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
        println!(
            "\n==> interrupted: stopping the operator, the VM, the daemons and the control plane"
        );
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
fn kubectl(plane: &ControlPlane, args: &[&str]) -> Result<String> {
    println!("    $ kubectl {}", args.join(" "));
    run_shown(plane.kubectl().args(args))
}

/// `kubectl apply -f -` of `manifest`, shown.
fn kubectl_apply(plane: &ControlPlane, manifest: &str) -> Result<()> {
    println!(
        "    $ kubectl apply -f - <<EOF\n{}    EOF",
        indent(manifest)
    );
    interrupted()?;
    let mut child = plane
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
    if let Some(reason) = harness::skip_reason(&[Need::Sshd, Need::Libvirtd]) {
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

fn demo(image: &Path, operator: &Path) -> Result<()> {
    step(
        "starting a local Kubernetes control plane (etcd, kube-apiserver, namespace and GC controllers) on 127.0.0.1",
    );
    let plane = ControlPlane::start()?;
    interrupted()?;
    println!("    API server at {}", plane.server()?);
    kubectl(&plane, &["version"])?;

    step(
        "starting sshd on 127.0.0.1, an isolated libvirtd in its own network namespace, and an HTTP server inside it",
    );
    let lab = GuestLab::start(image, false)?;
    interrupted()?;
    println!(
        "    libvirtd in netns {}, bridge {} ({}, no route out); HTTP server at {}",
        lab.libvirtd.netns(),
        lab.libvirtd.bridge(),
        lab.bridge_net(),
        lab.hello_url()
    );

    step("installing the operator's CRDs and RBAC from config/ (kubectl)");
    let root = integration_tests::workspace_root();
    kubectl(
        &plane,
        &[
            "apply",
            "--server-side",
            "-f",
            &root.join("config/crd/bases").to_string_lossy(),
        ],
    )?;
    kubectl(
        &plane,
        &[
            "wait",
            "--for=condition=Established",
            "--timeout=60s",
            "-f",
            &root.join("config/crd/bases").to_string_lossy(),
        ],
    )?;
    kubectl(
        &plane,
        &[
            "apply",
            "-f",
            &root.join("config/manager/namespace.yaml").to_string_lossy(),
        ],
    )?;
    kubectl(
        &plane,
        &["apply", "-k", &root.join("config/rbac").to_string_lossy()],
    )?;

    step(
        "running `egress-operator run` as ServiceAccount egress-system/egress-operator (leader election on)",
    );
    let kubeconfig = plane.operator_kubeconfig()?;
    let plugins = integration_tests::target_dir().join("plugins");
    let config = lab.dir().join("providers-config.yaml");
    std::fs::write(&config, lab.config_yaml(true, &plugins, &[443]))?;
    run_shown(Command::new(operator).arg("validate-config").arg(&config))?;
    let options = OperatorOptions::new(
        operator,
        &config,
        &kubeconfig,
        "egress-operator-demo-0",
        OPERATOR_NAMESPACE,
        lab.dir(),
    );
    let mut op = OperatorProcess::start(&options)?;
    // Leading, with the template plugins compiled: a Proxy applied before that only waits
    // for them, with a warning event.
    wait_until(
        "the operator to lead with its plugins loaded",
        Duration::from_secs(180),
        &op,
        || {
            Ok(matches!(op.http_get("/readyz"),
                Some((200, body)) if body.contains("leading") && body.contains("plugins: ok")))
        },
    )?;
    println!(
        "    operator ready (identity {}, as {OPERATOR_NAMESPACE}/{OPERATOR_SERVICE_ACCOUNT}); its log (JSON lines) is shown on failure",
        op.identity()
    );
    kubectl(&plane, &["get", "lease", "-n", OPERATOR_NAMESPACE])?;

    step("kubectl apply: a user-data Secret and a Proxy");
    kubectl(&plane, &["create", "namespace", DEMO_NAMESPACE])?;
    kubectl_apply(
        &plane,
        &format!(
            "apiVersion: v1\nkind: Secret\nmetadata:\n  name: demo-user-data\n  namespace: {DEMO_NAMESPACE}\n  \
             labels:\n    egress-operator.dev/user-data: \"true\"\nstringData:\n  user-data: |\n    \
             #cloud-config\n    timezone: UTC\n"
        ),
    )?;
    kubectl_apply(
        &plane,
        &format!(
            "apiVersion: egress-operator.dev/v1alpha1\nkind: Proxy\nmetadata:\n  name: {PROXY_NAME}\n  \
             namespace: {DEMO_NAMESPACE}\nspec:\n  provider: kvm2\n  userData:\n    secretRef:\n      \
             name: demo-user-data\n      key: user-data\n"
        ),
    )?;

    step("kubectl wait --for=condition=Ready (the VM boots under software emulation: 2-5 minutes)");
    let started = Instant::now();
    let proxy = format!("proxy/{PROXY_NAME}");
    wait_until("the Proxy to be Ready", READY_GUARD, &op, || {
        let out = plane
            .kubectl()
            .args([
                "get",
                &proxy,
                "-n",
                DEMO_NAMESPACE,
                "-o",
                "jsonpath={.status.conditions[?(@.type==\"Ready\")].status}",
            ])
            .output()?;
        Ok(String::from_utf8_lossy(&out.stdout).trim() == "True")
    })?;
    kubectl(
        &plane,
        &[
            "wait",
            "--for=condition=Ready",
            &proxy,
            "-n",
            DEMO_NAMESPACE,
            "--timeout=60s",
        ],
    )?;
    println!(
        "    (Ready after {:.0} s, boot of the guest included)",
        started.elapsed().as_secs_f64()
    );
    kubectl(&plane, &["get", "egp", "-n", DEMO_NAMESPACE, "-o", "wide"])?;
    kubectl(
        &plane,
        &[
            "get",
            "events.events.k8s.io",
            "-n",
            DEMO_NAMESPACE,
            "--sort-by=.metadata.creationTimestamp",
        ],
    )?;
    let address: Ipv4Addr = plane
        .kubectl_run(&[
            "get",
            &proxy,
            "-n",
            DEMO_NAMESPACE,
            "-o",
            "jsonpath={.status.address}",
        ])?
        .trim()
        .parse()
        .context("the Proxy's status.address is not an IPv4 address")?;

    step("a request from the bridge side, THROUGH the VM's proxy");
    interrupted()?;
    let (code, body) = lab.curl_via(address, lab.client(), &lab.hello_url(), false)?;
    println!(
        "    curl --interface {} -x http://{address}:{PROXY_PORT} {} -> HTTP {code}: {}",
        lab.client(),
        lab.hello_url(),
        body.trim()
    );
    if code != 200 || !body.contains(HELLO) {
        bail!("the proxied request did not come back (HTTP {code})");
    }

    step("a client outside the allowed CIDRs is refused");
    interrupted()?;
    let (code, _) = lab.curl_via(address, lab.outsider(), &lab.hello_url(), false)?;
    println!(
        "    curl --interface {} -x http://{address}:{PROXY_PORT} {} -> HTTP {code}",
        lab.outsider(),
        lab.hello_url()
    );
    if code != 403 {
        bail!("a client outside the allowed CIDRs got HTTP {code}, not 403");
    }

    step("kubectl delete the Proxy: the operator's finalizer removes the VM");
    kubectl(
        &plane,
        &[
            "delete",
            &proxy,
            "-n",
            DEMO_NAMESPACE,
            "--wait=true",
            "--timeout=300s",
        ],
    )?;
    kubectl(&plane, &["get", "egp", "-A"])?;
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
        bail!("something of the demo VM was left behind: {domains} {instance_volumes:?}");
    }

    step("stopping the operator (SIGTERM), the lab and the control plane");
    let status = op.terminate()?;
    println!("    the operator exited with {status}");
    drop(lab);
    drop(plane);
    println!(
        "demo finished: the operator made a proxy VM from a Proxy object, it served a page at {address}, \
         kubectl delete removed it; nothing left"
    );
    Ok(())
}

/// Polls `f` every second until true; fails on an interrupt, when the operator exits
/// (with its log), or after `guard` (a hang guard).
fn wait_until(
    what: &str,
    guard: Duration,
    op: &OperatorProcess,
    mut f: impl FnMut() -> Result<bool>,
) -> Result<()> {
    let start = Instant::now();
    loop {
        interrupted()?;
        if f()? {
            return Ok(());
        }
        if start.elapsed() > guard {
            bail!(
                "waiting for {what}: not within {guard:?}; the operator logged:\n{}",
                op.log()
            );
        }
        std::thread::sleep(Duration::from_secs(1));
    }
}
